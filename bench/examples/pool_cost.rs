//! Profiling aid: the heap a shared pool takes in the index and the cost of its lookup.
//!
//! Fills a one-shard tree with `BLOCKS` shared-pool blocks (`cache_owner` events, chains of
//! 64) split evenly over `SOURCES` publishing sources, then times the decider's tier lookup
//! of a `QUERY`-block request that every pool holds a part of, with no pool rule and with a
//! rule for every source. Prints heap bytes per pool block (counted by the bench's
//! allocator) and the median lookup time of each.
//!
//! `cargo run --release -p kvrouter-bench --example pool_cost -- [BLOCKS] [SOURCES] [QUERY]`

use std::time::Instant;

use kvrouter_bench::heap;
use kvrouter_core::decision::{Decider, DeciderConfig};
use kvrouter_core::event::{KvCacheEvent, ResidencyDomain, RouterEvent};
use kvrouter_core::hash::{LocalBlockHash, SequenceBlockHash, sequence_hashes};
use kvrouter_core::index::{Index, PoolReaders, TreeIndex};
use kvrouter_core::worker::StorageTier;

#[global_allocator]
static ALLOC: heap::Counting = heap::Counting;

fn main() {
    let mut args = std::env::args().skip(1);
    let mut arg = |d: usize| args.next().map_or(d, |s| s.parse().expect("a number"));
    let (blocks, sources, query) = (arg(1 << 20), arg(1), arg(2_000));
    heap::enable();
    let before = heap::live_bytes();
    let mut idx = TreeIndex::new(1);
    // A worker, so that the decider has a candidate.
    idx.apply(RouterEvent::new(
        1,
        KvCacheEvent::stored(0, 0, None, [(LocalBlockHash(1), SequenceBlockHash(1))]),
    ))
    .expect("stored");
    // The request's blocks: each source's pool holds one stretch of it.
    let q: Vec<LocalBlockHash> = (0..query as u64).map(|i| LocalBlockHash(i + 10)).collect();
    let seq = sequence_hashes(&q);
    let per_source = blocks / sources;
    let mut next = 1u64 << 40;
    for s in 0..sources {
        let source = 1_000 + s as u64;
        let mut held = 0;
        let mut id = 0;
        // A prefix of the request first (source `s` of `S` holds `(s + 1) / S` of it),
        // then chains of its own.
        let hi = ((s + 1) * query / sources).min(per_source);
        let mut chains: Vec<Vec<(LocalBlockHash, SequenceBlockHash)>> = Vec::new();
        chains.push((0..hi).map(|i| (q[i], seq[i])).collect());
        held += hi;
        while held < per_source {
            let n = 64.min(per_source - held);
            let chain = (0..n)
                .map(|_| {
                    next += 1;
                    (LocalBlockHash(next), SequenceBlockHash(next))
                })
                .collect();
            chains.push(chain);
            held += n;
        }
        for chain in chains {
            id += 1;
            let mut e = RouterEvent::new(source, KvCacheEvent::stored(id, 0, None, chain));
            e.residency_domain = Some(ResidencyDomain::CacheOwner);
            e.storage_tier = StorageTier::External;
            idx.apply(e).expect("pool event");
        }
    }
    let bytes = heap::live_bytes() - before;
    let reader = idx.reader();
    let held = per_source * sources;
    println!(
        "{sources} source(s), {held} pool blocks: {:.1} heap bytes per pool block",
        bytes as f64 / held as f64
    );
    let mut rules = PoolReaders::new();
    for s in 0..sources {
        rules.set(1_000 + s as u64, [1]);
    }
    for (name, readers) in [
        ("no rule", PoolReaders::new()),
        ("a rule per source", rules),
    ] {
        let mut d = Decider::new(DeciderConfig::default());
        d.set_pool_readers(readers);
        let mut times: Vec<u128> = (0..201)
            .map(|_| {
                let t = Instant::now();
                let (_, tiers) = d.tier_overlaps(Some(&reader), &q, None, 0);
                std::hint::black_box(tiers.shared_beyond(0));
                t.elapsed().as_nanos()
            })
            .collect();
        times.sort_unstable();
        println!(
            "{name}: tier lookup of a {query}-block request, median {:.1} us",
            times[100] as f64 / 1000.0
        );
    }
}
