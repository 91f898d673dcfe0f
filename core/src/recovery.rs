//! Keeping the router's view of each worker exact: event-id bookkeeping, and the messages
//! of the recovery protocol between the router and a worker's local indexer.
//!
//! # Event ids
//!
//! Each (worker, dp rank) numbers its events. [`EventIds`] remembers the last id applied
//! per (worker, dp rank) and classifies the next one ([`Verdict`]):
//!
//! * the first event seen from a worker is applied whatever its id (0, 1 or more — stock
//!   Dynamo 1.6.1 workers count from 1, ours from 0) and sets the baseline;
//! * `last + 1` is applied; `last` itself is a duplicate (ignored);
//! * an id lower than `last` from a *different publisher* (the envelope's `publisher_id`,
//!   random per worker process) that starts a fresh numbering (0 or 1, or more than
//!   [`RESTART_WINDOW`] below `last`) means the worker restarted: its state is reset, and
//!   the event is applied as a new baseline. Any other lower id is a late duplicate (a
//!   message overtaken by a recovery answer, or one from a sibling publisher that arrived
//!   out of order), ignored;
//! * an id above `last + 1` leaves a gap `last + 1 ..= id - 1`: a worker with a local
//!   indexer is asked for the missing range (or its full dump when the range is no longer
//!   buffered); for other workers the gap is logged and counted and the event applied.
//!
//! # Protocol
//!
//! The router sends a [`RecoveryRequest`] to the worker's recovery subject (NATS
//! request/reply); the worker answers with one [`RecoveryReply::Range`] holding exactly the
//! requested events, or, when it no longer has them all, with a dump in one or more
//! [`RecoveryReply::Dump`] chunks (each under the server's `max_payload`), the last one
//! flagged. Both are MessagePack (named maps), like the rest of the event plane.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::codec::{CodecError, from_msgpack, to_msgpack};
use crate::event::RouterEvent;
use crate::worker::{DpRank, WorkerDp, WorkerId};

/// What to do with an event, given the last id applied for its (worker, dp rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The next event (or the first one seen): apply it.
    Apply,
    /// Already applied: ignore it.
    Duplicate,
    /// Events `first ..= last` are missing.
    Gap {
        /// First missing id.
        first: u64,
        /// Last missing id.
        last: u64,
    },
    /// The id went backwards: the worker restarted.
    Restart,
}

/// How far below the last id an event from another publisher must be to count as a
/// restart (rather than a message of a sibling publisher that arrived out of order).
pub const RESTART_WINDOW: u64 = 1024;

/// Last applied event id per (worker, dp rank), with the publisher that sent it.
#[derive(Debug, Default, Clone)]
pub struct EventIds {
    last: HashMap<WorkerDp, (u64, u64)>,
}

impl EventIds {
    /// Nothing seen yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Classifies event `id` of `worker`, received from `publisher`.
    pub fn verdict(&self, worker: WorkerDp, id: u64, publisher: u64) -> Verdict {
        match self.last.get(&worker) {
            None => Verdict::Apply,
            Some(&(last, _)) if id == last.wrapping_add(1) => Verdict::Apply,
            Some(&(last, _)) if id == last => Verdict::Duplicate,
            Some(&(last, from)) if id < last => {
                // A new process numbers from 0 or 1; a much lower id from another
                // publisher is a restart too. A slightly lower one from another publisher of
                // the same worker is a message that arrived out of order.
                let fresh = id <= 1 || last - id > RESTART_WINDOW;
                if from != publisher && fresh {
                    Verdict::Restart
                } else {
                    Verdict::Duplicate
                }
            }
            Some(&(last, _)) => Verdict::Gap {
                first: last + 1,
                last: id - 1,
            },
        }
    }

    /// Records `id` from `publisher` as the last applied event of `worker`.
    pub fn set(&mut self, worker: WorkerDp, id: u64, publisher: u64) {
        self.last.insert(worker, (id, publisher));
    }

    /// The last applied id of `worker`.
    pub fn last(&self, worker: WorkerDp) -> Option<u64> {
        self.last.get(&worker).map(|&(id, _)| id)
    }

    /// The publisher of the last applied event of `worker`.
    pub fn publisher(&self, worker: WorkerDp) -> Option<u64> {
        self.last.get(&worker).map(|&(_, p)| p)
    }

    /// Forgets one (worker, dp rank).
    pub fn forget(&mut self, worker: WorkerDp) {
        self.last.remove(&worker);
    }

    /// Forgets every dp rank of a worker.
    pub fn forget_worker(&mut self, worker_id: WorkerId) {
        self.last.retain(|w, _| w.worker_id != worker_id);
    }
}

/// The router asks a worker's local indexer for events it missed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecoveryRequest {
    /// The worker.
    pub worker_id: WorkerId,
    /// The dp rank; `None` asks for every rank (a full dump).
    pub dp_rank: Option<DpRank>,
    /// The missing range, inclusive; `None` asks for a full dump.
    pub range: Option<(u64, u64)>,
}

/// The local indexer's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RecoveryReply {
    /// Exactly the requested events, in order.
    Range {
        /// The publisher id the worker's live events carry.
        #[serde(default)]
        publisher_id: u64,
        /// The events.
        events: Vec<RouterEvent>,
    },
    /// A chunk of a full dump: applying all chunks in order (each rank starts with a
    /// `Cleared`) rebuilds the worker's state as of `last_event_ids`.
    Dump {
        /// The publisher id the worker's live events carry.
        #[serde(default)]
        publisher_id: u64,
        /// Chunk number, from 0.
        chunk: u32,
        /// Whether this is the last chunk.
        last_chunk: bool,
        /// Per dp rank, the id of the last event the dump covers.
        last_event_ids: Vec<(DpRank, u64)>,
        /// The events of this chunk.
        events: Vec<RouterEvent>,
    },
}

impl RecoveryRequest {
    /// MessagePack.
    pub fn encode(&self) -> Result<Vec<u8>, CodecError> {
        to_msgpack("recovery request", self)
    }

    /// From MessagePack.
    pub fn decode(bytes: &[u8]) -> Result<Self, CodecError> {
        from_msgpack("recovery request", bytes)
    }
}

impl RecoveryReply {
    /// MessagePack.
    pub fn encode(&self) -> Result<Vec<u8>, CodecError> {
        to_msgpack("recovery reply", self)
    }

    /// From MessagePack.
    pub fn decode(bytes: &[u8]) -> Result<Self, CodecError> {
        from_msgpack("recovery reply", bytes)
    }
}

/// Splits dump events into chunks of at most `max_blocks` blocks each (at least one event
/// per chunk), so that each chunk's message stays under the server's `max_payload`.
pub fn chunk_dump(events: Vec<RouterEvent>, max_blocks: usize) -> Vec<Vec<RouterEvent>> {
    let mut chunks = vec![Vec::new()];
    let mut blocks = 0;
    for e in events {
        let n = e.block_count().max(1);
        if blocks + n > max_blocks
            && !chunks
                .last()
                .is_some_and(|c: &Vec<RouterEvent>| c.is_empty())
        {
            chunks.push(Vec::new());
            blocks = 0;
        }
        blocks += n;
        chunks.last_mut().expect("non-empty").push(e);
    }
    chunks
}

/// A worker's announcement on the discovery subject (JSON), sent at start and then as a
/// heartbeat every `heartbeat_ms`; `leaving: true` when it shuts down.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Announcement {
    /// The worker.
    pub worker_id: WorkerId,
    /// Its dp ranks.
    #[serde(default)]
    pub dp_ranks: Vec<DpRank>,
    /// Where its local indexer answers [`RecoveryRequest`]s.
    pub recovery_subject: String,
    /// Heartbeat interval, ms.
    pub heartbeat_ms: u64,
    /// Set on the last announcement of a shutting-down worker.
    #[serde(default)]
    pub leaving: bool,
    /// Per dp rank, the id of the last event published so far: lets the router notice
    /// that it missed the latest events even when nothing follows them.
    #[serde(default)]
    pub last_event_ids: Vec<(DpRank, u64)>,
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::event::KvCacheEvent;
    use crate::hash::{LocalBlockHash as L, SequenceBlockHash as S};

    const W: WorkerDp = WorkerDp::new(1, 0);

    #[test]
    fn verdicts() {
        let mut ids = EventIds::new();
        assert_eq!(ids.verdict(W, 5, 7), Verdict::Apply);
        ids.set(W, 5, 7);
        assert_eq!(ids.verdict(W, 6, 7), Verdict::Apply);
        assert_eq!(ids.verdict(W, 5, 7), Verdict::Duplicate);
        assert_eq!(ids.verdict(W, 9, 7), Verdict::Gap { first: 6, last: 8 });
        assert_eq!(ids.verdict(W, 0, 8), Verdict::Restart);
        assert_eq!(
            ids.verdict(W, 4, 8),
            Verdict::Duplicate,
            "out of order from a sibling publisher"
        );
        assert_eq!(
            ids.verdict(W, 0, 7),
            Verdict::Duplicate,
            "a late message of the same process"
        );
        assert_eq!(ids.verdict(WorkerDp::new(1, 1), 0, 7), Verdict::Apply);
        ids.forget_worker(1);
        assert_eq!(ids.last(W), None);
    }

    #[test]
    fn protocol_round_trips_and_chunks() {
        let req = RecoveryRequest {
            worker_id: u64::MAX,
            dp_rank: Some(2),
            range: Some((3, 9)),
        };
        assert_eq!(
            RecoveryRequest::decode(&req.encode().unwrap()).unwrap(),
            req
        );
        let ev = |i| {
            RouterEvent::new(
                1,
                KvCacheEvent::stored(i, 0, None, (0..10).map(|j| (L(j), S(j)))),
            )
        };
        let reply = RecoveryReply::Dump {
            publisher_id: 3,
            chunk: 0,
            last_chunk: true,
            last_event_ids: vec![(0, 7)],
            events: vec![ev(1)],
        };
        assert_eq!(
            RecoveryReply::decode(&reply.encode().unwrap()).unwrap(),
            reply
        );
        assert!(RecoveryReply::decode(b"\x80").is_err());
        let chunks = chunk_dump((0..10).map(ev).collect(), 25);
        assert_eq!(
            chunks.iter().map(Vec::len).collect::<Vec<_>>(),
            vec![2, 2, 2, 2, 2]
        );
        assert_eq!(chunk_dump(vec![ev(0)], 1).len(), 1);
        assert_eq!(chunk_dump(vec![], 1), vec![Vec::<RouterEvent>::new()]);
    }
}
