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
//! **Counting by prefix, not by block.** Since the held set is a union of chains, it is kept
//! as a tree: each held block records its parent (the block before it in the chain that
//! added it) and a count of what keeps it: its held children plus the requests that end
//! there (a request *pins* its last block). Adding a prompt inserts only the blocks past the
//! prefix the worker holds and pins one block; releasing it unpins that block and removes
//! blocks upward while nothing keeps them. So a session's next turn, which repeats its
//! previous prompt and adds a few blocks, costs those few blocks, not its whole length (an
//! agentic prompt is about 1,900 blocks), and `active_blocks` is still the number of
//! distinct blocks. Input that is not a chain (a hash seen before under another parent)
//! stays consistent: the request then pins each stretch it built where it joins a held
//! block, and every pin is undone on release.
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

use smallvec::SmallVec;

use crate::hash::MixBuildHasher;
use crate::index::OverlapScores;
use crate::policy::Candidate;
use crate::worker::WorkerDp;

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

/// A held block: its parent in the chain that added it, and what keeps it (held children
/// and pins of requests ending at it).
#[derive(Debug, Clone, Copy)]
struct Held {
    parent: u64,
    has_parent: bool,
    keeps: u32,
}

#[derive(Debug, Default)]
struct WorkerSlots {
    blocks: Map<u64, Held>,
    prefill_tokens: u64,
    requests: u64,
}

impl WorkerSlots {
    /// Adds a request's chain: the blocks past the held prefix, then its pins (returned).
    /// One map insert per new block: a new block is inserted already kept once, for the
    /// child that follows it or, for the last, the request's pin.
    fn hold(&mut self, blocks: &[u64]) -> SmallVec<[u64; 1]> {
        let mut pins = SmallVec::new();
        let h = held_prefix(blocks, &self.blocks);
        let mut parent = h.checked_sub(1).map(|i| blocks[i]);
        // Whether `parent` was inserted by this call (and so holds a provisional keep).
        let mut parent_new = false;
        self.blocks.reserve(blocks.len() - h);
        for &b in &blocks[h..] {
            match self.blocks.entry(b) {
                Entry::Occupied(_) => {
                    // Not a chain: b is held under another parent. What was built so far is
                    // kept by a pin of its own (a new parent's provisional keep becomes it).
                    match parent {
                        Some(p) if parent_new => pins.push(p),
                        Some(p) => self.pin(p, &mut pins),
                        None => {}
                    }
                    parent_new = false;
                }
                Entry::Vacant(e) => {
                    e.insert(Held {
                        parent: parent.unwrap_or(0),
                        has_parent: parent.is_some(),
                        keeps: 1,
                    });
                    // A new parent's provisional keep is this child; a held one gains it.
                    if !parent_new
                        && let Some(p) = parent
                        && let Some(ph) = self.blocks.get_mut(&p)
                    {
                        ph.keeps += 1;
                    }
                    parent_new = true;
                }
            }
            parent = Some(b);
        }
        match parent {
            Some(last) if parent_new => pins.push(last),
            Some(last) => self.pin(last, &mut pins),
            None => {}
        }
        pins
    }

    fn pin(&mut self, b: u64, pins: &mut SmallVec<[u64; 1]>) {
        if let Some(h) = self.blocks.get_mut(&b) {
            h.keeps += 1;
            pins.push(b);
        }
    }

    /// Undoes [`Self::hold`] for a request whose prompt was `blocks`: unpins each pin and
    /// removes blocks upward while nothing keeps them, then shrinks a map that held a huge
    /// load. The last pin is the prompt's last block, and for a chain the blocks above it
    /// are the prompt's own in reverse: they are walked from the list (whose next key is
    /// known before the current lookup ends, so the lookups overlap) rather than from each
    /// removed block's parent.
    fn release(&mut self, pins: &[u64], blocks: &[u64]) {
        let Some((&last, others)) = pins.split_last() else {
            return;
        };
        for &pin in others {
            self.unkeep_from(pin);
        }
        debug_assert_eq!(blocks.last(), Some(&last));
        for i in (0..blocks.len()).rev() {
            match self.unkeep(blocks[i]) {
                None => break,
                Some(p) if i > 0 && blocks[i - 1] == p => {}
                Some(p) => {
                    // Not the prompt's own parent (not a chain): follow the stored one.
                    self.unkeep_from(p);
                    break;
                }
            }
        }
        // A map that held a huge load keeps no more than four times what it holds now
        // (amortised: half its entries go between two shrinks), so that its memory follows
        // the load instead of its high-water mark.
        let (len, cap) = (self.blocks.len(), self.blocks.capacity());
        if cap > KEEP_IDLE_CAPACITY && len < cap / 4 {
            self.blocks.shrink_to(len * 2);
        }
    }

    /// Drops one keep of block `b`, and upward from it while nothing keeps a block.
    fn unkeep_from(&mut self, b: u64) {
        let mut next = Some(b);
        while let Some(b) = next {
            next = self.unkeep(b);
        }
    }

    /// Drops one keep of block `b`; when nothing keeps it any more it is removed, and its
    /// parent (which loses a keep in turn) is returned.
    fn unkeep(&mut self, b: u64) -> Option<u64> {
        let Entry::Occupied(mut e) = self.blocks.entry(b) else {
            debug_assert!(false, "a kept block is held");
            return None;
        };
        let h = e.get_mut();
        debug_assert!(h.keeps > 0, "a held block is kept");
        h.keeps = h.keeps.saturating_sub(1);
        if h.keeps > 0 {
            return None;
        }
        let h = e.remove();
        h.has_parent.then_some(h.parent)
    }
}

#[derive(Debug)]
struct Active {
    worker: WorkerDp,
    /// The blocks its prompt named (what the budget counts, and what release walks).
    blocks: Vec<u64>,
    /// Its pins in its worker's held tree (usually one: its last block).
    pins: SmallVec<[u64; 1]>,
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
    /// Blocks of all active requests together, as their prompts named them (a block shared
    /// by two requests counts twice): what the budget bounds. The memory held is less: one
    /// entry per distinct block per worker, nothing per request beyond its pins.
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
fn held_prefix(blocks: &[u64], held: &Map<u64, Held>) -> usize {
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
            let pins = std::mem::take(&mut r.pins);
            let blocks = std::mem::take(&mut r.blocks);
            let worker = r.worker;
            self.held_blocks -= blocks.len() as u64;
            self.shed_requests += 1;
            if let Some(w) = self.workers.get_mut(&worker) {
                w.release(&pins, &blocks);
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
        let pins = w.hold(&blocks);
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
                pins,
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

    fn release(&mut self, r: &Active) {
        if !r.blocks.is_empty() {
            self.held_blocks -= r.blocks.len() as u64;
            self.holding.remove(&r.seq);
        }
        let Some(w) = self.workers.get_mut(&r.worker) else {
            return;
        };
        w.release(&r.pins, &r.blocks);
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

    /// Blocks the active requests hold in all (each request's whole list, shared blocks
    /// once per request: what the budget bounds).
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
        // Per busy worker: (potential blocks, the prefix its active requests hold).
        let busy: Map<WorkerDp, (u64, u32)> = self
            .workers
            .iter()
            .filter(|(_, s)| s.requests > 0)
            .map(|(&w, s)| {
                let held = held_prefix(blocks, &s.blocks);
                let new = blocks.len() - held;
                (w, ((s.blocks.len() + new) as u64, held as u32))
            })
            .collect();
        let busy = |w: WorkerDp| busy.get(&w).copied().unwrap_or((n, 0));
        workers
            .iter()
            .map(|&w| {
                let load = self.load(w);
                let (potential, held) = busy(w);
                Candidate {
                    worker: w,
                    active_prefill_tokens: load.active_prefill_tokens,
                    active_decode_blocks: load.active_blocks,
                    potential_decode_blocks: potential,
                    device_overlap_blocks: overlaps.get(w),
                    inflight_overlap_blocks: held,
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
    use proptest::prelude::*;

    const A: WorkerDp = WorkerDp::new(1, 0);

    #[derive(Debug, Clone)]
    enum SlotOp {
        /// A request on worker `w` whose prompt is `path` (as a chain, or as the raw
        /// symbols, which is no chain).
        Add { w: u8, path: Vec<u8>, chain: bool },
        /// Frees the `i`-th active request (modulo their number).
        Free { i: usize },
        /// Expires every request older than `age`.
        Expire { age: u64 },
    }

    fn slot_op() -> impl Strategy<Value = SlotOp> {
        prop_oneof![
            6 => (0..3u8, proptest::collection::vec(0..3u8, 0..10), proptest::bool::weighted(0.85))
                .prop_map(|(w, path, chain)| SlotOp::Add { w, path, chain }),
            4 => any::<usize>().prop_map(|i| SlotOp::Free { i }),
            1 => (0..20u64).prop_map(|age| SlotOp::Expire { age }),
        ]
    }

    fn hashes(path: &[u8], chain: bool) -> Vec<u64> {
        if !chain {
            // Distinct, but named by symbol and position only: the same name appears under
            // different parents across requests.
            return path
                .iter()
                .enumerate()
                .map(|(i, &s)| 1000 + (i as u64 % 3) * 10 + s as u64)
                .collect();
        }
        let l: Vec<crate::hash::LocalBlockHash> = path
            .iter()
            .map(|&s| crate::hash::LocalBlockHash(s as u64 + 1))
            .collect();
        crate::hash::sequence_hashes(&l)
            .into_iter()
            .map(|h| h.0)
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        /// With chains, each worker's active blocks are exactly the union of its live
        /// requests' blocks (shed requests hold none); with any input, the budget's count is
        /// the sum of live lists and releasing everything leaves nothing held.
        #[test]
        fn prefix_counting_is_the_union_of_live_requests(
            ops in proptest::collection::vec(slot_op(), 1..80),
            budget in prop_oneof![Just(u64::MAX), 4..40u64],
        ) {
            let mut s = Slots::new(5);
            s.set_block_budget(budget);
            // The model: id -> (worker, blocks, chain, added at).
            let mut live: Vec<(String, WorkerDp, Vec<u64>, bool, u64)> = Vec::new();
            let mut all_chains = true;
            for (now, op) in ops.iter().enumerate() {
                let now = now as u64;
                match op {
                    SlotOp::Add { w, path, chain } => {
                        let id = format!("r{now}");
                        let worker = WorkerDp::new(*w as u64 + 1, 0);
                        let blocks = hashes(path, *chain);
                        let mut d = blocks.clone();
                        d.sort_unstable();
                        d.dedup();
                        if d.len() != blocks.len() {
                            continue;
                        }
                        all_chains &= *chain;
                        s.add(&id, worker, blocks.clone(), 10, now).unwrap();
                        live.push((id, worker, blocks, *chain, now));
                    }
                    SlotOp::Free { i } => {
                        if !live.is_empty() {
                            let (id, ..) = live.remove(i % live.len());
                            s.free(&id).unwrap();
                        }
                    }
                    SlotOp::Expire { age } => {
                        s.stale_after_ms = *age;
                        s.expire(now);
                        live.retain(|r| now.saturating_sub(r.4) <= *age);
                    }
                }
                let held: Vec<&(String, WorkerDp, Vec<u64>, bool, u64)> = live
                    .iter()
                    .filter(|r| s.requests.get(&r.0).is_some_and(|a| !a.blocks.is_empty()))
                    .collect();
                prop_assert_eq!(
                    s.held_blocks(),
                    held.iter().map(|r| r.2.len() as u64).sum::<u64>()
                );
                if all_chains {
                    for w in 1..=3u64 {
                        let w = WorkerDp::new(w, 0);
                        let mut union: Vec<u64> = held
                            .iter()
                            .filter(|r| r.1 == w)
                            .flat_map(|r| r.2.iter().copied())
                            .collect();
                        union.sort_unstable();
                        union.dedup();
                        prop_assert_eq!(s.load(w).active_blocks, union.len() as u64, "{:?}", op);
                    }
                }
            }
            for (id, ..) in live {
                s.free(&id).unwrap();
            }
            prop_assert!(s.workers.values().all(|w| w.blocks.is_empty()));
            prop_assert_eq!(s.held_blocks(), 0);
        }
    }

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
        s.remove(A);
        assert_eq!(s.active_requests(), 0);
    }
}
