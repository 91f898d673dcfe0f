//! The proxy's counters and histograms, rendered in Prometheus text beside the routing
//! API's (`kvrouter_proxy_*`, in the style of `dynamo_frontend_*`).

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::model::ModelCard;
use super::pieces::PieceStats;

/// Upper bounds of the latency buckets, seconds.
const LATENCY_BUCKETS: [f64; 16] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    10.0, 60.0,
];

/// A Prometheus histogram with fixed buckets.
#[derive(Debug, Default)]
pub(crate) struct Histogram {
    counts: RefCell<[u64; LATENCY_BUCKETS.len()]>,
    count: Cell<u64>,
    sum: Cell<f64>,
}

impl Histogram {
    pub(crate) fn observe(&self, secs: f64) {
        let mut c = self.counts.borrow_mut();
        if let Some(i) = LATENCY_BUCKETS.iter().position(|&b| secs <= b) {
            c[i] += 1;
        }
        self.count.set(self.count.get() + 1);
        self.sum.set(self.sum.get() + secs);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let c = self.counts.borrow();
        let mut cum = 0;
        for (b, n) in LATENCY_BUCKETS.iter().zip(c.iter()) {
            cum += n;
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cum}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count.get());
        let _ = writeln!(out, "{name}_sum {}", self.sum.get());
        let _ = writeln!(out, "{name}_count {}", self.count.get());
    }
}

/// Per model: consecutive requests routed with no cached block anywhere.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Streak {
    pub(crate) now: u64,
    pub(crate) longest: u64,
    pub(crate) zero_overlap: u64,
}

/// Everything the proxy counts (single executor: cells).
#[derive(Debug, Default)]
pub(crate) struct ProxyStats {
    /// Requests answered, by endpoint and status.
    pub(crate) requests: RefCell<BTreeMap<(&'static str, u16), u64>>,
    pub(crate) inflight: Cell<u64>,
    pub(crate) ttft: Histogram,
    pub(crate) itl: Histogram,
    pub(crate) e2e: Histogram,
    /// Tokenisation and the decision, per request.
    pub(crate) routing: Histogram,
    pub(crate) tokenize: Histogram,
    pub(crate) prompt_tokens: Cell<u64>,
    /// Prompt tokens the decision expected cached on the worker it chose.
    pub(crate) predicted_cached_tokens: Cell<u64>,
    /// Cached prompt tokens the engines reported (`usage.prompt_tokens_details`).
    pub(crate) engine_cached_tokens: Cell<u64>,
    /// Prompt tokens of the answers that reported cached tokens.
    pub(crate) engine_reported_prompt_tokens: Cell<u64>,
    pub(crate) retries: Cell<u64>,
    /// Exchanges with engines that failed, by kind.
    pub(crate) upstream_errors: RefCell<BTreeMap<&'static str, u64>>,
    /// Refused as busy (429) or with no worker (503).
    pub(crate) busy: RefCell<BTreeMap<u16, u64>>,
    pub(crate) client_disconnects: Cell<u64>,
    pub(crate) connections_refused: Cell<u64>,
    pub(crate) connections_open: Cell<u64>,
    pub(crate) session_bound: Cell<u64>,
    pub(crate) session_yielded: Cell<u64>,
    pub(crate) sessions: Cell<u64>,
    pub(crate) streaks: RefCell<BTreeMap<String, Streak>>,
    pub(crate) pool_opened: Cell<u64>,
    pub(crate) pool_reused: Cell<u64>,
    /// Each distinct model card, named by the first model that uses it: its piece cache's
    /// counters are rendered from it.
    pub(crate) cards: RefCell<Vec<(String, Arc<ModelCard>)>>,
}

fn bump(c: &Cell<u64>, by: u64) {
    c.set(c.get() + by);
}

impl ProxyStats {
    /// The piece caches' counters, per card.
    fn render_pieces(&self, out: &mut String) {
        type Rows = fn(&ModelCard, &PieceStats) -> Vec<(&'static str, u64)>;
        let cards = self.cards.borrow();
        let stats: Vec<_> = cards
            .iter()
            .filter_map(|(m, c)| c.piece_stats().map(|s| (m, c, s)))
            .collect();
        if stats.is_empty() {
            return;
        }
        fn n(a: &AtomicU64) -> u64 {
            a.load(Relaxed)
        }
        // Name, help, type, and each card's rows (the outcome label, or none).
        let families: [(&str, &str, &str, Rows); 7] = [
            (
                "kvrouter_proxy_tokenize_pieces_total",
                "Prompt pieces found in the piece cache (hit) or encoded (miss).",
                "counter",
                |_, s| vec![("hit", n(&s.hits)), ("miss", n(&s.misses))],
            ),
            (
                "kvrouter_proxy_tokenize_piece_tokens_total",
                "Tokens of the prompt pieces found in the cache (hit) or encoded (miss).",
                "counter",
                |_, s| vec![("hit", n(&s.hit_tokens)), ("miss", n(&s.miss_tokens))],
            ),
            (
                "kvrouter_proxy_tokenize_piece_prompts_total",
                "Prompts encoded in pieces (one piece or more), and of them: also encoded whole and equal (verified), different (mismatch: pieces then off), encoded whole instead (fallback), sampled but not compared while the checker was busy (check_skipped).",
                "counter",
                |_, s| {
                    vec![
                        ("pieces", n(&s.prompts)),
                        ("verified", n(&s.verified)),
                        ("mismatch", n(&s.mismatches)),
                        ("fallback", n(&s.fallbacks)),
                        ("check_skipped", n(&s.checks_skipped)),
                    ]
                },
            ),
            (
                "kvrouter_proxy_tokenize_cache_bytes",
                "Bytes the piece cache holds (text and ids).",
                "gauge",
                |_, s| vec![("", n(&s.bytes))],
            ),
            (
                "kvrouter_proxy_tokenize_cache_evictions_total",
                "Pieces evicted to keep the cache within its bytes.",
                "counter",
                |_, s| vec![("", n(&s.evictions))],
            ),
            (
                "kvrouter_proxy_tokenize_pieces_off",
                "1 when a piecewise encoding differed from the whole and pieces were turned off for the card.",
                "gauge",
                |c, _| vec![("", u64::from(c.pieces_off()))],
            ),
            (
                "kvrouter_proxy_tokenize_byte_level",
                "1 when the card's pieces are encoded by the router's byte-level BPE encoder, 0 when by the tokenizer itself.",
                "gauge",
                |c, _| vec![("", u64::from(c.byte_level()))],
            ),
        ];
        for (name, help, kind, rows) in families {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (m, c, s) in &stats {
                for (outcome, v) in rows(c, s) {
                    let _ = if outcome.is_empty() {
                        writeln!(out, "{name}{{model=\"{m}\"}} {v}")
                    } else {
                        writeln!(out, "{name}{{model=\"{m}\",outcome=\"{outcome}\"}} {v}")
                    };
                }
            }
        }
    }

    pub(crate) fn answered(&self, endpoint: &'static str, status: u16) {
        *self
            .requests
            .borrow_mut()
            .entry((endpoint, status))
            .or_default() += 1;
    }

    pub(crate) fn upstream_error(&self, kind: &'static str) {
        *self.upstream_errors.borrow_mut().entry(kind).or_default() += 1;
    }

    pub(crate) fn refused(&self, status: u16) {
        *self.busy.borrow_mut().entry(status).or_default() += 1;
    }

    pub(crate) fn add(&self, c: &Cell<u64>, by: u64) {
        bump(c, by);
    }

    /// Records a routed request's overlap; returns the model's streak when it just
    /// reached `warn_at` (once per streak).
    pub(crate) fn overlap(&self, model: &str, any_cached: bool, warn_at: u64) -> Option<u64> {
        let mut s = self.streaks.borrow_mut();
        let e = s.entry(model.to_owned()).or_default();
        if any_cached {
            e.now = 0;
            return None;
        }
        e.now += 1;
        e.zero_overlap += 1;
        e.longest = e.longest.max(e.now);
        (e.now == warn_at).then_some(e.now)
    }

    /// Appends the Prometheus text.
    pub(crate) fn render(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "# HELP kvrouter_proxy_requests_total OpenAI requests answered, by endpoint and status.\n# TYPE kvrouter_proxy_requests_total counter"
        );
        for ((e, s), n) in self.requests.borrow().iter() {
            let _ = writeln!(
                out,
                "kvrouter_proxy_requests_total{{endpoint=\"{e}\",status=\"{s}\"}} {n}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP kvrouter_proxy_upstream_errors_total Exchanges with engines that failed or broke the protocol, by kind.\n# TYPE kvrouter_proxy_upstream_errors_total counter"
        );
        for (k, n) in self.upstream_errors.borrow().iter() {
            let _ = writeln!(
                out,
                "kvrouter_proxy_upstream_errors_total{{kind=\"{k}\"}} {n}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP kvrouter_proxy_refused_total Requests refused by busy thresholds (429) or for want of workers (503).\n# TYPE kvrouter_proxy_refused_total counter"
        );
        for (s, n) in self.busy.borrow().iter() {
            let _ = writeln!(out, "kvrouter_proxy_refused_total{{status=\"{s}\"}} {n}");
        }
        let _ = writeln!(
            out,
            "# HELP kvrouter_proxy_zero_overlap_streak Consecutive requests of a model routed with no cached block on any worker (a long streak on a warm fleet: the proxy's tokens are not the engine's).\n# TYPE kvrouter_proxy_zero_overlap_streak gauge"
        );
        for (m, s) in self.streaks.borrow().iter() {
            let m = m.replace('\\', "\\\\").replace('"', "\\\"");
            let _ = writeln!(
                out,
                "kvrouter_proxy_zero_overlap_streak{{model=\"{m}\"}} {}",
                s.now
            );
            let _ = writeln!(
                out,
                "kvrouter_proxy_zero_overlap_streak_max{{model=\"{m}\"}} {}",
                s.longest
            );
            let _ = writeln!(
                out,
                "kvrouter_proxy_zero_overlap_requests_total{{model=\"{m}\"}} {}",
                s.zero_overlap
            );
        }
        for (name, help, kind, v) in [
            (
                "kvrouter_proxy_inflight_requests",
                "Requests being answered now.",
                "gauge",
                self.inflight.get(),
            ),
            (
                "kvrouter_proxy_prompt_tokens_total",
                "Prompt tokens routed.",
                "counter",
                self.prompt_tokens.get(),
            ),
            (
                "kvrouter_proxy_predicted_cached_tokens_total",
                "Prompt tokens the decision expected cached on the worker it chose.",
                "counter",
                self.predicted_cached_tokens.get(),
            ),
            (
                "kvrouter_proxy_engine_cached_tokens_total",
                "Cached prompt tokens the engines reported (usage.prompt_tokens_details.cached_tokens).",
                "counter",
                self.engine_cached_tokens.get(),
            ),
            (
                "kvrouter_proxy_engine_reported_prompt_tokens_total",
                "Prompt tokens of the answers that reported cached tokens.",
                "counter",
                self.engine_reported_prompt_tokens.get(),
            ),
            (
                "kvrouter_proxy_retries_total",
                "Requests sent again to another worker before their first byte.",
                "counter",
                self.retries.get(),
            ),
            (
                "kvrouter_proxy_client_disconnects_total",
                "Requests whose client left before the end (the engine's request was cancelled).",
                "counter",
                self.client_disconnects.get(),
            ),
            (
                "kvrouter_proxy_connections_open",
                "Client connections open now.",
                "gauge",
                self.connections_open.get(),
            ),
            (
                "kvrouter_proxy_connections_refused_total",
                "Client connections refused past the connection cap.",
                "counter",
                self.connections_refused.get(),
            ),
            (
                "kvrouter_proxy_session_routes_total",
                "Requests routed to their session's bound worker.",
                "counter",
                self.session_bound.get(),
            ),
            (
                "kvrouter_proxy_session_yields_total",
                "Requests whose session's worker was gone or busy (routed afresh).",
                "counter",
                self.session_yielded.get(),
            ),
            (
                "kvrouter_proxy_sessions",
                "Session bindings held, this replica's and those taken from others (expired ones until the next sweep, at most 10 s later).",
                "gauge",
                self.sessions.get(),
            ),
            (
                "kvrouter_proxy_upstream_connections_opened_total",
                "Connections opened to engines.",
                "counter",
                self.pool_opened.get(),
            ),
            (
                "kvrouter_proxy_upstream_connections_reused_total",
                "Exchanges on a pooled keep-alive connection.",
                "counter",
                self.pool_reused.get(),
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
            );
        }
        self.ttft.render(
            out,
            "kvrouter_proxy_time_to_first_token_seconds",
            "From the request's arrival to its first streamed chunk.",
        );
        self.itl.render(
            out,
            "kvrouter_proxy_inter_chunk_seconds",
            "Between two streamed chunks of an answer.",
        );
        self.e2e.render(
            out,
            "kvrouter_proxy_request_duration_seconds",
            "From the request's arrival to the end of its answer.",
        );
        self.routing.render(
            out,
            "kvrouter_proxy_routing_seconds",
            "Tokenisation, hashing and the decision, per request.",
        );
        self.tokenize.render(
            out,
            "kvrouter_proxy_tokenize_seconds",
            "Preparing a request: parsing its body, chat template and tokenizer.",
        );
        self.render_pieces(out);
    }
}
