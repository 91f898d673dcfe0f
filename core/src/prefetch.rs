//! Cache hints: ask for lines ahead of the loads that need them. A hint reads nothing into
//! the program and never faults, so any address is fine; a wrong one only wastes the hint.

/// Asks the cache for the line at `addr`, if the target can.
#[inline(always)]
pub fn prefetch_line(addr: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint: it never faults and reads nothing into the program, so
    // any address, even one outside every allocation, is fine.
    unsafe {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        _mm_prefetch::<_MM_HINT_T0>(addr as *const i8);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = addr;
}

/// Asks the cache for every line holding `items`.
#[inline]
pub fn prefetch_slice<T>(items: &[T]) {
    let start = items.as_ptr() as usize;
    let end = start + std::mem::size_of_val(items);
    let mut line = start & !63;
    while line < end {
        prefetch_line(line);
        line += 64;
    }
}
