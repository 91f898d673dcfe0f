//! Lock-free lookups: `find_matches` over one shard tree, under an epoch guard, without
//! locks and without waiting for the writer.
//!
//! The walk keeps the set of workers still matching as a bitset. At each node it compares
//! the query with the published edge (eight hashes at a time), looks up the child that
//! continues the query, and keeps the workers that hold the node up to the divergence point
//! *and* hold the child; every worker that drops out is scored once. The cost is O(depth)
//! word operations plus one entry per worker that drops out, and the walk stops as soon as
//! no worker can match further.

use crossbeam_epoch::Guard;
use smallvec::SmallVec;

use super::raw::bits::for_each_set;
use super::raw::node::Node;
use super::writer::{ShardShared, SlotTable};
use crate::index::OverlapScores;
use crate::sync::Ordering;

type Words = SmallVec<[u64; 4]>;

/// Scores every worker of `shard` for `query` (local hashes as `u64`), pushing positive
/// scores into `out` (not finished).
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
    let mut active: Words = smallvec::smallvec![0; nwords];
    shard.root.any.or_into(&mut active, guard);

    let root_children = shard.root.children.load(Ordering::Acquire, guard);
    // SAFETY: child tables are freed through the collector after being replaced.
    let Some(mut node) =
        (unsafe { root_children.as_ref() }).and_then(|t| t.get(0, query[0], guard))
    else {
        return;
    };
    node.any.and_into(&mut active, guard);
    let mut depth = 0usize;
    let mut reach: Words = smallvec::smallvec![0; nwords];
    let mut keep: Words = smallvec::smallvec![0; nwords];
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
        reach.copy_from_slice(&active);
        node.full.and_into(&mut reach, guard);
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
        keep.copy_from_slice(&reach);
        match child {
            Some(c) => c.any.and_into(&mut keep, guard),
            None => keep.iter_mut().for_each(|w| *w = 0),
        }
        // Score the workers that stop here.
        for (a, k) in active.iter_mut().zip(keep.iter()) {
            *a &= !k;
        }
        let full_words = &reach;
        for_each_set(&active, |slot| {
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
            out.push(slots.get(slot), (depth + held) as u32);
        });
        let Some(c) = child else { return };
        std::mem::swap(&mut active, &mut keep);
        depth += m;
        node = c;
    }
}
