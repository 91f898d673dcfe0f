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
//! worker already holds is a prefix of it.
//!
//! **Counting by run, not by block.** The held set is kept as a compressed trie of *runs*
//! ([`HeldRuns`]): a run is a stretch of blocks, in a plain vector, with no branch and no
//! request ending inside it. A request *pins* the run its prompt ends at; a run lives while
//! it is pinned or branches, and `active_blocks` is the sum of the runs' lengths. Adding a
//! prompt walks the trie from its first block (one map probe per run entered, then, since
//! the hashes are chains, one probe at the run's end or a binary search where the prompt
//! leaves it), splits the run where the prompt leaves it or ends inside it, and attaches the
//! rest as one new run; releasing it unpins that run and removes, or merges into its only
//! child, each run upward that nothing keeps any more. So the per-block work of a request is
//! at most one copy of its new blocks (none when it shares nothing: its own vector becomes
//! the run), never a hash-map entry per block: an agentic
//! prompt of about 1,900 blocks that the worker does not hold used to cost 1,900 map inserts
//! on add and as many removals on release (docs/BENCHMARKS.md, "Slot manager"). Pricing a
//! request walks the same way on each busy worker. Input that is not a chain (a hash seen
//! under two parents) keeps the trie consistent, and every pin is undone on release, but its
//! counts are not exact: the walk's probes assume chains.
//!
//! **Hashing only what no run knows.** A decision's prompt arrives as local hashes; its
//! sequence hashes cost about 4.5 ns a block, each waiting on the one before, and a busy
//! worker's walk would need them all the way along what it holds. So a run also keeps the
//! local hashes its blocks were chained from, when the prompt that brought them had them (a
//! decision's does; a replica's, sequence hashes only, does not). The walk then compares
//! local hashes along such a run and *learns* the prompt's sequence hash at the point where
//! they part (or at the run's end) from the run, instead of computing the chain up to it
//! ([`SequenceChain`]); it hashes one block to probe each next run, and hashes stretches
//! only along runs without local hashes. The insert hashes only what the chosen worker does
//! not hold. On the agentic dev log with 512 requests kept active, a decision computes 7.4 %
//! of its prompts' sequence hashes (docs/BENCHMARKS.md, "Hashing only what no run knows").
//! The local hashes double a held block's memory (16 bytes instead of 8); the block budget
//! bounds both.
//!
//! A worker whose last request is released keeps its (empty) run table, so that a worker
//! that goes idle between requests does not allocate and free one per request; the table
//! goes when the worker is removed, and its memory when it grew past [`KEEP_IDLE_RUNS`]
//! runs. A run's blocks are freed with the run, so a huge prompt leaves nothing behind.
//!
//! Memory is bounded by a block budget ([`Slots::set_block_budget`]): when a new request's
//! blocks would take the blocks all requests hold past it, the oldest requests holding
//! blocks are *shed*: their blocks are released while they stay active (their request and
//! prefill counts remain, their free still finds them). A client that routes and never
//! frees thus costs others precision about its own old requests, never their admission.
//! Shedding whole requests keeps every worker's held set a union of whole chains, so it
//! stays prefix-closed.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};

use smallvec::SmallVec;

use crate::chain::SequenceChain;
use crate::hash::{MixBuildHasher, common_prefix, local_hashes_as_u64, local_hashes_into_u64};
use crate::index::OverlapScores;
use crate::policy::Candidate;
use crate::worker::WorkerDp;

type Map<K, V> = HashMap<K, V, MixBuildHasher>;

/// An idle worker keeps its run table's memory up to this many runs.
pub const KEEP_IDLE_RUNS: usize = 4_096;

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

/// "No run": the parent of a root run, and where a walk starts.
const NO_RUN: u32 = u32::MAX;

/// A run of held blocks: a stretch of one or more prompts' chains with no branch and no
/// request ending inside it (see [`HeldRuns`]).
#[derive(Debug, Default)]
struct Run {
    /// Its blocks, in chain order.
    blocks: Vec<u64>,
    /// The local hashes its blocks were chained from, one per block, when the prompts that
    /// brought them came with them (a decision's do, a replica's do not: then empty).
    locals: Vec<u64>,
    /// The run it continues ([`NO_RUN`] for a root).
    parent: u32,
    /// The runs that continue it.
    children: SmallVec<[u32; 2]>,
    /// Requests whose prompt ends at its last block.
    pins: u32,
}

/// One worker's held blocks as a compressed trie of [`Run`]s (module docs: "Counting by
/// run").
///
/// Invariants, between calls:
/// * every live run has at least one block, and `pins > 0` or at least two children (a run
///   left with neither is removed, one left with a single child is merged into it);
/// * `edges[(p, b)] == c` exactly when `c` is a live run whose parent is `p` and whose first
///   block is `b`; children of one run start with distinct blocks;
/// * `blocks` is the sum of the live runs' lengths;
/// * a run's `locals` is empty or as long as its `blocks`, and then `blocks[i]` is the
///   sequence hash of its parent chain continued by `locals[..=i]` (so a prompt that agrees
///   with the run on local hashes agrees on sequence hashes);
/// * a pin handed out by [`Self::hold`] names a live run until [`Self::release`] takes it:
///   a split keeps the id on the part that ends where the run ended, and a merge keeps
///   the child's.
#[derive(Debug, Default)]
struct HeldRuns {
    runs: Vec<Run>,
    /// Ids of dead runs, for reuse.
    free: Vec<u32>,
    /// (parent run or [`NO_RUN`], first block) -> run.
    edges: Map<(u32, u64), u32>,
    /// Blocks held: the sum of the live runs' lengths.
    blocks: u64,
}

/// How far a prompt's blocks run along the held trie.
#[derive(Debug, Clone, Copy)]
struct Found {
    /// Blocks of the prompt held (a prefix).
    held: usize,
    /// The run the walk stopped in ([`NO_RUN`] when nothing is held).
    run: u32,
    /// Blocks of `run` the prompt matched (from its start).
    within: usize,
}

impl HeldRuns {
    fn is_empty(&self) -> bool {
        self.blocks == 0
    }

    /// The longest prefix of the prompt the trie holds, and where it ends: one map probe
    /// per run entered (one sequence hash, at the run's first block), then the run's local
    /// hashes compared with the prompt's where both have them (the run's sequence hash is
    /// then learnt, not computed), else [`matched`] on sequence hashes.
    fn find(&self, p: &mut SequenceChain<'_>) -> Found {
        let mut f = Found {
            held: 0,
            run: NO_RUN,
            within: 0,
        };
        while f.held < p.len() {
            let next = p.get(f.held);
            let Some(&c) = self.edges.get(&(f.run, next)) else {
                break;
            };
            let run = &self.runs[c as usize];
            let m = match p.locals() {
                Some(locals) if !run.locals.is_empty() => {
                    // Block 0 agrees (its sequence hash led the walk here).
                    let m =
                        common_prefix(&run.locals, local_hashes_as_u64(&locals[f.held..])).max(1);
                    p.learn(f.held + m - 1, run.blocks[m - 1]);
                    m
                }
                _ => {
                    let n = run.blocks.len().min(p.len() - f.held);
                    matched(&run.blocks, p.range(f.held, f.held + n))
                }
            };
            f = Found {
                held: f.held + m,
                run: c,
                within: m,
            };
            if m < run.blocks.len() {
                break;
            }
        }
        f
    }

    /// Holds a prompt's blocks and pins its last one; returns the pin (`None` for an empty
    /// prompt). Only the blocks past what the trie holds are hashed; a prompt that shares
    /// nothing moves its vector into the trie as one run.
    fn hold(&mut self, p: SequenceChain<'_>) -> Option<u32> {
        if p.is_empty() {
            return None;
        }
        let mut p = p;
        let f = self.find(&mut p);
        let mut at = f.run;
        if at != NO_RUN && f.within < self.runs[at as usize].blocks.len() {
            at = self.split(at, f.within);
        }
        let pin = if f.held == p.len() {
            at
        } else {
            let (rest, locals) = if f.held == 0 {
                // A new root: the chain's vectors become the run's (a huge prompt's are
                // half a MiB each), the local hashes copied only where they were borrowed.
                let (locals, all) = p.into_parts();
                let locals = match locals {
                    Some(Cow::Owned(v)) => local_hashes_into_u64(v),
                    Some(Cow::Borrowed(l)) => local_hashes_as_u64(l).to_vec(),
                    None => Vec::new(),
                };
                (all, locals)
            } else {
                let locals = p
                    .locals()
                    .map(|l| local_hashes_as_u64(&l[f.held..]).to_vec())
                    .unwrap_or_default();
                let n = p.len();
                (p.range(f.held, n).to_vec(), locals)
            };
            self.attach(at, rest, locals)
        };
        self.runs[pin as usize].pins += 1;
        Some(pin)
    }

    /// Drops a pin and removes (or merges) upward whatever nothing keeps any more.
    fn release(&mut self, pin: u32) {
        let mut run = pin;
        let r = &mut self.runs[run as usize];
        debug_assert!(r.pins > 0, "a pin names a pinned run");
        r.pins = r.pins.saturating_sub(1);
        loop {
            let r = &self.runs[run as usize];
            match (r.pins, r.children.len()) {
                (0, 0) => {
                    let (parent, first, len) = (r.parent, r.blocks[0], r.blocks.len());
                    self.blocks -= len as u64;
                    self.edges.remove(&(parent, first));
                    self.kill(run);
                    if parent == NO_RUN {
                        return;
                    }
                    self.runs[parent as usize].children.retain(|c| *c != run);
                    run = parent;
                }
                (0, 1) => return self.merge_into_child(run),
                _ => return,
            }
        }
    }

    /// Splits `run` after its first `k` blocks (`0 < k < len`). The tail keeps the id (and
    /// so its pins and children); the head gets a new one, which is returned.
    fn split(&mut self, run: u32, k: usize) -> u32 {
        let tail = &mut self.runs[run as usize];
        let mut head_blocks = split_vec(&mut tail.blocks, k);
        let mut head_locals = if tail.locals.is_empty() {
            Vec::new()
        } else {
            split_vec(&mut tail.locals, k)
        };
        // Repeated splits of one run must not add up either.
        for v in [
            &mut tail.blocks,
            &mut head_blocks,
            &mut tail.locals,
            &mut head_locals,
        ] {
            if v.capacity() > 2 * v.len() {
                v.shrink_to_fit();
            }
        }
        let (parent, tail_first) = (tail.parent, tail.blocks[0]);
        let head_first = head_blocks[0];
        let head = self.alloc(Run {
            blocks: head_blocks,
            locals: head_locals,
            parent,
            children: smallvec::smallvec![run],
            pins: 0,
        });
        self.runs[run as usize].parent = head;
        self.replace_child(parent, head_first, run, head);
        self.edges.insert((head, tail_first), run);
        head
    }

    /// A new run of `blocks` under `parent`.
    fn attach(&mut self, parent: u32, blocks: Vec<u64>, locals: Vec<u64>) -> u32 {
        debug_assert!(locals.is_empty() || locals.len() == blocks.len());
        let first = blocks[0];
        self.blocks += blocks.len() as u64;
        let id = self.alloc(Run {
            blocks,
            locals,
            parent,
            children: SmallVec::new(),
            pins: 0,
        });
        self.edges.insert((parent, first), id);
        if parent != NO_RUN {
            self.runs[parent as usize].children.push(id);
        }
        id
    }

    /// Merges `run` (no pins, one child) into its child, which keeps its id.
    fn merge_into_child(&mut self, run: u32) {
        let r = std::mem::take(&mut self.runs[run as usize]);
        let c = r.children[0];
        let child = &mut self.runs[c as usize];
        self.edges.remove(&(run, child.blocks[0]));
        let mut blocks = r.blocks;
        blocks.reserve_exact(child.blocks.len());
        blocks.extend_from_slice(&child.blocks);
        let first = blocks[0];
        child.blocks = blocks;
        // The merged run knows its local hashes only where both parts did.
        if r.locals.is_empty() || child.locals.is_empty() {
            child.locals = Vec::new();
        } else {
            let mut locals = r.locals;
            locals.reserve_exact(child.locals.len());
            locals.extend_from_slice(&child.locals);
            child.locals = locals;
        }
        child.parent = r.parent;
        self.replace_child(r.parent, first, run, c);
        self.kill(run);
    }

    /// Puts run `new` where `old` (whose first block is `first`) hung under `parent`.
    fn replace_child(&mut self, parent: u32, first: u64, old: u32, new: u32) {
        self.edges.insert((parent, first), new);
        if parent != NO_RUN {
            for c in self.runs[parent as usize].children.iter_mut() {
                if *c == old {
                    *c = new;
                }
            }
        }
    }

    fn alloc(&mut self, run: Run) -> u32 {
        match self.free.pop() {
            Some(id) => {
                self.runs[id as usize] = run;
                id
            }
            None => {
                self.runs.push(run);
                (self.runs.len() - 1) as u32
            }
        }
    }

    /// Frees a run's id and memory.
    fn kill(&mut self, run: u32) {
        self.runs[run as usize] = Run::default();
        self.free.push(run);
    }

    /// Forgets everything; an idle worker keeps the tables' memory while it is small.
    fn reset(&mut self) {
        debug_assert!(self.is_empty() && self.edges.is_empty());
        if self.runs.len() > KEEP_IDLE_RUNS {
            *self = Self::default();
        } else {
            self.runs.clear();
            self.free.clear();
            self.edges.clear();
            self.blocks = 0;
        }
    }

    /// Blocks of memory the runs' vectors hold (their capacity), for tests.
    #[cfg(test)]
    fn capacity_blocks(&self) -> usize {
        self.runs.iter().map(|r| r.blocks.capacity()).sum()
    }

    /// Checks every invariant of the [type docs](Self) (tests).
    #[cfg(test)]
    fn check(&self) {
        let free: std::collections::HashSet<u32> = self.free.iter().copied().collect();
        let mut blocks = 0;
        let mut edges = 0;
        for (id, r) in self.runs.iter().enumerate() {
            let id = id as u32;
            if free.contains(&id) {
                assert!(r.blocks.is_empty() && r.children.is_empty() && r.pins == 0);
                continue;
            }
            assert!(!r.blocks.is_empty(), "run {id} is empty");
            if !r.locals.is_empty() {
                // The sequence hashes are the chain of the local hashes.
                assert_eq!(r.locals.len(), r.blocks.len());
                let mut parent = match r.parent {
                    NO_RUN => None,
                    p => self.runs[p as usize].blocks.last().copied(),
                };
                for (&b, &l) in r.blocks.iter().zip(&r.locals) {
                    let want = match parent {
                        None => l,
                        Some(p) => crate::hash::next_sequence_hash(p.into(), l.into()).0,
                    };
                    assert_eq!(b, want, "run {id}'s locals are not its chain");
                    parent = Some(b);
                }
            }
            assert!(
                r.pins > 0 || r.children.len() >= 2,
                "run {id} is not kept: {r:?}"
            );
            assert_eq!(self.edges.get(&(r.parent, r.blocks[0])), Some(&id));
            edges += 1;
            blocks += r.blocks.len() as u64;
            let mut firsts: Vec<u64> = r
                .children
                .iter()
                .map(|&c| {
                    assert_eq!(self.runs[c as usize].parent, id);
                    self.runs[c as usize].blocks[0]
                })
                .collect();
            firsts.sort_unstable();
            firsts.dedup();
            assert_eq!(firsts.len(), r.children.len());
        }
        assert_eq!(edges, self.edges.len());
        assert_eq!(blocks, self.blocks);
    }
}

/// Splits `v` after its first `k` elements and returns the head, `v` keeping the tail. The
/// larger part keeps the vector, the smaller is copied out: no part keeps more than twice
/// its length (a short prefix of a huge prompt must not pin its memory).
fn split_vec(v: &mut Vec<u64>, k: usize) -> Vec<u64> {
    if 2 * k <= v.len() {
        let head = v[..k].to_vec();
        v.drain(..k);
        head
    } else {
        let rest = v.split_off(k);
        std::mem::replace(v, rest)
    }
}

/// How many of `run`'s blocks `rest` (whose first block is the run's first) continues
/// with. Sequence hashes are chains: a prompt that agrees with a run at block `i` agrees at
/// every block before it (block `i`'s hash names the whole prefix), so one probe at the end
/// settles a run the prompt passes through whole, and a binary search finds where it leaves
/// one: `O(log n)` probes, where a compare would read every block. Input that is not a chain
/// gets an answer that keeps the trie consistent, not an exact one.
fn matched(run: &[u64], rest: &[u64]) -> usize {
    let n = run.len().min(rest.len());
    if n == 0 || run[n - 1] == rest[n - 1] {
        return n;
    }
    // Invariant: blocks `..lo` agree (block 0 led the walk here), block `hi` does not.
    let (mut lo, mut hi) = (1, n - 1);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if run[mid] == rest[mid] {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

#[derive(Debug, Default)]
struct WorkerSlots {
    held: HeldRuns,
    prefill_tokens: u64,
    requests: u64,
}

#[derive(Debug)]
struct Active {
    worker: WorkerDp,
    /// Blocks its prompt named while it holds them (what the budget counts); 0 once shed.
    held: u64,
    /// The run its prompt ends at in its worker's [`HeldRuns`], while it holds blocks.
    pin: Option<u32>,
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
            let pin = r.pin.take();
            self.held_blocks -= std::mem::take(&mut r.held);
            let worker = r.worker;
            self.shed_requests += 1;
            if let (Some(pin), Some(w)) = (pin, self.workers.get_mut(&worker)) {
                w.held.release(pin);
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
        let chain = SequenceChain::given(None, blocks);
        self.add_chain(request_id, worker, chain, prefill_tokens, now_ms)
    }

    /// [`Self::add`] for a prompt whose sequence hashes are computed on demand: only the
    /// blocks past what `worker` already holds are hashed, and they are held with their
    /// local hashes (so later prompts compare local hashes there, see
    /// [`Self::candidates`]).
    pub fn add_chain(
        &mut self,
        request_id: &str,
        worker: WorkerDp,
        blocks: SequenceChain<'_>,
        prefill_tokens: u64,
        now_ms: u64,
    ) -> Result<(), SlotError> {
        self.add_later(request_id, worker, prefill_tokens, now_ms)?;
        self.hold_blocks(request_id, blocks);
        Ok(())
    }

    /// Adds a routed request whose blocks come later ([`Self::hold_blocks`]): it counts as
    /// active (and its prefill tokens as queued) at once, its blocks from then on. The
    /// decider answers between the two (`crate::decision`, "settle").
    pub fn add_later(
        &mut self,
        request_id: &str,
        worker: WorkerDp,
        prefill_tokens: u64,
        now_ms: u64,
    ) -> Result<(), SlotError> {
        if self.requests.contains_key(request_id) {
            return Err(SlotError::DuplicateRequest(request_id.into()));
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        let w = self.workers.entry(worker).or_default();
        w.prefill_tokens += prefill_tokens;
        w.requests += 1;
        if w.requests == self.worker_cap {
            self.full += 1;
        }
        self.requests.insert(
            request_id.into(),
            Active {
                worker,
                held: 0,
                pin: None,
                prefill_tokens,
                last_ms: now_ms,
                seq,
            },
        );
        Ok(())
    }

    /// Holds the blocks of a request added by [`Self::add_later`] and holding none yet,
    /// shedding the oldest holders past the budget first (a prompt larger than the budget
    /// is held without its blocks, counted as shed). Any other request: nothing happens.
    pub fn hold_blocks(&mut self, request_id: &str, blocks: SequenceChain<'_>) {
        let len = blocks.len() as u64;
        match self.requests.get(request_id) {
            Some(r) if r.held == 0 && r.pin.is_none() && len > 0 => {}
            _ => return,
        }
        if len > self.block_budget {
            self.shed_requests += 1;
            return;
        }
        // The request is in no holder list yet: shedding never takes its own blocks.
        self.shed_to(len);
        let Some(r) = self.requests.get_mut(request_id) else {
            return;
        };
        let Some(w) = self.workers.get_mut(&r.worker) else {
            debug_assert!(false, "an active request's worker has slots");
            return;
        };
        r.pin = w.held.hold(blocks);
        r.held = len;
        self.holding.insert(r.seq, request_id.into());
        self.held_blocks += len;
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
        if r.held > 0 {
            self.held_blocks -= r.held;
            self.holding.remove(&r.seq);
        }
        let Some(w) = self.workers.get_mut(&r.worker) else {
            return;
        };
        if let Some(pin) = r.pin {
            w.held.release(pin);
        }
        w.prefill_tokens -= r.prefill_tokens;
        if w.requests == self.worker_cap {
            self.full -= 1;
        }
        w.requests -= 1;
        if w.requests == 0 {
            debug_assert!(w.prefill_tokens == 0);
            w.held.reset();
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
        self.held_blocks = self.requests.values().map(|r| r.held).sum();
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
                active_blocks: w.held.blocks,
                active_prefill_tokens: w.prefill_tokens,
                active_requests: w.requests,
            })
    }

    /// The worker's active blocks if a request with `blocks` were added to it.
    /// `blocks` is a prompt's chain of sequence hashes.
    pub fn potential_blocks(&self, worker: WorkerDp, blocks: &[u64]) -> u64 {
        let mut chain = SequenceChain::given(None, blocks.to_vec());
        match self.workers.get(&worker) {
            Some(w) => w.held.blocks + (blocks.len() - w.held.find(&mut chain).held) as u64,
            None => blocks.len() as u64,
        }
    }

    /// The cost function's view of each of `workers` for a request whose sequence hashes
    /// `blocks` gives (distinct, as the sequence hashes of one prompt are): loads and
    /// potential decode blocks from here, device overlaps from `overlaps`. Busy workers
    /// walk the prompt along what they hold; the chain hashes only where a walk needs a
    /// hash it cannot learn from a held run (module docs, "Counting by run").
    pub fn candidates(
        &self,
        workers: &[WorkerDp],
        blocks: &mut SequenceChain<'_>,
        overlaps: &OverlapScores,
    ) -> Vec<Candidate> {
        // [`Self::potential_blocks`] for every worker at once. A request's sequence hashes
        // are distinct (each names a different prefix), so no deduplication is needed: busy
        // workers search the prefix they hold, idle ones add them all.
        let n = blocks.len() as u64;
        // Per busy worker: (potential blocks, the prefix its active requests hold).
        let busy: Map<WorkerDp, (u64, u32)> = self
            .workers
            .iter()
            .filter(|(_, s)| s.requests > 0)
            .map(|(&w, s)| {
                let held = s.held.find(blocks).held;
                let new = (blocks.len() - held) as u64;
                (w, (s.held.blocks + new, held as u32))
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
    use crate::hash::LocalBlockHash;
    use proptest::prelude::*;

    const A: WorkerDp = WorkerDp::new(1, 0);

    fn given(blocks: &[u64]) -> SequenceChain<'static> {
        SequenceChain::given(None, blocks.to_vec())
    }

    #[derive(Debug, Clone)]
    enum SlotOp {
        /// A request on worker `w` whose prompt is `path` (as a chain, or as the raw
        /// symbols, which is no chain); a chain comes with its local hashes (a decision's
        /// prompt, hashed on demand) or without (a replica's).
        Add {
            w: u8,
            path: Vec<u8>,
            chain: bool,
            locals: bool,
        },
        /// Frees the `i`-th active request (modulo their number).
        Free { i: usize },
        /// Expires every request older than `age`.
        Expire { age: u64 },
    }

    fn slot_op() -> impl Strategy<Value = SlotOp> {
        prop_oneof![
            6 => (
                0..3u8,
                proptest::collection::vec(0..3u8, 0..10),
                proptest::bool::weighted(0.85),
                any::<bool>(),
            )
                .prop_map(|(w, path, chain, locals)| SlotOp::Add { w, path, chain, locals }),
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
        crate::hash::sequence_hashes(&symbols(path))
            .into_iter()
            .map(|h| h.0)
            .collect()
    }

    fn symbols(path: &[u8]) -> Vec<LocalBlockHash> {
        path.iter().map(|&s| LocalBlockHash(s as u64 + 1)).collect()
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
                    SlotOp::Add { w, path, chain, locals } => {
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
                        let l = symbols(path);
                        if all_chains {
                            // A walk on a chain hashed on demand finds, on every worker,
                            // exactly the prefix the worker's live requests hold.
                            let mut c = SequenceChain::new(&l);
                            let workers = [1, 2, 3].map(|w| WorkerDp::new(w, 0));
                            let cands = s.candidates(&workers, &mut c, &OverlapScores::new());
                            for cand in cands {
                                let union: std::collections::HashSet<u64> = live
                                    .iter()
                                    .filter(|r| r.1 == cand.worker)
                                    .filter(|r| s.requests.get(&r.0).is_some_and(|a| a.held > 0))
                                    .flat_map(|r| r.2.iter().copied())
                                    .collect();
                                let prefix = blocks.iter().take_while(|b| union.contains(b)).count();
                                prop_assert_eq!(cand.inflight_overlap_blocks as usize, prefix);
                            }
                            prop_assert!(c.hashed() <= blocks.len());
                        }
                        if *chain && *locals {
                            // Borrowed local hashes (copied into a run) or owned ones (a
                            // settled decision's: moved into a new root run).
                            let c: SequenceChain<'_> = if now.is_multiple_of(2) {
                                SequenceChain::new(&l).into_owned()
                            } else {
                                SequenceChain::new(&l)
                            };
                            s.add_chain(&id, worker, c, 10, now).unwrap();
                        } else {
                            s.add(&id, worker, blocks.clone(), 10, now).unwrap();
                        }
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
                    .filter(|r| s.requests.get(&r.0).is_some_and(|a| a.held > 0))
                    .collect();
                prop_assert_eq!(
                    s.held_blocks(),
                    held.iter().map(|r| r.2.len() as u64).sum::<u64>()
                );
                for w in s.workers.values() {
                    w.held.check();
                }
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
            prop_assert!(s.workers.values().all(|w| w.held.is_empty() && w.held.edges.is_empty()));
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
        let c = s.candidates(&[A, b], &mut given(&[1, 2, 7]), &overlaps);
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
    fn a_huge_prompt_leaves_nothing_behind() {
        let mut s = Slots::new(1000);
        s.add("huge", A, (0..100_000).collect(), 0, 0).unwrap();
        s.add("small", A, vec![0, 1], 0, 0).unwrap();
        assert_eq!(s.load(A).active_blocks, 100_000);
        s.free("huge").unwrap();
        // Only the small prompt's run is left, and only its memory.
        assert_eq!(s.load(A).active_blocks, 2);
        assert!(s.workers[&A].held.capacity_blocks() < 100);
        s.free("small").unwrap();
        assert_eq!(s.workers[&A].held.capacity_blocks(), 0);
        // A worker that went idle with a huge run table gives it back.
        for i in 0..=KEEP_IDLE_RUNS as u64 {
            s.add(&format!("r{i}"), A, vec![i], 0, 0).unwrap();
        }
        for i in 0..=KEEP_IDLE_RUNS as u64 {
            s.free(&format!("r{i}")).unwrap();
        }
        assert_eq!(s.workers[&A].held.runs.capacity(), 0);
        s.add("small", A, vec![1, 2], 0, 0).unwrap();
        s.free("small").unwrap();
        assert!(s.workers[&A].held.runs.capacity() > 0);
    }

    /// A new prompt's vector becomes its run as it is, a session's next turn adds one run
    /// of its new blocks, and the trie splits and merges back as requests come and go.
    #[test]
    fn runs_split_and_merge_back() {
        let mut s = Slots::new(1000);
        let turn1: Vec<u64> = (1..=6).collect();
        let ptr = turn1.as_ptr();
        s.add("t1", A, turn1, 0, 0).unwrap();
        let runs = |s: &Slots| {
            let h = &s.workers[&A].held;
            h.check();
            let mut v: Vec<Vec<u64>> = h
                .runs
                .iter()
                .filter(|r| !r.blocks.is_empty())
                .map(|r| r.blocks.clone())
                .collect();
            v.sort();
            v
        };
        assert_eq!(
            s.workers[&A].held.runs[0].blocks.as_ptr(),
            ptr,
            "moved, not copied"
        );
        // The next turn extends it: one more run.
        s.add("t2", A, (1..=8).collect(), 0, 0).unwrap();
        assert_eq!(runs(&s), [vec![1, 2, 3, 4, 5, 6], vec![7, 8]]);
        // A prompt that leaves it in the middle splits it; one that ends inside splits too.
        s.add("b", A, vec![1, 2, 9], 0, 0).unwrap();
        s.add("c", A, vec![1], 0, 0).unwrap();
        assert_eq!(
            runs(&s),
            [vec![1], vec![2], vec![3, 4, 5, 6], vec![7, 8], vec![9]]
        );
        assert_eq!(s.load(A).active_blocks, 9);
        assert_eq!(s.potential_blocks(A, &[1, 2, 3, 4, 10]), 10);
        // Releasing merges what no longer branches or ends a request.
        s.free("c").unwrap();
        s.free("b").unwrap();
        assert_eq!(runs(&s), [vec![1, 2, 3, 4, 5, 6], vec![7, 8]]);
        s.free("t1").unwrap();
        assert_eq!(runs(&s), [vec![1, 2, 3, 4, 5, 6, 7, 8]]);
        s.free("t2").unwrap();
        assert_eq!(s.load(A), WorkerLoad::default());
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
        let c = s.candidates(&[A, idle], &mut given(&[1, 5, 6]), &OverlapScores::new());
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
        let c = s.candidates(&[A], &mut given(&[1, 2]), &OverlapScores::new());
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

    /// The held prefix found by the walk is the exact count of held blocks whenever
    /// what a worker holds is whole prompts' chains.
    #[test]
    fn held_prefix_is_exact_on_chains() {
        use crate::hash::sequence_hashes;
        let chain = |v: &[u64]| -> Vec<u64> {
            let l: Vec<LocalBlockHash> = v.iter().copied().map(LocalBlockHash).collect();
            sequence_hashes(&l).into_iter().map(|h| h.0).collect()
        };
        let mut rng = crate::policy::Rng::new(7);
        for round in 0..200 {
            let mut s = Slots::new(1000);
            // A few prompts sharing prefixes of random lengths.
            let base: Vec<u64> = (0..64).map(|_| rng.below(4) as u64).collect();
            let mut added = Vec::new();
            for r in 0..rng.below(5) {
                let keep = rng.below(64);
                let mut p = base[..keep].to_vec();
                p.extend((0..rng.below(40)).map(|_| 100 + rng.below(1000) as u64));
                s.add(&format!("{round}-{r}"), A, chain(&p), 0, 0).unwrap();
                added.push(chain(&p));
            }
            let keep = rng.below(64);
            let mut q = base[..keep].to_vec();
            q.extend((0..rng.below(40)).map(|_| 5000 + rng.below(1000) as u64));
            let q = chain(&q);
            let held: std::collections::HashSet<u64> = added.iter().flatten().copied().collect();
            let exact = q.iter().filter(|b| held.contains(b)).count();
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
