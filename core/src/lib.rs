//! # kvrouter-core
//!
//! The pure core of kvrouter, a KV-cache-aware request router for LLM inference fleets:
//!
//! * [`worker`] and [`hash`]: who holds a block, and how blocks are named; hashing is
//!   byte-identical with NVIDIA Dynamo 1.6.1.
//! * [`event`]: the KV events workers publish (stored, removed, cleared).
//! * [`codec`]: Dynamo 1.6.1's event-plane wire formats (MessagePack envelope, kv-events,
//!   replica sync, metrics) and its JSON form of KV events; kvrouter's own session-binding
//!   messages.
//! * [`nats`]: the NATS client protocol, sans I/O (an incremental parser of what the server
//!   sends, encoders of what a client sends); `kvrouter-io`'s client drives it over sockets.
//! * [`zmtp`]: the ZeroMQ wire protocol (ZMTP 3.x, NULL mechanism), sans I/O, for the ZMQ
//!   event planes.
//! * [`index`]: the `Index` trait, the semantics every index obeys, and the reference
//!   index that is the oracle for the fast ones.
//! * [`policy`]: the cost of sending a request to each worker, and the choice (Dynamo's
//!   formula, temperature sampling, a herd-resistant option).
//! * [`slots`]: the slot manager, the router's prediction of each worker's load.
//! * [`decision`]: the routing decision (lookup, loads, cost, choice, slot add) that every
//!   front calls: the routing API, the harness, the proxy.
//! * [`sessions`]: session affinity's bindings, and how replicas agree on one per session.
//! * [`recovery`]: event-id bookkeeping (gaps, duplicates, restarts), the recovery protocol
//!   between the router and workers' local indexers, and worker announcements.
//! * [`snapshot`]: the snapshot file format (index state, last event ids, JetStream
//!   position), fully validated before anything in it is trusted.
//! * [`replay`]: replay logs of index operations with expected answers (the conformance
//!   corpus and the benchmark input).
//!
//! **Architecture Invariant:** this crate does no I/O, starts no threads of its own, uses
//! no async runtime and reads no clock: time is always an argument. It therefore runs
//! unchanged under loom, proptest, cargo-fuzz and miri. Sockets, files and executors live in
//! `kvrouter-io`.

pub mod chain;
pub mod codec;
pub mod decision;
pub mod engine;
pub mod event;
pub mod hash;
pub mod index;
pub mod nats;
pub mod policy;
pub mod prefetch;
pub mod prefill;
pub mod recovery;
pub mod replay;
pub mod returns;
pub mod sessions;
pub mod slots;
pub mod snapshot;
mod sync;
pub mod worker;
pub mod zmtp;

pub use event::{KvCacheEvent, KvEventData, RouterEvent, StoredBlock};
pub use hash::{LocalBlockHash, SequenceBlockHash};
pub use index::{ApplyError, ApplyOutcome, Index, OverlapScores, ReferenceIndex, TreeIndex};
pub use worker::{DpRank, StorageTier, WorkerDp, WorkerId};
