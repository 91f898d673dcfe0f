//! Writer-only hash tables keyed by a worker's sequence hashes.
//!
//! [`BlockMap`] maps each name to where its block sits (`node id << 32 | position`). Names
//! are random keys, so a probe's entry misses the cache (the replay streams its events
//! through the last-level cache beside the maps, so the misses often go to memory).
//!
//! # Layout
//!
//! A table of `n` slots in groups of 16 (any number of groups), like a Swiss table: one **tag**
//! byte per slot (0 for an empty slot, else 8 bits of the name's hash, never 0), an entry
//! `(name, value)` of 16 bytes per slot, and one **overflow count** byte per group. The
//! tags, 1/16 of the table, are what a probe reads first: for a worker's 16 k names they
//! are 25 KiB, which the cache keeps, so an insert reads no entry unless a tag matches
//! (one slot in 255 of the full ones), and a removal reads the one entry it removes.
//!
//! * A name's hash ([`name_hash`], keyed per process so that a worker cannot choose names
//!   that share a group) picks its **home group** (its high bits scaled to the group count
//!   by a multiply, as in Lemire's "fastrange", so that the count need not be a power of two),
//!   its tag (bits 4–11) and a start **offset** in the group (bits 0–3). A new name goes to
//!   the first empty slot of its home group from that offset on (wrapping within the
//!   group), so that the slot is near a line the writer prefetched; if the group is full,
//!   to the next group with room, and every group it passes over counts it in its
//!   overflow count.
//! * **Lookup**: compare the home group's 16 tags at once (SSE2) and the entries whose tag
//!   matches; if none is the name and the group's overflow count is 0, no name from this
//!   home went further: it is absent. Otherwise go on to the next group.
//! * **Removal** empties the slot's tag and lowers the counts of the groups between the
//!   name's home and its slot. No tombstones, as in F14 (folly): a slot is empty or full,
//!   so churn (the log removes and stores millions of names) never lengthens probes, and a
//!   removal reads no neighbouring group to decide between empty and deleted.
//! * A count that reaches 255 **saturates**: it is never raised or lowered again until the
//!   table is rebuilt, so it only overstates (a lookup may look further than it needs to,
//!   never stops short). Lookups are bounded by the group count besides. With the hash's
//!   per-process key a count saturates only if 255 names overflow one group, which
//!   random names at 3/4 load never do.
//! * The table grows beyond 3/4 full, rebuilding every count exactly, by half again (×1.5,
//!   not ×2 as hashbrown does): 17 bytes per slot, plus 1/16 byte for the counts, at a load
//!   between 1/2 and 3/4 instead of hashbrown's 7/16 to 7/8. Engines size their caches in
//!   powers of two, and a worker that holds 2^k blocks sat in a doubling table exactly half
//!   full, 34 bytes per name; ×1.5 puts it at 64 % (26.6 bytes). Near 7/8 a quarter of the
//!   groups overflow under churn, which made a small log's replay 40 % slower, hence the
//!   lower limit. The price is more rebuilds while a table fills (each name moved three
//!   times on average, not twice), none once a worker's cache is full.
//!
//! We used hashbrown's `HashTable` before, with the same prefetching. This table replays
//! the shared logs faster although it runs more instructions: its probes stall less. With
//! 255 tag values instead of 128, half as many inserts compare a key on a false tag match
//! (that compare was the costliest instruction of the writer in a sampling profile); a
//! removal reads no neighbouring group; a new table's entries are not zeroed; and the
//! prefetched entry lines are those a new name goes to.
//!
//! A stored chain is usually placed in the tree before its names are probed (the writer
//! plans it read-only), so that one probe per name both checks that the worker lacks it and
//! inserts it with its final location ([`BlockMap::insert_new_h`]). Otherwise (a name the
//! worker already has) a stored chain's names are looked up and, where absent, reserved in
//! the same probe ([`BlockMap::claim_h`]). That probe also marks each name as claimed by the
//! chain, which is how a chain that names a block twice is caught, and returns the name's
//! slot, so that setting it once the chain is placed needs no second probe
//! ([`BlockMap::set_at`]: a slot is only a hint, checked against the key, so a stale one
//! costs the probe and nothing else). A removal is one probe per name.
//!
//! The writer hashes all of an event's names first and [prefetches](BlockMap::prefetch)
//! each name's tags and entry lines a fixed distance ahead of its probe (the writer's
//! `PREFETCH_AHEAD`, 24 names), so that the misses overlap.
//!
//! Tables we measured and dropped, all slower on the shared replay logs: hashbrown (above);
//! four entries per 64-byte line with overflow counts and no tags (every insert then reads
//! a line of entries to learn that the name is new); a Robin Hood table with a separate tag
//! array; linear probing over single 16-byte slots with backward-shift removal or with
//! tombstones; four entries per line with tombstones (they piled up under the logs'
//! churn). docs/BENCHMARKS.md has each one's figures.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::mem::MaybeUninit;
use std::sync::OnceLock;

use crate::prefetch::prefetch_line;

/// The value of a name reserved by [`BlockMap::claim_h`] until its caller sets it (no block
/// sits at node `u32::MAX`); it has [`CLAIMED`] set.
pub(crate) const PENDING: u64 = u64::MAX;

/// Set on a value while a chain being validated claims its name ([`BlockMap::claim_h`]).
/// No stored value has it: node ids stay below 2^31 (a tree of 2^31 nodes would need
/// hundreds of GiB).
pub(crate) const CLAIMED: u64 = 1 << 63;

/// Slots per group.
const GROUP: usize = 16;
/// A count that has reached this stays there (see the module docs).
const SATURATED: u8 = u8::MAX;
/// Groups of the first table.
const MIN_GROUPS: usize = 1;

/// The hash of a name, as the table uses it: SplitMix64's finaliser of the name xor a key
/// drawn once per process. Names come from workers' events; with a fixed hash a worker
/// could pick names that all share one home group (the finaliser is invertible) and make
/// every probe of its map walk the whole table. Instruction counts (callgrind) therefore
/// vary a little from run to run with the layout.
#[inline]
pub(crate) fn name_hash(key: u64) -> u64 {
    NameHasher::get().hash(key)
}

/// [`name_hash`] with the process's key loaded once, for loops over an event's names.
#[derive(Debug, Clone, Copy)]
pub(crate) struct NameHasher(u64);

impl NameHasher {
    /// The process's hasher.
    #[inline]
    pub(crate) fn get() -> Self {
        static KEY: OnceLock<u64> = OnceLock::new();
        Self(*KEY.get_or_init(|| RandomState::new().hash_one(0x6b76_726f_7574_6572_u64)))
    }

    /// [`name_hash`] of `key`.
    #[inline(always)]
    pub(crate) fn hash(self, key: u64) -> u64 {
        crate::hash::mix(key ^ self.0)
    }
}

/// The tag of a hash: bits 4–11 (bits 0–3 are the start offset; the home group comes from
/// the high bits), 0 (the empty tag) taken as 1.
#[inline(always)]
fn tag_of(hash: u64) -> u8 {
    ((hash >> 4) as u8).max(1)
}

/// The home group of `hash` among `groups`: its high bits scaled (`hash * groups / 2^64`).
#[inline(always)]
fn home_in(hash: u64, groups: usize) -> usize {
    ((u128::from(hash) * groups as u128) >> 64) as usize
}

/// The tags of one group.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(16))]
struct Tags([u8; GROUP]);

impl Tags {
    /// Bit `i` set where tag `i` is `t`.
    #[inline(always)]
    fn matching(&self, t: u8) -> u16 {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{
                __m128i, _mm_cmpeq_epi8, _mm_load_si128, _mm_movemask_epi8, _mm_set1_epi8,
            };
            // SAFETY: `self` is 16 readable bytes aligned to 16 (`repr(align(16))`), and
            // SSE2 is part of every x86_64 target.
            unsafe {
                let v = _mm_load_si128(self.0.as_ptr() as *const __m128i);
                _mm_movemask_epi8(_mm_cmpeq_epi8(v, _mm_set1_epi8(t as i8))) as u16
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let mut m = 0u16;
            for (i, &x) in self.0.iter().enumerate() {
                m |= u16::from(x == t) << i;
            }
            m
        }
    }
}

/// One entry: a name and its value.
type Entry = (u64, u64);

/// The entries of one group, 256 bytes. Not aligned to cache lines: with
/// `#[repr(align(64))]` glibc's aligned allocations raised the replay's memory per cached
/// block past the memory target (docs/BENCHMARKS.md), so a group's entries may straddle
/// five lines.
#[derive(Debug)]
#[repr(C)]
struct Entries([MaybeUninit<Entry>; GROUP]);

// The sizes the module docs, the heap accounting and the prefetch offsets count on: a
// 16-byte entry, one 16-byte tag group read by one aligned SSE2 load, 256 bytes of entries
// per group.
const _: () = assert!(std::mem::size_of::<Entry>() == 16);
const _: () = assert!(std::mem::size_of::<Tags>() == GROUP && std::mem::align_of::<Tags>() == 16);
const _: () = assert!(std::mem::size_of::<Entries>() == GROUP * 16);

/// What a probe for an insert found.
enum Probe {
    /// The key, at this slot.
    Found(usize),
    /// Absent; `(home group, the first slot with room from there on)`.
    Vacant(usize, usize),
}

/// See the [module docs](self). Not `Clone`: nothing needs a copy.
#[derive(Debug, Default)]
pub(crate) struct BlockMap {
    /// Per group, its slots' tags (none before the first insert).
    tags: Box<[Tags]>,
    /// Per slot, its entry: written wherever the tag is not 0 (and perhaps uninitialised
    /// elsewhere: a new table's entries are not zeroed).
    entries: Box<[Entries]>,
    /// Per group: how many names with a home at or before it (in probe order) sit past
    /// it, saturating at [`SATURATED`].
    over: Box<[u8]>,
    /// Names held.
    len: usize,
    /// Groups (0 with no table: every hash then picks group 0, which `find` checks is
    /// there).
    groups: usize,
    /// Names the table takes before it grows: 3/4 of its slots.
    limit: usize,
}

impl BlockMap {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Bytes of the table: 17 per slot plus a count per group.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.tags.len() * (GROUP * 17 + 1)
    }

    /// Names `groups` groups take before the table grows: 3/4 of the slots.
    #[inline]
    fn limit(groups: usize) -> usize {
        groups * GROUP / 4 * 3
    }

    /// The home group of `hash`: its high bits scaled to the group count.
    #[inline(always)]
    fn home(&self, hash: u64) -> usize {
        home_in(hash, self.groups)
    }

    #[inline(always)]
    fn next(&self, g: usize) -> usize {
        let n = g + 1;
        if n >= self.groups { 0 } else { n }
    }

    /// The entry of slot `at`, whose tag is not 0.
    #[inline(always)]
    fn at(&self, at: usize) -> &Entry {
        debug_assert_ne!(self.tags[at / GROUP].0[at % GROUP], 0);
        // SAFETY: callers pass only slots whose tag is not 0, and `put` writes a slot's
        // entry whenever it sets its tag (a table starts with every tag 0).
        unsafe { self.entries[at / GROUP].0[at % GROUP].assume_init_ref() }
    }

    /// [`Self::at`], mutable.
    #[inline(always)]
    fn at_mut(&mut self, at: usize) -> &mut Entry {
        debug_assert_ne!(self.tags[at / GROUP].0[at % GROUP], 0);
        // SAFETY: as in `at`.
        unsafe { self.entries[at / GROUP].0[at % GROUP].assume_init_mut() }
    }

    /// Makes room for `additional` more names without moving the table, so that the
    /// prefetches of an event's names aim at the table its probes will read. Call before
    /// an event's prefetches.
    #[inline]
    pub(crate) fn ready_prefetch(&mut self, additional: usize) {
        self.reserve(additional);
    }

    /// Makes room for `additional` more names.
    #[inline(always)]
    fn reserve(&mut self, additional: usize) {
        if self.len + additional > self.limit {
            self.grow(self.len + additional);
        }
    }

    /// Rebuilds the table with enough groups for `need` names (half again as many groups
    /// at least).
    #[cold]
    #[inline(never)]
    fn grow(&mut self, need: usize) {
        let mut n = Self::grown(self.tags.len());
        while Self::limit(n) < need {
            n = Self::grown(n);
        }
        self.rebuild(n);
    }

    /// The group count after `n`: half again as many, at least one more.
    fn grown(n: usize) -> usize {
        (n + n / 2).max(n + 1).max(MIN_GROUPS)
    }

    /// Moves every name into a fresh table of `n` groups (with room for them all); counts
    /// start exact.
    fn rebuild(&mut self, n: usize) {
        debug_assert!(Self::limit(n) >= self.len);
        let old_tags = std::mem::replace(&mut self.tags, vec![Tags([0; GROUP]); n].into());
        let hasher = NameHasher::get();
        // SAFETY: `Entries` is an array of `MaybeUninit`, for which uninitialised memory is
        // a valid value.
        let fresh = unsafe { Box::<[Entries]>::new_uninit_slice(n).assume_init() };
        let old_entries = std::mem::replace(&mut self.entries, fresh);
        self.over = vec![0; n].into_boxed_slice();
        self.len = 0;
        self.groups = n;
        self.limit = Self::limit(n);
        for (g, t) in old_tags.iter().enumerate() {
            let mut full = !t.matching(0);
            while full != 0 {
                // SAFETY: the tag is not 0, so the entry was written (`put`).
                let (k, v) =
                    unsafe { old_entries[g].0[full.trailing_zeros() as usize].assume_init() };
                full &= full - 1;
                let h = hasher.hash(k);
                let home = self.home(h);
                let at = self.vacant_from(home, h);
                self.put(home, at, h, k, v);
            }
        }
    }

    /// Asks the cache for the lines a probe of `hash` starts with: the home group's tags
    /// and the entries from the start offset on (three lines, four entries each: a name
    /// sits within a few slots of its start offset unless its group is nearly full). Only
    /// a hint: it reads nothing.
    #[inline(always)]
    pub(crate) fn prefetch(&self, hash: u64) {
        if self.tags.is_empty() {
            return;
        }
        let g = self.home(hash);
        prefetch_line(self.tags.as_ptr().wrapping_add(g) as usize);
        let start = (hash as usize & (GROUP - 1)) * std::mem::size_of::<Entry>();
        let e = (self.entries.as_ptr().wrapping_add(g) as usize).wrapping_add(start);
        prefetch_line(e);
        prefetch_line(e.wrapping_add(64));
        prefetch_line(e.wrapping_add(128));
    }

    /// The slot of `key` in group `g`, whose tags are compared with `t`.
    #[inline(always)]
    fn match_in(&self, g: usize, t: u8, key: u64) -> Option<usize> {
        let mut m = self.tags[g].matching(t);
        while m != 0 {
            let at = g * GROUP + m.trailing_zeros() as usize;
            if self.at(at).0 == key {
                return Some(at);
            }
            m &= m - 1;
        }
        None
    }

    /// The slot of `key` (`hash == name_hash(key)`).
    #[inline(always)]
    fn find(&self, hash: u64, key: u64) -> Option<usize> {
        debug_assert_eq!(hash, name_hash(key));
        if self.tags.is_empty() {
            return None;
        }
        let t = tag_of(hash);
        let mut g = self.home(hash);
        for _ in 0..self.tags.len() {
            if let Some(at) = self.match_in(g, t, key) {
                return Some(at);
            }
            if self.over[g] == 0 {
                return None;
            }
            g = self.next(g);
        }
        None
    }

    /// The first empty slot of group `g` from `hash`'s start offset on, wrapping.
    #[inline(always)]
    fn vacant_in(&self, g: usize, hash: u64) -> Option<usize> {
        let empty = self.tags[g].matching(0);
        if empty == 0 {
            return None;
        }
        let o = hash as u32 & (GROUP as u32 - 1);
        let i = (empty.rotate_right(o).trailing_zeros() + o) as usize & (GROUP - 1);
        Some(g * GROUP + i)
    }

    /// Where `key` (`hash == name_hash(key)`) is, or the slot it would be inserted at.
    /// Needs room for one more name (the table is never full then).
    #[inline(always)]
    fn probe(&self, hash: u64, key: u64) -> Probe {
        let t = tag_of(hash);
        let home = self.home(hash);
        let mut g = home;
        let mut vacant = None;
        for _ in 0..self.tags.len() {
            if let Some(at) = self.match_in(g, t, key) {
                return Probe::Found(at);
            }
            if vacant.is_none() {
                vacant = self.vacant_in(g, hash);
            }
            if self.over[g] == 0 {
                break;
            }
            g = self.next(g);
        }
        let at = vacant.unwrap_or_else(|| self.vacant_from(self.next(g), hash));
        Probe::Vacant(home, at)
    }

    /// The first empty slot from group `g` on. Needs an empty slot somewhere (a table
    /// below its limit has one).
    fn vacant_from(&self, mut g: usize, hash: u64) -> usize {
        for _ in 0..self.tags.len() {
            if let Some(at) = self.vacant_in(g, hash) {
                return at;
            }
            g = self.next(g);
        }
        unreachable!("a table below its limit has an empty slot")
    }

    /// Puts `key` (`hash == name_hash(key)`, home group `home`) in the empty slot `at` and
    /// counts it in every group from its home to `at`'s.
    #[inline(always)]
    fn put(&mut self, home: usize, at: usize, hash: u64, key: u64, val: u64) {
        let (g, i) = (at / GROUP, at % GROUP);
        self.count_past(home, g, true);
        self.entries[g].0[i].write((key, val));
        self.tags[g].0[i] = tag_of(hash);
        self.len += 1;
    }

    /// Raises (`up`) or lowers the count of every group from `home` up to, not including,
    /// `g`: the groups a name homed at `home` and sitting in `g` passed over. Saturated
    /// counts stay.
    #[inline(always)]
    fn count_past(&mut self, home: usize, g: usize, up: bool) {
        let mut h = home;
        while h != g {
            let c = &mut self.over[h];
            if *c != SATURATED {
                *c = if up { *c + 1 } else { *c - 1 };
            }
            h = self.next(h);
        }
    }

    /// Empties slot `at` (which holds a name with hash `hash`) and uncounts it; returns
    /// its value.
    #[inline(always)]
    fn take(&mut self, at: usize, hash: u64) -> u64 {
        let (g, i) = (at / GROUP, at % GROUP);
        self.count_past(self.home(hash), g, false);
        let v = self.at(at).1;
        self.tags[g].0[i] = 0;
        self.len -= 1;
        v
    }

    #[inline]
    pub(crate) fn get(&self, key: u64) -> Option<u64> {
        self.get_h(name_hash(key), key)
    }

    /// [`Self::get`] with `hash == name_hash(key)` already computed.
    #[inline(always)]
    pub(crate) fn get_h(&self, hash: u64, key: u64) -> Option<u64> {
        self.find(hash, key).map(|at| self.at(at).1)
    }

    /// The entry of `key` (`hash == name_hash(key)`): `Ok(slot)` if present, else inserts
    /// it with `val` and returns `Err(slot)`.
    #[inline(always)]
    fn entry(&mut self, hash: u64, key: u64, val: u64) -> Result<usize, usize> {
        debug_assert_eq!(hash, name_hash(key));
        self.reserve(1);
        match self.probe(hash, key) {
            Probe::Found(at) => Ok(at),
            Probe::Vacant(home, at) => {
                self.put(home, at, hash, key, val);
                Err(at)
            }
        }
    }

    /// Claims `key` (`hash == name_hash(key)`) for the chain being validated: returns its
    /// value from before the claim, or `None` and inserts it as [`PENDING`] if absent; and
    /// either way the entry's slot, a hint for [`Self::set_at`].
    /// A present value gets [`CLAIMED`] set, so that a second claim of the same name
    /// returns a value with [`CLAIMED`] set ([`PENDING`] has it too). The caller restores
    /// every value it claimed, and sets or removes every name it reserved, before the map
    /// is read by anything else.
    #[inline(always)]
    pub(crate) fn claim_h(&mut self, hash: u64, key: u64) -> (Option<u64>, usize) {
        match self.entry(hash, key, PENDING) {
            Ok(at) => {
                let v = &mut self.at_mut(at).1;
                let old = *v;
                *v = old | CLAIMED;
                (Some(old), at)
            }
            Err(at) => (None, at),
        }
    }

    /// Inserts `key` (`hash == name_hash(key)`) with `val` if absent and returns `None`;
    /// returns its value, unchanged, if present. The fast path of a stored chain
    /// (`ShardWriter::apply_stored`): one probe per name that both checks that the worker
    /// lacks the name and sets its final location.
    #[inline(always)]
    pub(crate) fn insert_new_h(&mut self, hash: u64, key: u64, val: u64) -> Option<u64> {
        match self.entry(hash, key, val) {
            Ok(at) => Some(self.at(at).1),
            Err(_) => None,
        }
    }

    /// [`Self::set_h`], trying slot `hint` first: a hint from this map that still holds
    /// `key` saves the probe. Any hint is safe: a stale one (the table grew, or the entry
    /// went) is caught by the tag and key check and falls back to the probe.
    #[inline(always)]
    pub(crate) fn set_at(&mut self, hint: usize, hash: u64, key: u64, val: u64) {
        if let Some(t) = self.tags.get(hint / GROUP)
            && t.0[hint % GROUP] != 0
            && self.at(hint).0 == key
        {
            self.at_mut(hint).1 = val;
            return;
        }
        self.set_cold(hash, key, val)
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
        if let Ok(at) = self.entry(hash, key, val) {
            self.at_mut(at).1 = val;
        }
    }

    /// Removes `key` (`hash == name_hash(key)`); returns its value.
    #[inline(always)]
    pub(crate) fn remove_h(&mut self, hash: u64, key: u64) -> Option<u64> {
        let at = self.find(hash, key)?;
        Some(self.take(at, hash))
    }

    /// Every `(key, value)`.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.tags.iter().enumerate().flat_map(move |(g, t)| {
            (0..GROUP)
                .filter(move |&i| t.0[i] != 0)
                .map(move |i| *self.at(g * GROUP + i))
        })
    }

    /// Removes the entries for which `drop(key, value)` is true; returns how many. Moves
    /// no other entry, so slot hints of the others stay good.
    pub(crate) fn remove_where(&mut self, mut drop: impl FnMut(u64, u64) -> bool) -> usize {
        let before = self.len;
        for at in 0..self.entries.len() * GROUP {
            if self.tags[at / GROUP].0[at % GROUP] == 0 {
                continue;
            }
            let (k, v) = *self.at(at);
            if drop(k, v) {
                self.take(at, name_hash(k));
            }
        }
        before - self.len
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

    /// Keys whose home group is `g` in a table of `groups` groups.
    fn keys_homed_at(g: usize, groups: usize, n: usize) -> Vec<u64> {
        (1..)
            .filter(|&k| home_in(name_hash(k), groups) == g)
            .take(n)
            .collect()
    }

    #[test]
    fn overflow_counts_track_names_past_their_home() {
        let mut m = BlockMap::new();
        m.ready_prefetch(100);
        let groups = m.tags.len();
        assert!(groups >= 8);
        // Forty names homed at the last group: sixteen fit, the rest wrap around to groups
        // 0 and 1.
        let keys = keys_homed_at(groups - 1, groups, 40);
        for (v, &k) in keys.iter().enumerate() {
            assert_eq!(m.insert_new_h(name_hash(k), k, v as u64), None);
        }
        assert_eq!(m.tags.len(), groups, "no growth");
        assert_eq!(m.over[groups - 1], 24);
        assert_eq!(m.over[0], 8);
        assert_eq!(m.over[1], 0);
        for (v, &k) in keys.iter().enumerate() {
            assert_eq!(m.get(k), Some(v as u64));
        }
        // Removing a name from the home group leaves a hole that the next insert fills;
        // the names further on stay reachable.
        assert_eq!(m.remove_h(name_hash(keys[0]), keys[0]), Some(0));
        assert_eq!(m.over[groups - 1], 24);
        assert_eq!(m.remove_h(name_hash(keys[39]), keys[39]), Some(39));
        assert_eq!((m.over[groups - 1], m.over[0]), (23, 7));
        for &k in &keys[1..39] {
            assert!(m.get(k).is_some());
        }
        let more = keys_homed_at(groups - 1, groups, 41)[40];
        assert_eq!(m.insert_new_h(name_hash(more), more, 77), None);
        assert_eq!(m.over[groups - 1], 23, "took the hole in its home group");
        assert_eq!(m.get(more), Some(77));
        for &k in keys[1..39].iter().chain([&more]) {
            assert!(m.remove_h(name_hash(k), k).is_some());
        }
        assert!(m.over.iter().all(|&c| c == 0), "every count back to 0");
        assert!(m.tags.iter().all(|t| t.0 == [0; GROUP]));
        assert_eq!(m.len(), 0);
    }

    #[test]
    fn saturated_counts_only_overstate() {
        let mut m = BlockMap::new();
        m.ready_prefetch(400);
        let groups = m.tags.len();
        assert!(BlockMap::limit(groups) >= 400 && groups >= 32);
        // 300 names homed at group 0: its count passes 255 and saturates.
        let keys = keys_homed_at(0, groups, 300);
        for &k in &keys {
            m.set_h(name_hash(k), k, k);
        }
        assert_eq!(m.tags.len(), groups);
        assert_eq!(m.over[0], SATURATED);
        for &k in keys.iter().step_by(2) {
            assert_eq!(m.remove_h(name_hash(k), k), Some(k));
        }
        assert_eq!(m.over[0], SATURATED, "never lowered once saturated");
        for (i, &k) in keys.iter().enumerate() {
            assert_eq!(m.get(k), (i % 2 == 1).then_some(k));
        }
        // A name absent from a saturated chain is still found absent (the probe is
        // bounded), and inserting it works.
        let absent = keys_homed_at(0, groups, 301)[300];
        assert_eq!(m.get(absent), None);
        assert_eq!(m.insert_new_h(name_hash(absent), absent, 1), None);
        assert_eq!(m.get(absent), Some(1));
        // Growth rebuilds the counts exactly.
        m.ready_prefetch(2000);
        assert!(m.over.iter().all(|&c| c != SATURATED));
        assert_eq!(m.len(), 151);
        for (i, &k) in keys.iter().enumerate() {
            assert_eq!(m.get(k), (i % 2 == 1).then_some(k));
        }
    }

    #[test]
    fn a_power_of_two_of_names_fills_its_table_past_half() {
        // Engines size caches in powers of two; doubling tables held 2^k names at load 1/2.
        for k in [10u32, 14, 16] {
            let mut m = BlockMap::new();
            for key in 0..1u64 << k {
                m.set_h(name_hash(key), key, key);
            }
            let load = m.len() as f64 / (m.tags.len() * GROUP) as f64;
            assert!((0.5..=0.75).contains(&load), "2^{k} names: load {load}");
            for key in 0..1u64 << k {
                assert_eq!(m.get(key), Some(key));
            }
        }
        // Every growth step is at least one group and at most half again.
        let mut n = 0;
        for _ in 0..40 {
            let g = BlockMap::grown(n);
            assert!(g > n && g <= (n + n / 2).max(n + 1));
            n = g;
        }
    }

    #[test]
    fn tags_are_never_the_empty_tag() {
        assert_eq!(tag_of(0), 1);
        assert_eq!(tag_of(0xffff_ffff_ffff_f00f), 1);
        assert_eq!(tag_of(0x010), 1);
        assert_eq!(tag_of(0x020), 2);
        assert_eq!(tag_of(0xff0), 0xff);
        let mut t = Tags([0; GROUP]);
        t.0[3] = 7;
        t.0[15] = 7;
        assert_eq!(t.matching(7), 1 << 3 | 1 << 15);
        assert_eq!(t.matching(0), !(1 << 3 | 1 << 15));
    }

    #[test]
    fn names_sit_near_their_start_offset() {
        let mut m = BlockMap::new();
        m.ready_prefetch(0);
        m.prefetch(name_hash(1));
        for k in 0..5_000u64 {
            m.set_h(name_hash(k), k, k);
        }
        // The prefetch covers the entries from the start offset on; most names sit
        // within four slots of it.
        let near = (0..5_000u64)
            .filter(|&k| {
                let h = name_hash(k);
                let at = m.find(h, k).expect("held");
                let start = m.home(h) * GROUP + (h as usize & (GROUP - 1));
                at >= start && at < start + 4
            })
            .count();
        assert!(near > 4_000, "{near} of 5000 within 4 slots of their start");
    }

    #[test]
    fn stale_slot_hints_fall_back_to_the_probe() {
        let mut m = BlockMap::new();
        for k in 0..8u64 {
            m.set_h(name_hash(k), k, k);
        }
        let hints: Vec<usize> = (0..8u64).map(|k| m.claim_h(name_hash(k), k).1).collect();
        // Growth moves every entry: the hints now name other keys' slots or none.
        for k in 100..20_000u64 {
            m.set_h(name_hash(k), k, k);
        }
        for k in 0..8u64 {
            m.set_at(hints[k as usize], name_hash(k), k, k + 1000);
            assert_eq!(m.get(k), Some(k + 1000));
        }
        // A hint past the table.
        m.set_at(usize::MAX, name_hash(0), 0, 7);
        m.set_at(usize::MAX / 2, name_hash(0), 0, 7);
        assert_eq!(m.get(0), Some(7));
        assert_eq!(m.len(), 8 + 19_900);
    }
}
