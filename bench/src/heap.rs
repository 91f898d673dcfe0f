//! Live-heap accounting for the replays: a global allocator that forwards to the system's
//! (or, with the `mimalloc` feature, to mimalloc, the shipped binary's allocator, for
//! both indexes alike) and, once [`enable`]d, counts the bytes allocated and freed, so
//! that an index's memory is measured by what it asked the allocator for, the same way
//! for every index (ours and Dynamo's), instead of by RSS growth (which the parsed log,
//! page granularity and the allocator's own caching blur).
//!
//! Counting costs one relaxed atomic add per allocation and per free, on one of 32
//! cache-line-padded counters picked by the calling thread, so that threads do not share a
//! line. Off (the default), it costs one relaxed load of a flag that is never written.
//!
//! A reader of [`live_bytes`] may miss allocations in flight on other threads; a replay
//! reads it before and after, with its own thread the only one allocating (or after the
//! others have stopped).

#[cfg(not(feature = "mimalloc"))]
use std::alloc::System as Inner;
use std::alloc::{GlobalAlloc, Layout};

#[cfg(feature = "mimalloc")]
use mimalloc::MiMalloc as Inner;
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};

/// Whether to count. `Relaxed` on both sides: it pairs with no other memory, and a thread
/// that sees it late only leaves a few allocations of its own uncounted (a replay enables
/// it before it loads its log, and reads counts only as differences after that).
static ON: AtomicBool = AtomicBool::new(false);

#[repr(align(128))]
struct Slot(AtomicIsize);

const SLOTS: usize = 32;
static COUNTS: [Slot; SLOTS] = [const { Slot(AtomicIsize::new(0)) }; SLOTS];

thread_local! {
    static HERE: u8 = const { 0 };
}

fn slot() -> &'static AtomicIsize {
    // The address of a thread-local names the thread (const-initialised, no destructor:
    // usable inside the allocator).
    let a = HERE.with(|h| h as *const u8 as usize);
    &COUNTS[(a >> 7) % SLOTS].0
}

fn count(delta: isize) {
    if ON.load(Ordering::Relaxed) {
        slot().fetch_add(delta, Ordering::Relaxed);
    }
}

/// The counting allocator (install with `#[global_allocator]`).
#[derive(Debug, Default, Clone, Copy)]
pub struct Counting;

// SAFETY: every call forwards to `Inner` (`System` or `MiMalloc`) with the caller's
// arguments unchanged, so its guarantees are ours; the counting touches only atomics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as given; the caller upholds `alloc`'s contract.
        let p = unsafe { Inner.alloc(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        let p = unsafe { Inner.alloc_zeroed(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator, hence from `Inner`, with `layout`.
        unsafe { Inner.dealloc(ptr, layout) };
        count(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from `Inner` with `layout`; the caller upholds the rest.
        let p = unsafe { Inner.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            count(new_size as isize - layout.size() as isize);
        }
        p
    }
}

/// Starts counting (from 0: frees of earlier allocations then count negative, which a
/// difference of two readings cancels).
pub fn enable() {
    ON.store(true, Ordering::Relaxed);
}

/// Whether counting is on.
pub fn enabled() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Bytes allocated and not freed since [`enable`] (see the module docs for what a reader
/// may miss).
pub fn live_bytes() -> i64 {
    COUNTS
        .iter()
        .map(|s| s.0.load(Ordering::Relaxed) as i64)
        .sum()
}
