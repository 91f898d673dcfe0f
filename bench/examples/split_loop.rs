//! Profiling aid: replays a log through fresh tree indexes and prints where the time went,
//! per kind of operation (stores, removals, lookups), for each of `N` runs.
//!
//! `cargo run --release -p kvrouter-bench --example split_loop -- LOG [N]`

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvrouter_bench::perf::{LoadedLog, PerfOp};
use kvrouter_core::event::KvEventData;
use kvrouter_core::index::{Index, OverlapScores, TreeIndex};

fn main() {
    let mut args = std::env::args().skip(1);
    let path = PathBuf::from(args.next().expect("usage: split_loop LOG [N]"));
    let n: usize = args.next().map_or(5, |s| s.parse().expect("N"));
    let log = LoadedLog::load(&path).expect("load");
    for _ in 0..n {
        let mut idx = TreeIndex::new(1);
        let mut out = OverlapScores::new();
        let [mut store, mut remove, mut lookup] = [Duration::ZERO; 3];
        for op in &log.ops {
            match op {
                PerfOp::Event(e) => {
                    let stored = matches!(e.event.data, KvEventData::Stored(_));
                    let e = e.clone();
                    let t = Instant::now();
                    let _ = idx.apply(e);
                    *if stored { &mut store } else { &mut remove } += t.elapsed();
                }
                PerfOp::Match(q) => {
                    let t = Instant::now();
                    idx.find_matches_into(q, &mut out);
                    lookup += t.elapsed();
                }
            }
        }
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!(
            "stores {:.1} ms, removals {:.1} ms, lookups {:.1} ms",
            ms(store),
            ms(remove),
            ms(lookup)
        );
    }
}
