//! Differential fuzzing of the lower storage tiers: device and lower-tier stores, removals,
//! clears, worker removals and queries (`kvrouter_core::index::ops::TierOp`, the ops of the
//! `index_tiers` proptest) must leave the tree and the reference index with the same blocks
//! on every tier and the same scores, one to three shards.
#![no_main]

use kvrouter_core::index::ops::{TierOp, run_tiered};
use kvrouter_core::index::{ReferenceIndex, TreeIndex};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut input = data;
    let shards = (data.first().copied().unwrap_or(0) % 3) as usize + 1;
    let mut tree = TreeIndex::new(shards);
    let mut reference = ReferenceIndex::new();
    let mut n = 0usize;
    while let Some(op) = TierOp::decode(&mut input) {
        if let Err(why) = run_tiered(&mut tree, &mut reference, &op) {
            panic!("op #{n}: {why}");
        }
        n += 1;
    }
});
