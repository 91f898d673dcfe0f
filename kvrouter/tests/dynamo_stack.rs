//! Against the real NVIDIA Dynamo 1.6.1 stack (`../shared/dynamo/`: `dynamo.mocker`,
//! `dynamo.frontend`, `dynamo.llm.RadixTree`), on its default ZMQ event plane with file
//! discovery: `kvrouter serve` lists the idle fleet within a second and routes to it, and
//! after real traffic `/v1/overlaps` equals Dynamo's own RadixTree fed the same events,
//! both for the router on Dynamo's plane and for one on the mocker's vLLM-native wire
//! (`--zmq-kv-events-ports`, with replay).
//!
//! With a host tier (`--num-host-blocks`), kvrouter's device and lower-tier block counts equal
//! what the raw events say.
//!
//! With etcd discovery (a real etcd, Debian's `etcd-server`) the same: the idle fleet listed
//! within a second, `/v1/overlaps` equal to the RadixTree's, and a killed fleet removed once
//! etcd's leases lapse.
//!
//! Slow (the stack takes seconds to start), so not part of `scripts/test.sh`: run by
//! `scripts/dynamo-stack.sh`, which installs the stack and calls this test with the feature
//! `dynamo-stack` and a time limit (CI does).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use kvrouter_tests::etcd::Etcd;
use kvrouter_tests::{Served, free_port, free_ports, http, http_response, serve_binary};
use serde_json::{Value, json};

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn env(name: &str) -> PathBuf {
    PathBuf::from(std::env::var(name).unwrap_or_else(|_| {
        panic!("{name} is not set: run scripts/dynamo-stack.sh, which sets it")
    }))
}

fn dynamo_env(venv: &Path, kv: &Path, args: &[&str], log: &Path, env: &[(&str, &str)]) -> Proc {
    let child = Command::new(venv.join("bin/python"))
        .args(args)
        .env("DYN_FILE_KV", kv)
        .envs(env.iter().copied())
        .env("HF_HUB_OFFLINE", "1")
        .envs(
            [
                "DYN_TCP_RPC_HOST",
                "DYN_TCP_RESPONSE_STREAM_HOST",
                "DYN_EVENT_PLANE_HOST",
                "DYN_SYSTEM_HOST",
            ]
            .map(|k| (k, "127.0.0.1")),
        )
        .stdout(std::fs::File::create(log).unwrap())
        .stderr(Stdio::from(
            std::fs::File::create(log.with_extension("err")).unwrap(),
        ))
        .spawn()
        .expect("python starts");
    Proc(child)
}

/// Where a test's Dynamo processes find each other: the file tree `kv`, or etcd.
struct Stack<'a> {
    venv: &'a Path,
    kv: &'a Path,
    root: &'a Path,
    /// `file` or `etcd`.
    discovery: &'a str,
    env: &'a [(&'a str, &'a str)],
}

impl Stack<'_> {
    fn run(&self, args: &[&str], log: &str) -> Proc {
        let mut all = args.to_vec();
        all.extend([
            "--discovery-backend",
            self.discovery,
            "--event-plane",
            "zmq",
            "--request-plane",
            "tcp",
        ]);
        dynamo_env(self.venv, self.kv, &all, &self.root.join(log), self.env)
    }

    /// Two mocker workers of two dp ranks, 128 blocks of 16 tokens each rank, with
    /// `extra` arguments.
    fn mocker(&self, model: &Path, extra: &[&str]) -> Proc {
        let model = model.to_string_lossy();
        let mut args = vec![
            "-m",
            "dynamo.mocker",
            "--model-path",
            &model,
            "--model-name",
            "tiny",
            "--num-workers",
            "2",
            "--block-size",
            "16",
            "--num-gpu-blocks-override",
            "128",
            "--data-parallel-size",
            "2",
        ];
        args.extend(extra);
        self.run(&args, "mocker.log")
    }

    /// A frontend in `mode`, once it lists the model; with its address.
    fn frontend(&self, mode: &str) -> (Proc, String) {
        let port = free_port().to_string();
        let p = self.run(
            &[
                "-m",
                "dynamo.frontend",
                "--http-host",
                "127.0.0.1",
                "--http-port",
                &port,
                "--router-mode",
                mode,
            ],
            &format!("frontend-{mode}.log"),
        );
        let front = format!("127.0.0.1:{port}");
        wait_for("the frontend", Duration::from_secs(90), || {
            std::net::TcpStream::connect(&front).is_ok()
                && http(&front, "GET", "/v1/models", "", &[])
                    .1
                    .contains("tiny")
        });
        (p, front)
    }
}

/// The stack's venv and model card (from `scripts/dynamo-stack.sh`), and a fresh directory
/// for a test's logs with the file-discovery tree `kv` inside.
fn setup(test: &str) -> (PathBuf, PathBuf, PathBuf, PathBuf) {
    let root = std::env::temp_dir().join(format!("kvrouter-dynamo-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let kv = root.join("kv");
    std::fs::create_dir_all(&kv).unwrap();
    (
        env("KVROUTER_DYNAMO_VENV"),
        env("KVROUTER_DYNAMO_MODEL"),
        root,
        kv,
    )
}

/// A base port with its successor free too (a worker's two dp ranks).
fn free_pair() -> u16 {
    free_ports(2)
}

fn serve(args: &[&str]) -> (Served, String, Instant) {
    let mut all = vec!["--block-size", "16"];
    all.extend(args);
    let served = serve_binary(env!("CARGO_BIN_EXE_kvrouter"), &all);
    let started = Instant::now();
    let addr = served.api.clone();
    (served, addr, started)
}

fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The rows of `/v1/workers`.
fn worker_rows(addr: &str) -> Vec<Value> {
    let (_, body) = http(addr, "GET", "/v1/workers", "", &[]);
    let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
    v["workers"].as_array().cloned().unwrap_or_default()
}

/// Each rank's `(worker, rank)` and its cached blocks.
fn workers(addr: &str) -> Vec<(u64, u64, u64)> {
    worker_rows(addr)
        .iter()
        .map(|w| {
            (
                w["worker_id"].as_u64().unwrap(),
                w["dp_rank"].as_u64().unwrap(),
                w["cached_blocks"].as_u64().unwrap(),
            )
        })
        .collect()
}

fn overlaps(addr: &str, q: &[u64]) -> HashMap<(u64, u64), u64> {
    let (status, body) = http(
        addr,
        "POST",
        "/v1/overlaps",
        &json!({"block_hashes": q}).to_string(),
        &[],
    );
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    v["overlaps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| {
            (
                (
                    o["worker_id"].as_u64().unwrap(),
                    o["dp_rank"].as_u64().unwrap(),
                ),
                o["blocks"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// Real traffic: chat requests over three shared system prompts, through the frontend.
fn chat_traffic(front: &str) {
    for i in 0..30 {
        let system = format!(
            "You are assistant number {}. {}",
            i % 3,
            "Answer briefly. ".repeat(40)
        );
        let body = json!({
            "model": "tiny", "max_tokens": 4,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": format!("question {i}")}],
        });
        let (status, out) = http(
            front,
            "POST",
            "/v1/chat/completions",
            &body.to_string(),
            &[("Content-Type", "application/json")],
        );
        assert_eq!(status, 200, "{out}");
    }
}

/// Dynamo's RadixTree fed from the kv-events publishers `discovery` lists (a file tree, or
/// `etcd:URL`), once it has subscribed to `n` of them.
fn dynamo_tree(venv: &Path, discovery: &str, n: usize) -> Tree {
    let mut child = Command::new(venv.join("bin/python"))
        .arg(kvrouter_tests::repo_root().join("tests/py/dynamo_tree.py"))
        .args([discovery, &n.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdin = child.stdin.take().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), format!("subscribed {n}"));
    Tree {
        _p: Proc(child),
        stdin,
        stdout,
    }
}

/// Dynamo's RadixTree behind `tests/py/dynamo_tree.py`.
struct Tree {
    _p: Proc,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Tree {
    fn ask(&mut self, cmd: Value) -> Value {
        writeln!(self.stdin, "{cmd}").unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap()
    }

    fn scores(&mut self, q: &[u64]) -> HashMap<(u64, u64), u64> {
        let v = self.ask(json!({"op": "scores", "q": q}));
        v.as_object()
            .unwrap()
            .iter()
            .map(|(k, n)| {
                let (w, dp) = k.split_once('/').unwrap();
                (
                    (w.parse().unwrap(), dp.parse().unwrap()),
                    n.as_u64().unwrap(),
                )
            })
            .collect()
    }
}

#[test]
fn kvrouter_on_dynamos_zmq_planes_equals_dynamos_own_index() {
    let (venv, model, root, kv) = setup("zmq");
    let (e0, e1, r0, r1) = (free_pair(), free_pair(), free_pair(), free_pair());
    let ports = |a: u16, b: u16| format!("{a},{b}");
    let stack = Stack {
        venv: &venv,
        kv: &kv,
        root: &root,
        discovery: "file",
        env: &[],
    };
    let _mocker = stack.mocker(
        &model,
        &[
            "--zmq-kv-events-ports",
            &ports(e0, e1),
            "--zmq-replay-ports",
            &ports(r0, r1),
        ],
    );
    // The mocker is up once discovery lists its kv-events publishers.
    let channels = |kv: &Path| {
        std::fs::read_dir(kv.join("v1/event_channels"))
            .map(|d| {
                d.flatten()
                    .filter(|e| e.file_name().to_string_lossy().contains("kv%2Devents"))
                    .count()
            })
            .unwrap_or(0)
    };
    wait_for("the mocker's publishers", Duration::from_secs(60), || {
        channels(&kv) >= 4
    });

    // On Dynamo's plane, through discovery: the idle fleet is listed within a second.
    let (_a, a, started) = serve(&["--dynamo-discovery", &format!("file:{}", kv.display())]);
    wait_for("the idle fleet", Duration::from_secs(5), || {
        workers(&a).len() == 4
    });
    let listed_after = started.elapsed();
    assert!(listed_after < Duration::from_secs(1), "{listed_after:?}");
    let (status, body) = http(
        &a,
        "POST",
        "/v1/route",
        r#"{"block_hashes": [1, 2, 3]}"#,
        &[],
    );
    assert_eq!(status, 200, "{body}");
    let chosen: Value = serde_json::from_str(&body).unwrap();
    let ids: Vec<u64> = workers(&a).iter().map(|w| w.0).collect();
    assert!(ids.contains(&chosen["worker_id"].as_u64().unwrap()));
    assert_eq!(
        http(
            &a,
            "POST",
            &format!(
                "/v1/requests/{}/free",
                chosen["request_id"].as_str().unwrap()
            ),
            "",
            &[]
        )
        .0,
        200
    );
    // On the mocker's vLLM-native wire, with replay.
    let engine = |name: &str, e: u16, r: u16| {
        format!("{name}=tcp://127.0.0.1:{e},replay=tcp://127.0.0.1:{r},dp=2")
    };
    let (_b, b, _) = serve(&[
        "--zmq-engine",
        &engine("w0", e0, r0),
        "--zmq-engine",
        &engine("w1", e1, r1),
    ]);
    wait_for("the static engines", Duration::from_secs(5), || {
        workers(&b).len() == 4
    });

    // Dynamo's own index on the same plane.
    let mut tree = dynamo_tree(&venv, &kv.to_string_lossy(), 4);
    std::thread::sleep(Duration::from_millis(500));

    // Real traffic: chat requests over three shared system prompts, through the frontend.
    let (_frontend, front) = stack.frontend("round-robin");
    chat_traffic(&front);
    // Quiet: every router has every event once the counts stop moving.
    let total = |addr: &str| workers(addr).iter().map(|w| w.2).sum::<u64>();
    let mut last = (u64::MAX, u64::MAX, Value::Null);
    wait_for("the indexes to settle", Duration::from_secs(30), || {
        std::thread::sleep(Duration::from_millis(300));
        let now = (total(&a), total(&b), tree.ask(json!({"op": "count"})));
        let same = now == last;
        last = now;
        same
    });
    assert!(
        last.0 > 0 && last.0 == last.1,
        "plane {} native {}",
        last.0,
        last.1
    );

    let paths: Vec<Vec<u64>> = serde_json::from_value(tree.ask(json!({"op": "paths"}))).unwrap();
    assert!(paths.len() as u64 >= last.0 / 4, "{} paths", paths.len());
    // Native worker ids are ours (from the engine names): map them to Dynamo's by the first
    // answer that tells them apart, then hold every answer to that map.
    let mut native_to_dynamo: HashMap<(u64, u64), (u64, u64)> = HashMap::new();
    for q in &paths {
        let want = tree.scores(q);
        assert_eq!(
            overlaps(&a, q),
            want,
            "plane router, query of {} blocks",
            q.len()
        );
        let native = overlaps(&b, q);
        assert_eq!(
            native.len(),
            want.len(),
            "native router, query of {} blocks",
            q.len()
        );
        for (w, n) in &native {
            let candidates: Vec<(u64, u64)> = want
                .iter()
                .filter(|(_, m)| *m == n)
                .map(|(k, _)| *k)
                .collect();
            match native_to_dynamo.get(w) {
                Some(d) => assert_eq!(want.get(d), Some(n), "native {w:?} as {d:?}"),
                None if candidates.len() == 1 => {
                    native_to_dynamo.insert(*w, candidates[0]);
                }
                None => assert!(
                    !candidates.is_empty(),
                    "native {w:?}: {n} blocks nowhere in {want:?}"
                ),
            }
        }
    }
    eprintln!(
        "dynamo stack: idle fleet listed after {listed_after:?}; {} cached blocks on each router; {} queries equal Dynamo's RadixTree; native workers mapped {native_to_dynamo:?}",
        last.0,
        paths.len()
    );
    assert_eq!(
        native_to_dynamo.len(),
        4,
        "every native worker was told apart"
    );
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn kvrouter_follows_dynamos_etcd_discovery() {
    let (venv, model, root, kv) = setup("etcd");
    let etcd = Etcd::start();
    let url = etcd.url();
    let discovery = [
        ("ETCD_ENDPOINTS", url.as_str()),
        ("DYN_DISCOVERY_BACKEND", "etcd"),
    ];
    let stack = Stack {
        venv: &venv,
        kv: &kv,
        root: &root,
        discovery: "etcd",
        env: &discovery,
    };
    let mocker = stack.mocker(&model, &[]);
    // The mocker is up once etcd lists its four kv-events publishers.
    wait_for("the mocker's publishers", Duration::from_secs(60), || {
        etcd.keys("v1/event_channels/")
            .iter()
            .filter(|k| k.contains("/topic/kv-events/"))
            .count()
            >= 4
    });

    // The idle fleet is listed within a second and routable.
    let (_a, a, started) = serve(&["--dynamo-discovery", &format!("etcd:{url}")]);
    wait_for("the idle fleet", Duration::from_secs(5), || {
        workers(&a).len() == 4
    });
    let listed_after = started.elapsed();
    assert!(listed_after < Duration::from_secs(1), "{listed_after:?}");
    let (status, body) = http(&a, "POST", "/v1/route", r#"{"block_hashes": [1, 2]}"#, &[]);
    assert_eq!(status, 200, "{body}");

    // Real traffic through a frontend on the same etcd; the index equals Dynamo's own.
    let mut tree = dynamo_tree(&venv, &format!("etcd:{url}"), 4);
    std::thread::sleep(Duration::from_millis(500));
    let (_frontend, front) = stack.frontend("round-robin");
    chat_traffic(&front);
    let total = |addr: &str| workers(addr).iter().map(|w| w.2).sum::<u64>();
    let mut last = (u64::MAX, Value::Null);
    wait_for("the indexes to settle", Duration::from_secs(30), || {
        std::thread::sleep(Duration::from_millis(300));
        let now = (total(&a), tree.ask(json!({"op": "count"})));
        let same = now == last;
        last = now;
        same
    });
    assert!(last.0 > 0, "no blocks indexed");
    let paths: Vec<Vec<u64>> = serde_json::from_value(tree.ask(json!({"op": "paths"}))).unwrap();
    for q in &paths {
        assert_eq!(
            overlaps(&a, q),
            tree.scores(q),
            "query of {} blocks",
            q.len()
        );
    }

    // The workers die: etcd drops their entries when their leases lapse, and kvrouter
    // drops the workers with their blocks.
    drop(mocker);
    let died = Instant::now();
    wait_for("the dead fleet removed", Duration::from_secs(60), || {
        workers(&a).is_empty()
    });
    eprintln!(
        "dynamo stack (etcd): idle fleet listed after {listed_after:?}; {} cached blocks; {} queries equal Dynamo's RadixTree; dead fleet removed {:?} after the kill",
        last.0,
        paths.len(),
        died.elapsed()
    );
    let _ = std::fs::remove_dir_all(&root);
}

/// Each rank's last applied event id, from `/v1/workers`.
fn last_events(addr: &str) -> HashMap<(u64, u64), Option<u64>> {
    worker_rows(addr)
        .iter()
        .map(|w| {
            (
                (
                    w["worker_id"].as_u64().unwrap(),
                    w["dp_rank"].as_u64().unwrap(),
                ),
                w["last_event_id"].as_u64(),
            )
        })
        .collect()
}

/// A prefix-heavy chat load: 7 long system prompts (`set` keeps two loads apart), 5
/// questions each, interleaved so that no fixed rotation keeps a prompt on one worker.
fn prefix_heavy(set: &str) -> Vec<Value> {
    let mut out = Vec::new();
    for q in 0..5 {
        for p in 0..7 {
            let system = format!(
                "Set {set}, assistant {p}. {}",
                "Answer briefly and cite your sources. ".repeat(16)
            );
            out.push(json!({
                "model": "tiny", "max_tokens": 4,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": format!("question {q}")}],
            }));
        }
    }
    out
}

/// A numeric header kvrouter set on its answer.
fn header_u64(r: &kvrouter_tests::Response, name: &str) -> u64 {
    r.header(name)
        .unwrap_or_else(|| panic!("no {name}"))
        .parse()
        .unwrap()
}

/// `(cached_tokens, prompt_tokens)` of a non-streaming answer's usage.
fn usage(body: &str) -> (u64, u64) {
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
    let u = &v["usage"];
    (
        u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
        u["prompt_tokens"].as_u64().unwrap(),
    )
}

#[test]
fn kvrouter_in_front_of_dynamos_direct_mode_lands_every_request_where_it_chose() {
    let (venv, model, root, kv) = setup("direct");
    let model_s = model.to_string_lossy().to_string();
    let stack = Stack {
        venv: &venv,
        kv: &kv,
        root: &root,
        discovery: "file",
        env: &[],
    };
    let _mocker = stack.mocker(&model, &[]);
    let (_direct, direct) = stack.frontend("direct");
    let (_rr, rr) = stack.frontend("round-robin");
    let openai = format!("127.0.0.1:{}", free_port());
    let (_k, a, _) = serve(&[
        "--dynamo-discovery",
        &format!("file:{}", kv.display()),
        "--openai-listen",
        &openai,
        "--model",
        &format!("tiny={model_s}"),
        "--dynamo-frontend",
        &format!("http://{direct}"),
    ]);
    wait_for("the fleet", Duration::from_secs(10), || {
        workers(&a).len() == 4
    });
    wait_for("the OpenAI front", Duration::from_secs(10), || {
        std::net::TcpStream::connect(openai.as_str()).is_ok()
    });
    let json_header = [("Content-Type", "application/json")];

    // The same frontend's round-robin on one load...
    let (mut rr_cached, mut rr_prompt) = (0, 0);
    for body in prefix_heavy("A") {
        let r = http_response(
            &rr,
            "POST",
            "/v1/chat/completions",
            &body.to_string(),
            &json_header,
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let (c, p) = usage(&r.body);
        rr_cached += c;
        rr_prompt += p;
    }
    // ...and kvrouter in front of its direct mode on another of the same shape, one
    // request at a time: each lands on the rank kvrouter named (that rank, and no other,
    // publishes the request's new blocks), and the engine's cached tokens are kvrouter's
    // predicted overlap.
    let quiet = |before: &HashMap<(u64, u64), Option<u64>>| {
        let mut last = last_events(&a);
        loop {
            std::thread::sleep(Duration::from_millis(150));
            let now = last_events(&a);
            if now == last {
                return now
                    .into_iter()
                    .filter(|(k, v)| before.get(k) != Some(v))
                    .map(|(k, _)| k)
                    .collect::<Vec<_>>();
            }
            last = now;
        }
    };
    let (mut kv_cached, mut kv_prompt, mut predicted_exactly) = (0, 0, 0);
    let load = prefix_heavy("B");
    for body in &load {
        let before = last_events(&a);
        let r = http_response(
            &openai,
            "POST",
            "/v1/chat/completions",
            &body.to_string(),
            &json_header,
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let chosen = (
            header_u64(&r, "x-kvrouter-worker-id"),
            header_u64(&r, "x-kvrouter-dp-rank"),
        );
        let moved = quiet(&before);
        assert_eq!(
            moved,
            [chosen],
            "the request's blocks were published by {moved:?}, kvrouter chose {chosen:?}"
        );
        let (c, p) = usage(&r.body);
        if c == header_u64(&r, "x-kvrouter-overlap-blocks") * 16 {
            predicted_exactly += 1;
        }
        kv_cached += c;
        kv_prompt += p;
    }
    let ratio = |c: u64, p: u64| c as f64 / p.max(1) as f64;
    eprintln!(
        "dynamo stack (direct mode): {} requests each on the rank kvrouter chose; cached-token ratio {:.3} through kvrouter, {:.3} with the frontend's round-robin; predicted overlap = engine's cached tokens on {predicted_exactly}/{}",
        load.len(),
        ratio(kv_cached, kv_prompt),
        ratio(rr_cached, rr_prompt),
        load.len()
    );
    assert!(ratio(kv_cached, kv_prompt) > ratio(rr_cached, rr_prompt) + 0.2);
    assert!(
        predicted_exactly * 10 >= load.len() * 9,
        "{predicted_exactly}/{}",
        load.len()
    );

    // A completion whose prompt is token ids: kvrouter parses them as ids and writes the
    // body for the frontend from them (the prompt given back, the ids in nvext). The
    // engine prefills exactly those ids, on the rank kvrouter chose, and the second of
    // two equal prompts finds the first's blocks there.
    let ids: Vec<u32> = (0..96u32).map(|i| 100 + (i * 37) % 4000).collect();
    let body = json!({"model": "tiny", "max_tokens": 4, "prompt": ids}).to_string();
    let mut first = None;
    for _ in 0..2 {
        let before = last_events(&a);
        let r = http_response(&openai, "POST", "/v1/completions", &body, &json_header);
        assert_eq!(r.status, 200, "{}", r.body);
        let chosen = (
            header_u64(&r, "x-kvrouter-worker-id"),
            header_u64(&r, "x-kvrouter-dp-rank"),
        );
        let (cached, prompt) = usage(&r.body);
        assert_eq!(prompt, ids.len() as u64, "the engine's prompt: {}", r.body);
        match first {
            None => {
                assert_eq!(quiet(&before), [chosen], "the first turn's blocks");
                first = Some(chosen);
            }
            Some(f) => {
                assert_eq!(chosen, f, "the second turn goes where its blocks are");
                assert!(cached >= 80, "cached {cached} of {prompt}: {}", r.body);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn kvrouter_indexes_the_mockers_host_tier_as_its_events_say() {
    let (venv, model, root, kv) = setup("host");
    let stack = Stack {
        venv: &venv,
        kv: &kv,
        root: &root,
        discovery: "file",
        env: &[],
    };
    // 40 device blocks a rank: the traffic below overflows them, and the mocker offloads
    // what it evicts to a host tier of 200 blocks, publishing its own tier events.
    let _mocker = stack.mocker(
        &model,
        &[
            "--num-gpu-blocks-override",
            "40",
            "--num-host-blocks",
            "200",
        ],
    );
    let (_a, a, _) = serve(&["--dynamo-discovery", &format!("file:{}", kv.display())]);
    wait_for("the fleet", Duration::from_secs(60), || {
        workers(&a).len() == 4
    });
    let mut tree = dynamo_tree(&venv, &kv.to_string_lossy(), 4);
    std::thread::sleep(Duration::from_millis(500));
    let (_frontend, front) = stack.frontend("round-robin");
    chat_traffic(&front);
    let count = |name: &str| kvrouter_tests::metric(&a, name) as u64;
    let mut last = (u64::MAX, u64::MAX, Value::Null);
    wait_for("the index to settle", Duration::from_secs(30), || {
        std::thread::sleep(Duration::from_millis(300));
        let now = (
            count("kvrouter_index_blocks"),
            count("kvrouter_index_lower_tier_blocks"),
            tree.ask(json!({"op": "tiers"})),
        );
        let same = now == last;
        last = now;
        same
    });
    let (device, lower, tiers) = last;
    let published = |t: &str| tiers[t].as_u64().unwrap_or(0);
    let offloaded: u64 = tiers
        .as_object()
        .unwrap()
        .iter()
        .filter(|(t, _)| t.as_str() != "device")
        .map(|(_, n)| n.as_u64().unwrap())
        .sum();
    assert!(offloaded > 0, "the mocker offloaded nothing: {tiers}");
    assert_eq!(device, published("device"), "device blocks: {tiers}");
    assert_eq!(lower, offloaded, "lower-tier blocks: {tiers}");
    // A prompt whose prefix left the device is still found, in host memory.
    let paths: Vec<Vec<u64>> = serde_json::from_value(tree.ask(json!({"op": "paths"}))).unwrap();
    let host_hits = paths
        .iter()
        .filter(|q| {
            let (_, body) = http(
                &a,
                "POST",
                "/v1/overlaps",
                &json!({"block_hashes": q}).to_string(),
                &[],
            );
            body.contains("host_blocks")
        })
        .count();
    assert!(host_hits > 0, "no query found host blocks");
    eprintln!(
        "dynamo stack (host tier): {device} device and {lower} lower-tier blocks, as the events say ({tiers}); {host_hits}/{} queries continue in host memory",
        paths.len()
    );
    let _ = std::fs::remove_dir_all(&root);
}
