//! Lower storage tiers: the tree's path-keyed tiers against the reference index's literal
//! Dynamo edges (`(parent engine name, local) -> child`, followed from the last device
//! block), over random sequences of device, lower-tier and shared-pool (`cache_owner`)
//! stores, removals, clears and worker removals, with one shard and with two; the pool
//! against the reference's per-source map of names to full paths. Engines name blocks by content here (a
//! block's name is a function of its path, the same on every tier), which is where the two
//! models agree by design (see `kvrouter_core::index::tiers`). The ops are
//! `kvrouter_core::index::ops::TierOp`, which the fuzz target `index_tiers` decodes too.

use kvrouter_core::event::{KvCacheEvent, RouterEvent};
use kvrouter_core::hash::{LocalBlockHash, SequenceBlockHash, sequence_hashes};
use kvrouter_core::index::ops::{TierOp, run_tiered};
use kvrouter_core::index::{
    Index, OverlapScores, ReferenceIndex, TierOverlap, TierScores, TreeIndex,
};
use kvrouter_core::worker::{StorageTier, WorkerDp};
use proptest::prelude::*;

const TIERS: [StorageTier; 4] = [
    StorageTier::Device,
    StorageTier::HostPinned,
    StorageTier::Disk,
    StorageTier::External,
];

fn locals(path: &[u8]) -> Vec<LocalBlockHash> {
    path.iter()
        .map(|&s| LocalBlockHash(u64::from(s) + 1))
        .collect()
}

/// Content naming: a block's name is its path hash, moved off the local hashes' range.
fn names(path: &[u8]) -> Vec<SequenceBlockHash> {
    sequence_hashes(&locals(path))
        .into_iter()
        .map(|s| SequenceBlockHash(s.0 ^ 0xa5a5_0000_0000_0000))
        .collect()
}

fn event(worker: u8, tier: u8, data: KvCacheEvent) -> RouterEvent {
    let mut e = RouterEvent::new(u64::from(worker), data);
    e.storage_tier = TIERS[tier as usize];
    e
}

fn op() -> impl Strategy<Value = TierOp> {
    let path = || proptest::collection::vec(0..3u8, 1..=6);
    prop_oneof![
        6 => (0..3u8, 0..5u8, path(), 0..6u8)
            .prop_map(|(worker, tier, path, from)| TierOp::Store { worker, tier, path, from }),
        3 => (0..3u8, 0..5u8, path(), 0..6u8)
            .prop_map(|(worker, tier, path, at)| TierOp::Remove { worker, tier, path, at }),
        1 => (0..3u8, 0..5u8).prop_map(|(worker, tier)| TierOp::Clear { worker, tier }),
        1 => (0..3u8).prop_map(|worker| TierOp::RemoveWorker { worker }),
        4 => proptest::collection::vec(0..3u8, 0..=7).prop_map(|path| TierOp::Query { path }),
    ]
}

fn tiers_of(idx: &dyn Index, query: &[LocalBlockHash]) -> (OverlapScores, TierScores) {
    let device = idx.find_matches(query);
    let paths: Vec<u64> = sequence_hashes(query).into_iter().map(|s| s.0).collect();
    let mut out = TierScores::new();
    idx.tier_overlaps_into(query, &paths, &device, &mut out);
    (device, out)
}

fn run(ops: &[TierOp], shards: usize) -> Result<(), TestCaseError> {
    let mut tree = TreeIndex::new(shards);
    let mut reference = ReferenceIndex::new();
    for op in ops {
        run_tiered(&mut tree, &mut reference, op).map_err(TestCaseError::fail)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn tiers_match_the_reference_one_shard(ops in proptest::collection::vec(op(), 1..60)) {
        run(&ops, 1)?;
    }

    #[test]
    fn tiers_match_the_reference_two_shards(ops in proptest::collection::vec(op(), 1..60)) {
        run(&ops, 2)?;
    }
}

/// A candidate with `w`'s device score and tier counts, as the decision fills them.
fn candidate(
    w: WorkerDp,
    device: &OverlapScores,
    tiers: &TierScores,
) -> kvrouter_core::policy::Candidate {
    let mut c = kvrouter_core::policy::Candidate {
        worker: w,
        device_overlap_blocks: device.get(w),
        ..Default::default()
    };
    tiers.fill(&mut c);
    c
}

/// The worked example's fleet: the request's local hashes and names, and an index where
/// worker 1 holds blocks 0–1 on the device, 0–3 in host memory and 4 on disk, and worker 2
/// blocks 0–2 on disk.
fn worked_example() -> (TreeIndex, Vec<LocalBlockHash>, Vec<SequenceBlockHash>) {
    let path = [0u8, 1, 2, 0, 1, 2];
    let ls = locals(&path);
    let ns = names(&path);
    let a = |tier: u8, from: usize, to: usize| {
        let parent = (from > 0).then(|| ns[from - 1]);
        let blocks = ls[from..to]
            .iter()
            .copied()
            .zip(ns[from..to].iter().copied());
        event(1, tier, KvCacheEvent::stored(0, 0, parent, blocks))
    };
    let mut idx = TreeIndex::new(2);
    for e in [a(0, 0, 2), a(1, 0, 4), a(2, 4, 5)] {
        idx.apply(e).unwrap();
    }
    let blocks = ls[..3].iter().copied().zip(ns[..3].iter().copied());
    idx.apply(event(2, 2, KvCacheEvent::stored(0, 0, None, blocks)))
        .unwrap();
    (idx, ls, ns)
}

/// The seed's worked example extended with host and disk, by hand: a 6-block request,
/// worker A holds 2 blocks on the device, the next 2 in host memory and 1 more on disk;
/// worker B holds the first 3 on disk only.
#[test]
fn a_worked_example_by_hand() {
    let (mut idx, ls, ns) = worked_example();
    let (device, tiers) = tiers_of(&idx, &ls);
    let (wa, wb) = (WorkerDp::new(1, 0), WorkerDp::new(2, 0));
    assert_eq!(device.get(wa), 2);
    // Host blocks 0 and 1 are on the device too: counted there; host adds 2 and 3; disk 4.
    assert_eq!(tiers.get(wa), TierOverlap { host: 2, disk: 1 });
    assert_eq!(tiers.get(wb), TierOverlap { host: 0, disk: 3 });
    // The seed's formula at Dynamo's weights (device 1, host 0.75, disk 0.25), 6 blocks:
    // A: 6 - (2 + 0.75 * 2 + 0.25 * 1) = 2.25 blocks to prefill; B: 6 - 0.25 * 3 = 5.25.
    use kvrouter_core::policy::{CostConfig, score};
    let cfg = CostConfig::default();
    let cand = |w: WorkerDp| candidate(w, &device, &tiers);
    let s = score(&cfg, 6 * 16, 16, &[cand(wa), cand(wb)]);
    assert!(
        (s[0].adjusted_prefill_blocks - 2.25).abs() < 1e-9,
        "{:?}",
        s[0]
    );
    assert!(
        (s[1].adjusted_prefill_blocks - 5.25).abs() < 1e-9,
        "{:?}",
        s[1]
    );
    // Offload then eviction from the device: the host copy survives, and now counts.
    idx.apply(event(1, 0, KvCacheEvent::removed(0, 0, [ns[1]])))
        .unwrap();
    let (device, tiers) = tiers_of(&idx, &ls);
    assert_eq!(device.get(wa), 1);
    assert_eq!(tiers.get(wa), TierOverlap { host: 3, disk: 1 });
}

/// The worked example with a shared pool, by hand. The pool (residency `cache_owner`,
/// published by source 7, which is no worker) holds the request's blocks 0–5 but block 3:
/// Dynamo's `shared_beyond_blocks` counts the pool's blocks at or past each worker's device
/// prefix, contiguous or not, and credits them on top of the tier credits.
#[test]
fn the_worked_example_with_a_shared_pool() {
    let (mut idx, ls, ns) = worked_example();
    let pool = |data: KvCacheEvent| {
        let mut e = event(7, 3, data);
        e.residency_domain = Some(kvrouter_core::event::ResidencyDomain::CacheOwner);
        e
    };
    let all = ls.iter().copied().zip(ns.iter().copied());
    idx.apply(pool(KvCacheEvent::stored(0, 0, None, all)))
        .unwrap();
    idx.apply(pool(KvCacheEvent::removed(1, 0, [ns[3]])))
        .unwrap();
    // The pool's publisher is not a worker; the workers' own counts are unchanged.
    assert_eq!(idx.workers().len(), 2);
    let (device, tiers) = tiers_of(&idx, &ls);
    let (wa, wb) = (WorkerDp::new(1, 0), WorkerDp::new(2, 0));
    assert_eq!(tiers.get(wa), TierOverlap { host: 2, disk: 1 });
    assert_eq!(tiers.get(wb), TierOverlap { host: 0, disk: 3 });
    // Pool blocks 0, 1, 2, 4, 5: past A's 2 device blocks, 2, 4 and 5; past B's none, all 5.
    assert_eq!(tiers.shared_beyond(device.get(wa)), 3);
    assert_eq!(tiers.shared_beyond(device.get(wb)), 5);
    // Dynamo's weights with the multiplier HiCache gets (0.5), 6 blocks:
    // A: 6 - (2 + 0.75 * 2 + 0.25 * 1 + 0.5 * 3) = 0.75; B: 6 - (0.25 * 3 + 0.5 * 5) = 2.75.
    use kvrouter_core::policy::{CostConfig, score};
    let cfg = CostConfig {
        shared_cache_multiplier: 0.5,
        ..CostConfig::default()
    };
    let cand = |w: WorkerDp| candidate(w, &device, &tiers);
    let s = score(&cfg, 6 * 16, 16, &[cand(wa), cand(wb)]);
    assert!(
        (s[0].adjusted_prefill_blocks - 0.75).abs() < 1e-9,
        "{:?}",
        s[0]
    );
    assert!(
        (s[1].adjusted_prefill_blocks - 2.75).abs() < 1e-9,
        "{:?}",
        s[1]
    );
    assert!((s[1].credits.shared - 2.5).abs() < 1e-9);
    // A `cache_owner` clear empties the pool and leaves the workers' tiers.
    idx.apply(pool(KvCacheEvent::cleared(2, 0))).unwrap();
    let (_, tiers) = tiers_of(&idx, &ls);
    assert_eq!(tiers.shared_beyond(0), 0);
    assert_eq!(tiers.get(wa), TierOverlap { host: 2, disk: 1 });
}
