//! Our codecs and Dynamo 1.6.1's own types agree byte for byte: random events encoded by
//! us equal the bytes Dynamo's `rmp_serde::to_vec_named` / `serde_json` produce for the
//! same event, and each side decodes the other's output.

use std::time::Duration;

use dynamo_kv_router::protocols as dynamo;
use kvrouter_core::codec::{kv, replica};
use kvrouter_core::event::{
    BlockExtraInfo, BlockMmObjectInfo, KvCacheEvent, KvEventData, RemovedData, ResidencyDomain,
    RouterEvent, StoredBlock, StoredData,
};
use kvrouter_core::hash::{LocalBlockHash, SequenceBlockHash};
use kvrouter_core::worker::{StorageTier, WorkerDp};
use proptest::prelude::*;

fn tier() -> impl Strategy<Value = StorageTier> {
    proptest::sample::select(StorageTier::ALL.to_vec())
}

fn block() -> impl Strategy<Value = StoredBlock> {
    (
        any::<u64>(),
        any::<u64>(),
        proptest::option::weighted(
            0.2,
            proptest::collection::vec(
                (
                    any::<u64>(),
                    proptest::collection::vec((0u64..64, 0u64..64), 0..3),
                ),
                0..3,
            ),
        ),
    )
        .prop_map(|(s, l, mm)| StoredBlock {
            block_hash: SequenceBlockHash(s),
            tokens_hash: LocalBlockHash(l),
            mm_extra_info: mm.map(|objs| {
                Box::new(BlockExtraInfo {
                    mm_objects: objs
                        .into_iter()
                        .map(|(mm_hash, offsets)| BlockMmObjectInfo { mm_hash, offsets })
                        .collect(),
                })
            }),
        })
}

fn data() -> impl Strategy<Value = KvEventData> {
    prop_oneof![
        (
            proptest::option::of(any::<u64>()),
            proptest::option::of(any::<u32>()),
            proptest::collection::vec(block(), 0..6)
        )
            .prop_map(|(p, start, blocks)| KvEventData::Stored(StoredData {
                parent_hash: p.map(SequenceBlockHash),
                start_position: start,
                blocks,
            })),
        proptest::collection::vec(any::<u64>(), 0..6).prop_map(|h| KvEventData::Removed(
            RemovedData {
                block_hashes: h.into_iter().map(SequenceBlockHash).collect()
            }
        )),
        Just(KvEventData::Cleared),
    ]
}

fn router_event() -> impl Strategy<Value = RouterEvent> {
    (
        any::<u64>(),
        tier(),
        proptest::option::of(prop_oneof![
            Just(ResidencyDomain::Worker),
            Just(ResidencyDomain::CacheOwner)
        ]),
        any::<u64>(),
        data(),
        any::<u32>(),
        proptest::option::weighted(0.2, "[a-z0-9-]{0,12}"),
    )
        .prop_map(
            |(worker_id, storage_tier, residency_domain, event_id, data, dp_rank, session_id)| {
                RouterEvent {
                    worker_id,
                    storage_tier,
                    residency_domain,
                    event: KvCacheEvent {
                        event_id,
                        data,
                        dp_rank,
                    },
                    session_id,
                }
            },
        )
}

fn active_event() -> impl Strategy<Value = replica::ActiveSequenceEvent> {
    use replica::{ActiveSequenceEventData as D, PrefillLoadHint};
    let add = (
        proptest::option::of(proptest::collection::vec(any::<u64>(), 0..8)),
        any::<bool>(),
        proptest::option::of(any::<u32>()),
        proptest::option::of((
            any::<u64>(),
            proptest::option::of((0u64..1_000_000, 0u32..1_000_000_000)),
        )),
    )
        .prop_map(
            |(token_sequence, track_prefill_tokens, expected_output_tokens, hint)| D::AddRequest {
                token_sequence,
                track_prefill_tokens,
                expected_output_tokens,
                prefill_load_hint: hint.map(|(t, d)| PrefillLoadHint {
                    initial_effective_prefill_tokens: t,
                    expected_prefill_duration: d.map(|(s, n)| Duration::new(s, n)),
                }),
            },
        );
    (
        "[a-f0-9-]{1,36}",
        any::<u64>(),
        any::<u32>(),
        prop_oneof![add, Just(D::Free), Just(D::MarkPrefillCompleted)],
        any::<u64>(),
        proptest::option::of("[a-z]{0,8}"),
    )
        .prop_map(|(request_id, w, dp, data, router_id, lora_name)| {
            replica::ActiveSequenceEvent {
                request_id,
                worker: WorkerDp::new(w, dp),
                data,
                router_id,
                lora_name,
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn kv_events_msgpack_and_json_are_dynamos(events in proptest::collection::vec(router_event(), 0..4)) {
        let ours = kv::encode(&events).unwrap();
        let theirs: Vec<dynamo::RouterEvent> = rmp_serde::from_slice(&ours).expect("Dynamo decodes our bytes");
        prop_assert_eq!(&rmp_serde::to_vec_named(&theirs).unwrap(), &ours);
        prop_assert_eq!(&kv::decode(&ours).unwrap(), &events);

        for (e, t) in events.iter().zip(&theirs) {
            let json = kv::encode_json(e);
            prop_assert_eq!(&serde_json::to_string(t).unwrap(), &json);
            let back: dynamo::RouterEvent = serde_json::from_str(&json).unwrap();
            prop_assert_eq!(&kv::decode_json(serde_json::to_string(&back).unwrap().as_bytes()).unwrap()[0], e);
        }
    }

    #[test]
    fn replica_events_are_dynamos(e in active_event()) {
        let ours = replica::encode(&e).unwrap();
        let theirs: dynamo::ActiveSequenceEvent = rmp_serde::from_slice(&ours).expect("Dynamo decodes our bytes");
        prop_assert_eq!(&rmp_serde::to_vec_named(&theirs).unwrap(), &ours);
        prop_assert_eq!(&replica::decode(&ours).unwrap()[0], &e);
    }

    #[test]
    fn replica_batches_are_dynamos(events in proptest::collection::vec(active_event(), 0..4)) {
        let ours = replica::encode_batch(&events).unwrap();
        let theirs: dynamo::ActiveSequenceEventBatch = rmp_serde::from_slice(&ours).expect("Dynamo decodes our batch");
        prop_assert_eq!(&rmp_serde::to_vec_named(&theirs).unwrap(), &ours);
        prop_assert_eq!(replica::decode(&ours).unwrap(), events);
    }
}
