//! Removals: a worker's blocks dropped by name (tail runs at once), from a block down,
//! and a whole (worker, dp rank) cleared.

use super::*;

impl ShardWriter {
    /// Applies a removal of `slot`'s blocks (names it does not hold are counted, not
    /// refused).
    pub(super) fn apply_removed(
        &mut self,
        slot: u32,
        r: &RemovedData,
        guard: &Guard,
    ) -> Result<ApplyOutcome, ApplyError> {
        let mut out = ApplyOutcome::default();
        // Every name is hashed first, so that each name's map lines can be asked
        // for well before its probe: the probes' cache misses overlap.
        let mut hs = std::mem::take(&mut self.hashes);
        hs.clear();
        let hasher = NameHasher::get();
        hs.extend(r.block_hashes.iter().map(|h| hasher.hash(h.0)));
        let map = &self.state(slot).blocks;
        for &hash in hs.iter().take(PREFETCH_AHEAD) {
            map.prefetch(hash);
        }
        // Leaf-first eviction names a chain tail first: consecutive blocks of one
        // edge, each the worker's last there. Such a run is dropped with one
        // coverage change instead of one per block (same final state; a reader
        // sees the run go at once instead of block by block).
        let mut run: Option<TailRun> = None;
        for (i, (h, &hash)) in r.block_hashes.iter().zip(&hs).enumerate() {
            let map = &mut self.state(slot).blocks;
            if let Some(&ahead) = hs.get(i + PREFETCH_AHEAD) {
                map.prefetch(ahead);
            }
            let Some(loc) = map.remove_h(hash, h.0) else {
                out.not_found += 1;
                continue;
            };
            let (x, q) = unpack(loc);
            if let Some(r) = run.as_mut() {
                // Nothing of the worker's below `q`, from what the run remembered.
                if r.node == x && q + 1 == r.lo && r.floor <= q {
                    r.lo = q;
                    continue;
                }
                out.removed += self.drop_run(slot, r, guard);
                run = None;
            }
            let m = &self.nodes[x as usize];
            // The worker's last block there, with nothing of its below: no child
            // attached past `q` (`max_kid_attach` is an upper bound, 0 while it
            // holds no child; a false alarm takes the exact path of `drop_from`).
            let tail = m
                .holder(slot)
                .map(|i| m.holders[i])
                .filter(|h| h.cutoff == q + 1 && h.max_kid_attach <= q);
            if let Some(h) = tail {
                run = Some(TailRun {
                    node: x,
                    lo: q,
                    hi: q,
                    floor: h.max_kid_attach,
                });
            } else {
                out.removed += self.drop_from(slot, loc, guard);
            }
        }
        if let Some(r) = run.as_ref() {
            out.removed += self.drop_run(slot, r, guard);
        }
        self.hashes = hs;
        self.blocks -= out.removed as usize;
        Ok(out)
    }

    /// Drops a tail run found by the removal loop: blocks `[lo, hi]` of the run's node,
    /// the worker's last ones there, with nothing of the worker's below them. Their map
    /// entries are already gone. Returns the blocks dropped.
    pub(super) fn drop_run(&mut self, slot: u32, run: &TailRun, guard: &Guard) -> u32 {
        debug_assert_eq!(self.nodes[run.node as usize].cutoff(slot), run.hi + 1);
        self.set_coverage(run.node, slot, run.lo, guard);
        self.try_prune(run.node, guard);
        run.hi - run.lo + 1
    }

    /// Drops the worker's block at `loc` and everything it holds below; its map entry for
    /// `loc` is already gone. Returns the blocks dropped.
    pub(super) fn drop_from(&mut self, slot: u32, loc: u64, guard: &Guard) -> u32 {
        let (x, q) = unpack(loc);
        let m = &self.nodes[x as usize];
        let h = m.holders[m.holder(slot).expect("map entries point at held blocks")];
        debug_assert!(h.cutoff > q);
        let mut below: Vec<NodeId> = Vec::new();
        if h.kids > 0 && h.max_kid_attach > q {
            // `max_kid_attach` is an upper bound: look, and tighten it.
            let kids = self.held_children(x, slot, guard);
            let max = kids
                .iter()
                .map(|&c| self.nodes[c as usize].attach)
                .max()
                .unwrap_or(0);
            let hi = self.nodes[x as usize].holder(slot).expect("held");
            self.nodes[x as usize].holders[hi].max_kid_attach = max;
            below = kids
                .into_iter()
                .filter(|&c| self.nodes[c as usize].attach > q)
                .collect();
        }
        if h.cutoff == q + 1 && below.is_empty() {
            // Leaf-first eviction: nothing hangs below.
            self.set_coverage(x, slot, q, guard);
            self.try_prune(x, guard);
            return 1;
        }
        // Everything the worker holds below: the rest of this edge and its children hanging
        // past `q`, recursively (parents before children).
        let mut doomed = Vec::new();
        let mut stack = below;
        while let Some(c) = stack.pop() {
            doomed.push(c);
            stack.extend(self.held_children(c, slot, guard));
        }
        let doomed_set: AHashSet<NodeId> = doomed.iter().copied().collect();
        let mut dropped = h.cutoff - q;
        for &d in &doomed {
            dropped += self.nodes[d as usize].cutoff(slot);
        }
        self.state(slot).blocks.remove_where(|_, v| {
            let (n, p) = unpack(v);
            (n == x && p > q) || doomed_set.contains(&n)
        });
        for &d in doomed.iter().rev() {
            self.set_coverage(d, slot, 0, guard);
            self.try_prune(d, guard);
        }
        self.set_coverage(x, slot, q, guard);
        self.try_prune(x, guard);
        dropped
    }

    /// Children of `x` that `slot` holds.
    pub(super) fn held_children(&self, x: NodeId, slot: u32, guard: &Guard) -> Vec<NodeId> {
        let table = self.node(x).children.load(Ordering::Acquire, guard);
        // SAFETY: the writer's own child table and live children.
        let Some(t) = (unsafe { table.as_ref() }) else {
            return Vec::new();
        };
        t.children(guard)
            // SAFETY: live children of a live node.
            .map(|c| unsafe { c.deref() }.id)
            .filter(|&c| self.nodes[c as usize].holder(slot).is_some())
            .collect()
    }

    pub(super) fn clear_slot(&mut self, slot: u32, guard: &Guard) -> usize {
        let map = std::mem::take(&mut self.state(slot).blocks);
        let n = map.len();
        let mut held: Vec<NodeId> = map.iter().map(|(_, v)| unpack(v).0).collect();
        held.sort_unstable();
        held.dedup();
        for &x in &held {
            self.set_coverage(x, slot, 0, guard);
        }
        for &x in &held {
            // An ancestor pruned earlier in this loop may have taken `x` with it.
            if !self.nodes[x as usize].node.is_null() {
                self.try_prune(x, guard);
            }
        }
        self.blocks -= n;
        n
    }
}
