//! The OpenAI front end to end: the `openai` Python SDK as the client, a real
//! `kvrouter-io` router in this process (approximate mode, two static workers, no NATS)
//! serving the front, and our mock OpenAI engines (`tests/py/openai_engine.py`, for the
//! faults a real engine cannot be made to produce) behind it.

use std::time::Duration;

use kvrouter_core::worker::WorkerDp;
use kvrouter_io::proxy::{Backend, ModelSpec, ProxyConfig, Target, UpstreamConfig};
use kvrouter_io::router::{self, RouterConfig, RouterHandle};
use kvrouter_tests::fleet::wait_until;
use kvrouter_tests::openai::{MockEngine, card_with_template, sdk, tiny_card};
use kvrouter_tests::{http, http_response, metric};

fn front(engines: &[&MockEngine]) -> RouterHandle {
    front_with(engines, UpstreamConfig::default())
}

fn front_with(engines: &[&MockEngine], upstream: UpstreamConfig) -> RouterHandle {
    let strict = card_with_template(
        "strict",
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool turns') }}{% endif %}{{ m.content }}{% endfor %}",
    );
    let list = engines
        .iter()
        .enumerate()
        .map(|(i, e)| (i as u64 + 1, Target::parse(&e.url).expect("url")))
        .collect();
    router::start(
        RouterConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            replica_sync: false,
            kv_events: false,
            block_size: 16,
            static_workers: (1..=engines.len() as u64)
                .map(|w| WorkerDp::new(w, 0))
                .collect(),
            proxy: Some(ProxyConfig {
                listen: "127.0.0.1:0".parse().unwrap(),
                models: vec![
                    ModelSpec {
                        name: "tiny".into(),
                        dir: tiny_card(),
                        lora_name: None,
                    },
                    ModelSpec {
                        name: "tiny-sql".into(),
                        dir: tiny_card(),
                        lora_name: Some("tiny-sql".into()),
                    },
                    ModelSpec {
                        name: "strict".into(),
                        dir: strict,
                        lora_name: None,
                    },
                ],
                backend: Backend::Engines(list),
                upstream,
                max_body_bytes: 1 << 20,
                // Every request through the tokenizer threads (the binary's tests keep
                // the default, where small bodies stay inline).
                tokenizer_threads: 2,
                inline_tokenize_bytes: 0,
                ..ProxyConfig::default()
            }),
            ..RouterConfig::default()
        },
        None,
        None,
        512 << 10,
    )
    .expect("the router starts")
}

/// A streamed chat request through the front with `user` set (our mock engine's fault
/// modes), read whole; and how long it took.
fn chat_stream(proxy: &str, user: &str) -> (kvrouter_tests::Response, Duration) {
    let body = serde_json::json!({
        "model": "tiny", "stream": true, "user": user,
        "messages": [{"role": "user", "content": "hello there"}],
    });
    let t = std::time::Instant::now();
    let resp = http_response(
        proxy,
        "POST",
        "/v1/chat/completions",
        &body.to_string(),
        &[],
    );
    (resp, t.elapsed())
}

fn active_requests(api: &str) -> u64 {
    let (_, body) = http(api, "GET", "/v1/workers", "", &[]);
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    v["workers"]
        .as_array()
        .expect("workers")
        .iter()
        .map(|w| w["active_requests"].as_u64().unwrap_or(0))
        .sum()
}

#[test]
fn the_openai_sdk_gets_answers_relayed_and_every_request_is_freed() {
    let a = MockEngine::start("A", &["--cached", "16"]);
    let b = MockEngine::start("B", &["--cached", "16"]);
    let r = front(&[&a, &b]);
    let api = r.addr().to_string();
    let base = format!("http://{}", r.proxy_addr().expect("the front runs"));
    let out = sdk(
        &base,
        &[
            "models",
            "chat",
            "chat_stream",
            "completion",
            "completion_stream",
            "session",
            "die_after_first",
            "bad",
        ],
    );
    let by = |s: &str| {
        out.iter()
            .find(|o| o["scenario"] == s)
            .cloned()
            .unwrap_or_else(|| panic!("{s}: {out:?}"))
    };
    for o in &out {
        assert!(o.get("exception").is_none(), "{o}");
    }
    assert_eq!(
        by("models")["ids"],
        serde_json::json!(["tiny", "tiny-sql", "strict"])
    );
    // Answers arrive intact, from the engine the router named.
    let chat = by("chat");
    let worker = chat["worker"].as_str().expect("worker header");
    let name = if worker == "1" { "A" } else { "B" };
    assert_eq!(
        chat["content"],
        format!("{name}-t0 {name}-t1 {name}-t2 {name}-t3 ")
    );
    assert_eq!(chat["cached"], 16);
    let engine = if name == "A" { &a } else { &b };
    let rid = chat["request_id"].as_str().expect("request id").to_owned();
    engine.wait_for(
        "the chat request with the router's id",
        Duration::from_secs(5),
        |l| {
            l["event"] == "request"
                && l["request_id"] == rid.as_str()
                && l["authorization"] == "Bearer sk-test-secret"
                && l["dp_rank"] == "0"
                && l["body"]["messages"][0]["role"] == "system"
        },
    );
    let stream = by("chat_stream");
    let content = stream["content"].as_str().expect("content");
    assert!(
        content == "A-t0 A-t1 A-t2 A-t3 " || content == "B-t0 B-t1 B-t2 B-t3 ",
        "{stream}"
    );
    assert_eq!(stream["usage"], 4, "include_usage is honoured: {stream}");
    assert!(
        by("completion")["content"]
            .as_str()
            .expect("text")
            .ends_with("-t3 ")
    );
    assert!(
        by("completion_stream")["content"]
            .as_str()
            .expect("text")
            .ends_with("-t3 ")
    );
    // A session stays on its worker.
    let ws = by("session")["workers"]
        .as_array()
        .expect("workers")
        .clone();
    assert!(ws.iter().all(|w| *w == ws[0]), "{ws:?}");
    assert!(metric(&api, "kvrouter_proxy_session_routes_total") >= 3.0);
    // Its later turns were encoded in pieces, finding the earlier turns' in the cache.
    let pieces = |outcome: &str| {
        metric(
            &api,
            &format!(
                "kvrouter_proxy_tokenize_piece_prompts_total{{model=\"tiny\",outcome=\"{outcome}\"}}"
            ),
        )
    };
    assert!(pieces("pieces") >= 3.0, "{}", pieces("pieces"));
    assert_eq!(pieces("verified"), pieces("pieces"));
    assert_eq!(pieces("mismatch"), 0.0);
    assert!(
        metric(
            &api,
            "kvrouter_proxy_tokenize_piece_tokens_total{model=\"tiny\",outcome=\"hit\"}"
        ) > 0.0
    );
    // An engine that dies after the first byte: the client sees an error, no retry.
    let died = by("die_after_first");
    assert!(died["error"].is_string(), "{died}");
    assert_eq!(died["got"].as_array().map(Vec::len), Some(1), "{died}");
    // Bad input: OpenAI-style 4xx.
    let bad = by("bad");
    for (case, status) in [
        ("malformed", 400),
        ("unknown_model", 404),
        ("no_messages", 400),
        ("oversize", 413),
        ("template_raises", 400),
        ("not_object", 400),
    ] {
        assert_eq!(bad[case][0], status, "{case}: {bad}");
        assert!(
            bad[case][1]["error"]["message"].is_string(),
            "{case}: {bad}"
        );
    }
    assert_eq!(bad["sdk_unknown_model"], 404);
    assert!(
        bad["template_raises"][1]["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("no tool turns"),
        "{bad}"
    );
    // Every request was freed; first tokens were seen; the engines' cached tokens counted.
    wait_until("every request freed", Duration::from_secs(5), || {
        active_requests(&api) == 0
    });
    assert!(metric(&api, "kvrouter_proxy_time_to_first_token_seconds_count") >= 3.0);
    assert!(metric(&api, "kvrouter_proxy_engine_cached_tokens_total") >= 32.0);
    assert_eq!(
        metric(
            &api,
            "kvrouter_proxy_upstream_errors_total{kind=\"stream\"}"
        ),
        1.0
    );
    assert_eq!(metric(&api, "kvrouter_proxy_retries_total"), 0.0);
}

#[test]
fn a_client_that_leaves_mid_stream_cancels_the_engine_and_frees_its_slot() {
    let a = MockEngine::start("A", &[]);
    let r = front(&[&a]);
    let api = r.addr().to_string();
    let base = format!("http://{}", r.proxy_addr().expect("the front runs"));
    let out = sdk(&base, &["disconnect"]);
    assert_eq!(out[0]["read"], 3, "{out:?}");
    a.wait_for("the request cancelled", Duration::from_secs(10), |l| {
        l["event"] == "cancelled"
    });
    wait_until("the slot freed", Duration::from_secs(5), || {
        active_requests(&api) == 0
    });
    assert_eq!(metric(&api, "kvrouter_proxy_client_disconnects_total"), 1.0);
}

#[test]
fn a_dead_worker_before_the_first_byte_is_retried_elsewhere() {
    let dead = MockEngine::start("A", &["--fail"]);
    let b = MockEngine::start("B", &[]);
    let r = front(&[&dead, &b]);
    let api = r.addr().to_string();
    let base = format!("http://{}", r.proxy_addr().expect("the front runs"));
    let out = sdk(
        &base,
        &[
            "chat",
            "chat_stream",
            "completion",
            "completion_stream",
            "chat",
            "completion",
        ],
    );
    for o in &out {
        assert!(o.get("exception").is_none(), "{o}");
        assert!(
            o["content"].as_str().expect("content").starts_with("B-t0"),
            "{o}"
        );
    }
    // The dead engine was tried (its log has requests), and each try was retried on B.
    let tried = dead
        .log()
        .iter()
        .filter(|l| l["event"] == "request")
        .count() as f64;
    assert!(
        tried >= 1.0,
        "the dead worker was never chosen: {:?}",
        dead.log()
    );
    assert_eq!(metric(&api, "kvrouter_proxy_retries_total"), tried);
    wait_until("every request freed", Duration::from_secs(5), || {
        active_requests(&api) == 0
    });
}

#[test]
fn a_lora_adapter_has_its_own_blocks_and_reaches_the_engine_by_name() {
    // Approximate mode: the router records its own decisions, so a prompt routed once is
    // credited when it comes again, under the same hashes only.
    let a = MockEngine::start("A", &[]);
    let r = front(&[&a]);
    let proxy = r.proxy_addr().expect("the front runs").to_string();
    let system = "You are a careful SQL assistant. ".repeat(20);
    let ask = |model: &str| {
        let body = serde_json::json!({
            "model": model, "max_tokens": 2,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
        });
        let resp = http_response(
            &proxy,
            "POST",
            "/v1/chat/completions",
            &body.to_string(),
            &[("Content-Type", "application/json")],
        );
        assert_eq!(resp.status, 200, "{}", resp.body);
        let answer: serde_json::Value = serde_json::from_str(&resp.body).expect("json");
        assert_eq!(
            answer["model"], model,
            "the engine sees the name the client sent"
        );
        let overlap: u64 = resp
            .header("x-kvrouter-overlap-blocks")
            .expect("overlap header")
            .parse()
            .unwrap();
        overlap
    };
    assert_eq!(ask("tiny"), 0);
    let base = ask("tiny");
    assert!(
        base > 0,
        "the base model's prompt is credited the second time"
    );
    // The adapter's blocks are not the base model's, then are its own.
    assert_eq!(ask("tiny-sql"), 0);
    assert_eq!(ask("tiny-sql"), base);
}

#[test]
fn a_stream_ends_at_its_done_event_and_the_connection_is_reused_after() {
    // Our mock engine: "linger" waits 3 s between `data: [DONE]` and the end of its
    // chunked body; "after_done" sends one more event after `[DONE]`.
    let a = MockEngine::start("A", &[]);
    let r = front(&[&a]);
    let api = r.addr().to_string();
    let proxy = r.proxy_addr().expect("the front runs").to_string();
    let stream = |user: &str| chat_stream(&proxy, user);
    let (resp, took) = stream("linger");
    assert_eq!(resp.status, 200);
    assert!(resp.body.ends_with("data: [DONE]\n\n"), "{:?}", resp.body);
    // The client's stream is whole at `[DONE]`: it does not wait for the engine's 3 s.
    assert!(
        took < Duration::from_secs(2),
        "the stream waited for the engine's terminator: {took:?}"
    );
    // Freed at `[DONE]` too, while the engine still holds its answer open.
    wait_until("the slot freed", Duration::from_secs(1), || {
        active_requests(&api) == 0
    });
    assert!(
        !a.log().iter().any(|l| l["event"] == "done"),
        "the engine finished before the check: {:?}",
        a.log()
    );
    // Once the engine ends its body, the connection goes back to the pool: the next
    // request comes over the same one.
    a.wait_for("the lingering answer ended", Duration::from_secs(10), |l| {
        l["event"] == "done"
    });
    std::thread::sleep(Duration::from_millis(100));
    let (resp, _) = stream("");
    assert!(resp.body.ends_with("data: [DONE]\n\n"), "{:?}", resp.body);
    let peers: Vec<_> = a
        .log()
        .iter()
        .filter(|l| l["event"] == "request")
        .map(|l| l["peer"].clone())
        .collect();
    assert_eq!(peers.len(), 2, "{peers:?}");
    assert_eq!(peers[0], peers[1], "the connection was not reused");
    // An event after `[DONE]` never reaches the client; it is counted.
    let (resp, _) = stream("after_done");
    assert!(resp.body.ends_with("data: [DONE]\n\n"), "{:?}", resp.body);
    assert!(!resp.body.contains("late"), "{:?}", resp.body);
    wait_until("the late event counted", Duration::from_secs(5), || {
        metric(
            &api,
            "kvrouter_proxy_upstream_errors_total{kind=\"after_done\"}",
        ) == 1.0
    });
}

#[test]
fn an_engine_silent_past_the_idle_timeout_ends_the_stream_with_an_error() {
    // Our mock engine: "drip" sends 8 tokens 0.3 s apart (2.4 s in all), "stall" its
    // first chunk and then nothing for 8 s. The front's idle timeout is 2 s: between two
    // chunks, not over the whole answer.
    let a = MockEngine::start("A", &[]);
    let r = front_with(
        &[&a],
        UpstreamConfig {
            idle_timeout: Duration::from_secs(2),
            ..UpstreamConfig::default()
        },
    );
    let api = r.addr().to_string();
    let proxy = r.proxy_addr().expect("the front runs").to_string();
    let (resp, took) = chat_stream(&proxy, "drip");
    assert_eq!(resp.status, 200);
    assert!(resp.body.ends_with("data: [DONE]\n\n"), "{:?}", resp.body);
    assert!(resp.body.contains("A-t7"), "{:?}", resp.body);
    assert!(took >= Duration::from_millis(2100), "{took:?}");
    let (resp, took) = chat_stream(&proxy, "stall");
    assert_eq!(resp.status, 200);
    assert!(
        resp.body.contains("the engine sent nothing for too long"),
        "{:?}",
        resp.body
    );
    assert!(!resp.body.contains("[DONE]"), "{:?}", resp.body);
    // Between chunks: the first arrived, then the silence ended the stream, well before
    // the engine would have spoken again.
    assert!(resp.body.contains("A-t0"), "{:?}", resp.body);
    assert!(
        took >= Duration::from_millis(1900) && took < Duration::from_secs(6),
        "the stream ended after {took:?}"
    );
    wait_until("the slot freed", Duration::from_secs(2), || {
        active_requests(&api) == 0
    });
    assert_eq!(
        metric(
            &api,
            "kvrouter_proxy_upstream_errors_total{kind=\"idle_timeout\"}"
        ),
        1.0
    );
}
