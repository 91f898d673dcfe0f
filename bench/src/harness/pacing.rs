//! Wall-clock pacing of a networked engine against its timing model, and how late its
//! steps ran.
//!
//! A networked engine sleeps through each step the model prices. Sleeping for the step's
//! length made every step also pay for the work between two sleeps (the step itself, the
//! KV events, the token sends): the engines ran 1.4–2.0 % slower than modelled. A
//! [`Pacer`] keeps the model's clock instead: while an engine stays busy, each step ends
//! at the previous step's end plus its own length, so a step that starts late is followed
//! by shorter sleeps until the engine is back on the model's clock. It records how late
//! each step started against that clock in a [`Lateness`] histogram; the engines send it
//! to the harness, which reports it beside the run ([`LatenessSummary`]).

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// Buckets per doubling: a bucket spans about 9 %.
const PER_DOUBLING: f64 = 8.0;
/// Buckets up to 2^24 µs (about 17 s); later values go to the last.
const BUCKETS: usize = 24 * PER_DOUBLING as usize;

/// Bucket `b` holds the values `us` with `b ≤ 8·log2(us + 1) < b + 1`.
fn bucket(us: u64) -> usize {
    (((us as f64 + 1.0).log2() * PER_DOUBLING) as usize).min(BUCKETS - 1)
}

/// The largest whole value bucket `b` holds, µs.
fn upper_us(b: usize) -> f64 {
    ((2f64.powf((b + 1) as f64 / PER_DOUBLING) - 1.0).ceil() - 1.0).max(0.0)
}

/// One engine's step lateness so far: a log histogram (about 9 % per bucket), cumulative.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lateness {
    /// Requests the engine finished so far (the harness waits for its count).
    pub finished: u64,
    /// Steps that followed another step without the engine going idle.
    pub steps: u64,
    /// The latest start of one, µs after the model's clock.
    pub max_us: u64,
    /// Those that started more than 1 ms late.
    pub over_1ms: u64,
    /// Non-empty buckets: (bucket, steps).
    pub buckets: Vec<(u16, u64)>,
}

impl Lateness {
    /// Adds another engine's steps.
    pub fn merge(&mut self, other: &Lateness) {
        self.finished += other.finished;
        self.steps += other.steps;
        self.max_us = self.max_us.max(other.max_us);
        self.over_1ms += other.over_1ms;
        let mut dense = self.dense();
        for &(b, n) in &other.buckets {
            if let Some(c) = dense.get_mut(usize::from(b)) {
                *c += n;
            }
        }
        self.buckets = sparse(&dense);
    }

    fn dense(&self) -> Vec<u64> {
        let mut d = vec![0u64; BUCKETS];
        for &(b, n) in &self.buckets {
            if let Some(c) = d.get_mut(usize::from(b)) {
                *c += n;
            }
        }
        d
    }

    /// The fleet's figures (`None` when no step followed another).
    pub fn summary(&self) -> Option<LatenessSummary> {
        if self.steps == 0 {
            return None;
        }
        let dense = self.dense();
        let quantile = |p: f64| {
            let rank = ((p * self.steps as f64).ceil() as u64).max(1);
            let mut seen = 0;
            for (b, &n) in dense.iter().enumerate() {
                seen += n;
                if seen >= rank {
                    return (upper_us(b) / 1000.0).min(self.max_us as f64 / 1000.0);
                }
            }
            self.max_us as f64 / 1000.0
        };
        Some(LatenessSummary {
            steps: self.steps,
            p50_ms: quantile(0.5),
            p99_ms: quantile(0.99),
            max_ms: self.max_us as f64 / 1000.0,
            over_1ms: self.over_1ms as f64 / self.steps as f64,
        })
    }
}

fn sparse(dense: &[u64]) -> Vec<(u16, u64)> {
    dense
        .iter()
        .enumerate()
        .filter(|&(_, &n)| n > 0)
        .map(|(b, &n)| (b as u16, n))
        .collect()
}

/// How late the engines' steps started against their model's clock, over the whole run.
/// Quantiles are bucket bounds: at most about 9 % high.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LatenessSummary {
    /// Steps that followed another step.
    pub steps: u64,
    /// Median lateness, ms.
    pub p50_ms: f64,
    /// 99th percentile, ms.
    pub p99_ms: f64,
    /// The latest step, ms.
    pub max_ms: f64,
    /// Share of steps that started more than 1 ms late.
    pub over_1ms: f64,
}

/// Keeps an engine on its model's clock while it is busy.
#[derive(Debug, Default)]
pub struct Pacer {
    /// When the running step ends on the model's clock; `None` while idle.
    due: Option<Instant>,
    dense: Vec<u64>,
    steps: u64,
    max_us: u64,
    over_1ms: u64,
}

impl Pacer {
    /// A step of `ms` model milliseconds starts at `now`; returns when it ends. After a
    /// step, the next starts (on the model's clock) when that one ended, however late the
    /// engine got to it: lateness is recorded, and is made up by the sleeps that follow.
    pub fn step(&mut self, now: Instant, ms: f64) -> Instant {
        let start = match self.due {
            Some(due) => {
                let late = now.saturating_duration_since(due);
                let us = u64::try_from(late.as_micros()).unwrap_or(u64::MAX);
                if self.dense.is_empty() {
                    self.dense = vec![0; BUCKETS];
                }
                self.dense[bucket(us)] += 1;
                self.steps += 1;
                self.max_us = self.max_us.max(us);
                self.over_1ms += u64::from(us > 1000);
                due
            }
            None => now,
        };
        let end = start + Duration::from_secs_f64(ms.max(0.0) / 1000.0);
        self.due = Some(end);
        end
    }

    /// The engine ran out of work: the next step starts whenever it comes.
    pub fn idle(&mut self) {
        self.due = None;
    }

    /// The steps so far, with `finished` requests.
    pub fn lateness(&self, finished: u64) -> Lateness {
        Lateness {
            finished,
            steps: self.steps,
            max_us: self.max_us,
            over_1ms: self.over_1ms,
            buckets: sparse(&self.dense),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn ms(x: f64) -> Duration {
        Duration::from_secs_f64(x / 1000.0)
    }

    #[test]
    fn a_late_step_is_made_up_by_the_steps_after_it() {
        let t0 = Instant::now();
        let mut p = Pacer::default();
        // The first step of a busy period starts when it starts: nothing to be late for.
        assert_eq!(p.step(t0, 10.0), t0 + ms(10.0));
        // The engine woke 3 ms after the step's end: the next ends 10 ms after the first.
        assert_eq!(p.step(t0 + ms(13.0), 10.0), t0 + ms(20.0));
        // On time again.
        assert_eq!(p.step(t0 + ms(20.0), 10.0), t0 + ms(30.0));
        let l = p.lateness(0);
        assert_eq!((l.steps, l.max_us), (2, 3000));
        // After idling, a step starts from when it is taken.
        p.idle();
        assert_eq!(p.step(t0 + ms(100.0), 5.0), t0 + ms(105.0));
        assert_eq!(p.lateness(1).steps, 2);
    }

    #[test]
    fn the_summary_reads_quantiles_within_a_bucket() {
        let t0 = Instant::now();
        let mut p = Pacer::default();
        p.step(t0, 1.0);
        // 98 steps on time, one 0.5 ms late, one 40 ms late.
        let mut at = t0 + ms(1.0);
        for late in std::iter::repeat_n(0.0, 98).chain([0.5, 40.0]) {
            let end = p.step(at + ms(late), 1.0);
            at = end;
        }
        let s = p.lateness(0).summary().unwrap();
        assert_eq!(s.steps, 100);
        assert_eq!(s.p50_ms, 0.0);
        assert!((0.5..=0.55).contains(&s.p99_ms), "{s:?}");
        assert_eq!(s.max_ms, 40.0);
        assert!((s.over_1ms - 0.01).abs() < 1e-12, "{s:?}");
        assert_eq!(Lateness::default().summary(), None);
    }

    #[test]
    fn merged_engines_add_up() {
        let t0 = Instant::now();
        let (mut a, mut b) = (Pacer::default(), Pacer::default());
        a.step(t0, 1.0);
        a.step(t0 + ms(3.0), 1.0);
        b.step(t0, 1.0);
        b.step(t0 + ms(1.0), 1.0);
        b.step(t0 + ms(2.0), 1.0);
        let mut all = a.lateness(4);
        all.merge(&b.lateness(5));
        assert_eq!((all.finished, all.steps, all.max_us), (9, 3, 2000));
        let s = all.summary().unwrap();
        assert_eq!(s.p50_ms, 0.0);
        assert_eq!(s.max_ms, 2.0);
        // One of three steps was late by more than 1 ms.
        assert!((s.over_1ms - 1.0 / 3.0).abs() < 1e-12);
        // A malformed bucket index from the wire is ignored, never a panic.
        all.merge(&Lateness {
            buckets: vec![(u16::MAX, 1)],
            ..Lateness::default()
        });
        assert_eq!(all.summary().unwrap().steps, 3);
    }
}
