//! The reader-visible state of one shard: what the shard's writer publishes and every
//! reader walks. The writer ([`super::writer`]) and the reader ([`super::reader`]) both
//! import it from here; neither owns the other's types.
//!
//! Each field says which thread writes it and what a concurrent reader may observe.

use crossbeam_epoch::Atomic;

use super::raw::node::Node;
use crate::index::tiers::LowerTiers;
use crate::sync::{AtomicU32, AtomicU64, Ordering};
use crate::worker::WorkerDp;

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
    /// The shard's lower tiers ([`crate::index::tiers`]). Not lock-free: the writer takes
    /// the write lock per lower-tier event (and per clear of a worker holding lower-tier
    /// blocks), a reader the read lock per lookup, and only while `lower_blocks` is not 0.
    /// A reader sees each lower-tier event whole or not at all, and may combine it with
    /// device scores from a slightly different moment (as across shards).
    pub(crate) lower: std::sync::RwLock<LowerTiers>,
    /// Blocks in `lower`, stored (`Release`) after each change under the lock, so that a
    /// lookup of a device-only fleet skips the lock with one load.
    pub(crate) lower_blocks: AtomicU64,
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
