//! A shard core: the one writer of one index shard, and the event-id bookkeeping of its
//! workers (gaps, duplicates, restarts, recoveries: see [`kvrouter_core::recovery`]).
//!
//! It carries out [`ShardCmd`]s in the order they arrive, never waiting for more: events
//! are applied at once; a worker with a local indexer that shows a gap is asked for the
//! missing range (through the source core) and its later events wait in a per-worker queue
//! until the answer is applied; a snapshot dumps one worker at a time, applying what
//! arrives in between.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};

use kvrouter_core::event::{KvEventData, RouterEvent};
use kvrouter_core::index::tree::{ShardMap, ShardWriter};
use kvrouter_core::index::{ApplyError, WorkerSummary};
use kvrouter_core::recovery::{EventIds, Verdict};
use kvrouter_core::snapshot::WorkerRecord;
use kvrouter_core::worker::{DpRank, WorkerDp, WorkerId};

use super::counters::{AllCounters, IngestStats, PUBLISH_EVERY, Summaries};
use super::messages::{Flow, Recovered, ShardCmd, ShardPart, SourceCmd};

/// A shard core: one index writer and the event-id bookkeeping of its workers.
pub(super) struct ShardCore {
    pub(super) index: usize,
    pub(super) writer: ShardWriter,
    pub(super) ids: EventIds,
    /// Workers with a local indexer (announced), with their heartbeat interval in ms.
    pub(super) announced: HashMap<WorkerId, u64>,
    /// Workers waiting for a recovery answer, with the events that arrived meanwhile
    /// (event, publisher).
    pub(super) recovering: HashMap<WorkerId, VecDeque<(RouterEvent, u64)>>,
    /// Workers listed before (or without) any block: known from discovery, a static list
    /// or a heartbeat.
    pub(super) registered: HashSet<WorkerDp>,
    /// This core's counters (published to `published`).
    pub(super) stats: IngestStats,
    pub(super) counters: Arc<AllCounters>,
    /// Asks the source core for recoveries.
    pub(super) source: flume::Sender<SourceCmd>,
    pub(super) summaries: Summaries,
    /// Which shard owns each worker (a removed worker no longer counts toward ours).
    pub(super) map: Arc<ShardMap>,
    pub(super) latencies: Option<Arc<Mutex<Vec<u64>>>>,
    /// Commands taken off the channel during a snapshot's dump, to be carried out next.
    pub(super) deferred: VecDeque<ShardCmd>,
    /// Commands carried out since the last publication.
    pub(super) since_publish: u32,
}

impl ShardCore {
    pub(super) async fn run(mut self, rx: flume::Receiver<ShardCmd>) {
        loop {
            // Commands a snapshot took off the channel but left for after it come first.
            let cmd = match self.deferred.pop_front() {
                Some(cmd) => cmd,
                None => match rx.try_recv() {
                    Ok(cmd) => cmd,
                    Err(flume::TryRecvError::Disconnected) => break,
                    Err(flume::TryRecvError::Empty) => {
                        // Idle: what this core did is now visible to readers. (A `try_recv`
                        // first, not `is_empty`: one channel lock per command, as before.)
                        self.publish();
                        match rx.recv_async().await {
                            Ok(cmd) => cmd,
                            Err(_) => break,
                        }
                    }
                },
            };
            if self.command(cmd, &rx) == Flow::Stop {
                break;
            }
            self.since_publish += 1;
            if self.since_publish >= PUBLISH_EVERY {
                self.publish();
            }
        }
        self.publish();
    }

    /// Publishes this core's counters and changed summaries (see [`super::counters`]).
    pub(super) fn publish(&mut self) {
        self.since_publish = 0;
        self.counters.core(self.index + 1).publish(&self.stats);
        let (writer, ids, registered) = (&self.writer, &self.ids, &self.registered);
        self.summaries.publish(|w| {
            let s = writer.summary(w).or_else(|| {
                registered.contains(&w).then_some(WorkerSummary {
                    worker: w,
                    blocks: 0,
                    last_event_id: None,
                })
            })?;
            Some(WorkerSummary {
                last_event_id: ids.last(w),
                ..s
            })
        });
    }

    /// Carries out one command; `rx` lets a snapshot apply what arrives while it dumps.
    pub(super) fn command(&mut self, cmd: ShardCmd, rx: &flume::Receiver<ShardCmd>) -> Flow {
        match cmd {
            ShardCmd::Events {
                events,
                publisher,
                arrived,
            } => {
                for e in events {
                    self.handle(e, publisher);
                }
                if let Some(mut v) = self.latencies.as_ref().and_then(|l| l.lock().ok()) {
                    v.push(arrived.elapsed().as_nanos() as u64);
                }
            }
            ShardCmd::Announced {
                worker_id,
                heartbeat_ms,
            } => {
                self.announced.insert(worker_id, heartbeat_ms);
                // Load the worker's full state; hold its events until it arrives.
                self.recover(worker_id, None, None);
            }
            ShardCmd::Recovered { worker_id, result } => self.recovered(worker_id, result),
            ShardCmd::Heartbeat {
                worker_id,
                last_event_ids,
            } => {
                // Trailing gap: the worker published events we never received.
                if !self.recovering.contains_key(&worker_id) {
                    for (dp, published) in last_event_ids {
                        let w = WorkerDp::new(worker_id, dp);
                        match self.ids.last(w) {
                            Some(last) if last < published => {
                                self.stats.gaps += 1;
                                self.recover(worker_id, Some(dp), Some((last + 1, published)));
                                break;
                            }
                            None => {
                                self.recover(worker_id, None, None);
                                break;
                            }
                            _ => {}
                        }
                    }
                }
            }
            ShardCmd::Remove { worker_id } => {
                self.writer.remove_worker(worker_id);
                self.ids.forget_worker(worker_id);
                self.recovering.remove(&worker_id);
                self.announced.remove(&worker_id);
                self.registered.retain(|w| w.worker_id != worker_id);
                self.map.release(worker_id);
                self.stats.workers_removed += 1;
                self.summaries.touch_worker(worker_id);
                // Routing drops a removed worker as soon as it can see it gone.
                self.publish();
            }
            ShardCmd::Register { workers } => {
                for w in workers {
                    if self.registered.insert(w) {
                        self.summarize(w);
                    }
                }
                // Routable as soon as the routing API can see it.
                self.publish();
            }
            ShardCmd::Snapshot { reply } => {
                let part = self.snapshot_part(rx);
                let _ = reply.send(part);
            }
            ShardCmd::Barrier { reply } => {
                let _ = reply.send(());
            }
            ShardCmd::Stop => return Flow::Stop,
        }
        Flow::Go
    }

    /// This shard's state for a snapshot, dumped a worker at a time: between two workers
    /// the shard applies the events (and other commands) that arrived meanwhile, so it
    /// pauses for one worker's dump at a time rather than for the whole shard's. Each
    /// worker's record (last event id, publisher) is taken with its dump, so every worker
    /// is consistent in itself; a later worker may include events dispatched after the
    /// snapshot was asked for, and replaying those after a restore skips them as
    /// duplicates by their event ids. Workers waiting for a recovery answer are left out:
    /// their state is incomplete, and a restarted router that does not know them loads
    /// them afresh (a dump) at their next announcement. So are workers whose numbering was
    /// reset during the dump (a restart, or a removal and a new process): the stream past
    /// the snapshot's position still holds their old process's events, which would not
    /// replay as duplicates over the new process's record; left out, the replay rebuilds
    /// them and the new process's first event resets them as it did live. A second
    /// snapshot or a stop that arrives during the dump is carried out after it.
    pub(super) fn snapshot_part(&mut self, rx: &flume::Receiver<ShardCmd>) -> ShardPart {
        let mut part = ShardPart {
            workers: Vec::new(),
            events: Vec::new(),
            lower: Vec::new(),
            pool: Vec::new(),
        };
        // Once a stop is taken (or was already waiting), everything after it waits too.
        let mut stop = self.deferred.iter().any(|c| matches!(c, ShardCmd::Stop));
        let listed: Vec<(WorkerDp, Option<u64>, Option<u64>)> = self
            .writer
            .workers()
            .into_iter()
            .map(|s| {
                (
                    s.worker,
                    self.ids.publisher(s.worker),
                    self.ids.last(s.worker),
                )
            })
            .collect();
        for (i, (w, publisher, last)) in listed.into_iter().enumerate() {
            if i > 0 {
                // What arrived while the previous worker was dumped (not what keeps
                // arriving: a bounded drain, so a busy stream cannot starve the dump).
                for _ in 0..rx.len() {
                    match rx.try_recv() {
                        Ok(cmd @ (ShardCmd::Snapshot { .. } | ShardCmd::Stop)) => {
                            stop |= matches!(cmd, ShardCmd::Stop);
                            self.deferred.push_back(cmd);
                        }
                        Ok(cmd) if !stop => {
                            let _ = self.command(cmd, rx);
                        }
                        Ok(cmd) => self.deferred.push_back(cmd),
                        Err(_) => break,
                    }
                }
            }
            if self.recovering.contains_key(&w.worker_id) {
                continue;
            }
            // Removed since the list was taken: nothing to dump or record.
            if self.writer.summary(w).is_none() {
                continue;
            }
            // Renumbered since: another publisher, or ids gone back (forgotten included).
            if self.ids.publisher(w) != publisher || self.ids.last(w) < last {
                self.stats.snapshot_skipped_workers += 1;
                tracing::info!(worker = %w, "renumbered during the snapshot: left out of it");
                continue;
            }
            let heartbeat = self.announced.get(&w.worker_id).copied();
            part.workers.push(WorkerRecord {
                worker: w,
                last_event_id: self.ids.last(w),
                publisher: self.ids.publisher(w).unwrap_or(0),
                announced: heartbeat.is_some(),
                heartbeat_ms: heartbeat.unwrap_or(0),
            });
            self.writer.dump_worker(w, &mut part.events);
            self.writer.dump_lower_worker(w, &mut part.lower);
        }
        // The pools after the workers: they carry no event ids, so whatever arrived during
        // the dump is in them (a replay after a restore applies their events again, which
        // changes nothing).
        self.writer.dump_pool(&mut part.pool);
        part
    }

    /// Publishes the summaries of every worker (after a restore).
    pub(super) fn summarize_all(&mut self) {
        for s in self.writer.workers() {
            self.summarize(s.worker);
        }
        self.publish();
    }

    fn recover(&mut self, worker_id: WorkerId, dp_rank: Option<DpRank>, range: Option<(u64, u64)>) {
        self.recovering.entry(worker_id).or_default();
        let _ = self.source.send(SourceCmd::Recover {
            shard: self.index,
            worker_id,
            dp_rank,
            range,
        });
    }

    pub(super) fn handle(&mut self, e: RouterEvent, publisher: u64) {
        // Every tier of a worker's own cache is indexed (lower tiers beside the tree, see
        // `kvrouter_core::index::tiers`), and so is a shared pool's (`cache_owner`), which
        // makes no worker known and has no event-id bookkeeping: its order is its
        // publisher's, and a gap in it can only leave a credit out.
        // The tiers of one worker share its event ids: one publisher numbers them all.
        if e.is_shared_pool() {
            match self.writer.apply_event(&e) {
                Ok(_) => self.stats.pool_events += 1,
                Err(err) => {
                    self.stats.rejected += 1;
                    crate::warn_throttled!(source = %e.worker(), error = %err, "shared-pool event rejected");
                }
            }
            return;
        }
        if !e.is_worker_owned() {
            self.stats.unknown_domain_events += 1;
            crate::warn_throttled!(source = %e.worker(), "event of an unknown residency domain skipped");
            return;
        }
        if let Some(queue) = self.recovering.get_mut(&e.worker_id) {
            queue.push_back((e, publisher));
            return;
        }
        let w = e.worker();
        let id = e.event.event_id;
        // A worker is made known by what it holds (or by discovery): a removal or clear
        // for one never seen would only create a worker with no block, which routing
        // would then offer. Ignored, counted, no state kept.
        let known = self.knows(w);
        if !known && !matches!(e.event.data, KvEventData::Stored(_)) {
            self.unknown_worker(w);
            return;
        }
        match self.ids.verdict(w, id, publisher) {
            Verdict::Apply => self.apply(e, publisher),
            Verdict::Duplicate => self.stats.duplicates += 1,
            Verdict::Restart => {
                tracing::info!(worker = %w, event_id = id, "worker restarted: resetting its state");
                self.stats.restarts += 1;
                self.writer.clear_worker(w);
                self.ids.forget(w);
                self.apply(e, publisher);
            }
            Verdict::Gap { first, last } => {
                self.stats.gaps += 1;
                if self.announced.contains_key(&w.worker_id) {
                    tracing::debug!(worker = %w, first, last, "gap: asking the worker's local indexer");
                    self.recovering
                        .entry(w.worker_id)
                        .or_default()
                        .push_back((e, publisher));
                    self.recover(w.worker_id, Some(w.dp_rank), Some((first, last)));
                } else {
                    crate::warn_throttled!(worker = %w, first, last, "gap in the events of a worker without a local indexer");
                    self.apply(e, publisher);
                }
            }
        }
    }

    fn apply(&mut self, e: RouterEvent, publisher: u64) {
        let w = e.worker();
        let id = e.event.event_id;
        let blocks = e.block_count() as u64;
        let new = !self.knows(w);
        let result = self.writer.apply_event(&e);
        if new && self.writer.summary(w).is_none_or(|s| s.blocks == 0) {
            // A first event that left the worker holding nothing (rejected, or empty).
            if result.is_err() {
                self.stats.rejected += 1;
            }
            self.writer.remove_dp(w);
            self.ids.forget(w);
            self.unknown_worker(w);
            return;
        }
        match result {
            Ok(_) => {
                self.stats.events += 1;
                self.stats.event_blocks += blocks;
            }
            Err(err) => {
                self.stats.rejected += 1;
                crate::warn_throttled!(worker = %w, error = %err, "event rejected");
                if matches!(err, ApplyError::ParentNotFound { .. })
                    && self.announced.contains_key(&w.worker_id)
                {
                    // We are out of sync with this worker: reload its state.
                    self.ids.set(w, id, publisher);
                    self.summarize(w);
                    self.recover(w.worker_id, Some(w.dp_rank), None);
                    return;
                }
            }
        }
        self.ids.set(w, id, publisher);
        self.summarize(w);
    }

    fn summarize(&mut self, w: WorkerDp) {
        self.summaries.touch(w);
    }

    /// Whether `w` has state here: blocks or an event id in the index, a listing from
    /// discovery, or an announced local indexer.
    fn knows(&self, w: WorkerDp) -> bool {
        self.writer.summary(w).is_some()
            || self.registered.contains(&w)
            || self.announced.contains_key(&w.worker_id)
    }

    /// Counts an event that would have made a worker known with nothing to route to, and
    /// gives its shard back when no rank of the worker is known.
    fn unknown_worker(&mut self, w: WorkerDp) {
        self.stats.unknown_worker_events += 1;
        crate::warn_throttled!(
            worker = %w,
            "event for a worker never seen would leave it with no block: ignored"
        );
        let any_rank = self.registered.iter().any(|r| r.worker_id == w.worker_id)
            || self
                .writer
                .workers()
                .iter()
                .any(|s| s.worker.worker_id == w.worker_id);
        if !any_rank {
            self.map.release(w.worker_id);
        }
    }

    fn recovered(&mut self, worker_id: WorkerId, result: Recovered) {
        let pending = self.recovering.remove(&worker_id).unwrap_or_default();
        match result {
            Recovered::Range { publisher, events } => {
                self.stats.recoveries += 1;
                for e in events {
                    let w = e.worker();
                    if self.ids.verdict(w, e.event.event_id, publisher) == Verdict::Apply {
                        self.apply(e, publisher);
                    }
                }
            }
            Recovered::Dump {
                publisher,
                events,
                last_event_ids,
            } => {
                self.stats.dumps += 1;
                self.stats.recoveries += 1;
                for e in events {
                    let w = e.worker();
                    let blocks = e.block_count() as u64;
                    if self.writer.apply_event(&e).is_ok() {
                        self.stats.event_blocks += blocks;
                    }
                    self.summarize(w);
                }
                for (dp, last) in last_event_ids {
                    let w = WorkerDp::new(worker_id, dp);
                    self.ids.set(w, last, publisher);
                    self.summarize(w);
                }
            }
            Recovered::Failed(why) => {
                self.stats.recovery_failures += 1;
                crate::warn_throttled!(worker_id, %why, "recovery failed: applying its events best effort");
                // Accept whatever comes next as the new baseline.
                self.ids.forget_worker(worker_id);
            }
        }
        for (e, publisher) in pending {
            self.handle(e, publisher);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU64;
    use std::time::Instant;

    use kvrouter_core::event::KvCacheEvent;
    use kvrouter_core::hash::{LocalBlockHash, SequenceBlockHash};
    use kvrouter_core::index::tree::TreeIndex;

    use super::*;

    fn core() -> ShardCore {
        let index = TreeIndex::new(1);
        let map = index.shard_map();
        let (mut writers, _) = index.into_parts();
        ShardCore {
            index: 0,
            writer: writers.remove(0),
            ids: EventIds::new(),
            announced: HashMap::new(),
            recovering: HashMap::new(),
            registered: HashSet::new(),
            stats: IngestStats::default(),
            counters: AllCounters::new(2),
            source: flume::unbounded().0,
            summaries: Summaries::new(Arc::default(), Arc::new(AtomicU64::new(0))),
            map,
            latencies: None,
            deferred: VecDeque::new(),
            since_publish: 0,
        }
    }

    /// Event `id` of `worker` storing one block named `name`.
    fn stored(worker: WorkerId, id: u64, name: u64) -> RouterEvent {
        RouterEvent::new(
            worker,
            KvCacheEvent::stored(
                id,
                0,
                None,
                [(LocalBlockHash(name), SequenceBlockHash(name))],
            ),
        )
    }

    fn events(events: Vec<RouterEvent>, publisher: u64) -> ShardCmd {
        ShardCmd::Events {
            events,
            publisher,
            arrived: Instant::now(),
        }
    }

    fn workers_of(part: &ShardPart) -> Vec<(WorkerId, Option<u64>)> {
        part.workers
            .iter()
            .map(|r| (r.worker.worker_id, r.last_event_id))
            .collect()
    }

    #[test]
    fn a_snapshot_applies_arrivals_between_workers_and_records_each_with_its_dump() {
        let mut c = core();
        for w in [1, 2] {
            c.handle(stored(w, 0, 10 * w), 100);
        }
        let (tx, rx) = flume::unbounded();
        // Arrives while worker 1 is dumped: applied before worker 2's dump, which holds it.
        tx.send(events(vec![stored(2, 1, 21)], 100)).unwrap();
        let part = c.snapshot_part(&rx);
        assert_eq!(workers_of(&part), vec![(1, Some(0)), (2, Some(1))]);
        let blocks: usize = part.events.iter().map(|e| e.block_count()).sum();
        assert_eq!(blocks, 3);
        assert!(rx.is_empty() && c.deferred.is_empty());
    }

    #[test]
    fn a_worker_renumbered_during_the_dump_is_left_out() {
        let mut c = core();
        for w in [1, 2] {
            for id in 0..5 {
                c.handle(stored(w, id, 10 * w + id), 100);
            }
        }
        let (tx, rx) = flume::unbounded();
        // Worker 2 restarts (a new publisher numbering from 0) while worker 1 is dumped.
        tx.send(events(vec![stored(2, 0, 99)], 200)).unwrap();
        let part = c.snapshot_part(&rx);
        assert_eq!(workers_of(&part), vec![(1, Some(4))]);
        assert!(part.events.iter().all(|e| e.worker_id == 1));
        assert_eq!(c.stats.snapshot_skipped_workers, 1);
        assert_eq!(c.stats.restarts, 1);
    }

    #[test]
    fn a_stop_during_the_dump_waits_with_everything_after_it() {
        let mut c = core();
        for w in [1, 2] {
            c.handle(stored(w, 0, 10 * w), 100);
        }
        let (tx, rx) = flume::unbounded();
        tx.send(ShardCmd::Stop).unwrap();
        tx.send(events(vec![stored(2, 1, 21)], 100)).unwrap();
        let part = c.snapshot_part(&rx);
        // The event after the stop was not applied: worker 2 is dumped as it was.
        assert_eq!(workers_of(&part), vec![(1, Some(0)), (2, Some(0))]);
        assert_eq!(c.deferred.len(), 2);
        assert!(matches!(c.deferred.pop_front(), Some(ShardCmd::Stop)));
        assert!(matches!(
            c.deferred.pop_front(),
            Some(ShardCmd::Events { .. })
        ));
    }
}
