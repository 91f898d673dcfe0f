//! Batched reclamation: the writer retires unlinked objects into a batch, hands each batch
//! to the epoch collector as one deferred function, and that function only *sends the batch
//! back* to the writer over a channel. The writer frees the batches it receives at the start
//! of its next operation.
//!
//! Why not `defer_destroy` each object: crossbeam-epoch runs deferred functions on whichever
//! thread happens to pin when a collection is due — often a reader — so readers would pay
//! for `free()` calls of the writer's garbage in their latency tail. With this scheme a
//! reader's share of the work is one channel send per batch, and the frees happen on the
//! writer's core.
//!
//! Safety argument: a batch is sent only from a deferred function, so it runs after every
//! guard that was pinned when the objects were unlinked has been dropped; no reader can
//! reach the objects any more, and freeing them later, on any thread, is safe. If the
//! writer is gone (the receiver dropped), the send fails and the batch is freed in place.

use std::sync::mpsc::{Receiver, Sender, channel};

use crossbeam_epoch::{Guard, Pointer, Shared};

use super::raw::children::ChildTable;
use super::raw::edge::Edge;
use super::raw::node::Node;
use super::raw::partial::Partials;

/// An object unlinked from the tree, waiting for its grace period.
#[derive(Debug)]
pub(crate) enum Retired {
    Node(*const Node),
    /// An edge, as crossbeam's `Pointer::into_usize` gives it (edges are unsized).
    Edge(usize),
    /// A child table, as `Pointer::into_usize` gives it (tables are unsized too).
    Children(usize),
    /// A partial list, as `Pointer::into_usize` gives it (lists are unsized too).
    Partials(usize),
}

/// A batch of retired objects; dropping it frees them.
#[derive(Debug)]
struct Garbage(Vec<Retired>);

// SAFETY: the batch exclusively owns objects that no thread can reach any more (see the
// module docs), so moving it to another thread cannot create shared access.
unsafe impl Send for Garbage {}

impl Drop for Garbage {
    fn drop(&mut self) {
        for r in self.0.drain(..) {
            // SAFETY: every pointer came from `Owned::new` or `Owned::init` (crossbeam's owned
            // pointers; `init` for the unsized edges, tables and lists, raw::tail), was unlinked
            // before being retired, is retired once, and its grace period has passed.
            unsafe {
                match r {
                    Retired::Node(p) => drop(Shared::from(p).into_owned()),
                    Retired::Edge(p) => drop(Shared::<Edge>::from_usize(p).into_owned()),
                    Retired::Children(p) => drop(Shared::<ChildTable>::from_usize(p).into_owned()),
                    Retired::Partials(p) => drop(Shared::<Partials>::from_usize(p).into_owned()),
                }
            }
        }
    }
}

/// See the [module docs](self).
#[derive(Debug)]
pub(crate) struct Reclaimer {
    pending: Vec<Retired>,
    tx: Sender<Garbage>,
    rx: Receiver<Garbage>,
}

impl Reclaimer {
    pub(crate) fn new() -> Self {
        let (tx, rx) = channel();
        Self {
            pending: Vec::new(),
            tx,
            rx,
        }
    }

    /// Queues an unlinked object.
    #[inline]
    pub(crate) fn retire(&mut self, r: Retired) {
        self.pending.push(r);
    }

    /// Hands the queued objects to the collector as one batch.
    pub(crate) fn flush(&mut self, guard: &Guard) {
        if self.pending.is_empty() {
            return;
        }
        let batch = Garbage(std::mem::take(&mut self.pending));
        let tx = self.tx.clone();
        guard.defer(move || {
            // On failure the batch comes back in the error and is freed right here.
            let _ = tx.send(batch);
        });
    }

    /// Frees every batch whose grace period has passed.
    pub(crate) fn collect(&mut self) {
        while let Ok(batch) = self.rx.try_recv() {
            drop(batch);
        }
    }
}

impl Drop for Reclaimer {
    fn drop(&mut self) {
        self.collect();
        self.flush(&crossbeam_epoch::pin());
    }
}
