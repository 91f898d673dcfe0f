//! Wall-clock pacing of a networked engine against its timing model, and how late its
//! steps ran.
//!
//! A networked engine sleeps through each step the model prices. Sleeping for the step's
//! length made every step also pay for the work between two sleeps (the step itself, the
//! KV events, the token sends): the engines ran 1.4–2.0 % slower than modelled. A
//! [`Pacer`] keeps the model's clock instead: while an engine stays busy, each step ends
//! at the previous step's end plus its own length, so a step that starts late is followed
//! by shorter sleeps until the engine is back on the model's clock. A step that takes in a
//! request which came after the model's clock (the engine was behind) starts when that
//! request came, never earlier: the catch-up shortens the steps already under way, never a
//! new request's wait. The pacer records how late each step started in a [`Lateness`]
//! histogram; the engines send it to the harness, which reports it beside the run
//! ([`LatenessSummary`]).

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::report::{pct, sorted};

/// Buckets per doubling: a bucket spans about 9 %.
const PER_DOUBLING: f64 = 8.0;
/// Buckets up to 2^24 µs (about 17 s); later values go to the last.
const BUCKETS: usize = 24 * PER_DOUBLING as usize;
/// The longest step the pacer takes, ms (an hour: no model prices one near it).
const MAX_STEP_MS: f64 = 3.6e6;

/// Bucket `b` holds the values `us` with `b ≤ 8·log2(us + 1) < b + 1`.
fn bucket(us: u64) -> usize {
    (((us as f64 + 1.0).log2() * PER_DOUBLING) as usize).min(BUCKETS - 1)
}

/// The largest whole value bucket `b` holds, µs (the last holds everything later).
fn upper_us(b: usize) -> f64 {
    if b >= BUCKETS - 1 {
        return f64::INFINITY;
    }
    ((2f64.powf((b + 1) as f64 / PER_DOUBLING) - 1.0).ceil() - 1.0).max(0.0)
}

/// Adds sparse buckets into dense ones; an index out of range (from the wire) is ignored.
fn add_into(dense: &mut [u64], sparse: &[(u16, u64)]) {
    for &(b, n) in sparse {
        if let Some(c) = dense.get_mut(usize::from(b)) {
            *c = c.saturating_add(n);
        }
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

/// One engine's step lateness so far: a log histogram (about 9 % per bucket), cumulative.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lateness {
    /// Requests the engine finished so far (the harness waits for its count).
    pub finished: u64,
    /// Steps that followed another step without the engine going idle.
    pub steps: u64,
    /// The latest start of one, µs after the model's clock.
    pub max_us: u64,
    /// Steps that started more than 1 ms late.
    pub over_1ms: u64,
    /// Non-empty buckets: (bucket, steps).
    pub buckets: Vec<(u16, u64)>,
}

impl Lateness {
    /// Adds another engine's steps (counts saturate: a report is input from the wire).
    pub fn merge(&mut self, other: &Lateness) {
        self.finished = self.finished.saturating_add(other.finished);
        self.steps = self.steps.saturating_add(other.steps);
        self.max_us = self.max_us.max(other.max_us);
        self.over_1ms = self.over_1ms.saturating_add(other.over_1ms);
        let mut dense = self.dense();
        add_into(&mut dense, &other.buckets);
        self.buckets = sparse(&dense);
    }

    fn dense(&self) -> Vec<u64> {
        let mut d = vec![0u64; BUCKETS];
        add_into(&mut d, &self.buckets);
        d
    }

    /// The fleet's figures (`None` when no step followed another); `complete` says whether
    /// every engine's report covered all its requests.
    pub fn summary(&self, complete: bool) -> Option<LatenessSummary> {
        if self.steps == 0 {
            return None;
        }
        let dense = self.dense();
        let max_ms = self.max_us as f64 / 1000.0;
        let quantile = |p: f64| {
            let rank = ((p * self.steps as f64).ceil() as u64).max(1);
            let mut seen = 0u64;
            for (b, &n) in dense.iter().enumerate() {
                seen = seen.saturating_add(n);
                if seen >= rank {
                    return (upper_us(b) / 1000.0).min(max_ms);
                }
            }
            max_ms
        };
        Some(LatenessSummary {
            count: self.steps,
            p50_ms: quantile(0.5),
            p99_ms: quantile(0.99),
            max_ms,
            share_over_1ms: (self.over_1ms as f64 / self.steps as f64).min(1.0),
            complete,
        })
    }
}

/// How late something ran against its schedule over a run: the engines' steps against
/// their model's clock (quantiles are bucket bounds, at most about 9 % high), or the
/// requests the harness sent against the trace's arrival times (exact).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LatenessSummary {
    /// Steps that followed another step, or requests sent.
    pub count: u64,
    /// Median lateness, ms.
    pub p50_ms: f64,
    /// 99th percentile, ms.
    pub p99_ms: f64,
    /// The latest, ms.
    pub max_ms: f64,
    /// Share (0 to 1) of them more than 1 ms late.
    pub share_over_1ms: f64,
    /// Whether the figures cover everything: false when an engine did not report on all
    /// the requests it was sent before the harness gave up waiting.
    pub complete: bool,
}

impl LatenessSummary {
    /// The exact figures of `late_ms`, percentiles as the report takes them for TTFT
    /// (`None` when empty).
    pub fn of(late_ms: &[f64]) -> Option<Self> {
        if late_ms.is_empty() {
            return None;
        }
        let v = sorted(late_ms.to_vec());
        Some(LatenessSummary {
            count: v.len() as u64,
            p50_ms: pct(&v, 0.5),
            p99_ms: pct(&v, 0.99),
            max_ms: v[v.len() - 1],
            share_over_1ms: v.iter().filter(|&&x| x > 1.0).count() as f64 / v.len() as f64,
            complete: true,
        })
    }
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
    /// A step of `ms` model milliseconds starts at `now`, and the newest request it may
    /// take in came at `arrived`; returns when the step ends. After a step the next starts,
    /// on the model's clock, when that one ended (however late the engine got to it: the
    /// lateness is recorded, and made up by the sleeps that follow), or when its newest
    /// request came, if later.
    pub fn step(&mut self, now: Instant, arrived: Instant, ms: f64) -> Instant {
        let start = match self.due {
            Some(due) => {
                let start = due.max(arrived).min(now);
                let late = now.saturating_duration_since(start);
                let us = u64::try_from(late.as_micros()).unwrap_or(u64::MAX);
                if self.dense.is_empty() {
                    self.dense = vec![0; BUCKETS];
                }
                self.dense[bucket(us)] += 1;
                self.steps += 1;
                self.max_us = self.max_us.max(us);
                self.over_1ms += u64::from(us > 1000);
                start
            }
            None => now,
        };
        let end = start + Duration::from_secs_f64(ms.clamp(0.0, MAX_STEP_MS) / 1000.0);
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
        assert_eq!(p.step(t0, t0, 10.0), t0 + ms(10.0));
        // The engine woke 3 ms after the step's end: the next ends 10 ms after the first.
        assert_eq!(p.step(t0 + ms(13.0), t0, 10.0), t0 + ms(20.0));
        // On time again.
        assert_eq!(p.step(t0 + ms(20.0), t0, 10.0), t0 + ms(30.0));
        let l = p.lateness(0);
        assert_eq!((l.steps, l.max_us), (2, 3000));
        // After idling, a step starts from when it is taken.
        p.idle();
        assert_eq!(p.step(t0 + ms(100.0), t0, 5.0), t0 + ms(105.0));
        assert_eq!(p.lateness(1).steps, 2);
    }

    #[test]
    fn a_request_that_came_while_the_engine_was_behind_waits_its_own_time() {
        let t0 = Instant::now();
        let mut p = Pacer::default();
        p.step(t0, t0, 10.0);
        // 30 ms late, and a request came 25 ms after the step's end: the step it joins
        // starts when it came, not on the model's clock, so it gains nothing from the
        // catch-up; 5 ms of lateness is recorded.
        assert_eq!(p.step(t0 + ms(40.0), t0 + ms(35.0), 10.0), t0 + ms(45.0));
        assert_eq!(p.lateness(0).max_us, 5000);
        // A request that came before the clock's step start changes nothing.
        assert_eq!(p.step(t0 + ms(46.0), t0 + ms(35.0), 10.0), t0 + ms(55.0));
    }

    #[test]
    fn the_summary_reads_quantiles_within_a_bucket() {
        let t0 = Instant::now();
        let mut p = Pacer::default();
        p.step(t0, t0, 1.0);
        // 98 steps on time, one 0.5 ms late, one 40 ms late.
        let mut at = t0 + ms(1.0);
        for late in std::iter::repeat_n(0.0, 98).chain([0.5, 40.0]) {
            let end = p.step(at + ms(late), t0, 1.0);
            at = end;
        }
        let s = p.lateness(0).summary(true).unwrap();
        assert_eq!(s.count, 100);
        assert_eq!(s.p50_ms, 0.0);
        assert!((0.5..=0.55).contains(&s.p99_ms), "{s:?}");
        assert_eq!(s.max_ms, 40.0);
        assert!((s.share_over_1ms - 0.01).abs() < 1e-12, "{s:?}");
        assert_eq!(Lateness::default().summary(true), None);
    }

    #[test]
    fn merged_engines_add_up() {
        let t0 = Instant::now();
        let (mut a, mut b) = (Pacer::default(), Pacer::default());
        a.step(t0, t0, 1.0);
        a.step(t0 + ms(3.0), t0, 1.0);
        b.step(t0, t0, 1.0);
        b.step(t0 + ms(1.0), t0, 1.0);
        b.step(t0 + ms(2.0), t0, 1.0);
        let mut all = a.lateness(4);
        all.merge(&b.lateness(5));
        assert_eq!((all.finished, all.steps, all.max_us), (9, 3, 2000));
        let s = all.summary(true).unwrap();
        assert_eq!(s.p50_ms, 0.0);
        assert_eq!(s.max_ms, 2.0);
        // One of three steps was late by more than 1 ms.
        assert!((s.share_over_1ms - 1.0 / 3.0).abs() < 1e-12);
        // A malformed bucket index from the wire is ignored, never a panic.
        all.merge(&Lateness {
            buckets: vec![(u16::MAX, 1)],
            ..Lateness::default()
        });
        assert_eq!(all.summary(true).unwrap().count, 3);
        // Counts from the wire saturate; the last bucket's quantile is the maximum.
        let huge = Lateness {
            finished: u64::MAX,
            steps: u64::MAX,
            max_us: u64::MAX,
            over_1ms: u64::MAX,
            buckets: vec![(u16::try_from(BUCKETS - 1).unwrap(), u64::MAX)],
        };
        all.merge(&huge);
        all.merge(&huge);
        let s = all.summary(false).unwrap();
        assert_eq!((s.count, s.complete), (u64::MAX, false));
        assert_eq!(s.p99_ms, u64::MAX as f64 / 1000.0);
        assert!(s.share_over_1ms <= 1.0);
    }

    #[test]
    fn sends_are_summed_up_exactly() {
        let late: Vec<f64> = (0..200).map(|i| f64::from(i) / 100.0).collect();
        let s = LatenessSummary::of(&late).unwrap();
        assert_eq!(s.count, 200);
        // The report's percentiles: the value at the rounded rank over 199 gaps.
        assert_eq!((s.p50_ms, s.p99_ms, s.max_ms), (1.0, 1.97, 1.99));
        // 1.01 ms and later: 99 of 200.
        assert!((s.share_over_1ms - 99.0 / 200.0).abs() < 1e-12);
        assert_eq!(LatenessSummary::of(&[]), None);
        assert_eq!(LatenessSummary::of(&[3.0]).unwrap().p50_ms, 3.0);
    }
}
