//! The ingest's settings.

use std::path::PathBuf;
use std::time::Duration;

use kvrouter_core::codec::Subjects;
use kvrouter_core::worker::{DpRank, WorkerDp, WorkerId};

use crate::nats::Options;
use crate::zmq::{Endpoint, SubOptions};

/// Settings of the ingest.
#[derive(Debug, Clone)]
pub struct IngestConfig {
    /// NATS connection: Dynamo's NATS event plane, worker announcements and recovery
    /// (`None`: no NATS plane).
    pub nats: Option<Options>,
    /// How long [`super::Ingest::start`] waits for the first NATS connection. A broker
    /// that refuses us (authentication) fails the start; one that is not reachable yet
    /// does not: past this wait the ingest runs from what it has (a snapshot, the ZMQ
    /// planes), not ready, and keeps connecting in the background.
    pub nats_start_wait: Duration,
    /// Engines that publish the vLLM-native KV-event wire over ZMQ.
    pub zmq_engines: Vec<ZmqEngine>,
    /// Dynamo's discovery (its file tree or its etcd): its workers, routable at once, and
    /// the ZMQ event-plane publishers it advertises.
    pub dynamo_discovery: Option<DynamoDiscovery>,
    /// ZMQ sockets and replay.
    pub zmq: ZmqOptions,
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
    /// Let idle executors spin this long before parking, for a lower wake-up latency at
    /// the cost of CPU. glommio ignores it unless an executor is bound to a CPU; on a
    /// shared host it made the ingest's latency worse (docs/BENCHMARKS.md, "Ingest over
    /// NATS").
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
            nats: Some(Options::default()),
            nats_start_wait: Duration::from_secs(3),
            zmq_engines: Vec::new(),
            dynamo_discovery: None,
            zmq: ZmqOptions::default(),
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

/// Where Dynamo's discovery entries are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DynamoDiscovery {
    /// The file backend's directory (`DYN_FILE_KV`).
    File(PathBuf),
    /// etcd (`ETCD_ENDPOINTS`), through its v3 JSON gateway; a transport error moves to
    /// the next endpoint.
    Etcd(Vec<crate::proxy::Target>),
}

/// An engine that publishes the vLLM-native KV-event wire: vLLM's `--kv-events-config`
/// publisher, SGLang's, TensorRT-LLM's, LMCache's, or Dynamo's mocker with
/// `--zmq-kv-events-ports`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZmqEngine {
    /// Its name (logs).
    pub name: String,
    /// Its worker id in the index and in routing answers.
    pub worker_id: WorkerId,
    /// Its KV-event publisher. A host is connected to; a wildcard (`tcp://*:port`) is
    /// bound, for an engine whose publisher connects to us. Rank `dp_start + i` is at port
    /// + `i`, as vLLM and SGLang place them.
    pub events: Endpoint,
    /// Its replay socket (same port rule), when it has one.
    pub replay: Option<Endpoint>,
    /// First data-parallel rank.
    pub dp_start: DpRank,
    /// Number of data-parallel ranks.
    pub dp_size: u32,
    /// Tokens per KV block.
    pub block_size: u32,
    /// The engine's OpenAI-compatible HTTP base URL (for the proxy).
    pub http_url: Option<String>,
}

impl ZmqEngine {
    /// An engine with one rank, no replay socket, and a worker id derived from its name.
    pub fn new(name: impl Into<String>, events: Endpoint, block_size: u32) -> Self {
        let name = name.into();
        ZmqEngine {
            worker_id: Self::id_of(&name),
            name,
            events,
            replay: None,
            dp_start: 0,
            dp_size: 1,
            block_size,
            http_url: None,
        }
    }

    /// The worker id a name stands for when no id is given: XXH3-64 of the name, below
    /// 2^63 so that JSON readers that parse numbers as doubles at least keep its order.
    pub fn id_of(name: &str) -> WorkerId {
        xxhash_rust::xxh3::xxh3_64(name.as_bytes()) >> 1
    }

    /// Its (worker, dp rank)s with their rank index (the port offset).
    pub fn ranks(&self) -> impl Iterator<Item = (u16, WorkerDp)> + '_ {
        (0..self.dp_size.max(1))
            .map(move |i| (i as u16, WorkerDp::new(self.worker_id, self.dp_start + i)))
    }
}

/// ZMQ sockets and replay.
#[derive(Debug, Clone, Copy)]
pub struct ZmqOptions {
    /// Subscriber sockets.
    pub sub: SubOptions,
    /// How long one replay reply may take.
    pub replay_timeout: Duration,
    /// Most batches one replay takes (an engine keeps 10,000).
    pub replay_max: usize,
}

impl Default for ZmqOptions {
    fn default() -> Self {
        Self {
            sub: SubOptions::default(),
            replay_timeout: Duration::from_secs(2),
            replay_max: 10_000,
        }
    }
}
