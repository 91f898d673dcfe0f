//! The source core's program: the state every event source shares ([`Hub`]) and the loop
//! that runs them.
//!
//! The hub starts each configured source as tasks of this one executor — the NATS source
//! ([`super::nats_source`]), one task per vLLM-native ZMQ publisher
//! ([`super::zmq_source`]), Dynamo's ZMQ event plane with its file discovery
//! ([`super::dynamo_plane`]) — then every 100 ms removes the workers no plane has heard from
//! within their limit, and serves the shard cores' and the facade's commands (recoveries go
//! to the NATS source, the only plane whose workers answer them; snapshots to the
//! [`Snapshotter`]).

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvrouter_core::codec::{Envelope, kv, metrics};
use kvrouter_core::worker::WorkerDp;

use super::IngestError;
use super::config::IngestConfig;
use super::counters::{AllCounters, IngestStats};
use super::durable::Durable;
use super::messages::{Recovered, ShardCmd, SourceCmd};
use super::nats_source::NatsSource;
use super::snapshots::{SnapshotError, SnapshotInfo, Snapshotter};
use super::source::{Shards, Workers};

/// What every source on the source core shares.
#[derive(Debug)]
pub(super) struct Hub {
    pub(super) cfg: IngestConfig,
    pub(super) shards: Shards,
    pub(super) workers: Workers,
    /// The source core's counters (plain, published after each change: see
    /// [`super::counters`]).
    stats: RefCell<IngestStats>,
    counters: Arc<AllCounters>,
    pub(super) ready: Arc<AtomicBool>,
    snapshots: Snapshotter,
    /// The NATS source's durable mode (the stream position snapshots record).
    pub(super) durable: Durable,
}

impl Hub {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        cfg: IngestConfig,
        shards: Shards,
        workers: Workers,
        counters: Arc<AllCounters>,
        ready: Arc<AtomicBool>,
        snapshots: Snapshotter,
        stream_seq: u64,
    ) -> Self {
        Self {
            cfg,
            shards,
            workers,
            stats: RefCell::new(IngestStats::default()),
            counters,
            ready,
            snapshots,
            durable: Durable::new(stream_seq),
        }
    }

    /// Counts (and publishes: the source core's counters are its own block).
    pub(super) fn bump(&self, f: impl FnOnce(&mut IngestStats)) {
        let mut s = self.stats.borrow_mut();
        f(&mut s);
        self.counters.core(0).publish(&s);
    }

    /// Makes (worker, dp rank)s routable now, with no blocks until their events come.
    pub(super) async fn register(&self, workers: Vec<WorkerDp>) {
        let mut by_worker: Vec<(u64, Vec<WorkerDp>)> = Vec::new();
        for w in workers {
            match by_worker.iter_mut().find(|(id, _)| *id == w.worker_id) {
                Some((_, v)) => v.push(w),
                None => by_worker.push((w.worker_id, vec![w])),
            }
        }
        for (worker_id, workers) in by_worker {
            let _ = self
                .shards
                .to_worker(worker_id, ShardCmd::Register { workers })
                .await;
        }
    }

    /// One kv-events message in Dynamo's envelope (a NATS message, or the frame of Dynamo's
    /// ZMQ plane): decoded leniently, so that a malformed event is counted and skipped and
    /// the rest of its message applies, then handed to the shards.
    pub(super) async fn kv_events(&self, payload: &[u8], arrived: Instant) {
        let (publisher, events) = match kv::decode_message_lenient(payload) {
            Ok((env, decoded)) => {
                if decoded.bad > 0 {
                    self.bump(|s| s.malformed_events += decoded.bad as u64);
                    if let Some(e) = &decoded.first_error {
                        crate::warn_throttled!(error = %e, bad = decoded.bad, "malformed events skipped; the rest of their message applied");
                    }
                }
                (env.publisher_id, decoded.events)
            }
            Err(e) => {
                self.bump(|s| {
                    s.messages += 1;
                    s.decode_errors += 1;
                });
                crate::warn_throttled!(error = %e, kind = e.kind(), "undecodable kv-events message skipped");
                return;
            }
        };
        self.bump(|s| s.messages += 1);
        for e in &events {
            self.workers.seen(e.worker_id, None, arrived);
        }
        self.shards.events(events, publisher, arrived).await;
    }

    /// One metrics message (`kv_metrics`, `forward-pass-metrics`): a heartbeat of its
    /// worker, which is routable from the first one, before its first KV event.
    pub(super) async fn heartbeat(&self, payload: &[u8], arrived: Instant) {
        match Envelope::decode(payload).and_then(|env| metrics::heartbeat_worker(&env)) {
            Ok(Some(w)) => {
                self.workers.seen(w.worker_id, None, arrived);
                if self.workers.first_sight(w) {
                    self.register(vec![w]).await;
                }
            }
            Ok(None) => {}
            Err(e) => {
                self.bump(|s| s.decode_errors += 1);
                crate::warn_throttled!(error = %e, "undecodable metrics message skipped");
            }
        }
    }

    /// A snapshot now, counted.
    pub(super) async fn take_snapshot(&self) -> Result<SnapshotInfo, SnapshotError> {
        let result = self
            .snapshots
            .take(&self.shards, self.durable.dispatched_seq.get())
            .await;
        match &result {
            Ok(_) => self.bump(|s| s.snapshots += 1),
            Err(_) => self.bump(|s| s.snapshot_failures += 1),
        }
        result
    }

    /// Starts every source and serves commands until [`SourceCmd::Stop`]; `started` hears
    /// once the sources are up (NATS subscriptions active) or why not.
    pub(super) async fn run(
        self,
        cmds: flume::Receiver<SourceCmd>,
        started: std::sync::mpsc::Sender<Result<(), IngestError>>,
    ) {
        let hub = Rc::new(self);
        // The NATS source, once it has started (maybe after this core began serving).
        let nats: Rc<RefCell<Option<Rc<NatsSource>>>> = Rc::default();
        match hub.cfg.nats.clone() {
            Some(opts) => {
                let (first_tx, first_rx) = flume::bounded(1);
                let (h, cell) = (Rc::clone(&hub), Rc::clone(&nats));
                glommio::spawn_local(async move {
                    match NatsSource::start(h, opts).await {
                        Ok(n) => {
                            *cell.borrow_mut() = Some(n);
                            let _ = first_tx.try_send(Ok(()));
                        }
                        Err(e) => {
                            tracing::error!(error = %crate::Chain(&e), "the NATS plane could not start");
                            let _ = first_tx.try_send(Err(e));
                        }
                    }
                })
                .detach();
                let wait = hub.cfg.nats_start_wait;
                let first = async { first_rx.recv_async().await.ok() };
                let waited = async {
                    glommio::timer::sleep(wait).await;
                    None
                };
                match futures_lite::future::or(first, waited).await {
                    Some(Ok(())) => {}
                    Some(Err(e)) => {
                        let _ = started.send(Err(e));
                        return;
                    }
                    None => tracing::warn!(
                        waited_ms = wait.as_millis() as u64,
                        "NATS not reachable yet: serving from the current state, not ready, still connecting"
                    ),
                }
            }
            None => hub.ready.store(true, Ordering::Release),
        }
        let zmq = super::zmq_source::start(&hub).await;
        let plane = hub
            .cfg
            .dynamo_discovery
            .clone()
            .map(|d| super::dynamo_plane::start(&hub, d));
        let _ = started.send(Ok(()));
        let (h, n) = (Rc::clone(&hub), Rc::clone(&nats));
        let ticks = glommio::spawn_local(async move {
            loop {
                glommio::timer::sleep(Duration::from_millis(100)).await;
                h.reap().await;
                let source = n.borrow().clone();
                if let Some(n) = source {
                    n.tick();
                }
            }
        });
        let snapshots = hub
            .cfg
            .snapshot
            .as_ref()
            .and_then(|s| s.interval)
            .map(|every| {
                let h = Rc::clone(&hub);
                glommio::spawn_local(async move {
                    loop {
                        glommio::timer::sleep(every).await;
                        let _ = h.take_snapshot().await;
                    }
                })
            });
        while let Ok(cmd) = cmds.recv_async().await {
            match cmd {
                SourceCmd::Recover {
                    shard,
                    worker_id,
                    dp_rank,
                    range,
                } => {
                    let source = nats.borrow().clone();
                    match source {
                        Some(n) => n.recover_into(shard, worker_id, dp_rank, range),
                        None => {
                            let result = Recovered::Failed("no NATS plane to ask".into());
                            let cmd = ShardCmd::Recovered { worker_id, result };
                            let _ = hub.shards.send(shard, cmd).await;
                        }
                    }
                }
                SourceCmd::Snapshot { reply } => {
                    let h = Rc::clone(&hub);
                    glommio::spawn_local(async move {
                        let _ = reply.send_async(h.take_snapshot().await).await;
                    })
                    .detach();
                }
                SourceCmd::Stop => break,
            }
        }
        drop((ticks, snapshots, zmq, plane));
        let source = nats.borrow_mut().take();
        if let Some(n) = source {
            // Acknowledge what was applied before leaving.
            n.stop().await;
        }
    }

    /// Removes the workers no plane heard from within their limit.
    async fn reap(&self) {
        for w in self.workers.take_dead(Instant::now()) {
            tracing::info!(worker_id = w, "worker silent: removing it");
            let _ = self
                .shards
                .to_worker(w, ShardCmd::Remove { worker_id: w })
                .await;
        }
    }
}
