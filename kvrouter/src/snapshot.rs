//! `kvrouter snapshot inspect|verify FILE`: look into a snapshot file without a router.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use kvrouter_core::index::{Index, TreeIndex};
use kvrouter_io::snapshot::MappedSnapshot;

/// Flags of `kvrouter snapshot`.
#[derive(Debug, Args)]
pub(crate) struct SnapshotArgs {
    #[command(subcommand)]
    action: Action,
}

#[derive(Debug, Subcommand)]
enum Action {
    /// Print what the snapshot holds (header, stream position, workers) as JSON.
    Inspect {
        /// The snapshot file.
        file: PathBuf,
    },
    /// Validate every checksum and record, then rebuild the index from it; exit 1 when the
    /// file is unusable.
    Verify {
        /// The snapshot file.
        file: PathBuf,
    },
}

pub(crate) fn run(args: SnapshotArgs) -> anyhow::Result<ExitCode> {
    match args.action {
        Action::Inspect { file } => {
            let m = MappedSnapshot::open(&file)?;
            let v = m.view()?;
            let workers: Vec<serde_json::Value> = v
                .workers()
                .iter()
                .map(|w| {
                    serde_json::json!({
                        "worker_id": w.worker.worker_id,
                        "dp_rank": w.worker.dp_rank,
                        "last_event_id": w.last_event_id,
                        "announced": w.announced,
                    })
                })
                .collect();
            let out = serde_json::json!({
                "file": file.display().to_string(),
                "bytes": m.len(),
                "format_version": v.version(),
                "meta": v.meta(),
                "chains": v.chain_count(),
                "blocks": v.block_count(),
                "lower_tier_blocks": v.lower_count(),
                "shared_pool_blocks": v.pool_count(),
                "workers": workers,
            });
            println!("{}", serde_json::to_string_pretty(&out)?);
            Ok(ExitCode::SUCCESS)
        }
        Action::Verify { file } => {
            let m = match MappedSnapshot::open(&file) {
                Ok(m) => m,
                Err(e) => {
                    println!("invalid: {e}");
                    return Ok(ExitCode::from(1));
                }
            };
            let v = match m.view() {
                Ok(v) => v,
                Err(e) => {
                    println!("invalid ({}): {e}", e.kind());
                    return Ok(ExitCode::from(1));
                }
            };
            let started = std::time::Instant::now();
            let mut idx = TreeIndex::new(1);
            let mut rejected = 0u64;
            for e in v.events() {
                if idx.apply(e).is_err() {
                    rejected += 1;
                }
            }
            let rebuilt = idx.block_count() as u64;
            if rejected > 0 || rebuilt != v.block_count() {
                println!(
                    "invalid: {rejected} chains rejected, {rebuilt} of {} blocks rebuilt",
                    v.block_count()
                );
                return Ok(ExitCode::from(1));
            }
            println!(
                "ok: {} blocks, {} workers, rebuilt in {:.1} ms",
                rebuilt,
                v.workers().len(),
                started.elapsed().as_secs_f64() * 1e3
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}
