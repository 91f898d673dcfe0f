//! KV events: what workers publish about their caches, in Dynamo 1.6.1's shape.
//!
//! The types mirror Dynamo's `RouterEvent` / `KvCacheEvent` field for field and in the same
//! order, so that [`crate::codec`] decodes and re-encodes captured Dynamo traffic byte for
//! byte. Fields we do not use are kept (`start_position`, `mm_extra_info`,
//! `residency_domain`, `session_id`) so that nothing is lost when we forward or dump events;
//! unknown fields are ignored.
//!
//! Semantics (what an index does with each event) are in [`crate::index`].

use serde::de::Visitor;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::hash::{LocalBlockHash, SequenceBlockHash};
use crate::worker::{DpRank, StorageTier, WorkerDp, WorkerId};

/// A KV event of one worker, as the router receives it: the worker, the tier the blocks
/// live in, and the engine's event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouterEvent {
    /// The worker that published the event.
    pub worker_id: WorkerId,
    /// Where the event's blocks live; absent on the wire means device.
    #[serde(default)]
    pub storage_tier: StorageTier,
    /// Dynamo's logical owner of the residency (`"worker"` or `"cache_owner"`); absent in
    /// older publishers. Only worker-owned events describe a worker's cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub residency_domain: Option<ResidencyDomain>,
    /// The engine's event.
    pub event: KvCacheEvent,
    /// Session that triggered the store, when the engine says so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
}

impl RouterEvent {
    /// A device-tier, worker-owned event.
    pub fn new(worker_id: WorkerId, event: KvCacheEvent) -> Self {
        Self {
            worker_id,
            storage_tier: StorageTier::Device,
            residency_domain: Some(ResidencyDomain::Worker),
            event,
            session_id: None,
        }
    }

    /// The (worker, dp rank) whose cache this event changes.
    pub fn worker(&self) -> WorkerDp {
        WorkerDp::new(self.worker_id, self.event.dp_rank)
    }

    /// Whether the event describes the worker's own cache (worker residency, or the legacy
    /// absence of a domain). Cache-owner events belong to a shared pool, not to a worker.
    pub fn is_worker_owned(&self) -> bool {
        matches!(self.residency_domain, None | Some(ResidencyDomain::Worker))
    }

    /// Whether the event describes a shared pool's blocks (residency `cache_owner`;
    /// [`crate::index::tiers`], "The shared pool"). An event of neither domain (a name this
    /// build does not know) describes nothing it can index.
    pub fn is_shared_pool(&self) -> bool {
        matches!(self.residency_domain, Some(ResidencyDomain::CacheOwner))
    }

    /// Number of blocks the event names (stored or removed).
    pub fn block_count(&self) -> usize {
        match &self.event.data {
            KvEventData::Stored(s) => s.blocks.len(),
            KvEventData::Removed(r) => r.block_hashes.len(),
            KvEventData::Cleared => 0,
        }
    }
}

/// One engine event: its id in the publisher's numbering, what happened, and the dp rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvCacheEvent {
    /// Per-(worker, dp rank) event number. Stock Dynamo workers count from 1; ours from 0.
    pub event_id: u64,
    /// What happened.
    pub data: KvEventData,
    /// The data-parallel rank that emitted it.
    #[serde(default)]
    pub dp_rank: DpRank,
}

/// What happened to the cache.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvEventData {
    /// A chain of blocks was stored under `parent_hash`.
    Stored(StoredData),
    /// Blocks were evicted.
    Removed(RemovedData),
    /// Every block of this (worker, dp rank) was dropped.
    Cleared,
}

/// A stored chain: `blocks[0]` hangs under `parent_hash` (or the root), `blocks[i]` under
/// `blocks[i - 1]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredData {
    /// Sequence hash of the block the chain continues, `None` at the root.
    pub parent_hash: Option<SequenceBlockHash>,
    /// Absolute position of the first block (Dynamo's positional indexer); unused here.
    #[serde(default)]
    pub start_position: Option<u32>,
    /// The blocks, in prefix order.
    pub blocks: Vec<StoredBlock>,
}

/// One stored block: its (sequence, local) hash pair.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredBlock {
    /// The engine's sequence hash of the block.
    pub block_hash: SequenceBlockHash,
    /// The local hash of its tokens.
    pub tokens_hash: LocalBlockHash,
    /// Multimodal objects in the block (already folded into `tokens_hash`).
    #[serde(default)]
    pub mm_extra_info: Option<Box<BlockExtraInfo>>,
}

impl StoredBlock {
    /// A plain text block.
    pub fn new(local: LocalBlockHash, sequence: SequenceBlockHash) -> Self {
        Self {
            block_hash: sequence,
            tokens_hash: local,
            mm_extra_info: None,
        }
    }
}

/// Evicted blocks, by sequence hash, in eviction order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemovedData {
    /// Their sequence hashes.
    pub block_hashes: Vec<SequenceBlockHash>,
}

/// Multimodal metadata of a block (Dynamo's `BlockExtraInfo`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockExtraInfo {
    /// The multimodal objects that appear in the block.
    pub mm_objects: Vec<BlockMmObjectInfo>,
}

/// One multimodal object inside a block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockMmObjectInfo {
    /// Hash identifying the object.
    pub mm_hash: u64,
    /// Token ranges `[start, end)` of its placeholders, relative to the block start.
    pub offsets: Vec<(u64, u64)>,
}

/// Dynamo's residency domain. Unknown values are kept (and such events are not applied to
/// a worker's cache).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResidencyDomain {
    /// The worker's own cache.
    Worker,
    /// A cache owner that outlives worker attachments.
    CacheOwner,
    /// A value this version does not know.
    Unknown(String),
}

impl Serialize for ResidencyDomain {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(match self {
            ResidencyDomain::Worker => "worker",
            ResidencyDomain::CacheOwner => "cache_owner",
            ResidencyDomain::Unknown(v) => v,
        })
    }
}

impl<'de> Deserialize<'de> for ResidencyDomain {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = ResidencyDomain;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a residency domain string")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(match v {
                    "worker" => ResidencyDomain::Worker,
                    "cache_owner" => ResidencyDomain::CacheOwner,
                    other => ResidencyDomain::Unknown(other.to_owned()),
                })
            }
        }
        d.deserialize_str(V)
    }
}

/// Builders used by tests, the replay log and the worker-side library.
impl KvCacheEvent {
    /// A stored chain.
    pub fn stored(
        event_id: u64,
        dp_rank: DpRank,
        parent: Option<SequenceBlockHash>,
        blocks: impl IntoIterator<Item = (LocalBlockHash, SequenceBlockHash)>,
    ) -> Self {
        Self {
            event_id,
            dp_rank,
            data: KvEventData::Stored(StoredData {
                parent_hash: parent,
                start_position: None,
                blocks: blocks
                    .into_iter()
                    .map(|(l, s)| StoredBlock::new(l, s))
                    .collect(),
            }),
        }
    }

    /// Removed blocks.
    pub fn removed(
        event_id: u64,
        dp_rank: DpRank,
        blocks: impl IntoIterator<Item = SequenceBlockHash>,
    ) -> Self {
        Self {
            event_id,
            dp_rank,
            data: KvEventData::Removed(RemovedData {
                block_hashes: blocks.into_iter().collect(),
            }),
        }
    }

    /// A clear of the whole (worker, dp rank).
    pub fn cleared(event_id: u64, dp_rank: DpRank) -> Self {
        Self {
            event_id,
            dp_rank,
            data: KvEventData::Cleared,
        }
    }
}
