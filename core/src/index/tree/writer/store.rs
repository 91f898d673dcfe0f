//! Stored events: where a chain goes (planned in the tree first, read-only, when its
//! names are new to the worker), and storing it.

use super::*;

impl ShardWriter {
    /// Whether block `a` is `b` or one of its ancestors.
    pub(super) fn is_ancestor_or_self(&self, a: (NodeId, u32), b: (NodeId, u32)) -> bool {
        let (mut n, mut pos) = b;
        loop {
            if n == a.0 {
                return a.1 <= pos;
            }
            if n == ROOT {
                return false;
            }
            let m = &self.nodes[n as usize];
            if m.parent == ROOT {
                return false;
            }
            pos = m.attach - 1;
            n = m.parent;
        }
    }

    /// Where a block with local hash `local` goes after position `next - 1` of node `n`:
    /// the next cell of `n`'s edge, or the first cell of a child, or `None` (new storage).
    pub(super) fn locate(
        &self,
        n: NodeId,
        next: u32,
        local: u64,
        guard: &Guard,
    ) -> Option<(NodeId, u32)> {
        let m = &self.nodes[n as usize];
        if n != ROOT && next < m.len && self.local_at(n, next, guard) == local {
            return Some((n, next));
        }
        let table = self.node(n).children.load(Ordering::Acquire, guard);
        // SAFETY: the writer's own child table.
        let child = unsafe { table.as_ref() }?.get(next, local, guard)?;
        Some((child.id, 0))
    }

    /// How many blocks of `blocks[i..]` follow the edge of node `t` from position `p`,
    /// where `blocks[i]` sits: at least 1, and `blocks[i + k]` only while `more(i + k)`.
    #[inline(always)]
    pub(super) fn run_along(
        &self,
        t: NodeId,
        p: u32,
        blocks: &[StoredBlock],
        i: usize,
        guard: &Guard,
        more: impl Fn(usize) -> bool,
    ) -> usize {
        let len = self.nodes[t as usize].len;
        let mut k = 1;
        while i + k < blocks.len()
            && p + (k as u32) < len
            && self.local_at(t, p + k as u32, guard) == blocks[i + k].tokens_hash.0
            && more(i + k)
        {
            k += 1;
        }
        k
    }

    /// Whether new storage after position `next - 1` of node `n` is appended to `n`'s edge:
    /// `next` is its end and `slot` its only holder (so it holds all of it).
    pub(super) fn appends_at(&self, n: NodeId, next: u32, slot: u32) -> bool {
        let m = &self.nodes[n as usize];
        n != ROOT && next == m.len && m.holders.len() == 1 && m.holders[0].slot == slot
    }

    /// The id [`Self::new_child`] gives the next node.
    pub(super) fn next_node_id(&self) -> NodeId {
        self.free_ids
            .last()
            .copied()
            .unwrap_or(self.nodes.len() as NodeId)
    }

    pub(super) fn apply_stored(
        &mut self,
        slot: u32,
        worker: WorkerDp,
        event_id: u64,
        parent: Option<SequenceBlockHash>,
        blocks: &[StoredBlock],
        guard: &Guard,
    ) -> Result<ApplyOutcome, ApplyError> {
        let parent_loc = match parent {
            None => None,
            Some(h) => Some(unpack(self.state(slot).blocks.get(h.0).ok_or(
                ApplyError::ParentNotFound {
                    worker,
                    event_id,
                    parent: h,
                },
            )?)),
        };
        let invalid = |block| ApplyError::InvalidBlockSequence {
            worker,
            event_id,
            block,
        };
        // Each name is hashed once, here.
        let mut hs = std::mem::take(&mut self.hashes);
        let mut held = std::mem::take(&mut self.held);
        let mut buckets = std::mem::take(&mut self.buckets);
        hs.clear();
        held.clear();
        buckets.clear();
        let hasher = NameHasher::get();
        hs.extend(blocks.iter().map(|b| hasher.hash(b.block_hash.0)));
        // The common case first: a chain none of whose names the worker has, which does
        // not run over blocks the worker already holds. Its place in the tree is planned
        // before the map is touched (read-only), so that one probe per name both checks
        // that the name is new and sets where it goes; the tree is then changed as
        // planned. Any name found takes the general path below, with the map as it was.
        // Room for every name up front: no probe below (either path) moves the table, so
        // the prefetches keep aiming at it.
        let map = &mut self.state(slot).blocks;
        map.ready_prefetch(blocks.len());
        for &h in hs.iter().take(PREFETCH_AHEAD) {
            map.prefetch(h);
        }
        if let Some(tail) = self.plan_chain(slot, parent_loc, blocks, guard) {
            let planned = std::mem::take(&mut self.planned);
            let map = &mut self.state(slot).blocks;
            let mut fresh = blocks.len();
            for (i, ((b, &h), &v)) in blocks.iter().zip(&hs).zip(&planned).enumerate() {
                if let Some(&ahead) = hs.get(i + PREFETCH_AHEAD) {
                    map.prefetch(ahead);
                }
                if map.insert_new_h(h, b.block_hash.0, v).is_some() {
                    fresh = i;
                    break;
                }
            }
            self.planned = planned;
            if fresh == blocks.len() {
                let out = self.store_planned(slot, blocks, tail, guard);
                self.held = held;
                self.hashes = hs;
                self.buckets = buckets;
                return Ok(out);
            }
            // Names `..fresh` were new (the first name found ends the loop, and a name
            // repeated in the chain is found at its second use): they go, and the map is
            // as it was.
            let map = &mut self.state(slot).blocks;
            for (b, &h) in blocks[..fresh].iter().zip(&hs) {
                map.remove_h(h, b.block_hash.0);
            }
        }
        // Where the worker already has each name (one lookup per block, reused below until
        // a cascade or a rename changes the map). A name it lacks is reserved in the same
        // probe (`PENDING`), so that the insert's memory traffic overlaps the other
        // lookups' instead of missing again when `store_chain` sets it (at the bucket
        // remembered here). Every name is claimed in that probe, so a name found claimed
        // was claimed by this very chain (claims never outlive their event): the chain
        // names that block twice.
        // Room for every name was made above, so the claims below never move the table and
        // the prefetches (the first ones issued above too) keep aiming at it.
        let map = &mut self.state(slot).blocks;
        let mut repeated = None;
        let mut any_held = false;
        let mut names_parent = false;
        let parent_name = parent.map(|p| p.0);
        for (i, (b, &h)) in blocks.iter().zip(&hs).enumerate() {
            if let Some(&ahead) = hs.get(i + PREFETCH_AHEAD) {
                map.prefetch(ahead);
            }
            let (v, at) = map.claim_h(h, b.block_hash.0);
            if v.is_some_and(|v| v & CLAIMED != 0) {
                repeated = Some(b.block_hash);
                break;
            }
            any_held |= v.is_some();
            names_parent |= parent_name == Some(b.block_hash.0);
            held.push(v);
            buckets.push(at);
        }
        if any_held {
            // The held names' values back (their buckets are in cache from the claim).
            for (((b, &h), &at), v) in blocks.iter().zip(&hs).zip(&buckets).zip(&held) {
                if let Some(v) = *v {
                    map.set_at(at, h, b.block_hash.0, v);
                }
            }
        }
        let rejected = repeated.or(parent.filter(|_| names_parent)).or_else(|| {
            let ploc = parent_loc.filter(|_| any_held)?;
            blocks
                .iter()
                .zip(&held)
                .find(|(_, h)| h.is_some_and(|loc| self.is_ancestor_or_self(unpack(loc), ploc)))
                .map(|(b, _)| b.block_hash)
        });
        if let Some(b) = rejected {
            // Rejected: the reservations made so far go, and the map is as it was.
            let map = &mut self.state(slot).blocks;
            for ((blk, &x), h) in blocks.iter().zip(&hs).zip(&held) {
                if h.is_none() {
                    map.remove_h(x, blk.block_hash.0);
                }
            }
            self.held = held;
            self.hashes = hs;
            self.buckets = buckets;
            return Err(invalid(b));
        }
        let out = self.store_chain(
            slot, parent_loc, blocks, &hs, &buckets, &mut held, any_held, guard,
        );
        self.held = held;
        self.hashes = hs;
        self.buckets = buckets;
        Ok(out)
    }

    /// Plans where a stored chain goes if the worker holds none of its names: the existing
    /// edges it follows (`self.segments`), where each block goes (`self.planned`), and
    /// where the rest goes ([`NewStorage`]). Reads the tree only. `None` when the chain
    /// runs over a block the worker already holds (a renamed path: the general path
    /// handles it). What [`Self::store_chain`] does for such a chain, step for step.
    pub(super) fn plan_chain(
        &mut self,
        slot: u32,
        parent_loc: Option<(NodeId, u32)>,
        blocks: &[StoredBlock],
        guard: &Guard,
    ) -> Option<NewStorage> {
        let mut segments = std::mem::take(&mut self.segments);
        let mut planned = std::mem::take(&mut self.planned);
        segments.clear();
        planned.clear();
        let tail = self.plan_into(slot, parent_loc, blocks, &mut segments, &mut planned, guard);
        self.segments = segments;
        self.planned = planned;
        tail
    }

    pub(super) fn plan_into(
        &self,
        slot: u32,
        parent_loc: Option<(NodeId, u32)>,
        blocks: &[StoredBlock],
        segments: &mut Vec<(NodeId, u32, u32)>,
        planned: &mut Vec<u64>,
        guard: &Guard,
    ) -> Option<NewStorage> {
        let (mut n, mut next) = parent_loc.map_or((ROOT, 0), |(n, p)| (n, p + 1));
        let mut i = 0;
        while i < blocks.len() {
            let Some((t, p)) = self.locate(n, next, blocks[i].tokens_hash.0, guard) else {
                // New storage, decided as `store_chain` decides it once the edges above
                // are covered: covering adds this worker to their holders, so "this
                // worker alone" after covering is "this worker alone" now (every node
                // has a holder).
                let rest = (blocks.len() - i) as u32;
                let tail = if self.appends_at(n, next, slot) {
                    planned.extend((next..next + rest).map(|q| pack(n, q)));
                    NewStorage::Append { node: n, from: i }
                } else {
                    // The id `new_child` takes: nothing is freed or taken between now and
                    // then.
                    let id = self.next_node_id();
                    planned.extend((0..rest).map(|q| pack(id, q)));
                    NewStorage::Child {
                        parent: n,
                        attach: next,
                        id,
                        from: i,
                    }
                };
                return Some(tail);
            };
            if self.nodes[t as usize].cutoff(slot) > p {
                return None;
            }
            let k = self.run_along(t, p, blocks, i, guard, |_| true);
            let k32 = k as u32;
            planned.extend((p..p + k32).map(|q| pack(t, q)));
            segments.push((t, p, k32));
            (n, next) = (t, p + k32);
            i += k;
        }
        Some(NewStorage::None)
    }

    /// Carries out a plan of [`Self::plan_chain`] whose names are all in the map already,
    /// at their planned places.
    pub(super) fn store_planned(
        &mut self,
        slot: u32,
        blocks: &[StoredBlock],
        tail: NewStorage,
        guard: &Guard,
    ) -> ApplyOutcome {
        let segments = std::mem::take(&mut self.segments);
        for &(t, p, k) in &segments {
            self.set_coverage(t, slot, p + k, guard);
        }
        self.segments = segments;
        let from = match tail {
            NewStorage::None => blocks.len(),
            NewStorage::Append { from, .. } | NewStorage::Child { from, .. } => from,
        };
        let mut locals = std::mem::take(&mut self.locals);
        locals.clear();
        locals.extend(blocks[from..].iter().map(|b| b.tokens_hash.0));
        match tail {
            NewStorage::None => {}
            NewStorage::Append { node, .. } => self.append(node, slot, &locals, guard),
            NewStorage::Child {
                parent, attach, id, ..
            } => {
                let got = self.new_child(parent, attach, &locals, slot, guard);
                debug_assert_eq!(got, id, "planned node id");
            }
        }
        self.locals = locals;
        self.blocks += blocks.len();
        ApplyOutcome {
            stored: blocks.len() as u32,
            ..Default::default()
        }
    }

    /// The mutation part of a store (validated by the caller). `hs[i]` is the
    /// `name_hash` of `blocks[i]`'s name, `buckets[i]` its bucket in the worker's map when
    /// validated (a hint), and `held[i]` the worker's current location of that name,
    /// `None` where the map holds it as `PENDING` (each of those is set below).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn store_chain(
        &mut self,
        slot: u32,
        parent_loc: Option<(NodeId, u32)>,
        blocks: &[StoredBlock],
        hs: &[u64],
        buckets: &[usize],
        held: &mut [Option<u64>],
        mut any_held: bool,
        guard: &Guard,
    ) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        // Once a cascade or rename rewrote the map, `held` is refreshed for what is left
        // (and `any_held` with it: whether any of it is held).
        let refresh = |w: &Self, held: &mut [Option<u64>], from: usize| {
            let mut any = false;
            for ((h, b), &x) in held[from..]
                .iter_mut()
                .zip(&blocks[from..])
                .zip(&hs[from..])
            {
                *h = w
                    .map(slot)
                    .get_h(x, b.block_hash.0)
                    .filter(|&v| v != PENDING);
                any |= h.is_some();
            }
            any
        };
        let (mut n, mut next) = parent_loc.map_or((ROOT, 0), |(n, p)| (n, p + 1));
        let mut i = 0;
        while i < blocks.len() {
            let b = &blocks[i];
            let ext = b.block_hash.0;
            let mut target = self.locate(n, next, b.tokens_hash.0, guard);
            if let Some(old) = held[i] {
                if target.map(|(t, p)| pack(t, p)) == Some(old) {
                    out.duplicate += 1;
                    (n, next) = target
                        .map(|(t, p)| (t, p + 1))
                        .expect("duplicate has a target");
                    i += 1;
                    continue;
                }
                // A moved hash: drop the old block and what the worker holds below it.
                self.state(slot).blocks.remove_h(hs[i], ext);
                let dropped = self.drop_from(slot, old, guard);
                self.blocks -= dropped as usize;
                out.removed += dropped;
                held[i] = None;
                any_held = refresh(self, held, i + 1);
                target = self.locate(n, next, b.tokens_hash.0, guard);
            }
            match target {
                Some((t, p)) if self.nodes[t as usize].cutoff(slot) > p => {
                    // A renamed path: same block, new name.
                    let loc = pack(t, p);
                    self.state(slot).blocks.remove_where(|_, v| v == loc);
                    self.state(slot).blocks.set_at(buckets[i], hs[i], ext, loc);
                    any_held = refresh(self, held, i + 1);
                    out.stored += 1;
                    (n, next) = (t, p + 1);
                    i += 1;
                }
                Some((t, p)) => {
                    // Extend the worker's coverage along an existing edge as far as the
                    // chain follows it with fresh names.
                    let k = self.run_along(t, p, blocks, i, guard, |j| held[j].is_none());
                    let map = &mut self.state(slot).blocks;
                    for (j, ((blk, &x), &at)) in blocks[i..i + k]
                        .iter()
                        .zip(&hs[i..i + k])
                        .zip(&buckets[i..i + k])
                        .enumerate()
                    {
                        map.set_at(at, x, blk.block_hash.0, pack(t, p + j as u32));
                    }
                    self.set_coverage(t, slot, p + k as u32, guard);
                    self.blocks += k;
                    out.stored += k as u32;
                    (n, next) = (t, p + k as u32);
                    i += k;
                }
                None => {
                    // New storage for the rest of the chain. Names the worker already uses
                    // elsewhere are moved first (`held` is all `None` unless `any_held`).
                    if any_held {
                        for j in i..blocks.len() {
                            if held[j].is_none() {
                                continue;
                            }
                            if let Some(old) = self
                                .state(slot)
                                .blocks
                                .remove_h(hs[j], blocks[j].block_hash.0)
                            {
                                let dropped = self.drop_from(slot, old, guard);
                                self.blocks -= dropped as usize;
                                out.removed += dropped;
                                refresh(self, held, j + 1);
                            }
                        }
                    }
                    let rest = &blocks[i..];
                    let mut locals = std::mem::take(&mut self.locals);
                    locals.clear();
                    locals.extend(rest.iter().map(|b| b.tokens_hash.0));
                    let (t, start) = if self.appends_at(n, next, slot) {
                        self.append(n, slot, &locals, guard);
                        (n, next)
                    } else {
                        (self.new_child(n, next, &locals, slot, guard), 0)
                    };
                    let map = &mut self.state(slot).blocks;
                    for (j, ((blk, &x), &at)) in
                        rest.iter().zip(&hs[i..]).zip(&buckets[i..]).enumerate()
                    {
                        map.set_at(at, x, blk.block_hash.0, pack(t, start + j as u32));
                    }
                    self.locals = locals;
                    self.blocks += rest.len();
                    out.stored += rest.len() as u32;
                    break;
                }
            }
        }
        out
    }
}
