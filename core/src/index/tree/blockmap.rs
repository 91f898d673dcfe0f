//! A writer-only hash map from a worker's sequence hashes to where the blocks sit
//! (`node id << 32 | position`), tuned for memory and for cache misses.
//!
//! * Robin Hood linear probing with backward-shift deletion: no tombstones, short probe
//!   runs even at 7/8 load, and a lookup for an absent key stops early.
//! * One 2-byte tag per slot (probe distance and an 8-bit fingerprint of the key's hash)
//!   in its own array, 16-byte entries in another: probing, displacement and deletion read
//!   only the tags, which stay cache-resident; an entry is read only on a fingerprint match.
//!   Inserting a new key touches no entry but the ones it writes.
//! * Any capacity, not only powers of two (multiply-shift range reduction), up to 7/8 full,
//!   growth by 1.4x: 18 bytes per slot at 0.62 to 0.87 load, where a power-of-two table can
//!   sit at 0.44.
//!
//! Keys are mixed with a fixed 64-bit finaliser, so runs are repeatable (callgrind) and
//! sequential engine block ids spread evenly.

const MIN_CAP: usize = 16;
/// Probe distances must fit the tag's high byte (distance + 1, 0 meaning empty).
const MAX_DIST: usize = 250;

#[derive(Clone, Copy)]
struct Entry {
    key: u64,
    val: u64,
}

/// See the [module docs](self).
#[derive(Clone)]
pub(crate) struct BlockMap {
    /// 0: empty; else `(distance + 1) << 8 | fingerprint`.
    tags: Box<[u16]>,
    entries: Box<[Entry]>,
    len: usize,
}

impl std::fmt::Debug for BlockMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockMap")
            .field("len", &self.len)
            .field("cap", &self.tags.len())
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

#[inline]
fn tag(dist: usize, h: u64) -> u16 {
    ((dist as u16 + 1) << 8) | (h >> 56) as u16
}

#[inline]
fn dist_of(t: u16) -> usize {
    (t >> 8) as usize - 1
}

impl Default for BlockMap {
    fn default() -> Self {
        Self::new()
    }
}

impl BlockMap {
    pub(crate) fn new() -> Self {
        Self {
            tags: Box::new([]),
            entries: Box::new([]),
            len: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        self.tags.len() * (2 + std::mem::size_of::<Entry>())
    }

    #[inline]
    fn home(&self, h: u64) -> usize {
        ((h as u128 * self.tags.len() as u128) >> 64) as usize
    }

    #[inline]
    fn next(&self, i: usize) -> usize {
        if i + 1 == self.tags.len() { 0 } else { i + 1 }
    }

    #[inline]
    fn find(&self, key: u64) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let h = mix(key);
        let fp = (h >> 56) as u16;
        let mut i = self.home(h);
        let mut d = 0;
        loop {
            let t = self.tags[i];
            // Robin Hood: an empty slot, or an entry closer to its home than we are to ours,
            // means the key is absent.
            if t == 0 || dist_of(t) < d {
                return None;
            }
            if t & 0xff == fp && self.entries[i].key == key {
                return Some(i);
            }
            i = self.next(i);
            d += 1;
        }
    }

    /// Asks the CPU to start loading the slots `key` probes first, so that a batch of
    /// lookups overlaps its cache misses instead of paying them one after another.
    #[inline]
    pub(crate) fn prefetch(&self, key: u64) {
        if self.tags.is_empty() {
            return;
        }
        let i = self.home(mix(key));
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a prefetch is a hint that never faults and has no effect on program
        // semantics; both addresses are inside live allocations anyway.
        unsafe {
            use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
            _mm_prefetch::<_MM_HINT_T0>(self.tags.as_ptr().add(i).cast());
            _mm_prefetch::<_MM_HINT_T0>(self.entries.as_ptr().add(i).cast());
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = i;
    }

    #[inline]
    pub(crate) fn get(&self, key: u64) -> Option<u64> {
        self.find(key).map(|i| self.entries[i].val)
    }

    /// Inserts or replaces; returns the old value.
    pub(crate) fn insert(&mut self, key: u64, val: u64) -> Option<u64> {
        if let Some(i) = self.find(key) {
            return Some(std::mem::replace(&mut self.entries[i].val, val));
        }
        self.insert_new(key, val);
        None
    }

    /// Inserts a key known to be absent.
    pub(crate) fn insert_new(&mut self, key: u64, val: u64) {
        debug_assert!(self.find(key).is_none());
        if (self.len + 1) * 8 > self.tags.len() * 7 {
            self.resize(((self.tags.len() * 7) / 5).max(MIN_CAP));
        }
        let h = mix(key);
        let mut cur_tag = tag(0, h);
        let mut cur = Entry { key, val };
        let mut i = self.home(h);
        let mut d = 0;
        loop {
            let t = self.tags[i];
            if t == 0 {
                self.tags[i] = cur_tag;
                self.entries[i] = cur;
                self.len += 1;
                return;
            }
            if dist_of(t) < d {
                // Take the slot of the richer entry and carry it on.
                self.tags[i] = cur_tag;
                cur_tag = t;
                cur = std::mem::replace(&mut self.entries[i], cur);
                d = dist_of(t);
            }
            i = self.next(i);
            d += 1;
            if d > MAX_DIST {
                // Astronomically unlikely at 7/8 load; grow and place the carried entry.
                self.resize(self.tags.len() * 2);
                self.insert_new(cur.key, cur.val);
                return;
            }
            cur_tag = (cur_tag & 0xff) | (((d as u16) + 1) << 8);
        }
    }

    /// Removes `key`; returns its value.
    pub(crate) fn remove(&mut self, key: u64) -> Option<u64> {
        let mut i = self.find(key)?;
        let val = self.entries[i].val;
        self.len -= 1;
        // Backward shift: pull following displaced entries one slot closer to home.
        let mut j = self.next(i);
        loop {
            let t = self.tags[j];
            if t == 0 || dist_of(t) == 0 {
                break;
            }
            self.tags[i] = t - (1 << 8);
            self.entries[i] = self.entries[j];
            i = j;
            j = self.next(j);
        }
        self.tags[i] = 0;
        if self.tags.len() > MIN_CAP && self.len * 4 < self.tags.len() {
            self.resize((self.tags.len() / 2).max(MIN_CAP));
        }
        Some(val)
    }

    fn resize(&mut self, cap: usize) {
        let old_tags = std::mem::replace(&mut self.tags, vec![0; cap].into_boxed_slice());
        let old = std::mem::replace(
            &mut self.entries,
            vec![Entry { key: 0, val: 0 }; cap].into_boxed_slice(),
        );
        self.len = 0;
        for (t, e) in old_tags.iter().zip(old.iter()) {
            if *t != 0 {
                self.insert_new(e.key, e.val);
            }
        }
    }

    /// Empties the map, keeping its capacity.
    pub(crate) fn clear(&mut self) {
        self.tags.iter_mut().for_each(|t| *t = 0);
        self.len = 0;
    }

    /// Every `(key, value)`.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.tags
            .iter()
            .zip(self.entries.iter())
            .filter(|(t, _)| **t != 0)
            .map(|(_, e)| (e.key, e.val))
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
