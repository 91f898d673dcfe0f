//! The `kvrouter` binary.
//!
//! Exit codes: 0 success; 1 a check failed (replay mismatches); 2 bad usage, unreadable
//! input or any other error.

mod bench;
mod replay;
mod serve;
mod snapshot;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// The request path allocates in small pieces (the tokenizer's splits, parsed JSON, hyper's
/// buffers), and the index's nodes come in a few sizes: mimalloc serves both faster than
/// glibc's malloc (docs/BENCHMARKS.md, "The allocator").
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// KV-cache-aware request router for LLM inference fleets.
#[derive(Debug, Parser)]
#[command(name = "kvrouter", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Benchmark the routing policies: mock engines serve a Mooncake trace once per policy.
    Bench(Box<bench::BenchArgs>),
    /// One mock engine of `kvrouter bench --nats` (spawned by it).
    #[command(hide = true)]
    BenchEngine(bench::EngineArgs),
    /// Stream a replay log of index operations through an index and check every answer.
    Replay(replay::ReplayArgs),
    /// Run the router: ingest KV events from NATS and serve routing decisions over HTTP.
    Serve(Box<serve::ServeArgs>),
    /// Inspect or verify a snapshot file.
    Snapshot(snapshot::SnapshotArgs),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KVROUTER_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bench(args) => bench::run(*args),
        Command::BenchEngine(args) => bench::run_engine(args),
        Command::Replay(args) => replay::run(args),
        Command::Serve(args) => serve::run(*args),
        Command::Snapshot(args) => snapshot::run(args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}
