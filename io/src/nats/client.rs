//! A NATS client on glommio's io_uring sockets.
//!
//! One [`Client`] lives on one glommio executor (it is `!Send`); other cores talk to it
//! through channels. It keeps one connection, re-established with exponential backoff when
//! it drops, re-subscribing every live subscription; publications made while disconnected
//! wait in the write buffer (up to `max_pending_bytes`) and go out after the handshake.
//!
//! Writes are pipelined: `publish` appends to a write buffer and wakes the writer task,
//! which sends everything buffered in one `write_all`; `flush` waits for a PING/PONG round
//! trip, so that everything published before it reached the server. When the buffer holds
//! more than `max_pending_bytes`, `publish` waits for the writer to drain it
//! (backpressure). Payloads above the server's `max_payload` are refused with a typed error.
//!
//! When a connection is lost, nothing still in the buffer is lost with it: a batch that was
//! not written through, because the write failed or because the reader saw the connection
//! die first, goes back in front of the buffer whole and is sent again after the next
//! handshake (the server may then see the start of that batch twice). Bytes the socket
//! accepted before the connection died may still be lost with it: only a `flush` that
//! returns `Ok` confirms that the server got them. Each PING is matched to its PONG by
//! order: a flush ends on its own PONG, never on a keepalive's, and a flush whose connection
//! dies fails with `NotConnected` (its PING, if unsent, goes out again and its PONG is
//! skipped).
//!
//! Delivered messages go to each subscription's bounded channel; when a subscriber falls
//! behind, messages for it are dropped and counted (`Stats::dropped`), never buffered
//! without bound.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;
use std::time::Duration;

use futures_lite::future;
use futures_lite::io::{AsyncReadExt, AsyncWriteExt};
use glommio::net::TcpStream;

use super::error::NatsError;
use super::options::{Options, ServerUrl};
use super::proto::{self, ConnectInfo, Msg, Parser, ServerInfo, ServerOp, encode};

/// Counters of one client.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Messages delivered to subscriptions.
    pub msgs_in: u64,
    /// Payload bytes delivered.
    pub bytes_in: u64,
    /// Messages published.
    pub msgs_out: u64,
    /// Payload bytes published.
    pub bytes_out: u64,
    /// Messages dropped because a subscriber fell behind.
    pub dropped: u64,
    /// Connections established after the first.
    pub reconnects: u64,
    /// `-ERR`s received.
    pub server_errors: u64,
}

/// Who waits for a PING's PONG.
enum Ping {
    Keepalive,
    Flush(flume::Sender<Result<(), NatsError>>),
}

struct SubEntry {
    subject: String,
    queue: Option<String>,
    tx: flume::Sender<Msg>,
}

struct State {
    out: Vec<u8>,
    subs: HashMap<u64, SubEntry>,
    next_sid: u64,
    connected: bool,
    closed: bool,
    info: Option<ServerInfo>,
    /// Who waits for each PING this connection owes a PONG for, in the order the PINGs
    /// went into `out` (so in the order their PONGs come back).
    pings: VecDeque<Ping>,
    /// Keepalive PINGs without their PONG yet.
    pings_outstanding: u32,
    /// PING commands in the bytes of `out` (a batch being written counts until it is
    /// through; a failed one comes back with its PINGs).
    pings_in_out: usize,
    /// PONGs still to come that nobody waits for: answers to PINGs of an earlier
    /// connection that are sent again with the unsent bytes.
    stale_pongs: usize,
    inbox_prefix: String,
    inbox_sid: Option<u64>,
    next_token: u64,
    requests: HashMap<String, flume::Sender<Msg>>,
    stats: Stats,
    last_error: Option<NatsError>,
    ever_connected: bool,
}

impl State {
    /// Queues a PING, answered (in order) to `who`.
    fn ping(&mut self, who: Ping) {
        encode::ping(&mut self.out);
        self.pings_in_out += 1;
        self.pings.push_back(who);
    }
}

/// A batch the writer has taken out of `out`. Dropped before it is through (a write error,
/// or the connection's tasks cancelled because the reader failed first), it goes back in
/// front of `out` with its PINGs, so that the next connection sends it again: delivery
/// stays at least once (a batch cut off midway is sent whole again).
struct InFlight<'a> {
    inner: &'a Inner,
    batch: Vec<u8>,
    pings: usize,
    through: bool,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if self.through {
            return;
        }
        // No borrow of the state is held across an await point, so none is live while a
        // future holding this value is dropped.
        let mut s = self.inner.state.borrow_mut();
        let mut batch = std::mem::take(&mut self.batch);
        batch.append(&mut s.out);
        s.out = batch;
        s.pings_in_out += self.pings;
    }
}

struct Inner {
    opts: Options,
    state: RefCell<State>,
    /// Wakes the writer when bytes are buffered.
    wake_writer: flume::Sender<()>,
    wake_rx: flume::Receiver<()>,
    /// Wakes publishers waiting for buffer space, and waiters for the connection.
    drained: flume::Sender<()>,
    drained_rx: flume::Receiver<()>,
    /// Asks the connection to drop (stale connection, close).
    kill: flume::Sender<()>,
    kill_rx: flume::Receiver<()>,
}

/// A subscription: its messages arrive on [`Subscription::next`]. Dropping it unsubscribes.
pub struct Subscription {
    sid: u64,
    rx: flume::Receiver<Msg>,
    client: Client,
}

impl std::fmt::Debug for Subscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscription")
            .field("sid", &self.sid)
            .finish()
    }
}

impl Subscription {
    /// The next message, or `None` once the client is closed.
    pub async fn next(&self) -> Option<Msg> {
        self.rx.recv_async().await.ok()
    }

    /// A message if one is waiting.
    pub fn try_next(&self) -> Option<Msg> {
        self.rx.try_recv().ok()
    }

    /// The subscription id.
    pub fn sid(&self) -> u64 {
        self.sid
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.client.unsubscribe(self.sid);
    }
}

/// See the [module docs](self). Cheap to clone; all clones share one connection.
#[derive(Clone)]
pub struct Client(Rc<Inner>);

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.0.state.borrow();
        f.debug_struct("Client")
            .field("connected", &s.connected)
            .field("stats", &s.stats)
            .finish()
    }
}

fn random_token() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let seed = [t, std::process::id() as u64, n, &n as *const u64 as u64];
    let bytes: Vec<u8> = seed.iter().flat_map(|v| v.to_le_bytes()).collect();
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&bytes))
}

impl Client {
    /// Connects (waiting for the first connection, up to `connect_timeout` per attempt and
    /// `max_reconnects` attempts) and starts the connection tasks on the current glommio
    /// executor.
    pub async fn connect(opts: Options) -> Result<Client, NatsError> {
        for s in &opts.servers {
            ServerUrl::parse(s)?;
        }
        // Notifications: one pending signal is enough, extra ones are dropped.
        let (wake_writer, wake_rx) = flume::bounded(1);
        let (drained, drained_rx) = flume::bounded(1);
        let (kill, kill_rx) = flume::bounded(1);
        let inbox_prefix = format!("_INBOX.{}", random_token());
        let client = Client(Rc::new(Inner {
            opts,
            state: RefCell::new(State {
                out: Vec::with_capacity(64 << 10),
                subs: HashMap::new(),
                next_sid: 1,
                connected: false,
                closed: false,
                info: None,
                pings: VecDeque::new(),
                pings_outstanding: 0,
                pings_in_out: 0,
                stale_pongs: 0,
                inbox_prefix,
                inbox_sid: None,
                next_token: 1,
                requests: HashMap::new(),
                stats: Stats::default(),
                last_error: None,
                ever_connected: false,
            }),
            wake_writer,
            wake_rx,
            drained,
            drained_rx,
            kill,
            kill_rx,
        }));
        // First connection: in the foreground, so that errors (auth, refused) come back.
        let stream = client.establish().await?;
        let c = client.clone();
        glommio::spawn_local(async move { c.run(Some(stream)).await }).detach();
        let c = client.clone();
        glommio::spawn_local(async move { c.keepalive().await }).detach();
        Ok(client)
    }

    /// Whether the connection is up.
    pub fn is_connected(&self) -> bool {
        self.0.state.borrow().connected
    }

    /// The server's `max_payload` (or the configured limit before the first INFO).
    pub fn max_payload(&self) -> usize {
        let s = self.0.state.borrow();
        s.info
            .as_ref()
            .map_or(self.0.opts.max_payload, |i| i.max_payload)
    }

    /// Counters so far.
    pub fn stats(&self) -> Stats {
        self.0.state.borrow().stats
    }

    /// Connects to the first server that accepts us and completes the handshake.
    async fn establish(&self) -> Result<TcpStream, NatsError> {
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
    async fn run(self, mut first: Option<TcpStream>) {
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
            tracing::warn!(error = %err, "nats: connection lost, reconnecting");
        }
    }

    fn shutdown(&self, err: NatsError) {
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
                tracing::warn!(error = %e, "nats: server error");
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

    async fn keepalive(self) {
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
                tracing::warn!("nats: server stopped answering PINGs");
                let _ = self.0.kill.try_send(());
                continue;
            }
            s.pings_outstanding += 1;
            s.ping(Ping::Keepalive);
            drop(s);
            let _ = self.0.wake_writer.try_send(());
        }
    }

    /// Appends bytes to the write buffer, waiting for room when it is full.
    async fn enqueue(&self, write: impl Fn(&mut Vec<u8>)) -> Result<(), NatsError> {
        loop {
            {
                let mut s = self.0.state.borrow_mut();
                if s.closed {
                    return Err(NatsError::Closed);
                }
                if s.out.len() < self.0.opts.max_pending_bytes {
                    write(&mut s.out);
                    drop(s);
                    let _ = self.0.wake_writer.try_send(());
                    return Ok(());
                }
            }
            if self.0.drained_rx.recv_async().await.is_err() {
                return Err(NatsError::Closed);
            }
        }
    }

    fn check_payload(&self, size: usize) -> Result<(), NatsError> {
        let max = self.max_payload();
        if size > max {
            return Err(NatsError::PayloadTooLarge { size, max });
        }
        Ok(())
    }

    /// Publishes `payload` on `subject`.
    pub async fn publish(&self, subject: &str, payload: &[u8]) -> Result<(), NatsError> {
        self.publish_with_reply(subject, None, payload).await
    }

    /// Publishes with a reply subject.
    pub async fn publish_with_reply(
        &self,
        subject: &str,
        reply: Option<&str>,
        payload: &[u8],
    ) -> Result<(), NatsError> {
        if !proto::valid_publish_subject(subject)
            || reply.is_some_and(|r| !proto::valid_publish_subject(r))
        {
            return Err(NatsError::InvalidSubject(subject.into()));
        }
        self.check_payload(payload.len())?;
        self.enqueue(|out| encode::publish(out, subject, reply, payload))
            .await?;
        let mut s = self.0.state.borrow_mut();
        s.stats.msgs_out += 1;
        s.stats.bytes_out += payload.len() as u64;
        Ok(())
    }

    /// Subscribes to `subject` (wildcards allowed), optionally in a queue group.
    pub fn subscribe(&self, subject: &str, queue: Option<&str>) -> Result<Subscription, NatsError> {
        if !proto::valid_subject(subject) {
            return Err(NatsError::InvalidSubject(subject.into()));
        }
        let (tx, rx) = flume::bounded(self.0.opts.subscription_capacity);
        let mut s = self.0.state.borrow_mut();
        if s.closed {
            return Err(NatsError::Closed);
        }
        let sid = s.next_sid;
        s.next_sid += 1;
        s.subs.insert(
            sid,
            SubEntry {
                subject: subject.into(),
                queue: queue.map(Into::into),
                tx,
            },
        );
        if s.connected {
            encode::subscribe(&mut s.out, subject, queue, sid);
        }
        drop(s);
        let _ = self.0.wake_writer.try_send(());
        Ok(Subscription {
            sid,
            rx,
            client: self.clone(),
        })
    }

    fn unsubscribe(&self, sid: u64) {
        let mut s = self.0.state.borrow_mut();
        // Also while disconnected: the SUB may still wait in the buffer, to be sent after
        // the reconnect (the server ignores an UNSUB for an id it does not know).
        if s.subs.remove(&sid).is_some() && !s.closed {
            encode::unsubscribe(&mut s.out, sid, None);
            drop(s);
            let _ = self.0.wake_writer.try_send(());
        }
    }

    /// Waits until everything published so far has reached the server (a PING/PONG round
    /// trip).
    pub async fn flush(&self, timeout: Duration) -> Result<(), NatsError> {
        let (tx, rx) = flume::bounded(1);
        {
            let mut s = self.0.state.borrow_mut();
            if s.closed {
                return Err(NatsError::Closed);
            }
            if !s.connected {
                return Err(NatsError::NotConnected);
            }
            s.ping(Ping::Flush(tx));
        }
        let _ = self.0.wake_writer.try_send(());
        let wait = async { rx.recv_async().await.unwrap_or(Err(NatsError::Closed)) };
        let deadline = async {
            glommio::timer::sleep(timeout).await;
            Err(NatsError::Timeout)
        };
        future::or(wait, deadline).await
    }

    /// Waits until the client is connected (or `timeout`).
    pub async fn wait_connected(&self, timeout: Duration) -> Result<(), NatsError> {
        let start = std::time::Instant::now();
        while !self.is_connected() {
            if self.0.state.borrow().closed {
                return Err(NatsError::Closed);
            }
            if start.elapsed() > timeout {
                return Err(NatsError::Timeout);
            }
            glommio::timer::sleep(Duration::from_millis(5)).await;
        }
        Ok(())
    }

    fn inbox(&self) -> Result<(String, flume::Receiver<Msg>, String), NatsError> {
        let mut s = self.0.state.borrow_mut();
        if s.closed {
            return Err(NatsError::Closed);
        }
        if s.inbox_sid.is_none() {
            let sid = s.next_sid;
            s.next_sid += 1;
            let subject = format!("{}.*", s.inbox_prefix);
            // The inbox is a subscription like any other, so that it is re-subscribed on
            // reconnect; its channel is unused (replies are routed by token).
            let (tx, _rx) = flume::bounded(1);
            s.subs.insert(
                sid,
                SubEntry {
                    subject: subject.clone(),
                    queue: None,
                    tx,
                },
            );
            if s.connected {
                encode::subscribe(&mut s.out, &subject, None, sid);
            }
            s.inbox_sid = Some(sid);
        }
        let token = s.next_token.to_string();
        s.next_token += 1;
        let (tx, rx) = flume::bounded(1024);
        s.requests.insert(token.clone(), tx);
        let reply = format!("{}.{token}", s.inbox_prefix);
        Ok((reply, rx, token))
    }

    /// Sends a request and waits for the first reply.
    pub async fn request(
        &self,
        subject: &str,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<Msg, NatsError> {
        let stream = self.request_stream(subject, payload).await?;
        let wait = async { stream.rx.recv_async().await.map_err(|_| NatsError::Closed) };
        let deadline = async {
            glommio::timer::sleep(timeout).await;
            Err(NatsError::Timeout)
        };
        let msg = future::or(wait, deadline).await?;
        if msg.status() == Some(503) {
            return Err(NatsError::NoResponders);
        }
        Ok(msg)
    }

    /// Sends a request whose answer may come as several messages (a chunked dump); they
    /// arrive on the returned stream until it is dropped.
    pub async fn request_stream(
        &self,
        subject: &str,
        payload: &[u8],
    ) -> Result<ReplyStream, NatsError> {
        let (reply, rx, token) = self.inbox()?;
        let _ = self.0.wake_writer.try_send(());
        let guard = ReplyStream {
            rx,
            token,
            client: self.clone(),
        };
        self.publish_with_reply(subject, Some(&reply), payload)
            .await?;
        Ok(guard)
    }

    /// Closes the client: pending subscriptions end, tasks stop.
    pub fn close(&self) {
        self.shutdown(NatsError::Closed);
        let _ = self.0.kill.try_send(());
        let _ = self.0.wake_writer.try_send(());
    }
}

/// Replies to one request, as they arrive. Dropping it forgets the request.
pub struct ReplyStream {
    rx: flume::Receiver<Msg>,
    token: String,
    client: Client,
}

impl std::fmt::Debug for ReplyStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplyStream")
            .field("token", &self.token)
            .finish()
    }
}

impl ReplyStream {
    /// The next reply, or `Timeout`.
    pub async fn next(&self, timeout: Duration) -> Result<Msg, NatsError> {
        let wait = async { self.rx.recv_async().await.map_err(|_| NatsError::Closed) };
        let deadline = async {
            glommio::timer::sleep(timeout).await;
            Err(NatsError::Timeout)
        };
        let msg = future::or(wait, deadline).await?;
        if msg.status() == Some(503) {
            return Err(NatsError::NoResponders);
        }
        Ok(msg)
    }
}

impl Drop for ReplyStream {
    fn drop(&mut self) {
        self.client
            .0
            .state
            .borrow_mut()
            .requests
            .remove(&self.token);
    }
}
