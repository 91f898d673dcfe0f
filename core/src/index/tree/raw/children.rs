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
//! * The table never grows in place: the writer builds a new table, publishes it in the
//!   node with `Release`, and retires the old one; readers of the old table see the children
//!   as they were.

use crossbeam_epoch::{Atomic, Guard, Shared};

use super::node::Node;
use crate::sync::Ordering;

const TOMB: usize = 1;

/// See the [module docs](self).
#[derive(Debug)]
pub(crate) struct ChildTable {
    slots: Box<[Atomic<Node>]>,
}

#[inline]
fn hash(attach: u32, local: u64) -> u64 {
    (local ^ ((attach as u64) << 40 | attach as u64)).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

impl ChildTable {
    /// An empty table with `cap` slots (a power of two).
    pub(crate) fn with_capacity(cap: usize) -> Self {
        debug_assert!(cap.is_power_of_two());
        Self {
            slots: (0..cap).map(|_| Atomic::null()).collect(),
        }
    }

    pub(crate) fn cap(&self) -> usize {
        self.slots.len()
    }

    #[inline]
    fn start(&self, attach: u32, local: u64) -> usize {
        (hash(attach, local) >> 32) as usize & (self.slots.len() - 1)
    }

    /// The child hanging at `attach` whose first block is `local`.
    #[inline]
    pub(crate) fn get<'g>(&self, attach: u32, local: u64, guard: &'g Guard) -> Option<&'g Node> {
        let mask = self.slots.len() - 1;
        let mut i = self.start(attach, local);
        for _ in 0..self.slots.len() {
            let p = self.slots[i].load(Ordering::Acquire, guard);
            // SAFETY: non-null slot pointers are published children, freed only through the
            // epoch collector after being unlinked, so they outlive `guard`.
            match unsafe { p.as_ref() } {
                Some(child) if child.attach == attach && child.first == local => {
                    return Some(child);
                }
                Some(_) => {}
                None if p.tag() == TOMB => {}
                None => return None,
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
        let mask = self.slots.len() - 1;
        let mut i = self.start(c.attach, c.first);
        loop {
            let p = self.slots[i].load(Ordering::Relaxed, guard);
            if p.is_null() {
                self.slots[i].store(child, Ordering::Release);
                return p.tag() == TOMB;
            }
            i = (i + 1) & mask;
        }
    }

    /// Replaces the child with `key` by a tombstone. Writer only. Returns whether it was
    /// present.
    pub(crate) fn remove(&self, attach: u32, local: u64, guard: &Guard) -> bool {
        let mask = self.slots.len() - 1;
        let mut i = self.start(attach, local);
        for _ in 0..self.slots.len() {
            let p = self.slots[i].load(Ordering::Relaxed, guard);
            // SAFETY: as in `get`.
            match unsafe { p.as_ref() } {
                Some(c) if c.attach == attach && c.first == local => {
                    self.slots[i].store(Shared::null().with_tag(TOMB), Ordering::Release);
                    return true;
                }
                Some(_) => {}
                None if p.tag() == TOMB => {}
                None => return false,
            }
            i = (i + 1) & mask;
        }
        false
    }

    /// The live children.
    pub(crate) fn children<'a, 'g>(
        &'a self,
        guard: &'g Guard,
    ) -> impl Iterator<Item = Shared<'g, Node>> + use<'a, 'g> {
        self.slots
            .iter()
            .map(move |s| s.load(Ordering::Acquire, guard))
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
