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
        let mut out = ApplyOutcome::default();
        match data {
            KvEventData::Stored(s) => {
                let parent = match s.parent_hash {
                    None => Some(None),
                    Some(p) => {
                        let own = {
                            let l = self
                                .shared
                                .lower
                                .read()
                                .unwrap_or_else(std::sync::PoisonError::into_inner);
                            l.pool_path_of(source, p).or_else(|| l.path_of(source, p))
                        };
                        own.or_else(|| {
                            let slot = *self.slot_of.get(&source)?;
                            self.device_path_hash(slot, p, guard)
                        })
                        .map(Some)
                    }
                };
                let blocks: Vec<(LocalBlockHash, SequenceBlockHash)> = s
                    .blocks
                    .iter()
                    .map(|b| (b.tokens_hash, b.block_hash))
                    .collect();
                self.with_lower(|l| match parent {
                    Some(parent) => {
                        let new = l.pool_store(source, parent, &blocks);
                        out.stored = new as u32;
                        out.duplicate = (blocks.len() - new) as u32;
                    }
                    None => l.orphan(),
                });
            }
            KvEventData::Removed(r) => {
                let n = self.with_lower(|l| l.pool_remove(source, &r.block_hashes));
                out.removed = n as u32;
                out.not_found = (r.block_hashes.len() - n) as u32;
            }
            KvEventData::Cleared => {
                out.removed = self.with_lower(|l| l.pool_clear(source)) as u32;
            }
        }
        out
    }

    pub(super) fn apply_lower(
        &mut self,
        slot: u32,
        worker: WorkerDp,
        tier: usize,
        data: &KvEventData,
        guard: &Guard,
    ) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        match data {
            KvEventData::Stored(s) => {
                let parent = match s.parent_hash {
                    None => Some(None),
                    Some(p) => {
                        let lower = self
                            .shared
                            .lower
                            .read()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .path_of(worker, p);
                        lower
                            .or_else(|| self.device_path_hash(slot, p, guard))
                            .map(Some)
                    }
                };
                let blocks: Vec<(LocalBlockHash, SequenceBlockHash)> = s
                    .blocks
                    .iter()
                    .map(|b| (b.tokens_hash, b.block_hash))
                    .collect();
                self.with_lower(|l| match parent {
                    Some(parent) => {
                        let new = l.store(worker, tier, parent, &blocks);
                        out.stored = new as u32;
                        out.duplicate = (blocks.len() - new) as u32;
                    }
                    None => l.orphan(),
                });
            }
            KvEventData::Removed(r) => {
                let n = self.with_lower(|l| l.remove(worker, tier, &r.block_hashes));
                out.removed = n as u32;
                out.not_found = (r.block_hashes.len() - n) as u32;
            }
            KvEventData::Cleared => {
                out.removed = self.with_lower(|l| l.clear(worker, Some(tier))) as u32;
            }
        }
        out
    }
}
