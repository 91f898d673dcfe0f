//! `kvrouter replay`: conformance checks over replay logs.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use clap::{Args, ValueEnum};
use kvrouter_bench::perf::{self, LoadedLog};
use kvrouter_core::index::{Index, ReferenceIndex, TreeIndex};
use kvrouter_core::replay::ReplayChecker;
use kvrouter_io::log::LogReader;

/// The sample log bundled into the binary: the first 700 lines of the shared
/// `conversation_w4_e4_c4096_n2000` log (Mooncake conversation trace, 4 workers).
const SAMPLE_LOG: &[u8] = include_bytes!("../../bench/data/sample_w4.jsonl.zst");
const SAMPLE_NAME: &str = "<bundled sample_w4.jsonl.zst>";

#[derive(Debug, Args)]
pub(crate) struct ReplayArgs {
    /// Check every find_matches answer against the log's expected answer (the default).
    #[arg(long, conflicts_with = "perf")]
    check: bool,
    /// Parse the whole log first, then time the replay: ops/s, block ops/s, find_matches
    /// percentiles, peak RSS and bytes per cached block.
    #[arg(long)]
    perf: bool,
    /// With --perf: print one JSON object.
    #[arg(long, requires = "perf")]
    json: bool,
    /// The log (`.jsonl` or `.jsonl.zst`); the bundled sample when omitted.
    #[arg(env = "KVROUTER_REPLAY_LOG")]
    log: Option<PathBuf>,
    /// Which index to replay through.
    #[arg(long, value_enum, default_value_t = IndexKind::Reference, env = "KVROUTER_INDEX")]
    index: IndexKind,
}

/// Index backends selectable by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum IndexKind {
    /// The reference index (hash maps; the oracle).
    Reference,
    /// The lock-free sharded radix tree, driven from one thread (one shard).
    Tree,
}

impl IndexKind {
    fn build(self) -> Box<dyn Index> {
        match self {
            IndexKind::Reference => Box::new(ReferenceIndex::new()),
            IndexKind::Tree => Box::new(TreeIndex::new(1)),
        }
    }
}

pub(crate) fn run(args: ReplayArgs) -> anyhow::Result<ExitCode> {
    if args.perf {
        return perf(args);
    }
    let mut reader = match &args.log {
        Some(path) => {
            LogReader::open(path).with_context(|| format!("opening {}", path.display()))?
        }
        None => LogReader::from_bytes(SAMPLE_NAME, SAMPLE_LOG)?,
    };
    let name = args
        .log
        .as_ref()
        .map_or(SAMPLE_NAME.to_owned(), |p| p.display().to_string());
    let h = &reader.header;
    eprintln!(
        "replaying {name} ({} requests, {} workers, source {}) through the {} index",
        h.requests,
        h.workers,
        h.source,
        args.index.build().name()
    );
    let mut index = args.index.build();
    let mut check = ReplayChecker::new();
    let start = Instant::now();
    while let Some((line, op)) = reader.next_op()? {
        check.step(index.as_mut(), line, op);
    }
    let elapsed = start.elapsed();
    for m in &check.first_mismatches {
        println!(
            "mismatch at line {}: expected {:?}, got {:?}",
            m.line, m.expected, m.got
        );
    }
    for r in &check.first_rejections {
        println!("rejected event at {r}");
    }
    println!(
        "{} events applied ({} rejected), {} blocks cached at the end, {:.2} s",
        check.events,
        check.rejected,
        index.block_count(),
        elapsed.as_secs_f64()
    );
    println!(
        "{} matches checked, {} mismatches",
        check.matches, check.mismatches
    );
    Ok(if check.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn perf(args: ReplayArgs) -> anyhow::Result<ExitCode> {
    let reader = match &args.log {
        Some(path) => {
            LogReader::open(path).with_context(|| format!("opening {}", path.display()))?
        }
        None => LogReader::from_bytes(SAMPLE_NAME, SAMPLE_LOG)?,
    };
    let log = LoadedLog::from_reader(reader)?;
    let report = match args.index {
        IndexKind::Reference => perf::replay(&mut ReferenceIndex::new(), &log, |_| None),
        IndexKind::Tree => {
            perf::replay(
                &mut TreeIndex::new(1),
                &log,
                |t| Some(t.heap_bytes() as u64),
            )
        }
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "{}: {} ops in {:.3} s: {:.0} ops/s, {:.2} M block ops/s; find_matches p50/p99/p999 {}/{}/{} ns; \
             peak RSS {:.1} MiB; {:.1} bytes per cached block ({} cached)",
            report.index,
            report.ops,
            report.elapsed_s,
            report.ops_per_s,
            report.block_ops_per_s / 1e6,
            report.match_p50_ns,
            report.match_p99_ns,
            report.match_p999_ns,
            report.peak_rss_bytes as f64 / (1 << 20) as f64,
            report.bytes_per_block,
            report.cached_blocks
        );
    }
    Ok(ExitCode::SUCCESS)
}
