//! Prefill time, learned per worker: how long a worker takes to prefill a prompt, and how
//! long the prefill already routed to it will keep a new request waiting.
//!
//! **The model.** A prefill of `n` uncached tokens behind `c` cached ones takes
//!
//! ```text
//! t(n, c) = b0 + b1 · n/1000 + b2 · n·(c + n/2)/10^6      milliseconds
//! ```
//!
//! a fixed cost per request, a cost per token (the weights' matmuls), and a cost per token
//! and per token of context it attends to (attention: token `i` of the new ones attends to
//! `c + i` tokens, `n·(c + n/2)` pairs in all). It is linear in `b`, so each worker fits
//! its own `b` online by recursive least squares with forgetting (old samples fade with
//! weight [`FORGET`] per sample), which follows a worker whose speed changes and handles a
//! fleet of unlike GPUs: nothing is shared between workers.
//!
//! **Cold start.** Before a worker's first sample its model is the prior [`Prior::default`]:
//! about 8,300 tokens/s and attention from FLOP counts of a Llama-3-8B-class model on one
//! H100-class GPU (`b0` 20 ms, `b1` 120 ms per 1,000 tokens, `b2` 1 ms per 10^6 token
//! pairs). Its variance is large next to a prefill's squared features, so a worker's first
//! samples replace it almost at once: it prices workers never routed to, nothing more.
//! A coefficient may fit below 0 where the samples do not tell the terms apart (prompts
//! all of one size); predictions are clamped at 0, and the cost takes the per-token
//! coefficient at no less than 0 (a negative one would reward the busy).
//!
//! **What is observed.** Engines prefill in arrival order (chunked prefill hands the token
//! budget to the oldest unfinished prompt first), so a worker's prefills form a queue: a
//! request's own prefill starts when it was routed or when the request before it on that
//! worker produced its first token, whichever is later, and ends at its own first token.
//! That span is the sample of `t(n, c)` for the `n` and `c` charged when it was routed.
//! Decode steps that run beside the prefill are inside the sample, so the fit prices a
//! busy worker's prefill as slower, which it is. Engines also pack several short prompts
//! into one step, so first tokens can come at the same instant: a request whose first
//! token comes at the instant of the one before it on its worker shared that step and is
//! not a sample (its span would read 0). Engines that reorder prompts (SGLang's
//! longest-prefix-first) break the queue assumption; the clipping below bounds what one
//! such sample does. Requests another replica routed join the queue but are not samples
//! (that replica does not say what it credited).
//!
//! **The queue.** Per worker, the predicted end of the prefill routed to it: each decision
//! adds its predicted `t`; each first token resets it to now plus the predicted `t` of the
//! requests still waiting for theirs (the engine's progress on the head is unknown, so
//! drift is corrected at every first token rather than accumulated). A request's predicted
//! TTFT there is the wait until that end plus its own `t`.
//!
//! Pure and clock-free: times are arguments.

use std::collections::HashMap;

use crate::hash::MixBuildHasher;
use crate::worker::WorkerDp;

/// Weight of the previous samples at each new one (an effective memory of about 200
/// samples).
pub const FORGET: f64 = 0.995;

/// A sample's residual counts at most this many times the typical residual (a running
/// mean of recent absolute residuals) ...
pub const CLIP: f64 = 4.0;

/// ... or this many ms, when more.
pub const CLIP_MIN_MS: f64 = 50.0;

/// Samples learned in full before residuals are clipped (they set the typical residual,
/// and a prior far from the worker must be left behind quickly).
pub const UNCLIPPED_SAMPLES: u64 = 8;

/// Weight of each new absolute residual in the typical residual.
const SCALE_WEIGHT: f64 = 0.05;

/// Features of a prefill: `[1, n/1000, n·(c + n/2)/10^6]`.
pub fn features(new_tokens: u64, cached_tokens: u64) -> [f64; 3] {
    let n = new_tokens as f64;
    let c = cached_tokens as f64;
    [1.0, n / 1e3, n * (c + n / 2.0) / 1e6]
}

/// `t(n, c)` with coefficients `b` (`[b0, b1, b2]`), ms, at least 0.
pub fn predict_ms(b: &[f64; 3], new_tokens: u64, cached_tokens: u64) -> f64 {
    dot(b, &features(new_tokens, cached_tokens)).max(0.0)
}

/// The cold-start model and how strongly it is held.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Prior {
    /// `b0`: ms per request.
    pub base_ms: f64,
    /// `b1`: ms per 1,000 new tokens.
    pub ms_per_ktoken: f64,
    /// `b2`: ms per 10^6 (new token, context token) pairs.
    pub ms_per_mpair: f64,
    /// Variance of each coefficient (larger: the prior yields sooner).
    pub variance: f64,
}

impl Default for Prior {
    fn default() -> Self {
        Self {
            base_ms: 20.0,
            ms_per_ktoken: 120.0,
            ms_per_mpair: 1.0,
            variance: 1e4,
        }
    }
}

impl Prior {
    /// Its coefficients `[b0, b1, b2]`.
    pub fn coefficients(&self) -> [f64; 3] {
        [self.base_ms, self.ms_per_ktoken, self.ms_per_mpair]
    }
}

/// One worker's fitted `t(n, c)` (recursive least squares with forgetting).
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillModel {
    b: [f64; 3],
    p: [[f64; 3]; 3],
    /// Ceiling of `p`'s trace (its prior's), so that directions no sample excites do not
    /// grow without bound under forgetting.
    max_trace: f64,
    /// Typical absolute residual, ms (a running mean).
    scale: f64,
    samples: u64,
}

impl PrefillModel {
    /// A model at `prior`.
    pub fn new(prior: &Prior) -> Self {
        let v = prior.variance;
        Self {
            b: prior.coefficients(),
            p: [[v, 0.0, 0.0], [0.0, v, 0.0], [0.0, 0.0, v]],
            max_trace: 3.0 * v,
            scale: 0.0,
            samples: 0,
        }
    }

    /// Predicted prefill of `new_tokens` behind `cached_tokens`, ms (at least 0).
    pub fn predict(&self, new_tokens: u64, cached_tokens: u64) -> f64 {
        predict_ms(&self.b, new_tokens, cached_tokens)
    }

    /// Learns from one prefill of `new_tokens` behind `cached_tokens` that took `ms`.
    /// Samples that are not finite or below 0 are ignored (returns whether it learned).
    pub fn observe(&mut self, new_tokens: u64, cached_tokens: u64, ms: f64) -> bool {
        if !(ms.is_finite() && ms >= 0.0) {
            return false;
        }
        let x = features(new_tokens, cached_tokens);
        let px = mat_vec(&self.p, &x);
        let denom = FORGET + dot(&x, &px);
        if !(denom.is_finite() && denom > 0.0) {
            return false;
        }
        let k = px.map(|v| v / denom);
        // Huber-style: past the first samples a residual counts at most [`CLIP`] times the
        // typical residual (or `CLIP_MIN_MS`), so that a prefill held up by something else
        // (a full KV cache, a paused engine) moves the fit by a bounded step, not to the
        // outlier. Bounding it by the typical residual rather than by the prediction keeps
        // a fit that starts far off from stalling: its early residuals are all large.
        let predicted = dot(&self.b, &x);
        let raw = ms - predicted;
        let err = if self.samples < UNCLIPPED_SAMPLES {
            raw
        } else {
            let bound = (CLIP * self.scale).max(CLIP_MIN_MS);
            raw.clamp(-bound, bound)
        };
        self.scale = if self.samples == 0 {
            err.abs()
        } else {
            self.scale + SCALE_WEIGHT * (err.abs() - self.scale)
        };
        for (b, k) in self.b.iter_mut().zip(k) {
            *b += k * err;
        }
        // P = (P - k (Px)ᵀ) / λ, kept symmetric; its trace capped at the prior's.
        let mut trace = 0.0;
        for (i, (row, k)) in self.p.iter_mut().zip(k).enumerate() {
            for (p, px) in row.iter_mut().zip(px) {
                *p = (*p - k * px) / FORGET;
            }
            trace += row[i];
        }
        for i in 0..3 {
            for j in 0..i {
                let m = 0.5 * (self.p[i][j] + self.p[j][i]);
                self.p[i][j] = m;
                self.p[j][i] = m;
            }
        }
        if trace > self.max_trace {
            let s = self.max_trace / trace;
            self.p.iter_mut().flatten().for_each(|v| *v *= s);
        }
        self.samples += 1;
        true
    }

    /// The coefficients `[b0, b1, b2]`.
    pub fn coefficients(&self) -> [f64; 3] {
        self.b
    }

    /// Samples learned from.
    pub fn samples(&self) -> u64 {
        self.samples
    }
}

fn dot(a: &[f64; 3], b: &[f64; 3]) -> f64 {
    a[0] * b[0] + a[1] * b[1] + a[2] * b[2]
}

fn mat_vec(m: &[[f64; 3]; 3], x: &[f64; 3]) -> [f64; 3] {
    [dot(&m[0], x), dot(&m[1], x), dot(&m[2], x)]
}

/// A request whose first token is awaited.
#[derive(Debug, Clone, Copy)]
struct Waiting {
    worker: WorkerDp,
    routed_ms: u64,
    new_tokens: u64,
    cached_tokens: u64,
    predicted_ms: f64,
    /// Whether its first token is a sample (false: another replica routed it).
    learn: bool,
}

/// One worker's queue and model.
#[derive(Debug, Clone)]
struct WorkerQueue {
    model: PrefillModel,
    /// Predicted end of the prefill routed to it, ms.
    end_ms: f64,
    /// Sum of the predicted prefill of its requests awaiting their first token.
    pending_ms: f64,
    /// Requests awaiting their first token.
    pending: u64,
    /// Its last first token, ms (when the next prefill in line started).
    last_first_ms: Option<u64>,
}

/// Every worker's prefill model and queue, and the requests awaiting their first token.
/// See the [module docs](self).
#[derive(Debug, Clone)]
pub struct PrefillTimes {
    prior: Prior,
    workers: HashMap<WorkerDp, WorkerQueue, MixBuildHasher>,
    waiting: HashMap<String, Waiting>,
}

impl PrefillTimes {
    /// No worker known; new workers start at `prior`.
    pub fn new(prior: Prior) -> Self {
        Self {
            prior,
            workers: HashMap::default(),
            waiting: HashMap::new(),
        }
    }

    fn queue(&mut self, w: WorkerDp) -> &mut WorkerQueue {
        let prior = self.prior;
        self.workers.entry(w).or_insert_with(|| WorkerQueue {
            model: PrefillModel::new(&prior),
            end_ms: 0.0,
            pending_ms: 0.0,
            pending: 0,
            last_first_ms: None,
        })
    }

    /// Predicted wait at `w` before a request routed now starts its prefill, ms.
    pub fn wait_ms(&self, w: WorkerDp, now_ms: u64) -> f64 {
        self.workers
            .get(&w)
            .map_or(0.0, |q| (q.end_ms - now_ms as f64).max(0.0))
    }

    /// Predicted prefill at `w` of `new_tokens` behind `cached_tokens`, ms.
    pub fn prefill_ms(&self, w: WorkerDp, new_tokens: u64, cached_tokens: u64) -> f64 {
        predict_ms(&self.coefficients(w), new_tokens, cached_tokens)
    }

    /// A request was routed to `w` at `now_ms` with `new_tokens` to prefill behind
    /// `cached_tokens`: it joins `w`'s queue, and its first token is a sample when `learn`.
    /// An id already waiting is replaced.
    pub fn start(
        &mut self,
        request_id: &str,
        w: WorkerDp,
        (new_tokens, cached_tokens): (u64, u64),
        now_ms: u64,
        learn: bool,
    ) {
        self.forget(request_id);
        let q = self.queue(w);
        let predicted_ms = q.model.predict(new_tokens, cached_tokens);
        q.end_ms = q.end_ms.max(now_ms as f64) + predicted_ms;
        q.pending_ms += predicted_ms;
        q.pending += 1;
        self.waiting.insert(
            request_id.to_owned(),
            Waiting {
                worker: w,
                routed_ms: now_ms,
                new_tokens,
                cached_tokens,
                predicted_ms,
                learn,
            },
        );
    }

    /// The request produced its first token at `now_ms`: its worker's model learns from
    /// its prefill and the queue is re-anchored at now. Returns the observed prefill, ms
    /// (`None` when the request was not waiting).
    pub fn first_token(&mut self, request_id: &str, now_ms: u64) -> Option<f64> {
        let r = self.waiting.remove(request_id)?;
        let q = self.queue(r.worker);
        let started = q.last_first_ms.map_or(r.routed_ms, |t| t.max(r.routed_ms));
        let observed = now_ms.saturating_sub(started) as f64;
        let batched = q.last_first_ms == Some(now_ms);
        if r.learn && !batched {
            q.model.observe(r.new_tokens, r.cached_tokens, observed);
        }
        q.last_first_ms = Some(q.last_first_ms.map_or(now_ms, |t| t.max(now_ms)));
        q.pending_ms = (q.pending_ms - r.predicted_ms).max(0.0);
        q.pending = q.pending.saturating_sub(1);
        if q.pending == 0 {
            q.pending_ms = 0.0;
        }
        q.end_ms = now_ms as f64 + q.pending_ms;
        Some(observed)
    }

    /// The request left without a first token (freed, cancelled, expired): its predicted
    /// prefill leaves its worker's queue.
    pub fn forget(&mut self, request_id: &str) {
        if let Some(r) = self.waiting.remove(request_id)
            && let Some(q) = self.workers.get_mut(&r.worker)
        {
            q.pending_ms = (q.pending_ms - r.predicted_ms).max(0.0);
            q.pending = q.pending.saturating_sub(1);
            q.end_ms -= r.predicted_ms;
            if q.pending == 0 {
                q.pending_ms = 0.0;
            }
        }
    }

    /// One (worker, dp rank) left.
    pub fn remove(&mut self, worker: WorkerDp) {
        self.workers.remove(&worker);
        self.waiting.retain(|_, r| r.worker != worker);
    }

    /// `w`'s fitted coefficients and sample count (`None`: never routed to).
    pub fn model(&self, w: WorkerDp) -> Option<&PrefillModel> {
        self.workers.get(&w).map(|q| &q.model)
    }

    /// `w`'s requests awaiting their first token.
    pub fn pending(&self, w: WorkerDp) -> u64 {
        self.workers.get(&w).map_or(0, |q| q.pending)
    }

    /// `w`'s model's coefficients, or the prior's when it was never routed to.
    pub fn coefficients(&self, w: WorkerDp) -> [f64; 3] {
        self.workers
            .get(&w)
            .map_or(self.prior.coefficients(), |q| q.model.coefficients())
    }

    /// Forgets every waiting request `keep` refuses (requests the slot manager expired).
    pub fn retain(&mut self, mut keep: impl FnMut(&str) -> bool) {
        let gone: Vec<String> = self
            .waiting
            .keys()
            .filter(|id| !keep(id))
            .cloned()
            .collect();
        for id in gone {
            self.forget(&id);
        }
    }

    /// Requests awaiting their first token.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn the_fit_recovers_a_workers_true_coefficients() {
        // A worker 3× slower than the prior, with attention cost: exact samples.
        let truth = |n: u64, c: u64| {
            let x = features(n, c);
            5.0 * x[0] + 360.0 * x[1] + 4.0 * x[2]
        };
        let mut m = PrefillModel::new(&Prior::default());
        let mut seed = 7u64;
        for _ in 0..400 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let n = 64 + (seed >> 40) % 60_000;
            let c = (seed >> 20) % 100_000;
            assert!(m.observe(n, c, truth(n, c)));
        }
        let b = m.coefficients();
        assert!((b[0] - 5.0).abs() < 1.0, "{b:?}");
        assert!((b[1] - 360.0).abs() < 1.0, "{b:?}");
        assert!((b[2] - 4.0).abs() < 0.01, "{b:?}");
        assert!((m.predict(10_000, 50_000) - truth(10_000, 50_000)).abs() < 5.0);
        assert_eq!(m.samples(), 400);
        // One prefill held up 50× (a paused engine) moves the fit by a bounded step.
        let mut held = m.clone();
        assert!(held.observe(10_000, 50_000, 50.0 * truth(10_000, 50_000)));
        let after = held.predict(10_000, 50_000);
        assert!(
            (after - truth(10_000, 50_000)).abs() < 0.1 * truth(10_000, 50_000),
            "{after}"
        );
        // Bad samples are refused and change nothing.
        let before = m.clone();
        assert!(!m.observe(10, 0, f64::NAN));
        assert!(!m.observe(10, 0, -1.0));
        assert_eq!(m, before);
    }

    #[test]
    fn the_prior_answers_before_any_sample() {
        let m = PrefillModel::new(&Prior::default());
        // 8,192 new tokens, no context: 20 + 120 × 8.192 + 1 × 8192 × 4096 / 10^6 ms.
        let want = 20.0 + 120.0 * 8.192 + 8192.0 * 4096.0 / 1e6;
        assert!((m.predict(8192, 0) - want).abs() < 1e-9);
        assert_eq!(predict_ms(&Prior::default().coefficients(), 8192, 0), want);
    }

    #[test]
    fn the_queue_follows_routes_and_first_tokens() {
        let w = WorkerDp::new(1, 0);
        let mut t = PrefillTimes::new(Prior {
            base_ms: 100.0,
            ms_per_ktoken: 0.0,
            ms_per_mpair: 0.0,
            variance: 1e4,
        });
        assert_eq!(t.wait_ms(w, 0), 0.0);
        t.start("a", w, (1000, 0), 0, true);
        t.start("b", w, (1000, 0), 0, true);
        // Two requests of 100 ms each ahead of a third.
        assert!((t.wait_ms(w, 0) - 200.0).abs() < 1e-9);
        assert!((t.wait_ms(w, 50) - 150.0).abs() < 1e-9);
        // `a` took 120 ms: learned, and the queue is now `b`'s prediction from now.
        assert_eq!(t.first_token("a", 120), Some(120.0));
        assert_eq!(t.first_token("a", 130), None);
        let wait = t.wait_ms(w, 120);
        assert!(wait > 99.0 && wait < 121.0, "{wait}");
        // `b`'s prefill started at `a`'s first token, not at its route.
        assert_eq!(t.first_token("b", 240), Some(120.0));
        assert_eq!(t.wait_ms(w, 240), 0.0);
        // A cancelled request leaves the queue.
        t.start("c", w, (1000, 0), 300, true);
        t.forget("c");
        assert_eq!(t.wait_ms(w, 300), 0.0);
        assert_eq!(t.waiting(), 0);
        assert_eq!(t.model(w).map(PrefillModel::samples), Some(2));
        // Two first tokens at one instant: the second shared the first's step, no sample.
        t.start("d", w, (1000, 0), 400, true);
        t.start("e", w, (1000, 0), 400, true);
        assert!(t.first_token("d", 500).is_some());
        assert!(t.first_token("e", 500).is_some());
        assert_eq!(t.model(w).map(PrefillModel::samples), Some(3));
        // A request another replica routed waits in the queue but is no sample.
        t.start("f", w, (1000, 0), 600, false);
        assert!(t.wait_ms(w, 600) > 0.0);
        assert!(t.first_token("f", 700).is_some());
        assert_eq!(t.model(w).map(PrefillModel::samples), Some(3));
        t.remove(w);
        assert!(t.model(w).is_none());
    }

    #[test]
    fn workers_learn_apart() {
        let (fast, slow) = (WorkerDp::new(1, 0), WorkerDp::new(2, 0));
        let mut t = PrefillTimes::new(Prior::default());
        let mut now = 0;
        for i in 0..200 {
            let (a, b) = (format!("f{i}"), format!("s{i}"));
            t.start(&a, fast, (8000, 0), now, true);
            t.start(&b, slow, (8000, 0), now, true);
            t.first_token(&a, now + 500);
            t.first_token(&b, now + 2000);
            now += 3000;
        }
        let (f, s) = (t.prefill_ms(fast, 8000, 0), t.prefill_ms(slow, 8000, 0));
        assert!((f - 500.0).abs() < 25.0, "{f}");
        assert!((s - 2000.0).abs() < 100.0, "{s}");
    }
}
