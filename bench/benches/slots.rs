//! Criterion micro-benchmarks of the slot manager on agentic-sized prompts: add and free of
//! a request of about 1,900 blocks on a worker already running 16 sessions × 4 turns, when
//! it is the next turn of an active session (it extends a held prefix), when it is a new
//! prompt, and when it is a new session whose first 256 blocks (a system prompt and tools)
//! every held session shares. Ids: `slots/add_free/{next_turn,new_prompt,new_session}`.
//!
//! `cargo bench -p kvrouter-bench --bench slots`

use criterion::{Criterion, criterion_group, criterion_main};
use kvrouter_core::hash::{LocalBlockHash, sequence_hashes};
use kvrouter_core::slots::Slots;
use kvrouter_core::worker::WorkerDp;

fn chain(session: u64, blocks: usize) -> Vec<u64> {
    shared_chain(session, 0, blocks)
}

/// A session's prompt whose first `shared` blocks every session has.
fn shared_chain(session: u64, shared: usize, blocks: usize) -> Vec<u64> {
    let locals: Vec<LocalBlockHash> = (0..blocks as u64)
        .map(|i| {
            LocalBlockHash(if i < shared as u64 {
                i
            } else {
                session * 1_000_000 + i
            })
        })
        .collect();
    sequence_hashes(&locals).into_iter().map(|h| h.0).collect()
}

fn bench(c: &mut Criterion) {
    let w = WorkerDp::new(1, 0);
    let running = |shared: usize| {
        let mut slots = Slots::new(u64::MAX / 4);
        for s in 0..16 {
            for k in 0..4 {
                let id = format!("{s}-{k}");
                slots
                    .add(&id, w, shared_chain(s, shared, 1900 + 20 * k), 0, 0)
                    .unwrap();
            }
        }
        slots
    };
    let next: Vec<Vec<u64>> = (0..16).map(|s| chain(s, 1980)).collect();
    let new: Vec<Vec<u64>> = (100..116).map(|s| chain(s, 1900)).collect();
    let session: Vec<Vec<u64>> = (100..116).map(|s| shared_chain(s, 256, 1900)).collect();
    let mut g = c.benchmark_group("slots/add_free");
    for (name, shared, prompts) in [
        ("next_turn", 0, &next),
        ("new_prompt", 0, &new),
        ("new_session", 256, &session),
    ] {
        let mut slots = running(shared);
        let mut i = 0usize;
        g.bench_function(name, |b| {
            b.iter_batched(
                || {
                    i += 1;
                    prompts[i % prompts.len()].clone()
                },
                |blocks| {
                    slots.add("x", w, blocks, 0, 0).unwrap();
                    slots.free("x").unwrap();
                },
                criterion::BatchSize::SmallInput,
            )
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
