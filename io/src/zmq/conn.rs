//! One ZMTP connection over a glommio TCP stream.

use std::time::Duration;

use futures_lite::io::{AsyncReadExt, AsyncWriteExt};
use glommio::net::TcpStream;
use kvrouter_core::zmtp::{Event, Limits, Session, SocketType, ZmtpError};

/// Why a connection failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ZmqError {
    /// The socket failed or closed.
    #[error("socket")]
    Io(#[from] std::io::Error),
    /// The peer broke the protocol (or is not a ZeroMQ peer of the right type).
    #[error("protocol")]
    Protocol(#[from] ZmtpError),
    /// The handshake, a reply or the line went quiet past its deadline.
    #[error("timed out ({0})")]
    Timeout(&'static str),
    /// The peer closed the connection.
    #[error("closed by the peer")]
    Closed,
    /// A replay reply of the wrong shape.
    #[error("malformed {0}")]
    BadReply(&'static str),
}

/// A ZMTP connection after its handshake.
#[derive(Debug)]
pub struct Conn {
    stream: TcpStream,
    session: Session,
    buf: Vec<u8>,
    peer: SocketType,
    /// PING when nothing arrived for this long; give up after three such periods.
    heartbeat: Option<Duration>,
}

impl Conn {
    /// Runs the handshake as a socket of type `ours` (within `timeout`).
    pub async fn handshake(
        stream: TcpStream,
        ours: SocketType,
        limits: Limits,
        timeout: Duration,
    ) -> Result<Conn, ZmqError> {
        let _ = stream.set_nodelay(true);
        let mut c = Conn {
            stream,
            session: Session::new(ours, limits),
            buf: vec![0u8; 64 << 10],
            peer: ours,
            heartbeat: None,
        };
        let ready = async {
            loop {
                c.flush().await?;
                match c.session.poll()? {
                    Some(Event::Ready { peer, .. }) => {
                        c.peer = peer;
                        c.flush().await?;
                        return Ok::<(), ZmqError>(());
                    }
                    Some(_) => {}
                    None => c.fill().await?,
                }
            }
        };
        with_deadline(ready, timeout, "handshake").await?;
        Ok(c)
    }

    /// The peer's socket type.
    pub fn peer(&self) -> SocketType {
        self.peer
    }

    /// PINGs the peer when nothing arrived for `every`, and fails the connection when
    /// nothing (a message, a PONG) arrived for three such periods. (The socket's own read
    /// timeout measures the quiet: a read is never abandoned half done.)
    pub fn set_heartbeat(&mut self, every: Option<Duration>) -> Result<(), ZmqError> {
        self.heartbeat = every;
        self.stream
            .set_read_timeout(every)
            .map_err(|e| ZmqError::Io(e.into()))
    }

    async fn fill(&mut self) -> Result<(), ZmqError> {
        let n = self.stream.read(&mut self.buf).await?;
        if n == 0 {
            return Err(ZmqError::Closed);
        }
        self.session.feed(&self.buf[..n]);
        Ok(())
    }

    async fn flush(&mut self) -> Result<(), ZmqError> {
        if self.session.has_output() {
            let out = self.session.take_output();
            self.stream.write_all(&out).await?;
            self.stream.flush().await?;
        }
        Ok(())
    }

    /// Sends a message.
    pub async fn send<B: AsRef<[u8]>>(&mut self, frames: &[B]) -> Result<(), ZmqError> {
        self.session.send(frames);
        self.flush().await
    }

    /// Subscribes to `prefix` (a SUB's).
    pub async fn subscribe(&mut self, prefix: &[u8]) -> Result<(), ZmqError> {
        self.session.subscribe(prefix);
        self.flush().await
    }

    /// The next message (PINGs answered, PONGs and subscriptions consumed on the way).
    pub async fn recv(&mut self) -> Result<Vec<Vec<u8>>, ZmqError> {
        let mut quiet = 0u32;
        loop {
            match self.session.poll()? {
                Some(Event::Message(frames)) => {
                    self.flush().await?;
                    return Ok(frames);
                }
                Some(_) => {
                    quiet = 0;
                    continue;
                }
                None => {}
            }
            self.flush().await?;
            match self.fill().await {
                Ok(()) => quiet = 0,
                Err(ZmqError::Io(e))
                    if self.heartbeat.is_some()
                        && matches!(
                            e.kind(),
                            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
                        ) =>
                {
                    quiet += 1;
                    if quiet >= 3 {
                        return Err(ZmqError::Timeout("no traffic and no PONG"));
                    }
                    self.session.ping(b"kvr");
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// [`Self::recv`] within `timeout`.
    pub async fn recv_timeout(&mut self, timeout: Duration) -> Result<Vec<Vec<u8>>, ZmqError> {
        with_deadline(self.recv(), timeout, "reply").await
    }
}

async fn with_deadline<T>(
    f: impl std::future::Future<Output = Result<T, ZmqError>>,
    timeout: Duration,
    what: &'static str,
) -> Result<T, ZmqError> {
    let timer = async {
        glommio::timer::sleep(timeout).await;
        Err(ZmqError::Timeout(what))
    };
    futures_lite::future::or(f, timer).await
}
