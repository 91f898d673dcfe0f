//! Per-step cost of a routing decision outside HTTP, over a replay log's queries: JSON parse
//! (serde_json's, the fallback path of the API), find_matches, the sequence-hash chain
//! (only when `eager`: the decision itself hashes on demand), the slot manager's candidates
//! (whose walks hash what they cannot learn from held runs), scoring and choice, and the
//! slot insert (which hashes the blocks the chosen worker does not hold). Prints the steps
//! of the p50/p90/p99/p999 decisions, the mean of the largest 1 % of queries, and how many
//! sequence hashes were computed.
//!
//! ```sh
//! cargo run --release -p kvrouter-bench --example route_cost [LOG [ACTIVE [eager]]]
//! ```

use std::time::Instant;

use kvrouter_bench::perf::{LoadedLog, PerfOp};
use kvrouter_core::chain::SequenceChain;
use kvrouter_core::hash::{LocalBlockHash, sequence_hashes};
use kvrouter_core::index::{Index, OverlapScores, TreeIndex};
use kvrouter_core::policy::{CostConfig, Rng, choose, score};
use kvrouter_core::slots::Slots;

#[derive(serde::Deserialize)]
struct Input {
    block_hashes: Vec<u64>,
}

const STEPS: [&str; 7] = ["parse", "find", "seq", "cand", "score", "add", "total"];

fn main() -> anyhow::Result<()> {
    let path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "../shared/workloads/conversation_w16_e8_c16384.jsonl.zst".to_owned());
    let active: usize = match std::env::args().nth(2) {
        Some(a) => a.parse()?,
        None => 0,
    };
    let eager = std::env::args().nth(3).is_some_and(|a| a == "eager");
    let log = LoadedLog::load(std::path::Path::new(&path))?;
    let mut index = TreeIndex::new(1);
    for op in &log.ops {
        if let PerfOp::Event(e) = op {
            let _ = index.apply(e.clone());
        }
    }
    let reader = index.reader();
    let workers: Vec<_> = index.workers().iter().map(|s| s.worker).collect();
    let bodies = log
        .queries()
        .map(|q| {
            let h: Vec<u64> = q.iter().map(|l| l.0).collect();
            Ok(format!(
                "{{\"block_hashes\":{}}}",
                serde_json::to_string(&h)?
            ))
        })
        .collect::<anyhow::Result<Vec<String>>>()?;
    let (mut slots, cfg, mut rng) = (Slots::new(600_000), CostConfig::default(), Rng::new(1));
    let mut out = OverlapScores::new();
    let mut rows: Vec<(usize, [u64; 7])> = Vec::new();
    let mut running = std::collections::VecDeque::new();
    // (query blocks, sequence hashes computed)
    let mut hashed = (0usize, 0usize);
    for (i, body) in bodies.iter().enumerate() {
        let t0 = Instant::now();
        let input: Input = serde_json::from_str(body)?;
        let t1 = Instant::now();
        let locals: Vec<LocalBlockHash> = input
            .block_hashes
            .iter()
            .map(|&h| LocalBlockHash(h))
            .collect();
        reader.find_matches_into(&locals, &mut out);
        let t2 = Instant::now();
        let mut seqs = if eager {
            let all = sequence_hashes(&locals).into_iter().map(|s| s.0).collect();
            SequenceChain::given(Some(&locals), all)
        } else {
            SequenceChain::new(&locals)
        };
        let t3 = Instant::now();
        let candidates = slots.candidates(&workers, &mut seqs, &out);
        let t4 = Instant::now();
        let scored = score(&cfg, locals.len() as u64 * 64, 64, &candidates);
        let c = choose(&cfg, &scored, &mut rng).ok_or_else(|| anyhow::anyhow!("no worker"))?;
        let t5 = Instant::now();
        let id = format!("r{i}");
        // What the walks hashed, and what the insert will: the blocks past the chosen
        // worker's held prefix that no walk hashed (counted outside the timings).
        let len = locals.len();
        let held = scored[c].candidate.inflight_overlap_blocks as usize;
        let rest = (held..len).filter(|&i| seqs.known(i).is_none()).count();
        hashed.0 += len;
        hashed.1 += if eager { len } else { seqs.hashed() + rest };
        let t5b = Instant::now();
        slots.add_chain(&id, scored[c].candidate.worker, seqs, 0, 0)?;
        let t6 = Instant::now();
        running.push_back(id);
        while running.len() > active {
            if let Some(oldest) = running.pop_front() {
                slots.free(&oldest)?;
            }
        }
        let d = |a: Instant, b: Instant| (b - a).as_nanos() as u64;
        rows.push((
            locals.len(),
            [
                d(t0, t1),
                d(t1, t2),
                d(t2, t3),
                d(t3, t4),
                d(t4, t5),
                d(t5b, t6),
                d(t0, t5) + d(t5b, t6),
            ],
        ));
    }
    let show = |label: &str, len: usize, v: [u64; 7]| {
        let steps: Vec<String> = STEPS
            .iter()
            .zip(v)
            .map(|(s, ns)| format!("{s} {:.1} us", ns as f64 / 1e3))
            .collect();
        println!("{label} ({len} hashes): {}", steps.join(", "));
    };
    rows.sort_by_key(|r| r.1[6]);
    let n = rows.len();
    for (label, q) in [("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p999", 0.999)] {
        let r = &rows[((n - 1) as f64 * q) as usize];
        show(label, r.0, r.1);
    }
    rows.sort_by_key(|r| r.0);
    let big = &rows[n * 99 / 100..];
    let mut mean = [0u64; 7];
    for (k, m) in mean.iter_mut().enumerate() {
        *m = big.iter().map(|r| r.1[k]).sum::<u64>() / big.len() as u64;
    }
    show("largest 1 % mean", big[0].0, mean);
    let mut median = [0u64; 7];
    for (k, m) in median.iter_mut().enumerate() {
        let mut v: Vec<u64> = big.iter().map(|r| r.1[k]).collect();
        v.sort_unstable();
        *m = v[v.len() / 2];
    }
    show("largest 1 % median", big[0].0, median);
    println!(
        "sequence hashes computed: {} of {} query blocks ({:.1} %)",
        hashed.1,
        hashed.0,
        100.0 * hashed.1 as f64 / hashed.0.max(1) as f64
    );
    Ok(())
}
