//! Node mutations, each in the store order the Consistency section promises: coverage
//! changes, partial lists, trims, appends, new children, and pruning.

use super::*;

impl ShardWriter {
    // ---------------------------------------------------------------- node mutations

    /// Sets `slot`'s cutoff on node `x` to `new` (at most the published length), keeping
    /// `full`, `partial`, `any`, the edge length and the parent's kid counts right, in the
    /// order described in the module docs. Does not prune.
    pub(super) fn set_coverage(&mut self, x: NodeId, slot: u32, new: u32, guard: &Guard) {
        // SAFETY: see `node()`; the reference is to the node, not into `self.nodes`.
        let node: &Node = unsafe { &*self.nodes[x as usize].node };
        let hi = self.nodes[x as usize].holder(slot);
        let old = hi.map_or(0, |i| self.nodes[x as usize].holders[i].cutoff);
        if new == old {
            return;
        }
        let len = self.nodes[x as usize].len;
        if new > old {
            debug_assert!(new <= len);
            let hi = match hi {
                Some(i) => i,
                None => {
                    self.nodes[x as usize].holders.push(Holder {
                        slot,
                        cutoff: 0,
                        partial: NO_PARTIAL,
                        kids: 0,
                        max_kid_attach: 0,
                    });
                    self.nodes[x as usize].holders.len() - 1
                }
            };
            if new == len {
                node.full.set(slot, guard);
                let p = self.nodes[x as usize].holders[hi].partial;
                if p != NO_PARTIAL {
                    self.partials(x, guard).clear(p as usize);
                    self.nodes[x as usize].holders[hi].partial = NO_PARTIAL;
                }
            } else {
                self.set_partial(x, hi, new, guard);
            }
            self.nodes[x as usize].holders[hi].cutoff = new;
            if old == 0 {
                node.any.set(slot, guard);
                self.adjust_parent_kids(x, slot, true);
            }
            return;
        }

        let hi = hi.expect("shrinking a held node");
        let others_max = self.nodes[x as usize]
            .holders
            .iter()
            .filter(|h| h.slot != slot)
            .map(|h| h.cutoff)
            .max()
            .unwrap_or(0);
        let was_full = old == len;
        if was_full && new > others_max {
            // The worker stays the (joint) top holder: trimming the edge is the whole change.
            self.nodes[x as usize].holders[hi].cutoff = new;
            self.trim(x, new, guard);
            return;
        }
        // 1. Publish the worker's smaller coverage.
        if new == 0 {
            // Out of `any` first: at no point is a worker in `any` but in neither `full`
            // nor the list (a lookup that finds one repeats its step, `reader::node_step`).
            node.any.clear(slot, guard);
            if was_full {
                node.full.clear(slot, guard);
            } else {
                let p = self.nodes[x as usize].holders[hi].partial;
                self.partials(x, guard).clear(p as usize);
            }
            self.nodes[x as usize].holders.swap_remove(hi);
            self.adjust_parent_kids(x, slot, false);
        } else {
            self.set_partial(x, hi, new, guard);
            if was_full {
                node.full.clear(slot, guard);
            }
            self.nodes[x as usize].holders[hi].cutoff = new;
        }
        // 2. Trim the edge to the longest remaining hold, then 3. promote whoever now holds
        // all of it.
        let new_len = self.nodes[x as usize]
            .holders
            .iter()
            .map(|h| h.cutoff)
            .max()
            .unwrap_or(0);
        if new_len < len {
            self.trim(x, new_len, guard);
            for i in 0..self.nodes[x as usize].holders.len() {
                let h = self.nodes[x as usize].holders[i];
                if h.cutoff == new_len && h.partial != NO_PARTIAL {
                    node.full.set(h.slot, guard);
                    self.partials(x, guard).clear(h.partial as usize);
                    self.nodes[x as usize].holders[i].partial = NO_PARTIAL;
                }
            }
        }
    }

    pub(super) fn adjust_parent_kids(&mut self, x: NodeId, slot: u32, added: bool) {
        let (parent, attach) = (self.nodes[x as usize].parent, self.nodes[x as usize].attach);
        if parent == ROOT {
            return;
        }
        let pm = &mut self.nodes[parent as usize];
        if let Some(i) = pm.holder(slot) {
            let h = &mut pm.holders[i];
            if added {
                h.kids += 1;
                h.max_kid_attach = h.max_kid_attach.max(attach);
            } else {
                h.kids -= 1;
                if h.kids == 0 {
                    h.max_kid_attach = 0;
                }
            }
        }
    }

    pub(super) fn partials<'g>(&self, x: NodeId, guard: &'g Guard) -> &'g Partials {
        let p = self.node(x).partial.load(Ordering::Acquire, guard);
        // SAFETY: present whenever a holder has a partial index; replaced only by this writer.
        unsafe { p.deref() }
    }

    /// Gives holder `hi` of `x` a partial entry with `cutoff` (in place when it has one).
    pub(super) fn set_partial(&mut self, x: NodeId, hi: usize, cutoff: u32, guard: &Guard) {
        let slot = self.nodes[x as usize].holders[hi].slot;
        let mut idx = self.nodes[x as usize].holders[hi].partial;
        if idx == NO_PARTIAL {
            let m = &self.nodes[x as usize];
            let used: SmallVec<[u32; 4]> = m
                .holders
                .iter()
                .map(|h| h.partial)
                .filter(|&p| p != NO_PARTIAL)
                .collect();
            idx = (0..m.partial_cap)
                .find(|i| !used.contains(i))
                .unwrap_or(m.partial_cap);
            if idx == m.partial_cap {
                let node = self.node(x);
                let old = node.partial.load(Ordering::Acquire, guard);
                let cap = (m.partial_cap * 2).max(2);
                // SAFETY: the writer's own list.
                let grown = Partials::grown(unsafe { old.as_ref() }, cap as usize);
                node.partial.store(grown, Ordering::Release);
                if !old.is_null() {
                    // Replaced above: freed after current readers unpin.
                    self.garbage.retire(Retired::Partials(old.into_usize()));
                }
                self.nodes[x as usize].partial_cap = cap;
            }
            self.nodes[x as usize].holders[hi].partial = idx;
        }
        self.partials(x, guard).set(idx as usize, slot, cutoff);
    }

    /// Lowers the published length of `x` to `new_len`; compacts the buffer when it is
    /// mostly slack.
    pub(super) fn trim(&mut self, x: NodeId, new_len: u32, guard: &Guard) {
        // SAFETY: see `node()`; the reference is to the node, not into `self.nodes`.
        let node: &Node = unsafe { &*self.nodes[x as usize].node };
        let edge = node.edge.load(Ordering::Acquire, guard);
        // SAFETY: the writer's own edge buffer.
        unsafe { edge.deref() }.publish_len(new_len as usize);
        let m = &mut self.nodes[x as usize];
        m.len = new_len;
        if new_len > 0 && m.cap > 32 && new_len * 4 < m.cap {
            // SAFETY: cells below `new_len` are below `hwm`: read-only.
            let blocks: Vec<u64> = (0..new_len)
                .map(|i| unsafe { edge.deref().get(i as usize) })
                .collect();
            node.edge.store(
                Edge::with_blocks(&blocks, new_len as usize),
                Ordering::Release,
            );
            // Replaced above: freed after current readers unpin.
            self.garbage.retire(Retired::Edge(edge.into_usize()));
            let m = &mut self.nodes[x as usize];
            m.cap = new_len;
            m.hwm = new_len;
        }
    }

    /// Appends `locals` to the edge of `x`, whose only holder is `slot` and holds all of it.
    pub(super) fn append(&mut self, x: NodeId, slot: u32, locals: &[u64], guard: &Guard) {
        let node = self.node(x);
        let m = &self.nodes[x as usize];
        let (len, new_len) = (m.len as usize, m.len as usize + locals.len());
        let edge = node.edge.load(Ordering::Acquire, guard);
        if m.hwm as usize == len && new_len <= m.cap as usize {
            // SAFETY: the writer's own buffer.
            let e = unsafe { edge.deref() };
            for (i, &l) in locals.iter().enumerate() {
                // SAFETY: `len + i >= hwm`: never published, no reader reads it.
                unsafe { e.write(len + i, l) };
            }
            e.publish_len(new_len);
        } else {
            let cap = new_len + new_len / 4;
            // SAFETY: cells below `len <= hwm` are read-only.
            let old = (0..len).map(|i| unsafe { edge.deref().get(i) });
            let blocks: Vec<u64> = old.chain(locals.iter().copied()).collect();
            node.edge
                .store(Edge::with_blocks(&blocks, cap), Ordering::Release);
            // Replaced above: freed after current readers unpin.
            self.garbage.retire(Retired::Edge(edge.into_usize()));
            self.nodes[x as usize].cap = cap as u32;
        }
        let m = &mut self.nodes[x as usize];
        m.len = new_len as u32;
        m.hwm = new_len as u32;
        let hi = m.holder(slot).expect("the appending worker holds the node");
        m.holders[hi].cutoff = new_len as u32;
    }

    /// Creates a child of `parent` at `attach` holding `locals`, held whole by `slot`.
    pub(super) fn new_child(
        &mut self,
        parent: NodeId,
        attach: u32,
        locals: &[u64],
        slot: u32,
        guard: &Guard,
    ) -> NodeId {
        let id = self.next_node_id();
        if self.free_ids.pop().is_none() {
            self.nodes.push(Meta::vacant());
        }
        let node = Node::new(attach, id, locals, locals.len());
        node.full.set(slot, guard);
        node.any.set(slot, guard);
        let shared = Owned::new(node).into_shared(guard);
        let k = locals.len() as u32;
        self.nodes[id as usize] = Meta {
            node: shared.as_raw(),
            parent,
            attach,
            len: k,
            hwm: k,
            cap: k,
            holders: smallvec::smallvec![Holder {
                slot,
                cutoff: k,
                partial: NO_PARTIAL,
                kids: 0,
                max_kid_attach: 0
            }],
            child_live: 0,
            child_used: 0,
            child_cap: 0,
            partial_cap: 0,
        };
        self.link_child(parent, shared, guard);
        self.adjust_parent_kids(id, slot, true);
        id
    }

    pub(super) fn link_child(&mut self, parent: NodeId, child: Shared<'_, Node>, guard: &Guard) {
        let pm = &self.nodes[parent as usize];
        if (pm.child_used + 1) * 4 > pm.child_cap * 3 {
            self.rebuild_children(
                parent,
                ((pm.child_live + 1) * 2).next_power_of_two().max(2),
                guard,
            );
        }
        let table = self.node(parent).children.load(Ordering::Acquire, guard);
        // SAFETY: the writer's own table (just ensured to exist).
        let reused = unsafe { table.deref() }.insert(child, guard);
        let pm = &mut self.nodes[parent as usize];
        pm.child_live += 1;
        if !reused {
            pm.child_used += 1;
        }
    }

    /// Publishes a fresh child table of `cap` slots holding the live children of `x`.
    pub(super) fn rebuild_children(&mut self, x: NodeId, cap: u32, guard: &Guard) {
        let node = self.node(x);
        let old = node.children.load(Ordering::Acquire, guard);
        let table = ChildTable::with_capacity(cap as usize);
        // SAFETY: the writer's own table and live children.
        if let Some(t) = unsafe { old.as_ref() } {
            for c in t.children(guard) {
                table.insert(c, guard);
            }
        }
        node.children.store(table, Ordering::Release);
        if !old.is_null() {
            // Replaced above: freed after current readers unpin.
            self.garbage.retire(Retired::Children(old.into_usize()));
        }
        let m = &mut self.nodes[x as usize];
        m.child_cap = cap;
        m.child_used = m.child_live;
    }

    /// Prunes `x` and then its ancestors while they are held by nobody and have no
    /// children.
    pub(super) fn try_prune(&mut self, mut x: NodeId, guard: &Guard) {
        while x != ROOT {
            let m = &self.nodes[x as usize];
            if !m.holders.is_empty() || m.child_live > 0 {
                return;
            }
            let parent = m.parent;
            self.prune(x, guard);
            x = parent;
        }
    }

    pub(super) fn prune(&mut self, x: NodeId, guard: &Guard) {
        let (parent, ptr) = (self.nodes[x as usize].parent, self.nodes[x as usize].node);
        // SAFETY: live node.
        let (attach, first) = unsafe { ((*ptr).attach, (*ptr).first) };
        let table = self.node(parent).children.load(Ordering::Acquire, guard);
        // SAFETY: the parent's table, which holds `x`.
        let removed = unsafe { table.deref() }.remove(attach, first, guard);
        debug_assert!(removed);
        let pm = &mut self.nodes[parent as usize];
        pm.child_live -= 1;
        if pm.child_cap > 8 && pm.child_live * 8 < pm.child_cap {
            let cap = (pm.child_live * 2).next_power_of_two().max(2);
            self.rebuild_children(parent, cap, guard);
        }
        // `x` is unlinked: no parent table, no map entry (nobody holds it) and no child
        // refers to it, so only readers pinned before the unlink can reach it; it is freed
        // after they unpin.
        self.garbage.retire(Retired::Node(ptr));
        self.nodes[x as usize] = Meta::vacant();
        self.free_ids.push(x);
    }
}
