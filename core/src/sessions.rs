//! Session affinity's bindings: which worker each named session goes to, for how long,
//! and how router replicas agree on one binding per session.
//!
//! A front binds a session to the worker it routed one of the session's requests to; the
//! session's next request goes there while that worker is a candidate with room (the
//! front's rule, in `io/src/proxy/session.rs`). A binding lasts `ttl_ms` after the
//! session's last request. At most `max` are held; when the table is full, expired
//! bindings are swept (at most once a second), and a new session that still finds no
//! room is not bound (its requests are routed by the cost alone).
//!
//! **Replicas.** Every binding carries a stamp: `bound_at_ms`, the wall clock of the router
//! that made it, then that router's id. A replica takes another's binding when it holds
//! none for the session (or only an expired one), or when the other's stamp is later than
//! its own. An equal stamp is the same binding announced again: it only extends the
//! binding's life. So once every announcement has arrived, every replica holds the binding
//! with the latest stamp, whatever order the announcements came in: two replicas that
//! bound one session to different workers at the same moment end on the same worker. A
//! binding that replaces another is stamped after it (`max(wall clock, old stamp + 1)`),
//! so a rebinding wins over what it replaces even on a router whose clock is behind.
//!
//! **Announcements.** [`Sessions::bind`] returns what to announce: a new binding, or a
//! changed worker, at once; a binding kept is announced again once half the TTL has passed
//! since it was last announced (by anyone), so that the other replicas' copies do not
//! expire while it is in use. Replicas are expected to share one TTL.
//!
//! Nothing here reads a clock: every call takes the times (`now_ms` on the caller's own
//! monotonic clock, `wall_ms` since the Unix epoch).

use std::collections::HashMap;

use crate::codec::session::SessionBinding;
use crate::worker::WorkerDp;

/// The longest session name kept (a longer header is not a session; a longer announced
/// one is [`Applied::Invalid`]).
pub const MAX_SESSION_LEN: usize = 256;

/// How often a full table may be swept for expired bindings, ms.
const SWEEP_EVERY_MS: u64 = 1_000;

#[derive(Debug, Clone, Copy)]
struct Entry {
    worker: WorkerDp,
    /// On the caller's clock.
    expires_ms: u64,
    bound_at_ms: u64,
    router_id: u64,
    /// When it was last announced (by this router or another), on the caller's clock.
    announced_ms: u64,
}

impl Entry {
    fn stamp(&self) -> (u64, u64) {
        (self.bound_at_ms, self.router_id)
    }

    fn binding(&self, session: &str) -> SessionBinding {
        SessionBinding {
            session: session.to_owned(),
            worker: self.worker,
            bound_at_ms: self.bound_at_ms,
            router_id: self.router_id,
        }
    }
}

/// What [`Sessions::apply`] did with another replica's binding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// Taken: the session had no live binding here, or an earlier one.
    Taken,
    /// The binding held here, announced again: its life is extended.
    Refreshed,
    /// Ignored: the binding held here is later.
    Older,
    /// Ignored: a new session, and the table is full.
    Full,
    /// Ignored: an empty session name or one over [`MAX_SESSION_LEN`].
    Invalid,
}

/// The session table of one router (see the [module docs](self)).
#[derive(Debug)]
pub struct Sessions {
    map: HashMap<String, Entry>,
    ttl_ms: u64,
    max: usize,
    router_id: u64,
    /// A full table is not swept again before this.
    next_sweep_ms: u64,
}

impl Sessions {
    /// An empty table: bindings live `ttl_ms`, at most `max` at once, made by `router_id`.
    pub fn new(ttl_ms: u64, max: usize, router_id: u64) -> Self {
        Sessions {
            map: HashMap::new(),
            ttl_ms,
            max,
            router_id,
            next_sweep_ms: 0,
        }
    }

    /// Bindings held (expired ones too, until a sweep drops them).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The worker `session` is bound to, if its binding is live.
    pub fn get(&self, session: &str, now_ms: u64) -> Option<WorkerDp> {
        self.map
            .get(session)
            .filter(|e| e.expires_ms > now_ms)
            .map(|e| e.worker)
    }

    /// Binds `session` to `worker` for the TTL from `now_ms` (a request of it was just
    /// routed there), and returns what the other replicas should hear, if anything.
    pub fn bind(
        &mut self,
        session: &str,
        worker: WorkerDp,
        now_ms: u64,
        wall_ms: u64,
    ) -> Option<SessionBinding> {
        if session.is_empty() || session.len() > MAX_SESSION_LEN {
            return None;
        }
        let expires_ms = now_ms.saturating_add(self.ttl_ms);
        if let Some(e) = self.map.get_mut(session) {
            if e.expires_ms > now_ms && e.worker == worker {
                e.expires_ms = expires_ms;
                if now_ms.saturating_sub(e.announced_ms) < self.ttl_ms / 2 {
                    return None;
                }
            } else {
                *e = Entry {
                    worker,
                    expires_ms,
                    bound_at_ms: wall_ms.max(e.bound_at_ms.saturating_add(1)),
                    router_id: self.router_id,
                    announced_ms: now_ms,
                };
            }
            e.announced_ms = now_ms;
            return Some(e.binding(session));
        }
        if !self.make_room(now_ms) {
            return None;
        }
        let e = Entry {
            worker,
            expires_ms,
            bound_at_ms: wall_ms,
            router_id: self.router_id,
            announced_ms: now_ms,
        };
        self.map.insert(session.to_owned(), e);
        Some(e.binding(session))
    }

    /// Applies another replica's binding (see the [module docs](self) for the rule).
    pub fn apply(&mut self, b: SessionBinding, now_ms: u64) -> Applied {
        if b.session.is_empty() || b.session.len() > MAX_SESSION_LEN {
            return Applied::Invalid;
        }
        let expires_ms = now_ms.saturating_add(self.ttl_ms);
        let taken = Entry {
            worker: b.worker,
            expires_ms,
            bound_at_ms: b.bound_at_ms,
            router_id: b.router_id,
            announced_ms: now_ms,
        };
        if let Some(e) = self.map.get_mut(b.session.as_str()) {
            let live = e.expires_ms > now_ms;
            let (theirs, ours) = (taken.stamp(), e.stamp());
            if live && theirs < ours {
                return Applied::Older;
            }
            if live && theirs == ours {
                e.expires_ms = e.expires_ms.max(expires_ms);
                e.announced_ms = now_ms;
                return Applied::Refreshed;
            }
            *e = taken;
            return Applied::Taken;
        }
        if !self.make_room(now_ms) {
            return Applied::Full;
        }
        self.map.insert(b.session, taken);
        Applied::Taken
    }

    /// Drops the expired bindings; returns how many.
    pub fn sweep(&mut self, now_ms: u64) -> usize {
        let before = self.map.len();
        self.map.retain(|_, e| e.expires_ms > now_ms);
        before - self.map.len()
    }

    /// Whether a new session fits, after a sweep if the table is full and none ran in the
    /// last second.
    fn make_room(&mut self, now_ms: u64) -> bool {
        if self.map.len() < self.max {
            return true;
        }
        if now_ms >= self.next_sweep_ms {
            self.next_sweep_ms = now_ms.saturating_add(SWEEP_EVERY_MS);
            self.sweep(now_ms);
        }
        self.map.len() < self.max
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const TTL: u64 = 10_000;
    const W1: WorkerDp = WorkerDp::new(1, 0);
    const W2: WorkerDp = WorkerDp::new(2, 0);

    fn theirs(session: &str, worker: WorkerDp, bound_at_ms: u64, router_id: u64) -> SessionBinding {
        SessionBinding {
            session: session.into(),
            worker,
            bound_at_ms,
            router_id,
        }
    }

    #[test]
    fn a_binding_lives_its_ttl_after_the_last_request() {
        let mut s = Sessions::new(TTL, 10, 1);
        assert!(s.bind("a", W1, 0, 500).is_some());
        assert_eq!(s.get("a", 9_999), Some(W1));
        assert_eq!(s.get("a", 10_000), None);
        // A request at 4 s keeps it to 14 s.
        assert!(s.bind("a", W1, 4_000, 4_500).is_none());
        assert_eq!(s.get("a", 13_999), Some(W1));
        assert_eq!(s.get("a", 14_000), None);
        assert!(s.bind("", W1, 0, 0).is_none());
        assert!(s.bind(&"x".repeat(MAX_SESSION_LEN + 1), W1, 0, 0).is_none());
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn announced_when_made_moved_or_half_its_ttl_old() {
        let mut s = Sessions::new(TTL, 10, 1);
        let b = s.bind("a", W1, 0, 1_000).unwrap();
        assert_eq!(b, theirs("a", W1, 1_000, 1));
        // Kept: not again before half the TTL.
        assert!(s.bind("a", W1, 4_999, 5_999).is_none());
        // Kept past half the TTL: announced again with its own stamp.
        assert_eq!(s.bind("a", W1, 5_000, 6_000), Some(b.clone()));
        assert!(s.bind("a", W1, 6_000, 7_000).is_none());
        // Moved: a new stamp, after the old one even if this clock is behind.
        let moved = s.bind("a", W2, 7_000, 10).unwrap();
        assert_eq!(moved, theirs("a", W2, 1_001, 1));
        // Expired, then bound again to the same worker: a new binding.
        let again = s.bind("a", W2, 30_000, 31_000).unwrap();
        assert_eq!(again, theirs("a", W2, 31_000, 1));
    }

    #[test]
    fn the_latest_stamp_wins_in_any_order() {
        // Router 1 binds to W1 at wall 100, router 2 to W2 at wall 100 too: router 2's
        // id breaks the tie, on both, whichever heard of the other first.
        let mut r1 = Sessions::new(TTL, 10, 1);
        let mut r2 = Sessions::new(TTL, 10, 2);
        let b1 = r1.bind("a", W1, 0, 100).unwrap();
        let b2 = r2.bind("a", W2, 0, 100).unwrap();
        assert_eq!(r1.apply(b2.clone(), 1), Applied::Taken);
        assert_eq!(r2.apply(b1.clone(), 1), Applied::Older);
        assert_eq!((r1.get("a", 2), r2.get("a", 2)), (Some(W2), Some(W2)));
        // The same binding announced again: its life is extended, nothing else.
        assert_eq!(r1.apply(b2.clone(), 9_000), Applied::Refreshed);
        assert_eq!(r1.get("a", 18_000), Some(W2));
        // Heard of from router 2 at 9 s: router 1 does not announce it again before 14 s.
        assert!(r1.bind("a", W2, 13_999, 0).is_none());
        assert_eq!(r1.bind("a", W2, 14_000, 0), Some(b2));
        // An old announcement of an expired binding is taken: nothing later is live.
        assert_eq!(r2.apply(b1, 100_000), Applied::Taken);
        assert_eq!(r2.get("a", 100_000), Some(W1));
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// Replica `r` routes a request of session `s` to worker `w`, its wall clock at
        /// `wall` (clocks differ between replicas and may step back).
        Bind { r: usize, s: u8, w: u64, wall: u64 },
        /// Replica `r` receives the pending announcement at `pick` (any order).
        Deliver { r: usize, pick: usize },
    }

    fn op(replicas: usize) -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..replicas, 0..3u8, 1..4u64, 0..50u64).prop_map(|(r, s, w, wall)| Op::Bind {
                r,
                s,
                w,
                wall
            }),
            (0..replicas, any::<usize>()).prop_map(|(r, pick)| Op::Deliver { r, pick }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        /// Whatever the interleaving of bindings and the order announcements arrive in,
        /// once all have arrived every replica holds, for each session, the announced
        /// binding with the latest stamp.
        #[test]
        fn replicas_agree_once_every_announcement_arrived(
            replicas in 2..5usize,
            ops in proptest::collection::vec(op(4), 1..60),
            order in any::<u64>(),
        ) {
            let mut tables: Vec<Sessions> =
                (0..replicas).map(|r| Sessions::new(u64::MAX / 4, 100, r as u64 + 1)).collect();
            // Each replica's inbox: announcements from the others, not yet applied.
            let mut inbox: Vec<Vec<SessionBinding>> = vec![Vec::new(); replicas];
            let mut announced: Vec<SessionBinding> = Vec::new();
            for (now, op) in ops.iter().enumerate() {
                let now = now as u64;
                match *op {
                    Op::Bind { r, s, w, wall } => {
                        let r = r % replicas;
                        let name = format!("s{s}");
                        if let Some(b) = tables[r].bind(&name, WorkerDp::new(w, 0), now, wall) {
                            for (o, q) in inbox.iter_mut().enumerate() {
                                if o != r {
                                    q.push(b.clone());
                                }
                            }
                            announced.push(b);
                        }
                    }
                    Op::Deliver { r, pick } => {
                        let q = &mut inbox[r % replicas];
                        if !q.is_empty() {
                            let b = q.remove(pick % q.len());
                            tables[r % replicas].apply(b, now);
                        }
                    }
                }
            }
            // The rest arrive, in an order of their own.
            let now = ops.len() as u64;
            let mut rng = order | 1;
            for (r, q) in inbox.iter_mut().enumerate() {
                while !q.is_empty() {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    let b = q.remove(rng as usize % q.len());
                    tables[r].apply(b, now);
                }
            }
            for s in 0..3u8 {
                let name = format!("s{s}");
                let latest = announced
                    .iter()
                    .filter(|b| b.session == name)
                    .max_by_key(|b| (b.bound_at_ms, b.router_id));
                for t in &tables {
                    prop_assert_eq!(t.get(&name, now), latest.map(|b| b.worker));
                }
            }
        }
    }

    #[test]
    fn a_full_table_takes_new_sessions_once_some_expire() {
        let mut s = Sessions::new(TTL, 2, 1);
        assert!(s.bind("a", W1, 0, 0).is_some());
        assert!(s.bind("b", W1, 5_000, 0).is_some());
        assert!(s.bind("c", W1, 6_000, 0).is_none());
        assert_eq!(s.apply(theirs("c", W2, 0, 2), 6_000), Applied::Full);
        // "a" expired at 10 s, but the last sweep (at 6 s) allows the next at 7 s only.
        assert_eq!(s.apply(theirs("c", W2, 0, 2), 10_500), Applied::Taken);
        assert_eq!(s.len(), 2);
        assert_eq!(
            (s.get("b", 10_500), s.get("c", 10_500)),
            (Some(W1), Some(W2))
        );
        assert_eq!(s.apply(theirs("", W2, 0, 2), 0), Applied::Invalid);
        assert_eq!(s.sweep(20_500), 2);
        assert!(s.is_empty());
    }
}
