//! Lock-free lookups: `find_matches` over one shard tree, under an epoch guard, without
//! locks and without waiting for the writer.
//!
//! The walk keeps the set of workers still matching as a bitset. At each node it compares
//! the query with the published edge (eight hashes at a time), looks up the child that
//! continues the query, and keeps the workers that hold the node up to the divergence point
//! *and* hold the child; every worker that drops out is scored once. The cost is O(depth)
//! word operations plus one entry per worker that drops out, and the walk stops as soon as
//! no worker can match further. Scores are kept per slot and emitted in the shard's
//! [`SlotOrder`], so each shard's answer comes out sorted by worker without a sort; a
//! lookup over several shards emits through their orders merged once per change
//! ([`MergedOrder`]), so it needs no merge either.
//!
//! The walk is written once over [`SlotSet`]: a plain `u64` for shards of up to 64 slots
//! (every set operation one instruction), a word slice for larger ones. What these choices
//! cost and saved, measured, is in docs/BENCHMARKS.md.

use std::sync::Arc;

use crossbeam_epoch::{Atomic, Guard, Owned, Shared};
use smallvec::SmallVec;

use super::raw::bits::{AtomicBits, for_each_set};
use super::raw::node::Node;
use super::shared::{ShardShared, SlotOrder};
use crate::index::OverlapScores;
use crate::sync::Ordering;
use crate::worker::WorkerDp;

type Words = SmallVec<[u64; 4]>;

/// `n` zero words, without the element-by-element fill of `smallvec![0; n]` when they fit
/// inline.
#[inline]
fn zeros(n: usize) -> Words {
    if n <= 4 {
        Words::from_buf_and_len([0; 4], n)
    } else {
        smallvec::smallvec![0; n]
    }
}

/// A set of worker slots as the walk keeps it: one plain word for a shard of up to 64
/// slots (the common case, where every step is one instruction), or a word slice.
trait SlotSet: Clone {
    fn is_empty(&self) -> bool;
    /// `self &= bits`.
    fn and_bits(&mut self, bits: &AtomicBits, guard: &Guard);
    /// `self = other` (same length).
    fn copy_from(&mut self, other: &Self);
    fn clear(&mut self);
    /// `self &= !other`.
    fn remove_all(&mut self, other: &Self);
    /// Whether `slot` is in; a slot past the set's words is not.
    fn contains(&self, slot: u32) -> bool;
    fn insert(&mut self, slot: u32);
    /// Takes `slot` out; a slot past the set's words is not in it anyway.
    fn remove(&mut self, slot: u32);
    /// `self |= other` (same length).
    fn add_all(&mut self, other: &Self);
    fn for_each(&self, f: impl FnMut(u32));
}

impl SlotSet for u64 {
    #[inline(always)]
    fn is_empty(&self) -> bool {
        *self == 0
    }
    #[inline(always)]
    fn and_bits(&mut self, bits: &AtomicBits, _: &Guard) {
        *self &= bits.first_word();
    }
    #[inline(always)]
    fn copy_from(&mut self, other: &Self) {
        *self = *other;
    }
    #[inline(always)]
    fn clear(&mut self) {
        *self = 0;
    }
    #[inline(always)]
    fn remove_all(&mut self, other: &Self) {
        *self &= !*other;
    }
    #[inline(always)]
    fn contains(&self, slot: u32) -> bool {
        slot < 64 && *self & (1 << slot) != 0
    }
    #[inline(always)]
    fn insert(&mut self, slot: u32) {
        *self |= 1 << slot;
    }
    #[inline(always)]
    fn remove(&mut self, slot: u32) {
        if slot < 64 {
            *self &= !(1 << slot);
        }
    }
    #[inline(always)]
    fn add_all(&mut self, other: &Self) {
        *self |= *other;
    }
    #[inline(always)]
    fn for_each(&self, f: impl FnMut(u32)) {
        for_each_set(std::slice::from_ref(self), f);
    }
}

impl SlotSet for Words {
    fn is_empty(&self) -> bool {
        self.iter().all(|&w| w == 0)
    }
    fn and_bits(&mut self, bits: &AtomicBits, guard: &Guard) {
        bits.and_into(self, guard);
    }
    fn copy_from(&mut self, other: &Self) {
        self.copy_from_slice(other);
    }
    fn clear(&mut self) {
        self.iter_mut().for_each(|w| *w = 0);
    }
    fn remove_all(&mut self, other: &Self) {
        for (a, k) in self.iter_mut().zip(other.iter()) {
            *a &= !k;
        }
    }
    fn contains(&self, slot: u32) -> bool {
        self.get((slot / 64) as usize)
            .is_some_and(|w| w & (1 << (slot % 64)) != 0)
    }
    fn insert(&mut self, slot: u32) {
        self[(slot / 64) as usize] |= 1 << (slot % 64);
    }
    fn remove(&mut self, slot: u32) {
        if let Some(w) = self.get_mut((slot / 64) as usize) {
            *w &= !(1 << (slot % 64));
        }
    }
    fn add_all(&mut self, other: &Self) {
        for (a, o) in self.iter_mut().zip(other.iter()) {
            *a |= o;
        }
    }
    fn for_each(&self, f: impl FnMut(u32)) {
        for_each_set(self, f);
    }
}

/// Scores every worker of `shard` for `query` (local hashes as `u64`), appending the
/// positive scores to `out` sorted by worker.
pub(crate) fn find_in_shard(
    shard: &ShardShared,
    query: &[u64],
    out: &mut OverlapScores,
    guard: &Guard,
) {
    if query.is_empty() {
        return;
    }
    // Bits beyond the slot capacity loaded here are left out: they belong to slots added
    // after it was loaded, which this lookup does not score.
    let cap = slot_cap(shard);
    if cap <= 64 {
        let active = shard.root.any.first_word();
        walk_and_emit(shard, query, active, &mut [0; 64], out, guard);
    } else {
        let nwords = cap.div_ceil(64);
        let mut active: Words = zeros(nwords);
        shard.root.any.or_into(&mut active, guard);
        walk_and_emit(shard, query, active, &mut vec![0; nwords * 64], out, guard);
    }
}

/// Walks `shard` from `active` (its root's `any`, loaded just before) into `scores` (zero,
/// one per slot) and appends the positive ones to `out` in worker order.
#[inline]
fn walk_and_emit<S: SlotSet>(
    shard: &ShardShared,
    query: &[u64],
    active: S,
    scores: &mut [u32],
    out: &mut OverlapScores,
    guard: &Guard,
) {
    // After the root's `any`, as `load_order` requires.
    let order = load_order(shard, guard);
    walk(shard, query, active, scores, guard);
    emit(order, scores, out);
}

/// Lookups over up to this many shards emit through a [`MergedOrder`].
const MERGED_SHARDS: usize = 4;

/// Scores every worker of every shard for `query`, writing the positive scores into `out`
/// (empty) sorted by worker. Up to [`MERGED_SHARDS`] shards of up to 64 slots each (the
/// common case) emit once through `merged`, in worker order, with no merge per lookup;
/// other shapes emit shard by shard and merge the runs.
pub(crate) fn find_in_shards(
    shards: &[Arc<ShardShared>],
    merged: &MergedCache,
    query: &[u64],
    out: &mut OverlapScores,
    guard: &Guard,
) {
    if query.is_empty() {
        return;
    }
    if shards.len() == 1 || shards.len() > MERGED_SHARDS || shards.iter().any(|s| slot_cap(s) > 64)
    {
        for shard in shards {
            // Each shard appends its scores sorted by worker; worker sets of shards are
            // disjoint, so merging the runs gives the sorted answer.
            let start = out.len();
            find_in_shard(shard, query, out, guard);
            out.merge_run(start);
        }
        return;
    }
    // Every shard had at most 64 slots when checked, so each shard's walk scores slots
    // 0..64 (its first bitset word) into its own 64 scores, as `find_in_shard` would.
    let mut scores = [0u32; 64 * MERGED_SHARDS];
    let mut orders: SmallVec<[&SlotOrder; MERGED_SHARDS]> = SmallVec::new();
    for (shard, scores) in shards.iter().zip(scores.chunks_exact_mut(64)) {
        let active = shard.root.any.first_word();
        orders.push(load_order(shard, guard));
        walk(shard, query, active, scores, guard);
    }
    for &(at, worker) in merged.get(&orders, guard).entries.iter() {
        match scores[at as usize] {
            0 => {}
            score => out.push(worker, score),
        }
    }
}

/// How many slots `shard`'s bitsets may use (load it before the root's `any`).
#[inline]
fn slot_cap(shard: &ShardShared) -> usize {
    shard.slot_cap.load(Ordering::Acquire) as usize
}

/// `shard`'s slot order; load it after the root's `any`, so that it holds every slot set
/// there (see `SlotOrder`).
#[inline]
fn load_order<'g>(shard: &ShardShared, guard: &'g Guard) -> &'g SlotOrder {
    let order_ptr = shard.order.load(Ordering::Acquire, guard);
    // SAFETY: replaced only by the writer and freed through the collector.
    unsafe { order_ptr.deref() }
}

/// Appends the positive `scores` (by slot) to `out` in the order's worker order.
#[inline]
fn emit(order: &SlotOrder, scores: &[u32], out: &mut OverlapScores) {
    for &(slot, worker) in order.slots.iter() {
        match scores.get(slot as usize) {
            Some(&score) if score > 0 => out.push(worker, score),
            _ => {}
        }
    }
}

/// The slot orders of several shards merged into one worker order, for lookups over
/// those shards: `(shard * 64 + slot, worker)` for every slot below 64 of every shard, in
/// worker order, built from the orders with the generations in `generations`.
///
/// Immutable once built. Built by whichever lookup first finds the cached one stale (a
/// shard's order changes only when a slot gets a worker), so the cost of the merge is paid
/// once per change instead of once per lookup.
#[derive(Debug)]
pub(crate) struct MergedOrder {
    generations: SmallVec<[u64; MERGED_SHARDS]>,
    entries: Box<[(u32, WorkerDp)]>,
}

impl MergedOrder {
    #[cfg(all(test, loom))]
    pub(crate) fn entries_for_test(&self) -> &[(u32, WorkerDp)] {
        &self.entries
    }

    fn build(orders: &[&SlotOrder]) -> Self {
        let mut entries: Vec<(u32, WorkerDp)> = Vec::new();
        for (i, o) in orders.iter().enumerate() {
            // Slots from 64 on belong to shards that grew after a lookup checked them:
            // that lookup scores only slots below 64, and later ones take the other path.
            entries.extend(
                o.slots
                    .iter()
                    .filter(|&&(slot, _)| slot < 64)
                    .map(|&(slot, w)| ((i * 64) as u32 + slot, w)),
            );
        }
        // Stable, and each shard's entries are in its own order already: a stale entry of
        // a removed worker (no bits, never emitted) keeps its place as it does there.
        entries.sort_by_key(|&(_, w)| w);
        Self {
            generations: orders.iter().map(|o| o.generation).collect(),
            entries: entries.into_boxed_slice(),
        }
    }
}

/// The latest [`MergedOrder`] of a reader's shards, shared by the clones of a reader.
///
/// Invariants and what readers see: the pointer is null or a published, immutable
/// [`MergedOrder`]; it is replaced by compare-and-swap (any lookup may replace it) and
/// the old value is retired through the epoch collector, so a pinned lookup that loaded
/// it may keep using it. A lookup uses a merged order only if its generations are those of
/// the orders that lookup loaded, so it emits exactly what per-shard emission would.
#[derive(Debug, Default)]
pub(crate) struct MergedCache(Atomic<MergedOrder>);

impl MergedCache {
    /// The merged order of `orders`: the cached one if it was built from them, else a
    /// new one (also cached for the lookups after this one).
    #[inline]
    pub(crate) fn get<'g>(&self, orders: &[&SlotOrder], guard: &'g Guard) -> &'g MergedOrder {
        let cur = self.0.load(Ordering::Acquire, guard);
        // SAFETY: published merged orders are freed only through the collector after being
        // replaced, so they outlive `guard`.
        if let Some(m) = unsafe { cur.as_ref() }
            && m.generations.len() == orders.len()
            && m.generations
                .iter()
                .zip(orders)
                .all(|(&g, o)| g == o.generation)
        {
            return m;
        }
        self.rebuild(cur, orders, guard)
    }

    #[cold]
    #[inline(never)]
    fn rebuild<'g>(
        &self,
        cur: Shared<'_, MergedOrder>,
        orders: &[&SlotOrder],
        guard: &'g Guard,
    ) -> &'g MergedOrder {
        let new = Owned::new(MergedOrder::build(orders)).into_shared(guard);
        // `AcqRel`: the new order is published (`Release`, pairing with the `Acquire` load
        // in `get`) for the lookups that load it.
        let lost =
            match self
                .0
                .compare_exchange(cur, new, Ordering::AcqRel, Ordering::Acquire, guard)
            {
                Ok(_) => cur,
                // Another lookup replaced it first; ours serves this lookup only.
                Err(_) => new,
            };
        if !lost.is_null() {
            // SAFETY: `lost` is unreachable from the cache now (replaced, or never
            // published), so only lookups pinned before this point can hold it; the
            // collector frees it after they unpin, and `new` outlives `guard` either way.
            unsafe { guard.defer_destroy(lost) };
        }
        // SAFETY: `new` is freed only through the collector, after `guard` unpins.
        unsafe { new.deref() }
    }
}

impl Drop for MergedCache {
    fn drop(&mut self) {
        // SAFETY: `&mut self`: no lookup can reach the cache any more, and its value was
        // created by `Owned::new` and is freed once, here.
        unsafe {
            let m = self
                .0
                .load(Ordering::Relaxed, crossbeam_epoch::unprotected());
            if !m.is_null() {
                drop(m.into_owned());
            }
        }
    }
}

/// The walk: writes the score of each worker in `active` into `scores[slot]`.
fn walk<S: SlotSet>(
    shard: &ShardShared,
    query: &[u64],
    mut active: S,
    scores: &mut [u32],
    guard: &Guard,
) {
    let root_children = shard.root.children.load(Ordering::Acquire, guard);
    // SAFETY: child tables are freed through the collector after being replaced.
    let Some(mut node) =
        (unsafe { root_children.as_ref() }).and_then(|t| t.get(0, query[0], guard))
    else {
        return;
    };
    active.and_bits(&node.any, guard);
    let mut depth = 0usize;
    // `active` and `keep` swap roles at every level.
    let (mut reach, mut keep) = (active.clone(), active.clone());
    let mut partials: SmallVec<[(u32, u32); 8]> = SmallVec::new();
    loop {
        if active.is_empty() {
            return;
        }
        let rest = &query[depth..];
        // The node step and the child that continues the query, repeated while the writer
        // changes the node under it (see `node_step`).
        let (m, child) = loop {
            if let Some(found) = node_step(node, rest, &active, &mut reach, &mut partials, guard) {
                break found;
            }
        };
        // Who holds the child.
        keep.copy_from(&reach);
        match child {
            Some(c) => keep.and_bits(&c.any, guard),
            None => keep.clear(),
        }
        // Score the workers that stop here: those that reach `m` score `depth + m` (one
        // store each); the others hold a shorter prefix by the partial list (or, seen
        // mid-update, none of the node) and are looked up there.
        active.remove_all(&keep);
        let mut short = active.clone();
        short.remove_all(&reach);
        active.remove_all(&short);
        let reached = (depth + m) as u32;
        active.for_each(|slot| scores[slot as usize] = reached);
        // A short worker scores `depth` plus the most it holds by the partial list (one
        // pass over the list, not one per worker: with many workers both are long).
        short.for_each(|slot| scores[slot as usize] = depth as u32);
        for &(slot, c) in &partials {
            if short.contains(slot) {
                let held = (depth + (c as usize).min(m)) as u32;
                let score = &mut scores[slot as usize];
                *score = (*score).max(held);
            }
        }
        let Some(c) = child else { return };
        std::mem::swap(&mut active, &mut keep);
        depth += m;
        node = c;
    }
}

/// One node of the walk: the divergence point `m` of `rest` with the node's edge, the child
/// attached at `m` that continues `rest` (if any), and in `reach` the workers of `active`
/// that hold the node up to `m` (with the partial list it read in `partials`). `None` when
/// the edge was replaced, or trimmed below `m`, while the step read the node's bits and
/// child table, or when a worker of the node moved between `full` and the partial list
/// both ways during the step: the caller runs it again.
///
/// Why the edge is checked again at the end: `full` means "holds the whole edge *now*", so
/// a worker seen in `full` holds `m` blocks only if the length stayed at least `m` while
/// the bits were read. The writer publishes a trim before the promotions it causes (and
/// removes a worker's coverage before the trim), but the step loads the length first, so
/// without the check it could pair a length from before a trim with a `full` bit from
/// after the promotion, and credit the promoted worker with blocks it never held (loom
/// model `loom_models_trim_then_promote_past_the_query`). Within one buffer the length only
/// rises (appends in place while nothing was trimmed) and then only falls (trims; an append
/// after a trim copies to a new buffer, see `raw::edge`), so if the buffer is the same at
/// both ends of the step and both lengths are at least `m`, the length was at least `m` at
/// every moment in between, and every `full` bit the step saw stands for `m` blocks. The
/// partial list's cutoffs are absolute, and cells below a loaded length never change.
///
/// The child is looked up inside the step, before the check, for the same reason: the
/// node's blocks below `m` can change (a trim below `m`, then an append that copies new
/// blocks into a new buffer), and a child looked up after that would hang below blocks
/// the query does not follow (loom model `loom_models_child_found_below_replaced_blocks`).
/// A child found while the blocks below `m` stayed those the query matched hangs below
/// them. Its `any` may be loaded after the check: a worker in it holds the child, so the
/// child is still linked, and a linked child's parent cannot have lost the blocks below
/// it (trimming below `m` leaves every child attached at `m` held by nobody, and such a
/// child is pruned in the same event, before any append).
///
/// "Moments" are points of the writer's program order: every store a reader can see is the
/// one writer's, with `Release`, and every load here is `Acquire`, so the values one step
/// reads are those at a sequence of such points that never goes back in the order of the
/// loads. A buffer seen twice is the same buffer throughout: a replaced one is retired
/// through the collector, so its address is not reused while this lookup is pinned.
#[inline(always)]
fn node_step<'g, S: SlotSet>(
    node: &Node,
    rest: &[u64],
    active: &S,
    reach: &mut S,
    partials: &mut SmallVec<[(u32, u32); 8]>,
    guard: &'g Guard,
) -> Option<(usize, Option<&'g Node>)> {
    let edge_ptr = node.edge.load(Ordering::Acquire, guard);
    // SAFETY: edge buffers are freed through the collector after being replaced.
    let edge = unsafe { edge_ptr.deref() };
    let len = edge.len();
    // SAFETY: indices below a length loaded from this buffer are read-only (raw::edge).
    let m = unsafe { edge.common_prefix(len, rest) };

    // Workers holding the node up to the divergence point `m`.
    reach.copy_from(active);
    reach.and_bits(&node.full, guard);
    partials.clear();
    let pl = node.partial.load(Ordering::Acquire, guard);
    // SAFETY: partial lists are freed through the collector after being replaced.
    if let Some(p) = unsafe { pl.as_ref() } {
        p.for_each(|slot, cutoff| partials.push((slot, cutoff)));
    }
    for &(slot, cutoff) in partials.iter() {
        if cutoff as usize >= m && active.contains(slot) {
            reach.insert(slot);
        }
    }
    // A worker promoted from the partial list to `full` (the writer sets its `full` bit,
    // then frees its partial entry) is in neither if this step loaded `full` before the
    // set and the list after the free. The free it missed the entry by was published after
    // the set, so a second load of `full` has the bit, unless the worker was also demoted
    // again (a new entry, then its `full` bit cleared) before that load: active workers
    // found in neither are looked up in `full` again, and any still missing then that
    // are still in the node's `any` repeat the step (loom models
    // `loom_models_partial_holder_promoted_to_full`, `..._promoted_and_demoted`): the writer
    // keeps every worker of `any` in `full` or the list at every point, so the repeat
    // waits on no writer, only on one that moved the worker during the step. A worker out
    // of `any` as well is leaving the node in an event this lookup overlaps (the writer
    // takes it out of `any` first, `loom_models_holder_leaves_a_node`), and is scored as
    // after it. Rare: usually none is lost, and the check is a few word operations.
    let mut lost = active.clone();
    lost.remove_all(reach);
    for &(slot, _) in partials.iter() {
        lost.remove(slot);
    }
    if !lost.is_empty() {
        let mut found = lost.clone();
        found.and_bits(&node.full, guard);
        reach.add_all(&found);
        lost.remove_all(&found);
        lost.and_bits(&node.any, guard);
        if !lost.is_empty() {
            return None;
        }
    }
    // The child that continues the query.
    let child = if m < rest.len() {
        let t = node.children.load(Ordering::Acquire, guard);
        // SAFETY: child tables are freed through the collector after being replaced.
        unsafe { t.as_ref() }.and_then(|t| t.get(m as u32, rest[m], guard))
    } else {
        None
    };
    // The length check: after every load of the node's bits and child table (`Acquire`
    // loads, so these two come after them).
    let same = node.edge.load(Ordering::Acquire, guard) == edge_ptr;
    (same && edge.len() >= m).then_some((m, child))
}
