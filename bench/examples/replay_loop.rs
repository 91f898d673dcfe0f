//! Profiling aid: loads a replay log once, then replays it `N` times through fresh tree
//! indexes, so that a sampling profiler sees the replay and not the parse.
//!
//! `cargo run --release -p kvrouter-bench --example replay_loop -- LOG [N]`
//!
//! With `--features dynamo` and a third argument `radix`, each round replays the log
//! through a fresh tree and then through a fresh Dynamo `RadixTree`, and prints both
//! times: whether a gap between the two is the cost of a cold process (the first round)
//! or holds once both are warm (the rounds after it).

use std::path::PathBuf;

use kvrouter_bench::perf::{LoadedLog, replay};
use kvrouter_core::index::TreeIndex;

fn main() {
    let mut args = std::env::args().skip(1);
    let path = PathBuf::from(args.next().expect("usage: replay_loop LOG [N] [radix]"));
    let n: usize = args.next().map_or(10, |s| s.parse().expect("N"));
    let radix = args.next().as_deref() == Some("radix");
    let log = LoadedLog::load(&path).expect("load");
    let mut secs = Vec::new();
    for round in 0..n {
        let mut idx = TreeIndex::new(1);
        let r = replay(&mut idx, &log, |_| None);
        secs.push(r.elapsed_s);
        if radix {
            alongside(round, r.elapsed_s, &log);
        }
    }
    secs.sort_by(f64::total_cmp);
    println!(
        "median {:.4} s, {:.2} M block ops/s",
        secs[n / 2],
        (log.event_blocks + log.query_blocks) as f64 / secs[n / 2] / 1e6
    );
}

#[cfg(feature = "dynamo")]
fn alongside(round: usize, tree_s: f64, log: &LoadedLog) {
    let d = kvrouter_bench::dynamo::replay_radix_tree(log).elapsed_s;
    println!(
        "round {round}: tree {:.2} ms, RadixTree {:.2} ms, x{:.2}",
        tree_s * 1e3,
        d * 1e3,
        d / tree_s
    );
}

#[cfg(not(feature = "dynamo"))]
fn alongside(_: usize, _: f64, _: &LoadedLog) {
    panic!("`radix` needs --features dynamo");
}
