//! The reader-visible node of a shard tree.
//!
//! A node is a compressed path: `edge` holds the local hashes of consecutive blocks.
//! Children hang at any position `1..=len` of the edge (`attach`), keyed by
//! `(attach, first local hash)`, so blocks never move between nodes once stored: a branch
//! in the middle of an edge is a child attached there, not a split. Every worker that holds
//! any block of the node holds a prefix `[0, cutoff)` of its edge (prefix closure): the
//! workers whose cutoff is the whole published length are in `full`, the others are in
//! `partial`, all of them are in `any` (a worker leaving the node leaves `any` first, so
//! for a moment it is in `full` or `partial` only; never the other way round).
//!
//! `attach`, `first` and `id` never change. Everything else is written only by the shard's
//! writer and read under an epoch guard; each field's module documents its protocol.

use crossbeam_epoch::{Atomic, Guard};

use super::bits::AtomicBits;
use super::children::ChildTable;
use super::edge::Edge;
use super::partial::Partials;
use crate::sync::Ordering;

/// See the [module docs](self).
#[derive(Debug)]
pub(crate) struct Node {
    /// Position in the parent's edge this node hangs at (0 for children of the root).
    pub(crate) attach: u32,
    /// Local hash of the first block (the child-table key with `attach`).
    pub(crate) first: u64,
    /// The writer's id for this node.
    pub(crate) id: u32,
    /// The compressed path.
    pub(crate) edge: Atomic<Edge>,
    /// Workers holding the whole published edge.
    pub(crate) full: AtomicBits,
    /// Workers holding at least the first block.
    pub(crate) any: AtomicBits,
    /// Workers holding a shorter prefix, with their cutoffs.
    pub(crate) partial: Atomic<Partials>,
    /// Children, or null.
    pub(crate) children: Atomic<ChildTable>,
}

// 72 bytes: what the memory accounting and the bytes-per-block figures count per node
// (loom's atomics are larger).
#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<Node>() == 72);

impl Node {
    /// A node holding `blocks` (at least one) in an edge of capacity `cap`, with no holders
    /// yet.
    pub(crate) fn new(attach: u32, id: u32, blocks: &[u64], cap: usize) -> Self {
        Self {
            attach,
            first: blocks.first().copied().unwrap_or(0),
            id,
            edge: Atomic::from(Edge::with_blocks(blocks, cap)),
            full: AtomicBits::new(),
            any: AtomicBits::new(),
            partial: Atomic::null(),
            children: Atomic::null(),
        }
    }

    /// Heap bytes this node owns (excluding children), for memory accounting.
    pub(crate) fn heap_bytes(&self, guard: &Guard) -> usize {
        let mut n = std::mem::size_of::<Node>() + 16;
        // SAFETY: the fields are published by the writer and freed only through the
        // collector after being replaced, so they outlive `guard`.
        unsafe {
            if let Some(e) = self.edge.load(Ordering::Acquire, guard).as_ref() {
                n += Edge::bytes(e.cap()) + 16;
            }
            if let Some(p) = self.partial.load(Ordering::Acquire, guard).as_ref() {
                n += Partials::bytes(p.cap()) + 16;
            }
            if let Some(c) = self.children.load(Ordering::Acquire, guard).as_ref() {
                n += ChildTable::bytes(c.cap()) + 16;
            }
        }
        n + self.full.heap_bytes(guard) + self.any.heap_bytes(guard)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // SAFETY: `&mut self`: the node is unreachable (retired and past its grace period, or
        // never shared), so nobody else can load these pointers; each was created by
        // `Owned::new` or `Owned::init` (raw::tail) and is dropped once here.
        unsafe {
            let g = crossbeam_epoch::unprotected();
            for p in [self.edge.load(Ordering::Relaxed, g)] {
                if !p.is_null() {
                    drop(p.into_owned());
                }
            }
            let p = self.partial.load(Ordering::Relaxed, g);
            if !p.is_null() {
                drop(p.into_owned());
            }
            let c = self.children.load(Ordering::Relaxed, g);
            if !c.is_null() {
                drop(c.into_owned());
            }
        }
    }
}
