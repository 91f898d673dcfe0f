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

use super::error::NatsError;
use super::options::{Options, ServerUrl};
use super::proto::{self, Msg, ServerInfo, encode};

mod conn;
mod subs;

pub use subs::{ReplyStream, Subscription};

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

    /// Closes the client: pending subscriptions end, tasks stop.
    pub fn close(&self) {
        self.shutdown(NatsError::Closed);
        let _ = self.0.kill.try_send(());
        let _ = self.0.wake_writer.try_send(());
    }
}
