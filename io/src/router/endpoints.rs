//! The API executor's state and its endpoints: each request is parsed, answered from the
//! state and the index, and turned into a response, all on the API executor (no locks:
//! one executor owns the [`State`]).

use std::rc::Rc;
use std::time::Instant;

use kvrouter_core::chain::SequenceChain;
use kvrouter_core::codec::replica::{
    ActiveSequenceEvent, ActiveSequenceEventData, PrefillLoadHint,
};
use kvrouter_core::codec::session::SessionBinding;
use kvrouter_core::decision::{DecideError, Decider, Decision, Lookup, Route};
use kvrouter_core::hash::{HashOptions, LocalBlockHash, local_block_hashes};
use kvrouter_core::sessions::{Applied, Sessions};
use kvrouter_core::slots::SlotError;
use kvrouter_core::worker::WorkerDp;
use serde::Serialize;

use super::RouterConfig;
use super::input::{RouteInput, route_input};
use super::metrics::{self, ApiCounters, DecisionTimes};
use crate::http::{HttpStats, Request, Response, decode_segment};
use crate::ingest::IngestView;
use crate::proxy::ProxyStats;
use crate::routing::{Ask, Routing, Update};

#[derive(Debug, Serialize)]
struct RouteOutput {
    worker_id: u64,
    dp_rank: u32,
    overlap_blocks: u32,
    request_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    candidates: Option<Vec<kvrouter_core::policy::Scored>>,
}

#[derive(Debug, Serialize)]
struct OverlapEntry {
    worker_id: u64,
    dp_rank: u32,
    /// Device blocks from the start of the request.
    blocks: u32,
    /// Host-pinned blocks continuing it past the device prefix (left out when 0).
    #[serde(skip_serializing_if = "is_zero")]
    host_blocks: u32,
    /// Disk (then external) blocks continuing it past that (left out when 0).
    #[serde(skip_serializing_if = "is_zero")]
    disk_blocks: u32,
    /// Shared-pool blocks at or past its device prefix, what its shared credit counts
    /// (left out when 0).
    #[serde(skip_serializing_if = "is_zero")]
    shared_blocks: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// `a == b` in a time that depends on their lengths only (not on where they differ), so
/// that the bearer token cannot be guessed byte by byte from response times.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a
        .iter()
        .zip(b)
        .fold(0u8, |acc, (x, y)| std::hint::black_box(acc | (x ^ y)));
    diff == 0
}

/// Everything the API executor owns.
pub(crate) struct State {
    cfg: RouterConfig,
    ingest: Option<IngestView>,
    decider: Decider,
    start: Instant,
    pub(super) counters: ApiCounters,
    /// The listener's counters (connections, framing, deadlines).
    pub(super) http: Rc<HttpStats>,
    /// The replica publisher's counters.
    pub(super) replica: Rc<super::replica::ReplicaStats>,
    times: DecisionTimes,
    replica_tx: Option<flume::Sender<ActiveSequenceEvent>>,
    /// The last decision, until it settles and the replicas hear of it (replica sync only).
    unsent: Option<Unsent>,
    /// The OpenAI front's counters, when it runs (rendered in `/metrics` too).
    pub(crate) proxy: Option<Rc<ProxyStats>>,
    /// The candidates from the static list and the ingest, sorted, as of the ingest's
    /// membership `known_at`.
    known: Vec<WorkerDp>,
    known_at: Option<u64>,
    /// The ingest's share of `known` (sorted): a worker that leaves it was removed by the
    /// ingest, and leaves routing with it.
    from_ingest: Vec<WorkerDp>,
    /// Session affinity's bindings (the OpenAI front with a session TTL only).
    sessions: Option<Sessions>,
    /// Bindings to announce to the other replicas (with session sync on).
    session_tx: Option<flume::Sender<SessionBinding>>,
    /// The session publisher's counters.
    pub(super) session_replica: Rc<super::replica::ReplicaStats>,
    /// When the session table is next swept of expired bindings.
    session_sweep_ms: u64,
}

/// How often the session table is swept of expired bindings, ms.
const SESSION_SWEEP_MS: u64 = 10_000;

/// Milliseconds since the Unix epoch (session bindings' stamps).
fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl State {
    pub(super) fn new(
        cfg: RouterConfig,
        ingest: Option<IngestView>,
        mut decider: Decider,
        replica_tx: Option<flume::Sender<ActiveSequenceEvent>>,
        session_tx: Option<flume::Sender<SessionBinding>>,
    ) -> Self {
        // The replicas are told of a decision once it settles, with all its sequence hashes.
        decider.keep_settled(replica_tx.is_some());
        let sessions = cfg
            .proxy
            .as_ref()
            .filter(|p| !p.session_ttl.is_zero())
            .map(|p| {
                Sessions::new(
                    p.session_ttl.as_millis() as u64,
                    p.max_sessions,
                    cfg.router_id,
                )
            });
        State {
            cfg,
            ingest,
            decider,
            start: Instant::now(),
            counters: ApiCounters::default(),
            http: Rc::default(),
            replica: Rc::default(),
            times: DecisionTimes::default(),
            replica_tx,
            unsent: None,
            proxy: None,
            known: Vec::new(),
            known_at: None,
            from_ingest: Vec::new(),
            sessions,
            session_tx,
            session_replica: Rc::default(),
            session_sweep_ms: SESSION_SWEEP_MS,
        }
    }

    fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// Releases stale requests (once a second).
    pub(super) fn expire(&mut self) {
        let now = self.now_ms();
        let n = self.decider.expire(now);
        self.send_settled();
        self.counters.expired += n as u64;
        if now >= self.session_sweep_ms {
            self.session_sweep_ms = now + SESSION_SWEEP_MS;
            if let Some(s) = &mut self.sessions {
                s.sweep(now);
            }
            self.session_gauge();
        }
    }

    /// Applies other replicas' session bindings (a message of our own is skipped).
    pub(super) fn apply_sessions(&mut self, publisher_id: u64, bindings: Vec<SessionBinding>) {
        if publisher_id == self.cfg.router_id {
            return;
        }
        let now = self.now_ms();
        let Some(s) = &mut self.sessions else {
            return;
        };
        for b in bindings {
            let c = &mut self.counters.sessions;
            match s.apply(b, now) {
                Applied::Taken => c.taken += 1,
                Applied::Refreshed => c.refreshed += 1,
                Applied::Older => c.older += 1,
                Applied::Full => c.full += 1,
                Applied::Invalid => c.invalid += 1,
            }
        }
        self.session_gauge();
    }

    /// A session-binding message that did not decode.
    pub(super) fn session_undecodable(&mut self) {
        self.counters.sessions.undecodable += 1;
    }

    fn session_gauge(&self) {
        if let (Some(p), Some(s)) = (&self.proxy, &self.sessions) {
            p.sessions.set(s.len() as u64);
        }
    }

    /// Tells the replicas of the decisions that settled since the last call: each is the
    /// last decision made (`unsent`), since a decision settles before the next one is made.
    fn send_settled(&mut self) {
        if self.replica_tx.is_none() {
            return;
        }
        for s in self.decider.take_settled() {
            let (lora_name, prefill) = match self.unsent.take() {
                Some(u) if u.request_id == s.request_id => (u.lora_name, u.prefill_tokens),
                other => {
                    debug_assert!(false, "a settled decision is the last one made");
                    self.unsent = other;
                    (None, 0)
                }
            };
            self.replicate(
                &s.request_id,
                s.worker,
                lora_name,
                ActiveSequenceEventData::AddRequest {
                    token_sequence: Some(s.blocks),
                    track_prefill_tokens: true,
                    expected_output_tokens: None,
                    prefill_load_hint: Some(PrefillLoadHint {
                        initial_effective_prefill_tokens: prefill,
                        expected_prefill_duration: None,
                    }),
                },
            );
        }
    }

    /// The request's local block hashes and prompt tokens; past the block limit, a 413
    /// before any hashing.
    fn locals(&mut self, input: &RouteInput) -> Result<(Vec<LocalBlockHash>, u64), Response> {
        let blocks = match (&input.token_ids, &input.block_hashes) {
            (Some(tokens), None) => tokens.len() / self.cfg.block_size.max(1) as usize,
            (None, Some(hashes)) => hashes.len(),
            _ => 0,
        };
        if let Err(e) = self.decider.check_blocks(blocks) {
            return Err(self.refusal(&e));
        }
        match (&input.token_ids, &input.block_hashes) {
            (Some(tokens), None) => {
                let opts = HashOptions {
                    lora_name: input.lora_name.as_deref(),
                    ..Default::default()
                };
                Ok((
                    local_block_hashes(tokens, self.cfg.block_size, &opts),
                    tokens.len() as u64,
                ))
            }
            (None, Some(hashes)) => {
                let locals: Vec<LocalBlockHash> =
                    hashes.iter().map(|h| LocalBlockHash(h.0)).collect();
                let tokens = locals.len() as u64 * self.cfg.block_size as u64;
                Ok((locals, tokens))
            }
            _ => Err(Response::error(
                400,
                "give exactly one of token_ids or block_hashes",
            )),
        }
    }

    /// Every worker a request may go to, sorted: the static ones and the ingest's (and,
    /// without an ingest, those the slot manager learnt of from other replicas). The first
    /// two are rebuilt only when the ingest's membership counter moves (not on every route:
    /// that takes each shard's summary lock); a worker the ingest no longer lists was
    /// removed (it left, restarted under a new id, fell silent) and its slots go with it,
    /// so it is never chosen again.
    fn known_workers(&mut self) -> Vec<WorkerDp> {
        let at = self.ingest.as_ref().map_or(0, IngestView::membership);
        if self.known_at != Some(at) {
            let mut now: Vec<WorkerDp> = self
                .ingest
                .as_ref()
                .map(|i| i.workers().into_iter().map(|s| s.worker).collect())
                .unwrap_or_default();
            now.sort_unstable();
            for w in std::mem::take(&mut self.from_ingest) {
                if now.binary_search(&w).is_err() && !self.cfg.static_workers.contains(&w) {
                    tracing::info!(worker = %w, "worker removed by the ingest: no longer routed to");
                    self.decider.remove(w);
                    self.counters.workers_removed += 1;
                }
            }
            let mut v: Vec<WorkerDp> = self.cfg.static_workers.clone();
            v.extend_from_slice(&now);
            v.sort_unstable();
            v.dedup();
            self.known = v;
            self.from_ingest = now;
            self.known_at = Some(at);
        }
        let mut out = self.known.clone();
        if self.ingest.is_none() {
            let before = out.len();
            // The slot manager's workers are distinct, so those added here are too.
            for (w, _) in self.decider.slots().workers() {
                if self.known.binary_search(&w).is_err() {
                    out.push(w);
                }
            }
            if out.len() != before {
                out.sort_unstable();
            }
        }
        out
    }

    /// The KV index, when the router reads one.
    fn index(ingest: &Option<IngestView>, kv_events: bool) -> Option<&dyn Lookup> {
        match ingest {
            Some(i) if kv_events => Some(i.reader() as &dyn Lookup),
            _ => None,
        }
    }

    fn route(&mut self, input: RouteInput) -> Response {
        let (locals, tokens) = match self.locals(&input) {
            Ok(v) => v,
            Err(r) => return r,
        };
        let workers = self.known_workers();
        let ask = Ask {
            locals: &locals,
            tokens,
            request_id: input.request_id.as_deref(),
            lora_name: input.lora_name,
            explain: input.explain,
        };
        let d = match self.decide(ask, &workers) {
            Ok(d) => d,
            Err(e) => return self.refusal(&e),
        };
        let out = RouteOutput {
            worker_id: d.worker.worker_id,
            dp_rank: d.worker.dp_rank,
            overlap_blocks: d.overlap_blocks,
            request_id: d.request_id,
            candidates: d.scored,
        };
        Response::json(200, serde_json::to_vec(&out).unwrap_or_default())
    }

    fn overlaps(&mut self, input: RouteInput) -> Response {
        let locals = match self.locals(&input) {
            Ok((locals, _)) => locals,
            Err(r) => return r,
        };
        self.counters.overlaps += 1;
        // With pool rules, a worker may read more pools than the fleet-wide ones and is
        // then listed even without a device prefix: the known workers are taken before
        // the lookup, whose answer borrows the decider.
        let known = if self.decider.has_pool_readers() {
            self.known_workers()
        } else {
            Vec::new()
        };
        let now = self.now_ms();
        let index = Self::index(&self.ingest, self.cfg.kv_events);
        let (device, tiers) = self.decider.tier_overlaps(index, &locals, None, now);
        let mut list: Vec<OverlapEntry> = tiers
            .with_device(device)
            .map(|(w, blocks, t)| OverlapEntry {
                worker_id: w.worker_id,
                dp_rank: w.dp_rank,
                blocks,
                host_blocks: t.host,
                disk_blocks: t.disk,
                shared_blocks: tiers.shared_beyond_for(w, blocks),
            })
            .collect();
        // A worker not listed has every pool block it reads past its (empty) device prefix:
        // the top-level figure counts the pools every worker reads, and workers that also
        // read a pool with readers (`--pool-readers`) are listed with their own count.
        let shared = tiers.shared_beyond(0);
        if tiers.has_scoped() {
            for &w in &known {
                let mine = tiers.shared_beyond_for(w, 0);
                let listed = list
                    .iter()
                    .any(|e| (e.worker_id, e.dp_rank) == (w.worker_id, w.dp_rank));
                if mine != shared && !listed {
                    list.push(OverlapEntry {
                        worker_id: w.worker_id,
                        dp_rank: w.dp_rank,
                        blocks: 0,
                        host_blocks: 0,
                        disk_blocks: 0,
                        shared_blocks: mine,
                    });
                }
            }
        }
        let body = match shared {
            0 => serde_json::json!({ "overlaps": list }),
            shared => serde_json::json!({ "overlaps": list, "shared_blocks": shared }),
        };
        Response::json(200, serde_json::to_vec(&body).unwrap_or_default())
    }

    fn replicate(
        &mut self,
        request_id: &str,
        worker: WorkerDp,
        lora_name: Option<String>,
        data: ActiveSequenceEventData,
    ) {
        if let Some(tx) = &self.replica_tx {
            let e = ActiveSequenceEvent {
                request_id: request_id.into(),
                worker,
                data,
                router_id: self.cfg.router_id,
                lora_name,
            };
            match tx.try_send(e) {
                Ok(()) => self.counters.replica_queued += 1,
                Err(_) => self.counters.replica_dropped += 1,
            }
        }
    }

    /// Applies another replica's slot change (our own are skipped).
    pub(super) fn apply_replica(&mut self, e: ActiveSequenceEvent) {
        if e.router_id == self.cfg.router_id {
            return;
        }
        self.counters.replica_in += 1;
        let now = self.now_ms();
        let _ = self.decider.apply_replica(e, now);
        self.send_settled();
    }

    fn workers_json(&mut self) -> Response {
        /// One row of the listing, serialised as it is built (no JSON tree per row: the
        /// listing of 30,000 workers is one pass).
        #[derive(Serialize)]
        struct Row {
            worker_id: u64,
            dp_rank: u32,
            cached_blocks: usize,
            last_event_id: Option<u64>,
            active_blocks: u64,
            active_prefill_tokens: u64,
            active_requests: u64,
        }
        #[derive(Serialize)]
        struct Listing {
            workers: Vec<Row>,
        }
        // Both lists are sorted by worker: one merge walk pairs them.
        let summaries = self
            .ingest
            .as_ref()
            .map(IngestView::workers)
            .unwrap_or_default();
        let mut next = summaries.iter().peekable();
        let known = self.known_workers();
        let mut workers = Vec::with_capacity(known.len());
        for w in known {
            while next.next_if(|s| s.worker < w).is_some() {}
            let s = next.next_if(|s| s.worker == w);
            let load = self.decider.slots().load(w);
            workers.push(Row {
                worker_id: w.worker_id,
                dp_rank: w.dp_rank,
                cached_blocks: s.map_or(0, |s| s.blocks),
                last_event_id: s.and_then(|s| s.last_event_id),
                active_blocks: load.active_blocks,
                active_prefill_tokens: load.active_prefill_tokens,
                active_requests: load.active_requests,
            });
        }
        Response::json(
            200,
            serde_json::to_vec(&Listing { workers }).unwrap_or_default(),
        )
    }

    fn healthy(&self) -> bool {
        self.ingest.as_ref().is_none_or(IngestView::is_ready)
    }

    fn authorized(&self, req: &Request) -> bool {
        match &self.cfg.auth_token {
            None => true,
            Some(t) => req.header("authorization").is_some_and(|h| {
                h.strip_prefix("Bearer ")
                    .is_some_and(|v| constant_time_eq(v.as_bytes(), t.as_bytes()))
            }),
        }
    }

    /// Answers one request; counts client errors and times successful routes.
    pub(super) fn handle(&mut self, req: Request) -> Response {
        let started = Instant::now();
        // Only routing decisions count in the decision-time quantiles (not frees, metrics
        // scrapes or errors, which would flatter them).
        let path = req.path.trim_end_matches('/');
        let is_route = req.method == "POST" && path == "/v1/route";
        // A request's first token or free settles through the decider, which lets a
        // decision freed before it settled go without ever holding its blocks.
        let is_update = req.method == "POST" && path.starts_with("/v1/requests/");
        if !is_route && !is_update {
            // A route answered earlier in this batch of pipelined requests is settled
            // before anything else reads or changes the slots.
            Routing::settle(self);
        }
        let resp = self.dispatch(req);
        if (400..500).contains(&resp.status) {
            self.counters.client_errors += 1;
        }
        if is_route && resp.status == 200 {
            self.times.record(started.elapsed().as_nanos() as u64);
        }
        resp
    }

    fn dispatch(&mut self, req: Request) -> Response {
        let path = req.path.trim_end_matches('/');
        let mutating = req.method == "POST" && path != "/v1/overlaps";
        if mutating && !self.authorized(&req) {
            return Response::error(401, "missing or wrong bearer token");
        }
        match (req.method.as_str(), path) {
            ("POST", "/v1/route") => match route_input(&req) {
                Ok(input) => self.route(input),
                Err(e) => Response::error(400, e),
            },
            ("POST", "/v1/overlaps") => match route_input(&req) {
                Ok(input) => self.overlaps(input),
                Err(e) => Response::error(400, e),
            },
            ("GET", "/v1/workers") => self.workers_json(),
            ("GET", "/metrics") => Response::text(200, self.metrics_text()),
            ("GET", "/healthz") => {
                if self.healthy() {
                    Response::json(200, br#"{"status":"ok"}"#.to_vec())
                } else {
                    Response::error(503, "NATS subscriptions not active")
                }
            }
            ("POST", p) if p.starts_with("/v1/requests/") => {
                // One segment, percent-decoded: an id with `/`, `?`, a space or any
                // non-ASCII character comes as its escapes.
                let rest = &p["/v1/requests/".len()..];
                let Some((raw, action)) = rest.rsplit_once('/') else {
                    return Response::error(404, "no such endpoint");
                };
                if raw.contains('/') {
                    return Response::error(
                        404,
                        "no such endpoint (a `/` in a request id is sent as %2F)",
                    );
                }
                match decode_segment(raw) {
                    Some(id) => self.request_update(&id, action),
                    None => Response::error(400, "malformed percent-escapes in the request id"),
                }
            }
            (_, "/v1/route" | "/v1/overlaps" | "/v1/workers" | "/metrics" | "/healthz") => {
                Response::error(405, "method not allowed")
            }
            _ => Response::error(404, "no such endpoint"),
        }
    }

    /// `first_token` or `free` of one request.
    fn request_update(&mut self, id: &str, action: &str) -> Response {
        let update = match action {
            "first_token" => Update::FirstToken,
            "free" => Update::Free,
            _ => return Response::error(404, "no such endpoint"),
        };
        match self.update(id, update) {
            Ok(_) => Response::json(200, br#"{"ok":true}"#.to_vec()),
            Err(e) => Response::error(404, e.to_string()),
        }
    }
}

/// A decision the replicas have not heard of yet: what its announcement needs besides
/// its sequence hashes.
struct Unsent {
    request_id: String,
    lora_name: Option<String>,
    prefill_tokens: u64,
}

/// The routing state as every front sees it (the proxy through `dyn Routing`).
impl Routing for State {
    fn decide(&mut self, ask: Ask<'_>, workers: &[WorkerDp]) -> Result<Decision, DecideError> {
        // Sequence hashes are computed as far as the decision needs them before its answer;
        // the rest, and the replicas' copy, when it settles.
        let seqs = SequenceChain::new(ask.locals);
        let now = self.now_ms();
        let route = Route {
            locals: ask.locals,
            tokens: ask.tokens,
            request_id: ask.request_id,
            explain: ask.explain,
        };
        let index = Self::index(&self.ingest, self.cfg.kv_events);
        let d = self.decider.decide(index, workers, route, seqs, now);
        // The decision before this one settled first: the replicas hear of it now.
        self.send_settled();
        let d = d?;
        if self.replica_tx.is_some() {
            self.unsent = Some(Unsent {
                request_id: d.request_id.clone(),
                lora_name: ask.lora_name,
                prefill_tokens: d.prefill_tokens,
            });
        }
        self.counters.routes += 1;
        Ok(d)
    }

    fn settle(&mut self) {
        self.decider.settle();
        self.send_settled();
    }

    fn refusal(&mut self, e: &DecideError) -> Response {
        let c = &mut self.counters;
        match e {
            DecideError::NoWorkers => Response::error(503, e.to_string()).with_retry_after(1),
            DecideError::TooManyBlocks { .. } => {
                c.too_large += 1;
                Response::error(413, e.to_string())
            }
            DecideError::BadRequestId(_) => {
                c.bad_request_ids += 1;
                Response::error(400, e.to_string())
            }
            DecideError::Overloaded { .. } | DecideError::WorkersFull { .. } => {
                c.overloaded += 1;
                Response::error(429, e.to_string()).with_retry_after(1)
            }
            _ => Response::error(409, e.to_string()),
        }
    }

    fn update(&mut self, id: &str, update: Update) -> Result<WorkerDp, SlotError> {
        let now = self.now_ms();
        let (result, data) = match update {
            Update::FirstToken => (
                self.decider.first_token(id, now),
                ActiveSequenceEventData::MarkPrefillCompleted,
            ),
            Update::Free => (self.decider.free(id), ActiveSequenceEventData::Free),
        };
        // A decision this settled is announced before what happened to it.
        self.send_settled();
        if let Ok(worker) = result {
            match &self.unsent {
                // Freed before it settled: the replicas never heard of it, nor need to.
                Some(u) if u.request_id == id => self.unsent = None,
                _ => self.replicate(id, worker, None, data),
            }
        }
        result
    }

    fn candidates(&mut self, exclude: &[WorkerDp]) -> Vec<WorkerDp> {
        let mut v = self.known_workers();
        if !exclude.is_empty() {
            v.retain(|w| !exclude.contains(w));
        }
        v
    }

    fn is_open(&mut self, worker: WorkerDp) -> bool {
        self.known_workers().binary_search(&worker).is_ok() && !self.decider.slots().is_full(worker)
    }

    fn session_worker(&mut self, session: &str) -> Option<WorkerDp> {
        let now = self.now_ms();
        self.sessions.as_ref()?.get(session, now)
    }

    fn bind_session(&mut self, session: &str, worker: WorkerDp) {
        let now = self.now_ms();
        let Some(s) = &mut self.sessions else {
            return;
        };
        let announce = s.bind(session, worker, now, wall_ms());
        self.session_gauge();
        if let (Some(b), Some(tx)) = (announce, &self.session_tx) {
            match tx.try_send(b) {
                Ok(()) => self.counters.sessions.queued += 1,
                Err(_) => self.counters.sessions.dropped += 1,
            }
        }
    }

    fn is_healthy(&self) -> bool {
        self.healthy()
    }

    fn metrics_text(&self) -> String {
        let mut out = metrics::render(
            &self.counters,
            &self.http,
            &self.replica,
            &self.session_replica,
            &self.times,
            self.decider.slots(),
            self.ingest.as_ref(),
        );
        if let Some(p) = &self.proxy {
            p.render(&mut out);
        }
        out
    }

    fn block_size(&self) -> u32 {
        self.cfg.block_size
    }

    fn check_blocks(&self, blocks: usize) -> Result<(), DecideError> {
        self.decider.check_blocks(blocks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrouter_core::decision::DeciderConfig;
    use kvrouter_core::hash::sequence_hashes;

    /// With replica sync, a decision is announced once it settles (with all its sequence
    /// hashes, its adapter and its prefill), before anything else said of it; a request
    /// freed before it settled is never announced, nor its free.
    #[test]
    fn replicas_hear_of_a_decision_once_it_settles_and_in_order() {
        let (tx, rx) = flume::unbounded();
        let decider = Decider::new(DeciderConfig::default());
        let mut st = State::new(RouterConfig::default(), None, decider, Some(tx), None);
        let locals: Vec<LocalBlockHash> = (1..=8).map(LocalBlockHash).collect();
        let ask = |id: &'static str| Ask {
            locals: &locals,
            tokens: 8 * 16,
            request_id: Some(id),
            lora_name: Some("adapter".into()),
            explain: false,
        };
        let w = [WorkerDp::new(1, 0)];
        let d = st.decide(ask("a"), &w).unwrap();
        assert!(rx.try_recv().is_err(), "announced before it settled");
        st.settle();
        let add = rx.try_recv().unwrap();
        assert_eq!((add.request_id.as_str(), add.worker), ("a", w[0]));
        assert_eq!(add.lora_name.as_deref(), Some("adapter"));
        let want: Vec<u64> = sequence_hashes(&locals).iter().map(|h| h.0).collect();
        match add.data {
            ActiveSequenceEventData::AddRequest {
                token_sequence,
                prefill_load_hint,
                ..
            } => {
                assert_eq!(token_sequence, Some(want));
                assert_eq!(
                    prefill_load_hint.map(|h| h.initial_effective_prefill_tokens),
                    Some(d.prefill_tokens)
                );
            }
            other => panic!("{other:?}"),
        }
        // `b` settles when `a`'s first token comes: its add goes first.
        st.decide(ask("b"), &w).unwrap();
        st.update("a", Update::FirstToken).unwrap();
        let order: Vec<(String, bool)> = rx
            .try_iter()
            .map(|e| {
                let add = matches!(e.data, ActiveSequenceEventData::AddRequest { .. });
                (e.request_id, add)
            })
            .collect();
        assert_eq!(order, [("b".to_owned(), true), ("a".to_owned(), false)]);
        // `c` is freed before it settled.
        st.decide(ask("c"), &w).unwrap();
        st.update("c", Update::Free).unwrap();
        st.settle();
        assert!(rx.try_recv().is_err());
        assert_eq!(st.decider.slots().worker_of("c"), None);
        // So is `d`, through the API (a free pipelined behind its route): never held,
        // never announced.
        st.decide(ask("d"), &w).unwrap();
        let free = crate::http::Request {
            method: "POST".into(),
            path: "/v1/requests/d/free".into(),
            ..Default::default()
        };
        assert_eq!(st.handle(free).status, 200);
        assert!(st.decider.is_settled());
        assert!(rx.try_recv().is_err());
        assert_eq!(st.decider.slots().worker_of("d"), None);
        // Everything else still reaches the replicas.
        st.update("b", Update::Free).unwrap();
        assert_eq!(rx.try_recv().unwrap().request_id, "b");
    }

    #[test]
    fn tokens_compare_in_full() {
        use super::constant_time_eq as eq;
        assert!(eq(b"secret", b"secret"));
        assert!(!eq(b"secret", b"secreT"));
        assert!(!eq(b"Secret", b"secret"));
        assert!(!eq(b"secret", b"secret2"));
        assert!(eq(b"", b""));
    }
}
