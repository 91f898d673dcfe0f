//! Durability over a real `nats-server` (each test its own): snapshots restore the index,
//! unusable snapshots fall back to a full resync, a failed write keeps the previous
//! snapshot, and in JetStream mode a router that restarts from an older snapshot, or a
//! broker restarted under load, loses nothing.
//!
//! The process-level `kill -9` of a router is in `kvrouter/tests/serve_e2e.rs`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kvrouter_core::event::RouterEvent;
use kvrouter_core::index::Index;
use kvrouter_io::ingest::{DurableConfig, Ingest, IngestConfig, SnapshotConfig, SnapshotError};
use kvrouter_io::nats::Client;
use kvrouter_io::snapshot::{SnapshotIoError, SnapshotStore};
use kvrouter_tests::fleet::*;
use kvrouter_tests::{NatsServer, on_glommio};

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvrouter-durability-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// One JetStream API call from the side (an operator, another program).
fn js_api(url: &str, subject: &str) -> String {
    let (url, subject) = (url.to_owned(), subject.to_owned());
    on_glommio(move || async move {
        let c = Client::connect(nats_opts(&url)).await.unwrap();
        let m = c
            .request(&subject, b"", Duration::from_secs(5))
            .await
            .unwrap();
        String::from_utf8_lossy(&m.payload).into_owned()
    })
}

fn start(url: &str, snapshots: Option<&Path>, durable: Option<&str>) -> Ingest {
    Ingest::start(IngestConfig {
        nats: Some(nats_opts(url)),
        shards: 2,
        recovery_timeout: Duration::from_secs(2),
        silence_timeout: Duration::from_secs(60),
        router_id: 7,
        snapshot: snapshots.map(|d| SnapshotConfig {
            dir: d.to_path_buf(),
            interval: None,
            on_stop: false,
        }),
        durable: durable.map(|consumer| DurableConfig {
            idle_heartbeat: Duration::from_millis(200),
            ..DurableConfig::new("kvtest", consumer)
        }),
        ..Default::default()
    })
    .expect("ingest starts")
}

#[test]
fn a_snapshot_restores_the_index_before_any_event_arrives() {
    let server = NatsServer::start();
    let snaps = dir("restore");
    let (events, queries) = sample();
    let events = shift(&events);
    let reference = reference_of(&events);
    let first = start(&server.url(), Some(&snaps), None);
    let fleet = publish_all(server.url(), events.clone(), true, None);
    wait_applied(&first, &expected_last_ids(&events));
    let info = first.snapshot_now().expect("snapshot written");
    assert_eq!(info.blocks as usize, reference.block_count());
    assert_eq!(info.stream_seq, None, "core mode has no stream position");
    first.stop();
    fleet.stop();

    // No worker is publishing: everything the new ingest knows comes from the file.
    let second = start(&server.url(), Some(&snaps), None);
    assert_same(&second, &reference, &queries);
    let last = expected_last_ids(&events);
    for s in second.workers() {
        assert_eq!(Some(last[&s.worker.worker_id]), s.last_event_id, "{s:?}");
    }
    let st = second.stats();
    assert_eq!(
        st.snapshot_restored_blocks as usize,
        reference.block_count()
    );
    assert_eq!(st.snapshot_load_failures, 0);
    let _ = std::fs::remove_dir_all(&snaps);
}

#[test]
fn a_corrupt_or_truncated_snapshot_falls_back_to_a_full_resync() {
    let server = NatsServer::start();
    let snaps = dir("corrupt");
    let (events, queries) = sample();
    let events = shift(&events);
    let reference = reference_of(&events);
    let fleet = publish_all(server.url(), events.clone(), true, None);
    {
        let first = start(&server.url(), Some(&snaps), None);
        wait_applied(&first, &expected_last_ids(&events));
        first.snapshot_now().unwrap();
    }
    let path = SnapshotStore::new(&snaps).path();
    let good = std::fs::read(&path).unwrap();
    let mut flipped = good.clone();
    let at = good.len() / 2;
    flipped[at] ^= 0x40;
    for (what, bytes) in [
        ("corrupt", flipped),
        ("truncated", good[..good.len() - 7].to_vec()),
    ] {
        std::fs::write(&path, &bytes).unwrap();
        let ingest = start(&server.url(), Some(&snaps), None);
        assert_eq!(ingest.stats().snapshot_load_failures, 1, "{what}");
        assert_eq!(ingest.stats().snapshot_restored_blocks, 0, "{what}");
        // The workers still heartbeat: each is loaded from its local indexer.
        wait_applied(&ingest, &expected_last_ids(&events));
        assert_same(&ingest, &reference, &queries);
        assert!(ingest.stats().dumps >= 4, "{what}: {:?}", ingest.stats());
    }
    fleet.stop();
    let _ = std::fs::remove_dir_all(&snaps);
}

#[test]
fn a_failed_snapshot_write_keeps_the_previous_snapshot() {
    let server = NatsServer::start();
    let snaps = dir("readonly");
    let (events, _) = sample();
    let events = shift(&events);
    let ingest = start(&server.url(), Some(&snaps), None);
    let fleet = publish_all(server.url(), events.clone(), true, None);
    wait_applied(&ingest, &expected_last_ids(&events));
    ingest.snapshot_now().unwrap();
    let path = SnapshotStore::new(&snaps).path();
    let before = std::fs::read(&path).unwrap();
    // Make the next write fail whatever our privileges (tests run as root, where
    // permission bits do not stop a write): the temporary file's name is taken by a
    // directory.
    let blocker = snaps.join(format!(".kvrouter.snap.tmp.{}", std::process::id()));
    std::fs::create_dir_all(&blocker).unwrap();
    let err = ingest.snapshot_now().unwrap_err();
    // A typed error that keeps the file system's answer as its source.
    let SnapshotError::Write(SnapshotIoError::Io { path: at, .. }) = &err else {
        panic!("{err:?}");
    };
    assert!(
        at.to_string_lossy().contains("kvrouter.snap.tmp"),
        "{err:?}"
    );
    let chain = kvrouter_io::Chain(&err).to_string();
    assert!(chain.contains("kvrouter.snap.tmp"), "{chain}");
    assert_eq!(ingest.stats().snapshot_failures, 1);
    assert_eq!(
        std::fs::read(&path).unwrap(),
        before,
        "the old snapshot is intact"
    );
    std::fs::remove_dir(&blocker).unwrap();
    ingest
        .snapshot_now()
        .expect("writes again once the fault is gone");
    assert_eq!(ingest.stats().snapshots, 2);
    fleet.stop();
    let _ = std::fs::remove_dir_all(&snaps);
}

/// The sample's events in two halves, published durably by workers without a local
/// indexer: anything the stream failed to deliver would stay missing, so equality with the
/// reference shows the stream alone carried every event.
struct Halves {
    events: Vec<RouterEvent>,
    queries: Vec<Vec<kvrouter_core::hash::LocalBlockHash>>,
    half: usize,
}

impl Halves {
    fn new() -> Self {
        let (events, queries) = sample();
        let events = shift(&events);
        let half = events.len() / 2;
        Self {
            events,
            queries,
            half,
        }
    }

    fn how() -> Publishing {
        Publishing {
            durable: true,
            ..Publishing::default()
        }
    }

    /// Publishes the first half and waits until `ingest` applied it.
    fn first(&self, url: &str, ingest: &Ingest) {
        let part = &self.events[..self.half];
        publish_with(url.to_owned(), part.to_vec(), Self::how()).stop();
        wait_applied(ingest, &expected_last_ids(part));
    }

    /// Publishes the second half, carrying on the workers' numbering.
    fn second(&self, url: &str) {
        let how = Publishing {
            first_ids: expected_last_ids(&self.events[..self.half])
                .into_iter()
                .map(|(w, id)| (w, id + 1))
                .collect(),
            ..Self::how()
        };
        publish_with(url.to_owned(), self.events[self.half..].to_vec(), how).stop();
    }

    /// Waits until `ingest` applied everything, and checks it against the reference.
    fn check(&self, ingest: &Ingest) {
        wait_applied(ingest, &expected_last_ids(&self.events));
        assert_same(ingest, &reference_of(&self.events), &self.queries);
    }
}

#[test]
fn durable_mode_resumes_from_the_snapshot_sequence_after_a_crash() {
    let server = NatsServer::start();
    let snaps = dir("durable-resume");
    let h = Halves::new();
    let first = start(&server.url(), Some(&snaps), Some("router-a"));
    h.first(&server.url(), &first);
    let info = first.snapshot_now().unwrap();
    assert!(info.stream_seq.is_some_and(|s| s > 0), "{info:?}");
    // A crash: no snapshot on the way out; what follows is only in the stream.
    drop(first);
    h.second(&server.url());

    let second = start(&server.url(), Some(&snaps), Some("router-a"));
    assert!(second.stats().snapshot_restored_blocks > 0);
    h.check(&second);
    let st = second.stats();
    assert_eq!(st.gaps, 0, "{st:?}");
    // Delivery resumed right after the snapshot: nothing before it came again.
    assert_eq!(st.duplicates, 0, "{st:?}");
    assert_eq!(st.events, (h.events.len() - h.half) as u64, "{st:?}");
    assert!(st.js_acks > 0, "{st:?}");
    let _ = std::fs::remove_dir_all(&snaps);
}

#[test]
fn durable_mode_restores_snapshots_taken_while_events_stream_in() {
    // Each shard dumps a worker at a time and applies what arrived in between, so a
    // snapshot taken under load holds later workers at later points of the stream than
    // its recorded position; the replay after a restore must skip exactly those events.
    let server = NatsServer::start();
    let snaps = dir("durable-under-load");
    let h = Halves::new();
    let first = start(&server.url(), Some(&snaps), Some("router-c"));
    h.first(&server.url(), &first);
    let url = server.url();
    let mut taken = 0;
    std::thread::scope(|s| {
        let publisher = s.spawn(|| h.second(&url));
        while !publisher.is_finished() || taken == 0 {
            first.snapshot_now().expect("snapshot written");
            taken += 1;
        }
    });
    // A crash after the last snapshot: what it does not hold is only in the stream.
    drop(first);
    let second = start(&server.url(), Some(&snaps), Some("router-c"));
    assert!(second.stats().snapshot_restored_blocks > 0);
    h.check(&second);
    let st = second.stats();
    assert_eq!(st.gaps, 0, "{st:?} after {taken} snapshots");
    assert_eq!(st.restarts, 0, "{st:?}");
    let _ = std::fs::remove_dir_all(&snaps);
}

#[test]
fn durable_mode_loses_nothing_when_the_broker_restarts_under_load() {
    let mut server = NatsServer::start();
    let (events, queries) = sample();
    let events = shift(&events);
    let ingest = start(&server.url(), None, Some("router-b"));
    let progress = Arc::new(AtomicUsize::new(0));
    let fleet = publish_with(
        server.url(),
        events.clone(),
        Publishing {
            durable: true,
            pace: Some(Duration::from_micros(300)),
            progress: Some(Arc::clone(&progress)),
            ..Publishing::default()
        },
    );
    wait_until("a third published", Duration::from_secs(30), || {
        progress.load(Ordering::Relaxed) > events.len() / 3
    });
    server.kill();
    std::thread::sleep(Duration::from_millis(300));
    server.restart();
    wait_applied(&ingest, &expected_last_ids(&events));
    assert_same(&ingest, &reference_of(&events), &queries);
    let st = ingest.stats();
    assert!(st.nats_reconnects >= 1, "{st:?}");
    assert!(
        progress.load(Ordering::Relaxed) == events.len(),
        "every event published"
    );
    fleet.stop();
}

#[test]
fn a_consumer_deleted_behind_the_routers_back_is_re_created() {
    let server = NatsServer::start();
    let h = Halves::new();
    let ingest = start(&server.url(), None, Some("router-c"));
    h.first(&server.url(), &ingest);
    let answer = js_api(&server.url(), "$JS.API.CONSUMER.DELETE.kvtest.router-c");
    assert!(answer.contains("\"success\":true"), "{answer}");
    h.second(&server.url());
    h.check(&ingest);
    assert!(ingest.stats().js_resets >= 1, "{:?}", ingest.stats());
}

#[test]
fn a_stream_re_created_since_the_snapshot_is_replayed_from_its_start() {
    let server = NatsServer::start();
    let snaps = dir("stream-recreated");
    let h = Halves::new();
    let first = start(&server.url(), Some(&snaps), Some("router-d"));
    h.first(&server.url(), &first);
    assert!(first.snapshot_now().unwrap().stream_seq.unwrap() >= h.half as u64);
    drop(first);
    // The stream is deleted: its numbering starts over below the snapshot's sequence.
    let answer = js_api(&server.url(), "$JS.API.STREAM.DELETE.kvtest");
    assert!(answer.contains("\"success\":true"), "{answer}");
    let second = start(&server.url(), Some(&snaps), Some("router-d"));
    h.second(&server.url());
    h.check(&second);
    let _ = std::fs::remove_dir_all(&snaps);
}
