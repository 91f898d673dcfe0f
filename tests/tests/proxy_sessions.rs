//! Session affinity across router replicas: two `kvrouter-io` routers in this process, each
//! with its OpenAI front, share a real `nats-server` (replica sync and session sync), in
//! front of two of our mock OpenAI engines (`tests/py/openai_engine.py`). A session bound
//! on one replica stays on its worker when its next requests reach the other, and a
//! rebinding on either (its worker full) moves the session on both.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use kvrouter_core::decision::Limits;
use kvrouter_core::worker::WorkerDp;
use kvrouter_io::proxy::{Backend, ModelSpec, ProxyConfig, Target};
use kvrouter_io::router::{self, RouterConfig, RouterHandle};
use kvrouter_tests::fleet::{nats_opts, wait_until};
use kvrouter_tests::openai::{MockEngine, tiny_card};
use kvrouter_tests::{NatsServer, http_response, metric};

fn replica(nats: &str, id: u64, engines: &[&MockEngine]) -> RouterHandle {
    let list = engines
        .iter()
        .enumerate()
        .map(|(i, e)| (i as u64 + 1, Target::parse(&e.url).expect("url")))
        .collect();
    router::start(
        RouterConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            kv_events: false,
            block_size: 16,
            router_id: id,
            nats: nats_opts(nats),
            static_workers: (1..=engines.len() as u64)
                .map(|w| WorkerDp::new(w, 0))
                .collect(),
            // One request at a time per worker: a worker with a stream open is full.
            limits: Limits {
                max_active_per_worker: 1,
                ..Limits::default()
            },
            proxy: Some(ProxyConfig {
                listen: "127.0.0.1:0".parse().unwrap(),
                models: vec![ModelSpec {
                    name: "tiny".into(),
                    dir: tiny_card(),
                    lora_name: None,
                }],
                backend: Backend::Engines(list),
                tokenizer_threads: 1,
                ..ProxyConfig::default()
            }),
            ..RouterConfig::default()
        },
        None,
        None,
        512 << 10,
    )
    .expect("a replica starts")
}

fn chat_body(text: &str, stream: bool, user: &str) -> String {
    serde_json::json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": text}],
        "stream": stream,
        "user": user,
    })
    .to_string()
}

/// One non-streaming chat request of `session` through the front at `front`: the worker
/// that answered it.
fn turn(front: SocketAddr, session: &str, text: &str) -> String {
    let r = http_response(
        &front.to_string(),
        "POST",
        "/v1/chat/completions",
        &chat_body(text, false, ""),
        &[
            ("Content-Type", "application/json"),
            ("X-Dynamo-Session-ID", session),
        ],
    );
    assert_eq!(r.status, 200, "{}", r.body);
    r.header("x-kvrouter-worker-id")
        .expect("the worker header")
        .to_owned()
}

fn sessions(api: &str, op: &str) -> f64 {
    metric(
        api,
        &format!("kvrouter_replica_session_bindings_total{{op=\"{op}\"}}"),
    )
}

#[test]
fn a_session_keeps_its_worker_on_every_replica_and_moves_on_all_of_them() {
    let server = NatsServer::start();
    let (a, b) = (MockEngine::start("A", &[]), MockEngine::start("B", &[]));
    let r1 = replica(&server.url(), 11, &[&a, &b]);
    let r2 = replica(&server.url(), 22, &[&a, &b]);
    let (api1, api2) = (r1.addr().to_string(), r2.addr().to_string());
    let (f1, f2) = (r1.proxy_addr().unwrap(), r2.proxy_addr().unwrap());

    // Eight sessions start on replica 1.
    let names: Vec<String> = (0..8).map(|i| format!("agent-{i}")).collect();
    let first: Vec<String> = names
        .iter()
        .enumerate()
        .map(|(i, s)| turn(f1, s, &format!("first turn of session {i} ").repeat(20)))
        .collect();
    // (and has heard that their requests ended: a worker still busy would be full)
    wait_until(
        "replica 2 takes the eight bindings",
        Duration::from_secs(10),
        || {
            sessions(&api2, "taken") == 8.0
                && metric(&api2, "kvrouter_slots_active_requests") == 0.0
        },
    );
    assert_eq!(sessions(&api1, "queued"), 8.0);
    assert_eq!(sessions(&api1, "out"), 8.0);
    assert_eq!(metric(&api2, "kvrouter_proxy_sessions"), 8.0);
    // Their next turns reach replica 2, with prompts that share nothing with the first:
    // each goes to its session's worker because replica 2 holds the binding.
    for (i, s) in names.iter().enumerate() {
        let w = turn(
            f2,
            s,
            &format!("an unrelated question number {i} ").repeat(20),
        );
        assert_eq!(w, first[i], "{s}");
    }
    assert_eq!(metric(&api2, "kvrouter_proxy_session_routes_total"), 8.0);
    assert_eq!(metric(&api2, "kvrouter_proxy_session_yields_total"), 0.0);
    // Kept on the worker it was bound to, replica 2 announces nothing (the bindings are
    // fresh), and replica 1 ignores nothing.
    assert_eq!(sessions(&api2, "queued"), 0.0);
    assert_eq!(sessions(&api1, "older"), 0.0);

    // agent-0's worker is busy with a slow stream (through replica 1, of agent-0 itself,
    // so it lands there); both replicas count it, through replica sync.
    let held = first[0].clone();
    wait_until(
        "replica 1 hears that replica 2's requests ended",
        Duration::from_secs(10),
        || metric(&api1, "kvrouter_slots_active_requests") == 0.0,
    );
    let mut stream = TcpStream::connect(f1).expect("connect");
    let body = chat_body("hold the worker ", true, "slow");
    write!(
        stream,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nX-Dynamo-Session-ID: agent-0\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    let mut head = String::new();
    while !head.ends_with("\r\n\r\n") {
        assert!(reader.read_line(&mut head).expect("read") > 0, "{head}");
    }
    assert!(
        head.to_ascii_lowercase()
            .contains(&format!("x-kvrouter-worker-id: {held}")),
        "{head}"
    );
    wait_until(
        "replica 2 counts the stream",
        Duration::from_secs(10),
        || metric(&api2, "kvrouter_slots_active_requests") == 1.0,
    );
    // agent-0's next turn reaches replica 2: its worker is full, so it yields, and is
    // bound anew to the other worker; replica 1 takes the new binding.
    let moved = turn(
        f2,
        "agent-0",
        &"a turn while the worker is busy ".repeat(20),
    );
    assert_ne!(moved, held);
    assert_eq!(metric(&api2, "kvrouter_proxy_session_yields_total"), 1.0);
    assert_eq!(sessions(&api2, "queued"), 1.0);
    wait_until(
        "replica 1 takes the rebinding",
        Duration::from_secs(10),
        || sessions(&api1, "taken") == 1.0,
    );
    // The stream ends (the client leaves: the front cancels it and frees the slot); its
    // old worker is free again, yet agent-0's next turn, on replica 1, goes to the new one.
    drop(reader);
    drop(stream);
    wait_until(
        "both replicas free the stream",
        Duration::from_secs(10),
        || {
            metric(&api1, "kvrouter_slots_active_requests") == 0.0
                && metric(&api2, "kvrouter_slots_active_requests") == 0.0
        },
    );
    let routed = metric(&api1, "kvrouter_proxy_session_routes_total");
    assert_eq!(turn(f1, "agent-0", &"and one more turn ".repeat(20)), moved);
    assert_eq!(
        metric(&api1, "kvrouter_proxy_session_routes_total"),
        routed + 1.0
    );
    for op in ["dropped", "unsent", "full", "invalid", "undecodable"] {
        assert_eq!(sessions(&api1, op), 0.0, "{op}");
        assert_eq!(sessions(&api2, op), 0.0, "{op}");
    }
    r1.stop();
    r2.stop();
}
