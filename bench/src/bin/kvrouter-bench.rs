//! `kvrouter-bench`: timed replays and side-by-side comparisons with Dynamo's indexer.
//!
//! ```text
//! kvrouter-bench perf LOG --index tree|reference|dynamo-radix|dynamo-crtc [--threads N] [--json]
//! kvrouter-bench concurrent LOG --index tree|dynamo-crtc [--writers N] [--readers N] [--passes 1] [--json]
//! kvrouter-bench compare LOG... [--runs 3] [--writers 2] [--readers 1] [--passes 5]
//! kvrouter-bench recovery [--blocks 1000000] [--workers 16] [--kvrouter target/release/kvrouter] [--runs 5]
//! ```
//!
//! `compare` runs every index in its own process (so that RSS figures are per index),
//! `--runs` times each, for every log given, and prints medians, our/Dynamo ratios, and a
//! summary of every log at the end. Dynamo's indexes need `--features dynamo`.
//!
//! `perf` counts the live heap (the binary's allocator is [`kvrouter_bench::heap`]), so
//! bytes per cached block come from what each index allocated, next to RSS growth.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use kvrouter_bench::concurrent::{self, ConcurrentReport};
use kvrouter_bench::perf::{self, LoadedLog, PerfReport};
use kvrouter_core::index::{ReferenceIndex, TreeIndex};
use serde_json::Value;

#[global_allocator]
static ALLOC: kvrouter_bench::heap::Counting = kvrouter_bench::heap::Counting;

#[derive(Debug, Parser)]
#[command(
    name = "kvrouter-bench",
    about = "Timed replays and comparisons with Dynamo's indexer"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// One timed sequential replay.
    Perf {
        /// Replay log.
        log: PathBuf,
        /// tree, reference, dynamo-radix or dynamo-crtc.
        #[arg(long, default_value = "tree")]
        index: String,
        /// Event threads of dynamo-crtc.
        #[arg(long, default_value_t = 2)]
        threads: usize,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// One concurrent run: writers apply every event while readers look up.
    Concurrent {
        /// Replay log.
        log: PathBuf,
        /// tree or dynamo-crtc.
        #[arg(long, default_value = "tree")]
        index: String,
        /// Writer (event) threads.
        #[arg(long, default_value_t = 2)]
        writers: usize,
        /// Reader threads.
        #[arg(long, default_value_t = 1)]
        readers: usize,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
        /// Apply the log's events this many times (each pass after the first starts with
        /// a `Cleared` event per worker), for a measurement window long enough that the
        /// scheduler's placement of the threads averages out.
        #[arg(long, default_value_t = 1)]
        passes: usize,
    },
    /// End-to-end ingest over NATS (workers publish the log's events; the router applies
    /// them), next to the broker's raw PUB/SUB rate for the same messages.
    Ingest {
        /// Replay log.
        log: PathBuf,
        /// NATS server.
        #[arg(long, default_value = "nats://127.0.0.1:4222")]
        nats: String,
        /// Shard cores of the ingest.
        #[arg(long, default_value_t = 1)]
        shards: usize,
        /// Runs (medians are printed).
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Pace the workers to this many block events per second (latency at a sustained
        /// load); as fast as possible when omitted.
        #[arg(long)]
        rate: Option<f64>,
    },
    /// End-to-end ingest of the vLLM-native ZMQ wire (pyzmq publishers play the log's
    /// workers), next to a raw pyzmq SUB loop on the same messages
    Zmq {
        /// Replay log.
        log: PathBuf,
        /// Python with pyzmq (default: the venv of scripts/pyenv.sh, made when missing).
        #[arg(long)]
        python: Option<PathBuf>,
        /// Shard cores of the ingest.
        #[arg(long, default_value_t = 1)]
        shards: usize,
        /// Runs (medians are printed).
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Pace the publishers to this many block events per second; as fast as they go
        /// when omitted.
        #[arg(long)]
        rate: Option<f64>,
        /// Tokens per block on the wire (default: the log's block size).
        #[arg(long)]
        block_tokens: Option<usize>,
    },
    /// The OpenAI front's added latency: streaming chat requests at each rate to a mock
    /// engine that answers at once, directly and through `kvrouter serve --openai-listen`
    /// (and Dynamo's frontend with `--dynamo-venv`), and the tokenisation cost.
    Proxy {
        #[command(flatten)]
        bench: kvrouter_bench::proxy::ProxyBench,
        /// Runs (medians are printed).
        #[arg(long, default_value_t = 3)]
        runs: usize,
    },
    /// Routing-API load generator over loopback, with the log's events loaded.
    Route {
        /// Replay log (events loaded, queries sent).
        log: PathBuf,
        /// Routes per second (0: as fast as possible, closed loop).
        #[arg(long, default_value_t = 10_000.0)]
        rate: f64,
        /// Seconds per run.
        #[arg(long, default_value_t = 5)]
        seconds: u64,
        /// Client connections.
        #[arg(long, default_value_t = 1)]
        connections: usize,
        /// Runs (medians are printed).
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Send the binary framing (little-endian hashes) instead of JSON.
        #[arg(long)]
        binary: bool,
        /// Send the queries to `/v1/overlaps` instead (client-side figures only).
        #[arg(long)]
        overlaps: bool,
        /// Routed requests kept active (spread over the connections; the oldest is freed
        /// when a route would pass it), as a fleet's running requests are; 0 frees each
        /// request at once.
        #[arg(long, default_value_t = 0)]
        active: usize,
    },
    /// Restart recovery: a `kvrouter serve` process restoring a snapshot of `--blocks`
    /// blocks, from spawn to serving.
    Recovery {
        /// Cached blocks in the snapshot.
        #[arg(long, default_value_t = 1_000_000)]
        blocks: u64,
        /// Workers holding them.
        #[arg(long, default_value_t = 16)]
        workers: u64,
        /// The kvrouter binary.
        #[arg(long, default_value = "target/release/kvrouter")]
        kvrouter: PathBuf,
        /// NATS server.
        #[arg(long, default_value = "nats://127.0.0.1:4222")]
        nats: String,
        /// Snapshot directory (a temporary one when absent).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Runs (medians are printed).
        #[arg(long, default_value_t = 5)]
        runs: usize,
    },
    /// Hostile-client soak of a `kvrouter serve` process: small routes at a fixed rate
    /// while huge, leaking, malformed, slow and flooding clients come and go (phases:
    /// baseline, huge, hostile, hostile-again, after); latency and RSS per phase.
    Hostile {
        /// The kvrouter binary.
        #[arg(long, default_value = "target/release/kvrouter")]
        kvrouter: PathBuf,
        /// NATS server.
        #[arg(long, default_value = "nats://127.0.0.1:4222")]
        nats: String,
        /// Seconds per phase.
        #[arg(long, default_value_t = 20)]
        seconds: u64,
        /// Small routes per second.
        #[arg(long, default_value_t = 1_000.0)]
        rate: f64,
        /// Blocks per small route.
        #[arg(long, default_value_t = 64)]
        small_blocks: usize,
        /// Blocks per huge route (also the router's --max-request-blocks).
        #[arg(long, default_value_t = 65_536)]
        huge_blocks: usize,
        /// Huge routes per second in the `huge` phase.
        #[arg(long, default_value_t = 20.0)]
        huge_rate: f64,
        /// Workers.
        #[arg(long, default_value_t = 16)]
        workers: u64,
        /// Slow clients held at once.
        #[arg(long, default_value_t = 200)]
        slow_clients: usize,
        /// Connections per flood burst.
        #[arg(long, default_value_t = 1_500)]
        flood: usize,
        /// The router's --max-connections.
        #[arg(long, default_value_t = 1_024)]
        max_connections: usize,
        /// The router's --max-active-blocks.
        #[arg(long, default_value_t = 4 << 20)]
        max_active_blocks: u64,
        /// The router's --header-timeout-secs.
        #[arg(long, default_value_t = 5)]
        header_timeout_secs: u64,
        /// Runs (each a fresh process; every run is printed, then the medians).
        #[arg(long, default_value_t = 3)]
        runs: usize,
    },
    /// Every index, each in its own process, `--runs` times, per log; medians and ratios.
    Compare {
        /// Replay logs (each compared in turn, then summarised together).
        #[arg(required = true, num_args = 1..)]
        logs: Vec<PathBuf>,
        /// Runs per index.
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Writer threads in concurrent mode (and Dynamo's event threads).
        #[arg(long, default_value_t = 2)]
        writers: usize,
        /// Reader threads in concurrent mode.
        #[arg(long, default_value_t = 1)]
        readers: usize,
        /// Passes over the log's events in concurrent mode (see `concurrent --passes`).
        #[arg(long, default_value_t = 5)]
        passes: usize,
    },
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Cmd::Perf {
            log,
            index,
            threads,
            json,
        } => {
            kvrouter_bench::heap::enable();
            let loaded = LoadedLog::load(&log)?;
            let report = perf_one(&loaded, &index, threads)?;
            emit(&report, json, print_perf)
        }
        Cmd::Concurrent {
            log,
            index,
            writers,
            readers,
            json,
            passes,
        } => {
            let loaded = LoadedLog::load(&log)?;
            let report = concurrent_one(&loaded, &index, writers, readers, passes)?;
            emit(&report, json, print_concurrent)
        }
        Cmd::Compare {
            logs,
            runs,
            writers,
            readers,
            passes,
        } => {
            let mut rows = Vec::new();
            for log in &logs {
                rows.push(compare(log, runs, writers, readers, passes)?);
            }
            print_summary(&rows, runs);
            Ok(())
        }
        Cmd::Route {
            log,
            rate,
            seconds,
            connections,
            runs,
            binary,
            overlaps,
            active,
        } => {
            let loaded = LoadedLog::load(&log)?;
            let mut reports = Vec::new();
            for run in 0..runs {
                let r = kvrouter_bench::route::run(
                    &loaded,
                    rate,
                    std::time::Duration::from_secs(seconds),
                    connections,
                    binary,
                    overlaps,
                    active,
                )?;
                eprintln!("run {}: {}", run + 1, serde_json::to_string(&r)?);
                reports.push(r);
            }
            let med = |f: fn(&kvrouter_bench::route::RouteReport) -> f64| {
                median(reports.iter().map(f).collect())
            };
            println!(
                "{} ({} cached blocks, {}, target {rate}/s, {connections} connection(s), {active} kept active, median of {runs}): {:.0} requests/s; \
                 client-side p50/p99/p999 {:.1}/{:.1}/{:.1} us; server-side decision p50/p99/p999 {:.1}/{:.1}/{:.1} us",
                if overlaps {
                    "/v1/overlaps"
                } else {
                    "/v1/route"
                },
                reports[0].cached_blocks,
                if binary { "binary framing" } else { "JSON" },
                med(|r| r.routes_per_s),
                med(|r| r.p50_ns as f64) / 1e3,
                med(|r| r.p99_ns as f64) / 1e3,
                med(|r| r.p999_ns as f64) / 1e3,
                med(|r| r.server_p50_ns as f64) / 1e3,
                med(|r| r.server_p99_ns as f64) / 1e3,
                med(|r| r.server_p999_ns as f64) / 1e3,
            );
            Ok(())
        }
        Cmd::Ingest {
            log,
            nats,
            shards,
            runs,
            rate,
        } => ingest(&log, &nats, shards, runs, rate),
        Cmd::Proxy { bench, runs } => proxy(&bench, runs),
        Cmd::Zmq {
            log,
            python,
            shards,
            runs,
            rate,
            block_tokens,
        } => zmq(&log, python, shards, runs, rate, block_tokens),
        Cmd::Hostile {
            kvrouter,
            nats,
            seconds,
            rate,
            small_blocks,
            huge_blocks,
            huge_rate,
            workers,
            slow_clients,
            flood,
            max_connections,
            max_active_blocks,
            header_timeout_secs,
            runs,
        } => {
            let cfg = kvrouter_bench::hostile::HostileConfig {
                workers,
                rate,
                small_blocks,
                huge_blocks,
                huge_rate,
                phase: std::time::Duration::from_secs(seconds),
                slow_clients,
                flood,
                max_connections,
                max_active_blocks,
                header_timeout_secs,
            };
            let mut reports = Vec::new();
            for run in 0..runs {
                let r = kvrouter_bench::hostile::run(&kvrouter, &nats, &cfg)?;
                eprintln!("run {}: {}", run + 1, serde_json::to_string(&r)?);
                reports.push(r);
            }
            println!(
                "hostile soak ({workers} workers, {rate} small routes/s of {small_blocks} blocks, huge routes of {huge_blocks} ({huge_rate}/s in `huge`), {seconds} s phases, median of {runs}):"
            );
            println!(
                "| phase | small routes | p50 us | p99 us | p999 us | max ms | failures | RSS start→end MB | peak MB |"
            );
            println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
            for (i, name) in reports[0].phases.iter().map(|p| p.phase).enumerate() {
                let med = |f: &dyn Fn(&kvrouter_bench::hostile::PhaseReport) -> f64| {
                    median(reports.iter().map(|r| f(&r.phases[i])).collect())
                };
                println!(
                    "| {name} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1} | {:.0} | {:.1} → {:.1} | {:.1} |",
                    med(&|p| p.routes as f64),
                    med(&|p| p.p50_ns as f64) / 1e3,
                    med(&|p| p.p99_ns as f64) / 1e3,
                    med(&|p| p.p999_ns as f64) / 1e3,
                    med(&|p| p.max_ns as f64) / 1e6,
                    med(&|p| p.failures as f64),
                    med(&|p| p.rss_start_kib as f64) / 1024.0,
                    med(&|p| p.rss_end_kib as f64) / 1024.0,
                    med(&|p| p.rss_peak_kib as f64) / 1024.0,
                );
            }
            let last = reports.last().map(|r| &r.hostile);
            println!(
                "hostile clients (last run): {}",
                serde_json::to_string(&last)?
            );
            Ok(())
        }
        Cmd::Recovery {
            blocks,
            workers,
            kvrouter,
            nats,
            dir,
            runs,
        } => {
            let dir = dir.unwrap_or_else(|| {
                std::env::temp_dir().join(format!("kvrouter-recovery-{}", std::process::id()))
            });
            let reports =
                kvrouter_bench::recovery::run(blocks, workers, &dir, &kvrouter, &nats, runs)?;
            let _ = std::fs::remove_dir_all(&dir);
            let med = |f: fn(&kvrouter_bench::recovery::RecoveryReport) -> f64| {
                median(reports.iter().map(f).collect())
            };
            let r = &reports[0];
            println!(
                "recovery ({} blocks, {} workers, snapshot {:.1} MB, median of {runs}): written in {:.0} ms \
                 (+ {:.0} ms of shard dump, {:.1} ms for its largest worker); in-process restore {:.0} ms; process start to serving {:.0} ms ({:.2} s per 1 M blocks)",
                r.blocks,
                r.workers,
                r.snapshot_bytes as f64 / 1e6,
                r.write_ms,
                med(|r| r.dump_ms),
                med(|r| r.worker_dump_max_ms),
                med(|r| r.restore_ms),
                med(|r| r.start_to_serving_ms),
                med(|r| r.start_to_serving_ms) / 1e3 / (r.blocks as f64 / 1e6),
            );
            Ok(())
        }
    }
}

fn ingest(
    log: &Path,
    nats: &str,
    shards: usize,
    runs: usize,
    rate: Option<f64>,
) -> anyhow::Result<()> {
    let loaded = LoadedLog::load(log)?;
    let mut reports = Vec::new();
    for run in 0..runs {
        let tag = format!("{}x{run}", std::process::id());
        let r = kvrouter_bench::ingest::run(&loaded, nats, shards, &tag, rate)?;
        eprintln!("run {}: {}", run + 1, serde_json::to_string(&r)?);
        reports.push(r);
    }
    let med = |f: fn(&kvrouter_bench::ingest::IngestReport) -> f64| {
        median(reports.iter().map(f).collect())
    };
    println!(
        "ingest ({shards} shard(s), median of {runs}): {:.2} M block events/s, arrival-to-visible p50 {:.0} us, \
         p99 {:.0} us; raw PUB/SUB of the same messages: {:.2} M block events/s (ingest/raw x{:.2})",
        med(|r| r.ingest_block_events_per_s) / 1e6,
        med(|r| r.visible_p50_ns as f64) / 1e3,
        med(|r| r.visible_p99_ns as f64) / 1e3,
        med(|r| r.raw_block_events_per_s) / 1e6,
        med(|r| r.ingest_block_events_per_s / r.raw_block_events_per_s),
    );
    Ok(())
}

fn zmq(
    log: &Path,
    python: Option<PathBuf>,
    shards: usize,
    runs: usize,
    rate: Option<f64>,
    block_tokens: Option<usize>,
) -> anyhow::Result<()> {
    let python = match python {
        Some(p) => p,
        None => {
            let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/pyenv.sh");
            let out = std::process::Command::new("bash").arg(script).output()?;
            anyhow::ensure!(out.status.success(), "scripts/pyenv.sh failed");
            PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
        }
    };
    let loaded = LoadedLog::load(log)?;
    let mut reports = Vec::new();
    for run in 0..runs {
        let r = kvrouter_bench::zmq_ingest::run(&loaded, &python, shards, rate, block_tokens)?;
        eprintln!("run {}: {}", run + 1, serde_json::to_string(&r)?);
        reports.push(r);
    }
    let med = |f: fn(&kvrouter_bench::zmq_ingest::ZmqIngestReport) -> f64| {
        median(reports.iter().map(f).collect())
    };
    println!(
        "zmq ingest ({shards} shard(s), {} tokens per block, median of {runs}): {:.2} M block events/s, arrival-to-visible p50 {:.0} us, \
         p99 {:.0} us; raw pyzmq SUB of the same messages: {:.2} M block events/s (ingest/raw x{:.2})\n\
         per core: ingest {:.2} M block events per CPU-second of its busiest thread (source {:.3} s, shard {:.3} s); \
         raw pyzmq SUB {:.2} M per CPU-second ({:.3} s); ingest/raw x{:.2}",
        reports[0].block_tokens,
        med(|r| r.ingest_block_events_per_s) / 1e6,
        med(|r| r.visible_p50_ns as f64) / 1e3,
        med(|r| r.visible_p99_ns as f64) / 1e3,
        med(|r| r.raw_block_events_per_s) / 1e6,
        med(|r| r.ingest_block_events_per_s / r.raw_block_events_per_s),
        med(|r| r.ingest_block_events_per_core_s) / 1e6,
        med(|r| r.source_cpu_s),
        med(|r| r.shard_cpu_s),
        med(|r| r.raw_block_events_per_cpu_s) / 1e6,
        med(|r| r.raw_cpu_s),
        med(|r| r.ingest_block_events_per_core_s / r.raw_block_events_per_cpu_s),
    );
    Ok(())
}

fn proxy(cfg: &kvrouter_bench::proxy::ProxyBench, runs: usize) -> anyhow::Result<()> {
    let mut all = Vec::new();
    for run in 0..runs {
        let phases = kvrouter_bench::proxy::run(cfg)?;
        for p in &phases {
            eprintln!("run {}: {}", run + 1, serde_json::to_string(p)?);
        }
        all.push(phases);
    }
    println!(
        "OpenAI front, streaming chat, {} connections, system prompt of {} words, {}, {} tokens per answer{}, median of {runs}:",
        cfg.connections,
        cfg.prompt_words,
        if cfg.question_words == 0 {
            "the same question in every request".to_owned()
        } else {
            format!(
                "a different question of {} words in each",
                cfg.question_words
            )
        },
        cfg.max_tokens.max(1),
        if cfg.max_tokens > 1 && cfg.itl_ms > 0.0 {
            format!(" {} ms apart", cfg.itl_ms)
        } else {
            String::new()
        },
    );
    for (i, p) in all[0].iter().enumerate() {
        let med = |f: &dyn Fn(&kvrouter_bench::proxy::Phase) -> f64| {
            median(all.iter().map(|ps| f(&ps[i])).collect())
        };
        let direct = all[0]
            .iter()
            .position(|d| d.target == "direct" && d.rate == p.rate)
            .expect("a direct phase at each rate");
        let added = |f: &dyn Fn(&kvrouter_bench::proxy::Phase) -> f64| {
            median(all.iter().map(|ps| f(&ps[i]) - f(&ps[direct])).collect())
        };
        println!(
            "  {:>8} at {:>5.0}/s: {:>7.0} answered/s, {} errors, {} late; TTFT p50 {:.0} us, p99 {:.0} us{}{}",
            p.target,
            p.rate,
            med(&|x| x.achieved_rps),
            med(&|x| x.errors as f64),
            med(&|x| x.late as f64),
            med(&|x| x.ttft_p50_us),
            med(&|x| x.ttft_p99_us),
            if p.target == "kvrouter" {
                format!(
                    "; added p50 {:.0} us, p99 {:.0} us",
                    added(&|x| x.ttft_p50_us),
                    added(&|x| x.ttft_p99_us)
                )
            } else {
                String::new()
            },
            match p.cpu_ms_per_request {
                Some(_) if cfg.max_tokens > 1 => format!(
                    "; {:.1} chunks in {:.1} reads per answer; {:.3} ms CPU per request, {:.1} us per chunk",
                    med(&|x| x.chunks_per_request),
                    med(&|x| x.reads_per_request),
                    med(&|x| x.cpu_ms_per_request.unwrap_or(f64::NAN)),
                    med(&|x| x.cpu_us_per_chunk.unwrap_or(f64::NAN))
                ),
                Some(_) => format!(
                    "; {:.3} ms CPU per request",
                    med(&|x| x.cpu_ms_per_request.unwrap_or(f64::NAN))
                ),
                None if cfg.max_tokens > 1 => {
                    format!(
                        "; {:.1} chunks in {:.1} reads per answer",
                        med(&|x| x.chunks_per_request),
                        med(&|x| x.reads_per_request)
                    )
                }
                None => String::new(),
            },
        );
    }
    for (tokens, whole, front, byte_level) in
        kvrouter_bench::proxy::tokenisation(&cfg.model, &[1_000, 10_000, 100_000])?
    {
        let by = if byte_level {
            "byte-level encoder"
        } else {
            "tokenizer crate"
        };
        println!(
            "  tokenisation of an unseen prompt (chat template + encode) of {tokens} tokens: {whole:.0} us by the tokenizer crate, {front:.0} us as the front does ({by})"
        );
    }
    Ok(())
}

fn emit<T: serde::Serialize>(r: &T, json: bool, human: fn(&T)) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(r)?);
    } else {
        human(r);
    }
    Ok(())
}

fn perf_one(log: &LoadedLog, index: &str, threads: usize) -> anyhow::Result<PerfReport> {
    Ok(match index {
        "tree" => perf::replay(&mut TreeIndex::new(1), log, |t| Some(t.heap_bytes() as u64)),
        "reference" => perf::replay(&mut ReferenceIndex::new(), log, |_| None),
        #[cfg(feature = "dynamo")]
        "dynamo-radix" => kvrouter_bench::dynamo::replay_radix_tree(log),
        #[cfg(feature = "dynamo")]
        "dynamo-crtc" => kvrouter_bench::dynamo::replay_thread_pool(log, threads),
        other => {
            bail!("unknown index {other:?} (Dynamo's need --features dynamo); threads {threads}")
        }
    })
}

fn concurrent_one(
    log: &LoadedLog,
    index: &str,
    writers: usize,
    readers: usize,
    passes: usize,
) -> anyhow::Result<ConcurrentReport> {
    Ok(match index {
        "tree" => concurrent::run_tree(log, writers, readers, passes),
        #[cfg(feature = "dynamo")]
        "dynamo-crtc" => {
            kvrouter_bench::dynamo::concurrent_thread_pool(log, writers, readers, passes)
        }
        other => bail!("unknown concurrent index {other:?} (Dynamo's needs --features dynamo)"),
    })
}

fn print_perf(r: &PerfReport) {
    println!(
        "{}: {} ops in {:.3} s: {:.0} ops/s, {:.2} M block ops/s; find_matches p50/p99/p999 {}/{}/{} ns; \
         peak RSS {:.1} MiB, {:.1} bytes per cached block ({} cached){}; checksum {}",
        r.index,
        r.ops,
        r.elapsed_s,
        r.ops_per_s,
        r.block_ops_per_s / 1e6,
        r.match_p50_ns,
        r.match_p99_ns,
        r.match_p999_ns,
        r.peak_rss_bytes as f64 / (1 << 20) as f64,
        r.bytes_per_block,
        r.cached_blocks,
        r.heap_bytes.map_or(String::new(), |h| format!(
            ", own heap {:.1} bytes/block",
            h as f64 / r.cached_blocks.max(1) as f64
        )) + &r.heap_bytes_per_block.map_or(String::new(), |h| format!(
            ", live heap growth {h:.1} bytes/block"
        )),
        r.score_checksum
    );
}

fn print_concurrent(r: &ConcurrentReport) {
    println!(
        "{} ({} writers, {} readers): {:.2} M event blocks/s ({:.0} events/s) in {:.3} s; \
         {:.0} lookups/s, p50/p99/p999 {}/{}/{} ns; readers got {:.2} CPU-s \
         ({:.0} lookups per reader CPU-s), the process {:.2} CPU-s",
        r.index,
        r.writers,
        r.readers,
        r.event_blocks_per_s / 1e6,
        r.events_per_s,
        r.elapsed_s,
        r.lookups_per_s,
        r.lookup_p50_ns,
        r.lookup_p99_ns,
        r.lookup_p999_ns,
        r.reader_cpu_s,
        r.lookups_per_reader_cpu_s,
        r.process_cpu_s
    );
}

fn run_child(args: &[String]) -> anyhow::Result<Value> {
    let exe = std::env::current_exe()?;
    let out = Command::new(&exe)
        .args(args)
        .output()
        .with_context(|| format!("running {args:?}"))?;
    if !out.status.success() {
        bail!("{args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() { 0.0 } else { v[v.len() / 2] }
}

/// One log's ratios, ours over Dynamo's (`None` where Dynamo's side did not run).
#[derive(Debug, Default)]
struct Summary {
    log: String,
    block_ops: Option<f64>,
    heap_per_block: Option<f64>,
    rss_per_block: Option<f64>,
    find_p99: Option<f64>,
    event_blocks: Option<f64>,
    lookups: Option<f64>,
    lookups_per_cpu: Option<f64>,
    lookup_p99: Option<f64>,
}

fn print_summary(rows: &[Summary], runs: usize) {
    let x = |v: Option<f64>| v.map_or_else(|| "–".to_owned(), |v| format!("×{v:.2}"));
    println!(
        "\n## Summary: tree over Dynamo, every log (medians of {runs} runs; targets: ≥ 3, ≥ 3, ≤ 0.5, ≤ 0.5, ≥ 3, ≥ 3, ≤ 0.5)\n"
    );
    println!(
        "| log | block ops/s vs RadixTree | heap bytes/block | RSS bytes/block | find p99 | event blocks/s vs CRTC | lookups/s | lookups per reader CPU-s | lookup p99 |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        let name = Path::new(&r.log)
            .file_name()
            .map_or(r.log.clone(), |n| n.to_string_lossy().into_owned());
        println!(
            "| {name} | {} | {} | {} | {} | {} | {} | {} | {} |",
            x(r.block_ops),
            x(r.heap_per_block),
            x(r.rss_per_block),
            x(r.find_p99),
            x(r.event_blocks),
            x(r.lookups),
            x(r.lookups_per_cpu),
            x(r.lookup_p99)
        );
    }
}

fn compare(
    log: &Path,
    runs: usize,
    writers: usize,
    readers: usize,
    passes: usize,
) -> anyhow::Result<Summary> {
    let log_s = log.display().to_string();
    let mut seq: Vec<(String, Vec<Value>)> = Vec::new();
    let indexes: Vec<&str> = if cfg!(feature = "dynamo") {
        vec!["tree", "reference", "dynamo-radix", "dynamo-crtc"]
    } else {
        vec!["tree", "reference"]
    };
    let mut conc: Vec<(String, Vec<Value>)> = Vec::new();
    let conc_indexes: Vec<&str> = if cfg!(feature = "dynamo") {
        vec!["tree", "dynamo-crtc"]
    } else {
        vec!["tree"]
    };
    for run in 0..runs {
        for &ix in &indexes {
            eprintln!("run {}/{runs}: perf {ix}", run + 1);
            let v = run_child(&[
                "perf".into(),
                log_s.clone(),
                "--index".into(),
                ix.into(),
                "--threads".into(),
                writers.to_string(),
                "--json".into(),
            ])?;
            match seq.iter_mut().find(|(n, _)| n == ix) {
                Some((_, vs)) => vs.push(v),
                None => seq.push((ix.to_owned(), vec![v])),
            }
        }
        for &ix in &conc_indexes {
            eprintln!("run {}/{runs}: concurrent {ix}", run + 1);
            let v = run_child(&[
                "concurrent".into(),
                log_s.clone(),
                "--index".into(),
                ix.into(),
                "--writers".into(),
                writers.to_string(),
                "--readers".into(),
                readers.to_string(),
                "--passes".into(),
                passes.to_string(),
                "--json".into(),
            ])?;
            match conc.iter_mut().find(|(n, _)| n == ix) {
                Some((_, vs)) => vs.push(v),
                None => conc.push((ix.to_owned(), vec![v])),
            }
        }
    }
    let med = |vs: &[Value], k: &str| median(vs.iter().filter_map(|v| v[k].as_f64()).collect());
    println!(
        "## Sequential replay of {log_s} (median of {runs} runs, each index in its own process)\n"
    );
    println!(
        "| index | M block ops/s | ops/s | find p50 ns | p99 ns | p999 ns | peak RSS MiB | RSS bytes/cached block | heap bytes/cached block |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (name, vs) in &seq {
        println!(
            "| {name} | {:.2} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1} | {:.1} | {:.1} |",
            med(vs, "block_ops_per_s") / 1e6,
            med(vs, "ops_per_s"),
            med(vs, "match_p50_ns"),
            med(vs, "match_p99_ns"),
            med(vs, "match_p999_ns"),
            med(vs, "peak_rss_bytes") / (1 << 20) as f64,
            med(vs, "bytes_per_block"),
            med(vs, "heap_bytes_per_block"),
        );
    }
    // Ours over Dynamo's `other` for key `k` of `runs` (printed; `None` where `other` did
    // not run).
    let ratio = |runs: &[(String, Vec<Value>)], other: &str, k: &str, what: &str| {
        let get = |name: &str| {
            runs.iter()
                .find(|(n, _)| n == name)
                .map(|(_, vs)| med(vs, k))
        };
        let r = get("tree")? / get(other)?;
        println!("tree / {other}: {what} x{r:.2}");
        Some(r)
    };
    println!();
    let mut summary = Summary {
        log: log_s.clone(),
        block_ops: ratio(&seq, "dynamo-radix", "block_ops_per_s", "block ops/s"),
        heap_per_block: ratio(
            &seq,
            "dynamo-radix",
            "heap_bytes_per_block",
            "heap bytes per cached block",
        ),
        rss_per_block: ratio(
            &seq,
            "dynamo-radix",
            "bytes_per_block",
            "RSS bytes per cached block",
        ),
        find_p99: ratio(&seq, "dynamo-radix", "match_p99_ns", "find_matches p99"),
        ..Summary::default()
    };
    println!(
        "\n## Concurrent mode ({writers} writers, {readers} readers, {passes} passes over the events; median of {runs} runs)\n"
    );
    println!(
        "| index | M event blocks/s | events/s | lookups/s | reader CPU-s | lookups per reader CPU-s | process CPU-s | lookup p50 ns | p99 ns | p999 ns |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (name, vs) in &conc {
        println!(
            "| {name} | {:.2} | {:.0} | {:.0} | {:.2} | {:.0} | {:.2} | {:.0} | {:.0} | {:.0} |",
            med(vs, "event_blocks_per_s") / 1e6,
            med(vs, "events_per_s"),
            med(vs, "lookups_per_s"),
            med(vs, "reader_cpu_s"),
            med(vs, "lookups_per_reader_cpu_s"),
            med(vs, "process_cpu_s"),
            med(vs, "lookup_p50_ns"),
            med(vs, "lookup_p99_ns"),
            med(vs, "lookup_p999_ns"),
        );
    }
    println!();
    summary.event_blocks = ratio(&conc, "dynamo-crtc", "event_blocks_per_s", "event blocks/s");
    summary.lookups = ratio(&conc, "dynamo-crtc", "lookups_per_s", "lookups/s");
    summary.lookups_per_cpu = ratio(
        &conc,
        "dynamo-crtc",
        "lookups_per_reader_cpu_s",
        "lookups per reader CPU-second",
    );
    summary.lookup_p99 = ratio(&conc, "dynamo-crtc", "lookup_p99_ns", "lookup p99");
    Ok(summary)
}
