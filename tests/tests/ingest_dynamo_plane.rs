//! Dynamo's ZMQ event plane through its discovery, against a real libzmq publisher
//! (pyzmq: `tests/py/vllm_engine.py` sending raw frames) and discovery entries written the
//! way Dynamo 1.6.1 writes them, both into a file tree
//! (`../shared/fixtures/dynamo-1.6.1/zmq/discovery`) and into a real etcd: the workers
//! discovery lists are routable before their first event; the index equals the reference
//! index fed the same events although some messages carry a malformed event (that event is
//! counted and skipped, the rest of its message applies) and some messages are not the
//! plane's four frames (counted, nothing lost); a worker whose entry leaves discovery is
//! removed from the index and from the listing at once, the others keep their blocks. An
//! etcd that goes away changes nothing (counted); once back, its changes apply again.
//! The real Dynamo stack on this plane is `kvrouter/tests/dynamo_stack.rs`.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use kvrouter_core::codec::{Envelope, TOPIC_KV_EVENTS, kv};
use kvrouter_core::event::RouterEvent;
use kvrouter_core::index::Index;
use kvrouter_core::worker::{WorkerDp, WorkerId};
use kvrouter_io::ingest::{DynamoDiscovery, Ingest, IngestConfig};
use kvrouter_io::proxy::Target;
use kvrouter_tests::engine::PyEngine;
use kvrouter_tests::etcd::Etcd;
use kvrouter_tests::fleet::{assert_same, expected_last_ids, reference_of, sample, wait_until};
use kvrouter_tests::free_port;
use serde_json::json;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Where the test writes Dynamo's discovery entries.
enum Tree {
    /// The file backend: one file per key, the key's tail percent-encoded.
    Dir(PathBuf),
    /// A real etcd: the keys themselves.
    Etcd(Etcd),
}

impl Tree {
    /// A fresh discovery directory.
    fn dir() -> Self {
        let dir = std::env::temp_dir().join(format!(
            "kvrouter-dynplane-{}-{}",
            std::process::id(),
            free_port()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        for sub in ["instances", "mdc", "event_channels"] {
            std::fs::create_dir_all(dir.join("v1").join(sub)).unwrap();
        }
        Tree::Dir(dir)
    }

    fn discovery(&self) -> DynamoDiscovery {
        match self {
            Tree::Dir(dir) => DynamoDiscovery::File(dir.clone()),
            Tree::Etcd(etcd) => DynamoDiscovery::Etcd(vec![Target::parse(&etcd.url()).unwrap()]),
        }
    }

    /// Writes the entry `v1/{key}` as Dynamo does (a file: whole, renamed into place).
    fn put(&self, key: &str, value: &serde_json::Value) {
        match self {
            Tree::Dir(dir) => {
                let path = self.path(dir, key);
                let tmp = path.with_extension("tmp-write");
                std::fs::write(&tmp, serde_json::to_vec(value).unwrap()).unwrap();
                std::fs::rename(&tmp, &path).unwrap();
            }
            Tree::Etcd(etcd) => etcd.put(&format!("v1/{key}"), &value.to_string()),
        }
    }

    fn remove(&self, key: &str) {
        match self {
            Tree::Dir(dir) => std::fs::remove_file(self.path(dir, key)).unwrap(),
            Tree::Etcd(etcd) => etcd.delete(&format!("v1/{key}")),
        }
    }

    fn path(&self, dir: &Path, key: &str) -> PathBuf {
        let (section, tail) = key.split_once('/').unwrap();
        dir.join("v1")
            .join(section)
            .join(tail.replace('/', "%2F").replace('-', "%2D"))
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        if let Tree::Dir(dir) = self {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// The key of the `generate` endpoint's instance entry of one worker.
fn instance(tree: &Tree, id: WorkerId) -> String {
    let key = format!("instances/dynamo/backend/generate/{id:x}");
    tree.put(
        &key,
        &json!({"type": "Endpoint", "namespace": "dynamo", "component": "backend",
                "endpoint": "generate", "instance_id": id,
                "transport": {"tcp": "127.0.0.1:1/x"}}),
    );
    key
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

/// A fleet on the plane, followed through `tree`; returns it with the workers still listed.
fn follows_discovery(tree: &Tree) -> (Ingest, PyEngine, HashMap<WorkerId, String>) {
    let (events, queries) = sample();
    let ids: BTreeSet<WorkerId> = events.iter().map(|e| e.worker_id).collect();
    assert!(ids.len() >= 3, "{ids:?}");
    let port = free_port();
    let mut entries: HashMap<WorkerId, String> =
        ids.iter().map(|&id| (id, instance(tree, id))).collect();
    tree.put(
        "event_channels/namespace/dynamo/component/backend/endpoint/generate/topic/kv-events/1",
        &json!({"type": "EventChannel",
                "scope": {"kind": "endpoint",
                          "endpoint": {"namespace": "dynamo", "component": "backend", "name": "generate"}},
                "topic": "kv-events", "instance_id": 1,
                "transport": {"kind": "Zmq", "config": {"endpoint": format!("tcp://127.0.0.1:{port}")}}}),
    );
    let ingest = Ingest::start(IngestConfig {
        nats: None,
        dynamo_discovery: Some(tree.discovery()),
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
    tree.remove(&entries.remove(&leaving).unwrap());
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
    (ingest, engine, entries)
}

#[test]
fn a_dynamo_plane_fleet_follows_file_discovery_and_skips_only_bad_events() {
    let tree = Tree::dir();
    let (ingest, engine, _) = follows_discovery(&tree);
    engine.finish();
    ingest.stop();
}

#[test]
fn a_dynamo_plane_fleet_follows_etcd_discovery_and_survives_its_outage() {
    let mut tree = Tree::Etcd(Etcd::start());
    let (ingest, engine, mut entries) = follows_discovery(&tree);
    let blocks = |i: &Ingest| i.workers().iter().map(|s| s.blocks).sum::<usize>();
    let (before, cached) = (listed(&ingest), blocks(&ingest));
    let errors = ingest.stats().discovery_errors;
    let Tree::Etcd(etcd) = &mut tree else {
        unreachable!()
    };
    // etcd goes away: each failed listing is counted, and the fleet stays as it was.
    etcd.kill();
    wait_until("failed listings counted", Duration::from_secs(20), || {
        ingest.stats().discovery_errors >= errors + 2
    });
    assert_eq!(listed(&ingest), before);
    assert_eq!(blocks(&ingest), cached);
    // Back, with its entries: a worker deleted meanwhile goes at the next listing.
    etcd.restart();
    let leaving = *entries.keys().next().unwrap();
    tree.remove(&entries.remove(&leaving).unwrap());
    wait_until("the leaver removed", Duration::from_secs(10), || {
        !listed(&ingest).contains(&leaving)
    });
    assert_eq!(listed(&ingest), entries.keys().copied().collect());
    engine.finish();
    ingest.stop();
}
