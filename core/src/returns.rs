//! Each worker's recent rate of *returning* requests: requests routed there for the
//! prefix it already held (a session's next turn, a shared system prompt).
//!
//! The cost's queue terms see the requests already routed. They cannot see the sessions
//! idle between turns on a worker, whose next turns will land there whatever else it is
//! given: their cache is there. A long prompt prefilled on such a worker holds every turn
//! that returns while it runs (engines give a step's budget to running prefills first),
//! on average for half of that prefill. The expected cost to them is
//!
//! ```text
//! returning delay = rate × prefill × prefill / 2
//! ```
//!
//! where `rate` is this module's estimate and `prefill` the candidate's uncached prefill
//! time (`core::policy`, `return_weight`). A request counts as returning in proportion to
//! the share of its prompt credited as cached on the worker chosen for it, so a new
//! prompt counts 0 and a turn found whole counts 1: the turns a worker attracts by its
//! cache, which no other placement would have moved.
//!
//! The rate is an exponentially decayed count over `window_ms`: `count × e^(−Δt/window)`
//! plus the new weight at each arrival, `count / window` read at `now`. Pure: the caller
//! passes the clock.

use std::collections::HashMap;

use crate::hash::MixBuildHasher;
use crate::worker::WorkerDp;

/// Each worker's decayed count of returning requests.
#[derive(Debug, Clone)]
pub struct Returns {
    window_ms: f64,
    /// Worker → (decayed count, at ms).
    counts: HashMap<WorkerDp, (f64, u64), MixBuildHasher>,
}

impl Returns {
    /// Rates over a decay window of `window_ms` (at least 1 ms).
    pub fn new(window_ms: f64) -> Self {
        Self {
            window_ms: window_ms.max(1.0),
            counts: HashMap::default(),
        }
    }

    fn decayed(&self, count: f64, at: u64, now_ms: u64) -> f64 {
        // A clock that went back (a replica's) decays nothing.
        let dt = now_ms.saturating_sub(at) as f64;
        count * (-dt / self.window_ms).exp()
    }

    /// A request routed to `worker` at `now_ms`, `weight` of it (in [0, 1]) returning.
    pub fn record(&mut self, worker: WorkerDp, weight: f64, now_ms: u64) {
        let weight = if weight.is_finite() {
            weight.clamp(0.0, 1.0)
        } else {
            0.0
        };
        if weight == 0.0 && !self.counts.contains_key(&worker) {
            return;
        }
        let (count, at) = self.counts.get(&worker).copied().unwrap_or((0.0, now_ms));
        let count = self.decayed(count, at, now_ms) + weight;
        self.counts.insert(worker, (count, now_ms.max(at)));
    }

    /// Returning requests per ms at `worker`, read at `now_ms`.
    pub fn per_ms(&self, worker: WorkerDp, now_ms: u64) -> f64 {
        self.counts
            .get(&worker)
            .map_or(0.0, |&(c, at)| self.decayed(c, at, now_ms) / self.window_ms)
    }

    /// Forgets a worker that left.
    pub fn remove(&mut self, worker: WorkerDp) {
        self.counts.remove(&worker);
    }

    /// Workers with a count.
    pub fn len(&self) -> usize {
        self.counts.len()
    }

    /// Whether no worker has a count.
    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: WorkerDp = WorkerDp {
        worker_id: 1,
        dp_rank: 0,
    };
    const B: WorkerDp = WorkerDp {
        worker_id: 2,
        dp_rank: 0,
    };

    #[test]
    fn a_rate_is_the_decayed_count_over_the_window() {
        let mut r = Returns::new(1000.0);
        r.record(A, 1.0, 0);
        r.record(A, 1.0, 0);
        assert!((r.per_ms(A, 0) - 2.0 / 1000.0).abs() < 1e-12);
        // One window later: e^-1 of it.
        assert!((r.per_ms(A, 1000) - 2.0 * (-1.0f64).exp() / 1000.0).abs() < 1e-12);
        r.record(A, 0.5, 1000);
        let want = (2.0 * (-1.0f64).exp() + 0.5) / 1000.0;
        assert!((r.per_ms(A, 1000) - want).abs() < 1e-12);
        assert_eq!(r.per_ms(B, 1000), 0.0);
    }

    #[test]
    fn new_prompts_count_nothing_and_bad_weights_are_clamped() {
        let mut r = Returns::new(1000.0);
        r.record(A, 0.0, 5);
        assert!(r.is_empty());
        r.record(A, f64::NAN, 5);
        r.record(A, -3.0, 5);
        assert!(r.is_empty());
        r.record(A, 7.0, 5);
        assert!((r.per_ms(A, 5) - 1.0 / 1000.0).abs() < 1e-12);
        // A clock that goes back neither decays nor moves the count's time back.
        r.record(A, 1.0, 2);
        assert!((r.per_ms(A, 5) - 2.0 / 1000.0).abs() < 1e-12);
        r.remove(A);
        assert_eq!(r.len(), 0);
        assert_eq!(r.per_ms(A, 5), 0.0);
    }
}
