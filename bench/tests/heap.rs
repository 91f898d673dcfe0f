//! The counting allocator counts what is live: growth by what is allocated and kept, back
//! down when it is freed, reallocations by their difference, other threads too.

use kvrouter_bench::heap::{self, Counting};

#[global_allocator]
static ALLOC: Counting = Counting;

#[test]
fn counts_live_bytes_across_threads() {
    assert!(!heap::enabled());
    heap::enable();
    let before = heap::live_bytes();
    let mut v: Vec<u8> = Vec::with_capacity(1 << 20);
    v.push(1);
    let grown = heap::live_bytes() - before;
    assert!((1 << 20..(1 << 20) + 4096).contains(&grown), "{grown}");
    v.reserve_exact((3 << 20) - v.len());
    let grown = heap::live_bytes() - before;
    assert!((3 << 20..(3 << 20) + 4096).contains(&grown), "{grown}");
    let kept = std::thread::spawn(|| vec![0u8; 1 << 20]).join().unwrap();
    let grown = heap::live_bytes() - before;
    assert!((4 << 20..(4 << 20) + 65536).contains(&grown), "{grown}");
    drop((v, kept));
    let left = heap::live_bytes() - before;
    assert!(left.abs() < 65536, "{left}");
}
