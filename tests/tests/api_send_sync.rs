//! The thread-safety claims of the public types, pinned at compile time (tokio's
//! `async_send_sync.rs`): a change that makes `ShardWriter` `Sync` (two writers on one
//! shard) or the NATS client `Send` (its state leaving its executor) stops this file from
//! compiling.

use kvrouter_core::decision::Decider;
use kvrouter_core::index::tree::{ShardMap, ShardWriter, TreeIndex, TreeReader};
use kvrouter_core::index::{ApproxIndex, ReferenceIndex};
use kvrouter_core::slots::Slots;
use kvrouter_io::ingest::{Ingest, IngestView};
use kvrouter_io::nats::{Client, Subscription};
use kvrouter_io::router::RouterHandle;

fn send<T: Send>() {}
fn send_sync<T: Send + Sync>() {}

/// Compiles only if `$t` does not implement `$trait` (two blanket impls make the call
/// ambiguous exactly when it does).
macro_rules! assert_not_impl {
    ($t:ty, $trait:path) => {
        const _: fn() = || {
            trait Ambiguous<A> {
                fn some_item() {}
            }
            impl<T: ?Sized> Ambiguous<()> for T {}
            #[allow(dead_code)]
            struct Invalid;
            impl<T: ?Sized + $trait> Ambiguous<Invalid> for T {}
            let _ = <$t as Ambiguous<_>>::some_item;
        };
    };
}

// One writer per shard: it moves to its core, and is never shared.
assert_not_impl!(ShardWriter, Sync);
// The client's state lives on its executor (`Rc`, `RefCell`): it never leaves it.
assert_not_impl!(Client, Send);
assert_not_impl!(Client, Sync);
assert_not_impl!(Subscription, Send);

#[test]
fn thread_safety_claims() {
    send::<ShardWriter>();
    // Lookups from any thread; the map is asked by every source.
    send_sync::<TreeReader>();
    send_sync::<ShardMap>();
    send::<TreeIndex>();
    send_sync::<ReferenceIndex>();
    // The decision's state moves to the API executor with it.
    send::<Decider>();
    send_sync::<Slots>();
    send_sync::<ApproxIndex>();
    // What the ingest shares with other executors, and the handles that stop services.
    send_sync::<IngestView>();
    send::<Ingest>();
    send::<RouterHandle>();
}
