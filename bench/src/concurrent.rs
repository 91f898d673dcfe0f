//! Concurrent mode: writer threads apply a log's events at full speed while reader threads
//! run its queries (cycling through them) until every event is applied. Reports sustained
//! event blocks/s, events/s, lookups/s and lookup latency percentiles.
//!
//! One pass over the shared log's events takes 0.1–0.3 s here, and with more threads than
//! cores the scheduler's placement (which thread gets a core to itself) swings a single
//! pass's lookups/s by 2×. `passes` applies the events several times over, each pass
//! after the first starting with a `Cleared` event per (worker, dp rank), so that one run
//! measures a window long enough for the placement to average out.
//!
//! For our tree, each writer thread owns one shard (`TreeIndex::into_parts`) and applies
//! the events of its workers straight from memory, as a core fed by its own subscription
//! would. For Dynamo (`crate::dynamo`), the calling thread enqueues every event into its
//! `ThreadPoolIndexer` and waits for the pool to drain.

use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvrouter_core::event::{KvCacheEvent, RouterEvent};
use kvrouter_core::hash::LocalBlockHash;
use kvrouter_core::index::OverlapScores;
use kvrouter_core::index::tree::TreeIndex;
use kvrouter_core::prefetch::prefetch_slice;
use serde::Serialize;

use crate::perf::{LoadedLog, percentile};

/// The log's events `passes` times over; each pass after the first starts with a
/// `Cleared` event for every (worker, dp rank) of the log, so it starts from an empty
/// cache.
pub fn pass_events(log: &LoadedLog, passes: usize) -> Vec<RouterEvent> {
    let passes = passes.max(1);
    let events: Vec<&RouterEvent> = log.events().collect();
    let workers: std::collections::BTreeSet<_> = events.iter().map(|e| e.worker()).collect();
    let mut out = Vec::with_capacity((events.len() + workers.len()) * passes);
    for pass in 0..passes {
        if pass > 0 {
            out.extend(
                workers
                    .iter()
                    .map(|w| RouterEvent::new(w.worker_id, KvCacheEvent::cleared(0, w.dp_rank))),
            );
        }
        out.extend(events.iter().map(|&e| e.clone()));
    }
    out
}

/// The result of one concurrent run. Field names are the JSON keys.
#[derive(Debug, Clone, Serialize)]
pub struct ConcurrentReport {
    /// Index name.
    pub index: String,
    /// Writer (event) threads.
    pub writers: usize,
    /// Reader threads.
    pub readers: usize,
    /// Events applied.
    pub events: u64,
    /// Blocks named by those events.
    pub event_blocks: u64,
    /// Time until every event was applied, seconds.
    pub elapsed_s: f64,
    /// Event blocks per second.
    pub event_blocks_per_s: f64,
    /// Events per second.
    pub events_per_s: f64,
    /// Lookups completed while writers ran.
    pub lookups: u64,
    /// Lookups per second.
    pub lookups_per_s: f64,
    /// Lookup latency, median, ns.
    pub lookup_p50_ns: u64,
    /// Lookup latency, 99th percentile, ns.
    pub lookup_p99_ns: u64,
    /// Lookup latency, 99.9th percentile, ns.
    pub lookup_p999_ns: u64,
    /// CPU time the reader threads got while the writers ran, seconds, all readers
    /// (`/proc/thread-self/stat`, 10 ms ticks). With more threads than cores the readers'
    /// share of the cores depends on how the writers run (spinning or blocking), so
    /// lookups/s compares indexes and scheduling together; this separates the two.
    pub reader_cpu_s: f64,
    /// Lookups per second of reader CPU time: the lookup's own cost, whatever share of the
    /// cores the readers got.
    pub lookups_per_reader_cpu_s: f64,
    /// CPU time of the whole process over the run, seconds (`/proc/self/stat`).
    pub process_cpu_s: f64,
}

/// CPU time (user + system) in `/proc/.../stat` form, seconds; 0 where unreadable.
fn cpu_seconds(stat_path: &str) -> f64 {
    std::fs::read_to_string(stat_path)
        .ok()
        .and_then(|s| stat_cpu_seconds(&s))
        .unwrap_or(0.0)
}

/// User + system CPU seconds of one `/proc/.../stat` line (`None` if it has no such fields).
fn stat_cpu_seconds(stat: &str) -> Option<f64> {
    // The fields after the command name, which ends at the last ')': state is field 3,
    // utime 14 and stime 15.
    let (_, rest) = stat.rsplit_once(')')?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i - 3)?.parse::<u64>().ok();
    // CLK_TCK is 100 on every Linux target we run on.
    Some((ticks(14)? + ticks(15)?) as f64 / 100.0)
}

/// Runs `readers` lookup threads over `queries` while `write` runs on the calling thread;
/// `write` returns the time it took to apply every event.
///
/// `queries` are the log's queries in the index's own type, converted before the run. A
/// reader looks up each query where it lies, and while it does, asks the cache for the
/// next query's lines (untimed, for every index alike): a router looks up block hashes it
/// has just computed from the request's tokens, so the query is in cache, as the sequential
/// replay has it too ([`crate::perf::replay`] copies each query just before its timed call).
/// Without it, every lookup would start by missing on an 18 MB arena of stored queries and
/// time the arena rather than the index; copying each query inside the loop instead made
/// the reader's loop pay that copy, as costly as our lookup, in lookups/s.
pub fn measure<Q, L>(
    index: &str,
    writers: usize,
    readers: usize,
    queries: &[Vec<Q>],
    events: &[RouterEvent],
    lookup: L,
    write: impl FnOnce(&Barrier) -> Duration,
) -> ConcurrentReport
where
    Q: Sync,
    L: Fn(&[Q], &mut OverlapScores) -> u32 + Sync,
{
    let done = AtomicBool::new(false);
    let barrier = Barrier::new(readers + 1);
    let process_before = cpu_seconds("/proc/self/stat");
    let (elapsed, samples, reader_cpu) = std::thread::scope(|s| {
        let handles: Vec<_> = (0..readers)
            .map(|r| {
                let (done, barrier, lookup) = (&done, &barrier, &lookup);
                s.spawn(move || {
                    let mut lat = Vec::with_capacity(1 << 16);
                    let mut out = OverlapScores::new();
                    let mut i = r * 997;
                    barrier.wait();
                    let cpu_before = cpu_seconds("/proc/thread-self/stat");
                    while !done.load(Ordering::Acquire) && !queries.is_empty() {
                        let query = &queries[i % queries.len()];
                        prefetch_slice(&queries[(i + 1) % queries.len()]);
                        let t = Instant::now();
                        std::hint::black_box(lookup(query, &mut out));
                        lat.push(t.elapsed().as_nanos() as u64);
                        i += 1;
                    }
                    (lat, cpu_seconds("/proc/thread-self/stat") - cpu_before)
                })
            })
            .collect();
        let elapsed = write(&barrier);
        done.store(true, Ordering::Release);
        let mut cpu = 0.0;
        let mut samples = Vec::new();
        for h in handles {
            let (lat, c) = h.join().expect("reader");
            samples.extend(lat);
            cpu += c;
        }
        (elapsed, samples, cpu)
    });
    let process_cpu = cpu_seconds("/proc/self/stat") - process_before;
    let mut samples = samples;
    samples.sort_unstable();
    let secs = elapsed.as_secs_f64().max(1e-9);
    let event_blocks: u64 = events.iter().map(|e| e.block_count() as u64).sum();
    let events = events.len() as u64;
    ConcurrentReport {
        index: index.to_owned(),
        writers,
        readers,
        events,
        event_blocks,
        elapsed_s: secs,
        event_blocks_per_s: event_blocks as f64 / secs,
        events_per_s: events as f64 / secs,
        lookups: samples.len() as u64,
        lookups_per_s: samples.len() as f64 / secs,
        lookup_p50_ns: percentile(&samples, 0.50),
        lookup_p99_ns: percentile(&samples, 0.99),
        lookup_p999_ns: percentile(&samples, 0.999),
        reader_cpu_s: reader_cpu,
        lookups_per_reader_cpu_s: if reader_cpu > 0.0 {
            samples.len() as f64 / reader_cpu
        } else {
            0.0
        },
        process_cpu_s: process_cpu,
    }
}

/// Our tree with `writers` shards, one writer thread each, `passes` passes over the events.
pub fn run_tree(
    log: &LoadedLog,
    writers: usize,
    readers: usize,
    passes: usize,
) -> ConcurrentReport {
    let writers = writers.max(1);
    let index = TreeIndex::new(writers);
    let map = index.shard_map();
    let (shards, reader) = index.into_parts();
    let events = pass_events(log, passes);
    // Routed as the ingest routes them: each worker to its shard, assigned on first sight.
    let mut lists: Vec<Vec<&RouterEvent>> = vec![Vec::new(); writers];
    for e in &events {
        lists[map.shard_of(e.worker_id)].push(e);
    }
    let queries: Vec<Vec<LocalBlockHash>> = log.queries().map(<[_]>::to_vec).collect();
    measure(
        "tree",
        writers,
        readers,
        &queries,
        &events,
        |q, out| {
            reader.find_matches_into(q, out);
            out.max_score()
        },
        |barrier| {
            let start_line = Barrier::new(writers + 1);
            std::thread::scope(|s| {
                let handles: Vec<_> = shards
                    .into_iter()
                    .zip(lists)
                    .map(|(mut w, list)| {
                        let start_line = &start_line;
                        s.spawn(move || {
                            start_line.wait();
                            for e in list {
                                let _ = w.apply_event(e);
                            }
                            (Instant::now(), w)
                        })
                    })
                    .collect();
                barrier.wait();
                start_line.wait();
                let t0 = Instant::now();
                let ends: Vec<_> = handles
                    .into_iter()
                    .map(|h| h.join().expect("writer"))
                    .collect();
                let last = ends.iter().map(|(t, _)| *t).max().unwrap_or(t0);
                last.duration_since(t0)
            })
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrouter_io::log::LogReader;

    fn sample() -> LoadedLog {
        let bytes = include_bytes!("../data/sample_w4.jsonl.zst");
        LoadedLog::from_reader(LogReader::from_bytes("sample_w4", bytes).expect("sample"))
            .expect("parse")
    }

    #[test]
    fn cpu_time_is_read_after_the_command_name() {
        // A command name may hold spaces and parentheses; utime and stime are fields 14
        // and 15, in ticks of 10 ms.
        let line = "42 (a (b) c) R 1 2 3 4 5 6 7 8 9 10 250 130 0 0 20 0 1 0";
        assert!((stat_cpu_seconds(line).unwrap() - 3.8).abs() < 1e-9);
        assert_eq!(stat_cpu_seconds("garbage"), None);
        assert_eq!(stat_cpu_seconds("1 (x) R"), None);
        // This system's own files have the fields where we read them.
        for path in ["/proc/self/stat", "/proc/thread-self/stat"] {
            let stat = std::fs::read_to_string(path).unwrap();
            assert!(stat_cpu_seconds(&stat).is_some(), "{path}: {stat}");
        }
    }

    #[test]
    fn pass_events_restarts_every_worker_from_empty() {
        let log = sample();
        let one = pass_events(&log, 1);
        let three = pass_events(&log, 3);
        let workers: std::collections::BTreeSet<_> = one.iter().map(|e| e.worker()).collect();
        assert_eq!(three.len(), 3 * one.len() + 2 * workers.len());
        let clears = three
            .iter()
            .filter(|e| matches!(e.event.data, kvrouter_core::event::KvEventData::Cleared))
            .count();
        assert_eq!(clears, 2 * workers.len());
    }

    #[test]
    fn the_tree_applies_every_event_while_readers_look_up() {
        let log = sample();
        let r = run_tree(&log, 2, 1, 2);
        let events = pass_events(&log, 2);
        assert_eq!(r.events, events.len() as u64);
        let blocks: u64 = events.iter().map(|e| e.block_count() as u64).sum();
        assert_eq!(r.event_blocks, blocks);
        assert!(r.elapsed_s > 0.0 && r.event_blocks_per_s > 0.0);
        assert!(r.lookup_p50_ns <= r.lookup_p99_ns && r.lookup_p99_ns <= r.lookup_p999_ns);
    }
}
