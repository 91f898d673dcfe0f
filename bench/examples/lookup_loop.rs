//! Profiling aid: applies a replay log's events to a tree index with `SHARDS` shards, then
//! answers all of its queries `N` times; prints the mean time per lookup.
//!
//! `cargo run --release -p kvrouter-bench --example lookup_loop -- LOG [N] [SHARDS]`

use std::path::PathBuf;
use std::time::Instant;

use kvrouter_bench::perf::LoadedLog;
use kvrouter_core::hash::LocalBlockHash;
use kvrouter_core::index::{Index, OverlapScores, TreeIndex, TreeReader};

fn main() {
    let mut args = std::env::args().skip(1);
    let path = PathBuf::from(args.next().expect("usage: lookup_loop LOG [N] [SHARDS]"));
    let n: usize = args.next().map_or(20, |s| s.parse().expect("N"));
    let shards: usize = args.next().map_or(2, |s| s.parse().expect("SHARDS"));
    let log = LoadedLog::load(&path).expect("load");
    let mut idx = TreeIndex::new(shards);
    for e in log.events() {
        let _ = idx.apply(e.clone());
    }
    let queries: Vec<_> = log.queries().collect();
    let reader = idx.reader();
    let t = Instant::now();
    let sum = run_queries(&reader, &queries, n);
    let ns = t.elapsed().as_nanos() as f64 / (n * queries.len()) as f64;
    println!("{ns:.0} ns per lookup (checksum {sum})");
}

/// The timed loop, on its own so that `valgrind --tool=callgrind
/// --toggle-collect='*run_queries*'` counts only the lookups.
#[inline(never)]
fn run_queries(reader: &TreeReader, queries: &[&[LocalBlockHash]], n: usize) -> u64 {
    let mut out = OverlapScores::new();
    let mut sum = 0u64;
    for _ in 0..n {
        for q in queries {
            reader.find_matches_into(q, &mut out);
            sum += out.max_score() as u64;
        }
    }
    sum
}
