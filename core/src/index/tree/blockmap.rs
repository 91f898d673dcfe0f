//! A writer-only hash map from a worker's sequence hashes to where the blocks sit
//! (`node id << 32 | position`), tuned for memory: 16-byte entries, open addressing with
//! linear probing, any capacity (not only powers of two, via multiply-shift range reduction),
//! up to 7/8 full, growth by 1.4x, backward-shift deletion (no tombstones).
//!
//! Keys are mixed with a fixed 64-bit finaliser, so runs are repeatable (callgrind) and
//! sequential engine block ids spread evenly.

const EMPTY: u64 = u64::MAX;
const MIN_CAP: usize = 16;

#[derive(Clone, Copy)]
struct Entry {
    key: u64,
    val: u64,
}

/// See the [module docs](self).
#[derive(Clone)]
pub(crate) struct BlockMap {
    entries: Box<[Entry]>,
    len: usize,
}

impl std::fmt::Debug for BlockMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockMap")
            .field("len", &self.len)
            .field("cap", &self.entries.len())
            .finish()
    }
}

#[inline]
fn mix(k: u64) -> u64 {
    let mut z = k.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Default for BlockMap {
    fn default() -> Self {
        Self::new()
    }
}

impl BlockMap {
    pub(crate) fn new() -> Self {
        Self {
            entries: Box::new([]),
            len: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        self.entries.len() * std::mem::size_of::<Entry>()
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        ((mix(key) as u128 * self.entries.len() as u128) >> 64) as usize
    }

    #[inline]
    fn next(&self, i: usize) -> usize {
        if i + 1 == self.entries.len() {
            0
        } else {
            i + 1
        }
    }

    #[inline]
    fn find(&self, key: u64) -> Option<usize> {
        if self.entries.is_empty() {
            return None;
        }
        let mut i = self.home(key);
        loop {
            let e = self.entries[i];
            if e.val == EMPTY {
                return None;
            }
            if e.key == key {
                return Some(i);
            }
            i = self.next(i);
        }
    }

    #[inline]
    pub(crate) fn get(&self, key: u64) -> Option<u64> {
        self.find(key).map(|i| self.entries[i].val)
    }

    /// Inserts or replaces; returns the old value. `val` must not be `u64::MAX`.
    pub(crate) fn insert(&mut self, key: u64, val: u64) -> Option<u64> {
        debug_assert_ne!(val, EMPTY);
        if (self.len + 1) * 8 > self.entries.len() * 7 {
            self.resize(((self.entries.len() * 7) / 5).max(MIN_CAP));
        }
        let mut i = self.home(key);
        loop {
            let e = &mut self.entries[i];
            if e.val == EMPTY {
                *e = Entry { key, val };
                self.len += 1;
                return None;
            }
            if e.key == key {
                return Some(std::mem::replace(&mut e.val, val));
            }
            i = self.next(i);
        }
    }

    /// Removes `key`; returns its value.
    pub(crate) fn remove(&mut self, key: u64) -> Option<u64> {
        let mut hole = self.find(key)?;
        let val = self.entries[hole].val;
        self.len -= 1;
        // Backward-shift: pull later entries of the probe run into the hole when their home
        // is not cyclically inside (hole, j].
        let mut j = self.next(hole);
        loop {
            let e = self.entries[j];
            if e.val == EMPTY {
                break;
            }
            let h = self.home(e.key);
            let between = if hole <= j {
                hole < h && h <= j
            } else {
                hole < h || h <= j
            };
            if !between {
                self.entries[hole] = e;
                hole = j;
            }
            j = self.next(j);
        }
        self.entries[hole] = Entry { key: 0, val: EMPTY };
        if self.entries.len() > MIN_CAP && self.len * 4 < self.entries.len() {
            self.resize((self.entries.len() / 2).max(MIN_CAP));
        }
        Some(val)
    }

    fn resize(&mut self, cap: usize) {
        let old = std::mem::replace(
            &mut self.entries,
            vec![Entry { key: 0, val: EMPTY }; cap].into_boxed_slice(),
        );
        self.len = 0;
        for e in old.iter().filter(|e| e.val != EMPTY) {
            self.insert(e.key, e.val);
        }
    }

    /// Every `(key, value)`.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.entries
            .iter()
            .filter(|e| e.val != EMPTY)
            .map(|e| (e.key, e.val))
    }

    /// Removes the entries for which `drop(key, value)` is true; returns how many.
    pub(crate) fn remove_where(&mut self, mut drop: impl FnMut(u64, u64) -> bool) -> usize {
        let doomed: Vec<u64> = self
            .iter()
            .filter(|&(k, v)| drop(k, v))
            .map(|(k, _)| k)
            .collect();
        for k in &doomed {
            self.remove(*k);
        }
        doomed.len()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn behaves_like_a_hash_map() {
        let mut m = BlockMap::new();
        let mut r = HashMap::new();
        let mut x = 1u64;
        for step in 0..200_000u64 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let key = (x >> 33) % 5000;
            match x % 3 {
                0 => assert_eq!(m.remove(key), r.remove(&key)),
                _ => assert_eq!(m.insert(key, step), r.insert(key, step)),
            }
            assert_eq!(m.len(), r.len());
        }
        for (k, v) in &r {
            assert_eq!(m.get(*k), Some(*v));
        }
        assert_eq!(m.iter().count(), r.len());
        let n = m.remove_where(|k, _| k % 2 == 0);
        assert_eq!(n, r.keys().filter(|k| *k % 2 == 0).count());
        assert!(m.iter().all(|(k, _)| k % 2 == 1));
    }
}
