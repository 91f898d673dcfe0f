//! Lock-free lookups: `find_matches` over one shard tree, under an epoch guard, without
//! locks and without waiting for the writer.
//!
//! The walk keeps the set of workers still matching as a bitset. At each node it compares
//! the query with the published edge (eight hashes at a time), looks up the child that
//! continues the query, and keeps the workers that hold the node up to the divergence point
//! *and* hold the child; every worker that drops out is scored once. The cost is O(depth)
//! word operations plus one entry per worker that drops out, and the walk stops as soon as
//! no worker can match further. Scores are kept per slot and emitted in the shard's
//! [`SlotOrder`], so each shard's answer comes out sorted by worker without a sort.

use crossbeam_epoch::Guard;
use smallvec::SmallVec;

use super::raw::bits::for_each_set;
use super::raw::node::Node;
use super::writer::{ShardShared, SlotOrder, SlotTable};
use crate::index::OverlapScores;
use crate::sync::Ordering;

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
    let slots_ptr = shard.slots.load(Ordering::Acquire, guard);
    // SAFETY: the slot table is replaced only by the writer and freed through the collector,
    // so it outlives `guard`.
    let slots: &SlotTable = unsafe { slots_ptr.deref() };
    let nwords = slots.cap().div_ceil(64).max(1);
    let mut active: Words = zeros(nwords);
    // Bits beyond this table's capacity are left out: they belong to slots added after the
    // table was loaded, which this lookup does not score.
    shard.root.any.or_into(&mut active, guard);
    // Loaded after the root's `any`: holds every slot set there (see `SlotOrder`).
    let order_ptr = shard.order.load(Ordering::Acquire, guard);
    // SAFETY: replaced only by the writer and freed through the collector.
    let order: &SlotOrder = unsafe { order_ptr.deref() };
    // Scores by slot: on the stack for up to 64 slots (one bitset word).
    let mut small = [0u32; 64];
    let mut big: Vec<u32>;
    let scores: &mut [u32] = if nwords == 1 {
        &mut small
    } else {
        big = vec![0; nwords * 64];
        &mut big
    };
    walk(shard, query, &mut active, scores, guard);
    for &slot in order.0.iter() {
        match scores.get(slot as usize) {
            Some(&score) if score > 0 => out.push(slots.get(slot), score),
            _ => {}
        }
    }
}

/// The walk: writes each worker's score into `scores[slot]`.
fn walk(shard: &ShardShared, query: &[u64], active: &mut [u64], scores: &mut [u32], guard: &Guard) {
    let nwords = active.len();
    let root_children = shard.root.children.load(Ordering::Acquire, guard);
    // SAFETY: child tables are freed through the collector after being replaced.
    let Some(mut node) =
        (unsafe { root_children.as_ref() }).and_then(|t| t.get(0, query[0], guard))
    else {
        return;
    };
    node.any.and_into(active, guard);
    let mut depth = 0usize;
    // Plain slices over the buffers (one inline-or-heap check each, not one per access);
    // `active` and `keep` swap roles at every level.
    let (mut reach_buf, mut keep_buf) = (zeros(nwords), zeros(nwords));
    let reach: &mut [u64] = &mut reach_buf;
    let mut keep: &mut [u64] = &mut keep_buf;
    let mut active: &mut [u64] = active;
    let mut partials: SmallVec<[(u32, u32); 8]> = SmallVec::new();
    loop {
        if active.iter().all(|&w| w == 0) {
            return;
        }
        let edge_ptr = node.edge.load(Ordering::Acquire, guard);
        // SAFETY: edge buffers are freed through the collector after being replaced.
        let edge = unsafe { edge_ptr.deref() };
        let len = edge.len();
        let rest = &query[depth..];
        // SAFETY: indices below a length loaded from this buffer are read-only (raw::edge).
        let m = unsafe { edge.common_prefix(len, rest) };

        // Workers holding the node up to the divergence point `m`.
        reach.copy_from_slice(active);
        node.full.and_into(reach, guard);
        partials.clear();
        let pl = node.partial.load(Ordering::Acquire, guard);
        // SAFETY: partial lists are freed through the collector after being replaced.
        if let Some(p) = unsafe { pl.as_ref() } {
            p.for_each(|slot, cutoff| partials.push((slot, cutoff)));
        }
        for &(slot, cutoff) in &partials {
            let (w, b) = ((slot / 64) as usize, 1u64 << (slot % 64));
            if w < nwords && cutoff as usize >= m && active[w] & b != 0 {
                reach[w] |= b;
            }
        }
        // The child that continues the query, and who holds it.
        let child: Option<&Node> = if m < rest.len() {
            let t = node.children.load(Ordering::Acquire, guard);
            // SAFETY: as for the root's table.
            unsafe { t.as_ref() }.and_then(|t| t.get(m as u32, rest[m], guard))
        } else {
            None
        };
        keep.copy_from_slice(reach);
        match child {
            Some(c) => c.any.and_into(keep, guard),
            None => keep.iter_mut().for_each(|w| *w = 0),
        }
        // Score the workers that stop here.
        for (a, k) in active.iter_mut().zip(keep.iter()) {
            *a &= !k;
        }
        let full_words = &*reach;
        for_each_set(active, |slot| {
            let (w, b) = ((slot / 64) as usize, 1u64 << (slot % 64));
            let held = if full_words[w] & b != 0 {
                m
            } else {
                partials
                    .iter()
                    .filter(|&&(s, _)| s == slot)
                    .map(|&(_, c)| (c as usize).min(m))
                    .max()
                    .unwrap_or(0)
            };
            scores[slot as usize] = (depth + held) as u32;
        });
        let Some(c) = child else { return };
        std::mem::swap(&mut active, &mut keep);
        depth += m;
        node = c;
    }
}
