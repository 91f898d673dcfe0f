//! KV-event ingest: NATS → decode → the core that owns the worker → the lock-free index.
//!
//! # Threads
//!
//! Thread per core, on glommio executors (placement configurable, io memory sized
//! explicitly because the memlock limit is small):
//!
//! * the **NATS core** runs the [`Client`], subscribes to the kv-events, metrics and
//!   discovery subjects, decodes every message (bad ones are counted, logged and
//!   skipped), tracks worker liveness, runs recovery requests, and hands each worker's
//!   events to the shard that owns the worker (its [`ShardMap`]: round-robin by arrival)
//!   over a bounded flume channel, in arrival order;
//! * each **shard core** owns one [`ShardWriter`] and the event-id bookkeeping of its
//!   workers ([`EventIds`]): it applies events as they arrive, never waiting for more.
//!
//! Lookups go through a [`TreeReader`] from any thread.
//!
//! # Gaps, restarts, recovery
//!
//! Per (worker, dp rank) the shard keeps the last applied event id (see
//! [`kvrouter_core::recovery`]). On a gap, a worker that announced itself (it has a local
//! indexer) is asked for the missing range; its later events wait in a per-worker queue
//! until the answer (the range, or a full dump) is applied. A worker that never announced
//! itself (a stock Dynamo worker) is registered by its first event, applied at once; a gap
//! is logged and counted and the event applied. An id lower than the last one means the
//! worker restarted: its rank is cleared and rebuilt from the new events.
//!
//! # Discovery and liveness
//!
//! Announced workers get a full dump when first seen, and are removed after missing three
//! heartbeats or on a `leaving` announcement. Any message a worker publishes
//! (kv-events, `kv_metrics`, `forward-pass-metrics`) counts as a heartbeat; a worker that
//! never announced is removed after `silence_timeout` without messages.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use glommio::{LocalExecutorBuilder, Placement};
use kvrouter_core::codec::{self, Envelope, Subjects, kv, metrics};
use kvrouter_core::event::RouterEvent;
use kvrouter_core::index::tree::{ShardMap, ShardWriter, TreeIndex, TreeReader};
use kvrouter_core::index::{ApplyError, WorkerSummary};
use kvrouter_core::recovery::{Announcement, EventIds, RecoveryReply, RecoveryRequest, Verdict};
use kvrouter_core::snapshot::{SnapshotMeta, SnapshotView, StreamPosition, WorkerRecord};
use kvrouter_core::worker::{DpRank, StorageTier, WorkerDp, WorkerId};

use crate::nats::jetstream::{self, ConsumerSpec, StreamSpec};
use crate::nats::{Client, NatsError, Options};
use crate::snapshot::SnapshotStore;
use crate::worker::TOPIC_WORKERS;

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

/// What one snapshot wrote.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SnapshotInfo {
    /// The file.
    pub path: PathBuf,
    /// Its size.
    pub bytes: usize,
    /// Blocks in it.
    pub blocks: u64,
    /// (worker, dp rank)s in it.
    pub workers: usize,
    /// The JetStream sequence it covers (durable mode).
    pub stream_seq: Option<u64>,
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

/// Why the ingest could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IngestError {
    /// NATS failed (connecting, subscribing).
    #[error("nats: {0}")]
    Nats(#[from] NatsError),
    /// An executor could not start (io_uring, memlock).
    #[error("executor: {0}")]
    Executor(String),
}

/// Counters of the ingest; each is written by one core, read on scrape.
#[derive(Debug, Default)]
pub struct IngestCounters {
    /// kv-events messages received.
    pub messages: AtomicU64,
    /// Messages that failed to decode (skipped).
    pub decode_errors: AtomicU64,
    /// Events applied.
    pub events: AtomicU64,
    /// Blocks named by applied events.
    pub event_blocks: AtomicU64,
    /// Events ignored as duplicates.
    pub duplicates: AtomicU64,
    /// Events rejected by the index (e.g. unknown parent).
    pub rejected: AtomicU64,
    /// Gaps seen.
    pub gaps: AtomicU64,
    /// Gaps repaired from a local indexer (range or dump).
    pub recoveries: AtomicU64,
    /// Full dumps applied.
    pub dumps: AtomicU64,
    /// Recoveries that failed (timeout, no responders); events applied best effort.
    pub recovery_failures: AtomicU64,
    /// Worker restarts detected.
    pub restarts: AtomicU64,
    /// Workers removed (silence, missed heartbeats, leaving).
    pub workers_removed: AtomicU64,
    /// Events skipped: not worker-owned or not on the device tier.
    pub skipped: AtomicU64,
    /// Messages dropped by the NATS client because the ingest fell behind.
    pub nats_dropped: AtomicU64,
    /// NATS reconnects.
    pub nats_reconnects: AtomicU64,
    /// Snapshots written.
    pub snapshots: AtomicU64,
    /// Snapshots that could not be written (the previous one is kept).
    pub snapshot_failures: AtomicU64,
    /// Workers left out of a snapshot because their numbering was reset while it was
    /// taken (a restart during the dump).
    pub snapshot_skipped_workers: AtomicU64,
    /// Snapshots found at start but unusable (corrupt, truncated, other version).
    pub snapshot_load_failures: AtomicU64,
    /// Blocks restored from a snapshot at start.
    pub snapshot_restored_blocks: AtomicU64,
    /// JetStream acknowledgements sent.
    pub js_acks: AtomicU64,
    /// JetStream deliveries skipped as already applied (redeliveries).
    pub js_redelivered: AtomicU64,
    /// Durable consumers re-created after messages were lost in flight.
    pub js_resets: AtomicU64,
}

/// A snapshot of [`IngestCounters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[allow(missing_docs)]
pub struct IngestStats {
    pub messages: u64,
    pub decode_errors: u64,
    pub events: u64,
    pub event_blocks: u64,
    pub duplicates: u64,
    pub rejected: u64,
    pub gaps: u64,
    pub recoveries: u64,
    pub dumps: u64,
    pub recovery_failures: u64,
    pub restarts: u64,
    pub workers_removed: u64,
    pub skipped: u64,
    pub nats_dropped: u64,
    pub nats_reconnects: u64,
    pub snapshots: u64,
    pub snapshot_failures: u64,
    pub snapshot_skipped_workers: u64,
    pub snapshot_load_failures: u64,
    pub snapshot_restored_blocks: u64,
    pub js_acks: u64,
    pub js_redelivered: u64,
    pub js_resets: u64,
}

impl IngestCounters {
    fn snapshot(&self) -> IngestStats {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        IngestStats {
            messages: l(&self.messages),
            decode_errors: l(&self.decode_errors),
            events: l(&self.events),
            event_blocks: l(&self.event_blocks),
            duplicates: l(&self.duplicates),
            rejected: l(&self.rejected),
            gaps: l(&self.gaps),
            recoveries: l(&self.recoveries),
            dumps: l(&self.dumps),
            recovery_failures: l(&self.recovery_failures),
            restarts: l(&self.restarts),
            workers_removed: l(&self.workers_removed),
            skipped: l(&self.skipped),
            nats_dropped: l(&self.nats_dropped),
            nats_reconnects: l(&self.nats_reconnects),
            snapshots: l(&self.snapshots),
            snapshot_failures: l(&self.snapshot_failures),
            snapshot_skipped_workers: l(&self.snapshot_skipped_workers),
            snapshot_load_failures: l(&self.snapshot_load_failures),
            snapshot_restored_blocks: l(&self.snapshot_restored_blocks),
            js_acks: l(&self.js_acks),
            js_redelivered: l(&self.js_redelivered),
            js_resets: l(&self.js_resets),
        }
    }
}

fn bump(a: &AtomicU64, n: u64) {
    a.fetch_add(n, Ordering::Relaxed);
}

/// What a recovery brought back.
#[derive(Debug)]
enum Recovered {
    Range {
        publisher: u64,
        events: Vec<RouterEvent>,
    },
    Dump {
        publisher: u64,
        events: Vec<RouterEvent>,
        last_event_ids: Vec<(DpRank, u64)>,
    },
    Failed(String),
}

enum ShardCmd {
    Events {
        events: Vec<RouterEvent>,
        publisher: u64,
        arrived: Instant,
    },
    Heartbeat {
        worker_id: WorkerId,
        last_event_ids: Vec<(DpRank, u64)>,
    },
    Announced {
        worker_id: WorkerId,
        heartbeat_ms: u64,
    },
    Recovered {
        worker_id: WorkerId,
        result: Recovered,
    },
    Remove {
        worker_id: WorkerId,
    },
    /// Dump this shard's state for a snapshot.
    Snapshot {
        reply: flume::Sender<ShardPart>,
    },
    /// Answer once everything sent before has been applied.
    Barrier {
        reply: flume::Sender<()>,
    },
    Stop,
}

/// One shard's share of a snapshot.
struct ShardPart {
    workers: Vec<WorkerRecord>,
    events: Vec<RouterEvent>,
}

enum NatsCmd {
    Recover {
        shard: usize,
        worker_id: WorkerId,
        dp_rank: Option<DpRank>,
        range: Option<(u64, u64)>,
    },
    Snapshot {
        reply: flume::Sender<Result<SnapshotInfo, String>>,
    },
    Stop,
}

/// Per-shard view shared with readers of worker summaries.
type Summaries = Arc<Mutex<HashMap<WorkerDp, WorkerSummary>>>;

/// A running ingest. Dropping it stops the executors.
pub struct Ingest {
    /// Lookups, readiness, counters and summaries: what the ingest shares with readers.
    view: IngestView,
    shard_tx: Vec<flume::Sender<ShardCmd>>,
    /// Which shard owns each worker.
    map: Arc<ShardMap>,
    nats_tx: flume::Sender<NatsCmd>,
    latencies: Arc<Mutex<Vec<u64>>>,
    threads: Vec<glommio::ExecutorJoinHandle<()>>,
    snapshot_on_stop: bool,
}

impl std::fmt::Debug for Ingest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ingest")
            .field("shards", &self.shard_tx.len())
            .field("stats", &self.stats())
            .finish()
    }
}

impl std::fmt::Debug for ShardCmd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ShardCmd")
    }
}

impl std::fmt::Debug for NatsCmd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NatsCmd")
    }
}

fn builder(cfg: &IngestConfig, i: usize, name: &str) -> LocalExecutorBuilder {
    let placement = match cfg.cpus.get(i) {
        Some(&cpu) => Placement::Fixed(cpu),
        None => Placement::Unbound,
    };
    let b = LocalExecutorBuilder::new(placement)
        .name(name)
        .io_memory(cfg.io_memory);
    match cfg.spin_before_park {
        Some(d) => b.spin_before_park(d),
        None => b,
    }
}

/// A cheap, `Send + Sync` view of a running ingest: lookups, readiness, counters and
/// worker summaries (what the routing API needs).
#[derive(Clone)]
pub struct IngestView {
    reader: TreeReader,
    counters: Arc<IngestCounters>,
    ready: Arc<AtomicBool>,
    summaries: Vec<Summaries>,
    /// Bumped (`Release`) after any shard's summary map gains or loses a (worker, dp rank).
    members: Arc<AtomicU64>,
}

impl std::fmt::Debug for IngestView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IngestView")
            .field("ready", &self.is_ready())
            .finish()
    }
}

impl IngestView {
    /// A view of an index fed by something else than NATS (benchmarks, the harness): always
    /// ready, no counters, a fixed worker list.
    pub fn fixed(reader: TreeReader, workers: Vec<WorkerSummary>) -> Self {
        let map: HashMap<WorkerDp, WorkerSummary> =
            workers.into_iter().map(|s| (s.worker, s)).collect();
        IngestView {
            reader,
            counters: Arc::new(IngestCounters::default()),
            ready: Arc::new(AtomicBool::new(true)),
            summaries: vec![Arc::new(Mutex::new(map))],
            members: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Lock-free lookups into the index.
    pub fn reader(&self) -> &TreeReader {
        &self.reader
    }

    /// Whether the NATS subscriptions are active.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// Counters.
    pub fn stats(&self) -> IngestStats {
        self.counters.snapshot()
    }

    /// A counter that changes whenever the set of known (worker, dp rank)s changes: a
    /// caller that read it, then [`Self::workers`], may keep that worker list for as long
    /// as the counter reads the same.
    pub fn membership(&self) -> u64 {
        // `Acquire` pairs with the shard cores' `Release` bump, made after they changed a
        // summary map: a caller that reads the new count then lists the new membership.
        self.members.load(Ordering::Acquire)
    }

    /// Known (worker, dp rank)s with block counts and last applied event ids.
    pub fn workers(&self) -> Vec<WorkerSummary> {
        let mut v: Vec<WorkerSummary> = self
            .summaries
            .iter()
            .flat_map(|s| {
                s.lock()
                    .map(|m| m.values().copied().collect::<Vec<_>>())
                    .unwrap_or_default()
            })
            .collect();
        v.sort_by_key(|s| s.worker);
        v
    }

    /// The last applied event id of one (worker, dp rank).
    pub fn last_event_id(&self, worker: WorkerDp) -> Option<u64> {
        // One shard has the worker; there are a handful.
        self.summaries
            .iter()
            .find_map(|s| s.lock().ok()?.get(&worker).map(|s| s.last_event_id))?
    }
}

impl Ingest {
    /// Starts the executors, connects and subscribes; returns once the subscriptions are
    /// active (or the first connection failed).
    pub fn start(cfg: IngestConfig) -> Result<Ingest, IngestError> {
        let shards = cfg.shards.max(1);
        let index = TreeIndex::new(shards);
        let map = index.shard_map();
        let (mut writers, reader) = index.into_parts();
        let counters = Arc::new(IngestCounters::default());
        let store = cfg.snapshot.as_ref().map(|s| SnapshotStore::new(&s.dir));
        let restored = match &store {
            Some(store) => restore(store, &cfg, &mut writers, &map, &counters),
            None => Restored::empty(shards),
        };
        let ready = Arc::new(AtomicBool::new(false));
        let latencies = Arc::new(Mutex::new(Vec::new()));
        let (nats_tx, nats_rx) = flume::unbounded::<NatsCmd>();
        let mut shard_tx = Vec::new();
        let mut shard_rx = Vec::new();
        for _ in 0..shards {
            let (tx, rx) = flume::bounded::<ShardCmd>(4096);
            shard_tx.push(tx);
            shard_rx.push(rx);
        }
        let mut threads = Vec::new();
        let mut summaries = Vec::new();
        let members = Arc::new(AtomicU64::new(0));
        let mut ids_of = restored.ids;
        let mut announced_of = restored.announced;
        for (i, (writer, rx)) in writers.into_iter().zip(shard_rx).enumerate() {
            let sum: Summaries = Arc::new(Mutex::new(HashMap::new()));
            summaries.push(Arc::clone(&sum));
            let shard = ShardCore {
                index: i,
                writer,
                ids: std::mem::take(&mut ids_of[i]),
                announced: std::mem::take(&mut announced_of[i]),
                recovering: HashMap::new(),
                counters: Arc::clone(&counters),
                nats: nats_tx.clone(),
                summaries: sum,
                members: Arc::clone(&members),
                latencies: cfg.record_latency.then(|| Arc::clone(&latencies)),
                deferred: VecDeque::new(),
            };
            shard.summarize_all();
            let h = builder(&cfg, i + 1, &format!("kvrouter-shard-{i}"))
                .spawn(move || async move { shard.run(rx).await })
                .map_err(|e| IngestError::Executor(e.to_string()))?;
            threads.push(h);
        }
        let (started_tx, started_rx) = std::sync::mpsc::channel::<Result<(), NatsError>>();
        let nats_core = NatsCoreConfig {
            cfg: cfg.clone(),
            shards: shard_tx.clone(),
            map: Arc::clone(&map),
            counters: Arc::clone(&counters),
            ready: Arc::clone(&ready),
            store,
            liveness: restored.liveness,
            stream_seq: restored.stream_seq,
        };
        let h = builder(&cfg, 0, "kvrouter-nats")
            .spawn(move || async move { nats_core.start().run(nats_rx, started_tx).await })
            .map_err(|e| IngestError::Executor(e.to_string()))?;
        threads.push(h);
        // The NATS core's handle is last: `shutdown` joins it first.
        let ingest = Ingest {
            view: IngestView {
                reader,
                counters,
                ready,
                summaries,
                members,
            },
            shard_tx,
            map,
            nats_tx,
            latencies,
            threads,
            snapshot_on_stop: cfg.snapshot.as_ref().is_some_and(|s| s.on_stop),
        };
        match started_rx.recv() {
            Ok(Ok(())) => Ok(ingest),
            Ok(Err(e)) => Err(IngestError::Nats(e)),
            Err(_) => Err(IngestError::Executor("the NATS core stopped".into())),
        }
    }

    /// Lock-free lookups into the index this ingest feeds.
    pub fn reader(&self) -> TreeReader {
        self.view.reader.clone()
    }

    /// A `Send + Sync` view for other executors (the routing API).
    pub fn view(&self) -> IngestView {
        self.view.clone()
    }

    /// Whether the NATS subscriptions are active (false while reconnecting).
    pub fn is_ready(&self) -> bool {
        self.view.is_ready()
    }

    /// Counters.
    pub fn stats(&self) -> IngestStats {
        self.view.stats()
    }

    /// Known (worker, dp rank)s with their block counts and last applied event ids.
    pub fn workers(&self) -> Vec<WorkerSummary> {
        self.view.workers()
    }

    /// The last applied event id of one (worker, dp rank).
    pub fn last_event_id(&self, worker: WorkerDp) -> Option<u64> {
        self.view.last_event_id(worker)
    }

    /// Arrival-to-visible latencies recorded so far, ns (with `record_latency`).
    pub fn take_latencies(&self) -> Vec<u64> {
        self.latencies
            .lock()
            .map(|mut v| std::mem::take(&mut *v))
            .unwrap_or_default()
    }

    /// Removes a worker now (all dp ranks).
    pub fn remove_worker(&self, worker_id: WorkerId) {
        // `shard_of`, not `get`: a worker whose first events the NATS core is routing now
        // gets one shard either way, so its removal queues behind them.
        let shard = self.map.shard_of(worker_id);
        let _ = self.shard_tx[shard].send(ShardCmd::Remove { worker_id });
    }

    /// Writes a snapshot now (blocking until it is on disk). Lookups are never blocked; each
    /// shard core pauses applying events while it dumps one worker's state, and catches up
    /// between workers.
    pub fn snapshot_now(&self) -> Result<SnapshotInfo, String> {
        let (tx, rx) = flume::bounded(1);
        self.nats_tx
            .send(NatsCmd::Snapshot { reply: tx })
            .map_err(|_| "the ingest has stopped".to_owned())?;
        rx.recv().map_err(|_| "the ingest has stopped".to_owned())?
    }

    /// Stops every executor and waits for them (writing a snapshot first when configured).
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if std::mem::take(&mut self.snapshot_on_stop) {
            match self.snapshot_now() {
                Ok(info) => {
                    tracing::info!(path = %info.path.display(), blocks = info.blocks, "snapshot written on stop")
                }
                Err(e) => tracing::error!(error = %e, "no snapshot on stop"),
            }
        }
        // The NATS core stops first: on its way out it acknowledges through the shards, which
        // must still be running. The shards stop once it is gone.
        let _ = self.nats_tx.send(NatsCmd::Stop);
        if let Some(nats) = self.threads.pop() {
            let _ = nats.join();
        }
        for tx in &self.shard_tx {
            let _ = tx.send(ShardCmd::Stop);
        }
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

impl Drop for Ingest {
    fn drop(&mut self) {
        self.shutdown();
    }
}

// ------------------------------------------------------------------------------ restore

/// What a snapshot restored, per shard.
struct Restored {
    ids: Vec<EventIds>,
    announced: Vec<HashMap<WorkerId, u64>>,
    liveness: HashMap<WorkerId, Liveness>,
    /// The JetStream sequence the restored state covers (0: none).
    stream_seq: u64,
}

impl Restored {
    fn empty(shards: usize) -> Self {
        Self {
            ids: (0..shards).map(|_| EventIds::new()).collect(),
            announced: vec![HashMap::new(); shards],
            liveness: HashMap::new(),
            stream_seq: 0,
        }
    }
}

/// Loads the snapshot into the (empty) writers. Any problem with the file is logged and
/// counted, and the ingest starts empty (a full resync: dumps from announced workers, the
/// whole stream in durable mode).
fn restore(
    store: &SnapshotStore,
    cfg: &IngestConfig,
    writers: &mut [ShardWriter],
    map: &ShardMap,
    counters: &IngestCounters,
) -> Restored {
    let shards = writers.len();
    let mut out = Restored::empty(shards);
    let started = Instant::now();
    store.remove_stale_temporaries();
    let mapped = match store.open() {
        Ok(Some(m)) => m,
        Ok(None) => {
            tracing::info!(dir = %store.dir().display(), "no snapshot: starting empty");
            return out;
        }
        Err(e) => {
            bump(&counters.snapshot_load_failures, 1);
            tracing::error!(error = %e, "snapshot unreadable: starting empty, full resync");
            return out;
        }
    };
    let view: SnapshotView<'_> = match mapped.view() {
        Ok(v) => v,
        Err(e) => {
            bump(&counters.snapshot_load_failures, 1);
            tracing::error!(error = %e, kind = e.kind(), "snapshot rejected: starting empty, full resync");
            return out;
        }
    };
    let mut blocks = 0u64;
    for e in view.events() {
        blocks += e.block_count() as u64;
        let w = map.shard_of(e.worker_id);
        if let Err(err) = writers[w].apply_event(&e) {
            // A valid file from a buggy writer: keep what applies, say so.
            tracing::warn!(error = %err, "snapshot chain rejected while restoring");
        }
    }
    let now = Instant::now();
    for r in view.workers() {
        let i = map.shard_of(r.worker.worker_id);
        if let Some(id) = r.last_event_id {
            out.ids[i].set(r.worker, id, r.publisher);
        }
        let heartbeat = r
            .announced
            .then(|| Duration::from_millis(r.heartbeat_ms.max(1)));
        if r.announced {
            out.announced[i].insert(r.worker.worker_id, r.heartbeat_ms);
        }
        out.liveness.insert(
            r.worker.worker_id,
            Liveness {
                last_seen: now,
                heartbeat,
            },
        );
    }
    if let (Some(d), Some(pos)) = (&cfg.durable, &view.meta().stream) {
        if pos.stream == d.stream {
            out.stream_seq = pos.seq;
        } else {
            tracing::warn!(snapshot = %pos.stream, configured = %d.stream, "snapshot of another stream: replaying the whole stream");
        }
    }
    bump(&counters.snapshot_restored_blocks, blocks);
    tracing::info!(
        path = %mapped.path().display(),
        blocks,
        workers = view.workers().len(),
        stream_seq = out.stream_seq,
        ms = started.elapsed().as_millis() as u64,
        "snapshot restored"
    );
    out
}

// ------------------------------------------------------------------------------ shards

struct ShardCore {
    index: usize,
    writer: ShardWriter,
    ids: EventIds,
    /// Workers with a local indexer (announced), with their heartbeat interval in ms.
    announced: HashMap<WorkerId, u64>,
    /// Workers waiting for a recovery answer, with the events that arrived meanwhile
    /// (event, publisher).
    recovering: HashMap<WorkerId, VecDeque<(RouterEvent, u64)>>,
    counters: Arc<IngestCounters>,
    nats: flume::Sender<NatsCmd>,
    summaries: Summaries,
    /// See [`IngestView::membership`].
    members: Arc<AtomicU64>,
    latencies: Option<Arc<Mutex<Vec<u64>>>>,
    /// Commands taken off the channel during a snapshot's dump, to be carried out next.
    deferred: VecDeque<ShardCmd>,
}

/// Whether a shard core goes on after a command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flow {
    Go,
    Stop,
}

impl ShardCore {
    async fn run(mut self, rx: flume::Receiver<ShardCmd>) {
        loop {
            // Commands a snapshot took off the channel but left for after it come first.
            let cmd = match self.deferred.pop_front() {
                Some(cmd) => cmd,
                None => match rx.recv_async().await {
                    Ok(cmd) => cmd,
                    Err(_) => return,
                },
            };
            if self.command(cmd, &rx) == Flow::Stop {
                return;
            }
        }
    }

    /// Carries out one command; `rx` lets a snapshot apply what arrives while it dumps.
    fn command(&mut self, cmd: ShardCmd, rx: &flume::Receiver<ShardCmd>) -> Flow {
        match cmd {
            ShardCmd::Events {
                events,
                publisher,
                arrived,
            } => {
                for e in events {
                    self.handle(e, publisher);
                }
                if let Some(mut v) = self.latencies.as_ref().and_then(|l| l.lock().ok()) {
                    v.push(arrived.elapsed().as_nanos() as u64);
                }
            }
            ShardCmd::Announced {
                worker_id,
                heartbeat_ms,
            } => {
                self.announced.insert(worker_id, heartbeat_ms);
                // Load the worker's full state; hold its events until it arrives.
                self.recover(worker_id, None, None);
            }
            ShardCmd::Recovered { worker_id, result } => self.recovered(worker_id, result),
            ShardCmd::Heartbeat {
                worker_id,
                last_event_ids,
            } => {
                // Trailing gap: the worker published events we never received.
                if !self.recovering.contains_key(&worker_id) {
                    for (dp, published) in last_event_ids {
                        let w = WorkerDp::new(worker_id, dp);
                        match self.ids.last(w) {
                            Some(last) if last < published => {
                                bump(&self.counters.gaps, 1);
                                self.recover(worker_id, Some(dp), Some((last + 1, published)));
                                break;
                            }
                            None => {
                                self.recover(worker_id, None, None);
                                break;
                            }
                            _ => {}
                        }
                    }
                }
            }
            ShardCmd::Remove { worker_id } => {
                self.writer.remove_worker(worker_id);
                self.ids.forget_worker(worker_id);
                self.recovering.remove(&worker_id);
                self.announced.remove(&worker_id);
                bump(&self.counters.workers_removed, 1);
                if let Ok(mut m) = self.summaries.lock() {
                    let before = m.len();
                    m.retain(|w, _| w.worker_id != worker_id);
                    if m.len() != before {
                        drop(m);
                        self.members.fetch_add(1, Ordering::Release);
                    }
                }
            }
            ShardCmd::Snapshot { reply } => {
                let part = self.snapshot_part(rx);
                let _ = reply.send(part);
            }
            ShardCmd::Barrier { reply } => {
                let _ = reply.send(());
            }
            ShardCmd::Stop => return Flow::Stop,
        }
        Flow::Go
    }

    /// This shard's state for a snapshot, dumped a worker at a time: between two workers
    /// the shard applies the events (and other commands) that arrived meanwhile, so it
    /// pauses for one worker's dump at a time rather than for the whole shard's. Each
    /// worker's record (last event id, publisher) is taken with its dump, so every worker
    /// is consistent in itself; a later worker may include events dispatched after the
    /// snapshot was asked for, and replaying those after a restore skips them as
    /// duplicates by their event ids. Workers waiting for a recovery answer are left out:
    /// their state is incomplete, and a restarted router that does not know them loads
    /// them afresh (a dump) at their next announcement. So are workers whose numbering was
    /// reset during the dump (a restart, or a removal and a new process): the stream past
    /// the snapshot's position still holds their old process's events, which would not
    /// replay as duplicates over the new process's record; left out, the replay rebuilds
    /// them and the new process's first event resets them as it did live. A second
    /// snapshot or a stop that arrives during the dump is carried out after it.
    fn snapshot_part(&mut self, rx: &flume::Receiver<ShardCmd>) -> ShardPart {
        let mut part = ShardPart {
            workers: Vec::new(),
            events: Vec::new(),
        };
        // Once a stop is taken (or was already waiting), everything after it waits too.
        let mut stop = self.deferred.iter().any(|c| matches!(c, ShardCmd::Stop));
        let listed: Vec<(WorkerDp, Option<u64>, Option<u64>)> = self
            .writer
            .workers()
            .into_iter()
            .map(|s| {
                (
                    s.worker,
                    self.ids.publisher(s.worker),
                    self.ids.last(s.worker),
                )
            })
            .collect();
        for (i, (w, publisher, last)) in listed.into_iter().enumerate() {
            if i > 0 {
                // What arrived while the previous worker was dumped (not what keeps
                // arriving: a bounded drain, so a busy stream cannot starve the dump).
                for _ in 0..rx.len() {
                    match rx.try_recv() {
                        Ok(cmd @ (ShardCmd::Snapshot { .. } | ShardCmd::Stop)) => {
                            stop |= matches!(cmd, ShardCmd::Stop);
                            self.deferred.push_back(cmd);
                        }
                        Ok(cmd) if !stop => {
                            let _ = self.command(cmd, rx);
                        }
                        Ok(cmd) => self.deferred.push_back(cmd),
                        Err(_) => break,
                    }
                }
            }
            if self.recovering.contains_key(&w.worker_id) {
                continue;
            }
            // Removed since the list was taken: nothing to dump or record.
            if self.writer.summary(w).is_none() {
                continue;
            }
            // Renumbered since: another publisher, or ids gone back (forgotten included).
            if self.ids.publisher(w) != publisher || self.ids.last(w) < last {
                bump(&self.counters.snapshot_skipped_workers, 1);
                tracing::info!(worker = %w, "renumbered during the snapshot: left out of it");
                continue;
            }
            let heartbeat = self.announced.get(&w.worker_id).copied();
            part.workers.push(WorkerRecord {
                worker: w,
                last_event_id: self.ids.last(w),
                publisher: self.ids.publisher(w).unwrap_or(0),
                announced: heartbeat.is_some(),
                heartbeat_ms: heartbeat.unwrap_or(0),
            });
            self.writer.dump_worker(w, &mut part.events);
        }
        part
    }

    /// Publishes the summaries of every worker (after a restore).
    fn summarize_all(&self) {
        for s in self.writer.workers() {
            self.summarize(s.worker);
        }
    }

    fn recover(&mut self, worker_id: WorkerId, dp_rank: Option<DpRank>, range: Option<(u64, u64)>) {
        self.recovering.entry(worker_id).or_default();
        let _ = self.nats.send(NatsCmd::Recover {
            shard: self.index,
            worker_id,
            dp_rank,
            range,
        });
    }

    fn handle(&mut self, e: RouterEvent, publisher: u64) {
        if !e.is_worker_owned() || e.storage_tier != StorageTier::Device {
            bump(&self.counters.skipped, 1);
            return;
        }
        if let Some(queue) = self.recovering.get_mut(&e.worker_id) {
            queue.push_back((e, publisher));
            return;
        }
        let w = e.worker();
        let id = e.event.event_id;
        match self.ids.verdict(w, id, publisher) {
            Verdict::Apply => self.apply(e, publisher),
            Verdict::Duplicate => bump(&self.counters.duplicates, 1),
            Verdict::Restart => {
                tracing::info!(worker = %w, event_id = id, "worker restarted: resetting its state");
                bump(&self.counters.restarts, 1);
                self.writer.clear_worker(w);
                self.ids.forget(w);
                self.apply(e, publisher);
            }
            Verdict::Gap { first, last } => {
                bump(&self.counters.gaps, 1);
                if self.announced.contains_key(&w.worker_id) {
                    tracing::debug!(worker = %w, first, last, "gap: asking the worker's local indexer");
                    self.recovering
                        .entry(w.worker_id)
                        .or_default()
                        .push_back((e, publisher));
                    self.recover(w.worker_id, Some(w.dp_rank), Some((first, last)));
                } else {
                    tracing::warn!(worker = %w, first, last, "gap in the events of a worker without a local indexer");
                    self.apply(e, publisher);
                }
            }
        }
    }

    fn apply(&mut self, e: RouterEvent, publisher: u64) {
        let w = e.worker();
        let id = e.event.event_id;
        let blocks = e.block_count() as u64;
        match self.writer.apply_event(&e) {
            Ok(_) => {
                bump(&self.counters.events, 1);
                bump(&self.counters.event_blocks, blocks);
            }
            Err(err) => {
                bump(&self.counters.rejected, 1);
                tracing::warn!(worker = %w, error = %err, "event rejected");
                if matches!(err, ApplyError::ParentNotFound { .. })
                    && self.announced.contains_key(&w.worker_id)
                {
                    // We are out of sync with this worker: reload its state.
                    self.ids.set(w, id, publisher);
                    self.summarize(w);
                    self.recover(w.worker_id, Some(w.dp_rank), None);
                    return;
                }
            }
        }
        self.ids.set(w, id, publisher);
        self.summarize(w);
    }

    fn summarize(&self, w: WorkerDp) {
        if let Ok(mut m) = self.summaries.lock() {
            let changed = match self.writer.summary(w) {
                Some(s) => m
                    .insert(
                        w,
                        WorkerSummary {
                            last_event_id: self.ids.last(w),
                            ..s
                        },
                    )
                    .is_none(),
                None => m.remove(&w).is_some(),
            };
            drop(m);
            if changed {
                self.members.fetch_add(1, Ordering::Release);
            }
        }
    }

    fn recovered(&mut self, worker_id: WorkerId, result: Recovered) {
        let pending = self.recovering.remove(&worker_id).unwrap_or_default();
        match result {
            Recovered::Range { publisher, events } => {
                bump(&self.counters.recoveries, 1);
                for e in events {
                    let w = e.worker();
                    if self.ids.verdict(w, e.event.event_id, publisher) == Verdict::Apply {
                        self.apply(e, publisher);
                    }
                }
            }
            Recovered::Dump {
                publisher,
                events,
                last_event_ids,
            } => {
                bump(&self.counters.dumps, 1);
                bump(&self.counters.recoveries, 1);
                for e in events {
                    let w = e.worker();
                    let blocks = e.block_count() as u64;
                    if self.writer.apply_event(&e).is_ok() {
                        bump(&self.counters.event_blocks, blocks);
                    }
                    self.summarize(w);
                }
                for (dp, last) in last_event_ids {
                    let w = WorkerDp::new(worker_id, dp);
                    self.ids.set(w, last, publisher);
                    self.summarize(w);
                }
            }
            Recovered::Failed(why) => {
                bump(&self.counters.recovery_failures, 1);
                tracing::warn!(worker_id, %why, "recovery failed: applying its events best effort");
                // Accept whatever comes next as the new baseline.
                self.ids.forget_worker(worker_id);
            }
        }
        for (e, publisher) in pending {
            self.handle(e, publisher);
        }
    }
}

// ------------------------------------------------------------------------------ NATS core

#[derive(Debug, Clone, Copy)]
struct Liveness {
    last_seen: Instant,
    /// Heartbeat interval of an announced worker.
    heartbeat: Option<Duration>,
}

/// What the NATS core is built from (sent to its thread).
struct NatsCoreConfig {
    cfg: IngestConfig,
    shards: Vec<flume::Sender<ShardCmd>>,
    map: Arc<ShardMap>,
    counters: Arc<IngestCounters>,
    ready: Arc<AtomicBool>,
    store: Option<SnapshotStore>,
    liveness: HashMap<WorkerId, Liveness>,
    stream_seq: u64,
}

impl NatsCoreConfig {
    fn start(self) -> NatsCore {
        NatsCore {
            cfg: self.cfg,
            shards: self.shards,
            map: self.map,
            counters: self.counters,
            ready: self.ready,
            workers: RefCell::new(self.liveness),
            store: self.store,
            dispatched_seq: Cell::new(self.stream_seq),
            snapshot_busy: Cell::new(false),
            ack_reply: RefCell::new(None),
            consumer_ready: Cell::new(false),
        }
    }
}

struct NatsCore {
    cfg: IngestConfig,
    shards: Vec<flume::Sender<ShardCmd>>,
    /// Which shard owns each worker.
    map: Arc<ShardMap>,
    counters: Arc<IngestCounters>,
    ready: Arc<AtomicBool>,
    workers: RefCell<HashMap<WorkerId, Liveness>>,
    store: Option<SnapshotStore>,
    /// Durable mode: the stream sequence of the last message handed to the shards in full.
    dispatched_seq: Cell<u64>,
    snapshot_busy: Cell<bool>,
    /// Durable mode: the ack subject of the last message handed to the shards, not yet
    /// acknowledged.
    ack_reply: RefCell<Option<String>>,
    /// Durable mode: the consumer exists and delivers.
    consumer_ready: Cell<bool>,
}

impl NatsCore {
    fn shard_of(&self, worker_id: WorkerId) -> usize {
        self.map.shard_of(worker_id)
    }

    async fn run(
        self,
        cmds: flume::Receiver<NatsCmd>,
        started: std::sync::mpsc::Sender<Result<(), NatsError>>,
    ) {
        let client = match Client::connect(self.cfg.nats.clone()).await {
            Ok(c) => c,
            Err(e) => {
                let _ = started.send(Err(e));
                return;
            }
        };
        let durable = self.cfg.durable.is_some();
        let subs = (|| -> Result<_, NatsError> {
            Ok((
                // Durable mode: events come through the consumer instead.
                (!durable)
                    .then(|| client.subscribe(&self.cfg.subjects.kv_events(), None))
                    .transpose()?,
                client.subscribe(&self.cfg.subjects.subject(codec::TOPIC_KV_METRICS), None)?,
                client.subscribe(
                    &self.cfg.subjects.subject(codec::TOPIC_FORWARD_PASS_METRICS),
                    None,
                )?,
                client.subscribe(&self.cfg.subjects.subject(TOPIC_WORKERS), None)?,
            ))
        })();
        let (events_sub, kvm_sub, fpm_sub, disc_sub) = match subs {
            Ok(s) => s,
            Err(e) => {
                let _ = started.send(Err(e));
                return;
            }
        };
        if let Err(e) = client.flush(Duration::from_secs(5)).await {
            let _ = started.send(Err(e));
            return;
        }
        if let Some(d) = &self.cfg.durable {
            let spec = StreamSpec {
                name: d.stream.clone(),
                subjects: vec![self.cfg.subjects.kv_events()],
                max_age: d.max_age,
                max_bytes: None,
            };
            match jetstream::ensure_stream(&client, &spec, Duration::from_secs(5)).await {
                Ok(st) => {
                    let from = self.dispatched_seq.get();
                    if from > st.last_seq {
                        // The stream was re-created (or its store wiped) since the snapshot:
                        // its numbering started over. Replay all of it.
                        tracing::warn!(
                            snapshot_seq = from,
                            last_seq = st.last_seq,
                            "the stream is behind the snapshot (re-created?): replaying it from the start"
                        );
                        self.dispatched_seq.set(0);
                    } else if from > 0 && st.first_seq > from + 1 {
                        tracing::warn!(
                            snapshot_seq = from,
                            first_seq = st.first_seq,
                            "the stream no longer holds every message after the snapshot: workers with a local indexer will be resynchronised by gap recovery"
                        );
                    }
                    tracing::info!(stream = %d.stream, first_seq = st.first_seq, last_seq = st.last_seq, "stream bound");
                }
                Err(e) => {
                    let _ = started.send(Err(NatsError::Io(format!("jetstream: {e}"))));
                    return;
                }
            }
        }
        // Durable mode is ready once its consumer exists (see the liveness task).
        self.ready
            .store(self.cfg.durable.is_none(), Ordering::Release);
        let _ = started.send(Ok(()));
        let me = Rc::new(self);

        // kv-events.
        let m = Rc::clone(&me);
        let c = client.clone();
        let events_task = glommio::spawn_local(async move {
            match events_sub {
                Some(sub) => {
                    while let Some(msg) = sub.next().await {
                        m.on_events(&msg.payload).await;
                    }
                }
                None => m.consume_durable(&c).await,
            }
        });
        if let Some(d) = me.cfg.durable.clone() {
            let m = Rc::clone(&me);
            let c = client.clone();
            glommio::spawn_local(async move {
                loop {
                    glommio::timer::sleep(d.ack_interval).await;
                    m.ack_applied(&c).await;
                }
            })
            .detach();
        }
        if let Some(every) = me.cfg.snapshot.as_ref().and_then(|s| s.interval) {
            let m = Rc::clone(&me);
            glommio::spawn_local(async move {
                loop {
                    glommio::timer::sleep(every).await;
                    if let Err(e) = m.take_snapshot().await {
                        tracing::error!(error = %e, "periodic snapshot failed; the previous one is kept");
                    }
                }
            })
            .detach();
        }
        // Metrics: heartbeats only.
        for sub in [kvm_sub, fpm_sub] {
            let m = Rc::clone(&me);
            glommio::spawn_local(async move {
                while let Some(msg) = sub.next().await {
                    match Envelope::decode(&msg.payload)
                        .and_then(|env| metrics::heartbeat_worker(&env))
                    {
                        Ok(Some(w)) => m.seen(w.worker_id, None),
                        Ok(None) => {}
                        Err(e) => {
                            bump(&m.counters.decode_errors, 1);
                            tracing::debug!(error = %e, "undecodable metrics message");
                        }
                    }
                }
            })
            .detach();
        }
        // Discovery.
        let m = Rc::clone(&me);
        glommio::spawn_local(async move {
            while let Some(msg) = disc_sub.next().await {
                match serde_json::from_slice::<Announcement>(&msg.payload) {
                    Ok(a) => m.on_announcement(a).await,
                    Err(e) => {
                        bump(&m.counters.decode_errors, 1);
                        tracing::warn!(error = %e, "malformed worker announcement");
                    }
                }
            }
        })
        .detach();
        // Liveness and client counters.
        let m = Rc::clone(&me);
        let c = client.clone();
        glommio::spawn_local(async move {
            loop {
                glommio::timer::sleep(Duration::from_millis(100)).await;
                m.reap().await;
                let st = c.stats();
                m.counters.nats_dropped.store(st.dropped, Ordering::Relaxed);
                m.counters
                    .nats_reconnects
                    .store(st.reconnects, Ordering::Relaxed);
                let consuming = m.cfg.durable.is_none() || m.consumer_ready.get();
                m.ready
                    .store(c.is_connected() && consuming, Ordering::Release);
            }
        })
        .detach();
        // Recovery requests from the shards.
        while let Ok(cmd) = cmds.recv_async().await {
            match cmd {
                NatsCmd::Recover {
                    shard,
                    worker_id,
                    dp_rank,
                    range,
                } => {
                    let (m, c) = (Rc::clone(&me), client.clone());
                    glommio::spawn_local(async move {
                        let result = m.recover(&c, worker_id, dp_rank, range).await;
                        let _ = m.shards[shard]
                            .send_async(ShardCmd::Recovered { worker_id, result })
                            .await;
                    })
                    .detach();
                }
                NatsCmd::Snapshot { reply } => {
                    let m = Rc::clone(&me);
                    glommio::spawn_local(async move {
                        let _ = reply.send_async(m.take_snapshot().await).await;
                    })
                    .detach();
                }
                NatsCmd::Stop => break,
            }
        }
        // Acknowledge what was applied before leaving.
        me.ack_applied(&client).await;
        drop(events_task);
        client.close();
    }

    /// Durable mode: (re)creates this replica's consumer right after the last message
    /// handed to the shards and feeds its deliveries to the shards in order. A delivery
    /// that skips consumer sequences (messages lost in flight: a full subscription buffer,
    /// a broker restart) re-creates the consumer after the last message applied, so that
    /// events are never applied out of order; redeliveries of applied messages are skipped.
    async fn consume_durable(&self, client: &Client) {
        let Some(d) = self.cfg.durable.clone() else {
            return;
        };
        let mut generation = 0u64;
        let mut backoff = Duration::from_millis(50);
        loop {
            generation += 1;
            let deliver = format!("_KVROUTER.{:x}.{generation}", self.cfg.router_id);
            let sub = match client.subscribe(&deliver, None) {
                Ok(s) => s,
                Err(NatsError::Closed) => return,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot subscribe the delivery subject");
                    glommio::timer::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                    continue;
                }
            };
            let after = self.dispatched_seq.get();
            let spec = ConsumerSpec {
                stream: d.stream.clone(),
                durable: d.consumer.clone(),
                deliver_subject: deliver.clone(),
                start_seq: (after > 0).then_some(after + 1),
                max_ack_pending: d.max_ack_pending,
                ack_wait: d.ack_wait,
                idle_heartbeat: Some(d.idle_heartbeat),
            };
            self.consumer_ready.set(false);
            if let Err(e) =
                jetstream::recreate_consumer(client, &spec, Duration::from_secs(5)).await
            {
                if matches!(e, jetstream::JsError::Nats(NatsError::Closed)) {
                    return;
                }
                tracing::warn!(error = %e, "cannot create the durable consumer; retrying");
                glommio::timer::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
            backoff = Duration::from_millis(50);
            self.consumer_ready.set(true);
            tracing::info!(consumer = %d.consumer, from_seq = after + 1, "durable consumer ready");
            let mut last_cseq = 0u64;
            // The server sends an idle heartbeat when it has nothing to deliver; silence
            // while connected means the consumer is gone (deleted, or lost with the broker's
            // store).
            let silence = d.idle_heartbeat * 3;
            loop {
                let next = async { Some(sub.next().await) };
                let timeout = async {
                    glommio::timer::sleep(silence).await;
                    None
                };
                let msg = match futures_lite::future::or(next, timeout).await {
                    Some(Some(m)) => m,
                    Some(None) => return, // the client closed
                    None if client.is_connected() => {
                        bump(&self.counters.js_resets, 1);
                        tracing::warn!(
                            "no deliveries nor heartbeats from the consumer: re-creating it"
                        );
                        break;
                    }
                    None => continue, // disconnected: the client reconnects
                };
                let Some(reply) = msg.reply else {
                    continue; // a status message (idle heartbeat)
                };
                let Some(dl) = jetstream::parse_ack_subject(&reply) else {
                    bump(&self.counters.decode_errors, 1);
                    tracing::warn!(%reply, "delivery without a JetStream ack subject skipped");
                    continue;
                };
                let applied = dl.stream_seq <= self.dispatched_seq.get();
                if dl.delivered == 1 && (dl.consumer_seq <= last_cseq || applied) {
                    // A first delivery can neither repeat a consumer sequence nor go back in
                    // the stream: the consumer or the stream was re-created behind our back.
                    bump(&self.counters.js_resets, 1);
                    if applied {
                        tracing::warn!(
                            stream_seq = dl.stream_seq,
                            applied = self.dispatched_seq.get(),
                            "the stream's numbering went back (re-created?): replaying it from the start"
                        );
                        self.dispatched_seq.set(0);
                    } else {
                        tracing::warn!(
                            "the consumer was re-created by someone else (two replicas with one consumer name?)"
                        );
                    }
                    break;
                }
                if dl.consumer_seq <= last_cseq || applied {
                    bump(&self.counters.js_redelivered, 1);
                    last_cseq = last_cseq.max(dl.consumer_seq);
                    continue;
                }
                if dl.consumer_seq > last_cseq + 1 {
                    bump(&self.counters.js_resets, 1);
                    tracing::warn!(
                        expected = last_cseq + 1,
                        got = dl.consumer_seq,
                        "deliveries lost in flight: re-creating the consumer after the last applied message"
                    );
                    break;
                }
                last_cseq = dl.consumer_seq;
                self.on_events(&msg.payload).await;
                self.dispatched_seq.set(dl.stream_seq);
                *self.ack_reply.borrow_mut() = Some(reply);
            }
        }
    }

    /// Durable mode: once every shard has applied what was handed to it, acknowledges the
    /// last message (acknowledgement policy `all` covers every earlier one).
    async fn ack_applied(&self, client: &Client) {
        let Some(reply) = self.ack_reply.borrow_mut().take() else {
            return;
        };
        let (tx, rx) = flume::bounded(self.shards.len());
        for s in &self.shards {
            let _ = s.send_async(ShardCmd::Barrier { reply: tx.clone() }).await;
        }
        drop(tx);
        while rx.recv_async().await.is_ok() {}
        if client.publish(&reply, b"+ACK").await.is_ok() {
            bump(&self.counters.js_acks, 1);
        }
    }

    /// Dumps every shard (each cut between two events, in its own order, so the union covers
    /// at least every message handed to the shards before `covered` was read — possibly a
    /// few more, whose replay is then recognised by event id), then encodes and writes the
    /// file on a plain thread so that this executor keeps ingesting. A request made while
    /// another snapshot is being written waits for it, then takes its own.
    async fn take_snapshot(&self) -> Result<SnapshotInfo, String> {
        let store = self
            .store
            .clone()
            .ok_or("snapshots are off (no directory)")?;
        while self.snapshot_busy.replace(true) {
            glommio::timer::sleep(Duration::from_millis(5)).await;
        }
        let result = self.write_snapshot(store).await;
        self.snapshot_busy.set(false);
        match &result {
            Ok(info) => {
                bump(&self.counters.snapshots, 1);
                tracing::info!(path = %info.path.display(), bytes = info.bytes, blocks = info.blocks, stream_seq = ?info.stream_seq, "snapshot written");
            }
            Err(e) => {
                bump(&self.counters.snapshot_failures, 1);
                tracing::error!(error = %e, "snapshot failed; the previous one is kept");
            }
        }
        result
    }

    async fn write_snapshot(&self, store: SnapshotStore) -> Result<SnapshotInfo, String> {
        let covered = self.dispatched_seq.get();
        let (tx, rx) = flume::bounded(self.shards.len());
        for s in &self.shards {
            s.send_async(ShardCmd::Snapshot { reply: tx.clone() })
                .await
                .map_err(|_| "a shard core has stopped".to_owned())?;
        }
        drop(tx);
        let mut workers = Vec::new();
        let mut events = Vec::new();
        for _ in 0..self.shards.len() {
            let part = rx
                .recv_async()
                .await
                .map_err(|_| "a shard core has stopped".to_owned())?;
            workers.extend(part.workers);
            events.extend(part.events);
        }
        let meta = SnapshotMeta {
            created_unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            router_id: self.cfg.router_id,
            stream: self.cfg.durable.as_ref().map(|d| StreamPosition {
                stream: d.stream.clone(),
                seq: covered,
            }),
            blocks: 0,
        };
        let stream_seq = meta.stream.as_ref().map(|p| p.seq);
        let (done_tx, done_rx) = flume::bounded(1);
        std::thread::Builder::new()
            .name("kvrouter-snapshot".into())
            .spawn(move || {
                let r = kvrouter_core::snapshot::encode(&meta, &workers, &events)
                    .map_err(|e| e.to_string())
                    .and_then(|bytes| {
                        let blocks = events.iter().map(|e| e.block_count() as u64).sum();
                        store
                            .write(&bytes)
                            .map(|path| SnapshotInfo {
                                path,
                                bytes: bytes.len(),
                                blocks,
                                workers: workers.len(),
                                stream_seq,
                            })
                            .map_err(|e| e.to_string())
                    });
                let _ = done_tx.send(r);
            })
            .map_err(|e| e.to_string())?;
        done_rx
            .recv_async()
            .await
            .map_err(|_| "the snapshot thread died".to_owned())?
    }

    fn seen(&self, worker_id: WorkerId, heartbeat: Option<Duration>) {
        let mut w = self.workers.borrow_mut();
        let entry = w.entry(worker_id).or_insert(Liveness {
            last_seen: Instant::now(),
            heartbeat,
        });
        entry.last_seen = Instant::now();
        if heartbeat.is_some() {
            entry.heartbeat = heartbeat;
        }
    }

    async fn on_events(&self, payload: &[u8]) {
        let arrived = Instant::now();
        bump(&self.counters.messages, 1);
        let (publisher, events) = match kv::decode_message(payload) {
            Ok((env, events)) => (env.publisher_id, events),
            Err(e) => {
                bump(&self.counters.decode_errors, 1);
                tracing::warn!(error = %e, kind = e.kind(), "undecodable kv-events message skipped");
                return;
            }
        };
        let mut per_shard: Vec<Vec<RouterEvent>> = vec![Vec::new(); self.shards.len()];
        for e in events {
            self.seen(e.worker_id, None);
            per_shard[self.shard_of(e.worker_id)].push(e);
        }
        for (i, events) in per_shard.into_iter().enumerate() {
            if !events.is_empty() {
                let _ = self.shards[i]
                    .send_async(ShardCmd::Events {
                        events,
                        publisher,
                        arrived,
                    })
                    .await;
            }
        }
    }

    async fn on_announcement(&self, a: Announcement) {
        let shard = self.shard_of(a.worker_id);
        if a.leaving {
            self.workers.borrow_mut().remove(&a.worker_id);
            let _ = self.shards[shard]
                .send_async(ShardCmd::Remove {
                    worker_id: a.worker_id,
                })
                .await;
            return;
        }
        let known = self
            .workers
            .borrow()
            .get(&a.worker_id)
            .is_some_and(|l| l.heartbeat.is_some());
        self.seen(
            a.worker_id,
            Some(Duration::from_millis(a.heartbeat_ms.max(1))),
        );
        if !known {
            tracing::info!(
                worker_id = a.worker_id,
                "worker announced: loading its state"
            );
            let _ = self.shards[shard]
                .send_async(ShardCmd::Announced {
                    worker_id: a.worker_id,
                    heartbeat_ms: a.heartbeat_ms.max(1),
                })
                .await;
        } else if !a.last_event_ids.is_empty() {
            let cmd = ShardCmd::Heartbeat {
                worker_id: a.worker_id,
                last_event_ids: a.last_event_ids,
            };
            let _ = self.shards[shard].send_async(cmd).await;
        }
    }

    async fn reap(&self) {
        let now = Instant::now();
        let dead: Vec<WorkerId> = self
            .workers
            .borrow()
            .iter()
            .filter(|(_, l)| {
                let limit = l
                    .heartbeat
                    .map_or(self.cfg.silence_timeout, |h| h * self.cfg.heartbeat_misses);
                now.duration_since(l.last_seen) > limit
            })
            .map(|(&w, _)| w)
            .collect();
        for w in dead {
            tracing::info!(worker_id = w, "worker silent: removing it");
            self.workers.borrow_mut().remove(&w);
            let _ = self.shards[self.shard_of(w)]
                .send_async(ShardCmd::Remove { worker_id: w })
                .await;
        }
    }

    async fn recover(
        &self,
        client: &Client,
        worker_id: WorkerId,
        dp_rank: Option<DpRank>,
        range: Option<(u64, u64)>,
    ) -> Recovered {
        let subject = crate::worker::recovery_subject(&self.cfg.subjects, worker_id);
        let req = RecoveryRequest {
            worker_id,
            dp_rank,
            range,
        };
        let body = match req.encode() {
            Ok(b) => b,
            Err(e) => return Recovered::Failed(e.to_string()),
        };
        let stream = match client.request_stream(&subject, &body).await {
            Ok(s) => s,
            Err(e) => return Recovered::Failed(e.to_string()),
        };
        let mut dump_events = Vec::new();
        loop {
            let msg = match stream.next(self.cfg.recovery_timeout).await {
                Ok(m) => m,
                Err(e) => return Recovered::Failed(e.to_string()),
            };
            match RecoveryReply::decode(&msg.payload) {
                Ok(RecoveryReply::Range {
                    publisher_id,
                    events,
                }) => {
                    return Recovered::Range {
                        publisher: publisher_id,
                        events,
                    };
                }
                Ok(RecoveryReply::Dump {
                    publisher_id,
                    last_chunk,
                    last_event_ids,
                    events,
                    ..
                }) => {
                    dump_events.extend(events);
                    if last_chunk {
                        return Recovered::Dump {
                            publisher: publisher_id,
                            events: dump_events,
                            last_event_ids,
                        };
                    }
                }
                Err(e) => {
                    bump(&self.counters.decode_errors, 1);
                    return Recovered::Failed(e.to_string());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use kvrouter_core::event::KvCacheEvent;
    use kvrouter_core::hash::{LocalBlockHash, SequenceBlockHash};

    use super::*;

    fn core() -> ShardCore {
        let (mut writers, _) = TreeIndex::new(1).into_parts();
        ShardCore {
            index: 0,
            writer: writers.remove(0),
            ids: EventIds::new(),
            announced: HashMap::new(),
            recovering: HashMap::new(),
            counters: Arc::new(IngestCounters::default()),
            nats: flume::unbounded().0,
            summaries: Arc::new(Mutex::new(HashMap::new())),
            members: Arc::new(AtomicU64::new(0)),
            latencies: None,
            deferred: VecDeque::new(),
        }
    }

    /// Event `id` of `worker` storing one block named `name`.
    fn stored(worker: WorkerId, id: u64, name: u64) -> RouterEvent {
        RouterEvent::new(
            worker,
            KvCacheEvent::stored(
                id,
                0,
                None,
                [(LocalBlockHash(name), SequenceBlockHash(name))],
            ),
        )
    }

    fn events(events: Vec<RouterEvent>, publisher: u64) -> ShardCmd {
        ShardCmd::Events {
            events,
            publisher,
            arrived: Instant::now(),
        }
    }

    fn workers_of(part: &ShardPart) -> Vec<(WorkerId, Option<u64>)> {
        part.workers
            .iter()
            .map(|r| (r.worker.worker_id, r.last_event_id))
            .collect()
    }

    #[test]
    fn a_snapshot_applies_arrivals_between_workers_and_records_each_with_its_dump() {
        let mut c = core();
        for w in [1, 2] {
            c.handle(stored(w, 0, 10 * w), 100);
        }
        let (tx, rx) = flume::unbounded();
        // Arrives while worker 1 is dumped: applied before worker 2's dump, which holds it.
        tx.send(events(vec![stored(2, 1, 21)], 100)).unwrap();
        let part = c.snapshot_part(&rx);
        assert_eq!(workers_of(&part), vec![(1, Some(0)), (2, Some(1))]);
        let blocks: usize = part.events.iter().map(|e| e.block_count()).sum();
        assert_eq!(blocks, 3);
        assert!(rx.is_empty() && c.deferred.is_empty());
    }

    #[test]
    fn a_worker_renumbered_during_the_dump_is_left_out() {
        let mut c = core();
        for w in [1, 2] {
            for id in 0..5 {
                c.handle(stored(w, id, 10 * w + id), 100);
            }
        }
        let (tx, rx) = flume::unbounded();
        // Worker 2 restarts (a new publisher numbering from 0) while worker 1 is dumped.
        tx.send(events(vec![stored(2, 0, 99)], 200)).unwrap();
        let part = c.snapshot_part(&rx);
        assert_eq!(workers_of(&part), vec![(1, Some(4))]);
        assert!(part.events.iter().all(|e| e.worker_id == 1));
        assert_eq!(
            c.counters.snapshot_skipped_workers.load(Ordering::Relaxed),
            1
        );
        assert_eq!(c.counters.restarts.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_stop_during_the_dump_waits_with_everything_after_it() {
        let mut c = core();
        for w in [1, 2] {
            c.handle(stored(w, 0, 10 * w), 100);
        }
        let (tx, rx) = flume::unbounded();
        tx.send(ShardCmd::Stop).unwrap();
        tx.send(events(vec![stored(2, 1, 21)], 100)).unwrap();
        let part = c.snapshot_part(&rx);
        // The event after the stop was not applied: worker 2 is dumped as it was.
        assert_eq!(workers_of(&part), vec![(1, Some(0)), (2, Some(0))]);
        assert_eq!(c.deferred.len(), 2);
        assert!(matches!(c.deferred.pop_front(), Some(ShardCmd::Stop)));
        assert!(matches!(
            c.deferred.pop_front(),
            Some(ShardCmd::Events { .. })
        ));
    }
}
