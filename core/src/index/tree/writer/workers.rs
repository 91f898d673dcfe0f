//! Whole workers: clearing and removing them, their summaries, heap accounting, and the
//! dump that rebuilds a shard's state.

use super::*;

impl ShardWriter {
    pub(crate) fn clear_in(&mut self, worker: WorkerDp, guard: &Guard) -> usize {
        self.garbage.collect();
        let n = match self.slot_of.get(&worker) {
            Some(&s) => self.clear_slot(s, guard),
            None => 0,
        };
        if self.shared.lower_blocks.load(Ordering::Relaxed) > 0 {
            self.with_lower(|l| l.clear(worker, None));
        }
        self.garbage.flush(guard);
        n
    }

    pub(crate) fn remove_worker_in(&mut self, worker_id: WorkerId, guard: &Guard) -> usize {
        self.remove_slots_in(|w| w.worker_id == worker_id, guard)
    }

    /// Drops and forgets every (worker, dp rank) that `which` selects.
    pub(crate) fn remove_slots_in(
        &mut self,
        which: impl Fn(WorkerDp) -> bool,
        guard: &Guard,
    ) -> usize {
        let slots: Vec<(WorkerDp, u32)> = self
            .slot_of
            .iter()
            .filter(|(w, _)| which(**w))
            .map(|(w, s)| (*w, *s))
            .collect();
        self.garbage.collect();
        if self.shared.lower_blocks.load(Ordering::Relaxed) > 0 {
            self.with_lower(|l| l.remove_where(&which));
        }
        let mut dropped = 0;
        for (w, s) in slots {
            dropped += self.clear_slot(s, guard);
            self.shared.root.any.clear(s, guard);
            self.slots[s as usize] = None;
            self.slot_of.remove(&w);
            let recycled = Arc::clone(&self.recycled);
            guard.defer(move || {
                if let Ok(mut r) = recycled.lock() {
                    r.push(s);
                }
            });
        }
        self.garbage.flush(guard);
        dropped
    }

    pub(crate) fn summaries(&self) -> impl Iterator<Item = WorkerSummary> + '_ {
        self.slots.iter().flatten().map(|s| WorkerSummary {
            worker: s.worker,
            blocks: s.blocks.len(),
            last_event_id: s.last_event_id,
        })
    }

    pub(crate) fn summary_of(&self, worker: WorkerDp) -> Option<WorkerSummary> {
        let s = self.slots[*self.slot_of.get(&worker)? as usize].as_ref()?;
        Some(WorkerSummary {
            worker,
            blocks: s.blocks.len(),
            last_event_id: s.last_event_id,
        })
    }

    pub(crate) fn blocks_held(&self) -> usize {
        self.blocks
    }

    /// Heap bytes of the whole shard: nodes, writer bookkeeping and block maps.
    pub(crate) fn heap_bytes_in(&self, guard: &Guard) -> usize {
        let mut n = self.nodes.capacity() * std::mem::size_of::<Meta>();
        for m in &self.nodes {
            if !m.node.is_null() {
                // SAFETY: live node.
                n += unsafe { &*m.node }.heap_bytes(guard);
                if m.holders.spilled() {
                    n += m.holders.capacity() * std::mem::size_of::<Holder>();
                }
            }
        }
        n + self
            .slots
            .iter()
            .flatten()
            .map(|s| s.blocks.heap_bytes())
            .sum::<usize>()
    }

    /// Live nodes (excluding the root).
    pub(crate) fn live_nodes(&self) -> usize {
        self.nodes
            .iter()
            .skip(1)
            .filter(|m| !m.node.is_null())
            .count()
    }

    /// Events that rebuild this shard's state: per worker (in order) what
    /// [`Self::dump_worker_in`] gives.
    pub(crate) fn dump_in(&self, guard: &Guard) -> Vec<RouterEvent> {
        let mut workers: Vec<WorkerDp> = self.slots.iter().flatten().map(|s| s.worker).collect();
        workers.sort();
        let mut events = Vec::new();
        for w in workers {
            self.dump_worker_in(w, &mut events, guard);
        }
        events
    }

    /// Appends the events that rebuild one (worker, dp rank)'s state to `events`: a
    /// `Cleared`, then one `Stored` per node it holds, parents first. Nothing for a worker
    /// this shard does not know.
    pub(crate) fn dump_worker_in(
        &self,
        worker: WorkerDp,
        events: &mut Vec<RouterEvent>,
        guard: &Guard,
    ) {
        let Some(&slot) = self.slot_of.get(&worker) else {
            return;
        };
        if let Some(st) = self.slots[slot as usize].as_ref() {
            let id = st.last_event_id.unwrap_or(0);
            let w = st.worker;
            events.push(RouterEvent::new(
                w.worker_id,
                KvCacheEvent::cleared(id, w.dp_rank),
            ));
            // The nodes the worker holds, parents first, and where each one's names start
            // in one array: a name's place is its node's start plus its position, so the
            // worker's map is read once, in table order, and every name is written straight
            // to its place (a location -> name hash map missed the cache on every insert
            // and every lookup, and a worker of millions of blocks paused its shard for
            // hundreds of ms).
            let mut order: Vec<NodeId> = Vec::new();
            let mut start: Vec<usize> = vec![usize::MAX; self.nodes.len()];
            let mut total = 0usize;
            let mut stack: Vec<NodeId> = self.held_children(ROOT, slot, guard);
            while let Some(x) = stack.pop() {
                start[x as usize] = total;
                total += self.nodes[x as usize].cutoff(slot) as usize;
                order.push(x);
                stack.extend(self.held_children(x, slot, guard));
            }
            let mut names = vec![0u64; total];
            let mut placed = 0usize;
            for (name, loc) in st.blocks.iter() {
                let (x, p) = unpack(loc);
                let Some(&s) = start.get(x as usize) else {
                    continue;
                };
                if s != usize::MAX && p < self.nodes[x as usize].cutoff(slot) {
                    names[s + p as usize] = name;
                    placed += 1;
                }
            }
            // Every held block has exactly one name in the map (the map's invariant, which
            // no input can break): checked in release too, so that a broken invariant stops
            // the dump, as the hash map's lookup did, instead of writing a snapshot with
            // names missing.
            assert_eq!(
                placed, total,
                "a held block without a name in {worker:?}'s map"
            );
            for &x in &order {
                let m = &self.nodes[x as usize];
                let base = start[x as usize];
                // A held node's parent is held up to the node's attach point (prefix
                // closure), so its name there was placed above.
                let parent = (m.parent != ROOT).then(|| {
                    SequenceBlockHash(names[start[m.parent as usize] + m.attach as usize - 1])
                });
                let blocks = (0..m.cutoff(slot)).map(|p| {
                    (
                        LocalBlockHash(self.local_at(x, p, guard)),
                        SequenceBlockHash(names[base + p as usize]),
                    )
                });
                events.push(RouterEvent::new(
                    w.worker_id,
                    KvCacheEvent::stored(id, w.dp_rank, parent, blocks),
                ));
            }
        }
    }
}
