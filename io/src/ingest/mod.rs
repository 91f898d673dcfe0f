//! KV-event ingest: event planes → decode → the core that owns the worker → the lock-free
//! index.
//!
//! # Threads
//!
//! Thread per core, on glommio executors (placement configurable, io memory sized
//! explicitly because the memlock limit is small):
//!
//! * the **source core** runs every event source as tasks of one executor. Today that is
//!   the NATS source ([`nats_source`]): the [`crate::nats::Client`], subscriptions to the
//!   kv-events, metrics and discovery subjects, decoding (bad messages are counted, logged
//!   and skipped), worker liveness, recovery requests, and in durable mode the JetStream
//!   consumer ([`durable`]). Sources hand each worker's events to the shard that owns the
//!   worker through one seam ([`source`]: [`source::Shards`] and [`source::Workers`]), in
//!   arrival order, over bounded flume channels; another event plane is another source
//!   beside this one;
//! * each **shard core** ([`shard`]) owns one
//!   [`ShardWriter`](kvrouter_core::index::tree::ShardWriter) and the event-id bookkeeping
//!   of its workers ([`EventIds`](kvrouter_core::recovery::EventIds)): it applies events as they arrive, never
//!   waiting for more.
//!
//! The cores talk only through the commands of [`messages`]. Lookups go through a
//! [`TreeReader`] from any thread; counters and worker summaries are each core's own,
//! gathered on scrape ([`counters`]).
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
//! never announced is removed after `silence_timeout` without messages. A removed worker
//! leaves the index's summaries, and so routing (the routing API drops what the ingest no
//! longer lists).
//!
//! # Snapshots
//!
//! [`snapshots`]: restored into the writers before any core starts; written on demand,
//! periodically and on stop, each shard cut between two of its events.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use glommio::{LocalExecutorBuilder, Placement};
use kvrouter_core::index::WorkerSummary;
use kvrouter_core::index::tree::{ShardMap, TreeIndex, TreeReader};
use kvrouter_core::worker::{WorkerDp, WorkerId};

use crate::nats::NatsError;
use crate::nats::jetstream::JsError;
use crate::snapshot::SnapshotStore;

mod config;
mod counters;
mod durable;
mod dynamo_plane;
mod etcd;
mod hub;
mod messages;
mod nats_source;
mod shard;
mod snapshots;
mod source;
mod zmq_source;

pub use config::{
    DurableConfig, DynamoDiscovery, IngestConfig, SnapshotConfig, ZmqEngine, ZmqOptions,
};
pub use counters::IngestStats;
pub use snapshots::{SnapshotError, SnapshotInfo};

use counters::{AllCounters, SharedSummaries, Summaries};
use hub::Hub;
use messages::{ShardCmd, SourceCmd};
use shard::ShardCore;
use snapshots::{Restored, Snapshotter, restore};
use source::{Shards, Workers};

/// Why the ingest could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IngestError {
    /// NATS failed (connecting, subscribing).
    #[error("nats")]
    Nats(
        #[from]
        #[source]
        NatsError,
    ),
    /// The durable mode's stream could not be bound.
    #[error("jetstream")]
    JetStream(#[source] JsError),
    /// An executor could not start (io_uring, memlock).
    #[error("an ingest executor could not start")]
    Executor(#[source] std::io::Error),
    /// The source core stopped before it said whether it started.
    #[error("the source core stopped while starting")]
    Stopped,
}

/// A running ingest. Dropping it stops the executors.
pub struct Ingest {
    /// Lookups, readiness, counters and summaries: what the ingest shares with readers.
    view: IngestView,
    shard_tx: Vec<flume::Sender<ShardCmd>>,
    /// Which shard owns each worker.
    map: Arc<ShardMap>,
    source_tx: flume::Sender<SourceCmd>,
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
    counters: Arc<AllCounters>,
    ready: Arc<AtomicBool>,
    summaries: Vec<SharedSummaries>,
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
            counters: AllCounters::new(0),
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

    /// Counters: the sum of every core's last publication.
    pub fn stats(&self) -> IngestStats {
        self.counters.sum()
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
                let m = s.lock().unwrap_or_else(PoisonError::into_inner);
                m.values().copied().collect::<Vec<_>>()
            })
            .collect();
        v.sort_by_key(|s| s.worker);
        v
    }

    /// The last applied event id of one (worker, dp rank).
    pub fn last_event_id(&self, worker: WorkerDp) -> Option<u64> {
        // One shard has the worker; there are a handful.
        self.summaries.iter().find_map(|s| {
            let m = s.lock().unwrap_or_else(PoisonError::into_inner);
            m.get(&worker).map(|s| s.last_event_id)
        })?
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
        // Core 0 is the source core, core `i + 1` shard `i`.
        let counters = AllCounters::new(shards + 1);
        let store = cfg.snapshot.as_ref().map(|s| SnapshotStore::new(&s.dir));
        let mut restore_stats = IngestStats::default();
        let restored = match &store {
            Some(store) => restore(store, &cfg, &mut writers, &map, &mut restore_stats),
            None => Restored::empty(shards),
        };
        let ready = Arc::new(AtomicBool::new(false));
        let latencies = Arc::new(Mutex::new(Vec::new()));
        let (source_tx, source_rx) = flume::unbounded::<SourceCmd>();
        let (shard_tx, shard_rx): (Vec<_>, Vec<_>) = (0..shards)
            .map(|_| flume::bounded::<ShardCmd>(4096))
            .unzip();
        let mut threads = Vec::new();
        let mut summaries = Vec::new();
        let members = Arc::new(AtomicU64::new(0));
        let Restored {
            ids: mut ids_of,
            announced: mut announced_of,
            liveness,
            stream_seq,
        } = restored;
        for (i, (writer, rx)) in writers.into_iter().zip(shard_rx).enumerate() {
            let shared: SharedSummaries = Arc::default();
            summaries.push(Arc::clone(&shared));
            let mut shard = ShardCore {
                index: i,
                writer,
                ids: std::mem::take(&mut ids_of[i]),
                announced: std::mem::take(&mut announced_of[i]),
                recovering: HashMap::new(),
                registered: HashSet::new(),
                // The restore's counts go with shard 0 (the source core publishes its own).
                stats: if i == 0 {
                    restore_stats
                } else {
                    IngestStats::default()
                },
                counters: Arc::clone(&counters),
                source: source_tx.clone(),
                summaries: Summaries::new(shared, Arc::clone(&members)),
                map: Arc::clone(&map),
                latencies: cfg.record_latency.then(|| Arc::clone(&latencies)),
                deferred: VecDeque::new(),
                since_publish: 0,
            };
            shard.summarize_all();
            let h = builder(&cfg, i + 1, &format!("kvrouter-shard-{i}"))
                .spawn(move || async move { shard.run(rx).await })
                .map_err(|e| IngestError::Executor(e.into()))?;
            threads.push(h);
        }
        let (started_tx, started_rx) = std::sync::mpsc::channel::<Result<(), IngestError>>();
        let source = Hub::new(
            cfg.clone(),
            Shards::new(shard_tx.clone(), Arc::clone(&map)),
            Workers::new(liveness, cfg.silence_timeout, cfg.heartbeat_misses),
            Arc::clone(&counters),
            Arc::clone(&ready),
            Snapshotter::new(store, &cfg),
            stream_seq,
        );
        let h = builder(&cfg, 0, "kvrouter-source")
            .spawn(move || async move { source.run(source_rx, started_tx).await })
            .map_err(|e| IngestError::Executor(e.into()))?;
        threads.push(h);
        // The source core's handle is last: `shutdown` joins it first.
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
            source_tx,
            latencies,
            threads,
            snapshot_on_stop: cfg.snapshot.as_ref().is_some_and(|s| s.on_stop),
        };
        match started_rx.recv() {
            Ok(Ok(())) => Ok(ingest),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(IngestError::Stopped),
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
        // `shard_of`, not `get`: a worker whose first events the source core is routing now
        // gets one shard either way, so its removal queues behind them.
        let shard = self.map.shard_of(worker_id);
        let _ = self.shard_tx[shard].send(ShardCmd::Remove { worker_id });
    }

    /// Writes a snapshot now (blocking until it is on disk). Lookups are never blocked; each
    /// shard core pauses applying events while it dumps one worker's state, and catches up
    /// between workers.
    pub fn snapshot_now(&self) -> Result<SnapshotInfo, SnapshotError> {
        let (tx, rx) = flume::bounded(1);
        self.source_tx
            .send(SourceCmd::Snapshot { reply: tx })
            .map_err(|_| SnapshotError::Stopped)?;
        rx.recv().map_err(|_| SnapshotError::Stopped)?
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
                Err(e) => tracing::error!(error = %crate::Chain(&e), "no snapshot on stop"),
            }
        }
        // The source core stops first: on its way out it acknowledges through the shards,
        // which must still be running. The shards stop once it is gone.
        let _ = self.source_tx.send(SourceCmd::Stop);
        if let Some(source) = self.threads.pop() {
            let _ = source.join();
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
