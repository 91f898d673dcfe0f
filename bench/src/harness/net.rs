//! The networked mode (`kvrouter bench --nats URL`): the same trace and mock engines, but in
//! wall-clock time and across processes. Each engine is its own process (`kvrouter
//! bench-engine`) that takes jobs over NATS, publishes its KV events through the worker
//! library (`KvPublisher`, Dynamo's wire format) and reports first tokens and completions
//! over NATS. KV-aware policies are decided by a real `kvrouter serve` process over HTTP,
//! which ingests those events; the cache-blind policies are decided by the load generator.
//!
//! Subjects, under a namespace unique to each policy run:
//!
//! | subject | from → to | payload |
//! |---|---|---|
//! | `kvbench.{ns}.engine.{i}` | load generator → engine `i` | [`Job`] (JSON) |
//! | `kvbench.{ns}.progress` | engines → load generator | [`Progress`] (JSON) |
//! | `namespace.{ns}.component.backend.endpoint.generate.kv-events` | engines → router | Dynamo's KV events |
//!
//! Engine processes exit when their stdin closes, so none outlives the load generator.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvrouter_core::codec::Subjects;
use kvrouter_core::hash::{
    HashOptions, LocalBlockHash, SequenceBlockHash, local_block_hashes, sequence_hashes,
};
use kvrouter_core::policy::{CostConfig, Formula, Rng};
use kvrouter_io::nats::{Client, Options};
use kvrouter_io::worker::{KvPublisher, PublisherOptions};
use serde::{Deserialize, Serialize};

use super::engine::{Engine, EngineConfig, EngineRequest};
use super::openai::{self, HttpJob, Tok};
use super::pacing::{Lateness, LatenessSummary, Pacer};
use super::report::{PolicyReport, RequestOutcome};
use super::sim::{Ideals, Policy, SimConfig};
use super::trace::TraceRequest;
use crate::child::{Reaped, free_port, wait_port};

/// One request for an engine.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Job {
    /// Request index in the trace.
    pub id: usize,
    /// Prompt tokens.
    pub input_length: u32,
    /// Tokens to generate.
    pub output_length: u32,
    /// The trace's 512-token block ids (the engine derives tokens and hashes).
    pub hash_ids: Vec<u64>,
}

/// What an engine reports after a step (or once, when it is ready).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Progress {
    /// Engine index.
    pub w: usize,
    /// Set once, when the engine is subscribed and announced.
    #[serde(default)]
    pub ready: bool,
    /// Requests that produced their first token in this step.
    #[serde(default)]
    pub first: Vec<usize>,
    /// Requests that finished: (id, mean inter-token gap in ms, tokens generated).
    #[serde(default)]
    pub done: Vec<(usize, f64, u32)>,
    /// Prompt blocks served from the cache so far.
    #[serde(default)]
    pub hit: u64,
    /// Prompt blocks so far.
    #[serde(default)]
    pub prompt: u64,
    /// With `ready`, in the OpenAI mode: the port of the engine's OpenAI API.
    #[serde(default)]
    pub port: Option<u16>,
    /// Sent each time the engine runs out of work: how late its steps ran so far.
    #[serde(default)]
    pub late: Option<Lateness>,
}

fn job_subject(ns: &str, w: usize) -> String {
    format!("kvbench.{ns}.engine.{w}")
}

fn progress_subject(ns: &str) -> String {
    format!("kvbench.{ns}.progress")
}

fn subjects(ns: &str) -> Subjects {
    Subjects {
        namespace: ns.to_owned(),
        ..Subjects::default()
    }
}

/// Settings of one engine process.
#[derive(Debug, Clone)]
pub struct EngineProcess {
    /// NATS server URL.
    pub nats: String,
    /// Namespace of the run.
    pub namespace: String,
    /// Engine index (worker id = index + 1).
    pub index: usize,
    /// Engine model.
    pub engine: EngineConfig,
    /// Take jobs as OpenAI completions over HTTP ([`super::openai`]) instead of over NATS.
    pub openai: bool,
}

/// Runs one engine until its stdin closes (or the NATS connection is lost for good).
pub fn run_engine_process(p: EngineProcess) -> anyhow::Result<()> {
    // The parent closes our stdin when it is done or gone.
    std::thread::spawn(|| {
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
        std::process::exit(0);
    });
    let handle = glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
        .name("kvbench-engine")
        .io_memory(512 << 10)
        .spawn(move || async move { engine_loop(p).await })
        .map_err(|e| anyhow::anyhow!("engine executor: {e}"))?;
    handle
        .join()
        .map_err(|e| anyhow::anyhow!("engine executor: {e}"))?
}

fn decode_job(payload: &[u8], block_size: u32) -> anyhow::Result<EngineRequest> {
    let job: Job = serde_json::from_slice(payload).context("malformed job")?;
    let r = TraceRequest {
        timestamp: 0,
        input_length: job.input_length,
        output_length: job.output_length,
        hash_ids: job.hash_ids,
    };
    let locals = local_block_hashes(&r.tokens(), block_size, &HashOptions::default());
    let blocks: Vec<(LocalBlockHash, SequenceBlockHash)> = locals
        .iter()
        .copied()
        .zip(sequence_hashes(&locals))
        .collect();
    Ok(EngineRequest::new(
        job.id,
        job.input_length,
        job.output_length.max(1),
        blocks,
    ))
}

async fn engine_loop(p: EngineProcess) -> anyhow::Result<()> {
    let client = Client::connect(Options {
        servers: vec![p.nats.clone()],
        name: format!("kvbench-engine-{}", p.index),
        ..Options::default()
    })
    .await?;
    let jobs = client.subscribe(&job_subject(&p.namespace, p.index), None)?;
    let worker_id = p.index as u64 + 1;
    let publisher = KvPublisher::start(
        client.clone(),
        PublisherOptions {
            subjects: subjects(&p.namespace),
            ..PublisherOptions::new(worker_id)
        },
    )
    .await?;
    let progress = progress_subject(&p.namespace);
    let (http_tx, http) = flume::unbounded::<HttpJob>();
    let port = if p.openai {
        Some(openai::serve_engine(p.engine.block_size, http_tx)?)
    } else {
        drop(http_tx);
        None
    };
    let ready = Progress {
        w: p.index,
        ready: true,
        port,
        ..Progress::default()
    };
    client
        .publish(&progress, &serde_json::to_vec(&ready)?)
        .await?;
    client.flush(Duration::from_secs(5)).await?;
    let mut engine = Engine::new(worker_id, p.engine);
    let mut pacer = Pacer::default();
    // Requests finished, and whether a step ran since the lateness was last sent.
    let (mut finished, mut stepped) = (0u64, false);
    // When the newest request was taken in (a step never starts before it, on the model's
    // clock).
    let mut arrived = Instant::now();
    // Per running request: time of its latest token, sum of gaps, tokens.
    let mut tokens: HashMap<usize, (Instant, f64, u32)> = HashMap::new();
    let mut bad_jobs = 0u64;
    let mut submit =
        |engine: &mut Engine, payload: &[u8]| match decode_job(payload, p.engine.block_size) {
            Ok(r) => engine.submit(r),
            Err(e) => {
                bad_jobs += 1;
                tracing::warn!(error = %e, bad_jobs, "bench engine: job dropped");
            }
        };
    // The OpenAI mode's connections, by request.
    let mut conns: HashMap<usize, flume::Sender<Tok>> = HashMap::new();
    let take = |j: HttpJob, engine: &mut Engine, conns: &mut HashMap<_, _>| {
        conns.insert(j.request.id, j.tokens);
        engine.submit(j.request);
    };
    loop {
        if p.openai {
            while let Ok(j) = http.try_recv() {
                take(j, &mut engine, &mut conns);
                arrived = Instant::now();
            }
        } else {
            while let Some(m) = jobs.try_next() {
                submit(&mut engine, &m.payload);
                arrived = Instant::now();
            }
        }
        if !engine.busy() {
            pacer.idle();
            if stepped {
                stepped = false;
                let idle = Progress {
                    w: p.index,
                    hit: engine.hit_blocks,
                    prompt: engine.prompt_blocks,
                    late: Some(pacer.lateness(finished)),
                    ..Progress::default()
                };
                client
                    .publish(&progress, &serde_json::to_vec(&idle)?)
                    .await?;
            }
            if p.openai {
                match http.recv_async().await {
                    Ok(j) => take(j, &mut engine, &mut conns),
                    Err(_) => return Ok(()),
                }
            } else {
                match jobs.next().await {
                    Some(m) => submit(&mut engine, &m.payload),
                    None => return Ok(()),
                }
            }
            continue;
        }
        let Some((ms, out)) = engine.step() else {
            continue;
        };
        stepped = true;
        finished += out.finished.len() as u64;
        let end = pacer.step(Instant::now(), arrived, ms);
        // A timer whose deadline has passed is ready at once and yields nothing: the floor
        // makes every step a real sleep, so the NATS connection and the HTTP tasks on this
        // executor run while the engine catches up (the pacer counts the floor as lateness
        // and makes it up too).
        glommio::timer::sleep(
            end.saturating_duration_since(Instant::now())
                .max(Duration::from_micros(20)),
        )
        .await;
        for e in engine.take_events() {
            publisher
                .publish(e.event.dp_rank, vec![e.event.data])
                .await?;
        }
        if p.openai {
            // A connection that is gone drops its receiver: its sends fail, harmlessly.
            for (id, &cached_blocks) in out.first_tokens.iter().zip(&out.first_cached) {
                if let Some(tx) = conns.get(id) {
                    let _ = tx.send(Tok::First { cached_blocks });
                }
            }
            for id in &out.tokens {
                if let Some(tx) = conns.get(id) {
                    let _ = tx.send(Tok::Token);
                }
            }
            for id in &out.finished {
                if let Some(tx) = conns.remove(id) {
                    let _ = tx.send(Tok::Done);
                }
            }
            continue;
        }
        let now = Instant::now();
        let mut report = Progress {
            w: p.index,
            hit: engine.hit_blocks,
            prompt: engine.prompt_blocks,
            ..Progress::default()
        };
        for id in out.first_tokens {
            tokens.insert(id, (now, 0.0, 1));
            report.first.push(id);
        }
        for id in out.tokens {
            if let Some(t) = tokens.get_mut(&id) {
                t.1 += now.duration_since(t.0).as_secs_f64() * 1000.0;
                t.0 = now;
                t.2 += 1;
            }
        }
        for id in out.finished {
            let (_, gaps, n) = tokens.remove(&id).unwrap_or((now, 0.0, 1));
            report
                .done
                .push((id, if n > 1 { gaps / (n - 1) as f64 } else { 0.0 }, n));
        }
        if !report.first.is_empty() || !report.done.is_empty() {
            client
                .publish(&progress, &serde_json::to_vec(&report)?)
                .await?;
        }
    }
}

/// Settings of a networked run.
#[derive(Debug, Clone)]
pub struct NetConfig {
    /// NATS server URL.
    pub nats: String,
    /// The `kvrouter` executable (engines and the router are spawned from it).
    pub exe: PathBuf,
    /// Workers, speed, seed, engine model and cost weights.
    pub sim: SimConfig,
    /// Give up when no engine reports anything for this long while requests are pending
    /// (in the OpenAI mode: when an answer is silent this long).
    pub stall_timeout: Duration,
    /// Send every request through the router's OpenAI front ([`super::openai`]).
    pub openai: bool,
}

/// A keep-alive HTTP connection to the router.
struct RouterApi {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl RouterApi {
    fn connect(addr: &str) -> anyhow::Result<Self> {
        let stream = TcpStream::connect(addr)
            .with_context(|| format!("connecting to the router at {addr}"))?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(Duration::from_secs(30)))?;
        Ok(RouterApi {
            stream,
            buf: Vec::new(),
        })
    }

    /// The body of the router's answer to a call, which must succeed (2xx).
    fn call(&mut self, method: &str, path: &str, body: &[u8]) -> anyhow::Result<Vec<u8>> {
        let answer =
            crate::route::request_with(&mut self.stream, &mut self.buf, method, path, "", body)
                .with_context(|| format!("router {method} {path}"))?;
        // `buf` holds the whole answer, its status line first.
        if !self.buf.starts_with(b"HTTP/1.1 2") {
            let status = self.buf.split(|&b| b == b'\r').next().unwrap_or_default();
            bail!(
                "router {method} {path}: {} {}",
                String::from_utf8_lossy(status),
                String::from_utf8_lossy(&answer[..answer.len().min(300)])
            );
        }
        Ok(answer)
    }
}

/// How many route calls the load generator has in flight at most (the NATS mode).
const ROUTE_CALLS: usize = 4;

/// The load generator's side of the router's API in the NATS mode, as a gateway in front of
/// a fleet has it. Each request is routed on one of [`ROUTE_CALLS`] threads, each with a
/// connection of its own, which then sends its job to the chosen engine; the first-token
/// and free calls go out in order on one more. Routed on the load generator's own thread,
/// one answer at a time, a request that arrived while the router parsed and hashed another
/// agentic prompt (megabytes of JSON) waited for that answer, and for the calls ahead of it.
struct Gateway<'s> {
    /// Requests to route, by index in the trace.
    route: flume::Sender<usize>,
    /// Requests routed, each sent before its job goes out, so before any progress on it,
    /// and any thread's error, which ends the run.
    routed: flume::Receiver<anyhow::Result<Routed>>,
    /// The paths of `first_token` and `free` calls.
    control: flume::Sender<String>,
    threads: Vec<std::thread::ScopedJoinHandle<'s, ()>>,
}

/// A request the router has placed.
struct Routed {
    request: usize,
    /// Engine index.
    worker: usize,
    /// How late its route call went out against its arrival time.
    late_ms: f64,
}

impl<'s> Gateway<'s> {
    /// Starts the threads, on `scope`, that call the router at `addr`; `late` says how late
    /// a request is now.
    fn start<'e: 's>(
        scope: &'s std::thread::Scope<'s, 'e>,
        addr: &'e str,
        trace: &'e [TraceRequest],
        ns: &'e str,
        engines: usize,
        publish: &flume::Sender<(String, Vec<u8>)>,
        late: &'e (dyn Fn(usize) -> f64 + Sync),
    ) -> Self {
        let (route, queue) = flume::unbounded::<usize>();
        let (routed_tx, routed) = flume::unbounded();
        let (control, calls) = flume::unbounded::<String>();
        let mut threads = Vec::with_capacity(ROUTE_CALLS + 1);
        for _ in 0..ROUTE_CALLS {
            let (queue, tx, publish) = (queue.clone(), routed_tx.clone(), publish.clone());
            threads.push(scope.spawn(move || {
                let run = || -> anyhow::Result<()> {
                    let mut api = RouterApi::connect(addr)?;
                    // The route request's body, reused.
                    let mut body = Vec::new();
                    for i in queue.iter() {
                        let late_ms = late(i);
                        let worker = route_one(&mut api, &mut body, &trace[i], i, engines)?;
                        if tx
                            .send(Ok(Routed {
                                request: i,
                                worker,
                                late_ms,
                            }))
                            .is_err()
                        {
                            return Ok(());
                        }
                        publish
                            .send(job(ns, &trace[i], i, worker)?)
                            .map_err(|_| anyhow::anyhow!("NATS side stopped"))?;
                    }
                    Ok(())
                };
                if let Err(e) = run() {
                    let _ = tx.send(Err(e));
                }
            }));
        }
        let tx = routed_tx;
        threads.push(scope.spawn(move || {
            let run = || -> anyhow::Result<()> {
                let mut api = RouterApi::connect(addr)?;
                for path in calls.iter() {
                    api.call("POST", &path, b"")?;
                }
                Ok(())
            };
            if let Err(e) = run() {
                let _ = tx.send(Err(e));
            }
        }));
        Gateway {
            route,
            routed,
            control,
            threads,
        }
    }

    /// Queues request `i` to be routed.
    fn route(&self, i: usize) -> anyhow::Result<()> {
        match self.route.send(i) {
            Ok(()) => Ok(()),
            Err(_) => Err(self.why("the route calls stopped")),
        }
    }

    /// Queues a call of `path` (no body) after those before it.
    fn call(&self, path: String) -> anyhow::Result<()> {
        match self.control.send(path) {
            Ok(()) => Ok(()),
            Err(_) => Err(self.why("the router's control calls stopped")),
        }
    }

    /// Why a thread stopped: the error it left, or else `stopped`.
    fn why(&self, stopped: &str) -> anyhow::Error {
        self.routed
            .try_iter()
            .find_map(Result::err)
            .unwrap_or_else(|| anyhow::anyhow!("{stopped}"))
    }

    /// Lets the threads finish the calls queued and returns the first error any of them met.
    fn finish(self) -> anyhow::Result<()> {
        let Gateway {
            route,
            routed,
            control,
            threads,
        } = self;
        drop((route, control));
        for t in threads {
            t.join()
                .map_err(|_| anyhow::anyhow!("a thread calling the router panicked"))?;
        }
        match routed.try_iter().find_map(Result::err) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Routes request `i` over `api`: the engine index the router chose.
fn route_one(
    api: &mut RouterApi,
    body: &mut Vec<u8>,
    r: &TraceRequest,
    i: usize,
    engines: usize,
) -> anyhow::Result<usize> {
    route_body(body, r.token_ids(), i);
    let bytes = api.call("POST", "/v1/route", body)?;
    let answer: RouteAnswer = serde_json::from_slice(&bytes).with_context(|| {
        let text = String::from_utf8_lossy(&bytes);
        format!(
            "router answer to r{i}: {}",
            text.chars().take(300).collect::<String>()
        )
    })?;
    (answer.worker_id as usize)
        .checked_sub(1)
        .filter(|&w| w < engines)
        .with_context(|| format!("router chose unknown worker {}", answer.worker_id))
}

/// Request `i`'s job for engine `w`, as a message to publish.
fn job(ns: &str, r: &TraceRequest, i: usize, w: usize) -> anyhow::Result<(String, Vec<u8>)> {
    let job = Job {
        id: i,
        input_length: r.input_length,
        output_length: r.output_length,
        hash_ids: r.hash_ids.clone(),
    };
    Ok((job_subject(ns, w), serde_json::to_vec(&job)?))
}

/// Writes the route body `{"token_ids":[...],"request_id":"r<request>"}` into `out`,
/// reused from one request to the next. An agentic prompt's body is megabytes; built as a
/// `serde_json::Value` and then printed, it took most of the load generator's time (the
/// kernel zeroing fresh pages for it half), and requests were sent up to 255 ms late.
fn route_body(out: &mut Vec<u8>, ids: impl Iterator<Item = u32>, request: usize) {
    out.clear();
    out.extend_from_slice(b"{\"token_ids\":[");
    let mut text = itoa::Buffer::new();
    for (k, id) in ids.enumerate() {
        if k > 0 {
            out.push(b',');
        }
        out.extend_from_slice(text.format(id).as_bytes());
    }
    out.extend_from_slice(b"],\"request_id\":\"r");
    out.extend_from_slice(text.format(request).as_bytes());
    out.extend_from_slice(b"\"}");
}

fn router_args(cfg: &NetConfig, ns: &str, policy: Policy) -> Vec<String> {
    let workers: Vec<String> = (1..=cfg.sim.workers).map(|w| w.to_string()).collect();
    let mut a: Vec<String> = [
        "serve",
        "--nats",
        &cfg.nats,
        "--listen",
        "127.0.0.1:0",
        "--namespace",
        ns,
        "--block-size",
        &cfg.sim.engine.block_size.to_string(),
        "--workers",
        &workers.join(","),
        "--seed",
        &cfg.sim.seed.to_string(),
        "--replica-sync",
        "false",
        "--shards",
        "1",
        // The load generator sends each prompt's token ids as JSON: an agentic prompt of
        // 900 k tokens is over 6 MB, past the API's default limit of 4 MiB.
        "--max-body-bytes",
        "67108864",
        // The load generator's connections may idle for minutes in a sparse trace (each
        // route thread's, and the control calls' until the first token).
        "--idle-timeout-secs",
        "86400",
        // A request may wait longer than the default 600 s for its first token in a slow
        // run; released as stale, it would leave the router's load and its free fail.
        "--stale-after-secs",
        "86400",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    // Dynamo runs Dynamo 1.6.1's weights; kv-time the time-based cost; ours the run's.
    let c = match policy {
        Policy::Dynamo => CostConfig::dynamo(),
        Policy::KvTime => CostConfig {
            formula: Formula::Time,
            ..cfg.sim.time
        },
        _ => cfg.sim.cost,
    };
    a.extend([
        "--overlap-score-credit".to_owned(),
        c.overlap_score_credit.to_string(),
        "--prefill-load-scale".to_owned(),
        c.prefill_load_scale.to_string(),
        "--new-block-weight".to_owned(),
        c.new_block_weight.to_string(),
        "--temperature".to_owned(),
        c.temperature.to_string(),
        "--credit-inflight".to_owned(),
        c.credit_inflight.to_string(),
        "--saturation-weight".to_owned(),
        c.saturation_weight.to_string(),
        "--return-weight".to_owned(),
        c.return_weight.to_string(),
        "--return-window-secs".to_owned(),
        c.return_window_secs.to_string(),
        "--cost-formula".to_owned(),
        match c.formula {
            Formula::Blocks => "blocks",
            Formula::Time => "time",
        }
        .to_owned(),
        "--decode-delay-weight".to_owned(),
        c.decode_delay_weight.to_string(),
    ]);
    if let Some(m) = c.max_active_decode_blocks {
        a.extend(["--max-active-decode-blocks".to_owned(), m.to_string()]);
    }
    if matches!(policy, Policy::KvAware | Policy::KvAwareP2c) && cfg.sim.remember_ms > 0 {
        a.extend([
            "--remember-decisions-secs".to_owned(),
            cfg.sim.remember_ms.div_ceil(1000).to_string(),
        ]);
    }
    match policy {
        Policy::KvAwareP2c => a.extend(["--herd-k".to_owned(), "3".to_owned()]),
        Policy::Approximate => a.extend(["--kv-events".to_owned(), "false".to_owned()]),
        _ => {}
    }
    a
}

/// A `kvrouter` child command, logging at `KVROUTER_LOG` (`warn` by default).
fn kvrouter(cfg: &NetConfig) -> Command {
    let mut c = Command::new(&cfg.exe);
    c.env(
        "KVROUTER_LOG",
        std::env::var("KVROUTER_LOG").unwrap_or_else(|_| "warn".into()),
    );
    c
}

fn spawn_router(
    cfg: &NetConfig,
    ns: &str,
    policy: Policy,
    extra: &[String],
) -> anyhow::Result<(Reaped, String)> {
    // The router stops when its stdin closes: the pipe's end lives in `child` (a `Child`
    // keeps its stdin open), so the router goes with this process however it ends, a
    // SIGTERM or SIGKILL included, as the engines do.
    let mut child = kvrouter(cfg)
        .args(router_args(cfg, ns, policy))
        .args(extra)
        .arg("--stop-on-stdin-eof")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting kvrouter serve")?;
    let stdout = child.stdout.take().context("router stdout")?;
    let child = Reaped(child);
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .context("router banner")?;
    let Some(addr) = line
        .trim()
        .rsplit("http://")
        .next()
        .filter(|a| !a.is_empty() && line.contains("http://"))
    else {
        bail!("kvrouter serve did not start: {line:?}");
    };
    Ok((child, addr.to_owned()))
}

fn spawn_engine(cfg: &NetConfig, ns: &str, index: usize) -> anyhow::Result<Reaped> {
    let e = &cfg.sim.engine;
    let child = kvrouter(cfg)
        .args([
            "bench-engine",
            "--nats",
            &cfg.nats,
            "--namespace",
            ns,
            "--index",
            &index.to_string(),
            "--block-size",
            &e.block_size.to_string(),
            "--kv-blocks",
            &e.capacity_blocks.to_string(),
            "--max-batch-tokens",
            &e.max_batch_tokens.to_string(),
            "--long-prefill-token-threshold",
            &e.long_prefill_token_threshold.to_string(),
            "--engine-speedup",
            &e.speedup.to_string(),
        ])
        .args(cfg.openai.then_some("--openai"))
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting a bench engine")?;
    Ok(Reaped(child))
}

/// The load generator's NATS side, on its own glommio executor: publishes what it is given
/// and forwards every progress message.
struct NatsSide {
    publish: flume::Sender<(String, Vec<u8>)>,
    progress: flume::Receiver<Vec<u8>>,
    thread: Option<glommio::ExecutorJoinHandle<()>>,
}

impl NatsSide {
    fn start(url: &str, ns: &str) -> anyhow::Result<Self> {
        let (publish, publish_rx) = flume::unbounded::<(String, Vec<u8>)>();
        let (progress_tx, progress) = flume::unbounded::<Vec<u8>>();
        let (up_tx, up_rx) = std::sync::mpsc::channel::<Result<(), String>>();
        let (url, subject) = (url.to_owned(), progress_subject(ns));
        let thread = glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
            .name("kvbench-nats")
            .io_memory(512 << 10)
            .spawn(move || async move {
                let client = match Client::connect(Options {
                    servers: vec![url],
                    name: "kvbench-loadgen".into(),
                    ..Options::default()
                })
                .await
                {
                    Ok(c) => c,
                    Err(e) => {
                        let _ = up_tx.send(Err(e.to_string()));
                        return;
                    }
                };
                let sub = match client.subscribe(&subject, None) {
                    Ok(s) => s,
                    Err(e) => {
                        let _ = up_tx.send(Err(e.to_string()));
                        return;
                    }
                };
                if let Err(e) = client.flush(Duration::from_secs(5)).await {
                    let _ = up_tx.send(Err(e.to_string()));
                    return;
                }
                let _ = up_tx.send(Ok(()));
                glommio::spawn_local(async move {
                    while let Some(m) = sub.next().await {
                        if progress_tx.send(m.payload).is_err() {
                            return;
                        }
                    }
                })
                .detach();
                while let Ok((subject, payload)) = publish_rx.recv_async().await {
                    if let Err(e) = client.publish(&subject, &payload).await {
                        tracing::warn!(error = %e, "bench: cannot publish a job");
                    }
                }
                let _ = client.flush(Duration::from_secs(2)).await;
                client.close();
            })
            .map_err(|e| anyhow::anyhow!("load generator executor: {e}"))?;
        up_rx
            .recv_timeout(Duration::from_secs(10))
            .map_err(|_| anyhow::anyhow!("no NATS connection within 10 s"))?
            .map_err(|e| anyhow::anyhow!("NATS {e}"))?;
        Ok(NatsSide {
            publish,
            progress,
            thread: Some(thread),
        })
    }
}

impl Drop for NatsSide {
    fn drop(&mut self) {
        let (tx, _) = flume::unbounded();
        drop(std::mem::replace(&mut self.publish, tx));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[derive(Debug, Deserialize)]
struct RouteAnswer {
    worker_id: u64,
}

/// Replays `trace` in wall-clock time through engine processes and (for KV-aware policies)
/// a router process; see the [module docs](self).
pub fn run_networked(
    trace: &[TraceRequest],
    policy: Policy,
    cfg: &NetConfig,
    ideals: &Ideals,
    mut progress: impl FnMut(usize),
) -> anyhow::Result<PolicyReport> {
    let n = cfg.sim.workers;
    let ns = format!(
        "kvbench{}{}",
        std::process::id(),
        policy.name().replace('-', "")
    );
    let nats = NatsSide::start(&cfg.nats, &ns)?;
    let mut engines = Vec::with_capacity(n);
    for i in 0..n {
        engines.push(spawn_engine(cfg, &ns, i)?);
    }
    let mut ready = vec![false; n];
    let mut ports = vec![None; n];
    let deadline = Instant::now() + Duration::from_secs(30);
    while ready.iter().any(|r| !r) {
        let left = deadline.saturating_duration_since(Instant::now());
        let m = nats
            .progress
            .recv_timeout(left)
            .map_err(|_| anyhow::anyhow!("engines not ready within 30 s"))?;
        if let Ok(p) = serde_json::from_slice::<Progress>(&m)
            && p.ready
            && p.w < n
        {
            ready[p.w] = true;
            ports[p.w] = p.port;
        }
    }
    if cfg.openai {
        let ports = ports
            .into_iter()
            .collect::<Option<Vec<u16>>>()
            .context("an engine did not report its OpenAI port")?;
        let out = run_openai(trace, policy, cfg, ideals, &ns, &ports, &nats, progress);
        drop(engines);
        drop(nats);
        return out;
    }
    let uses_router = matches!(
        policy,
        Policy::KvAware
            | Policy::KvTime
            | Policy::KvAwareP2c
            | Policy::Dynamo
            | Policy::Approximate
    );
    let router = if uses_router {
        Some(spawn_router(cfg, &ns, policy, &[])?)
    } else {
        None
    };

    let mut recs: Vec<Option<RequestOutcome>> = (0..trace.len()).map(|_| None).collect();
    let mut in_flight = vec![0u64; n];
    // Each engine's latest lateness.
    let mut late = LateReports::new(n);
    // How late each request was sent against its arrival time.
    let mut sent_late = Vec::with_capacity(trace.len());
    let mut rng = Rng::new(cfg.sim.seed);
    let mut rr = 0usize;
    let mut hits = vec![(0u64, 0u64); n];
    let (mut completed, mut next) = (0usize, 0usize);
    let t0 = trace.first().map_or(0, |r| r.timestamp) as f64;
    let arrival = |i: usize| (trace[i].timestamp as f64 - t0) / cfg.sim.speed;
    let start = Instant::now();
    let now_ms = || start.elapsed().as_secs_f64() * 1000.0;
    let late_now = |i: usize| now_ms() - arrival(i);
    let outcome = |i: usize, worker: usize| RequestOutcome {
        request: i,
        input_tokens: trace[i].input_length,
        cached_blocks: None,
        worker,
        arrival: arrival(i),
        admitted: None,
        first: None,
        done: None,
        itl: None,
    };
    let mut last_news = Instant::now();
    std::thread::scope(|s| -> anyhow::Result<()> {
        let gateway = router
            .as_ref()
            .map(|(_, addr)| Gateway::start(s, addr, trace, &ns, n, &nats.publish, &late_now));
        // Takes in the requests the gateway has routed (each before its job went out, so
        // before any progress on it).
        let routed = |recs: &mut Vec<Option<RequestOutcome>>,
                      in_flight: &mut Vec<u64>,
                      sent_late: &mut Vec<f64>|
         -> anyhow::Result<()> {
            for r in gateway.iter().flat_map(|g| g.routed.try_iter()) {
                let r = r?;
                sent_late.push(r.late_ms);
                in_flight[r.worker] += 1;
                recs[r.request] = Some(outcome(r.request, r.worker));
            }
            Ok(())
        };
        while completed < trace.len() {
            routed(&mut recs, &mut in_flight, &mut sent_late)?;
            let now = now_ms();
            if next < trace.len() && arrival(next) <= now {
                let i = next;
                next += 1;
                if let Some(g) = &gateway {
                    g.route(i)?;
                    continue;
                }
                sent_late.push(now - arrival(i));
                let w = match policy {
                    Policy::RoundRobin => {
                        rr += 1;
                        (rr - 1) % n
                    }
                    Policy::Random => rng.below(n),
                    _ => {
                        let min = *in_flight.iter().min().unwrap_or(&0);
                        let ties: Vec<usize> = (0..n).filter(|&k| in_flight[k] == min).collect();
                        ties[rng.below(ties.len())]
                    }
                };
                in_flight[w] += 1;
                recs[i] = Some(outcome(i, w));
                nats.publish
                    .send(job(&ns, &trace[i], i, w)?)
                    .map_err(|_| anyhow::anyhow!("NATS side stopped"))?;
                continue;
            }
            let wait = if next < trace.len() {
                (arrival(next) - now).max(0.0)
            } else {
                250.0
            };
            match nats
                .progress
                .recv_timeout(Duration::from_secs_f64(wait / 1000.0))
            {
                Ok(m) => {
                    let Ok(p) = serde_json::from_slice::<Progress>(&m) else {
                        tracing::warn!("bench: malformed progress message dropped");
                        continue;
                    };
                    routed(&mut recs, &mut in_flight, &mut sent_late)?;
                    last_news = Instant::now();
                    let at = now_ms();
                    if p.w < n {
                        hits[p.w] = (p.hit, p.prompt);
                    }
                    late.note(&p);
                    for id in p.first {
                        if let Some(Some(rec)) = recs.get_mut(id) {
                            rec.first = Some(at);
                            if let Some(g) = &gateway {
                                g.call(format!("/v1/requests/r{id}/first_token"))?;
                            }
                        }
                    }
                    for (id, itl, tokens) in p.done {
                        if let Some(Some(rec)) = recs.get_mut(id)
                            && rec.done.is_none()
                        {
                            rec.done = Some(at);
                            rec.itl = (tokens > 1).then_some(itl);
                            in_flight[rec.worker] = in_flight[rec.worker].saturating_sub(1);
                            completed += 1;
                            if completed.is_multiple_of(16) {
                                progress(completed);
                            }
                            if let Some(g) = &gateway {
                                g.call(format!("/v1/requests/r{id}/free"))?;
                            }
                        }
                    }
                }
                Err(flume::RecvTimeoutError::Timeout) => {
                    if next >= trace.len() && last_news.elapsed() > cfg.stall_timeout {
                        bail!(
                            "{}: no engine progress for {:?} with {} requests pending",
                            policy.name(),
                            cfg.stall_timeout,
                            trace.len() - completed
                        );
                    }
                }
                Err(flume::RecvTimeoutError::Disconnected) => bail!("NATS side stopped"),
            }
        }
        match gateway {
            Some(g) => g.finish(),
            None => Ok(()),
        }
    })?;
    progress(completed);
    let span_s = now_ms() / 1000.0;
    let outcomes: Vec<RequestOutcome> = recs.into_iter().flatten().collect();
    let hits = hits.iter().fold((0, 0), |(h, p), x| (h + x.0, p + x.1));
    let mut report = PolicyReport::from_outcomes(policy.name(), outcomes, n, span_s, hits, *ideals);
    // Each engine reports on the requests it served (while it still runs).
    report.engine_lateness =
        late.finish(&nats.progress, &report.requests_per_worker, REPORT_PATIENCE);
    report.send_lateness = LatenessSummary::of(&sent_late);
    drop(router);
    drop(engines);
    drop(nats);
    Ok(report)
}

/// How long the harness waits, after a run, for the engines' last lateness reports.
const REPORT_PATIENCE: Duration = Duration::from_secs(5);

/// The engines' latest lateness reports ([`Progress::late`]), by engine.
struct LateReports(Vec<Option<Lateness>>);

impl LateReports {
    fn new(engines: usize) -> Self {
        LateReports(vec![None; engines])
    }

    /// Keeps `p`'s report, if it has one (reports from one engine arrive in order).
    fn note(&mut self, p: &Progress) {
        if let (Some(l), Some(slot)) = (&p.late, self.0.get_mut(p.w)) {
            *slot = Some(l.clone());
        }
    }

    /// Reads the progress messages waiting on `progress`, keeping their reports.
    fn drain(&mut self, progress: &flume::Receiver<Vec<u8>>) {
        for m in progress.try_iter() {
            self.take(&m);
        }
    }

    fn take(&mut self, m: &[u8]) {
        match serde_json::from_slice::<Progress>(m) {
            Ok(p) => self.note(&p),
            Err(e) => tracing::warn!(error = %e, "bench: malformed progress message dropped"),
        }
    }

    /// Engines that have not reported on every request they were `sent`.
    fn behind(&self, sent: &[u64]) -> usize {
        sent.iter()
            .zip(&self.0)
            .filter(|&(&s, l)| s > 0 && l.as_ref().is_none_or(|l| l.finished < s))
            .count()
    }

    /// The run's step lateness: waits (`patience` at most) until each engine has reported on
    /// every request it was `sent`, takes whatever else is waiting (an engine's last
    /// report is its latest), then adds them up. An engine that did not report in time is
    /// counted by what it reported before, and the figure says it is incomplete.
    fn finish(
        mut self,
        progress: &flume::Receiver<Vec<u8>>,
        sent: &[u64],
        patience: Duration,
    ) -> Option<LatenessSummary> {
        let deadline = Instant::now() + patience;
        while self.behind(sent) > 0 {
            match progress.recv_deadline(deadline) {
                Ok(m) => self.take(&m),
                Err(_) => break,
            }
        }
        self.drain(progress);
        let behind = self.behind(sent);
        if behind > 0 {
            tracing::warn!(
                engines = behind,
                "bench: engines did not report on all their requests; their lateness is partial"
            );
        }
        let mut all = Lateness::default();
        for l in self.0.iter().flatten() {
            all.merge(l);
        }
        all.summary(behind == 0)
    }
}

/// The router's flags of the OpenAI mode, beside [`router_args`]: its front on `port`, the
/// bench's model card, the engines' URLs, deadlines no queue in a trace reaches, and the
/// cache-blind policies as router modes.
fn openai_args(policy: Policy, card: &std::path::Path, port: u16, engines: &[u16]) -> Vec<String> {
    let mut a = vec![
        "--openai-listen".to_owned(),
        format!("127.0.0.1:{port}"),
        "--model".to_owned(),
        format!("{}={}", openai::MODEL, card.display()),
        "--worker-url".to_owned(),
        engines
            .iter()
            .enumerate()
            .map(|(i, p)| format!("{}=http://127.0.0.1:{p}", i + 1))
            .collect::<Vec<_>>()
            .join(";"),
        "--openai-max-body-bytes".to_owned(),
        (256usize << 20).to_string(),
        "--upstream-first-byte-timeout-secs".to_owned(),
        "86400".to_owned(),
        "--upstream-idle-timeout-secs".to_owned(),
        "86400".to_owned(),
    ];
    let mode = match policy {
        Policy::RoundRobin => Some("round-robin"),
        Policy::Random => Some("random"),
        Policy::LeastLoaded => Some("least-loaded"),
        _ => None,
    };
    if let Some(m) = mode {
        a.extend(["--router-mode".to_owned(), m.to_owned()]);
    }
    a
}

/// The OpenAI mode of [`run_networked`], once the engines are up on `ports`: every policy
/// is decided by the router's front, every request sent to it as a streaming completion.
#[allow(clippy::too_many_arguments)]
fn run_openai(
    trace: &[TraceRequest],
    policy: Policy,
    cfg: &NetConfig,
    ideals: &Ideals,
    ns: &str,
    ports: &[u16],
    nats: &NatsSide,
    mut progress: impl FnMut(usize),
) -> anyhow::Result<PolicyReport> {
    let n = cfg.sim.workers;
    let card = std::env::temp_dir().join(format!("kvbench-card-{ns}"));
    openai::write_card(&card).context("writing the bench's model card")?;
    let port = free_port()?;
    // Removed when the run ends, whichever way.
    struct Card(std::path::PathBuf);
    impl Drop for Card {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let card = Card(card);
    let router = spawn_router(cfg, ns, policy, &openai_args(policy, &card.0, port, ports))?;
    let addr = format!("127.0.0.1:{port}");
    wait_port(&addr, "the router's OpenAI front", Duration::from_secs(20))?;
    let block = u64::from(cfg.sim.engine.block_size);
    let mut recs: Vec<Option<RequestOutcome>> = (0..trace.len()).map(|_| None).collect();
    let (mut hit, mut prompt) = (0u64, 0u64);
    let mut sent_late = Vec::with_capacity(trace.len());
    // The engines' lateness reports come over NATS while their answers come over HTTP.
    let mut late = LateReports::new(n);
    let (mut completed, mut next) = (0usize, 0usize);
    let t0 = trace.first().map_or(0, |r| r.timestamp) as f64;
    let arrival = |i: usize| (trace[i].timestamp as f64 - t0) / cfg.sim.speed;
    let (tx, rx) = flume::unbounded::<(usize, anyhow::Result<openai::Answer>)>();
    // Every request is a task on one executor, started when it arrives: a thread each
    // cost about 1.5 MB a request in flight (its stack and the pages its allocator kept),
    // gigabytes when an overloaded front holds thousands, and a wake-up per token.
    let (jobs, queue) = flume::unbounded::<(usize, TraceRequest)>();
    let start = Instant::now();
    let timeout = cfg.stall_timeout;
    let loadgen = glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
        .name("kvbench-client")
        .io_memory(512 << 10)
        .spawn(move || async move {
            let client = openai::Client::new(addr, timeout);
            while let Ok((i, r)) = queue.recv_async().await {
                let (client, tx) = (client.clone(), tx.clone());
                glommio::spawn_local(async move {
                    let ids = || r.token_ids();
                    let answer = client.complete(i, ids, r.output_length.max(1), start).await;
                    let _ = tx.send((i, answer));
                })
                .detach();
            }
        })
        .map_err(|e| anyhow::anyhow!("starting the load generator's executor: {e}"))?;
    let now_ms = || start.elapsed().as_secs_f64() * 1000.0;
    while completed < trace.len() {
        let now = now_ms();
        if next < trace.len() && arrival(next) <= now {
            if jobs.send((next, trace[next].clone())).is_err() {
                // Its executor ended (a panic): say why.
                return Err(match loadgen.join() {
                    Err(e) => anyhow::anyhow!("the load generator's executor: {e}"),
                    Ok(()) => anyhow::anyhow!("the load generator stopped"),
                });
            }
            next += 1;
            continue;
        }
        let wait = if next < trace.len() {
            (arrival(next) - now).max(0.0)
        } else {
            250.0
        };
        match rx.recv_timeout(Duration::from_secs_f64(wait / 1000.0)) {
            Ok((i, answer)) => {
                // How many were in flight says whether the host kept up (an overloaded
                // front answers 408 to bodies its executor did not read in time).
                let a = answer.with_context(|| {
                    format!(
                        "{} over the OpenAI front, {} requests in flight, {:.0} s into the run",
                        policy.name(),
                        next - completed,
                        now_ms() / 1000.0
                    )
                })?;
                anyhow::ensure!(
                    a.worker < n,
                    "the front chose unknown worker {}",
                    a.worker + 1
                );
                recs[i] = Some(RequestOutcome {
                    request: i,
                    input_tokens: trace[i].input_length,
                    cached_blocks: Some(a.cached_tokens / block),
                    worker: a.worker,
                    arrival: arrival(i),
                    admitted: None,
                    first: Some(a.first_ms),
                    done: Some(a.done_ms),
                    itl: a.itl_ms,
                });
                sent_late.push(a.sent_ms - arrival(i));
                hit += a.cached_tokens / block;
                prompt += u64::from(trace[i].input_length) / block;
                completed += 1;
                if completed.is_multiple_of(16) {
                    progress(completed);
                }
            }
            Err(flume::RecvTimeoutError::Timeout) => {}
            Err(flume::RecvTimeoutError::Disconnected) => bail!("the load generator stopped"),
        }
        late.drain(&nats.progress);
    }
    progress(completed);
    let span_s = now_ms() / 1000.0;
    drop(jobs);
    loadgen
        .join()
        .map_err(|e| anyhow::anyhow!("the load generator's executor: {e}"))?;
    drop(router);
    let outcomes: Vec<RequestOutcome> = recs.into_iter().flatten().collect();
    let mut report =
        PolicyReport::from_outcomes(policy.name(), outcomes, n, span_s, (hit, prompt), *ideals);
    // The engines' reports waited on NATS while the answers came over HTTP.
    report.engine_lateness =
        late.finish(&nats.progress, &report.requests_per_worker, REPORT_PATIENCE);
    report.send_lateness = LatenessSummary::of(&sent_late);
    Ok(report)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_route_body_is_the_json_of_its_tokens() {
        let mut out = b"left over".to_vec();
        for (ids, request) in [(vec![], 0), (vec![0, 7, 4_294_967_295, 12], 1234)] {
            route_body(&mut out, ids.iter().copied(), request);
            let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
            assert_eq!(
                v,
                serde_json::json!({ "token_ids": ids, "request_id": format!("r{request}") })
            );
        }
    }

    /// A stand-in for the router's API (ours, for the gateway's threads alone): answers
    /// every `/v1/route` with `worker(request)`, a path with `missing` in it with a 404,
    /// every other call with `{}`, on each connection it accepts, and records each call's
    /// path and request id in `calls`.
    fn fake_router(
        worker: fn(usize) -> u64,
    ) -> (String, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
        use std::io::Write;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let calls = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = calls.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let (conn, seen) = (conn.unwrap(), seen.clone());
                std::thread::spawn(move || {
                    let mut r = BufReader::new(conn.try_clone().unwrap());
                    let mut w = conn;
                    loop {
                        let (mut path, mut len) = (String::new(), 0);
                        loop {
                            let mut line = String::new();
                            if r.read_line(&mut line).unwrap_or(0) == 0 {
                                return;
                            }
                            let l = line.trim_end();
                            if l.is_empty() {
                                break;
                            }
                            if path.is_empty() {
                                path = l.split(' ').nth(1).unwrap_or("").to_owned();
                            } else if let Some((k, v)) = l.split_once(':')
                                && k.eq_ignore_ascii_case("content-length")
                            {
                                len = v.trim().parse().unwrap();
                            }
                        }
                        let mut body = vec![0; len];
                        r.read_exact(&mut body).unwrap();
                        let mut status = "200 OK";
                        let answer = if path == "/v1/route" {
                            let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
                            let id = v["request_id"].as_str().unwrap().to_owned();
                            let i: usize = id[1..].parse().unwrap();
                            seen.lock().unwrap().push(format!("route {id}"));
                            format!("{{\"worker_id\":{}}}", worker(i))
                        } else if path.contains("missing") {
                            status = "404 Not Found";
                            r#"{"error":"unknown request"}"#.to_owned()
                        } else {
                            seen.lock().unwrap().push(path);
                            "{}".to_owned()
                        };
                        let head = format!(
                            "HTTP/1.1 {status}\r\nContent-Length: {}\r\n\r\n",
                            answer.len()
                        );
                        if w.write_all(head.as_bytes()).is_err()
                            || w.write_all(answer.as_bytes()).is_err()
                        {
                            return;
                        }
                    }
                });
            }
        });
        (addr, calls)
    }

    fn requests(count: usize) -> Vec<TraceRequest> {
        (0..count)
            .map(|i| TraceRequest {
                timestamp: i as u64,
                input_length: 1024 + i as u32,
                output_length: 3,
                hash_ids: vec![i as u64, 1_000 + i as u64],
            })
            .collect()
    }

    /// Requests routed on the gateway's threads: each once, its job published to the
    /// engine the router chose after the request is reported routed; the first-token and
    /// free calls reach the router in the order they were made.
    #[test]
    fn the_gateway_routes_each_request_once_and_keeps_its_calls_in_order() {
        let (addr, calls) = fake_router(|i| (i % 3) as u64 + 1);
        let trace = requests(40);
        let (publish, published) = flume::unbounded::<(String, Vec<u8>)>();
        let late = |i: usize| i as f64;
        let mut routed = Vec::new();
        let mut jobs = Vec::new();
        std::thread::scope(|s| {
            let g = Gateway::start(s, &addr, &trace, "ns", 3, &publish, &late);
            for i in 0..trace.len() {
                g.route(i).unwrap();
            }
            // Each job goes out after its request is reported routed.
            for (subject, m) in published.iter().take(trace.len()) {
                for r in g.routed.try_iter() {
                    let r = r.unwrap();
                    assert_eq!((r.worker, r.late_ms), (r.request % 3, r.request as f64));
                    routed.push(r.request);
                }
                let job: Job = serde_json::from_slice(&m).unwrap();
                assert!(routed.contains(&job.id), "r{} published first", job.id);
                jobs.push((subject, job));
            }
            for i in 0..trace.len() {
                g.call(format!("/v1/requests/r{i}/first_token")).unwrap();
                g.call(format!("/v1/requests/r{i}/free")).unwrap();
            }
            g.finish().unwrap();
        });
        routed.sort_unstable();
        assert_eq!(routed, (0..trace.len()).collect::<Vec<_>>());
        assert_eq!(published.try_iter().count(), 0);
        jobs.sort_by_key(|(_, j)| j.id);
        for ((subject, job), r) in jobs.iter().zip(&trace) {
            assert_eq!(subject, &job_subject("ns", job.id % 3));
            assert_eq!(
                (job.input_length, job.output_length, &job.hash_ids),
                (r.input_length, r.output_length, &r.hash_ids)
            );
        }
        let calls = calls.lock().unwrap();
        let mut routes: Vec<&String> = calls.iter().filter(|c| c.starts_with("route ")).collect();
        routes.sort_unstable();
        let mut each: Vec<String> = (0..trace.len()).map(|i| format!("route r{i}")).collect();
        each.sort_unstable();
        assert_eq!(routes, each.iter().collect::<Vec<_>>());
        let control: Vec<String> = calls
            .iter()
            .filter(|c| !c.starts_with("route "))
            .cloned()
            .collect();
        let expected: Vec<String> = (0..trace.len())
            .flat_map(|i| {
                [
                    format!("/v1/requests/r{i}/first_token"),
                    format!("/v1/requests/r{i}/free"),
                ]
            })
            .collect();
        assert_eq!(control, expected);
    }

    /// A router that names an engine the run does not have ends the run with that error,
    /// and nothing is published for the request; so does a call it refuses.
    #[test]
    fn a_route_to_an_unknown_engine_ends_the_run() {
        let (addr, _) = fake_router(|i| if i == 2 { 99 } else { 1 });
        let trace = requests(4);
        let (publish, published) = flume::unbounded::<(String, Vec<u8>)>();
        let late = |_: usize| 0.0;
        let err = std::thread::scope(|s| {
            let g = Gateway::start(s, &addr, &trace, "ns", 2, &publish, &late);
            g.route(2).unwrap();
            let err = g.routed.recv().unwrap().err().unwrap();
            assert!(g.finish().is_ok(), "the error was taken already");
            err
        });
        assert!(format!("{err:#}").contains("unknown worker 99"), "{err:#}");
        assert_eq!(published.try_iter().count(), 0);
        // The same error, left in the channel, comes out of `finish`.
        let err = std::thread::scope(|s| {
            let g = Gateway::start(s, &addr, &trace, "ns", 2, &publish, &late);
            g.route(0).unwrap();
            g.route(2).unwrap();
            g.finish().unwrap_err()
        });
        assert!(format!("{err:#}").contains("unknown worker 99"), "{err:#}");
        assert_eq!(published.try_iter().count(), 1);
        // A call the router refuses ends the run, with its status and answer.
        let err = std::thread::scope(|s| {
            let g = Gateway::start(s, &addr, &trace, "ns", 2, &publish, &late);
            g.call("/v1/requests/missing/free".into()).unwrap();
            g.finish().unwrap_err()
        });
        let text = format!("{err:#}");
        assert!(
            text.contains("404 Not Found") && text.contains("unknown request"),
            "{text}"
        );
    }

    /// A router that cannot be reached: the calls after the threads stopped fail with the
    /// reason they stopped, not only with the fact.
    #[test]
    fn a_call_after_the_threads_stopped_says_why() {
        let addr = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().to_string()
        };
        let trace = requests(1);
        let (publish, _published) = flume::unbounded::<(String, Vec<u8>)>();
        let late = |_: usize| 0.0;
        std::thread::scope(|s| {
            let g = Gateway::start(s, &addr, &trace, "ns", 1, &publish, &late);
            let deadline = Instant::now() + Duration::from_secs(10);
            while g.routed.len() < ROUTE_CALLS + 1 {
                assert!(Instant::now() < deadline, "the threads did not stop");
                std::thread::sleep(Duration::from_millis(5));
            }
            let err = g.route(0).unwrap_err();
            assert!(
                format!("{err:#}").contains("connecting to the router"),
                "{err:#}"
            );
            let err = g.call("/v1/requests/r0/free".into()).unwrap_err();
            assert!(
                format!("{err:#}").contains("connecting to the router"),
                "{err:#}"
            );
            assert!(g.finish().is_err());
        });
    }

    #[test]
    fn the_lateness_is_the_latest_report_of_every_engine() {
        let (tx, rx) = flume::unbounded::<Vec<u8>>();
        let report = |w: usize, finished: u64, steps: u64| {
            serde_json::to_vec(&Progress {
                w,
                late: Some(Lateness {
                    finished,
                    steps,
                    buckets: vec![(0, steps)],
                    ..Lateness::default()
                }),
                ..Progress::default()
            })
            .unwrap()
        };
        // Engine 0 was sent 3 requests: an early report, a malformed message, a report
        // from an engine that does not exist, the last report, and one more message
        // without a report. Engine 1 was sent nothing.
        for m in [
            report(0, 1, 10),
            b"{not json".to_vec(),
            report(7, 3, 1),
            report(0, 3, 40),
            serde_json::to_vec(&Progress::default()).unwrap(),
        ] {
            tx.send(m).unwrap();
        }
        let s = LateReports::new(2)
            .finish(&rx, &[3, 0], Duration::from_secs(5))
            .unwrap();
        assert_eq!((s.count, s.complete), (40, true));
        // An engine that never reports on all it was sent: the wait ends, and the figure
        // says it is partial.
        tx.send(report(0, 3, 40)).unwrap();
        tx.send(report(1, 1, 5)).unwrap();
        let started = Instant::now();
        let s = LateReports::new(2)
            .finish(&rx, &[3, 2], Duration::from_millis(50))
            .unwrap();
        assert!(started.elapsed() >= Duration::from_millis(50));
        assert_eq!((s.count, s.complete), (45, false));
        // Nobody reported anything.
        assert_eq!(
            LateReports::new(2).finish(&rx, &[0, 0], Duration::from_millis(1)),
            None
        );
    }

    /// The value after `flag` in `args`.
    fn value<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
        let i = args.iter().position(|a| a == flag)?;
        args.get(i + 1).map(String::as_str)
    }

    #[test]
    fn each_policy_runs_its_own_cost_in_the_router() {
        let cfg = NetConfig {
            nats: "nats://127.0.0.1:4222".into(),
            exe: PathBuf::from("kvrouter"),
            sim: SimConfig::default(),
            stall_timeout: Duration::from_secs(1),
            openai: false,
        };
        let args = |p| router_args(&cfg, "ns", p);
        // Dynamo's own weights, whatever the serve defaults are.
        let d = args(Policy::Dynamo);
        assert_eq!(value(&d, "--new-block-weight"), Some("0"));
        assert_eq!(value(&d, "--credit-inflight"), Some("false"));
        assert_eq!(value(&d, "--saturation-weight"), Some("0"));
        assert_eq!(value(&d, "--cost-formula"), Some("blocks"));
        let ours = args(Policy::KvAware);
        assert_eq!(value(&ours, "--new-block-weight"), Some("4"));
        assert_eq!(value(&ours, "--credit-inflight"), Some("true"));
        assert_eq!(value(&ours, "--saturation-weight"), Some("1"));
        let t = args(Policy::KvTime);
        assert_eq!(value(&t, "--cost-formula"), Some("time"));
        assert_eq!(value(&t, "--decode-delay-weight"), Some("1"));
        assert_eq!(
            value(&args(Policy::Approximate), "--kv-events"),
            Some("false")
        );
        assert_eq!(value(&args(Policy::KvAwareP2c), "--herd-k"), Some("3"));
        assert_eq!(value(&ours, "--remember-decisions-secs"), None);
        let remembering = NetConfig {
            sim: SimConfig {
                remember_ms: 600_000,
                ..SimConfig::default()
            },
            ..cfg.clone()
        };
        let r = router_args(&remembering, "ns", Policy::KvAware);
        assert_eq!(value(&r, "--remember-decisions-secs"), Some("600"));
        let r = router_args(&remembering, "ns", Policy::Dynamo);
        assert_eq!(value(&r, "--remember-decisions-secs"), None);
        // A busy threshold reaches our policies' routers, not Dynamo's.
        assert_eq!(value(&ours, "--max-active-decode-blocks"), None);
        let mut sim = SimConfig::default();
        sim.cost.max_active_decode_blocks = Some(50_000);
        sim.time.max_active_decode_blocks = Some(50_000);
        let busy = NetConfig { sim, ..cfg };
        for p in [Policy::KvAware, Policy::KvTime, Policy::Approximate] {
            let a = router_args(&busy, "ns", p);
            assert_eq!(value(&a, "--max-active-decode-blocks"), Some("50000"));
        }
        let d = router_args(&busy, "ns", Policy::Dynamo);
        assert_eq!(value(&d, "--max-active-decode-blocks"), None);
    }
}
