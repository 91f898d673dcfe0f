//! A node's partial holders: workers that hold only a prefix `[0, cutoff)` of the node's
//! edge, as packed `(slot << 32 | cutoff)` words.
//!
//! The list is a [`Tail`] with no header: its capacity, then the words, in one allocation,
//! so that a reader that has loaded the node's pointer reaches the entries without a
//! second dependent load (the list is read on every step of a walk through a node that
//! has one).
//!
//! Invariants and what readers see:
//! * Only the shard's writer stores entries, each with one `Release` store of a whole word,
//!   so a reader never sees a slot with another slot's cutoff. `EMPTY` marks a free entry.
//! * A reader that misses an entry (or sees an older cutoff) sees a coverage that was true
//!   at some moment of its read; the writer orders its stores so that a worker's coverage
//!   is never overstated (see `writer.rs`, `set_coverage`).
//! * The list never grows in place: the writer copies it into a longer one, publishes it
//!   with `Release` and retires the old one.

use crossbeam_epoch::Owned;

use super::tail::{Blank, Tail};
use crate::sync::{AtomicU64, Ordering};

const EMPTY: u64 = u64::MAX;

/// See the [module docs](self).
pub(crate) type Partials = Tail<(), AtomicU64>;

impl Blank for AtomicU64 {
    fn blank() -> Self {
        AtomicU64::new(EMPTY)
    }
}

impl Tail<(), AtomicU64> {
    /// A copy of `old` with room for `cap` entries. Writer only.
    pub(crate) fn grown(old: Option<&Partials>, cap: usize) -> Owned<Partials> {
        let new = Self::owned((), cap);
        if let Some(old) = old {
            for (n, o) in new.items.iter().zip(old.items.iter()) {
                n.store(o.load(Ordering::Relaxed), Ordering::Relaxed);
            }
        }
        new
    }

    /// Calls `f(slot, cutoff)` for every entry.
    #[inline]
    pub(crate) fn for_each(&self, mut f: impl FnMut(u32, u32)) {
        for e in self.items.iter() {
            let v = e.load(Ordering::Acquire);
            if v != EMPTY {
                f((v >> 32) as u32, v as u32);
            }
        }
    }

    /// Sets entry `idx`. Writer only. `Release`: pairs with the `Acquire` in `for_each`.
    pub(crate) fn set(&self, idx: usize, slot: u32, cutoff: u32) {
        self.items[idx].store((slot as u64) << 32 | cutoff as u64, Ordering::Release);
    }

    /// Frees entry `idx`. Writer only.
    pub(crate) fn clear(&self, idx: usize) {
        self.items[idx].store(EMPTY, Ordering::Release);
    }
}
