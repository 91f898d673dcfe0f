//! The lower storage tiers: blocks a worker keeps in host memory, on disk or in external
//! storage, and how far each continues a request past the device prefix.
//!
//! # What is counted (Dynamo 1.6.1's definitions)
//!
//! For a request `q[0..n)` and a worker whose device score is `d`:
//!
//! * **host** is how many blocks `q[d..)` the worker holds on the host-pinned tier, one
//!   after another from position `d`;
//! * then **disk** is how many further blocks it holds on disk from where host stopped, and
//!   **external** how many further in external storage from where disk stopped. Dynamo
//!   reports disk and external together as its disk figure ([`TierOverlap::disk`]), and its
//!   cost credits them with one weight.
//!
//! A tier that holds nothing at the position passes it on to the next tier unchanged. A
//! block held on the device and on a lower tier counts once, on the device: lower tiers are
//! only looked at past the device prefix. A worker with no device match starts from 0.
//! (Dynamo 1.6.1: `query_lower_tiers` in `indexer/lower_tier_indexers.rs`, which follows
//! edges `(parent engine hash, local hash) -> child` per tier from the worker's last device
//! block.)
//!
//! # How it is kept
//!
//! Dynamo keys a lower-tier block by its parent's engine hash; we key it by its **path
//! hash**: the router's sequence hash of the local hashes from the root
//! ([`crate::hash::sequence_hashes`]), which a decision computes in full only when some
//! worker holds blocks on a lower tier or in a pool (otherwise only where its slot walks
//! need them, [`crate::chain`]).
//! A lower-tier chain is placed when it is stored: its parent is the worker's block of that
//! engine name on a lower tier, or on the device (the shard writer resolves it from the
//! tree). Per tier, a map from path hash to the workers holding it; per worker and tier, a
//! map from engine name to path hash, for removals. A query is then one probe per position
//! per worker, and the device-only path pays nothing (an empty structure is skipped).
//!
//! The two agree wherever engines name blocks by content (the same path, the same name),
//! which the reference index checks against the literal edge model
//! (`tests/tests/index_tiers.rs`). One difference, by choice: a lower-tier chain whose
//! parent the worker holds on no tier when it is stored is not indexed (counted in
//! [`LowerTiers::orphans`]); Dynamo keeps its edge, which a later device block of that name
//! could reach.
//!
//! **Cost of placing a chain.** A lower-tier chain whose parent is a lower-tier block of
//! the worker is placed in O(1) per block. One whose parent is a device block pays one walk
//! of the tree from that block to the root (O(depth)) to learn its path hash, once per
//! event: engines publish offloads as chains (vLLM's connector per request, our mock
//! engine per round of evictions), so this is once per chain. An engine that published
//! every offloaded block of a deep prefix as its own event under a device parent would pay
//! the walk per block.
//!
//! A block moving between tiers is two events (stored on one, removed from the other, in
//! either order); each tier keeps its own copy, so an offload, an onload or an eviction
//! from one tier never loses the others'.
//!
//! # The shared pool
//!
//! A shared pool is a cache that every worker can read (SGLang's HiCache L3 storage, an
//! LMCache server, a Mooncake store). Dynamo 1.6.1's cost credits it as
//! `shared_cache_multiplier × shared_beyond_blocks`, where `shared_beyond_blocks` is how
//! many of the request's block positions **at or past the worker's device overlap** the
//! pool holds, counted whether or not they are contiguous (`SharedCacheHits::hits_beyond`
//! in `protocols.rs`; `selector/reference.rs` scores it). Dynamo learns which positions the
//! pool holds from a query to SGLang workers per request (`--shared-cache-type hicache`).
//!
//! kvrouter learns it from the KV events of the pool itself: events whose residency domain
//! is `cache_owner` (Dynamo's wire name for blocks owned by a cache rather than by a
//! worker's serving lifetime) are kept here, keyed by path hash like the lower tiers, per
//! publishing source (the event's worker id and dp rank), and never make their publisher a
//! routing candidate. Every worker reads every pool block unless told otherwise (below,
//! "Who reads a pool"). Dynamo 1.6.1 itself files
//! `cache_owner` blocks under the lower tier they name and credits them to the one worker
//! its discovery layer attaches the owner to; a fleet whose owners are private to one
//! worker should leave `shared_cache_multiplier` at its default, 0, which turns the credit
//! off. A pool chain's parent is the source's pool block of that name, else the source's
//! own block on any tier; a worker-scoped clear or restart of the source keeps its pool
//! blocks (as Dynamo's scoped clear keeps cache-owner residency), a `cache_owner` clear
//! drops them, and so does the source leaving the fleet. Snapshots keep the pool (format
//! version 3, [`crate::snapshot`]).
//!
//! ## Who reads a pool
//!
//! A pool need not serve the whole fleet: LMCache's local disk backend or a node's CPU
//! store serves the workers of one node, and Dynamo 1.6.1 credits a `cache_owner` block to
//! the one worker its discovery attaches the owner to. [`PoolReaders`] (`kvrouter serve
//! --pool-readers SOURCE=WORKER,...`) names the readers of a source's pool; a source
//! without a rule is read by every worker, as before. Each shard's pool map says, per
//! path hash, which sources hold it (nearly always one, packed into one 8-byte value,
//! which takes no more room in the map's entry than the count did), so a lookup is one
//! pass over the request whatever the number of sources, and where rules exist it also
//! marks, per source, which request positions its pool holds (one bit each in
//! [`TierScores`]). [`TierScores::scope`] then splits them: the pools every worker reads keep
//! the one suffix count ([`TierScores::shared_beyond`]), and a worker's own count
//! ([`TierScores::shared_beyond_for`]) is the union of those and of the pools it reads,
//! so a block two of its pools hold counts once, as one position. Without rules nothing is
//! split and the counts are those of the paragraph above. The rule is per worker id (every
//! dp rank of the source and of the reader): a pool is a process's, not a rank's.

use std::collections::HashMap;

use smallvec::SmallVec;

use crate::hash::{LocalBlockHash, MixBuildHasher, SequenceBlockHash, next_sequence_hash};
use crate::index::OverlapScores;
use crate::worker::{StorageTier, WorkerDp, WorkerId};

type Map<K, V> = HashMap<K, V, MixBuildHasher>;

/// The lower tiers, in the order a continuation visits them.
pub const LOWER_TIERS: [StorageTier; 3] = [
    StorageTier::HostPinned,
    StorageTier::Disk,
    StorageTier::External,
];

/// Index of a lower tier in [`LOWER_TIERS`] (`None` for the device).
pub fn lower_index(tier: StorageTier) -> Option<usize> {
    LOWER_TIERS.iter().position(|&t| t == tier)
}

/// How far a worker's lower tiers continue a request past its device prefix.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct TierOverlap {
    /// Blocks on the host-pinned tier right after the device prefix.
    pub host: u32,
    /// Blocks on disk and then in external storage right after that (Dynamo's disk figure).
    pub disk: u32,
}

impl TierOverlap {
    fn is_zero(self) -> bool {
        self.host == 0 && self.disk == 0
    }
}

/// Which workers read which shared pools (see the [module docs](self), "Who reads a
/// pool"): per source worker id, the worker ids that read its pool. A source not listed is
/// read by every worker; the rule is per worker id, every dp rank of either side.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolReaders {
    /// `(source, readers)`, sorted by source; readers sorted and distinct.
    by_source: Vec<(WorkerId, Vec<WorkerId>)>,
}

/// A pool-readers rule that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "pool readers {spec:?}: {why} (expected SOURCE=WORKER[,WORKER...], worker ids as integers)"
)]
pub struct PoolReadersError {
    /// The rule as given.
    pub spec: String,
    /// What is wrong with it.
    pub why: &'static str,
}

impl PoolReaders {
    /// No rule: every worker reads every pool.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether no source has a rule.
    pub fn is_empty(&self) -> bool {
        self.by_source.is_empty()
    }

    /// Sets who reads `source`'s pool (replacing an earlier rule for it). An empty list
    /// makes a pool that no worker reads.
    pub fn set(&mut self, source: WorkerId, readers: impl IntoIterator<Item = WorkerId>) {
        let mut readers: Vec<WorkerId> = readers.into_iter().collect();
        readers.sort_unstable();
        readers.dedup();
        match self.by_source.binary_search_by_key(&source, |e| e.0) {
            Ok(i) => self.by_source[i].1 = readers,
            Err(i) => self.by_source.insert(i, (source, readers)),
        }
    }

    /// Adds one rule, `SOURCE=WORKER[,WORKER...]` (as `--pool-readers` takes it).
    pub fn add_rule(&mut self, spec: &str) -> Result<(), PoolReadersError> {
        let err = |why| PoolReadersError {
            spec: spec.to_owned(),
            why,
        };
        let (source, readers) = spec.split_once('=').ok_or_else(|| err("no '='"))?;
        let source: WorkerId = source.trim().parse().map_err(|_| err("bad source id"))?;
        let readers = readers
            .split(',')
            .map(|r| r.trim().parse::<WorkerId>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| err("bad reader id"))?;
        if self.readers(source).is_some() {
            return Err(err("a second rule for the same source"));
        }
        self.set(source, readers);
        Ok(())
    }

    /// The workers that read `source`'s pool; `None` when every worker does.
    pub fn readers(&self, source: WorkerId) -> Option<&[WorkerId]> {
        self.by_source
            .binary_search_by_key(&source, |e| e.0)
            .ok()
            .map(|i| self.by_source[i].1.as_slice())
    }
}

/// Per worker, its [`TierOverlap`] when not zero, sorted by worker; and the request's
/// shared-pool blocks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TierScores {
    scores: Vec<(WorkerDp, TierOverlap)>,
    /// Before [`Self::finish`]: per request position, 1 where a shared pool holds it (each
    /// shard marks its pool's). After: the pool blocks at or past each position, one entry
    /// more than the request has positions; after [`Self::scope`] with a rule that applies,
    /// only the blocks of the pools every worker reads. Empty when no pool holds any.
    shared: Vec<u32>,
    /// Per pool source, the request positions it holds (one bit each), in the order marked.
    marks: SmallVec<[(WorkerDp, Vec<u64>); 2]>,
    /// After [`Self::scope`]: the pools with readers, their positions and their readers; and
    /// the positions of the pools every worker reads. Empty without such a pool.
    scoped: Vec<(Vec<u64>, Vec<WorkerId>)>,
    open: Vec<u64>,
    /// Whether lookups mark whose pool holds each block ([`Self::attribute_sources`]).
    attribute: bool,
}

impl TierScores {
    /// Empty.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether lookups say whose pool holds each block (off by default: without pool rules
    /// only how many blocks matter). Kept across [`Self::clear`].
    pub fn attribute_sources(&mut self, on: bool) {
        self.attribute = on;
    }

    /// See [`Self::attribute_sources`].
    pub(crate) fn attributes_sources(&self) -> bool {
        self.attribute
    }

    /// Empties it, keeping its memory and [`Self::attribute_sources`].
    pub fn clear(&mut self) {
        self.scores.clear();
        self.shared.clear();
        self.marks.clear();
        self.scoped.clear();
        self.open.clear();
    }

    /// Marks request position `i` of `n` as held by a shared pool.
    pub(crate) fn mark_shared(&mut self, i: usize, n: usize) {
        if self.shared.len() < n {
            self.shared.resize(n, 0);
        }
        self.shared[i] = 1;
    }

    /// With [`Self::attribute_sources`]: adds `bits` (one per request position) to the
    /// positions `source`'s pool holds, each also marked by [`Self::mark_shared`].
    pub(crate) fn mark_source(&mut self, source: WorkerDp, bits: &[u64]) {
        match self.marks.iter_mut().find(|m| m.0 == source) {
            Some(m) => m.1.iter_mut().zip(bits).for_each(|(a, b)| *a |= b),
            None => self.marks.push((source, bits.to_vec())),
        }
    }

    /// Applies `readers` after [`Self::finish`]: the blocks of a pool with a rule count only
    /// for its readers ([`Self::shared_beyond_for`]); [`Self::shared_beyond`] then counts the
    /// pools every worker reads. Nothing changes when no rule names a pool the request hit.
    pub fn scope(&mut self, readers: &PoolReaders) {
        if readers.is_empty()
            || !self
                .marks
                .iter()
                .any(|m| readers.readers(m.0.worker_id).is_some())
        {
            return;
        }
        let n = self.shared.len().saturating_sub(1);
        let mut open = vec![0u64; n.div_ceil(64)];
        for (source, bits) in &self.marks {
            match readers.readers(source.worker_id) {
                Some(r) => self.scoped.push((bits.clone(), r.to_vec())),
                None => open.iter_mut().zip(bits).for_each(|(o, b)| *o |= b),
            }
        }
        for i in (0..n).rev() {
            self.shared[i] = self.shared[i + 1] + ((open[i / 64] >> (i % 64)) & 1) as u32;
        }
        self.open = open;
    }

    /// Adds a worker's overlap (zero ones are left out); call [`Self::finish`] after.
    pub fn push(&mut self, worker: WorkerDp, o: TierOverlap) {
        if !o.is_zero() {
            self.scores.push((worker, o));
        }
    }

    /// Sorts what was pushed and counts the shared-pool blocks past each position. Once
    /// per [`Self::clear`].
    pub fn finish(&mut self) {
        self.scores.sort_unstable_by_key(|&(w, _)| w);
        // Shards and pools mark in no fixed order.
        self.marks.sort_unstable_by_key(|m| m.0);
        // Only a marked position makes `shared` non-empty.
        if self.shared.is_empty() {
            return;
        }
        self.shared.push(0);
        for i in (0..self.shared.len() - 1).rev() {
            self.shared[i] += self.shared[i + 1];
        }
    }

    /// Shared-pool blocks of the request at position `from` or later (Dynamo's
    /// `hits_beyond`): a worker's `shared_beyond_blocks` with `from` its device overlap.
    /// After [`Self::scope`], the pools every worker reads.
    pub fn shared_beyond(&self, from: u32) -> u32 {
        self.shared.get(from as usize).copied().unwrap_or(0)
    }

    /// [`Self::shared_beyond`] for `worker`: the blocks at or past `from` of every pool it
    /// reads (a block two pools hold counts once).
    pub fn shared_beyond_for(&self, worker: WorkerDp, from: u32) -> u32 {
        let mine: SmallVec<[&[u64]; 4]> = self
            .scoped
            .iter()
            .filter(|(_, r)| r.binary_search(&worker.worker_id).is_ok())
            .map(|(bits, _)| bits.as_slice())
            .collect();
        if mine.is_empty() {
            return self.shared_beyond(from);
        }
        let from = from as usize;
        let mut count = 0;
        for (w, &open) in self.open.iter().enumerate().skip(from / 64) {
            let mut word = mine.iter().fold(open, |acc, bits| acc | bits[w]);
            if w == from / 64 {
                word &= u64::MAX << (from % 64);
            }
            count += word.count_ones();
        }
        count
    }

    /// Whether a pool with readers holds a block of the request (after [`Self::scope`]):
    /// then workers differ in [`Self::shared_beyond_for`] beyond their device prefixes.
    pub fn has_scoped(&self) -> bool {
        !self.scoped.is_empty()
    }

    /// Fills a candidate's lower-tier and shared-pool counts from its worker's entry and
    /// its device overlap, as every front's decision does.
    pub fn fill(&self, c: &mut crate::policy::Candidate) {
        let t = self.get(c.worker);
        c.host_overlap_blocks = t.host;
        c.disk_overlap_blocks = t.disk;
        c.shared_beyond_blocks = self.shared_beyond_for(c.worker, c.device_overlap_blocks);
    }

    /// A worker's overlap (zero when absent).
    pub fn get(&self, worker: WorkerDp) -> TierOverlap {
        self.scores
            .binary_search_by_key(&worker, |&(w, _)| w)
            .map_or(TierOverlap::default(), |i| self.scores[i].1)
    }

    /// `(worker, overlap)`, sorted by worker.
    pub fn as_slice(&self) -> &[(WorkerDp, TierOverlap)] {
        &self.scores
    }

    /// Whether no worker has a lower-tier overlap and no shared pool holds a request block.
    pub fn is_empty(&self) -> bool {
        self.scores.is_empty() && self.shared.is_empty()
    }

    /// Every worker with a device or a lower-tier overlap, with both: first those of
    /// `device` in its order, then those whose match starts on a lower tier.
    pub fn with_device<'a>(
        &'a self,
        device: &'a OverlapScores,
    ) -> impl Iterator<Item = (WorkerDp, u32, TierOverlap)> + 'a {
        let on_device = device.iter().map(|(w, d)| (w, d, self.get(w)));
        let lower_only = self
            .scores
            .iter()
            .filter(|&&(w, _)| device.get(w) == 0)
            .map(|&(w, t)| (w, 0, t));
        on_device.chain(lower_only)
    }
}

/// `(engine name, path hash)` of each block of a chain stored under the block whose path
/// hash is `parent` (`None`: the root).
fn chain_paths(
    parent: Option<u64>,
    blocks: &[(LocalBlockHash, SequenceBlockHash)],
) -> impl Iterator<Item = (u64, u64)> + '_ {
    blocks.iter().scan(parent, |parent, &(local, name)| {
        let path = match *parent {
            None => local.0,
            Some(p) => next_sequence_hash(SequenceBlockHash(p), local).0,
        };
        *parent = Some(path);
        Some((name.0, path))
    })
}

/// One shard's lower tiers (see the [module docs](self)).
#[derive(Debug, Default)]
pub struct LowerTiers {
    /// Per tier: path hash -> the workers holding it there.
    holders: [Map<u64, SmallVec<[WorkerDp; 2]>>; 3],
    /// Per worker, per tier: engine name -> path hash.
    names: Map<WorkerDp, [Map<u64, u64>; 3]>,
    blocks: usize,
    orphans: u64,
    pool: SharedPool,
}

/// The shared-pool blocks of one shard's sources (see the [module docs](self)).
#[derive(Debug, Default)]
struct SharedPool {
    /// Path hash -> which sources hold it, with how many names each: one lookup per request
    /// block finds every pool hit and whose it is, however many sources there are. The
    /// value is [`one_holder`] (nearly always: one source) or [`MANY`] with an index into
    /// `many`, so that an entry is as small as a plain count's.
    paths: Map<u64, u64>,
    /// Holder lists of paths that several sources hold, `(source ordinal, names)`; the
    /// free slots are in `free`.
    many: Vec<SmallVec<[(u32, u32); 2]>>,
    free: Vec<usize>,
    /// Source ordinal -> source, for the sources that hold blocks; a source's ordinal is
    /// given back (to `free_ordinals`) when its last block goes, so there are never more
    /// ordinals than sources holding blocks at once.
    sources: Vec<WorkerDp>,
    ordinals: Map<WorkerDp, u32>,
    free_ordinals: Vec<u32>,
    /// Per source: engine name -> path hash.
    names: Map<WorkerDp, Map<u64, u64>>,
    blocks: usize,
}

/// A [`SharedPool::paths`] value naming a slot of its `many`, not one holder.
const MANY: u64 = 1 << 63;

/// A [`SharedPool::paths`] value: source ordinal `o` (below 2^31) holds it under `n` names.
fn one_holder(o: u32, n: u32) -> u64 {
    (u64::from(o) << 32) | u64::from(n)
}

impl SharedPool {
    fn ordinal(&mut self, source: WorkerDp) -> u32 {
        if let Some(&o) = self.ordinals.get(&source) {
            return o;
        }
        let o = match self.free_ordinals.pop() {
            Some(o) => {
                self.sources[o as usize] = source;
                o
            }
            None => {
                self.sources.push(source);
                (self.sources.len() - 1) as u32
            }
        };
        self.ordinals.insert(source, o);
        o
    }

    /// Gives `source`'s ordinal back once it holds no block (no path names it any more).
    fn retire(&mut self, source: WorkerDp) {
        if let Some(o) = self.ordinals.remove(&source) {
            self.free_ordinals.push(o);
        }
    }

    /// The source ordinals that hold a path, given its value.
    fn holders(&self, v: u64) -> impl Iterator<Item = u32> + '_ {
        let (one, many) = match v & MANY {
            0 => (Some((v >> 32) as u32), &[][..]),
            _ => (None, &self.many[(v & !MANY) as usize][..]),
        };
        one.into_iter().chain(many.iter().map(|h| h.0))
    }

    fn hold(&mut self, source: WorkerDp, name: u64, path: u64) {
        match self.names.entry(source).or_default().insert(name, path) {
            Some(old) if old == path => return,
            Some(old) => self.release(source, old),
            None => self.blocks += 1,
        }
        let o = self.ordinal(source);
        let Some(v) = self.paths.get_mut(&path) else {
            self.paths.insert(path, one_holder(o, 1));
            return;
        };
        if *v & MANY != 0 {
            let list = &mut self.many[(*v & !MANY) as usize];
            match list.iter_mut().find(|h| h.0 == o) {
                Some(h) => h.1 += 1,
                None => list.push((o, 1)),
            }
            return;
        }
        let (first, n) = ((*v >> 32) as u32, *v as u32);
        if first == o {
            *v = one_holder(o, n + 1);
            return;
        }
        let list: SmallVec<[(u32, u32); 2]> = SmallVec::from_buf([(first, n), (o, 1)]);
        let slot = match self.free.pop() {
            Some(slot) => {
                self.many[slot] = list;
                slot
            }
            None => {
                self.many.push(list);
                self.many.len() - 1
            }
        };
        *v = MANY | slot as u64;
    }

    fn release(&mut self, source: WorkerDp, path: u64) {
        let Some(&o) = self.ordinals.get(&source) else {
            return;
        };
        let Some(v) = self.paths.get_mut(&path) else {
            return;
        };
        let gone = if *v & MANY == 0 {
            let (first, n) = ((*v >> 32) as u32, *v as u32);
            if first != o {
                return;
            }
            *v = one_holder(o, n - 1);
            n == 1
        } else {
            let slot = (*v & !MANY) as usize;
            let list = &mut self.many[slot];
            if let Some(i) = list.iter().position(|h| h.0 == o) {
                list[i].1 -= 1;
                if list[i].1 == 0 {
                    list.swap_remove(i);
                }
            }
            // A list has two holders or more: down to one, the path goes back to the packed
            // value and the slot is free again.
            if let [(first, n)] = list[..] {
                list.clear();
                self.free.push(slot);
                *v = one_holder(first, n);
            }
            false
        };
        if gone {
            self.paths.remove(&path);
        }
    }

    fn remove(&mut self, source: WorkerDp, names: &[SequenceBlockHash]) -> usize {
        let Some(held) = self.names.get_mut(&source) else {
            return 0;
        };
        let gone: Vec<u64> = names.iter().filter_map(|n| held.remove(&n.0)).collect();
        let emptied = held.is_empty();
        if emptied {
            self.names.remove(&source);
        }
        for &path in &gone {
            self.release(source, path);
        }
        if emptied {
            self.retire(source);
        }
        self.blocks -= gone.len();
        gone.len()
    }

    fn clear(&mut self, source: WorkerDp) -> usize {
        let Some(held) = self.names.remove(&source) else {
            return 0;
        };
        for &path in held.values() {
            self.release(source, path);
        }
        self.retire(source);
        self.blocks -= held.len();
        held.len()
    }
}

impl LowerTiers {
    /// Empty.
    pub fn new() -> Self {
        Self::default()
    }

    /// Blocks held on lower tiers, all workers and tiers, and in shared pools.
    pub fn block_count(&self) -> usize {
        self.blocks + self.pool.blocks
    }

    /// Shared-pool blocks, all sources.
    pub fn pool_block_count(&self) -> usize {
        self.pool.blocks
    }

    /// The path hash of the shared-pool block `source` names `name`.
    pub fn pool_path_of(&self, source: WorkerDp, name: SequenceBlockHash) -> Option<u64> {
        self.pool.names.get(&source)?.get(&name.0).copied()
    }

    /// Stores a chain of `source`'s shared pool under the block whose path hash is
    /// `parent_path` (`None`: the root); returns how many blocks are new.
    pub fn pool_store(
        &mut self,
        source: WorkerDp,
        parent_path: Option<u64>,
        blocks: &[(LocalBlockHash, SequenceBlockHash)],
    ) -> usize {
        let before = self.pool.blocks;
        for (name, path) in chain_paths(parent_path, blocks) {
            self.pool.hold(source, name, path);
        }
        self.pool.blocks - before
    }

    /// Drops the named blocks of `source`'s shared pool; returns how many it held.
    pub fn pool_remove(&mut self, source: WorkerDp, names: &[SequenceBlockHash]) -> usize {
        self.pool.remove(source, names)
    }

    /// Drops every shared-pool block of `source`; returns how many.
    pub fn pool_clear(&mut self, source: WorkerDp) -> usize {
        self.pool.clear(source)
    }

    /// Every shared-pool block as `(source, name, path hash)`, for snapshots.
    pub fn pool_blocks(&self) -> impl Iterator<Item = (WorkerDp, u64, u64)> + '_ {
        self.pool
            .names
            .iter()
            .flat_map(|(&w, m)| m.iter().map(move |(&name, &path)| (w, name, path)))
    }

    /// Places one shared-pool block as a snapshot recorded it; returns whether it is new.
    pub fn pool_restore(&mut self, source: WorkerDp, name: u64, path: u64) -> bool {
        let before = self.pool.blocks;
        self.pool.hold(source, name, path);
        self.pool.blocks > before
    }

    /// Lower-tier chains not indexed because their parent was held on no tier.
    pub fn orphans(&self) -> u64 {
        self.orphans
    }

    /// Blocks `worker` holds on `tier` (a lower tier).
    pub fn blocks_of(&self, worker: WorkerDp, tier: usize) -> usize {
        self.names.get(&worker).map_or(0, |t| t[tier].len())
    }

    /// The path hash of the block `worker` names `name` on any lower tier.
    pub fn path_of(&self, worker: WorkerDp, name: SequenceBlockHash) -> Option<u64> {
        let tiers = self.names.get(&worker)?;
        tiers.iter().find_map(|t| t.get(&name.0).copied())
    }

    fn hold(&mut self, worker: WorkerDp, tier: usize, name: u64, path: u64) {
        let names = &mut self.names.entry(worker).or_default()[tier];
        match names.insert(name, path) {
            Some(old) if old == path => return,
            Some(old) => {
                Self::drop_holder(&mut self.holders[tier], old, worker);
                self.blocks -= 1;
            }
            None => {}
        }
        let h = self.holders[tier].entry(path).or_default();
        if !h.contains(&worker) {
            h.push(worker);
        }
        self.blocks += 1;
    }

    fn drop_holder(holders: &mut Map<u64, SmallVec<[WorkerDp; 2]>>, path: u64, worker: WorkerDp) {
        if let Some(h) = holders.get_mut(&path) {
            h.retain(|w| *w != worker);
            if h.is_empty() {
                holders.remove(&path);
            }
        }
    }

    /// Stores a chain on lower tier `tier` under the block whose path hash is
    /// `parent_path` (`None`: the root); returns how many blocks are new.
    pub fn store(
        &mut self,
        worker: WorkerDp,
        tier: usize,
        parent_path: Option<u64>,
        blocks: &[(LocalBlockHash, SequenceBlockHash)],
    ) -> usize {
        let before = self.blocks;
        for (name, path) in chain_paths(parent_path, blocks) {
            self.hold(worker, tier, name, path);
        }
        self.blocks - before
    }

    /// Places one block `worker` names `name` at path hash `path` on `tier`, as a snapshot
    /// recorded it; returns whether it is new.
    pub fn restore(&mut self, worker: WorkerDp, tier: usize, name: u64, path: u64) -> bool {
        let before = self.blocks;
        self.hold(worker, tier, name, path);
        self.blocks > before
    }

    /// `worker`'s lower-tier blocks as `(tier, name, path hash)`.
    pub fn blocks_of_worker(
        &self,
        worker: WorkerDp,
    ) -> impl Iterator<Item = (StorageTier, u64, u64)> + '_ {
        self.names.get(&worker).into_iter().flat_map(|tiers| {
            tiers.iter().enumerate().flat_map(|(t, m)| {
                m.iter()
                    .map(move |(&name, &path)| (LOWER_TIERS[t], name, path))
            })
        })
    }

    /// Counts a chain that could not be placed.
    pub fn orphan(&mut self) {
        self.orphans += 1;
    }

    /// Drops the named blocks of `worker` from `tier` (unknown names are skipped); returns
    /// how many it held.
    pub fn remove(&mut self, worker: WorkerDp, tier: usize, names: &[SequenceBlockHash]) -> usize {
        let Some(tiers) = self.names.get_mut(&worker) else {
            return 0;
        };
        let mut n = 0;
        for name in names {
            if let Some(path) = tiers[tier].remove(&name.0) {
                Self::drop_holder(&mut self.holders[tier], path, worker);
                n += 1;
            }
        }
        self.blocks -= n;
        if tiers.iter().all(Map::is_empty) {
            self.names.remove(&worker);
        }
        n
    }

    /// Drops everything `worker` holds on `tier`, or on every lower tier when `None`;
    /// returns how many blocks.
    pub fn clear(&mut self, worker: WorkerDp, tier: Option<usize>) -> usize {
        let Some(tiers) = self.names.get_mut(&worker) else {
            return 0;
        };
        let mut n = 0;
        for (t, names) in tiers.iter_mut().enumerate() {
            if tier.is_some_and(|x| x != t) {
                continue;
            }
            for (_, path) in names.drain() {
                Self::drop_holder(&mut self.holders[t], path, worker);
                n += 1;
            }
        }
        self.blocks -= n;
        if tiers.iter().all(Map::is_empty) {
            self.names.remove(&worker);
        }
        n
    }

    /// Drops every worker that `which` selects, on every tier and as a shared-pool source;
    /// returns the blocks dropped.
    pub fn remove_where(&mut self, which: impl Fn(WorkerDp) -> bool) -> usize {
        let gone: Vec<WorkerDp> = self.names.keys().copied().filter(|&w| which(w)).collect();
        let sources: Vec<WorkerDp> = self
            .pool
            .names
            .keys()
            .copied()
            .filter(|&w| which(w))
            .collect();
        let tiers: usize = gone.into_iter().map(|w| self.clear(w, None)).sum();
        let pool: usize = sources.into_iter().map(|w| self.pool.clear(w)).sum();
        tiers + pool
    }

    fn holds(&self, tier: usize, path: u64, worker: WorkerDp) -> bool {
        self.holders[tier]
            .get(&path)
            .is_some_and(|h| h.contains(&worker))
    }

    /// Appends to `out` the overlaps of this shard's workers for a request whose path
    /// hashes are `paths`, given every worker's device scores `device`. Call
    /// [`TierScores::finish`] once every shard has added its part.
    pub fn overlaps_into(&self, paths: &[u64], device: &OverlapScores, out: &mut TierScores) {
        if self.pool.blocks > 0 {
            // Only rules need to know whose the hits are: per source ordinal, its bits.
            let attribute = out.attributes_sources();
            let mut bits: Vec<Vec<u64>> = Vec::new();
            for (i, p) in paths.iter().enumerate() {
                let Some(&v) = self.pool.paths.get(p) else {
                    continue;
                };
                out.mark_shared(i, paths.len());
                if attribute {
                    for o in self.pool.holders(v) {
                        let o = o as usize;
                        if bits.len() <= o {
                            bits.resize(o + 1, Vec::new());
                        }
                        if bits[o].is_empty() {
                            bits[o] = vec![0; paths.len().div_ceil(64)];
                        }
                        bits[o][i / 64] |= 1 << (i % 64);
                    }
                }
            }
            for (o, b) in bits.iter().enumerate().filter(|(_, b)| !b.is_empty()) {
                out.mark_source(self.pool.sources[o], b);
            }
        }
        if self.blocks == 0 || paths.is_empty() {
            return;
        }
        // Candidates: workers with a device prefix, and those holding the first block on a
        // lower tier (a continuation from the root).
        let mut workers: SmallVec<[WorkerDp; 16]> = device
            .iter()
            .map(|(w, _)| w)
            .filter(|w| self.names.contains_key(w))
            .collect();
        for t in 0..3 {
            if let Some(h) = self.holders[t].get(&paths[0]) {
                for &w in h {
                    if device.get(w) == 0 && !workers.contains(&w) {
                        workers.push(w);
                    }
                }
            }
        }
        for w in workers {
            let mut pos = device.get(w) as usize;
            let mut run = [0u32; 3];
            for (t, r) in run.iter_mut().enumerate() {
                while pos < paths.len() && self.holds(t, paths[pos], w) {
                    *r += 1;
                    pos += 1;
                }
            }
            out.push(
                w,
                TierOverlap {
                    host: run[0],
                    disk: run[1] + run[2],
                },
            );
        }
    }

    /// Every worker's lower-tier blocks as `(tier, name, path hash)`, for dumps and tests.
    pub fn blocks(&self) -> impl Iterator<Item = (WorkerDp, StorageTier, u64, u64)> + '_ {
        self.names.iter().flat_map(|(&w, tiers)| {
            tiers.iter().enumerate().flat_map(move |(t, m)| {
                m.iter()
                    .map(move |(&name, &path)| (w, LOWER_TIERS[t], name, path))
            })
        })
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::hash::sequence_hashes;

    const A: WorkerDp = WorkerDp::new(1, 0);
    const B: WorkerDp = WorkerDp::new(2, 0);

    fn l(v: &[u64]) -> Vec<LocalBlockHash> {
        v.iter().map(|&x| LocalBlockHash(x)).collect()
    }

    fn chain(locals: &[LocalBlockHash], name0: u64) -> Vec<(LocalBlockHash, SequenceBlockHash)> {
        locals
            .iter()
            .enumerate()
            .map(|(i, &x)| (x, SequenceBlockHash(name0 + i as u64)))
            .collect()
    }

    #[test]
    fn continuations_start_after_the_device_and_chain_tiers() {
        let q = l(&[1, 2, 3, 4, 5, 6]);
        let paths: Vec<u64> = sequence_hashes(&q).into_iter().map(|s| s.0).collect();
        let mut t = LowerTiers::new();
        // A: host holds q[0..4) (its first two also on the device), disk q[4..5).
        t.store(A, 0, None, &chain(&q[..4], 100));
        t.store(A, 1, Some(paths[3]), &chain(&q[4..5], 200));
        // B: nothing on device or host, external q[0..2).
        t.store(B, 2, None, &chain(&q[..2], 300));
        let device: OverlapScores = [(A, 2)].into_iter().collect();
        let mut out = TierScores::new();
        t.overlaps_into(&paths, &device, &mut out);
        out.finish();
        assert_eq!(out.get(A), TierOverlap { host: 2, disk: 1 });
        assert_eq!(out.get(B), TierOverlap { host: 0, disk: 2 });
        // Device covering everything host holds: host adds nothing, disk continues.
        let device: OverlapScores = [(A, 4)].into_iter().collect();
        let mut out = TierScores::new();
        t.overlaps_into(&paths, &device, &mut out);
        out.finish();
        assert_eq!(out.get(A), TierOverlap { host: 0, disk: 1 });
        // Evicting the host copy of q[2] cuts host at 2 and strands the disk block.
        assert_eq!(t.remove(A, 0, &[SequenceBlockHash(102)]), 1);
        let device: OverlapScores = [(A, 2)].into_iter().collect();
        let mut out = TierScores::new();
        t.overlaps_into(&paths, &device, &mut out);
        out.finish();
        assert_eq!(out.get(A), TierOverlap::default());
        assert_eq!(t.block_count(), 3 + 1 + 2);
        assert_eq!(t.clear(A, None), 4);
        assert_eq!(t.remove_where(|w| w == B), 2);
        assert_eq!(t.block_count(), 0);
    }

    #[test]
    fn the_shared_pool_counts_its_blocks_past_each_device_prefix() {
        let q = l(&[1, 2, 3, 4, 5, 6]);
        let paths: Vec<u64> = sequence_hashes(&q).into_iter().map(|s| s.0).collect();
        let mut t = LowerTiers::new();
        // Source A's pool holds q[0..5); then q[1] goes: the pool's hits are sparse
        // (positions 0, 2, 3, 4), as Dynamo's `SharedCacheHits` ranges may be.
        assert_eq!(t.pool_store(A, None, &chain(&q[..5], 100)), 5);
        assert_eq!(t.pool_remove(A, &[SequenceBlockHash(101)]), 1);
        // Source B holds q[3] under A's path for q[2] (resolved by the writer) and q[5].
        assert_eq!(t.pool_store(B, Some(paths[2]), &chain(&q[3..6], 203)), 3);
        assert_eq!((t.pool_block_count(), t.block_count()), (7, 7));
        let device: OverlapScores = [(A, 3)].into_iter().collect();
        let mut out = TierScores::new();
        t.overlaps_into(&paths, &device, &mut out);
        out.finish();
        // Hits at 0, 2, 3, 4, 5: five from the start, three past a 3-block device prefix.
        assert_eq!(out.shared_beyond(0), 5);
        assert_eq!(out.shared_beyond(1), 4);
        assert_eq!(out.shared_beyond(3), 3);
        assert_eq!(out.shared_beyond(6), 0);
        assert_eq!(out.shared_beyond(99), 0);
        // No worker tier overlap: the pool alone makes the scores non-empty.
        assert_eq!(out.get(A), TierOverlap::default());
        assert!(!out.is_empty());
        // A path two sources hold stays until both let it go.
        assert_eq!(t.pool_clear(B), 3);
        let mut out = TierScores::new();
        t.overlaps_into(&paths, &device, &mut out);
        out.finish();
        assert_eq!(out.shared_beyond(0), 4);
        // A worker-scoped clear of the source keeps its pool; its leaving drops it.
        assert_eq!(t.clear(A, None), 0);
        assert_eq!(t.pool_block_count(), 4);
        assert_eq!(t.remove_where(|w| w == A), 4);
        assert_eq!(t.block_count(), 0);
        let mut out = TierScores::new();
        t.overlaps_into(&paths, &device, &mut out);
        out.finish();
        assert!(out.is_empty());
        assert_eq!(out.shared_beyond(0), 0);
    }

    #[test]
    fn pool_readers_parse_and_refuse_bad_rules() {
        let mut r = PoolReaders::new();
        assert!(r.is_empty());
        r.add_rule("9=3, 1,3").unwrap();
        r.add_rule(" 4 =7").unwrap();
        assert_eq!(r.readers(9), Some(&[1, 3][..]));
        assert_eq!(r.readers(4), Some(&[7][..]));
        assert_eq!(r.readers(5), None);
        for bad in ["9", "x=1", "8=1,y", "8=", "9=2"] {
            let e = r.add_rule(bad).unwrap_err();
            assert_eq!(e.spec, bad);
        }
        assert_eq!(r.readers(9), Some(&[1, 3][..]));
    }

    /// Two pools over a 150-block request (three bitset words), one read by `A` only:
    /// every count from every position equals a count position by position.
    #[test]
    fn scoped_pools_count_for_their_readers_from_any_position() {
        const C: WorkerDp = WorkerDp::new(9, 0);
        const D: WorkerDp = WorkerDp::new(10, 1);
        let q: Vec<LocalBlockHash> = (1..=150).map(LocalBlockHash).collect();
        let paths: Vec<u64> = sequence_hashes(&q).into_iter().map(|s| s.0).collect();
        let mut t = LowerTiers::new();
        // C (read by A only) holds 0..100, then 60..70 go; D (every worker) holds 90..150.
        t.pool_store(C, None, &chain(&q[..100], 1_000));
        let gone: Vec<SequenceBlockHash> = (60..70).map(|i| SequenceBlockHash(1_000 + i)).collect();
        assert_eq!(t.pool_remove(C, &gone), 10);
        t.pool_store(D, Some(paths[89]), &chain(&q[90..], 5_000));
        let mut readers = PoolReaders::new();
        readers.add_rule("9=1").unwrap();
        let mut out = TierScores::new();
        out.attribute_sources(true);
        t.overlaps_into(&paths, &OverlapScores::new(), &mut out);
        out.finish();
        let unscoped = out.clone();
        out.scope(&readers);
        assert!(out.has_scoped());
        let c_holds = |i: usize| i < 100 && !(60..70).contains(&i);
        let d_holds = |i: usize| i >= 90;
        for from in 0..=151u32 {
            let count =
                |f: &dyn Fn(usize) -> bool| (from as usize..150).filter(|&i| f(i)).count() as u32;
            let both = count(&|i| c_holds(i) || d_holds(i));
            assert_eq!(out.shared_beyond_for(A, from), both, "from {from}");
            assert_eq!(
                out.shared_beyond_for(B, from),
                count(&d_holds),
                "from {from}"
            );
            assert_eq!(out.shared_beyond(from), count(&d_holds), "from {from}");
            assert_eq!(unscoped.shared_beyond_for(B, from), both, "from {from}");
        }
        // D goes, and with it the blocks both held: A keeps C's, B reads nothing.
        assert_eq!(t.pool_clear(D), 60);
        let mut after = TierScores::new();
        after.attribute_sources(true);
        t.overlaps_into(&paths, &OverlapScores::new(), &mut after);
        after.finish();
        after.scope(&readers);
        for from in [0, 64, 95, 100] {
            let c = (from as usize..150).filter(|&i| c_holds(i)).count() as u32;
            assert_eq!(after.shared_beyond_for(A, from), c, "from {from}");
            assert_eq!(after.shared_beyond_for(B, from), 0, "from {from}");
        }
        // A rule for a source the request did not hit changes nothing.
        let mut other = PoolReaders::new();
        other.add_rule("77=2").unwrap();
        let mut again = unscoped.clone();
        again.scope(&other);
        assert_eq!(again, unscoped);
    }

    /// Sources that come and go (a hostile or churning publisher) do not pile up: a source
    /// that holds nothing any more gives its ordinal back, and a path two sources held
    /// keeps its remaining holder.
    #[test]
    fn pool_sources_that_leave_give_their_ordinals_back() {
        let q = l(&[1, 2, 3]);
        let paths: Vec<u64> = sequence_hashes(&q).into_iter().map(|s| s.0).collect();
        let mut t = LowerTiers::new();
        t.pool_store(A, None, &chain(&q, 10));
        for i in 0..1_000u64 {
            let s = WorkerDp::new(100 + i, 0);
            assert_eq!(t.pool_store(s, None, &chain(&q[..2], 20)), 2);
            if i % 2 == 0 {
                assert_eq!(t.pool_clear(s), 2);
            } else {
                let names = [SequenceBlockHash(20), SequenceBlockHash(21)];
                assert_eq!(t.pool_remove(s, &names), 2);
            }
        }
        assert_eq!(t.pool.sources.len(), 2);
        assert_eq!((t.pool.ordinals.len(), t.pool.paths.len()), (1, 3));
        assert!(t.pool.paths.values().all(|&v| v & MANY == 0));
        let mut out = TierScores::new();
        out.attribute_sources(true);
        t.overlaps_into(&paths, &OverlapScores::new(), &mut out);
        out.finish();
        assert_eq!(out.shared_beyond(0), 3);
        assert_eq!(out.marks.len(), 1);
        assert_eq!(out.marks[0].0, A);
    }

    #[test]
    fn shared_pool_hits_from_several_shards_are_counted_once() {
        let q = l(&[1, 2, 3]);
        let paths: Vec<u64> = sequence_hashes(&q).into_iter().map(|s| s.0).collect();
        let (mut s1, mut s2) = (LowerTiers::new(), LowerTiers::new());
        s1.pool_store(A, None, &chain(&q[..2], 10));
        s2.pool_store(B, None, &chain(&q, 20));
        let mut out = TierScores::new();
        s1.overlaps_into(&paths, &OverlapScores::new(), &mut out);
        s2.overlaps_into(&paths, &OverlapScores::new(), &mut out);
        out.finish();
        assert_eq!(out.shared_beyond(0), 3);
        assert_eq!(out.shared_beyond(2), 1);
        // Reused after a clear.
        out.clear();
        s1.overlaps_into(&paths, &OverlapScores::new(), &mut out);
        out.finish();
        assert_eq!(out.shared_beyond(0), 2);
    }

    #[test]
    fn a_renamed_block_moves_and_duplicates_are_free() {
        let q = l(&[7, 8]);
        let mut t = LowerTiers::new();
        assert_eq!(t.store(A, 0, None, &chain(&q, 10)), 2);
        assert_eq!(t.store(A, 0, None, &chain(&q, 10)), 0);
        // The name 11 now stands for another path: the old one is no longer held.
        let other = l(&[7, 9]);
        t.store(A, 0, None, &chain(&other, 10));
        assert_eq!(t.blocks_of(A, 0), 2);
        let paths: Vec<u64> = sequence_hashes(&q).into_iter().map(|s| s.0).collect();
        let mut out = TierScores::new();
        t.overlaps_into(&paths, &OverlapScores::new(), &mut out);
        out.finish();
        assert_eq!(out.get(A).host, 1);
    }
}
