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
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvrouter_core::codec;
use kvrouter_core::recovery::{Announcement, RecoveryReply, RecoveryRequest};
use kvrouter_core::worker::{DpRank, WorkerId};

use super::IngestError;
use super::hub::Hub;
use super::messages::{Recovered, ShardCmd};
use crate::nats::{Client, Options, Subscription};
use crate::worker::TOPIC_WORKERS;

/// The NATS source: its client and tasks, over the source core's [`Hub`].
#[derive(Debug)]
pub(super) struct NatsSource {
    pub(super) hub: Rc<Hub>,
    pub(super) client: Client,
    /// The events task (dropped to stop it).
    events: RefCell<Option<glommio::Task<()>>>,
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
    /// Connects, subscribes and starts the source's tasks; returns once the subscriptions
    /// are active.
    pub(super) async fn start(hub: Rc<Hub>, opts: Options) -> Result<Rc<NatsSource>, IngestError> {
        let (client, subs) = Self::connect(&hub, opts).await?;
        // Durable mode is ready once its consumer exists (see `tick`).
        hub.ready
            .store(hub.cfg.durable.is_none(), Ordering::Release);
        let me = Rc::new(NatsSource {
            hub,
            client,
            events: RefCell::new(None),
        });
        let events = Self::spawn_tasks(&me, subs);
        *me.events.borrow_mut() = Some(events);
        Ok(me)
    }

    /// Acknowledges what was applied (durable mode), stops the tasks, closes the client.
    pub(super) async fn stop(&self) {
        self.ack_applied(&self.client).await;
        drop(self.events.borrow_mut().take());
        self.client.close();
    }

    /// Every 100 ms (the hub's tick): copies the client's counters and says whether the
    /// source is ready.
    pub(super) fn tick(&self) {
        let st = self.client.stats();
        self.hub.bump(|s| {
            s.nats_dropped = st.dropped;
            s.nats_reconnects = st.reconnects;
        });
        let consuming = self.hub.cfg.durable.is_none() || self.hub.durable.consumer_ready.get();
        self.hub
            .ready
            .store(self.client.is_connected() && consuming, Ordering::Release);
    }

    /// Asks a worker's local indexer and hands the answer to `shard`.
    pub(super) fn recover_into(
        self: &Rc<Self>,
        shard: usize,
        worker_id: WorkerId,
        dp_rank: Option<DpRank>,
        range: Option<(u64, u64)>,
    ) {
        let m = Rc::clone(self);
        glommio::spawn_local(async move {
            let result = m.recover(&m.client, worker_id, dp_rank, range).await;
            let cmd = ShardCmd::Recovered { worker_id, result };
            let _ = m.hub.shards.send(shard, cmd).await;
        })
        .detach();
    }

    async fn connect(hub: &Hub, opts: Options) -> Result<(Client, Subscriptions), IngestError> {
        let client = Client::connect(opts).await?;
        let subject = |topic| hub.cfg.subjects.subject(topic);
        let subs = Subscriptions {
            events: (hub.cfg.durable.is_none())
                .then(|| client.subscribe(&hub.cfg.subjects.kv_events(), None))
                .transpose()?,
            kv_metrics: client.subscribe(&subject(codec::TOPIC_KV_METRICS), None)?,
            forward_pass_metrics: client
                .subscribe(&subject(codec::TOPIC_FORWARD_PASS_METRICS), None)?,
            discovery: client.subscribe(&subject(TOPIC_WORKERS), None)?,
        };
        client.flush(Duration::from_secs(5)).await?;
        super::durable::bind_stream(hub, &client)
            .await
            .map_err(IngestError::JetStream)?;
        Ok((client, subs))
    }

    /// Starts the source's tasks; returns the events task (dropped to stop it).
    fn spawn_tasks(me: &Rc<Self>, subs: Subscriptions) -> glommio::Task<()> {
        let client = &me.client;
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
        if let Some(d) = me.hub.cfg.durable.clone() {
            let (m, c) = (Rc::clone(me), client.clone());
            glommio::spawn_local(async move {
                loop {
                    glommio::timer::sleep(d.ack_interval).await;
                    m.ack_applied(&c).await;
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
                        m.hub.bump(|s| s.decode_errors += 1);
                        crate::warn_throttled!(error = %e, "malformed worker announcement");
                    }
                }
            }
        })
        .detach();
        events
    }

    /// Metrics messages: heartbeats only.
    async fn heartbeats(&self, sub: Subscription) {
        while let Some(msg) = sub.next().await {
            self.hub.heartbeat(&msg.payload, Instant::now()).await;
        }
    }

    /// One kv-events message: decoded and handed to the shards.
    pub(super) async fn on_events(&self, payload: &[u8]) {
        self.hub.kv_events(payload, Instant::now()).await;
    }

    async fn on_announcement(&self, a: Announcement) {
        if a.leaving {
            self.hub.workers.forget(a.worker_id);
            let cmd = ShardCmd::Remove {
                worker_id: a.worker_id,
            };
            let _ = self.hub.shards.to_worker(a.worker_id, cmd).await;
            return;
        }
        let known = self.hub.workers.is_announced(a.worker_id);
        let heartbeat = Duration::from_millis(a.heartbeat_ms.max(1));
        self.hub
            .workers
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
        let _ = self.hub.shards.to_worker(a.worker_id, cmd).await;
    }

    async fn recover(
        &self,
        client: &Client,
        worker_id: WorkerId,
        dp_rank: Option<DpRank>,
        range: Option<(u64, u64)>,
    ) -> Recovered {
        let subject = crate::worker::recovery_subject(&self.hub.cfg.subjects, worker_id);
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
            let msg = match stream.next(self.hub.cfg.recovery_timeout).await {
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
                    self.hub.bump(|s| s.decode_errors += 1);
                    return Recovered::Failed(e.to_string());
                }
            }
        }
    }
}
