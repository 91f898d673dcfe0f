//! The ingest's settings.

use std::path::PathBuf;
use std::time::Duration;

use kvrouter_core::codec::Subjects;

use crate::nats::Options;

/// Settings of the ingest.
#[derive(Debug, Clone)]
pub struct IngestConfig {
    /// NATS connection.
    pub nats: Options,
    /// Subject naming (Dynamo's defaults: `dynamo`, `backend`, `generate`).
    pub subjects: Subjects,
    /// Shard cores (index writers).
    pub shards: usize,
    /// CPUs to pin executors to: `[nats, shard0, shard1, ...]`; empty: unbound.
    pub cpus: Vec<usize>,
    /// io_uring memory per executor, bytes.
    pub io_memory: usize,
    /// Remove a never-announced worker after this long without messages.
    pub silence_timeout: Duration,
    /// Remove an announced worker after this many missed heartbeats.
    pub heartbeat_misses: u32,
    /// How long to wait for a recovery answer (per chunk).
    pub recovery_timeout: Duration,
    /// Record the arrival-to-visible latency of every message (for benchmarks).
    pub record_latency: bool,
    /// Let idle executors spin this long before parking: lower wake-up latency for more CPU
    /// (worth it on dedicated cores, not on a shared laptop).
    pub spin_before_park: Option<Duration>,
    /// Snapshots: restored at start, written periodically, on demand and on stop. `None`:
    /// off.
    pub snapshot: Option<SnapshotConfig>,
    /// JetStream durable mode: events come from a stream through a durable consumer.
    /// `None`: core NATS.
    pub durable: Option<DurableConfig>,
    /// This router's id (written into snapshots).
    pub router_id: u64,
}

/// Where and when snapshots are written.
#[derive(Debug, Clone)]
pub struct SnapshotConfig {
    /// The directory of the snapshot file.
    pub dir: PathBuf,
    /// Write one this often (`None`: only on demand and on stop).
    pub interval: Option<Duration>,
    /// Write one when the ingest stops.
    pub on_stop: bool,
}

/// The JetStream durable mode's settings.
#[derive(Debug, Clone)]
pub struct DurableConfig {
    /// The stream capturing the kv-events subject (created when missing).
    pub stream: String,
    /// This replica's durable consumer (one per router replica; stable across restarts).
    pub consumer: String,
    /// Messages older than this leave the stream (`None`: no age limit).
    pub max_age: Option<Duration>,
    /// Unacknowledged messages the server may push ahead of the ingest.
    pub max_ack_pending: u64,
    /// Redelivery delay of an unacknowledged message.
    pub ack_wait: Duration,
    /// How often applied messages are acknowledged.
    pub ack_interval: Duration,
    /// The consumer's idle heartbeat; three missed while connected re-create the consumer.
    pub idle_heartbeat: Duration,
}

impl DurableConfig {
    /// Defaults for a stream and a consumer name.
    pub fn new(stream: impl Into<String>, consumer: impl Into<String>) -> Self {
        Self {
            stream: stream.into(),
            consumer: consumer.into(),
            max_age: Some(Duration::from_secs(3600)),
            max_ack_pending: 16384,
            ack_wait: Duration::from_secs(30),
            ack_interval: Duration::from_millis(20),
            idle_heartbeat: Duration::from_secs(2),
        }
    }
}

impl Default for IngestConfig {
    fn default() -> Self {
        Self {
            nats: Options::default(),
            subjects: Subjects::default(),
            shards: 1,
            cpus: Vec::new(),
            io_memory: 512 << 10,
            silence_timeout: Duration::from_secs(60),
            heartbeat_misses: 3,
            recovery_timeout: Duration::from_secs(2),
            record_latency: false,
            spin_before_park: None,
            snapshot: None,
            durable: None,
            router_id: 0,
        }
    }
}
