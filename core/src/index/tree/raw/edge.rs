//! Edge buffers: the local hashes along one node's compressed path.
//!
//! Invariants and what readers see:
//! * `len` is the number of blocks readers may read; `data[..len]` is initialised.
//! * The writer writes `data[i]` only for `i >= hwm`, where `hwm` (writer-side) is the
//!   largest `len` ever published for this buffer, and only before publishing a `len > i`
//!   with `Release`. A reader loads `len` with `Acquire` and reads `data[..len]`: those cells
//!   are never written again, so reading them is race-free even after the writer lowers
//!   `len` (a trim) — a reader with the older, longer `len` reads blocks that were held a
//!   moment ago. After a trim the writer never appends in place (`hwm > len`); it copies the
//!   live prefix into a new buffer instead and retires this one through the epoch collector.

use crate::sync::{AtomicU32, Cell, Ordering};

/// See the [module docs](self).
#[derive(Debug)]
pub(crate) struct Edge {
    len: AtomicU32,
    data: Box<[Cell<u64>]>,
}

impl Edge {
    /// A buffer of capacity `cap` holding `blocks` (published length `blocks.len()`).
    pub(crate) fn new(blocks: impl ExactSizeIterator<Item = u64>, cap: usize) -> Self {
        let n = blocks.len();
        debug_assert!(n <= cap && n <= u32::MAX as usize);
        let data: Box<[Cell<u64>]> = blocks
            .chain(std::iter::repeat_n(0, cap - n))
            .map(Cell::new)
            .collect();
        Self {
            len: AtomicU32::new(n as u32),
            data,
        }
    }

    /// Capacity in blocks.
    pub(crate) fn cap(&self) -> usize {
        self.data.len()
    }

    /// The published length. `Acquire`: pairs with the `Release` in [`Self::publish_len`].
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len.load(Ordering::Acquire) as usize
    }

    /// Block `i`.
    ///
    /// # Safety
    /// `i` must be below a length this thread loaded with [`Self::len`] (or, for the writer,
    /// below its `hwm`).
    #[inline]
    pub(crate) unsafe fn get(&self, i: usize) -> u64 {
        // SAFETY: cells below a published length are never written again (module docs).
        unsafe { self.data[i].read() }
    }

    /// Length of the common prefix of `data[..len]` and `query`.
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
            let edge = unsafe { std::slice::from_raw_parts(self.data.as_ptr().cast::<u64>(), n) };
            common_prefix(edge, &query[..n])
        }
        #[cfg(loom)]
        {
            // SAFETY: as above, one cell at a time.
            (0..n)
                .take_while(|&i| unsafe { self.data[i].read() } == query[i])
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
        unsafe { self.data[i].write(v) }
    }

    /// Publishes a new length. `Release`: the writes of `data[..len]` happen before a reader's
    /// `Acquire` load that sees it.
    #[inline]
    pub(crate) fn publish_len(&self, len: usize) {
        debug_assert!(len <= self.cap());
        self.len.store(len as u32, Ordering::Release);
    }
}

/// Length of the common prefix of two slices, compared eight hashes at a time.
#[cfg_attr(loom, allow(dead_code))]
#[inline]
pub(crate) fn common_prefix(a: &[u64], b: &[u64]) -> usize {
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + 8 <= n {
        // A branch-free XOR-OR over eight hashes compiles to vector ops inline, where a
        // slice comparison calls `memcmp`.
        let (x, y) = (&a[i..i + 8], &b[i..i + 8]);
        if (0..8).fold(0u64, |d, k| d | (x[k] ^ y[k])) != 0 {
            break;
        }
        i += 8;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn prefix_append_trim() {
        let e = Edge::new([1u64, 2, 3].into_iter(), 6);
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
