//! `kvrouter bench`: the CLI contract (flags, the JSON keys per policy, the plot) on the
//! bundled sample and on a trace file; bad usage exits 2 with a message.

use std::process::Command;

use serde_json::Value;

/// A fresh directory, removed when dropped.
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!("kvrouter-bench-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }

    fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn kvrouter(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args(args)
        .output()
        .expect("run kvrouter")
}

/// Runs kvrouter, which must succeed (its stderr otherwise); returns its stdout.
fn kvrouter_ok(args: &[&str]) -> String {
    let out = kvrouter(args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn bench_writes_the_contracted_json_and_plot() {
    let dir = TempDir::new("contract");
    let json = dir.path().join("out.json");
    let plot = dir.path().join("ttft.svg");
    let outcomes = dir.path().join("outcomes.csv");
    let stdout = kvrouter_ok(&[
        "bench",
        "--workers",
        "4",
        "--limit",
        "120",
        "--speed",
        "2",
        "--seed",
        "7",
        "--policies",
        "kv-aware,round-robin,random,least-loaded",
        "--json",
        json.to_str().unwrap(),
        "--plot",
        plot.to_str().unwrap(),
        "--outcomes",
        outcomes.to_str().unwrap(),
    ]);
    for p in ["kv-aware", "round-robin", "random", "least-loaded"] {
        assert!(
            stdout.lines().any(|l| l.starts_with(p)),
            "{p} missing from\n{stdout}"
        );
    }
    let v: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let obj = v.as_object().unwrap();
    assert_eq!(obj.len(), 4);
    for (name, r) in obj {
        for k in ["mean", "p50", "p90", "p99"] {
            assert!(
                r["ttft_ms"][k].as_f64().unwrap() > 0.0,
                "{name} ttft_ms.{k}"
            );
        }
        for k in ["mean", "p99"] {
            assert!(r["itl_ms"][k].is_f64(), "{name} itl_ms.{k}");
            assert!(r["e2e_ms"][k].as_f64().unwrap() > 0.0, "{name} e2e_ms.{k}");
        }
        assert!(r["throughput_rps"].as_f64().unwrap() > 0.0);
        let hit = r["prefix_hit_ratio"].as_f64().unwrap();
        let ideal = r["ideal_prefix_hit_ratio"].as_f64().unwrap();
        assert!(
            (0.0..=ideal + 1e-9).contains(&hit),
            "{name}: {hit} > {ideal}"
        );
        let per_worker: Vec<u64> = r["requests_per_worker"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        assert_eq!(per_worker.len(), 4);
        assert_eq!(per_worker.iter().sum::<u64>(), 120);
        assert_eq!(r["completed"].as_u64(), Some(120));
        // Virtual time: nothing can run late.
        assert!(r["engine_lateness"].is_null(), "{name}");
        assert!(r["send_lateness"].is_null(), "{name}");
        // The TTFT floor is under every policy's TTFT, and not trivially so.
        for k in ["mean", "p99"] {
            let floor = r["ttft_floor_ms"][k].as_f64().unwrap();
            let ttft = r["ttft_ms"][k].as_f64().unwrap();
            assert!(
                floor > 0.0 && floor <= ttft,
                "{name} {k}: floor {floor}, TTFT {ttft}"
            );
        }
    }
    assert!(stdout.contains("TTFT floor"), "{stdout}");
    // Round-robin splits 120 requests evenly over 4 workers.
    assert_eq!(
        obj["round-robin"]["requests_per_worker"],
        serde_json::json!([30, 30, 30, 30])
    );
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("kv-aware") && svg.contains("<polyline"));
    // One line per request and policy; the workers the lines name add up to the JSON's.
    let csv = std::fs::read_to_string(&outcomes).unwrap();
    let mut lines = csv.lines();
    assert!(
        lines
            .next()
            .unwrap()
            .starts_with("speed,policy,request,worker,")
    );
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert_eq!(rows.len(), 4 * 120);
    let mut rr = [0u64; 4];
    for r in rows.iter().filter(|r| r[1] == "round-robin") {
        rr[r[3].parse::<usize>().unwrap()] += 1;
        let (arrival, first): (f64, f64) = (r[4].parse().unwrap(), r[6].parse().unwrap());
        assert!(first > arrival, "{r:?}");
    }
    assert_eq!(rr, [30, 30, 30, 30]);
}

#[test]
fn bench_reads_a_trace_file_and_rejects_bad_usage() {
    let dir = TempDir::new("usage");
    let trace = dir.path().join("t.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\":0,\"input_length\":1024,\"output_length\":4,\"hash_ids\":[1,2]}\n\
         {\"timestamp\":10,\"input_length\":1024,\"output_length\":4,\"hash_ids\":[1,2]}\n",
    )
    .unwrap();
    let stdout = kvrouter_ok(&[
        "bench",
        "--trace",
        trace.to_str().unwrap(),
        "--workers",
        "2",
        "--policies",
        "kv-aware",
    ]);
    // The second request goes where the first one's blocks are: 50 % hits, the ideal.
    let row = stdout.lines().find(|l| l.starts_with("kv-aware")).unwrap();
    assert!(row.contains("50.0"), "{row}");

    for bad in [
        vec!["bench", "--policies", "fastest"],
        vec!["bench", "--workers", "0"],
        vec!["bench", "--block-size", "48"],
        vec!["bench", "--trace", "/nonexistent/trace.jsonl"],
    ] {
        let out = kvrouter(&bad);
        assert_eq!(out.status.code(), Some(2), "{bad:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("error"),
            "{bad:?}"
        );
    }
    std::fs::write(&trace, "{\"timestamp\":0,\"input_length\":\n").unwrap();
    let out = kvrouter(&["bench", "--trace", trace.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("trace line 1"));
}

#[test]
fn bench_with_a_shared_pool_onloads_across_workers() {
    let dir = TempDir::new("pool");
    let trace = dir.path().join("t.jsonl");
    let json = dir.path().join("out.json");
    // The second request comes after the first one's prefill has completed.
    std::fs::write(
        &trace,
        "{\"timestamp\":0,\"input_length\":1024,\"output_length\":4,\"hash_ids\":[1,2]}\n\
         {\"timestamp\":2000,\"input_length\":1024,\"output_length\":4,\"hash_ids\":[1,2]}\n",
    )
    .unwrap();
    let t = trace.to_str().unwrap();
    kvrouter_ok(&[
        "bench",
        "--trace",
        t,
        "--workers",
        "2",
        "--policies",
        "round-robin",
        "--pool-blocks",
        "64",
        "--shared-cache-multiplier",
        "0.5",
        "--json",
        json.to_str().unwrap(),
    ]);
    // Round-robin sends the second request to the other worker, which onloads the whole
    // prompt from the pool the first one wrote: half of all prompt blocks.
    let v: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let r = &v["round-robin"];
    assert_eq!(r["pool_hit_ratio"].as_f64(), Some(0.5), "{r}");
    assert_eq!(r["prefix_hit_ratio"].as_f64(), Some(0.0), "{r}");
    assert!(r["host_hit_ratio"].is_null());
    for bad in [
        vec![
            "bench",
            "--trace",
            t,
            "--pool-blocks",
            "64",
            "--pool-gbps",
            "0",
        ],
        vec!["bench", "--trace", t, "--shared-cache-multiplier", "-1"],
    ] {
        let out = kvrouter(&bad);
        assert_eq!(out.status.code(), Some(2), "{bad:?}");
    }
}

/// Processes whose command line contains `needle` (from /proc).
fn processes_with(needle: &str) -> usize {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| std::fs::read(e.ok()?.path().join("cmdline")).ok())
        .filter(|c| {
            String::from_utf8_lossy(c)
                .replace('\0', " ")
                .contains(needle)
        })
        .count()
}

/// Runs the networked bench (`extra` flags added) on 3 conversations of 4 turns over 2
/// workers with kv-aware and round-robin, and checks what both modes promise.
fn networked_bench(tag: &str, extra: &[&str]) -> Value {
    let nats = kvrouter_tests::NatsServer::start();
    let dir = TempDir::new(tag);
    // 3 conversations of 4 turns; each turn extends the previous prompt by 2 blocks.
    let mut lines = String::new();
    for turn in 0..4u64 {
        for conv in 0..3u64 {
            let ids: Vec<String> = (0..=turn * 2 + 1)
                .map(|k| (conv * 100 + k).to_string())
                .collect();
            lines += &format!(
                "{{\"timestamp\":{},\"input_length\":{},\"output_length\":8,\"hash_ids\":[{}]}}\n",
                turn * 500 + conv * 60,
                ids.len() * 512,
                ids.join(",")
            );
        }
    }
    let trace = dir.path().join("conv.jsonl");
    std::fs::write(&trace, lines).unwrap();
    let json = dir.path().join("net.json");
    let url = nats.url();
    let mut args = vec![
        "bench",
        "--nats",
        &url,
        "--trace",
        trace.to_str().unwrap(),
        "--workers",
        "2",
        "--engine-speedup",
        "20",
        "--policies",
        "kv-aware,round-robin",
        "--json",
        json.to_str().unwrap(),
        "--stall-timeout-secs",
        "20",
    ];
    args.extend_from_slice(extra);
    kvrouter_ok(&args);
    let v: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    for p in ["kv-aware", "round-robin"] {
        assert_eq!(v[p]["completed"].as_u64(), Some(12), "{p}: {v}");
        let per: u64 = v[p]["requests_per_worker"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .sum();
        assert_eq!(per, 12);
        assert!(v[p]["ttft_ms"]["p50"].as_f64().unwrap() > 0.0);
        // Both engines reported how late their steps ran, on every request they served:
        // each request's 8 tokens took 8 steps, 7 of them after another.
        let late = &v[p]["engine_lateness"];
        assert_eq!(late["complete"], true, "{p}: {late}");
        assert!(late["count"].as_u64().unwrap() >= 2 * 7, "{p}: {late}");
        // Every request was sent: how late, against its arrival time.
        let sends = &v[p]["send_lateness"];
        assert_eq!(sends["count"].as_u64(), Some(12), "{p}: {sends}");
        // The JSON contract (docs/HARNESS.md) of both.
        for l in [late, sends] {
            for k in ["p50_ms", "p99_ms", "max_ms", "share_over_1ms"] {
                assert!(l[k].is_f64(), "{p}: {k} in {l}");
            }
        }
    }
    // The router saw the engines' KV events: every later turn found its conversation's
    // cache (ideal: 9 of 12 requests hit), which round-robin over 2 workers cannot do for
    // 3 conversations.
    let kv = v["kv-aware"]["prefix_hit_ratio"].as_f64().unwrap();
    let rr = v["round-robin"]["prefix_hit_ratio"].as_f64().unwrap();
    let ideal = v["kv-aware"]["ideal_prefix_hit_ratio"].as_f64().unwrap();
    assert!(kv > 0.9 * ideal, "kv-aware {kv}, ideal {ideal}");
    assert!(kv > rr, "kv-aware {kv}, round-robin {rr}");
    // No engine or router process outlives the run.
    let started = std::time::Instant::now();
    while processes_with(&url) > 0 {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "child processes left behind"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    v
}

#[test]
fn bench_over_nats_runs_engine_processes_and_the_real_router() {
    networked_bench("nats", &[]);
}

/// The OpenAI mode: every request goes through the router's front as a streamed
/// completion to engines speaking the OpenAI API (our mock engine, `bench-engine
/// --openai`); round-robin is the router's `--router-mode`, and the hits are what the
/// engines report in `usage.prompt_tokens_details.cached_tokens`.
#[test]
fn bench_over_the_openai_front_covers_the_whole_request_path() {
    let v = networked_bench("openai", &["--openai"]);
    // Round-robin over 2 workers alternates exactly: 6 requests each.
    assert_eq!(
        v["round-robin"]["requests_per_worker"],
        serde_json::json!([6, 6]),
        "{v}"
    );
    // Every request streamed its 8 tokens: an inter-token gap was measured.
    assert!(
        v["kv-aware"]["itl_ms"]["mean"].as_f64().unwrap() > 0.0,
        "{v}"
    );
}

#[test]
fn bench_sweeps_the_load_and_reads_zstd_traces() {
    let dir = TempDir::new("sweep");
    // The bundled sample's first 150 requests, compressed.
    let text: String = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../bench/data/mooncake_conversation_sample.jsonl"
    ))
    .unwrap()
    .lines()
    .take(150)
    .map(|l| format!("{l}\n"))
    .collect();
    let trace = dir.path().join("t.jsonl.zst");
    std::fs::write(&trace, zstd::encode_all(text.as_bytes(), 3).unwrap()).unwrap();
    let json = dir.path().join("sweep.json");
    let plot = dir.path().join("sweep.svg");
    let stdout = kvrouter_ok(&[
        "bench",
        "--trace",
        trace.to_str().unwrap(),
        "--workers",
        "4",
        "--speed",
        "1,4",
        "--policies",
        "kv-aware,kv-time,round-robin",
        "--json",
        json.to_str().unwrap(),
        "--plot",
        plot.to_str().unwrap(),
    ]);
    assert!(stdout.contains("load sweep"), "{stdout}");
    assert!(stdout.contains("busiest w"), "{stdout}");
    let v: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let speeds = v.as_object().unwrap();
    assert_eq!(
        speeds.keys().collect::<Vec<_>>(),
        vec!["1", "4"],
        "one entry per load"
    );
    for (speed, policies) in speeds {
        let policies = policies.as_object().unwrap();
        assert_eq!(policies.len(), 3, "speed {speed}");
        for (name, r) in policies {
            assert_eq!(r["completed"].as_u64(), Some(150), "{speed} {name}");
            let u = &r["utilisation"];
            let busiest = u["busiest"]["requests"].as_u64().unwrap();
            let idlest = u["idlest"]["requests"].as_u64().unwrap();
            assert!(busiest >= idlest, "{speed} {name}");
            assert!(!u["busiest"]["series"].as_array().unwrap().is_empty());
        }
    }
    // Four times the load: the same work waits at least as long.
    let mean = |s: &str| v[s]["round-robin"]["ttft_ms"]["mean"].as_f64().unwrap();
    assert!(mean("4") >= mean("1"), "{} < {}", mean("4"), mean("1"));
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("kv-time") && svg.contains("p99 TTFT"));
    // A sweep is in-process only; an empty or bad list is refused.
    for bad in [
        &["--speed", "1,0"][..],
        &["--speed", "1,x"][..],
        &["--speed", "1,1"][..],
        &["--decode-delay-weight", "-1"][..],
    ] {
        let out = kvrouter(&[&["bench", "--limit", "5"][..], bad].concat());
        assert!(!out.status.success(), "{bad:?}");
    }
}
