//! The slot manager: the router's own prediction of each worker's load.
//!
//! Per worker it keeps the active requests and their blocks (a block shared by several
//! active requests — a common prompt prefix — counts once), and the prefill tokens of
//! requests that have not produced their first token yet. A request is added when routed,
//! its prefill charge is released at its first token, and everything is released when it
//! finishes; requests that never report back expire after `stale_after_ms`.
//!
//! Replica routers feed each other's decisions into the same structure (replica sync), so
//! every replica predicts the whole fleet's load. Clock-free: times are arguments.
//!
//! A worker's active blocks are a union of whole prompts' sequence hashes, each a chain
//! from the prompt's first block: if one holds a prompt's block `i`, it holds its blocks
//! `0..i` too (block `i`'s hash names the whole prefix). So how much of a new prompt a
//! worker already holds is a prefix of it, found by binary search: pricing a request of
//! `n` blocks costs `O(log n)` probes per busy worker, not `n` (a huge prompt must not stall
//! every other decision).
//!
//! A worker whose last request is released keeps its (empty) block map, so that a worker
//! that goes idle between requests does not allocate and free a map per request; the map
//! goes when the worker is removed, and its memory when it was grown past
//! [`KEEP_IDLE_CAPACITY`] (a huge prompt must not leave megabytes behind per worker); a busy
//! worker's map shrinks when it holds less than a quarter of its capacity.
//!
//! Memory is bounded by a block budget ([`Slots::set_block_budget`]): when a new request's
//! blocks would take the blocks all requests hold past it, the oldest requests holding
//! blocks are *shed*: their blocks are released while they stay active (their request and
//! prefill counts remain, their free still finds them). A client that routes and never
//! frees thus costs others precision about its own old requests, never their admission.
//! Shedding whole requests keeps every worker's held set a union of whole chains, so it
//! stays prefix-closed.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};

use crate::hash::MixBuildHasher;
use crate::index::OverlapScores;
use crate::policy::Candidate;
use crate::worker::{WorkerDp, WorkerId};

type Map<K, V> = HashMap<K, V, MixBuildHasher>;

/// An idle worker's block map keeps its memory up to this many entries.
pub const KEEP_IDLE_CAPACITY: usize = 4_096;

/// Why a slot operation was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SlotError {
    /// No active request has this id.
    #[error("unknown request {0:?}")]
    UnknownRequest(String),
    /// A request with this id is already active.
    #[error("request {0:?} is already active")]
    DuplicateRequest(String),
    /// The manager holds as many requests as it may.
    #[error("{max} requests are active already")]
    Full {
        /// The limit.
        max: usize,
    },
}

/// Load of one worker as the slot manager sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct WorkerLoad {
    /// Distinct blocks of its active requests.
    pub active_blocks: u64,
    /// Prompt tokens of its requests still in prefill.
    pub active_prefill_tokens: u64,
    /// Active requests.
    pub active_requests: u64,
}

#[derive(Debug, Default)]
struct WorkerSlots {
    blocks: Map<u64, u32>,
    prefill_tokens: u64,
    requests: u64,
}

#[derive(Debug)]
struct Active {
    worker: WorkerDp,
    blocks: Vec<u64>,
    prefill_tokens: u64,
    last_ms: u64,
    /// Order of its add (the key in [`Slots::holding`] while it holds blocks).
    seq: u64,
}

/// See the [module docs](self).
#[derive(Debug)]
pub struct Slots {
    stale_after_ms: u64,
    workers: Map<WorkerDp, WorkerSlots>,
    requests: HashMap<String, Active>,
    /// Active requests from which a worker counts as full ([`Self::is_full`]).
    worker_cap: u64,
    /// Workers with `worker_cap` or more active requests.
    full: usize,
    /// Blocks of all active requests together (a block shared by two requests counts
    /// twice: this is what their lists hold).
    held_blocks: u64,
    /// Most `held_blocks` before the oldest requests are shed.
    block_budget: u64,
    /// Requests holding blocks, oldest first (by `Active::seq`).
    holding: BTreeMap<u64, String>,
    next_seq: u64,
    /// Requests whose blocks were shed, ever.
    shed_requests: u64,
}

/// The length of the longest prefix of `blocks` (a chain of sequence hashes) that `held`
/// holds, assuming what it holds is prefix-closed (see the [module docs](self)).
fn held_prefix(blocks: &[u64], held: &Map<u64, u32>) -> usize {
    if held.is_empty() {
        return 0;
    }
    // Invariant: blocks[..lo] held, blocks[hi..] not.
    let (mut lo, mut hi) = (0, blocks.len());
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if held.contains_key(&blocks[mid]) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

impl Slots {
    /// An empty manager; requests expire `stale_after_ms` after their last update.
    pub fn new(stale_after_ms: u64) -> Self {
        Self {
            stale_after_ms,
            workers: Map::default(),
            requests: HashMap::new(),
            worker_cap: u64::MAX,
            full: 0,
            held_blocks: 0,
            block_budget: u64::MAX,
            holding: BTreeMap::new(),
            next_seq: 0,
            shed_requests: 0,
        }
    }

    /// Counts a worker as full from `cap` active requests on ([`Self::is_full`]).
    pub fn set_worker_cap(&mut self, cap: u64) {
        self.worker_cap = cap.max(1);
        self.recount_full();
    }

    fn recount_full(&mut self) {
        let cap = self.worker_cap;
        self.full = self.workers.values().filter(|w| w.requests >= cap).count();
    }

    /// Sheds the oldest requests' blocks whenever the blocks all requests hold would pass
    /// `max` (see the [module docs](self)); a request of more than `max` blocks is held
    /// without its blocks.
    pub fn set_block_budget(&mut self, max: u64) {
        self.block_budget = max;
        self.shed_to(0);
    }

    /// Sheds the oldest requests until `more` blocks fit in the budget.
    fn shed_to(&mut self, more: u64) {
        while self.held_blocks.saturating_add(more) > self.block_budget {
            let Some((_, id)) = self.holding.pop_first() else {
                return;
            };
            let Some(r) = self.requests.get_mut(&id) else {
                debug_assert!(false, "a holding request is active");
                continue;
            };
            let blocks = std::mem::take(&mut r.blocks);
            let worker = r.worker;
            self.held_blocks -= blocks.len() as u64;
            self.shed_requests += 1;
            if let Some(w) = self.workers.get_mut(&worker) {
                Self::release_blocks(w, &blocks);
            }
        }
    }

    /// Requests whose blocks were shed to stay within the budget, ever.
    pub fn shed_requests(&self) -> u64 {
        self.shed_requests
    }

    /// Whether some worker is full (cheap: a counter).
    pub fn any_full(&self) -> bool {
        self.full > 0
    }

    /// Whether `worker` has the cap's number of active requests or more.
    pub fn is_full(&self, worker: WorkerDp) -> bool {
        self.workers
            .get(&worker)
            .is_some_and(|w| w.requests >= self.worker_cap)
    }

    /// Adds a routed request: its blocks (sequence hashes of its prompt) and the prefill
    /// tokens to charge until its first token.
    pub fn add(
        &mut self,
        request_id: &str,
        worker: WorkerDp,
        blocks: Vec<u64>,
        prefill_tokens: u64,
        now_ms: u64,
    ) -> Result<(), SlotError> {
        if self.requests.contains_key(request_id) {
            return Err(SlotError::DuplicateRequest(request_id.into()));
        }
        let blocks = if blocks.len() as u64 > self.block_budget {
            self.shed_requests += 1;
            Vec::new()
        } else {
            self.shed_to(blocks.len() as u64);
            blocks
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        if !blocks.is_empty() {
            self.holding.insert(seq, request_id.into());
        }
        let w = self.workers.entry(worker).or_default();
        w.blocks.reserve(blocks.len());
        for &b in &blocks {
            *w.blocks.entry(b).or_insert(0) += 1;
        }
        w.prefill_tokens += prefill_tokens;
        w.requests += 1;
        if w.requests == self.worker_cap {
            self.full += 1;
        }
        self.held_blocks += blocks.len() as u64;
        self.requests.insert(
            request_id.into(),
            Active {
                worker,
                blocks,
                prefill_tokens,
                last_ms: now_ms,
                seq,
            },
        );
        Ok(())
    }

    /// The request produced its first token: its prefill charge is released.
    pub fn mark_prefill_done(
        &mut self,
        request_id: &str,
        now_ms: u64,
    ) -> Result<WorkerDp, SlotError> {
        let r = self
            .requests
            .get_mut(request_id)
            .ok_or_else(|| SlotError::UnknownRequest(request_id.into()))?;
        let w = self
            .workers
            .get_mut(&r.worker)
            .expect("a request's worker has slots");
        w.prefill_tokens -= r.prefill_tokens;
        r.prefill_tokens = 0;
        r.last_ms = now_ms;
        Ok(r.worker)
    }

    /// The request finished (or was cancelled): everything it held is released.
    pub fn free(&mut self, request_id: &str) -> Result<WorkerDp, SlotError> {
        let r = self
            .requests
            .remove(request_id)
            .ok_or_else(|| SlotError::UnknownRequest(request_id.into()))?;
        self.release(&r);
        Ok(r.worker)
    }

    fn release_blocks(w: &mut WorkerSlots, blocks: &[u64]) {
        for &b in blocks {
            if let Entry::Occupied(mut e) = w.blocks.entry(b) {
                *e.get_mut() -= 1;
                if *e.get() == 0 {
                    e.remove();
                }
            }
        }
        // A map that held a huge load keeps no more than four times what it holds now
        // (amortised: half its entries go between two shrinks), so that its memory follows
        // the load instead of its high-water mark.
        let (len, cap) = (w.blocks.len(), w.blocks.capacity());
        if cap > KEEP_IDLE_CAPACITY && len < cap / 4 {
            w.blocks.shrink_to(len * 2);
        }
    }

    fn release(&mut self, r: &Active) {
        if !r.blocks.is_empty() {
            self.held_blocks -= r.blocks.len() as u64;
            self.holding.remove(&r.seq);
        }
        let Some(w) = self.workers.get_mut(&r.worker) else {
            return;
        };
        Self::release_blocks(w, &r.blocks);
        w.prefill_tokens -= r.prefill_tokens;
        if w.requests == self.worker_cap {
            self.full -= 1;
        }
        w.requests -= 1;
        if w.requests == 0 {
            debug_assert!(w.blocks.is_empty() && w.prefill_tokens == 0);
            if w.blocks.capacity() > KEEP_IDLE_CAPACITY {
                w.blocks = Map::default();
            } else {
                // Empty already; this resets the removals' tombstones, keeping the capacity.
                w.blocks.clear();
            }
        }
    }

    /// Releases requests not updated for `stale_after_ms`; returns how many.
    pub fn expire(&mut self, now_ms: u64) -> usize {
        let stale: Vec<String> = self
            .requests
            .iter()
            .filter(|(_, r)| now_ms.saturating_sub(r.last_ms) > self.stale_after_ms)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &stale {
            if let Some(r) = self.requests.remove(id) {
                self.release(&r);
            }
        }
        stale.len()
    }

    /// Drops every request of a worker, all dp ranks (it left the fleet).
    pub fn remove_worker(&mut self, worker_id: WorkerId) {
        self.requests.retain(|_, r| r.worker.worker_id != worker_id);
        self.workers.retain(|w, _| w.worker_id != worker_id);
        self.recount();
    }

    /// Drops every request of one (worker, dp rank).
    pub fn remove(&mut self, worker: WorkerDp) {
        self.requests.retain(|_, r| r.worker != worker);
        self.workers.remove(&worker);
        self.recount();
    }

    fn recount(&mut self) {
        self.recount_full();
        self.held_blocks = self.requests.values().map(|r| r.blocks.len() as u64).sum();
        let requests = &self.requests;
        self.holding.retain(|_, id| requests.contains_key(id));
    }

    /// Blocks the active requests hold in all (each request's whole list: what memory
    /// they pin).
    pub fn held_blocks(&self) -> u64 {
        self.held_blocks
    }

    /// A worker's load.
    pub fn load(&self, worker: WorkerDp) -> WorkerLoad {
        self.workers
            .get(&worker)
            .map_or_else(WorkerLoad::default, |w| WorkerLoad {
                active_blocks: w.blocks.len() as u64,
                active_prefill_tokens: w.prefill_tokens,
                active_requests: w.requests,
            })
    }

    /// The worker's active blocks if a request with `blocks` were added to it.
    /// `blocks` is a prompt's chain of sequence hashes.
    pub fn potential_blocks(&self, worker: WorkerDp, blocks: &[u64]) -> u64 {
        match self.workers.get(&worker) {
            Some(w) => (w.blocks.len() + blocks.len() - held_prefix(blocks, &w.blocks)) as u64,
            None => blocks.len() as u64,
        }
    }

    /// The cost function's view of each of `workers` for a request whose sequence hashes
    /// are `blocks` (distinct, as the sequence hashes of one prompt are): loads and potential
    /// decode blocks from here, device overlaps from `overlaps`.
    pub fn candidates(
        &self,
        workers: &[WorkerDp],
        blocks: &[u64],
        overlaps: &OverlapScores,
    ) -> Vec<Candidate> {
        // [`Self::potential_blocks`] for every worker at once. A request's sequence hashes
        // are distinct (each names a different prefix), so no deduplication is needed: busy
        // workers search the prefix they hold, idle ones add them all.
        debug_assert!(
            {
                let mut b = blocks.to_vec();
                b.sort_unstable();
                b.windows(2).all(|p| p[0] != p[1])
            },
            "sequence hashes of one request repeat"
        );
        let n = blocks.len() as u64;
        let busy: Map<WorkerDp, u64> = self
            .workers
            .iter()
            .filter(|(_, s)| s.requests > 0)
            .map(|(&w, s)| {
                let new = blocks.len() - held_prefix(blocks, &s.blocks);
                (w, (s.blocks.len() + new) as u64)
            })
            .collect();
        let potential = |w: WorkerDp| busy.get(&w).copied().unwrap_or(n);
        workers
            .iter()
            .map(|&w| {
                let load = self.load(w);
                Candidate {
                    worker: w,
                    active_prefill_tokens: load.active_prefill_tokens,
                    active_decode_blocks: load.active_blocks,
                    potential_decode_blocks: potential(w),
                    device_overlap_blocks: overlaps.get(w),
                    ..Default::default()
                }
            })
            .collect()
    }

    /// Workers with active requests.
    pub fn workers(&self) -> impl Iterator<Item = (WorkerDp, WorkerLoad)> + '_ {
        self.workers
            .iter()
            .filter(|(_, s)| s.requests > 0)
            .map(|(&w, _)| (w, self.load(w)))
    }

    /// Active requests.
    pub fn active_requests(&self) -> usize {
        self.requests.len()
    }

    /// The worker serving `request_id`.
    pub fn worker_of(&self, request_id: &str) -> Option<WorkerDp> {
        self.requests.get(request_id).map(|r| r.worker)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const A: WorkerDp = WorkerDp::new(1, 0);

    #[test]
    fn candidates_combine_loads_and_overlaps() {
        let b = WorkerDp::new(2, 0);
        let mut s = Slots::new(1000);
        s.add("r1", A, vec![1, 2, 3], 300, 0).unwrap();
        let mut overlaps = OverlapScores::new();
        overlaps.push(b, 2);
        overlaps.finish();
        let c = s.candidates(&[A, b], &[1, 2, 7], &overlaps);
        assert_eq!(c.len(), 2);
        assert_eq!(
            (
                c[0].worker,
                c[0].active_prefill_tokens,
                c[0].active_decode_blocks
            ),
            (A, 300, 3)
        );
        // A holds 1 and 2 already: only 7 is new; B is idle and takes all three.
        assert_eq!(
            (c[0].potential_decode_blocks, c[1].potential_decode_blocks),
            (4, 3)
        );
        assert_eq!(
            (c[0].device_overlap_blocks, c[1].device_overlap_blocks),
            (0, 2)
        );
    }

    #[test]
    fn the_budget_sheds_the_oldest_holders_first() {
        let b = WorkerDp::new(2, 0);
        let mut s = Slots::new(1000);
        s.set_block_budget(6);
        s.add("r1", A, vec![1, 2, 3], 30, 0).unwrap();
        s.add("r2", b, vec![7, 8], 20, 1).unwrap();
        s.add("r3", A, vec![1, 2], 10, 2).unwrap();
        assert_eq!(s.held_blocks(), 4);
        // 3 + 2 + 2 = 7 > 6: r1, the oldest, was shed; r3 still holds 1 and 2 on A.
        assert_eq!(s.shed_requests(), 1);
        assert_eq!(
            s.load(A),
            WorkerLoad {
                active_blocks: 2,
                active_prefill_tokens: 40,
                active_requests: 2
            }
        );
        assert_eq!(s.potential_blocks(A, &[1, 2, 3]), 3);
        // Freeing a shed request releases what it still holds, and only that.
        assert_eq!(s.free("r1"), Ok(A));
        assert_eq!(s.load(A).active_blocks, 2);
        assert_eq!(s.held_blocks(), 4);
        // Larger than the whole budget: held without blocks, nobody shed for it.
        s.add("big", b, (100..110).collect(), 0, 3).unwrap();
        assert_eq!((s.held_blocks(), s.shed_requests()), (4, 2));
        assert_eq!(s.load(b).active_requests, 2);
        // Lowering the budget sheds at once, oldest first (r2, then r3).
        s.set_block_budget(2);
        assert_eq!(s.held_blocks(), 2);
        assert_eq!(s.load(b).active_blocks, 0);
        assert_eq!(s.load(A).active_blocks, 2);
        s.remove(A);
        assert_eq!(s.held_blocks(), 0);
        for id in ["r2", "big"] {
            assert_eq!(s.free(id), Ok(b));
        }
        assert_eq!(s.active_requests(), 0);
    }

    #[test]
    fn an_idle_worker_gives_a_huge_map_back() {
        let mut s = Slots::new(1000);
        s.add("huge", A, (0..100_000).collect(), 0, 0).unwrap();
        s.add("small", A, vec![0, 1], 0, 0).unwrap();
        s.free("huge").unwrap();
        assert!(s.workers[&A].blocks.capacity() < 100);
        s.free("small").unwrap();
        s.add("huge", A, (0..100_000).collect(), 0, 0).unwrap();
        s.free("huge").unwrap();
        assert_eq!(s.workers[&A].blocks.capacity(), 0);
        s.add("small", A, vec![1, 2], 0, 0).unwrap();
        s.free("small").unwrap();
        assert!(s.workers[&A].blocks.capacity() > 0);
    }

    #[test]
    fn shared_blocks_count_once_and_loads_move() {
        let mut s = Slots::new(1000);
        s.add("r1", A, vec![1, 2, 3], 300, 0).unwrap();
        s.add("r2", A, vec![1, 2, 4], 100, 0).unwrap();
        assert_eq!(
            s.load(A),
            WorkerLoad {
                active_blocks: 4,
                active_prefill_tokens: 400,
                active_requests: 2
            }
        );
        assert_eq!(s.potential_blocks(A, &[1, 5, 6]), 6);
        // `candidates` counts the same, for every worker at once.
        let idle = WorkerDp::new(9, 0);
        let c = s.candidates(&[A, idle], &[1, 5, 6], &OverlapScores::new());
        let potential: Vec<u64> = c.iter().map(|c| c.potential_decode_blocks).collect();
        assert_eq!(potential, [6, 3]);
        assert_eq!(potential[0], s.potential_blocks(A, &[1, 5, 6]));
        s.mark_prefill_done("r1", 10).unwrap();
        assert_eq!(s.load(A).active_prefill_tokens, 100);
        s.free("r1").unwrap();
        assert_eq!(
            s.load(A),
            WorkerLoad {
                active_blocks: 3,
                active_prefill_tokens: 100,
                active_requests: 1
            }
        );
        assert_eq!(s.free("r1"), Err(SlotError::UnknownRequest("r1".into())));
        assert_eq!(
            s.add("r2", A, vec![], 0, 0),
            Err(SlotError::DuplicateRequest("r2".into()))
        );
        s.free("r2").unwrap();
        assert_eq!(s.load(A), WorkerLoad::default());
        assert_eq!(s.workers().count(), 0);
        // The idle worker keeps its empty map but counts as idle everywhere, and takes
        // requests again.
        let c = s.candidates(&[A], &[1, 2], &OverlapScores::new());
        assert_eq!(
            (c[0].active_decode_blocks, c[0].potential_decode_blocks),
            (0, 2)
        );
        s.add("r3", A, vec![1, 2], 5, 0).unwrap();
        assert_eq!(
            s.load(A),
            WorkerLoad {
                active_blocks: 2,
                active_prefill_tokens: 5,
                active_requests: 1
            }
        );
        assert_eq!(s.workers().map(|(w, _)| w).collect::<Vec<_>>(), [A]);
    }

    /// The held prefix found by binary search is the exact count of held blocks whenever
    /// what a worker holds is whole prompts' chains.
    #[test]
    fn held_prefix_is_exact_on_chains() {
        use crate::hash::{LocalBlockHash, sequence_hashes};
        let chain = |v: &[u64]| -> Vec<u64> {
            let l: Vec<LocalBlockHash> = v.iter().copied().map(LocalBlockHash).collect();
            sequence_hashes(&l).into_iter().map(|h| h.0).collect()
        };
        let mut rng = crate::policy::Rng::new(7);
        for round in 0..200 {
            let mut s = Slots::new(1000);
            // A few prompts sharing prefixes of random lengths.
            let base: Vec<u64> = (0..64).map(|_| rng.below(4) as u64).collect();
            for r in 0..rng.below(5) {
                let keep = rng.below(64);
                let mut p = base[..keep].to_vec();
                p.extend((0..rng.below(40)).map(|_| 100 + rng.below(1000) as u64));
                s.add(&format!("{round}-{r}"), A, chain(&p), 0, 0).unwrap();
            }
            let keep = rng.below(64);
            let mut q = base[..keep].to_vec();
            q.extend((0..rng.below(40)).map(|_| 5000 + rng.below(1000) as u64));
            let q = chain(&q);
            let held = s.workers.get(&A).map(|w| &w.blocks);
            let exact = held.map_or(0, |h| q.iter().filter(|b| h.contains_key(b)).count());
            let active = s.load(A).active_blocks;
            assert_eq!(s.potential_blocks(A, &q), active + (q.len() - exact) as u64);
        }
    }

    #[test]
    fn full_workers_are_counted() {
        let mut s = Slots::new(1000);
        s.set_worker_cap(2);
        let b = WorkerDp::new(2, 0);
        s.add("a1", A, vec![1], 0, 0).unwrap();
        assert!(!s.any_full());
        s.add("a2", A, vec![2], 0, 0).unwrap();
        s.add("a3", A, vec![3], 0, 0).unwrap();
        s.add("b1", b, vec![1], 0, 0).unwrap();
        assert!(s.any_full() && s.is_full(A) && !s.is_full(b));
        s.free("a3").unwrap();
        assert!(s.is_full(A));
        s.free("a2").unwrap();
        assert!(!s.any_full() && !s.is_full(A));
        s.add("a4", A, vec![4], 0, 0).unwrap();
        assert!(s.any_full());
        s.remove(A);
        assert!(!s.any_full());
    }

    #[test]
    fn stale_requests_expire() {
        let mut s = Slots::new(100);
        s.add("old", A, vec![1], 10, 0).unwrap();
        s.add("new", A, vec![2], 10, 90).unwrap();
        assert_eq!(s.expire(150), 1);
        assert_eq!(s.load(A).active_blocks, 1);
        assert_eq!(s.worker_of("new"), Some(A));
        s.remove_worker(1);
        assert_eq!(s.active_requests(), 0);
    }
}
