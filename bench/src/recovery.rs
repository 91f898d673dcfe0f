//! Restart recovery: how long a `kvrouter serve` process takes from its start to serving,
//! when it restores a snapshot of `blocks` cached blocks.
//!
//! The state is synthetic but shaped like a fleet's: every worker holds chains of 64 blocks
//! under a shared 4-block system prompt. The snapshot is written with the router's own
//! writer ([`SnapshotStore`]); the process is started with `--snapshot-dir`, and the clock
//! stops when `/healthz` answers 200 and `/v1/workers` reports every block.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::bail;
use kvrouter_core::event::{KvCacheEvent, RouterEvent};
use kvrouter_core::hash::{LocalBlockHash, SequenceBlockHash};
use kvrouter_core::index::{Index, TreeIndex};
use kvrouter_core::snapshot::{SnapshotMeta, WorkerRecord, encode};
use kvrouter_core::worker::WorkerDp;
use kvrouter_io::snapshot::{MappedSnapshot, SnapshotStore};
use serde::Serialize;

use crate::route::{request, serve};

/// What one recovery measurement found.
#[derive(Debug, Clone, Serialize)]
pub struct RecoveryReport {
    /// Cached blocks in the snapshot.
    pub blocks: u64,
    /// (worker, dp rank)s.
    pub workers: usize,
    /// Snapshot file size.
    pub snapshot_bytes: usize,
    /// Encoding and writing the snapshot (fsync, rename), ms.
    pub write_ms: f64,
    /// In process: map, validate and rebuild the index, ms.
    pub restore_ms: f64,
    /// In process: one shard writer dumping the whole restored state, ms.
    pub dump_ms: f64,
    /// In process: the longest of the per-worker dumps that the same state takes a worker
    /// at a time, as a shard core does for a snapshot (its longest pause in applying
    /// events), ms.
    pub worker_dump_max_ms: f64,
    /// A fresh `kvrouter serve` process: from spawn to serving with every block, ms.
    pub start_to_serving_ms: f64,
}

const SHARED: u64 = 4;
const CHAIN: u64 = 64;

/// The synthetic state: dump-shaped events and the worker records.
fn state(blocks: u64, workers: u64) -> (Vec<RouterEvent>, Vec<WorkerRecord>) {
    let per_worker = (blocks / workers).max(CHAIN + SHARED);
    let chains = (per_worker - SHARED) / CHAIN;
    let shared: Vec<(LocalBlockHash, SequenceBlockHash)> = (0..SHARED)
        .map(|i| (LocalBlockHash(i + 1), SequenceBlockHash(1_000 + i)))
        .collect();
    let last_shared = shared.last().map(|b| b.1);
    let mut events = Vec::new();
    let mut records = Vec::new();
    for w in 0..workers {
        let worker_id = 0x5eed_0000 + w;
        events.push(RouterEvent::new(
            worker_id,
            KvCacheEvent::stored(0, 0, None, shared.clone()),
        ));
        for c in 0..chains {
            let base = (w << 40) | (c << 12);
            let blocks = (0..CHAIN).map(|i| {
                (
                    LocalBlockHash(base + i + 0x10_0000),
                    SequenceBlockHash(base + i + 0x20_0000),
                )
            });
            events.push(RouterEvent::new(
                worker_id,
                KvCacheEvent::stored(0, 0, last_shared, blocks),
            ));
        }
        records.push(WorkerRecord {
            worker: WorkerDp::new(worker_id, 0),
            last_event_id: Some(chains),
            publisher: 1,
            announced: false,
            heartbeat_ms: 0,
        });
    }
    (events, records)
}

fn get(addr: &str, path: &str) -> Option<Vec<u8>> {
    let mut s = TcpStream::connect(addr).ok()?;
    request(&mut s, &mut Vec::new(), "GET", path, "").ok()
}

/// Writes the snapshot into `dir`, then measures `runs` in-process restores and `runs`
/// process starts of `kvrouter` (the binary at `kvrouter`) against the NATS server `nats`.
pub fn run(
    blocks: u64,
    workers: u64,
    dir: &Path,
    kvrouter: &Path,
    nats: &str,
    runs: usize,
) -> anyhow::Result<Vec<RecoveryReport>> {
    let (events, records) = state(blocks, workers);
    let started = Instant::now();
    let bytes = encode(&SnapshotMeta::default(), &records, &events)?;
    let store = SnapshotStore::new(dir);
    let path: PathBuf = store.write(&bytes)?;
    let write_ms = started.elapsed().as_secs_f64() * 1e3;
    let total: u64 = events.iter().map(|e| e.block_count() as u64).sum();
    drop(events);
    let mut out = Vec::new();
    for run in 0..runs {
        // In process.
        let t = Instant::now();
        let m = MappedSnapshot::open(&path)?;
        let view = m.view()?;
        let mut idx = TreeIndex::new(1);
        for e in view.events() {
            idx.apply(e)?;
        }
        let restore_ms = t.elapsed().as_secs_f64() * 1e3;
        if idx.block_count() as u64 != total {
            bail!("restored {} of {total} blocks", idx.block_count());
        }
        let t = Instant::now();
        let dumped = idx.dump().len();
        let dump_ms = t.elapsed().as_secs_f64() * 1e3;
        std::hint::black_box(dumped);
        let (writers, _) = idx.into_parts();
        let mut worker_dump_max_ms = 0f64;
        let mut part = Vec::new();
        for s in writers[0].workers() {
            part.clear();
            let t = Instant::now();
            writers[0].dump_worker(s.worker, &mut part);
            worker_dump_max_ms = worker_dump_max_ms.max(t.elapsed().as_secs_f64() * 1e3);
            std::hint::black_box(part.len());
        }
        drop(writers);
        // A fresh process.
        let t = Instant::now();
        let server = serve(
            kvrouter,
            nats,
            &["--snapshot-dir".as_ref(), dir.as_os_str()],
        )?;
        let addr = &server.addr;
        let serving = loop {
            let healthy =
                get(addr, "/healthz").is_some_and(|b| b.starts_with(b"{\"status\":\"ok\""));
            if healthy {
                let body = get(addr, "/v1/workers").unwrap_or_default();
                let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                let held: u64 = v["workers"]
                    .as_array()
                    .map(|a| a.iter().filter_map(|w| w["cached_blocks"].as_u64()).sum())
                    .unwrap_or(0);
                if held == total {
                    break t.elapsed();
                }
            }
            if t.elapsed().as_secs() > 60 {
                bail!("not serving after 60 s");
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        };
        drop(server);
        let r = RecoveryReport {
            blocks: total,
            workers: records.len(),
            snapshot_bytes: bytes.len(),
            write_ms,
            restore_ms,
            dump_ms,
            worker_dump_max_ms,
            start_to_serving_ms: serving.as_secs_f64() * 1e3,
        };
        eprintln!("run {}: {}", run + 1, serde_json::to_string(&r)?);
        out.push(r);
    }
    Ok(out)
}
