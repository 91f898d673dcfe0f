//! The OpenAI-compatible front: `POST /v1/chat/completions` and `POST /v1/completions`
//! (streamed or not), `GET /v1/models`, `/healthz` and `/metrics`, on a listener of its own
//! beside the routing API, on the same executor and the same router state (one decision, no
//! locks).
//!
//! A request's life: its prompt is tokenised as the engine will see it ([`model`]), hashed
//! into Dynamo's block hashes, and routed by the router state's `decide` (the decision `/v1/route`
//! and the harness make: slot added, replica sync told); the body goes to the chosen
//! worker unchanged (apart from what a Dynamo frontend needs to be told), and the answer
//! comes back chunk by chunk. A stream's first chunk marks the prefill done (the engine
//! sends nothing before its first token); its `data: [DONE]` event (which also ends the
//! client's stream, without waiting for the engine's end of body), an upstream error or
//! the client's disconnect frees the request, and a disconnect also closes the engine connection, which
//! cancels the engine's work. A non-streaming answer arrives whole, so nothing marks its
//! prefill done earlier: it holds its prefill charge until it is answered, then is freed.
//!
//! Connection errors, timeouts before the response's headers and 5xx answers retry on the
//! next-best worker (the failed ones are no candidates), at most
//! [`ProxyConfig::max_retries`] times; once the client has a byte, never. A decision that
//! is refused answers as `/v1/route` does: 429 (busy thresholds) or 503 (no workers) with
//! a `Retry-After`, counted apart from errors.
//!
//! Why two listeners: the routing API is a strict, synchronous server tuned for
//! microsecond answers (a bulk gate, one pass per request); the proxy holds connections
//! for whole generations, and its clients are OpenAI SDKs, not gateways. Each has its own
//! connection cap and deadlines, and either can be exposed alone.
//!
//! The front sees the router's state only through the crate's `routing::Routing` (the
//! router starts the front; the front never imports the router).
//!
//! Rooms: [`model`] (tokenizer and chat template), [`upstream`] (the engine client and its
//! pool), [`front`] (the listener, the handlers and the routing of a request with its
//! retries), [`request`] (reading a request's body and tokenising its prompt),
//! [`session`] (session affinity), [`relay`] (the engine's answer back to the client and
//! the request's life until it is freed), [`stats`] (`/metrics`), [`rt`] (hyper on
//! glommio).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

mod bpe;
mod front;
pub mod model;
pub mod pieces;
mod relay;
mod request;
mod rt;
mod session;
mod stats;
mod tokenize;
pub(crate) mod upstream;

pub(crate) use front::{Front, serve};
pub(crate) use stats::ProxyStats;
pub use upstream::{Target, UpstreamConfig};

/// Why the OpenAI front could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProxyError {
    /// Its address could not be bound.
    #[error("cannot listen on {addr}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A served model's card could not be loaded.
    #[error("model {name:?} ({})", dir.display())]
    Model {
        /// The name clients ask for.
        name: String,
        /// Its card's folder.
        dir: PathBuf,
        /// Why.
        #[source]
        source: model::CardError,
    },
    /// The tokenizer threads could not be started.
    #[error("cannot start the tokenizer threads")]
    Threads(#[source] std::io::Error),
}

/// Where the proxy sends a request.
#[derive(Debug, Clone)]
pub enum Backend {
    /// Engines that speak the OpenAI API themselves (vLLM, SGLang, TensorRT-LLM `serve`):
    /// a base URL per worker id. A worker's dp rank is named in vLLM's
    /// `X-data-parallel-rank` header.
    Engines(Vec<(u64, Target)>),
    /// One Dynamo frontend started with `--router-mode direct`: the chosen worker is named
    /// in the body (`nvext.backend_instance_id`, `nvext.dp_rank`), and our token ids go with
    /// it (`nvext.token_data`) so that it does not tokenise again.
    DynamoDirect(Target),
}

/// One served model.
#[derive(Debug, Clone)]
pub struct ModelSpec {
    /// The name clients ask for (`model`).
    pub name: String,
    /// Its card: `tokenizer.json` and `tokenizer_config.json`.
    pub dir: PathBuf,
    /// The LoRA adapter this name serves (vLLM's `--lora-modules NAME=PATH`: the engine
    /// applies it when a request names it): its blocks are hashed with the adapter's name,
    /// as the engine's KV events and Dynamo's hashing salt them, so a base model's cache
    /// never counts for its adapter nor one adapter's for another.
    pub lora_name: Option<String>,
}

/// Settings of the OpenAI front.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// Where it listens.
    pub listen: SocketAddr,
    /// The models it serves (every worker serves each).
    pub models: Vec<ModelSpec>,
    /// Where requests go.
    pub backend: Backend,
    /// The engine client's deadlines.
    pub upstream: UpstreamConfig,
    /// Retries on another worker before the first byte (2).
    pub max_retries: u32,
    /// Largest request body, bytes (16 MiB: a 100 k-token chat is about 0.5 MB).
    pub max_body_bytes: usize,
    /// Headers of a request must arrive within this (10 s).
    pub header_timeout: Duration,
    /// Its body within this after the headers (30 s).
    pub body_timeout: Duration,
    /// Open client connections (past it: 503 and closed) (4,096).
    pub max_connections: usize,
    /// Session affinity: the header naming a session (besides `X-Dynamo-Session-ID`).
    pub session_header: Option<String>,
    /// How long a session stays bound to its worker after its last request (600 s; 0: no
    /// affinity).
    pub session_ttl: Duration,
    /// Most sessions bound at once (100,000).
    pub max_sessions: usize,
    /// Share session bindings with the other replicas, with replica sync on (true): a
    /// session then stays on its worker whichever replica its requests reach
    /// ([`kvrouter_core::sessions`]).
    pub session_sync: bool,
    /// Consecutive requests of a model with no cached prefix anywhere after which the
    /// proxy warns that its tokenisation may not be the engine's (64).
    pub zero_overlap_warn: u64,
    /// Threads that tokenise requests off the front's executor (0: all inline; default:
    /// the machine's cores, at most 8).
    pub tokenizer_threads: usize,
    /// Bodies of at most this many bytes are tokenised inline, where the encoding is
    /// shorter than a hand-off between threads (2,048); those over 512 bytes only while
    /// inline encoding has taken under 30 % of the executor's recent time.
    pub inline_tokenize_bytes: usize,
    /// Bytes of prompt pieces kept encoded ([`pieces`]; 0: every prompt encoded whole), in
    /// all: each distinct model card gets an equal part
    /// ([`model::DEFAULT_PIECE_CACHE_BYTES`]).
    pub piece_cache_bytes: usize,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8000".parse().expect("valid"),
            models: Vec::new(),
            backend: Backend::Engines(Vec::new()),
            upstream: UpstreamConfig::default(),
            max_retries: 2,
            max_body_bytes: 16 << 20,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            max_connections: 4096,
            session_header: None,
            session_ttl: Duration::from_secs(600),
            max_sessions: 100_000,
            session_sync: true,
            zero_overlap_warn: 64,
            tokenizer_threads: std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(8),
            inline_tokenize_bytes: 2048,
            piece_cache_bytes: model::DEFAULT_PIECE_CACHE_BYTES,
        }
    }
}
