//! The same replays through NVIDIA Dynamo's own indexers (`dynamo-kv-router` 1.6.1):
//! `RadixTree` (single-threaded) and `ThreadPoolIndexer<ConcurrentRadixTreeCompressed>`.
//! Events are converted to Dynamo's types before timing (through their MessagePack form,
//! which `tests/tests/codec_dynamo.rs` proves identical); each event and query is cloned outside
//! the timed region because Dynamo's API takes them by value.

use std::sync::Barrier;
use std::time::{Duration, Instant};

use dynamo_kv_router::ConcurrentRadixTreeCompressed;
use dynamo_kv_router::RadixTree;
use dynamo_kv_router::indexer::SyncIndexer;
use dynamo_kv_router::indexer::ThreadPoolIndexer;
use dynamo_kv_router::protocols as dy;
use kvrouter_core::event::RouterEvent;
use kvrouter_core::index::OverlapScores;

use crate::concurrent::{ConcurrentReport, measure};
use crate::perf::{LoadedLog, PerfOp, PerfReport, Stopwatch};

enum DynOp {
    Event(dy::RouterEvent),
    Match(Vec<dy::LocalBlockHash>),
}

fn convert(e: &RouterEvent) -> dy::RouterEvent {
    let bytes = rmp_serde::to_vec_named(e).expect("encodable");
    rmp_serde::from_slice(&bytes).expect("Dynamo decodes our events")
}

fn prepare(log: &LoadedLog) -> Vec<DynOp> {
    log.ops
        .iter()
        .map(|op| match op {
            PerfOp::Event(e) => DynOp::Event(convert(e)),
            PerfOp::Match(q) => DynOp::Match(q.iter().map(|l| dy::LocalBlockHash(l.0)).collect()),
        })
        .collect()
}

fn best(scores: &dy::OverlapScores) -> u32 {
    scores.scores.values().copied().max().unwrap_or(0)
}

/// Dynamo's `RadixTree`, sequentially.
pub fn replay_radix_tree(log: &LoadedLog) -> PerfReport {
    let ops = prepare(log);
    let mut tree = RadixTree::new();
    let mut sw = Stopwatch::start(log.matches());
    for op in &ops {
        match op {
            DynOp::Event(e) => {
                let e = e.clone();
                sw.event(|| {
                    let _ = tree.apply_event(e);
                });
            }
            DynOp::Match(q) => {
                let q = q.clone();
                sw.query(|| best(&tree.find_matches(q, false)));
            }
        }
    }
    let cached = tree.current_size() as u64;
    sw.finish("dynamo-radix-tree", log, cached, None)
}

fn thread_pool(threads: usize) -> ThreadPoolIndexer<ConcurrentRadixTreeCompressed> {
    ThreadPoolIndexer::new(ConcurrentRadixTreeCompressed::new(), threads.max(1), 64)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// Dynamo's `ThreadPoolIndexer<ConcurrentRadixTreeCompressed>` with `threads` event
/// threads, sequentially: events are enqueued, and before each query the pool is flushed
/// (the wait is timed).
pub fn replay_thread_pool(log: &LoadedLog, threads: usize) -> PerfReport {
    let rt = runtime();
    let ops = prepare(log);
    let pool = thread_pool(threads);
    let mut sw = Stopwatch::start(log.matches());
    let mut query = Vec::new();
    let mut pending = false;
    for op in &ops {
        match op {
            DynOp::Event(e) => {
                let e = e.clone();
                sw.event(|| {
                    let _ = pool.enqueue_event(e);
                });
                pending = true;
            }
            DynOp::Match(q) => {
                if pending {
                    let t = Instant::now();
                    rt.block_on(pool.flush_and_wait()).expect("flush");
                    sw.add(t.elapsed());
                    pending = false;
                }
                // Copied outside the timed region, like every index's query (perf::replay).
                query.clone_from(q);
                sw.query(|| best(&pool.backend().find_matches(&query, false)));
            }
        }
    }
    rt.block_on(pool.flush_and_wait()).expect("flush");
    let cached = log.net_blocks();
    sw.finish(&format!("dynamo-crtc-{threads}t"), log, cached, None)
}

/// Dynamo's thread pool in concurrent mode: the calling thread enqueues every event while
/// readers look up on the shared tree; timed until the pool has applied everything.
pub fn concurrent_thread_pool(
    log: &LoadedLog,
    threads: usize,
    readers: usize,
    passes: usize,
) -> ConcurrentReport {
    let rt = runtime();
    let ours = crate::concurrent::pass_events(log, passes);
    let events: Vec<dy::RouterEvent> = ours.iter().map(convert).collect();
    let pool = thread_pool(threads);
    let backend = pool.backend_arc();
    // Converted before the run, as ours are copied before it (concurrent::measure).
    let queries: Vec<Vec<dy::LocalBlockHash>> = log
        .queries()
        .map(|q| q.iter().map(|l| dy::LocalBlockHash(l.0)).collect())
        .collect();
    measure(
        "dynamo-crtc",
        threads,
        readers,
        &queries,
        &ours,
        |q: &[dy::LocalBlockHash], _out: &mut OverlapScores| best(&backend.find_matches(q, false)),
        |barrier: &Barrier| -> Duration {
            barrier.wait();
            let t0 = Instant::now();
            for e in events {
                let _ = pool.enqueue_event(e);
            }
            rt.block_on(pool.flush_and_wait()).expect("flush");
            t0.elapsed()
        },
    )
}
