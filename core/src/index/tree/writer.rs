//! The shard writer: applies one shard's events to its tree. Single-threaded by
//! construction (`ShardWriter` is `Send` but not `Sync`, and every mutation takes
//! `&mut self`), so per-worker event order needs no lock.
//!
//! The writer keeps its own plain bookkeeping per node (`Meta`: parent, holders and their
//! cutoffs, counts) next to the reader-visible [`Node`]; readers never see `Meta`. Every
//! reader-visible change goes through a handful of routines whose store order is what the
//! Consistency section of the [parent module](super) promises:
//!
//! * [`ShardWriter::set_coverage`] changes one worker's cutoff on one node. Coverage that
//!   grows is published before the worker is added to `any`; a worker that leaves the node
//!   leaves `any` first, so a worker in `any` is always in `full` or the partial list (a
//!   promotion sets `full` before it frees the entry, a demotion writes the entry before it
//!   clears `full`); coverage that shrinks is published (worker moved from `full` to
//!   `partial`, or its cutoff lowered) *before* the edge is trimmed, and workers promoted
//!   to `full` by a trim are promoted only *after* it.
//!   A reader loads the edge's length before the bits, so the promotion order alone does not
//!   keep it from pairing a length from before a trim with a `full` bit from after it; the
//!   reader checks the edge again after the bits and repeats the node when it was replaced
//!   or trimmed below the reader's divergence point (`reader::node_step`). With that check,
//!   no reader computes a cutoff above one the worker had at some moment of its lookup.
//! * [`ShardWriter::append`] extends the edge of a node held by exactly one worker: the new
//!   cells are written first, then the length is published with `Release`.
//! * [`ShardWriter::new_child`] builds a node completely, then links it into its parent's
//!   child table with a `Release` store.
//! * [`ShardWriter::prune`] unlinks a node that no worker holds and hands it to the epoch
//!   collector; it is freed once every reader that might have reached it has unpinned.

use ahash::{AHashMap, AHashSet};
use std::sync::{Arc, Mutex};

use crossbeam_epoch::{Atomic, Guard, Owned, Pointer, Shared};
use smallvec::SmallVec;

use super::blockmap::{BlockMap, CLAIMED, NameHasher, PENDING};
use super::garbage::{Reclaimer, Retired};
use super::raw::children::ChildTable;
use super::raw::edge::Edge;
use super::raw::node::Node;
use super::raw::partial::Partials;
use crate::event::{KvCacheEvent, KvEventData, RouterEvent, StoredBlock};
use crate::hash::{LocalBlockHash, SequenceBlockHash};
use crate::index::{ApplyError, ApplyOutcome, WorkerSummary};
use crate::sync::{AtomicU32, Ordering};
use crate::worker::{WorkerDp, WorkerId};

pub(crate) type NodeId = u32;
pub(crate) const ROOT: NodeId = 0;
/// How many names ahead of its probe a name's map lines are prefetched (24 measured about
/// 5 % faster than 16 on the shared replay log, with three entry lines per name; see
/// `BlockMap::prefetch`).
const PREFETCH_AHEAD: usize = 24;
const NO_PARTIAL: u32 = u32::MAX;

#[inline]
fn pack(node: NodeId, pos: u32) -> u64 {
    (node as u64) << 32 | pos as u64
}

#[inline]
fn unpack(v: u64) -> (NodeId, u32) {
    ((v >> 32) as NodeId, v as u32)
}

/// Consecutive blocks `[lo, hi]` of one node that a removal names tail first.
#[derive(Debug, Clone, Copy)]
struct TailRun {
    node: NodeId,
    lo: u32,
    hi: u32,
    /// The worker's `max_kid_attach` on the node (unchanged while the run grows): the run
    /// may grow down to this position with nothing of the worker's below it.
    floor: u32,
}

/// Where the part of a planned chain past the existing edges goes
/// ([`ShardWriter::plan_chain`]): `blocks[from..]` of the chain.
#[derive(Debug, Clone, Copy)]
enum NewStorage {
    /// The chain ends on existing edges.
    None,
    /// Appended to the edge of `node`, which only this worker holds, all of it.
    Append { node: NodeId, from: usize },
    /// A new child of `parent` at `attach`; it gets node id `id`.
    Child {
        parent: NodeId,
        attach: u32,
        id: NodeId,
        from: usize,
    },
}

/// One worker's hold on one node.
#[derive(Debug, Clone, Copy)]
struct Holder {
    slot: u32,
    /// The worker holds blocks `[0, cutoff)` of the edge.
    cutoff: u32,
    /// Index of its entry in the node's partial list, or `NO_PARTIAL` while it is `full`.
    partial: u32,
    /// Children of this node that the worker holds.
    kids: u32,
    /// An upper bound of those children's attach positions (exact while `kids == 0`).
    max_kid_attach: u32,
}

/// Writer-only bookkeeping of a node.
#[derive(Debug)]
struct Meta {
    node: *const Node,
    parent: NodeId,
    attach: u32,
    /// Published edge length (mirror of the buffer's `len`).
    len: u32,
    /// Highest length ever published for the current buffer (cells below are read-only).
    hwm: u32,
    cap: u32,
    holders: SmallVec<[Holder; 2]>,
    child_live: u32,
    /// Live children plus tombstones in the child table.
    child_used: u32,
    child_cap: u32,
    partial_cap: u32,
}

impl Meta {
    fn vacant() -> Self {
        Meta {
            node: std::ptr::null(),
            parent: ROOT,
            attach: 0,
            len: 0,
            hwm: 0,
            cap: 0,
            holders: SmallVec::new(),
            child_live: 0,
            child_used: 0,
            child_cap: 0,
            partial_cap: 0,
        }
    }

    fn holder(&self, slot: u32) -> Option<usize> {
        self.holders.iter().position(|h| h.slot == slot)
    }

    fn cutoff(&self, slot: u32) -> u32 {
        self.holder(slot).map_or(0, |i| self.holders[i].cutoff)
    }
}

/// Every slot ever assigned, sorted by the worker in it, so that a reader emits scores in
/// worker order without sorting. Replaced (copy on write) whenever a slot gets a worker,
/// *before* that worker's bit is set in the root's `any`: a reader that loads the root's
/// `any` and then the order (both `Acquire`) finds every slot it can score in the order.
/// A slot whose worker was removed keeps its place until it is reused; it has no bits, so
/// it is never emitted.
///
/// Each entry carries its worker, so an order is a self-contained immutable snapshot: a
/// reader emits workers from it with no other table, and readers over several shards
/// merge the shards' orders once per generation ([`super::reader::MergedOrder`]) instead of
/// merging every answer.
#[derive(Debug, Default)]
pub(crate) struct SlotOrder {
    /// Counts this shard's orders, from 0: two orders of one shard with the same
    /// generation are the same order.
    pub(crate) generation: u64,
    /// `(slot, its worker)`, sorted by worker.
    pub(crate) slots: Box<[(u32, WorkerDp)]>,
}

/// The part of a shard that readers see.
#[derive(Debug)]
pub(crate) struct ShardShared {
    pub(crate) root: Node,
    /// A multiple of 64 above every slot that has a worker, so that a reader knows how
    /// many bitset words to keep. Only grows; raised (`Release`) before the slot's order
    /// and bits are published, so a reader that loads it (`Acquire`) before the root's
    /// `any` has room for every slot it finds there, or leaves out slots added later.
    pub(crate) slot_cap: AtomicU32,
    pub(crate) order: Atomic<SlotOrder>,
}

impl Drop for ShardShared {
    fn drop(&mut self) {
        // SAFETY: `&mut self`: no reader or writer remains; the order was created by
        // `Owned::new` and is freed once.
        unsafe {
            let o = self
                .order
                .load(Ordering::Relaxed, crossbeam_epoch::unprotected());
            if !o.is_null() {
                drop(o.into_owned());
            }
        }
    }
}

// SAFETY: all reader-visible state is atomics, or cells whose access protocol is documented
// in `raw::edge`; raw pointers inside are only dereferenced under an epoch guard.
unsafe impl Send for ShardShared {}
// SAFETY: as above.
unsafe impl Sync for ShardShared {}

#[derive(Debug)]
struct SlotState {
    worker: WorkerDp,
    blocks: BlockMap,
    last_event_id: Option<u64>,
}

/// See the [module docs](self).
#[derive(Debug)]
pub struct ShardWriter {
    shared: Arc<ShardShared>,
    nodes: Vec<Meta>,
    free_ids: Vec<NodeId>,
    slots: Vec<Option<SlotState>>,
    slot_of: AHashMap<WorkerDp, u32>,
    /// Slots freed by `remove_worker`, handed back after a grace period so that no pinned
    /// reader can attribute an old worker's bits to a new one.
    recycled: Arc<Mutex<Vec<u32>>>,
    blocks: usize,
    /// Scratch: `name_hash` of each name of the event being applied.
    hashes: Vec<u64>,
    /// Scratch: the name map's bucket of each name of a stored chain (a hint, see
    /// [`BlockMap::set_at`]).
    buckets: Vec<usize>,
    /// Scratch: where the worker already has each name of a stored chain.
    held: Vec<Option<u64>>,
    /// Scratch: the local hashes of the new part of a stored chain.
    locals: Vec<u64>,
    /// Scratch: the existing edges a planned chain follows, `(node, from, count)`
    /// ([`ShardWriter::plan_chain`]).
    segments: Vec<(NodeId, u32, u32)>,
    /// Scratch: where each block of a planned chain goes (packed).
    planned: Vec<u64>,
    /// Unlinked objects waiting for their grace period.
    garbage: Reclaimer,
}

// SAFETY: the raw node pointers in `Meta` point into nodes owned by this writer's tree
// (reachable from `shared`); the writer may move to another thread as a whole.
unsafe impl Send for ShardWriter {}

impl ShardWriter {
    pub(crate) fn new() -> Self {
        let shared = Arc::new(ShardShared {
            root: Node::new(0, ROOT, &[], 0),
            slot_cap: AtomicU32::new(64),
            order: Atomic::new(SlotOrder::default()),
        });
        let mut root = Meta::vacant();
        root.node = &shared.root;
        Self {
            shared,
            nodes: vec![root],
            free_ids: Vec::new(),
            slots: Vec::new(),
            slot_of: AHashMap::new(),
            recycled: Arc::new(Mutex::new(Vec::new())),
            blocks: 0,
            hashes: Vec::new(),
            buckets: Vec::new(),
            held: Vec::new(),
            locals: Vec::new(),
            segments: Vec::new(),
            planned: Vec::new(),
            garbage: Reclaimer::new(),
        }
    }

    pub(crate) fn shared(&self) -> &Arc<ShardShared> {
        &self.shared
    }

    #[inline]
    fn node(&self, id: NodeId) -> &Node {
        // SAFETY: `nodes[id].node` points to a live node of this tree: ids are freed (and
        // their nodes retired) only in `prune`, after which no map entry or parent refers
        // to them.
        unsafe { &*self.nodes[id as usize].node }
    }

    /// Local hash at `pos` of node `id`.
    #[inline]
    fn local_at(&self, id: NodeId, pos: u32, guard: &Guard) -> u64 {
        let edge = self.node(id).edge.load(Ordering::Acquire, guard);
        // SAFETY: the writer's own edge buffer; `pos < len <= hwm`, cells below hwm are
        // never written again.
        unsafe { edge.deref().get(pos as usize) }
    }

    // ---------------------------------------------------------------- slots

    fn slot_for(&mut self, worker: WorkerDp, guard: &Guard) -> u32 {
        if let Some(&s) = self.slot_of.get(&worker) {
            return s;
        }
        let recycled = self.recycled.lock().map(|mut r| r.pop()).unwrap_or(None);
        let slot = recycled.unwrap_or(self.slots.len() as u32);
        if slot as usize == self.slots.len() {
            self.slots.push(None);
        }
        // Raised before the order and the bit below; `Release` pairs with the reader's
        // `Acquire` load in `reader::slot_cap` (see `ShardShared::slot_cap`). The writer's
        // own load needs no ordering.
        if slot >= self.shared.slot_cap.load(Ordering::Relaxed) {
            self.shared
                .slot_cap
                .store((slot / 64 + 1) * 64, Ordering::Release);
        }
        // The new order: this slot moved to its worker's place (a reused slot leaves its old
        // one). Published before the bit below, as `SlotOrder` requires.
        let old = self.shared.order.load(Ordering::Acquire, guard);
        // SAFETY: the order is replaced only here, by this writer, and freed through the
        // collector.
        let old_order = unsafe { old.deref() };
        let mut order: Vec<(u32, WorkerDp)> = old_order
            .slots
            .iter()
            .copied()
            .filter(|&(s, _)| s != slot)
            .collect();
        let at = order.partition_point(|&(_, w)| w < worker);
        order.insert(at, (slot, worker));
        self.shared.order.store(
            Owned::new(SlotOrder {
                generation: old_order.generation + 1,
                slots: order.into_boxed_slice(),
            }),
            Ordering::Release,
        );
        // SAFETY: unreachable from `shared` now; freed after current readers unpin.
        unsafe { guard.defer_destroy(old) };
        // `Release` inside `set`: a reader that sees this bit sees the table entry and the
        // order with this slot.
        self.shared.root.any.set(slot, guard);
        self.slots[slot as usize] = Some(SlotState {
            worker,
            blocks: BlockMap::new(),
            last_event_id: None,
        });
        self.slot_of.insert(worker, slot);
        slot
    }

    fn map(&self, slot: u32) -> &BlockMap {
        &self.slots[slot as usize]
            .as_ref()
            .expect("allocated slot")
            .blocks
    }

    fn state(&mut self, slot: u32) -> &mut SlotState {
        self.slots[slot as usize].as_mut().expect("allocated slot")
    }

    // ---------------------------------------------------------------- apply

    pub(crate) fn apply_in(
        &mut self,
        event: &RouterEvent,
        guard: &Guard,
    ) -> Result<ApplyOutcome, ApplyError> {
        self.garbage.collect();
        let r = self.apply_inner(event, guard);
        self.garbage.flush(guard);
        r
    }

    fn apply_inner(
        &mut self,
        event: &RouterEvent,
        guard: &Guard,
    ) -> Result<ApplyOutcome, ApplyError> {
        let worker = event.worker();
        let slot = self.slot_for(worker, guard);
        let event_id = event.event.event_id;
        self.state(slot).last_event_id = Some(event_id);
        match &event.event.data {
            KvEventData::Stored(s) => {
                self.apply_stored(slot, worker, event_id, s.parent_hash, &s.blocks, guard)
            }
            KvEventData::Removed(r) => {
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
            KvEventData::Cleared => {
                let removed = self.clear_slot(slot, guard) as u32;
                Ok(ApplyOutcome {
                    removed,
                    ..Default::default()
                })
            }
        }
    }

    /// Whether block `a` is `b` or one of its ancestors.
    fn is_ancestor_or_self(&self, a: (NodeId, u32), b: (NodeId, u32)) -> bool {
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
    fn locate(&self, n: NodeId, next: u32, local: u64, guard: &Guard) -> Option<(NodeId, u32)> {
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
    fn run_along(
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
    fn appends_at(&self, n: NodeId, next: u32, slot: u32) -> bool {
        let m = &self.nodes[n as usize];
        n != ROOT && next == m.len && m.holders.len() == 1 && m.holders[0].slot == slot
    }

    /// The id [`Self::new_child`] gives the next node.
    fn next_node_id(&self) -> NodeId {
        self.free_ids
            .last()
            .copied()
            .unwrap_or(self.nodes.len() as NodeId)
    }

    fn apply_stored(
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
    fn plan_chain(
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

    fn plan_into(
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
    fn store_planned(
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
    fn store_chain(
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

    /// Drops a tail run found by the removal loop: blocks `[lo, hi]` of the run's node,
    /// the worker's last ones there, with nothing of the worker's below them. Their map
    /// entries are already gone. Returns the blocks dropped.
    fn drop_run(&mut self, slot: u32, run: &TailRun, guard: &Guard) -> u32 {
        debug_assert_eq!(self.nodes[run.node as usize].cutoff(slot), run.hi + 1);
        self.set_coverage(run.node, slot, run.lo, guard);
        self.try_prune(run.node, guard);
        run.hi - run.lo + 1
    }

    /// Drops the worker's block at `loc` and everything it holds below; its map entry for
    /// `loc` is already gone. Returns the blocks dropped.
    fn drop_from(&mut self, slot: u32, loc: u64, guard: &Guard) -> u32 {
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
    fn held_children(&self, x: NodeId, slot: u32, guard: &Guard) -> Vec<NodeId> {
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

    fn clear_slot(&mut self, slot: u32, guard: &Guard) -> usize {
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

    // ---------------------------------------------------------------- node mutations

    /// Sets `slot`'s cutoff on node `x` to `new` (at most the published length), keeping
    /// `full`, `partial`, `any`, the edge length and the parent's kid counts right, in the
    /// order described in the module docs. Does not prune.
    fn set_coverage(&mut self, x: NodeId, slot: u32, new: u32, guard: &Guard) {
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

    fn adjust_parent_kids(&mut self, x: NodeId, slot: u32, added: bool) {
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

    fn partials<'g>(&self, x: NodeId, guard: &'g Guard) -> &'g Partials {
        let p = self.node(x).partial.load(Ordering::Acquire, guard);
        // SAFETY: present whenever a holder has a partial index; replaced only by this writer.
        unsafe { p.deref() }
    }

    /// Gives holder `hi` of `x` a partial entry with `cutoff` (in place when it has one).
    fn set_partial(&mut self, x: NodeId, hi: usize, cutoff: u32, guard: &Guard) {
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
                node.partial.store(Owned::new(grown), Ordering::Release);
                if !old.is_null() {
                    // Replaced above: freed after current readers unpin.
                    self.garbage.retire(Retired::Partials(old.as_raw()));
                }
                self.nodes[x as usize].partial_cap = cap;
            }
            self.nodes[x as usize].holders[hi].partial = idx;
        }
        self.partials(x, guard).set(idx as usize, slot, cutoff);
    }

    /// Lowers the published length of `x` to `new_len`; compacts the buffer when it is
    /// mostly slack.
    fn trim(&mut self, x: NodeId, new_len: u32, guard: &Guard) {
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
    fn append(&mut self, x: NodeId, slot: u32, locals: &[u64], guard: &Guard) {
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
    fn new_child(
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

    fn link_child(&mut self, parent: NodeId, child: Shared<'_, Node>, guard: &Guard) {
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
    fn rebuild_children(&mut self, x: NodeId, cap: u32, guard: &Guard) {
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
    fn try_prune(&mut self, mut x: NodeId, guard: &Guard) {
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

    fn prune(&mut self, x: NodeId, guard: &Guard) {
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

    // ---------------------------------------------------------------- whole workers

    pub(crate) fn clear_in(&mut self, worker: WorkerDp, guard: &Guard) -> usize {
        self.garbage.collect();
        let n = match self.slot_of.get(&worker) {
            Some(&s) => self.clear_slot(s, guard),
            None => 0,
        };
        self.garbage.flush(guard);
        n
    }

    pub(crate) fn remove_worker_in(&mut self, worker_id: WorkerId, guard: &Guard) -> usize {
        let slots: Vec<(WorkerDp, u32)> = self
            .slot_of
            .iter()
            .filter(|(w, _)| w.worker_id == worker_id)
            .map(|(w, s)| (*w, *s))
            .collect();
        self.garbage.collect();
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

impl Drop for ShardWriter {
    fn drop(&mut self) {
        // Free every node still linked. Readers hold `Arc<ShardShared>`, not nodes, beyond
        // their guards; once the writer is dropped the tree is frozen, and nodes are handed
        // to the collector so that pinned readers finish first.
        let guard = crossbeam_epoch::pin();
        let root_table = self
            .shared
            .root
            .children
            .swap(Shared::null(), Ordering::AcqRel, &guard);
        if !root_table.is_null() {
            // SAFETY: unlinked just above; readers pinned before still see the old tree.
            unsafe { guard.defer_destroy(root_table) };
        }
        for m in self.nodes.iter().skip(1) {
            if !m.node.is_null() {
                // SAFETY: each live node is retired exactly once, here; readers that reached
                // it are pinned and the collector waits for them.
                unsafe { guard.defer_destroy(Shared::from(m.node)) };
            }
        }
    }
}
