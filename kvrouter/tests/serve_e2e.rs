//! `kvrouter serve` end to end: three router processes on one nats-server ingest events that
//! workers publish through the worker library; `/v1/route` picks the worker holding the
//! prompt; first_token / free move the loads; the replicas converge on loads through
//! replica sync; bad input gets 4xx answers. In JetStream durable mode, a router killed
//! with -9 mid-ingest and restarted from its periodic snapshot ends equal to a replica that
//! never stopped. Host-tier blocks from vLLM-wire engines (pyzmq) show in `/v1/overlaps`
//! and earn their credit in `/v1/route`, as `--host-cache-hit-weight` sets it.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvrouter_core::hash::{
    HashOptions, LocalBlockHash, SequenceBlockHash, local_block_hashes, sequence_hashes,
};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use kvrouter_core::index::{Index, ReferenceIndex};
use kvrouter_io::nats::{Client, Options};
use kvrouter_io::snapshot::MappedSnapshot;
use kvrouter_io::worker::{KvPublisher, PublisherOptions};
use kvrouter_tests::fleet::{
    Publishing, expected_last_ids, publish_with, reference_of, sample, shift,
};
use kvrouter_tests::{NatsServer, http, http_bytes, on_glommio};
use serde_json::Value;

struct Router {
    child: Child,
    addr: String,
}

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn router(nats: &str, extra: &[&str]) -> Router {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args([
            "serve",
            "--nats",
            nats,
            "--listen",
            "127.0.0.1:0",
            "--block-size",
            "16",
        ])
        .args(extra)
        .env("KVROUTER_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("kvrouter serve starts");
    let stdout = child.stdout.take().expect("stdout");
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).expect("banner");
    let addr = line
        .trim()
        .rsplit("http://")
        .next()
        .expect("address")
        .to_owned();
    Router { child, addr }
}

fn json(r: (u16, String)) -> (u16, Value) {
    (r.0, serde_json::from_str(&r.1).unwrap_or(Value::Null))
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(25));
    }
}

fn worker_row(addr: &str, worker: u64) -> Option<Value> {
    let (_, v) = json(http(addr, "GET", "/v1/workers", "", &[]));
    v["workers"]
        .as_array()?
        .iter()
        .find(|w| w["worker_id"].as_u64() == Some(worker))
        .cloned()
}

const A: u64 = 15_655_423_716_543_156_698; // above 2^53, like Dynamo's ids
const B: u64 = 77;

#[test]
fn three_replicas_route_track_loads_and_converge() {
    let server = NatsServer::start();
    let url = server.url();
    let replicas = [
        router(&url, &[]),
        router(&url, &[]),
        router(
            &url,
            &["--auth-token", "sekret", "--max-body-bytes", "4096"],
        ),
    ];
    for r in &replicas {
        wait_until("healthz", || {
            http(&r.addr, "GET", "/healthz", "", &[]).0 == 200
        });
    }

    // Worker A caches a 256-token prompt (16 blocks of 16 tokens); worker B another one.
    let prompt_a: Vec<u32> = (0..256).collect();
    let prompt_b: Vec<u32> = (1000..1256).collect();
    let la = local_block_hashes(&prompt_a, 16, &HashOptions::default());
    let lb = local_block_hashes(&prompt_b, 16, &HashOptions::default());
    let chain = |l: &[LocalBlockHash]| -> Vec<(LocalBlockHash, SequenceBlockHash)> {
        l.iter().copied().zip(sequence_hashes(l)).collect()
    };
    let (ca, cb) = (chain(&la), chain(&lb));
    let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
    let nats = url.clone();
    let workers = std::thread::spawn(move || {
        on_glommio(move || async move {
            let client = Client::connect(Options {
                servers: vec![nats],
                ..Default::default()
            })
            .await
            .unwrap();
            for (worker, chain) in [(A, ca), (B, cb)] {
                let opts = PublisherOptions {
                    heartbeat: Duration::from_millis(200),
                    ..PublisherOptions::new(worker)
                };
                let p = KvPublisher::start(client.clone(), opts).await.unwrap();
                // Its heartbeat and recovery tasks hold their own handles and keep running.
                p.stored(0, None, chain).await.unwrap();
            }
            client.flush(Duration::from_secs(5)).await.unwrap();
            while stop_rx.try_recv().is_err() {
                glommio::timer::sleep(Duration::from_millis(20)).await;
            }
        })
    });
    for r in &replicas {
        wait_until("both workers ingested", || {
            [A, B].iter().all(|&w| {
                worker_row(&r.addr, w).is_some_and(|row| row["last_event_id"].as_u64() == Some(0))
            })
        });
    }
    // Exact u64 worker ids in JSON.
    let row = worker_row(&replicas[0].addr, A).unwrap();
    assert!(row.to_string().contains("15655423716543156698"));
    assert_eq!(row["cached_blocks"], 16);

    // Overlaps: positive counts only, with dp_rank.
    let query = format!("{{\"token_ids\": {:?}}}", &prompt_a[..200]);
    let (status, v) = json(http(&replicas[0].addr, "POST", "/v1/overlaps", &query, &[]));
    assert_eq!(status, 200);
    assert_eq!(
        v["overlaps"],
        serde_json::json!([{"worker_id": A, "dp_rank": 0, "blocks": 12}])
    );

    // The binary framing: the same query as little-endian hashes.
    let raw = |body: &[u8]| {
        let ct = ("Content-Type", "application/x-kvrouter-block-hashes");
        json(http_bytes(
            &replicas[0].addr,
            "POST",
            "/v1/overlaps",
            body,
            &[ct],
        ))
    };
    let binary: Vec<u8> = la[..12].iter().flat_map(|h| h.0.to_le_bytes()).collect();
    let (status, v) = raw(&binary);
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        v["overlaps"],
        serde_json::json!([{"worker_id": A, "dp_rank": 0, "blocks": 12}])
    );
    assert_eq!(raw(&binary[..13]).0, 400, "not a whole number of hashes");

    // Route: the worker holding the prompt wins.
    let body = format!(
        "{{\"token_ids\": {:?}, \"request_id\": \"req-1\", \"explain\": true}}",
        &prompt_a[..200]
    );
    let (status, v) = json(http(&replicas[0].addr, "POST", "/v1/route", &body, &[]));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["worker_id"].as_u64(), Some(A));
    assert_eq!(v["overlap_blocks"], 12);
    assert_eq!(v["request_id"], "req-1");
    assert_eq!(v["candidates"].as_array().unwrap().len(), 2);

    // The replicas learn the load of req-1.
    for r in &replicas {
        wait_until("the active request replicated", || {
            worker_row(&r.addr, A).is_some_and(|w| w["active_requests"] == 1)
        });
    }
    let prefill = worker_row(&replicas[1].addr, A).unwrap()["active_prefill_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(prefill, 200 - 12 * 16);
    // First token, through replica 2: prefill released everywhere.
    assert_eq!(
        http(
            &replicas[1].addr,
            "POST",
            "/v1/requests/req-1/first_token",
            "",
            &[]
        )
        .0,
        200
    );
    for r in &replicas {
        wait_until("prefill released", || {
            worker_row(&r.addr, A).is_some_and(|w| w["active_prefill_tokens"] == 0)
        });
    }
    // Free, through replica 3 (which wants its bearer token).
    assert_eq!(
        http(
            &replicas[2].addr,
            "POST",
            "/v1/requests/req-1/free",
            "",
            &[]
        )
        .0,
        401
    );
    assert_eq!(
        http(
            &replicas[2].addr,
            "POST",
            "/v1/requests/req-1/free",
            "",
            &[("Authorization", "Bearer sekret")]
        )
        .0,
        200
    );
    for r in &replicas {
        wait_until("request freed", || {
            worker_row(&r.addr, A).is_some_and(|w| w["active_requests"] == 0)
        });
    }

    // Load moves decisions. A burst of one fresh prompt stays where it is in flight (the
    // in-flight credit: those blocks will be cached there by the time each prefill reaches
    // them) until the prefill queued there outweighs recomputing it elsewhere, then
    // spreads: both workers get some of it.
    let fresh =
        "{\"token_ids\": [9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9]}";
    // (2 blocks a request: the 6th in flight on one worker queues as much as a recompute
    // of 2 blocks costs at `new_block_weight` 4 and `prefill_load_scale` 32.)
    let mut to_a = 0;
    for _ in 0..12 {
        let (_, v) = json(http(&replicas[0].addr, "POST", "/v1/route", fresh, &[]));
        if v["worker_id"].as_u64() == Some(A) {
            to_a += 1;
        }
    }
    assert!(
        (1..=11).contains(&to_a),
        "a burst of one prompt spreads once its queue outweighs a recompute: {to_a}/12 to A"
    );

    // Bad input.
    let r0 = &replicas[0].addr;
    assert_eq!(http(r0, "POST", "/v1/route", "{not json", &[]).0, 400);
    assert_eq!(
        http(
            r0,
            "POST",
            "/v1/route",
            "{\"token_ids\": [1], \"block_hashes\": [1]}",
            &[]
        )
        .0,
        400
    );
    assert_eq!(
        http(r0, "POST", "/v1/route", "{\"token_ids\": [-1]}", &[]).0,
        400
    );
    assert_eq!(http(r0, "POST", "/v1/requests/nope/free", "", &[]).0, 404);
    assert_eq!(http(r0, "GET", "/v1/nothing", "", &[]).0, 404);
    assert_eq!(http(r0, "GET", "/v1/route", "", &[]).0, 405);
    let big = format!("{{\"token_ids\": {:?}}}", vec![1u32; 5000]);
    assert_eq!(
        http(&replicas[2].addr, "POST", "/v1/overlaps", &big, &[]).0,
        413
    );
    // Block hashes as decimal strings (ids above 2^53).
    let (status, v) = json(http(
        r0,
        "POST",
        "/v1/overlaps",
        &format!("{{\"block_hashes\": [\"{}\"]}}", la[0].0),
        &[],
    ));
    assert_eq!(
        (status, v["overlaps"][0]["blocks"].as_u64()),
        (200, Some(1))
    );
    let (status, metrics) = http(r0, "GET", "/metrics", "", &[]);
    assert_eq!(status, 200);
    assert!(
        metrics.contains("kvrouter_router_routes_total 13")
            && metrics.contains("kvrouter_ingest_events_total"),
        "{metrics}"
    );

    stop_tx.send(()).unwrap();
    workers.join().unwrap();
}

fn snapshot_index(path: &std::path::Path) -> ReferenceIndex {
    let m = MappedSnapshot::open(path).expect("snapshot file");
    let mut idx = ReferenceIndex::new();
    for e in m.view().expect("valid snapshot").events() {
        idx.apply(e).expect("applies");
    }
    idx
}

fn sigterm_and_wait(r: &mut Router) {
    let status = Command::new("kill")
        .args(["-TERM", &r.child.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success());
    let start = Instant::now();
    loop {
        if let Some(code) = r.child.try_wait().expect("wait") {
            assert!(code.success(), "clean exit on SIGTERM: {code}");
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "no exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn kill_9_mid_ingest_then_restart_equals_a_replica_that_never_stopped() {
    let server = NatsServer::start();
    let url = server.url();
    let base = std::env::temp_dir().join(format!("kvrouter-kill9-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let args = |name: &str| -> Vec<String> {
        [
            "--durable-kv-events",
            "true",
            "--stream-name",
            "kvtest",
            "--consumer-name",
            name,
            "--snapshot-interval-secs",
            "1",
            "--replica-sync",
            "false",
            "--snapshot-dir",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([base.join(name).display().to_string()])
        .collect()
    };
    let start = |name: &str| {
        let a = args(name);
        let r = router(&url, &a.iter().map(String::as_str).collect::<Vec<_>>());
        wait_until("healthz", || {
            http(&r.addr, "GET", "/healthz", "", &[]).0 == 200
        });
        r
    };
    let mut steady = start("steady");
    let mut crashy = start("crashy");

    let (events, _) = sample();
    let events = shift(&events);
    let progress = Arc::new(AtomicUsize::new(0));
    // Workers without a local indexer: only the stream can bring back what the crashed
    // router missed.
    let fleet = publish_with(
        url.clone(),
        events.clone(),
        Publishing {
            durable: true,
            pace: Some(Duration::from_millis(3)),
            progress: Some(Arc::clone(&progress)),
            ..Publishing::default()
        },
    );
    let crash_snapshot = base.join("crashy").join("kvrouter.snap");
    wait_until("a periodic snapshot mid-ingest", || {
        crash_snapshot.exists() && progress.load(Ordering::Relaxed) > events.len() / 3
    });
    assert!(
        progress.load(Ordering::Relaxed) < events.len(),
        "still ingesting"
    );
    // kill -9, keep publishing, restart from the periodic snapshot.
    let _ = crashy.child.kill();
    let _ = crashy.child.wait();
    std::thread::sleep(Duration::from_millis(200));
    let mut crashy = start("crashy");
    let (_, metrics) = http(&crashy.addr, "GET", "/metrics", "", &[]);
    let restored: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("kvrouter_ingest_snapshot_restored_blocks_total "))
        .and_then(|v| v.trim().parse().ok())
        .expect("the restored-blocks counter is exported");
    assert!(restored > 0, "restarted from the snapshot: {metrics}");

    let last = expected_last_ids(&events);
    for r in [&steady, &crashy] {
        wait_until("every event applied", || {
            last.iter().all(|(&w, &id)| {
                worker_row(&r.addr, w).is_some_and(|row| row["last_event_id"].as_u64() == Some(id))
            })
        });
    }
    fleet.stop();
    // Stop both cleanly: each writes its final snapshot; compare the dumps.
    sigterm_and_wait(&mut steady);
    sigterm_and_wait(&mut crashy);
    let a = snapshot_index(&base.join("steady").join("kvrouter.snap"));
    let b = snapshot_index(&crash_snapshot);
    assert_eq!(
        b.dump(),
        a.dump(),
        "the restarted replica equals the steady one"
    );
    assert_eq!(b.workers(), a.workers());
    assert_eq!(
        a.dump(),
        reference_of(&events).dump(),
        "both equal the truth"
    );

    // The snapshot tools.
    let bin = env!("CARGO_BIN_EXE_kvrouter");
    let out = Command::new(bin)
        .args(["snapshot", "verify"])
        .arg(&crash_snapshot)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("ok: "));
    let out = Command::new(bin)
        .args(["snapshot", "inspect"])
        .arg(&crash_snapshot)
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).expect("inspect prints JSON");
    assert_eq!(v["meta"]["stream"]["stream"], "kvtest");
    assert!(v["meta"]["stream"]["seq"].as_u64().unwrap() >= events.len() as u64);
    assert_eq!(v["blocks"].as_u64().unwrap() as usize, a.block_count());
    let mut bytes = std::fs::read(&crash_snapshot).unwrap();
    let n = bytes.len();
    bytes[n - 3] ^= 1;
    let broken = base.join("broken.snap");
    std::fs::write(&broken, &bytes).unwrap();
    let out = Command::new(bin)
        .args(["snapshot", "verify"])
        .arg(&broken)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("checksum"));
    let _ = std::fs::remove_dir_all(&base);
}

/// With the broker down at start, the router still serves: `/healthz` says 503, routing
/// answers from the static workers; once the broker is up, it connects and is healthy.
#[test]
fn serves_before_nats_is_reachable() {
    let mut server = NatsServer::start();
    server.kill();
    let started = Instant::now();
    let r = router(&server.url(), &["--workers", "1,2"]);
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
    let (status, body) = http(&r.addr, "GET", "/healthz", "", &[]);
    assert_eq!(status, 503, "{body}");
    let (status, v) = json(http(
        &r.addr,
        "POST",
        "/v1/route",
        r#"{"block_hashes": [1]}"#,
        &[],
    ));
    assert_eq!(status, 200, "{v}");
    server.restart();
    wait_until("healthy once NATS is up", || {
        http(&r.addr, "GET", "/healthz", "", &[]).0 == 200
    });
}

/// A `/metrics` counter's value.
fn counter(addr: &str, name: &str) -> u64 {
    let (_, text) = http(addr, "GET", "/metrics", "", &[]);
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn host_tier_blocks_from_vllm_engines_reach_overlaps_and_win_routes() {
    use kvrouter_io::ingest::ZmqEngine;
    use kvrouter_io::zmq::Endpoint;
    use kvrouter_tests::engine::PyEngine;

    // A weight out of Dynamo's range is refused at start.
    let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args(["serve", "--nats", "off", "--host-cache-hit-weight", "1.5"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("host_cache_hit_weight"));

    // Engine 1 has 2 blocks of the prompt on its GPU and all 8 offloaded to CPU memory;
    // engine 2 has 4 on its GPU. Dynamo's weights: 2 + 0.75 × 6 = 6.5 blocks of credit
    // beat 4; with the host credit off, 2 lose to 4.
    let (p1, p2) = (kvrouter_tests::free_port(), kvrouter_tests::free_port());
    let spec = |name: &str, port: u16| format!("{name}=tcp://127.0.0.1:{port}");
    let id = |name: &str, port: u16| {
        let ep = Endpoint::parse(&format!("tcp://127.0.0.1:{port}")).unwrap();
        ZmqEngine::new(name, ep, 16).worker_id
    };
    let (w1, w2) = (id("tier1", p1), id("tier2", p2));
    let engines = [
        "--zmq-engine",
        &spec("tier1", p1),
        "--zmq-engine",
        &spec("tier2", p2),
    ];
    let with_host = router("off", &engines);
    let mut no_host_args = engines.to_vec();
    no_host_args.extend(["--host-cache-hit-weight", "0"]);
    let no_host = router("off", &no_host_args);
    let mut e1 = PyEngine::start(&["--pub", &format!("tcp://*:{p1}")]);
    let mut e2 = PyEngine::start(&["--pub", &format!("tcp://*:{p2}")]);
    for r in [&with_host, &no_host] {
        wait_until("both engines connected", || {
            counter(&r.addr, "kvrouter_ingest_zmq_connects_total") >= 2
        });
    }
    let prompt: Vec<u32> = (5000..5128).collect();
    let stored = |medium: &str, blocks: u64, base: u64| {
        serde_json::json!({"type": "BlockStored",
            "block_hashes": (0..blocks).map(|i| base + i).collect::<Vec<u64>>(),
            "parent_block_hash": null, "token_ids": &prompt[..16 * blocks as usize],
            "block_size": 16, "lora_id": null, "medium": medium, "lora_name": null})
    };
    e1.send(&serde_json::json!({"op": "batch", "dp_rank": 0,
        "events": [stored("GPU", 2, 100), stored("CPU", 8, 100)]}));
    e2.send(&serde_json::json!({"op": "batch", "dp_rank": 0, "events": [stored("GPU", 4, 200)]}));
    let expected = serde_json::json!([
        {"worker_id": w1, "dp_rank": 0, "blocks": 2, "host_blocks": 6},
        {"worker_id": w2, "dp_rank": 0, "blocks": 4},
    ]);
    let query = format!("{{\"token_ids\": {prompt:?}}}");
    let sorted = |v: &Value| {
        let mut a = v["overlaps"].as_array().cloned().unwrap_or_default();
        a.sort_by_key(|e| e["worker_id"].as_u64());
        let mut b = expected.as_array().unwrap().clone();
        b.sort_by_key(|e| e["worker_id"].as_u64());
        a == b
    };
    for r in [&with_host, &no_host] {
        wait_until("the tiers ingested", || {
            let (_, v) = json(http(&r.addr, "POST", "/v1/overlaps", &query, &[]));
            sorted(&v)
        });
        assert_eq!(counter(&r.addr, "kvrouter_index_lower_tier_blocks"), 8);
    }
    let route = |r: &Router, id: &str| {
        let body =
            format!("{{\"token_ids\": {prompt:?}, \"request_id\": \"{id}\", \"explain\": true}}");
        let (status, v) = json(http(&r.addr, "POST", "/v1/route", &body, &[]));
        assert_eq!(status, 200, "{v}");
        v
    };
    let v = route(&with_host, "tiered-1");
    assert_eq!(v["worker_id"].as_u64(), Some(w1), "{v}");
    let c1 = v["candidates"]
        .as_array()
        .and_then(|cs| {
            cs.iter()
                .find(|c| c["worker"]["worker_id"].as_u64() == Some(w1))
        })
        .unwrap_or_else(|| panic!("{v}"))
        .clone();
    assert_eq!(c1["host_overlap_blocks"], 6, "{c1}");
    assert_eq!(c1["credits"]["host"], 4.5, "{c1}");
    assert_eq!(c1["credits"]["device"], 2.0, "{c1}");
    assert_eq!(c1["overlap_credit_blocks"], 6.5, "{c1}");
    let v = route(&no_host, "tiered-2");
    assert_eq!(v["worker_id"].as_u64(), Some(w2), "{v}");
    e1.finish();
    e2.finish();
}

/// Worker `w`'s entry in an explained route's `candidates`.
fn candidate_of(v: &Value, w: u64) -> Value {
    v["candidates"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["worker"]["worker_id"] == w))
        .unwrap_or_else(|| panic!("{v}"))
        .clone()
}

#[test]
fn a_shared_pool_from_cache_owner_events_reaches_overlaps_and_its_credit() {
    use kvrouter_core::event::{KvCacheEvent, ResidencyDomain, RouterEvent};
    use kvrouter_core::worker::StorageTier;

    // Worker 11 holds the prompt's first 2 blocks on its GPU, worker 12 none of them. A shared pool
    // (source 99, residency `cache_owner`, as Dynamo 1.6.1's wire names it) holds all 8 but
    // block 5: past worker 11's device prefix it holds 5 of the 6, past worker 12's all 7.
    let server = NatsServer::start();
    let r = router(&server.url(), &["--shared-cache-multiplier", "0.5"]);
    // A second router is told that only worker 12 reads source 99's pool. It shares no
    // decisions with the first (whose request would otherwise weigh on worker 11 here).
    let scoped = router(
        &server.url(),
        &[
            "--shared-cache-multiplier",
            "0.5",
            "--pool-readers",
            "99=12",
            "--replica-sync",
            "false",
        ],
    );
    let prompt: Vec<u32> = (7000..7128).collect();
    let l = local_block_hashes(&prompt, 16, &HashOptions::default());
    let chain: Vec<(LocalBlockHash, SequenceBlockHash)> =
        l.iter().copied().zip(sequence_hashes(&l)).collect();
    let pool = |id: u64, data: KvCacheEvent| {
        let mut e = RouterEvent::new(99, data);
        e.event.event_id = id;
        e.residency_domain = Some(ResidencyDomain::CacheOwner);
        e.storage_tier = StorageTier::External;
        e
    };
    let events = [
        RouterEvent::new(11, KvCacheEvent::stored(1, 0, None, chain[..2].to_vec())),
        // Worker 12 holds one unrelated block (a worker is known by what it holds).
        RouterEvent::new(
            12,
            KvCacheEvent::stored(1, 0, None, [(LocalBlockHash(3), SequenceBlockHash(3))]),
        ),
        pool(1, KvCacheEvent::stored(1, 0, None, chain.clone())),
        pool(2, KvCacheEvent::removed(2, 0, [chain[5].1])),
    ];
    kvrouter_tests::fleet::publish_encoded(&server.url(), 7, events.to_vec());
    let query = format!("{{\"token_ids\": {prompt:?}}}");
    wait_until("the pool ingested", || {
        let (_, v) = json(http(&r.addr, "POST", "/v1/overlaps", &query, &[]));
        v["shared_blocks"] == 7
    });
    let (_, v) = json(http(&r.addr, "POST", "/v1/overlaps", &query, &[]));
    assert_eq!(
        v["overlaps"],
        serde_json::json!([{"worker_id": 11, "dp_rank": 0, "blocks": 2, "shared_blocks": 5}]),
        "{v}"
    );
    assert_eq!(counter(&r.addr, "kvrouter_ingest_pool_events_total"), 2);
    // The pool's publisher is no worker: not listed, never routed to.
    let (_, workers) = json(http(&r.addr, "GET", "/v1/workers", "", &[]));
    assert!(
        !workers.to_string().contains("\"worker_id\":99"),
        "{workers}"
    );
    let body = format!("{{\"token_ids\": {prompt:?}, \"request_id\": \"p1\", \"explain\": true}}");
    let (status, v) = json(http(&r.addr, "POST", "/v1/route", &body, &[]));
    assert_eq!(status, 200, "{v}");
    // Worker 11: 2 device blocks + 0.5 × 5 = 4.5 of credit; worker 12: 0.5 × 7 = 3.5.
    assert_eq!(v["worker_id"], 11, "{v}");
    let credit = |w: u64| {
        let c = candidate_of(&v, w);
        (
            c["shared_beyond_blocks"].as_u64(),
            c["credits"]["shared"].as_f64(),
            c["overlap_credit_blocks"].as_f64(),
        )
    };
    assert_eq!(credit(11), (Some(5), Some(2.5), Some(4.5)), "{v}");
    assert_eq!(credit(12), (Some(7), Some(3.5), Some(3.5)), "{v}");

    // With the rule, worker 11 gets no pool credit and worker 12 all 7 blocks: it is listed
    // for them, and the top-level figure (pools every worker reads) is gone.
    let want = serde_json::json!([
        {"worker_id": 11, "dp_rank": 0, "blocks": 2},
        {"worker_id": 12, "dp_rank": 0, "blocks": 0, "shared_blocks": 7},
    ]);
    wait_until("the scoped router ingested", || {
        let (_, v) = json(http(&scoped.addr, "POST", "/v1/overlaps", &query, &[]));
        v["overlaps"] == want
    });
    let (_, v) = json(http(&scoped.addr, "POST", "/v1/overlaps", &query, &[]));
    assert_eq!(v.get("shared_blocks"), None, "{v}");
    let (status, v) = json(http(&scoped.addr, "POST", "/v1/route", &body, &[]));
    assert_eq!(status, 200, "{v}");
    // Worker 11: 2 device blocks; worker 12: 0.5 × 7 = 3.5.
    assert_eq!(v["worker_id"], 12, "{v}");
    let credit = |w: u64| {
        let c = candidate_of(&v, w);
        (
            c["shared_beyond_blocks"].as_u64(),
            c["overlap_credit_blocks"].as_f64(),
        )
    };
    assert_eq!(credit(11), (Some(0), Some(2.0)), "{v}");
    assert_eq!(credit(12), (Some(7), Some(3.5)), "{v}");
}

/// A supervisor that closes the router's stdout before the banner is written must not
/// take the router down (a failed `println!` panics): it serves on a known port.
#[test]
fn a_closed_stdout_does_not_stop_the_router() {
    let port = kvrouter_tests::free_port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args(["serve", "--nats", "off", "--workers", "1"])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .env("KVROUTER_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("kvrouter serve starts");
    drop(child.stdout.take());
    let addr = format!("127.0.0.1:{port}");
    wait_until("the API", || {
        std::net::TcpStream::connect(&addr).is_ok()
            && http(&addr, "GET", "/healthz", "", &[]).0 == 200
    });
    std::thread::sleep(Duration::from_millis(300));
    assert!(child.try_wait().unwrap().is_none(), "the router exited");
    assert_eq!(http(&addr, "GET", "/healthz", "", &[]).0, 200);
    let _ = child.kill();
    let _ = child.wait();
}

/// A parent that runs the router as its child (`kvrouter bench --nats`) passes
/// `--stop-on-stdin-eof` and holds the pipe: when the parent ends, however it ends, the pipe
/// closes and the router stops as on SIGTERM, cleanly.
#[test]
fn a_router_child_stops_when_its_parents_pipe_closes() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args([
            "serve",
            "--nats",
            "off",
            "--listen",
            "127.0.0.1:0",
            "--stop-on-stdin-eof",
        ])
        .env("KVROUTER_LOG", "warn")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("kvrouter serve starts");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("banner");
    assert!(line.contains("http://"), "{line}");
    // Still serving while the pipe is open.
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        child.try_wait().unwrap().is_none(),
        "stopped with the pipe open"
    );
    drop(child.stdin.take());
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "no exit after the pipe closed"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "clean stop: {status}");
}
