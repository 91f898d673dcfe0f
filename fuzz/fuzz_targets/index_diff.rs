//! Differential fuzzing of the lock-free tree against the reference index: every op (from
//! `kvrouter_core::index::ops`) must give the same result on both, the whole state must
//! agree at the end, the tree's dump must rebuild the reference's state, and no tree node
//! may outlive its last block.
#![no_main]

use kvrouter_core::index::ops::{self, Op};
use kvrouter_core::index::{Index, ReferenceIndex, TreeIndex};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut input = data;
    let shards = (data.first().copied().unwrap_or(0) % 3) as usize + 1;
    let mut reference = ReferenceIndex::new();
    let mut tree = TreeIndex::new(shards);
    let mut n = 0u64;
    while let Some(op) = Op::decode(&mut input) {
        let want = ops::run(&mut reference, &op, n);
        let got = ops::run(&mut tree, &op, n);
        assert_eq!(got, want, "op #{n}: {op:?}");
        assert!(tree.node_count() <= tree.block_count());
        n += 1;
    }
    assert_eq!(tree.workers(), reference.workers());
    assert_eq!(tree.block_count(), reference.block_count());
    let mut rebuilt = ReferenceIndex::new();
    for e in tree.dump() {
        rebuilt.apply(e).expect("a dump applies cleanly");
    }
    for q in ops::all_paths(3) {
        let l = ops::locals(&q);
        let want = reference.find_matches(&l);
        assert_eq!(tree.find_matches(&l), want);
        assert_eq!(rebuilt.find_matches(&l), want);
    }
});
