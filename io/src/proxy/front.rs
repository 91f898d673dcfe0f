//! The handlers of the OpenAI front and the life of a proxied request (see the
//! [module docs](super)).

use std::cell::RefCell;
use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_lite::io::AsyncWriteExt;
use glommio::net::TcpListener;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use kvrouter_core::decision::{DecideError, Decision};
use kvrouter_core::hash::{HashOptions, local_block_hashes};
use kvrouter_core::worker::WorkerDp;
use serde_json::Value as Json;

use super::model::ModelCard;
use super::rt::{Io, Timer};
use super::stats::ProxyStats;
use super::upstream::{Conn, Pool, Target};
use super::{Backend, ProxyConfig};
use crate::router::{Ask, State, Update};
use crate::throttle::Throttle;

/// Which OpenAI endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
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

/// The session header Dynamo's frontend and agentic clients send.
const DYNAMO_SESSION: &str = "x-dynamo-session-id";

/// The front's state: the router's, the models, the engines and the pool.
pub(crate) struct Front {
    state: Rc<RefCell<State>>,
    cfg: ProxyConfig,
    models: Vec<(String, ModelCard)>,
    targets: HashMap<u64, Target>,
    dynamo: Option<Target>,
    pool: Pool,
    stats: Rc<ProxyStats>,
    /// Session → (worker, expiry in the executor's clock, ms).
    sessions: RefCell<HashMap<String, (WorkerDp, u64)>>,
    warn: Throttle,
    created: u64,
}

impl std::fmt::Debug for Front {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Front")
            .field("listen", &self.cfg.listen)
            .field("models", &self.models.len())
            .finish_non_exhaustive()
    }
}

/// An OpenAI-style error answer.
fn error(status: u16, kind: &str, message: impl AsRef<str>) -> Response<ProxyBody> {
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
fn hop_by_hop(name: &HeaderName) -> bool {
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
        state: Rc<RefCell<State>>,
        cfg: ProxyConfig,
        stats: Rc<ProxyStats>,
    ) -> Result<Self, String> {
        let mut models = Vec::new();
        for m in &cfg.models {
            let card = ModelCard::load(&m.dir)
                .map_err(|e| format!("model {:?} ({}): {e}", m.name, m.dir.display()))?;
            if !card.has_chat_template() {
                tracing::warn!(model = %m.name, "no chat template: /v1/chat/completions answers 400 for it");
            }
            models.push((m.name.clone(), card));
        }
        let (targets, dynamo) = match &cfg.backend {
            Backend::Engines(list) => (list.iter().cloned().collect(), None),
            Backend::DynamoDirect(t) => (HashMap::new(), Some(t.clone())),
        };
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Ok(Front {
            state,
            cfg,
            models,
            targets,
            dynamo,
            pool: Pool::default(),
            stats,
            sessions: RefCell::default(),
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
            .iter()
            .map(|(name, _)| {
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

    fn card(&self, name: &str) -> Option<&ModelCard> {
        self.models.iter().find(|(n, _)| n == name).map(|(_, c)| c)
    }

    /// The body, within its size limit and deadline.
    async fn read_body(&self, body: Incoming) -> Result<Bytes, Response<ProxyBody>> {
        let max = self.cfg.max_body_bytes;
        let read = async {
            match Limited::new(body, max).collect().await {
                Ok(c) => Ok(c.to_bytes()),
                Err(e)
                    if e.downcast_ref::<http_body_util::LengthLimitError>()
                        .is_some() =>
                {
                    Err(error(
                        413,
                        "invalid_request_error",
                        format!("the body is over {max} bytes"),
                    ))
                }
                Err(e) => Err(error(
                    400,
                    "invalid_request_error",
                    format!("cannot read the body: {e}"),
                )),
            }
        };
        let late = async {
            glommio::timer::sleep(self.cfg.body_timeout).await;
            Err(error(
                408,
                "invalid_request_error",
                "the body did not arrive in time",
            ))
        };
        futures_lite::future::or(read, late).await
    }

    /// Reads and drops up to `max` bytes of a body, within the body deadline.
    async fn drain(&self, mut body: Incoming, max: usize) {
        let read = async {
            let mut n = 0;
            while n < max {
                match body.frame().await {
                    Some(Ok(f)) => n += f.data_ref().map_or(0, Bytes::len),
                    _ => break,
                }
            }
        };
        let late = glommio::timer::sleep(self.cfg.body_timeout);
        futures_lite::future::or(read, late).await;
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
        if let Some(n) = parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<usize>().ok())
            && n > self.cfg.max_body_bytes
        {
            // Read (and drop) what the client is sending before answering, up to a bound:
            // a client still writing when the connection closes sees a broken pipe, not
            // the 413.
            self.drain(body, n.min(4 * self.cfg.max_body_bytes)).await;
            return error(
                413,
                "invalid_request_error",
                format!("the body is over {} bytes", self.cfg.max_body_bytes),
            );
        }
        let body = match self.read_body(body).await {
            Ok(b) => b,
            Err(r) => return r,
        };
        let json: Json = match serde_json::from_slice(&body) {
            Ok(j @ Json::Object(_)) => j,
            Ok(_) => {
                return error(
                    400,
                    "invalid_request_error",
                    "the body must be a JSON object",
                );
            }
            Err(e) => return error(400, "invalid_request_error", format!("malformed JSON: {e}")),
        };
        let Some(model) = json.get("model").and_then(Json::as_str) else {
            return error(400, "invalid_request_error", "`model` is required");
        };
        let Some(card) = self.card(model) else {
            return error(
                404,
                "model_not_found",
                format!("the model `{model}` does not exist (GET /v1/models lists them)"),
            );
        };
        let t = Instant::now();
        let tokens = match ep {
            Endpoint::Chat => card.chat_tokens(&json),
            Endpoint::Completions => card.completion_tokens(&json),
        };
        let tokens = match tokens {
            Ok(t) => t,
            Err(e) => return error(400, "invalid_request_error", e.to_string()),
        };
        self.stats.tokenize.observe(t.elapsed().as_secs_f64());
        let stream = json.get("stream").and_then(Json::as_bool).unwrap_or(false);
        let bs = self.state.borrow().block_size();
        if let Err(e) = self
            .state
            .borrow()
            .check_blocks(tokens.len() / bs.max(1) as usize)
        {
            return self.refused(&e);
        }
        let locals = local_block_hashes(&tokens, bs, &HashOptions::default());
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
                lora_name: None,
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
                Some(_) => dynamo_body(&json, d.worker, &tokens),
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
                    let life = Life {
                        front: Rc::clone(self),
                        request_id: d.request_id.clone(),
                        started,
                        first: None,
                        last: started,
                        freed: false,
                        _inflight: inflight,
                    };
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

    /// The session a request names, if affinity is on.
    fn session_of(&self, headers: &HeaderMap) -> Option<String> {
        if self.cfg.session_ttl.is_zero() {
            return None;
        }
        let named = self.cfg.session_header.as_deref();
        headers
            .get(DYNAMO_SESSION)
            .or_else(|| named.and_then(|n| headers.get(n)))
            .and_then(|v| v.to_str().ok())
            .filter(|s| !s.is_empty() && s.len() <= 256)
            .map(str::to_owned)
    }

    /// The decision, with session affinity: a session goes to its bound worker while that
    /// one is a candidate with room; otherwise it is routed afresh and bound anew.
    fn choose(
        &self,
        ask: Ask<'_>,
        session: Option<&str>,
        excluded: &[WorkerDp],
    ) -> Result<Decision, DecideError> {
        let mut st = self.state.borrow_mut();
        let now = st.clock_ms();
        if let Some(s) = session {
            let bound = self
                .sessions
                .borrow()
                .get(s)
                .filter(|(_, exp)| *exp > now)
                .map(|b| b.0);
            if let Some(w) = bound {
                if !excluded.contains(&w) && st.is_open(w) {
                    match st.decide(ask.clone(), &[w]) {
                        Ok(d) => {
                            self.stats.add(&self.stats.session_bound, 1);
                            self.bind(s, d.worker, now);
                            return Ok(d);
                        }
                        Err(DecideError::WorkersFull { .. }) => {}
                        Err(e) => return Err(e),
                    }
                }
                self.stats.add(&self.stats.session_yielded, 1);
            }
        }
        let workers = st.candidates(excluded);
        let d = st.decide(ask, &workers)?;
        if let Some(s) = session {
            self.bind(s, d.worker, now);
        }
        Ok(d)
    }

    fn bind(&self, session: &str, worker: WorkerDp, now: u64) {
        let mut map = self.sessions.borrow_mut();
        if map.len() >= self.cfg.max_sessions && !map.contains_key(session) {
            map.retain(|_, (_, exp)| *exp > now);
            if map.len() >= self.cfg.max_sessions {
                return;
            }
        }
        let ttl = self.cfg.session_ttl.as_millis() as u64;
        map.insert(session.to_owned(), (worker, now + ttl));
        self.stats.sessions.set(map.len() as u64);
    }

    fn target_of(&self, w: WorkerDp) -> Option<Target> {
        match &self.dynamo {
            Some(t) => Some(t.clone()),
            None => self.targets.get(&w.worker_id).cloned(),
        }
    }

    fn free(&self, request_id: &str) {
        let _ = self.state.borrow_mut().update(request_id, Update::Free);
    }

    /// The engine's answer, relayed.
    async fn answer(
        self: &Rc<Self>,
        resp: Response<Incoming>,
        conn: Conn,
        d: Decision,
        mut life: Life,
        stream: bool,
    ) -> Response<ProxyBody> {
        let (parts, body) = resp.into_parts();
        let mut out_headers = HeaderMap::new();
        for (k, v) in &parts.headers {
            if !hop_by_hop(k) {
                out_headers.append(k, v.clone());
            }
        }
        out_headers.insert(
            "x-kvrouter-worker-id",
            HeaderValue::from(d.worker.worker_id),
        );
        out_headers.insert("x-kvrouter-dp-rank", HeaderValue::from(d.worker.dp_rank));
        out_headers.insert(
            "x-kvrouter-overlap-blocks",
            HeaderValue::from(d.overlap_blocks),
        );
        if let Ok(v) = HeaderValue::from_str(&d.request_id) {
            out_headers.insert("x-kvrouter-request-id", v);
        }
        let streaming = stream && parts.status == StatusCode::OK;
        if streaming {
            let relay = Relay {
                upstream: body,
                conn: Some(conn),
                idle: glommio::timer::Timer::new(self.cfg.upstream.idle_timeout),
                life,
                done: false,
            };
            let mut r = Response::new(ProxyBody::Relay(Box::new(relay)));
            *r.status_mut() = parts.status;
            *r.headers_mut() = out_headers;
            return r;
        }
        let idle = self.cfg.upstream.idle_timeout;
        let read = async {
            body.collect()
                .await
                .map(|c| c.to_bytes())
                .map_err(|e| e.to_string())
        };
        let late = async {
            glommio::timer::sleep(idle).await;
            Err(format!("no answer within {idle:?}"))
        };
        let bytes = futures_lite::future::or(read, late).await;
        match bytes {
            Ok(bytes) => {
                self.pool.put(conn, self.cfg.upstream.max_idle_per_engine);
                self.usage(&bytes);
                life.finish();
                let mut r = Response::new(ProxyBody::full(bytes.to_vec()));
                *r.status_mut() = parts.status;
                *r.headers_mut() = out_headers;
                r
            }
            Err(e) => {
                life.finish();
                self.stats.upstream_error("body");
                error(502, "upstream_error", format!("worker {}: {e}", d.worker))
            }
        }
    }

    /// Counts the cached tokens an engine reports in an answer's `usage` (a JSON body, or
    /// the `data:` lines of a stream chunk).
    fn usage(&self, bytes: &[u8]) {
        if memchr(bytes, b"cached_tokens").is_none() {
            return;
        }
        let seen = |v: &Json| {
            let u = &v["usage"];
            if let Some(c) = u["prompt_tokens_details"]["cached_tokens"].as_u64() {
                self.stats.add(&self.stats.engine_cached_tokens, c);
                self.stats.add(
                    &self.stats.engine_reported_prompt_tokens,
                    u["prompt_tokens"].as_u64().unwrap_or(0),
                );
            }
        };
        if let Ok(v) = serde_json::from_slice::<Json>(bytes) {
            seen(&v);
            return;
        }
        for line in bytes.split(|&b| b == b'\n') {
            if let Some(data) = line.strip_prefix(b"data: ")
                && let Ok(v) = serde_json::from_slice::<Json>(data)
            {
                seen(&v);
            }
        }
    }
}

fn memchr(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The body for a Dynamo frontend in direct mode: the request with the chosen worker and
/// our token ids in `nvext` (what was there is kept).
fn dynamo_body(json: &Json, worker: WorkerDp, tokens: &[u32]) -> Bytes {
    let mut j = json.clone();
    if !j["nvext"].is_object() {
        j["nvext"] = Json::Object(serde_json::Map::new());
    }
    j["nvext"]["backend_instance_id"] = Json::from(worker.worker_id);
    j["nvext"]["dp_rank"] = Json::from(worker.dp_rank);
    j["nvext"]["token_data"] = Json::from(tokens.to_vec());
    Bytes::from(serde_json::to_vec(&j).unwrap_or_default())
}

/// Counts a request in flight until dropped.
struct Inflight(Rc<ProxyStats>);

impl Inflight {
    fn new(stats: Rc<ProxyStats>) -> Self {
        stats.inflight.set(stats.inflight.get() + 1);
        Inflight(stats)
    }
}

impl Drop for Inflight {
    fn drop(&mut self) {
        self.0.inflight.set(self.0.inflight.get().saturating_sub(1));
    }
}

/// An active request's slot, from its answer's headers to its end: the first chunk marks
/// its prefill done, its end frees it; dropped before the end (the client left), it is
/// freed and counted as a disconnect.
struct Life {
    front: Rc<Front>,
    request_id: String,
    started: Instant,
    first: Option<Instant>,
    last: Instant,
    freed: bool,
    _inflight: Inflight,
}

impl Life {
    fn chunk(&mut self) {
        let now = Instant::now();
        match self.first {
            None => {
                self.first = Some(now);
                let _ = self
                    .front
                    .state
                    .borrow_mut()
                    .update(&self.request_id, Update::FirstToken);
                self.front
                    .stats
                    .ttft
                    .observe((now - self.started).as_secs_f64());
            }
            Some(_) => self
                .front
                .stats
                .itl
                .observe((now - self.last).as_secs_f64()),
        }
        self.last = now;
    }

    fn finish(&mut self) {
        if !self.freed {
            self.freed = true;
            self.front.free(&self.request_id);
            self.front
                .stats
                .e2e
                .observe(self.started.elapsed().as_secs_f64());
        }
    }
}

impl Drop for Life {
    fn drop(&mut self) {
        if !self.freed {
            self.front
                .stats
                .add(&self.front.stats.client_disconnects, 1);
            self.finish();
        }
    }
}

/// A streamed answer on its way to the client.
struct Relay {
    upstream: Incoming,
    /// The engine connection; back to the pool at the end, dropped (closed) otherwise.
    conn: Option<Conn>,
    idle: glommio::timer::Timer,
    life: Life,
    done: bool,
}

/// An SSE event the OpenAI SDKs raise as an error.
fn error_event(message: &str) -> Bytes {
    let v = serde_json::json!({"error": {"message": message, "type": "upstream_error", "param": null, "code": 502}});
    Bytes::from(format!("data: {v}\n\n"))
}

impl Relay {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        if self.done {
            return Poll::Ready(None);
        }
        match Pin::new(&mut self.upstream).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref()
                    && !data.is_empty()
                {
                    self.life.chunk();
                    self.life.front.usage(data);
                }
                self.idle.reset(self.life.front.cfg.upstream.idle_timeout);
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                self.done = true;
                self.life.front.stats.upstream_error("stream");
                self.life.finish();
                Poll::Ready(Some(Ok(Frame::data(error_event(&format!(
                    "the engine's stream broke: {e}"
                ))))))
            }
            Poll::Ready(None) => {
                self.done = true;
                self.life.finish();
                if let Some(c) = self.conn.take() {
                    self.life
                        .front
                        .pool
                        .put(c, self.life.front.cfg.upstream.max_idle_per_engine);
                }
                Poll::Ready(None)
            }
            Poll::Pending => {
                if Pin::new(&mut self.idle).poll(cx).is_ready() {
                    self.done = true;
                    self.life.front.stats.upstream_error("idle_timeout");
                    self.life.finish();
                    self.conn = None;
                    return Poll::Ready(Some(Ok(Frame::data(error_event(
                        "the engine sent nothing for too long",
                    )))));
                }
                Poll::Pending
            }
        }
    }
}

/// The body of a proxy answer: whole, or relayed.
enum ProxyBody {
    Full(Option<Bytes>),
    Relay(Box<Relay>),
}

impl ProxyBody {
    fn full(b: impl Into<Bytes>) -> Self {
        ProxyBody::Full(Some(b.into()))
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        match self.get_mut() {
            ProxyBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            ProxyBody::Relay(r) => r.poll(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ProxyBody::Full(b) => b.is_none(),
            ProxyBody::Relay(r) => r.done,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ProxyBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            ProxyBody::Full(None) => SizeHint::with_exact(0),
            ProxyBody::Relay(_) => SizeHint::default(),
        }
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
                .serve_connection(Io(stream), svc);
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
