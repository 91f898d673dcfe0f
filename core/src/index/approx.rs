//! The approximate index: for fleets whose workers publish no KV events, the router records
//! its own routing decisions ("request R's blocks went to worker W") and assumes they stay
//! cached for a while.
//!
//! * Every recorded block expires `ttl` after its latest record (default 120 s).
//! * The number of recorded (worker, block) pairs is capped (default 2^20); when a record
//!   pushes it over the cap, the oldest records are pruned until 80 % of the cap remains.
//! * Blocks are identified by Dynamo's chained sequence hash of their local-hash path, which
//!   the index computes itself, so a lookup is one hash-map probe per block.
//!
//! Single-threaded, and, like all of `core`, clock-free: every call takes the current time
//! in milliseconds.

use std::collections::VecDeque;

use ahash::AHashMap;

use smallvec::SmallVec;

use super::OverlapScores;
use crate::hash::{LocalBlockHash, SequenceBlockHash, next_sequence_hash};
use crate::worker::WorkerDp;

/// Settings of the approximate index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApproxConfig {
    /// How long a recorded block is assumed cached, ms.
    pub ttl_ms: u64,
    /// Most (worker, block) pairs kept.
    pub max_blocks: usize,
    /// Fraction of `max_blocks` kept after pruning, in percent.
    pub prune_to_percent: u8,
}

impl Default for ApproxConfig {
    fn default() -> Self {
        Self {
            ttl_ms: 120_000,
            max_blocks: 1 << 20,
            prune_to_percent: 80,
        }
    }
}

/// See the [module docs](self).
#[derive(Debug, Default)]
pub struct ApproxIndex {
    config: ApproxConfig,
    /// Path hash -> who holds it until when. Keyed by hashes of request tokens, so the
    /// map's hasher is ahash with per-process random keys: a client cannot aim its requests
    /// at one bucket.
    blocks: AHashMap<u64, SmallVec<[(WorkerDp, u64); 2]>>,
    /// Records in time order: (expiry, worker, path hash). Entries whose expiry no longer
    /// matches `blocks` were refreshed later and are skipped.
    order: VecDeque<(u64, WorkerDp, u64)>,
    len: usize,
}

impl ApproxIndex {
    /// An empty index.
    pub fn new(config: ApproxConfig) -> Self {
        Self {
            config,
            ..Default::default()
        }
    }

    /// Recorded (worker, block) pairs, expired ones included until the next prune.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is recorded.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn paths(locals: &[LocalBlockHash]) -> impl Iterator<Item = u64> + '_ {
        let mut parent: Option<SequenceBlockHash> = None;
        locals.iter().map(move |&l| {
            let s = match parent {
                None => SequenceBlockHash(l.0),
                Some(p) => next_sequence_hash(p, l),
            };
            parent = Some(s);
            s.0
        })
    }

    /// Records that `locals` (a request's blocks) were sent to `worker` at `now_ms`.
    pub fn record(&mut self, worker: WorkerDp, locals: &[LocalBlockHash], now_ms: u64) {
        let expiry = now_ms.saturating_add(self.config.ttl_ms);
        for path in Self::paths(locals) {
            let holders = self.blocks.entry(path).or_default();
            match holders.iter_mut().find(|(w, _)| *w == worker) {
                Some(h) => h.1 = expiry,
                None => {
                    holders.push((worker, expiry));
                    self.len += 1;
                }
            }
            self.order.push_back((expiry, worker, path));
        }
        self.expire(now_ms);
        if self.len > self.config.max_blocks {
            let target = self.config.max_blocks * self.config.prune_to_percent as usize / 100;
            while self.len > target {
                if !self.pop_oldest() {
                    break;
                }
            }
        }
    }

    /// Drops the oldest live record; false when there is none.
    fn pop_oldest(&mut self) -> bool {
        while let Some((expiry, worker, path)) = self.order.pop_front() {
            if self.drop_if(path, worker, |e| e == expiry) {
                return true;
            }
        }
        false
    }

    fn drop_if(&mut self, path: u64, worker: WorkerDp, pred: impl Fn(u64) -> bool) -> bool {
        let Some(holders) = self.blocks.get_mut(&path) else {
            return false;
        };
        let Some(i) = holders.iter().position(|&(w, e)| w == worker && pred(e)) else {
            return false;
        };
        holders.swap_remove(i);
        if holders.is_empty() {
            self.blocks.remove(&path);
        }
        self.len -= 1;
        true
    }

    /// Drops every record that expired by `now_ms`.
    pub fn expire(&mut self, now_ms: u64) {
        while let Some(&(expiry, worker, path)) = self.order.front() {
            if expiry > now_ms {
                break;
            }
            self.order.pop_front();
            self.drop_if(path, worker, |e| e == expiry);
        }
    }

    /// Per worker, how many leading blocks of `locals` it is assumed to hold at `now_ms`.
    pub fn find_matches_into(
        &self,
        locals: &[LocalBlockHash],
        now_ms: u64,
        out: &mut OverlapScores,
    ) {
        out.clear();
        let mut active: SmallVec<[WorkerDp; 16]> = SmallVec::new();
        for (depth, path) in Self::paths(locals).enumerate() {
            let holders = self.blocks.get(&path);
            let live = |w: &WorkerDp| {
                holders.is_some_and(|h| h.iter().any(|&(x, e)| x == *w && e > now_ms))
            };
            if depth == 0 {
                if let Some(h) = holders {
                    active.extend(h.iter().filter(|&&(_, e)| e > now_ms).map(|&(w, _)| w));
                }
            } else {
                active.retain(|w| {
                    let keep = live(w);
                    if !keep {
                        out.push(*w, depth as u32);
                    }
                    keep
                });
            }
            if active.is_empty() {
                break;
            }
        }
        for w in active {
            out.push(w, locals.len() as u32);
        }
        out.finish();
    }

    /// Forgets every record of one (worker, dp rank).
    pub fn remove(&mut self, worker: WorkerDp) {
        let mut dropped = 0;
        self.blocks.retain(|_, h| {
            let before = h.len();
            h.retain(|(w, _)| *w != worker);
            dropped += before - h.len();
            !h.is_empty()
        });
        self.len -= dropped;
        self.order.retain(|(_, w, _)| *w != worker);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn l(v: &[u64]) -> Vec<LocalBlockHash> {
        v.iter().map(|&x| LocalBlockHash(x)).collect()
    }

    const A: WorkerDp = WorkerDp::new(1, 0);
    const B: WorkerDp = WorkerDp::new(2, 0);

    #[test]
    fn records_match_until_they_expire() {
        let mut idx = ApproxIndex::new(ApproxConfig {
            ttl_ms: 100,
            ..Default::default()
        });
        idx.record(A, &l(&[1, 2, 3]), 0);
        idx.record(B, &l(&[1, 2]), 50);
        let mut out = OverlapScores::new();
        idx.find_matches_into(&l(&[1, 2, 3, 4]), 60, &mut out);
        assert_eq!(out.as_slice(), &[(A, 3), (B, 2)]);
        idx.find_matches_into(&l(&[1, 2, 3]), 120, &mut out);
        assert_eq!(out.as_slice(), &[(B, 2)]);
        idx.expire(200);
        assert!(idx.is_empty());
    }

    #[test]
    fn refresh_extends_the_prefix_only() {
        let mut idx = ApproxIndex::new(ApproxConfig {
            ttl_ms: 100,
            ..Default::default()
        });
        idx.record(A, &l(&[1, 2, 3]), 0);
        idx.record(A, &l(&[1]), 90);
        assert_eq!(idx.len(), 3);
        let mut out = OverlapScores::new();
        idx.find_matches_into(&l(&[1, 2, 3]), 150, &mut out);
        assert_eq!(out.as_slice(), &[(A, 1)]);
    }

    #[test]
    fn cap_prunes_oldest_to_eighty_percent() {
        let mut idx = ApproxIndex::new(ApproxConfig {
            ttl_ms: 1_000,
            max_blocks: 10,
            prune_to_percent: 80,
        });
        for i in 0..4u64 {
            idx.record(A, &l(&[100 + i, 200 + i, 300 + i]), i);
        }
        assert!(idx.len() <= 10 && idx.len() >= 8, "{}", idx.len());
        let mut out = OverlapScores::new();
        idx.find_matches_into(&l(&[103, 203, 303]), 5, &mut out);
        assert_eq!(out.get(A), 3, "the newest record survives");
        idx.find_matches_into(&l(&[100, 200, 300]), 5, &mut out);
        assert!(out.get(A) < 3, "the oldest record was pruned");
        idx.remove(A);
        assert!(idx.is_empty());
    }
}
