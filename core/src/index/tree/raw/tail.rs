//! One allocation for a small header and a run of items, owned through crossbeam-epoch's
//! one-word pointers ([`Atomic`](crossbeam_epoch::Atomic), [`Owned`], `Shared`).
//!
//! Edge buffers and child tables are read on every level of every lookup, partial lists
//! at every node that has one. Kept as a header pointing at a separate array
//! (`Box<[T]>`), each costs two dependent loads: the header, then the array. As a
//! [`Tail`] the items follow the header in the same allocation, so a reader that has the
//! pointer reaches them in one (the first items usually share the header's cache line:
//! the allocation is only word-aligned).
//!
//! A `Tail` is unsized (its last field is a slice); crossbeam keeps it behind a thin
//! pointer through the [`Pointable`] hooks below, which store the capacity first in the
//! allocation and rebuild the fat pointer from it. The capacity never changes, so it needs
//! no synchronisation: it is written before the pointer is published.

use std::alloc::Layout;
use std::ptr;

use crossbeam_epoch::{Owned, Pointable};

/// An item's value in a fresh tail.
pub(crate) trait Blank {
    fn blank() -> Self;
}

/// See the [module docs](self).
#[derive(Debug)]
#[repr(C)]
pub(crate) struct Tail<H, T> {
    cap: usize,
    // Private to `raw`: edge.rs, children.rs and partial.rs reach them only through their
    // protocols.
    pub(super) head: H,
    pub(super) items: [T],
}

/// The layout of a tail of `cap` items, and the byte offsets of `head` and `items` (as
/// `repr(C)` lays them out: `Layout::extend` is that algorithm).
fn layout<H, T>(cap: usize) -> (Layout, usize, usize) {
    let (head, head_at) = Layout::new::<usize>()
        .extend(Layout::new::<H>())
        .expect("tail header layout");
    let items = Layout::array::<T>(cap).expect("tail capacity fits the address space");
    let (l, items_at) = head.extend(items).expect("tail layout");
    (l.pad_to_align(), head_at, items_at)
}

/// The fat pointer to the tail at `base`, of capacity `cap`.
fn fat<H, T>(base: *mut u8, cap: usize) -> *mut Tail<H, T> {
    // A slice pointer cast to a struct whose last field is a slice of the same type keeps
    // its length as the struct's metadata; the address is the struct's start.
    ptr::slice_from_raw_parts_mut(base.cast::<T>(), cap) as *mut Tail<H, T>
}

/// The capacity stored at `base`, the start of a live tail built by [`Pointable::init`]
/// (its first word, written before the tail was shared and never again).
///
/// # Safety
/// `base` must be the address of a live tail.
unsafe fn stored_cap(base: usize) -> usize {
    // SAFETY: the caller's tail starts with its capacity (`repr(C)`, first field).
    unsafe { ptr::read(base as *const usize) }
}

const fn max(a: usize, b: usize) -> usize {
    if a > b { a } else { b }
}

// `init` returns a live allocation of `layout(cap)` with every field initialised, aligned
// to `ALIGN` (the layout's alignment: at least a word's, which leaves crossbeam its tag
// bits); `deref`/`deref_mut` rebuild the fat pointer from the stored capacity; `drop` drops
// the fields in place and frees with the same layout.
impl<H, T: Blank> Pointable for Tail<H, T> {
    const ALIGN: usize = max(
        std::mem::align_of::<usize>(),
        max(std::mem::align_of::<H>(), std::mem::align_of::<T>()),
    );
    type Init = (H, usize);

    unsafe fn init((head, cap): (H, usize)) -> usize {
        let (l, head_at, items_at) = layout::<H, T>(cap);
        debug_assert_eq!(l.align(), Self::ALIGN);
        // SAFETY: the layout has a nonzero size (the capacity word alone).
        let base = unsafe { std::alloc::alloc(l) };
        if base.is_null() {
            std::alloc::handle_alloc_error(l);
        }
        // SAFETY: `base` is a fresh allocation of `l`; each field is written once at its
        // `repr(C)` offset before anything reads it.
        unsafe {
            base.cast::<usize>().write(cap);
            base.add(head_at).cast::<H>().write(head);
            let items = base.add(items_at).cast::<T>();
            for i in 0..cap {
                items.add(i).write(T::blank());
            }
        }
        base as usize
    }

    unsafe fn deref<'a>(ptr: usize) -> &'a Self {
        // SAFETY: the caller holds a live tail (crossbeam's contract).
        unsafe { &*fat(ptr as *mut u8, stored_cap(ptr)) }
    }

    unsafe fn deref_mut<'a>(ptr: usize) -> &'a mut Self {
        // SAFETY: as for `deref`, with the caller's exclusive access.
        unsafe { &mut *fat(ptr as *mut u8, stored_cap(ptr)) }
    }

    unsafe fn drop(ptr: usize) {
        // SAFETY: the caller owns the live tail and frees it once; `init` allocated it with
        // `layout(cap)`.
        unsafe {
            let cap = stored_cap(ptr);
            ptr::drop_in_place(fat::<H, T>(ptr as *mut u8, cap));
            std::alloc::dealloc(ptr as *mut u8, layout::<H, T>(cap).0);
        }
    }
}

impl<H, T: Blank> Tail<H, T> {
    /// A tail with `head` and `cap` blank items.
    pub(crate) fn owned(head: H, cap: usize) -> Owned<Self> {
        Owned::init((head, cap))
    }

    /// Bytes of the allocation of a tail of `cap` items.
    pub(crate) fn bytes(cap: usize) -> usize {
        layout::<H, T>(cap).0.size()
    }
}

impl<H, T> Tail<H, T> {
    /// Number of items.
    #[inline]
    pub(crate) fn cap(&self) -> usize {
        self.items.len()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crossbeam_epoch::{Atomic, Guard, Pointer, Shared};
    use std::sync::atomic::{AtomicUsize, Ordering};

    static DROPS: AtomicUsize = AtomicUsize::new(0);

    #[derive(Debug)]
    struct Counted(u64);
    impl Blank for Counted {
        fn blank() -> Self {
            Counted(7)
        }
    }
    impl Drop for Counted {
        fn drop(&mut self) {
            DROPS.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn build_read_and_free_through_crossbeam() {
        let mut o = Tail::<u8, Counted>::owned(3, 5);
        assert_eq!((o.head, o.cap()), (3, 5));
        assert!(o.items.iter().all(|c| c.0 == 7));
        o.items[4].0 = 9;
        let a: Atomic<Tail<u8, Counted>> = Atomic::from(o);
        let g: &Guard = &crossbeam_epoch::pin();
        let p = a.load(std::sync::atomic::Ordering::Acquire, g);
        // SAFETY: this thread owns the tail; nothing else saw it.
        let t = unsafe { p.deref() };
        assert_eq!(t.items[4].0, 9);
        assert_eq!(Tail::<u8, Counted>::bytes(5), 8 + 8 + 5 * 8);
        let raw = p.into_usize();
        // SAFETY: as above; freed once.
        drop(unsafe { Shared::<Tail<u8, Counted>>::from_usize(raw).into_owned() });
        assert_eq!(DROPS.load(Ordering::Relaxed), 5);
        let empty = Tail::<(), Counted>::owned((), 0);
        assert_eq!(empty.cap(), 0);
    }
}
