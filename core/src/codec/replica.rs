//! `active_sequences_events`: router replicas sharing their slot predictions
//! (Dynamo 1.6.1's `ActiveSequenceEvent`).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{CodecError, Envelope, TOPIC_ACTIVE_SEQUENCES, from_msgpack, to_msgpack};
use crate::worker::WorkerDp;

/// One slot change on one worker, sent by router `router_id`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActiveSequenceEvent {
    /// The request.
    pub request_id: String,
    /// The worker (and rank) that serves it.
    pub worker: WorkerDp,
    /// What changed.
    pub data: ActiveSequenceEventData,
    /// The sender, so that a router ignores its own messages.
    pub router_id: u64,
    /// The request's LoRA adapter, if any.
    #[serde(default)]
    pub lora_name: Option<String>,
}

/// What changed for the request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ActiveSequenceEventData {
    /// A request was routed to the worker.
    AddRequest {
        /// The request's block sequence hashes (its prompt blocks).
        token_sequence: Option<Vec<u64>>,
        /// Whether its prefill tokens count as load until the first token.
        #[serde(default = "yes")]
        track_prefill_tokens: bool,
        /// Expected output length, if known.
        #[serde(default)]
        expected_output_tokens: Option<u32>,
        /// The sender's estimate of the prefill work.
        #[serde(default)]
        prefill_load_hint: Option<PrefillLoadHint>,
    },
    /// The request finished (or was cancelled).
    Free,
    /// The request produced its first token: its prefill is done.
    MarkPrefillCompleted,
}

fn yes() -> bool {
    true
}

/// The sender's estimate of a request's prefill work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillLoadHint {
    /// Prompt tokens not covered by the cache on the chosen worker.
    pub initial_effective_prefill_tokens: u64,
    /// Expected prefill duration, if the sender predicts one.
    #[serde(default)]
    pub expected_prefill_duration: Option<Duration>,
}

/// A batch of events (Dynamo's `ActiveSequenceEventBatch`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActiveSequenceEventBatch {
    /// The events, in the sender's order.
    pub events: Vec<ActiveSequenceEvent>,
}

/// Decodes a payload holding one event or a batch.
pub fn decode(payload: &[u8]) -> Result<Vec<ActiveSequenceEvent>, CodecError> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrBatch {
        Batch(ActiveSequenceEventBatch),
        One(ActiveSequenceEvent),
    }
    match from_msgpack::<OneOrBatch>("active sequence event", payload)? {
        OneOrBatch::Batch(b) => Ok(b.events),
        OneOrBatch::One(e) => Ok(vec![e]),
    }
}

/// Encodes one event as a payload (what Dynamo 1.6.1 publishes, one per message).
pub fn encode(event: &ActiveSequenceEvent) -> Result<Vec<u8>, CodecError> {
    to_msgpack("active sequence event", event)
}

/// Encodes a batch as a payload.
pub fn encode_batch(events: &[ActiveSequenceEvent]) -> Result<Vec<u8>, CodecError> {
    #[derive(Serialize)]
    struct BatchRef<'a> {
        events: &'a [ActiveSequenceEvent],
    }
    to_msgpack("active sequence batch", &BatchRef { events })
}

/// Decodes a whole NATS message.
pub fn decode_message(
    message: &[u8],
) -> Result<(Envelope<'_>, Vec<ActiveSequenceEvent>), CodecError> {
    let env = Envelope::decode_topic(message, TOPIC_ACTIVE_SEQUENCES)?;
    Ok((env, decode(env.payload)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn add() -> ActiveSequenceEvent {
        ActiveSequenceEvent {
            request_id: "r1".into(),
            worker: WorkerDp::new(u64::MAX, 2),
            data: ActiveSequenceEventData::AddRequest {
                token_sequence: Some(vec![1, u64::MAX]),
                track_prefill_tokens: true,
                expected_output_tokens: Some(10),
                prefill_load_hint: Some(PrefillLoadHint {
                    initial_effective_prefill_tokens: 871,
                    expected_prefill_duration: Some(Duration::from_millis(1500)),
                }),
            },
            router_id: 3,
            lora_name: None,
        }
    }

    #[test]
    fn single_and_batch_round_trip() {
        let free = ActiveSequenceEvent {
            data: ActiveSequenceEventData::Free,
            ..add()
        };
        assert_eq!(decode(&encode(&add()).unwrap()).unwrap(), vec![add()]);
        let batch = vec![add(), free];
        assert_eq!(decode(&encode_batch(&batch).unwrap()).unwrap(), batch);
    }

    #[test]
    fn malformed_is_an_error() {
        assert!(decode(b"\x80").is_err());
        assert!(decode(b"").is_err());
        assert!(decode(b"\x81\xa6events\x91\x80").is_err());
    }
}
