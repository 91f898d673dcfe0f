//! # kvrouter-io
//!
//! Everything in kvrouter that touches the outside world, over the pure `kvrouter-core`:
//!
//! * [`log`]: reading replay logs (plain or zstd-compressed JSON lines) from files or
//!   memory.
//! * [`nats`]: the NATS protocol and a client on glommio's io_uring sockets.
//! * [`ingest`]: KV-event ingest (thread per core): NATS → decode → the shard core that owns
//!   the worker → the lock-free index; gap recovery, restarts, discovery, liveness.
//! * [`worker`]: the worker-side library: `KvPublisher` and its local indexer.
//! * [`http`]: a small HTTP/1.1 server on glommio's io_uring sockets.
//! * [`snapshot`]: snapshot files (atomic writes, mmap loads, full validation).
//! * [`router`]: the routing API (cost function, slot manager, replica sync).
//!
//! **Architecture Invariant:** `io` depends on `core`, never the other way round.

pub mod http;
pub mod ingest;
pub mod log;
pub mod nats;
pub mod router;
pub mod snapshot;
pub mod worker;
