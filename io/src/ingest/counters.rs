//! Per-core counters and worker summaries, gathered on scrape.
//!
//! Each core (the source core, every shard core) counts in plain integers it owns
//! ([`IngestStats`], no atomics on the event path) and publishes them now and then to its
//! own [`Published`] block: relaxed stores by that one core into its own cache lines, never
//! a read-modify-write, never a line another core writes. A scrape sums the blocks. This is
//! tokio's batched worker metrics: the hot path bumps locals, the publication is amortised
//! over a batch of work (a shard core publishes when its queue runs dry, and at least every
//! [`PUBLISH_EVERY`] commands; the source core after each message it handles).
//!
//! Worker summaries (blocks, last event id) work the same way: a shard core keeps its own
//! map and marks what changed; at publication it copies the changed entries, under one lock
//! per batch rather than one per event, into the map readers see, and bumps the membership
//! counter (`Release`) when a (worker, dp rank) came or went.
//!
//! What a reader may see: counters and summaries as of some publication of each core
//! (never torn within one counter; different counters and cores from slightly different
//! moments). Anything a core did before a publication that happens-before the reader's
//! read (a summary lock taken after the core's, a barrier) is visible.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use kvrouter_core::index::WorkerSummary;
use kvrouter_core::worker::{DpRank, WorkerDp, WorkerId};

/// A shard core publishes at least this often (in commands) while its queue stays busy.
pub(super) const PUBLISH_EVERY: u32 = 64;

macro_rules! stats {
    ($( $(#[$doc:meta])* $name:ident ),* $(,)?) => {
        /// The ingest's counters: one core's, or (from [`super::IngestView::stats`]) the sum
        /// over every core. Field names are the JSON keys and, as
        /// `kvrouter_ingest_{name}_total`, the Prometheus names.
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
        #[non_exhaustive]
        pub struct IngestStats {
            $( $(#[$doc])* pub $name: u64, )*
        }

        impl IngestStats {
            /// Every counter with its name.
            pub fn fields(&self) -> Vec<(&'static str, u64)> {
                vec![$( (stringify!($name), self.$name), )*]
            }

            fn add(&mut self, o: &IngestStats) {
                $( self.$name += o.$name; )*
            }

            const LEN: usize = [$( stringify!($name), )*].len();

            fn store(&self, to: &[AtomicU64]) {
                let mut i = 0;
                $(
                    to[i].store(self.$name, Ordering::Relaxed);
                    i += 1;
                )*
                debug_assert_eq!(i, Self::LEN);
            }

            fn load(from: &[AtomicU64]) -> IngestStats {
                let mut i = 0;
                let mut s = IngestStats::default();
                $(
                    s.$name = from[i].load(Ordering::Relaxed);
                    i += 1;
                )*
                debug_assert_eq!(i, Self::LEN);
                s
            }
        }
    };
}

stats! {
    /// kv-events messages received.
    messages,
    /// Messages that failed to decode (skipped).
    decode_errors,
    /// Events of a message that failed to decode while the rest of it did (each skipped).
    malformed_events,
    /// Events applied.
    events,
    /// Blocks named by applied events.
    event_blocks,
    /// Events ignored as duplicates.
    duplicates,
    /// Events rejected by the index (e.g. unknown parent).
    rejected,
    /// Gaps seen.
    gaps,
    /// Gaps repaired from a local indexer (range or dump).
    recoveries,
    /// Full dumps applied.
    dumps,
    /// Recoveries that failed (timeout, no responders); events applied best effort.
    recovery_failures,
    /// Worker restarts detected.
    restarts,
    /// Workers removed (silence, missed heartbeats, leaving).
    workers_removed,
    /// Shared-pool events (`cache_owner`) applied to the pool beside the index.
    pool_events,
    /// Events of a residency domain this build does not know (neither `worker` nor
    /// `cache_owner`): skipped.
    unknown_domain_events,
    /// Events for a worker never seen that would have left it with no block (a removal,
    /// a clear, a rejected or empty store): ignored, so that they create no worker.
    unknown_worker_events,
    /// Messages dropped by the NATS client because the ingest fell behind.
    nats_dropped,
    /// NATS reconnects.
    nats_reconnects,
    /// Snapshots written.
    snapshots,
    /// Snapshots that could not be written (the previous one is kept).
    snapshot_failures,
    /// Workers left out of a snapshot because their numbering was reset while it was
    /// taken (a restart during the dump).
    snapshot_skipped_workers,
    /// Snapshots found at start but unusable (corrupt, truncated, other version).
    snapshot_load_failures,
    /// Blocks restored from a snapshot at start.
    snapshot_restored_blocks,
    /// JetStream acknowledgements sent.
    js_acks,
    /// JetStream deliveries skipped as already applied (redeliveries).
    js_redelivered,
    /// Durable consumers re-created after messages were lost in flight.
    js_resets,
    /// ZMQ messages received (vLLM-native wire and Dynamo's ZMQ plane).
    zmq_messages,
    /// ZMQ publisher connections made.
    zmq_connects,
    /// ZMQ publisher connections lost.
    zmq_disconnects,
    /// Gaps in a ZMQ publisher's sequence numbers.
    zmq_gaps,
    /// Gaps (and catch-ups at first sight) repaired through an engine's replay socket.
    zmq_replays,
    /// Replays that could not repair a gap (the range was gone, or the socket did not
    /// answer): the worker was reset and refills from its next events.
    zmq_replay_failures,
    /// Engine restarts seen (a sequence number that went back): the worker was reset.
    zmq_restarts,
    /// Engine events of attention groups that are not full attention (not indexed).
    engine_other_groups,
    /// Engine events whose block size is not the engine's configured one.
    engine_block_size_mismatches,
    /// Stored blocks without the tokens to hash them.
    engine_no_token_blocks,
    /// Engine events on a medium we do not know (kept out of every credit).
    engine_unknown_medium,
    /// Engine events about another engine's cache (`locality` REMOTE).
    engine_remote,
    /// Engine events of a type we do not know.
    engine_unknown_type,
    /// Batches that named another dp rank than their publisher's.
    engine_wrong_rank,
    /// Discovery entries that could not be read.
    discovery_errors,
}

/// One core's published counters: written by that core only, read on scrape. Aligned to
/// cache lines so that no two cores' blocks share one.
#[repr(align(128))]
#[derive(Debug)]
pub(super) struct Published {
    cells: [AtomicU64; IngestStats::LEN],
}

impl Default for Published {
    fn default() -> Self {
        Self {
            cells: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

const _: () = assert!(std::mem::align_of::<Published>() == 128);

impl Published {
    /// Called by the owning core only.
    pub(super) fn publish(&self, s: &IngestStats) {
        s.store(&self.cells);
    }

    fn read(&self) -> IngestStats {
        IngestStats::load(&self.cells)
    }
}

/// Every core's published counters (shared with readers).
#[derive(Debug, Default)]
pub(super) struct AllCounters {
    cores: Vec<Published>,
}

impl AllCounters {
    pub(super) fn new(cores: usize) -> Arc<Self> {
        Arc::new(Self {
            cores: (0..cores).map(|_| Published::default()).collect(),
        })
    }

    /// Core `i`'s block (index 0: the source core; shard `k` is `k + 1`).
    pub(super) fn core(&self, i: usize) -> &Published {
        &self.cores[i]
    }

    /// The sum over every core.
    pub(super) fn sum(&self) -> IngestStats {
        let mut total = IngestStats::default();
        for c in &self.cores {
            total.add(&c.read());
        }
        total
    }
}

/// The worker summaries readers see: one map per shard, written at its publications.
pub(super) type SharedSummaries = Arc<Mutex<HashMap<WorkerDp, WorkerSummary>>>;

/// A shard core's worker summaries: its own copy, what changed since the last publication,
/// and where it publishes.
#[derive(Debug)]
pub(super) struct Summaries {
    dirty: HashSet<WorkerDp>,
    /// The dp ranks of each worker in the shared map (so that a whole worker can be
    /// marked without listing every worker).
    ranks: HashMap<WorkerId, Vec<DpRank>>,
    shared: SharedSummaries,
    members: Arc<AtomicU64>,
}

impl Summaries {
    pub(super) fn new(shared: SharedSummaries, members: Arc<AtomicU64>) -> Self {
        Self {
            dirty: HashSet::new(),
            ranks: HashMap::new(),
            shared,
            members,
        }
    }

    /// `w`'s summary may have changed.
    pub(super) fn touch(&mut self, w: WorkerDp) {
        self.dirty.insert(w);
    }

    /// Every dp rank of `worker_id` may have changed.
    pub(super) fn touch_worker(&mut self, worker_id: WorkerId) {
        if let Some(ranks) = self.ranks.get(&worker_id) {
            for &dp in ranks {
                self.dirty.insert(WorkerDp::new(worker_id, dp));
            }
        }
    }

    /// Whether anything waits for publication.
    #[cfg(test)]
    pub(super) fn is_dirty(&self) -> bool {
        !self.dirty.is_empty()
    }

    /// Copies the changed summaries (from `now`, which says what each worker's summary is
    /// now, `None` for gone) into the shared map; bumps the membership counter when a
    /// worker came or went.
    pub(super) fn publish(&mut self, mut now: impl FnMut(WorkerDp) -> Option<WorkerSummary>) {
        if self.dirty.is_empty() {
            return;
        }
        let mut changed = false;
        {
            // Nothing under the lock can panic; a poisoned map is still a whole map.
            let mut m = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
            for w in self.dirty.drain() {
                let came_or_went = match now(w) {
                    Some(s) => m.insert(w, s).is_none(),
                    None => m.remove(&w).is_some(),
                };
                if came_or_went {
                    changed = true;
                    let ranks = self.ranks.entry(w.worker_id).or_default();
                    match ranks.iter().position(|&d| d == w.dp_rank) {
                        Some(i) => {
                            ranks.swap_remove(i);
                            if ranks.is_empty() {
                                self.ranks.remove(&w.worker_id);
                            }
                        }
                        None => ranks.push(w.dp_rank),
                    }
                }
            }
        }
        if changed {
            // `Release` pairs with `IngestView::membership`'s `Acquire`: a reader that sees
            // the new count lists the new membership.
            self.members.fetch_add(1, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cores_publish_their_own_blocks_and_a_scrape_sums_them() {
        let all = AllCounters::new(3);
        let mut a = IngestStats {
            events: 5,
            gaps: 1,
            ..Default::default()
        };
        all.core(1).publish(&a);
        let b = IngestStats {
            events: 2,
            js_resets: 7,
            ..Default::default()
        };
        all.core(2).publish(&b);
        let s = all.sum();
        assert_eq!((s.events, s.gaps, s.js_resets), (7, 1, 7));
        // A later publication replaces the core's block, it does not add to it.
        a.events = 6;
        all.core(1).publish(&a);
        assert_eq!(all.sum().events, 8);
        assert_eq!(s.fields().len(), IngestStats::LEN);
        assert!(s.fields().contains(&("js_resets", 7)));
    }

    #[test]
    fn summaries_publish_changes_and_count_membership() {
        let shared: SharedSummaries = Arc::default();
        let members = Arc::new(AtomicU64::new(0));
        let mut s = Summaries::new(Arc::clone(&shared), Arc::clone(&members));
        let w = WorkerDp::new(1, 0);
        let sum = |blocks| WorkerSummary {
            worker: w,
            blocks,
            last_event_id: Some(blocks as u64),
        };
        s.touch(w);
        s.publish(|_| Some(sum(1)));
        assert_eq!(members.load(Ordering::Acquire), 1);
        // A changed count is published without a membership change.
        s.touch(w);
        s.publish(|_| Some(sum(2)));
        assert_eq!(members.load(Ordering::Acquire), 1);
        assert_eq!(shared.lock().unwrap()[&w].blocks, 2);
        // Two ranks of one worker; removing the worker marks both.
        let w1 = WorkerDp::new(1, 1);
        s.touch(w1);
        s.publish(|x| {
            Some(WorkerSummary {
                worker: x,
                ..sum(3)
            })
        });
        assert_eq!(members.load(Ordering::Acquire), 2);
        s.touch_worker(1);
        assert!(s.is_dirty());
        s.publish(|_| None);
        assert!(!s.is_dirty() && shared.lock().unwrap().is_empty());
        assert_eq!(members.load(Ordering::Acquire), 3);
        assert!(s.ranks.is_empty());
    }
}
