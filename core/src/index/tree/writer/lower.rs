//! Lower-tier events: kept in the shard's [`LowerTiers`] beside the tree, behind a lock the
//! readers share (see [`ShardShared::lower`]). A lower-tier chain's parent is resolved here,
//! on the writer: a lower-tier block of the worker, or its device block, whose path the
//! tree gives. Shared-pool (`cache_owner`) events are kept there too
//! ([`crate::index::tiers`], "The shared pool"), without a worker slot.

use super::*;
use crate::hash::next_sequence_hash;
use crate::index::tiers::LowerTiers;

impl ShardWriter {
    /// The path hash of the device block `worker` (in `slot`) names `name`: the chained hash
    /// of the local hashes from the root to it. O(depth).
    fn device_path_hash(&self, slot: u32, name: SequenceBlockHash, guard: &Guard) -> Option<u64> {
        let (mut x, p) = unpack(self.map(slot).get(name.0)?);
        let mut rev: Vec<u64> = Vec::new();
        let mut upto = p + 1;
        loop {
            for i in (0..upto).rev() {
                rev.push(self.local_at(x, i, guard));
            }
            let m = &self.nodes[x as usize];
            if m.parent == ROOT {
                break;
            }
            upto = m.attach;
            x = m.parent;
        }
        let mut it = rev.iter().rev();
        let first = *it.next()?;
        Some(it.fold(first, |h, &l| {
            next_sequence_hash(SequenceBlockHash(h), LocalBlockHash(l)).0
        }))
    }

    /// The shard's lower tiers (and shared pools) under the read lock.
    pub(in crate::index::tree) fn read_lower(&self) -> std::sync::RwLockReadGuard<'_, LowerTiers> {
        self.shared
            .lower
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Runs `f` on the shard's lower tiers under the write lock and republishes their
    /// block count.
    pub(in crate::index::tree) fn with_lower<T>(&self, f: impl FnOnce(&mut LowerTiers) -> T) -> T {
        let mut lower = self
            .shared
            .lower
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let out = f(&mut lower);
        self.shared
            .lower_blocks
            .store(lower.block_count() as u64, Ordering::Release);
        out
    }

    /// Applies a shared-pool (`cache_owner`) event of `source`. Creates no worker slot: a
    /// pool's publisher is not a routing candidate by its pool events.
    pub(super) fn apply_pool(
        &mut self,
        source: WorkerDp,
        data: &KvEventData,
        guard: &Guard,
    ) -> ApplyOutcome {
        self.apply_beside(
            data,
            |w, p| {
                let own = {
                    let l = w.read_lower();
                    l.pool_path_of(source, p).or_else(|| l.path_of(source, p))
                };
                own.or_else(|| {
                    let slot = *w.slot_of.get(&source)?;
                    w.device_path_hash(slot, p, guard)
                })
            },
            |l, parent, blocks| l.pool_store(source, parent, blocks),
            |l, names| l.pool_remove(source, names),
            |l| l.pool_clear(source),
        )
    }

    pub(super) fn apply_lower(
        &mut self,
        slot: u32,
        worker: WorkerDp,
        tier: usize,
        data: &KvEventData,
        guard: &Guard,
    ) -> ApplyOutcome {
        self.apply_beside(
            data,
            |w, p| {
                let lower = w.read_lower().path_of(worker, p);
                lower.or_else(|| w.device_path_hash(slot, p, guard))
            },
            |l, parent, blocks| l.store(worker, tier, parent, blocks),
            |l, names| l.remove(worker, tier, names),
            |l| l.clear(worker, Some(tier)),
        )
    }

    /// An event kept beside the tree (a lower tier's, a shared pool's): a stored chain is
    /// placed by `store` under the path hash `parent_path` gives for its parent's name (an
    /// orphan, counted, when it gives none), a removal by `remove`, a clear by `clear`;
    /// each returns how many blocks it added or dropped.
    fn apply_beside(
        &self,
        data: &KvEventData,
        parent_path: impl FnOnce(&Self, SequenceBlockHash) -> Option<u64>,
        store: impl FnOnce(
            &mut LowerTiers,
            Option<u64>,
            &[(LocalBlockHash, SequenceBlockHash)],
        ) -> usize,
        remove: impl FnOnce(&mut LowerTiers, &[SequenceBlockHash]) -> usize,
        clear: impl FnOnce(&mut LowerTiers) -> usize,
    ) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        match data {
            KvEventData::Stored(s) => {
                let parent = match s.parent_hash {
                    None => Some(None),
                    Some(p) => parent_path(self, p).map(Some),
                };
                let blocks: Vec<(LocalBlockHash, SequenceBlockHash)> = s
                    .blocks
                    .iter()
                    .map(|b| (b.tokens_hash, b.block_hash))
                    .collect();
                self.with_lower(|l| match parent {
                    Some(parent) => {
                        let new = store(l, parent, &blocks);
                        out.stored = new as u32;
                        out.duplicate = (blocks.len() - new) as u32;
                    }
                    None => l.orphan(),
                });
            }
            KvEventData::Removed(r) => {
                let n = self.with_lower(|l| remove(l, &r.block_hashes));
                out.removed = n as u32;
                out.not_found = (r.block_hashes.len() - n) as u32;
            }
            KvEventData::Cleared => {
                out.removed = self.with_lower(clear) as u32;
            }
        }
        out
    }
}
