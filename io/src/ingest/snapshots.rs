//! Snapshots: restored into the writers at start, before any core runs; written on
//! demand, periodically and on stop, cut by each shard core between two of its events and
//! encoded and written on a plain thread so that no core stalls on the disk.

use std::cell::Cell;
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvrouter_core::index::tree::{ShardMap, ShardWriter};
use kvrouter_core::recovery::EventIds;
use kvrouter_core::snapshot::{SnapshotMeta, SnapshotView, StreamPosition};
use kvrouter_core::worker::WorkerId;

use super::config::IngestConfig;
use super::counters::IngestStats;
use super::source::{Liveness, Shards};
use crate::Chain;
use crate::snapshot::{SnapshotIoError, SnapshotStore};

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

/// What a snapshot restored, per shard.
pub(super) struct Restored {
    pub(super) ids: Vec<EventIds>,
    pub(super) announced: Vec<HashMap<WorkerId, u64>>,
    pub(super) liveness: HashMap<WorkerId, Liveness>,
    /// The JetStream sequence the restored state covers (0: none).
    pub(super) stream_seq: u64,
}

impl Restored {
    pub(super) fn empty(shards: usize) -> Self {
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
pub(super) fn restore(
    store: &SnapshotStore,
    cfg: &IngestConfig,
    writers: &mut [ShardWriter],
    map: &ShardMap,
    stats: &mut IngestStats,
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
            stats.snapshot_load_failures += 1;
            tracing::error!(error = %Chain(&e), "snapshot unreadable: starting empty, full resync");
            return out;
        }
    };
    let view: SnapshotView<'_> = match mapped.view() {
        Ok(v) => v,
        Err(e) => {
            stats.snapshot_load_failures += 1;
            tracing::error!(error = %Chain(&e), kind = e.kind(), "snapshot rejected: starting empty, full resync");
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
    let mut lower_blocks = 0u64;
    for r in view.lower() {
        let w = map.shard_of(r.worker.worker_id);
        if writers[w].restore_lower(&r) {
            lower_blocks += 1;
        }
    }
    for r in view.pool() {
        let w = map.shard_of(r.source.worker_id);
        if writers[w].restore_pool(&r) {
            lower_blocks += 1;
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
    stats.snapshot_restored_blocks += blocks + lower_blocks;
    tracing::info!(
        path = %mapped.path().display(),
        blocks,
        lower_blocks,
        workers = view.workers().len(),
        stream_seq = out.stream_seq,
        ms = started.elapsed().as_millis() as u64,
        "snapshot restored"
    );
    out
}

/// Why a snapshot was not written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SnapshotError {
    /// Snapshots are off (no directory configured).
    #[error("snapshots are off (no directory)")]
    Off,
    /// The ingest (or one of its cores) has stopped.
    #[error("the ingest has stopped")]
    Stopped,
    /// The state could not be encoded.
    #[error("cannot encode the snapshot")]
    Encode(#[source] kvrouter_core::snapshot::SnapshotError),
    /// The file could not be written (the previous one is kept).
    #[error("cannot write the snapshot")]
    Write(#[source] SnapshotIoError),
    /// The writing thread could not start, or died.
    #[error("the snapshot thread failed")]
    Thread(#[source] Option<std::io::Error>),
}

/// Writes snapshots for the source core: one at a time.
#[derive(Debug)]
pub(super) struct Snapshotter {
    store: Option<SnapshotStore>,
    busy: Cell<bool>,
    router_id: u64,
    /// Durable mode: the stream whose position the snapshot records.
    stream: Option<String>,
}

impl Snapshotter {
    pub(super) fn new(store: Option<SnapshotStore>, cfg: &IngestConfig) -> Self {
        Self {
            store,
            busy: Cell::new(false),
            router_id: cfg.router_id,
            stream: cfg.durable.as_ref().map(|d| d.stream.clone()),
        }
    }

    /// Dumps every shard (each cut between two events, in its own order, so the union
    /// covers at least every message handed to the shards before `covered` was read —
    /// possibly a few more, whose replay is then recognised by event id), then encodes and
    /// writes the file on a plain thread so that this executor keeps ingesting. A request
    /// made while another snapshot is being written waits for it, then takes its own.
    pub(super) async fn take(
        &self,
        shards: &Shards,
        covered: u64,
    ) -> Result<SnapshotInfo, SnapshotError> {
        let store = self.store.clone().ok_or(SnapshotError::Off)?;
        while self.busy.replace(true) {
            glommio::timer::sleep(Duration::from_millis(5)).await;
        }
        let result = self.write(store, shards, covered).await;
        self.busy.set(false);
        match &result {
            Ok(info) => {
                tracing::info!(path = %info.path.display(), bytes = info.bytes, blocks = info.blocks, stream_seq = ?info.stream_seq, "snapshot written");
            }
            Err(e) => {
                tracing::error!(error = %Chain(e), "snapshot failed; the previous one is kept");
            }
        }
        result
    }

    async fn write(
        &self,
        store: SnapshotStore,
        shards: &Shards,
        covered: u64,
    ) -> Result<SnapshotInfo, SnapshotError> {
        let mut workers = Vec::new();
        let mut events = Vec::new();
        let mut lower = Vec::new();
        let mut pool = Vec::new();
        for part in shards
            .snapshot()
            .await
            .map_err(|_| SnapshotError::Stopped)?
        {
            workers.extend(part.workers);
            events.extend(part.events);
            lower.extend(part.lower);
            pool.extend(part.pool);
        }
        let meta = SnapshotMeta {
            created_unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            router_id: self.router_id,
            stream: self.stream.as_ref().map(|stream| StreamPosition {
                stream: stream.clone(),
                seq: covered,
            }),
            blocks: 0,
        };
        let stream_seq = meta.stream.as_ref().map(|p| p.seq);
        let (done_tx, done_rx) = flume::bounded(1);
        std::thread::Builder::new()
            .name("kvrouter-snapshot".into())
            .spawn(move || {
                let r = kvrouter_core::snapshot::encode_with_tiers(
                    &meta, &workers, &events, &lower, &pool,
                )
                .map_err(SnapshotError::Encode)
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
                        .map_err(SnapshotError::Write)
                });
                let _ = done_tx.send(r);
            })
            .map_err(|e| SnapshotError::Thread(Some(e)))?;
        done_rx
            .recv_async()
            .await
            .map_err(|_| SnapshotError::Thread(None))?
    }
}
