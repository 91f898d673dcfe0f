//! Timed replays of a replay log: the whole log is parsed into memory first, then the
//! operations are replayed through an index with only the replay timed.
//!
//! Reported (see [`PerfReport`]): total ops/s, block ops/s (blocks stored + removed + looked
//! up), find_matches latency percentiles, peak RSS and bytes per cached block (RSS growth
//! over the replay divided by the blocks cached at the end). RSS figures are per process:
//! compare indexes in separate processes (`kvrouter-bench compare` does).

use std::path::Path;
use std::time::{Duration, Instant};

use kvrouter_core::event::RouterEvent;
use kvrouter_core::hash::LocalBlockHash;
use kvrouter_core::index::{Index, OverlapScores};
use kvrouter_core::replay::{ReplayHeader, ReplayOp};
use kvrouter_io::log::{LogError, LogReader};
use serde::Serialize;

/// One operation, ready to replay.
#[derive(Debug, Clone)]
pub enum PerfOp {
    /// An event to apply.
    Event(RouterEvent),
    /// A query to answer.
    Match(Vec<LocalBlockHash>),
}

/// A whole log in memory.
#[derive(Debug)]
pub struct LoadedLog {
    /// The log's header.
    pub header: ReplayHeader,
    /// Its operations, in order.
    pub ops: Vec<PerfOp>,
    /// Blocks named by events (stored + removed).
    pub event_blocks: u64,
    /// Blocks named by queries.
    pub query_blocks: u64,
    /// Blocks stored minus blocks removed: the blocks cached at the end for a conformance
    /// log (whose stores add only new blocks and whose removals name only held ones).
    net: i64,
}

impl LoadedLog {
    /// Parses a whole log file.
    pub fn load(path: &Path) -> Result<Self, LogError> {
        Self::from_reader(LogReader::open(path)?)
    }

    /// Parses a whole log from a reader.
    pub fn from_reader(reader: LogReader) -> Result<Self, LogError> {
        let header = reader.header.clone();
        let mut ops = Vec::new();
        let (mut event_blocks, mut query_blocks, mut net) = (0, 0, 0i64);
        for (_, op) in reader.read_all()? {
            match op {
                ReplayOp::Match { blocks, .. } => {
                    query_blocks += blocks.len() as u64;
                    ops.push(PerfOp::Match(blocks));
                }
                op => {
                    event_blocks += op.block_count() as u64;
                    net += match op {
                        ReplayOp::Store { ref blocks, .. } => blocks.len() as i64,
                        _ => -(op.block_count() as i64),
                    };
                    ops.push(PerfOp::Event(
                        op.to_event().expect("stores and removes are events"),
                    ));
                }
            }
        }
        Ok(Self {
            header,
            ops,
            event_blocks,
            query_blocks,
            net,
        })
    }

    /// Blocks cached at the end of a conformance log.
    pub fn net_blocks(&self) -> u64 {
        self.net.max(0) as u64
    }

    /// Number of queries.
    pub fn matches(&self) -> usize {
        self.ops
            .iter()
            .filter(|o| matches!(o, PerfOp::Match(_)))
            .count()
    }

    /// The events, in order.
    pub fn events(&self) -> impl Iterator<Item = &RouterEvent> {
        self.ops.iter().filter_map(|o| match o {
            PerfOp::Event(e) => Some(e),
            PerfOp::Match(_) => None,
        })
    }

    /// The queries, in order.
    pub fn queries(&self) -> impl Iterator<Item = &[LocalBlockHash]> {
        self.ops.iter().filter_map(|o| match o {
            PerfOp::Match(q) => Some(&q[..]),
            PerfOp::Event(_) => None,
        })
    }
}

/// The result of one timed replay. Field names are the JSON keys.
#[derive(Debug, Clone, Serialize)]
pub struct PerfReport {
    /// Index name.
    pub index: String,
    /// Operations replayed (events + queries).
    pub ops: u64,
    /// Events applied.
    pub events: u64,
    /// Queries answered.
    pub matches: u64,
    /// Blocks stored + removed + looked up.
    pub block_ops: u64,
    /// Replay wall time, seconds.
    pub elapsed_s: f64,
    /// Operations per second.
    pub ops_per_s: f64,
    /// Block operations per second.
    pub block_ops_per_s: f64,
    /// find_matches latency, median, ns.
    pub match_p50_ns: u64,
    /// find_matches latency, 99th percentile, ns.
    pub match_p99_ns: u64,
    /// find_matches latency, 99.9th percentile, ns.
    pub match_p999_ns: u64,
    /// Peak resident set of the process, bytes.
    pub peak_rss_bytes: u64,
    /// Resident set growth over the replay, bytes.
    pub rss_growth_bytes: u64,
    /// Blocks cached at the end (summed over workers).
    pub cached_blocks: u64,
    /// `rss_growth_bytes / cached_blocks`.
    pub bytes_per_block: f64,
    /// The index's own accounting of its heap, when it has one.
    pub heap_bytes: Option<u64>,
    /// Live heap growth over the replay, from the counting allocator ([`crate::heap`]),
    /// when it counts.
    pub heap_growth_bytes: Option<u64>,
    /// `heap_growth_bytes / cached_blocks`.
    pub heap_bytes_per_block: Option<f64>,
    /// Sum of the best score of every query (a checksum: equal across correct indexes).
    pub score_checksum: u64,
}

/// Current resident set size of this process, bytes (0 where `/proc` is unavailable).
pub fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(1)
                .and_then(|v| v.parse::<u64>().ok())
        })
        .map_or(0, |pages| pages * 4096)
}

/// Peak resident set size of this process, bytes (`VmHWM`).
pub fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|v| v.parse::<u64>().ok())
            })
        })
        .map_or(0, |kb| kb * 1024)
}

/// Percentile `p` (0..=1) of sorted nanosecond samples.
pub fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Timing state shared by every replay driver. Each operation is timed on its own, so that
/// work done between operations (cloning an event for an index that takes ownership) is not
/// counted; the log stays alive for the whole replay, so that memory freed by consumed
/// events cannot hide the index's growth.
#[derive(Debug)]
pub struct Stopwatch {
    busy: Duration,
    rss_before: u64,
    heap_before: Option<i64>,
    latencies: Vec<u64>,
    checksum: u64,
}

impl Stopwatch {
    /// Starts timing (records the RSS before the replay).
    pub fn start(queries: usize) -> Self {
        let rss_before = rss_bytes();
        let latencies = Vec::with_capacity(queries);
        Self {
            busy: Duration::ZERO,
            rss_before,
            heap_before: crate::heap::enabled().then(crate::heap::live_bytes),
            latencies,
            checksum: 0,
        }
    }

    /// Times one event.
    #[inline]
    pub fn event(&mut self, f: impl FnOnce()) {
        let t = Instant::now();
        f();
        self.busy += t.elapsed();
    }

    /// Times one query; `f` returns its best score.
    #[inline]
    pub fn query(&mut self, f: impl FnOnce() -> u32) {
        let t = Instant::now();
        let best = std::hint::black_box(f());
        let d = t.elapsed();
        self.busy += d;
        self.latencies.push(d.as_nanos() as u64);
        self.checksum += best as u64;
    }

    /// Adds time measured elsewhere (a barrier waiting for background threads).
    pub fn add(&mut self, d: Duration) {
        self.busy += d;
    }

    /// Ends timing and builds the report.
    pub fn finish(
        mut self,
        index: &str,
        log: &LoadedLog,
        cached_blocks: u64,
        heap_bytes: Option<u64>,
    ) -> PerfReport {
        let rss_after = rss_bytes();
        let heap_growth = self
            .heap_before
            .map(|b| (crate::heap::live_bytes() - b).max(0) as u64);
        self.latencies.sort_unstable();
        let ops = log.ops.len() as u64;
        let block_ops = log.event_blocks + log.query_blocks;
        let secs = self.busy.as_secs_f64().max(1e-9);
        let growth = rss_after.saturating_sub(self.rss_before);
        PerfReport {
            index: index.to_owned(),
            ops,
            events: ops - log.matches() as u64,
            matches: log.matches() as u64,
            block_ops,
            elapsed_s: secs,
            ops_per_s: ops as f64 / secs,
            block_ops_per_s: block_ops as f64 / secs,
            match_p50_ns: percentile(&self.latencies, 0.50),
            match_p99_ns: percentile(&self.latencies, 0.99),
            match_p999_ns: percentile(&self.latencies, 0.999),
            peak_rss_bytes: peak_rss_bytes(),
            rss_growth_bytes: growth,
            cached_blocks,
            bytes_per_block: if cached_blocks == 0 {
                0.0
            } else {
                growth as f64 / cached_blocks as f64
            },
            heap_bytes,
            heap_growth_bytes: heap_growth,
            heap_bytes_per_block: heap_growth
                .filter(|_| cached_blocks > 0)
                .map(|h| h as f64 / cached_blocks as f64),
            score_checksum: self.checksum,
        }
    }
}

/// Replays `log` through one of our indexes. `heap_bytes` reads the index's own memory
/// accounting, when it has one.
pub fn replay<I: Index + ?Sized>(
    index: &mut I,
    log: &LoadedLog,
    heap_bytes: impl Fn(&I) -> Option<u64>,
) -> PerfReport {
    let mut out = OverlapScores::new();
    let mut query = Vec::new();
    let mut sw = Stopwatch::start(log.matches());
    for op in &log.ops {
        match op {
            PerfOp::Event(e) => {
                let e = e.clone();
                sw.event(|| {
                    let _ = index.apply(e);
                });
            }
            PerfOp::Match(q) => {
                // Copied outside the timed region, as the Dynamo side clones each query
                // there (its API takes it by value): every index looks up a query that was
                // just written, as a router does right after hashing a request.
                query.clear();
                query.extend_from_slice(q);
                sw.query(|| {
                    index.find_matches_into(&query, &mut out);
                    out.max_score()
                })
            }
        }
    }
    let cached = index.block_count() as u64;
    let heap = heap_bytes(index);
    sw.finish(index.name(), log, cached, heap)
}

/// How long a closure took.
pub fn timed<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let t = Instant::now();
    let v = f();
    (v, t.elapsed())
}
