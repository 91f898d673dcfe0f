//! Session affinity (see [`ProxyConfig::session_ttl`](super::ProxyConfig::session_ttl)):
//! a request naming a session goes to the worker its session is bound to while that one is
//! a candidate with room; the binding lasts `session_ttl` after the session's last request,
//! and at most `max_sessions` are held.
//!
//! The bindings live in the routing state ([`kvrouter_core::sessions::Sessions`]). With
//! replica sync and [`ProxyConfig::session_sync`](super::ProxyConfig::session_sync) on,
//! replicas share them on a subject of kvrouter's own beside Dynamo's active-sequence one
//! (whose messages have no field for a session, and which Dynamo's routers read too): a
//! session stays on its worker whichever replica its requests reach, and two replicas
//! that bind one session at once end on the same worker.

use hyper::header::HeaderMap;
use kvrouter_core::decision::{DecideError, Decision};
use kvrouter_core::sessions::MAX_SESSION_LEN;
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
            .filter(|s| !s.is_empty() && s.len() <= MAX_SESSION_LEN)
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
        if let Some(s) = session
            && let Some(w) = st.session_worker(s)
        {
            if !excluded.contains(&w) && st.is_open(w) {
                match st.decide(ask.clone(), &[w]) {
                    Ok(d) => {
                        self.stats.add(&self.stats.session_bound, 1);
                        st.bind_session(s, d.worker);
                        return Ok(d);
                    }
                    Err(DecideError::WorkersFull { .. }) => {}
                    Err(e) => return Err(e),
                }
            }
            self.stats.add(&self.stats.session_yielded, 1);
        }
        let workers = st.candidates(excluded);
        let d = st.decide(ask, &workers)?;
        if let Some(s) = session {
            st.bind_session(s, d.worker);
        }
        Ok(d)
    }
}
