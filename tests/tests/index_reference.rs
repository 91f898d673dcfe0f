//! The reference index against NVIDIA Dynamo 1.6.1's `RadixTree`, on random operation
//! sequences where Dynamo's semantics are sane (evictions leaf-first, as engines do): both
//! must give the same answer to every query. Also: dumps rebuild the same state in our
//! index and are accepted by Dynamo's.

use std::collections::{BTreeMap, HashSet};

use dynamo_kv_router::RadixTree;
use dynamo_kv_router::protocols as dynamo;
use kvrouter_core::event::{KvCacheEvent, KvEventData, RouterEvent};
use kvrouter_core::hash::{LocalBlockHash, SequenceBlockHash, sequence_hashes};
use kvrouter_core::index::{Index, ReferenceIndex};
use kvrouter_core::worker::WorkerDp;
use proptest::prelude::*;

/// A block path over a tiny alphabet, so that paths collide and share prefixes often.
type Path = Vec<u8>;

fn locals(path: &[u8]) -> Vec<LocalBlockHash> {
    path.iter()
        .map(|&s| LocalBlockHash(0x1000 + s as u64))
        .collect()
}

fn ext(path: &[u8]) -> SequenceBlockHash {
    *sequence_hashes(&locals(path))
        .last()
        .expect("non-empty path")
}

#[derive(Debug, Clone)]
enum Step {
    /// Store `path[from..]` under `path[..from]` (maybe an unknown parent, maybe duplicates).
    Store {
        w: usize,
        path: Path,
        from: usize,
    },
    /// Evict the `pick`-th held leaf of the worker.
    EvictLeaf {
        w: usize,
        pick: usize,
    },
    /// Remove a block the worker may not hold.
    RemoveAny {
        w: usize,
        path: Path,
    },
    Clear {
        w: usize,
    },
    RemoveWorker {
        worker_id: u64,
    },
    Find {
        path: Path,
    },
}

const WORKERS: [WorkerDp; 4] = [
    WorkerDp::new(0, 0),
    WorkerDp::new(0, 1),
    WorkerDp::new(1, 0),
    WorkerDp::new(u64::MAX, 0),
];

fn path() -> impl Strategy<Value = Path> {
    proptest::collection::vec(0u8..3, 1..7)
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (0..WORKERS.len(), path(), 0usize..7).prop_map(|(w, path, from)| {
            let from = from.min(path.len() - 1);
            Step::Store { w, path, from }
        }),
        3 => (0..WORKERS.len(), any::<usize>()).prop_map(|(w, pick)| Step::EvictLeaf { w, pick }),
        1 => (0..WORKERS.len(), path()).prop_map(|(w, path)| Step::RemoveAny { w, path }),
        1 => (0..WORKERS.len()).prop_map(|w| Step::Clear { w }),
        1 => proptest::sample::select(vec![0u64, 1, u64::MAX]).prop_map(|worker_id| Step::RemoveWorker { worker_id }),
        6 => proptest::collection::vec(0u8..3, 0..8).prop_map(|path| Step::Find { path }),
    ]
}

/// Which paths each worker holds (prefix-closed sets), to pick leaves to evict.
#[derive(Default)]
struct Held(BTreeMap<WorkerDp, HashSet<Path>>);

impl Held {
    fn apply(&mut self, w: WorkerDp, e: &KvEventData, paths: &BTreeMap<SequenceBlockHash, Path>) {
        let set = self.0.entry(w).or_default();
        match e {
            KvEventData::Stored(s) => {
                if s.parent_hash.is_some_and(|p| !set.contains(&paths[&p])) {
                    return;
                }
                for b in &s.blocks {
                    set.insert(paths[&b.block_hash].clone());
                }
            }
            KvEventData::Removed(r) => {
                for h in &r.block_hashes {
                    set.remove(&paths[h]);
                }
            }
            KvEventData::Cleared => set.clear(),
        }
    }

    fn leaves(&self, w: WorkerDp) -> Vec<Path> {
        let Some(set) = self.0.get(&w) else {
            return vec![];
        };
        let mut leaves: Vec<Path> = set
            .iter()
            .filter(|p| {
                !set.iter()
                    .any(|q| q.len() == p.len() + 1 && q.starts_with(p))
            })
            .cloned()
            .collect();
        leaves.sort();
        leaves
    }
}

fn to_dynamo(e: &RouterEvent) -> dynamo::RouterEvent {
    let bytes = rmp_serde::to_vec_named(e).unwrap();
    rmp_serde::from_slice(&bytes).unwrap()
}

fn dynamo_scores(tree: &RadixTree, query: &[LocalBlockHash]) -> Vec<(WorkerDp, u32)> {
    let q = query.iter().map(|l| dynamo::LocalBlockHash(l.0)).collect();
    let mut v: Vec<(WorkerDp, u32)> = tree
        .find_matches(q, false)
        .scores
        .into_iter()
        .filter(|&(_, s)| s > 0)
        .map(|(w, s)| (WorkerDp::new(w.worker_id, w.dp_rank), s))
        .collect();
    v.sort();
    v
}

fn run(steps: Vec<Step>) -> Result<(), TestCaseError> {
    let mut ours = ReferenceIndex::new();
    let mut theirs = RadixTree::new();
    let mut held = Held::default();
    let mut paths: BTreeMap<SequenceBlockHash, Path> = BTreeMap::new();
    let mut event_id = 0;
    for step in steps {
        event_id += 1;
        let event = match step {
            Step::Store { w, path, from } => {
                for i in 1..=path.len() {
                    paths.insert(ext(&path[..i]), path[..i].to_vec());
                }
                let parent = (from > 0).then(|| ext(&path[..from]));
                let blocks =
                    (from + 1..=path.len()).map(|i| (locals(&path[..i])[i - 1], ext(&path[..i])));
                Some((
                    w,
                    KvCacheEvent::stored(event_id, WORKERS[w].dp_rank, parent, blocks),
                ))
            }
            Step::EvictLeaf { w, pick } => {
                let leaves = held.leaves(WORKERS[w]);
                (!leaves.is_empty()).then(|| {
                    let leaf = &leaves[pick % leaves.len()];
                    (
                        w,
                        KvCacheEvent::removed(event_id, WORKERS[w].dp_rank, [ext(leaf)]),
                    )
                })
            }
            Step::RemoveAny { w, path } => {
                // Only blocks the worker does not hold, or holds as a leaf: no mid-chain evictions.
                let leaves = held.leaves(WORKERS[w]);
                let holds = held.0.get(&WORKERS[w]).is_some_and(|s| s.contains(&path));
                paths.insert(ext(&path), path.clone());
                (!holds || leaves.contains(&path)).then(|| {
                    (
                        w,
                        KvCacheEvent::removed(event_id, WORKERS[w].dp_rank, [ext(&path)]),
                    )
                })
            }
            Step::Clear { w } => Some((w, KvCacheEvent::cleared(event_id, WORKERS[w].dp_rank))),
            Step::RemoveWorker { worker_id } => {
                ours.remove_worker(worker_id);
                theirs.remove_worker(worker_id);
                held.0.retain(|w, _| w.worker_id != worker_id);
                None
            }
            Step::Find { path } => {
                let q = locals(&path);
                prop_assert_eq!(
                    ours.find_matches(&q).as_slice().to_vec(),
                    dynamo_scores(&theirs, &q),
                    "query {:?}",
                    path
                );
                None
            }
        };
        if let Some((w, ev)) = event {
            let e = RouterEvent::new(WORKERS[w].worker_id, ev);
            held.apply(WORKERS[w], &e.event.data, &paths);
            let a = ours.apply(e.clone());
            let b = theirs.apply_event(to_dynamo(&e));
            if matches!(e.event.data, KvEventData::Stored(_)) {
                prop_assert_eq!(
                    a.is_ok(),
                    b.is_ok(),
                    "store accepted by one index only: {:?}",
                    e
                );
            }
        }
    }
    // Final state: every query over the alphabet agrees, and our dump rebuilds both.
    let mut rebuilt = ReferenceIndex::new();
    let mut dyn_rebuilt = RadixTree::new();
    for e in ours.dump() {
        prop_assert!(rebuilt.apply(e.clone()).is_ok());
        prop_assert!(dyn_rebuilt.apply_event(to_dynamo(&e)).is_ok());
    }
    prop_assert_eq!(rebuilt.block_count(), ours.block_count());
    let held_total: usize = held.0.values().map(|s| s.len()).sum();
    prop_assert_eq!(ours.block_count(), held_total);
    for a in 0..3u8 {
        for b in 0..3u8 {
            for c in 0..3u8 {
                let q = locals(&[a, b, c, a, b, c]);
                let want = ours.find_matches(&q);
                prop_assert_eq!(want.as_slice().to_vec(), dynamo_scores(&theirs, &q));
                prop_assert_eq!(&rebuilt.find_matches(&q), &want);
                prop_assert_eq!(want.as_slice().to_vec(), dynamo_scores(&dyn_rebuilt, &q));
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn reference_agrees_with_dynamo_radix_tree(steps in proptest::collection::vec(step(), 1..80)) {
        run(steps)?;
    }
}

#[test]
fn empty_index_paths_are_freed() {
    let mut idx = ReferenceIndex::new();
    let w = 7;
    let p: Path = vec![0, 1, 2, 0];
    let blocks = (1..=p.len()).map(|i| (locals(&p[..i])[i - 1], ext(&p[..i])));
    idx.apply(RouterEvent::new(
        w,
        KvCacheEvent::stored(0, 0, None, blocks),
    ))
    .unwrap();
    assert_eq!(idx.path_count(), 4);
    idx.apply(RouterEvent::new(
        w,
        KvCacheEvent::removed(1, 0, [ext(&p[..1])]),
    ))
    .unwrap();
    assert_eq!((idx.block_count(), idx.path_count()), (0, 0));
}
