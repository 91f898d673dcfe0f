//! The one place atomics and cells come from, so that `--cfg loom` swaps in loom's
//! checked versions (and `--cfg crossbeam_loom` crossbeam-epoch's) for the model tests.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// A cell whose accesses loom tracks; a plain `UnsafeCell` otherwise (same layout as `T`).
#[derive(Debug)]
#[cfg_attr(not(loom), repr(transparent))]
pub(crate) struct Cell<T>(
    #[cfg(loom)] loom::cell::UnsafeCell<T>,
    #[cfg(not(loom))] std::cell::UnsafeCell<T>,
);

impl<T: Copy> Cell<T> {
    pub(crate) fn new(v: T) -> Self {
        #[cfg(loom)]
        return Self(loom::cell::UnsafeCell::new(v));
        #[cfg(not(loom))]
        return Self(std::cell::UnsafeCell::new(v));
    }

    /// Reads the value.
    ///
    /// # Safety
    /// No write to this cell may run concurrently with the read.
    #[inline]
    pub(crate) unsafe fn read(&self) -> T {
        #[cfg(loom)]
        // SAFETY: the caller guarantees no concurrent write; loom checks it.
        return self.0.with(|p| unsafe { *p });
        #[cfg(not(loom))]
        // SAFETY: the caller guarantees no concurrent write.
        return unsafe { *self.0.get() };
    }

    /// Writes the value.
    ///
    /// # Safety
    /// No other access to this cell may run concurrently with the write.
    #[inline]
    pub(crate) unsafe fn write(&self, v: T) {
        #[cfg(loom)]
        // SAFETY: the caller guarantees exclusive access; loom checks it.
        self.0.with_mut(|p| unsafe { *p = v });
        #[cfg(not(loom))]
        // SAFETY: the caller guarantees exclusive access.
        unsafe {
            *self.0.get() = v
        };
    }
}
