//! ZeroMQ sockets on glommio's io_uring sockets: the SUB side of a publisher (connecting to
//! it, or bound for publishers that connect to us) and the DEALER side of a replay request,
//! over the sans-io [`kvrouter_core::zmtp`] codec.
//!
//! No ZeroMQ crate runs on glommio: `zmq` binds libzmq, which runs its own I/O threads
//! beside every executor, and `zeromq` (zmq.rs) runs on tokio or async-std. A SUB and a
//! DEALER are small (the protocol work is in the codec, fuzzed), so we speak ZMTP ourselves,
//! as the NATS client does, and keep the thread-per-core shape.
//!
//! * [`Endpoint`]: `tcp://host:port` to connect to, or `tcp://*:port` / `tcp://0.0.0.0:port`
//!   to bind.
//! * [`Conn`]: one ZMTP connection: handshake (with a deadline), messages in and out, PINGs
//!   answered, and our own PINGs when the line is quiet so that a dead publisher is noticed.
//! * [`Subscriber`]: a SUB that connects (reconnecting with backoff) or binds (accepting
//!   many publishers), subscribed to everything, handing whole messages to one bounded
//!   channel: when the consumer falls behind, the channel fills, our reads stop, TCP pushes
//!   back, and the publisher drops at its high-water mark (which its sequence numbers show).
//! * [`replay`]: a DEALER that asks a publisher's replay socket for everything from a
//!   sequence number on.

mod conn;
mod dealer;
mod endpoint;
mod sub;

pub use conn::{Conn, ZmqError};
pub use dealer::{ReplayItem, replay};
pub use endpoint::Endpoint;
pub use sub::{SubEvent, SubOptions, Subscriber};
