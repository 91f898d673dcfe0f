//! The routing API's edges, as a hostile client sees them: request limits (413, 429, 400
//! with their counters), strict HTTP/1.1 framing, header and body deadlines that a
//! trickling client cannot renew, the connection cap, and request ids that round-trip
//! through percent-encoded paths. A real `kvrouter-io` router in this process (approximate
//! mode, static workers, no NATS), raw TCP clients.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kvrouter_core::decision::Limits;
use kvrouter_core::worker::WorkerDp;
use kvrouter_io::http::HttpConfig;
use kvrouter_io::router::{self, BINARY_HASHES, RouterConfig};
use kvrouter_tests::{http, http_bytes, metric};

fn api(http: HttpConfig, limits: Limits) -> router::RouterHandle {
    router::start(
        RouterConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            replica_sync: false,
            kv_events: false,
            block_size: 16,
            static_workers: vec![WorkerDp::new(1, 0), WorkerDp::new(2, 0)],
            http,
            limits,
            ..RouterConfig::default()
        },
        None,
        None,
        512 << 10,
    )
    .expect("the routing API starts")
}

/// Sends `wire` on a fresh connection and reads everything until the server closes it.
fn raw(addr: &str, wire: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(wire).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

fn statuses(resp: &str) -> Vec<u16> {
    resp.match_indices("HTTP/1.1 ")
        .filter_map(|(i, _)| resp[i + 9..i + 12].parse().ok())
        .collect()
}

#[test]
fn limits_refuse_with_413_429_and_400_and_count() {
    let api = api(
        HttpConfig::default(),
        Limits {
            max_blocks: 1000,
            max_active_requests: 3,
            max_active_per_worker: 2,
            max_request_id_bytes: 16,
            max_active_blocks: u64::MAX,
        },
    );
    let addr = api.addr().to_string();
    let hashes = |n: u64| -> Vec<u8> { (1..=n).flat_map(|h| h.to_le_bytes()).collect() };
    let binary = [("Content-Type", BINARY_HASHES)];
    // Too many blocks, binary or JSON tokens (checked before hashing).
    assert_eq!(
        http_bytes(&addr, "POST", "/v1/route", &hashes(1001), &binary).0,
        413
    );
    let tokens: Vec<u32> = (0..16 * 1001).collect();
    let body = serde_json::json!({ "token_ids": tokens }).to_string();
    let (status, text) = http(&addr, "POST", "/v1/route", &body, &[]);
    assert_eq!(status, 413, "{text}");
    assert!(text.contains("1001 blocks"), "{text}");
    assert_eq!(http(&addr, "POST", "/v1/overlaps", &body, &[]).0, 413);
    assert_eq!(
        http_bytes(&addr, "POST", "/v1/route", &hashes(1000), &binary).0,
        200
    );
    // Ids: too long, control characters.
    for id in ["x".repeat(17), "a\u{1}b".into()] {
        let body = serde_json::json!({ "block_hashes": [1], "request_id": id }).to_string();
        assert_eq!(http(&addr, "POST", "/v1/route", &body, &[]).0, 400);
    }
    // Two more fill the total of three; the fourth waits for a free.
    for id in ["a", "b"] {
        let body = serde_json::json!({ "block_hashes": [1], "request_id": id }).to_string();
        assert_eq!(http(&addr, "POST", "/v1/route", &body, &[]).0, 200);
    }
    let busy = serde_json::json!({ "block_hashes": [1], "request_id": "c" }).to_string();
    let mut s = TcpStream::connect(&addr).unwrap();
    write!(
        s,
        "POST /v1/route HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{busy}",
        busy.len()
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    assert!(resp.starts_with("HTTP/1.1 429 "), "{resp}");
    assert!(resp.contains("\r\nRetry-After: 1\r\n"), "{resp}");
    assert_eq!(http(&addr, "POST", "/v1/requests/a/free", "", &[]).0, 200);
    assert_eq!(http(&addr, "POST", "/v1/route", &busy, &[]).0, 200);
    assert_eq!(metric(&addr, "kvrouter_router_too_large_total"), 3.0);
    assert_eq!(metric(&addr, "kvrouter_router_overloaded_total"), 1.0);
    assert_eq!(metric(&addr, "kvrouter_router_bad_request_ids_total"), 2.0);
    assert_eq!(metric(&addr, "kvrouter_slots_active_requests"), 3.0);
    api.stop();
}

#[test]
fn request_ids_round_trip_through_encoded_paths() {
    let api = api(HttpConfig::default(), Limits::default());
    let addr = api.addr().to_string();
    for (id, path) in [
        ("a b?/é", "a%20b%3F%2F%C3%A9"),
        ("x#1", "x%231"),
        ("plain", "plain"),
    ] {
        let body = serde_json::json!({ "block_hashes": [1, 2], "request_id": id }).to_string();
        let (status, text) = http(&addr, "POST", "/v1/route", &body, &[]);
        assert_eq!(status, 200, "{text}");
        let first = format!("/v1/requests/{path}/first_token");
        assert_eq!(http(&addr, "POST", &first, "", &[]).0, 200, "{id}");
        let free = format!("/v1/requests/{path}/free");
        assert_eq!(http(&addr, "POST", &free, "", &[]).0, 200, "{id}");
        assert_eq!(http(&addr, "POST", &free, "", &[]).0, 404, "{id}");
    }
    assert_eq!(
        http(&addr, "POST", "/v1/requests/bad%2/free", "", &[]).0,
        400
    );
    assert_eq!(http(&addr, "POST", "/v1/requests/a/b/free", "", &[]).0, 404);
    assert_eq!(metric(&addr, "kvrouter_slots_active_requests"), 0.0);
    api.stop();
}

#[test]
fn framing_is_strict_on_the_wire() {
    let api = api(HttpConfig::default(), Limits::default());
    let addr = api.addr().to_string();
    let ok = "GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n";
    // Two lengths: one answer (400), and the bytes behind are never read as a request.
    let r = raw(
        &addr,
        format!("POST /v1/overlaps HTTP/1.1\r\nHost: t\r\nContent-Length: 17\r\nContent-Length: 0\r\n\r\n{ok}").as_bytes(),
    );
    assert_eq!(statuses(&r), [400], "{r}");
    for (wire, want) in [
        (
            format!("POST /v1/overlaps HTTP/1.1\r\nHost: t\r\nContent-Length: +2\r\n\r\n{{}}{ok}"),
            400,
        ),
        (
            format!("POST /v1/overlaps HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip\r\n\r\n{ok}"),
            501,
        ),
        (
            format!(
                "POST /v1/overlaps HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n{ok}"
            ),
            411,
        ),
        (
            format!(
                "POST /v1/overlaps HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n{{}}{ok}"
            ),
            400,
        ),
        (format!("GET /healthz HTTP/1.1\r\n\r\n{ok}"), 400),
        // One 70 KB header or target, in one write.
        (
            format!(
                "GET /healthz HTTP/1.1\r\nHost: t\r\nX-Big: {}\r\n\r\n",
                "v".repeat(70_000)
            ),
            431,
        ),
        (
            format!("GET /{} HTTP/1.1\r\nHost: t\r\n\r\n", "p".repeat(70_000)),
            414,
        ),
    ] {
        let r = raw(&addr, wire.as_bytes());
        assert_eq!(statuses(&r), [want], "{}", &wire[..wire.len().min(120)]);
    }
    // Pipelined valid requests still get one answer each.
    let r = raw(
        &addr,
        format!("{ok}{ok}GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n").as_bytes(),
    );
    assert_eq!(statuses(&r), [200, 200, 200], "{r}");
    assert_eq!(metric(&addr, "kvrouter_http_rejected_total"), 8.0);
    api.stop();
}

/// Sends `wire` one byte per `every`, and returns when the server answered and closed.
fn trickle(addr: &str, wire: &[u8], every: Duration) -> (String, Duration) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(every)).unwrap();
    let start = Instant::now();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    for &b in wire {
        if s.write_all(&[b]).is_err() {
            break;
        }
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(_) => {}
        }
        if !out.is_empty() {
            break;
        }
    }
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = s.read_to_end(&mut out);
    (String::from_utf8_lossy(&out).into_owned(), start.elapsed())
}

#[test]
fn trickling_clients_meet_their_deadlines() {
    let api = api(
        HttpConfig {
            header_timeout: Duration::from_millis(800),
            body_timeout: Duration::from_millis(800),
            idle_timeout: Duration::from_secs(30),
            ..HttpConfig::default()
        },
        Limits::default(),
    );
    let addr = api.addr().to_string();
    let every = Duration::from_millis(100);
    // Headers of 200 bytes at 10 bytes/s would take 20 s: cut at the deadline.
    let head = format!(
        "GET /healthz HTTP/1.1\r\nHost: t\r\nX-Pad: {}\r\n\r\n",
        "p".repeat(150)
    );
    let (r, took) = trickle(&addr, head.as_bytes(), every);
    assert_eq!(statuses(&r), [408], "{r}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    // A body trickled the same way.
    let body = "x".repeat(200);
    let wire = format!(
        "POST /v1/overlaps HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let mut s = TcpStream::connect(&addr).unwrap();
    s.write_all(wire.as_bytes()).unwrap();
    let (r, took) = {
        let start = Instant::now();
        let mut out = Vec::new();
        s.set_read_timeout(Some(every)).unwrap();
        for b in body.bytes() {
            if s.write_all(&[b]).is_err() {
                break;
            }
            let mut buf = [0u8; 4096];
            if let Ok(n) = s.read(&mut buf) {
                out.extend_from_slice(&buf[..n]);
                break;
            }
        }
        (String::from_utf8_lossy(&out).into_owned(), start.elapsed())
    };
    assert!(r.starts_with("HTTP/1.1 408 "), "{r}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert_eq!(metric(&addr, "kvrouter_http_read_timeouts_total"), 2.0);
    api.stop();
}

#[test]
fn the_connection_cap_refuses_clearly_and_recovers() {
    let api = api(
        HttpConfig {
            max_connections: 4,
            ..HttpConfig::default()
        },
        Limits::default(),
    );
    let addr = api.addr().to_string();
    let held: Vec<TcpStream> = (0..4).map(|_| TcpStream::connect(&addr).unwrap()).collect();
    // Let the server accept them.
    std::thread::sleep(Duration::from_millis(200));
    let r = raw(&addr, b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n");
    assert!(r.starts_with("HTTP/1.1 503 "), "{r}");
    assert!(r.contains("too many connections"), "{r}");
    drop(held);
    let start = Instant::now();
    loop {
        if statuses(&raw(
            &addr,
            b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
        )) == [200]
        {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "still refused");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(metric(&addr, "kvrouter_http_connections_refused_total") >= 1.0);
    api.stop();
}

#[test]
fn large_bodies_pass_the_bulk_gate_one_at_a_time() {
    let api = api(HttpConfig::default(), Limits::default());
    let addr = api.addr().to_string();
    // Pipelined overlap queries of 16,384 hashes (128 KiB bodies, past the 64 KiB bulk
    // threshold): each shuts the gate for as long as it ran, so those behind it wait,
    // and every one is still answered.
    let body: Vec<u8> = (1..=16_384u64).flat_map(|h| h.to_le_bytes()).collect();
    let mut wire = Vec::new();
    let n = 6;
    for i in 0..n {
        let close = if i == n - 1 {
            "Connection: close\r\n"
        } else {
            ""
        };
        wire.extend_from_slice(
            format!(
                "POST /v1/overlaps HTTP/1.1\r\nHost: t\r\nContent-Type: {BINARY_HASHES}\r\n{close}Content-Length: {}\r\n\r\n",
                body.len()
            )
            .as_bytes(),
        );
        wire.extend_from_slice(&body);
    }
    let resp = raw(&addr, &wire);
    assert_eq!(statuses(&resp), vec![200; n]);
    assert!(metric(&addr, "kvrouter_http_bulk_waits_total") >= 1.0);
    // Small requests never pass it.
    let before = metric(&addr, "kvrouter_http_bulk_waits_total");
    for _ in 0..3 {
        assert_eq!(
            http(
                &addr,
                "POST",
                "/v1/overlaps",
                r#"{"block_hashes":[1,2]}"#,
                &[]
            )
            .0,
            200
        );
    }
    assert_eq!(metric(&addr, "kvrouter_http_bulk_waits_total"), before);
    api.stop();
}
