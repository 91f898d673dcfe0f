//! `kvrouter_session_bindings`: router replicas sharing their session bindings.
//!
//! A topic of kvrouter's own, beside Dynamo's `active_sequences_events` (whose messages
//! have no field for a session and which Dynamo's routers also read). Dynamo's routers do
//! not subscribe to it. The payload is a MessagePack map `{bindings: [...]}`, each binding
//! `{session, worker, bound_at_ms, router_id}`; what a replica does with one is
//! [`Sessions::apply`](crate::sessions::Sessions::apply)'s.

use serde::{Deserialize, Serialize};

use super::{CodecError, Envelope, TOPIC_SESSION_BINDINGS, from_msgpack, to_msgpack};
use crate::worker::WorkerDp;

/// One session bound to one worker, as the router that bound it announces it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionBinding {
    /// The session, as its requests name it.
    pub session: String,
    /// The worker (and rank) it is bound to.
    pub worker: WorkerDp,
    /// When the binding was made, ms since the Unix epoch on the router that made it. With
    /// `router_id` it orders two bindings of one session: the later one wins everywhere.
    pub bound_at_ms: u64,
    /// The router that made the binding (not always the one that announces it: a router
    /// that keeps a session on a binding it heard of announces it again, unchanged).
    pub router_id: u64,
}

/// Encodes bindings as a payload.
pub fn encode_batch(bindings: &[SessionBinding]) -> Result<Vec<u8>, CodecError> {
    #[derive(Serialize)]
    struct BatchRef<'a> {
        bindings: &'a [SessionBinding],
    }
    to_msgpack("session bindings", &BatchRef { bindings })
}

/// Decodes a payload.
pub fn decode(payload: &[u8]) -> Result<Vec<SessionBinding>, CodecError> {
    #[derive(Deserialize)]
    struct Batch {
        bindings: Vec<SessionBinding>,
    }
    Ok(from_msgpack::<Batch>("session bindings", payload)?.bindings)
}

/// Decodes a whole NATS message.
pub fn decode_message(message: &[u8]) -> Result<(Envelope<'_>, Vec<SessionBinding>), CodecError> {
    let env = Envelope::decode_topic(message, TOPIC_SESSION_BINDINGS)?;
    Ok((env, decode(env.payload)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_malformed() {
        let b = vec![
            SessionBinding {
                session: "agent-7".into(),
                worker: WorkerDp::new(u64::MAX, 3),
                bound_at_ms: 1_780_000_000_000,
                router_id: 9,
            },
            SessionBinding {
                session: String::new(),
                worker: WorkerDp::new(1, 0),
                bound_at_ms: 0,
                router_id: 0,
            },
        ];
        let payload = encode_batch(&b).unwrap();
        assert_eq!(decode(&payload).unwrap(), b);
        let env = Envelope {
            publisher_id: 4,
            sequence: 0,
            published_at: 1,
            topic: TOPIC_SESSION_BINDINGS,
            payload: &payload,
        };
        let message = env.encode();
        let (e, got) = decode_message(&message).unwrap();
        assert_eq!((e.publisher_id, got), (4, b));
        assert!(decode(b"").is_err());
        assert!(decode(b"\x80").is_err());
        assert!(decode(b"\x81\xa8bindings\x91\x80").is_err());
        let other = Envelope {
            topic: super::super::TOPIC_ACTIVE_SEQUENCES,
            ..env
        };
        assert!(matches!(
            decode_message(&other.encode()),
            Err(CodecError::UnexpectedTopic { .. })
        ));
    }
}
