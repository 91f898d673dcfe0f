//! One operation type for every differential checker: the proptest suites, the cargo-fuzz
//! target `index_diff` and the loom models all drive indexes with [`Op`]s and compare them
//! with the [`ReferenceIndex`](super::ReferenceIndex).
//!
//! Ops speak in small numbers so that random sequences collide often: block paths over an
//! alphabet of four local hashes, a few dozen workers (enough to need more than one bitset
//! word), two dp ranks, and three ways of naming blocks:
//!
//! * `Naming::Chain` — Dynamo's chained sequence hashes, the same for every worker (a
//!   deterministic engine);
//! * `Naming::PerWorker` — ids that differ from worker to worker (an engine with a random
//!   hash seed);
//! * `Naming::Slot` — a handful of ids reused for unrelated blocks (an engine that names
//!   blocks by memory slot), which exercises moved hashes and renamed paths.

use crate::event::{KvCacheEvent, RouterEvent};
use crate::hash::{LocalBlockHash, SequenceBlockHash, next_sequence_hash};
use crate::index::{ApplyError, ApplyOutcome, Index, OverlapScores};
use crate::worker::{WorkerDp, WorkerId};

/// Local-hash alphabet size.
pub const SYMBOLS: u8 = 4;
/// Longest path an op names.
pub const MAX_PATH: usize = 8;
/// Distinct workers ops name.
pub const WORKERS: u8 = 72;

/// How a worker names its blocks (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Naming {
    /// Chained hashes, identical across workers.
    Chain,
    /// Chained hashes salted by the worker.
    PerWorker,
    /// A few reused slot ids.
    Slot,
}

/// One operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// The worker stores `path[from..]` under `path[..from]` (maybe an unknown parent).
    Store {
        /// Worker number (`< WORKERS`).
        worker: u8,
        /// Dp rank (0 or 1).
        dp: u8,
        /// Block path (symbols `< SYMBOLS`).
        path: Vec<u8>,
        /// Where the stored chain starts.
        from: u8,
        /// Naming scheme.
        naming: Naming,
    },
    /// The worker removes, in one event, the block at `path` and the `span - 1` blocks
    /// above it (maybe not held, maybe mid-chain): tail first like an engine's leaf-first
    /// eviction, or root first when `root_first` (whose later names are then already gone).
    Remove {
        /// Worker number.
        worker: u8,
        /// Dp rank.
        dp: u8,
        /// Path of the deepest block named.
        path: Vec<u8>,
        /// Blocks named (at least one, at most the path's length).
        span: u8,
        /// Name the blocks from the top of the span down instead of tail first.
        root_first: bool,
        /// Naming scheme.
        naming: Naming,
    },
    /// The worker clears one dp rank.
    Clear {
        /// Worker number.
        worker: u8,
        /// Dp rank.
        dp: u8,
    },
    /// The worker is removed (all dp ranks).
    RemoveWorker {
        /// Worker number.
        worker: u8,
    },
    /// A lookup.
    Find {
        /// Query path.
        path: Vec<u8>,
    },
}

/// The worker id an op's worker number stands for: some small, some above 2^53.
pub fn worker_id(w: u8) -> WorkerId {
    match w % 4 {
        0 => w as u64,
        1 => u64::MAX - w as u64,
        _ => (w as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
    }
}

/// Local hashes of a path.
pub fn locals(path: &[u8]) -> Vec<LocalBlockHash> {
    path.iter()
        .map(|&s| LocalBlockHash(0xA11C_E000 + s as u64))
        .collect()
}

/// The name a worker gives the block at `path` under `naming`.
pub fn name(path: &[u8], worker: u8, naming: Naming) -> SequenceBlockHash {
    let ls = locals(path);
    let mut h = SequenceBlockHash(ls[0].0);
    for &l in &ls[1..] {
        h = next_sequence_hash(h, l);
    }
    match naming {
        Naming::Chain => h,
        Naming::PerWorker => next_sequence_hash(h, LocalBlockHash(worker as u64)),
        Naming::Slot => SequenceBlockHash((h.0 % 5) + 1),
    }
}

impl Op {
    /// The event this op stands for (`None` for lookups and whole-worker removals).
    pub fn to_event(&self, event_id: u64) -> Option<RouterEvent> {
        match self {
            Op::Store {
                worker,
                dp,
                path,
                from,
                naming,
            } => {
                if path.is_empty() {
                    return None;
                }
                let from = (*from as usize).min(path.len() - 1);
                let parent = (from > 0).then(|| name(&path[..from], *worker, *naming));
                let ls = locals(path);
                let blocks =
                    (from..path.len()).map(|i| (ls[i], name(&path[..=i], *worker, *naming)));
                Some(RouterEvent::new(
                    worker_id(*worker),
                    KvCacheEvent::stored(event_id, *dp as u32, parent, blocks),
                ))
            }
            Op::Remove {
                worker,
                dp,
                path,
                span,
                root_first,
                naming,
            } => (!path.is_empty()).then(|| {
                let span = (*span as usize).clamp(1, path.len());
                let mut names: Vec<SequenceBlockHash> = (0..span)
                    .map(|k| name(&path[..path.len() - k], *worker, *naming))
                    .collect();
                if *root_first {
                    names.reverse();
                }
                RouterEvent::new(
                    worker_id(*worker),
                    KvCacheEvent::removed(event_id, *dp as u32, names),
                )
            }),
            Op::Clear { worker, dp } => Some(RouterEvent::new(
                worker_id(*worker),
                KvCacheEvent::cleared(event_id, *dp as u32),
            )),
            Op::RemoveWorker { .. } | Op::Find { .. } => None,
        }
    }

    /// Decodes one op from fuzz input; `None` when the input is exhausted.
    pub fn decode(data: &mut &[u8]) -> Option<Op> {
        fn take(data: &mut &[u8]) -> Option<u8> {
            let (&b, rest) = data.split_first()?;
            *data = rest;
            Some(b)
        }
        fn path(data: &mut &[u8]) -> Option<Vec<u8>> {
            let n = take(data)? as usize % (MAX_PATH + 1);
            (0..n).map(|_| take(data).map(|b| b % SYMBOLS)).collect()
        }
        let tag = take(data)?;
        let naming = match (tag >> 4) % 8 {
            0..=5 => Naming::Chain,
            6 => Naming::PerWorker,
            _ => Naming::Slot,
        };
        let worker = take(data)? % WORKERS;
        Some(match tag % 8 {
            0..=2 => {
                let dp = take(data)? % 2;
                let from = take(data)?;
                Op::Store {
                    worker,
                    dp,
                    path: path(data)?,
                    from,
                    naming,
                }
            }
            3 | 4 => {
                let dp = take(data)? % 2;
                let span = take(data)?;
                Op::Remove {
                    worker,
                    dp,
                    path: path(data)?,
                    span: span % 8 + 1,
                    root_first: span & 0x80 != 0,
                    naming,
                }
            }
            5 => Op::Clear {
                worker,
                dp: take(data)? % 2,
            },
            6 => Op::RemoveWorker { worker },
            _ => Op::Find { path: path(data)? },
        })
    }
}

/// What an op did, in a form two indexes can be compared on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpResult {
    /// An event applied.
    Applied(ApplyOutcome),
    /// An event rejected (the error's kind).
    Rejected(&'static str),
    /// Blocks dropped by a whole-worker removal.
    Removed(usize),
    /// A lookup's answer.
    Found(OverlapScores),
    /// Nothing to do (an empty path).
    Skipped,
}

/// Applies `op` (as event number `event_id`) to `index`.
pub fn run<I: Index + ?Sized>(index: &mut I, op: &Op, event_id: u64) -> OpResult {
    match op {
        Op::RemoveWorker { worker } => OpResult::Removed(index.remove_worker(worker_id(*worker))),
        Op::Find { path } => OpResult::Found(index.find_matches(&locals(path))),
        _ => match op.to_event(event_id) {
            Some(e) => match index.apply(e) {
                Ok(o) => OpResult::Applied(o),
                Err(e) => OpResult::Rejected(ApplyError::kind(&e)),
            },
            None => OpResult::Skipped,
        },
    }
}

/// Every query path over the alphabet up to `len` symbols (for whole-state comparisons).
pub fn all_paths(len: usize) -> Vec<Vec<u8>> {
    let mut out = vec![Vec::new()];
    let mut frontier = vec![Vec::new()];
    for _ in 0..len {
        let mut next = Vec::new();
        for p in &frontier {
            for s in 0..SYMBOLS {
                let mut q: Vec<u8> = p.clone();
                q.push(s);
                next.push(q);
            }
        }
        out.extend(next.iter().cloned());
        frontier = next;
    }
    out
}

/// The worker an op touches, if any.
pub fn op_worker(op: &Op) -> Option<WorkerDp> {
    match op {
        Op::Store { worker, dp, .. } | Op::Remove { worker, dp, .. } | Op::Clear { worker, dp } => {
            Some(WorkerDp::new(worker_id(*worker), *dp as u32))
        }
        _ => None,
    }
}

/// An operation on a worker's storage tiers, for the differential checks of the lower tiers
/// (the proptest `index_tiers` and the fuzz target `index_tiers`). Blocks are named by
/// content (a block's name is a function of its path, the same on every tier and worker),
/// where the tree's path-keyed tiers and the reference's literal Dynamo edges agree by
/// design (see [`crate::index::tiers`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TierOp {
    /// Stores `path[from..]` under `path[..from]` on `tier` (0 the device, 1 host, 2 disk,
    /// 3 external, 4 the worker's shared pool: a `cache_owner` event of that source).
    Store {
        /// Worker number.
        worker: u8,
        /// Tier number.
        tier: u8,
        /// Block path (symbols `< SYMBOLS`, at least one).
        path: Vec<u8>,
        /// Where the stored chain starts.
        from: u8,
    },
    /// Removes the blocks at `path[at..]` from `tier`, tail first.
    Remove {
        /// Worker number.
        worker: u8,
        /// Tier number.
        tier: u8,
        /// Block path (at least one).
        path: Vec<u8>,
        /// First block removed.
        at: u8,
    },
    /// Clears `tier` (the device: every tier, as an engine's clear does).
    Clear {
        /// Worker number.
        worker: u8,
        /// Tier number.
        tier: u8,
    },
    /// Removes the worker.
    RemoveWorker {
        /// Worker number.
        worker: u8,
    },
    /// Looks `path` up on every tier.
    Query {
        /// Query path.
        path: Vec<u8>,
    },
}

/// Workers [`TierOp`]s name.
pub const TIER_WORKERS: u8 = 3;

/// The content name of the block at `path`, moved off the local hashes' range.
pub fn content_name(path: &[u8]) -> SequenceBlockHash {
    SequenceBlockHash(name(path, 0, Naming::Chain).0 ^ 0xa5a5_0000_0000_0000)
}

impl TierOp {
    /// The event this op stands for (`None` for a query or a worker removal).
    pub fn to_event(&self) -> Option<RouterEvent> {
        let tier = |t: u8| crate::worker::StorageTier::ALL[(t % 5).min(3) as usize];
        let (worker, t, data) = match self {
            TierOp::Store {
                worker,
                tier,
                path,
                from,
            } => {
                let from = (*from as usize).min(path.len().checked_sub(1)?);
                let ls = locals(path);
                let parent = (from > 0).then(|| content_name(&path[..from]));
                let blocks = (from..path.len()).map(|i| (ls[i], content_name(&path[..=i])));
                (*worker, *tier, KvCacheEvent::stored(0, 0, parent, blocks))
            }
            TierOp::Remove {
                worker,
                tier,
                path,
                at,
            } => {
                let at = (*at as usize).min(path.len().checked_sub(1)?);
                let names = (at..path.len()).rev().map(|i| content_name(&path[..=i]));
                (*worker, *tier, KvCacheEvent::removed(0, 0, names))
            }
            TierOp::Clear { worker, tier } => (*worker, *tier, KvCacheEvent::cleared(0, 0)),
            TierOp::RemoveWorker { .. } | TierOp::Query { .. } => return None,
        };
        let mut e = RouterEvent::new(u64::from(worker), data);
        e.storage_tier = tier(t);
        if t % 5 == 4 {
            e.residency_domain = Some(crate::event::ResidencyDomain::CacheOwner);
        }
        Some(e)
    }

    /// Decodes one op from fuzz input; `None` when the input is exhausted.
    pub fn decode(data: &mut &[u8]) -> Option<TierOp> {
        fn take(data: &mut &[u8]) -> Option<u8> {
            let (&b, rest) = data.split_first()?;
            *data = rest;
            Some(b)
        }
        fn path(data: &mut &[u8], min: usize) -> Option<Vec<u8>> {
            let n = (take(data)? as usize % 7).max(min);
            (0..n).map(|_| take(data).map(|b| b % 3)).collect()
        }
        let tag = take(data)?;
        let worker = (tag >> 4) % TIER_WORKERS;
        // Bit 7 of a store or removal moves its tier up one (tier 4: the shared pool).
        let tier = ((tag >> 2) & 3) + u8::from(tag & 0x80 != 0 && tag & 3 < 2);
        Some(match tag & 3 {
            0 => TierOp::Store {
                worker,
                tier,
                from: take(data)? % 6,
                path: path(data, 1)?,
            },
            1 => TierOp::Remove {
                worker,
                tier,
                at: take(data)? % 6,
                path: path(data, 1)?,
            },
            2 if tag & 0x80 != 0 => TierOp::RemoveWorker { worker },
            2 => TierOp::Clear { worker, tier },
            _ => TierOp::Query {
                path: path(data, 0)?,
            },
        })
    }
}

/// An index's device scores of `path` and its lower tiers' continuation.
pub fn tier_scores<I: Index + ?Sized>(
    index: &I,
    path: &[u8],
) -> (OverlapScores, crate::index::TierScores) {
    let query = locals(path);
    let device = index.find_matches(&query);
    let paths: Vec<u64> = crate::hash::sequence_hashes(&query)
        .into_iter()
        .map(|s| s.0)
        .collect();
    let mut out = crate::index::TierScores::new();
    index.tier_overlaps_into(&query, &paths, &device, &mut out);
    (device, out)
}

/// Applies `op` to both indexes and compares them: whether the event applied, the blocks
/// on the device and on lower tiers, and a query's scores on every tier. `Err` says where
/// they differ.
pub fn run_tiered<A: Index + ?Sized, B: Index + ?Sized>(
    tree: &mut A,
    reference: &mut B,
    op: &TierOp,
) -> Result<(), String> {
    match op {
        TierOp::RemoveWorker { worker } => {
            tree.remove_worker(u64::from(*worker));
            reference.remove_worker(u64::from(*worker));
        }
        TierOp::Query { path } => {
            let (a, b) = (tier_scores(tree, path), tier_scores(reference, path));
            if a != b {
                return Err(format!("scores of {path:?}: {a:?} against {b:?}"));
            }
        }
        _ => {
            if let Some(e) = op.to_event() {
                let (a, b) = (tree.apply(e.clone()).is_ok(), reference.apply(e).is_ok());
                if a != b {
                    return Err(format!("{op:?} applied: {a} against {b}"));
                }
            }
        }
    }
    let lower = (tree.lower_block_count(), reference.lower_block_count());
    let device = (tree.block_count(), reference.block_count());
    if lower.0 != lower.1 || device.0 != device.1 {
        return Err(format!("after {op:?}: lower {lower:?}, device {device:?}"));
    }
    Ok(())
}
