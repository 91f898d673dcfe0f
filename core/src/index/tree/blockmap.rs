//! A writer-only hash map from a worker's sequence hashes to where the blocks sit
//! (`node id << 32 | position`): hashbrown (std's `HashMap`) with a fixed 64-bit finaliser
//! as the hash, so that runs are repeatable (callgrind) and sequential engine block ids
//! spread evenly.
//!
//! We measured a Robin Hood table with a separate tag array (non-power-of-two capacity,
//! 7/8 load): 8 bytes per cached block smaller, but about 20 % slower on the shared replay
//! log, where every removal is a cache miss and hashbrown's SIMD control groups probe
//! faster. Memory stays under half of Dynamo's per block with hashbrown (docs/BENCHMARKS.md).

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

pub(crate) use crate::hash::MixHasher;

/// See the [module docs](self).
#[derive(Debug, Clone, Default)]
pub(crate) struct BlockMap {
    map: HashMap<u64, u64, BuildHasherDefault<MixHasher>>,
}

impl BlockMap {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Bytes of the table: buckets of 16 bytes plus one control byte each.
    pub(crate) fn heap_bytes(&self) -> usize {
        let buckets = if self.map.capacity() == 0 {
            0
        } else {
            (self.map.capacity() * 8 / 7).next_power_of_two()
        };
        buckets * 17
    }

    #[inline]
    pub(crate) fn get(&self, key: u64) -> Option<u64> {
        self.map.get(&key).copied()
    }

    /// Inserts or replaces; returns the old value.
    #[inline]
    pub(crate) fn insert(&mut self, key: u64, val: u64) -> Option<u64> {
        self.map.insert(key, val)
    }

    /// Removes `key`; returns its value.
    #[inline]
    pub(crate) fn remove(&mut self, key: u64) -> Option<u64> {
        self.map.remove(&key)
    }

    /// Empties the map, keeping its capacity.
    pub(crate) fn clear(&mut self) {
        self.map.clear();
    }

    /// Every `(key, value)`.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.map.iter().map(|(&k, &v)| (k, v))
    }

    /// Removes the entries for which `drop(key, value)` is true; returns how many.
    pub(crate) fn remove_where(&mut self, mut drop: impl FnMut(u64, u64) -> bool) -> usize {
        let before = self.map.len();
        self.map.retain(|&k, &mut v| !drop(k, v));
        before - self.map.len()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
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
            match x % 3 {
                0 => assert_eq!(m.remove(key), r.remove(&key)),
                _ => assert_eq!(m.insert(key, step), r.insert(key, step)),
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
}
