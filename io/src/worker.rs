//! The worker-side library: what an engine integration (and our mock engine) links to
//! publish KV events that a kvrouter can keep exact.
//!
//! * [`KvPublisher`] numbers each dp rank's events from 0, publishes them in Dynamo 1.6.1's
//!   event-plane format on `namespace.{ns}.component.{c}.endpoint.{e}.kv-events`, and keeps
//!   a **local indexer**: the worker's own index plus a ring buffer of its last events
//!   (1024 by default). The local indexer answers [`RecoveryRequest`]s on the worker's
//!   recovery subject with the missing range, or with a chunked full dump when the range
//!   is no longer buffered.
//! * It announces the worker on the discovery subject (`...kvrouter-workers`, JSON
//!   [`Announcement`]) at start and every `heartbeat`, and says goodbye on [`KvPublisher::leave`].
//!
//! Subjects and payloads are documented in `docs/INGEST.md`.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvrouter_core::codec::{Envelope, Subjects, TOPIC_KV_EVENTS, kv};
use kvrouter_core::event::{KvCacheEvent, KvEventData, RouterEvent, StoredData};
use kvrouter_core::hash::{LocalBlockHash, SequenceBlockHash};
use kvrouter_core::index::{Index, TreeIndex};
use kvrouter_core::recovery::{Announcement, RecoveryReply, RecoveryRequest, chunk_dump};
use kvrouter_core::worker::{DpRank, WorkerDp, WorkerId};

use crate::nats::jetstream::{self, JsError};
use crate::nats::{Client, NatsError};

/// Topic of worker announcements (discovery).
pub const TOPIC_WORKERS: &str = "kvrouter-workers";

/// The recovery subject of a worker.
pub fn recovery_subject(subjects: &Subjects, worker_id: WorkerId) -> String {
    subjects.subject(&format!("kvrouter-recovery.{worker_id}"))
}

/// Settings of a [`KvPublisher`].
#[derive(Debug, Clone)]
pub struct PublisherOptions {
    /// The worker's id.
    pub worker_id: WorkerId,
    /// Its dp ranks.
    pub dp_ranks: Vec<DpRank>,
    /// Subject naming.
    pub subjects: Subjects,
    /// Events kept for range recovery, per dp rank.
    pub ring: usize,
    /// Announce the worker and answer recovery requests (`false`: behave like a stock
    /// Dynamo worker, which does neither).
    pub announce: bool,
    /// Heartbeat interval.
    pub heartbeat: Duration,
    /// Blocks per dump chunk (keeps each reply under `max_payload`).
    pub dump_chunk_blocks: usize,
    /// The id of each rank's first event (ours count from 0, stock Dynamo 1.6.1 from 1).
    pub first_event_id: u64,
    /// JetStream durable mode: each message is published as a JetStream request and resent
    /// until the stream confirms it stored it (a broker restart loses nothing; a resent
    /// message the stream already had is a harmless duplicate, events being idempotent).
    pub durable: bool,
    /// Test hook: do not send every Nth message (events are still numbered and indexed
    /// locally), to exercise the router's gap recovery.
    pub drop_every: Option<u64>,
}

impl PublisherOptions {
    /// Defaults for `worker_id` at dp rank 0.
    pub fn new(worker_id: WorkerId) -> Self {
        Self {
            worker_id,
            dp_ranks: vec![0],
            subjects: Subjects::default(),
            ring: 1024,
            announce: true,
            heartbeat: Duration::from_secs(1),
            dump_chunk_blocks: 8192,
            first_event_id: 0,
            durable: false,
            drop_every: None,
        }
    }
}

#[derive(Debug)]
struct LocalState {
    index: TreeIndex,
    ring: HashMap<DpRank, VecDeque<RouterEvent>>,
    next_id: HashMap<DpRank, u64>,
    sequence: u64,
    messages: u64,
    dropped: u64,
}

/// See the [module docs](self). Lives on one glommio executor, like its [`Client`].
#[derive(Clone)]
pub struct KvPublisher {
    client: Client,
    opts: Rc<PublisherOptions>,
    publisher_id: u64,
    state: Rc<RefCell<LocalState>>,
}

impl std::fmt::Debug for KvPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvPublisher")
            .field("worker_id", &self.opts.worker_id)
            .finish()
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl KvPublisher {
    /// Starts publishing for a worker: subscribes its recovery subject, announces it and
    /// starts the heartbeat (unless `announce` is off).
    pub async fn start(client: Client, opts: PublisherOptions) -> Result<Self, NatsError> {
        let publisher_id = xxhash_rust::xxh3::xxh3_64(
            &[opts.worker_id.to_le_bytes(), now_ms().to_le_bytes()].concat(),
        ) >> 11;
        let p = KvPublisher {
            client,
            opts: Rc::new(opts),
            publisher_id,
            state: Rc::new(RefCell::new(LocalState {
                index: TreeIndex::new(1),
                ring: HashMap::new(),
                next_id: HashMap::new(),
                sequence: 0,
                messages: 0,
                dropped: 0,
            })),
        };
        if p.opts.announce {
            let sub = p
                .client
                .subscribe(&recovery_subject(&p.opts.subjects, p.opts.worker_id), None)?;
            let responder = p.clone();
            glommio::spawn_local(async move {
                while let Some(msg) = sub.next().await {
                    if let Err(e) = responder.answer(&msg).await {
                        crate::warn_throttled!(error = %e, "local indexer: cannot answer a recovery request");
                    }
                }
            })
            .detach();
            p.client.flush(Duration::from_secs(5)).await?;
            p.announce(false).await?;
            let beat = p.clone();
            glommio::spawn_local(async move {
                loop {
                    glommio::timer::sleep(beat.opts.heartbeat).await;
                    if beat.announce(false).await.is_err() {
                        return;
                    }
                }
            })
            .detach();
        }
        Ok(p)
    }

    async fn announce(&self, leaving: bool) -> Result<(), NatsError> {
        let a = Announcement {
            worker_id: self.opts.worker_id,
            dp_ranks: self.opts.dp_ranks.clone(),
            recovery_subject: recovery_subject(&self.opts.subjects, self.opts.worker_id),
            heartbeat_ms: self.opts.heartbeat.as_millis() as u64,
            leaving,
            last_event_ids: {
                let s = self.state.borrow();
                let mut v: Vec<(DpRank, u64)> = s
                    .next_id
                    .iter()
                    .filter(|(_, n)| **n > 0)
                    .map(|(&dp, &n)| (dp, n - 1))
                    .collect();
                v.sort();
                v
            },
        };
        let body = serde_json::to_vec(&a).map_err(|e| NatsError::Encode {
            what: "an announcement",
            reason: e.to_string(),
        })?;
        self.client
            .publish(&self.opts.subjects.subject(TOPIC_WORKERS), &body)
            .await
    }

    /// Announces that the worker is leaving (the router drops its blocks at once).
    pub async fn leave(&self) -> Result<(), NatsError> {
        self.announce(true).await?;
        self.client.flush(Duration::from_secs(5)).await
    }

    /// The worker id.
    pub fn worker_id(&self) -> WorkerId {
        self.opts.worker_id
    }

    /// Messages sent and messages deliberately dropped (test hook).
    pub fn counts(&self) -> (u64, u64) {
        let s = self.state.borrow();
        (s.messages, s.dropped)
    }

    /// The id the next event of `dp_rank` will get.
    pub fn next_event_id(&self, dp_rank: DpRank) -> u64 {
        self.state
            .borrow()
            .next_id
            .get(&dp_rank)
            .copied()
            .unwrap_or(self.opts.first_event_id)
    }

    /// The worker's own view (its local index).
    pub fn local_scores(&self, query: &[LocalBlockHash]) -> u32 {
        self.state.borrow().index.find_matches(query).max_score()
    }

    /// Publishes events of one dp rank in one message; returns the id of the last one.
    /// A batch that would exceed the server's `max_payload` goes out as several messages.
    pub async fn publish(&self, dp_rank: DpRank, data: Vec<KvEventData>) -> Result<u64, NatsError> {
        let events: Vec<RouterEvent> = {
            let mut s = self.state.borrow_mut();
            let mut out = Vec::with_capacity(data.len());
            for d in data {
                let id = s
                    .next_id
                    .get(&dp_rank)
                    .copied()
                    .unwrap_or(self.opts.first_event_id);
                s.next_id.insert(dp_rank, id + 1);
                let e = RouterEvent::new(
                    self.opts.worker_id,
                    KvCacheEvent {
                        event_id: id,
                        data: d,
                        dp_rank,
                    },
                );
                let _ = s.index.apply(e.clone());
                let ring = s.ring.entry(dp_rank).or_default();
                ring.push_back(e.clone());
                if ring.len() > self.opts.ring {
                    ring.pop_front();
                }
                out.push(e);
            }
            out
        };
        let last = events.last().map_or(0, |e| e.event.event_id);
        let max = self.client.max_payload().saturating_sub(1024);
        let mut batch: Vec<RouterEvent> = Vec::new();
        let mut size = 0usize;
        for e in events {
            let est = 64 + e.block_count() * 64;
            if !batch.is_empty() && size + est > max {
                self.send(std::mem::take(&mut batch)).await?;
                size = 0;
            }
            size += est;
            batch.push(e);
        }
        if !batch.is_empty() {
            self.send(batch).await?;
        }
        // Let the local indexer answer recovery requests between bursts.
        glommio::yield_if_needed().await;
        Ok(last)
    }

    async fn send(&self, events: Vec<RouterEvent>) -> Result<(), NatsError> {
        let (seq, drop) = {
            let mut s = self.state.borrow_mut();
            let seq = s.sequence;
            s.sequence += 1;
            let drop = self
                .opts
                .drop_every
                .is_some_and(|n| n > 0 && (seq + 1).is_multiple_of(n));
            if drop {
                s.dropped += 1;
            } else {
                s.messages += 1;
            }
            (seq, drop)
        };
        if drop {
            return Ok(());
        }
        let payload = kv::encode(&events).map_err(|e| NatsError::Encode {
            what: "kv events",
            reason: e.to_string(),
        })?;
        let env = Envelope {
            publisher_id: self.publisher_id,
            sequence: seq,
            published_at: now_ms(),
            topic: TOPIC_KV_EVENTS,
            payload: &payload,
        };
        let subject = self.opts.subjects.kv_events();
        let body = env.encode();
        if !self.opts.durable {
            return self.client.publish(&subject, &body).await;
        }
        let started = std::time::Instant::now();
        loop {
            match jetstream::publish_acked(&self.client, &subject, &body, Duration::from_secs(1))
                .await
            {
                Ok(_) => return Ok(()),
                Err(e) if started.elapsed() > Duration::from_secs(60) => {
                    tracing::warn!(error = %crate::Chain(&e), "durable publish not confirmed for 60 s: giving up");
                    return Err(NatsError::Timeout);
                }
                Err(JsError::Nats(NatsError::Closed)) => return Err(NatsError::Closed),
                Err(e) => {
                    tracing::debug!(error = %crate::Chain(&e), "durable publish not confirmed; resending");
                    glommio::timer::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    /// Publishes a stored chain.
    pub async fn stored(
        &self,
        dp_rank: DpRank,
        parent: Option<SequenceBlockHash>,
        blocks: Vec<(LocalBlockHash, SequenceBlockHash)>,
    ) -> Result<u64, NatsError> {
        let KvCacheEvent { data, .. } = KvCacheEvent::stored(0, dp_rank, parent, blocks);
        self.publish(dp_rank, vec![data]).await
    }

    /// Publishes evicted blocks.
    pub async fn removed(
        &self,
        dp_rank: DpRank,
        hashes: Vec<SequenceBlockHash>,
    ) -> Result<u64, NatsError> {
        let KvCacheEvent { data, .. } = KvCacheEvent::removed(0, dp_rank, hashes);
        self.publish(dp_rank, vec![data]).await
    }

    /// Publishes a clear of the rank.
    pub async fn cleared(&self, dp_rank: DpRank) -> Result<u64, NatsError> {
        self.publish(dp_rank, vec![KvEventData::Cleared]).await
    }

    /// Answers one recovery request.
    async fn answer(&self, msg: &crate::nats::Msg) -> Result<(), NatsError> {
        let Some(reply) = msg.reply.as_deref() else {
            return Ok(());
        };
        let req = match RecoveryRequest::decode(&msg.payload) {
            Ok(r) if r.worker_id == self.opts.worker_id => r,
            Ok(_) => return Ok(()),
            Err(e) => {
                crate::warn_throttled!(error = %e, "local indexer: malformed recovery request");
                return Ok(());
            }
        };
        let range_events = match (req.range, req.dp_rank) {
            (Some((first, last)), Some(dp)) => {
                let s = self.state.borrow();
                let ring = s.ring.get(&dp);
                let found: Vec<RouterEvent> = ring
                    .map(|r| {
                        r.iter()
                            .filter(|e| (first..=last).contains(&e.event.event_id))
                            .cloned()
                            .collect()
                    })
                    .unwrap_or_default();
                (last >= first && found.len() as u64 == last - first + 1).then_some(found)
            }
            _ => None,
        };
        if let Some(events) = range_events {
            let body = RecoveryReply::Range {
                publisher_id: self.publisher_id,
                events,
            }
            .encode()
            .map_err(|e| NatsError::Encode {
                what: "a recovery reply",
                reason: e.to_string(),
            })?;
            return self.client.publish(reply, &body).await;
        }
        // A full dump of the requested rank (or all ranks), in chunks.
        let (events, last_ids) = {
            let s = self.state.borrow();
            let events: Vec<RouterEvent> = s
                .index
                .dump()
                .into_iter()
                .filter(|e| req.dp_rank.is_none_or(|dp| e.event.dp_rank == dp))
                .collect();
            let last_ids: Vec<(DpRank, u64)> = s
                .next_id
                .iter()
                .filter(|(dp, n)| **n > 0 && req.dp_rank.is_none_or(|r| r == **dp))
                .map(|(&dp, &n)| (dp, n - 1))
                .collect();
            (events, last_ids)
        };
        let chunks = chunk_dump(events, self.opts.dump_chunk_blocks);
        let n = chunks.len();
        for (i, events) in chunks.into_iter().enumerate() {
            let body = RecoveryReply::Dump {
                publisher_id: self.publisher_id,
                chunk: i as u32,
                last_chunk: i + 1 == n,
                last_event_ids: last_ids.clone(),
                events,
            }
            .encode()
            .map_err(|e| NatsError::Encode {
                what: "a recovery reply",
                reason: e.to_string(),
            })?;
            self.client.publish(reply, &body).await?;
        }
        Ok(())
    }

    /// The (worker, dp rank)s this publisher has published for.
    pub fn workers(&self) -> Vec<WorkerDp> {
        let s = self.state.borrow();
        let mut v: Vec<WorkerDp> = s
            .next_id
            .keys()
            .map(|&dp| WorkerDp::new(self.opts.worker_id, dp))
            .collect();
        v.sort();
        v
    }

    /// Stored data helper for callers that build chains themselves.
    pub fn stored_data(
        parent: Option<SequenceBlockHash>,
        blocks: Vec<(LocalBlockHash, SequenceBlockHash)>,
    ) -> KvEventData {
        KvEventData::Stored(StoredData {
            parent_hash: parent,
            start_position: None,
            blocks: blocks
                .into_iter()
                .map(|(l, s)| kvrouter_core::event::StoredBlock::new(l, s))
                .collect(),
        })
    }
}
