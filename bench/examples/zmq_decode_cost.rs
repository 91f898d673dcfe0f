//! The CPU cost per block of the vLLM-native ZMQ ingest's stages, in process, without
//! sockets: decoding the batches (source core), converting them to events with local
//! hashes (source core) and applying them to a tree (shard core).
//!
//! `cargo run --release -p kvrouter-bench --example zmq_decode_cost -- LOG [TOKENS_PER_BLOCK]`

use kvrouter_core::codec::vllm;
use kvrouter_core::engine::{Converter, Dropped};
use kvrouter_core::index::{Index, TreeIndex};
use std::time::Instant;
fn main() {
    let path = std::env::args().nth(1).unwrap();
    let log = kvrouter_bench::perf::LoadedLog::load(std::path::Path::new(&path)).unwrap();
    let (msgs, workers) = kvrouter_bench::zmq_ingest::encode(
        &log,
        std::env::args()
            .nth(2)
            .map_or(log.header.block_tokens as usize, |s| s.parse().unwrap()),
    )
    .unwrap();
    let blocks: u64 = msgs.iter().map(|m| m.1 as u64).sum();
    let bs = std::env::args()
        .nth(2)
        .map_or(log.header.block_tokens as u32, |s| s.parse().unwrap());
    for _ in 0..3 {
        let t = Instant::now();
        let mut n = 0;
        for (_, _, p) in &msgs {
            n += vllm::decode_batch(p).unwrap().events.len();
        }
        let dec = t.elapsed();
        let mut convs: Vec<Converter> = workers.iter().map(|&w| Converter::new(w, bs)).collect();
        let batches: Vec<_> = msgs
            .iter()
            .map(|(i, _, p)| (*i, vllm::decode_batch(p).unwrap()))
            .collect();
        let t = Instant::now();
        let mut evs = Vec::new();
        let mut d = Dropped::default();
        for (i, b) in batches {
            evs.extend(convs[i as usize].convert(b, 0, &mut d));
        }
        let conv = t.elapsed();
        let mut idx = TreeIndex::new(1);
        let t = Instant::now();
        for e in evs {
            let _ = idx.apply(e);
        }
        let apply = t.elapsed();
        println!(
            "{n} events {blocks} blocks: decode {:?} ({:.0} ns/block) convert {:?} ({:.0} ns/block) apply {:?} ({:.0} ns/block)",
            dec,
            dec.as_nanos() as f64 / blocks as f64,
            conv,
            conv.as_nanos() as f64 / blocks as f64,
            apply,
            apply.as_nanos() as f64 / blocks as f64
        );
    }
}
