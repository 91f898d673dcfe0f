//! Wire codecs for Dynamo 1.6.1's event plane, and its JSON form of KV events.
//!
//! Dynamo publishes on NATS subjects
//! `namespace.{ns}.component.{component}.endpoint.{endpoint}.{topic}` (see [`Subjects`]).
//! Every message is a MessagePack map, the [`Envelope`]
//! `{publisher_id, sequence, published_at, topic, payload}`, whose `payload` is a
//! MessagePack `bin` holding the topic's own MessagePack value:
//!
//! | topic | payload | module |
//! |---|---|---|
//! | `kv-events` | list of [`RouterEvent`](crate::event::RouterEvent) | [`kv`] |
//! | `active_sequences_events` | one [`ActiveSequenceEvent`](replica::ActiveSequenceEvent) or a batch | [`replica`] |
//! | `kv_metrics` | [`KvMetrics`](metrics::KvMetrics) | [`metrics`] |
//! | `forward-pass-metrics` | [`ForwardPassMetrics`](metrics::ForwardPassMetrics) | [`metrics`] |
//! | `kvrouter_session_bindings` (ours, not Dynamo's) | [`SessionBinding`](session::SessionBinding)s | [`session`] |
//!
//! Structs are encoded as maps with named fields in Dynamo's field order (rmp-serde's
//! `to_vec_named`, as Dynamo does), so decoding a captured message and encoding it again
//! gives the same bytes. Unknown fields are ignored. Malformed input gives a
//! [`CodecError`], never a panic (fuzzed by `fuzz/fuzz_targets/codec_decode.rs`).
//!
//! [`openai`] parses the body of an OpenAI request for the front (JSON, not Dynamo's wire).

pub mod kv;
pub mod metrics;
pub mod openai;
pub mod replica;
pub mod session;
pub mod vllm;

use serde::{Deserialize, Serialize};

/// Topic of KV cache events.
pub const TOPIC_KV_EVENTS: &str = "kv-events";
/// Topic of router replica sync.
pub const TOPIC_ACTIVE_SEQUENCES: &str = "active_sequences_events";
/// Topic of a worker's load metrics.
pub const TOPIC_KV_METRICS: &str = "kv_metrics";
/// Topic of a worker's per-forward-pass metrics.
pub const TOPIC_FORWARD_PASS_METRICS: &str = "forward-pass-metrics";
/// Topic of session bindings shared between kvrouter replicas (kvrouter's own).
pub const TOPIC_SESSION_BINDINGS: &str = "kvrouter_session_bindings";

/// Why a payload could not be decoded or encoded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CodecError {
    /// The bytes are not valid MessagePack of the expected shape.
    #[error("malformed {what} (msgpack): {source}")]
    Msgpack {
        /// What was being decoded.
        what: &'static str,
        /// The decoder's error.
        #[source]
        source: rmp_serde::decode::Error,
    },
    /// The bytes are not valid JSON of the expected shape.
    #[error("malformed {what} (json): {source}")]
    Json {
        /// What was being decoded.
        what: &'static str,
        /// The decoder's error.
        #[source]
        source: serde_json::Error,
    },
    /// The envelope's topic is not the one the caller expected.
    #[error("unexpected topic {found:?}, expected {expected:?}")]
    UnexpectedTopic {
        /// The topic the caller asked for.
        expected: &'static str,
        /// The topic in the envelope.
        found: String,
    },
    /// Bytes our own MessagePack reader refused.
    #[error("malformed {what} at byte {at}: {why}")]
    Malformed {
        /// What was being decoded.
        what: &'static str,
        /// Where.
        at: usize,
        /// Why.
        why: &'static str,
    },
    /// A ZMQ event-plane frame whose header does not match its length.
    #[error("malformed ZMQ event-plane frame ({0})")]
    Frame(&'static str),
    /// Encoding failed (only possible for values that MessagePack cannot represent).
    #[error("cannot encode {what}: {source}")]
    Encode {
        /// What was being encoded.
        what: &'static str,
        /// The encoder's error.
        #[source]
        source: rmp_serde::encode::Error,
    },
}

impl CodecError {
    /// A short stable label, for metrics (`kvrouter_ingest_decode_errors_total{kind=...}`).
    pub fn kind(&self) -> &'static str {
        match self {
            CodecError::Msgpack { .. } => "msgpack",
            CodecError::Json { .. } => "json",
            CodecError::UnexpectedTopic { .. } => "topic",
            CodecError::Frame(_) => "frame",
            CodecError::Malformed { .. } => "malformed",
            CodecError::Encode { .. } => "encode",
        }
    }
}

/// The envelope inside the last frame of a Dynamo ZMQ event-plane message
/// (`[topic, publisher id, seq, frame]`): a format byte (1), the envelope's length as four
/// big-endian bytes, then the same MessagePack envelope the NATS plane carries.
pub fn zmq_plane_envelope(frame: &[u8]) -> Result<&[u8], CodecError> {
    let (&format, rest) = frame.split_first().ok_or(CodecError::Frame("empty"))?;
    if format != 1 {
        return Err(CodecError::Frame("unknown format byte"));
    }
    let (len, body) = rest
        .split_at_checked(4)
        .ok_or(CodecError::Frame("no length"))?;
    let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
    if len != body.len() {
        return Err(CodecError::Frame("length does not match"));
    }
    Ok(body)
}

pub(crate) fn from_msgpack<'a, T: Deserialize<'a>>(
    what: &'static str,
    bytes: &'a [u8],
) -> Result<T, CodecError> {
    rmp_serde::from_slice(bytes).map_err(|source| CodecError::Msgpack { what, source })
}

pub(crate) fn to_msgpack<T: Serialize + ?Sized>(
    what: &'static str,
    value: &T,
) -> Result<Vec<u8>, CodecError> {
    rmp_serde::to_vec_named(value).map_err(|source| CodecError::Encode { what, source })
}

/// The event-plane envelope around every Dynamo message. Borrows from the message bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Envelope<'a> {
    /// Random id of the publishing process/connection.
    pub publisher_id: u64,
    /// Per-publisher message counter, from 0.
    pub sequence: u64,
    /// Publish time, milliseconds since the Unix epoch.
    pub published_at: u64,
    /// The topic (last subject token).
    #[serde(borrow)]
    pub topic: &'a str,
    /// The topic's MessagePack payload.
    #[serde(with = "serde_bytes", borrow)]
    pub payload: &'a [u8],
}

impl<'a> Envelope<'a> {
    /// Decodes a whole NATS message body.
    pub fn decode(message: &'a [u8]) -> Result<Self, CodecError> {
        from_msgpack("envelope", message)
    }

    /// Decodes and checks the topic.
    pub fn decode_topic(message: &'a [u8], topic: &'static str) -> Result<Self, CodecError> {
        let env = Self::decode(message)?;
        if env.topic != topic {
            return Err(CodecError::UnexpectedTopic {
                expected: topic,
                found: env.topic.to_owned(),
            });
        }
        Ok(env)
    }

    /// Encodes the envelope (with its payload) as a NATS message body.
    pub fn encode(&self) -> Vec<u8> {
        // A map of integers, a string and a bin cannot fail to encode into a Vec.
        to_msgpack("envelope", self).unwrap_or_default()
    }
}

/// Dynamo's subject naming for one endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subjects {
    /// Dynamo namespace (`dynamo` by default).
    pub namespace: String,
    /// Component (`backend` by default).
    pub component: String,
    /// Endpoint (`generate` by default).
    pub endpoint: String,
}

impl Default for Subjects {
    fn default() -> Self {
        Self {
            namespace: "dynamo".into(),
            component: "backend".into(),
            endpoint: "generate".into(),
        }
    }
}

impl Subjects {
    /// The subject of `topic` on this endpoint.
    pub fn subject(&self, topic: &str) -> String {
        format!(
            "namespace.{}.component.{}.endpoint.{}.{topic}",
            self.namespace, self.component, self.endpoint
        )
    }

    /// The kv-events subject.
    pub fn kv_events(&self) -> String {
        self.subject(TOPIC_KV_EVENTS)
    }

    /// A wildcard subject matching every topic of this endpoint.
    pub fn all_topics(&self) -> String {
        self.subject("*")
    }

    /// Splits a subject into `(namespace, component, endpoint, topic)`.
    pub fn parse(subject: &str) -> Option<(&str, &str, &str, &str)> {
        let mut it = subject.split('.');
        let (Some("namespace"), Some(ns), Some("component"), Some(c), Some("endpoint"), Some(e)) = (
            it.next(),
            it.next(),
            it.next(),
            it.next(),
            it.next(),
            it.next(),
        ) else {
            return None;
        };
        let topic = it.next()?;
        if it.next().is_some() {
            return None;
        }
        Some((ns, c, e, topic))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_format_and_parse() {
        let s = Subjects::default();
        assert_eq!(
            s.kv_events(),
            "namespace.dynamo.component.backend.endpoint.generate.kv-events"
        );
        assert_eq!(
            Subjects::parse(&s.kv_events()),
            Some(("dynamo", "backend", "generate", "kv-events"))
        );
        assert_eq!(Subjects::parse("namespace.a.component.b.endpoint.c"), None);
        assert_eq!(
            Subjects::parse("namespace.a.component.b.endpoint.c.d.e"),
            None
        );
    }

    #[test]
    fn envelope_round_trip_and_errors() {
        let env = Envelope {
            publisher_id: 7,
            sequence: 3,
            published_at: 99,
            topic: "kv-events",
            payload: &[0x90],
        };
        let bytes = env.encode();
        assert_eq!(Envelope::decode(&bytes).unwrap(), env);
        assert!(matches!(
            Envelope::decode_topic(&bytes, TOPIC_KV_METRICS),
            Err(CodecError::UnexpectedTopic { .. })
        ));
        assert!(Envelope::decode(&bytes[..bytes.len() - 1]).is_err());
        assert!(Envelope::decode(&[]).is_err());
    }
}
