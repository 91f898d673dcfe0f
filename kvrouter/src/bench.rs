//! `kvrouter bench`: the benchmark harness. Mock engines serve a Mooncake-format trace once
//! per routing policy, in one process and in virtual time; prints a table, and optionally
//! writes JSON and an SVG plot of the TTFT CDFs.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use kvrouter_bench::harness::net::{EngineProcess, NetConfig, run_engine_process, run_networked};
use kvrouter_bench::harness::{self, EngineConfig, Ideals, Policy, PolicyReport, SimConfig};
use kvrouter_core::policy::CostConfig;

/// The first 500 requests of the Mooncake conversation trace, bundled for fresh clones.
const SAMPLE_TRACE: &str = include_str!("../../bench/data/mooncake_conversation_sample.jsonl");
const SAMPLE_NAME: &str = "<bundled mooncake_conversation_sample.jsonl>";

#[derive(Debug, Args)]
pub(crate) struct BenchArgs {
    /// Mooncake-format trace (JSON lines); the bundled 500-request sample when omitted.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Mock workers.
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// Arrival-time scale: 2 replays the trace twice as fast.
    #[arg(long, default_value_t = 1.0)]
    speed: f64,
    /// Replay only the first N requests.
    #[arg(long)]
    limit: Option<usize>,
    /// Comma-separated policies (kv-aware, kv-aware-p2c, dynamo, approximate,
    /// least-loaded, round-robin, random); all when omitted.
    #[arg(long, value_delimiter = ',')]
    policies: Vec<String>,
    /// Seed of every random choice (routing ties, random policy, sampling).
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Write `{policy: {ttft_ms, itl_ms, e2e_ms, ...}}` here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write the TTFT CDF of every policy here (SVG).
    #[arg(long)]
    plot: Option<PathBuf>,
    #[command(flatten)]
    engine: EngineFlags,
    /// Our policies' credit per cached block (Dynamo's `overlap_score_weight`), in [0, 1].
    #[arg(long, default_value_t = CostConfig::default().overlap_score_credit)]
    overlap_credit: f64,
    /// Our policies' weight of prefill load against decode load.
    #[arg(long, default_value_t = CostConfig::default().prefill_load_scale)]
    prefill_load_scale: f64,
    /// Our policies' extra weight of each block a request would prefill from scratch (0: Dynamo's formula).
    #[arg(long, default_value_t = CostConfig::default().new_block_weight)]
    new_block_weight: f64,
    /// Our policies' credit per block continuing a prompt in an engine's host memory
    /// (Dynamo's `host_cache_hit_weight`), in [0, 1]; `dynamo` always uses 0.75.
    #[arg(long, default_value_t = CostConfig::default().host_cache_hit_weight)]
    host_cache_hit_weight: f64,
    /// Our policies' softmax temperature (0: lowest cost wins).
    #[arg(long, default_value_t = CostConfig::default().temperature)]
    temperature: f64,
    /// Run in wall-clock time across processes: one `kvrouter bench-engine` process per
    /// worker and a `kvrouter serve` router, over this NATS server (policies one after
    /// another). Scale time with --speed and --engine-speedup together.
    #[arg(long)]
    nats: Option<String>,
    /// With --nats: give up when no engine reports progress for this many seconds.
    #[arg(long, default_value_t = 60)]
    stall_timeout_secs: u64,
    /// Policies simulated at once (default: available cores).
    #[arg(long)]
    jobs: Option<usize>,
}

pub(crate) fn run(args: BenchArgs) -> anyhow::Result<ExitCode> {
    let policies: Vec<Policy> = if args.policies.is_empty() {
        Policy::ALL.to_vec()
    } else {
        let mut out = Vec::new();
        for name in &args.policies {
            let p = Policy::parse(name).with_context(|| {
                let known: Vec<&str> = Policy::ALL.iter().map(|p| p.name()).collect();
                format!("unknown policy {name:?} (known: {})", known.join(", "))
            })?;
            if !out.contains(&p) {
                out.push(p);
            }
        }
        out
    };
    if args.workers == 0 {
        bail!("--workers must be at least 1");
    }
    let positive = |x: f64| x > 0.0 && x.is_finite();
    if !positive(args.speed) || !positive(args.engine.engine_speedup) {
        bail!("--speed and --engine-speedup must be positive");
    }
    if args.engine.host_blocks > 0 && args.nats.is_some() {
        bail!("--host-blocks runs in-process only (the networked engines publish the device tier)");
    }
    if args.engine.host_blocks > 0 && !positive(args.engine.host_gbps) {
        bail!("--host-gbps must be positive");
    }
    if args.engine.block_size == 0 || 512 % args.engine.block_size != 0 {
        bail!("--block-size must divide 512 (the trace's block size)");
    }
    let (text, name) = match &args.trace {
        Some(p) => (
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
            p.display().to_string(),
        ),
        None => (SAMPLE_TRACE.to_owned(), SAMPLE_NAME.to_owned()),
    };
    let trace = harness::load_trace(&text, args.limit)?;
    if trace.is_empty() {
        bail!("{name}: no requests");
    }
    let cfg = SimConfig {
        workers: args.workers,
        speed: args.speed,
        seed: args.seed,
        engine: args.engine.config(),
        cost: CostConfig {
            overlap_score_credit: args.overlap_credit,
            prefill_load_scale: args.prefill_load_scale,
            new_block_weight: args.new_block_weight,
            host_cache_hit_weight: args.host_cache_hit_weight,
            temperature: args.temperature,
            ..CostConfig::default()
        },
    };
    cfg.cost.check().context(
        "invalid cost weights (--overlap-credit, --prefill-load-scale, --new-block-weight, --host-cache-hit-weight, --temperature)",
    )?;
    let span_s = trace.last().map_or(0, |r| r.timestamp) as f64 / 1000.0 / args.speed;
    eprintln!(
        "trace {name}: {} requests over {span_s:.0} s (speed {}), {} workers × {} KV blocks of {} tokens; policies: {}",
        trace.len(),
        args.speed,
        args.workers,
        args.engine.kv_blocks,
        args.engine.block_size,
        policies
            .iter()
            .map(|p| p.name())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let started = Instant::now();
    let ideals = Ideals::compute(&trace, &cfg);
    let reports = match &args.nats {
        None => run_all(&trace, &policies, &cfg, &ideals, args.jobs),
        Some(url) => {
            let net = NetConfig {
                nats: url.clone(),
                exe: std::env::current_exe().context("locating the kvrouter executable")?,
                sim: cfg,
                stall_timeout: Duration::from_secs(args.stall_timeout_secs.max(1)),
            };
            run_networked_all(&trace, &policies, &net, &ideals)?
        }
    };
    eprintln!("finished in {:.1} s", started.elapsed().as_secs_f64());
    print!("{}", harness::report::table(&reports));
    if let Some(p) = &args.json {
        harness::write_json(p, &reports)?;
        eprintln!("wrote {}", p.display());
    }
    if let Some(p) = &args.plot {
        let title = format!(
            "TTFT CDF: {} requests, {} workers, speed {}",
            trace.len(),
            args.workers,
            args.speed
        );
        harness::write_svg(p, &reports, &title)?;
        eprintln!("wrote {}", p.display());
    }
    Ok(ExitCode::SUCCESS)
}

fn bar_style() -> ProgressStyle {
    ProgressStyle::with_template("{prefix:>13} [{bar:30}] {pos}/{len} requests {elapsed}")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ")
}

/// Runs every policy over NATS, one after another, each with a progress bar.
fn run_networked_all(
    trace: &[harness::TraceRequest],
    policies: &[Policy],
    net: &NetConfig,
    ideals: &Ideals,
) -> anyhow::Result<Vec<PolicyReport>> {
    let mut out = Vec::new();
    for &policy in policies {
        let bar = ProgressBar::new(trace.len() as u64);
        bar.set_style(bar_style());
        bar.set_prefix(policy.name());
        bar.enable_steady_tick(Duration::from_millis(200));
        let report = run_networked(trace, policy, net, ideals, |done| {
            bar.set_position(done as u64)
        })?;
        bar.finish();
        out.push(report);
    }
    Ok(out)
}

/// The mock engine's settings (shared by `bench` and `bench-engine`).
#[derive(Debug, Args)]
pub(crate) struct EngineFlags {
    /// Tokens per KV block (must divide 512, the trace's block).
    #[arg(long, default_value_t = EngineConfig::default().block_size)]
    block_size: u32,
    /// KV cache capacity of each mock engine, blocks.
    #[arg(long, default_value_t = EngineConfig::default().capacity_blocks)]
    kv_blocks: usize,
    /// Token budget of one engine step (chunked prefill).
    #[arg(long, default_value_t = EngineConfig::default().max_batch_tokens)]
    max_batch_tokens: u32,
    /// Divides every engine duration (a faster GPU).
    #[arg(long, default_value_t = 1.0)]
    engine_speedup: f64,
    /// Host-memory tier of each mock engine, blocks (0: none): evicted device blocks are
    /// offloaded there and onloaded instead of prefilled. In-process runs only.
    #[arg(long, default_value_t = 0)]
    host_blocks: usize,
    /// Host-to-device bandwidth for onloads, GB/s.
    #[arg(long, default_value_t = 25.0)]
    host_gbps: f64,
    /// KV bytes per token (the onload size of a block is this × block size; the default is
    /// Llama-3-8B's: 2 × 32 layers × 8 KV heads × 128 × 2 bytes).
    #[arg(long, default_value_t = 131_072)]
    kv_bytes_per_token: u64,
}

impl EngineFlags {
    fn config(&self) -> EngineConfig {
        EngineConfig {
            block_size: self.block_size,
            capacity_blocks: self.kv_blocks,
            max_batch_tokens: self.max_batch_tokens,
            speedup: self.engine_speedup,
            host_capacity_blocks: self.host_blocks,
            onload_ms_per_block: (self.kv_bytes_per_token * u64::from(self.block_size)) as f64
                / (self.host_gbps * 1e9)
                * 1e3,
            ..EngineConfig::default()
        }
    }
}

/// Flags of the hidden `kvrouter bench-engine` (spawned by `kvrouter bench --nats`).
#[derive(Debug, Args)]
pub(crate) struct EngineArgs {
    #[arg(long)]
    nats: String,
    #[arg(long)]
    namespace: String,
    #[arg(long)]
    index: usize,
    #[command(flatten)]
    engine: EngineFlags,
}

pub(crate) fn run_engine(args: EngineArgs) -> anyhow::Result<ExitCode> {
    run_engine_process(EngineProcess {
        engine: args.engine.config(),
        nats: args.nats,
        namespace: args.namespace,
        index: args.index,
    })?;
    Ok(ExitCode::SUCCESS)
}

/// Simulates every policy, `jobs` at a time, each with a progress bar (drawn only on a
/// terminal); returns the reports in `policies` order.
fn run_all(
    trace: &[harness::TraceRequest],
    policies: &[Policy],
    cfg: &SimConfig,
    ideals: &Ideals,
    jobs: Option<usize>,
) -> Vec<PolicyReport> {
    let jobs = jobs
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .clamp(1, policies.len().max(1));
    let bars = MultiProgress::new();
    let style = bar_style();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut slots: Vec<Option<PolicyReport>> = policies.iter().map(|_| None).collect();
    let results = std::sync::Mutex::new(&mut slots);
    std::thread::scope(|s| {
        for _ in 0..jobs {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(&policy) = policies.get(i) else {
                        return;
                    };
                    let bar = bars.add(ProgressBar::new(trace.len() as u64));
                    bar.set_style(style.clone());
                    bar.set_prefix(policy.name());
                    bar.enable_steady_tick(Duration::from_millis(200));
                    let report = harness::simulate(trace, policy, cfg, ideals, |done| {
                        bar.set_position(done as u64)
                    });
                    bar.finish();
                    results.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(report);
                }
            });
        }
    });
    slots.into_iter().flatten().collect()
}
