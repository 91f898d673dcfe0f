//! loom models of the publication and reclamation steps of the shard tree. Run with
//!
//! ```text
//! RUSTFLAGS="--cfg loom --cfg crossbeam_loom" cargo test -p kvrouter-core --release --lib loom_models
//! ```
//!
//! (`scripts/loom.sh`). Each model is one writer and one reader on the real code paths:
//! loom explores their interleavings, checks every cell access for data races and every
//! epoch-deferred free against the reader's guard.

use crossbeam_epoch::Owned;
use loom::sync::Arc;
use loom::thread;

use super::raw::children::ChildTable;
use super::raw::edge::Edge;
use super::raw::node::Node;
use super::writer::ShardWriter;
use crate::event::{KvCacheEvent, RouterEvent};
use crate::hash::{LocalBlockHash, SequenceBlockHash};
use crate::index::tree::TreeReader;
use crate::sync::Ordering;

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(f);
}

/// A node with an empty child table of `cap` slots.
fn parent_with_table(cap: usize) -> Arc<Node> {
    let parent = Arc::new(Node::new(0, 0, &[7], 1));
    parent
        .children
        .store(ChildTable::with_capacity(cap), Ordering::Release);
    parent
}

/// Appended cells are published by the length: a reader sees a prefix of what the writer
/// wrote, never an unwritten cell, and a trim never exposes a rewritten cell.
#[test]
fn loom_models_edge_append_then_trim() {
    model(|| {
        let edge = Arc::new(Edge::with_blocks(&[1u64], 3));
        let w = Arc::clone(&edge);
        let writer = thread::spawn(move || {
            // SAFETY: index 1 and 2 are at or above every published length (1).
            unsafe {
                w.write(1, 2);
                w.write(2, 3);
            }
            w.publish_len(3);
            w.publish_len(2);
        });
        let len = edge.len();
        // SAFETY: indices below a length loaded from this buffer.
        let seen: Vec<u64> = (0..len).map(|i| unsafe { edge.get(i) }).collect();
        assert_eq!(seen, [1, 2, 3][..len].to_vec());
        writer.join().unwrap();
    });
}

/// A child is fully built before it is linked; a reader finds it or not, never a
/// half-built node, and a tombstoned and rebuilt table stays readable until the reader
/// unpins.
#[test]
fn loom_models_child_link_unlink_rebuild() {
    model(|| {
        let parent = parent_with_table(2);
        let p = Arc::clone(&parent);
        let writer = thread::spawn(move || {
            let g = crossbeam_epoch::pin();
            let child = Owned::new(Node::new(1, 1, &[42, 43], 2)).into_shared(&g);
            // SAFETY: the parent's table is live; only this thread writes it.
            let t = unsafe { p.children.load(Ordering::Acquire, &g).deref() };
            t.insert(child, &g);
            t.remove(1, 42, &g);
            // Rebuild: publish an empty table and retire the old one, then the child.
            let old = p
                .children
                .swap(ChildTable::with_capacity(2), Ordering::AcqRel, &g);
            // SAFETY: both are unreachable from the parent now.
            unsafe {
                g.defer_destroy(old);
                g.defer_destroy(child);
            }
        });
        {
            let g = crossbeam_epoch::pin();
            // SAFETY: tables are freed only through the collector.
            let t = unsafe { parent.children.load(Ordering::Acquire, &g).deref() };
            if let Some(c) = t.get(1, 42, &g) {
                let e = c.edge.load(Ordering::Acquire, &g);
                // SAFETY: the child's edge lives as long as the child.
                let e = unsafe { e.deref() };
                assert_eq!(e.len(), 2);
                // SAFETY: below the loaded length.
                assert_eq!(unsafe { e.get(1) }, 43);
            }
        }
        writer.join().unwrap();
        // Free what is still linked (the model owns everything at the end).
        // SAFETY: no other thread remains.
        unsafe {
            let g = crossbeam_epoch::unprotected();
            drop(
                parent
                    .children
                    .swap(crossbeam_epoch::Shared::null(), Ordering::Relaxed, g)
                    .into_owned(),
            );
        }
    });
}

/// A tombstoned slot reused for another child: the slot's key hash is a filter written
/// before the pointer, so a reader that loaded the old child may see the new child's hash
/// (and then passes it over: a miss), but never takes one child for another's key, and
/// never misses a child linked for the whole lookup.
#[test]
fn loom_models_child_slot_reuse_keeps_keys_apart() {
    model(|| {
        // Two slots, one held throughout by `stays`: the second child must reuse the
        // first one's.
        let parent = parent_with_table(2);
        {
            let g = crossbeam_epoch::pin();
            let stays = Owned::new(Node::new(1, 3, &[60], 1)).into_shared(&g);
            // SAFETY: the table is live and not shared yet.
            unsafe { parent.children.load(Ordering::Acquire, &g).deref() }.insert(stays, &g);
        }
        let p = Arc::clone(&parent);
        let writer = thread::spawn(move || {
            let g = crossbeam_epoch::pin();
            // SAFETY: the parent's table is live; only this thread writes it.
            let t = unsafe { p.children.load(Ordering::Acquire, &g).deref() };
            let a = Owned::new(Node::new(1, 1, &[42], 1)).into_shared(&g);
            t.insert(a, &g);
            t.remove(1, 42, &g);
            // SAFETY: unlinked above; freed after the reader unpins.
            unsafe { g.defer_destroy(a) };
            let b = Owned::new(Node::new(1, 2, &[50], 1)).into_shared(&g);
            assert!(t.insert(b, &g), "the only free slot was a tombstone");
        });
        {
            let g = crossbeam_epoch::pin();
            // SAFETY: tables are freed only through the collector.
            let t = unsafe { parent.children.load(Ordering::Acquire, &g).deref() };
            if let Some(c) = t.get(1, 42, &g) {
                assert_eq!((c.id, c.first), (1, 42));
            }
            if let Some(c) = t.get(1, 50, &g) {
                assert_eq!((c.id, c.first), (2, 50));
            }
            let c = t
                .get(1, 60, &g)
                .expect("a child linked throughout is found");
            assert_eq!((c.id, c.first), (3, 60));
        }
        writer.join().unwrap();
        // SAFETY: no other thread remains; `stays` and `b` are the children still linked.
        unsafe {
            let g = crossbeam_epoch::unprotected();
            let t = parent
                .children
                .swap(crossbeam_epoch::Shared::null(), Ordering::Relaxed, g);
            for c in t.deref().children(g) {
                drop(c.into_owned());
            }
            drop(t.into_owned());
        }
    });
}

/// A writer of one shard and a reader of it.
fn writer_and_reader() -> (ShardWriter, TreeReader) {
    let w = ShardWriter::new();
    let reader = TreeReader {
        shards: vec![std::sync::Arc::clone(w.shared())].into(),
        merged: Default::default(),
    };
    (w, reader)
}

/// A stored chain of `(local, sequence)` hashes under the block named `parent`, or at the
/// root.
fn stored_under(
    worker: u64,
    event_id: u64,
    parent: Option<u64>,
    blocks: &[(u64, u64)],
) -> RouterEvent {
    RouterEvent::new(
        worker,
        KvCacheEvent::stored(
            event_id,
            0,
            parent.map(SequenceBlockHash),
            blocks
                .iter()
                .map(|&(l, s)| (LocalBlockHash(l), SequenceBlockHash(s))),
        ),
    )
}

/// A root-level stored chain of `(local, sequence)` hashes.
fn stored(worker: u64, event_id: u64, blocks: &[(u64, u64)]) -> RouterEvent {
    stored_under(worker, event_id, None, blocks)
}

/// The whole writer: a store, then an eviction, while a reader looks up. The reader's
/// score is one the worker had at some moment: 0, 2 or 1 for the query [1, 2].
#[test]
fn loom_models_store_evict_lookup() {
    model(|| {
        let (mut w, reader) = writer_and_reader();
        let t = thread::spawn(move || {
            w.apply_event(&stored(9, 0, &[(1, 11), (2, 12)])).unwrap();
            let evict = RouterEvent::new(9, KvCacheEvent::removed(1, 0, [SequenceBlockHash(12)]));
            w.apply_event(&evict).unwrap();
            w
        });
        let got = reader.find_matches(&[LocalBlockHash(1), LocalBlockHash(2)]);
        assert!(got.max_score() <= 2);
        assert!(got.iter().all(|(w, _)| w.worker_id == 9));
        let w = t.join().unwrap();
        assert_eq!(
            reader
                .find_matches(&[LocalBlockHash(1), LocalBlockHash(2)])
                .max_score(),
            1
        );
        drop(w);
    });
}

/// Slot assignment: the slot order (which carries the slot's worker) is published before
/// the worker's first bit, so a reader attributes every score to the right worker and emits
/// the answer sorted by worker, while a second worker (sorting before the first) arrives.
#[test]
fn loom_models_slot_order_publication() {
    model(|| {
        let (mut w, reader) = writer_and_reader();
        let t = thread::spawn(move || {
            for (i, worker) in [9u64, 3].into_iter().enumerate() {
                w.apply_event(&stored(worker, i as u64, &[(1, 11)]))
                    .unwrap();
            }
            w
        });
        let got = reader.find_matches(&[LocalBlockHash(1)]);
        let workers: Vec<u64> = got.iter().map(|(w, _)| w.worker_id).collect();
        assert!(
            matches!(workers.as_slice(), [] | [9] | [3] | [3, 9]),
            "{workers:?}"
        );
        assert!(got.iter().all(|(_, s)| s == 1));
        let w = t.join().unwrap();
        let workers: Vec<u64> = reader
            .find_matches(&[LocalBlockHash(1)])
            .iter()
            .map(|(w, _)| w.worker_id)
            .collect();
        assert_eq!(workers, [3, 9]);
        drop(w);
    });
}

/// Two shards, whose lookups emit through the merged slot order: one shard's writer adds a
/// worker (a new slot order) while a reader looks up twice, each lookup finding the cached
/// merged order current or stale (and then replacing it, the old one retired). Every answer
/// is sorted by worker, scores only workers that held the block, and always has the other
/// shard's worker; a merged order in use is never freed under its reader.
#[test]
fn loom_models_merged_order_replacement() {
    model(|| {
        let (mut a, mut b) = (ShardWriter::new(), ShardWriter::new());
        b.apply_event(&stored(5, 0, &[(1, 11)])).unwrap();
        let reader = TreeReader {
            shards: vec![
                std::sync::Arc::clone(a.shared()),
                std::sync::Arc::clone(b.shared()),
            ]
            .into(),
            merged: Default::default(),
        };
        let writer = thread::spawn(move || {
            a.apply_event(&stored(3, 0, &[(1, 11)])).unwrap();
            a
        });
        for _ in 0..2 {
            let got = reader.find_matches(&[LocalBlockHash(1)]);
            let workers: Vec<u64> = got.iter().map(|(w, _)| w.worker_id).collect();
            assert!(matches!(workers.as_slice(), [5] | [3, 5]), "{workers:?}");
            assert!(got.iter().all(|(_, s)| s == 1));
        }
        let a = writer.join().unwrap();
        let workers: Vec<u64> = reader
            .find_matches(&[LocalBlockHash(1)])
            .iter()
            .map(|(w, _)| w.worker_id)
            .collect();
        assert_eq!(workers, [3, 5]);
        drop((a, b));
    });
}

/// Two lookups that both find the merged order stale race to replace it: one wins the
/// compare-and-swap, the other retires its own; each uses the one it built, and neither is
/// freed while its lookup is pinned.
#[test]
fn loom_models_merged_order_race() {
    use super::reader::MergedCache;
    use super::shared::SlotOrder;
    use crate::worker::WorkerDp;
    model(|| {
        let orders: Arc<[SlotOrder; 2]> = Arc::new([
            SlotOrder {
                generation: 1,
                slots: vec![(0, WorkerDp::new(7, 0))].into(),
            },
            SlotOrder {
                generation: 4,
                slots: vec![(0, WorkerDp::new(2, 0))].into(),
            },
        ]);
        let cache = Arc::new(MergedCache::default());
        let run = |cache: &MergedCache, orders: &[SlotOrder; 2]| {
            let g = crossbeam_epoch::pin();
            let m = cache.get(&[&orders[0], &orders[1]], &g);
            assert_eq!(
                m.entries_for_test(),
                [(64, WorkerDp::new(2, 0)), (0, WorkerDp::new(7, 0))]
            );
        };
        let (c, o) = (Arc::clone(&cache), Arc::clone(&orders));
        let t = thread::spawn(move || run(&c, &o));
        run(&cache, &orders);
        t.join().unwrap();
    });
}

/// An eviction of `names` by `worker` (dp rank 0).
fn evicted(worker: u64, event_id: u64, names: &[u64]) -> RouterEvent {
    let names = names.iter().map(|&n| SequenceBlockHash(n));
    RouterEvent::new(worker, KvCacheEvent::removed(event_id, 0, names))
}

/// Applies `before` to a fresh shard, then `during` on a writer thread while this thread
/// looks up `query`; returns the answer as `(worker, score)` pairs.
fn lookup_during(
    before: &[RouterEvent],
    during: Vec<RouterEvent>,
    query: &[u64],
) -> Vec<(u64, u32)> {
    let (mut w, reader) = writer_and_reader();
    for e in before {
        w.apply_event(e).unwrap();
    }
    let t = thread::spawn(move || {
        for e in &during {
            w.apply_event(e).unwrap();
        }
        w
    });
    let query: Vec<LocalBlockHash> = query.iter().map(|&l| LocalBlockHash(l)).collect();
    let got = reader.find_matches(&query);
    drop(t.join().unwrap());
    got.iter().map(|(w, s)| (w.worker_id, s)).collect()
}

/// Worker 9 holds blocks [1, 2] of one node and worker 4 holds [1]; worker 9 drops block 2,
/// so the edge is trimmed to one block and worker 4 (which now holds all of it) moves from
/// the partial list to `full`, while a lookup of `query` runs.
fn lookup_during_trim_and_promotion(query: &[u64]) -> Vec<(u64, u32)> {
    let before = [stored(9, 0, &[(1, 11), (2, 12)]), stored(4, 0, &[(1, 11)])];
    lookup_during(&before, vec![evicted(9, 1, &[12])], query)
}

/// A partial holder promoted to `full` while a reader walks the node: the writer sets the
/// `full` bit, then frees the partial entry, so a reader that loaded `full` before the set
/// and the list after the free finds the worker in neither, and must look in `full` again.
/// Worker 4 holds block 1 of the node throughout, so it scores 1 in every answer.
#[test]
fn loom_models_partial_holder_promoted_to_full() {
    model(|| {
        assert_eq!(lookup_during_trim_and_promotion(&[1]), [(4, 1), (9, 1)]);
    });
}

/// The same trim and promotion, seen by a reader whose query runs past the new length. A
/// reader that loaded the edge's length before the trim and `full` after the promotion
/// would credit worker 4 with block 2, which it never held: every answer must score worker
/// 4 exactly 1, and worker 9 one of the 2 or 1 blocks it held.
#[test]
fn loom_models_trim_then_promote_past_the_query() {
    model(|| {
        let scores = lookup_during_trim_and_promotion(&[1, 2]);
        assert!(
            matches!(scores.as_slice(), [(4, 1), (9, 1 | 2)]),
            "{scores:?}"
        );
    });
}

/// A node's blocks below a lookup's divergence point replaced while the lookup goes from the
/// node to its child. Worker 9 alone holds one node `[1, 2, 3]`; the query `[1, 2, 5]` leaves
/// it at position 2. The writer then drops blocks 3 and 2 (a trim to `[1]`), stores `[7, 8]`
/// after block 1 (an append after a trim copies into a new buffer: `[1, 7, 8]`), and stores
/// `[5]` after block 7 (a child attached at position 2). A lookup that checked the node's
/// edge before the trim and looked up its child after the last store would follow a path
/// `1, 2, 5` that never existed and score worker 9 three blocks; it held at most two of the
/// query's blocks at any moment, and always block 1.
#[test]
fn loom_models_child_found_below_replaced_blocks() {
    model(|| {
        let during = vec![
            evicted(9, 1, &[13, 12]),
            stored_under(9, 2, Some(11), &[(7, 17), (8, 18)]),
            stored_under(9, 3, Some(17), &[(5, 15)]),
        ];
        let before = [stored(9, 0, &[(1, 11), (2, 12), (3, 13)])];
        let scores = lookup_during(&before, during, &[1, 2, 5]);
        assert!(matches!(scores.as_slice(), [(9, 1 | 2)]), "{scores:?}");
    });
}

/// A partial holder promoted to `full` and demoted again within one lookup's step on the
/// node: worker 5 holds the node `[1, 2, 3]`, worker 4 holds `[1, 2]` (a partial entry);
/// worker 4 stores block 3 (its `full` bit is set, then its entry freed) and drops it
/// again (a new entry, then its `full` bit cleared). A step that loads `full` before the
/// promotion, the list between the two events and `full` again after the demotion finds
/// worker 4 in none of them, though it held at least the query's first block throughout:
/// every answer must score both workers 1 for the query `[1, 9]`.
#[test]
fn loom_models_partial_holder_promoted_and_demoted() {
    model(|| {
        let before = [
            stored(5, 0, &[(1, 11), (2, 12), (3, 13)]),
            stored(4, 0, &[(1, 11), (2, 12)]),
        ];
        let during = vec![
            stored_under(4, 1, Some(12), &[(3, 13)]),
            evicted(4, 2, &[13]),
        ];
        assert_eq!(lookup_during(&before, during, &[1, 9]), [(4, 1), (5, 1)]);
    });
}

/// A worker leaving a node while a lookup is at it: worker 5 holds the node `[1, 2]`,
/// worker 4 holds block 1 (a partial entry) and drops it. The writer takes worker 4 out of
/// `any` before it frees the entry, so that at no point of the writer is a worker in `any`
/// but in neither `full` nor the list: a lookup that found one such would repeat its step
/// until the writer moved on, spinning on a writer paused in between. Worker 4 scores 1 or
/// nothing, worker 5 always 2.
#[test]
fn loom_models_holder_leaves_a_node() {
    model(|| {
        let before = [stored(5, 0, &[(1, 11), (2, 12)]), stored(4, 0, &[(1, 11)])];
        let scores = lookup_during(&before, vec![evicted(4, 1, &[11])], &[1, 2]);
        assert!(
            matches!(scores.as_slice(), [(4, 1), (5, 2)] | [(5, 2)]),
            "{scores:?}"
        );
    });
}
