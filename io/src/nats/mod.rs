//! NATS for kvrouter: the sans-io protocol ([`proto`], which lives in the core as
//! `kvrouter_core::nats`, where it is fuzzed without the I/O stack) and a client on
//! glommio's io_uring sockets ([`client`]). No existing crate serves glommio, so the client
//! is ours; it speaks the core protocol (INFO, CONNECT, PUB/HPUB, SUB/UNSUB, MSG/HMSG,
//! PING/PONG, +OK/-ERR) with token and user/password authentication, request/reply through
//! an inbox, `max_payload`, credentials in server URLs (never logged), pipelined writes with backpressure, and reconnects with
//! re-subscription; [`jetstream`] adds the JetStream calls of the durable mode.

pub mod client;
mod error;
pub mod jetstream;
mod options;
pub use kvrouter_core::nats as proto;

pub use client::{Client, ReplyStream, Stats, Subscription};
pub use error::{IoError, NatsError};
pub use options::{Options, ServerUrl, redact};
pub use proto::{Msg, ServerInfo};
