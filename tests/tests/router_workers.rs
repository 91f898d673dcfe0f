//! The routing API's candidate workers follow the ingest: a worker the ingest removed (it
//! left, restarted under a new id, fell silent) is never chosen again and its requests are
//! released, however many of its requests were open. Real nats-server, the ingest and the
//! routing API in this process, workers publishing through the worker library.

use std::sync::mpsc;
use std::time::Duration;

use kvrouter_core::hash::{LocalBlockHash, SequenceBlockHash};
use kvrouter_io::ingest::{Ingest, IngestConfig};
use kvrouter_io::nats::Client;
use kvrouter_io::router::{self, RouterConfig};
use kvrouter_io::worker::{KvPublisher, PublisherOptions};
use kvrouter_tests::fleet::{nats_opts, wait_until};
use kvrouter_tests::{NatsServer, http, metric, on_glommio};
use serde_json::Value;

fn json(r: (u16, String)) -> (u16, Value) {
    (r.0, serde_json::from_str(&r.1).unwrap_or(Value::Null))
}

fn listed(addr: &str) -> Vec<u64> {
    let (_, v) = json(http(addr, "GET", "/v1/workers", "", &[]));
    v["workers"]
        .as_array()
        .map(|a| a.iter().filter_map(|w| w["worker_id"].as_u64()).collect())
        .unwrap_or_default()
}

fn api(ingest: &Ingest) -> router::RouterHandle {
    router::start(
        RouterConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            replica_sync: false,
            block_size: 16,
            ..RouterConfig::default()
        },
        Some(ingest.view()),
        None,
        512 << 10,
    )
    .expect("the routing API starts")
}

#[test]
fn a_worker_the_ingest_removed_is_never_routed_to_again() {
    let server = NatsServer::start();
    let ingest = Ingest::start(IngestConfig {
        nats: Some(nats_opts(&server.url())),
        ..IngestConfig::default()
    })
    .unwrap();
    let api = api(&ingest);
    let addr = api.addr().to_string();
    let (leave_tx, leave_rx) = mpsc::channel::<()>();
    let (stop_tx, stop_rx) = mpsc::channel::<()>();
    let url = server.url();
    // Workers 1 and 2, each with a local indexer and one cached block (10 and 20).
    let workers = std::thread::spawn(move || {
        on_glommio(move || async move {
            let client = Client::connect(nats_opts(&url)).await.unwrap();
            let one = KvPublisher::start(client.clone(), PublisherOptions::new(1))
                .await
                .unwrap();
            let two = KvPublisher::start(client.clone(), PublisherOptions::new(2))
                .await
                .unwrap();
            for (p, block) in [(&one, 10), (&two, 20)] {
                let b = vec![(LocalBlockHash(block), SequenceBlockHash(block))];
                p.stored(0, None, b).await.unwrap();
            }
            client.flush(Duration::from_secs(5)).await.unwrap();
            while leave_rx.try_recv().is_err() {
                glommio::timer::sleep(Duration::from_millis(10)).await;
            }
            one.leave().await.unwrap();
            client.flush(Duration::from_secs(5)).await.unwrap();
            while stop_rx.try_recv().is_err() {
                glommio::timer::sleep(Duration::from_millis(10)).await;
            }
        })
    });
    wait_until("both workers listed", Duration::from_secs(10), || {
        listed(&addr) == [1, 2]
    });
    // Worker 1 caches block 10: it gets the request, which stays open.
    let (status, v) = json(http(
        &addr,
        "POST",
        "/v1/route",
        r#"{"block_hashes": [10], "request_id": "open-on-one"}"#,
        &[],
    ));
    assert_eq!((status, v["worker_id"].as_u64()), (200, Some(1)), "{v}");
    leave_tx.send(()).unwrap();
    wait_until(
        "the ingest removes worker 1",
        Duration::from_secs(10),
        || ingest.workers().iter().all(|s| s.worker.worker_id != 1),
    );
    // Gone from routing at once, open request and all.
    assert_eq!(listed(&addr), [2]);
    for i in 0..20 {
        let body = format!(r#"{{"block_hashes": [10, {i}], "request_id": "after-{i}"}}"#);
        let (status, v) = json(http(&addr, "POST", "/v1/route", &body, &[]));
        assert_eq!((status, v["worker_id"].as_u64()), (200, Some(2)), "{v}");
    }
    // Its request was released with it.
    let (status, _) = http(&addr, "POST", "/v1/requests/open-on-one/free", "", &[]);
    assert_eq!(status, 404);
    assert_eq!(metric(&addr, "kvrouter_router_workers_removed_total"), 1.0);
    assert_eq!(metric(&addr, "kvrouter_slots_active_requests"), 20.0);
    stop_tx.send(()).unwrap();
    workers.join().unwrap();
    api.stop();
    ingest.stop();
}

#[test]
fn a_duplicate_request_id_is_one_client_error() {
    let server = NatsServer::start();
    let ingest = Ingest::start(IngestConfig {
        nats: Some(nats_opts(&server.url())),
        ..IngestConfig::default()
    })
    .unwrap();
    let api = router::start(
        RouterConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            replica_sync: false,
            static_workers: vec![kvrouter_core::worker::WorkerDp::new(7, 0)],
            ..RouterConfig::default()
        },
        Some(ingest.view()),
        None,
        512 << 10,
    )
    .unwrap();
    let addr = api.addr().to_string();
    let body = r#"{"block_hashes": [1], "request_id": "dup"}"#;
    assert_eq!(http(&addr, "POST", "/v1/route", body, &[]).0, 200);
    assert_eq!(http(&addr, "POST", "/v1/route", body, &[]).0, 409);
    assert_eq!(metric(&addr, "kvrouter_router_client_errors_total"), 1.0);
    api.stop();
    ingest.stop();
}

/// Removals, clears and rejected stores from worker ids never seen create no worker:
/// nothing routable with zero blocks, nothing listed, each counted.
/// An ingest of two shard cores reading `server`.
fn two_shard_ingest(server: &NatsServer) -> Ingest {
    Ingest::start(IngestConfig {
        nats: Some(nats_opts(&server.url())),
        shards: 2,
        ..IngestConfig::default()
    })
    .unwrap()
}

#[test]
fn events_that_leave_an_unknown_worker_empty_create_no_worker() {
    let server = NatsServer::start();
    let ingest = two_shard_ingest(&server);
    let api = api(&ingest);
    let addr = api.addr().to_string();
    let url = server.url();
    let phantoms = 200u64;
    std::thread::spawn(move || {
        on_glommio(move || async move {
            let client = Client::connect(nats_opts(&url)).await.unwrap();
            let real = KvPublisher::start(client.clone(), PublisherOptions::new(1))
                .await
                .unwrap();
            let b = vec![(LocalBlockHash(10), SequenceBlockHash(10))];
            real.stored(0, None, b).await.unwrap();
            for id in 0..phantoms {
                let p = KvPublisher::start(
                    client.clone(),
                    PublisherOptions {
                        announce: false,
                        ..PublisherOptions::new(1000 + id)
                    },
                )
                .await
                .unwrap();
                match id % 3 {
                    0 => p.removed(0, vec![SequenceBlockHash(5)]).await.unwrap(),
                    1 => p.cleared(0).await.unwrap(),
                    // A store under a parent it never stored: rejected.
                    _ => {
                        let b = vec![(LocalBlockHash(7), SequenceBlockHash(7))];
                        p.stored(0, Some(SequenceBlockHash(99)), b).await.unwrap()
                    }
                };
            }
            client.flush(Duration::from_secs(5)).await.unwrap();
        })
    })
    .join()
    .unwrap();
    wait_until(
        "every phantom event counted",
        Duration::from_secs(10),
        || metric(&addr, "kvrouter_ingest_unknown_worker_events_total") == phantoms as f64,
    );
    wait_until("the real worker listed", Duration::from_secs(10), || {
        listed(&addr) == [1]
    });
    assert_eq!(ingest.workers().len(), 1);
    for i in 0..10 {
        let body = format!(r#"{{"block_hashes": [{i}], "request_id": "r{i}"}}"#);
        let (status, v) = json(http(&addr, "POST", "/v1/route", &body, &[]));
        assert_eq!((status, v["worker_id"].as_u64()), (200, Some(1)), "{v}");
    }
    api.stop();
    ingest.stop();
}

/// 30,000 workers, each with one cached block: `GET /v1/workers` lists every one with its
/// block (the listing is one pass over the ingest's summaries, not a search per worker),
/// and routes answered between listings stay correct. The listing's time is printed
/// (`--nocapture`); docs/BENCHMARKS.md has the release build's figure.
#[test]
fn thirty_thousand_workers_are_listed_in_one_pass() {
    use kvrouter_core::codec::{Subjects, kv};
    use kvrouter_core::event::{KvCacheEvent, RouterEvent};
    const N: u64 = 30_000;
    let server = NatsServer::start();
    let ingest = two_shard_ingest(&server);
    let api = api(&ingest);
    let addr = api.addr().to_string();
    let url = server.url();
    std::thread::spawn(move || {
        on_glommio(move || async move {
            let client = Client::connect(nats_opts(&url)).await.unwrap();
            let subject = Subjects::default().kv_events();
            for id in 1..=N {
                let block = (LocalBlockHash(id), SequenceBlockHash(id));
                let e = RouterEvent::new(id, KvCacheEvent::stored(0, 0, None, [block]));
                let msg = kv::encode_message(id, 0, 0, &[e]).unwrap();
                client.publish(&subject, &msg).await.unwrap();
            }
            client.flush(Duration::from_secs(10)).await.unwrap();
        })
    })
    .join()
    .unwrap();
    wait_until("every worker indexed", Duration::from_secs(60), || {
        ingest.workers().len() == N as usize
    });
    let mut times = Vec::new();
    for round in 0..3u64 {
        let started = std::time::Instant::now();
        let (status, v) = json(http(&addr, "GET", "/v1/workers", "", &[]));
        times.push(started.elapsed());
        assert_eq!(status, 200);
        let rows = v["workers"].as_array().expect("rows");
        assert_eq!(rows.len(), N as usize);
        assert!(
            rows.iter().all(|w| w["cached_blocks"].as_u64() == Some(1)),
            "a worker without its block"
        );
        // A route for one worker's block picks that worker.
        let id = 1 + round * 9_999;
        let body = format!(r#"{{"block_hashes": [{id}], "request_id": "big{round}"}}"#);
        let (status, v) = json(http(&addr, "POST", "/v1/route", &body, &[]));
        assert_eq!((status, v["worker_id"].as_u64()), (200, Some(id)), "{v}");
    }
    eprintln!("GET /v1/workers with {N} workers: {times:?}");
    api.stop();
    ingest.stop();
}
