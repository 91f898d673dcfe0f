//! Dynamo's ZMQ event plane through its file discovery, against a real libzmq publisher
//! (pyzmq: `tests/py/vllm_engine.py` sending raw frames) and a discovery tree written the
//! way Dynamo 1.6.1 writes it (`../shared/fixtures/dynamo-1.6.1/zmq/discovery`): the workers
//! discovery lists are routable before their first event; the index equals the reference
//! index fed the same events although some messages carry a malformed event (that event is
//! counted and skipped, the rest of its message applies) and some messages are not the
//! plane's four frames (counted, nothing lost); a worker whose entry leaves discovery is
//! removed from the index and from the listing at once, the others keep their blocks.
//! The real Dynamo stack on this plane is `kvrouter/tests/dynamo_stack.rs`.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use kvrouter_core::codec::{Envelope, TOPIC_KV_EVENTS, kv};
use kvrouter_core::event::RouterEvent;
use kvrouter_core::index::Index;
use kvrouter_core::worker::{WorkerDp, WorkerId};
use kvrouter_io::ingest::{Ingest, IngestConfig};
use kvrouter_tests::engine::PyEngine;
use kvrouter_tests::fleet::{assert_same, expected_last_ids, reference_of, sample, wait_until};
use kvrouter_tests::free_port;
use serde_json::json;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A fresh discovery directory.
fn tree() -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "kvrouter-dynplane-{}-{}",
        std::process::id(),
        free_port()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    for sub in ["instances", "mdc", "event_channels"] {
        std::fs::create_dir_all(dir.join("v1").join(sub)).unwrap();
    }
    dir
}

/// Writes an entry as Dynamo does: a whole file renamed into place.
fn put(dir: &Path, sub: &str, name: &str, value: &serde_json::Value) -> PathBuf {
    let path = dir.join("v1").join(sub).join(name);
    let tmp = path.with_extension("tmp-write");
    std::fs::write(&tmp, serde_json::to_vec(value).unwrap()).unwrap();
    std::fs::rename(&tmp, &path).unwrap();
    path
}

/// The `generate` endpoint's instance entry of one worker.
fn instance(dir: &Path, id: WorkerId) -> PathBuf {
    put(
        dir,
        "instances",
        &format!("dynamo%2Fbackend%2Fgenerate%2F{id:x}"),
        &json!({"type": "Endpoint", "namespace": "dynamo", "component": "backend",
                "endpoint": "generate", "instance_id": id,
                "transport": {"tcp": "127.0.0.1:1/x"}}),
    )
}

/// Dynamo's plane message: `[topic, publisher id, seq, 1 ‖ len ‖ envelope]`.
fn plane_message(publisher: u64, seq: u64, payload: &[u8]) -> Vec<String> {
    let env = Envelope {
        publisher_id: publisher,
        sequence: seq,
        published_at: 0,
        topic: TOPIC_KV_EVENTS,
        payload,
    }
    .encode();
    let mut frame = vec![1u8];
    frame.extend_from_slice(&(env.len() as u32).to_be_bytes());
    frame.extend_from_slice(&env);
    vec![
        hex(TOPIC_KV_EVENTS.as_bytes()),
        hex(&publisher.to_be_bytes()),
        hex(&seq.to_be_bytes()),
        hex(&frame),
    ]
}

/// A kv-events payload of `events` with a malformed event (a map with none of an event's
/// fields) spliced in after the first: a MessagePack array of n + 1 elements.
fn payload_with_a_bad_event(events: &[RouterEvent]) -> Vec<u8> {
    let n = events.len() + 1;
    assert!(n < 16, "fixarray");
    let mut out = vec![0x90 | n as u8];
    for (i, e) in events.iter().enumerate() {
        let one = kv::encode(std::slice::from_ref(e)).unwrap();
        assert_eq!(one[0], 0x91);
        out.extend_from_slice(&one[1..]);
        if i == 0 {
            out.extend_from_slice(&[0x81, 0xa3, b'b', b'a', b'd', 0x01]); // {"bad": 1}
        }
    }
    out
}

fn listed(ingest: &Ingest) -> BTreeSet<WorkerId> {
    ingest
        .workers()
        .iter()
        .map(|s| s.worker.worker_id)
        .collect()
}

#[test]
fn a_dynamo_plane_fleet_follows_discovery_and_skips_only_bad_events() {
    let (events, queries) = sample();
    let ids: BTreeSet<WorkerId> = events.iter().map(|e| e.worker_id).collect();
    assert!(ids.len() >= 3, "{ids:?}");
    let dir = tree();
    let port = free_port();
    let entries: HashMap<WorkerId, PathBuf> =
        ids.iter().map(|&id| (id, instance(&dir, id))).collect();
    put(
        &dir,
        "event_channels",
        "namespace%2Fdynamo%2Fcomponent%2Fbackend%2Fendpoint%2Fgenerate%2Ftopic%2Fkv%2Devents%2F1",
        &json!({"type": "EventChannel",
                "scope": {"kind": "endpoint",
                          "endpoint": {"namespace": "dynamo", "component": "backend", "name": "generate"}},
                "topic": "kv-events", "instance_id": 1,
                "transport": {"kind": "Zmq", "config": {"endpoint": format!("tcp://127.0.0.1:{port}")}}}),
    );
    let ingest = Ingest::start(IngestConfig {
        nats: None,
        dynamo_discovery: Some(dir.clone()),
        ..IngestConfig::default()
    })
    .expect("the ingest starts on the ZMQ plane alone");
    // Routable from discovery, before any event.
    wait_until("the discovered fleet", Duration::from_secs(10), || {
        listed(&ingest) == ids
    });

    // Dynamo's publisher binds its PUB and advertises it; the router connects.
    let mut engine = PyEngine::start(&["--pub", &format!("tcp://*:{port}")]);
    wait_until("the plane's publisher", Duration::from_secs(10), || {
        ingest.stats().zmq_connects >= 1
    });
    // A slow joiner: PUB drops what it sends before the subscription reaches it, so the
    // first message is sent until it arrives.
    let mut seq = 0u64;
    wait_until("the subscription", Duration::from_secs(10), || {
        seq += 1;
        let frames = vec![hex(b"kv-events"), hex(&[0; 7])];
        engine.send(&json!({"op": "raw", "frames_hex": frames}));
        std::thread::sleep(Duration::from_millis(20));
        ingest.stats().decode_errors >= 1
    });
    let garbage_before = ingest.stats().decode_errors;

    let (mut bad, mut odd) = (0u64, 0u64);
    for (i, chunk) in events.chunks(6).enumerate() {
        seq += 1;
        let payload = if i % 7 == 3 {
            bad += 1;
            payload_with_a_bad_event(chunk)
        } else {
            kv::encode(chunk).unwrap()
        };
        engine.send(&json!({"op": "raw", "frames_hex": plane_message(7, seq, &payload)}));
        if i % 11 == 5 {
            // Three frames: not the plane's shape.
            odd += 1;
            let mut frames = plane_message(7, seq, &payload);
            frames.remove(1);
            engine.send(&json!({"op": "raw", "frames_hex": frames}));
        }
    }
    let last = expected_last_ids(&events);
    wait_until("every event applied", Duration::from_secs(30), || {
        last.iter()
            .all(|(&w, &id)| ingest.last_event_id(WorkerDp::new(w, 0)) == Some(id))
    });
    assert_same(&ingest, &reference_of(&events), &queries);
    let st = ingest.stats();
    assert_eq!(st.malformed_events, bad, "{st:?}");
    assert_eq!(st.decode_errors - garbage_before, odd, "{st:?}");
    assert!(bad > 0 && odd > 0);

    // One worker leaves discovery: gone from the listing and the index; the rest stay.
    let leaving = *ids.iter().next().unwrap();
    std::fs::remove_file(&entries[&leaving]).unwrap();
    wait_until("the leaver removed", Duration::from_secs(10), || {
        !listed(&ingest).contains(&leaving)
    });
    let rest: Vec<RouterEvent> = events
        .iter()
        .filter(|e| e.worker_id != leaving)
        .cloned()
        .collect();
    wait_until(
        "the leaver's blocks dropped",
        Duration::from_secs(10),
        || {
            ingest.workers().iter().map(|s| s.blocks).sum::<usize>()
                == reference_of(&rest).block_count()
        },
    );
    assert_same(&ingest, &reference_of(&rest), &queries);
    assert_eq!(
        listed(&ingest),
        ids.iter().copied().filter(|&w| w != leaving).collect()
    );
    engine.finish();
    ingest.stop();
    let _ = std::fs::remove_dir_all(&dir);
}
