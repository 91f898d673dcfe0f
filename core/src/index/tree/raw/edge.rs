//! Edge buffers: the local hashes along one node's compressed path.
//!
//! Invariants and what readers see (`len` is the tail's `head`, the published length;
//! `cells` are its `items`, [`Tail`]):
//! * `len` is the number of blocks readers may read; `cells[..len]` is initialised.
//! * The writer writes `cells[i]` only for `i >= hwm`, where `hwm` (writer-side) is the
//!   largest `len` ever published for this buffer, and only before publishing a `len > i`
//!   with `Release`. A reader loads `len` with `Acquire` and reads `cells[..len]`: those cells
//!   are never written again, so reading them is race-free even after the writer lowers
//!   `len` (a trim) — a reader with the older, longer `len` reads blocks that were held a
//!   moment ago. After a trim the writer never appends in place (`hwm > len`); it copies the
//!   live prefix into a new buffer instead and retires this one through the epoch collector.
//! * Hence, within one buffer, the published length only rises (appends) and then only
//!   falls (trims): a reader that loads the same buffer pointer and a length of at least `m`
//!   before and after some other loads knows the length was at least `m` throughout. The
//!   reader's node step relies on this (`reader::node_step`).

use crossbeam_epoch::Owned;

#[cfg(not(loom))]
use crate::hash::common_prefix;

use super::tail::{Blank, Tail};
use crate::sync::{AtomicU32, Cell, Ordering};

/// See the [module docs](self): the published length, then the cells, in one allocation
/// ([`Tail`]), so a reader that has loaded a node's edge pointer reaches the hashes without
/// a second dependent load.
pub(crate) type Edge = Tail<AtomicU32, Cell<u64>>;

impl Blank for Cell<u64> {
    fn blank() -> Self {
        Cell::new(0)
    }
}

impl Tail<AtomicU32, Cell<u64>> {
    /// A buffer of capacity `cap` holding `blocks` (published length `blocks.len()`).
    pub(crate) fn with_blocks(blocks: &[u64], cap: usize) -> Owned<Self> {
        assert!(blocks.len() <= cap && cap <= u32::MAX as usize);
        let e = Self::owned(AtomicU32::new(blocks.len() as u32), cap);
        for (c, &b) in e.items.iter().zip(blocks) {
            // SAFETY: the buffer is not shared yet: nothing else reads or writes it.
            unsafe { c.write(b) };
        }
        e
    }

    /// The published length. `Acquire`: pairs with the `Release` in [`Self::publish_len`].
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.head.load(Ordering::Acquire) as usize
    }

    /// Block `i`.
    ///
    /// # Safety
    /// `i` must be below a length this thread loaded with [`Self::len`] (or, for the writer,
    /// below its `hwm`).
    #[inline]
    pub(crate) unsafe fn get(&self, i: usize) -> u64 {
        // SAFETY: cells below a published length are never written again (module docs).
        unsafe { self.items[i].read() }
    }

    /// Length of the common prefix of `cells[..len]` and `query`.
    ///
    /// # Safety
    /// As for [`Self::get`], for every index below `len`.
    #[inline]
    pub(crate) unsafe fn common_prefix(&self, len: usize, query: &[u64]) -> usize {
        let n = len.min(query.len());
        #[cfg(not(loom))]
        {
            // SAFETY: `Cell<u64>` is `repr(transparent)` over `UnsafeCell<u64>`, which has
            // the layout of `u64`; cells `..n` are never written while we read (caller).
            let edge = unsafe { std::slice::from_raw_parts(self.items.as_ptr().cast::<u64>(), n) };
            common_prefix(edge, &query[..n])
        }
        #[cfg(loom)]
        {
            // SAFETY: as above, one cell at a time.
            (0..n)
                .take_while(|&i| unsafe { self.items[i].read() } == query[i])
                .count()
        }
    }

    /// Writes block `i`. Writer only.
    ///
    /// # Safety
    /// `i` must be at or above every length ever published for this buffer, and no reader may
    /// be reading cell `i` (true by the previous condition).
    #[inline]
    pub(crate) unsafe fn write(&self, i: usize, v: u64) {
        // SAFETY: readers only read below a published length, which `i` is not (caller).
        unsafe { self.items[i].write(v) }
    }

    /// Publishes a new length. `Release`: the writes of `cells[..len]` happen before a reader's
    /// `Acquire` load that sees it.
    #[inline]
    pub(crate) fn publish_len(&self, len: usize) {
        debug_assert!(len <= self.cap());
        self.head.store(len as u32, Ordering::Release);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn prefix_append_trim() {
        let e = Edge::with_blocks(&[1u64, 2, 3], 6);
        assert_eq!(e.len(), 3);
        // SAFETY: single-threaded test; indices below the published length or hwm.
        unsafe {
            assert_eq!(e.common_prefix(e.len(), &[1, 2, 9]), 2);
            e.write(3, 4);
        }
        e.publish_len(4);
        // SAFETY: as above.
        unsafe {
            assert_eq!(e.common_prefix(e.len(), &[1, 2, 3, 4, 5]), 4);
            assert_eq!(e.get(3), 4);
        }
        e.publish_len(1);
        assert_eq!(e.len(), 1);
        let v: Vec<u64> = (0..40).collect();
        let mut w = v.clone();
        w[17] = 99;
        assert_eq!(common_prefix(&v, &w), 17);
        assert_eq!(common_prefix(&v, &v[..33]), 33);
    }
}
