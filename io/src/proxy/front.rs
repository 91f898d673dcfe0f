//! The OpenAI front's listener and handlers, and the routing of a proxied request: its
//! decision (with session affinity, [`super::session`]), the exchange with the chosen
//! engine and the retries on the next-best worker (see the [module docs](super)). Reading
//! the request is [`super::request`]'s; relaying the answer, [`super::relay`]'s.

use std::cell::RefCell;
use std::collections::HashMap;
use std::convert::Infallible;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_lite::io::AsyncWriteExt;
use glommio::net::TcpListener;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{self, HeaderName, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use kvrouter_core::decision::DecideError;
use kvrouter_core::hash::{HashOptions, local_block_hashes};
use kvrouter_core::worker::WorkerDp;
use serde_json::Value as Json;

use super::model::ModelCard;
use super::relay::{Inflight, Life, ProxyBody};
use super::request::{Models, Prompt};
use super::rt::{Io, Timer};
use super::stats::ProxyStats;
use super::upstream::{Pool, Target};
use super::{Backend, ProxyConfig, ProxyError};
use crate::routing::{Ask, Routing, Update};
use crate::throttle::Throttle;

/// Which OpenAI endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Endpoint {
    Chat,
    Completions,
}

impl Endpoint {
    fn label(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat_completions",
            Endpoint::Completions => "completions",
        }
    }
}

/// The front's state: the router's, the models, the engines and the pool.
pub(crate) struct Front {
    /// The routing state, shared with the routing API on this executor.
    pub(super) state: Rc<RefCell<dyn Routing>>,
    pub(super) cfg: ProxyConfig,
    /// What it serves (shared with the tokenizer threads).
    pub(super) models: Arc<Models>,
    pub(super) tokenizers: super::tokenize::Tokenizers,
    targets: HashMap<u64, Target>,
    dynamo: Option<Target>,
    pub(super) pool: Pool,
    pub(super) stats: Rc<ProxyStats>,
    warn: Throttle,
    created: u64,
}

impl std::fmt::Debug for Front {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Front")
            .field("listen", &self.cfg.listen)
            .field("models", &self.models.0.len())
            .finish_non_exhaustive()
    }
}

/// An OpenAI-style error answer.
pub(super) fn error(status: u16, kind: &str, message: impl AsRef<str>) -> Response<ProxyBody> {
    let body = serde_json::json!({
        "error": {"message": message.as_ref(), "type": kind, "param": null, "code": status}
    });
    let mut r = Response::new(ProxyBody::full(
        serde_json::to_vec(&body).unwrap_or_default(),
    ));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

fn json_response(status: u16, body: Vec<u8>, content_type: &'static str) -> Response<ProxyBody> {
    let mut r = Response::new(ProxyBody::full(body));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

/// Headers that describe one hop, not the message: never forwarded.
pub(super) fn hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "proxy-connection"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "host"
            | "content-length"
    )
}

impl Front {
    pub(crate) fn new(
        state: Rc<RefCell<dyn Routing>>,
        cfg: ProxyConfig,
        stats: Rc<ProxyStats>,
    ) -> Result<Self, ProxyError> {
        let mut models = Vec::new();
        let mut cards: HashMap<std::path::PathBuf, Arc<ModelCard>> = HashMap::new();
        // The piece caches share one budget: each distinct card gets its part.
        let distinct = cfg
            .models
            .iter()
            .map(|m| &m.dir)
            .collect::<std::collections::HashSet<_>>()
            .len();
        let piece_cache_bytes = cfg.piece_cache_bytes / distinct.max(1);
        for m in &cfg.models {
            let card = match cards.get(&m.dir) {
                Some(c) => Arc::clone(c),
                None => {
                    let card =
                        ModelCard::load_with(&m.dir, piece_cache_bytes).map_err(|source| {
                            ProxyError::Model {
                                name: m.name.clone(),
                                dir: m.dir.clone(),
                                source,
                            }
                        })?;
                    if !card.has_chat_template() {
                        tracing::warn!(model = %m.name, "no chat template: /v1/chat/completions answers 400 for it");
                    }
                    let card = Arc::new(card);
                    cards.insert(m.dir.clone(), Arc::clone(&card));
                    stats
                        .cards
                        .borrow_mut()
                        .push((m.name.clone(), Arc::clone(&card)));
                    card
                }
            };
            models.push((m.name.clone(), card, m.lora_name.clone()));
        }
        let (targets, dynamo) = match &cfg.backend {
            Backend::Engines(list) => (list.iter().cloned().collect(), None),
            Backend::DynamoDirect(t) => (HashMap::new(), Some(t.clone())),
        };
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let tokenizers =
            super::tokenize::Tokenizers::new(cfg.tokenizer_threads, cfg.inline_tokenize_bytes)
                .map_err(ProxyError::Threads)?;
        Ok(Front {
            state,
            cfg,
            models: Arc::new(Models(models)),
            tokenizers,
            targets,
            dynamo,
            pool: Pool::default(),
            stats,
            warn: Throttle::new(Duration::from_secs(10)),
            created,
        })
    }

    async fn handle(self: Rc<Self>, req: Request<Incoming>) -> Response<ProxyBody> {
        let path = req.uri().path().trim_end_matches('/').to_owned();
        match (req.method(), path.as_str()) {
            (&Method::POST, "/v1/chat/completions") => self.proxy(req, Endpoint::Chat).await,
            (&Method::POST, "/v1/completions") => self.proxy(req, Endpoint::Completions).await,
            (&Method::GET, "/v1/models") => self.models_json(),
            (&Method::GET, "/healthz") => {
                if self.state.borrow().is_healthy() {
                    json_response(200, br#"{"status":"ok"}"#.to_vec(), "application/json")
                } else {
                    error(503, "unavailable", "the KV index is not ready")
                }
            }
            (&Method::GET, "/metrics") => {
                let text = self.state.borrow().metrics_text();
                json_response(200, text.into_bytes(), "text/plain; version=0.0.4")
            }
            (
                _,
                "/v1/chat/completions" | "/v1/completions" | "/v1/models" | "/healthz" | "/metrics",
            ) => error(405, "invalid_request_error", "method not allowed"),
            _ => error(
                404,
                "invalid_request_error",
                format!("no such endpoint: {path}"),
            ),
        }
    }

    fn models_json(&self) -> Response<ProxyBody> {
        let data: Vec<Json> = self
            .models
            .0
            .iter()
            .map(|(name, _, _)| {
                serde_json::json!({"id": name, "object": "model", "created": self.created, "owned_by": "kvrouter"})
            })
            .collect();
        let body = serde_json::json!({"object": "list", "data": data});
        json_response(
            200,
            serde_json::to_vec(&body).unwrap_or_default(),
            "application/json",
        )
    }

    /// A refused decision as the client sees it, counted as `/v1/route` counts it.
    fn refused(&self, e: &DecideError) -> Response<ProxyBody> {
        let r = self.state.borrow_mut().refusal(e);
        let kind = match r.status {
            429 => "rate_limit_error",
            503 => "unavailable",
            _ => "invalid_request_error",
        };
        if matches!(r.status, 429 | 503) {
            self.stats.refused(r.status);
        }
        let mut out = error(r.status, kind, e.to_string());
        if let Some(s) = r.retry_after {
            out.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        out
    }

    async fn proxy(self: Rc<Self>, req: Request<Incoming>, ep: Endpoint) -> Response<ProxyBody> {
        let started = Instant::now();
        let inflight = Inflight::new(Rc::clone(&self.stats));
        let resp = self.proxy_inner(req, ep, started, inflight).await;
        self.stats.answered(ep.label(), resp.status().as_u16());
        resp
    }

    async fn proxy_inner(
        self: &Rc<Self>,
        req: Request<Incoming>,
        ep: Endpoint,
        started: Instant,
        inflight: Inflight,
    ) -> Response<ProxyBody> {
        let (parts, body) = req.into_parts();
        let Prompt {
            body,
            json,
            model,
            tokens,
            prompt_ids,
            stream,
            lora,
        } = match self.read_prompt(&parts.headers, body, ep).await {
            Ok(p) => p,
            Err(r) => return r,
        };
        let model = model.as_str();
        let bs = self.state.borrow().block_size();
        if let Err(e) = self
            .state
            .borrow()
            .check_blocks(tokens.len() / bs.max(1) as usize)
        {
            return self.refused(&e);
        }
        let locals = local_block_hashes(
            &tokens,
            bs,
            &HashOptions {
                lora_name: lora.as_deref(),
                ..HashOptions::default()
            },
        );
        let session = self.session_of(&parts.headers);
        let client_id = parts
            .headers
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let mut excluded: Vec<WorkerDp> = Vec::new();
        let mut last_error = String::new();
        let mut attempt = 0u32;
        loop {
            let ask = Ask {
                locals: &locals,
                tokens: tokens.len() as u64,
                request_id: client_id.as_deref().filter(|_| attempt == 0),
                lora_name: lora.clone(),
                explain: false,
            };
            let d = match self.choose(ask, session.as_deref(), &excluded) {
                Ok(d) => d,
                Err(DecideError::NoWorkers) if !excluded.is_empty() => {
                    return error(
                        502,
                        "upstream_error",
                        format!("every candidate worker failed; the last: {last_error}"),
                    );
                }
                Err(e) => return self.refused(&e),
            };
            if attempt == 0 {
                self.stats.routing.observe(started.elapsed().as_secs_f64());
                self.stats
                    .add(&self.stats.prompt_tokens, tokens.len() as u64);
                if let Some(streak) =
                    self.stats
                        .overlap(model, d.overlap_blocks > 0, self.cfg.zero_overlap_warn)
                    && tokens.len() >= bs as usize
                {
                    tracing::warn!(
                        model,
                        streak,
                        "requests keep finding no cached prefix on any worker: is the engine's tokenizer or chat template this one?"
                    );
                }
            }
            self.stats.add(
                &self.stats.predicted_cached_tokens,
                u64::from(d.overlap_blocks) * u64::from(bs),
            );
            let Some(target) = self.target_of(d.worker) else {
                self.free(&d.request_id);
                self.stats.upstream_error("no_url");
                last_error = format!("worker {} has no HTTP URL", d.worker);
                excluded.push(d.worker);
                continue;
            };
            let upstream_body = match &self.dynamo {
                Some(_) => dynamo_body(&json, d.worker, &tokens, prompt_ids),
                None => body.clone(),
            };
            let uri = format!(
                "{}{}",
                target.prefix,
                parts.uri.path_and_query().map_or("/", |p| p.as_str())
            );
            let dp = (self.dynamo.is_none()).then_some(d.worker.dp_rank);
            let build = || {
                let mut b = Request::builder().method(Method::POST).uri(uri.as_str());
                for (k, v) in &parts.headers {
                    if !hop_by_hop(k) && k.as_str() != "x-request-id" {
                        b = b.header(k, v);
                    }
                }
                b = b
                    .header(header::HOST, target.host.as_str())
                    .header("x-request-id", d.request_id.as_str());
                if let Some(dp) = dp {
                    b = b.header("x-data-parallel-rank", dp);
                }
                b.body(Full::new(upstream_body.clone()))
                    .unwrap_or_else(|_| Request::new(Full::new(Bytes::new())))
            };
            // The decision's slot insert runs once this task waits on the engine, behind the
            // connection's write of the request (one yield), so it is off the request's
            // path; it runs even if this task is dropped (the client went away) meanwhile.
            let state = Rc::clone(&self.state);
            glommio::spawn_local(async move {
                futures_lite::future::yield_now().await;
                state.borrow_mut().settle();
            })
            .detach();
            let sent = self.pool.send(&target, &build, &self.cfg.upstream).await;
            self.stats.pool_opened.set(self.pool.opened.get());
            self.stats.pool_reused.set(self.pool.reused.get());
            match sent {
                Ok((resp, _))
                    if resp.status().is_server_error() && attempt < self.cfg.max_retries =>
                {
                    self.free(&d.request_id);
                    self.stats.upstream_error("status_5xx");
                    last_error = format!("worker {} answered {}", d.worker, resp.status());
                }
                Ok((resp, conn)) => {
                    // No retry once the engine answered: the body and the prompt's ids and
                    // hashes go now, not when the stream ends (an agentic prompt's are
                    // about 10 MB, held for its whole generation).
                    drop((upstream_body, body, json, tokens, locals));
                    let life = Life::new(Rc::clone(self), d.request_id.clone(), started, inflight);
                    return self.answer(resp, conn, d, life, stream).await;
                }
                Err(e) => {
                    self.free(&d.request_id);
                    self.stats.upstream_error(e.kind());
                    if let Some(n) = self.warn.allow() {
                        tracing::warn!(worker = %d.worker, error = %e, suppressed = n, "engine exchange failed");
                    }
                    last_error = e.to_string();
                    if attempt >= self.cfg.max_retries {
                        return error(502, "upstream_error", last_error);
                    }
                }
            }
            excluded.push(d.worker);
            attempt += 1;
            self.stats.add(&self.stats.retries, 1);
        }
    }

    fn target_of(&self, w: WorkerDp) -> Option<Target> {
        match &self.dynamo {
            Some(t) => Some(t.clone()),
            None => self.targets.get(&w.worker_id).cloned(),
        }
    }

    pub(super) fn free(&self, request_id: &str) {
        let _ = self.state.borrow_mut().update(request_id, Update::Free);
    }
}

/// The body for a Dynamo frontend in direct mode: the request with the chosen worker and
/// our token ids in `nvext` (what else was there is kept), and a `prompt` of token ids
/// (`prompt_ids`) given back. Written from the token slice: no JSON value per token.
fn dynamo_body(json: &Json, worker: WorkerDp, tokens: &[u32], prompt_ids: bool) -> Bytes {
    let body = DynamoBody {
        fields: json.as_object(),
        worker,
        tokens,
        prompt_ids,
    };
    Bytes::from(serde_json::to_vec(&body).unwrap_or_default())
}

struct DynamoBody<'a> {
    fields: Option<&'a serde_json::Map<String, Json>>,
    worker: WorkerDp,
    tokens: &'a [u32],
    prompt_ids: bool,
}

/// What [`dynamo_body`] writes into `nvext`.
const NVEXT_OURS: [&str; 3] = ["backend_instance_id", "dp_rank", "token_data"];

impl serde::Serialize for DynamoBody<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(None)?;
        let mut kept = None;
        for (k, v) in self.fields.into_iter().flatten() {
            match k.as_str() {
                "nvext" => kept = v.as_object(),
                "prompt" if self.prompt_ids => {}
                _ => m.serialize_entry(k, v)?,
            }
        }
        if self.prompt_ids {
            m.serialize_entry("prompt", self.tokens)?;
        }
        m.serialize_entry("nvext", &Nvext { kept, body: self })?;
        m.end()
    }
}

struct Nvext<'a> {
    kept: Option<&'a serde_json::Map<String, Json>>,
    body: &'a DynamoBody<'a>,
}

impl serde::Serialize for Nvext<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(None)?;
        for (k, v) in self.kept.into_iter().flatten() {
            if !NVEXT_OURS.contains(&k.as_str()) {
                m.serialize_entry(k, v)?;
            }
        }
        m.serialize_entry("backend_instance_id", &self.body.worker.worker_id)?;
        m.serialize_entry("dp_rank", &self.body.worker.dp_rank)?;
        m.serialize_entry("token_data", self.body.tokens)?;
        m.end()
    }
}

/// Accepts client connections until the executor stops.
pub(crate) async fn serve(listener: TcpListener, front: Rc<Front>) {
    let accept_warn = Throttle::new(Duration::from_secs(10));
    loop {
        let mut stream = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                if let Some(n) = accept_warn.allow() {
                    tracing::warn!(error = %e, suppressed = n, "proxy accept failed");
                }
                glommio::timer::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let stats = Rc::clone(&front.stats);
        if stats.connections_open.get() >= front.cfg.max_connections as u64 {
            stats.add(&stats.connections_refused, 1);
            glommio::spawn_local(async move {
                let body = br#"{"error":{"message":"too many connections","type":"unavailable","param":null,"code":503}}"#;
                let head = format!(
                    "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n",
                    body.len()
                );
                let _ = stream.write_all(head.as_bytes()).await;
                let _ = stream.write_all(body).await;
                let _ = stream.close().await;
            })
            .detach();
            continue;
        }
        let _ = stream.set_nodelay(true);
        stats.add(&stats.connections_open, 1);
        let f = Rc::clone(&front);
        glommio::spawn_local(async move {
            let open = OpenConn(Rc::clone(&f.stats));
            let svc_front = Rc::clone(&f);
            let svc = hyper::service::service_fn(move |req| {
                let f = Rc::clone(&svc_front);
                async move { Ok::<_, Infallible>(f.handle(req).await) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(Timer)
                .header_read_timeout(f.cfg.header_timeout)
                .keep_alive(true)
                .serve_connection(Io::new(stream), svc);
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "proxy connection ended");
            }
            drop(open);
        })
        .detach();
    }
}

/// Counts an open client connection until dropped.
struct OpenConn(Rc<ProxyStats>);

impl Drop for OpenConn {
    fn drop(&mut self) {
        let c = &self.0.connections_open;
        c.set(c.get().saturating_sub(1));
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use serde_json::json;

    fn body_of(json: &Json, tokens: &[u32], prompt_ids: bool) -> Json {
        let worker = WorkerDp {
            worker_id: 7,
            dp_rank: 3,
        };
        serde_json::from_slice(&dynamo_body(json, worker, tokens, prompt_ids)).unwrap()
    }

    #[test]
    fn the_dynamo_body_names_the_worker_and_hands_over_the_ids() {
        // A text prompt stays; what the client put in nvext stays, apart from ours.
        let text = json!({"model": "m", "prompt": "hi", "x": [1, {"y": null}],
            "nvext": {"keep": 1, "token_data": [9], "dp_rank": 0}});
        assert_eq!(
            body_of(&text, &[1, 2], false),
            json!({"model": "m", "prompt": "hi", "x": [1, {"y": null}],
                "nvext": {"keep": 1, "backend_instance_id": 7, "dp_rank": 3, "token_data": [1, 2]}})
        );
        // A prompt of ids, parsed apart from the fields, is given back.
        let ids = json!({"model": "m", "stream": true, "nvext": null});
        assert_eq!(
            body_of(&ids, &[5, 6, 7], true),
            json!({"model": "m", "stream": true, "prompt": [5, 6, 7],
                "nvext": {"backend_instance_id": 7, "dp_rank": 3, "token_data": [5, 6, 7]}})
        );
        // A chat request: no prompt added.
        let chat = json!({"model": "m", "messages": [{"role": "user", "content": "q"}]});
        assert_eq!(
            body_of(&chat, &[4], false),
            json!({"model": "m", "messages": [{"role": "user", "content": "q"}],
                "nvext": {"backend_instance_id": 7, "dp_rank": 3, "token_data": [4]}})
        );
    }
}
