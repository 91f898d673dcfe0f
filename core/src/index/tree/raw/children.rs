//! A node's child table: open addressing with linear probing over atomic child pointers,
//! keyed by each child's immutable `(attach position, first local hash)`.
//!
//! Invariants and what readers see:
//! * Only the shard's writer stores into a table. A slot goes EMPTY → child → TOMBSTONE →
//!   child → ...; it never returns to EMPTY, so a probe sequence that a reader follows is
//!   never cut short under it. A reader that meets EMPTY may stop: the key was not present
//!   when that slot was read.
//! * A child is fully built before its pointer is stored with `Release`; readers load slots
//!   with `Acquire`, then read the child's immutable key. Because the key is read from the
//!   child itself, a slot that is reused for another child while a reader probes cannot make
//!   the reader accept the wrong child.
//! * Each slot also keeps its child's key hash, written (`Relaxed`) before the pointer's
//!   `Release` store, so a probe dereferences only the child whose hash matches instead of
//!   every child it passes (each a cache miss). The hash is a filter, never the answer: a
//!   reader that loaded a pointer sees that child's hash or a later child's; with a later
//!   one it passes over a child that was removed by then (a miss that a lookup one moment
//!   later would see too), and a match is still confirmed against the child itself.
//! * The table never grows in place: the writer builds a new table, publishes it in the
//!   node with `Release`, and retires the old one; readers of the old table see the children
//!   as they were.

use crossbeam_epoch::{Atomic, Guard, Owned, Shared};

use super::node::Node;
use super::tail::{Blank, Tail};
use crate::sync::{AtomicU64, Ordering};

const TOMB: usize = 1;

/// See the [module docs](self): the slots in one allocation ([`Tail`]), so a reader that
/// has loaded a node's table pointer reaches them without a second dependent load.
pub(crate) type ChildTable = Tail<(), Slot>;

/// One slot: the child's key hash (a probe filter) and the child, null, or a tombstone.
#[derive(Debug)]
pub(crate) struct Slot {
    key: AtomicU64,
    child: Atomic<Node>,
}

// A key filter and a pointer: four slots to a cache line.
#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<Slot>() == 16);

impl Blank for Slot {
    fn blank() -> Self {
        Slot {
            key: AtomicU64::new(0),
            child: Atomic::null(),
        }
    }
}

#[inline]
fn hash(attach: u32, local: u64) -> u64 {
    (local ^ ((attach as u64) << 40 | attach as u64)).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

impl Tail<(), Slot> {
    /// An empty table with `cap` slots (a power of two).
    pub(crate) fn with_capacity(cap: usize) -> Owned<Self> {
        // A release check too: a wrong mask would index past the slots or probe forever.
        assert!(
            cap.is_power_of_two(),
            "child table capacity {cap} is not a power of two"
        );
        Self::owned((), cap)
    }

    #[inline]
    fn start(&self, key: u64) -> usize {
        (key >> 32) as usize & (self.items.len() - 1)
    }

    /// The child hanging at `attach` whose first block is `local`.
    #[inline]
    pub(crate) fn get<'g>(&self, attach: u32, local: u64, guard: &'g Guard) -> Option<&'g Node> {
        self.find(attach, local, guard).map(|(_, child)| child)
    }

    /// The probe of [`Self::get`] and [`Self::remove`]: the slot holding the child with this
    /// key, and the child.
    #[inline]
    fn find<'g>(&self, attach: u32, local: u64, guard: &'g Guard) -> Option<(&Slot, &'g Node)> {
        let mask = self.items.len() - 1;
        let key = hash(attach, local);
        let mut i = self.start(key);
        for _ in 0..self.items.len() {
            let slot = &self.items[i];
            // `Acquire`: pairs with the `Release` store of the pointer in `insert`, so the
            // child's fields and the slot's hash written before it are visible.
            let p = slot.child.load(Ordering::Acquire, guard);
            if p.is_null() {
                if p.tag() != TOMB {
                    return None;
                }
            } else if slot.key.load(Ordering::Relaxed) == key {
                // SAFETY: non-null slot pointers are published children, freed only through
                // the epoch collector after being unlinked, so they outlive `guard`.
                let child = unsafe { p.deref() };
                if child.attach == attach && child.first == local {
                    return Some((slot, child));
                }
            }
            i = (i + 1) & mask;
        }
        None
    }

    /// Stores `child` in the first free or tombstoned slot of its probe sequence. Writer
    /// only; the caller keeps the load below 3/4 and checked that the key is absent. Returns
    /// whether a tombstone was reused.
    pub(crate) fn insert(&self, child: Shared<'_, Node>, guard: &Guard) -> bool {
        // SAFETY: the caller passes a live child.
        let c = unsafe { child.deref() };
        let mask = self.items.len() - 1;
        let key = hash(c.attach, c.first);
        let mut i = self.start(key);
        loop {
            let slot = &self.items[i];
            let p = slot.child.load(Ordering::Relaxed, guard);
            if p.is_null() {
                // The hash first: a reader that loads the pointer sees it (module docs).
                slot.key.store(key, Ordering::Relaxed);
                slot.child.store(child, Ordering::Release);
                return p.tag() == TOMB;
            }
            i = (i + 1) & mask;
        }
    }

    /// Replaces the child with `key` by a tombstone. Writer only. Returns whether it was
    /// present.
    pub(crate) fn remove(&self, attach: u32, local: u64, guard: &Guard) -> bool {
        match self.find(attach, local, guard) {
            Some((slot, _)) => {
                // `Release`, as every pointer store that `find`'s `Acquire` load may see.
                slot.child
                    .store(Shared::null().with_tag(TOMB), Ordering::Release);
                true
            }
            None => false,
        }
    }

    /// The live children.
    pub(crate) fn children<'a, 'g>(
        &'a self,
        guard: &'g Guard,
    ) -> impl Iterator<Item = Shared<'g, Node>> + use<'a, 'g> {
        self.items
            .iter()
            .map(move |s| s.child.load(Ordering::Acquire, guard))
            .filter(|p| !p.is_null())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crossbeam_epoch::Owned;

    #[test]
    fn insert_get_remove_reuse() {
        let g = crossbeam_epoch::pin();
        let t = ChildTable::with_capacity(8);
        let nodes: Vec<Shared<'_, Node>> = (0..5u64)
            .map(|i| Owned::new(Node::new(i as u32 % 2, i as u32, &[100 + i], 1)).into_shared(&g))
            .collect();
        for n in &nodes {
            assert!(!t.insert(*n, &g));
        }
        for i in 0..5u64 {
            assert_eq!(
                t.get(i as u32 % 2, 100 + i, &g).map(|n| n.first),
                Some(100 + i)
            );
        }
        assert!(t.get(1, 100, &g).is_none());
        assert!(t.remove(0, 102, &g));
        assert!(!t.remove(0, 102, &g));
        assert!(t.get(0, 102, &g).is_none());
        assert_eq!(t.children(&g).count(), 4);
        assert!(t.insert(nodes[2], &g) || t.children(&g).count() == 5);
        assert_eq!(t.get(0, 102, &g).map(|n| n.first), Some(102));
        for n in nodes {
            // SAFETY: the test owns the nodes and no other thread saw them.
            unsafe { drop(n.into_owned()) };
        }
    }
}
