//! The lock-free index: a radix tree sharded by worker, one writer per shard, lock-free
//! `find_matches` from any thread under crossbeam-epoch guards.
//!
//! # Shape, and why
//!
//! Workers are partitioned into **shards** ([`ShardMap`]: round-robin by arrival; all dp
//! ranks of a worker in one shard). Each shard is a compressed radix tree with exactly
//! **one writer**, the [`ShardWriter`], which a thread-per-core runtime pins to one core:
//! every event of a worker is applied by that core, so per-worker order needs no lock and
//! the writer never contends with another writer (no CAS loops, no lock on shared nodes).
//! Readers ([`TreeReader`]) walk every shard's tree and merge the scores; worker sets of
//! shards are disjoint, and each shard's writer publishes its slots in worker order, so the
//! answer comes out sorted with no sort: over up to four shards through the shards' orders
//! merged once per change (cached in the reader), otherwise one linear merge per shard.
//!
//! The alternative — one tree shared by all writer cores, with atomic worker bitsets per
//! node — saves the per-shard walks (one walk instead of S) and shares prefixes across
//! shards, but every structural change (a new child, an eviction that frees a node) would
//! need writer-writer synchronisation on shared nodes, and Dynamo's own notes found its
//! prefix-sharded variant fast only while it was wrong. We choose the design whose
//! correctness argument is a single-writer one, and pay S walks per lookup; S is the number
//! of writer cores (1–4 on the machines we target), and each walk stops as soon as no worker
//! of that shard matches.
//!
//! # The tree
//!
//! A node ([`raw::node`]) is a compressed path: an edge of local hashes. **Blocks never
//! move**: a branch in the middle of an edge is a child *attached* at that position
//! (children are keyed by `(attach position, first local hash)`), not a split, so a
//! worker's map from sequence hash to `(node, position)` stays valid for the block's whole
//! life. Each worker holds a prefix `[0, cutoff)` of every node it touches (prefix closure);
//! per node, dense **worker-slot bitsets** `full` (holds the whole edge) and `any` (holds
//! the first block), plus a short `partial` list of `(slot, cutoff)` for the rest. A lookup
//! therefore costs O(depth) word operations, plus one step per worker that drops out.
//!
//! Memory is **bounded by construction**: when the last worker drops a block, the edge is
//! trimmed (and compacted when mostly slack); a node nobody holds is unlinked at once and
//! freed through the epoch collector; no node without a live block survives an event
//! (`tests/tests/index_tree.rs` checks node counts against block counts). Per cached block we
//! keep 8 bytes of local hash (shared by all its holders) and, in the holder's hash map
//! (sequence hash → node, position), one 16-byte entry and its tag byte at up to 7/8 load
//! ([`blockmap`]). Sequence hashes are not stored in the tree: the rare operations that
//! need a worker's names below a block (a removal in the middle of a chain, a renamed path)
//! scan that worker's map.
//!
//! # Writers and readers
//!
//! [`writer`] applies events; [`reader`] answers lookups. The lock-free building blocks are
//! in [`raw`], each with its invariants. All memory that a reader can reach is freed only by
//! `defer_destroy` after it is unlinked, so a pinned reader never touches freed memory.
//!
//! # Consistency
//!
//! A lookup never blocks and is never blocked (it is lock-free: a node's step is repeated
//! only when the writer replaced or trimmed that node's edge, or moved one of its holders
//! between `full` and the partial list and back, during the step's few loads; see
//! `reader::node_step`). While a write is in flight it may observe:
//!
//! * for each worker, a score between the lowest and the highest score that worker had at
//!   some moment during the lookup — in particular a count that is **briefly short** while
//!   blocks are being stored, or **briefly long** (the blocks of an eviction in progress);
//! * never a block that the worker did not hold at some moment during the lookup, and never
//!   a path that did not exist (blocks are immutable once published; edge cells are never
//!   rewritten while a reader may read them);
//! * scores of different workers from slightly different moments (the answer is not an
//!   atomic snapshot across workers);
//! * never a worker's slot attributed to another worker: slots of removed workers are
//!   reused only after a grace period.
//!
//! "A moment during the lookup" counts events by their effect: a worker's state before an
//! event that was being applied while the lookup ran, and its state after it, both belong
//! to the lookup (`tests/tests/index_tree.rs` checks each answer against every state of the
//! shard from the one the lookup started on to one event past the one it returned on).
//! One exception: a stored chain that reuses names the worker holds at other positions
//! first drops those blocks (and what the worker holds below them), then stores the
//! chain, so a lookup in flight may see that worker's count dip below both its count
//! before the event and after it, for the moment in between. Engines that name blocks by
//! content never do this; it takes a worker that renames its blocks.
//!
//! Once the writer has applied an event and the lookup starts after that, the lookup sees
//! the event (`Release` on publication, `Acquire` on every load a lookup makes).

mod blockmap;
mod garbage;
#[cfg(all(test, loom))]
mod loom_models;
pub(crate) mod raw;
mod reader;
mod shared;
mod writer;

use ahash::AHashMap;
use std::sync::{Arc, PoisonError, RwLock};

use shared::ShardShared;
pub use writer::ShardWriter;

use super::{ApplyError, ApplyOutcome, Index, OverlapScores, TierScores, WorkerSummary};
use crate::event::RouterEvent;
use crate::hash::{LocalBlockHash, local_hashes_as_u64};
use crate::snapshot::LowerRecord;
use crate::sync::Ordering;
use crate::worker::{WorkerDp, WorkerId};

/// Which shard owns each worker. A worker gets a shard the first time it is asked for —
/// the shard that then has the fewest live workers, the lowest such on ties (round-robin by
/// arrival) — and keeps it for the map's lifetime, so that every event, dp rank and
/// removal of one worker goes to one writer, even across a removal and a return (a removed
/// worker's events may still be queued at its old writer). A hash of the id cannot balance a
/// handful of workers (the one we used put 9 of the ids 0–15 on one of two shards, and that
/// shard's writer set the pace); counting can. Counts are of **live** workers: whoever
/// removes a worker [`releases`](ShardMap::release) it, so that churn (restarts come back
/// under new ids) does not leave "fewest workers" meaning "fewest ever seen". The map keeps
/// one entry per worker id it has seen.
///
/// One per [`TreeIndex`] ([`TreeIndex::shard_map`]); whoever routes events to its writers
/// (the ingest, a benchmark) asks it, as [`TreeIndex::apply`] does.
#[derive(Debug)]
pub struct ShardMap {
    shards: usize,
    inner: RwLock<ShardMapInner>,
}

#[derive(Debug, Default)]
struct ShardMapInner {
    /// Each worker's shard, and whether it is live (counted).
    of: AHashMap<WorkerId, (u32, bool)>,
    /// Live workers per shard.
    counts: Vec<u32>,
}

impl ShardMap {
    /// A map over `shards` shards (at least one).
    pub fn new(shards: usize) -> Self {
        let shards = shards.max(1);
        Self {
            shards,
            inner: RwLock::new(ShardMapInner {
                of: AHashMap::new(),
                counts: vec![0; shards],
            }),
        }
    }

    /// Number of shards.
    pub fn shards(&self) -> usize {
        self.shards
    }

    /// The shard of `worker_id`, assigned now if it has none; a released worker counts as
    /// live again.
    pub fn shard_of(&self, worker_id: WorkerId) -> usize {
        if self.shards == 1 {
            return 0;
        }
        {
            let g = self.inner.read().unwrap_or_else(PoisonError::into_inner);
            if let Some(&(s, true)) = g.of.get(&worker_id) {
                return s as usize;
            }
        }
        // Nothing under the lock can panic; a poisoned lock still holds a whole map.
        let mut g = self.inner.write().unwrap_or_else(PoisonError::into_inner);
        let g = &mut *g;
        match g.of.get_mut(&worker_id) {
            Some((s, live)) => {
                if !*live {
                    *live = true;
                    g.counts[*s as usize] += 1;
                }
                *s as usize
            }
            None => {
                let s = (0..self.shards).min_by_key(|&i| g.counts[i]).unwrap_or(0);
                g.counts[s] += 1;
                g.of.insert(worker_id, (s as u32, true));
                s
            }
        }
    }

    /// The shard of `worker_id` if it has one, live or released (every worker has shard 0
    /// of one shard).
    pub fn get(&self, worker_id: WorkerId) -> Option<usize> {
        if self.shards == 1 {
            return Some(0);
        }
        let g = self.inner.read().unwrap_or_else(PoisonError::into_inner);
        g.of.get(&worker_id).map(|&(s, _)| s as usize)
    }

    /// The worker was removed: it no longer counts toward its shard (it keeps the shard,
    /// should it come back).
    pub fn release(&self, worker_id: WorkerId) {
        if self.shards == 1 {
            return;
        }
        let mut g = self.inner.write().unwrap_or_else(PoisonError::into_inner);
        let g = &mut *g;
        if let Some((s, live)) = g.of.get_mut(&worker_id)
            && *live
        {
            *live = false;
            g.counts[*s as usize] -= 1;
        }
    }

    /// Live workers per shard.
    pub fn live_counts(&self) -> Vec<u32> {
        let g = self.inner.read().unwrap_or_else(PoisonError::into_inner);
        g.counts.clone()
    }
}

impl ShardWriter {
    /// Applies one event of a worker of this shard.
    pub fn apply_event(&mut self, event: &RouterEvent) -> Result<ApplyOutcome, ApplyError> {
        let guard = crossbeam_epoch::pin();
        self.apply_in(event, &guard)
    }

    /// Drops every block of one (worker, dp rank) of this shard.
    pub fn clear_worker(&mut self, worker: WorkerDp) -> usize {
        self.clear_in(worker, &crossbeam_epoch::pin())
    }

    /// Drops and forgets every dp rank of `worker_id`.
    pub fn remove_worker(&mut self, worker_id: WorkerId) -> usize {
        self.remove_worker_in(worker_id, &crossbeam_epoch::pin())
    }

    /// Drops and forgets one (worker, dp rank); the worker's other ranks stay.
    pub fn remove_dp(&mut self, worker: WorkerDp) -> usize {
        self.remove_slots_in(|w| w == worker, &crossbeam_epoch::pin())
    }

    /// The workers of this shard.
    pub fn workers(&self) -> Vec<WorkerSummary> {
        let mut v: Vec<WorkerSummary> = self.summaries().collect();
        v.sort_by_key(|s| s.worker);
        v
    }

    /// What this shard knows of one (worker, dp rank).
    pub fn summary(&self, worker: WorkerDp) -> Option<WorkerSummary> {
        self.summary_of(worker)
    }

    /// Blocks held by this shard's workers.
    pub fn block_count(&self) -> usize {
        self.blocks_held()
    }

    /// Heap bytes of this shard.
    pub fn heap_bytes(&self) -> usize {
        self.heap_bytes_in(&crossbeam_epoch::pin())
    }

    /// Live tree nodes of this shard (without the root).
    pub fn node_count(&self) -> usize {
        self.live_nodes()
    }

    /// Events that rebuild this shard's state.
    pub fn dump(&self) -> Vec<RouterEvent> {
        self.dump_in(&crossbeam_epoch::pin())
    }

    /// Appends the events that rebuild one (worker, dp rank)'s state to `events` (a
    /// `Cleared`, then its blocks, parents first; nothing for a worker this shard does not
    /// know). [`Self::dump`] is this for every worker in order, so a dump can be taken a
    /// worker at a time with events applied in between.
    pub fn dump_worker(&self, worker: WorkerDp, events: &mut Vec<RouterEvent>) {
        self.dump_worker_in(worker, events, &crossbeam_epoch::pin())
    }

    /// Appends one (worker, dp rank)'s lower-tier blocks to `out`, as a snapshot keeps them
    /// (engine name and path hash, [`crate::index::tiers`]).
    pub fn dump_lower_worker(&self, worker: WorkerDp, out: &mut Vec<LowerRecord>) {
        let lower = self.read_lower();
        out.extend(
            lower
                .blocks_of_worker(worker)
                .map(|(tier, name, path)| LowerRecord {
                    worker,
                    tier,
                    name,
                    path,
                }),
        );
    }

    /// Appends this shard's shared-pool blocks to `out`, as a snapshot keeps them.
    pub fn dump_pool(&self, out: &mut Vec<crate::snapshot::PoolRecord>) {
        let lower = self.read_lower();
        out.extend(
            lower
                .pool_blocks()
                .map(|(source, name, path)| crate::snapshot::PoolRecord { source, name, path }),
        );
    }

    /// Places a shared-pool block as [`Self::dump_pool`] gave it; returns whether it is new.
    /// A pool's source needs no worker slot.
    pub fn restore_pool(&mut self, r: &crate::snapshot::PoolRecord) -> bool {
        self.with_lower(|l| l.pool_restore(r.source, r.name, r.path))
    }

    /// Places a lower-tier block as [`Self::dump_lower_worker`] gave it, for a worker this
    /// shard knows; returns whether it was placed (not for the device tier, nor for an
    /// unknown worker).
    pub fn restore_lower(&mut self, r: &LowerRecord) -> bool {
        let Some(t) = crate::index::tiers::lower_index(r.tier) else {
            return false;
        };
        if self.summary_of(r.worker).is_none() {
            return false;
        }
        self.with_lower(|l| l.restore(r.worker, t, r.name, r.path))
    }
}

/// A cheap, cloneable handle for lock-free lookups from any thread.
#[derive(Debug, Clone)]
pub struct TreeReader {
    shards: Arc<[Arc<ShardShared>]>,
    merged: Arc<reader::MergedCache>,
}

impl TreeReader {
    /// Writes the scores of `query` into `out` (cleared first).
    pub fn find_matches_into(&self, query: &[LocalBlockHash], out: &mut OverlapScores) {
        out.clear();
        let q = local_hashes_as_u64(query);
        let guard = crossbeam_epoch::pin();
        reader::find_in_shards(&self.shards, &self.merged, q, out, &guard);
    }

    /// The scores of `query`.
    pub fn find_matches(&self, query: &[LocalBlockHash]) -> OverlapScores {
        let mut out = OverlapScores::new();
        self.find_matches_into(query, &mut out);
        out
    }

    /// Whether any shard holds lower-tier blocks (one load per shard).
    pub fn has_lower_tiers(&self) -> bool {
        self.shards
            .iter()
            .any(|s| s.lower_blocks.load(Ordering::Acquire) > 0)
    }

    /// Blocks held on lower tiers, all shards.
    pub fn lower_block_count(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lower_blocks.load(Ordering::Acquire) as usize)
            .sum()
    }

    /// How far each worker's lower tiers continue the request past its device score in
    /// `device` ([`crate::index::tiers`]); `paths` are the request's path hashes. Takes each
    /// shard's read lock only when that shard holds lower-tier blocks.
    pub fn tier_overlaps_into(&self, paths: &[u64], device: &OverlapScores, out: &mut TierScores) {
        out.clear();
        for s in self.shards.iter() {
            if s.lower_blocks.load(Ordering::Acquire) > 0 {
                let lower = s.lower.read().unwrap_or_else(PoisonError::into_inner);
                lower.overlaps_into(paths, device, out);
            }
        }
        out.finish();
    }
}

/// The lock-free index driven from one thread: owns every shard's writer and applies each
/// event on the calling thread. For the thread-per-core deployment, take the writers apart
/// with [`TreeIndex::into_parts`] and give each to its core.
#[derive(Debug)]
pub struct TreeIndex {
    writers: Vec<ShardWriter>,
    reader: TreeReader,
    map: Arc<ShardMap>,
}

impl Default for TreeIndex {
    fn default() -> Self {
        Self::new(1)
    }
}

impl TreeIndex {
    /// An empty index with `shards` shards (at least one).
    pub fn new(shards: usize) -> Self {
        let writers: Vec<ShardWriter> = (0..shards.max(1)).map(|_| ShardWriter::new()).collect();
        let reader = TreeReader {
            shards: writers.iter().map(|w| Arc::clone(w.shared())).collect(),
            merged: Arc::default(),
        };
        let map = Arc::new(ShardMap::new(writers.len()));
        Self {
            writers,
            reader,
            map,
        }
    }

    /// A lookup handle that stays valid while the writers live.
    pub fn reader(&self) -> TreeReader {
        self.reader.clone()
    }

    /// Which shard owns each worker; take it before [`Self::into_parts`] to route events
    /// to the writers.
    pub fn shard_map(&self) -> Arc<ShardMap> {
        Arc::clone(&self.map)
    }

    /// The per-shard writers (route each worker with the [`ShardMap`] of
    /// [`Self::shard_map`]) and a reader.
    pub fn into_parts(self) -> (Vec<ShardWriter>, TreeReader) {
        (self.writers, self.reader)
    }

    fn writer_for(&mut self, worker_id: WorkerId) -> &mut ShardWriter {
        &mut self.writers[self.map.shard_of(worker_id)]
    }

    /// Heap bytes held by the index (nodes, edges, tables, block maps).
    pub fn heap_bytes(&self) -> usize {
        self.writers.iter().map(|w| w.heap_bytes()).sum()
    }

    /// Live tree nodes (without roots).
    pub fn node_count(&self) -> usize {
        self.writers.iter().map(|w| w.node_count()).sum()
    }
}

impl Index for TreeIndex {
    fn name(&self) -> &'static str {
        "tree"
    }

    fn apply(&mut self, event: RouterEvent) -> Result<ApplyOutcome, ApplyError> {
        self.writer_for(event.worker_id).apply_event(&event)
    }

    fn find_matches_into(&self, query: &[LocalBlockHash], out: &mut OverlapScores) {
        self.reader.find_matches_into(query, out);
    }

    fn tier_overlaps_into(
        &self,
        _query: &[LocalBlockHash],
        paths: &[u64],
        device: &OverlapScores,
        out: &mut TierScores,
    ) {
        self.reader.tier_overlaps_into(paths, device, out);
    }

    fn lower_block_count(&self) -> usize {
        self.reader.lower_block_count()
    }

    fn clear(&mut self, worker: WorkerDp) -> usize {
        // A worker without a shard has nothing to clear (and gets no shard for it).
        match self.map.get(worker.worker_id) {
            Some(s) => self.writers[s].clear_worker(worker),
            None => 0,
        }
    }

    fn remove_worker(&mut self, worker_id: WorkerId) -> usize {
        match self.map.get(worker_id) {
            Some(s) => self.writers[s].remove_worker(worker_id),
            None => 0,
        }
    }

    fn workers(&self) -> Vec<WorkerSummary> {
        let mut v: Vec<WorkerSummary> = self.writers.iter().flat_map(|w| w.workers()).collect();
        v.sort_by_key(|s| s.worker);
        v
    }

    fn block_count(&self) -> usize {
        self.writers.iter().map(|w| w.block_count()).sum()
    }

    fn dump(&self) -> Vec<RouterEvent> {
        let mut events: Vec<RouterEvent> = self.writers.iter().flat_map(|w| w.dump()).collect();
        // Group by worker, keeping each worker's parent-first order.
        events.sort_by_key(|e| e.worker());
        events
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn shard_map_balances_workers_by_arrival_and_keeps_them() {
        let map = ShardMap::new(2);
        // Ids a hash split 9 / 7; any arrival order splits them 8 / 8.
        let order = [3u64, 0, 15, 7, 8, 1, 2, 14, 4, 5, 6, 9, 10, 11, 12, 13];
        let first: Vec<usize> = order.iter().map(|&w| map.shard_of(w)).collect();
        assert_eq!(first.iter().filter(|&&s| s == 0).count(), 8);
        assert_eq!(first[..4], [0, 1, 0, 1]);
        // Sticky: asked again, in any order, the same shard.
        for (&w, &s) in order.iter().zip(&first).rev() {
            assert_eq!(map.shard_of(w), s);
            assert_eq!(map.get(w), Some(s));
        }
        // `get` assigns nothing.
        assert_eq!(map.get(99), None);
        assert_eq!(map.shard_of(99), 0);
        assert_eq!(ShardMap::new(1).get(5), Some(0));
        assert_eq!(ShardMap::new(0).shards(), 1);
    }

    #[test]
    fn shard_map_counts_live_workers_so_churn_stays_balanced() {
        let map = ShardMap::new(2);
        assert_eq!((map.shard_of(1), map.shard_of(2)), (0, 1));
        // Shard 0's workers keep leaving and coming back under new ids; shard 1 keeps its
        // one. Counting every id ever seen would send every newcomer to shard 1.
        let mut on_zero = 1;
        for id in 10..20 {
            map.release(on_zero);
            assert_eq!(map.live_counts(), [0, 1]);
            assert_eq!(map.shard_of(id), 0, "id {id}");
            on_zero = id;
        }
        assert_eq!(map.live_counts(), [1, 1]);
        // A released worker that comes back keeps its shard and counts again; releasing
        // twice counts once.
        map.release(2);
        map.release(2);
        assert_eq!(map.live_counts(), [1, 0]);
        assert_eq!(map.get(2), Some(1));
        assert_eq!(map.shard_of(2), 1);
        assert_eq!(map.live_counts(), [1, 1]);
        map.release(99);
        assert_eq!(map.live_counts(), [1, 1]);
    }

    #[test]
    fn removing_an_unseen_worker_assigns_it_no_shard() {
        let mut idx = TreeIndex::new(2);
        assert_eq!(idx.remove_worker(7), 0);
        assert_eq!(idx.clear(WorkerDp::new(7, 0)), 0);
        assert_eq!(idx.shard_map().get(7), None);
    }
}
