//! The seam between event sources and the shard cores.
//!
//! An event source is a set of tasks on the **source core** that read one event plane
//! (NATS today: [`super::nats_source`]; the ZMQ planes plug in beside it), decode what
//! arrives and hand each worker's events to the shard core that owns the worker. Every
//! source gets the same two things:
//!
//! * [`Shards`]: the way to the shard cores. Events go to the worker's shard (its
//!   [`ShardMap`]: round-robin by arrival, sticky) over a bounded channel, in the order the
//!   source hands them over, which is what per-worker order needs;
//! * [`Workers`]: who is alive, by when each worker was last heard from on any plane, and
//!   whether it announced a heartbeat interval. A worker heard from on no plane for its
//!   limit is removed from the index (and so, through the ingest's membership, from
//!   routing).
//!
//! Both are owned by the source core (`Rc`, no locks); the shard cores know nothing of
//! where their commands come from.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvrouter_core::event::RouterEvent;
use kvrouter_core::index::tree::ShardMap;
use kvrouter_core::worker::{WorkerDp, WorkerId};

use super::messages::{ShardCmd, ShardPart};

/// The shard cores, as a source sees them.
#[derive(Debug, Clone)]
pub(super) struct Shards {
    tx: Vec<flume::Sender<ShardCmd>>,
    map: Arc<ShardMap>,
}

/// A shard core has stopped (the ingest is stopping).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a shard core has stopped")]
pub(super) struct ShardStopped;

impl Shards {
    pub(super) fn new(tx: Vec<flume::Sender<ShardCmd>>, map: Arc<ShardMap>) -> Self {
        Self { tx, map }
    }

    /// The shard that owns `worker_id` (assigned on first sight).
    pub(super) fn of(&self, worker_id: WorkerId) -> usize {
        self.map.shard_of(worker_id)
    }

    /// Sends a command to one shard.
    pub(super) async fn send(&self, shard: usize, cmd: ShardCmd) -> Result<(), ShardStopped> {
        self.tx[shard]
            .send_async(cmd)
            .await
            .map_err(|_| ShardStopped)
    }

    /// Sends a command about `worker_id` to its shard.
    pub(super) async fn to_worker(
        &self,
        worker_id: WorkerId,
        cmd: ShardCmd,
    ) -> Result<(), ShardStopped> {
        self.send(self.of(worker_id), cmd).await
    }

    /// Hands one message's events to their workers' shards, in order, each shard's share in
    /// one command.
    pub(super) async fn events(&self, events: Vec<RouterEvent>, publisher: u64, arrived: Instant) {
        if self.tx.len() == 1 {
            if !events.is_empty() {
                let _ = self
                    .send(
                        0,
                        ShardCmd::Events {
                            events,
                            publisher,
                            arrived,
                        },
                    )
                    .await;
            }
            return;
        }
        let mut per_shard: Vec<Vec<RouterEvent>> = vec![Vec::new(); self.tx.len()];
        for e in events {
            per_shard[self.of(e.worker_id)].push(e);
        }
        for (i, events) in per_shard.into_iter().enumerate() {
            if !events.is_empty() {
                let _ = self
                    .send(
                        i,
                        ShardCmd::Events {
                            events,
                            publisher,
                            arrived,
                        },
                    )
                    .await;
            }
        }
    }

    /// Waits until every shard has carried out everything sent to it before.
    pub(super) async fn barrier(&self) {
        let (tx, rx) = flume::bounded(self.tx.len());
        for s in &self.tx {
            let _ = s.send_async(ShardCmd::Barrier { reply: tx.clone() }).await;
        }
        drop(tx);
        while rx.recv_async().await.is_ok() {}
    }

    /// Every shard's share of a snapshot (each cut between two of its events).
    pub(super) async fn snapshot(&self) -> Result<Vec<ShardPart>, ShardStopped> {
        let (tx, rx) = flume::bounded(self.tx.len());
        for s in &self.tx {
            s.send_async(ShardCmd::Snapshot { reply: tx.clone() })
                .await
                .map_err(|_| ShardStopped)?;
        }
        drop(tx);
        let mut parts = Vec::with_capacity(self.tx.len());
        for _ in 0..self.tx.len() {
            parts.push(rx.recv_async().await.map_err(|_| ShardStopped)?);
        }
        Ok(parts)
    }
}

/// When a worker was last heard from.
#[derive(Debug, Clone, Copy)]
pub(super) struct Liveness {
    pub(super) last_seen: Instant,
    /// Heartbeat interval of an announced worker.
    pub(super) heartbeat: Option<Duration>,
}

/// Who is alive, as far as the sources know.
#[derive(Debug)]
pub(super) struct Workers {
    live: RefCell<HashMap<WorkerId, Liveness>>,
    /// Workers whose liveness another signal vouches for (discovery lists them, or their
    /// ZMQ connection is up): never removed for silence.
    pinned: RefCell<HashMap<WorkerId, u32>>,
    /// (Worker, dp rank)s already registered with their shard (so that a heartbeat
    /// registers a worker once).
    registered: RefCell<std::collections::HashSet<WorkerDp>>,
    /// Limit of a worker that never announced a heartbeat interval.
    silence_timeout: Duration,
    /// An announced worker's limit, in heartbeats.
    heartbeat_misses: u32,
}

impl Workers {
    pub(super) fn new(
        restored: HashMap<WorkerId, Liveness>,
        silence_timeout: Duration,
        heartbeat_misses: u32,
    ) -> Self {
        Self {
            live: RefCell::new(restored),
            pinned: RefCell::default(),
            registered: RefCell::default(),
            silence_timeout,
            heartbeat_misses,
        }
    }

    /// `worker_id` was heard from at `now` (with its heartbeat interval, if it announced
    /// one).
    pub(super) fn seen(&self, worker_id: WorkerId, heartbeat: Option<Duration>, now: Instant) {
        let mut w = self.live.borrow_mut();
        let entry = w.entry(worker_id).or_insert(Liveness {
            last_seen: now,
            heartbeat,
        });
        entry.last_seen = now;
        if heartbeat.is_some() {
            entry.heartbeat = heartbeat;
        }
    }

    /// Whether `worker_id` announced a heartbeat interval.
    pub(super) fn is_announced(&self, worker_id: WorkerId) -> bool {
        self.live
            .borrow()
            .get(&worker_id)
            .is_some_and(|l| l.heartbeat.is_some())
    }

    /// Forgets a worker (it said it is leaving, or it was removed).
    pub(super) fn forget(&self, worker_id: WorkerId) {
        self.live.borrow_mut().remove(&worker_id);
        self.registered
            .borrow_mut()
            .retain(|w| w.worker_id != worker_id);
    }

    /// Whether `w` is seen for the first time since it was registered or removed (the
    /// caller registers it with its shard when so).
    pub(super) fn first_sight(&self, w: WorkerDp) -> bool {
        self.registered.borrow_mut().insert(w)
    }

    /// One more signal vouches for `worker_id`'s liveness.
    pub(super) fn pin(&self, worker_id: WorkerId, now: Instant) {
        *self.pinned.borrow_mut().entry(worker_id).or_insert(0) += 1;
        self.seen(worker_id, None, now);
    }

    /// One signal fewer vouches for it; with none, silence removes it again (counted from
    /// now).
    pub(super) fn unpin(&self, worker_id: WorkerId, now: Instant) {
        let mut p = self.pinned.borrow_mut();
        if let Some(n) = p.get_mut(&worker_id) {
            *n -= 1;
            if *n == 0 {
                p.remove(&worker_id);
            }
        }
        drop(p);
        self.seen(worker_id, None, now);
    }

    /// The workers past their limit at `now`, forgotten here (the caller removes them).
    pub(super) fn take_dead(&self, now: Instant) -> Vec<WorkerId> {
        let mut live = self.live.borrow_mut();
        let pinned = self.pinned.borrow();
        let dead: Vec<WorkerId> = live
            .iter()
            .filter(|(w, _)| !pinned.contains_key(w))
            .filter(|(_, l)| {
                let limit = l
                    .heartbeat
                    .map_or(self.silence_timeout, |h| h * self.heartbeat_misses);
                now.duration_since(l.last_seen) > limit
            })
            .map(|(&w, _)| w)
            .collect();
        for w in &dead {
            live.remove(w);
        }
        drop((live, pinned));
        let mut registered = self.registered.borrow_mut();
        registered.retain(|w| !dead.contains(&w.worker_id));
        dead
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silent_workers_die_by_their_own_limit() {
        let t0 = Instant::now();
        let w = Workers::new(HashMap::new(), Duration::from_secs(60), 3);
        w.seen(1, None, t0);
        w.seen(2, Some(Duration::from_secs(1)), t0);
        assert!(w.is_announced(2) && !w.is_announced(1));
        assert!(w.take_dead(t0 + Duration::from_secs(2)).is_empty());
        // The announced worker missed three heartbeats; the other has a minute.
        assert_eq!(w.take_dead(t0 + Duration::from_secs(4)), [2]);
        w.seen(1, None, t0 + Duration::from_secs(30));
        assert!(w.take_dead(t0 + Duration::from_secs(80)).is_empty());
        assert_eq!(w.take_dead(t0 + Duration::from_secs(91)), [1]);
        assert!(w.take_dead(t0 + Duration::from_secs(200)).is_empty());
        // A pinned worker is never silent; unpinned, its limit counts from then.
        w.pin(3, t0);
        w.pin(3, t0);
        assert!(w.take_dead(t0 + Duration::from_secs(500)).is_empty());
        w.unpin(3, t0 + Duration::from_secs(500));
        assert!(w.take_dead(t0 + Duration::from_secs(600)).is_empty());
        w.unpin(3, t0 + Duration::from_secs(600));
        assert!(w.take_dead(t0 + Duration::from_secs(650)).is_empty());
        assert_eq!(w.take_dead(t0 + Duration::from_secs(661)), [3]);
        let x = WorkerDp::new(4, 0);
        assert!(w.first_sight(x) && !w.first_sight(x));
        w.forget(4);
        assert!(w.first_sight(x));
    }
}
