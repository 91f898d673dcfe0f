//! Writer-only hash tables keyed by a worker's sequence hashes.
//!
//! [`BlockMap`] maps each name to where its block sits (`node id << 32 | position`). It is
//! a hashbrown `HashTable` with explicit hashes: the writer hashes every name of an event
//! once ([`name_hash`], the SplitMix64 finaliser, fixed so that runs are repeatable under
//! callgrind and sequential engine block ids spread evenly) and reuses that hash for the
//! lookup, the insert and the removal of the name. A stored chain is usually placed in the
//! tree before its names are probed (the writer plans it read-only), so that one probe per
//! name both checks that the worker lacks it and inserts it with its final location
//! ([`BlockMap::insert_new_h`]); on the shared replay log that took 14 % off the replay's
//! instructions and 20 % off its L1 misses. Otherwise (a name the worker already has) a
//! stored chain's names are looked up and, where absent, reserved in the same probe
//! ([`BlockMap::claim_h`]), so that the misses of the inserts overlap with those of the
//! lookups. That probe also marks each name as claimed by the chain, which is how a chain
//! that names a block twice is caught, and remembers the name's bucket, so that setting it
//! once the chain is placed needs no second probe ([`BlockMap::set_at`]: a bucket is only a
//! hint, checked against the key, so a stale one costs the probe and nothing else). A
//! removal is one probe per name.
//!
//! The names of an event are random keys, so each probe misses the cache (the replay
//! streams its events through the last-level cache, so the misses often go to memory). The
//! writer hashes all of an event's names first and [prefetches](BlockMap::prefetch) each
//! name's lines (control group and entries) a fixed distance ahead of its probe (the
//! writer's `PREFETCH_AHEAD`, 16 names), so that the misses overlap: on the shared replay
//! log this took a quarter off the sequential replay.
//!
//! Tables we measured and dropped, on the shared replay log: a Robin Hood table with a
//! separate tag array (non-power-of-two capacity, 7/8 load), 8 bytes per cached block
//! smaller but about 20 % slower than hashbrown (both without prefetching); and, with the
//! same prefetching, linear probing over inline 16-byte `(key, value)` slots (one line per
//! probe instead of a control line and an entry line), 25-30 % slower than hashbrown both
//! with backward-shift removal (closing the gap re-hashes the rest of the cluster) and with
//! tombstones (longer probes). Memory stays under half of Dynamo's per block with hashbrown
//! (docs/BENCHMARKS.md).

use hashbrown::HashTable;
use hashbrown::hash_table::Entry;

use crate::prefetch::prefetch_line;

/// The value of a name reserved by [`BlockMap::claim_h`] until its caller sets it (no block
/// sits at node `u32::MAX`); it has [`CLAIMED`] set.
pub(crate) const PENDING: u64 = u64::MAX;

/// Set on a value while a chain being validated claims its name ([`BlockMap::claim_h`]).
/// No stored value has it: node ids stay below 2^31 (a tree of 2^31 nodes would need
/// hundreds of GiB).
pub(crate) const CLAIMED: u64 = 1 << 63;

/// Bytes of one entry.
const ENTRY: usize = std::mem::size_of::<(u64, u64)>();

/// The hash of a name, as both tables use it.
#[inline]
pub(crate) fn name_hash(key: u64) -> u64 {
    crate::hash::mix(key)
}

#[inline]
fn rehash(e: &(u64, u64)) -> u64 {
    name_hash(e.0)
}

/// See the [module docs](self). Not `Clone`: a copy would aim its prefetches at the
/// original's table.
#[derive(Debug, Default)]
pub(crate) struct BlockMap {
    table: HashTable<(u64, u64)>,
    /// Where the table's control bytes start, and the bucket count it was taken at: a
    /// prefetch hint only ([`Self::prefetch`]), refreshed by [`Self::ready_prefetch`].
    ctrl: usize,
    ctrl_buckets: usize,
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

    /// Makes room for `additional` more names without moving the table, and refreshes the
    /// address [`Self::prefetch`] aims at if the table moved (or had no entry to aim from).
    /// Call before an event's prefetches: a table that grows in the middle of an event
    /// would leave them aiming at the old one.
    #[inline]
    pub(crate) fn ready_prefetch(&mut self, additional: usize) {
        self.table.reserve(additional, rehash);
        let n = self.table.num_buckets();
        if n != self.ctrl_buckets || (self.ctrl == 0 && !self.table.is_empty()) {
            self.ready_cold(n);
        }
    }

    #[cold]
    #[inline(never)]
    fn ready_cold(&mut self, n: usize) {
        self.ctrl_buckets = n;
        self.ctrl = 0;
        let Some(&(k, _)) = self.table.iter().next() else {
            return;
        };
        let Some(i) = self.table.find_bucket_index(name_hash(k), |e| e.0 == k) else {
            return;
        };
        if let Some(e) = self.table.get_bucket(i) {
            self.ctrl = (e as *const (u64, u64) as usize).wrapping_add((i + 1) * ENTRY);
        }
    }

    /// Where bucket `i`'s entry sits by hashbrown's layout (entries just below the control
    /// bytes, one per bucket, last bucket lowest), from the last [`Self::ready_prefetch`].
    #[inline(always)]
    fn entry_addr(&self, i: usize) -> usize {
        self.ctrl.wrapping_sub((i + 1) * ENTRY)
    }

    /// Asks the cache for the lines a probe of `hash` starts with: the control group at the
    /// hash's home bucket and the entries from there on (on the shared replay log, 9 in 10
    /// names sit within 3 buckets of their home). Only a hint: it reads nothing, and an
    /// address that is off (hashbrown does not promise its layout; a test checks it) costs
    /// a wasted prefetch, nothing else.
    #[inline(always)]
    pub(crate) fn prefetch(&self, hash: u64) {
        if self.ctrl == 0 {
            return;
        }
        let pos = (hash as usize) & (self.ctrl_buckets - 1);
        let data = self.entry_addr(pos);
        prefetch_line(self.ctrl.wrapping_add(pos));
        prefetch_line(data);
        prefetch_line(data.wrapping_sub(64));
    }

    /// [`Self::prefetch`] for a removal, which also reads the control group that ends at
    /// the entry's bucket (hashbrown's erase looks at the groups before and after the
    /// entry to choose between empty and tombstone; we aim at the home bucket's, where 9 in
    /// 10 entries sit within 3 buckets).
    #[inline(always)]
    pub(crate) fn prefetch_removal(&self, hash: u64) {
        if self.ctrl == 0 {
            return;
        }
        let mask = self.ctrl_buckets - 1;
        let pos = (hash as usize) & mask;
        let before = pos.wrapping_sub(16) & mask;
        if (self.ctrl.wrapping_add(pos) & 63) < 16 || before > pos {
            prefetch_line(self.ctrl.wrapping_add(before));
        }
        self.prefetch(hash);
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

    /// Claims `key` (`hash == name_hash(key)`) for the chain being validated: returns its
    /// value from before the claim, or `None` and inserts it as [`PENDING`] if absent; and
    /// either way the entry's bucket, a hint for [`Self::set_at`].
    /// A present value gets [`CLAIMED`] set, so that a second claim of the same name
    /// returns a value with [`CLAIMED`] set ([`PENDING`] has it too). The caller restores
    /// every value it claimed, and sets or removes every name it reserved, before the map
    /// is read by anything else.
    #[inline]
    pub(crate) fn claim_h(&mut self, hash: u64, key: u64) -> (Option<u64>, usize) {
        match self.table.entry(hash, |e| e.0 == key, rehash) {
            Entry::Occupied(mut e) => {
                let v = e.get().1;
                e.get_mut().1 = v | CLAIMED;
                (Some(v), e.bucket_index())
            }
            Entry::Vacant(v) => (None, v.insert((key, PENDING)).bucket_index()),
        }
    }

    /// Inserts `key` (`hash == name_hash(key)`) with `val` if absent and returns `None`;
    /// returns its value, unchanged, if present. The fast path of a stored chain
    /// (`ShardWriter::apply_stored`): one probe per name that both checks that the worker
    /// lacks the name and sets its final location.
    #[inline]
    pub(crate) fn insert_new_h(&mut self, hash: u64, key: u64, val: u64) -> Option<u64> {
        match self.table.entry(hash, |e| e.0 == key, rehash) {
            Entry::Occupied(e) => Some(e.get().1),
            Entry::Vacant(v) => {
                v.insert((key, val));
                None
            }
        }
    }

    /// [`Self::set_h`], trying bucket `hint` first: a hint from this map that still holds
    /// `key` saves the probe. Any hint is safe: a stale one (the table grew or rehashed, or
    /// the entry went) is caught by the key check and falls back to the probe.
    #[inline(always)]
    pub(crate) fn set_at(&mut self, hint: usize, hash: u64, key: u64, val: u64) {
        match self.table.get_bucket_mut(hint) {
            Some(e) if e.0 == key => e.1 = val,
            _ => self.set_cold(hash, key, val),
        }
    }

    // The probe behind a stale hint, kept out of line so that the hinted path stays small.
    #[cold]
    #[inline(never)]
    fn set_cold(&mut self, hash: u64, key: u64, val: u64) {
        self.set_h(hash, key, val)
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

#[cfg(all(test, not(loom)))]
mod tests {
    use std::collections::HashMap;

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
                0 => assert_eq!(m.remove_h(name_hash(key), key), r.remove(&key)),
                1 => {
                    // A hint taken before another key went (removals move no entry, so
                    // it still holds; stale hints have their own test below).
                    let h = name_hash(key);
                    let (old, at) = m.claim_h(h, key);
                    assert_eq!(old, r.get(&key).copied());
                    let other = key ^ 1;
                    assert_eq!(m.remove_h(name_hash(other), other), r.remove(&other));
                    m.set_at(at, h, key, step);
                    r.insert(key, step);
                }
                2 => {
                    let h = name_hash(key);
                    let (old, at) = m.claim_h(h, key);
                    assert_eq!(old, r.get(&key).copied());
                    assert_eq!(m.get_h(h, key), Some(old.map_or(PENDING, |v| v | CLAIMED)));
                    // A second claim sees the first.
                    assert!(m.claim_h(h, key).0.is_some_and(|v| v & CLAIMED != 0));
                    m.set_at(at, h, key, step);
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
    fn insert_new_sets_only_absent_names() {
        let mut m = BlockMap::new();
        for k in 0..1000u64 {
            assert_eq!(m.insert_new_h(name_hash(k), k, k * 2), None);
        }
        for k in 0..2000u64 {
            let old = (k < 1000).then_some(k * 2);
            assert_eq!(m.insert_new_h(name_hash(k), k, 7), old);
        }
        // Present names kept their values; absent ones got theirs.
        assert_eq!(m.get(10), Some(20));
        assert_eq!(m.get(1500), Some(7));
        assert_eq!(m.len(), 2000);
    }

    #[test]
    fn prefetches_aim_at_the_entries() {
        let mut m = BlockMap::new();
        m.ready_prefetch(0);
        assert_eq!(m.ctrl, 0, "an empty table has nothing to aim at");
        m.prefetch(name_hash(1));
        for k in 0..5_000u64 {
            m.set_h(name_hash(k), k, k);
            if k % 1000 == 0 {
                m.ready_prefetch(0);
            }
        }
        // Growth moved the table; the next event's refresh follows it.
        m.ready_prefetch(0);
        assert_eq!(m.ctrl_buckets, m.table.num_buckets());
        for k in 0..5_000u64 {
            let i = m
                .table
                .find_bucket_index(name_hash(k), |e| e.0 == k)
                .expect("held");
            let e = m.table.get_bucket(i).expect("full bucket");
            assert_eq!(
                m.entry_addr(i),
                e as *const (u64, u64) as usize,
                "bucket {i}"
            );
        }
    }

    #[test]
    fn stale_bucket_hints_fall_back_to_the_probe() {
        let mut m = BlockMap::new();
        for k in 0..8u64 {
            m.set_h(name_hash(k), k, k);
        }
        let hints: Vec<usize> = (0..8u64).map(|k| m.claim_h(name_hash(k), k).1).collect();
        // Growth moves every entry: the hints now name other keys' buckets or none.
        for k in 100..20_000u64 {
            m.set_h(name_hash(k), k, k);
        }
        for k in 0..8u64 {
            m.set_at(hints[k as usize], name_hash(k), k, k + 1000);
            assert_eq!(m.get(k), Some(k + 1000));
        }
        // A hint past the table.
        m.set_at(usize::MAX, name_hash(0), 0, 7);
        assert_eq!(m.get(0), Some(7));
        assert_eq!(m.len(), 8 + 19_900);
    }
}
