//! Why a NATS operation failed.

use std::sync::Arc;

use super::proto::ProtoError;

/// Why a NATS operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NatsError {
    /// A socket error (the operating system's error is the source).
    #[error("i/o error")]
    Io(#[source] IoError),
    /// The connection ended: closed by the server, during the handshake, or dropped.
    #[error("connection {0}")]
    Disconnected(&'static str),
    /// A value that could not be encoded into a message.
    #[error("cannot encode {what}")]
    Encode {
        /// What it was.
        what: &'static str,
        /// Why.
        reason: String,
    },
    /// The server sent bytes we cannot parse.
    #[error("protocol: {0}")]
    Proto(#[from] ProtoError),
    /// The server reported an error (`-ERR`), e.g. an authorization violation.
    #[error("server error: {0}")]
    Server(String),
    /// A payload larger than the server accepts.
    #[error("payload of {size} bytes exceeds the server's max_payload of {max}")]
    PayloadTooLarge {
        /// The payload size.
        size: usize,
        /// The server's limit.
        max: usize,
    },
    /// An invalid subject.
    #[error("invalid subject {0:?}")]
    InvalidSubject(String),
    /// No reply in time.
    #[error("timed out")]
    Timeout,
    /// A request that nobody is subscribed to answer.
    #[error("no responders")]
    NoResponders,
    /// The connection is not (yet, or any more) established.
    #[error("not connected")]
    NotConnected,
    /// The client was closed.
    #[error("client closed")]
    Closed,
    /// A malformed server URL.
    #[error("bad url {0:?}")]
    BadUrl(String),
}

impl From<std::io::Error> for NatsError {
    fn from(e: std::io::Error) -> Self {
        NatsError::Io(IoError(Arc::new(e)))
    }
}

/// An operating-system error that can be cloned (errors fan out to every waiter of a
/// connection) and compared (by kind).
#[derive(Debug, Clone)]
pub struct IoError(Arc<std::io::Error>);

impl IoError {
    /// The error's kind.
    pub fn kind(&self) -> std::io::ErrorKind {
        self.0.kind()
    }

    /// The error itself.
    pub fn get_ref(&self) -> &std::io::Error {
        &self.0
    }
}

impl std::fmt::Display for IoError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for IoError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

impl PartialEq for IoError {
    fn eq(&self, other: &Self) -> bool {
        self.kind() == other.kind()
    }
}

impl Eq for IoError {}
