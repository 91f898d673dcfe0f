//! The OpenAI front's added latency and CPU cost per request.
//!
//! A mock engine that answers at once (ours, in this process: a streaming chat answer of one
//! token and `[DONE]` the moment the request is read; with `--max-tokens N`, N chunks of
//! one token, `--itl-ms` apart) serves an open-loop load of streaming
//! chat requests, first directly, then through `kvrouter serve --openai-listen` (the real
//! binary, its own process: tokenisation with the model card, the routing decision, the
//! relay). TTFT is from a request's send to the first byte of its answer body's first
//! chunk (with one-token answers, the `data:` event itself); the
//! added latency is the proxied TTFT's percentile minus the direct one's. The kvrouter
//! process's CPU time over the phase gives its CPU per request, and per streamed chunk
//! (the client counts the `data:` events of every answer).
//!
//! With `--dynamo-venv`, the same load goes to Dynamo 1.6.1's frontend (`--router-mode kv`)
//! in front of its mocker with `--speedup-ratio 0` (no simulated delays), and the frontend
//! process's CPU per request is reported next to ours. Its TTFT includes the mocker's own
//! request plane, so only the CPU figure compares like with like.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use kvrouter_io::http::chunked;
use memchr::memmem;
use serde::Serialize;

use crate::child::{Reaped, free_port, wait_port};
use crate::perf::percentile;

/// One phase of the load.
#[derive(Debug, Clone, Serialize)]
pub struct Phase {
    /// What was measured (`direct`, `kvrouter`, `dynamo`).
    pub target: &'static str,
    /// Requests per second asked for.
    pub rate: f64,
    /// Requests answered (measured window).
    pub requests: u64,
    /// Requests that failed (status, connection, framing).
    pub errors: u64,
    /// Requests sent later than their schedule by more than 1 ms (the client fell behind).
    pub late: u64,
    /// Requests answered per second over the window as it really ran (below `rate` when
    /// the server, or the machine, could not keep up).
    pub achieved_rps: f64,
    /// TTFT median, µs.
    pub ttft_p50_us: f64,
    /// TTFT 99th percentile, µs.
    pub ttft_p99_us: f64,
    /// CPU milliseconds per request of the measured server process (none for `direct`).
    pub cpu_ms_per_request: Option<f64>,
    /// Streamed chunks (`data:` events before `[DONE]`) the client received per answer.
    pub chunks_per_request: f64,
    /// Socket reads that brought the client an answer, per answer: as many as the chunks
    /// when each came on its own, fewer when they arrived together.
    pub reads_per_request: f64,
    /// CPU microseconds of the measured server process per streamed chunk relayed.
    pub cpu_us_per_chunk: Option<f64>,
}

/// Settings (the flags of `kvrouter-bench proxy`).
#[derive(Debug, Clone, clap::Args)]
pub struct ProxyBench {
    /// The kvrouter binary.
    #[arg(long, default_value = "target/release/kvrouter")]
    pub kvrouter: PathBuf,
    /// Model card directory (tokenizer.json, tokenizer_config.json).
    #[arg(long, default_value = "target/tiny-model")]
    pub model: PathBuf,
    /// Requests per second (comma list).
    #[arg(long, value_delimiter = ',', default_value = "1000,5000")]
    pub rates: Vec<f64>,
    /// Seconds measured per phase (after one second of warm-up).
    #[arg(long, default_value_t = 5.0)]
    pub seconds: f64,
    /// Client connections.
    #[arg(long, default_value_t = 32)]
    pub connections: usize,
    /// Words of each request's system prompt (200 words: about 520 tokens with the tiny
    /// card).
    #[arg(long, default_value_t = 200)]
    pub prompt_words: usize,
    /// Words of each request's question after the system prompt, different in every request
    /// (0: the same "hello" in every request, so that every body is the same).
    #[arg(long, default_value_t = 0)]
    pub question_words: usize,
    /// Appends every measured request to this file, one line each: target, rate, the
    /// send time (µs after the phase's start, warm-up included), TTFT (µs) and the
    /// client connection. Stalls that recur at a period show there as slow requests at
    /// that period, which percentiles hide.
    #[arg(long)]
    pub latency_log: Option<PathBuf>,
    /// Dynamo's venv (`../shared/dynamo/setup.sh`): measure its frontend too.
    #[arg(long)]
    pub dynamo_venv: Option<PathBuf>,
    /// Tokens each request asks for (`max_tokens`): the mock engine streams that many
    /// chunks of one token each before `[DONE]`, so the relay of long answers is measured
    /// (1: one chunk, the routing and first-byte path alone).
    #[arg(long, default_value_t = 1)]
    pub max_tokens: u32,
    /// The mock engine's pause between two chunks of an answer, ms (0: written back to
    /// back, which lets the chunks of one answer reach the front together). Dynamo's
    /// mocker keeps its own pace (none with `--speedup-ratio 0`).
    #[arg(long, default_value_t = 0.0)]
    pub itl_ms: f64,
}

/// CPU seconds (user + system) of process `pid` so far.
fn cpu_s(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the command name (which may hold spaces): utime is the 14th field.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

/// How the mock engine answers: `tokens` chunks of one token, `itl` apart.
#[derive(Debug, Clone, Copy)]
struct Answer {
    tokens: u32,
    itl: Duration,
}

/// The mock engine: every request answered at once (its first chunk as soon as it is
/// read), keep-alive, a thread per connection.
fn mock_engine(stop: Arc<AtomicBool>, answer: Answer) -> anyhow::Result<String> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?.to_string();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            // A bare flag (no data travels with it): pairs with the store when the run
            // ends; seen at the next connection.
            if stop.load(Ordering::Relaxed) {
                return;
            }
            let Ok(conn) = conn else { continue };
            std::thread::spawn(move || {
                let _ = engine_conn(conn, answer);
            });
        }
    });
    Ok(addr)
}

fn engine_conn(conn: TcpStream, answer: Answer) -> std::io::Result<()> {
    conn.set_nodelay(true)?;
    let mut r = BufReader::new(conn.try_clone()?);
    let mut w = conn;
    let chunk = |s: &str| format!("{:x}\r\n{s}\r\n", s.len());
    let event = |finish: &str| {
        chunk(&format!(
            "data: {{\"id\":\"b\",\"object\":\"chat.completion.chunk\",\"model\":\"tiny\",\"choices\":[{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":\"ok\"}},\"finish_reason\":{finish}}}]}}\n\n"
        ))
    };
    let head =
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
    let (token, last) = (event("null"), event("\"stop\""));
    let end = format!("{}0\r\n\r\n", chunk("data: [DONE]\n\n"));
    // One token: the whole answer in one write, as before streams were measured.
    let whole = format!("{head}{last}{end}");
    loop {
        let mut len = 0usize;
        let mut line = String::new();
        loop {
            line.clear();
            if r.read_line(&mut line)? == 0 {
                return Ok(());
            }
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':')
                && k.eq_ignore_ascii_case("content-length")
            {
                len = v.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0; len];
        r.read_exact(&mut body)?;
        if answer.tokens <= 1 {
            w.write_all(whole.as_bytes())?;
            continue;
        }
        w.write_all(format!("{head}{token}").as_bytes())?;
        for k in 1..answer.tokens {
            if !answer.itl.is_zero() {
                std::thread::sleep(answer.itl);
            }
            if k + 1 == answer.tokens {
                w.write_all(format!("{last}{end}").as_bytes())?;
            } else {
                w.write_all(token.as_bytes())?;
            }
        }
    }
}

/// One streaming request on a keep-alive connection: its TTFT (ns), the chunks it
/// streamed (`data:` events before `[DONE]`) and the socket reads that brought its answer
/// (fewer reads than chunks: chunks arrived together), or why it failed.
fn one(
    conn: &mut TcpStream,
    head: &[u8],
    body: &[u8],
    buf: &mut Vec<u8>,
) -> anyhow::Result<(u64, u64, u64)> {
    let t = Instant::now();
    conn.write_all(head)?;
    conn.write_all(body)?;
    buf.clear();
    let mut ttft = None;
    let mut body_at = None;
    let mut chunk = [0u8; 8192];
    let mut reads = 0;
    loop {
        let n = conn.read(&mut chunk)?;
        anyhow::ensure!(n > 0, "connection closed mid-answer");
        reads += 1;
        buf.extend_from_slice(&chunk[..n]);
        let end = match body_at {
            Some(end) => end,
            None => {
                let Some(end) = memmem::find(buf, b"\r\n\r\n") else {
                    continue;
                };
                anyhow::ensure!(
                    buf.starts_with(b"HTTP/1.1 200"),
                    "status: {:?}",
                    String::from_utf8_lossy(&buf[..buf.len().min(64)])
                );
                body_at = Some(end);
                end
            }
        };
        // The first byte of the body's first chunk (a relay may split an event across
        // its chunks, so `data:` itself may not have arrived whole yet).
        if ttft.is_none()
            && memmem::find(&buf[end + 4..], b"\r\n")
                .is_some_and(|line| buf.len() > end + 4 + line + 2)
        {
            ttft = Some(t.elapsed().as_nanos() as u64);
        }
        if buf.ends_with(b"\r\n0\r\n\r\n") {
            // Counted in the decoded body, for the same reason.
            let sse = chunked::dechunk(&buf[end + 4..]).context("a malformed chunked body")?;
            let events = count(&sse, b"data:");
            let done = count(&sse, b"data: [DONE]");
            anyhow::ensure!(events > done, "an answer without data");
            return Ok((
                ttft.context("an answer without data")?,
                events - done,
                reads,
            ));
        }
    }
}

fn count(hay: &[u8], needle: &[u8]) -> u64 {
    memmem::find_iter(hay, needle).count() as u64
}

/// The request bodies, each with its HTTP head.
type Bodies = Arc<Vec<(Vec<u8>, Vec<u8>)>>;

/// One measured request: when it was due (µs after the phase's start), its TTFT (ns) and
/// its connection.
type Sample = (u64, u64, usize);

/// What a load measured: its samples (in no order), errors, late sends, the rate
/// achieved, and the requests answered and chunks streamed, warm-up included.
struct Measured {
    samples: Vec<Sample>,
    errors: u64,
    late: u64,
    rps: f64,
    answered: u64,
    chunks: u64,
    reads: u64,
}

/// An open-loop load at `rate` on `connections` keep-alive connections to `addr`: one
/// second of warm-up, then `seconds` measured.
fn load(
    addr: &str,
    rate: f64,
    seconds: f64,
    connections: usize,
    (bodies, first): (&Bodies, usize),
) -> anyhow::Result<Measured> {
    let warm = Duration::from_secs(1);
    let start = Instant::now() + Duration::from_millis(100);
    let total = warm + Duration::from_secs_f64(seconds);
    let per = connections as f64 / rate;
    let threads: Vec<_> = (0..connections)
        .map(|i| {
            let (addr, bodies) = (addr.to_owned(), Arc::clone(bodies));
            std::thread::spawn(move || -> (Vec<Sample>, u64, u64, Instant, [u64; 3]) {
                let (mut lat, mut errors, mut late) = (Vec::new(), 0u64, 0u64);
                let mut conn = None;
                let mut buf = Vec::new();
                let mut k = 0u64;
                let (mut done, mut chunks, mut reads) = (0u64, 0u64, 0u64);
                loop {
                    let at = start + Duration::from_secs_f64(i as f64 / rate + k as f64 * per);
                    k += 1;
                    if at >= start + total {
                        return (lat, errors, late, Instant::now(), [done, chunks, reads]);
                    }
                    let now = Instant::now();
                    if at > now {
                        std::thread::sleep(at - now);
                    } else if now - at > Duration::from_millis(1) && at >= start + warm {
                        late += 1;
                    }
                    if conn.is_none() {
                        conn = TcpStream::connect(&addr).ok().inspect(|c| {
                            let _ = c.set_nodelay(true);
                        });
                    }
                    let Some(c) = conn.as_mut() else {
                        errors += 1;
                        continue;
                    };
                    // Connection i sends bodies first + i, first + i + connections, ...:
                    // each once per cycle of the list.
                    let at_body = first + i + (k as usize - 1) * connections;
                    let (head, body) = &bodies[at_body % bodies.len()];
                    match one(c, head, body, &mut buf) {
                        Ok((t, n, r)) => {
                            done += 1;
                            chunks += n;
                            reads += r;
                            if at >= start + warm {
                                lat.push(((at - start).as_micros() as u64, t, i));
                            }
                        }
                        Err(_) => {
                            conn = None;
                            if at >= start + warm {
                                errors += 1;
                            }
                        }
                    }
                }
            })
        })
        .collect();
    let (mut lat, mut errors, mut late) = (Vec::new(), 0, 0);
    let mut last = start;
    let (mut all, mut all_chunks, mut all_reads) = (0u64, 0u64, 0u64);
    for t in threads {
        let (l, e, s, end, [d, c, r]) = t
            .join()
            .map_err(|_| anyhow::anyhow!("a client thread panicked"))?;
        lat.extend(l);
        last = last.max(end);
        all += d;
        all_chunks += c;
        all_reads += r;
        errors += e;
        late += s;
    }
    // Over the measured window as it really ran: a client that fell behind ran longer.
    let window = last
        .saturating_duration_since(start + warm)
        .as_secs_f64()
        .max(seconds * 1e-3);
    let rps = lat.len() as f64 / window;
    Ok(Measured {
        samples: lat,
        errors,
        late,
        rps,
        answered: all,
        chunks: all_chunks,
        reads: all_reads,
    })
}

fn phase(
    target: &'static str,
    rate: f64,
    m: Measured,
    cpu: Option<f64>,
    log: Option<&Path>,
) -> anyhow::Result<Phase> {
    let mut samples = m.samples;
    samples.sort_unstable();
    if let Some(path) = log {
        write_samples(path, target, rate, &samples)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let mut lat: Vec<u64> = samples.iter().map(|s| s.1).collect();
    lat.sort_unstable();
    let requests = lat.len() as u64;
    Ok(Phase {
        target,
        rate,
        requests,
        errors: m.errors,
        late: m.late,
        achieved_rps: m.rps,
        ttft_p50_us: percentile(&lat, 0.5) as f64 / 1e3,
        ttft_p99_us: percentile(&lat, 0.99) as f64 / 1e3,
        // The CPU time covers the warm-up too: divided by every request answered.
        cpu_ms_per_request: cpu.map(|c| c * 1e3 / m.answered.max(1) as f64),
        chunks_per_request: m.chunks as f64 / m.answered.max(1) as f64,
        reads_per_request: m.reads as f64 / m.answered.max(1) as f64,
        cpu_us_per_chunk: cpu.map(|c| c * 1e6 / m.chunks.max(1) as f64),
    })
}

/// Appends a phase's samples (in the order they were due) to the latency log.
fn write_samples(path: &Path, target: &str, rate: f64, samples: &[Sample]) -> std::io::Result<()> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    let mut w = std::io::BufWriter::new(file);
    for &(at_us, ttft_ns, conn) in samples {
        writeln!(w, "{target} {rate} {at_us} {} {conn}", ttft_ns / 1000)?;
    }
    w.flush()
}

/// The requests the phases send, each with its HTTP head: one system prompt of `words`
/// words, and a question of `question_words` words different in each of `n` bodies
/// ("hello" in one body when 0).
fn request_bodies(
    words: usize,
    question_words: usize,
    n: usize,
    max_tokens: u32,
) -> Vec<(Vec<u8>, Vec<u8>)> {
    let system: String = (0..words).map(|i| format!("w{} ", i % 97)).collect();
    let n = if question_words == 0 { 1 } else { n };
    (0..n)
        .map(|q| {
            let question = if question_words == 0 {
                "hello".to_owned()
            } else {
                // The first word makes each question its own.
                std::iter::once(format!("n{q} "))
                    .chain((1..question_words).map(|i| format!("q{} ", (q * 131 + i * 17) % 4099)))
                    .collect()
            };
            let body = serde_json::to_vec(&serde_json::json!({
                "model": "tiny", "stream": true, "max_tokens": max_tokens,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            }))
            .expect("json");
            let head = format!(
                "POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                body.len()
            )
            .into_bytes();
            (head, body)
        })
        .collect()
}

/// Runs every phase at every rate: direct, through kvrouter, and (with a venv) Dynamo.
pub fn run(cfg: &ProxyBench) -> anyhow::Result<Vec<Phase>> {
    // With questions, every request a phase sends, warm-up included, is one no earlier
    // phase sent: kvrouter's piece cache would otherwise answer a later phase's questions
    // from an earlier one's (or from its own warm-up at high rates), and the measured
    // window would see none of them new. Each rate gets its own range of bodies.
    let per_rate: Vec<usize> = cfg
        .rates
        .iter()
        .map(|&r| (r * (cfg.seconds + 1.0)).ceil() as usize + cfg.connections)
        .collect();
    let bodies = Arc::new(request_bodies(
        cfg.prompt_words,
        cfg.question_words,
        per_rate.iter().sum(),
        cfg.max_tokens.max(1),
    ));
    let firsts: Vec<usize> = per_rate
        .iter()
        .scan(0, |at, &n| {
            let first = *at;
            *at += n;
            Some(first)
        })
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let answer = Answer {
        tokens: cfg.max_tokens.max(1),
        itl: Duration::from_secs_f64(cfg.itl_ms.max(0.0) / 1e3),
    };
    let engine = mock_engine(Arc::clone(&stop), answer)?;
    let openai = format!("127.0.0.1:{}", free_port()?);
    let kv = Reaped(
        Command::new(&cfg.kvrouter)
            .args([
                "serve",
                "--nats",
                "off",
                "--kv-events",
                "false",
                "--replica-sync",
                "false",
            ])
            .args([
                "--listen",
                "127.0.0.1:0",
                "--workers",
                "1",
                "--openai-listen",
                &openai,
            ])
            .arg("--model")
            .arg(format!("tiny={}", cfg.model.display()))
            .args(["--worker-url", &format!("1=http://{engine}")])
            .env("KVROUTER_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", cfg.kvrouter.display()))?,
    );
    wait_port(&openai, "kvrouter's OpenAI front", Duration::from_secs(20))?;
    let dynamo = match &cfg.dynamo_venv {
        Some(venv) => Some(dynamo_stack(venv, &cfg.model)?),
        None => None,
    };
    let mut out = Vec::new();
    let log = cfg.latency_log.as_deref();
    for (&rate, &first) in cfg.rates.iter().zip(&firsts) {
        let bodies = (&bodies, first);
        let direct = load(&engine, rate, cfg.seconds, cfg.connections, bodies)?;
        out.push(phase("direct", rate, direct, None, log)?);
        let c0 = cpu_s(kv.0.id());
        let r = load(&openai, rate, cfg.seconds, cfg.connections, bodies)?;
        // The warm-up second is in the CPU time too: scale to the measured window.
        let c = cpu_s(kv.0.id()) - c0;
        out.push(phase("kvrouter", rate, r, Some(c), log)?);
        if let Some(d) = &dynamo {
            let c0 = cpu_s(d.frontend.0.id());
            let r = load(&d.addr, rate, cfg.seconds, cfg.connections, bodies)?;
            let c = cpu_s(d.frontend.0.id()) - c0;
            out.push(phase("dynamo", rate, r, Some(c), log)?);
        }
    }
    stop.store(true, Ordering::Relaxed);
    drop(kv);
    Ok(out)
}

struct DynamoStack {
    _mocker: Reaped,
    frontend: Reaped,
    addr: String,
    _dir: PathBuf,
}

/// Dynamo 1.6.1's mocker (no simulated delays) and its frontend in `kv` mode.
fn dynamo_stack(venv: &Path, model: &Path) -> anyhow::Result<DynamoStack> {
    let dir = std::env::temp_dir().join(format!("kvrouter-proxy-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let py = |args: &[&str], log: &str| -> anyhow::Result<Reaped> {
        Ok(Reaped(
            Command::new(venv.join("bin/python"))
                .args(args)
                .env("DYN_FILE_KV", &dir)
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
                .stdout(std::fs::File::create(dir.join(format!("{log}.log")))?)
                .stderr(std::fs::File::create(dir.join(format!("{log}.err")))?)
                .spawn()?,
        ))
    };
    let m = model.to_string_lossy();
    let plane = [
        "--discovery-backend",
        "file",
        "--event-plane",
        "zmq",
        "--request-plane",
        "tcp",
    ];
    let mut args = vec![
        "-m",
        "dynamo.mocker",
        "--model-path",
        &m,
        "--model-name",
        "tiny",
    ];
    args.extend([
        "--num-workers",
        "1",
        "--block-size",
        "16",
        "--speedup-ratio",
        "0",
    ]);
    args.extend(plane);
    let mocker = py(&args, "mocker")?;
    let port = free_port()?.to_string();
    let mut args = vec![
        "-m",
        "dynamo.frontend",
        "--http-host",
        "127.0.0.1",
        "--http-port",
        &port,
    ];
    args.extend(["--router-mode", "kv"]);
    args.extend(plane);
    let frontend = py(&args, "frontend")?;
    let addr = format!("127.0.0.1:{port}");
    let t = Instant::now();
    loop {
        anyhow::ensure!(
            t.elapsed() < Duration::from_secs(120),
            "Dynamo's frontend did not list the model"
        );
        if let Ok(mut c) = TcpStream::connect(&addr) {
            let _ = write!(
                c,
                "GET /v1/models HTTP/1.1\r\nhost: b\r\nconnection: close\r\n\r\n"
            );
            let mut s = String::new();
            let _ = c.read_to_string(&mut s);
            if s.contains("tiny") {
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(DynamoStack {
        _mocker: mocker,
        frontend,
        addr,
        _dir: dir,
    })
}

/// Tokenisation cost: a chat request of about `n` prompt tokens rendered with the card's
/// template and encoded, by the tokenizer crate (the piece cache off) and as the front
/// does for a prompt it has not seen (in pieces, by the byte-level encoder where the card
/// allows it; `examples/token_cost.rs` also times a session's next turn); (tokens, median
/// µs of 5 each way, whether the front's encoder is the byte-level one).
pub fn tokenisation(model: &Path, sizes: &[usize]) -> anyhow::Result<Vec<(usize, f64, f64, bool)>> {
    use kvrouter_io::proxy::model::ModelCard;
    let crate_only = ModelCard::load_with(model, 0)?;
    let front = ModelCard::load(model)?;
    // Past the card's first prompts, which the front also encodes whole to check them.
    for k in 0..kvrouter_io::proxy::pieces::VERIFY_FIRST {
        front.chat_tokens(&chat(&format!("warm-up {k}")))?;
    }
    let median = |card: &ModelCard, text: &str| -> anyhow::Result<(usize, f64)> {
        let mut times = Vec::new();
        let mut tokens = 0;
        for k in 0..5 {
            // Unseen each time: a piece once encoded is kept.
            let req = chat(&format!("{k} {text}"));
            let t = Instant::now();
            tokens = card.chat_tokens(&req)?.len();
            times.push(t.elapsed().as_nanos() as u64);
        }
        times.sort_unstable();
        Ok((tokens, times[2] as f64 / 1e3))
    };
    let mut out = Vec::new();
    for &n in sizes {
        let text: String = (0..n).map(|i| format!("w{} ", i % 997)).collect();
        let (tokens, whole) = median(&crate_only, &text)?;
        let (_, pieces) = median(&front, &text)?;
        out.push((tokens, whole, pieces, front.byte_level()));
    }
    Ok(out)
}

/// A chat request of one user message.
fn chat(text: &str) -> serde_json::Value {
    serde_json::json!({"model": "tiny", "messages": [{"role": "user", "content": text}]})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_split_event_is_counted_once_in_the_decoded_body() {
        // A relay re-chunked `data: {...}\n\n` mid-word: the raw bytes hold no whole
        // `data:` for it; the decoded body does.
        let body = b"2\r\nda\r\nf\r\nta: {\"a\":1}\n\nda\r\nc\r\nta: [DONE]\n\n\r\n0\r\n\r\n";
        let sse = chunked::dechunk(body).expect("well framed");
        assert_eq!(sse, b"data: {\"a\":1}\n\ndata: [DONE]\n\n".to_vec());
        assert_eq!(
            (count(&sse, b"data:"), count(&sse, b"data: [DONE]")),
            (2, 1)
        );
    }

    #[test]
    fn the_mock_engine_streams_the_tokens_asked_for() {
        let stop = Arc::new(AtomicBool::new(false));
        let answer = Answer {
            tokens: 7,
            itl: Duration::from_millis(1),
        };
        let addr = mock_engine(Arc::clone(&stop), answer).expect("engine");
        let (head, body) = request_bodies(3, 0, 1, 7).remove(0);
        let mut conn = TcpStream::connect(&addr).expect("connect");
        let mut buf = Vec::new();
        for _ in 0..2 {
            // Twice on one connection: keep-alive holds across streamed answers.
            let (ttft, chunks, reads) = one(&mut conn, &head, &body, &mut buf).expect("answer");
            assert!(ttft > 0);
            assert_eq!(chunks, 7);
            assert!((1..=8).contains(&reads), "{reads} reads");
        }
        stop.store(true, Ordering::Relaxed);
    }
}
