//! # kvrouter-io
//!
//! Everything in kvrouter that touches the outside world, over the pure `kvrouter-core`:
//!
//! * [`log`]: reading replay logs (plain or zstd-compressed JSON lines) from files or
//!   memory.
//! * [`nats`]: the NATS protocol and a client on glommio's io_uring sockets.
//! * [`ingest`]: KV-event ingest (thread per core): NATS → decode → the shard core that owns
//!   the worker → the lock-free index; gap recovery, restarts, discovery, liveness.
//! * [`zmq`]: ZeroMQ SUB and DEALER sockets on glommio (our own ZMTP, no libzmq).
//! * [`worker`]: the worker-side library: `KvPublisher` and its local indexer.
//! * [`http`]: a small HTTP/1.1 server on glommio's io_uring sockets.
//! * [`snapshot`]: snapshot files (atomic writes, mmap loads, full validation).
//! * [`router`]: the routing API (every decision is `kvrouter_core::decision`'s; endpoints,
//!   input parsing, metrics, replica sync).
//! * [`proxy`]: the OpenAI-compatible front (tokenisation, upstream engines, streaming,
//!   session affinity), on the routing API's executor and state.
//! * `routing` (crate-private): what a front asks of the routing state, the seam that lets
//!   `router` start `proxy` without `proxy` importing `router`.
//! * `threads` (crate-private): background threads give way to the executors
//!   (`SCHED_IDLE`).
//! * [`throttle`]: rate-limited warnings.
//!
//! **Architecture Invariant:** `io` depends on `core`, never the other way round.

pub mod http;
pub mod ingest;
pub mod log;
pub mod nats;
pub mod proxy;
pub mod router;
mod routing;
pub mod snapshot;
mod threads;
pub mod throttle;
pub mod worker;
pub mod zmq;

/// Displays an error with its whole chain of sources (`outer: inner: innermost`), for log
/// lines: the error types here keep each cause as a `source`, not in their own message.
#[derive(Debug, Clone, Copy)]
pub struct Chain<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut cause = self.0.source();
        while let Some(e) = cause {
            write!(f, ": {e}")?;
            cause = e.source();
        }
        Ok(())
    }
}
