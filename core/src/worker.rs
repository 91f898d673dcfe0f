//! Worker identity: a worker id, a data-parallel rank, and the storage tier of a cache.

use serde::{Deserialize, Serialize};

/// A worker (engine instance) id. Stock Dynamo ids are random u64s, often above 2^53:
/// they must never pass through a float.
pub type WorkerId = u64;

/// A data-parallel rank inside one worker; 0 when data parallelism is off.
pub type DpRank = u32;

/// One independently cached replica: a worker and one of its data-parallel ranks.
///
/// Every index keeps state per `WorkerDp`; `Cleared` events and event ids are per `WorkerDp`.
/// Wire-compatible with Dynamo's `WorkerWithDpRank` (`{"worker_id", "dp_rank"}`).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub struct WorkerDp {
    /// The worker.
    pub worker_id: WorkerId,
    /// Its data-parallel rank.
    #[serde(default)]
    pub dp_rank: DpRank,
}

impl WorkerDp {
    /// A worker at a given rank.
    pub const fn new(worker_id: WorkerId, dp_rank: DpRank) -> Self {
        Self { worker_id, dp_rank }
    }
}

impl std::fmt::Display for WorkerDp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.worker_id, self.dp_rank)
    }
}

/// Where a cached block lives. Wire names as Dynamo's `StorageTier` (`"device"`, ...).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum StorageTier {
    /// GPU memory: what the engine can use at once.
    #[default]
    Device,
    /// Pinned host memory (an offload tier).
    HostPinned,
    /// Local disk or NVMe (an offload tier).
    Disk,
    /// A cache shared outside the worker (network, remote pool).
    External,
}

impl StorageTier {
    /// All tiers, fastest first.
    pub const ALL: [StorageTier; 4] = [
        StorageTier::Device,
        StorageTier::HostPinned,
        StorageTier::Disk,
        StorageTier::External,
    ];

    /// The wire name (`"device"`, `"host_pinned"`, `"disk"`, `"external"`).
    pub const fn as_str(self) -> &'static str {
        match self {
            StorageTier::Device => "device",
            StorageTier::HostPinned => "host_pinned",
            StorageTier::Disk => "disk",
            StorageTier::External => "external",
        }
    }
}
