//! Snapshot files are untrusted input: parsing must never panic, whatever parses must
//! rebuild an index without panicking, and re-encoding what was read (lower tiers included)
//! must parse back to the same state. (Under cargo-fuzz the checksums are not enforced, so mutations reach every
//! structural check.)
#![no_main]

use kvrouter_core::index::{Index, ReferenceIndex, TreeIndex};
use kvrouter_core::snapshot::{encode_with_lower, parse};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(view) = parse(data) else {
        return;
    };
    let events: Vec<_> = view.events().collect();
    let mut reference = ReferenceIndex::new();
    let mut tree = TreeIndex::new(2);
    for e in &events {
        let a = reference.apply(e.clone()).is_ok();
        let b = tree.apply(e.clone()).is_ok();
        assert_eq!(a, b, "the backends disagree on {e:?}");
    }
    assert_eq!(reference.block_count(), tree.block_count());
    let lower: Vec<_> = view.lower().collect();
    let bytes = encode_with_lower(view.meta(), view.workers(), &events, &lower)
        .expect("what was read encodes");
    let again = parse(&bytes).expect("what was written parses");
    assert_eq!(again.workers(), view.workers());
    assert_eq!(again.events().collect::<Vec<_>>(), events);
    assert_eq!(again.lower().collect::<Vec<_>>(), lower);
});
