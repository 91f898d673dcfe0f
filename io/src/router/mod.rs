//! The router service: routing decisions over HTTP on a glommio executor of its own, fed by
//! the ingest's index (or, in approximate mode, by its own decisions), with the slot
//! manager's load predictions shared between replicas over NATS.
//!
//! Endpoints (JSON; worker ids are integers carrying the exact u64, inputs accept integers or
//! decimal strings):
//!
//! | endpoint | what |
//! |---|---|
//! | `POST /v1/route` | `{"token_ids": [...]}` or `{"block_hashes": [...]}`, optional `lora_name`, `request_id`, `explain` → `{"worker_id", "dp_rank", "overlap_blocks", "request_id"}` (+ `candidates` with their cost terms when `explain`). Binary framing: `Content-Type: application/x-kvrouter-block-hashes`, the body the local block hashes as little-endian u64s, `X-Request-Id` / `X-Lora-Name` headers |
//! | `POST /v1/overlaps` | same input → `{"overlaps": [{"worker_id", "dp_rank", "blocks"}]}`: find_matches without early exit, positive counts only |
//! | `POST /v1/requests/{id}/first_token` | the request's prefill is done: its prefill tokens are released |
//! | `POST /v1/requests/{id}/free` | the request finished: its slots are released |
//! | `GET /v1/workers` | workers, dp ranks, cached blocks, last applied event id, loads |
//! | `GET /metrics` | Prometheus text |
//! | `GET /healthz` | 200 once the NATS subscriptions are active, else 503 |
//!
//! An optional bearer token guards the mutating endpoints (`route`, `first_token`, `free`).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use kvrouter_core::codec::replica::{
    self, ActiveSequenceEvent, ActiveSequenceEventData, PrefillLoadHint,
};
use kvrouter_core::codec::{Envelope, Subjects, TOPIC_ACTIVE_SEQUENCES};
use kvrouter_core::hash::{HashOptions, LocalBlockHash, local_block_hashes, sequence_hashes};
use kvrouter_core::index::{ApproxConfig, ApproxIndex, OverlapScores};
use kvrouter_core::policy::{CostConfig, Rng, choose, score};
use kvrouter_core::slots::Slots;
use kvrouter_core::worker::{WorkerDp, WorkerId};
use serde::{Deserialize, Deserializer, Serialize};

use crate::http::{self, HttpConfig, Request, Response};
use crate::ingest::IngestView;
use crate::nats::{Client, Options};

/// Settings of the router service.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// Where the HTTP API listens.
    pub listen: SocketAddr,
    /// HTTP limits.
    pub http: HttpConfig,
    /// Tokens per KV block (hashing `token_ids`).
    pub block_size: u32,
    /// Cost function.
    pub cost: CostConfig,
    /// `false`: approximate mode (no KV events; the router records its own decisions).
    pub kv_events: bool,
    /// Approximate-mode settings.
    pub approx: ApproxConfig,
    /// Share slot predictions with other replicas over NATS.
    pub replica_sync: bool,
    /// This router's id (replicas ignore their own messages).
    pub router_id: u64,
    /// Subject naming.
    pub subjects: Subjects,
    /// NATS connection (replica sync).
    pub nats: Options,
    /// Requests not heard of for this long are released.
    pub stale_after: Duration,
    /// Bearer token guarding mutating endpoints.
    pub auth_token: Option<String>,
    /// Seed of the tie-breaking / sampling generator.
    pub seed: u64,
    /// Workers to route to even before any event of theirs arrives (approximate mode).
    pub static_workers: Vec<WorkerDp>,
    /// Let the API executor spin this long before parking: lower latency on a dedicated
    /// core, wasted CPU on a shared one.
    pub spin_before_park: Option<Duration>,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8080".parse().expect("valid"),
            http: HttpConfig::default(),
            block_size: 64,
            cost: CostConfig::default(),
            kv_events: true,
            approx: ApproxConfig::default(),
            replica_sync: true,
            router_id: 0,
            subjects: Subjects::default(),
            nats: Options::default(),
            stale_after: Duration::from_secs(600),
            auth_token: None,
            seed: 0,
            static_workers: Vec::new(),
            spin_before_park: None,
        }
    }
}

/// A `u64` given as a JSON integer or a decimal string.
#[derive(Debug, Clone, Copy)]
struct U64Lenient(u64);

impl<'de> Deserialize<'de> for U64Lenient {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = U64Lenient;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an unsigned 64-bit integer or its decimal string")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<U64Lenient, E> {
                Ok(U64Lenient(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<U64Lenient, E> {
                u64::try_from(v)
                    .map(U64Lenient)
                    .map_err(|_| E::custom("negative hash"))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<U64Lenient, E> {
                v.trim()
                    .parse()
                    .map(U64Lenient)
                    .map_err(|_| E::custom(format!("{v:?} is not a decimal u64")))
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RouteInput {
    #[serde(default)]
    token_ids: Option<Vec<u32>>,
    #[serde(default)]
    block_hashes: Option<Vec<U64Lenient>>,
    #[serde(default)]
    lora_name: Option<String>,
    #[serde(default)]
    request_id: Option<String>,
    #[serde(default)]
    explain: bool,
}

/// The binary framing's content type: the body is the request's local block hashes, each a
/// little-endian u64; `X-Request-Id` and `X-Lora-Name` headers stand for the JSON fields.
pub const BINARY_HASHES: &str = "application/x-kvrouter-block-hashes";

/// The input of `/v1/route` and `/v1/overlaps`, in the binary framing or as JSON.
fn route_input(req: &Request) -> Result<RouteInput, String> {
    let content_type = req
        .header("content-type")
        .and_then(|v| v.split(';').next())
        .map(str::trim);
    if content_type == Some(BINARY_HASHES) {
        if !req.body.len().is_multiple_of(8) {
            return Err(format!(
                "a {BINARY_HASHES} body is a whole number of 8-byte hashes, not {} bytes",
                req.body.len()
            ));
        }
        let hashes = req
            .body
            .chunks_exact(8)
            .map(|c| {
                let mut b = [0u8; 8];
                b.copy_from_slice(c);
                U64Lenient(u64::from_le_bytes(b))
            })
            .collect();
        return Ok(RouteInput {
            token_ids: None,
            block_hashes: Some(hashes),
            lora_name: req.header("x-lora-name").map(str::to_owned),
            request_id: req.header("x-request-id").map(str::to_owned),
            explain: false,
        });
    }
    parse_route_input(&req.body).map_err(|e| format!("malformed JSON: {e}"))
}

/// Parses a route body: the fast path for the common shape (`block_hashes` first, as
/// integers), serde_json for everything else (and for every error message).
fn parse_route_input(body: &[u8]) -> Result<RouteInput, serde_json::Error> {
    match fast::route_input(body) {
        Some(input) => Ok(input),
        None => serde_json::from_slice(body),
    }
}

/// A fast path for the hot input, `{"block_hashes": [u64, ...], ...}`: long prompts carry
/// thousands of 20-digit hashes, which serde_json parses one digit at a time (about 50 ns a
/// hash, the largest single cost of a decision). Here eight digits are converted at once.
/// Anything outside the plain shape (another key first, strings, signs, fractions,
/// exponents, leading zeros, overflow, odd whitespace) declines with `None`, and serde_json
/// parses the body instead, so the accepted language and every error stay serde_json's.
mod fast {
    use super::{RouteInput, U64Lenient};

    fn ws(b: &[u8], mut i: usize) -> usize {
        while i < b.len() && matches!(b[i], b' ' | b'\t' | b'\n' | b'\r') {
            i += 1;
        }
        i
    }

    /// Eight ASCII digits at `b[..8]` as a number (first digit most significant), or `None`
    /// when any of them is not a digit.
    #[inline]
    fn eight_digits(b: &[u8]) -> Option<u64> {
        let x = u64::from_le_bytes(b.get(..8)?.try_into().ok()?);
        // Every byte 0x30..=0x39 (simdjson's test: a carry out of a byte can only come from
        // a byte that fails the test itself).
        if (x & 0xF0F0_F0F0_F0F0_F0F0)
            | ((x.wrapping_add(0x0606_0606_0606_0606) & 0xF0F0_F0F0_F0F0_F0F0) >> 4)
            != 0x3333_3333_3333_3333
        {
            return None;
        }
        let mut v = x - 0x3030_3030_3030_3030;
        v = (v.wrapping_mul(10) + (v >> 8)) & 0x00FF_00FF_00FF_00FF;
        v = (v.wrapping_mul(100) + (v >> 16)) & 0x0000_FFFF_0000_FFFF;
        v = (v.wrapping_mul(10_000) + (v >> 32)) & 0x0000_0000_FFFF_FFFF;
        Some(v)
    }

    fn number(b: &[u8], mut i: usize) -> Option<(u64, usize)> {
        let start = i;
        let mut v: u64 = 0;
        while let Some(x) = b.get(i..).and_then(eight_digits) {
            v = v.checked_mul(100_000_000)?.checked_add(x)?;
            i += 8;
        }
        while let Some(d) = b.get(i).filter(|c| c.is_ascii_digit()) {
            v = v.checked_mul(10)?.checked_add(u64::from(d - b'0'))?;
            i += 1;
        }
        // No digits, or a leading zero (invalid JSON): let serde_json say so.
        if i == start || (b[start] == b'0' && i - start > 1) {
            return None;
        }
        Some((v, i))
    }

    pub(super) fn route_input(b: &[u8]) -> Option<RouteInput> {
        const KEY: &[u8] = b"\"block_hashes\"";
        let mut i = ws(b, 0);
        if b.get(i) != Some(&b'{') {
            return None;
        }
        i = ws(b, i + 1);
        if !b.get(i..)?.starts_with(KEY) {
            return None;
        }
        i = ws(b, i + KEY.len());
        if b.get(i) != Some(&b':') {
            return None;
        }
        i = ws(b, i + 1);
        if b.get(i) != Some(&b'[') {
            return None;
        }
        i = ws(b, i + 1);
        let mut hashes = Vec::with_capacity(b.len() / 21 + 1);
        if b.get(i) == Some(&b']') {
            i += 1;
        } else {
            loop {
                let (v, next) = number(b, i)?;
                hashes.push(U64Lenient(v));
                i = ws(b, next);
                match b.get(i)? {
                    b',' => i = ws(b, i + 1),
                    b']' => {
                        i += 1;
                        break;
                    }
                    _ => return None,
                }
            }
        }
        i = ws(b, i);
        match b.get(i)? {
            b'}' => (ws(b, i + 1) == b.len()).then_some(RouteInput {
                token_ids: None,
                block_hashes: Some(hashes),
                lora_name: None,
                request_id: None,
                explain: false,
            }),
            b',' => {
                // The other keys (few and short): serde_json on `{` + the rest.
                let mut rest = Vec::with_capacity(b.len() - i);
                rest.push(b'{');
                rest.extend_from_slice(&b[i + 1..]);
                let mut input: RouteInput = serde_json::from_slice(&rest).ok()?;
                if input.block_hashes.is_some() || input.token_ids.is_some() {
                    return None; // a duplicate key, or both inputs: serde_json's verdict
                }
                input.block_hashes = Some(hashes);
                Some(input)
            }
            _ => None,
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        /// Checks the fast path against serde_json; returns whether the fast path took it.
        fn same(body: &str) -> bool {
            let slow: Result<RouteInput, _> = serde_json::from_str(body);
            // `None`: serde_json decides.
            let Some(fast) = route_input(body.as_bytes()) else {
                return false;
            };
            let slow = slow.unwrap_or_else(|e| panic!("fast accepted {body:?}, serde: {e}"));
            assert_eq!(format!("{fast:?}"), format!("{slow:?}"), "{body}");
            true
        }

        #[test]
        fn agrees_with_serde_json() {
            for body in [
                r#"{"block_hashes":[]}"#,
                r#"{"block_hashes":[0]}"#,
                r#"{"block_hashes":[18446744073709551615]}"#,
                r#"{"block_hashes":[18446744073709551616]}"#,
                r#"{"block_hashes":[12345678,123456789,1234567812345678]}"#,
                r#" { "block_hashes" : [ 1 , 2 ,3 ] , "request_id" : "r" , "explain": true } "#,
                r#"{"block_hashes":[1,2],"lora_name":"x"}"#,
                r#"{"block_hashes":[01]}"#,
                r#"{"block_hashes":[-1]}"#,
                r#"{"block_hashes":[1.5]}"#,
                r#"{"block_hashes":[1e3]}"#,
                r#"{"block_hashes":["7"]}"#,
                r#"{"block_hashes":[1,]}"#,
                r#"{"block_hashes":[1],"block_hashes":[2]}"#,
                r#"{"block_hashes":[1],"token_ids":[2]}"#,
                r#"{"block_hashes":[1]} x"#,
                r#"{"block_hashes":[1],"nope":1}"#,
                r#"{"request_id":"r","block_hashes":[1]}"#,
            ] {
                same(body);
            }
            let big = format!(
                "{{\"block_hashes\":{:?},\"request_id\":\"q\"}}",
                (0..2000u64)
                    .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
                    .collect::<Vec<_>>()
            );
            assert!(route_input(big.as_bytes()).is_some());
            same(&big);
            // Every prefix of a valid body: never a wrong acceptance.
            for n in 0..big.len().min(300) {
                same(&big[..n]);
            }
        }

        #[test]
        fn random_mutations_never_accept_what_serde_json_refuses() {
            let base = br#" {"block_hashes": [18446744073709551615, 0, 12345678901234567890, 7],"request_id":"a"} "#;
            let alphabet = b"0123456789 ,[]{}\":-.eE\"\\ab";
            let mut x = 0x9E37_79B9_7F4A_7C15u64;
            let mut next = move || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            let mut taken = [0u32; 2];
            for _ in 0..20_000 {
                let mut b = base.to_vec();
                for _ in 0..(next() % 4 + 1) {
                    let at = (next() % b.len() as u64) as usize;
                    let c = alphabet[(next() % alphabet.len() as u64) as usize];
                    match next() % 3 {
                        0 => b[at] = c,
                        1 => b.insert(at, c),
                        _ => {
                            b.remove(at);
                        }
                    }
                }
                if let Ok(text) = std::str::from_utf8(&b) {
                    taken[usize::from(same(text))] += 1;
                }
            }
            // Both ways were exercised: mutants the fast path took, and ones it left.
            assert!(taken[0] > 1000 && taken[1] > 1000, "{taken:?}");
        }

        #[test]
        fn eight_digit_blocks() {
            assert_eq!(eight_digits(b"12345678"), Some(12_345_678));
            assert_eq!(eight_digits(b"00000000"), Some(0));
            assert_eq!(eight_digits(b"99999999"), Some(99_999_999));
            assert_eq!(eight_digits(b"1234567a"), None);
            assert_eq!(eight_digits(b"/2345678"), None);
            assert_eq!(eight_digits(b"1234:678"), None);
            assert_eq!(eight_digits(b"1234"), None);
        }
    }
}

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
    blocks: u32,
}

/// Counters of the API, for `/metrics`.
#[derive(Debug, Default, Clone, Copy)]
struct ApiCounters {
    routes: u64,
    overlaps: u64,
    client_errors: u64,
    replica_in: u64,
    replica_out: u64,
    expired: u64,
}

struct State {
    cfg: RouterConfig,
    ingest: Option<IngestView>,
    slots: Slots,
    approx: ApproxIndex,
    rng: Rng,
    start: Instant,
    next_request: u64,
    counters: ApiCounters,
    /// Recent decision latencies, ns (a ring for /metrics quantiles).
    latencies: Vec<u64>,
    latency_pos: usize,
    replica_tx: Option<flume::Sender<ActiveSequenceEvent>>,
    scratch: OverlapScores,
    /// The static workers and the ingest's, sorted, as of ingest membership `known_at`.
    known: Vec<WorkerDp>,
    known_at: Option<u64>,
}

impl State {
    fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    fn locals(&self, input: &RouteInput) -> Result<(Vec<LocalBlockHash>, u64), Response> {
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

    fn overlaps(&mut self, locals: &[LocalBlockHash]) -> OverlapScores {
        let mut out = std::mem::take(&mut self.scratch);
        match (&self.ingest, self.cfg.kv_events) {
            (Some(ingest), true) => ingest.reader().find_matches_into(locals, &mut out),
            _ => {
                let now = self.now_ms();
                self.approx.find_matches_into(locals, now, &mut out);
            }
        }
        out
    }

    /// Every worker a request may go to, sorted: the static ones, the ingest's and the
    /// slot manager's. The first two are rebuilt only when the ingest's membership
    /// counter moves (not on every route: that takes each shard's summary lock).
    fn known_workers(&mut self) -> Vec<WorkerDp> {
        let at = self.ingest.as_ref().map_or(0, IngestView::membership);
        if self.known_at != Some(at) {
            let mut v: Vec<WorkerDp> = self.cfg.static_workers.clone();
            if let Some(ingest) = &self.ingest {
                v.extend(ingest.workers().into_iter().map(|s| s.worker));
            }
            v.sort_unstable();
            v.dedup();
            self.known = v;
            self.known_at = Some(at);
        }
        let mut out = self.known.clone();
        let before = out.len();
        // The slot manager's workers are distinct, so those added here are too.
        for (w, _) in self.slots.workers() {
            if self.known.binary_search(&w).is_err() {
                out.push(w);
            }
        }
        if out.len() != before {
            out.sort_unstable();
        }
        out
    }

    fn route(&mut self, input: RouteInput) -> Response {
        let (locals, tokens) = match self.locals(&input) {
            Ok(v) => v,
            Err(r) => return r,
        };
        let overlaps = self.overlaps(&locals);
        let seqs: Vec<u64> = sequence_hashes(&locals).into_iter().map(|s| s.0).collect();
        let workers = self.known_workers();
        if workers.is_empty() {
            self.scratch = overlaps;
            return Response::error(503, "no workers known yet");
        }
        let candidates = self.slots.candidates(&workers, &seqs, &overlaps);
        self.scratch = overlaps;
        let scored = score(&self.cfg.cost, tokens, self.cfg.block_size, &candidates);
        let Some(i) = choose(&self.cfg.cost, &scored, &mut self.rng) else {
            return Response::error(503, "no eligible worker");
        };
        let chosen = scored[i].candidate;
        let request_id = input.request_id.clone().unwrap_or_else(|| {
            self.next_request += 1;
            format!("{:x}-{}", self.cfg.router_id, self.next_request)
        });
        let cached_tokens = chosen.device_overlap_blocks as u64 * self.cfg.block_size as u64;
        let prefill = tokens.saturating_sub(cached_tokens);
        let now = self.now_ms();
        // The replicas need their own copy of the blocks; without replica sync, no copy.
        let replicated = self.replica_tx.is_some().then(|| seqs.clone());
        if let Err(e) = self
            .slots
            .add(&request_id, chosen.worker, seqs, prefill, now)
        {
            self.counters.client_errors += 1;
            return Response::error(409, e.to_string());
        }
        if !self.cfg.kv_events {
            self.approx.record(chosen.worker, &locals, now);
        }
        if let Some(seqs) = replicated {
            self.replicate(
                &request_id,
                chosen.worker,
                input.lora_name.clone(),
                ActiveSequenceEventData::AddRequest {
                    token_sequence: Some(seqs),
                    track_prefill_tokens: true,
                    expected_output_tokens: None,
                    prefill_load_hint: Some(PrefillLoadHint {
                        initial_effective_prefill_tokens: prefill,
                        expected_prefill_duration: None,
                    }),
                },
            );
        }
        self.counters.routes += 1;
        let out = RouteOutput {
            worker_id: chosen.worker.worker_id,
            dp_rank: chosen.worker.dp_rank,
            overlap_blocks: chosen.device_overlap_blocks,
            request_id,
            candidates: input.explain.then_some(scored),
        };
        Response::json(200, serde_json::to_vec(&out).unwrap_or_default())
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
            if tx.try_send(e).is_ok() {
                self.counters.replica_out += 1;
            }
        }
    }

    fn apply_replica(&mut self, e: ActiveSequenceEvent) {
        if e.router_id == self.cfg.router_id {
            return;
        }
        self.counters.replica_in += 1;
        let now = self.now_ms();
        let _ = match e.data {
            ActiveSequenceEventData::AddRequest {
                token_sequence,
                track_prefill_tokens,
                prefill_load_hint,
                ..
            } => {
                let prefill = if track_prefill_tokens {
                    prefill_load_hint.map_or(0, |h| h.initial_effective_prefill_tokens)
                } else {
                    0
                };
                self.slots
                    .add(
                        &e.request_id,
                        e.worker,
                        token_sequence.unwrap_or_default(),
                        prefill,
                        now,
                    )
                    .map(|_| e.worker)
            }
            ActiveSequenceEventData::MarkPrefillCompleted => {
                self.slots.mark_prefill_done(&e.request_id, now)
            }
            ActiveSequenceEventData::Free => self.slots.free(&e.request_id),
        };
    }

    fn workers_json(&mut self) -> Response {
        let mut rows: BTreeMap<WorkerDp, serde_json::Value> = BTreeMap::new();
        let summaries = self
            .ingest
            .as_ref()
            .map(|i| i.workers())
            .unwrap_or_default();
        for w in self.known_workers() {
            let s = summaries.iter().find(|s| s.worker == w);
            let load = self.slots.load(w);
            rows.insert(
                w,
                serde_json::json!({
                    "worker_id": w.worker_id,
                    "dp_rank": w.dp_rank,
                    "cached_blocks": s.map_or(0, |s| s.blocks),
                    "last_event_id": s.and_then(|s| s.last_event_id),
                    "active_blocks": load.active_blocks,
                    "active_prefill_tokens": load.active_prefill_tokens,
                    "active_requests": load.active_requests,
                }),
            );
        }
        let body = serde_json::json!({ "workers": rows.into_values().collect::<Vec<_>>() });
        Response::json(200, serde_json::to_vec(&body).unwrap_or_default())
    }

    fn metrics(&self) -> Response {
        let mut out = String::new();
        let mut gauge = |name: &str, kind: &str, help: &str, v: f64| {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"
            ));
        };
        let c = self.counters;
        gauge(
            "kvrouter_router_routes_total",
            "counter",
            "Routing decisions made.",
            c.routes as f64,
        );
        gauge(
            "kvrouter_router_overlap_queries_total",
            "counter",
            "Overlap queries answered.",
            c.overlaps as f64,
        );
        gauge(
            "kvrouter_router_client_errors_total",
            "counter",
            "Requests answered with a 4xx.",
            c.client_errors as f64,
        );
        gauge(
            "kvrouter_replica_events_in_total",
            "counter",
            "Replica-sync events applied from other routers.",
            c.replica_in as f64,
        );
        gauge(
            "kvrouter_replica_events_out_total",
            "counter",
            "Replica-sync events published.",
            c.replica_out as f64,
        );
        gauge(
            "kvrouter_slots_expired_total",
            "counter",
            "Requests released after going stale.",
            c.expired as f64,
        );
        gauge(
            "kvrouter_slots_active_requests",
            "gauge",
            "Active requests tracked by the slot manager.",
            self.slots.active_requests() as f64,
        );
        let mut lat: Vec<u64> = self.latencies.clone();
        lat.sort_unstable();
        let q = |p: f64| {
            if lat.is_empty() {
                0.0
            } else {
                lat[((lat.len() - 1) as f64 * p) as usize] as f64 / 1e9
            }
        };
        out.push_str("# HELP kvrouter_router_decision_seconds Routing decision time (recent decisions).\n# TYPE kvrouter_router_decision_seconds summary\n");
        for p in [0.5, 0.99, 0.999] {
            out.push_str(&format!(
                "kvrouter_router_decision_seconds{{quantile=\"{p}\"}} {}\n",
                q(p)
            ));
        }
        if let Some(ingest) = &self.ingest {
            let s = ingest.stats();
            let v = serde_json::to_value(s).unwrap_or_default();
            if let Some(map) = v.as_object() {
                for (k, val) in map {
                    let name = format!("kvrouter_ingest_{k}_total");
                    out.push_str(&format!(
                        "# TYPE {name} counter\n{name} {}\n",
                        val.as_u64().unwrap_or(0)
                    ));
                }
            }
            out.push_str(&format!(
                "# TYPE kvrouter_index_workers gauge\nkvrouter_index_workers {}\n",
                ingest.workers().len()
            ));
            out.push_str(&format!(
                "# TYPE kvrouter_index_blocks gauge\nkvrouter_index_blocks {}\n",
                ingest.workers().iter().map(|s| s.blocks).sum::<usize>()
            ));
        }
        Response::text(200, out)
    }

    fn healthy(&self) -> bool {
        match &self.ingest {
            Some(i) => i.is_ready(),
            None => true,
        }
    }

    fn authorized(&self, req: &Request) -> bool {
        match &self.cfg.auth_token {
            None => true,
            Some(t) => req
                .header("authorization")
                .is_some_and(|h| h.strip_prefix("Bearer ").is_some_and(|v| v == t)),
        }
    }

    fn handle(&mut self, req: Request) -> Response {
        let started = Instant::now();
        // Only routing decisions count in the decision-time quantiles (not frees, metrics
        // scrapes or errors, which would flatter them).
        let is_route = req.method == "POST" && req.path.trim_end_matches('/') == "/v1/route";
        let resp = self.dispatch(req);
        if resp.status >= 400 && resp.status < 500 {
            self.counters.client_errors += 1;
        }
        if is_route && resp.status == 200 {
            let ns = started.elapsed().as_nanos() as u64;
            if self.latencies.len() < 4096 {
                self.latencies.push(ns);
            } else {
                self.latencies[self.latency_pos] = ns;
                self.latency_pos = (self.latency_pos + 1) % 4096;
            }
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
                Ok(input) => match self.locals(&input) {
                    Ok((locals, _)) => {
                        self.counters.overlaps += 1;
                        let scores = self.overlaps(&locals);
                        let list: Vec<OverlapEntry> = scores
                            .iter()
                            .map(|(w, blocks)| OverlapEntry {
                                worker_id: w.worker_id,
                                dp_rank: w.dp_rank,
                                blocks,
                            })
                            .collect();
                        self.scratch = scores;
                        Response::json(
                            200,
                            serde_json::to_vec(&serde_json::json!({ "overlaps": list }))
                                .unwrap_or_default(),
                        )
                    }
                    Err(r) => r,
                },
                Err(e) => Response::error(400, e),
            },
            ("GET", "/v1/workers") => self.workers_json(),
            ("GET", "/metrics") => self.metrics(),
            ("GET", "/healthz") => {
                if self.healthy() {
                    Response::json(200, br#"{"status":"ok"}"#.to_vec())
                } else {
                    Response::error(503, "NATS subscriptions not active")
                }
            }
            ("POST", p) if p.starts_with("/v1/requests/") => {
                let rest = &p["/v1/requests/".len()..];
                let Some((id, action)) = rest.rsplit_once('/') else {
                    return Response::error(404, "no such endpoint");
                };
                let now = self.now_ms();
                let (result, data) = match action {
                    "first_token" => (
                        self.slots.mark_prefill_done(id, now),
                        ActiveSequenceEventData::MarkPrefillCompleted,
                    ),
                    "free" => (self.slots.free(id), ActiveSequenceEventData::Free),
                    _ => return Response::error(404, "no such endpoint"),
                };
                match result {
                    Ok(worker) => {
                        self.replicate(id, worker, None, data);
                        Response::json(200, br#"{"ok":true}"#.to_vec())
                    }
                    Err(e) => Response::error(404, e.to_string()),
                }
            }
            (_, "/v1/route" | "/v1/overlaps" | "/v1/workers" | "/metrics" | "/healthz") => {
                Response::error(405, "method not allowed")
            }
            _ => Response::error(404, "no such endpoint"),
        }
    }
}

/// A running router service.
pub struct RouterHandle {
    addr: SocketAddr,
    stop: flume::Sender<()>,
    thread: Option<glommio::ExecutorJoinHandle<()>>,
}

impl std::fmt::Debug for RouterHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterHandle")
            .field("addr", &self.addr)
            .finish()
    }
}

impl RouterHandle {
    /// The address the API listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops the service and waits for it.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        let _ = self.stop.send(());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    /// Waits until the service stops by itself (never, normally).
    pub fn join(mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for RouterHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Starts the router service on its own executor (placement `cpu`, io memory `io_memory`).
pub fn start(
    cfg: RouterConfig,
    ingest: Option<IngestView>,
    cpu: Option<usize>,
    io_memory: usize,
) -> Result<RouterHandle, String> {
    let (addr_tx, addr_rx) = std::sync::mpsc::channel::<Result<SocketAddr, String>>();
    let (stop, stop_rx) = flume::bounded::<()>(1);
    let placement = cpu.map_or(glommio::Placement::Unbound, glommio::Placement::Fixed);
    let mut builder = glommio::LocalExecutorBuilder::new(placement)
        .name("kvrouter-api")
        .io_memory(io_memory);
    if let Some(spin) = cfg.spin_before_park {
        builder = builder.spin_before_park(spin);
    }
    let thread = builder
        .spawn(move || async move { run(cfg, ingest, addr_tx, stop_rx).await })
        .map_err(|e| e.to_string())?;
    let addr = addr_rx
        .recv()
        .map_err(|_| "the API executor stopped".to_string())??;
    Ok(RouterHandle {
        addr,
        stop,
        thread: Some(thread),
    })
}

async fn run(
    cfg: RouterConfig,
    ingest: Option<IngestView>,
    addr_tx: std::sync::mpsc::Sender<Result<SocketAddr, String>>,
    stop: flume::Receiver<()>,
) {
    let listener = match http::bind(cfg.listen) {
        Ok(l) => l,
        Err(e) => {
            let _ = addr_tx.send(Err(format!("cannot listen on {}: {e}", cfg.listen)));
            return;
        }
    };
    let addr = listener.local_addr().unwrap_or(cfg.listen);
    let (replica_tx, replica_rx) = flume::bounded::<ActiveSequenceEvent>(1 << 16);
    let state = Rc::new(RefCell::new(State {
        slots: Slots::new(cfg.stale_after.as_millis() as u64),
        approx: ApproxIndex::new(cfg.approx),
        rng: Rng::new(cfg.seed ^ cfg.router_id),
        start: Instant::now(),
        next_request: 0,
        counters: ApiCounters::default(),
        latencies: Vec::new(),
        latency_pos: 0,
        replica_tx: cfg.replica_sync.then_some(replica_tx),
        scratch: OverlapScores::new(),
        known: Vec::new(),
        known_at: None,
        ingest,
        cfg: cfg.clone(),
    }));
    if cfg.replica_sync {
        match Client::connect(cfg.nats.clone()).await {
            Ok(client) => start_replica_sync(client, Rc::clone(&state), replica_rx, &cfg).await,
            Err(e) => {
                let _ = addr_tx.send(Err(format!("replica sync: cannot connect to NATS: {e}")));
                return;
            }
        }
    }
    // Stale requests.
    let st = Rc::clone(&state);
    glommio::spawn_local(async move {
        loop {
            glommio::timer::sleep(Duration::from_secs(1)).await;
            let mut s = st.borrow_mut();
            let now = s.now_ms();
            let n = s.slots.expire(now);
            s.counters.expired += n as u64;
            s.approx.expire(now);
        }
    })
    .detach();
    let _ = addr_tx.send(Ok(addr));
    tracing::info!(%addr, "routing API listening");
    let st = Rc::clone(&state);
    let handler: Rc<dyn Fn(Request) -> Response> = Rc::new(move |req| st.borrow_mut().handle(req));
    let server = http::serve(listener, cfg.http.clone(), handler);
    let stopped = async {
        let _ = stop.recv_async().await;
    };
    futures_lite::future::or(server, stopped).await;
}

async fn start_replica_sync(
    client: Client,
    state: Rc<RefCell<State>>,
    out: flume::Receiver<ActiveSequenceEvent>,
    cfg: &RouterConfig,
) {
    let subject = cfg.subjects.subject(TOPIC_ACTIVE_SEQUENCES);
    let sub = match client.subscribe(&subject, None) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "replica sync: cannot subscribe");
            return;
        }
    };
    let _ = client.flush(Duration::from_secs(5)).await;
    let st = Rc::clone(&state);
    glommio::spawn_local(async move {
        while let Some(msg) = sub.next().await {
            match replica::decode_message(&msg.payload) {
                Ok((_, events)) => {
                    let mut s = st.borrow_mut();
                    for e in events {
                        s.apply_replica(e);
                    }
                }
                Err(e) => tracing::warn!(error = %e, "replica sync: undecodable message"),
            }
        }
    })
    .detach();
    // Outgoing: batches of up to 256 events or 1 ms.
    let publisher_id = cfg.router_id;
    glommio::spawn_local(async move {
        let mut seq = 0u64;
        while let Ok(first) = out.recv_async().await {
            let mut batch = vec![first];
            let deadline = Instant::now() + Duration::from_millis(1);
            while batch.len() < 256 {
                match out.try_recv() {
                    Ok(e) => batch.push(e),
                    Err(_) if Instant::now() < deadline => {
                        glommio::timer::sleep(Duration::from_micros(100)).await
                    }
                    Err(_) => break,
                }
            }
            let payload = if batch.len() == 1 {
                replica::encode(&batch[0])
            } else {
                replica::encode_batch(&batch)
            };
            let Ok(payload) = payload else { continue };
            let env = Envelope {
                publisher_id,
                sequence: seq,
                published_at: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64),
                topic: TOPIC_ACTIVE_SEQUENCES,
                payload: &payload,
            };
            seq += 1;
            if let Err(e) = client.publish(&subject, &env.encode()).await {
                tracing::warn!(error = %e, "replica sync: publish failed");
            }
        }
    })
    .detach();
}

/// The worker ids of a route decision's JSON answer, for tests and the harness.
pub fn worker_of(answer: &serde_json::Value) -> Option<(WorkerId, u32)> {
    Some((
        answer.get("worker_id")?.as_u64()?,
        answer.get("dp_rank")?.as_u64()? as u32,
    ))
}
