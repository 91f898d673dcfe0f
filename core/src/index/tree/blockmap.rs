//! Writer-only hash tables keyed by a worker's sequence hashes.
//!
//! [`BlockMap`] maps each name to where its block sits (`node id << 32 | position`). It is
//! a hashbrown `HashTable` with explicit hashes: the writer hashes every name of an event
//! once ([`name_hash`], the SplitMix64 finaliser, fixed so that runs are repeatable under
//! callgrind and sequential engine block ids spread evenly) and reuses that hash for the
//! lookup, the insert and the removal of the name. A stored chain's names are looked up
//! and, where absent, reserved in the same probe ([`BlockMap::get_or_reserve_h`]), so
//! that the misses of the inserts overlap with those of the lookups.
//!
//! [`ChainSet`] is the per-event scratch set that checks that a stored chain names each
//! block once: open addressing with generation stamps, so that it is never cleared.
//!
//! We measured a Robin Hood table with a separate tag array (non-power-of-two capacity,
//! 7/8 load): 8 bytes per cached block smaller, but about 20 % slower on the shared replay
//! log, where every removal is a cache miss and hashbrown's SIMD control groups probe
//! faster. Memory stays under half of Dynamo's per block with hashbrown (docs/BENCHMARKS.md).

use hashbrown::HashTable;
use hashbrown::hash_table::Entry;

/// The value of a name reserved by [`BlockMap::get_or_reserve_h`] until its caller sets it
/// (no block sits at node `u32::MAX`).
pub(crate) const PENDING: u64 = u64::MAX;

/// The hash of a name, as both tables use it.
#[inline]
pub(crate) fn name_hash(key: u64) -> u64 {
    crate::hash::mix(key)
}

#[inline]
fn rehash(e: &(u64, u64)) -> u64 {
    name_hash(e.0)
}

/// See the [module docs](self).
#[derive(Debug, Clone, Default)]
pub(crate) struct BlockMap {
    table: HashTable<(u64, u64)>,
}

impl BlockMap {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }

    /// Bytes of the table: buckets of 16 bytes plus one control byte each.
    pub(crate) fn heap_bytes(&self) -> usize {
        let buckets = if self.table.capacity() == 0 {
            0
        } else {
            (self.table.capacity() * 8 / 7).next_power_of_two()
        };
        buckets * 17
    }

    #[inline]
    pub(crate) fn get(&self, key: u64) -> Option<u64> {
        self.get_h(name_hash(key), key)
    }

    /// [`Self::get`] with `hash == name_hash(key)` already computed.
    #[inline]
    pub(crate) fn get_h(&self, hash: u64, key: u64) -> Option<u64> {
        self.table.find(hash, |e| e.0 == key).map(|e| e.1)
    }

    /// `key`'s value (`hash == name_hash(key)`) if present; otherwise inserts it as
    /// [`PENDING`] and returns `None`. The caller sets or removes every name it reserved
    /// before the map is read by anything else.
    #[inline]
    pub(crate) fn get_or_reserve_h(&mut self, hash: u64, key: u64) -> Option<u64> {
        match self.table.entry(hash, |e| e.0 == key, rehash) {
            Entry::Occupied(e) => Some(e.get().1),
            Entry::Vacant(v) => {
                v.insert((key, PENDING));
                None
            }
        }
    }

    /// Sets `key` (`hash == name_hash(key)`) to `val`, inserting it if absent.
    #[inline]
    pub(crate) fn set_h(&mut self, hash: u64, key: u64, val: u64) {
        match self.table.find_entry(hash, |e| e.0 == key) {
            Ok(mut e) => e.get_mut().1 = val,
            Err(_) => {
                self.table.insert_unique(hash, (key, val), rehash);
            }
        }
    }

    /// Removes `key` (`hash == name_hash(key)`); returns its value.
    #[inline]
    pub(crate) fn remove_h(&mut self, hash: u64, key: u64) -> Option<u64> {
        match self.table.find_entry(hash, |e| e.0 == key) {
            Ok(e) => Some(e.remove().0.1),
            Err(_) => None,
        }
    }

    /// Every `(key, value)`.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.table.iter().copied()
    }

    /// Removes the entries for which `drop(key, value)` is true; returns how many.
    pub(crate) fn remove_where(&mut self, mut drop: impl FnMut(u64, u64) -> bool) -> usize {
        let before = self.table.len();
        self.table.retain(|e| !drop(e.0, e.1));
        before - self.table.len()
    }
}

/// See the [module docs](self). Holds at most half its slots, so probes stay short.
#[derive(Debug, Clone, Default)]
pub(crate) struct ChainSet {
    keys: Vec<u64>,
    /// `stamps[i] == stamp` marks slot `i` as holding a key of the current chain.
    stamps: Vec<u32>,
    stamp: u32,
}

impl ChainSet {
    /// Empties the set, sized for `n` keys.
    pub(crate) fn begin(&mut self, n: usize) {
        let want = (2 * n).next_power_of_two().max(16);
        if self.keys.len() < want {
            self.keys = vec![0; want];
            self.stamps = vec![0; want];
            self.stamp = 0;
        }
        self.stamp = self.stamp.wrapping_add(1);
        if self.stamp == 0 {
            self.stamps.fill(0);
            self.stamp = 1;
        }
    }

    /// Where `key`'s probe ends: its slot and `true`, or the free slot that ends the
    /// probe and `false`.
    #[inline]
    fn probe(&self, hash: u64, key: u64) -> (usize, bool) {
        let mask = self.keys.len() - 1;
        // The high half of the hash: hashbrown places by the low bits.
        let mut i = (hash >> 32) as usize & mask;
        while self.stamps[i] == self.stamp {
            if self.keys[i] == key {
                return (i, true);
            }
            i = (i + 1) & mask;
        }
        (i, false)
    }

    /// Adds `key` (`hash == name_hash(key)`); `false` if it was already in the set. At most
    /// the `n` keys given to [`Self::begin`] may be added.
    #[inline]
    pub(crate) fn insert(&mut self, hash: u64, key: u64) -> bool {
        let (i, found) = self.probe(hash, key);
        if !found {
            self.stamps[i] = self.stamp;
            self.keys[i] = key;
        }
        !found
    }

    /// Whether `key` (`hash == name_hash(key)`) is in the set.
    #[inline]
    pub(crate) fn contains(&self, hash: u64, key: u64) -> bool {
        !self.keys.is_empty() && self.probe(hash, key).1
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::collections::{HashMap, HashSet};

    use super::*;

    #[test]
    fn behaves_like_a_hash_map() {
        let mut m = BlockMap::new();
        let mut r = HashMap::new();
        let mut x = 1u64;
        for step in 0..50_000u64 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let key = (x >> 33) % 5000;
            match x % 4 {
                0 | 1 => assert_eq!(m.remove_h(name_hash(key), key), r.remove(&key)),
                2 => {
                    let h = name_hash(key);
                    if m.get_or_reserve_h(h, key).is_none() {
                        assert_eq!(m.get_h(h, key), Some(PENDING));
                    }
                    m.set_h(h, key, step);
                    r.insert(key, step);
                }
                _ => {
                    assert_eq!(m.get(key), r.get(&key).copied());
                    m.set_h(name_hash(key), key, step);
                    r.insert(key, step);
                }
            }
        }
        for (k, v) in &r {
            assert_eq!(m.get(*k), Some(*v));
        }
        assert_eq!(m.iter().count(), r.len());
        let n = m.remove_where(|k, _| k % 2 == 0);
        assert_eq!(n, r.keys().filter(|k| *k % 2 == 0).count());
        assert!(m.iter().all(|(k, _)| k % 2 == 1));
        assert!(m.heap_bytes() >= m.len() * 17);
    }

    #[test]
    fn chain_set_finds_repeats_across_many_chains() {
        let mut s = ChainSet::default();
        let mut x = 7u64;
        for chain in 0..3_000usize {
            let n = chain % 97;
            s.begin(n);
            let mut seen = HashSet::new();
            for _ in 0..n {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                // Small keys, so that chains repeat names and slots collide.
                let key = (x >> 40) % 64;
                let h = name_hash(key);
                assert_eq!(s.contains(h, key), seen.contains(&key));
                assert_eq!(s.insert(h, key), seen.insert(key));
                assert!(s.contains(h, key));
            }
        }
        // Stamps wrap around without leaking old chains' keys.
        s.stamp = u32::MAX - 1;
        s.begin(4);
        assert!(s.insert(name_hash(1), 1));
        s.begin(4);
        assert!(!s.contains(name_hash(1), 1));
        assert!(s.insert(name_hash(1), 1));
    }
}
