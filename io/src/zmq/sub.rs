//! A SUB socket: connected to one publisher (reconnecting with backoff), or bound for any
//! number of publishers that connect to us; whole messages go to one bounded channel.

use std::rc::Rc;
use std::time::Duration;

use glommio::net::{TcpListener, TcpStream};
use kvrouter_core::zmtp::{Limits, SocketType};

use super::conn::{Conn, ZmqError};
use super::endpoint::Endpoint;

/// Settings of a subscriber.
#[derive(Debug, Clone, Copy)]
pub struct SubOptions {
    /// Bounds on what a publisher may send.
    pub limits: Limits,
    /// Messages queued for the consumer before reads stop.
    pub capacity: usize,
    /// First reconnect delay; doubles up to `reconnect_max`.
    pub reconnect_base: Duration,
    /// Longest reconnect delay.
    pub reconnect_max: Duration,
    /// Connect and handshake timeout.
    pub connect_timeout: Duration,
    /// PING a quiet publisher this often; three quiet periods drop the connection (`None`:
    /// never, the connection lives as long as TCP says).
    pub heartbeat: Option<Duration>,
}

impl Default for SubOptions {
    fn default() -> Self {
        Self {
            limits: Limits::default(),
            capacity: 4096,
            reconnect_base: Duration::from_millis(50),
            reconnect_max: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(2),
            heartbeat: Some(Duration::from_secs(2)),
        }
    }
}

/// What a subscriber hands its consumer.
#[derive(Debug)]
pub enum SubEvent {
    /// A publisher connection completed its handshake (connection `conn`, counted from 0
    /// for this subscriber).
    Connected {
        /// Which connection.
        conn: u64,
    },
    /// A message from connection `conn`.
    Message {
        /// Which connection.
        conn: u64,
        /// Its frames.
        frames: Vec<Vec<u8>>,
    },
    /// A connection ended (why).
    Disconnected {
        /// Which connection.
        conn: u64,
        /// Why.
        error: ZmqError,
    },
    /// Connecting (or binding) failed; it is retried.
    Failed {
        /// Why.
        error: ZmqError,
    },
}

/// A running SUB: its tasks run on the executor that started it until the subscriber is
/// dropped.
#[derive(Debug)]
pub struct Subscriber {
    rx: flume::Receiver<SubEvent>,
    _tasks: Vec<glommio::Task<()>>,
}

impl Subscriber {
    /// A SUB connected to the publisher at `endpoint` (a wildcard endpoint is bound
    /// instead: publishers connect to us).
    pub fn start(endpoint: &Endpoint, opts: SubOptions) -> Subscriber {
        if endpoint.wildcard {
            Self::bind(endpoint, opts)
        } else {
            Self::connect(endpoint, opts)
        }
    }

    /// A SUB that connects to `endpoint` and reconnects, with backoff, whenever the
    /// connection ends.
    pub fn connect(endpoint: &Endpoint, opts: SubOptions) -> Subscriber {
        let (tx, rx) = flume::bounded(opts.capacity.max(1));
        let endpoint = endpoint.clone();
        let task = glommio::spawn_local(async move {
            let mut delay = opts.reconnect_base;
            let mut conn_id = 0u64;
            loop {
                let connected = async {
                    let addr = endpoint.socket_addr()?;
                    let stream = TcpStream::connect_timeout(addr, opts.connect_timeout)
                        .await
                        .map_err(std::io::Error::from)?;
                    Ok::<TcpStream, ZmqError>(stream)
                };
                match connected.await {
                    Ok(stream) => {
                        let id = conn_id;
                        conn_id += 1;
                        if serve(stream, id, &opts, &tx).await.is_err() {
                            return; // the consumer is gone
                        }
                        delay = opts.reconnect_base;
                    }
                    Err(error) => {
                        if tx.send_async(SubEvent::Failed { error }).await.is_err() {
                            return;
                        }
                    }
                }
                glommio::timer::sleep(delay).await;
                delay = (delay * 2).min(opts.reconnect_max);
            }
        });
        Subscriber {
            rx,
            _tasks: vec![task],
        }
    }

    /// A SUB bound at `endpoint`, accepting publishers that connect (each its own
    /// connection id).
    pub fn bind(endpoint: &Endpoint, opts: SubOptions) -> Subscriber {
        let (tx, rx) = flume::bounded(opts.capacity.max(1));
        let endpoint = endpoint.clone();
        let task = glommio::spawn_local(async move {
            let mut delay = opts.reconnect_base;
            let listener = loop {
                let bound = endpoint
                    .socket_addr()
                    .and_then(|a| TcpListener::bind(a).map_err(std::io::Error::from));
                match bound {
                    Ok(l) => break l,
                    Err(e) => {
                        let error = ZmqError::Io(e);
                        if tx.send_async(SubEvent::Failed { error }).await.is_err() {
                            return;
                        }
                        glommio::timer::sleep(delay).await;
                        delay = (delay * 2).min(opts.reconnect_max);
                    }
                }
            };
            let tx = Rc::new(tx);
            let mut conn_id = 0u64;
            loop {
                match listener.accept().await {
                    Ok(stream) => {
                        let (id, tx) = (conn_id, Rc::clone(&tx));
                        conn_id += 1;
                        glommio::spawn_local(async move {
                            let _ = serve(stream, id, &opts, &tx).await;
                        })
                        .detach();
                    }
                    Err(e) => {
                        let error = ZmqError::Io(e.into());
                        if tx.send_async(SubEvent::Failed { error }).await.is_err() {
                            return;
                        }
                        glommio::timer::sleep(opts.reconnect_base).await;
                    }
                }
            }
        });
        Subscriber {
            rx,
            _tasks: vec![task],
        }
    }

    /// The next event (`None` once the subscriber's tasks are gone).
    pub async fn next(&self) -> Option<SubEvent> {
        self.rx.recv_async().await.ok()
    }
}

/// One publisher connection: handshake, subscribe to everything, forward its messages.
/// `Err` when the consumer is gone (stop everything).
async fn serve(
    stream: TcpStream,
    id: u64,
    opts: &SubOptions,
    tx: &flume::Sender<SubEvent>,
) -> Result<(), ()> {
    // Forwarding only ends with an error.
    let Err(error) = forward(stream, id, opts, tx).await;
    tx.send_async(SubEvent::Disconnected { conn: id, error })
        .await
        .map_err(|_| ())
}

async fn forward(
    stream: TcpStream,
    id: u64,
    opts: &SubOptions,
    tx: &flume::Sender<SubEvent>,
) -> Result<std::convert::Infallible, ZmqError> {
    let mut conn =
        Conn::handshake(stream, SocketType::Sub, opts.limits, opts.connect_timeout).await?;
    conn.subscribe(b"").await?;
    conn.set_heartbeat(opts.heartbeat)?;
    tx.send_async(SubEvent::Connected { conn: id })
        .await
        .map_err(|_| ZmqError::Closed)?;
    loop {
        let frames = conn.recv().await?;
        tx.send_async(SubEvent::Message { conn: id, frames })
            .await
            .map_err(|_| ZmqError::Closed)?;
    }
}
