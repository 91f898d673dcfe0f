//! Golden tests over traffic captured from a running Dynamo 1.6.1
//! (`tests/fixtures/dynamo-1.6.1/`): every message decodes, its decoded form equals the
//! capture's own decoding, and encoding it again gives the captured bytes exactly.

use base64::Engine as _;
use kvrouter_core::codec::{self, Envelope, kv, metrics, replica};
use kvrouter_tests::fixture;
use serde_json::Value;

/// Decodes a payload by topic, re-encodes it, and returns the decoded value as JSON.
fn decode_and_reencode(topic: &str, payload: &[u8]) -> (Value, Vec<u8>) {
    match topic {
        codec::TOPIC_KV_EVENTS => {
            let events = kv::decode(payload).expect("kv-events decode");
            (
                serde_json::to_value(&events).unwrap(),
                kv::encode(&events).unwrap(),
            )
        }
        codec::TOPIC_ACTIVE_SEQUENCES => {
            let mut events = replica::decode(payload).expect("active sequences decode");
            assert_eq!(events.len(), 1, "Dynamo 1.6.1 sends one event per message");
            let e = events.pop().unwrap();
            (
                serde_json::to_value(&e).unwrap(),
                replica::encode(&e).unwrap(),
            )
        }
        codec::TOPIC_KV_METRICS => {
            let m = metrics::decode_kv_metrics(payload).expect("kv_metrics decode");
            (
                serde_json::to_value(&m).unwrap(),
                metrics::encode_kv_metrics(&m).unwrap(),
            )
        }
        codec::TOPIC_FORWARD_PASS_METRICS => {
            let m = metrics::decode_forward_pass(payload).expect("forward-pass-metrics decode");
            assert!(m.worker().is_some(), "worker_id is a decimal string");
            (
                serde_json::to_value(&m).unwrap(),
                metrics::encode_forward_pass(&m).unwrap(),
            )
        }
        other => panic!("unexpected topic {other}"),
    }
}

fn check_message(subject: &str, bytes: &[u8]) -> Value {
    let env = Envelope::decode(bytes).expect("envelope decodes");
    let (_, _, _, topic) = codec::Subjects::parse(subject).expect("Dynamo subject");
    assert_eq!(env.topic, topic);
    let (value, payload) = decode_and_reencode(env.topic, env.payload);
    assert_eq!(
        payload, env.payload,
        "{subject}: payload re-encodes byte for byte"
    );
    let again = Envelope {
        payload: &payload,
        ..env
    }
    .encode();
    assert_eq!(again, bytes, "{subject}: message re-encodes byte for byte");
    if let Some(w) = metrics::heartbeat_worker(&env).unwrap() {
        assert_ne!(w.worker_id, 0);
    }
    value
}

#[test]
fn every_fixture_decodes_matches_its_capture_and_round_trips() {
    let index: Value = serde_json::from_slice(
        &std::fs::read(fixture("dynamo-1.6.1/fixtures/INDEX.json")).unwrap(),
    )
    .unwrap();
    let fixtures = index.as_object().unwrap();
    assert_eq!(fixtures.len(), 15);
    for (name, entry) in fixtures {
        let bytes =
            std::fs::read(fixture(&format!("dynamo-1.6.1/fixtures/{name}.msgpack"))).unwrap();
        assert_eq!(
            bytes.len() as u64,
            entry["size"].as_u64().unwrap(),
            "{name}"
        );
        let value = check_message(entry["subject"].as_str().unwrap(), &bytes);
        let decoded = &entry["decoded"];
        let env = Envelope::decode(&bytes).unwrap();
        assert_eq!(env.publisher_id, decoded["publisher_id"].as_u64().unwrap());
        assert_eq!(env.sequence, decoded["sequence"].as_u64().unwrap());
        assert_eq!(env.published_at, decoded["published_at"].as_u64().unwrap());
        assert_eq!(
            value, decoded["payload"]["__msgpack__"],
            "{name}: decoded form"
        );
    }
}

#[test]
fn sniffed_streams_decode_without_a_single_error() {
    let mut kv_events = 0;
    let mut blocks = 0;
    for stream in [
        "kv-events-stream.sniff.jsonl",
        "replica-sync-stream.sniff.jsonl",
    ] {
        let text = std::fs::read_to_string(fixture(&format!("dynamo-1.6.1/{stream}"))).unwrap();
        let mut messages = 0;
        for line in text.lines() {
            let rec: Value = serde_json::from_str(line).unwrap();
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(rec["payload_b64"].as_str().unwrap())
                .unwrap();
            assert_eq!(bytes.len() as u64, rec["size"].as_u64().unwrap());
            let subject = rec["subject"].as_str().unwrap();
            check_message(subject, &bytes);
            if subject.ends_with(".kv-events") {
                let (_, events) = kv::decode_message(&bytes).unwrap();
                kv_events += events.len();
                blocks += events.iter().map(|e| e.block_count()).sum::<usize>();
                assert!(events.iter().all(|e| e.is_worker_owned()));
            }
            messages += 1;
        }
        assert!(messages >= 80, "{stream}: {messages} messages");
    }
    assert!(
        kv_events > 100 && blocks > kv_events,
        "{kv_events} events, {blocks} blocks"
    );
}
