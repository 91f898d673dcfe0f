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
    /// Arrival-time scale: 2 replays the trace twice as fast. A comma-separated list
    /// sweeps the load: every policy at every speed, side by side.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    speed: Vec<f64>,
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
    /// Write every request's outcome here, one CSV line per request and policy (and
    /// speed): worker, arrival, first token, completion, prompt tokens, cached blocks.
    #[arg(long)]
    outcomes: Option<PathBuf>,
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
    /// Credit per shared-pool block at or past a worker's device prefix (Dynamo's
    /// `shared_cache_multiplier`: 0 without a shared cache, 0.5 with HiCache), for our
    /// policies and `dynamo` alike.
    #[arg(long, default_value_t = CostConfig::default().shared_cache_multiplier)]
    shared_cache_multiplier: f64,
    /// Our policies' softmax temperature (0: lowest cost wins).
    #[arg(long, default_value_t = CostConfig::default().temperature)]
    temperature: f64,
    /// Our policies credit the prefix held by a worker's active requests as cached.
    #[arg(long, default_value_t = CostConfig::default().credit_inflight, action = clap::ArgAction::Set)]
    credit_inflight: bool,
    /// Our policies' fresh-block charge grows with the least prefill queued on any worker
    /// (0: off).
    #[arg(long, default_value_t = CostConfig::default().saturation_weight)]
    saturation_weight: f64,
    /// Our policies' weight of the delay a request's uncached prefill adds to the requests
    /// expected to return to a worker meanwhile (0: off; `core::returns`).
    #[arg(long, default_value_t = CostConfig::default().return_weight)]
    return_weight: f64,
    /// The decay window of each worker's rate of returning requests, seconds.
    #[arg(long, default_value_t = CostConfig::default().return_window_secs)]
    return_window_secs: f64,
    /// Our policies' busy threshold: a worker whose active blocks (those of every request
    /// routed to it and not yet freed) exceed this is left out while another is not, as
    /// `kvrouter serve --max-active-decode-blocks`. Absent: none.
    #[arg(long)]
    max_active_decode_blocks: Option<u64>,
    /// kv-aware and kv-aware-p2c also remember their own decisions this long, seconds,
    /// and credit a worker with the longer of the index's prefix and the remembered one
    /// (0: off; `kvrouter serve --remember-decisions-secs`).
    #[arg(long, default_value_t = 0)]
    remember_secs: u64,
    /// kv-time: weight of the delay a prefill adds to each request decoding there.
    #[arg(long, default_value_t = CostConfig::time().decode_delay_weight)]
    decode_delay_weight: f64,
    /// kv-time credits the prefix held by a worker's active requests as cached.
    #[arg(long, default_value_t = CostConfig::time().credit_inflight, action = clap::ArgAction::Set)]
    time_credit_inflight: bool,
    /// Run in wall-clock time across processes: one `kvrouter bench-engine` process per
    /// worker and a `kvrouter serve` router, over this NATS server (policies one after
    /// another). Scale time with --speed and --engine-speedup together.
    #[arg(long)]
    nats: Option<String>,
    /// With --nats: send every request through the router's OpenAI front
    /// (`/v1/completions`, streamed) to engines that speak the OpenAI API, so that the
    /// comparison covers the whole request path; every policy is decided by the router.
    #[arg(long, requires = "nats")]
    openai: bool,
    /// With --nats: give up when no engine reports progress for this many seconds
    /// (--openai: when an answer stays silent this long).
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
    if args.speed.is_empty()
        || !args.speed.iter().all(|&s| positive(s))
        || !positive(args.engine.engine_speedup)
    {
        bail!("--speed and --engine-speedup must be positive");
    }
    if args.speed.len() > 1 && args.nats.is_some() {
        bail!("a --speed list (a load sweep) runs in-process only");
    }
    if args.engine.host_blocks > 0 && args.nats.is_some() {
        bail!("--host-blocks runs in-process only (the networked engines publish the device tier)");
    }
    if args.engine.host_blocks > 0 && !positive(args.engine.host_gbps) {
        bail!("--host-gbps must be positive");
    }
    if args.engine.pool_blocks > 0 && args.nats.is_some() {
        bail!("--pool-blocks runs in-process only (the networked engines share no pool)");
    }
    if args.engine.pool_blocks > 0 && !positive(args.engine.pool_gbps) {
        bail!("--pool-gbps must be positive");
    }
    if args.engine.block_size == 0 || 512 % args.engine.block_size != 0 {
        bail!("--block-size must divide 512 (the trace's block size)");
    }
    let (text, name) = match &args.trace {
        Some(p) => (read_trace(p)?, p.display().to_string()),
        None => (SAMPLE_TRACE.to_owned(), SAMPLE_NAME.to_owned()),
    };
    let trace = harness::load_trace(&text, args.limit)?;
    if trace.is_empty() {
        bail!("{name}: no requests");
    }
    let cfg = SimConfig {
        workers: args.workers,
        speed: args.speed[0],
        seed: args.seed,
        engine: args.engine.config(),
        cost: CostConfig {
            overlap_score_credit: args.overlap_credit,
            prefill_load_scale: args.prefill_load_scale,
            new_block_weight: args.new_block_weight,
            host_cache_hit_weight: args.host_cache_hit_weight,
            shared_cache_multiplier: args.shared_cache_multiplier,
            temperature: args.temperature,
            credit_inflight: args.credit_inflight,
            saturation_weight: args.saturation_weight,
            return_weight: args.return_weight,
            return_window_secs: args.return_window_secs,
            max_active_decode_blocks: args.max_active_decode_blocks,
            ..CostConfig::default()
        },
        time: CostConfig {
            decode_delay_weight: args.decode_delay_weight,
            max_active_decode_blocks: args.max_active_decode_blocks,
            credit_inflight: args.time_credit_inflight,
            shared_cache_multiplier: args.shared_cache_multiplier,
            ..CostConfig::time()
        },
        remember_ms: args.remember_secs.saturating_mul(1000),
    };
    cfg.cost.check().context(
        "invalid cost weights (--overlap-credit, --prefill-load-scale, --new-block-weight, --host-cache-hit-weight, --shared-cache-multiplier, --temperature, --saturation-weight, --return-weight, --return-window-secs)",
    )?;
    cfg.time
        .check()
        .context("invalid kv-time weights (--decode-delay-weight)")?;
    let mut distinct = args.speed.clone();
    distinct.sort_by(f64::total_cmp);
    distinct.dedup();
    if distinct.len() != args.speed.len() {
        bail!("--speed lists a load twice");
    }
    let speeds = args.speed.clone();
    let span_s = trace.last().map_or(0, |r| r.timestamp) as f64 / 1000.0;
    let list = |v: &[f64]| {
        v.iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    eprintln!(
        "trace {name}: {} requests over {span_s:.0} s at speed 1 (speed {}), {} workers × {} KV blocks of {} tokens; policies: {}",
        trace.len(),
        list(&speeds),
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
    let hashes = harness::TraceHashes::new(&trace, cfg.engine.block_size);
    let runs: Vec<Vec<PolicyReport>> = match &args.nats {
        None => {
            // The ideals are two single-cache replays of their own (the same at every
            // speed): computed beside the policies, not before them.
            let configs: Vec<SimConfig> = speeds
                .iter()
                .map(|&speed| SimConfig { speed, ..cfg })
                .collect();
            let (ideals, mut runs) = std::thread::scope(|s| {
                let ideals = s.spawn(|| Ideals::compute(&trace, &hashes, &cfg));
                let runs = run_all(&trace, &hashes, &policies, &configs, args.jobs);
                (ideals.join(), runs)
            });
            let ideals = ideals.map_err(|_| anyhow::anyhow!("computing the ideals panicked"))?;
            for r in runs.iter_mut().flatten() {
                r.set_ideals(ideals);
            }
            runs
        }
        Some(url) => {
            let ideals = Ideals::compute(&trace, &hashes, &cfg);
            let net = NetConfig {
                nats: url.clone(),
                exe: std::env::current_exe().context("locating the kvrouter executable")?,
                sim: cfg,
                stall_timeout: Duration::from_secs(args.stall_timeout_secs.max(1)),
                openai: args.openai,
            };
            vec![run_networked_all(&trace, &policies, &net, &ideals)?]
        }
    };
    eprintln!("finished in {:.1} s", started.elapsed().as_secs_f64());
    for (speed, reports) in speeds.iter().zip(&runs) {
        if speeds.len() > 1 {
            println!("speed {speed}:");
        }
        print!("{}", harness::report::table(reports));
        print!("{}", harness::utilisation_lines(reports));
        print!("{}", harness::lateness_lines(reports));
    }
    if speeds.len() > 1 {
        println!("load sweep (TTFT mean and p99 at each speed):");
        print!("{}", harness::sweep_table(&speeds, &runs));
    }
    if let Some(p) = &args.json {
        if speeds.len() > 1 {
            harness::write_sweep_json(p, &speeds, &runs)?;
        } else {
            harness::write_json(p, &runs[0])?;
        }
        eprintln!("wrote {}", p.display());
    }
    if let Some(p) = &args.outcomes {
        harness::write_outcomes_csv(p, &speeds, &runs, &cfg.engine)?;
        eprintln!("wrote {}", p.display());
    }
    if let Some(p) = &args.plot {
        if speeds.len() > 1 {
            let title = format!(
                "TTFT against load: {} requests, {} workers",
                trace.len(),
                args.workers
            );
            harness::write_sweep_svg(p, &speeds, &runs, &title)?;
        } else {
            let title = format!(
                "TTFT CDF: {} requests, {} workers, speed {}",
                trace.len(),
                args.workers,
                speeds[0]
            );
            harness::write_svg(p, &runs[0], &title)?;
        }
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
    /// Most prefill tokens one request gets in a step (0: no cap): vLLM's
    /// `--long-prefill-token-threshold`. A long prompt then prefills beside the requests
    /// behind it instead of holding the whole step's budget until it ends.
    #[arg(long, default_value_t = EngineConfig::default().long_prefill_token_threshold)]
    long_prefill_token_threshold: u32,
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
    /// The fleet's shared pool, blocks (0: none; in-process runs only): a cache every
    /// engine writes each prompt through to and onloads from (an LMCache server, a
    /// Mooncake store), publishing `cache_owner` KV events.
    #[arg(long, default_value_t = 0)]
    pool_blocks: usize,
    /// Pool-to-device bandwidth for onloads, GB/s (a network or storage hop).
    #[arg(long, default_value_t = 10.0)]
    pool_gbps: f64,
    /// KV bytes per token (the onload size of a block is this × block size; the default is
    /// Llama-3-8B's: 2 × 32 layers × 8 KV heads × 128 × 2 bytes).
    #[arg(long, default_value_t = 131_072)]
    kv_bytes_per_token: u64,
}

impl EngineFlags {
    /// Time to copy one block's KV at `gbps` GB/s, ms.
    fn copy_ms_per_block(&self, gbps: f64) -> f64 {
        (self.kv_bytes_per_token * u64::from(self.block_size)) as f64 / (gbps * 1e9) * 1e3
    }

    fn config(&self) -> EngineConfig {
        EngineConfig {
            block_size: self.block_size,
            capacity_blocks: self.kv_blocks,
            max_batch_tokens: self.max_batch_tokens,
            long_prefill_token_threshold: self.long_prefill_token_threshold,
            speedup: self.engine_speedup,
            host_capacity_blocks: self.host_blocks,
            onload_ms_per_block: self.copy_ms_per_block(self.host_gbps),
            pool_capacity_blocks: self.pool_blocks,
            pool_onload_ms_per_block: self.copy_ms_per_block(self.pool_gbps),
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
    /// Take jobs as OpenAI completions on a loopback port (reported when ready).
    #[arg(long)]
    openai: bool,
    #[command(flatten)]
    engine: EngineFlags,
}

pub(crate) fn run_engine(args: EngineArgs) -> anyhow::Result<ExitCode> {
    run_engine_process(EngineProcess {
        engine: args.engine.config(),
        nats: args.nats,
        namespace: args.namespace,
        index: args.index,
        openai: args.openai,
    })?;
    Ok(ExitCode::SUCCESS)
}

/// Reads a trace file; `*.zst` files are decompressed.
fn read_trace(p: &std::path::Path) -> anyhow::Result<String> {
    let what = || format!("reading {}", p.display());
    let raw = std::fs::read(p).with_context(what)?;
    let bytes = if p.extension().is_some_and(|e| e == "zst") {
        zstd::decode_all(&raw[..]).with_context(what)?
    } else {
        raw
    };
    String::from_utf8(bytes).with_context(what)
}

/// Simulates every policy under every config (one per speed), `jobs` at a time, each
/// with a progress bar (drawn only on a terminal); returns, per config, the reports in
/// `policies` order.
fn run_all(
    trace: &[harness::TraceRequest],
    hashes: &harness::TraceHashes,
    policies: &[Policy],
    configs: &[SimConfig],
    jobs: Option<usize>,
) -> Vec<Vec<PolicyReport>> {
    let work: Vec<(usize, Policy)> = (0..configs.len())
        .flat_map(|c| policies.iter().map(move |&p| (c, p)))
        .collect();
    let jobs = jobs
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .clamp(1, work.len().max(1));
    let bars = MultiProgress::new();
    let style = bar_style();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut slots: Vec<Option<PolicyReport>> = work.iter().map(|_| None).collect();
    let results = std::sync::Mutex::new(&mut slots);
    std::thread::scope(|s| {
        for _ in 0..jobs {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(&(c, policy)) = work.get(i) else {
                        return;
                    };
                    let cfg = &configs[c];
                    let bar = bars.add(ProgressBar::new(trace.len() as u64));
                    bar.set_style(style.clone());
                    if configs.len() > 1 {
                        bar.set_prefix(format!("{} ×{}", policy.name(), cfg.speed));
                    } else {
                        bar.set_prefix(policy.name());
                    }
                    bar.enable_steady_tick(Duration::from_millis(200));
                    let report =
                        harness::simulate(trace, hashes, policy, cfg, &Ideals::default(), |done| {
                            bar.set_position(done as u64)
                        });
                    bar.finish();
                    results.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(report);
                }
            });
        }
    });
    let mut reports = slots.into_iter().flatten();
    configs
        .iter()
        .map(|_| reports.by_ref().take(policies.len()).collect())
        .collect()
}
