//! The NATS source: the event source for Dynamo's NATS event plane, on the source core.
//!
//! It runs the [`Client`], subscribes to the kv-events, metrics and discovery subjects,
//! decodes every message (bad ones are counted, logged and skipped), keeps the workers'
//! liveness ([`Workers`]), answers the shard cores' recovery requests by asking the
//! workers' local indexers, and hands each worker's events to its shard ([`Shards`]) in
//! arrival order. In durable mode the events come from a JetStream consumer instead
//! ([`super::durable`]). It also runs the snapshot timer and requests ([`Snapshotter`]).

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvrouter_core::codec::{self, Envelope, kv, metrics};
use kvrouter_core::recovery::{Announcement, RecoveryReply, RecoveryRequest};
use kvrouter_core::worker::{DpRank, WorkerId};

use super::IngestError;
use super::config::IngestConfig;
use super::counters::{AllCounters, IngestStats};
use super::durable::Durable;
use super::messages::{Recovered, ShardCmd, SourceCmd};
use super::snapshots::{SnapshotError, SnapshotInfo, Snapshotter};
use super::source::{Shards, Workers};
use crate::nats::{Client, Subscription};
use crate::worker::TOPIC_WORKERS;

/// The NATS source's state (owned by the source core; its tasks share it through `Rc`).
#[derive(Debug)]
pub(super) struct NatsSource {
    pub(super) cfg: IngestConfig,
    pub(super) shards: Shards,
    pub(super) workers: Workers,
    /// The source core's counters (plain, published after each message: see
    /// [`super::counters`]).
    stats: RefCell<IngestStats>,
    counters: Arc<AllCounters>,
    ready: Arc<AtomicBool>,
    snapshots: Snapshotter,
    pub(super) durable: Durable,
}

/// The subscriptions of a running source.
struct Subscriptions {
    /// `None` in durable mode: events come through the consumer.
    events: Option<Subscription>,
    kv_metrics: Subscription,
    forward_pass_metrics: Subscription,
    discovery: Subscription,
}

impl NatsSource {
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

    /// Connects, subscribes and runs until a [`SourceCmd::Stop`]; `started` hears once
    /// the subscriptions are active (or why not).
    pub(super) async fn run(
        self,
        cmds: flume::Receiver<SourceCmd>,
        started: std::sync::mpsc::Sender<Result<(), IngestError>>,
    ) {
        let (client, subs) = match self.connect().await {
            Ok(c) => c,
            Err(e) => {
                let _ = started.send(Err(e));
                return;
            }
        };
        // Durable mode is ready once its consumer exists (see the liveness task).
        self.ready
            .store(self.cfg.durable.is_none(), Ordering::Release);
        let _ = started.send(Ok(()));
        let me = Rc::new(self);
        let events = Self::spawn_tasks(&me, &client, subs);
        me.serve_commands(&client, cmds).await;
        // Acknowledge what was applied before leaving.
        me.ack_applied(&client).await;
        drop(events);
        client.close();
    }

    async fn connect(&self) -> Result<(Client, Subscriptions), IngestError> {
        let client = Client::connect(self.cfg.nats.clone()).await?;
        let subject = |topic| self.cfg.subjects.subject(topic);
        let subs = Subscriptions {
            events: (self.cfg.durable.is_none())
                .then(|| client.subscribe(&self.cfg.subjects.kv_events(), None))
                .transpose()?,
            kv_metrics: client.subscribe(&subject(codec::TOPIC_KV_METRICS), None)?,
            forward_pass_metrics: client
                .subscribe(&subject(codec::TOPIC_FORWARD_PASS_METRICS), None)?,
            discovery: client.subscribe(&subject(TOPIC_WORKERS), None)?,
        };
        client.flush(Duration::from_secs(5)).await?;
        self.bind_stream(&client)
            .await
            .map_err(IngestError::JetStream)?;
        Ok((client, subs))
    }

    /// Starts the source's tasks; returns the events task (dropped to stop it).
    fn spawn_tasks(me: &Rc<Self>, client: &Client, subs: Subscriptions) -> glommio::Task<()> {
        let (m, c) = (Rc::clone(me), client.clone());
        let events = glommio::spawn_local(async move {
            match subs.events {
                Some(sub) => {
                    while let Some(msg) = sub.next().await {
                        m.on_events(&msg.payload).await;
                    }
                }
                None => m.consume_durable(&c).await,
            }
        });
        if let Some(d) = me.cfg.durable.clone() {
            let (m, c) = (Rc::clone(me), client.clone());
            glommio::spawn_local(async move {
                loop {
                    glommio::timer::sleep(d.ack_interval).await;
                    m.ack_applied(&c).await;
                }
            })
            .detach();
        }
        if let Some(every) = me.cfg.snapshot.as_ref().and_then(|s| s.interval) {
            let m = Rc::clone(me);
            glommio::spawn_local(async move {
                loop {
                    glommio::timer::sleep(every).await;
                    let _ = m.take_snapshot().await;
                }
            })
            .detach();
        }
        for sub in [subs.kv_metrics, subs.forward_pass_metrics] {
            let m = Rc::clone(me);
            glommio::spawn_local(async move { m.heartbeats(sub).await }).detach();
        }
        let m = Rc::clone(me);
        let discovery = subs.discovery;
        glommio::spawn_local(async move {
            while let Some(msg) = discovery.next().await {
                match serde_json::from_slice::<Announcement>(&msg.payload) {
                    Ok(a) => m.on_announcement(a).await,
                    Err(e) => {
                        m.bump(|s| s.decode_errors += 1);
                        tracing::warn!(error = %e, "malformed worker announcement");
                    }
                }
            }
        })
        .detach();
        let (m, c) = (Rc::clone(me), client.clone());
        glommio::spawn_local(async move { m.liveness(&c).await }).detach();
        events
    }

    /// Recovery and snapshot requests, until [`SourceCmd::Stop`].
    async fn serve_commands(self: &Rc<Self>, client: &Client, cmds: flume::Receiver<SourceCmd>) {
        while let Ok(cmd) = cmds.recv_async().await {
            match cmd {
                SourceCmd::Recover {
                    shard,
                    worker_id,
                    dp_rank,
                    range,
                } => {
                    let (m, c) = (Rc::clone(self), client.clone());
                    glommio::spawn_local(async move {
                        let result = m.recover(&c, worker_id, dp_rank, range).await;
                        let cmd = ShardCmd::Recovered { worker_id, result };
                        let _ = m.shards.send(shard, cmd).await;
                    })
                    .detach();
                }
                SourceCmd::Snapshot { reply } => {
                    let m = Rc::clone(self);
                    glommio::spawn_local(async move {
                        let _ = reply.send_async(m.take_snapshot().await).await;
                    })
                    .detach();
                }
                SourceCmd::Stop => break,
            }
        }
    }

    /// Metrics messages: heartbeats only.
    async fn heartbeats(&self, sub: Subscription) {
        while let Some(msg) = sub.next().await {
            match Envelope::decode(&msg.payload).and_then(|env| metrics::heartbeat_worker(&env)) {
                Ok(Some(w)) => self.workers.seen(w.worker_id, None, Instant::now()),
                Ok(None) => {}
                Err(e) => {
                    self.bump(|s| s.decode_errors += 1);
                    tracing::debug!(error = %e, "undecodable metrics message");
                }
            }
        }
    }

    /// Every 100 ms: removes silent workers, copies the client's counters, and says whether
    /// the source is ready.
    async fn liveness(&self, client: &Client) {
        loop {
            glommio::timer::sleep(Duration::from_millis(100)).await;
            for w in self.workers.take_dead(Instant::now()) {
                tracing::info!(worker_id = w, "worker silent: removing it");
                let _ = self
                    .shards
                    .to_worker(w, ShardCmd::Remove { worker_id: w })
                    .await;
            }
            let st = client.stats();
            self.bump(|s| {
                s.nats_dropped = st.dropped;
                s.nats_reconnects = st.reconnects;
            });
            let consuming = self.cfg.durable.is_none() || self.durable.consumer_ready.get();
            self.ready
                .store(client.is_connected() && consuming, Ordering::Release);
        }
    }

    /// A snapshot now, counted.
    async fn take_snapshot(&self) -> Result<SnapshotInfo, SnapshotError> {
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

    /// One kv-events message: decoded and handed to the shards.
    pub(super) async fn on_events(&self, payload: &[u8]) {
        let arrived = Instant::now();
        let (publisher, events) = match kv::decode_message(payload) {
            Ok((env, events)) => (env.publisher_id, events),
            Err(e) => {
                self.bump(|s| {
                    s.messages += 1;
                    s.decode_errors += 1;
                });
                tracing::warn!(error = %e, kind = e.kind(), "undecodable kv-events message skipped");
                return;
            }
        };
        self.bump(|s| s.messages += 1);
        for e in &events {
            self.workers.seen(e.worker_id, None, arrived);
        }
        self.shards.events(events, publisher, arrived).await;
    }

    async fn on_announcement(&self, a: Announcement) {
        if a.leaving {
            self.workers.forget(a.worker_id);
            let cmd = ShardCmd::Remove {
                worker_id: a.worker_id,
            };
            let _ = self.shards.to_worker(a.worker_id, cmd).await;
            return;
        }
        let known = self.workers.is_announced(a.worker_id);
        let heartbeat = Duration::from_millis(a.heartbeat_ms.max(1));
        self.workers
            .seen(a.worker_id, Some(heartbeat), Instant::now());
        let cmd = if !known {
            tracing::info!(
                worker_id = a.worker_id,
                "worker announced: loading its state"
            );
            ShardCmd::Announced {
                worker_id: a.worker_id,
                heartbeat_ms: a.heartbeat_ms.max(1),
            }
        } else if !a.last_event_ids.is_empty() {
            ShardCmd::Heartbeat {
                worker_id: a.worker_id,
                last_event_ids: a.last_event_ids,
            }
        } else {
            return;
        };
        let _ = self.shards.to_worker(a.worker_id, cmd).await;
    }

    async fn recover(
        &self,
        client: &Client,
        worker_id: WorkerId,
        dp_rank: Option<DpRank>,
        range: Option<(u64, u64)>,
    ) -> Recovered {
        let subject = crate::worker::recovery_subject(&self.cfg.subjects, worker_id);
        let req = RecoveryRequest {
            worker_id,
            dp_rank,
            range,
        };
        let body = match req.encode() {
            Ok(b) => b,
            Err(e) => return Recovered::Failed(e.to_string()),
        };
        let stream = match client.request_stream(&subject, &body).await {
            Ok(s) => s,
            Err(e) => return Recovered::Failed(e.to_string()),
        };
        let mut dump_events = Vec::new();
        loop {
            let msg = match stream.next(self.cfg.recovery_timeout).await {
                Ok(m) => m,
                Err(e) => return Recovered::Failed(e.to_string()),
            };
            match RecoveryReply::decode(&msg.payload) {
                Ok(RecoveryReply::Range {
                    publisher_id,
                    events,
                }) => {
                    return Recovered::Range {
                        publisher: publisher_id,
                        events,
                    };
                }
                Ok(RecoveryReply::Dump {
                    publisher_id,
                    last_chunk,
                    last_event_ids,
                    events,
                    ..
                }) => {
                    dump_events.extend(events);
                    if last_chunk {
                        return Recovered::Dump {
                            publisher: publisher_id,
                            events: dump_events,
                            last_event_ids,
                        };
                    }
                }
                Err(e) => {
                    self.bump(|s| s.decode_errors += 1);
                    return Recovered::Failed(e.to_string());
                }
            }
        }
    }
}
