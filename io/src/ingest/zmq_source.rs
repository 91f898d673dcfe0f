//! The vLLM-native ZMQ source: one task per (engine, dp rank) publisher on the source core.
//!
//! Each task runs a [`Subscriber`] (connected to the engine, or bound when the engine's
//! endpoint is a wildcard), checks that the publisher's sequence numbers are consecutive,
//! decodes each `EventBatch` ([`kvrouter_core::codec::vllm`]), turns it into the worker's
//! events ([`Converter`]) and hands them to the worker's shard. Its events are numbered by
//! the converter, so the shard's bookkeeping sees one gapless stream per rank; a reset is a
//! `Cleared` event in that stream (the rank's blocks dropped).
//!
//! * A **gap** (seq past the next one: the subscriber fell behind and the engine's PUB
//!   dropped at its high-water mark, or a reconnect lost messages in flight) is repaired from
//!   the engine's replay socket; the live messages wait meanwhile in the subscriber's bounded
//!   channel.
//! * At **first sight** a publisher past seq 0 is caught up from the replay socket too (what
//!   the engine cached before we connected).
//! * A seq that **goes back** means the engine restarted: the rank is reset, then caught up
//!   from 0.
//! * When the replay socket no longer holds the range (an engine keeps 10,000 batches) or
//!   does not answer, the failure is counted and logged, the rank is reset and refills from
//!   the events that follow.
//!
//! The worker is registered (routable, zero blocks) as soon as its publisher connects, and
//! pinned alive while connected: an idle engine publishes nothing but still answers our
//! PINGs. Once disconnected it is removed after the silence timeout unless it comes back.

use std::rc::Rc;
use std::time::{Duration, Instant};

use kvrouter_core::codec::vllm;
use kvrouter_core::engine::{Converter, Dropped};
use kvrouter_core::worker::WorkerDp;

use super::config::ZmqEngine;
use super::counters::IngestStats;
use super::hub::Hub;
use crate::zmq::{Endpoint, SubEvent, Subscriber, replay};

/// Starts one task per publisher of every configured engine; dropping the tasks stops them.
pub(super) async fn start(hub: &Rc<Hub>) -> Vec<glommio::Task<()>> {
    let mut tasks = Vec::new();
    for engine in &hub.cfg.zmq_engines {
        for (offset, worker) in engine.ranks() {
            let (Some(events), replay) = (
                engine.events.offset(offset),
                engine.replay.as_ref().and_then(|r| r.offset(offset)),
            ) else {
                tracing::error!(engine = %engine.name, "port of rank {offset} out of range");
                continue;
            };
            let p = Publisher::new(Rc::clone(hub), engine, worker, events, replay);
            tasks.push(glommio::spawn_local(async move { p.run().await }));
        }
    }
    tasks
}

/// One publisher's state.
struct Publisher {
    hub: Rc<Hub>,
    name: String,
    worker: WorkerDp,
    events: Endpoint,
    replay: Option<Endpoint>,
    converter: Converter,
    /// The last sequence number applied.
    last_seq: Option<u64>,
    /// Connections up (a bound socket may have several).
    connected: u32,
    /// When a warning of each kind was last logged (a flood of the same is one line per
    /// 10 s).
    warned: [Option<Instant>; 3],
}

const WARN_EVERY: Duration = Duration::from_secs(10);

impl Publisher {
    fn new(
        hub: Rc<Hub>,
        engine: &ZmqEngine,
        worker: WorkerDp,
        events: Endpoint,
        replay: Option<Endpoint>,
    ) -> Self {
        Self {
            hub,
            name: engine.name.clone(),
            worker,
            events,
            replay,
            converter: Converter::new(engine.worker_id, engine.block_size),
            last_seq: None,
            connected: 0,
            warned: [None; 3],
        }
    }

    /// Whether a warning of kind `k` may be logged now.
    fn may_warn(&mut self, k: usize) -> bool {
        let now = Instant::now();
        if self.warned[k].is_some_and(|t| now.duration_since(t) < WARN_EVERY) {
            return false;
        }
        self.warned[k] = Some(now);
        true
    }

    /// The publisher id the shard records for this rank's events.
    fn publisher_id(&self) -> u64 {
        let mut b = [0u8; 12];
        b[..8].copy_from_slice(&self.worker.worker_id.to_le_bytes());
        b[8..].copy_from_slice(&self.worker.dp_rank.to_le_bytes());
        xxhash_rust::xxh3::xxh3_64(&b)
    }

    async fn run(mut self) {
        let sub = Subscriber::start(&self.events, self.hub.cfg.zmq.sub);
        tracing::info!(engine = %self.name, worker = %self.worker, endpoint = %self.events, bind = self.events.wildcard, "ZMQ engine publisher");
        // Configured engines are routable from the start.
        self.hub.register(vec![self.worker]).await;
        while let Some(ev) = sub.next().await {
            let now = Instant::now();
            match ev {
                SubEvent::Connected { .. } => {
                    self.hub.bump(|s| s.zmq_connects += 1);
                    self.connected += 1;
                    self.hub.workers.pin(self.worker.worker_id, now);
                    if self.hub.workers.first_sight(self.worker) {
                        // New, or removed while it was away (its state went with it): catch
                        // up from the start of its history at its next message.
                        self.last_seq = None;
                        self.hub.register(vec![self.worker]).await;
                    }
                    tracing::info!(engine = %self.name, worker = %self.worker, "publisher connected");
                }
                SubEvent::Disconnected { error, .. } => {
                    self.hub.bump(|s| s.zmq_disconnects += 1);
                    self.connected = self.connected.saturating_sub(1);
                    self.hub.workers.unpin(self.worker.worker_id, now);
                    if self.may_warn(0) {
                        crate::warn_throttled!(engine = %self.name, worker = %self.worker, error = %crate::Chain(&error), "publisher connection lost");
                    }
                }
                SubEvent::Failed { error } => {
                    if self.may_warn(1) {
                        tracing::debug!(engine = %self.name, error = %crate::Chain(&error), "cannot reach the publisher; retrying");
                    }
                }
                SubEvent::Message { frames, .. } => self.on_message(frames, now).await,
            }
        }
    }

    async fn on_message(&mut self, frames: Vec<Vec<u8>>, arrived: Instant) {
        self.hub.bump(|s| s.zmq_messages += 1);
        self.hub.workers.seen(self.worker.worker_id, None, arrived);
        // `[topic, seq, payload]`; the oldest publishers sent `[seq, payload]`.
        let (seq, payload) = match frames.as_slice() {
            [_, seq, payload] | [seq, payload] => (seq, payload),
            _ => return self.malformed("frame count"),
        };
        let Ok(seq) = <[u8; 8]>::try_from(seq.as_slice()).map(u64::from_be_bytes) else {
            return self.malformed("sequence number");
        };
        match self.last_seq {
            Some(last) if seq == last.wrapping_add(1) => {}
            Some(last) if seq <= last => {
                self.hub.bump(|s| s.zmq_restarts += 1);
                tracing::info!(engine = %self.name, worker = %self.worker, seq, last, "engine restarted: resetting the worker");
                self.reset().await;
                self.catch_up(0, seq).await;
            }
            Some(last) => {
                self.hub.bump(|s| s.zmq_gaps += 1);
                tracing::debug!(engine = %self.name, worker = %self.worker, from = last + 1, to = seq, "gap: asking the replay socket");
                self.catch_up(last + 1, seq).await;
            }
            None if seq > 0 => self.catch_up(0, seq).await,
            None => {}
        }
        self.apply(payload, arrived).await;
        self.last_seq = Some(seq);
    }

    fn malformed(&mut self, what: &'static str) {
        self.hub.bump(|s| s.decode_errors += 1);
        if self.may_warn(2) {
            crate::warn_throttled!(engine = %self.name, what, "malformed ZMQ message skipped");
        }
    }

    /// The rank's state is dropped (a `Cleared` event in its stream).
    async fn reset(&mut self) {
        self.converter.reset();
        let cleared = self.converter.cleared(self.worker.dp_rank);
        let publisher = self.publisher_id();
        self.hub
            .shards
            .events(vec![cleared], publisher, Instant::now())
            .await;
    }

    /// Applies batches `[from, to)` from the replay socket, or resets when they cannot all
    /// be had.
    async fn catch_up(&mut self, from: u64, to: u64) {
        let Some(endpoint) = self.replay.clone() else {
            if from > 0 {
                // No replay socket: what was missed is gone. Counted; the worker is reset
                // only when it restarted (above), since a gap usually loses few events.
                self.hub.bump(|s| s.zmq_replay_failures += 1);
                if self.may_warn(0) {
                    crate::warn_throttled!(engine = %self.name, worker = %self.worker, from, to, "gap and no replay socket: events lost");
                }
            }
            return;
        };
        let opts = self.hub.cfg.zmq;
        let wanted = (to - from) as usize;
        let got = replay(
            &endpoint,
            from,
            opts.sub.limits,
            opts.replay_timeout,
            wanted.min(opts.replay_max),
        )
        .await;
        let items = match got {
            Ok(items) => items,
            Err(e) => {
                self.replay_failed(from, to, &format!("{}", crate::Chain(&e)))
                    .await;
                return;
            }
        };
        let covers = items.first().is_some_and(|i| i.seq == from)
            && items.len() >= wanted
            && items
                .windows(2)
                .all(|w| w[1].seq == w[0].seq.wrapping_add(1));
        if !covers {
            if from > 0 {
                self.replay_failed(from, to, "the range is no longer held")
                    .await;
                return;
            }
            // From the start (first sight, or a restart, both on a fresh state): the oldest
            // batches are gone, so what is left is applied best effort (stores below a lost
            // parent are refused and counted).
            self.hub.bump(|s| s.zmq_replay_failures += 1);
            crate::warn_throttled!(engine = %self.name, worker = %self.worker, to, first = items.first().map(|i| i.seq), "the engine's oldest batches are gone: catching up best effort");
        } else {
            self.hub.bump(|s| s.zmq_replays += 1);
        }
        for item in items.into_iter().filter(|i| i.seq >= from && i.seq < to) {
            self.apply(&item.payload, Instant::now()).await;
        }
    }

    async fn replay_failed(&mut self, from: u64, to: u64, why: &str) {
        self.hub.bump(|s| s.zmq_replay_failures += 1);
        crate::warn_throttled!(engine = %self.name, worker = %self.worker, from, to, why, "replay failed: resetting the worker, it refills from its next events");
        self.reset().await;
    }

    async fn apply(&mut self, payload: &[u8], arrived: Instant) {
        let batch = match vllm::decode_batch(payload) {
            Ok(b) => b,
            Err(e) => {
                self.hub.bump(|s| s.decode_errors += 1);
                if self.may_warn(2) {
                    crate::warn_throttled!(engine = %self.name, error = %e, kind = e.kind(), "undecodable engine batch skipped");
                }
                return;
            }
        };
        if batch.dp_rank.is_some_and(|r| r != self.worker.dp_rank) {
            self.hub.bump(|s| s.engine_wrong_rank += 1);
            return;
        }
        let mut dropped = Dropped::default();
        let events = self
            .converter
            .convert(batch, self.worker.dp_rank, &mut dropped);
        if !dropped.is_empty() {
            self.hub.bump(|s| count(s, &dropped));
        }
        if !events.is_empty() {
            let publisher = self.publisher_id();
            self.hub.shards.events(events, publisher, arrived).await;
        }
    }
}

fn count(s: &mut IngestStats, d: &Dropped) {
    s.engine_other_groups += d.other_groups;
    s.engine_block_size_mismatches += d.block_size;
    s.engine_no_token_blocks += d.no_tokens;
    s.engine_unknown_medium += d.unknown_medium;
    s.engine_remote += d.remote;
    s.engine_unknown_type += d.unknown_type;
}
