//! The router service: routing decisions over HTTP on a glommio executor of its own, fed by
//! the ingest's index (or, in approximate mode, by its own decisions), with the slot
//! manager's load predictions shared between replicas over NATS.
//!
//! Endpoints (JSON; worker ids are integers carrying the exact u64, inputs accept integers or
//! decimal strings):
//!
//! | endpoint | what |
//! |---|---|
//! | `POST /v1/route` | `{"token_ids": [...]}` or `{"block_hashes": [...]}`, optional `lora_name`, `request_id`, `explain` → `{"worker_id", "dp_rank", "overlap_blocks", "request_id"}` (+ `candidates` with their cost terms and each tier's credit, `credits: {device, host, disk, shared}`, when `explain`). Binary framing: `Content-Type: application/x-kvrouter-block-hashes`, the body the local block hashes as little-endian u64s, `X-Request-Id` / `X-Lora-Name` headers |
//! | `POST /v1/overlaps` | same input → `{"overlaps": [{"worker_id", "dp_rank", "blocks", "host_blocks"?, "disk_blocks"?, "shared_blocks"?}], "shared_blocks"?}`: device blocks from the start (find_matches without early exit), then how far host memory, then disk and external storage continue the prefix, then the shared pool's blocks at or past the device prefix (each left out when 0); workers with any positive device or lower-tier count only; the top-level `shared_blocks` is the request's blocks in the pools every worker reads (what an unlisted worker is credited with); with `--pool-readers`, a worker that reads more than that is listed with its own `shared_blocks` |
//! | `POST /v1/requests/{id}/first_token` | the request's prefill is done: its prefill tokens are released |
//! | `POST /v1/requests/{id}/free` | the request finished: its slots are released |
//! | `GET /v1/workers` | workers, dp ranks, cached blocks, last applied event id, loads |
//! | `GET /metrics` | Prometheus text |
//! | `GET /healthz` | 200 once the NATS subscriptions are active, else 503 |
//!
//! An optional bearer token guards the mutating endpoints (`route`, `first_token`, `free`).
//!
//! Rooms: [`input`] parses route bodies (the binary framing, the JSON fast path),
//! [`endpoints`] holds the executor's state and answers each endpoint (every decision is
//! [`kvrouter_core::decision::Decider::decide`], the one the harness measures; what a
//! front sees of the state, the OpenAI proxy included, is the crate's `routing::Routing`),
//! [`metrics`] renders `/metrics`, [`replica`] runs replica sync; this file starts and
//! stops the executor and, when configured, the OpenAI front on the same executor.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;

use kvrouter_core::codec::Subjects;
use kvrouter_core::codec::replica::ActiveSequenceEvent;
use kvrouter_core::codec::session::SessionBinding;
use kvrouter_core::decision::{Decider, DeciderConfig, Limits, Selection};
use kvrouter_core::index::{ApproxConfig, PoolReaders};
use kvrouter_core::policy::CostConfig;
use kvrouter_core::worker::WorkerDp;

use crate::http::{self, HttpConfig, Request, Response};
use crate::ingest::IngestView;
use crate::nats::{Client, NatsError, Options};
use crate::proxy::{self, ProxyConfig, ProxyError, ProxyStats};
use crate::routing::Routing;

mod endpoints;
mod input;
mod metrics;
mod replica;

pub use input::BINARY_HASHES;

/// Settings of the router service.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// Where the HTTP API listens.
    pub listen: SocketAddr,
    /// HTTP limits.
    pub http: HttpConfig,
    /// Tokens per KV block (hashing `token_ids`).
    pub block_size: u32,
    /// Cost function.
    pub cost: CostConfig,
    /// How a worker is picked (the cost function, or a cache-blind baseline).
    pub selection: Selection,
    /// `false`: approximate mode (no KV events; the router records its own decisions).
    pub kv_events: bool,
    /// Approximate-mode settings.
    pub approx: ApproxConfig,
    /// With KV events: also remember our own decisions this long, ms, and credit a worker
    /// with the longer of the index's prefix and the remembered one (0: off).
    pub remember_ms: u64,
    /// Which workers read which shared pools (none named: every worker reads every pool).
    pub pool_readers: PoolReaders,
    /// Share slot predictions with other replicas over NATS.
    pub replica_sync: bool,
    /// This router's id (replicas ignore their own messages).
    pub router_id: u64,
    /// Subject naming.
    pub subjects: Subjects,
    /// NATS connection (replica sync).
    pub nats: Options,
    /// How long the start waits for replica sync's first connection (then it goes on
    /// connecting in the background; a broker that refuses us fails the start).
    pub nats_start_wait: Duration,
    /// Requests not heard of for this long are released.
    pub stale_after: Duration,
    /// Bearer token guarding mutating endpoints.
    pub auth_token: Option<String>,
    /// Seed of the tie-breaking / sampling generator.
    pub seed: u64,
    /// Workers to route to even before any event of theirs arrives (approximate mode).
    pub static_workers: Vec<WorkerDp>,
    /// What one request may hold (blocks, active requests, id length).
    pub limits: Limits,
    /// Let the API executor spin this long before parking. glommio ignores it unless the
    /// executor is bound to a CPU (`cpu` in [`start`]); bound, on our hosts it added about
    /// its own length to the front's latency (docs/BENCHMARKS.md), so it stays off.
    pub spin_before_park: Option<Duration>,
    /// The OpenAI-compatible front, on its own listener (absent: not served).
    pub proxy: Option<ProxyConfig>,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8080".parse().expect("valid"),
            http: HttpConfig::default(),
            block_size: 64,
            cost: CostConfig::default(),
            selection: Selection::Cost,
            kv_events: true,
            approx: ApproxConfig::default(),
            remember_ms: 0,
            pool_readers: PoolReaders::new(),
            replica_sync: true,
            router_id: 0,
            subjects: Subjects::default(),
            nats: Options::default(),
            nats_start_wait: Duration::from_secs(3),
            stale_after: Duration::from_secs(600),
            auth_token: None,
            seed: 0,
            static_workers: Vec::new(),
            limits: Limits::default(),
            spin_before_park: None,
            proxy: None,
        }
    }
}

/// Why the router service could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RouterError {
    /// The API's address could not be bound.
    #[error("cannot listen on {addr}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The API's executor could not start (io_uring, memlock).
    #[error("the API executor could not start")]
    Executor(#[source] std::io::Error),
    /// The API's executor stopped before it listened.
    #[error("the API executor stopped while starting")]
    Stopped,
    /// The OpenAI front could not start (its address, a model card).
    #[error("the OpenAI front could not start")]
    Proxy(#[source] ProxyError),
    /// Replica sync could not reach NATS.
    #[error("replica sync")]
    ReplicaSync(#[source] NatsError),
}

/// A running router service.
pub struct RouterHandle {
    addr: SocketAddr,
    proxy_addr: Option<SocketAddr>,
    stop: flume::Sender<()>,
    thread: Option<glommio::ExecutorJoinHandle<()>>,
}

impl std::fmt::Debug for RouterHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterHandle")
            .field("addr", &self.addr)
            .finish()
    }
}

impl RouterHandle {
    /// The address the API listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The address the OpenAI front listens on, when it runs.
    pub fn proxy_addr(&self) -> Option<SocketAddr> {
        self.proxy_addr
    }

    /// Stops the service and waits for it.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        let _ = self.stop.send(());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    /// Waits until the service stops by itself (never, normally).
    pub fn join(mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for RouterHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Starts the router service on its own executor (placement `cpu`, io memory `io_memory`).
pub fn start(
    cfg: RouterConfig,
    ingest: Option<IngestView>,
    cpu: Option<usize>,
    io_memory: usize,
) -> Result<RouterHandle, RouterError> {
    let (addr_tx, addr_rx) = std::sync::mpsc::channel::<Result<Addrs, RouterError>>();
    let (stop, stop_rx) = flume::bounded::<()>(1);
    let placement = cpu.map_or(glommio::Placement::Unbound, glommio::Placement::Fixed);
    let mut builder = glommio::LocalExecutorBuilder::new(placement)
        .name("kvrouter-api")
        .io_memory(io_memory);
    if let Some(spin) = cfg.spin_before_park {
        builder = builder.spin_before_park(spin);
    }
    let thread = builder
        .spawn(move || async move { run(cfg, ingest, addr_tx, stop_rx).await })
        .map_err(|e| RouterError::Executor(e.into()))?;
    let (addr, proxy_addr) = addr_rx.recv().map_err(|_| RouterError::Stopped)??;
    Ok(RouterHandle {
        addr,
        proxy_addr,
        stop,
        thread: Some(thread),
    })
}

/// The routing API's address and the OpenAI front's.
type Addrs = (SocketAddr, Option<SocketAddr>);

/// The decision's settings from the service's.
fn decider_config(cfg: &RouterConfig) -> DeciderConfig {
    DeciderConfig {
        cost: cfg.cost,
        selection: cfg.selection,
        block_size: cfg.block_size,
        approximate: (!cfg.kv_events).then_some(cfg.approx),
        remember: (cfg.kv_events && cfg.remember_ms > 0).then_some(ApproxConfig {
            ttl_ms: cfg.remember_ms,
            ..cfg.approx
        }),
        stale_after_ms: cfg.stale_after.as_millis() as u64,
        seed: cfg.seed ^ cfg.router_id,
        id_prefix: cfg.router_id,
        limits: cfg.limits,
    }
}

async fn run(
    cfg: RouterConfig,
    ingest: Option<IngestView>,
    addr_tx: std::sync::mpsc::Sender<Result<Addrs, RouterError>>,
    stop: flume::Receiver<()>,
) {
    let listener = match http::bind(cfg.listen) {
        Ok(l) => l,
        Err(source) => {
            let _ = addr_tx.send(Err(RouterError::Listen {
                addr: cfg.listen,
                source,
            }));
            return;
        }
    };
    let addr = listener.local_addr().unwrap_or(cfg.listen);
    let (replica_tx, replica_rx) = flume::bounded::<ActiveSequenceEvent>(replica::QUEUE);
    // Session bindings are shared when the front binds sessions and asks to share them.
    let session_sync = cfg.replica_sync
        && cfg
            .proxy
            .as_ref()
            .is_some_and(|p| p.session_sync && !p.session_ttl.is_zero());
    let (session_tx, session_rx) = flume::bounded::<SessionBinding>(replica::QUEUE);
    let mut decider = Decider::new(decider_config(&cfg));
    decider.set_pool_readers(cfg.pool_readers.clone());
    let state = Rc::new(RefCell::new(endpoints::State::new(
        cfg.clone(),
        ingest,
        decider,
        cfg.replica_sync.then_some(replica_tx),
        session_sync.then_some(session_tx),
    )));
    if cfg.replica_sync {
        // Connected in the background: a broker not reachable yet delays replica sync
        // (its events wait in the queue, up to its bound), never the API. One that
        // refuses us fails the start.
        let (first_tx, first_rx) = flume::bounded::<Result<(), NatsError>>(1);
        let (st, c) = (Rc::clone(&state), cfg.clone());
        glommio::spawn_local(async move {
            let started = match Client::connect(c.nats.clone()).await {
                Ok(client) => {
                    let stats = Rc::clone(&st.borrow().replica);
                    let sessions = session_sync.then(|| replica::SessionSync {
                        out: session_rx,
                        stats: Rc::clone(&st.borrow().session_replica),
                    });
                    replica::start(client, st, replica_rx, stats, sessions, &c).await
                }
                Err(e) => Err(e),
            };
            if let Err(e) = &started {
                tracing::error!(error = %e, "replica sync could not start");
            }
            let _ = first_tx.try_send(started);
        })
        .detach();
        let first = async { first_rx.recv_async().await.ok() };
        let waited = async {
            glommio::timer::sleep(cfg.nats_start_wait).await;
            None
        };
        match futures_lite::future::or(first, waited).await {
            Some(Err(e)) => {
                let _ = addr_tx.send(Err(RouterError::ReplicaSync(e)));
                return;
            }
            Some(Ok(())) => {}
            None => tracing::warn!("replica sync: NATS not reachable yet, still connecting"),
        }
    }
    // Stale requests.
    let st = Rc::clone(&state);
    glommio::spawn_local(async move {
        loop {
            glommio::timer::sleep(Duration::from_secs(1)).await;
            st.borrow_mut().expire();
        }
    })
    .detach();
    let mut proxy_addr = None;
    if let Some(pc) = cfg.proxy.clone() {
        let listener = match glommio::net::TcpListener::bind(pc.listen) {
            Ok(l) => l,
            Err(source) => {
                let _ = addr_tx.send(Err(RouterError::Proxy(ProxyError::Listen {
                    addr: pc.listen,
                    source: source.into(),
                })));
                return;
            }
        };
        proxy_addr = Some(listener.local_addr().unwrap_or(pc.listen));
        let stats = Rc::new(ProxyStats::default());
        state.borrow_mut().proxy = Some(Rc::clone(&stats));
        // The front sees the state as `dyn Routing` (it never imports the router).
        let routing = Rc::clone(&state);
        let front = match proxy::Front::new(routing, pc, stats) {
            Ok(f) => Rc::new(f),
            Err(e) => {
                let _ = addr_tx.send(Err(RouterError::Proxy(e)));
                return;
            }
        };
        glommio::spawn_local(proxy::serve(listener, front)).detach();
        tracing::info!(addr = ?proxy_addr, "OpenAI front listening");
    }
    let _ = addr_tx.send(Ok((addr, proxy_addr)));
    tracing::info!(%addr, "routing API listening");
    let st = Rc::clone(&state);
    let handler: Rc<dyn Fn(Request) -> Response> = Rc::new(move |req| st.borrow_mut().handle(req));
    // A decision's slot insert finishes once its answer is written (`Decider::settle`).
    let st = Rc::clone(&state);
    let answered: Rc<dyn Fn()> = Rc::new(move || st.borrow_mut().settle());
    let stats = Rc::clone(&state.borrow().http);
    let server = http::serve(listener, cfg.http.clone(), stats, handler, answered);
    let stopped = async {
        let _ = stop.recv_async().await;
    };
    futures_lite::future::or(server, stopped).await;
}
