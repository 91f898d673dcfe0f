//! Criterion micro-benchmarks: `find_matches` and `apply` at 10^4..10^6 cached blocks and
//! 16 / 128 / 1024 workers, for our tree and the reference index (the naive competitor).
//! Ids: `index/{find_matches,apply}/{index}/{workers}w/{blocks}b`.
//!
//! `cargo bench -p kvrouter-bench --bench index`

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use kvrouter_core::event::{KvCacheEvent, RouterEvent};
use kvrouter_core::hash::{LocalBlockHash, SequenceBlockHash};
use kvrouter_core::index::{Index, OverlapScores, ReferenceIndex, TreeIndex};

const CHAIN: usize = 256;

/// A fleet where every worker holds chains of `CHAIN` blocks: a shared 32-block system
/// prompt, then per-chain blocks; `blocks` cached in all.
fn fleet(workers: usize, blocks: usize) -> (Vec<RouterEvent>, Vec<Vec<LocalBlockHash>>) {
    let chains = (blocks / CHAIN).max(workers);
    let mut events = Vec::new();
    let mut queries = Vec::new();
    for c in 0..chains {
        let w = (c % workers) as u64;
        let path: Vec<u64> = (0..CHAIN as u64)
            .map(|i| if i < 32 { i + 1 } else { (c as u64) << 20 | i })
            .collect();
        let locals: Vec<LocalBlockHash> = path.iter().map(|&l| LocalBlockHash(l)).collect();
        let seqs = kvrouter_core::hash::sequence_hashes(&locals);
        let blocks = locals
            .iter()
            .copied()
            .zip(seqs.iter().map(|s| SequenceBlockHash(s.0 ^ w)));
        events.push(RouterEvent::new(
            w,
            KvCacheEvent::stored(c as u64, 0, None, blocks),
        ));
        if c % 7 == 0 {
            queries.push(locals);
        }
    }
    (events, queries)
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("index");
    g.sample_size(10);
    g.measurement_time(std::time::Duration::from_secs(2));
    g.warm_up_time(std::time::Duration::from_millis(500));
    for &workers in &[16usize, 128, 1024] {
        for &blocks in &[10_000usize, 100_000, 1_000_000] {
            let (events, queries) = fleet(workers, blocks);
            let mut tree = TreeIndex::new(1);
            let mut reference = ReferenceIndex::new();
            for e in &events {
                tree.apply(e.clone()).unwrap();
                if blocks <= 100_000 {
                    reference.apply(e.clone()).unwrap();
                }
            }
            let id = format!("{workers}w/{blocks}b");
            let mut out = OverlapScores::new();
            g.bench_function(BenchmarkId::new("find_matches/tree", &id), |b| {
                let mut i = 0;
                b.iter(|| {
                    tree.find_matches_into(&queries[i % queries.len()], &mut out);
                    i += 1;
                    black_box(out.len())
                })
            });
            if blocks <= 100_000 {
                g.bench_function(BenchmarkId::new("find_matches/reference", &id), |b| {
                    let mut i = 0;
                    b.iter(|| {
                        reference.find_matches_into(&queries[i % queries.len()], &mut out);
                        i += 1;
                        black_box(out.len())
                    })
                });
            }
            // apply: remove one chain and store it again (two events, 2 x CHAIN blocks).
            let victim = &events[0];
            let hashes: Vec<SequenceBlockHash> = match &victim.event.data {
                kvrouter_core::KvEventData::Stored(s) => {
                    s.blocks.iter().rev().map(|b| b.block_hash).collect()
                }
                _ => unreachable!(),
            };
            let remove = RouterEvent::new(victim.worker_id, KvCacheEvent::removed(0, 0, hashes));
            g.bench_function(BenchmarkId::new("apply/tree", &id), |b| {
                b.iter(|| {
                    tree.apply(remove.clone()).unwrap();
                    tree.apply(victim.clone()).unwrap();
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
