//! Session affinity (see [`ProxyConfig::session_ttl`](super::ProxyConfig::session_ttl)):
//! a request naming a session goes to the worker its session is bound to while that one is
//! a candidate with room; the binding lasts `session_ttl` after the session's last request,
//! and at most `max_sessions` are held.
//!
//! Bindings are per replica, not shared through replica sync. Replica sync carries
//! Dynamo's own active-sequence messages (so that a Dynamo router and kvrouter replicas can
//! share one subject), which have no field for a session; a message of our own would
//! break that compatibility. What a shared binding would buy is small: every replica sees
//! the same KV events and, through replica sync, every replica's in-flight requests, so a
//! session's next turn, wherever it lands, finds its prefix cached (or in flight, with
//! `credit_inflight`) on the worker that served the last one and is routed there by the
//! cost alone; the binding only decides ties and the turns whose cache was evicted. A
//! deployment that needs strict stickiness across replicas routes a session's requests
//! to one replica (a hash of the session header at the load balancer).

use hyper::header::HeaderMap;
use kvrouter_core::decision::{DecideError, Decision};
use kvrouter_core::worker::WorkerDp;

use super::front::Front;
use crate::routing::Ask;

/// The session header Dynamo's frontend and agentic clients send.
const DYNAMO_SESSION: &str = "x-dynamo-session-id";

impl Front {
    /// The session a request names, if affinity is on.
    pub(super) fn session_of(&self, headers: &HeaderMap) -> Option<String> {
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
    pub(super) fn choose(
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
}
