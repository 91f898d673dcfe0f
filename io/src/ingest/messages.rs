//! What the cores of the ingest say to each other: the source core (NATS today, and every
//! other event source beside it) to the shard cores ([`ShardCmd`]), the shard cores back to
//! the source core ([`SourceCmd`]), and what they answer.

use std::time::Instant;

use kvrouter_core::event::RouterEvent;
use kvrouter_core::snapshot::{LowerRecord, PoolRecord, WorkerRecord};
use kvrouter_core::worker::{DpRank, WorkerDp, WorkerId};

use super::snapshots::{SnapshotError, SnapshotInfo};

/// What a recovery brought back.
#[derive(Debug)]
pub(super) enum Recovered {
    /// The missing range of events.
    Range {
        publisher: u64,
        events: Vec<RouterEvent>,
    },
    /// The worker's whole state, and where its numbering stands.
    Dump {
        publisher: u64,
        events: Vec<RouterEvent>,
        last_event_ids: Vec<(DpRank, u64)>,
    },
    /// Nothing (timeout, no responders, a bad answer): why.
    Failed(String),
}

/// A command to a shard core. Every command about one worker goes to the worker's shard,
/// and each shard carries its commands out in the order they were sent.
pub(super) enum ShardCmd {
    /// Events of this shard's workers, in arrival order, from one message of `publisher`.
    Events {
        events: Vec<RouterEvent>,
        publisher: u64,
        arrived: Instant,
    },
    /// An announced worker's heartbeat: where its numbering stands (a trailing gap shows).
    Heartbeat {
        worker_id: WorkerId,
        last_event_ids: Vec<(DpRank, u64)>,
    },
    /// A worker announced itself (it has a local indexer): load its state.
    Announced {
        worker_id: WorkerId,
        heartbeat_ms: u64,
    },
    /// The answer to a recovery this shard asked for.
    Recovered {
        worker_id: WorkerId,
        result: Recovered,
    },
    /// The worker left: drop everything it holds.
    Remove { worker_id: WorkerId },
    /// These (worker, dp rank)s exist (discovery, a static engine list, a heartbeat): list
    /// them, with no blocks until their events come, so that they are routable at once.
    Register { workers: Vec<WorkerDp> },
    /// Dump this shard's state for a snapshot.
    Snapshot { reply: flume::Sender<ShardPart> },
    /// Answer once everything sent before has been applied.
    Barrier { reply: flume::Sender<()> },
    /// Stop (after everything sent before).
    Stop,
}

impl std::fmt::Debug for ShardCmd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ShardCmd::Events { .. } => "Events",
            ShardCmd::Heartbeat { .. } => "Heartbeat",
            ShardCmd::Announced { .. } => "Announced",
            ShardCmd::Recovered { .. } => "Recovered",
            ShardCmd::Remove { .. } => "Remove",
            ShardCmd::Register { .. } => "Register",
            ShardCmd::Snapshot { .. } => "Snapshot",
            ShardCmd::Barrier { .. } => "Barrier",
            ShardCmd::Stop => "Stop",
        })
    }
}

/// One shard's share of a snapshot.
#[derive(Debug)]
pub(super) struct ShardPart {
    pub(super) workers: Vec<WorkerRecord>,
    pub(super) events: Vec<RouterEvent>,
    /// The workers' lower-tier blocks.
    pub(super) lower: Vec<LowerRecord>,
    /// The shard's shared-pool blocks.
    pub(super) pool: Vec<PoolRecord>,
}

/// A command to the source core.
pub(super) enum SourceCmd {
    /// Ask a worker's local indexer for a range (or, with `range: None`, its whole state)
    /// and send the answer to `shard`.
    Recover {
        shard: usize,
        worker_id: WorkerId,
        dp_rank: Option<DpRank>,
        range: Option<(u64, u64)>,
    },
    /// Write a snapshot now.
    Snapshot {
        reply: flume::Sender<Result<SnapshotInfo, SnapshotError>>,
    },
    /// Stop every source (acknowledging what was applied, in durable mode).
    Stop,
}

impl std::fmt::Debug for SourceCmd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SourceCmd::Recover { .. } => "Recover",
            SourceCmd::Snapshot { .. } => "Snapshot",
            SourceCmd::Stop => "Stop",
        })
    }
}

/// Whether a shard core goes on after a command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Flow {
    Go,
    Stop,
}
