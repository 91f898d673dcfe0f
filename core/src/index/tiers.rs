//! The lower storage tiers: blocks a worker keeps in host memory, on disk or in external
//! storage, and how far each continues a request past the device prefix.
//!
//! # What is counted (Dynamo 1.6.1's definitions)
//!
//! For a request `q[0..n)` and a worker whose device score is `d`:
//!
//! * **host** is how many blocks `q[d..)` the worker holds on the host-pinned tier, one
//!   after another from position `d`;
//! * then **disk** is how many further blocks it holds on disk from where host stopped, and
//!   **external** how many further in external storage from where disk stopped. Dynamo
//!   reports disk and external together as its disk figure ([`TierOverlap::disk`]), and its
//!   cost credits them with one weight.
//!
//! A tier that holds nothing at the position passes it on to the next tier unchanged. A
//! block held on the device and on a lower tier counts once, on the device: lower tiers are
//! only looked at past the device prefix. A worker with no device match starts from 0.
//! (Dynamo 1.6.1: `query_lower_tiers` in `indexer/lower_tier_indexers.rs`, which follows
//! edges `(parent engine hash, local hash) -> child` per tier from the worker's last device
//! block.)
//!
//! # How it is kept
//!
//! Dynamo keys a lower-tier block by its parent's engine hash; we key it by its **path
//! hash**: the router's sequence hash of the local hashes from the root
//! ([`crate::hash::sequence_hashes`]), which the router computes for every request anyway.
//! A lower-tier chain is placed when it is stored: its parent is the worker's block of that
//! engine name on a lower tier, or on the device (the shard writer resolves it from the
//! tree). Per tier, a map from path hash to the workers holding it; per worker and tier, a
//! map from engine name to path hash, for removals. A query is then one probe per position
//! per worker, and the device-only path pays nothing (an empty structure is skipped).
//!
//! The two agree wherever engines name blocks by content (the same path, the same name),
//! which the reference index checks against the literal edge model
//! (`tests/tests/index_tiers.rs`). One difference, by choice: a lower-tier chain whose
//! parent the worker holds on no tier when it is stored is not indexed (counted in
//! [`LowerTiers::orphans`]); Dynamo keeps its edge, which a later device block of that name
//! could reach.
//!
//! **Cost of placing a chain.** A lower-tier chain whose parent is a lower-tier block of
//! the worker is placed in O(1) per block. One whose parent is a device block pays one walk
//! of the tree from that block to the root (O(depth)) to learn its path hash, once per
//! event: engines publish offloads as chains (vLLM's connector per request, our mock
//! engine per round of evictions), so this is once per chain. An engine that published
//! every offloaded block of a deep prefix as its own event under a device parent would pay
//! the walk per block.
//!
//! A block moving between tiers is two events (stored on one, removed from the other, in
//! either order); each tier keeps its own copy, so an offload, an onload or an eviction
//! from one tier never loses the others'.

use std::collections::HashMap;

use smallvec::SmallVec;

use crate::hash::{LocalBlockHash, MixBuildHasher, SequenceBlockHash, next_sequence_hash};
use crate::index::OverlapScores;
use crate::worker::{StorageTier, WorkerDp};

type Map<K, V> = HashMap<K, V, MixBuildHasher>;

/// The lower tiers, in the order a continuation visits them.
pub const LOWER_TIERS: [StorageTier; 3] = [
    StorageTier::HostPinned,
    StorageTier::Disk,
    StorageTier::External,
];

/// Index of a lower tier in [`LOWER_TIERS`] (`None` for the device).
pub fn lower_index(tier: StorageTier) -> Option<usize> {
    LOWER_TIERS.iter().position(|&t| t == tier)
}

/// How far a worker's lower tiers continue a request past its device prefix.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct TierOverlap {
    /// Blocks on the host-pinned tier right after the device prefix.
    pub host: u32,
    /// Blocks on disk and then in external storage right after that (Dynamo's disk figure).
    pub disk: u32,
}

impl TierOverlap {
    fn is_zero(self) -> bool {
        self.host == 0 && self.disk == 0
    }
}

/// Per worker, its [`TierOverlap`] when not zero, sorted by worker.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TierScores {
    scores: Vec<(WorkerDp, TierOverlap)>,
}

impl TierScores {
    /// Empty.
    pub fn new() -> Self {
        Self::default()
    }

    /// Empties it, keeping its memory.
    pub fn clear(&mut self) {
        self.scores.clear();
    }

    /// Adds a worker's overlap (zero ones are left out); call [`Self::finish`] after.
    pub fn push(&mut self, worker: WorkerDp, o: TierOverlap) {
        if !o.is_zero() {
            self.scores.push((worker, o));
        }
    }

    /// Sorts what was pushed.
    pub fn finish(&mut self) {
        self.scores.sort_unstable_by_key(|&(w, _)| w);
    }

    /// A worker's overlap (zero when absent).
    pub fn get(&self, worker: WorkerDp) -> TierOverlap {
        self.scores
            .binary_search_by_key(&worker, |&(w, _)| w)
            .map_or(TierOverlap::default(), |i| self.scores[i].1)
    }

    /// `(worker, overlap)`, sorted by worker.
    pub fn as_slice(&self) -> &[(WorkerDp, TierOverlap)] {
        &self.scores
    }

    /// Whether no worker has a lower-tier overlap.
    pub fn is_empty(&self) -> bool {
        self.scores.is_empty()
    }

    /// Every worker with a device or a lower-tier overlap, with both: first those of
    /// `device` in its order, then those whose match starts on a lower tier.
    pub fn with_device<'a>(
        &'a self,
        device: &'a OverlapScores,
    ) -> impl Iterator<Item = (WorkerDp, u32, TierOverlap)> + 'a {
        let on_device = device.iter().map(|(w, d)| (w, d, self.get(w)));
        let lower_only = self
            .scores
            .iter()
            .filter(|&&(w, _)| device.get(w) == 0)
            .map(|&(w, t)| (w, 0, t));
        on_device.chain(lower_only)
    }
}

/// One shard's lower tiers (see the [module docs](self)).
#[derive(Debug, Default)]
pub struct LowerTiers {
    /// Per tier: path hash -> the workers holding it there.
    holders: [Map<u64, SmallVec<[WorkerDp; 2]>>; 3],
    /// Per worker, per tier: engine name -> path hash.
    names: Map<WorkerDp, [Map<u64, u64>; 3]>,
    blocks: usize,
    orphans: u64,
}

impl LowerTiers {
    /// Empty.
    pub fn new() -> Self {
        Self::default()
    }

    /// Blocks held on lower tiers, all workers and tiers.
    pub fn block_count(&self) -> usize {
        self.blocks
    }

    /// Lower-tier chains not indexed because their parent was held on no tier.
    pub fn orphans(&self) -> u64 {
        self.orphans
    }

    /// Blocks `worker` holds on `tier` (a lower tier).
    pub fn blocks_of(&self, worker: WorkerDp, tier: usize) -> usize {
        self.names.get(&worker).map_or(0, |t| t[tier].len())
    }

    /// The path hash of the block `worker` names `name` on any lower tier.
    pub fn path_of(&self, worker: WorkerDp, name: SequenceBlockHash) -> Option<u64> {
        let tiers = self.names.get(&worker)?;
        tiers.iter().find_map(|t| t.get(&name.0).copied())
    }

    fn hold(&mut self, worker: WorkerDp, tier: usize, name: u64, path: u64) {
        let names = &mut self.names.entry(worker).or_default()[tier];
        match names.insert(name, path) {
            Some(old) if old == path => return,
            Some(old) => {
                Self::drop_holder(&mut self.holders[tier], old, worker);
                self.blocks -= 1;
            }
            None => {}
        }
        let h = self.holders[tier].entry(path).or_default();
        if !h.contains(&worker) {
            h.push(worker);
        }
        self.blocks += 1;
    }

    fn drop_holder(holders: &mut Map<u64, SmallVec<[WorkerDp; 2]>>, path: u64, worker: WorkerDp) {
        if let Some(h) = holders.get_mut(&path) {
            h.retain(|w| *w != worker);
            if h.is_empty() {
                holders.remove(&path);
            }
        }
    }

    /// Stores a chain on lower tier `tier` under the block whose path hash is
    /// `parent_path` (`None`: the root); returns how many blocks are new.
    pub fn store(
        &mut self,
        worker: WorkerDp,
        tier: usize,
        parent_path: Option<u64>,
        blocks: &[(LocalBlockHash, SequenceBlockHash)],
    ) -> usize {
        let before = self.blocks;
        let mut parent = parent_path;
        for &(local, name) in blocks {
            let path = match parent {
                None => local.0,
                Some(p) => next_sequence_hash(SequenceBlockHash(p), local).0,
            };
            self.hold(worker, tier, name.0, path);
            parent = Some(path);
        }
        self.blocks - before
    }

    /// Places one block `worker` names `name` at path hash `path` on `tier`, as a snapshot
    /// recorded it; returns whether it is new.
    pub fn restore(&mut self, worker: WorkerDp, tier: usize, name: u64, path: u64) -> bool {
        let before = self.blocks;
        self.hold(worker, tier, name, path);
        self.blocks > before
    }

    /// `worker`'s lower-tier blocks as `(tier, name, path hash)`.
    pub fn blocks_of_worker(
        &self,
        worker: WorkerDp,
    ) -> impl Iterator<Item = (StorageTier, u64, u64)> + '_ {
        self.names.get(&worker).into_iter().flat_map(|tiers| {
            tiers.iter().enumerate().flat_map(|(t, m)| {
                m.iter()
                    .map(move |(&name, &path)| (LOWER_TIERS[t], name, path))
            })
        })
    }

    /// Counts a chain that could not be placed.
    pub fn orphan(&mut self) {
        self.orphans += 1;
    }

    /// Drops the named blocks of `worker` from `tier` (unknown names are skipped); returns
    /// how many it held.
    pub fn remove(&mut self, worker: WorkerDp, tier: usize, names: &[SequenceBlockHash]) -> usize {
        let Some(tiers) = self.names.get_mut(&worker) else {
            return 0;
        };
        let mut n = 0;
        for name in names {
            if let Some(path) = tiers[tier].remove(&name.0) {
                Self::drop_holder(&mut self.holders[tier], path, worker);
                n += 1;
            }
        }
        self.blocks -= n;
        if tiers.iter().all(Map::is_empty) {
            self.names.remove(&worker);
        }
        n
    }

    /// Drops everything `worker` holds on `tier`, or on every lower tier when `None`;
    /// returns how many blocks.
    pub fn clear(&mut self, worker: WorkerDp, tier: Option<usize>) -> usize {
        let Some(tiers) = self.names.get_mut(&worker) else {
            return 0;
        };
        let mut n = 0;
        for (t, names) in tiers.iter_mut().enumerate() {
            if tier.is_some_and(|x| x != t) {
                continue;
            }
            for (_, path) in names.drain() {
                Self::drop_holder(&mut self.holders[t], path, worker);
                n += 1;
            }
        }
        self.blocks -= n;
        if tiers.iter().all(Map::is_empty) {
            self.names.remove(&worker);
        }
        n
    }

    /// Drops every worker that `which` selects, on every tier; returns the blocks dropped.
    pub fn remove_where(&mut self, which: impl Fn(WorkerDp) -> bool) -> usize {
        let gone: Vec<WorkerDp> = self.names.keys().copied().filter(|&w| which(w)).collect();
        gone.into_iter().map(|w| self.clear(w, None)).sum()
    }

    fn holds(&self, tier: usize, path: u64, worker: WorkerDp) -> bool {
        self.holders[tier]
            .get(&path)
            .is_some_and(|h| h.contains(&worker))
    }

    /// Appends to `out` the overlaps of this shard's workers for a request whose path
    /// hashes are `paths`, given every worker's device scores `device`. Call
    /// [`TierScores::finish`] once every shard has added its part.
    pub fn overlaps_into(&self, paths: &[u64], device: &OverlapScores, out: &mut TierScores) {
        if self.blocks == 0 || paths.is_empty() {
            return;
        }
        // Candidates: workers with a device prefix, and those holding the first block on a
        // lower tier (a continuation from the root).
        let mut workers: SmallVec<[WorkerDp; 16]> = device
            .iter()
            .map(|(w, _)| w)
            .filter(|w| self.names.contains_key(w))
            .collect();
        for t in 0..3 {
            if let Some(h) = self.holders[t].get(&paths[0]) {
                for &w in h {
                    if device.get(w) == 0 && !workers.contains(&w) {
                        workers.push(w);
                    }
                }
            }
        }
        for w in workers {
            let mut pos = device.get(w) as usize;
            let mut run = [0u32; 3];
            for (t, r) in run.iter_mut().enumerate() {
                while pos < paths.len() && self.holds(t, paths[pos], w) {
                    *r += 1;
                    pos += 1;
                }
            }
            out.push(
                w,
                TierOverlap {
                    host: run[0],
                    disk: run[1] + run[2],
                },
            );
        }
    }

    /// Every worker's lower-tier blocks as `(tier, name, path hash)`, for dumps and tests.
    pub fn blocks(&self) -> impl Iterator<Item = (WorkerDp, StorageTier, u64, u64)> + '_ {
        self.names.iter().flat_map(|(&w, tiers)| {
            tiers.iter().enumerate().flat_map(move |(t, m)| {
                m.iter()
                    .map(move |(&name, &path)| (w, LOWER_TIERS[t], name, path))
            })
        })
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::hash::sequence_hashes;

    const A: WorkerDp = WorkerDp::new(1, 0);
    const B: WorkerDp = WorkerDp::new(2, 0);

    fn l(v: &[u64]) -> Vec<LocalBlockHash> {
        v.iter().map(|&x| LocalBlockHash(x)).collect()
    }

    fn chain(locals: &[LocalBlockHash], name0: u64) -> Vec<(LocalBlockHash, SequenceBlockHash)> {
        locals
            .iter()
            .enumerate()
            .map(|(i, &x)| (x, SequenceBlockHash(name0 + i as u64)))
            .collect()
    }

    #[test]
    fn continuations_start_after_the_device_and_chain_tiers() {
        let q = l(&[1, 2, 3, 4, 5, 6]);
        let paths: Vec<u64> = sequence_hashes(&q).into_iter().map(|s| s.0).collect();
        let mut t = LowerTiers::new();
        // A: host holds q[0..4) (its first two also on the device), disk q[4..5).
        t.store(A, 0, None, &chain(&q[..4], 100));
        t.store(A, 1, Some(paths[3]), &chain(&q[4..5], 200));
        // B: nothing on device or host, external q[0..2).
        t.store(B, 2, None, &chain(&q[..2], 300));
        let device: OverlapScores = [(A, 2)].into_iter().collect();
        let mut out = TierScores::new();
        t.overlaps_into(&paths, &device, &mut out);
        out.finish();
        assert_eq!(out.get(A), TierOverlap { host: 2, disk: 1 });
        assert_eq!(out.get(B), TierOverlap { host: 0, disk: 2 });
        // Device covering everything host holds: host adds nothing, disk continues.
        let device: OverlapScores = [(A, 4)].into_iter().collect();
        let mut out = TierScores::new();
        t.overlaps_into(&paths, &device, &mut out);
        out.finish();
        assert_eq!(out.get(A), TierOverlap { host: 0, disk: 1 });
        // Evicting the host copy of q[2] cuts host at 2 and strands the disk block.
        assert_eq!(t.remove(A, 0, &[SequenceBlockHash(102)]), 1);
        let device: OverlapScores = [(A, 2)].into_iter().collect();
        let mut out = TierScores::new();
        t.overlaps_into(&paths, &device, &mut out);
        out.finish();
        assert_eq!(out.get(A), TierOverlap::default());
        assert_eq!(t.block_count(), 3 + 1 + 2);
        assert_eq!(t.clear(A, None), 4);
        assert_eq!(t.remove_where(|w| w == B), 2);
        assert_eq!(t.block_count(), 0);
    }

    #[test]
    fn a_renamed_block_moves_and_duplicates_are_free() {
        let q = l(&[7, 8]);
        let mut t = LowerTiers::new();
        assert_eq!(t.store(A, 0, None, &chain(&q, 10)), 2);
        assert_eq!(t.store(A, 0, None, &chain(&q, 10)), 0);
        // The name 11 now stands for another path: the old one is no longer held.
        let other = l(&[7, 9]);
        t.store(A, 0, None, &chain(&other, 10));
        assert_eq!(t.blocks_of(A, 0), 2);
        let paths: Vec<u64> = sequence_hashes(&q).into_iter().map(|s| s.0).collect();
        let mut out = TierScores::new();
        t.overlaps_into(&paths, &OverlapScores::new(), &mut out);
        out.finish();
        assert_eq!(out.get(A).host, 1);
    }
}
