//! Worker load metrics that Dynamo workers publish even when idle (`kv_metrics`,
//! `forward-pass-metrics`). The router uses them as heartbeats, and `kv_used_blocks` as a
//! load signal.

use serde::{Deserialize, Serialize};

use super::{
    CodecError, Envelope, TOPIC_FORWARD_PASS_METRICS, TOPIC_KV_METRICS, from_msgpack, to_msgpack,
};
use crate::worker::{DpRank, WorkerDp, WorkerId};

/// `kv_metrics`: Dynamo's `ActiveLoad`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvMetrics {
    /// The worker.
    pub worker_id: WorkerId,
    /// Its rank.
    #[serde(default)]
    pub dp_rank: DpRank,
    /// Decode blocks in use, as a scheduler sees it.
    #[serde(default)]
    pub active_decode_blocks: Option<u64>,
    /// Prefill tokens pending, as a scheduler sees it.
    #[serde(default)]
    pub active_prefill_tokens: Option<u64>,
    /// KV blocks in use on the worker.
    #[serde(default)]
    pub kv_used_blocks: Option<u64>,
}

/// `forward-pass-metrics`: one engine step's batch statistics. `worker_id` is a decimal
/// string on the wire.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForwardPassMetrics {
    /// Format version.
    pub version: u32,
    /// The worker, as a decimal string.
    pub worker_id: String,
    /// Its rank.
    #[serde(default)]
    pub dp_rank: DpRank,
    /// Monotonic step counter.
    pub counter_id: u64,
    /// Step wall time, seconds.
    pub wall_time: f64,
    /// Requests in the step.
    pub scheduled_requests: ScheduledRequests,
    /// Requests waiting.
    pub queued_requests: QueuedRequests,
}

impl ForwardPassMetrics {
    /// The worker, parsed from its decimal string.
    pub fn worker(&self) -> Option<WorkerDp> {
        self.worker_id
            .parse()
            .ok()
            .map(|id| WorkerDp::new(id, self.dp_rank))
    }
}

/// Requests scheduled in a forward pass.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct ScheduledRequests {
    pub num_prefill_requests: u64,
    pub sum_prefill_tokens: u64,
    pub var_prefill_length: f64,
    pub sum_prefill_kv_tokens: u64,
    pub num_decode_requests: u64,
    pub sum_decode_kv_tokens: u64,
    pub var_decode_kv_tokens: f64,
}

/// Requests queued at a forward pass.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct QueuedRequests {
    pub num_prefill_requests: u64,
    pub sum_prefill_tokens: u64,
    pub var_prefill_length: f64,
    pub num_decode_requests: u64,
    pub sum_decode_kv_tokens: u64,
    pub var_decode_kv_tokens: f64,
}

/// Decodes a `kv_metrics` payload.
pub fn decode_kv_metrics(payload: &[u8]) -> Result<KvMetrics, CodecError> {
    from_msgpack("kv_metrics", payload)
}

/// Decodes a `forward-pass-metrics` payload.
pub fn decode_forward_pass(payload: &[u8]) -> Result<ForwardPassMetrics, CodecError> {
    from_msgpack("forward-pass-metrics", payload)
}

/// Encodes a `kv_metrics` payload.
pub fn encode_kv_metrics(m: &KvMetrics) -> Result<Vec<u8>, CodecError> {
    to_msgpack("kv_metrics", m)
}

/// Encodes a `forward-pass-metrics` payload.
pub fn encode_forward_pass(m: &ForwardPassMetrics) -> Result<Vec<u8>, CodecError> {
    to_msgpack("forward-pass-metrics", m)
}

/// The worker a metrics message speaks for: any message a worker publishes is a heartbeat.
/// Reads only the identity fields, so that metric fields added later do not break it.
pub fn heartbeat_worker(env: &Envelope<'_>) -> Result<Option<WorkerDp>, CodecError> {
    #[derive(Deserialize)]
    struct Identity {
        #[serde(deserialize_with = "crate::hash::deserialize_u64_or_string")]
        worker_id: u64,
        #[serde(default)]
        dp_rank: DpRank,
    }
    match env.topic {
        TOPIC_KV_METRICS | TOPIC_FORWARD_PASS_METRICS => {
            let id: Identity = from_msgpack("metrics identity", env.payload)?;
            Ok(Some(WorkerDp::new(id.worker_id, id.dp_rank)))
        }
        _ => Ok(None),
    }
}
