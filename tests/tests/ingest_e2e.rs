//! End-to-end ingest over a real `nats-server` (each test its own): workers publish through
//! the worker library, the router's ingest applies, and its index must equal the reference
//! index fed the same events — also with injected message loss, worker restarts, a broker
//! restart mid-stream, malformed payloads, stock Dynamo workers (no local indexer) and
//! departures.

use std::collections::HashMap;
use std::time::Duration;

use kvrouter_core::event::KvCacheEvent;
use kvrouter_core::hash::LocalBlockHash;
use kvrouter_core::worker::{WorkerDp, WorkerId};
use kvrouter_io::ingest::{Ingest, IngestConfig};
use kvrouter_io::nats::Client;
use kvrouter_io::worker::{KvPublisher, PublisherOptions};
use kvrouter_tests::fleet::*;
use kvrouter_tests::{NatsServer, on_glommio};

fn ingest(url: &str, shards: usize) -> Ingest {
    Ingest::start(IngestConfig {
        nats: Some(nats_opts(url)),
        shards,
        recovery_timeout: Duration::from_secs(2),
        silence_timeout: Duration::from_secs(30),
        ..Default::default()
    })
    .expect("ingest starts")
}

#[test]
fn ingest_equals_the_reference_fed_the_same_events() {
    let server = NatsServer::start();
    let ingest = ingest(&server.url(), 2);
    assert!(ingest.is_ready());
    let (events, queries) = sample();
    let events = shift(&events);
    let fleet = publish_all(server.url(), events.clone(), true, None);
    wait_applied(&ingest, &expected_last_ids(&events));
    assert_same(&ingest, &reference_of(&events), &queries);
    assert_eq!(fleet.stop(), expected_last_ids(&events));
    let st = ingest.stats();
    assert_eq!(st.decode_errors, 0, "{st:?}");
    // Every message was applied live, or covered by the dump loaded when the worker
    // announced itself (its live copies then count as duplicates).
    assert!(st.events + st.duplicates >= events.len() as u64, "{st:?}");
    assert!(st.dumps >= 4, "{st:?}");
}

#[test]
fn injected_loss_is_recovered_exactly() {
    let server = NatsServer::start();
    let ingest = ingest(&server.url(), 1);
    let (events, queries) = sample();
    let events = shift(&events);
    // The publishers keep answering while we wait for the router to catch up. Paced, so
    // that most messages arrive after the dump each announcement triggers (unpaced, the
    // dump can cover them all and no gap is ever seen).
    let fleet = publish_with(
        server.url(),
        events.clone(),
        Publishing {
            announce: true,
            drop_every: Some(10),
            pace: Some(Duration::from_micros(500)),
            ..Publishing::default()
        },
    );
    wait_applied(&ingest, &expected_last_ids(&events));
    assert_same(&ingest, &reference_of(&events), &queries);
    let st = ingest.stats();
    assert!(st.gaps > 0 && st.recoveries > 0, "{st:?}");
    fleet.stop();
}

#[test]
fn a_worker_restart_resets_and_rebuilds_its_state() {
    let server = NatsServer::start();
    let ingest = ingest(&server.url(), 1);
    let url = server.url();
    let worker = 77u64;
    let blocks =
        |base: u64, n: u64| -> Vec<(LocalBlockHash, kvrouter_core::hash::SequenceBlockHash)> {
            (0..n)
                .map(|i| {
                    (
                        LocalBlockHash(base + i),
                        kvrouter_core::hash::SequenceBlockHash(base * 1000 + i),
                    )
                })
                .collect()
        };
    let (b1, b2) = (blocks(10, 5), blocks(20, 3));
    let (c1, c2) = (b1.clone(), b2.clone());
    std::thread::spawn(move || {
        on_glommio(move || async move {
            let client = Client::connect(nats_opts(&url)).await.unwrap();
            let p = KvPublisher::start(
                client.clone(),
                PublisherOptions {
                    heartbeat: Duration::from_millis(100),
                    ..PublisherOptions::new(worker)
                },
            )
            .await
            .unwrap();
            p.stored(0, None, c1).await.unwrap();
            p.stored(0, None, c2.clone()).await.unwrap();
            client.flush(Duration::from_secs(5)).await.unwrap();
            glommio::timer::sleep(Duration::from_millis(500)).await;
            // The engine restarts: a fresh publisher, ids from 0, an empty cache.
            let p2 = KvPublisher::start(
                client.clone(),
                PublisherOptions {
                    heartbeat: Duration::from_millis(100),
                    ..PublisherOptions::new(worker)
                },
            )
            .await
            .unwrap();
            drop(p);
            p2.stored(0, None, c2).await.unwrap();
            client.flush(Duration::from_secs(5)).await.unwrap();
            glommio::timer::sleep(Duration::from_millis(800)).await;
        })
    })
    .join()
    .unwrap();
    let q1: Vec<LocalBlockHash> = b1.iter().map(|b| b.0).collect();
    let q2: Vec<LocalBlockHash> = b2.iter().map(|b| b.0).collect();
    wait_until("the restart applied", Duration::from_secs(10), || {
        ingest.reader().find_matches(&q1).is_empty()
    });
    assert_eq!(ingest.reader().find_matches(&q2).max_score(), 3);
    assert!(ingest.stats().restarts >= 1, "{:?}", ingest.stats());
}

#[test]
fn a_broker_restart_mid_stream_converges() {
    let mut server = NatsServer::start();
    let ingest = ingest(&server.url(), 2);
    let (events, queries) = sample();
    let events = shift(&events);
    let url = server.url();
    let (half_tx, half_rx) = std::sync::mpsc::channel::<()>();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
    let all = events.clone();
    let publisher = std::thread::spawn(move || {
        on_glommio(move || async move {
            let client = Client::connect(nats_opts(&url)).await.unwrap();
            let mut pubs: HashMap<WorkerId, KvPublisher> = HashMap::new();
            let half = all.len() / 2;
            for (i, e) in all.into_iter().enumerate() {
                if i == half {
                    client.flush(Duration::from_secs(5)).await.unwrap();
                    half_tx.send(()).unwrap();
                    while go_rx.try_recv().is_err() {
                        glommio::timer::sleep(Duration::from_millis(10)).await;
                    }
                }
                if let std::collections::hash_map::Entry::Vacant(slot) = pubs.entry(e.worker_id) {
                    let opts = PublisherOptions {
                        heartbeat: Duration::from_millis(100),
                        ..PublisherOptions::new(e.worker_id)
                    };
                    slot.insert(KvPublisher::start(client.clone(), opts).await.unwrap());
                }
                pubs[&e.worker_id]
                    .publish(e.event.dp_rank, vec![e.event.data.clone()])
                    .await
                    .unwrap();
            }
            // Until a flush goes through. When `go` is already there at this task's first
            // look (the kill was quick), the task has not yielded since the kill, and the
            // second half never yields either (every publish fits the client's buffer): the
            // client's connection tasks have not run, so it still believes its first
            // connection alive. `wait_connected` returns at once and the flush's PING meets
            // the dead socket (`Broken pipe`, `reconnects == 0`; about one run in twenty,
            // diagnosed with prints of both). That flush fails with `NotConnected`, and the
            // next connection resends everything still buffered, which the checks below
            // verify.
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            loop {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                if client.wait_connected(left).await.is_ok()
                    && client.flush(Duration::from_secs(5)).await.is_ok()
                {
                    break;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "the publisher never flushed after the broker restart"
                );
                glommio::timer::sleep(Duration::from_millis(50)).await;
            }
            while stop_rx.try_recv().is_err() {
                glommio::timer::sleep(Duration::from_millis(20)).await;
            }
        })
    });
    half_rx.recv().unwrap();
    server.kill();
    // Publishing goes on while the broker is down (buffered by the client).
    go_tx.send(()).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    server.restart();
    wait_applied(&ingest, &expected_last_ids(&events));
    assert_same(&ingest, &reference_of(&events), &queries);
    assert!(ingest.stats().nats_reconnects >= 1);
    stop_tx.send(()).unwrap();
    publisher.join().unwrap();
}

#[test]
fn malformed_payloads_are_counted_and_skipped() {
    let server = NatsServer::start();
    let ingest = ingest(&server.url(), 1);
    let url = server.url();
    let subject = kvrouter_core::codec::Subjects::default().kv_events();
    std::thread::spawn(move || {
        on_glommio(move || async move {
            let client = Client::connect(nats_opts(&url)).await.unwrap();
            for junk in [
                &b"not msgpack"[..],
                b"\x85",
                b"",
                b"\x81\xa5topic\xa9kv-events",
            ] {
                client.publish(&subject, junk).await.unwrap();
            }
            let p = KvPublisher::start(
                client.clone(),
                PublisherOptions {
                    announce: false,
                    ..PublisherOptions::new(5)
                },
            )
            .await
            .unwrap();
            p.stored(
                0,
                None,
                vec![(LocalBlockHash(1), kvrouter_core::hash::SequenceBlockHash(2))],
            )
            .await
            .unwrap();
            client.flush(Duration::from_secs(5)).await.unwrap();
        })
    })
    .join()
    .unwrap();
    wait_until("the valid event", Duration::from_secs(10), || {
        ingest.last_event_id(WorkerDp::new(5, 0)) == Some(0)
    });
    assert_eq!(
        ingest
            .reader()
            .find_matches(&[LocalBlockHash(1)])
            .max_score(),
        1
    );
    assert_eq!(ingest.stats().decode_errors, 4);
}

#[test]
fn stock_dynamo_workers_are_registered_by_their_first_event_and_reaped_when_silent() {
    let server = NatsServer::start();
    let ingest = Ingest::start(IngestConfig {
        nats: Some(nats_opts(&server.url())),
        silence_timeout: Duration::from_millis(600),
        ..Default::default()
    })
    .unwrap();
    let url = server.url();
    let worker = 15_655_423_716_543_156_698u64; // above 2^53, like Dynamo's
    std::thread::spawn(move || {
        on_glommio(move || async move {
            let client = Client::connect(nats_opts(&url)).await.unwrap();
            // No announcement, no local indexer; numbering starts at 1 as in Dynamo 1.6.1,
            // and one message in three is lost.
            let opts = PublisherOptions {
                announce: false,
                drop_every: Some(3),
                first_event_id: 1,
                ..PublisherOptions::new(worker)
            };
            let p = KvPublisher::start(client.clone(), opts).await.unwrap();
            for i in 0..6u64 {
                let KvCacheEvent { data, .. } = KvCacheEvent::stored(
                    0,
                    0,
                    None,
                    [(
                        LocalBlockHash(100 + i),
                        kvrouter_core::hash::SequenceBlockHash(100 + i),
                    )],
                );
                p.publish(0, vec![data]).await.unwrap();
            }
            client.flush(Duration::from_secs(5)).await.unwrap();
        })
    })
    .join()
    .unwrap();
    wait_until("the worker's events", Duration::from_secs(10), || {
        ingest
            .last_event_id(WorkerDp::new(worker, 0))
            .is_some_and(|id| id >= 5)
    });
    // Messages 3 and 6 (ids 3 and 6) were lost: id 4 came after a gap and was applied.
    let st = ingest.stats();
    assert!(st.gaps >= 1 && st.recoveries == 0, "{st:?}");
    // Event ids 1..=6 carried blocks 100..=105; ids 3 and 6 were lost.
    assert_eq!(
        ingest
            .reader()
            .find_matches(&[LocalBlockHash(104)])
            .max_score(),
        1
    );
    assert!(
        ingest
            .reader()
            .find_matches(&[LocalBlockHash(102)])
            .is_empty()
    );
    wait_until("the silent worker removed", Duration::from_secs(10), || {
        ingest.workers().is_empty()
    });
    assert!(ingest.stats().workers_removed >= 1);
}

#[test]
fn a_leaving_worker_is_removed_at_once() {
    let server = NatsServer::start();
    let ingest = ingest(&server.url(), 1);
    let url = server.url();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let h = std::thread::spawn(move || {
        on_glommio(move || async move {
            let client = Client::connect(nats_opts(&url)).await.unwrap();
            let p = KvPublisher::start(client.clone(), PublisherOptions::new(42))
                .await
                .unwrap();
            p.stored(
                0,
                None,
                vec![(LocalBlockHash(9), kvrouter_core::hash::SequenceBlockHash(9))],
            )
            .await
            .unwrap();
            client.flush(Duration::from_secs(5)).await.unwrap();
            tx.send(()).unwrap();
            while go_rx.try_recv().is_err() {
                glommio::timer::sleep(Duration::from_millis(10)).await;
            }
            p.leave().await.unwrap();
        })
    });
    let view = ingest.view();
    let empty = view.membership();
    rx.recv().unwrap();
    wait_until("the worker's block", Duration::from_secs(10), || {
        ingest
            .reader()
            .find_matches(&[LocalBlockHash(9)])
            .max_score()
            == 1
    });
    // The membership counter (what the router's cached worker list keys on) moved when
    // the worker appeared, and moves again when it leaves.
    wait_until("the worker listed", Duration::from_secs(10), || {
        view.workers().len() == 1
    });
    let joined = view.membership();
    assert_ne!(joined, empty);
    go_tx.send(()).unwrap();
    h.join().unwrap();
    wait_until("the worker removed", Duration::from_secs(10), || {
        ingest
            .reader()
            .find_matches(&[LocalBlockHash(9)])
            .is_empty()
    });
    wait_until("the worker unlisted", Duration::from_secs(10), || {
        view.workers().is_empty()
    });
    assert_ne!(view.membership(), joined);
}

#[test]
fn a_one_million_token_prompt_fits_in_one_message() {
    // 1 M tokens at block size 64: one stored event of 15,625 blocks under the default
    // 1 MiB max_payload.
    let server = NatsServer::start();
    let ingest = ingest(&server.url(), 1);
    let url = server.url();
    let tokens: Vec<u32> = (0..1_000_000u32)
        .map(|i| i.wrapping_mul(2_654_435_761))
        .collect();
    let locals = kvrouter_core::hash::local_block_hashes(&tokens, 64, &Default::default());
    let seqs = kvrouter_core::hash::sequence_hashes(&locals);
    assert_eq!(locals.len(), 15_625);
    let blocks: Vec<_> = locals.iter().copied().zip(seqs).collect();
    let sent = std::thread::spawn(move || {
        on_glommio(move || async move {
            let client = Client::connect(nats_opts(&url)).await.unwrap();
            assert_eq!(client.max_payload(), 1 << 20);
            let p = KvPublisher::start(
                client.clone(),
                PublisherOptions {
                    announce: false,
                    ..PublisherOptions::new(3)
                },
            )
            .await
            .unwrap();
            p.stored(0, None, blocks).await.unwrap();
            client.flush(Duration::from_secs(5)).await.unwrap();
            p.counts()
        })
    })
    .join()
    .unwrap();
    assert_eq!(sent, (1, 0), "one message");
    wait_until("the long prompt", Duration::from_secs(10), || {
        ingest.last_event_id(WorkerDp::new(3, 0)) == Some(0)
    });
    assert_eq!(ingest.reader().find_matches(&locals).max_score(), 15_625);
    assert_eq!(ingest.stats().event_blocks, 15_625);
}

/// Shared-pool events (residency `cache_owner`) over a real nats-server: indexed, counted,
/// no worker made of their source; a snapshot keeps them, and a router restored from it
/// with no broker credits the same pool blocks.
#[test]
fn a_shared_pool_is_ingested_and_survives_a_snapshot() {
    use kvrouter_core::event::{ResidencyDomain, RouterEvent};
    use kvrouter_core::hash::{SequenceBlockHash, sequence_hashes};
    use kvrouter_core::index::{OverlapScores, TierScores};
    use kvrouter_io::ingest::SnapshotConfig;

    let server = NatsServer::start();
    let snaps = std::env::temp_dir().join(format!("kvrouter-pool-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&snaps);
    let with_snapshots = |nats: Option<&str>| {
        Ingest::start(IngestConfig {
            nats: nats.map(nats_opts),
            snapshot: Some(SnapshotConfig {
                dir: snaps.clone(),
                interval: None,
                on_stop: false,
            }),
            ..IngestConfig::default()
        })
        .expect("ingest starts")
    };
    let ingest = with_snapshots(Some(&server.url()));
    let q: Vec<LocalBlockHash> = (1..=6).map(LocalBlockHash).collect();
    let names = sequence_hashes(&q);
    let chain: Vec<(LocalBlockHash, SequenceBlockHash)> =
        q.iter().copied().zip(names.iter().copied()).collect();
    let pool = |data: KvCacheEvent| {
        let mut e = RouterEvent::new(77, data);
        e.residency_domain = Some(ResidencyDomain::CacheOwner);
        e
    };
    // Worker 5 holds the first 2 blocks on its device; the pool all 6 but block 3.
    let events = [
        RouterEvent::new(5, KvCacheEvent::stored(1, 0, None, chain[..2].to_vec())),
        pool(KvCacheEvent::stored(1, 0, None, chain.clone())),
        pool(KvCacheEvent::removed(2, 0, [names[3]])),
    ];
    publish_encoded(&server.url(), 3, events.to_vec());
    let paths: Vec<u64> = names.iter().map(|h| h.0).collect();
    let shared = |ingest: &Ingest| {
        let reader = ingest.reader();
        let mut device = OverlapScores::new();
        reader.find_matches_into(&q, &mut device);
        let mut tiers = TierScores::new();
        reader.tier_overlaps_into(&paths, &device, &mut tiers);
        (
            device.get(WorkerDp::new(5, 0)),
            tiers.shared_beyond(0),
            tiers.shared_beyond(2),
        )
    };
    wait_until("the pool's events", Duration::from_secs(10), || {
        ingest.stats().pool_events == 2
    });
    assert_eq!(shared(&ingest), (2, 5, 3));
    let listed: Vec<WorkerId> = ingest
        .workers()
        .iter()
        .map(|s| s.worker.worker_id)
        .collect();
    assert_eq!(listed, [5], "the pool's source is no worker");
    ingest.snapshot_now().expect("snapshot written");
    ingest.stop();
    let restored = with_snapshots(None);
    assert_eq!(shared(&restored), (2, 5, 3));
    assert_eq!(restored.stats().snapshot_restored_blocks, 2 + 5);
    restored.stop();
    let _ = std::fs::remove_dir_all(&snaps);
}
