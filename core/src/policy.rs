//! Worker selection: the cost of sending a request to each worker, and the choice.
//!
//! For each candidate (worker, dp rank):
//!
//! ```text
//! raw_prefill_blocks      = (active_prefill_tokens + request_tokens) / block_size
//! overlap_credit_blocks   = overlap_score_credit   * device_overlap_blocks
//!                         + host_cache_hit_weight   * host_overlap_blocks
//!                         + disk_cache_hit_weight   * disk_overlap_blocks
//!                         + shared_cache_multiplier * shared_beyond_blocks
//! adjusted_prefill_blocks = max(raw_prefill_blocks - overlap_credit_blocks, 0)
//! fresh_prefill_blocks    = max(request_tokens / block_size - overlap_credit_blocks, 0)
//! fresh_weight            = new_block_weight
//!                         * (1 + saturation_weight * least_queued_blocks / request_blocks)
//! returning_delay         = return_weight * returns_per_ms * block_ms
//!                         * fresh_prefill_blocks^2 / 2
//! cost = prefill_load_scale * (adjusted_prefill_blocks + fresh_weight * fresh_prefill_blocks
//!                              + returning_delay)
//!      + decode_blocks
//! ```
//!
//! (`returning_delay` is 0 unless `return_weight` is set: "What neither formula sees yet"
//! below; `block_ms` is the prior's price of a block's prefill) where
//! `device_overlap_blocks` is, with `credit_inflight`, the larger of the index's
//! prefix and the one the worker's active requests hold (below), `least_queued_blocks` is
//! the least `active_prefill_tokens / block_size` over the candidates, and `decode_blocks` is
//! the worker's potential active blocks (its active blocks plus
//! the request's blocks it does not hold yet, from the slot manager). Candidates over the
//! busy thresholds are filtered out (unless all are). The lowest cost wins, ties broken at
//! random; with `temperature > 0` the worker is sampled by softmax over the costs
//! normalised to `[0, 1]` (min-max), `p ∝ exp(-normalised / temperature)`.
//!
//! **Dynamo's formula and ours.** With `new_block_weight = 0`, `prefill_load_scale = 1`
//! and `credit_inflight` off ([`CostConfig::dynamo`]) this is NVIDIA Dynamo 1.6.1's cost,
//! term for term. Our defaults differ in two weights, for two reasons the harness
//! measured (`docs/BENCHMARKS.md`, "Routing policies"), credit what active requests hold
//! and raise the fresh-block charge when the fleet is saturated (both below):
//!
//! - `prefill_load_scale` 32: a request's first token waits for the prefill queued ahead
//!   of it and its own prefill; the decode blocks a worker holds slow a step by far less
//!   (a decode token is one token of the step's budget). At weight 1 the decode term,
//!   which grows with every long conversation a worker holds, outweighs the cache and
//!   pushes follow-up turns away from it. (16 until the harness engine scheduled as vLLM
//!   does; 32 won more of the harness's cells on three seeds, docs/BENCHMARKS.md.)
//! - `new_block_weight` 4: the plain formula is greedy for the request at hand: it moves
//!   a request off its cache as soon as another worker's queue is shorter by more than
//!   the cached blocks. But every block recomputed is fleet capacity spent twice, and it
//!   delays every request queued behind it on that worker; under load that externality
//!   is worth several times the request's own wait. Charging each block the request
//!   would prefill from scratch 4 more times keeps follow-ups on their cache unless the
//!   queue gap is large. It only compares candidates that differ in what they cache: with
//!   equal overlaps the term is equal everywhere and load alone decides, so a hot prefix
//!   stops attracting requests once a second worker holds it.
//!
//! On the Mooncake conversation trace the pair keeps far more of the hits the fleet's
//! capacity allows, at a much lower mean TTFT (docs/BENCHMARKS.md has the figures).
//! Where KV memory rather than prefill is the bottleneck (caches a few requests deep),
//! the decode term matters more: lower `prefill_load_scale` there.
//!
//! **Herding.** When a burst of requests shares a prefix, the plain formula sends all of
//! them to the worker holding it until its load catches up (Dynamo issues #589, #737,
//! #7836). [`Herd::PowerOfTwo`] picks two candidates at random among the `k` cheapest and
//! keeps the cheaper: the cache-hot worker still wins most of the time, but a burst spreads
//! over the few nearly-as-good workers.
//!
//! **What the approximate mode knows.** On the agentic dev trace (long sessions whose
//! every reuse is the previous turn's prompt) the approximate mode, which sees no KV event,
//! kept up with or beat the exact one. The harness shows why (`docs/HARNESS.md`,
//! `offered %`): it records a routed request's whole prompt at its worker the moment it
//! routes it, while the exact index learns of those blocks only when the engine has
//! prefilled them and published them. When turns queue (load, long prompts), a session's
//! next turn often arrives while its previous one is still waiting or prefilling, and the
//! exact index then says the session's worker holds nothing: the exact policy moves the
//! session and recomputes its prompt. `credit_inflight` (on in ours, off in Dynamo's)
//! carries the approximate mode's knowledge over exactly: a worker is credited with the
//! longest prefix of the request that its own active requests hold (the slot manager's
//! per-worker prefix tree), when that is longer than what its events have shown. Blocks
//! of a request still prefilling will be cached by the time this one's prefill reaches
//! them: engines prefill in arrival order, and vLLM v1 starts a waiting request only
//! when the running ones leave budget over, caching a chunk's blocks when it schedules
//! it. With an engine that publishes each chunk's blocks as it schedules it, as vLLM
//! does, the index lags by the prompts still waiting and the chunks not yet scheduled,
//! and the credit lowers our mean 0.5–8 % at agentic speed 1, on the whole agentic trace
//! and on the synthetic trace at its highest load, on three seeds (docs/BENCHMARKS.md, "The engine publishes each
//! chunk's blocks when it schedules it"). With an engine that published a prompt's blocks
//! only when its prefill completed, it cut the whole agentic trace's mean 5.7–8.1×; with
//! one that looked a request's prefix up as soon as its memory fitted, so that such a
//! request recomputed what it joined, it looked harmful. The approximate mode also
//! never sees evictions and keeps a session where it was; the exact policy moves a
//! session once the index shows its blocks gone, and the copy it leaves behind is
//! capacity wasted twice. How much a
//! recompute costs depends on the load. While some worker is idle, a block recomputed
//! there costs that request its prefill time and nobody else anything; when every worker
//! has prefill queued, it is capacity taken from every request waiting.
//! `saturation_weight` (1 in ours, 0 in Dynamo's) says so: the fresh-block charge is
//! multiplied by `1 + saturation_weight × q / own`, where `q` is the least prefill
//! queued on any candidate and `own` the request's blocks (at least 1). Light loads route
//! as before; saturated ones keep sessions on their caches unless the queue gap is larger
//! than the recompute. `q / own` stands for the requests a recompute would delay, which
//! holds when prompts are alike; for a short cached request among long ones it
//! over-charges (it stays behind a longer queue than it should).
//!
//! With both, and `prefill_load_scale` 32, the exact policy is never worse than the
//! approximate mode on the harness's eleven cells on three seeds (docs/BENCHMARKS.md,
//! "The mock engine schedules as vLLM v1 does"). The router can also keep the
//! approximate mode's stickiness outright: with `DeciderConfig::remember`
//! (`kvrouter serve --remember-decisions-secs`) it records its own decisions too and
//! credits a worker with the longer of the index's prefix and the remembered one, so a
//! session whose blocks the index shows evicted still stays where it was. It is off by
//! default: with the harness engine scheduling as vLLM does it changed little and cost
//! the agentic p99 (seed 42, 120 s, before the engine published chunks as scheduled:
//! the whole agentic trace 2.16 s / 31.4 s → 2.06 s /
//! 31.9 s; its first 6,000 requests at speed 1 34.9 s → 38.0 s p99, above the approximate
//! mode's 37.2 s).
//!
//! **What neither formula sees yet.** On the agentic trace about half of our slowest 1 %
//! at speed 1 (a third at speed 0.3) are a session's next turn, its prompt all but
//! cached, arriving on its worker just after
//! another session's new prompt of several hundred thousand tokens started there.
//! Engines give each step's token budget to the running prefills first (vLLM v1 does), so
//! the cached turn waits for that whole prefill. Moving the turn recomputes its prompt,
//! which the block formula rightly prices above most of the wait; the lever is where the
//! long new prompt goes, and a cost built from the request's own queue and cache cannot
//! see the sessions, idle between turns, that it will hold up (docs/HARNESS.md).
//! `return_weight` (0, off) tries it with what the router can count: each worker's
//! decayed rate of returning requests ([`crate::returns`]), and a charge of
//! `rate × prefill² / 2` for the turns that would wait behind the request's uncached
//! prefill. It evens the requests per worker at light load but loses under load (p99
//! 15–31 % higher at agentic speed 1 with weight 0.25, three seeds): the rate lags, so new
//! sessions gather on the workers that look quiet and return together (docs/BENCHMARKS.md,
//! "Charging a prompt for the turns that return to a worker"). The
//! engine can remove that wait itself: with vLLM's `long_prefill_token_threshold` the
//! cached turn starts beside the long prefill, and in the harness our p99 at light load
//! falls by a quarter or more; under load the same cap lets a turn start before its
//! session's previous prompt has finished prefilling, and it computes again what that
//! prompt has not yet scheduled (docs/BENCHMARKS.md, "Why, cell by cell").
//!
//! **A cost in time** ([`Formula::Time`], the `kv-time` policy in the harness, opt-in).
//! The block weights are block counts tuned on one trace; a cost in milliseconds does not
//! need them: for each candidate, the predicted TTFT there (the wait until the prefill
//! already routed there ends, plus this request's own uncached prefill) plus
//! `decode_delay_weight` times the delay its prefill adds to each request decoding
//! there, plus the decode-memory term priced per block. Each worker's prefill time is a
//! model fitted online from the first tokens every front reports ([`crate::prefill`]),
//! so unlike GPUs are priced apart. Measured in the harness it loses to the block formula
//! on the mean in every cell, and on p99 in all but one (the first 6,000 agentic requests
//! at speed 0.3, on two seeds of three), so it is not the default: first-token times there
//! are often dominated by waits for KV memory (an engine holds about 33 agentic prompts),
//! which a prefill-queue model reads as a slow worker, herding the rest of the fleet onto a few
//! workers. The figures and the diagnosis are in docs/BENCHMARKS.md.
//!
//! Pure: the caller passes the loads, the overlaps and a seeded [`Rng`].

use serde::{Deserialize, Serialize};

use crate::worker::WorkerDp;

/// What a cost counts in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Formula {
    /// Blocks: Dynamo's formula with our weights (`prefill_load_scale`,
    /// `new_block_weight`), or Dynamo's own with [`CostConfig::dynamo`].
    #[default]
    Blocks,
    /// Milliseconds: predicted TTFT plus the delay the prefill adds to the requests
    /// decoding there, from each worker's learned prefill time ([`crate::prefill`]).
    Time,
}

impl std::str::FromStr for Formula {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "blocks" => Ok(Formula::Blocks),
            "time" => Ok(Formula::Time),
            other => Err(format!("unknown cost formula {other:?} (blocks, time)")),
        }
    }
}

/// Herd-resistance option.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Herd {
    /// The plain formula.
    #[default]
    Off,
    /// Power of two choices among the `k` cheapest candidates.
    PowerOfTwo {
        /// How many of the cheapest candidates to choose from.
        k: usize,
    },
}

/// Weights of the cost function. [`Default`] is ours; [`CostConfig::dynamo`] is Dynamo
/// 1.6.1's.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CostConfig {
    /// Credit per device-tier overlap block, in [0, 1].
    pub overlap_score_credit: f64,
    /// Weight of prefill load against decode load.
    pub prefill_load_scale: f64,
    /// Extra weight, in prefill blocks, of each block the request itself would have to
    /// prefill from scratch on the candidate (`fresh_prefill_blocks`); 0 in Dynamo.
    pub new_block_weight: f64,
    /// Credit per host-tier overlap block.
    pub host_cache_hit_weight: f64,
    /// Credit per disk-tier overlap block.
    pub disk_cache_hit_weight: f64,
    /// Credit per shared-cache block beyond the device overlap.
    pub shared_cache_multiplier: f64,
    /// 0: deterministic lowest cost; above 0: softmax sampling.
    pub temperature: f64,
    /// Filter out workers with more active decode blocks than this.
    pub max_active_decode_blocks: Option<u64>,
    /// Filter out workers with more active prefill tokens than this.
    pub max_active_prefill_tokens: Option<u64>,
    /// Herd-resistance option.
    pub herd: Herd,
    /// Credit the prefix held by the candidate's active requests as device overlap when
    /// it is longer than the index's (see the module docs, "What the approximate mode
    /// knows"); off in Dynamo.
    pub credit_inflight: bool,
    /// Blocks or time.
    pub formula: Formula,
    /// The fresh-block charge grows with the fleet's saturation: `new_block_weight` is
    /// multiplied by `1 + saturation_weight × q / own`, where `q` is the least prefill
    /// queued on any candidate and `own` the request's blocks (0: off). When no worker is
    /// idle, a block recomputed is fleet capacity taken from every request queued.
    pub saturation_weight: f64,
    /// With [`Formula::Time`]: weight of the delay a prefill adds to each request decoding
    /// on the candidate (every step that carries a prefill chunk holds their next token).
    pub decode_delay_weight: f64,
    /// With [`Formula::Time`]: the prefill model of a worker not yet observed. With
    /// [`Formula::Blocks`]: its `ms_per_ktoken` prices a block's prefill for the
    /// returning-delay term.
    pub prior: crate::prefill::Prior,
    /// Weight of the delay the request's uncached prefill adds to the requests expected
    /// to return to the candidate while it runs (`rate × prefill² / 2`, [`crate::returns`];
    /// 0: off, as in Dynamo).
    pub return_weight: f64,
    /// Decay window of each worker's rate of returning requests, seconds.
    pub return_window_secs: f64,
}

impl Default for CostConfig {
    /// Ours: Dynamo's formula with prefill weighted 32×, each block a request would
    /// prefill from scratch charged 4 more times (more when every worker has prefill
    /// queued), and the prefix a worker's active requests hold credited as cached (see
    /// the module docs).
    fn default() -> Self {
        Self {
            prefill_load_scale: 32.0,
            new_block_weight: 4.0,
            credit_inflight: true,
            saturation_weight: 1.0,
            ..Self::dynamo()
        }
    }
}

impl CostConfig {
    /// Checks the weights: the credits (`overlap_score_credit`, `host_cache_hit_weight`,
    /// `disk_cache_hit_weight`, `shared_cache_multiplier`) in [0, 1] as Dynamo 1.6.1 checks
    /// them, `prior.variance` and `return_window_secs` finite and above 0, every other
    /// weight finite and at least 0; the error names the first bad one.
    pub fn check(&self) -> Result<(), CostError> {
        for (name, value) in [
            ("overlap_score_credit", self.overlap_score_credit),
            ("host_cache_hit_weight", self.host_cache_hit_weight),
            ("disk_cache_hit_weight", self.disk_cache_hit_weight),
            ("shared_cache_multiplier", self.shared_cache_multiplier),
        ] {
            if !(0.0..=1.0).contains(&value) {
                return Err(CostError {
                    name,
                    value,
                    rule: "in [0, 1]",
                });
            }
        }
        for (name, value) in [
            ("prefill_load_scale", self.prefill_load_scale),
            ("new_block_weight", self.new_block_weight),
            ("temperature", self.temperature),
            ("decode_delay_weight", self.decode_delay_weight),
            ("saturation_weight", self.saturation_weight),
            ("return_weight", self.return_weight),
            ("prior.base_ms", self.prior.base_ms),
            ("prior.ms_per_ktoken", self.prior.ms_per_ktoken),
            ("prior.ms_per_mpair", self.prior.ms_per_mpair),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(CostError {
                    name,
                    value,
                    rule: "finite and at least 0",
                });
            }
        }
        for (name, value) in [
            ("prior.variance", self.prior.variance),
            ("return_window_secs", self.return_window_secs),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(CostError {
                    name,
                    value,
                    rule: "finite and above 0",
                });
            }
        }
        Ok(())
    }

    /// The time-based cost ([`Formula::Time`]) on our other defaults.
    pub fn time() -> Self {
        Self {
            formula: Formula::Time,
            decode_delay_weight: 1.0,
            ..Self::default()
        }
    }

    /// NVIDIA Dynamo 1.6.1's defaults: the plain formula (`new_block_weight` 0) with
    /// `prefill_load_scale` 1, host and disk credits 0.75 and 0.25, and the shared-cache
    /// multiplier of a deployment without a shared cache (`DYN_SHARED_CACHE_TYPE` none): 0.
    pub fn dynamo() -> Self {
        Self {
            overlap_score_credit: 1.0,
            prefill_load_scale: 1.0,
            new_block_weight: 0.0,
            host_cache_hit_weight: 0.75,
            disk_cache_hit_weight: 0.25,
            shared_cache_multiplier: 0.0,
            temperature: 0.0,
            max_active_decode_blocks: None,
            max_active_prefill_tokens: None,
            herd: Herd::Off,
            credit_inflight: false,
            saturation_weight: 0.0,
            formula: Formula::Blocks,
            decode_delay_weight: 0.0,
            prior: crate::prefill::Prior::default(),
            return_weight: 0.0,
            return_window_secs: 60.0,
        }
    }
}

/// A cost weight out of its range.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
#[error("{name} must be {rule}, not {value}")]
pub struct CostError {
    /// The weight's name (its `CostConfig` field).
    pub name: &'static str,
    /// Its value.
    pub value: f64,
    /// What it must be.
    pub rule: &'static str,
}

/// What the router knows about one candidate for one request.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct Candidate {
    /// The worker.
    pub worker: WorkerDp,
    /// Prompt tokens of its requests still in prefill.
    pub active_prefill_tokens: u64,
    /// Its active blocks now.
    pub active_decode_blocks: u64,
    /// Its active blocks if the request were added (shared blocks counted once).
    pub potential_decode_blocks: u64,
    /// Leading request blocks cached on the device.
    pub device_overlap_blocks: u32,
    /// Further blocks cached in host memory.
    pub host_overlap_blocks: u32,
    /// Further blocks cached on disk.
    pub disk_overlap_blocks: u32,
    /// Request blocks at or past the device overlap that a shared pool holds. Dynamo 1.6.1
    /// learns the pool's blocks from a query to it per request (SGLang HiCache); kvrouter
    /// from the pool's `cache_owner` KV events ([`crate::index::tiers`], "The shared pool").
    pub shared_beyond_blocks: u32,
    /// Leading request blocks that requests routed to it and still active hold (the slot
    /// manager's view: blocks its prefills are computing or have computed, before or
    /// whether or not their KV events arrived).
    pub inflight_overlap_blocks: u32,
    /// Its requests past their prefill (decoding), for [`Formula::Time`].
    pub decoding_requests: u64,
    /// Predicted wait before a request routed now starts its prefill there, ms
    /// ([`Formula::Time`]).
    pub wait_ms: f64,
    /// Its prefill model's coefficients `[b0, b1, b2]` ([`crate::prefill::features`]).
    pub prefill_model: [f64; 3],
    /// Requests returning to it per ms, recently ([`crate::returns`]; with
    /// `return_weight` above 0).
    pub returns_per_ms: f64,
}

/// A candidate's cost, with its terms (for `explain`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Scored {
    /// The candidate.
    #[serde(flatten)]
    pub candidate: Candidate,
    /// `(active_prefill_tokens + request_tokens) / block_size`.
    pub raw_prefill_blocks: f64,
    /// The overlap credits, all tiers together.
    pub overlap_credit_blocks: f64,
    /// Each tier's credit (their sum is `overlap_credit_blocks`).
    pub credits: Credits,
    /// `max(raw - credits, 0)`.
    pub adjusted_prefill_blocks: f64,
    /// `max(request_tokens / block_size - credits, 0)`: the request's own blocks less the
    /// cache credits this candidate earns (a host-tier block, credited 0.75, still counts
    /// 0.25 here).
    pub fresh_prefill_blocks: f64,
    /// The potential decode blocks.
    pub decode_blocks: f64,
    /// [`Formula::Time`]: the request's own predicted prefill there, ms.
    pub prefill_ms: f64,
    /// [`Formula::Time`]: predicted TTFT there (`wait_ms + prefill_ms`), ms.
    pub ttft_ms: f64,
    /// [`Formula::Time`]: the delay its prefill adds to the requests decoding there
    /// (`decode_delay_weight × prefill_ms × decoding_requests`), ms.
    pub added_delay_ms: f64,
    /// The delay its uncached prefill adds to the requests expected to return there
    /// meanwhile, weighted by `return_weight`: prefill blocks ([`Formula::Blocks`],
    /// inside `prefill_load_scale`) or ms ([`Formula::Time`]).
    pub returning_delay: f64,
    /// The cost.
    pub cost: f64,
    /// Whether it passed the busy thresholds.
    pub eligible: bool,
}

/// One candidate's overlap credit per tier, in blocks (weight × blocks).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct Credits {
    /// `overlap_score_credit × device_overlap_blocks`.
    pub device: f64,
    /// `host_cache_hit_weight × host_overlap_blocks`.
    pub host: f64,
    /// `disk_cache_hit_weight × disk_overlap_blocks`.
    pub disk: f64,
    /// `shared_cache_multiplier × shared_beyond_blocks`.
    pub shared: f64,
}

impl Credits {
    /// A candidate's credits under `cfg` (the device tier's overlap is, with
    /// `credit_inflight`, the longer of the index's and its active requests').
    fn of(cfg: &CostConfig, c: &Candidate) -> Self {
        let device = if cfg.credit_inflight {
            c.device_overlap_blocks.max(c.inflight_overlap_blocks)
        } else {
            c.device_overlap_blocks
        };
        Credits {
            device: cfg.overlap_score_credit * device as f64,
            host: cfg.host_cache_hit_weight * c.host_overlap_blocks as f64,
            disk: cfg.disk_cache_hit_weight * c.disk_overlap_blocks as f64,
            shared: cfg.shared_cache_multiplier * c.shared_beyond_blocks as f64,
        }
    }

    /// All tiers together.
    fn total(&self) -> f64 {
        self.device + self.host + self.disk + self.shared
    }
}

/// SplitMix64: a small seeded generator, so that decisions are reproducible in tests and
/// the harness.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator with this seed.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }
}

/// Scores every candidate for a request of `request_tokens` tokens.
pub fn score(
    cfg: &CostConfig,
    request_tokens: u64,
    block_size: u32,
    candidates: &[Candidate],
) -> Vec<Scored> {
    let bs = block_size.max(1) as f64;
    let own_blocks = (request_tokens as f64 / bs).max(1.0);
    let least_queued = candidates
        .iter()
        .map(|c| c.active_prefill_tokens)
        .min()
        .unwrap_or(0) as f64
        / bs;
    let fresh_weight =
        cfg.new_block_weight * (1.0 + cfg.saturation_weight * least_queued / own_blocks);
    let own = request_tokens as f64 / bs;
    candidates
        .iter()
        .map(|c| {
            let raw = c.active_prefill_tokens as f64 / bs + own;
            let credits = Credits::of(cfg, c);
            let credit = credits.total();
            let adjusted = (raw - credit).max(0.0);
            let fresh = (own - credit).max(0.0);
            let decode = c.potential_decode_blocks as f64;
            // Requests returning while the uncached prefill runs wait half of it on
            // average: `rate × prefill × prefill / 2`.
            let returning = |prefill: f64| {
                if cfg.return_weight > 0.0 && c.returns_per_ms > 0.0 && prefill > 0.0 {
                    cfg.return_weight * c.returns_per_ms * prefill * prefill / 2.0
                } else {
                    0.0
                }
            };
            let mut returning_delay = 0.0;
            let (prefill_ms, ttft_ms, added_delay_ms, time_cost) = match cfg.formula {
                Formula::Blocks => {
                    // In blocks: the prefill time is `fresh` blocks at the prior's price
                    // of one, and the delay is divided by that price again.
                    let block_ms = cfg.prior.ms_per_ktoken * bs / 1e3;
                    if block_ms > 0.0 {
                        returning_delay = returning(fresh * block_ms) / block_ms;
                    }
                    (0.0, 0.0, 0.0, 0.0)
                }
                Formula::Time => {
                    // Credited blocks are cached context; the rest is prefilled.
                    let cached = (credit * bs).min(request_tokens as f64) as u64;
                    let m = c.prefill_model;
                    let prefill = crate::prefill::predict_ms(&m, request_tokens - cached, cached);
                    let ttft = c.wait_ms + prefill;
                    let added = cfg.decode_delay_weight * prefill * c.decoding_requests as f64;
                    // KV memory: the decode blocks at the price of a prefill block over
                    // `prefill_load_scale`, as in the block formula.
                    let block_ms = m[1].max(0.0) * bs / 1e3;
                    let memory = block_ms / cfg.prefill_load_scale.max(1e-9) * decode;
                    // A turn found whole prefills nothing (the model's per-request base
                    // is not a prefill that holds anyone up).
                    if request_tokens > cached {
                        returning_delay = returning(prefill);
                    }
                    (
                        prefill,
                        ttft,
                        added,
                        ttft + added + memory + returning_delay,
                    )
                }
            };
            let eligible = cfg
                .max_active_decode_blocks
                .is_none_or(|m| c.active_decode_blocks <= m)
                && cfg
                    .max_active_prefill_tokens
                    .is_none_or(|m| c.active_prefill_tokens <= m);
            Scored {
                candidate: *c,
                raw_prefill_blocks: raw,
                overlap_credit_blocks: credit,
                credits,
                adjusted_prefill_blocks: adjusted,
                fresh_prefill_blocks: fresh,
                decode_blocks: decode,
                prefill_ms,
                ttft_ms,
                added_delay_ms,
                returning_delay,
                cost: match cfg.formula {
                    Formula::Blocks => {
                        // `fresh` 0 charges nothing, whatever the weight (no inf × 0).
                        let charge = if fresh > 0.0 {
                            fresh_weight * fresh
                        } else {
                            0.0
                        };
                        cfg.prefill_load_scale * (adjusted + charge + returning_delay) + decode
                    }
                    Formula::Time => time_cost,
                },
                eligible,
            }
        })
        .collect()
}

/// Chooses among scored candidates; `None` when there are none. When every candidate is
/// over a busy threshold, all of them are considered (the request must go somewhere).
pub fn choose(cfg: &CostConfig, scored: &[Scored], rng: &mut Rng) -> Option<usize> {
    let mut pool: Vec<usize> = (0..scored.len()).filter(|&i| scored[i].eligible).collect();
    if pool.is_empty() {
        pool = (0..scored.len()).collect();
    }
    if pool.is_empty() {
        return None;
    }
    if cfg.temperature > 0.0 {
        return Some(softmax_pick(scored, &pool, cfg.temperature, rng));
    }
    match cfg.herd {
        Herd::Off => Some(lowest(scored, &pool, rng)),
        Herd::PowerOfTwo { k } => {
            pool.sort_by(|&a, &b| scored[a].cost.total_cmp(&scored[b].cost));
            let k = k.clamp(1, pool.len());
            let a = pool[rng.below(k)];
            let b = pool[rng.below(k)];
            Some(if scored[b].cost < scored[a].cost {
                b
            } else {
                a
            })
        }
    }
}

fn lowest(scored: &[Scored], pool: &[usize], rng: &mut Rng) -> usize {
    // A cost that is not a number ranks last (weights are checked; this keeps a bad one
    // from emptying the ties).
    let cost = |i: usize| {
        let c = scored[i].cost;
        if c.is_nan() { f64::INFINITY } else { c }
    };
    let min = pool.iter().map(|&i| cost(i)).fold(f64::INFINITY, f64::min);
    let ties: Vec<usize> = pool.iter().copied().filter(|&i| cost(i) <= min).collect();
    ties[rng.below(ties.len())]
}

fn softmax_pick(scored: &[Scored], pool: &[usize], temperature: f64, rng: &mut Rng) -> usize {
    let min = pool
        .iter()
        .map(|&i| scored[i].cost)
        .fold(f64::INFINITY, f64::min);
    let max = pool
        .iter()
        .map(|&i| scored[i].cost)
        .fold(f64::NEG_INFINITY, f64::max);
    let span = max - min;
    let weights: Vec<f64> = pool
        .iter()
        .map(|&i| {
            let norm = if span > 0.0 {
                (scored[i].cost - min) / span
            } else {
                0.0
            };
            (-norm / temperature).exp()
        })
        .collect();
    let total: f64 = weights.iter().sum();
    let mut x = rng.next_f64() * total;
    for (w, &i) in weights.iter().zip(pool) {
        if x < *w {
            return i;
        }
        x -= w;
    }
    *pool.last().expect("non-empty pool")
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn cand(id: u64, overlap: u32, decode: u64) -> Candidate {
        Candidate {
            worker: WorkerDp::new(id, 0),
            potential_decode_blocks: decode,
            device_overlap_blocks: overlap,
            ..Default::default()
        }
    }

    #[test]
    fn the_seeds_worked_example() {
        // Credit 1.0, 10 raw prefill blocks each (160 tokens at block size 16).
        let cands = [cand(1, 2, 10), cand(2, 5, 5), cand(3, 8, 9)];
        let scored = score(&CostConfig::dynamo(), 160, 16, &cands);
        let costs: Vec<f64> = scored.iter().map(|s| s.cost).collect();
        assert_eq!(costs, vec![18.0, 10.0, 11.0]);
        let pick = choose(&CostConfig::dynamo(), &scored, &mut Rng::new(1)).unwrap();
        assert_eq!(scored[pick].candidate.worker.worker_id, 2);
    }

    #[test]
    fn our_defaults_charge_fresh_blocks_and_weigh_prefill() {
        // Ours: 32 * (adjusted + 4 * fresh) + decode. W1 fresh 8, W2 5, W3 2.
        let cands = [cand(1, 2, 10), cand(2, 5, 5), cand(3, 8, 9)];
        let scored = score(&CostConfig::default(), 160, 16, &cands);
        let fresh: Vec<f64> = scored.iter().map(|s| s.fresh_prefill_blocks).collect();
        assert_eq!(fresh, vec![8.0, 5.0, 2.0]);
        let costs: Vec<f64> = scored.iter().map(|s| s.cost).collect();
        assert_eq!(
            costs,
            vec![
                32.0 * (8.0 + 32.0) + 10.0,
                32.0 * (5.0 + 20.0) + 5.0,
                32.0 * (2.0 + 8.0) + 9.0
            ]
        );
        // Dynamo sends it to W2 (less decode load); ours keeps it with the longest cache.
        let pick = choose(&CostConfig::default(), &scored, &mut Rng::new(1)).unwrap();
        assert_eq!(scored[pick].candidate.worker.worker_id, 3);
        // The charge compares caches, not loads: with equal overlaps load alone decides.
        let queued = Candidate {
            active_prefill_tokens: 64,
            ..cand(1, 4, 0)
        };
        let scored = score(&CostConfig::default(), 160, 16, &[queued, cand(2, 4, 0)]);
        assert_eq!(
            scored[0].fresh_prefill_blocks,
            scored[1].fresh_prefill_blocks
        );
        assert_eq!(
            choose(&CostConfig::default(), &scored, &mut Rng::new(1)),
            Some(1)
        );
    }

    #[test]
    fn the_time_cost_weighs_the_queue_against_the_recompute() {
        // 100 ms per request and 100 ms per 1,000 new tokens, no attention term.
        let model = [100.0, 100.0, 0.0];
        let time = CostConfig {
            decode_delay_weight: 0.0,
            ..CostConfig::time()
        };
        // W1 caches 60 of the 64 blocks (4,096 tokens at 64) but 2 s of prefill wait there;
        // W2 caches nothing and waits for nothing.
        let hot = Candidate {
            wait_ms: 2000.0,
            prefill_model: model,
            ..cand(1, 60, 0)
        };
        let cold = Candidate {
            prefill_model: model,
            ..cand(2, 0, 0)
        };
        let s = score(&time, 4096, 64, &[hot, cold]);
        // W1: 2,000 + 100 + 0.1 × 256 new tokens; W2: 100 + 0.1 × 4,096.
        assert!((s[0].prefill_ms - 125.6).abs() < 1e-9, "{:?}", s[0]);
        assert!((s[0].ttft_ms - 2125.6).abs() < 1e-9);
        assert!((s[1].ttft_ms - 509.6).abs() < 1e-9);
        assert_eq!(choose(&time, &s, &mut Rng::new(1)), Some(1));
        // A shorter queue keeps it on its cache.
        let s = score(
            &time,
            4096,
            64,
            &[
                Candidate {
                    wait_ms: 300.0,
                    ..hot
                },
                cold,
            ],
        );
        assert_eq!(choose(&time, &s, &mut Rng::new(1)), Some(0));
        // Each request decoding on a worker pays for the prefill there once more.
        let busy = Candidate {
            decoding_requests: 3,
            ..cold
        };
        let weighted = CostConfig {
            decode_delay_weight: 1.0,
            ..time
        };
        let s = score(&weighted, 4096, 64, &[busy]);
        assert!((s[0].added_delay_ms - 3.0 * 509.6).abs() < 1e-9);
        // The block formula leaves the time terms at 0.
        let s = score(&CostConfig::default(), 4096, 64, &[hot]);
        assert_eq!(
            (s[0].prefill_ms, s[0].ttft_ms, s[0].added_delay_ms),
            (0.0, 0.0, 0.0)
        );
    }

    #[test]
    fn the_fresh_charge_grows_when_no_worker_is_idle() {
        // 10 blocks of request; W1 caches 8, W2 nothing.
        let hot = Candidate {
            active_prefill_tokens: 40 * 16,
            ..cand(1, 8, 0)
        };
        let cold = Candidate {
            active_prefill_tokens: 20 * 16,
            ..cand(2, 0, 0)
        };
        let plain = CostConfig {
            saturation_weight: 0.0,
            ..CostConfig::default()
        };
        // Plain: W1 32 × (42 + 4 × 2), W2 32 × (30 + 4 × 10). Saturated (the least queue
        // is 20 blocks, twice the request): each fresh block is charged 4 × (1 + 2) = 12.
        let s = score(&plain, 160, 16, &[hot, cold]);
        assert_eq!(s[1].cost, 32.0 * (30.0 + 4.0 * 10.0));
        let s = score(&CostConfig::default(), 160, 16, &[hot, cold]);
        assert_eq!(s[0].cost, 32.0 * (42.0 + 12.0 * 2.0));
        assert_eq!(s[1].cost, 32.0 * (30.0 + 12.0 * 10.0));
        // An idle worker among the candidates: no saturation, the plain charge.
        let idle = cand(3, 0, 0);
        let s = score(&CostConfig::default(), 160, 16, &[hot, cold, idle]);
        assert_eq!(s[1].cost, 32.0 * (30.0 + 4.0 * 10.0));
        // The queue gap that moves a request off its cache grows with saturation: W2 with
        // 12 blocks queued against W1's 40 takes it plainly, not when every worker is busy.
        let cold = Candidate {
            active_prefill_tokens: 12 * 16,
            ..cand(2, 0, 0)
        };
        let hot = Candidate {
            active_prefill_tokens: 60 * 16,
            ..cand(1, 8, 0)
        };
        let pick = |cfg: &CostConfig| {
            let s = score(cfg, 160, 16, &[hot, cold]);
            s[choose(cfg, &s, &mut Rng::new(1)).unwrap()]
                .candidate
                .worker
                .worker_id
        };
        assert_eq!(pick(&plain), 2);
        assert_eq!(pick(&CostConfig::default()), 1);
    }

    #[test]
    fn a_long_new_prompt_avoids_the_worker_its_sessions_return_to() {
        // A new prompt of 100 blocks of 16 tokens; both workers idle and caching nothing.
        // At the prior's 120 ms per 1,000 tokens a block takes 1.92 ms, so the prefill
        // takes 192 ms. W1 sees a returning request every 10 ms, W2 every 100 ms.
        let busy = Candidate {
            returns_per_ms: 0.1,
            ..cand(1, 0, 0)
        };
        let quiet = Candidate {
            returns_per_ms: 0.01,
            ..cand(2, 0, 0)
        };
        let cfg = CostConfig {
            return_weight: 1.0,
            ..CostConfig::default()
        };
        let s = score(&cfg, 1600, 16, &[busy, quiet]);
        // rate × t² / 2, in blocks: 0.1 × 192² / 2 ms / 1.92 ms = 960 blocks at W1, 96
        // at W2.
        for (sc, want) in s.iter().zip([960.0, 96.0]) {
            assert!((sc.returning_delay - want).abs() < 1e-9, "{sc:?}");
            let base = 32.0 * (100.0 + 4.0 * 100.0);
            assert!((sc.cost - (base + 32.0 * want)).abs() < 1e-6);
        }
        assert_eq!(choose(&cfg, &s, &mut Rng::new(1)), Some(1));
        // Off by default, and nothing for what is cached: a turn found whole at W1 stays.
        let s = score(&CostConfig::default(), 1600, 16, &[busy, quiet]);
        assert_eq!(s[0].returning_delay, 0.0);
        assert_eq!(s[0].cost, s[1].cost);
        let home = Candidate {
            returns_per_ms: 0.1,
            ..cand(1, 100, 0)
        };
        let s = score(&cfg, 1600, 16, &[home, quiet]);
        assert_eq!(s[0].returning_delay, 0.0);
        assert_eq!(choose(&cfg, &s, &mut Rng::new(1)), Some(0));
        // In time: the same delay in ms, with the candidate's own prefill model.
        let time = CostConfig {
            return_weight: 1.0,
            ..CostConfig::time()
        };
        let m = [0.0, 120.0, 0.0];
        let busy = Candidate {
            prefill_model: m,
            ..busy
        };
        let s = score(&time, 1600, 16, &[busy]);
        let t = crate::prefill::predict_ms(&m, 1600, 0);
        assert!((s[0].returning_delay - 0.1 * t * t / 2.0).abs() < 1e-9);
        // A turn found whole is charged nothing there either (no per-request base).
        let home = Candidate {
            prefill_model: [20.0, 120.0, 1.0],
            ..home
        };
        let s = score(&time, 1600, 16, &[home]);
        assert_eq!(s[0].returning_delay, 0.0);
        // The weights are checked.
        for bad in [
            CostConfig {
                return_weight: -1.0,
                ..CostConfig::default()
            },
            CostConfig {
                return_window_secs: 0.0,
                ..CostConfig::default()
            },
        ] {
            assert!(bad.check().is_err());
        }
    }

    #[test]
    fn a_cost_that_is_no_number_ranks_last() {
        let mut s = score(
            &CostConfig::default(),
            160,
            16,
            &[cand(1, 0, 0), cand(2, 0, 9)],
        );
        s[0].cost = f64::NAN;
        let cfg = CostConfig::default();
        assert_eq!(choose(&cfg, &s, &mut Rng::new(1)), Some(1));
        s[1].cost = f64::NAN;
        assert!(choose(&cfg, &s, &mut Rng::new(1)).is_some());
        // No inf × 0: a fully cached candidate is charged nothing for fresh blocks even
        // under an unbounded saturation charge.
        let wild = CostConfig {
            saturation_weight: f64::MAX,
            ..CostConfig::default()
        };
        let busy = |id, overlap| Candidate {
            active_prefill_tokens: 1 << 40,
            ..cand(id, overlap, 0)
        };
        let s = score(&wild, 160, 16, &[busy(1, 10), busy(2, 0)]);
        assert!(s[0].cost.is_finite(), "{:?}", s[0]);
        assert_eq!(choose(&wild, &s, &mut Rng::new(1)), Some(0));
    }

    #[test]
    fn inflight_credit_counts_the_prefix_active_requests_hold() {
        // The index knows 2 blocks at W1, its active requests hold 6 (their prefill is
        // still running, so no event has come yet).
        let c = Candidate {
            inflight_overlap_blocks: 6,
            ..cand(1, 2, 0)
        };
        let off = CostConfig {
            credit_inflight: false,
            ..CostConfig::default()
        };
        let off = score(&off, 160, 16, &[c]);
        assert!(CostConfig::default().credit_inflight);
        assert!(!CostConfig::dynamo().credit_inflight);
        let on = score(&CostConfig::default(), 160, 16, &[c]);
        assert_eq!(off[0].overlap_credit_blocks, 2.0);
        assert_eq!(on[0].overlap_credit_blocks, 6.0);
        // The index's longer view wins when it is the longer.
        let c = Candidate {
            inflight_overlap_blocks: 1,
            ..c
        };
        let on = CostConfig {
            credit_inflight: true,
            ..CostConfig::default()
        };
        assert_eq!(score(&on, 160, 16, &[c])[0].overlap_credit_blocks, 2.0);
    }

    #[test]
    fn weights_are_checked() {
        assert_eq!(CostConfig::default().check(), Ok(()));
        assert_eq!(CostConfig::dynamo().check(), Ok(()));
        let bad = [
            CostConfig {
                overlap_score_credit: 1.5,
                ..Default::default()
            },
            CostConfig {
                new_block_weight: -1.0,
                ..Default::default()
            },
            CostConfig {
                prefill_load_scale: f64::NAN,
                ..Default::default()
            },
            CostConfig {
                temperature: f64::INFINITY,
                ..Default::default()
            },
            CostConfig {
                prior: crate::prefill::Prior {
                    variance: 0.0,
                    ..Default::default()
                },
                ..CostConfig::time()
            },
            CostConfig {
                saturation_weight: -1.0,
                ..Default::default()
            },
        ];
        for c in bad {
            assert!(c.check().is_err(), "{c:?}");
        }
    }

    #[test]
    fn credits_tiers_and_clamping() {
        let c = Candidate {
            worker: WorkerDp::new(1, 0),
            active_prefill_tokens: 64,
            potential_decode_blocks: 3,
            device_overlap_blocks: 2,
            host_overlap_blocks: 4,
            disk_overlap_blocks: 4,
            shared_beyond_blocks: 1,
            ..Default::default()
        };
        let with_shared = CostConfig {
            shared_cache_multiplier: 1.0,
            ..Default::default()
        };
        let s = score(&with_shared, 256, 64, &[c])[0];
        assert_eq!(s.raw_prefill_blocks, 5.0);
        assert_eq!(s.overlap_credit_blocks, 2.0 + 3.0 + 1.0 + 1.0);
        assert_eq!(
            s.credits,
            Credits {
                device: 2.0,
                host: 3.0,
                disk: 1.0,
                shared: 1.0
            }
        );
        let without = score(&CostConfig::default(), 256, 64, &[c])[0];
        assert_eq!(without.overlap_credit_blocks, 2.0 + 3.0 + 1.0);
        assert_eq!(s.adjusted_prefill_blocks, 0.0);
        assert_eq!(s.fresh_prefill_blocks, 0.0);
        assert_eq!(s.cost, 3.0);
    }

    #[test]
    fn ties_are_broken_at_random_and_thresholds_filter() {
        let cands = [cand(1, 0, 5), cand(2, 0, 5)];
        let scored = score(&CostConfig::default(), 64, 64, &cands);
        let mut rng = Rng::new(7);
        let mut seen = [0; 2];
        for _ in 0..1000 {
            seen[choose(&CostConfig::default(), &scored, &mut rng).unwrap()] += 1;
        }
        assert!(seen[0] > 400 && seen[1] > 400, "{seen:?}");
        let mut busy = cands;
        busy[0].active_decode_blocks = 100;
        let cfg = CostConfig {
            max_active_decode_blocks: Some(50),
            ..Default::default()
        };
        let scored = score(&cfg, 64, 64, &busy);
        assert!(!scored[0].eligible);
        for _ in 0..100 {
            assert_eq!(choose(&cfg, &scored, &mut rng), Some(1));
        }
        assert_eq!(choose(&cfg, &[], &mut rng), None);
    }

    #[test]
    fn temperature_samples_by_softmax_of_normalised_costs() {
        // Costs 0, 5, 10 normalise to 0, 0.5, 1; at T = 0.5 the weights are 1, e^-1, e^-2.
        let cands = [cand(1, 0, 0), cand(2, 0, 5), cand(3, 0, 10)];
        let cfg = CostConfig {
            temperature: 0.5,
            ..Default::default()
        };
        let scored = score(&cfg, 0, 16, &cands);
        let mut rng = Rng::new(42);
        let n = 200_000;
        let mut seen = [0f64; 3];
        for _ in 0..n {
            seen[choose(&cfg, &scored, &mut rng).unwrap()] += 1.0;
        }
        let w = [1.0, (-1.0f64).exp(), (-2.0f64).exp()];
        let total: f64 = w.iter().sum();
        for i in 0..3 {
            let expected = w[i] / total;
            let got = seen[i] / n as f64;
            assert!(
                (got - expected).abs() < 0.01,
                "worker {i}: {got} vs {expected}"
            );
        }
    }

    #[test]
    fn power_of_two_spreads_a_burst_over_the_k_cheapest() {
        let cands = [
            cand(1, 0, 10),
            cand(2, 0, 11),
            cand(3, 0, 12),
            cand(4, 0, 100),
        ];
        let cfg = CostConfig {
            herd: Herd::PowerOfTwo { k: 3 },
            ..Default::default()
        };
        let scored = score(&cfg, 0, 16, &cands);
        let mut rng = Rng::new(3);
        let mut seen = [0; 4];
        for _ in 0..9000 {
            seen[choose(&cfg, &scored, &mut rng).unwrap()] += 1;
        }
        // Cheapest of two uniform picks among 3: 5/9, 3/9, 1/9; never the expensive one.
        assert_eq!(seen[3], 0);
        assert!(
            seen[0] > seen[1] && seen[1] > seen[2] && seen[2] > 500,
            "{seen:?}"
        );
    }
}
