//! Rate-limited warnings: a repeated WARN (a garbage message a second, a flood of refused
//! connections) is logged at most once per interval per call site, with the count of the
//! ones it stood for since, so that the log stays readable and its volume bounded while
//! the counters keep the exact numbers.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// One call site's limiter. Shared by every thread that reaches the site.
#[derive(Debug)]
pub struct Throttle {
    interval_ms: u64,
    /// When the last line was let through, in ms since [`epoch`] plus one (0: never).
    last: AtomicU64,
    /// Lines held back since then.
    suppressed: AtomicU64,
}

impl Throttle {
    /// A limiter that lets one line through per `interval`.
    pub const fn new(interval: Duration) -> Self {
        Self {
            interval_ms: interval.as_millis() as u64,
            last: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// `Some(held back since the last line)` when this line may be logged, else `None`.
    pub fn allow(&self) -> Option<u64> {
        self.allow_at(epoch().elapsed().as_millis() as u64 + 1)
    }

    fn allow_at(&self, now: u64) -> Option<u64> {
        // Relaxed throughout: the two counters publish no other data, and a count that a
        // racing thread adds just after the winner's swap is reported with the next line
        // instead (never lost: every increment lands in `suppressed`).
        let last = self.last.load(Ordering::Relaxed);
        if last != 0 && now < last.saturating_add(self.interval_ms) {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        // One winner per interval; a loser counts as held back.
        if self
            .last
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
        {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Some(self.suppressed.swap(0, Ordering::Relaxed))
    }
}

/// `tracing::warn!` at most once per 10 s from this call site, with a `suppressed` field
/// counting the lines held back since the last one.
#[macro_export]
macro_rules! warn_throttled {
    ($($arg:tt)+) => {{
        static THROTTLE: $crate::throttle::Throttle =
            $crate::throttle::Throttle::new(::std::time::Duration::from_secs(10));
        if let Some(suppressed) = THROTTLE.allow() {
            ::tracing::warn!(suppressed, $($arg)+);
        }
    }};
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_interval_with_the_count_held_back() {
        let t = Throttle::new(Duration::from_millis(1000));
        assert_eq!(t.allow_at(1), Some(0));
        for now in 2..500 {
            assert_eq!(t.allow_at(now), None);
        }
        assert_eq!(t.allow_at(1000), None);
        assert_eq!(t.allow_at(1001), Some(499));
        assert_eq!(t.allow_at(1002), None);
        assert_eq!(t.allow_at(5000), Some(1));
    }
}
