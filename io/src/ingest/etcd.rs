//! Reading Dynamo's etcd discovery: a prefix listing through etcd's v3 JSON gateway
//! (`POST /v3/kv/range`, keys and values base64), on the proxy's hyper client.
//!
//! Dynamo 1.6.1 keeps the same entries in etcd as in its file backend, under the same
//! keys (`v1/instances/{ns}/{component}/{endpoint}/{id:x}`, `v1/mdc/...`,
//! `v1/event_channels/...`), each value the same JSON, each bound to its worker's lease
//! so that it goes when the worker stops renewing it. A listing is paged
//! ([`PAGE`] keys a request) and every page after the first is read at the first page's
//! revision, so one listing is one consistent view of the store, however many workers it
//! holds. Several endpoints may be given: a transport error moves to the next. Plain HTTP
//! only: TLS and etcd's authentication are not supported (an `https://` endpoint is
//! refused at start).

use std::cell::Cell;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde::Deserialize;

use crate::proxy::Target;
use crate::proxy::upstream::{Pool, UpstreamConfig};

/// Keys asked for in one range request.
const PAGE: usize = 512;
/// A whole exchange (connect, reply, body) must end within this.
const EXCHANGE: Duration = Duration::from_secs(5);

/// Why a listing failed. The watcher keeps what it knew and tries again.
#[derive(Debug, thiserror::Error)]
pub(super) enum EtcdError {
    #[error("etcd at {addr}: {why}")]
    Transport {
        addr: std::net::SocketAddr,
        why: String,
    },
    #[error("etcd at {addr} answered HTTP {status}: {body}")]
    Status {
        addr: std::net::SocketAddr,
        status: u16,
        body: String,
    },
    #[error("etcd at {addr}: unexpected reply: {why}")]
    Reply {
        addr: std::net::SocketAddr,
        why: String,
    },
}

/// The client: endpoints to try in turn and a keep-alive connection pool.
pub(super) struct Etcd {
    targets: Vec<Target>,
    /// The endpoint that answered last (tried first).
    current: Cell<usize>,
    pool: Pool,
    cfg: UpstreamConfig,
}

#[derive(Deserialize)]
struct RangeReply {
    #[serde(default)]
    header: Header,
    #[serde(default)]
    kvs: Vec<Kv>,
    #[serde(default)]
    more: bool,
}

#[derive(Deserialize, Default)]
struct Header {
    /// An int64, which the gateway writes as a string.
    #[serde(default)]
    revision: serde_json::Value,
}

#[derive(Deserialize)]
struct Kv {
    key: String,
    #[serde(default)]
    value: String,
}

impl Etcd {
    pub(super) fn new(targets: Vec<Target>) -> Self {
        assert!(!targets.is_empty(), "etcd discovery needs an endpoint");
        Self {
            targets,
            current: Cell::new(0),
            pool: Pool::default(),
            cfg: UpstreamConfig {
                connect_timeout: Duration::from_secs(1),
                first_byte_timeout: EXCHANGE,
                idle_timeout: EXCHANGE,
                max_idle_per_engine: 2,
            },
        }
    }

    /// Every key under `prefix` with its value, at one revision, in key order.
    pub(super) async fn list(&self, prefix: &[u8]) -> Result<Vec<(Vec<u8>, Vec<u8>)>, EtcdError> {
        let n = self.targets.len();
        let mut last = None;
        for i in 0..n {
            let at = (self.current.get() + i) % n;
            match self.list_at(&self.targets[at], prefix).await {
                Ok(kvs) => {
                    self.current.set(at);
                    return Ok(kvs);
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("at least one endpoint"))
    }

    async fn list_at(
        &self,
        target: &Target,
        prefix: &[u8],
    ) -> Result<Vec<(Vec<u8>, Vec<u8>)>, EtcdError> {
        let end = prefix_end(prefix);
        let mut out = Vec::new();
        let mut from = prefix.to_vec();
        let mut revision: Option<i64> = None;
        loop {
            let mut body = serde_json::json!({
                "key": B64.encode(&from),
                "range_end": B64.encode(&end),
                "limit": PAGE,
            });
            if let Some(r) = revision {
                body["revision"] = r.into();
            }
            let reply: RangeReply = self.post(target, "/v3/kv/range", &body).await?;
            let bad = |why: String| EtcdError::Reply {
                addr: target.addr,
                why,
            };
            if revision.is_none() {
                let r = match &reply.header.revision {
                    serde_json::Value::String(s) => s.parse::<i64>().ok(),
                    v => v.as_i64(),
                };
                revision = Some(r.ok_or_else(|| bad("no revision in the header".into()))?);
            }
            let page = reply.kvs.len();
            for kv in reply.kvs {
                let key = B64
                    .decode(kv.key)
                    .map_err(|e| bad(format!("key not base64: {e}")))?;
                let value = B64
                    .decode(kv.value)
                    .map_err(|e| bad(format!("value not base64: {e}")))?;
                out.push((key, value));
            }
            if !reply.more || page == 0 {
                return Ok(out);
            }
            // The next page starts just past the last key read.
            from = out.last().map(|(k, _)| k.clone()).unwrap_or_default();
            from.push(0);
        }
    }

    async fn post<T: serde::de::DeserializeOwned>(
        &self,
        target: &Target,
        path: &str,
        body: &serde_json::Value,
    ) -> Result<T, EtcdError> {
        let addr = target.addr;
        let bytes = Bytes::from(serde_json::to_vec(body).expect("a JSON value serialises"));
        let build = || {
            hyper::Request::post(format!("{}{path}", target.prefix))
                .header(hyper::header::HOST, target.host.as_str())
                .header(hyper::header::CONTENT_TYPE, "application/json")
                .body(Full::new(bytes.clone()))
                .expect("a valid request")
        };
        let exchange = async {
            let (resp, conn) = self
                .pool
                .send(target, &build, &self.cfg)
                .await
                .map_err(|e| EtcdError::Transport {
                    addr,
                    why: e.to_string(),
                })?;
            let status = resp.status();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| EtcdError::Transport {
                    addr,
                    why: format!("reading the reply: {e}"),
                })?
                .to_bytes();
            self.pool.put(conn, self.cfg.max_idle_per_engine);
            if !status.is_success() {
                let mut text = String::from_utf8_lossy(&body).into_owned();
                text.truncate(200);
                return Err(EtcdError::Status {
                    addr,
                    status: status.as_u16(),
                    body: text,
                });
            }
            serde_json::from_slice(&body).map_err(|e| EtcdError::Reply {
                addr,
                why: e.to_string(),
            })
        };
        let deadline = async {
            glommio::timer::sleep(EXCHANGE).await;
            Err(EtcdError::Transport {
                addr,
                why: format!("no whole reply within {EXCHANGE:?}"),
            })
        };
        futures_lite::future::or(exchange, deadline).await
    }
}

/// The end of `prefix`'s range: the prefix with its last byte below 0xff incremented (and
/// what follows it dropped); `[0]` (every key) when there is none, as etcd defines it.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(&last) = end.last() {
        if last < 0xff {
            *end.last_mut().expect("not empty") += 1;
            return end;
        }
        end.pop();
    }
    vec![0]
}

#[cfg(test)]
mod tests {
    use super::prefix_end;

    #[test]
    fn a_prefix_range_ends_past_every_key_that_starts_with_it() {
        assert_eq!(prefix_end(b"v1/"), b"v10");
        assert_eq!(prefix_end(&[b'a', 0xff]), b"b");
        assert_eq!(prefix_end(&[0xff, 0xff]), [0]);
        assert_eq!(prefix_end(b""), [0]);
    }
}
