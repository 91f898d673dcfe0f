//! The proxy's HTTP/1.1 client: hyper's client connections on glommio sockets, a
//! keep-alive pool per engine address, and the deadlines of one exchange (connect, first
//! byte). Each connection is driven by a task of its own; a request holds its connection
//! for the whole response, so streams never block one another, and the connection goes
//! back to the pool only when its response was read to the end. Dropping a [`Conn`]
//! cancels its task, which closes the socket: that is how a client's disconnect cancels
//! the engine's work.

use std::cell::RefCell;
use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper::{Request, Response};

use super::rt::Io;

/// Where an engine's OpenAI API is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// Its socket address (resolved once, at start).
    pub addr: SocketAddr,
    /// The `Host` header.
    pub host: String,
    /// The path before `/v1/...` (empty, or `/prefix` without a trailing `/`).
    pub prefix: String,
}

impl Target {
    /// Parses `http://HOST:PORT[/PREFIX]` (TLS to engines is not supported) and resolves it.
    pub fn parse(url: &str) -> Result<Self, String> {
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| format!("{url:?}: an engine URL starts with http://"))?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        if authority.is_empty() || authority.contains('@') {
            return Err(format!("{url:?}: expected http://HOST:PORT"));
        }
        let with_port = if authority
            .rsplit_once(':')
            .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
        {
            authority.to_owned()
        } else {
            format!("{authority}:80")
        };
        let addr = with_port
            .to_socket_addrs()
            .map_err(|e| format!("{url:?}: cannot resolve: {e}"))?
            .next()
            .ok_or_else(|| format!("{url:?}: resolves to no address"))?;
        let mut prefix = path.trim_end_matches('/').to_owned();
        if let Some(p) = prefix.strip_suffix("/v1") {
            prefix = p.to_owned();
        }
        Ok(Target {
            addr,
            host: authority.to_owned(),
            prefix,
        })
    }
}

/// The client's deadlines and pool size.
#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    /// Connecting to an engine (2 s).
    pub connect_timeout: Duration,
    /// From sending a request to the response's headers (60 s: a long prefill can take
    /// that long before a non-streaming answer, or before a stream's first chunk).
    pub first_byte_timeout: Duration,
    /// Between two chunks of a response (60 s).
    pub idle_timeout: Duration,
    /// Idle keep-alive connections kept per engine (64).
    pub max_idle_per_engine: usize,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(2),
            first_byte_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(60),
            max_idle_per_engine: 64,
        }
    }
}

/// Why an exchange with an engine failed before its response's headers.
#[derive(Debug, thiserror::Error)]
pub(crate) enum UpstreamError {
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("HTTP handshake with {addr} failed: {source}")]
    Handshake {
        addr: SocketAddr,
        #[source]
        source: hyper::Error,
    },
    #[error("{addr}: {source}")]
    Exchange {
        addr: SocketAddr,
        #[source]
        source: hyper::Error,
    },
    #[error("{addr}: no response within {after:?}")]
    FirstByte { addr: SocketAddr, after: Duration },
}

impl UpstreamError {
    /// A short label for counters.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            UpstreamError::Connect { .. } => "connect",
            UpstreamError::Handshake { .. } => "handshake",
            UpstreamError::Exchange { .. } => "exchange",
            UpstreamError::FirstByte { .. } => "first_byte_timeout",
        }
    }
}

/// A connection to one engine, leased for one exchange.
pub(crate) struct Conn {
    addr: SocketAddr,
    sender: SendRequest<Full<Bytes>>,
    /// The task driving the connection; dropped, it closes the socket.
    _task: glommio::Task<()>,
}

/// Keep-alive connections by engine address.
#[derive(Default)]
pub(crate) struct Pool {
    idle: RefCell<HashMap<SocketAddr, Vec<Conn>>>,
    /// Connections opened (for `/metrics`).
    pub(crate) opened: std::cell::Cell<u64>,
    /// Exchanges that reused a pooled connection.
    pub(crate) reused: std::cell::Cell<u64>,
}

impl Pool {
    /// A pooled connection that is still open and ready, or none.
    fn take(&self, addr: SocketAddr) -> Option<Conn> {
        let mut idle = self.idle.borrow_mut();
        let list = idle.get_mut(&addr)?;
        while let Some(c) = list.pop() {
            if !c.sender.is_closed() && c.sender.is_ready() {
                return Some(c);
            }
        }
        None
    }

    /// Gives a connection whose response was read to the end back to the pool.
    pub(crate) fn put(&self, conn: Conn, max: usize) {
        if conn.sender.is_closed() {
            return;
        }
        let mut idle = self.idle.borrow_mut();
        let list = idle.entry(conn.addr).or_default();
        if list.len() < max {
            list.push(conn);
        }
    }

    async fn connect(&self, addr: SocketAddr, cfg: &UpstreamConfig) -> Result<Conn, UpstreamError> {
        let stream = glommio::net::TcpStream::connect_timeout(addr, cfg.connect_timeout)
            .await
            .map_err(|e| UpstreamError::Connect {
                addr,
                source: e.into(),
            })?;
        let _ = stream.set_nodelay(true);
        let (sender, conn) = hyper::client::conn::http1::handshake(Io::new(stream))
            .await
            .map_err(|source| UpstreamError::Handshake { addr, source })?;
        let task = glommio::spawn_local(async move {
            if let Err(e) = conn.await {
                tracing::debug!(%addr, error = %e, "engine connection ended");
            }
        });
        self.opened.set(self.opened.get() + 1);
        Ok(Conn {
            addr,
            sender,
            _task: task,
        })
    }

    /// Sends `req` to `target` and waits for its response's headers (within the first-
    /// byte deadline). A pooled connection the engine closed meanwhile is replaced by a
    /// fresh one once, without counting as the engine's failure.
    pub(crate) async fn send(
        &self,
        target: &Target,
        build: &dyn Fn() -> Request<Full<Bytes>>,
        cfg: &UpstreamConfig,
    ) -> Result<(Response<Incoming>, Conn), UpstreamError> {
        let addr = target.addr;
        let exchange = async {
            let mut pooled = self.take(addr);
            loop {
                let was_pooled = pooled.is_some();
                let mut conn = match pooled.take() {
                    Some(c) => {
                        self.reused.set(self.reused.get() + 1);
                        c
                    }
                    None => self.connect(addr, cfg).await?,
                };
                match conn.sender.send_request(build()).await {
                    Ok(resp) => return Ok((resp, conn)),
                    // A keep-alive connection the engine closed before our request: once
                    // more, on a fresh connection.
                    Err(e)
                        if was_pooled
                            && (e.is_canceled() || e.is_closed() || e.is_incomplete_message()) =>
                    {
                        continue;
                    }
                    Err(source) => return Err(UpstreamError::Exchange { addr, source }),
                }
            }
        };
        let deadline = async {
            glommio::timer::sleep(cfg.first_byte_timeout).await;
            Err(UpstreamError::FirstByte {
                addr,
                after: cfg.first_byte_timeout,
            })
        };
        futures_lite::future::or(exchange, deadline).await
    }
}
