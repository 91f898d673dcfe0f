//! Replay requests: a DEALER asks a publisher's replay ROUTER for every buffered batch from
//! a sequence number on.
//!
//! The request is two frames, `["", start_seq as 8 bytes big-endian]` (the ROUTER sees the
//! DEALER's identity before them). Each buffered batch comes back as `["", seq, payload]`
//! (SGLang, vLLM before 0.26) or `["", topic, seq, payload]` (vLLM 0.26 on); the frame count
//! tells them apart. The end is a batch whose seq is -1 (eight `FF` bytes) with an empty
//! payload. A publisher that no longer holds `start_seq` answers from the oldest it has, so
//! the caller compares the first seq with what it asked for.

use std::time::Duration;

use glommio::net::TcpStream;
use kvrouter_core::zmtp::{Limits, SocketType};

use super::conn::{Conn, ZmqError};
use super::endpoint::Endpoint;

/// One replayed batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayItem {
    /// Its sequence number.
    pub seq: u64,
    /// Its payload (an `EventBatch`).
    pub payload: Vec<u8>,
}

/// The end-of-replay sequence frame (-1).
const END: [u8; 8] = [0xFF; 8];

/// Asks `endpoint` for everything from `start_seq` on; each reply must arrive within
/// `timeout`. At most `max_items` batches are taken (a publisher keeps 10,000).
pub async fn replay(
    endpoint: &Endpoint,
    start_seq: u64,
    limits: Limits,
    timeout: Duration,
    max_items: usize,
) -> Result<Vec<ReplayItem>, ZmqError> {
    let addr = endpoint.socket_addr()?;
    let stream = TcpStream::connect_timeout(addr, timeout)
        .await
        .map_err(std::io::Error::from)?;
    let mut conn = Conn::handshake(stream, SocketType::Dealer, limits, timeout).await?;
    conn.send(&[&b""[..], &start_seq.to_be_bytes()]).await?;
    let mut out = Vec::new();
    loop {
        let frames = conn.recv_timeout(timeout).await?;
        let (seq, payload) = match frames.as_slice() {
            [delim, seq, payload] if delim.is_empty() => (seq, payload),
            [delim, _topic, seq, payload] if delim.is_empty() => (seq, payload),
            _ => return Err(ZmqError::BadReply("replay reply")),
        };
        if seq.as_slice() == END {
            return Ok(out);
        }
        let seq: [u8; 8] = seq
            .as_slice()
            .try_into()
            .map_err(|_| ZmqError::BadReply("replay sequence number"))?;
        if out.len() < max_items {
            out.push(ReplayItem {
                seq: u64::from_be_bytes(seq),
                payload: payload.clone(),
            });
        }
    }
}
