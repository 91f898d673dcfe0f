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

mod lower;
mod publish;
mod removal;
mod store;
mod workers;

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
use super::shared::{ShardShared, SlotOrder};
use crate::event::{KvCacheEvent, KvEventData, RemovedData, RouterEvent, StoredBlock};
use crate::hash::{LocalBlockHash, SequenceBlockHash};
use crate::index::{ApplyError, ApplyOutcome, WorkerSummary};
use crate::sync::{AtomicU32, AtomicU64, Ordering};
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
            lower: Default::default(),
            lower_blocks: AtomicU64::new(0),
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
        if event.is_shared_pool() {
            return Ok(self.apply_pool(worker, &event.event.data, guard));
        }
        if !event.is_worker_owned() {
            // A residency domain this build does not know: nothing to index (the ingest
            // counts it before it gets here).
            return Ok(ApplyOutcome::default());
        }
        let slot = self.slot_for(worker, guard);
        let event_id = event.event.event_id;
        self.state(slot).last_event_id = Some(event_id);
        if let Some(t) = crate::index::tiers::lower_index(event.storage_tier) {
            return Ok(self.apply_lower(slot, worker, t, &event.event.data, guard));
        }
        match &event.event.data {
            KvEventData::Stored(s) => {
                self.apply_stored(slot, worker, event_id, s.parent_hash, &s.blocks, guard)
            }
            KvEventData::Removed(r) => self.apply_removed(slot, r, guard),
            KvEventData::Cleared => {
                let removed = self.clear_slot(slot, guard) as u32;
                if self.shared.lower_blocks.load(Ordering::Relaxed) > 0 {
                    self.with_lower(|l| l.clear(worker, None));
                }
                Ok(ApplyOutcome {
                    removed,
                    ..Default::default()
                })
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
