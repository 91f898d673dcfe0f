//! What one huge route costs outside HTTP: 400 decisions of 65,536 random blocks on 16
//! workers, never freed (as the hostile soak's leaker sends them), each step timed: the
//! chain as given (`eager`: every sequence hash first) or hashed on demand (default), the
//! candidates and choice, and the slot insert (which hashes what the chain lacks).
//!
//! ```sh
//! cargo run --release -p kvrouter-bench --example huge_route_cost -- [eager]
//! ```

use std::time::Instant;

use kvrouter_core::chain::SequenceChain;
use kvrouter_core::hash::{LocalBlockHash, sequence_hashes};
use kvrouter_core::index::OverlapScores;
use kvrouter_core::policy::{CostConfig, Rng, choose, score};
use kvrouter_core::slots::Slots;
use kvrouter_core::worker::WorkerDp;

const BLOCKS: usize = 65_536;
const ROUTES: usize = 400;

fn main() -> anyhow::Result<()> {
    let eager = std::env::args().nth(1).is_some_and(|a| a == "eager");
    let workers: Vec<WorkerDp> = (0..16).map(|w| WorkerDp::new(w, 0)).collect();
    let mut slots = Slots::new(u64::MAX);
    let (cfg, mut rng) = (CostConfig::default(), Rng::new(1));
    let overlaps = OverlapScores::new();
    let mut g = 0x1234_5678u64;
    let mut times: [Vec<u64>; 3] = Default::default();
    for i in 0..ROUTES {
        let locals: Vec<LocalBlockHash> = (0..BLOCKS)
            .map(|_| {
                g ^= g << 13;
                g ^= g >> 7;
                g ^= g << 17;
                LocalBlockHash(g)
            })
            .collect();
        let t0 = Instant::now();
        let mut chain = if eager {
            let all = sequence_hashes(&locals).into_iter().map(|s| s.0).collect();
            SequenceChain::given(Some(&locals), all)
        } else {
            SequenceChain::new(&locals)
        };
        let t1 = Instant::now();
        let candidates = slots.candidates(&workers, &mut chain, &overlaps);
        let scored = score(&cfg, (BLOCKS * 64) as u64, 64, &candidates);
        let c = choose(&cfg, &scored, &mut rng).ok_or_else(|| anyhow::anyhow!("no worker"))?;
        let t2 = Instant::now();
        slots.add_chain(&format!("r{i}"), candidates[c].worker, chain, 0, 0)?;
        let t3 = Instant::now();
        for (v, (a, b)) in times.iter_mut().zip([(t0, t1), (t1, t2), (t2, t3)]) {
            v.push((b - a).as_nanos() as u64);
        }
    }
    for (name, mut v) in ["chain", "candidates", "insert"].into_iter().zip(times) {
        v.sort_unstable();
        let at = |q: f64| v[((v.len() - 1) as f64 * q) as usize] as f64 / 1e3;
        println!("{name}: p50 {:.1} us, p90 {:.1} us", at(0.5), at(0.9));
    }
    println!("held blocks {}", slots.held_blocks());
    Ok(())
}
