//! Worker-slot bitsets: one inline word (slots 0..64) plus an overflow array for larger
//! shards. Written by the shard's one writer, read by any number of readers.
//!
//! Invariants and what readers see:
//! * Only the owning shard's writer calls [`AtomicBits::set`] / [`AtomicBits::clear`].
//! * A word is changed by one atomic RMW with `Release`; readers load words with `Acquire`,
//!   so a reader that sees a bit also sees everything the writer did before setting it (the
//!   slot's order entry, the coverage it stands for).
//! * The overflow array only grows: to grow, the writer copies the words into a longer
//!   array, publishes it with `Release` and retires the old one through the epoch
//!   collector. A reader holding the old array sees the words as they were when it was
//!   replaced, which is after the reader loaded it: bits set or cleared later are not seen
//!   (the set of a moment ago, which is a moment of the reader's lookup).

use crossbeam_epoch::{Atomic, Guard, Owned};

use crate::sync::{AtomicU64, Ordering};

/// Bits per word.
pub(crate) const WORD: usize = 64;

#[derive(Debug)]
struct Overflow {
    words: Box<[AtomicU64]>,
}

/// See the [module docs](self).
#[derive(Debug)]
pub(crate) struct AtomicBits {
    first: AtomicU64,
    rest: Atomic<Overflow>,
}

// One inline word and one pointer: a node's two bitsets cost 32 bytes until a shard has
// more than 64 slots.
#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<AtomicBits>() == 16);

impl AtomicBits {
    pub(crate) fn new() -> Self {
        Self {
            first: AtomicU64::new(0),
            rest: Atomic::null(),
        }
    }

    /// Sets `slot`. Writer only.
    pub(crate) fn set(&self, slot: u32, guard: &Guard) {
        let (w, bit) = split(slot);
        if w == 0 {
            self.first.fetch_or(bit, Ordering::Release);
            return;
        }
        let rest = self.rest.load(Ordering::Acquire, guard);
        // SAFETY: `rest` is null or was published by this (the only) writer and is retired
        // only by this writer after replacing it, which has not happened under `guard`.
        let cur = unsafe { rest.as_ref() };
        match cur {
            Some(o) if o.words.len() >= w => {
                o.words[w - 1].fetch_or(bit, Ordering::Release);
            }
            _ => {
                let old_len = cur.map_or(0, |o| o.words.len());
                let new_len = w.max(old_len * 2);
                let words: Box<[AtomicU64]> = (0..new_len)
                    .map(|i| {
                        let v = cur.map_or(0, |o| {
                            o.words.get(i).map_or(0, |x| x.load(Ordering::Relaxed))
                        });
                        AtomicU64::new(if i == w - 1 { v | bit } else { v })
                    })
                    .collect();
                self.rest
                    .store(Owned::new(Overflow { words }), Ordering::Release);
                if !rest.is_null() {
                    // SAFETY: the old array is unreachable from `self` now (replaced above),
                    // so only readers pinned before the swap can hold it; the collector
                    // frees it after they unpin.
                    unsafe { guard.defer_destroy(rest) };
                }
            }
        }
    }

    /// Clears `slot`. Writer only.
    pub(crate) fn clear(&self, slot: u32, guard: &Guard) {
        let (w, bit) = split(slot);
        if w == 0 {
            self.first.fetch_and(!bit, Ordering::Release);
            return;
        }
        let rest = self.rest.load(Ordering::Acquire, guard);
        // SAFETY: as in `set`.
        if let Some(word) = unsafe { rest.as_ref() }.and_then(|o| o.words.get(w - 1)) {
            word.fetch_and(!bit, Ordering::Release);
        }
    }

    /// Whether `slot` is set.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn contains(&self, slot: u32, guard: &Guard) -> bool {
        let (w, bit) = split(slot);
        if w == 0 {
            return self.first.load(Ordering::Acquire) & bit != 0;
        }
        let rest = self.rest.load(Ordering::Acquire, guard);
        // SAFETY: published overflow arrays stay valid while `guard` is pinned.
        unsafe { rest.as_ref() }
            .and_then(|o| o.words.get(w - 1))
            .is_some_and(|x| x.load(Ordering::Acquire) & bit != 0)
    }

    /// The first word (slots `0..64`), `Acquire`: all of the set for a shard whose slot
    /// capacity is at most 64.
    #[inline]
    pub(crate) fn first_word(&self) -> u64 {
        self.first.load(Ordering::Acquire)
    }

    /// `acc &= self`, word by word (words past the end of `self` are zero).
    #[inline]
    pub(crate) fn and_into(&self, acc: &mut [u64], guard: &Guard) {
        acc[0] &= self.first.load(Ordering::Acquire);
        if acc.len() > 1 {
            let rest = self.rest.load(Ordering::Acquire, guard);
            // SAFETY: published overflow arrays stay valid while `guard` is pinned.
            let words = unsafe { rest.as_ref() }.map_or(&[][..], |o| &o.words[..]);
            for (i, a) in acc[1..].iter_mut().enumerate() {
                *a &= words.get(i).map_or(0, |x| x.load(Ordering::Acquire));
            }
        }
    }

    /// `acc |= self`, word by word.
    #[inline]
    pub(crate) fn or_into(&self, acc: &mut [u64], guard: &Guard) {
        acc[0] |= self.first.load(Ordering::Acquire);
        if acc.len() > 1 {
            let rest = self.rest.load(Ordering::Acquire, guard);
            // SAFETY: published overflow arrays stay valid while `guard` is pinned.
            if let Some(o) = unsafe { rest.as_ref() } {
                for (a, x) in acc[1..].iter_mut().zip(o.words.iter()) {
                    *a |= x.load(Ordering::Acquire);
                }
            }
        }
    }

    /// Heap bytes owned (for memory accounting).
    pub(crate) fn heap_bytes(&self, guard: &Guard) -> usize {
        let rest = self.rest.load(Ordering::Acquire, guard);
        // SAFETY: published overflow arrays stay valid while `guard` is pinned.
        unsafe { rest.as_ref() }.map_or(0, |o| 16 + o.words.len() * 8)
    }
}

impl Drop for AtomicBits {
    fn drop(&mut self) {
        // SAFETY: `&mut self` means no reader can reach this value any more (its node was
        // retired and its grace period ended, or it was never shared).
        unsafe {
            let rest = self
                .rest
                .load(Ordering::Relaxed, crossbeam_epoch::unprotected());
            if !rest.is_null() {
                drop(rest.into_owned());
            }
        }
    }
}

#[inline]
fn split(slot: u32) -> (usize, u64) {
    let s = slot as usize;
    (s / WORD, 1u64 << (s % WORD))
}

/// Iterates the set bits of a word slice as slot numbers.
pub(crate) fn for_each_set(words: &[u64], mut f: impl FnMut(u32)) {
    for (i, &w) in words.iter().enumerate() {
        let mut w = w;
        while w != 0 {
            let b = w.trailing_zeros();
            f((i * WORD) as u32 + b);
            w &= w - 1;
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn set_clear_and_grow() {
        let bits = AtomicBits::new();
        let g = crossbeam_epoch::pin();
        for s in [0, 5, 63, 64, 200, 1023] {
            bits.set(s, &g);
        }
        bits.clear(5, &g);
        let mut acc = vec![u64::MAX; 16];
        bits.and_into(&mut acc, &g);
        let mut got = vec![];
        for_each_set(&acc, |s| got.push(s));
        assert_eq!(got, vec![0, 63, 64, 200, 1023]);
        assert!(bits.contains(1023, &g) && !bits.contains(5, &g) && !bits.contains(4000, &g));
        let mut or = vec![0u64; 2];
        bits.or_into(&mut or, &g);
        assert_eq!(or, vec![1 | (1 << 63), 1]);
    }
}
