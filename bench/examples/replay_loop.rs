//! Profiling aid: loads a replay log once, then replays it `N` times through fresh tree
//! indexes, so that a sampling profiler sees the replay and not the parse.
//!
//! `cargo run --release -p kvrouter-bench --example replay_loop -- LOG [N]`

use std::path::PathBuf;

use kvrouter_bench::perf::{LoadedLog, replay};
use kvrouter_core::index::TreeIndex;

fn main() {
    let mut args = std::env::args().skip(1);
    let path = PathBuf::from(args.next().expect("usage: replay_loop LOG [N]"));
    let n: usize = args.next().map_or(10, |s| s.parse().expect("N"));
    let log = LoadedLog::load(&path).expect("load");
    let mut secs = Vec::new();
    for _ in 0..n {
        let mut idx = TreeIndex::new(1);
        let r = replay(&mut idx, &log, |_| None);
        secs.push(r.elapsed_s);
    }
    secs.sort_by(f64::total_cmp);
    println!(
        "median {:.4} s, {:.2} M block ops/s",
        secs[n / 2],
        (log.event_blocks + log.query_blocks) as f64 / secs[n / 2] / 1e6
    );
}
