//! Golden tests over ZMQ traffic captured from a running Dynamo 1.6.1
//! (`tests/fixtures/dynamo-1.6.1/zmq/`, copied from `../shared/fixtures`): every frame of
//! the vLLM-native wire (the mocker's `--zmq-kv-events-ports` publisher) and of Dynamo's own
//! ZMQ event plane decodes, converts, and numbers as the README says; and what a mocker with
//! a host tier publishes (`tests/fixtures/dynamo-host/`).

use std::collections::HashMap;

use base64::Engine as _;
use kvrouter_core::codec::vllm::{self, EngineEvent};
use kvrouter_core::codec::{self, Envelope, kv, metrics};
use kvrouter_core::engine::{Converter, Dropped};
use kvrouter_core::event::KvEventData;
use kvrouter_core::hash::{HashOptions, local_block_hashes};
use kvrouter_tests::fixture;
use serde_json::Value;

fn frames_of(file: &str) -> Vec<(String, Vec<Vec<u8>>)> {
    let text = std::fs::read_to_string(fixture(&format!("dynamo-1.6.1/zmq/{file}"))).unwrap();
    text.lines()
        .map(|line| {
            let v: Value = serde_json::from_str(line).unwrap();
            let frames = v["frames_b64"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| {
                    base64::engine::general_purpose::STANDARD
                        .decode(f.as_str().unwrap())
                        .unwrap()
                })
                .collect();
            (v["endpoint"].as_str().unwrap().to_owned(), frames)
        })
        .collect()
}

fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b.try_into().expect("8 bytes"))
}

#[test]
fn every_vllm_native_frame_decodes_and_converts() {
    let messages = frames_of("vllm-native.frames.jsonl");
    assert_eq!(messages.len(), 143);
    let mut next_seq: HashMap<String, u64> = HashMap::new();
    let mut converters: HashMap<String, Converter> = HashMap::new();
    let (mut stored_blocks, mut removed_blocks, mut with_tokens) = (0usize, 0usize, 0usize);
    for (endpoint, frames) in &messages {
        assert_eq!(frames.len(), 3, "[topic, seq, payload]");
        assert!(frames[0].is_empty(), "the mocker's topic is empty");
        // Each publisher numbers its messages from 0, without a gap.
        let seq = be64(&frames[1]);
        let want = next_seq.entry(endpoint.clone()).or_insert(0);
        assert_eq!(seq, *want, "{endpoint}");
        *want += 1;
        let batch = vllm::decode_batch(&frames[2]).expect("EventBatch decodes");
        // Port base + dp rank: 25600/25601 and 25610/25611.
        let port: u32 = endpoint.parse().unwrap();
        assert_eq!(batch.dp_rank, Some(port % 10), "{endpoint}");
        for e in &batch.events {
            match e {
                EngineEvent::Stored(s) => {
                    assert_eq!(s.block_size, 16);
                    assert_eq!(s.token_ids.len(), s.block_hashes.len() * 16);
                    assert!(s.medium.as_deref().is_none_or(|m| m == "GPU"), "{s:?}");
                    stored_blocks += s.block_hashes.len();
                    with_tokens += 1;
                }
                EngineEvent::Removed(r) => removed_blocks += r.block_hashes.len(),
                EngineEvent::AllCleared => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        let c = converters
            .entry(endpoint.clone())
            .or_insert_with(|| Converter::new(port as u64 / 10, 16));
        let raw = batch.clone();
        let mut dropped = Dropped::default();
        let out = c.convert(batch, port % 10, &mut dropped);
        assert!(dropped.is_empty(), "{dropped:?}");
        // Every stored block gets the local hash of its own tokens, and keeps the engine's
        // hash as its name.
        for (ev, engine) in out.iter().zip(raw.events.iter()) {
            if let (KvEventData::Stored(sd), EngineEvent::Stored(s)) = (&ev.event.data, engine) {
                let locals = local_block_hashes(&s.token_ids, 16, &HashOptions::default());
                for ((b, l), h) in sd.blocks.iter().zip(&locals).zip(&s.block_hashes) {
                    assert_eq!((b.tokens_hash, b.block_hash.0), (*l, *h));
                }
            }
        }
    }
    assert_eq!(next_seq.len(), 4, "two workers, two dp ranks each");
    assert!(stored_blocks > 100 && removed_blocks > 0 && with_tokens > 0);
}

#[test]
fn every_dynamo_plane_frame_decodes_like_its_nats_twin() {
    let messages = frames_of("dynamo-plane.frames.jsonl");
    let mut topics: HashMap<String, usize> = HashMap::new();
    let mut kv_seq: HashMap<u64, u64> = HashMap::new();
    for (_, frames) in &messages {
        assert_eq!(frames.len(), 4, "[topic, publisher id, seq, envelope]");
        let topic = std::str::from_utf8(&frames[0]).unwrap();
        let publisher = be64(&frames[1]);
        let seq = be64(&frames[2]);
        let inner = codec::zmq_plane_envelope(&frames[3]).expect("format byte and length");
        let env = Envelope::decode(inner).expect("the NATS plane's envelope");
        assert_eq!(env.topic, topic);
        assert_eq!(env.publisher_id, publisher);
        *topics.entry(topic.to_owned()).or_default() += 1;
        match topic {
            codec::TOPIC_KV_EVENTS => {
                let (_, events) = kv::decode_message(inner).expect("kv-events decode");
                assert!(!events.is_empty());
                // Every kv-events message of the run is kept: consecutive per publisher.
                if let Some(last) = kv_seq.insert(publisher, seq) {
                    assert_eq!(seq, last + 1);
                }
            }
            codec::TOPIC_KV_METRICS | codec::TOPIC_FORWARD_PASS_METRICS => {
                let w = metrics::heartbeat_worker(&env).expect("metrics decode");
                assert!(w.is_some_and(|w| w.worker_id != 0));
            }
            other => panic!("unexpected topic {other}"),
        }
    }
    assert_eq!(topics["kv-events"], 145);
    assert_eq!(topics["kv_metrics"], 40);
    assert_eq!(topics["forward-pass-metrics"], 40);
    for bad in [&b""[..], b"\x02\0\0\0\0", b"\x01\0\0\0\x05ab", b"\x01\0"] {
        assert!(codec::zmq_plane_envelope(bad).is_err(), "{bad:?}");
    }
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// A 1.6.1 mocker with a host tier (`--num-host-blocks 64`, captured in
/// `tests/fixtures/dynamo-host/`): a prompt served from host memory reappears as device
/// stores on both wires, with no `medium` and `storage_tier` device, and the same names.
#[test]
fn a_host_tier_mockers_onloads_are_device_stores_on_both_wires() {
    let text = std::fs::read_to_string(fixture("dynamo-host/raw_frames.jsonl")).unwrap();
    let mut names: HashMap<u64, (Vec<u64>, Vec<u64>)> = HashMap::new();
    for line in text.lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        let frames: Vec<Vec<u8>> = v["frames_hex"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| unhex(f.as_str().unwrap()))
            .collect();
        let seq = v["seq"].as_u64().unwrap();
        let entry = names.entry(seq).or_default();
        if v["wire"].as_str().unwrap().starts_with("vllm") {
            let batch = vllm::decode_batch(&frames[2]).expect("EventBatch decodes");
            let mut dropped = Dropped::default();
            let out = Converter::new(1, 16).convert(batch, 0, &mut dropped);
            assert!(dropped.is_empty() && !out.is_empty(), "{dropped:?}");
            for e in out {
                assert_eq!(e.storage_tier, kvrouter_core::StorageTier::Device);
                if let KvEventData::Stored(s) = e.event.data {
                    entry.0.extend(s.blocks.iter().map(|b| b.block_hash.0));
                }
            }
        } else {
            let inner = codec::zmq_plane_envelope(&frames[3]).expect("format byte and length");
            let (_, events) = kv::decode_message(inner).expect("kv-events decode");
            for e in events {
                assert_eq!(e.storage_tier, kvrouter_core::StorageTier::Device);
                if let KvEventData::Stored(s) = e.event.data {
                    entry.1.extend(s.blocks.iter().map(|b| b.block_hash.0));
                }
            }
        }
    }
    assert_eq!(names.len(), 2);
    for (seq, (vllm, plane)) in names {
        assert!(!vllm.is_empty(), "seq {seq}");
        assert_eq!(vllm, plane, "seq {seq}: the two wires name the same blocks");
    }
}
