//! The lock-free tree against the reference index, driven by the shared `Op` type:
//!
//! * sequentially, with one and with several shards: every op gives the same result
//!   (outcome counts, errors, answers), and the whole state agrees at the end (every query
//!   over the alphabet, worker summaries, block counts, dumps that rebuild the reference);
//! * concurrently: one writer thread per shard applies its ops while reader threads look
//!   up; every answer lies within what the Consistency section allows (for each worker, a
//!   score it had at some moment of the lookup's window), and the final states are equal.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use kvrouter_core::index::ops::{self, Naming, Op, OpResult};
use kvrouter_core::index::{Index, OverlapScores, ReferenceIndex, TreeIndex};
use kvrouter_core::worker::WorkerDp;
use proptest::prelude::*;

fn path() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(0..ops::SYMBOLS, 0..=ops::MAX_PATH)
}

/// Blocks one removal names: mostly one (an eviction that reaches a branch point), often a
/// run (a chain's tail).
fn span() -> impl Strategy<Value = u8> {
    prop_oneof![3 => Just(1u8), 2 => 2..=ops::MAX_PATH as u8]
}

fn naming() -> impl Strategy<Value = Naming> {
    prop_oneof![6 => Just(Naming::Chain), 1 => Just(Naming::PerWorker), 1 => Just(Naming::Slot)]
}

fn op(workers: u8) -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (0..workers, 0..2u8, path(), 0..8u8, naming())
            .prop_map(|(worker, dp, path, from, naming)| Op::Store { worker, dp, path, from, naming }),
        4 => (0..workers, 0..2u8, path(), span(), any::<bool>(), naming())
            .prop_map(|(worker, dp, path, span, root_first, naming)| Op::Remove { worker, dp, path, span, root_first, naming }),
        1 => (0..workers, 0..2u8).prop_map(|(worker, dp)| Op::Clear { worker, dp }),
        1 => (0..workers).prop_map(|worker| Op::RemoveWorker { worker }),
        5 => path().prop_map(|path| Op::Find { path }),
    ]
}

fn queries() -> Vec<Vec<u8>> {
    let mut q = ops::all_paths(4);
    q.extend(
        ops::all_paths(2)
            .into_iter()
            .map(|p| p.iter().cycle().take(ops::MAX_PATH).copied().collect()),
    );
    q
}

fn same_state(a: &dyn Index, b: &dyn Index) -> Result<(), TestCaseError> {
    prop_assert_eq!(a.workers(), b.workers());
    prop_assert_eq!(a.block_count(), b.block_count());
    for q in queries() {
        let l = ops::locals(&q);
        prop_assert_eq!(a.find_matches(&l), b.find_matches(&l), "query {:?}", q);
    }
    Ok(())
}

fn sequential(ops_: &[Op], shards: usize) -> Result<(), TestCaseError> {
    let mut reference = ReferenceIndex::new();
    let mut tree = TreeIndex::new(shards);
    for (i, op) in ops_.iter().enumerate() {
        let want = ops::run(&mut reference, op, i as u64);
        let got = ops::run(&mut tree, op, i as u64);
        prop_assert_eq!(got, want, "op #{} {:?}", i, op);
        prop_assert!(
            tree.node_count() <= tree.block_count(),
            "a node without a live block"
        );
    }
    same_state(&tree, &reference)?;
    // The tree's dump rebuilds the reference's state.
    let mut rebuilt = ReferenceIndex::new();
    for e in tree.dump() {
        prop_assert!(rebuilt.apply(e).is_ok());
    }
    same_state(&rebuilt, &reference)?;
    // Removing every worker frees every node.
    for w in 0..ops::WORKERS {
        tree.remove_worker(ops::worker_id(w));
    }
    prop_assert_eq!((tree.block_count(), tree.node_count()), (0, 0));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn tree_equals_reference_few_workers(ops_ in proptest::collection::vec(op(3), 1..120)) {
        sequential(&ops_, 1)?;
    }

    #[test]
    fn tree_equals_reference_many_workers_and_shards(ops_ in proptest::collection::vec(op(ops::WORKERS), 1..200)) {
        sequential(&ops_, 1)?;
        sequential(&ops_, 3)?;
        // More shards than a merged slot order serves (4): the per-shard path.
        sequential(&ops_, 5)?;
    }
}

/// A lookup made while writers ran: its window of shard progress and its answer.
struct Observation {
    query: Vec<u8>,
    before: Vec<usize>,
    after: Vec<usize>,
    answer: OverlapScores,
}

fn concurrent(ops_: Vec<Op>, shards: usize, readers: usize) -> Result<(), TestCaseError> {
    // Per-shard event lists (lookups and whole-worker removals are dropped: the first are
    // what readers do, the second are exercised sequentially).
    let index = TreeIndex::new(shards);
    let map = index.shard_map();
    let mut per_shard: Vec<Vec<Op>> = vec![Vec::new(); shards];
    for op in ops_ {
        if let Some(w) = ops::op_worker(&op) {
            per_shard[map.shard_of(w.worker_id)].push(op);
        }
    }
    let (writers, reader) = index.into_parts();
    let progress: Arc<Vec<AtomicUsize>> =
        Arc::new((0..shards).map(|_| AtomicUsize::new(0)).collect());
    let done = Arc::new(AtomicBool::new(false));
    let qs = Arc::new(queries());
    let observations: Vec<Observation> = std::thread::scope(|s| {
        let mut handles = Vec::new();
        for (i, (mut w, list)) in writers.into_iter().zip(per_shard.iter()).enumerate() {
            let progress = Arc::clone(&progress);
            handles.push(s.spawn(move || {
                for (k, op) in list.iter().enumerate() {
                    if let Some(e) = op.to_event(k as u64) {
                        let _ = w.apply_event(&e);
                    }
                    progress[i].store(k + 1, Ordering::Release);
                }
                w
            }));
        }
        let mut obs_handles = Vec::new();
        for r in 0..readers {
            let (reader, progress, done, qs) = (
                reader.clone(),
                Arc::clone(&progress),
                Arc::clone(&done),
                Arc::clone(&qs),
            );
            obs_handles.push(s.spawn(move || {
                let mut out = Vec::new();
                let mut i = r * 7;
                while !done.load(Ordering::Acquire) || out.len() < 50 {
                    let query = qs[i % qs.len()].clone();
                    i += 13;
                    let before: Vec<usize> =
                        progress.iter().map(|p| p.load(Ordering::Acquire)).collect();
                    let answer = reader.find_matches(&ops::locals(&query));
                    let after: Vec<usize> =
                        progress.iter().map(|p| p.load(Ordering::Acquire)).collect();
                    out.push(Observation {
                        query,
                        before,
                        after,
                        answer,
                    });
                    if out.len() > 20_000 {
                        break;
                    }
                }
                out
            }));
        }
        let finished: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        done.store(true, Ordering::Release);
        let obs: Vec<Observation> = obs_handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect();
        // Final state: all shards' writers are done.
        let mut reference = ReferenceIndex::new();
        for list in &per_shard {
            for (k, op) in list.iter().enumerate() {
                if let Some(e) = op.to_event(k as u64) {
                    let _ = reference.apply(e);
                }
            }
        }
        for q in queries() {
            let l = ops::locals(&q);
            assert_eq!(
                reader.find_matches(&l),
                reference.find_matches(&l),
                "final state, query {q:?}"
            );
        }
        let mut summaries: Vec<_> = finished.iter().flat_map(|w| w.workers()).collect();
        summaries.sort_by_key(|s| s.worker);
        assert_eq!(summaries, reference.workers());
        obs
    });

    // Check every observation: for each worker, its score must be one it had at some state
    // of its shard inside the observation's window.
    for (s, list) in per_shard.iter().enumerate() {
        let mut reference = ReferenceIndex::new();
        // (observation, worker) -> (min, max) seen over the window.
        let mut bounds: BTreeMap<(usize, WorkerDp), (u32, u32)> = BTreeMap::new();
        let shard_workers: BTreeSet<WorkerDp> = list.iter().filter_map(ops::op_worker).collect();
        for k in 0..=list.len() {
            if let Some(e) = k.checked_sub(1).and_then(|j| list[j].to_event(j as u64)) {
                let _ = reference.apply(e);
            }
            for (i, o) in observations.iter().enumerate() {
                // `after` ops were complete when the lookup returned; one more may have been
                // in flight.
                if o.before[s] <= k && k <= o.after[s] + 1 {
                    let scores = reference.find_matches(&ops::locals(&o.query));
                    for &w in &shard_workers {
                        let v = scores.get(w);
                        let b = bounds.entry((i, w)).or_insert((v, v));
                        b.0 = b.0.min(v);
                        b.1 = b.1.max(v);
                    }
                }
            }
        }
        for (i, o) in observations.iter().enumerate() {
            for &w in &shard_workers {
                let (lo, hi) = bounds[&(i, w)];
                let got = o.answer.get(w);
                prop_assert!(
                    lo <= got && got <= hi,
                    "worker {} scored {} for {:?}, allowed [{}, {}] (shard {} window {}..={})",
                    w,
                    got,
                    o.query,
                    lo,
                    hi,
                    s,
                    o.before[s],
                    o.after[s] + 1
                );
            }
        }
    }
    for o in &observations {
        for (w, _) in o.answer.iter() {
            prop_assert!(
                map.get(w.worker_id)
                    .is_some_and(|s| per_shard[s].iter().any(|op| ops::op_worker(op) == Some(w))),
                "unknown worker {}",
                w
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn concurrent_answers_stay_within_the_consistency_window(ops_ in proptest::collection::vec(op(6), 20..160)) {
        concurrent(ops_.clone(), 1, 2)?;
        // Two readers over two shards: both may find the merged slot order stale and race
        // to replace it.
        concurrent(ops_, 2, 2)?;
    }
}

#[test]
fn many_workers_exceed_one_bitset_word() {
    let mut tree = TreeIndex::new(1);
    let mut reference = ReferenceIndex::new();
    for w in 0..ops::WORKERS {
        let op = Op::Store {
            worker: w,
            dp: 0,
            path: vec![1, 2, 3, (w % 4)],
            from: 0,
            naming: Naming::Chain,
        };
        assert_eq!(
            ops::run(&mut tree, &op, 0),
            ops::run(&mut reference, &op, 0)
        );
    }
    let q = ops::locals(&[1, 2, 3, 0]);
    let got = tree.find_matches(&q);
    assert_eq!(got, reference.find_matches(&q));
    assert_eq!(got.len(), ops::WORKERS as usize);
    assert_eq!(
        got.iter().filter(|&(_, s)| s == 4).count(),
        ops::WORKERS as usize / 4
    );
}

/// Workers arriving one by one across two shards: every answer matches the reference while
/// each shard's slot order changes (the cached merged order goes stale at every arrival),
/// and after a shard passes 64 slots (lookups then take the per-shard path).
#[test]
fn arriving_workers_keep_answers_sorted_across_shards() {
    let mut tree = TreeIndex::new(2);
    let mut reference = ReferenceIndex::new();
    let q = ops::locals(&[1, 2, 3]);
    // Arrival order is not worker order, so each new worker lands between others.
    for i in 0..ops::WORKERS {
        let w = (i as u32 * 37 % ops::WORKERS as u32) as u8;
        for dp in 0..2 {
            let op = Op::Store {
                worker: w,
                dp,
                path: vec![1, 2, 3][..1 + (w as usize + dp as usize) % 3].to_vec(),
                from: 0,
                naming: Naming::Chain,
            };
            assert_eq!(
                ops::run(&mut tree, &op, 0),
                ops::run(&mut reference, &op, 0)
            );
            assert_eq!(
                tree.find_matches(&q),
                reference.find_matches(&q),
                "after {w}/{dp}"
            );
        }
    }
    assert_eq!(tree.find_matches(&q).len(), 2 * ops::WORKERS as usize);
}

/// A chain rejected after its names were looked up (one of them names an ancestor of its
/// parent) leaves nothing behind: the fresh names it carried are not held afterwards.
#[test]
fn a_rejected_chain_leaves_no_names_behind() {
    use kvrouter_core::event::{KvCacheEvent, RouterEvent};
    use kvrouter_core::hash::{LocalBlockHash as L, SequenceBlockHash as S};
    let stored = |parent: Option<u64>, blocks: &[(u64, u64)]| {
        RouterEvent::new(
            7,
            KvCacheEvent::stored(
                0,
                0,
                parent.map(S),
                blocks.iter().map(|&(l, s)| (L(l), S(s))),
            ),
        )
    };
    let mut tree = TreeIndex::new(1);
    let mut reference = ReferenceIndex::new();
    for idx in [&mut tree as &mut dyn Index, &mut reference] {
        idx.apply(stored(None, &[(1, 101), (2, 102)])).unwrap();
        // 777 and 778 are fresh; 101 is an ancestor of the parent 102.
        assert!(
            idx.apply(stored(Some(102), &[(3, 777), (4, 778), (5, 101)]))
                .is_err()
        );
        assert_eq!(idx.block_count(), 2);
        assert_eq!(idx.workers()[0].blocks, 2);
        let o = idx
            .apply(RouterEvent::new(
                7,
                KvCacheEvent::removed(0, 0, [S(777), S(778)]),
            ))
            .unwrap();
        assert_eq!((o.removed, o.not_found), (0, 2));
        // The names are free to use afterwards.
        idx.apply(stored(Some(102), &[(3, 777), (4, 778)])).unwrap();
        assert_eq!(idx.block_count(), 4);
        // A chain naming a block twice: a fresh name (779) or one the worker holds (101),
        // after fresh names that must not stay behind (780, 781).
        for twice in [779, 101] {
            let chain = [(5, 780), (6, twice), (7, 781), (8, twice)];
            assert!(idx.apply(stored(Some(778), &chain)).is_err());
            assert_eq!(idx.block_count(), 4);
        }
        let o = idx
            .apply(RouterEvent::new(
                7,
                KvCacheEvent::removed(0, 0, [S(779), S(780), S(781)]),
            ))
            .unwrap();
        assert_eq!((o.removed, o.not_found), (0, 3));
        // 101 still names the first block: a chain under it is accepted, and removing it
        // drops everything the worker holds.
        idx.apply(stored(Some(101), &[(9, 790)])).unwrap();
        let o = idx
            .apply(RouterEvent::new(7, KvCacheEvent::removed(0, 0, [S(101)])))
            .unwrap();
        assert_eq!(o.removed, 5);
        assert_eq!(idx.block_count(), 0);
        idx.apply(stored(None, &[(1, 101), (2, 102), (3, 777), (4, 778)]))
            .unwrap();
    }
    let q = ops::locals(&[1, 2, 3, 4]);
    assert_eq!(tree.find_matches(&q), reference.find_matches(&q));
}

#[test]
fn eviction_frees_nodes_and_memory() {
    let mut tree = TreeIndex::new(1);
    let empty = tree.heap_bytes();
    for round in 0..50u8 {
        let path: Vec<u8> = (0..ops::MAX_PATH as u8)
            .map(|i| (i + round) % ops::SYMBOLS)
            .collect();
        let store = Op::Store {
            worker: round % 5,
            dp: 0,
            path: path.clone(),
            from: 0,
            naming: Naming::Chain,
        };
        ops::run(&mut tree, &store, round as u64);
        let rm = |path: &[u8], span: usize, root_first: bool| Op::Remove {
            worker: round % 5,
            dp: 0,
            path: path.to_vec(),
            span: span as u8,
            root_first,
            naming: Naming::Chain,
        };
        let n = path.len() as u32;
        match round % 3 {
            // Block by block, tail first.
            0 => {
                for len in (1..=path.len()).rev() {
                    let r = ops::run(&mut tree, &rm(&path[..len], 1, false), 0);
                    assert!(matches!(r, OpResult::Applied(o) if o.removed == 1), "{r:?}");
                }
            }
            // The whole chain in one event, tail first (one run).
            1 => {
                let r = ops::run(&mut tree, &rm(&path, path.len(), false), 0);
                assert!(
                    matches!(r, OpResult::Applied(o) if o.removed == n && o.not_found == 0),
                    "{r:?}"
                );
            }
            // Root first: the first name takes the chain with it, the rest are gone.
            _ => {
                let r = ops::run(&mut tree, &rm(&path, path.len(), true), 0);
                assert!(
                    matches!(r, OpResult::Applied(o) if o.removed == n && o.not_found == n - 1),
                    "{r:?}"
                );
            }
        }
        assert_eq!((tree.block_count(), tree.node_count()), (0, 0));
    }
    // Bounded: what is left is the root tables and the workers' empty maps.
    assert!(
        tree.heap_bytes() < empty + 4096,
        "{} -> {}",
        empty,
        tree.heap_bytes()
    );
}
