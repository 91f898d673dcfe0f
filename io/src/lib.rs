//! # kvrouter-io
//!
//! Everything in kvrouter that touches the outside world, over the pure `kvrouter-core`:
//!
//! * [`log`]: reading replay logs (plain or zstd-compressed JSON lines) from files or
//!   memory.
//! * [`nats`]: the NATS protocol and a client on glommio's io_uring sockets.
//!
//! **Architecture Invariant:** `io` depends on `core`, never the other way round.

pub mod log;
pub mod nats;
