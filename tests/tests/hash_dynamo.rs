//! Hashing is byte-identical with NVIDIA Dynamo 1.6.1: every local and sequence hash we
//! compute equals what the `dynamo-kv-router` crate computes, on random token sequences,
//! block sizes, LoRA names, cache namespaces, multimodal blocks and Eagle windows.

use dynamo_kv_router::protocols::{
    BlockExtraInfo, BlockHashOptions, BlockMmObjectInfo, LocalBlockHash as DynLocal,
    compute_block_hash_for_seq, compute_next_seq_hash, compute_seq_hash_for_block,
};
use kvrouter_core::hash::{
    HashOptions, LocalBlockHash, SequenceBlockHash, local_block_hashes, next_sequence_hash,
    sequence_hashes,
};
use proptest::prelude::*;

fn name() -> impl Strategy<Value = Option<String>> {
    prop_oneof![
        Just(None),
        Just(Some(String::new())),
        "[a-z0-9_-]{1,12}".prop_map(Some),
        any::<String>().prop_map(Some),
    ]
}

fn mm_blocks() -> impl Strategy<Value = Option<Vec<Vec<u64>>>> {
    prop_oneof![
        3 => Just(None),
        1 => proptest::collection::vec(proptest::collection::vec(any::<u64>(), 0..3), 0..8).prop_map(Some),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn local_and_sequence_hashes_equal_dynamo(
        tokens in proptest::collection::vec(any::<u32>(), 0..400),
        block_size in prop_oneof![Just(16u32), Just(64), Just(1), 1u32..80],
        lora in name(),
        namespace in name(),
        eagle in any::<bool>(),
        mm in mm_blocks(),
    ) {
        let ours = local_block_hashes(&tokens, block_size, &HashOptions {
            lora_name: lora.as_deref(),
            cache_namespace: namespace.as_deref(),
            mm_hashes: mm.as_deref(),
            eagle,
        });
        let dyn_mm: Option<Vec<Option<BlockExtraInfo>>> = mm.as_ref().map(|blocks| {
            blocks.iter().map(|hashes| {
                (!hashes.is_empty()).then(|| BlockExtraInfo {
                    mm_objects: hashes.iter().map(|&mm_hash| BlockMmObjectInfo { mm_hash, offsets: vec![(0, 1)] }).collect(),
                })
            }).collect()
        });
        let theirs = compute_block_hash_for_seq(&tokens, block_size, BlockHashOptions {
            block_mm_infos: dyn_mm.as_deref(),
            lora_name: lora.as_deref(),
            cache_namespace: namespace.as_deref(),
            is_eagle: Some(eagle),
        });
        prop_assert_eq!(ours.iter().map(|h| h.0).collect::<Vec<_>>(), theirs.iter().map(|h| h.0).collect::<Vec<_>>());

        let seq = sequence_hashes(&ours);
        let their_seq = compute_seq_hash_for_block(&theirs);
        prop_assert_eq!(seq.iter().map(|h| h.0).collect::<Vec<_>>(), their_seq);
    }

    #[test]
    fn chain_step_equals_dynamo(parent in any::<u64>(), local in any::<u64>()) {
        prop_assert_eq!(
            next_sequence_hash(SequenceBlockHash(parent), LocalBlockHash(local)).0,
            compute_next_seq_hash(parent, DynLocal(local))
        );
    }
}

#[test]
fn long_prompt_at_block_size_64() {
    // A 1 M-token prompt: ~15.6 k blocks, hashed identically.
    let tokens: Vec<u32> = (0..1_000_000u32)
        .map(|i| i.wrapping_mul(2_654_435_761))
        .collect();
    let ours = local_block_hashes(&tokens, 64, &HashOptions::default());
    let theirs = compute_block_hash_for_seq(&tokens, 64, BlockHashOptions::default());
    assert_eq!(ours.len(), 15_625);
    assert!(ours.iter().zip(&theirs).all(|(a, b)| a.0 == b.0));
}
