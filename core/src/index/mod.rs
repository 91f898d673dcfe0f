//! The KV index: which blocks every worker holds, and how much of a request each can reuse.
//!
//! # The model
//!
//! A block is identified by its **path**: the local hashes of the block and of every block
//! before it, from the root. Each (worker, dp rank) — a [`WorkerDp`] — holds a set of paths,
//! and names each held path by the engine's sequence hash (one id per path). The state of a
//! `WorkerDp` is always **prefix-closed**: it holds a path only if it holds the path's
//! parent. A query is the list of a request's local hashes `q[0..n)`; the **score** of a
//! worker is the largest `m` such that it holds every path `q[0..1)`, ..., `q[0..m)`.
//! [`Index::find_matches`] returns the positive scores (Dynamo's
//! `find_matches(query, early_exit = false)`).
//!
//! # Semantics of each event, pinned down
//!
//! Each choice matches Dynamo 1.6.1's `RadixTree` wherever that is sane; the differences
//! are marked.
//!
//! * **Stored** `{parent, blocks}`: the chain hangs under the path that the worker names
//!   `parent` (the root when `parent` is `None`), `blocks[i]` under `blocks[i-1]`.
//!   * **Unknown parent** — the worker holds no block named `parent`: the whole event is
//!     rejected with [`ApplyError::ParentNotFound`] and nothing changes (as Dynamo). It means
//!     the router missed events of this worker; the ingest resynchronises it.
//!   * **Invalid chain** — the same sequence hash twice in the chain, or a chain block that
//!     the worker holds as the parent or one of its ancestors (a cycle): rejected with
//!     [`ApplyError::InvalidBlockSequence`], nothing changes (Dynamo rejects only the
//!     parent-in-chain case and may corrupt its tree on the others).
//!   * **Duplicate store** — a block the worker already holds at the same path under the
//!     same hash: a no-op, counted in [`ApplyOutcome::duplicate`] (as Dynamo). Replays and
//!     overlapping dumps are therefore idempotent.
//!   * **Moved hash** — a sequence hash the worker holds at a *different* path (an engine
//!     that reuses block ids): the old block and everything the worker holds below it are
//!     dropped first, then the new one is stored. **Renamed path** — a path the worker holds
//!     under a different hash: the path is kept and is now named by the new hash. (Dynamo
//!     keeps stale entries in both cases.)
//!   * **The same block stored by many workers**: each worker holds its own copy; the
//!     tree node is shared.
//! * **Removed** `{hashes}`: in order, each named block is dropped **with every block the
//!   worker holds below it**, so the state stays prefix-closed. Dynamo truncates the
//!   worker's coverage at the removed block as well (its descendants stop counting); it
//!   keeps them in its lookup table, so that re-storing the removed block alone revives them,
//!   which we do not. Engines evict leaf-first, where the two agree exactly.
//!   * **Unknown block** — not held by the worker: skipped and counted in
//!     [`ApplyOutcome::not_found`]; the rest of the event is applied. Not an error: a replayed
//!     removal is a no-op. (Dynamo logs a warning and returns `BlockNotFound`.)
//! * **Cleared**: the `WorkerDp` drops every block; it stays known (with its last event
//!   id). Other dp ranks of the worker are untouched (as Dynamo).
//! * [`Index::remove_worker`] drops every dp rank of a worker and forgets it.
//!
//! Every applied event records its `event_id` as the `WorkerDp`'s last event id (even when
//! rejected: the event was seen). Ordering and gap detection by event id belong to the
//! ingest, not to the index.
//!
//! The tree above is the **device** tier. Events of the lower tiers (host-pinned, disk,
//! external) are kept beside it ([`tiers`]) and never change a device score; a device
//! `Cleared` clears the worker's lower tiers too, a lower-tier `Cleared` only its tier, and
//! [`Index::remove_worker`] all of them. Shared-pool events (residency `cache_owner`,
//! not [`RouterEvent::is_worker_owned`]) are kept beside them too, in the
//! [`TreeIndex`] only (`tiers`, "The shared pool"); other indexes take worker-owned events.

pub mod approx;
pub mod ops;
mod reference;
pub mod tiers;
pub mod tree;

pub use approx::{ApproxConfig, ApproxIndex};
pub use reference::ReferenceIndex;
pub use tiers::{LowerTiers, PoolReaders, PoolReadersError, TierOverlap, TierScores};
pub use tree::{ShardWriter, TreeIndex, TreeReader};

use crate::event::RouterEvent;
use crate::hash::{LocalBlockHash, SequenceBlockHash};
use crate::worker::{WorkerDp, WorkerId};

/// What applying one event did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ApplyOutcome {
    /// Blocks newly held (stored, moved or renamed).
    pub stored: u32,
    /// Stored blocks that were already held at the same path under the same hash.
    pub duplicate: u32,
    /// Blocks dropped, including descendants dropped with a removed or moved block.
    pub removed: u32,
    /// Removed hashes the worker did not hold.
    pub not_found: u32,
}

impl ApplyOutcome {
    /// Adds another outcome into this one.
    pub fn merge(&mut self, o: ApplyOutcome) {
        self.stored += o.stored;
        self.duplicate += o.duplicate;
        self.removed += o.removed;
        self.not_found += o.not_found;
    }
}

/// Why an event was rejected. A rejected event changes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ApplyError {
    /// A store's parent is not held by the worker: events were missed.
    #[error("worker {worker}: stored event {event_id} hangs under unknown parent {parent:?}")]
    ParentNotFound {
        /// The worker.
        worker: WorkerDp,
        /// The event.
        event_id: u64,
        /// The unknown parent.
        parent: SequenceBlockHash,
    },
    /// A store names one block twice, or stores an ancestor of itself.
    #[error("worker {worker}: stored event {event_id} is not a valid chain (block {block:?})")]
    InvalidBlockSequence {
        /// The worker.
        worker: WorkerDp,
        /// The event.
        event_id: u64,
        /// The offending block.
        block: SequenceBlockHash,
    },
}

impl ApplyError {
    /// A short stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            ApplyError::ParentNotFound { .. } => "parent_not_found",
            ApplyError::InvalidBlockSequence { .. } => "invalid_block_sequence",
        }
    }
}

/// Per-worker scores of one query: `(worker, score)` for every worker with a positive
/// score, sorted by worker.
#[derive(Clone, Default)]
pub struct OverlapScores {
    scores: Vec<(WorkerDp, u32)>,
    /// Scratch of [`Self::merge_run`], kept for reuse across queries; not part of the value.
    scratch: Vec<(WorkerDp, u32)>,
}

impl PartialEq for OverlapScores {
    fn eq(&self, other: &Self) -> bool {
        self.scores == other.scores
    }
}

impl Eq for OverlapScores {}

impl std::fmt::Debug for OverlapScores {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OverlapScores")
            .field("scores", &self.scores)
            .finish()
    }
}

impl OverlapScores {
    /// An empty answer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Empties the answer, keeping its memory (for reuse across queries).
    pub fn clear(&mut self) {
        self.scores.clear();
    }

    /// Records a worker's score; zero scores are dropped. Backends call [`Self::finish`]
    /// after the last push.
    #[inline]
    pub fn push(&mut self, worker: WorkerDp, score: u32) {
        if score > 0 {
            self.scores.push((worker, score));
        }
    }

    /// Sorts by worker (each worker must have been pushed at most once).
    pub fn finish(&mut self) {
        self.scores.sort_unstable_by_key(|&(w, _)| w);
        debug_assert!(
            self.scores.windows(2).all(|p| p[0].0 != p[1].0),
            "a worker scored twice"
        );
    }

    /// Merges the entries pushed since `start`, sorted by worker, into the sorted entries
    /// before them (for backends that emit sorted runs: no sort, one pass). The two runs
    /// must not share a worker.
    pub fn merge_run(&mut self, start: usize) {
        let s = &mut self.scores;
        debug_assert!(
            s[start..].windows(2).all(|p| p[0].0 < p[1].0),
            "unsorted run"
        );
        if start == 0 || start == s.len() || s[start - 1].0 < s[start].0 {
            return;
        }
        let left = &mut self.scratch;
        left.clear();
        left.extend_from_slice(&s[..start]);
        let (mut i, mut j, mut k) = (0, start, 0);
        while i < left.len() {
            if j < s.len() && s[j].0 < left[i].0 {
                s[k] = s[j];
                j += 1;
            } else {
                s[k] = left[i];
                i += 1;
            }
            k += 1;
        }
        debug_assert!(
            s.windows(2).all(|p| p[0].0 < p[1].0),
            "a worker scored twice"
        );
    }

    /// Takes, per worker, the larger of its score here and in `other` (both sorted by
    /// worker), in one pass; reuses this answer's scratch, so nothing is allocated once
    /// warm.
    pub fn merge_max(&mut self, other: &OverlapScores) {
        if other.scores.is_empty() {
            return;
        }
        let (a, b) = (&mut self.scratch, &other.scores);
        a.clear();
        a.append(&mut self.scores);
        let out = &mut self.scores;
        let (mut i, mut j) = (0, 0);
        while i < a.len() || j < b.len() {
            if j == b.len() || (i < a.len() && a[i].0 < b[j].0) {
                out.push(a[i]);
                i += 1;
            } else if i == a.len() || b[j].0 < a[i].0 {
                out.push(b[j]);
                j += 1;
            } else {
                out.push((a[i].0, a[i].1.max(b[j].1)));
                i += 1;
                j += 1;
            }
        }
    }

    /// The score of `worker` (0 when absent).
    pub fn get(&self, worker: WorkerDp) -> u32 {
        self.scores
            .binary_search_by_key(&worker, |&(w, _)| w)
            .map_or(0, |i| self.scores[i].1)
    }

    /// `(worker, score)` pairs, sorted by worker.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (WorkerDp, u32)> + '_ {
        self.scores.iter().copied()
    }

    /// The pairs as a slice, sorted by worker.
    pub fn as_slice(&self) -> &[(WorkerDp, u32)] {
        &self.scores
    }

    /// Number of workers with a positive score.
    pub fn len(&self) -> usize {
        self.scores.len()
    }

    /// Whether no worker matched.
    pub fn is_empty(&self) -> bool {
        self.scores.is_empty()
    }

    /// The highest score (0 when empty).
    pub fn max_score(&self) -> u32 {
        self.scores.iter().map(|&(_, s)| s).max().unwrap_or(0)
    }
}

impl FromIterator<(WorkerDp, u32)> for OverlapScores {
    fn from_iter<T: IntoIterator<Item = (WorkerDp, u32)>>(iter: T) -> Self {
        let mut s = OverlapScores::new();
        for (w, v) in iter {
            s.push(w, v);
        }
        s.finish();
        s
    }
}

/// What an index knows of one (worker, dp rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerSummary {
    /// The worker.
    pub worker: WorkerDp,
    /// Blocks it holds.
    pub blocks: usize,
    /// The id of the last event applied for it.
    pub last_event_id: Option<u64>,
}

/// An index of the blocks every worker holds. Implemented by the [`ReferenceIndex`] (the
/// oracle) and by every fast backend; all must give the same answers (see the module docs
/// for the semantics).
pub trait Index {
    /// A short name (`reference`, ...), as `--index` takes it.
    fn name(&self) -> &'static str;

    /// Applies one event to the worker's state.
    fn apply(&mut self, event: RouterEvent) -> Result<ApplyOutcome, ApplyError>;

    /// Writes the scores of `query` into `out` (which is cleared first).
    fn find_matches_into(&self, query: &[LocalBlockHash], out: &mut OverlapScores);

    /// Writes into `out` how far each worker's lower tiers continue `query` past its device
    /// score in `device` ([`tiers`]); `paths` are the query's path hashes
    /// ([`crate::hash::sequence_hashes`]). An index without lower tiers leaves it empty.
    fn tier_overlaps_into(
        &self,
        query: &[LocalBlockHash],
        paths: &[u64],
        device: &OverlapScores,
        out: &mut TierScores,
    ) {
        let _ = (query, paths, device);
        out.clear();
    }

    /// Blocks held on lower tiers (0 for an index without them).
    fn lower_block_count(&self) -> usize {
        0
    }

    /// The scores of `query`.
    fn find_matches(&self, query: &[LocalBlockHash]) -> OverlapScores {
        let mut out = OverlapScores::new();
        self.find_matches_into(query, &mut out);
        out
    }

    /// Drops every block of one (worker, dp rank), keeping it known. Returns the blocks
    /// dropped.
    fn clear(&mut self, worker: WorkerDp) -> usize;

    /// Drops every dp rank of `worker_id` and forgets them. Returns the blocks dropped.
    fn remove_worker(&mut self, worker_id: WorkerId) -> usize;

    /// Every known (worker, dp rank), sorted.
    fn workers(&self) -> Vec<WorkerSummary>;

    /// Total blocks held, summed over workers.
    fn block_count(&self) -> usize;

    /// Events that rebuild this state in an empty index (or reset and rebuild these workers
    /// in a non-empty one): per worker a `Cleared`, then `Stored` chains parent-first. Every
    /// event of a worker carries that worker's last event id.
    fn dump(&self) -> Vec<RouterEvent>;
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn scores(ws: &[u64]) -> Vec<(WorkerDp, u32)> {
        ws.iter()
            .map(|&w| (WorkerDp::new(w, 0), w as u32 + 1))
            .collect()
    }

    #[test]
    fn merge_max_keeps_each_workers_larger_score() {
        let of = |v: &[(u64, u32)]| {
            let mut o = OverlapScores::new();
            for &(w, s) in v {
                o.push(WorkerDp::new(w, 0), s);
            }
            o.finish();
            o
        };
        let mut a = of(&[(1, 3), (4, 1), (6, 2)]);
        a.merge_max(&of(&[(2, 5), (4, 7), (6, 1), (9, 2)]));
        assert_eq!(a, of(&[(1, 3), (2, 5), (4, 7), (6, 2), (9, 2)]));
        // Either side empty.
        let mut e = OverlapScores::new();
        e.merge_max(&of(&[(3, 1)]));
        assert_eq!(e, of(&[(3, 1)]));
        e.merge_max(&OverlapScores::new());
        assert_eq!(e, of(&[(3, 1)]));
    }

    #[test]
    fn merge_run_equals_a_sort() {
        let cases: [(&[u64], &[u64]); 6] = [
            (&[], &[]),
            (&[], &[1, 5]),
            (&[2, 4], &[]),
            (&[1, 2], &[3, 9]),
            (&[3, 9], &[1, 2]),
            (&[1, 4, 6, 10], &[0, 2, 5, 11, 12]),
        ];
        for (a, b) in cases {
            let mut o = OverlapScores::new();
            for &(w, s) in scores(a).iter().chain(&scores(b)) {
                o.push(w, s);
            }
            o.merge_run(a.len());
            let mut want = scores(a);
            want.extend(scores(b));
            want.sort();
            assert_eq!(o.as_slice(), &want[..], "{a:?} + {b:?}");
            // The scratch is not part of the value.
            let mut fresh = OverlapScores::new();
            for &(w, s) in &want {
                fresh.push(w, s);
            }
            assert_eq!(o, fresh);
        }
    }
}
