//! The connection's life: connect and handshake, the reader/writer pair of one
//! connection, the server's operations, keepalive, and re-establishing a lost connection.

use futures_lite::future;
use futures_lite::io::{AsyncReadExt, AsyncWriteExt};
use glommio::net::TcpStream;

use super::super::error::NatsError;
use super::super::options::ServerUrl;
use super::super::proto::{ConnectInfo, Parser, ServerOp, encode};
use super::{Client, InFlight, Ping};

impl Client {
    /// Connects to the first server that accepts us and completes the handshake.
    pub(super) async fn establish(&self) -> Result<TcpStream, NatsError> {
        let opts = &self.0.opts;
        let mut delay = opts.reconnect_base;
        let mut failures = 0u32;
        loop {
            if self.0.state.borrow().closed {
                return Err(NatsError::Closed);
            }
            let mut last = NatsError::NotConnected;
            for server in &opts.servers {
                match self.handshake(&ServerUrl::parse(server)?).await {
                    Ok(stream) => return Ok(stream),
                    Err(e @ NatsError::Server(_)) => {
                        // Authentication failures do not heal by retrying fast.
                        self.0.state.borrow_mut().last_error = Some(e.clone());
                        if !self.0.state.borrow().ever_connected {
                            return Err(e);
                        }
                        last = e;
                    }
                    Err(e) => last = e,
                }
            }
            failures += 1;
            if opts.max_reconnects.is_some_and(|m| failures >= m) {
                return Err(last);
            }
            glommio::timer::sleep(delay).await;
            delay = (delay * 2).min(opts.reconnect_max);
        }
    }

    /// TCP connect, INFO, CONNECT + PING, then PONG (or -ERR).
    async fn handshake(&self, url: &ServerUrl) -> Result<TcpStream, NatsError> {
        let opts = &self.0.opts;
        let mut stream = TcpStream::connect_timeout(&url.addr, opts.connect_timeout)
            .await
            .map_err(std::io::Error::from)?;
        let _ = stream.set_nodelay(true);
        let mut parser = Parser::new(opts.max_payload);
        let mut buf = vec![0u8; 16 << 10];
        let deadline = async {
            glommio::timer::sleep(opts.connect_timeout).await;
            Err(NatsError::Timeout)
        };
        let exchange = async {
            let info = loop {
                if let Some(op) = parser.next_op()? {
                    match op {
                        ServerOp::Info(i) => break *i,
                        ServerOp::Err(e) => return Err(NatsError::Server(e)),
                        _ => continue,
                    }
                }
                let n = stream.read(&mut buf).await?;
                if n == 0 {
                    return Err(NatsError::Disconnected("closed during the handshake"));
                }
                parser.push(&buf[..n]);
            };
            let connect = ConnectInfo {
                verbose: false,
                pedantic: false,
                name: Some(opts.name.clone()),
                lang: "rust-kvrouter".into(),
                version: env!("CARGO_PKG_VERSION").into(),
                protocol: 1,
                headers: info.headers,
                no_responders: info.headers,
                // The options' credentials, else the URL's.
                auth_token: opts.token.clone().or_else(|| url.token.clone()),
                user: opts.user.clone().or_else(|| url.user.clone()),
                pass: opts.password.clone().or_else(|| url.password.clone()),
                echo: true,
            };
            let mut hello = Vec::new();
            encode::connect(&mut hello, &connect);
            encode::ping(&mut hello);
            stream.write_all(&hello).await?;
            loop {
                while let Some(op) = parser.next_op()? {
                    match op {
                        ServerOp::Pong => return Ok(info),
                        ServerOp::Err(e) => return Err(NatsError::Server(e)),
                        ServerOp::Ping => stream.write_all(b"PONG\r\n").await?,
                        _ => {}
                    }
                }
                let n = stream.read(&mut buf).await?;
                if n == 0 {
                    return Err(NatsError::Disconnected("closed during the handshake"));
                }
                parser.push(&buf[..n]);
            }
        };
        let info = future::or(exchange, deadline).await?;
        {
            let mut s = self.0.state.borrow_mut();
            s.info = Some(info);
            // Re-subscribe everything, ahead of anything published while we were away.
            let mut head = Vec::new();
            for (sid, sub) in &s.subs {
                encode::subscribe(&mut head, &sub.subject, sub.queue.as_deref(), *sid);
            }
            head.append(&mut s.out);
            s.out = head;
            if s.ever_connected {
                s.stats.reconnects += 1;
            }
            s.ever_connected = true;
            s.connected = true;
            s.pings_outstanding = 0;
        }
        let _ = self.0.drained.try_send(());
        let _ = self.0.wake_writer.try_send(());
        Ok(stream)
    }

    /// The connection loop: serve a connection until it fails, then re-establish it.
    pub(super) async fn run(self, mut first: Option<TcpStream>) {
        loop {
            let stream = match first.take() {
                Some(s) => s,
                None => match self.establish().await {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::error!(error = %e, "nats: giving up reconnecting");
                        self.shutdown(e);
                        return;
                    }
                },
            };
            while self.0.kill_rx.try_recv().is_ok() {}
            if self.0.state.borrow().closed {
                // Closed during the handshake: its `kill` was drained just above.
                self.0.state.borrow_mut().connected = false;
                return;
            }
            let err = self.serve(stream).await;
            {
                let mut s = self.0.state.borrow_mut();
                s.connected = false;
                s.last_error = Some(err.clone());
                // The PINGs still in `out` go out again on the next connection, whose
                // PONGs for them nobody waits for any more.
                s.stale_pongs = s.pings_in_out;
                s.pings_outstanding = 0;
                for p in s.pings.drain(..) {
                    if let Ping::Flush(w) = p {
                        let _ = w.try_send(Err(NatsError::NotConnected));
                    }
                }
                if s.closed {
                    return;
                }
            }
            crate::warn_throttled!(error = %err, "nats: connection lost, reconnecting");
        }
    }

    pub(super) fn shutdown(&self, err: NatsError) {
        let mut s = self.0.state.borrow_mut();
        s.closed = true;
        s.connected = false;
        s.last_error = Some(err);
        s.subs.clear();
        s.requests.clear();
        for p in s.pings.drain(..) {
            if let Ping::Flush(w) = p {
                let _ = w.try_send(Err(NatsError::Closed));
            }
        }
        drop(s);
        let _ = self.0.drained.try_send(());
    }

    async fn serve(&self, stream: TcpStream) -> NatsError {
        let (mut rd, mut wr) = futures_lite::io::split(stream);
        let reader = async {
            let mut parser = Parser::new(self.max_payload().max(1 << 20) + 4096);
            let mut buf = vec![0u8; 256 << 10];
            loop {
                let n = match rd.read(&mut buf).await {
                    Ok(0) => return NatsError::Disconnected("closed by the server"),
                    Ok(n) => n,
                    Err(e) => return e.into(),
                };
                parser.push(&buf[..n]);
                loop {
                    match parser.next_op() {
                        Ok(Some(op)) => {
                            if let Some(e) = self.dispatch(op) {
                                return e;
                            }
                        }
                        Ok(None) => break,
                        Err(e) => return NatsError::Proto(e),
                    }
                }
            }
        };
        let writer = async {
            loop {
                if self.0.state.borrow().out.is_empty() {
                    if self.0.wake_rx.recv_async().await.is_err() {
                        return NatsError::Closed;
                    }
                    continue;
                }
                let mut f = {
                    let mut s = self.0.state.borrow_mut();
                    InFlight {
                        inner: &self.0,
                        pings: std::mem::take(&mut s.pings_in_out),
                        batch: std::mem::take(&mut s.out),
                        through: false,
                    }
                };
                let res = async {
                    wr.write_all(&f.batch).await?;
                    wr.flush().await
                }
                .await;
                if let Err(e) = res {
                    // `f` goes back in front of `out` as it drops.
                    return e.into();
                }
                f.through = true;
                let _ = self.0.drained.try_send(());
            }
        };
        let killer = async {
            let _ = self.0.kill_rx.recv_async().await;
            NatsError::Disconnected("dropped by the client")
        };
        future::or(future::or(reader, writer), killer).await
    }

    /// Handles one server operation; returns an error that ends the connection.
    fn dispatch(&self, op: ServerOp) -> Option<NatsError> {
        let mut s = self.0.state.borrow_mut();
        match op {
            ServerOp::Msg(msg) => {
                s.stats.msgs_in += 1;
                s.stats.bytes_in += msg.payload.len() as u64;
                let delivered = if Some(msg.sid) == s.inbox_sid {
                    let token = msg.subject.rsplit('.').next().unwrap_or("").to_owned();
                    // A reply nobody waits for any more is not a drop.
                    s.requests
                        .get(&token)
                        .is_none_or(|tx| tx.try_send(msg).is_ok())
                } else {
                    s.subs
                        .get(&msg.sid)
                        .is_none_or(|sub| sub.tx.try_send(msg).is_ok())
                };
                if !delivered {
                    s.stats.dropped += 1;
                }
            }
            ServerOp::Ping => {
                encode::pong(&mut s.out);
                drop(s);
                let _ = self.0.wake_writer.try_send(());
            }
            ServerOp::Pong => {
                if s.stale_pongs > 0 {
                    s.stale_pongs -= 1;
                } else {
                    match s.pings.pop_front() {
                        Some(Ping::Keepalive) => {
                            s.pings_outstanding = s.pings_outstanding.saturating_sub(1);
                        }
                        Some(Ping::Flush(w)) => {
                            let _ = w.try_send(Ok(()));
                        }
                        None => {}
                    }
                }
            }
            ServerOp::Info(info) => s.info = Some(*info),
            ServerOp::Ok => {}
            ServerOp::Err(e) => {
                s.stats.server_errors += 1;
                crate::warn_throttled!(error = %e, "nats: server error");
                let err = NatsError::Server(e.clone());
                s.last_error = Some(err.clone());
                // Permission errors on one subject keep the connection; the rest end it.
                if !e.to_ascii_lowercase().contains("permissions violation") {
                    return Some(err);
                }
            }
        }
        None
    }

    pub(super) async fn keepalive(self) {
        loop {
            glommio::timer::sleep(self.0.opts.ping_interval).await;
            let mut s = self.0.state.borrow_mut();
            if s.closed {
                return;
            }
            if !s.connected {
                continue;
            }
            if s.pings_outstanding >= 2 {
                drop(s);
                crate::warn_throttled!("nats: server stopped answering PINGs");
                let _ = self.0.kill.try_send(());
                continue;
            }
            s.pings_outstanding += 1;
            s.ping(Ping::Keepalive);
            drop(s);
            let _ = self.0.wake_writer.try_send(());
        }
    }
}
