//! The routing decision: the one composition of lookup, load prediction, cost and choice
//! that every front calls (the HTTP routing API, the benchmark harness, the proxy).
//!
//! ```text
//! find_matches ─▶ candidates (slot manager) ─▶ score ─▶ choose ─▶ slot add ─▶ approximate record
//!   (index, or         (loads, potential          (cost     (lowest, softmax,   (the prediction
//!    the router's       decode blocks)             terms)    power of two)       starts here)
//!    own decisions)
//! ```
//!
//! A [`Decider`] owns what a decision changes: the slot manager ([`Slots`]), the
//! approximate-mode index ([`ApproxIndex`], when the router sees no KV events), the seeded
//! generator and the request counter. What it only reads is passed in: the KV index (any
//! [`Lookup`]), the candidate workers and the time. Each front keeps its own plumbing
//! (parsing, transport, metrics) and nothing of the decision, so that the figures the
//! harness publishes are the production decision's.
//!
//! [`Selection`] says how a worker is picked once the candidates are scored: by the cost
//! function ([`Selection::Cost`], the router's mode; its weights say whether it is ours or
//! Dynamo's formula), or by one of the cache-blind baselines the harness compares against
//! (round robin, random, least loaded), which a deployment may also choose. Every
//! selection looks the request up, so that its predicted prefill charge and the reported
//! overlap are the cache's, whatever the selection did with them.
//!
//! A decision answers before its slot insert is complete: the request counts as active at
//! once, and its blocks (whose sequence hashes may still need computing for the part its
//! worker does not hold, `crate::chain`) are held when the front calls
//! [`Decider::settle`] after sending the answer, or else before the decider's next
//! operation. The hashing is the same; it leaves the answer's path, not the executor.
//!
//! Pure and clock-free: times are arguments, the generator is seeded.

use crate::chain::SequenceChain;
use crate::codec::replica::{ActiveSequenceEvent, ActiveSequenceEventData};
use crate::hash::LocalBlockHash;
use crate::index::{
    ApproxConfig, ApproxIndex, Index, OverlapScores, PoolReaders, TierScores, TreeReader,
};
use crate::policy::{CostConfig, Formula, Rng, Scored, choose, score};
use crate::prefill::PrefillTimes;
use crate::returns::Returns;
use crate::slots::{SlotError, Slots};
use crate::worker::WorkerDp;

/// Where a decision reads which blocks each worker caches.
pub trait Lookup {
    /// Writes, per worker, how many leading blocks of `query` it holds into `out`.
    fn find_matches_into(&self, query: &[LocalBlockHash], out: &mut OverlapScores);

    /// Whether any worker holds blocks on a lower tier (when not, tier overlaps are all
    /// zero and need not be asked for).
    fn has_lower_tiers(&self) -> bool;

    /// Writes how far each worker's lower tiers continue `query` past its device score
    /// ([`crate::index::tiers`]); `paths` are the query's path hashes.
    fn tier_overlaps_into(
        &self,
        query: &[LocalBlockHash],
        paths: &[u64],
        device: &OverlapScores,
        out: &mut TierScores,
    );
}

impl Lookup for TreeReader {
    fn find_matches_into(&self, query: &[LocalBlockHash], out: &mut OverlapScores) {
        TreeReader::find_matches_into(self, query, out);
    }

    fn has_lower_tiers(&self) -> bool {
        TreeReader::has_lower_tiers(self)
    }

    fn tier_overlaps_into(
        &self,
        _query: &[LocalBlockHash],
        paths: &[u64],
        device: &OverlapScores,
        out: &mut TierScores,
    ) {
        TreeReader::tier_overlaps_into(self, paths, device, out);
    }
}

impl<I: Index> Lookup for I {
    fn find_matches_into(&self, query: &[LocalBlockHash], out: &mut OverlapScores) {
        Index::find_matches_into(self, query, out);
    }

    fn has_lower_tiers(&self) -> bool {
        self.lower_block_count() > 0
    }

    fn tier_overlaps_into(
        &self,
        query: &[LocalBlockHash],
        paths: &[u64],
        device: &OverlapScores,
        out: &mut TierScores,
    ) {
        Index::tier_overlaps_into(self, query, paths, device, out);
    }
}

/// How a worker is picked among the candidates. The names (`kv`, `round-robin`,
/// `random`, `least-loaded`) are those of Dynamo's `--router-mode` where it has one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum Selection {
    /// The cost function ([`crate::policy`]) with the decider's weights.
    #[default]
    #[serde(rename = "kv")]
    Cost,
    /// Request `i` to candidate `i mod n` (cache-blind).
    RoundRobin,
    /// Uniformly at random (cache-blind).
    Random,
    /// Fewest active requests as the slot manager sees them, ties at random (cache-blind).
    LeastLoaded,
}

impl std::str::FromStr for Selection {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "kv" => Ok(Selection::Cost),
            "round-robin" => Ok(Selection::RoundRobin),
            "random" => Ok(Selection::Random),
            "least-loaded" => Ok(Selection::LeastLoaded),
            other => Err(format!(
                "unknown router mode {other:?} (kv, round-robin, random, least-loaded)"
            )),
        }
    }
}

/// What one client may make the decider hold. Each bounds memory or work a request can
/// pin: a request's blocks stay in the slot manager until it is freed or goes stale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Blocks per request (65,536: a 1 M-token prompt at 16 tokens per block is 62,500).
    pub max_blocks: usize,
    /// Active requests in all (65,536).
    pub max_active_requests: usize,
    /// Active requests per (worker, dp rank); a worker with as many is not a candidate
    /// (4,096).
    pub max_active_per_worker: usize,
    /// Bytes of a request id (256).
    pub max_request_id_bytes: usize,
    /// Blocks all active requests hold together (4 Mi); past it the oldest requests' blocks
    /// are shed (see [`Slots`]). Without it, `max_active_requests` requests of `max_blocks`
    /// each could pin hundreds of GiB.
    pub max_active_blocks: u64,
}

impl Limits {
    /// No limits (the harness's simulations, which model their own queues).
    pub const NONE: Limits = Limits {
        max_blocks: usize::MAX,
        max_active_requests: usize::MAX,
        max_active_per_worker: usize::MAX,
        max_request_id_bytes: usize::MAX,
        max_active_blocks: u64::MAX,
    };
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_blocks: 65_536,
            max_active_requests: 65_536,
            max_active_per_worker: 4_096,
            max_request_id_bytes: 256,
            max_active_blocks: 4 << 20,
        }
    }
}

/// Settings of a [`Decider`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeciderConfig {
    /// Cost weights (used by [`Selection::Cost`]).
    pub cost: CostConfig,
    /// How a worker is picked.
    pub selection: Selection,
    /// Tokens per KV block.
    pub block_size: u32,
    /// `Some`: approximate mode (no KV events): the decider records its own decisions in an
    /// index with these settings and looks requests up there instead of in the KV index.
    pub approximate: Option<ApproxConfig>,
    /// `Some` (with KV events): the decider also records its own decisions, and a worker's
    /// overlap is the larger of the index's and the records'.
    pub remember: Option<ApproxConfig>,
    /// Requests not heard of for this long are released, ms.
    pub stale_after_ms: u64,
    /// Seed of tie-breaking and sampling.
    pub seed: u64,
    /// Prefix of the request ids the decider makes up (`{prefix:x}-{n}`): the router id,
    /// so that replicas never make up the same id.
    pub id_prefix: u64,
    /// What one request may hold.
    pub limits: Limits,
}

impl Default for DeciderConfig {
    fn default() -> Self {
        Self {
            cost: CostConfig::default(),
            selection: Selection::Cost,
            block_size: 64,
            approximate: None,
            remember: None,
            stale_after_ms: 600_000,
            seed: 0,
            id_prefix: 0,
            limits: Limits::default(),
        }
    }
}

/// One request to route.
#[derive(Debug, Clone, Copy)]
pub struct Route<'a> {
    /// Its local block hashes.
    pub locals: &'a [LocalBlockHash],
    /// Its prompt tokens.
    pub tokens: u64,
    /// Its id (`None`: the decider makes one up).
    pub request_id: Option<&'a str>,
    /// Keep every candidate's cost terms in the decision.
    pub explain: bool,
}

/// What a decision chose.
#[derive(Debug, Clone)]
pub struct Decision {
    /// The worker.
    pub worker: WorkerDp,
    /// Its position in the candidates given to [`Decider::decide`].
    pub position: usize,
    /// Leading request blocks it caches (as the decision saw them).
    pub overlap_blocks: u32,
    /// The request's id (given or made up), now active in the slot manager.
    pub request_id: String,
    /// Prompt tokens charged as its prefill until its first token.
    pub prefill_tokens: u64,
    /// Every candidate's cost terms, with [`Route::explain`] and [`Selection::Cost`].
    pub scored: Option<Vec<Scored>>,
}

/// Why no decision was made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecideError {
    /// No candidate worker.
    #[error("no workers known yet")]
    NoWorkers,
    /// The request id is already active.
    #[error(transparent)]
    Slot(#[from] SlotError),
    /// The request has more blocks than [`Limits::max_blocks`].
    #[error("the request has {blocks} blocks, more than the limit of {max}")]
    TooManyBlocks {
        /// Its blocks.
        blocks: usize,
        /// The limit.
        max: usize,
    },
    /// The request id is empty, too long, or holds control characters.
    #[error("invalid request id: {0}")]
    BadRequestId(&'static str),
    /// [`Limits::max_active_requests`] requests are active.
    #[error("{max} requests are active already: retry later")]
    Overloaded {
        /// The limit.
        max: usize,
    },
    /// Every candidate has [`Limits::max_active_per_worker`] active requests.
    #[error("every worker has {max} active requests: retry later")]
    WorkersFull {
        /// The limit.
        max: usize,
    },
}

impl DecideError {
    /// Whether the request itself is at fault (`false`: the fleet is, for now).
    pub fn is_client_error(&self) -> bool {
        !matches!(
            self,
            DecideError::NoWorkers
                | DecideError::Overloaded { .. }
                | DecideError::WorkersFull { .. }
        )
    }
}

/// Whether `id` may name a request: 1 to `max` bytes, no control characters (so that it
/// round-trips through a percent-encoded path and never breaks a log line).
pub fn check_request_id(id: &str, max: usize) -> Result<(), DecideError> {
    if id.is_empty() {
        return Err(DecideError::BadRequestId("empty"));
    }
    if id.len() > max {
        return Err(DecideError::BadRequestId("too long"));
    }
    if id.chars().any(char::is_control) {
        return Err(DecideError::BadRequestId("control characters"));
    }
    Ok(())
}

/// See the [module docs](self).
#[derive(Debug)]
pub struct Decider {
    cfg: DeciderConfig,
    slots: Slots,
    approx: Option<ApproxIndex>,
    recent: Option<ApproxIndex>,
    recent_scores: OverlapScores,
    rng: Rng,
    next_request: u64,
    round_robin: usize,
    /// The overlaps of the last decision (reused: no allocation per decision).
    overlaps: OverlapScores,
    /// Its lower-tier overlaps.
    tiers: TierScores,
    /// Learned prefill times and queues ([`Formula::Time`] only).
    prefill: Option<PrefillTimes>,
    /// Each worker's rate of returning requests (`return_weight` above 0 only).
    returns: Option<Returns>,
    /// The last decision's blocks, held at [`Decider::settle`].
    pending: Option<Pending>,
    /// Keep settled decisions' sequence hashes for [`Decider::take_settled`].
    keep_settled: bool,
    settled: Vec<Settled>,
    /// Which workers read which shared pools ([`Decider::set_pool_readers`]).
    pool_readers: PoolReaders,
}

/// A decision whose blocks were held, with all its sequence hashes: what replica sync
/// tells the other routers ([`Decider::keep_settled`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settled {
    /// The request.
    pub request_id: String,
    /// Its worker.
    pub worker: WorkerDp,
    /// Its sequence hashes, every block.
    pub blocks: Vec<u64>,
}

/// A decision's blocks, not yet held by the slot manager (see [`Decider::settle`]).
#[derive(Debug)]
struct Pending {
    request_id: String,
    worker: WorkerDp,
    blocks: SequenceChain<'static>,
}

impl Decider {
    /// A decider with no active requests.
    pub fn new(cfg: DeciderConfig) -> Self {
        let mut slots = Slots::new(cfg.stale_after_ms);
        slots.set_worker_cap(cfg.limits.max_active_per_worker as u64);
        slots.set_block_budget(cfg.limits.max_active_blocks);
        Self {
            slots,
            approx: cfg.approximate.map(ApproxIndex::new),
            recent: cfg
                .remember
                .filter(|_| cfg.approximate.is_none())
                .map(ApproxIndex::new),
            recent_scores: OverlapScores::new(),
            rng: Rng::new(cfg.seed),
            next_request: 0,
            round_robin: 0,
            overlaps: OverlapScores::new(),
            tiers: TierScores::new(),
            prefill: (cfg.cost.formula == Formula::Time && cfg.selection == Selection::Cost)
                .then(|| PrefillTimes::new(cfg.cost.prior)),
            returns: (cfg.cost.return_weight > 0.0 && cfg.selection == Selection::Cost)
                .then(|| Returns::new(cfg.cost.return_window_secs * 1e3)),
            pending: None,
            keep_settled: false,
            settled: Vec::new(),
            pool_readers: PoolReaders::new(),
            cfg,
        }
    }

    /// Keeps, from now on, each settled decision's request and sequence hashes until
    /// [`Self::take_settled`] takes them (replica sync sends them to the other routers). A
    /// request freed before it settled is never settled, so it never appears there.
    pub fn keep_settled(&mut self, on: bool) {
        self.keep_settled = on;
        if !on {
            self.settled.clear();
        }
    }

    /// Which workers read which shared pools: from now on a pool with a rule earns its
    /// credit only on its readers' candidates (`crate::index::tiers`, "Who reads a pool").
    pub fn set_pool_readers(&mut self, readers: PoolReaders) {
        self.tiers.attribute_sources(!readers.is_empty());
        self.pool_readers = readers;
    }

    /// Whether any pool has readers ([`Self::set_pool_readers`]).
    pub fn has_pool_readers(&self) -> bool {
        !self.pool_readers.is_empty()
    }

    /// The decisions settled since the last call, oldest first ([`Self::keep_settled`]).
    pub fn take_settled(&mut self) -> Vec<Settled> {
        std::mem::take(&mut self.settled)
    }

    /// Holds the last decision's blocks in the slot manager, hashing what its worker does
    /// not hold yet. A decision answers first: its request counts as active (with its
    /// prefill tokens) at once, and its blocks are held here, which a front calls once it
    /// has sent the answer; every other operation of the decider settles first, so no
    /// decision ever sees the one before it half done. Until then, [`Self::slots`] counts
    /// the request but not its blocks.
    pub fn settle(&mut self) {
        if let Some(p) = self.pending.take() {
            let mut blocks = p.blocks;
            if self.keep_settled {
                self.settled.push(Settled {
                    request_id: p.request_id.clone(),
                    worker: p.worker,
                    blocks: blocks.full().to_vec(),
                });
            }
            self.slots.hold_blocks(&p.request_id, blocks);
        }
    }

    /// Whether a decision's blocks wait for [`Self::settle`].
    pub fn is_settled(&self) -> bool {
        self.pending.is_none()
    }

    /// The learned prefill times (with [`Formula::Time`]).
    pub fn prefill_times(&self) -> Option<&PrefillTimes> {
        self.prefill.as_ref()
    }

    /// Its settings.
    pub fn config(&self) -> &DeciderConfig {
        &self.cfg
    }

    /// Whether it runs in approximate mode (its own decisions stand for KV events).
    pub fn is_approximate(&self) -> bool {
        self.approx.is_some()
    }

    /// The slot manager (loads, active requests; the last decision's blocks once settled,
    /// [`Self::settle`]).
    pub fn slots(&self) -> &Slots {
        &self.slots
    }

    /// Per worker, how many leading blocks of `locals` it caches: from `index`, or in
    /// approximate mode from the decider's own records.
    pub fn overlaps(
        &mut self,
        index: Option<&dyn Lookup>,
        locals: &[LocalBlockHash],
        now_ms: u64,
    ) -> &OverlapScores {
        self.look_up(index, locals, now_ms);
        &self.overlaps
    }

    /// How far each worker's lower tiers continue `locals` past its device prefix (the KV
    /// index's lower tiers; none in approximate mode). `paths` are the request's path
    /// hashes; computed here from `locals` when `None` and needed.
    pub fn tier_overlaps(
        &mut self,
        index: Option<&dyn Lookup>,
        locals: &[LocalBlockHash],
        paths: Option<&[u64]>,
        now_ms: u64,
    ) -> (&OverlapScores, &TierScores) {
        self.look_up(index, locals, now_ms);
        self.look_up_tiers(index, locals, paths);
        (&self.overlaps, &self.tiers)
    }

    fn look_up_tiers(
        &mut self,
        index: Option<&dyn Lookup>,
        locals: &[LocalBlockHash],
        paths: Option<&[u64]>,
    ) {
        self.tiers.clear();
        let Some(index) = index.filter(|i| self.approx.is_none() && i.has_lower_tiers()) else {
            return;
        };
        let owned: Vec<u64>;
        let paths = match paths {
            Some(p) => p,
            None => {
                owned = crate::hash::sequence_hashes(locals)
                    .into_iter()
                    .map(|s| s.0)
                    .collect();
                &owned
            }
        };
        index.tier_overlaps_into(locals, paths, &self.overlaps, &mut self.tiers);
        self.tiers.scope(&self.pool_readers);
    }

    fn look_up(&mut self, index: Option<&dyn Lookup>, locals: &[LocalBlockHash], now_ms: u64) {
        match (&self.approx, index) {
            (Some(approx), _) => approx.find_matches_into(locals, now_ms, &mut self.overlaps),
            (None, Some(index)) => index.find_matches_into(locals, &mut self.overlaps),
            (None, None) => self.overlaps.clear(),
        }
        if let Some(recent) = &self.recent {
            recent.find_matches_into(locals, now_ms, &mut self.recent_scores);
            self.overlaps.merge_max(&self.recent_scores);
        }
    }

    /// Refuses a request of `blocks` blocks past [`Limits::max_blocks`]: a front checks
    /// before it hashes or looks anything up.
    pub fn check_blocks(&self, blocks: usize) -> Result<(), DecideError> {
        let max = self.cfg.limits.max_blocks;
        if blocks > max {
            return Err(DecideError::TooManyBlocks { blocks, max });
        }
        Ok(())
    }

    /// The overlaps the last decision (or [`Self::overlaps`]) saw.
    pub fn last_overlaps(&self) -> &OverlapScores {
        &self.overlaps
    }

    /// Routes one request among `workers` (sorted, distinct): looks it up, scores and picks
    /// a worker, and makes the request active there. `blocks` are the request's sequence
    /// hashes (distinct; usually [`SequenceChain::new`] of `route.locals`, computed only as
    /// far as the slot manager needs them), which the slot manager keeps until the request
    /// is freed.
    pub fn decide(
        &mut self,
        index: Option<&dyn Lookup>,
        workers: &[WorkerDp],
        route: Route<'_>,
        blocks: SequenceChain<'_>,
        now_ms: u64,
    ) -> Result<Decision, DecideError> {
        self.settle();
        let mut blocks = blocks;
        let limits = self.cfg.limits;
        self.check_blocks(route.locals.len())?;
        if let Some(id) = route.request_id {
            check_request_id(id, limits.max_request_id_bytes)?;
            if self.slots.worker_of(id).is_some() {
                return Err(SlotError::DuplicateRequest(id.into()).into());
            }
        }
        if self.slots.active_requests() >= limits.max_active_requests {
            return Err(DecideError::Overloaded {
                max: limits.max_active_requests,
            });
        }
        // Full workers are no candidates; the common case (none full) copies nothing.
        let all = workers;
        let open: Vec<WorkerDp>;
        let workers = if self.slots.any_full() {
            open = workers
                .iter()
                .copied()
                .filter(|&w| !self.slots.is_full(w))
                .collect();
            if open.is_empty() && !workers.is_empty() {
                return Err(DecideError::WorkersFull {
                    max: limits.max_active_per_worker,
                });
            }
            &open[..]
        } else {
            workers
        };
        if workers.is_empty() {
            return Err(DecideError::NoWorkers);
        }
        self.look_up(index, route.locals, now_ms);
        // Lower tiers are found by path hashes: then the whole chain is needed.
        let tiered = self.approx.is_none() && index.is_some_and(|i| i.has_lower_tiers());
        self.look_up_tiers(index, route.locals, tiered.then(|| blocks.full()));
        let mut scored = None;
        let mut credited_tokens = 0;
        let position = match self.cfg.selection {
            Selection::Cost => {
                let mut candidates = self.slots.candidates(workers, &mut blocks, &self.overlaps);
                if !self.tiers.is_empty() {
                    for c in &mut candidates {
                        self.tiers.fill(c);
                    }
                }
                if let Some(p) = &self.prefill {
                    for c in &mut candidates {
                        let active = self.slots.load(c.worker).active_requests;
                        c.decoding_requests = active.saturating_sub(p.pending(c.worker));
                        c.wait_ms = p.wait_ms(c.worker, now_ms);
                        c.prefill_model = p.coefficients(c.worker);
                    }
                }
                if let Some(r) = &self.returns {
                    for c in &mut candidates {
                        c.returns_per_ms = r.per_ms(c.worker, now_ms);
                    }
                }
                let s = score(
                    &self.cfg.cost,
                    route.tokens,
                    self.cfg.block_size,
                    &candidates,
                );
                // `s` is not empty (one per worker), so `choose` always picks.
                let i = choose(&self.cfg.cost, &s, &mut self.rng).unwrap_or(0);
                credited_tokens = (s[i].overlap_credit_blocks * f64::from(self.cfg.block_size))
                    .min(route.tokens as f64) as u64;
                if route.explain {
                    scored = Some(s);
                }
                i
            }
            Selection::RoundRobin => {
                self.round_robin += 1;
                (self.round_robin - 1) % workers.len()
            }
            Selection::Random => self.rng.below(workers.len()),
            Selection::LeastLoaded => {
                let load = |w: &WorkerDp| self.slots.load(*w).active_requests;
                let min = workers.iter().map(load).min().unwrap_or(0);
                let ties: Vec<usize> = (0..workers.len())
                    .filter(|&i| load(&workers[i]) == min)
                    .collect();
                ties[self.rng.below(ties.len())]
            }
        };
        let worker = workers[position];
        // The position among the candidates the caller gave.
        let position = if workers.len() == all.len() {
            position
        } else {
            all.iter().position(|&w| w == worker).unwrap_or(position)
        };
        let overlap_blocks = self.overlaps.get(worker);
        let cached_tokens = u64::from(overlap_blocks) * u64::from(self.cfg.block_size);
        let prefill_tokens = route.tokens.saturating_sub(cached_tokens);
        let request_id = match route.request_id {
            Some(id) => id.to_owned(),
            None => {
                self.next_request += 1;
                format!("{:x}-{}", self.cfg.id_prefix, self.next_request)
            }
        };
        self.slots
            .add_later(&request_id, worker, prefill_tokens, now_ms)?;
        self.pending = Some(Pending {
            request_id: request_id.clone(),
            worker,
            blocks: blocks.into_owned(),
        });
        if let Some(r) = &mut self.returns {
            // Returning in proportion to the share of it the worker holds. A front that
            // retries elsewhere routes again, so the first worker keeps its count too (as
            // the approximate records do).
            let share = credited_tokens as f64 / route.tokens.max(1) as f64;
            r.record(worker, share, now_ms);
        }
        if let Some(p) = &mut self.prefill {
            let new = route.tokens.saturating_sub(credited_tokens);
            p.start(&request_id, worker, (new, credited_tokens), now_ms, true);
        }
        if let Some(approx) = &mut self.approx {
            approx.record(worker, route.locals, now_ms);
        }
        if let Some(recent) = &mut self.recent {
            recent.record(worker, route.locals, now_ms);
        }
        Ok(Decision {
            worker,
            position,
            overlap_blocks,
            request_id,
            prefill_tokens,
            scored,
        })
    }

    /// The request produced its first token (its prefill charge is released).
    pub fn first_token(&mut self, request_id: &str, now_ms: u64) -> Result<WorkerDp, SlotError> {
        self.settle();
        let w = self.slots.mark_prefill_done(request_id, now_ms)?;
        if let Some(p) = &mut self.prefill {
            p.first_token(request_id, now_ms);
        }
        Ok(w)
    }

    /// The request finished: everything it held is released.
    pub fn free(&mut self, request_id: &str) -> Result<WorkerDp, SlotError> {
        // Blocks never held need no holding (nor shedding others to make room) to be let go.
        match &self.pending {
            Some(p) if p.request_id == request_id => self.pending = None,
            _ => self.settle(),
        }
        if let Some(p) = &mut self.prefill {
            p.forget(request_id);
        }
        self.slots.free(request_id)
    }

    /// Releases stale requests and expired approximate records; returns how many requests.
    pub fn expire(&mut self, now_ms: u64) -> usize {
        self.settle();
        if let Some(recent) = &mut self.recent {
            recent.expire(now_ms);
        }
        if let Some(approx) = &mut self.approx {
            approx.expire(now_ms);
        }
        let n = self.slots.expire(now_ms);
        if n > 0
            && let Some(p) = &mut self.prefill
        {
            let slots = &self.slots;
            p.retain(|id| slots.worker_of(id).is_some());
        }
        n
    }

    /// One (worker, dp rank) left the fleet (the others of the worker stay): its requests
    /// are released, its approximate records and learned prefill times forgotten; it is
    /// never chosen again unless it is a candidate again.
    pub fn remove(&mut self, worker: WorkerDp) {
        // A decision for the leaving worker goes with its requests, never held (nor
        // announced as settled).
        match &self.pending {
            Some(p) if p.worker == worker => self.pending = None,
            _ => self.settle(),
        }
        self.slots.remove(worker);
        if let Some(recent) = &mut self.recent {
            recent.remove(worker);
        }
        if let Some(approx) = &mut self.approx {
            approx.remove(worker);
        }
        if let Some(p) = &mut self.prefill {
            p.remove(worker);
        }
        if let Some(r) = &mut self.returns {
            r.remove(worker);
        }
    }

    /// Applies another replica's slot change (its own messages are the caller's to skip).
    /// Returns the worker it concerned, or why it did not apply. The limits hold here too:
    /// past [`Limits::max_active_requests`] an add is refused, a prompt longer than
    /// [`Limits::max_blocks`] is kept as its first `max_blocks` blocks, and the block budget
    /// sheds as for a decision (a load is then undercounted, never a request lost: its
    /// free still finds it).
    pub fn apply_replica(
        &mut self,
        e: ActiveSequenceEvent,
        now_ms: u64,
    ) -> Result<WorkerDp, SlotError> {
        // `first_token` and `free` settle as they do for our own fronts.
        match e.data {
            ActiveSequenceEventData::AddRequest {
                token_sequence,
                track_prefill_tokens,
                prefill_load_hint,
                ..
            } => {
                self.settle();
                let limits = self.cfg.limits;
                if self.slots.active_requests() >= limits.max_active_requests {
                    return Err(SlotError::Full {
                        max: limits.max_active_requests,
                    });
                }
                let mut blocks = token_sequence.unwrap_or_default();
                blocks.truncate(limits.max_blocks);
                let prefill = if track_prefill_tokens {
                    prefill_load_hint.map_or(0, |h| h.initial_effective_prefill_tokens)
                } else {
                    0
                };
                self.slots
                    .add(&e.request_id, e.worker, blocks, prefill, now_ms)?;
                // Another replica's request waits in the same queue (its cached part is
                // not sent: priced as all new, and its first token is no sample).
                if let Some(p) = &mut self.prefill
                    && prefill > 0
                {
                    p.start(&e.request_id, e.worker, (prefill, 0), now_ms, false);
                }
                Ok(e.worker)
            }
            ActiveSequenceEventData::MarkPrefillCompleted => {
                self.first_token(&e.request_id, now_ms)
            }
            ActiveSequenceEventData::Free => self.free(&e.request_id),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::event::{KvCacheEvent, RouterEvent};
    use crate::hash::{SequenceBlockHash, sequence_hashes};
    use crate::index::ReferenceIndex;
    use crate::policy::Herd;

    fn locals(v: &[u64]) -> Vec<LocalBlockHash> {
        v.iter().copied().map(LocalBlockHash).collect()
    }

    /// A decider whose slot manager holds at most `blocks` blocks.
    fn budgeted(blocks: u64) -> Decider {
        Decider::new(DeciderConfig {
            limits: Limits {
                max_active_blocks: blocks,
                ..Limits::default()
            },
            ..Default::default()
        })
    }

    fn seqs(l: &[LocalBlockHash]) -> SequenceChain<'_> {
        SequenceChain::new(l)
    }

    /// An index where worker 2 holds the first three blocks of `[1, 2, 3, 4]`.
    fn index() -> ReferenceIndex {
        let mut idx = ReferenceIndex::new();
        let l = locals(&[1, 2, 3]);
        let blocks: Vec<(LocalBlockHash, SequenceBlockHash)> =
            l.iter().copied().zip(sequence_hashes(&l)).collect();
        idx.apply(RouterEvent::new(
            2,
            KvCacheEvent::stored(0, 0, None, blocks),
        ))
        .unwrap();
        idx
    }

    const W: [WorkerDp; 3] = [
        WorkerDp::new(1, 0),
        WorkerDp::new(2, 0),
        WorkerDp::new(3, 0),
    ];

    fn route<'a>(l: &'a [LocalBlockHash], id: Option<&'a str>) -> Route<'a> {
        Route {
            locals: l,
            tokens: l.len() as u64 * 16,
            request_id: id,
            explain: true,
        }
    }

    #[test]
    fn the_time_cost_learns_each_workers_prefill_from_its_first_tokens() {
        use crate::policy::CostConfig;
        use crate::prefill::Prior;
        let idx = index();
        let mut d = Decider::new(DeciderConfig {
            block_size: 16,
            cost: CostConfig {
                prior: Prior {
                    base_ms: 10.0,
                    ms_per_ktoken: 100.0,
                    ms_per_mpair: 0.0,
                    variance: 1e4,
                },
                ..CostConfig::time()
            },
            ..Default::default()
        });
        let l = locals(&[1, 2, 3, 4]);
        let out = d
            .decide(Some(&idx), &W, route(&l, Some("a")), seqs(&l), 0)
            .unwrap();
        // Worker 2 caches 3 of 4 blocks: 16 new tokens behind 48 cached.
        assert_eq!(out.worker, W[1]);
        let scored = out.scored.unwrap();
        let mine = scored.iter().find(|s| s.candidate.worker == W[1]).unwrap();
        assert!(
            (mine.prefill_ms - (10.0 + 100.0 * 0.016)).abs() < 1e-9,
            "{mine:?}"
        );
        let p = d.prefill_times().unwrap();
        assert_eq!(p.waiting(), 1);
        assert!(p.wait_ms(W[1], 0) > 0.0);
        // Its first token after 500 ms: a sample, and the queue is empty again.
        d.first_token("a", 500).unwrap();
        let p = d.prefill_times().unwrap();
        assert_eq!(p.model(W[1]).unwrap().samples(), 1);
        assert_eq!(p.waiting(), 0);
        assert_eq!(p.wait_ms(W[1], 500), 0.0);
        assert!(p.prefill_ms(W[1], 16, 48) > 11.6);
        // A request freed before its first token leaves the queue without a sample.
        let l2 = locals(&[9, 8]);
        let out = d
            .decide(Some(&idx), &W, route(&l2, Some("b")), seqs(&l2), 600)
            .unwrap();
        d.free("b").unwrap();
        let p = d.prefill_times().unwrap();
        assert_eq!(p.waiting(), 0);
        assert_eq!(p.wait_ms(out.worker, 600), 0.0);
        // A worker that leaves takes its model with it.
        d.remove(W[1]);
        assert!(d.prefill_times().unwrap().model(W[1]).is_none());
        // The block formula keeps no prefill times.
        assert!(
            Decider::new(DeciderConfig::default())
                .prefill_times()
                .is_none()
        );
    }

    #[test]
    fn a_new_prompt_is_charged_for_the_turns_that_return_to_a_worker() {
        use crate::policy::CostConfig;
        let idx = index();
        let mut d = Decider::new(DeciderConfig {
            block_size: 16,
            cost: CostConfig {
                return_weight: 1.0,
                return_window_secs: 1.0,
                ..CostConfig::default()
            },
            ..Default::default()
        });
        // Five turns that find three of their four blocks at worker 2, each done at once.
        let l = locals(&[1, 2, 3, 4]);
        for t in 0..5u64 {
            let id = format!("turn{t}");
            let out = d
                .decide(Some(&idx), &W, route(&l, Some(&id)), seqs(&l), t)
                .unwrap();
            assert_eq!(out.worker, W[1]);
            d.free(&id).unwrap();
        }
        // A new prompt of 40 blocks: worker 2 expects 5 × 3/4 returns over the last
        // second, the others none, so it goes elsewhere.
        let new: Vec<u64> = (100..140).collect();
        let l = locals(&new);
        let out = d
            .decide(Some(&idx), &W, route(&l, Some("new")), seqs(&l), 10)
            .unwrap();
        assert_ne!(out.worker, W[1]);
        let scored = out.scored.unwrap();
        let rate: f64 = (0..5u64)
            .map(|t| 0.75 * (-((10 - t) as f64) / 1000.0).exp())
            .sum::<f64>()
            / 1000.0;
        // 40 blocks of 16 tokens at 120 ms per 1,000 tokens: 76.8 ms; in blocks of 1.92 ms.
        let want = rate * 76.8 * 76.8 / 2.0 / 1.92;
        let w2 = scored.iter().find(|s| s.candidate.worker == W[1]).unwrap();
        assert!((w2.candidate.returns_per_ms - rate).abs() < 1e-12, "{w2:?}");
        assert!((w2.returning_delay - want).abs() < 1e-9, "{w2:?}");
        for s in scored.iter().filter(|s| s.candidate.worker != W[1]) {
            assert_eq!(s.returning_delay, 0.0);
        }
        // A worker that leaves takes its rate with it.
        d.free("new").unwrap();
        d.remove(W[1]);
        let out = d
            .decide(Some(&idx), &W, route(&l, Some("again")), seqs(&l), 11)
            .unwrap();
        let scored = out.scored.unwrap();
        assert!(scored.iter().all(|s| s.returning_delay == 0.0));
        // Off by default: no rates kept.
        let mut d = Decider::new(DeciderConfig {
            block_size: 16,
            ..Default::default()
        });
        let l = locals(&[1, 2, 3, 4]);
        d.decide(Some(&idx), &W, route(&l, Some("x")), seqs(&l), 0)
            .unwrap();
        assert!(d.returns.is_none());
    }

    #[test]
    fn the_cost_selection_takes_the_cache_and_charges_what_is_left() {
        let idx = index();
        let mut d = Decider::new(DeciderConfig {
            block_size: 16,
            ..Default::default()
        });
        let l = locals(&[1, 2, 3, 4]);
        let out = d
            .decide(Some(&idx), &W, route(&l, Some("a")), seqs(&l), 0)
            .unwrap();
        assert_eq!((out.worker, out.position, out.overlap_blocks), (W[1], 1, 3));
        assert_eq!(out.prefill_tokens, 16);
        assert_eq!(out.scored.as_ref().map(Vec::len), Some(3));
        assert_eq!(d.slots().load(W[1]).active_prefill_tokens, 16);
        // The same id again is refused and changes nothing.
        let again = d.decide(Some(&idx), &W, route(&l, Some("a")), seqs(&l), 0);
        assert!(matches!(again, Err(DecideError::Slot(_))));
        assert_eq!(d.slots().active_requests(), 1);
        assert_eq!(d.first_token("a", 1), Ok(W[1]));
        assert_eq!(d.slots().load(W[1]).active_prefill_tokens, 0);
        assert_eq!(d.free("a"), Ok(W[1]));
        assert_eq!(
            d.decide(Some(&idx), &[], route(&l, None), seqs(&l), 0)
                .unwrap_err(),
            DecideError::NoWorkers
        );
    }

    #[test]
    fn made_up_ids_carry_the_prefix_and_count() {
        let mut d = Decider::new(DeciderConfig {
            id_prefix: 0xab,
            ..Default::default()
        });
        let l = locals(&[9]);
        let a = d.decide(None, &W, route(&l, None), seqs(&l), 0).unwrap();
        let b = d.decide(None, &W, route(&l, None), seqs(&l), 0).unwrap();
        assert_eq!(
            (a.request_id.as_str(), b.request_id.as_str()),
            ("ab-1", "ab-2")
        );
    }

    #[test]
    fn baselines_ignore_the_cache_but_report_it() {
        let idx = index();
        let l = locals(&[1, 2, 3, 4]);
        let mut rr = Decider::new(DeciderConfig {
            selection: Selection::RoundRobin,
            block_size: 16,
            ..Default::default()
        });
        let picks: Vec<usize> = (0..4)
            .map(|_| {
                rr.decide(Some(&idx), &W, route(&l, None), seqs(&l), 0)
                    .unwrap()
                    .position
            })
            .collect();
        assert_eq!(picks, [0, 1, 2, 0]);
        // What worker 2 caches is charged as cached there.
        assert_eq!(rr.slots().load(W[1]).active_prefill_tokens, 16);
        let mut ll = Decider::new(DeciderConfig {
            selection: Selection::LeastLoaded,
            ..Default::default()
        });
        let mut seen = [0; 3];
        for _ in 0..9 {
            seen[ll
                .decide(Some(&idx), &W, route(&l, None), seqs(&l), 0)
                .unwrap()
                .position] += 1;
        }
        assert_eq!(seen, [3, 3, 3]);
        let mut rnd = Decider::new(DeciderConfig {
            selection: Selection::Random,
            ..Default::default()
        });
        let out = rnd
            .decide(Some(&idx), &W, route(&l, None), seqs(&l), 0)
            .unwrap();
        assert!(out.scored.is_none());
    }

    #[test]
    fn approximate_mode_records_its_own_decisions_until_they_expire() {
        let mut d = Decider::new(DeciderConfig {
            approximate: Some(ApproxConfig {
                ttl_ms: 100,
                ..Default::default()
            }),
            stale_after_ms: 500,
            cost: CostConfig {
                herd: Herd::Off,
                ..CostConfig::default()
            },
            ..Default::default()
        });
        assert!(d.is_approximate());
        let l = locals(&[5, 6]);
        let first = d.decide(None, &W, route(&l, None), seqs(&l), 0).unwrap();
        d.free(&first.request_id).unwrap();
        // The next identical request follows the first: the decider remembers it.
        assert_eq!(d.overlaps(None, &l, 50).get(first.worker), 2);
        let next = d.decide(None, &W, route(&l, None), seqs(&l), 50).unwrap();
        assert_eq!((next.worker, next.overlap_blocks), (first.worker, 2));
        d.expire(1000);
        assert_eq!(d.overlaps(None, &l, 1000).get(first.worker), 0);
        assert_eq!(d.slots().active_requests(), 0);
    }

    #[test]
    fn remembered_decisions_credit_what_the_index_no_longer_shows() {
        let mut d = Decider::new(DeciderConfig {
            remember: Some(ApproxConfig {
                ttl_ms: 100,
                ..Default::default()
            }),
            cost: CostConfig {
                herd: Herd::Off,
                ..CostConfig::default()
            },
            ..Default::default()
        });
        assert!(!d.is_approximate());
        let idx = index();
        // [7, 8] is in no worker's cache; the decision is remembered.
        let l = locals(&[7, 8]);
        let first = d
            .decide(Some(&idx), &W, route(&l, None), seqs(&l), 0)
            .unwrap();
        d.free(&first.request_id).unwrap();
        // The index still shows nothing (the blocks were evicted, say); the record does.
        assert_eq!(d.overlaps(Some(&idx), &l, 50).get(first.worker), 2);
        let next = d
            .decide(Some(&idx), &W, route(&l, None), seqs(&l), 50)
            .unwrap();
        assert_eq!((next.worker, next.overlap_blocks), (first.worker, 2));
        // Merged per worker with the index's answer: the longer of the two.
        let q = locals(&[1, 2, 3, 4]);
        let w2 = WorkerDp::new(2, 0);
        assert_eq!(d.overlaps(Some(&idx), &q, 60).get(w2), 3);
        // Records expire; the index's answer stays.
        d.free(&next.request_id).unwrap();
        d.expire(1000);
        assert_eq!(d.overlaps(Some(&idx), &l, 1000).get(first.worker), 0);
        assert_eq!(d.overlaps(Some(&idx), &q, 1000).get(w2), 3);
    }

    #[test]
    fn a_removed_worker_loses_its_requests_and_records() {
        let mut d = Decider::new(DeciderConfig {
            approximate: Some(ApproxConfig::default()),
            ..Default::default()
        });
        let l = locals(&[5]);
        let out = d.decide(None, &W, route(&l, None), seqs(&l), 0).unwrap();
        d.remove(out.worker);
        assert_eq!(d.slots().active_requests(), 0);
        assert_eq!(d.overlaps(None, &l, 1).get(out.worker), 0);
        assert!(d.free(&out.request_id).is_err());
    }

    #[test]
    fn limits_refuse_with_their_cause() {
        let mut d = Decider::new(DeciderConfig {
            limits: Limits {
                max_blocks: 3,
                max_active_requests: 3,
                max_active_per_worker: 1,
                max_request_id_bytes: 8,
                max_active_blocks: u64::MAX,
            },
            ..Default::default()
        });
        let l = locals(&[1, 2, 3, 4]);
        assert_eq!(
            d.decide(None, &W, route(&l, None), seqs(&l), 0)
                .unwrap_err(),
            DecideError::TooManyBlocks { blocks: 4, max: 3 }
        );
        let l = locals(&[1, 2]);
        for (id, why) in [
            ("", "empty"),
            ("123456789", "too long"),
            ("a\nb", "control characters"),
        ] {
            assert_eq!(
                d.decide(None, &W, route(&l, Some(id)), seqs(&l), 0)
                    .unwrap_err(),
                DecideError::BadRequestId(why)
            );
        }
        // One request per worker: each decision takes a worker the others do not have,
        // reported at its position among the candidates given.
        let mut taken = Vec::new();
        for i in 0..3 {
            let out = d
                .decide(None, &W, route(&l, Some(&format!("r{i}"))), seqs(&l), 0)
                .unwrap();
            assert_eq!(W[out.position], out.worker);
            assert!(!taken.contains(&out.worker));
            taken.push(out.worker);
        }
        let err = d
            .decide(None, &W, route(&l, Some("r3")), seqs(&l), 0)
            .unwrap_err();
        assert_eq!(err, DecideError::Overloaded { max: 3 });
        assert!(!err.is_client_error());
        d.free("r0").unwrap();
        // Two workers full, the free one is chosen; then all are full.
        let out = d
            .decide(None, &W, route(&l, Some("r4")), seqs(&l), 0)
            .unwrap();
        assert_eq!(out.worker, taken[0]);
        d.free("r4").unwrap();
        d.free("r1").unwrap();
        let mut e = Decider::new(DeciderConfig {
            limits: Limits {
                max_active_per_worker: 1,
                ..Limits::default()
            },
            ..Default::default()
        });
        for i in 0..3 {
            e.decide(None, &W, route(&l, Some(&format!("r{i}"))), seqs(&l), 0)
                .unwrap();
        }
        assert_eq!(
            e.decide(None, &W, route(&l, Some("r9")), seqs(&l), 0)
                .unwrap_err(),
            DecideError::WorkersFull { max: 1 }
        );
    }

    /// One decision among `W` with `cost`, 16-token blocks, its candidates explained.
    fn decide_explained(idx: &dyn Lookup, cost: CostConfig, l: &[LocalBlockHash]) -> Decision {
        let mut d = Decider::new(DeciderConfig {
            cost,
            block_size: 16,
            ..Default::default()
        });
        let mut r = route(l, None);
        r.explain = true;
        d.decide(Some(idx), &W, r, seqs(l), 0).unwrap()
    }

    #[test]
    fn host_blocks_earn_their_credit() {
        // Worker 2 holds 3 of 4 blocks on the device; worker 3 holds all 4 in host memory
        // only. At host weight 1.0 worker 3's credit is 4 blocks and it wins; at 0.5 it is
        // 2, less than worker 2's 3.
        let mut idx = index();
        let l = locals(&[1, 2, 3, 4]);
        let blocks: Vec<(LocalBlockHash, SequenceBlockHash)> =
            l.iter().copied().zip(sequence_hashes(&l)).collect();
        let mut e = RouterEvent::new(3, KvCacheEvent::stored(0, 0, None, blocks));
        e.storage_tier = crate::worker::StorageTier::HostPinned;
        idx.apply(e).unwrap();
        for (weight, want) in [(1.0, W[2]), (0.5, W[1])] {
            let cost = CostConfig {
                host_cache_hit_weight: weight,
                ..CostConfig::default()
            };
            let out = decide_explained(&idx, cost, &l);
            assert_eq!(out.worker, want, "host weight {weight}");
            let scored = out.scored.unwrap();
            assert_eq!(scored[2].candidate.host_overlap_blocks, 4);
            assert_eq!(scored[1].candidate.device_overlap_blocks, 3);
        }
        let mut d = Decider::new(DeciderConfig::default());
        let (device, tiers) = d.tier_overlaps(Some(&idx), &l, None, 0);
        assert_eq!(device.get(W[1]), 3);
        assert_eq!(tiers.get(W[2]).host, 4);
    }

    /// Worker 2 holds the first 3 of 4 request blocks on the device; each `(source, n)`
    /// publishes a shared pool (residency `cache_owner`) of the first `n`.
    fn pools_over_a_device_prefix(
        pools: &[(u64, usize)],
    ) -> (crate::index::TreeIndex, Vec<LocalBlockHash>) {
        let mut idx = crate::index::TreeIndex::new(2);
        let l = locals(&[1, 2, 3, 4]);
        let blocks: Vec<(LocalBlockHash, SequenceBlockHash)> =
            l.iter().copied().zip(sequence_hashes(&l)).collect();
        idx.apply(RouterEvent::new(
            2,
            KvCacheEvent::stored(0, 0, None, blocks[..3].to_vec()),
        ))
        .unwrap();
        for &(source, n) in pools {
            let stored = KvCacheEvent::stored(0, 0, None, blocks[..n].to_vec());
            let mut e = RouterEvent::new(source, stored);
            e.residency_domain = Some(crate::event::ResidencyDomain::CacheOwner);
            e.storage_tier = crate::worker::StorageTier::External;
            idx.apply(e).unwrap();
        }
        (idx, l)
    }

    #[test]
    fn shared_pool_blocks_are_credited_past_each_device_prefix() {
        // Worker 2 holds 3 of the 4 blocks on the device; a shared pool (published by
        // source 9, residency `cache_owner`) holds all 4. Every worker reads the pool: worker
        // 2 is credited its one pool block past its device prefix, the others all 4.
        let (idx, l) = pools_over_a_device_prefix(&[(9, 4)]);
        // The pool's publisher is no worker.
        assert_eq!(idx.workers().len(), 1);
        for multiplier in [0.0, 0.5] {
            let cost = CostConfig {
                shared_cache_multiplier: multiplier,
                ..CostConfig::default()
            };
            let out = decide_explained(&idx, cost, &l);
            let scored = out.scored.unwrap();
            let beyond: Vec<u32> = scored
                .iter()
                .map(|s| s.candidate.shared_beyond_blocks)
                .collect();
            assert_eq!(beyond, [4, 1, 4]);
            for s in &scored {
                let want = multiplier * f64::from(s.candidate.shared_beyond_blocks);
                assert_eq!(s.credits.shared, want);
            }
            // Worker 2: 3 device blocks and half a block from the pool, against 2 pool
            // blocks elsewhere at 0.5: it still wins.
            assert_eq!(out.worker, W[1]);
        }
        let mut d = Decider::new(DeciderConfig::default());
        let (device, tiers) = d.tier_overlaps(Some(&idx), &l, None, 0);
        assert_eq!((device.get(W[1]), tiers.shared_beyond(3)), (3, 1));
        assert_eq!(tiers.shared_beyond(0), 4);
    }

    #[test]
    fn a_pool_with_readers_is_credited_to_its_readers_only() {
        // Worker 2 holds 3 of the 4 blocks on the device. Source 9's pool holds all 4 and
        // is read by worker 3 alone; source 10's holds the first 2 and every worker reads
        // it. Past its device prefix: worker 1 reads 2 pool blocks (source 10's), worker 2
        // none, worker 3 all 4 (blocks both pools hold count once).
        let (idx, l) = pools_over_a_device_prefix(&[(9, 4), (10, 2)]);
        let mut readers = PoolReaders::new();
        readers.add_rule("9=3").unwrap();
        let mut d = Decider::new(DeciderConfig {
            cost: CostConfig {
                shared_cache_multiplier: 0.5,
                ..CostConfig::default()
            },
            block_size: 16,
            ..Default::default()
        });
        d.set_pool_readers(readers);
        let out = d
            .decide(Some(&idx), &W, route(&l, None), seqs(&l), 0)
            .unwrap();
        let beyond: Vec<u32> = out
            .scored
            .unwrap()
            .iter()
            .map(|s| s.candidate.shared_beyond_blocks)
            .collect();
        assert_eq!(beyond, [2, 0, 4]);
        let (device, tiers) = d.tier_overlaps(Some(&idx), &l, None, 0);
        assert_eq!(device.get(W[1]), 3);
        assert!(tiers.has_scoped());
        // The pools every worker reads: source 10's 2 blocks.
        assert_eq!(tiers.shared_beyond(0), 2);
        assert_eq!(tiers.shared_beyond_for(W[2], 1), 3);
        // Without the rule every worker reads both: 4, 1, 4.
        d.set_pool_readers(PoolReaders::new());
        let (_, tiers) = d.tier_overlaps(Some(&idx), &l, None, 0);
        assert!(!tiers.has_scoped());
        let all: Vec<u32> = [0, 3, 0]
            .iter()
            .zip(W)
            .map(|(&from, w)| tiers.shared_beyond_for(w, from))
            .collect();
        assert_eq!(all, [4, 1, 4]);
    }

    /// A decision left unsettled is settled by the next one before it walks: the next turn
    /// of a session finds the turn before it held, with its sequence hashes learnt from the
    /// held run, not recomputed.
    #[test]
    fn the_next_decision_sees_the_last_one_settled() {
        let mut d = Decider::new(DeciderConfig::default());
        let first: Vec<u64> = (1..=40).collect();
        let l = locals(&first);
        let a = d
            .decide(None, &W, route(&l, Some("a")), seqs(&l), 0)
            .unwrap();
        assert!(!d.is_settled());
        let mut next = first.clone();
        next.extend(100..110);
        let l2 = locals(&next);
        let mut chain = SequenceChain::new(&l2);
        let b = d
            .decide(None, &W, route(&l2, Some("b")), chain.clone(), 0)
            .unwrap();
        let scored = b.scored.unwrap();
        let on_a = scored
            .iter()
            .find(|s| s.candidate.worker == a.worker)
            .unwrap();
        assert_eq!(on_a.candidate.inflight_overlap_blocks, 40);
        d.settle();
        // The walk alone, along `a`'s run and then `b`'s: one hash, to probe the edge from
        // the first run to the second; none along them.
        let c = d
            .slots()
            .candidates(&[a.worker], &mut chain, &OverlapScores::new());
        assert_eq!(c[0].inflight_overlap_blocks, 50);
        assert_eq!(chain.hashed(), 1);
        assert_eq!(
            chain.into_vec(),
            sequence_hashes(&l2).iter().map(|h| h.0).collect::<Vec<_>>()
        );
    }

    /// A request freed before its decision settled is let go without its blocks ever being
    /// held, and without shedding others' to make room for them.
    #[test]
    fn a_request_freed_unsettled_never_holds() {
        let mut d = budgeted(4);
        let l = locals(&[1, 2, 3]);
        d.decide(None, &W, route(&l, Some("a")), seqs(&l), 0)
            .unwrap();
        let l2 = locals(&[7, 8, 9]);
        d.decide(None, &W, route(&l2, Some("b")), seqs(&l2), 0)
            .unwrap();
        assert_eq!(d.slots().held_blocks(), 3);
        d.free("b").unwrap();
        assert!(d.is_settled());
        assert_eq!(d.slots().held_blocks(), 3);
        assert_eq!(d.slots().shed_requests(), 0);
        assert_eq!(d.slots().active_requests(), 1);
        assert_eq!(d.free("b"), Err(SlotError::UnknownRequest("b".into())));
        // The same when another replica frees it, and when its worker leaves: nothing
        // held, nobody shed, nothing announced as settled.
        d.keep_settled(true);
        let c = d
            .decide(None, &W, route(&l2, Some("c")), seqs(&l2), 0)
            .unwrap();
        let free = ActiveSequenceEvent {
            request_id: "c".into(),
            worker: c.worker,
            data: ActiveSequenceEventData::Free,
            router_id: 7,
            lora_name: None,
        };
        assert_eq!(d.apply_replica(free, 0), Ok(c.worker));
        assert!(d.is_settled());
        let e = d
            .decide(None, &W, route(&l2, Some("e")), seqs(&l2), 0)
            .unwrap();
        d.remove(e.worker);
        assert!(d.is_settled());
        assert_eq!(d.slots().worker_of("e"), None);
        assert_eq!(d.slots().shed_requests(), 0);
        assert!(d.take_settled().is_empty());
    }

    #[test]
    fn the_block_budget_sheds_old_requests_never_refuses() {
        let mut d = budgeted(5);
        let l = locals(&[1, 2, 3]);
        d.decide(None, &W, route(&l, Some("a")), seqs(&l), 0)
            .unwrap();
        d.decide(None, &W, route(&l, Some("b")), seqs(&l), 0)
            .unwrap();
        // `b` counts at once; its blocks wait until its answer is out.
        assert!(!d.is_settled());
        assert_eq!(d.slots().active_requests(), 2);
        assert_eq!(d.slots().held_blocks(), 3);
        d.settle();
        assert!(d.is_settled());
        // `a` gave its blocks up for `b`; both are active, and both can be freed.
        assert_eq!(d.slots().held_blocks(), 3);
        assert_eq!(d.slots().shed_requests(), 1);
        assert_eq!(d.slots().active_requests(), 2);
        d.free("a").unwrap();
        d.free("b").unwrap();
        assert_eq!(d.slots().held_blocks(), 0);
    }

    #[test]
    fn replicas_are_held_to_the_limits() {
        let mut d = Decider::new(DeciderConfig {
            limits: Limits {
                max_blocks: 2,
                max_active_requests: 1,
                ..Limits::default()
            },
            ..Default::default()
        });
        let add = |id: &str| ActiveSequenceEvent {
            request_id: id.into(),
            worker: W[0],
            data: ActiveSequenceEventData::AddRequest {
                token_sequence: Some(vec![1, 2, 3, 4]),
                track_prefill_tokens: false,
                expected_output_tokens: None,
                prefill_load_hint: None,
            },
            router_id: 9,
            lora_name: None,
        };
        assert_eq!(d.apply_replica(add("a"), 0), Ok(W[0]));
        assert_eq!(d.slots().load(W[0]).active_blocks, 2);
        assert_eq!(
            d.apply_replica(add("b"), 0),
            Err(SlotError::Full { max: 1 })
        );
        assert_eq!(d.free("a"), Ok(W[0]));
        // Past the block budget a replica's request is counted without its blocks.
        let mut d = budgeted(6);
        assert_eq!(d.apply_replica(add("a"), 0), Ok(W[0]));
        assert_eq!(d.apply_replica(add("b"), 0), Ok(W[0]));
        assert_eq!(d.slots().held_blocks(), 4);
        assert_eq!(d.slots().load(W[0]).active_requests, 2);
        assert_eq!(d.free("b"), Ok(W[0]));
        assert_eq!(d.free("a"), Ok(W[0]));
        assert_eq!(d.slots().held_blocks(), 0);
    }
}
