//! The routing API's counters and decision-time ring, and their Prometheus rendering.

use std::fmt::Write as _;

use kvrouter_core::slots::Slots;

use super::replica::ReplicaStats;
use crate::http::HttpStats;
use crate::ingest::IngestView;

/// Counters of the API (one executor owns them: plain integers).
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct ApiCounters {
    pub(super) routes: u64,
    pub(super) overlaps: u64,
    pub(super) client_errors: u64,
    pub(super) replica_in: u64,
    pub(super) replica_queued: u64,
    pub(super) replica_dropped: u64,
    pub(super) expired: u64,
    pub(super) workers_removed: u64,
    pub(super) too_large: u64,
    pub(super) overloaded: u64,
    pub(super) bad_request_ids: u64,
    pub(super) sessions: SessionCounters,
}

/// What became of session bindings, ours and the other replicas'.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct SessionCounters {
    /// Ours, handed to the publisher.
    pub(super) queued: u64,
    /// Ours, not sent: the publisher's queue was full.
    pub(super) dropped: u64,
    /// Theirs, by what [`kvrouter_core::sessions::Sessions::apply`] did.
    pub(super) taken: u64,
    pub(super) refreshed: u64,
    pub(super) older: u64,
    pub(super) full: u64,
    pub(super) invalid: u64,
    /// Their messages that did not decode.
    pub(super) undecodable: u64,
}

/// The last [`DecisionTimes::CAP`] decision times, ns.
#[derive(Debug, Default)]
pub(super) struct DecisionTimes {
    ring: Vec<u64>,
    pos: usize,
}

impl DecisionTimes {
    const CAP: usize = 4096;

    pub(super) fn record(&mut self, ns: u64) {
        if self.ring.len() < Self::CAP {
            self.ring.push(ns);
        } else {
            self.ring[self.pos] = ns;
            self.pos = (self.pos + 1) % Self::CAP;
        }
    }

    /// Quantiles `ps` of the recorded times, seconds (0 when none).
    fn quantiles<const N: usize>(&self, ps: [f64; N]) -> [f64; N] {
        let mut v = self.ring.clone();
        v.sort_unstable();
        ps.map(|p| {
            if v.is_empty() {
                0.0
            } else {
                v[((v.len() - 1) as f64 * p) as usize] as f64 / 1e9
            }
        })
    }
}

fn metric(out: &mut String, name: &str, kind: &str, help: &str, v: impl std::fmt::Display) {
    let _ = write!(
        out,
        "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"
    );
}

/// Prometheus text of the API's state and, when there is one, the ingest's.
pub(super) fn render(
    c: &ApiCounters,
    http: &HttpStats,
    replica: &ReplicaStats,
    sessions: &ReplicaStats,
    times: &DecisionTimes,
    slots: &Slots,
    ingest: Option<&IngestView>,
) -> String {
    let mut out = String::new();
    for (name, help, v) in [
        (
            "kvrouter_router_routes_total",
            "Routing decisions made.",
            c.routes,
        ),
        (
            "kvrouter_router_overlap_queries_total",
            "Overlap queries answered.",
            c.overlaps,
        ),
        (
            "kvrouter_router_client_errors_total",
            "Requests answered with a 4xx.",
            c.client_errors,
        ),
        (
            "kvrouter_replica_events_in_total",
            "Replica-sync events applied from other routers.",
            c.replica_in,
        ),
        (
            "kvrouter_replica_events_queued_total",
            "Replica-sync events handed to the publisher.",
            c.replica_queued,
        ),
        (
            "kvrouter_replica_events_out_total",
            "Replica-sync events in messages the NATS client accepted.",
            replica.out.get(),
        ),
        (
            "kvrouter_replica_events_degraded_total",
            "AddRequests sent with their blocks cut to fit the broker's max_payload.",
            replica.degraded.get(),
        ),
        (
            "kvrouter_replica_events_unsent_total",
            "Replica-sync events not sent: too big in every form, or their publish failed.",
            replica.unsent.get(),
        ),
        (
            "kvrouter_replica_messages_out_total",
            "Replica-sync messages published.",
            replica.messages.get(),
        ),
        (
            "kvrouter_replica_events_dropped_total",
            "Replica-sync events not sent (the publisher's queue was full).",
            c.replica_dropped,
        ),
        (
            "kvrouter_slots_expired_total",
            "Requests released after going stale.",
            c.expired,
        ),
        (
            "kvrouter_slots_shed_requests_total",
            "Active requests whose blocks were shed to keep within --max-active-blocks.",
            slots.shed_requests(),
        ),
        (
            "kvrouter_router_workers_removed_total",
            "Workers dropped from routing after the ingest removed them.",
            c.workers_removed,
        ),
        (
            "kvrouter_router_too_large_total",
            "Requests refused with 413: more blocks than --max-request-blocks.",
            c.too_large,
        ),
        (
            "kvrouter_router_overloaded_total",
            "Requests refused with 429: --max-active-requests in all or per worker reached.",
            c.overloaded,
        ),
        (
            "kvrouter_router_bad_request_ids_total",
            "Requests refused with 400 for their id (empty, too long, control characters).",
            c.bad_request_ids,
        ),
        (
            "kvrouter_http_connections_accepted_total",
            "Connections accepted by the API listener.",
            http.accepted.get(),
        ),
        (
            "kvrouter_http_connections_refused_total",
            "Connections refused with 503 at --max-connections.",
            http.refused.get(),
        ),
        (
            "kvrouter_http_rejected_total",
            "Requests refused for their framing or size (400, 411, 413, 414, 431, 501).",
            http.rejected.get(),
        ),
        (
            "kvrouter_http_read_timeouts_total",
            "Connections closed with 408: headers or body missed their deadline.",
            http.read_timeouts.get(),
        ),
        (
            "kvrouter_http_write_timeouts_total",
            "Connections dropped: a response could not be written in time.",
            http.write_timeouts.get(),
        ),
        (
            "kvrouter_http_bulk_waits_total",
            "Large-bodied requests that waited at the bulk gate (bulk work takes at most half the API thread).",
            http.bulk_waits.get(),
        ),
    ] {
        metric(&mut out, name, "counter", help, v);
    }
    let sc = &c.sessions;
    out.push_str("# HELP kvrouter_replica_session_bindings_total Session bindings shared with the other replicas: ours queued, dropped (queue full), out (taken by the NATS client), unsent; theirs taken, refreshed, older (ours is later), full (no room), invalid, undecodable (messages).\n# TYPE kvrouter_replica_session_bindings_total counter\n");
    for (op, v) in [
        ("queued", sc.queued),
        ("dropped", sc.dropped),
        ("out", sessions.out.get()),
        ("unsent", sessions.unsent.get()),
        ("taken", sc.taken),
        ("refreshed", sc.refreshed),
        ("older", sc.older),
        ("full", sc.full),
        ("invalid", sc.invalid),
        ("undecodable", sc.undecodable),
    ] {
        let _ = writeln!(
            out,
            "kvrouter_replica_session_bindings_total{{op=\"{op}\"}} {v}"
        );
    }
    metric(
        &mut out,
        "kvrouter_http_connections_open",
        "gauge",
        "Connections open on the API listener.",
        http.open.get(),
    );
    metric(
        &mut out,
        "kvrouter_slots_active_requests",
        "gauge",
        "Active requests tracked by the slot manager.",
        slots.active_requests(),
    );
    metric(
        &mut out,
        "kvrouter_slots_held_blocks",
        "gauge",
        "Blocks the active requests hold together (at most --max-active-blocks).",
        slots.held_blocks(),
    );
    out.push_str("# HELP kvrouter_router_decision_seconds Routing decision time (recent decisions).\n# TYPE kvrouter_router_decision_seconds summary\n");
    let ps = [0.5, 0.99, 0.999];
    for (p, q) in ps.into_iter().zip(times.quantiles(ps)) {
        let _ = writeln!(
            out,
            "kvrouter_router_decision_seconds{{quantile=\"{p}\"}} {q}"
        );
    }
    if let Some(ingest) = ingest {
        for (k, v) in ingest.stats().fields() {
            let _ = write!(
                out,
                "# TYPE kvrouter_ingest_{k}_total counter\nkvrouter_ingest_{k}_total {v}\n"
            );
        }
        let workers = ingest.workers();
        let _ = write!(
            out,
            "# TYPE kvrouter_index_workers gauge\nkvrouter_index_workers {}\n",
            workers.len()
        );
        let _ = write!(
            out,
            "# TYPE kvrouter_index_blocks gauge\nkvrouter_index_blocks {}\n",
            workers.iter().map(|s| s.blocks).sum::<usize>()
        );
        let _ = write!(
            out,
            "# TYPE kvrouter_index_lower_tier_blocks gauge\nkvrouter_index_lower_tier_blocks {}\n",
            ingest.reader().lower_block_count()
        );
    }
    out
}
