//! Replica sync under a small broker `max_payload`: a request whose blocks exceed it, in a
//! batch with many small ones, costs the others nothing; the big one reaches the other
//! replica cut to fit (and is freed there), and the counters say so. Real nats-server
//! (`max_payload: 4KB`), two routers in this process.

use std::time::Duration;

use kvrouter_core::worker::WorkerDp;
use kvrouter_io::router::{self, BINARY_HASHES, RouterConfig};
use kvrouter_tests::fleet::{nats_opts, wait_until};
use kvrouter_tests::{NatsServer, http, http_bytes, metric};

fn replica(url: &str, id: u64) -> router::RouterHandle {
    router::start(
        RouterConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            kv_events: false,
            router_id: id,
            nats: nats_opts(url),
            static_workers: vec![WorkerDp::new(1, 0), WorkerDp::new(2, 0)],
            ..RouterConfig::default()
        },
        None,
        None,
        512 << 10,
    )
    .expect("a replica starts")
}

#[test]
fn an_oversized_add_costs_its_batch_nothing_and_arrives_cut() {
    let conf = NatsServer::config_file("max_payload: 4KB\n");
    let server = NatsServer::start_with(&["-c", conf.to_str().unwrap()]);
    let a = replica(&server.url(), 11);
    let b = replica(&server.url(), 22);
    let (a_addr, b_addr) = (a.addr().to_string(), b.addr().to_string());
    // 2,000 blocks: about 18 KB of hashes, four times the broker's limit.
    let big: Vec<u8> = (1..=2000u64).flat_map(|h| h.to_le_bytes()).collect();
    let headers = [("Content-Type", BINARY_HASHES), ("X-Request-Id", "big")];
    assert_eq!(
        http_bytes(&a_addr, "POST", "/v1/route", &big, &headers).0,
        200
    );
    for i in 0..100 {
        let body = format!(r#"{{"block_hashes": [{i}, 7], "request_id": "small-{i}"}}"#);
        assert_eq!(http(&a_addr, "POST", "/v1/route", &body, &[]).0, 200);
    }
    wait_until("B sees every request of A", Duration::from_secs(10), || {
        metric(&b_addr, "kvrouter_slots_active_requests") == 101.0
    });
    assert_eq!(metric(&a_addr, "kvrouter_replica_events_out_total"), 101.0);
    assert_eq!(
        metric(&a_addr, "kvrouter_replica_events_degraded_total"),
        1.0
    );
    assert_eq!(metric(&a_addr, "kvrouter_replica_events_unsent_total"), 0.0);
    // The big one's free finds it on B.
    assert_eq!(
        http(&a_addr, "POST", "/v1/requests/big/free", "", &[]).0,
        200
    );
    wait_until("B frees it", Duration::from_secs(10), || {
        metric(&b_addr, "kvrouter_slots_active_requests") == 100.0
    });
    a.stop();
    b.stop();
}
