//! The lock-free primitives of the shard tree: bitsets, edge buffers, child tables, partial
//! holder lists and the node that ties them together; edge buffers, child tables and
//! partial lists are each one allocation ([`tail`]: a capacity written once, before the
//! pointer is published, then a header and the items). Each module states its invariants
//! and what a concurrent reader may observe; `writer.rs` and `reader.rs` use them only
//! through those rules.

pub(crate) mod bits;
pub(crate) mod children;
pub(crate) mod edge;
pub(crate) mod node;
pub(crate) mod partial;
pub(crate) mod tail;
