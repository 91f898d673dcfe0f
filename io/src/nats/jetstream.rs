//! The slice of the JetStream API the durable mode needs, over our [`Client`]: bind or
//! create a stream, (re)create a durable push consumer at a stream sequence, read the
//! delivery metadata of a message from its ack subject, acknowledge, and publish with a
//! stored-acknowledgement (PubAck).
//!
//! Requests are JSON on `$JS.API.*` subjects (the NATS JetStream API reference); errors in
//! replies (`{"error": {"code", "err_code", "description"}}`) become [`JsError::Api`].

use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use serde_json::json;

use super::{Client, NatsError};

/// Why a JetStream operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum JsError {
    /// The request did not get through (no JetStream, timeout, disconnected).
    #[error("nats")]
    Nats(#[from] NatsError),
    /// The server refused.
    #[error("jetstream error {code}/{err_code}: {description}")]
    Api {
        /// HTTP-like status.
        code: u16,
        /// JetStream's own error code.
        err_code: u32,
        /// The server's words.
        description: String,
    },
    /// A body that is not the JSON the API documents (the reply, or the `error` in it),
    /// or a request that cannot be encoded.
    #[error("malformed jetstream {what}")]
    Json {
        /// Which body: `request`, `reply`, `reply error`.
        what: &'static str,
        /// Why (serde_json's error).
        #[source]
        source: JsonError,
    },
    /// The reply was JSON, but not what the API documents.
    #[error("unexpected jetstream reply: {0}")]
    Reply(String),
}

impl JsError {
    fn json(what: &'static str) -> impl FnOnce(serde_json::Error) -> Self {
        move |e| JsError::Json {
            what,
            source: JsonError(Arc::new(e)),
        }
    }
}

/// A serde_json error that can be cloned and compared (by category), as [`JsError`] is.
#[derive(Debug, Clone)]
pub struct JsonError(Arc<serde_json::Error>);

impl JsonError {
    /// The error itself.
    pub fn get_ref(&self) -> &serde_json::Error {
        &self.0
    }
}

impl std::fmt::Display for JsonError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for JsonError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

impl PartialEq for JsonError {
    fn eq(&self, other: &Self) -> bool {
        self.0.classify() == other.0.classify()
    }
}

impl Eq for JsonError {}

/// JetStream's "stream not found" error code.
pub const ERR_STREAM_NOT_FOUND: u32 = 10059;
/// JetStream's "consumer not found" error code.
pub const ERR_CONSUMER_NOT_FOUND: u32 = 10014;

#[derive(Debug, Deserialize)]
struct ApiError {
    #[serde(default)]
    code: u16,
    #[serde(default)]
    err_code: u32,
    #[serde(default)]
    description: String,
}

async fn api(
    client: &Client,
    subject: &str,
    body: &serde_json::Value,
    timeout: Duration,
) -> Result<serde_json::Value, JsError> {
    let payload = serde_json::to_vec(body).map_err(JsError::json("request"))?;
    reply_json(&client.request(subject, &payload, timeout).await?.payload)
}

/// A JetStream reply as JSON, or its `error` as [`JsError::Api`].
fn reply_json(payload: &[u8]) -> Result<serde_json::Value, JsError> {
    let v: serde_json::Value = serde_json::from_slice(payload).map_err(JsError::json("reply"))?;
    if let Some(err) = v.get("error") {
        let e: ApiError =
            serde_json::from_value(err.clone()).map_err(JsError::json("reply error"))?;
        return Err(JsError::Api {
            code: e.code,
            err_code: e.err_code,
            description: e.description,
        });
    }
    Ok(v)
}

/// What a durable stream is made of.
#[derive(Debug, Clone)]
pub struct StreamSpec {
    /// Stream name (no `.`, `*`, `>` or spaces).
    pub name: String,
    /// Subjects it captures.
    pub subjects: Vec<String>,
    /// Messages older than this are dropped (`None`: kept until other limits apply).
    pub max_age: Option<Duration>,
    /// Total bytes kept (`None`: unlimited).
    pub max_bytes: Option<u64>,
}

/// A stream's sequence range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StreamState {
    /// Messages held.
    pub messages: u64,
    /// Oldest sequence held.
    pub first_seq: u64,
    /// Newest sequence held.
    pub last_seq: u64,
}

fn state_of(v: &serde_json::Value) -> StreamState {
    let n = |k: &str| v["state"][k].as_u64().unwrap_or(0);
    StreamState {
        messages: n("messages"),
        first_seq: n("first_seq"),
        last_seq: n("last_seq"),
    }
}

/// Binds the stream when it exists (checking that it captures our subjects), creates it
/// otherwise (file storage, limits retention, discard old).
pub async fn ensure_stream(
    client: &Client,
    spec: &StreamSpec,
    timeout: Duration,
) -> Result<StreamState, JsError> {
    let info = format!("$JS.API.STREAM.INFO.{}", spec.name);
    match api(client, &info, &json!({}), timeout).await {
        Ok(v) => {
            let have: Vec<&str> = v["config"]["subjects"]
                .as_array()
                .map(|a| a.iter().filter_map(|s| s.as_str()).collect())
                .unwrap_or_default();
            if let Some(missing) = spec.subjects.iter().find(|s| !have.contains(&s.as_str())) {
                return Err(JsError::Reply(format!(
                    "stream {} exists but does not capture {missing} (it captures {have:?})",
                    spec.name
                )));
            }
            Ok(state_of(&v))
        }
        Err(JsError::Api {
            err_code: ERR_STREAM_NOT_FOUND,
            ..
        }) => {
            let mut cfg = json!({
                "name": spec.name,
                "subjects": spec.subjects,
                "retention": "limits",
                "storage": "file",
                "discard": "old",
                "num_replicas": 1,
            });
            if let Some(age) = spec.max_age {
                cfg["max_age"] = json!(age.as_nanos() as u64);
            }
            if let Some(b) = spec.max_bytes {
                cfg["max_bytes"] = json!(b);
            }
            let create = format!("$JS.API.STREAM.CREATE.{}", spec.name);
            let v = api(client, &create, &cfg, timeout).await?;
            Ok(state_of(&v))
        }
        Err(e) => Err(e),
    }
}

/// A durable push consumer's settings.
#[derive(Debug, Clone)]
pub struct ConsumerSpec {
    /// The stream.
    pub stream: String,
    /// The durable name (one per router replica).
    pub durable: String,
    /// Where the server pushes messages.
    pub deliver_subject: String,
    /// First stream sequence to deliver (`None`: from the start of the stream).
    pub start_seq: Option<u64>,
    /// Unacknowledged messages the server may have in flight.
    pub max_ack_pending: u64,
    /// Redelivery delay of an unacknowledged message.
    pub ack_wait: Duration,
    /// Have the server send a heartbeat when it has nothing to deliver for this long.
    pub idle_heartbeat: Option<Duration>,
}

/// Deletes the durable consumer if it exists and creates it afresh at `start_seq`, so that
/// delivery resumes exactly where the caller's state ends (acknowledgement policy `all`).
pub async fn recreate_consumer(
    client: &Client,
    spec: &ConsumerSpec,
    timeout: Duration,
) -> Result<(), JsError> {
    let del = format!("$JS.API.CONSUMER.DELETE.{}.{}", spec.stream, spec.durable);
    match api(client, &del, &json!({}), timeout).await {
        Ok(_)
        | Err(JsError::Api {
            err_code: ERR_CONSUMER_NOT_FOUND,
            ..
        }) => {}
        Err(e) => return Err(e),
    }
    let mut config = json!({
        "durable_name": spec.durable,
        "deliver_subject": spec.deliver_subject,
        "ack_policy": "all",
        "ack_wait": spec.ack_wait.as_nanos() as u64,
        "max_ack_pending": spec.max_ack_pending,
        "replay_policy": "instant",
        "max_deliver": -1,
    });
    if let Some(hb) = spec.idle_heartbeat {
        config["idle_heartbeat"] = json!(hb.as_nanos() as u64);
    }
    match spec.start_seq {
        Some(seq) => {
            config["deliver_policy"] = json!("by_start_sequence");
            config["opt_start_seq"] = json!(seq.max(1));
        }
        None => config["deliver_policy"] = json!("all"),
    }
    let create = format!(
        "$JS.API.CONSUMER.DURABLE.CREATE.{}.{}",
        spec.stream, spec.durable
    );
    api(
        client,
        &create,
        &json!({ "stream_name": spec.stream, "config": config }),
        timeout,
    )
    .await?;
    Ok(())
}

/// Delivery metadata of a JetStream message, from its ack subject.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delivery {
    /// Times delivered (1 on the first delivery).
    pub delivered: u64,
    /// The message's stream sequence.
    pub stream_seq: u64,
    /// Its sequence in this consumer's deliveries (contiguous for first deliveries).
    pub consumer_seq: u64,
    /// Messages still pending for the consumer.
    pub pending: u64,
}

/// Parses `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>` and the
/// newer form with domain and account hash (`$JS.ACK.<domain>.<hash>.<stream>...`).
pub fn parse_ack_subject(reply: &str) -> Option<Delivery> {
    let t: Vec<&str> = reply.split('.').collect();
    if t.len() < 9 || t[0] != "$JS" || t[1] != "ACK" {
        return None;
    }
    let base = match t.len() {
        9 => 4,
        n if n >= 11 => 6,
        _ => return None,
    };
    let n = |i: usize| t.get(base + i)?.parse::<u64>().ok();
    Some(Delivery {
        delivered: n(0)?,
        stream_seq: n(1)?,
        consumer_seq: n(2)?,
        pending: n(4)?,
    })
}

/// Publishes into a stream and waits for the server to confirm that it stored the message;
/// returns the stream sequence.
pub async fn publish_acked(
    client: &Client,
    subject: &str,
    payload: &[u8],
    timeout: Duration,
) -> Result<u64, JsError> {
    let v = reply_json(&client.request(subject, payload, timeout).await?.payload)?;
    v["seq"]
        .as_u64()
        .ok_or_else(|| JsError::Reply(format!("no sequence in PubAck {v}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ack_subjects() {
        assert_eq!(
            parse_ack_subject("$JS.ACK.KV.router-a.1.42.7.1700000000000000000.3"),
            Some(Delivery {
                delivered: 1,
                stream_seq: 42,
                consumer_seq: 7,
                pending: 3
            })
        );
        assert_eq!(
            parse_ack_subject("$JS.ACK.hub.ACCHASH.KV.router-a.2.42.7.1700000000000000000.0.tok")
                .map(|d| (d.delivered, d.stream_seq, d.consumer_seq)),
            Some((2, 42, 7))
        );
        assert_eq!(parse_ack_subject("_INBOX.x.y"), None);
        assert_eq!(parse_ack_subject("$JS.ACK.KV.c.x.42.7.1.0"), None);
    }

    #[test]
    fn malformed_replies_keep_serdes_error() {
        use std::error::Error as _;
        let e = reply_json(b"not json").unwrap_err();
        assert!(matches!(e, JsError::Json { what: "reply", .. }), "{e:?}");
        let source = e.source().expect("the serde error is the source");
        assert!(source.to_string().contains("line 1"), "{source}");
        let e = reply_json(br#"{"error": {"code": "not a number"}}"#).unwrap_err();
        assert!(
            matches!(
                e,
                JsError::Json {
                    what: "reply error",
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(matches!(
            reply_json(br#"{"error": {"code": 404, "err_code": 10059, "description": "x"}}"#),
            Err(JsError::Api {
                code: 404,
                err_code: 10059,
                ..
            })
        ));
    }
}
