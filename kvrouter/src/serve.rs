//! `kvrouter serve`: the router service. Settings come from defaults, then a TOML file
//! (`--config`, unknown keys rejected), then `KVROUTER_*` environment variables, then flags;
//! the effective configuration is logged at start.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kvrouter_core::codec::Subjects;
use kvrouter_core::decision::{Limits, Selection};
use kvrouter_core::index::PoolReaders;
use kvrouter_core::policy::{CostConfig, Formula, Herd};
use kvrouter_core::prefill::Prior;
use kvrouter_core::worker::WorkerDp;
use kvrouter_io::http::HttpConfig;
use kvrouter_io::ingest::{
    DurableConfig, DynamoDiscovery, Ingest, IngestConfig, SnapshotConfig, ZmqEngine,
};
use kvrouter_io::nats::Options;
use kvrouter_io::proxy::{Backend, ModelSpec, ProxyConfig, Target, UpstreamConfig};
use kvrouter_io::router::{self, RouterConfig};
use kvrouter_io::zmq::Endpoint;
use serde::{Deserialize, Serialize};

/// `--dynamo-discovery`: `file:DIR`, `etcd:URL[,URL...]`, or `etcd` (then `etcd_env`,
/// Dynamo's `ETCD_ENDPOINTS`, else its default).
fn dynamo_discovery(spec: &str, etcd_env: Option<&str>) -> anyhow::Result<DynamoDiscovery> {
    if let Some(dir) = spec.strip_prefix("file:") {
        return Ok(DynamoDiscovery::File(PathBuf::from(dir)));
    }
    let urls = match spec.strip_prefix("etcd") {
        Some("") => etcd_env
            .filter(|e| !e.trim().is_empty())
            .unwrap_or("http://localhost:2379"),
        Some(rest) => rest.strip_prefix(':').unwrap_or(""),
        None => "",
    };
    anyhow::ensure!(
        !urls.is_empty(),
        "--dynamo-discovery {spec:?}: expected file:DIR, etcd or etcd:http://HOST:PORT[,...]"
    );
    let targets = urls
        .split(',')
        .map(|u| {
            let u = u.trim();
            anyhow::ensure!(
                u.starts_with("http://"),
                "--dynamo-discovery: etcd endpoint {u:?}: only http:// (no TLS) is supported"
            );
            Target::parse(u).map_err(anyhow::Error::msg)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(DynamoDiscovery::Etcd(targets))
}

/// Flags of `kvrouter serve`; each has an environment fallback and a key in the TOML file.
#[derive(Debug, Args)]
pub(crate) struct ServeArgs {
    /// TOML configuration file (keys as the long flags, with `_` for `-`).
    #[arg(long, env = "KVROUTER_CONFIG")]
    config: Option<PathBuf>,
    /// Stop as on SIGTERM when stdin reaches its end: for a parent that runs the router as
    /// its child (`kvrouter bench --nats`) and holds the pipe's other end, so that the
    /// router goes with the parent however the parent ends.
    #[arg(long, hide = true)]
    stop_on_stdin_eof: bool,
    /// NATS server URL (`off`: no NATS plane, no replica sync).
    #[arg(long, env = "KVROUTER_NATS")]
    nats: Option<String>,
    /// An engine publishing vLLM-native KV events over ZMQ, repeated:
    /// `NAME=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,dp=N][,dp_start=R][,id=WORKER_ID]
    /// [,block_size=N][,url=http://HOST:PORT]`. A wildcard host (`tcp://*:PORT`) is bound
    /// for an engine that connects to us. Ranks are at port + i.
    #[arg(
        long = "zmq-engine",
        env = "KVROUTER_ZMQ_ENGINES",
        value_delimiter = ';'
    )]
    zmq_engines: Option<Vec<String>>,
    /// Dynamo's discovery, for the workers and its ZMQ event plane: `file:DIR` (its
    /// `DYN_FILE_KV` directory), or `etcd:http://HOST:PORT[,http://...]`, or `etcd` alone
    /// (the endpoints of `ETCD_ENDPOINTS`, else `http://localhost:2379`, as Dynamo does).
    #[arg(long, env = "KVROUTER_DYNAMO_DISCOVERY")]
    dynamo_discovery: Option<String>,
    /// NATS token.
    #[arg(long, env = "KVROUTER_NATS_TOKEN")]
    nats_token: Option<String>,
    /// NATS user.
    #[arg(long, env = "KVROUTER_NATS_USER")]
    nats_user: Option<String>,
    /// NATS password.
    #[arg(long, env = "KVROUTER_NATS_PASSWORD")]
    nats_password: Option<String>,
    /// Address of the HTTP API.
    #[arg(long, env = "KVROUTER_LISTEN")]
    listen: Option<SocketAddr>,
    /// Dynamo namespace of the subjects.
    #[arg(long, env = "KVROUTER_NAMESPACE")]
    namespace: Option<String>,
    /// Dynamo component of the subjects.
    #[arg(long, env = "KVROUTER_COMPONENT")]
    component: Option<String>,
    /// Dynamo endpoint of the subjects.
    #[arg(long, env = "KVROUTER_ENDPOINT")]
    endpoint: Option<String>,
    /// Tokens per KV block (hashing of `token_ids`).
    #[arg(long, env = "KVROUTER_BLOCK_SIZE")]
    block_size: Option<u32>,
    /// Ingest KV events (`false`: approximate mode).
    #[arg(long, env = "KVROUTER_KV_EVENTS")]
    kv_events: Option<bool>,
    /// Share slot predictions with other replicas.
    #[arg(long, env = "KVROUTER_REPLICA_SYNC")]
    replica_sync: Option<bool>,
    /// JetStream durable mode: events come from a stream through this replica's durable
    /// consumer (workers publish with `durable` too).
    #[arg(long, env = "KVROUTER_DURABLE_KV_EVENTS")]
    durable_kv_events: Option<bool>,
    /// Durable mode: the stream's name (created when missing).
    #[arg(long, env = "KVROUTER_STREAM_NAME")]
    stream_name: Option<String>,
    /// Durable mode: messages older than this many seconds leave a stream we create (0: no
    /// age limit).
    #[arg(long, env = "KVROUTER_STREAM_MAX_AGE_SECS")]
    stream_max_age_secs: Option<u64>,
    /// Durable mode: this replica's durable consumer (stable across restarts; default from
    /// the router id, or from the host name when the id is random).
    #[arg(long, env = "KVROUTER_CONSUMER_NAME")]
    consumer_name: Option<String>,
    /// Directory of the snapshot file (absent: no snapshots).
    #[arg(long, env = "KVROUTER_SNAPSHOT_DIR")]
    snapshot_dir: Option<PathBuf>,
    /// Seconds between periodic snapshots (0: only on stop).
    #[arg(long, env = "KVROUTER_SNAPSHOT_INTERVAL_SECS")]
    snapshot_interval_secs: Option<u64>,
    /// Write a snapshot on SIGTERM / SIGINT.
    #[arg(long, env = "KVROUTER_SNAPSHOT_ON_STOP")]
    snapshot_on_stop: Option<bool>,
    /// This router's id (random when 0 or absent).
    #[arg(long, env = "KVROUTER_ROUTER_ID")]
    router_id: Option<u64>,
    /// Index shard cores.
    #[arg(long, env = "KVROUTER_SHARDS")]
    shards: Option<usize>,
    /// CPUs: `api,nats,shard0,...` (comma list; unbound when absent).
    #[arg(long, env = "KVROUTER_CPUS", value_delimiter = ',')]
    cpus: Option<Vec<usize>>,
    /// Bearer token guarding the mutating endpoints.
    #[arg(long, env = "KVROUTER_AUTH_TOKEN")]
    auth_token: Option<String>,
    /// Largest request body, bytes.
    #[arg(long, env = "KVROUTER_MAX_BODY_BYTES")]
    max_body_bytes: Option<usize>,
    /// Most blocks per routed request (more: 413).
    #[arg(long, env = "KVROUTER_MAX_REQUEST_BLOCKS")]
    max_request_blocks: Option<usize>,
    /// Most active requests in all (more: 429).
    #[arg(long, env = "KVROUTER_MAX_ACTIVE_REQUESTS")]
    max_active_requests: Option<usize>,
    /// Most active requests per worker and dp rank (a full worker is skipped; all full: 429).
    #[arg(long, env = "KVROUTER_MAX_ACTIVE_PER_WORKER")]
    max_active_per_worker: Option<usize>,
    /// Most blocks all active requests hold together (more: 429).
    #[arg(long, env = "KVROUTER_MAX_ACTIVE_BLOCKS")]
    max_active_blocks: Option<u64>,
    /// Longest request id, bytes (longer: 400).
    #[arg(long, env = "KVROUTER_MAX_REQUEST_ID_BYTES")]
    max_request_id_bytes: Option<usize>,
    /// Most open connections on the API listener (more: 503 and closed).
    #[arg(long, env = "KVROUTER_MAX_CONNECTIONS")]
    max_connections: Option<usize>,
    /// Seconds for a request's whole header block to arrive (else 408).
    #[arg(long, env = "KVROUTER_HEADER_TIMEOUT_SECS")]
    header_timeout_secs: Option<u64>,
    /// Seconds for a request's whole body to arrive after its headers (else 408); also
    /// the limit for writing a response.
    #[arg(long, env = "KVROUTER_BODY_TIMEOUT_SECS")]
    body_timeout_secs: Option<u64>,
    /// Seconds a keep-alive connection may idle between requests.
    #[arg(long, env = "KVROUTER_IDLE_TIMEOUT_SECS")]
    idle_timeout_secs: Option<u64>,
    /// Release requests not heard of for this many seconds.
    #[arg(long, env = "KVROUTER_STALE_AFTER_SECS")]
    stale_after_secs: Option<u64>,
    /// Remove workers silent for this many seconds (workers without announcements).
    #[arg(long, env = "KVROUTER_SILENCE_TIMEOUT_SECS")]
    silence_timeout_secs: Option<u64>,
    /// Seed of tie-breaking and sampling.
    #[arg(long, env = "KVROUTER_SEED")]
    seed: Option<u64>,
    /// Workers to route to from the start (`worker_id` or `worker_id/dp_rank`, comma list).
    #[arg(long, env = "KVROUTER_WORKERS", value_delimiter = ',')]
    workers: Option<Vec<String>>,
    /// Credit per cached device block.
    #[arg(long, env = "KVROUTER_OVERLAP_SCORE_CREDIT")]
    overlap_score_credit: Option<f64>,
    /// Weight of prefill load against decode load.
    #[arg(long, env = "KVROUTER_PREFILL_LOAD_SCALE")]
    prefill_load_scale: Option<f64>,
    /// Extra weight of each block a request would prefill from scratch (0: Dynamo's formula).
    #[arg(long, env = "KVROUTER_NEW_BLOCK_WEIGHT")]
    new_block_weight: Option<f64>,
    /// Credit per block continuing the device prefix in host memory (Dynamo's default 0.75).
    #[arg(long, env = "KVROUTER_HOST_CACHE_HIT_WEIGHT")]
    host_cache_hit_weight: Option<f64>,
    /// Credit per block continuing it on disk or external storage (Dynamo's default 0.25).
    #[arg(long, env = "KVROUTER_DISK_CACHE_HIT_WEIGHT")]
    disk_cache_hit_weight: Option<f64>,
    /// Credit per shared-pool block beyond the worker's own (Dynamo without a shared cache: 0).
    #[arg(long, env = "KVROUTER_SHARED_CACHE_MULTIPLIER")]
    shared_cache_multiplier: Option<f64>,
    /// Who reads a shared pool: `SOURCE=WORKER[,WORKER...]` (worker ids), repeatable; in
    /// the environment, rules separated by `;`. A pool without a rule is read by every
    /// worker.
    #[arg(long, env = "KVROUTER_POOL_READERS", value_delimiter = ';')]
    pool_readers: Option<Vec<String>>,
    /// Softmax temperature (0: lowest cost).
    #[arg(long, env = "KVROUTER_TEMPERATURE")]
    temperature: Option<f64>,
    /// What the cost counts: `blocks` (the block formula, default) or `time` (predicted
    /// TTFT from prefill times learned online per worker; experimental, see OPERATIONS).
    #[arg(long, env = "KVROUTER_COST_FORMULA")]
    cost_formula: Option<Formula>,
    /// Credit the prefix a worker's active requests hold as cached when it is longer than
    /// what its KV events have shown yet.
    #[arg(long, env = "KVROUTER_CREDIT_INFLIGHT")]
    credit_inflight: Option<bool>,
    /// The fresh-block charge grows by this times the least prefill queued on any worker
    /// over the request's own blocks (0: a fixed charge).
    #[arg(long, env = "KVROUTER_SATURATION_WEIGHT")]
    saturation_weight: Option<f64>,
    /// Weight of the delay a request's uncached prefill adds to the requests expected to
    /// return to a worker while it runs (0: off).
    #[arg(long, env = "KVROUTER_RETURN_WEIGHT")]
    return_weight: Option<f64>,
    /// Decay window of each worker's rate of returning requests, seconds.
    #[arg(long, env = "KVROUTER_RETURN_WINDOW_SECS")]
    return_window_secs: Option<f64>,
    /// With `--cost-formula time`: weight of the delay a prefill adds to each request
    /// decoding on the candidate.
    #[arg(long, env = "KVROUTER_DECODE_DELAY_WEIGHT")]
    decode_delay_weight: Option<f64>,
    /// Herd resistance: power of two choices among the k cheapest (0: off).
    #[arg(long, env = "KVROUTER_HERD_K")]
    herd_k: Option<usize>,
    /// Also remember our own decisions this long, seconds, and credit a worker with the
    /// longer of its KV events' prefix and the remembered one: sessions stay where they
    /// were when the index shows their blocks evicted (0: off; see OPERATIONS).
    #[arg(long, env = "KVROUTER_REMEMBER_DECISIONS_SECS")]
    remember_decisions_secs: Option<u64>,
    /// How a worker is picked: `kv` (the cost function, default), or a cache-blind
    /// baseline: `round-robin`, `random`, `least-loaded` (Dynamo's `--router-mode`).
    #[arg(long, env = "KVROUTER_ROUTER_MODE")]
    router_mode: Option<Selection>,
    /// Busy threshold: most active decode blocks per worker.
    #[arg(long, env = "KVROUTER_MAX_ACTIVE_DECODE_BLOCKS")]
    max_active_decode_blocks: Option<u64>,
    /// Busy threshold: most active prefill tokens per worker.
    #[arg(long, env = "KVROUTER_MAX_ACTIVE_PREFILL_TOKENS")]
    max_active_prefill_tokens: Option<u64>,
    /// Serve the OpenAI-compatible front on this address (absent: not served).
    #[arg(long, env = "KVROUTER_OPENAI_LISTEN")]
    openai_listen: Option<SocketAddr>,
    /// A model the front serves, repeated: `NAME=DIR` (DIR holds tokenizer.json and
    /// tokenizer_config.json).
    #[arg(long = "model", env = "KVROUTER_MODELS", value_delimiter = ';')]
    models: Option<Vec<String>>,
    /// A LoRA adapter the front serves, repeated: `ADAPTER=BASE` (BASE a `--model` name):
    /// requests naming ADAPTER use BASE's card, go to the engines unchanged, and hash their
    /// blocks with the adapter's name, as the engines' KV events do.
    #[arg(long = "lora", env = "KVROUTER_LORAS", value_delimiter = ';')]
    loras: Option<Vec<String>>,
    /// A worker's OpenAI base URL, repeated: `WORKER_ID=http://HOST:PORT` (ZMQ engines
    /// give theirs with `url=`).
    #[arg(
        long = "worker-url",
        env = "KVROUTER_WORKER_URLS",
        value_delimiter = ';'
    )]
    worker_urls: Option<Vec<String>>,
    /// Send every request to this Dynamo frontend (`--router-mode direct`) instead, naming
    /// the chosen worker in `nvext`.
    #[arg(long, env = "KVROUTER_DYNAMO_FRONTEND")]
    dynamo_frontend: Option<String>,
    /// Retries on another worker before a response's first byte.
    #[arg(long, env = "KVROUTER_PROXY_RETRIES")]
    proxy_retries: Option<u32>,
    /// Milliseconds to connect to an engine.
    #[arg(long, env = "KVROUTER_UPSTREAM_CONNECT_TIMEOUT_MS")]
    upstream_connect_timeout_ms: Option<u64>,
    /// Seconds from sending a request to an engine to its response's headers.
    #[arg(long, env = "KVROUTER_UPSTREAM_FIRST_BYTE_TIMEOUT_SECS")]
    upstream_first_byte_timeout_secs: Option<u64>,
    /// Seconds an engine may stay silent in the middle of an answer.
    #[arg(long, env = "KVROUTER_UPSTREAM_IDLE_TIMEOUT_SECS")]
    upstream_idle_timeout_secs: Option<u64>,
    /// Largest body the front accepts, bytes.
    #[arg(long, env = "KVROUTER_OPENAI_MAX_BODY_BYTES")]
    openai_max_body_bytes: Option<usize>,
    /// Threads tokenising the front's requests off its executor (0: inline).
    #[arg(long, env = "KVROUTER_TOKENIZER_THREADS")]
    tokenizer_threads: Option<usize>,
    /// Bodies of at most this many bytes are tokenised inline on the front's executor
    /// (those over 512 bytes only while inline encoding is not busy).
    #[arg(long, env = "KVROUTER_INLINE_TOKENIZE_BYTES")]
    inline_tokenize_bytes: Option<usize>,
    /// MiB of prompt pieces kept encoded, in all, split evenly between the distinct model
    /// cards (0: encode every prompt whole). A session's next turn then encodes only its
    /// new messages.
    #[arg(long, env = "KVROUTER_TOKENIZE_CACHE_MIB")]
    tokenize_cache_mib: Option<usize>,
    /// Session affinity: a header naming the session, besides `X-Dynamo-Session-ID`.
    #[arg(long, env = "KVROUTER_SESSION_HEADER")]
    session_header: Option<String>,
    /// Seconds a session stays bound to its worker after its last request (0: off).
    #[arg(long, env = "KVROUTER_SESSION_TTL_SECS")]
    session_ttl_secs: Option<u64>,
    /// Share session bindings with the other replicas (with replica sync on), so a session
    /// stays on its worker whichever replica its requests reach.
    #[arg(long, env = "KVROUTER_SESSION_SYNC")]
    session_sync: Option<bool>,
    /// Most sessions bound at once (a new session past it is routed by the cost alone).
    #[arg(long, env = "KVROUTER_MAX_SESSIONS")]
    max_sessions: Option<usize>,
}

/// The effective configuration (also the TOML file's schema).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(crate) struct ServeConfig {
    /// Logged without any credentials it holds.
    #[serde(serialize_with = "redacted_url")]
    nats: String,
    /// Engines on the vLLM-native ZMQ wire (TOML `[[engines]]`, or `--zmq-engine`).
    engines: Vec<EngineEntry>,
    dynamo_discovery: Option<String>,
    #[serde(skip_serializing)]
    nats_token: Option<String>,
    nats_user: Option<String>,
    #[serde(skip_serializing)]
    nats_password: Option<String>,
    listen: SocketAddr,
    namespace: String,
    component: String,
    endpoint: String,
    block_size: u32,
    kv_events: bool,
    replica_sync: bool,
    durable_kv_events: bool,
    stream_name: Option<String>,
    stream_max_age_secs: u64,
    consumer_name: Option<String>,
    snapshot_dir: Option<PathBuf>,
    snapshot_interval_secs: u64,
    snapshot_on_stop: bool,
    router_id: u64,
    shards: usize,
    cpus: Vec<usize>,
    #[serde(skip_serializing)]
    auth_token: Option<String>,
    max_body_bytes: usize,
    max_request_blocks: usize,
    max_active_requests: usize,
    max_active_per_worker: usize,
    max_active_blocks: u64,
    max_request_id_bytes: usize,
    max_connections: usize,
    header_timeout_secs: u64,
    body_timeout_secs: u64,
    idle_timeout_secs: u64,
    stale_after_secs: u64,
    silence_timeout_secs: u64,
    seed: u64,
    workers: Vec<String>,
    overlap_score_credit: f64,
    prefill_load_scale: f64,
    new_block_weight: f64,
    host_cache_hit_weight: f64,
    disk_cache_hit_weight: f64,
    shared_cache_multiplier: f64,
    pool_readers: Vec<String>,
    temperature: f64,
    cost_formula: Formula,
    credit_inflight: bool,
    saturation_weight: f64,
    return_weight: f64,
    return_window_secs: f64,
    decode_delay_weight: f64,
    /// With `cost_formula = "time"`: the prefill model of a worker not yet observed
    /// (TOML only).
    prefill_prior: Prior,
    herd_k: usize,
    router_mode: Selection,
    remember_decisions_secs: u64,
    max_active_decode_blocks: Option<u64>,
    max_active_prefill_tokens: Option<u64>,
    openai_listen: Option<SocketAddr>,
    models: Vec<String>,
    loras: Vec<String>,
    #[serde(serialize_with = "redacted_urls")]
    worker_urls: Vec<String>,
    #[serde(serialize_with = "redacted_opt_url")]
    dynamo_frontend: Option<String>,
    proxy_retries: u32,
    upstream_connect_timeout_ms: u64,
    upstream_first_byte_timeout_secs: u64,
    upstream_idle_timeout_secs: u64,
    openai_max_body_bytes: usize,
    tokenizer_threads: usize,
    inline_tokenize_bytes: usize,
    tokenize_cache_mib: usize,
    session_header: Option<String>,
    session_ttl_secs: u64,
    session_sync: bool,
    max_sessions: usize,
}

impl Default for ServeConfig {
    fn default() -> Self {
        let cost = CostConfig::default();
        let (http, limits) = (HttpConfig::default(), Limits::default());
        let proxy = ProxyConfig::default();
        Self {
            nats: "nats://127.0.0.1:4222".into(),
            engines: Vec::new(),
            dynamo_discovery: None,
            nats_token: None,
            nats_user: None,
            nats_password: None,
            listen: "127.0.0.1:8080".parse().expect("valid"),
            namespace: "dynamo".into(),
            component: "backend".into(),
            endpoint: "generate".into(),
            block_size: 64,
            kv_events: true,
            replica_sync: true,
            durable_kv_events: false,
            stream_name: None,
            stream_max_age_secs: 3600,
            consumer_name: None,
            snapshot_dir: None,
            snapshot_interval_secs: 60,
            snapshot_on_stop: true,
            router_id: 0,
            shards: 1,
            cpus: Vec::new(),
            auth_token: None,
            max_body_bytes: http.max_body_bytes,
            max_request_blocks: limits.max_blocks,
            max_active_requests: limits.max_active_requests,
            max_active_per_worker: limits.max_active_per_worker,
            max_active_blocks: limits.max_active_blocks,
            max_request_id_bytes: limits.max_request_id_bytes,
            max_connections: http.max_connections,
            header_timeout_secs: http.header_timeout.as_secs(),
            body_timeout_secs: http.body_timeout.as_secs(),
            idle_timeout_secs: http.idle_timeout.as_secs(),
            stale_after_secs: 600,
            silence_timeout_secs: 60,
            seed: 0,
            workers: Vec::new(),
            overlap_score_credit: cost.overlap_score_credit,
            prefill_load_scale: cost.prefill_load_scale,
            new_block_weight: cost.new_block_weight,
            host_cache_hit_weight: cost.host_cache_hit_weight,
            disk_cache_hit_weight: cost.disk_cache_hit_weight,
            shared_cache_multiplier: cost.shared_cache_multiplier,
            pool_readers: Vec::new(),
            temperature: cost.temperature,
            cost_formula: cost.formula,
            credit_inflight: cost.credit_inflight,
            saturation_weight: cost.saturation_weight,
            return_weight: cost.return_weight,
            return_window_secs: cost.return_window_secs,
            decode_delay_weight: CostConfig::time().decode_delay_weight,
            prefill_prior: cost.prior,
            herd_k: 0,
            router_mode: Selection::Cost,
            remember_decisions_secs: 0,
            max_active_decode_blocks: None,
            max_active_prefill_tokens: None,
            openai_listen: None,
            models: Vec::new(),
            loras: Vec::new(),
            worker_urls: Vec::new(),
            dynamo_frontend: None,
            proxy_retries: proxy.max_retries,
            upstream_connect_timeout_ms: proxy.upstream.connect_timeout.as_millis() as u64,
            upstream_first_byte_timeout_secs: proxy.upstream.first_byte_timeout.as_secs(),
            upstream_idle_timeout_secs: proxy.upstream.idle_timeout.as_secs(),
            openai_max_body_bytes: proxy.max_body_bytes,
            tokenizer_threads: proxy.tokenizer_threads,
            inline_tokenize_bytes: proxy.inline_tokenize_bytes,
            tokenize_cache_mib: proxy.piece_cache_bytes >> 20,
            session_header: None,
            session_ttl_secs: proxy.session_ttl.as_secs(),
            session_sync: proxy.session_sync,
            max_sessions: proxy.max_sessions,
        }
    }
}

/// One engine of the vLLM-native ZMQ wire, as the TOML file and `--zmq-engine` give it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct EngineEntry {
    /// Its name (and, without `id`, the source of its worker id).
    name: String,
    /// Its worker id (default: derived from the name).
    #[serde(default)]
    id: Option<u64>,
    /// Its KV-event publisher (`tcp://host:port`; a wildcard host is bound).
    events: String,
    /// Its replay socket.
    #[serde(default)]
    replay: Option<String>,
    /// First dp rank.
    #[serde(default)]
    dp_start: u32,
    /// Dp ranks (ports + 0, + 1, ...).
    #[serde(default = "one")]
    dp_size: u32,
    /// Tokens per block (default: the router's `block_size`).
    #[serde(default)]
    block_size: Option<u32>,
    /// Its OpenAI-compatible HTTP base URL.
    #[serde(default)]
    http_url: Option<String>,
}

fn one() -> u32 {
    1
}

impl EngineEntry {
    /// `NAME=ENDPOINT[,key=value...]`.
    fn parse(spec: &str) -> anyhow::Result<EngineEntry> {
        let (name, rest) = spec
            .split_once('=')
            .with_context(|| format!("--zmq-engine {spec:?}: expected NAME=tcp://HOST:PORT"))?;
        let mut parts = rest.split(',');
        let mut e = EngineEntry {
            name: name.trim().to_owned(),
            id: None,
            events: parts.next().unwrap_or_default().trim().to_owned(),
            replay: None,
            dp_start: 0,
            dp_size: 1,
            block_size: None,
            http_url: None,
        };
        for kv in parts {
            let (k, v) = kv
                .split_once('=')
                .with_context(|| format!("--zmq-engine {spec:?}: {kv:?} is not key=value"))?;
            let v = v.trim();
            let num = || -> anyhow::Result<u64> {
                v.parse()
                    .with_context(|| format!("--zmq-engine {spec:?}: {k} {v:?}"))
            };
            match k.trim() {
                "replay" => e.replay = Some(v.to_owned()),
                "dp" | "dp_size" => e.dp_size = num()? as u32,
                "dp_start" => e.dp_start = num()? as u32,
                "id" => e.id = Some(num()?),
                "block_size" => e.block_size = Some(num()? as u32),
                "url" | "http_url" => e.http_url = Some(v.to_owned()),
                other => anyhow::bail!("--zmq-engine {spec:?}: unknown key {other:?}"),
            }
        }
        if e.name.is_empty() {
            anyhow::bail!("--zmq-engine {spec:?}: the name is empty");
        }
        Ok(e)
    }

    fn engine(&self, block_size: u32) -> anyhow::Result<ZmqEngine> {
        let endpoint =
            |s: &str| Endpoint::parse(s).with_context(|| format!("engine {:?}", self.name));
        let mut e = ZmqEngine::new(
            self.name.clone(),
            endpoint(&self.events)?,
            self.block_size.unwrap_or(block_size),
        );
        if let Some(id) = self.id {
            e.worker_id = id;
        }
        e.replay = self.replay.as_deref().map(endpoint).transpose()?;
        e.dp_start = self.dp_start;
        e.dp_size = self.dp_size.max(1);
        e.http_url = self.http_url.clone();
        Ok(e)
    }
}

macro_rules! overlay {
    ($cfg:ident, $args:ident, $($field:ident),*) => {
        $( if let Some(v) = $args.$field.clone() { $cfg.$field = v; } )*
    };
}

macro_rules! overlay_opt {
    ($cfg:ident, $args:ident, $($field:ident),*) => {
        $( if let Some(v) = $args.$field.clone() { $cfg.$field = Some(v); } )*
    };
}

impl ServeConfig {
    /// Defaults < file < env < flags (clap already merged env and flags).
    pub(crate) fn resolve(args: &ServeArgs) -> anyhow::Result<ServeConfig> {
        let mut cfg = match &args.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading {}", path.display()))?;
                toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?
            }
            None => ServeConfig::default(),
        };
        if let Some(list) = &args.zmq_engines {
            cfg.engines = list
                .iter()
                .filter(|s| !s.trim().is_empty())
                .map(|s| EngineEntry::parse(s))
                .collect::<anyhow::Result<_>>()?;
        }
        overlay!(
            cfg,
            args,
            nats,
            listen,
            namespace,
            component,
            endpoint,
            block_size,
            kv_events,
            replica_sync,
            durable_kv_events,
            stream_max_age_secs,
            snapshot_interval_secs,
            snapshot_on_stop,
            router_id,
            shards,
            cpus,
            max_body_bytes,
            max_request_blocks,
            max_active_requests,
            max_active_per_worker,
            max_active_blocks,
            max_request_id_bytes,
            max_connections,
            header_timeout_secs,
            body_timeout_secs,
            idle_timeout_secs,
            stale_after_secs,
            silence_timeout_secs,
            seed,
            workers,
            overlap_score_credit,
            prefill_load_scale,
            new_block_weight,
            host_cache_hit_weight,
            disk_cache_hit_weight,
            shared_cache_multiplier,
            pool_readers,
            temperature,
            cost_formula,
            credit_inflight,
            saturation_weight,
            return_weight,
            return_window_secs,
            decode_delay_weight,
            herd_k,
            router_mode,
            remember_decisions_secs,
            models,
            loras,
            worker_urls,
            proxy_retries,
            upstream_connect_timeout_ms,
            upstream_first_byte_timeout_secs,
            upstream_idle_timeout_secs,
            openai_max_body_bytes,
            tokenizer_threads,
            inline_tokenize_bytes,
            tokenize_cache_mib,
            session_ttl_secs,
            session_sync,
            max_sessions
        );
        overlay_opt!(
            cfg,
            args,
            nats_token,
            nats_user,
            nats_password,
            auth_token,
            stream_name,
            consumer_name,
            dynamo_discovery,
            snapshot_dir,
            max_active_decode_blocks,
            max_active_prefill_tokens,
            openai_listen,
            dynamo_frontend,
            session_header
        );
        // A bad rule fails the start, before anything is connected.
        cfg.pool_readers()?;
        Ok(cfg)
    }

    /// The OpenAI front's settings, when it is on.
    fn proxy(&self, engines: &[ZmqEngine]) -> anyhow::Result<Option<ProxyConfig>> {
        let Some(listen) = self.openai_listen else {
            return Ok(None);
        };
        let models = self
            .models
            .iter()
            .map(|m| {
                let (name, dir) = m
                    .split_once('=')
                    .with_context(|| format!("--model {m:?}: expected NAME=DIR"))?;
                Ok(ModelSpec {
                    name: name.trim().to_owned(),
                    dir: PathBuf::from(dir.trim()),
                    lora_name: None,
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let mut models = models;
        for l in &self.loras {
            let (adapter, base) = l
                .split_once('=')
                .with_context(|| format!("--lora {l:?}: expected ADAPTER=BASE"))?;
            let (adapter, base) = (adapter.trim(), base.trim());
            let dir = models
                .iter()
                .find(|m| m.name == base)
                .map(|m| m.dir.clone())
                .with_context(|| format!("--lora {l:?}: {base:?} is not a --model"))?;
            anyhow::ensure!(
                !models.iter().any(|m| m.name == adapter),
                "--lora {l:?}: {adapter:?} is already served"
            );
            models.push(ModelSpec {
                name: adapter.to_owned(),
                dir,
                lora_name: Some(adapter.to_owned()),
            });
        }
        if models.is_empty() {
            anyhow::bail!("--openai-listen needs at least one --model NAME=DIR");
        }
        let backend = match &self.dynamo_frontend {
            Some(url) => Backend::DynamoDirect(
                Target::parse(url).map_err(|e| anyhow::anyhow!("--dynamo-frontend {e}"))?,
            ),
            None => {
                let mut list = Vec::new();
                for e in engines {
                    if let Some(url) = &e.http_url {
                        let t = Target::parse(url)
                            .map_err(|err| anyhow::anyhow!("engine {}: {err}", e.name))?;
                        list.push((e.worker_id, t));
                    }
                }
                for w in &self.worker_urls {
                    let (id, url) = w
                        .split_once('=')
                        .with_context(|| format!("--worker-url {w:?}: expected ID=URL"))?;
                    let id: u64 = id.trim().parse().context("--worker-url: worker id")?;
                    let t = Target::parse(url.trim())
                        .map_err(|e| anyhow::anyhow!("--worker-url {e}"))?;
                    list.retain(|(i, _)| *i != id);
                    list.push((id, t));
                }
                if list.is_empty() {
                    anyhow::bail!(
                        "--openai-listen needs engine URLs (--worker-url ID=URL, url= in --zmq-engine) or --dynamo-frontend"
                    );
                }
                Backend::Engines(list)
            }
        };
        let d = ProxyConfig::default();
        Ok(Some(ProxyConfig {
            listen,
            models,
            backend,
            upstream: UpstreamConfig {
                connect_timeout: Duration::from_millis(self.upstream_connect_timeout_ms.max(1)),
                first_byte_timeout: Duration::from_secs(
                    self.upstream_first_byte_timeout_secs.max(1),
                ),
                idle_timeout: Duration::from_secs(self.upstream_idle_timeout_secs.max(1)),
                ..UpstreamConfig::default()
            },
            max_retries: self.proxy_retries,
            max_body_bytes: self.openai_max_body_bytes,
            tokenizer_threads: self.tokenizer_threads,
            inline_tokenize_bytes: self.inline_tokenize_bytes,
            piece_cache_bytes: self.tokenize_cache_mib.saturating_mul(1 << 20),
            header_timeout: Duration::from_secs(self.header_timeout_secs.max(1)),
            body_timeout: Duration::from_secs(self.body_timeout_secs.max(1)),
            session_header: self.session_header.clone().map(|h| h.to_ascii_lowercase()),
            session_ttl: Duration::from_secs(self.session_ttl_secs),
            session_sync: self.session_sync,
            max_sessions: self.max_sessions.max(1),
            ..d
        }))
    }

    fn pool_readers(&self) -> anyhow::Result<PoolReaders> {
        let mut r = PoolReaders::new();
        for rule in self.pool_readers.iter().filter(|s| !s.trim().is_empty()) {
            r.add_rule(rule)?;
        }
        Ok(r)
    }

    fn static_workers(&self) -> anyhow::Result<Vec<WorkerDp>> {
        self.workers
            .iter()
            .map(|w| {
                let (id, dp) = w.split_once('/').unwrap_or((w, "0"));
                Ok(WorkerDp::new(
                    id.trim().parse().context("worker id")?,
                    dp.trim().parse().context("dp rank")?,
                ))
            })
            .collect()
    }
}

/// glibc's malloc gives a freed block of 128 KiB or more back to the kernel (its own
/// mapping, or a trim of the heap's top), so the next one of that size faults in fresh,
/// zeroed pages: a 65,536-block route's sequence hashes and held run are 512 KiB each, and
/// the faults were half of its cost (docs/BENCHMARKS.md, "Hostile clients"). Such blocks
/// stay in the heap instead (mmap threshold 32 MiB, glibc's largest; up to 64 MiB free at
/// the heap's top kept), unless the operator set either through the environment. A build
/// with mimalloc (the default) does not allocate through glibc: it keeps freed spans for
/// reuse itself and purges them only after a second unused.
#[cfg(all(target_os = "linux", target_env = "gnu", not(feature = "mimalloc")))]
fn keep_large_blocks_in_heap() {
    let tuned = std::env::var("GLIBC_TUNABLES").is_ok_and(|v| {
        v.contains("glibc.malloc.mmap_threshold") || v.contains("glibc.malloc.trim_threshold")
    }) || std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_some()
        || std::env::var_os("MALLOC_TRIM_THRESHOLD_").is_some();
    if tuned {
        return;
    }
    // SAFETY: `mallopt` sets two of the allocator's parameters under its own lock; no
    // pointer is passed and nothing allocated so far is affected.
    let ok = unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20) == 1
            && libc::mallopt(libc::M_TRIM_THRESHOLD, 64 << 20) == 1
    };
    if !ok {
        tracing::warn!(
            "malloc's thresholds could not be set: large blocks are unmapped when freed"
        );
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu", not(feature = "mimalloc"))))]
fn keep_large_blocks_in_heap() {}

pub(crate) fn run(args: ServeArgs) -> anyhow::Result<ExitCode> {
    let args_stop_on_eof = args.stop_on_stdin_eof;
    let mut cfg = ServeConfig::resolve(&args)?;
    let fd_limit = raise_fd_limit();
    keep_large_blocks_in_heap();
    let cost = CostConfig {
        overlap_score_credit: cfg.overlap_score_credit,
        prefill_load_scale: cfg.prefill_load_scale,
        new_block_weight: cfg.new_block_weight,
        host_cache_hit_weight: cfg.host_cache_hit_weight,
        disk_cache_hit_weight: cfg.disk_cache_hit_weight,
        shared_cache_multiplier: cfg.shared_cache_multiplier,
        temperature: cfg.temperature,
        herd: if cfg.herd_k > 0 {
            Herd::PowerOfTwo { k: cfg.herd_k }
        } else {
            Herd::Off
        },
        max_active_decode_blocks: cfg.max_active_decode_blocks,
        max_active_prefill_tokens: cfg.max_active_prefill_tokens,
        formula: cfg.cost_formula,
        credit_inflight: cfg.credit_inflight,
        saturation_weight: cfg.saturation_weight,
        return_weight: cfg.return_weight,
        return_window_secs: cfg.return_window_secs,
        decode_delay_weight: cfg.decode_delay_weight,
        prior: cfg.prefill_prior,
    };
    cost.check().context("invalid cost weights")?;
    if cfg.durable_kv_events && !cfg.kv_events {
        anyhow::bail!("--durable-kv-events needs --kv-events true");
    }
    let nats_on = !matches!(cfg.nats.trim(), "" | "off" | "none");
    if !nats_on && cfg.durable_kv_events {
        anyhow::bail!("--durable-kv-events needs NATS (--nats is off)");
    }
    if !nats_on && cfg.replica_sync {
        tracing::info!("--nats off: replica sync is off too");
        cfg.replica_sync = false;
    }
    let engines: Vec<ZmqEngine> = cfg
        .engines
        .iter()
        .map(|e| e.engine(cfg.block_size))
        .collect::<anyhow::Result<_>>()?;
    let proxy = cfg.proxy(&engines)?;
    let discovery = cfg
        .dynamo_discovery
        .as_deref()
        .map(|d| dynamo_discovery(d, std::env::var("ETCD_ENDPOINTS").ok().as_deref()))
        .transpose()?;
    let random_id = cfg.router_id == 0;
    if cfg.router_id == 0 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let seed = [std::process::id() as u64, nanos]
            .map(u64::to_le_bytes)
            .concat();
        cfg.router_id = (xxhash_rust::xxh3::xxh3_64(&seed) >> 11) | 1;
    }
    if cfg.durable_kv_events {
        let stream = cfg
            .stream_name
            .get_or_insert_with(|| sanitize(&format!("kvrouter-events-{}", cfg.namespace)));
        if !valid_name(stream) {
            anyhow::bail!("invalid stream name {stream:?} (letters, digits, '-' and '_')");
        }
        let consumer = cfg.consumer_name.get_or_insert_with(|| {
            if random_id {
                let host = std::fs::read_to_string("/etc/hostname")
                    .ok()
                    .or_else(|| std::env::var("HOSTNAME").ok())
                    .unwrap_or_else(|| "host".into());
                sanitize(&format!("kvrouter-{}", host.trim()))
            } else {
                format!("kvrouter-{:x}", cfg.router_id)
            }
        });
        if !valid_name(consumer) {
            anyhow::bail!("invalid consumer name {consumer:?} (letters, digits, '-' and '_')");
        }
    }
    tracing::info!(config = %serde_json::to_string(&cfg).unwrap_or_default(), "effective configuration");
    let subjects = Subjects {
        namespace: cfg.namespace.clone(),
        component: cfg.component.clone(),
        endpoint: cfg.endpoint.clone(),
    };
    let nats = Options {
        servers: vec![cfg.nats.clone()],
        token: cfg.nats_token.clone(),
        user: cfg.nats_user.clone(),
        password: cfg.nats_password.clone(),
        name: format!("kvrouter-{:x}", cfg.router_id),
        max_reconnects: None,
        ..Options::default()
    };
    let ingest = if cfg.kv_events {
        Some(
            Ingest::start(IngestConfig {
                nats: nats_on.then(|| nats.clone()),
                zmq_engines: engines,
                dynamo_discovery: discovery,
                subjects: subjects.clone(),
                shards: cfg.shards,
                cpus: cfg.cpus.iter().skip(1).copied().collect(),
                silence_timeout: Duration::from_secs(cfg.silence_timeout_secs),
                router_id: cfg.router_id,
                snapshot: cfg.snapshot_dir.clone().map(|dir| SnapshotConfig {
                    dir,
                    interval: (cfg.snapshot_interval_secs > 0)
                        .then(|| Duration::from_secs(cfg.snapshot_interval_secs)),
                    on_stop: cfg.snapshot_on_stop,
                }),
                durable: cfg.durable_kv_events.then(|| DurableConfig {
                    max_age: (cfg.stream_max_age_secs > 0)
                        .then(|| Duration::from_secs(cfg.stream_max_age_secs)),
                    ..DurableConfig::new(
                        cfg.stream_name.clone().unwrap_or_default(),
                        cfg.consumer_name.clone().unwrap_or_default(),
                    )
                }),
                ..IngestConfig::default()
            })
            .context("starting the KV-event ingest")?,
        )
    } else {
        None
    };
    let rcfg = RouterConfig {
        listen: cfg.listen,
        http: HttpConfig {
            max_body_bytes: cfg.max_body_bytes,
            max_connections: connection_cap(cfg.max_connections, fd_limit),
            header_timeout: Duration::from_secs(cfg.header_timeout_secs.max(1)),
            body_timeout: Duration::from_secs(cfg.body_timeout_secs.max(1)),
            write_timeout: Duration::from_secs(cfg.body_timeout_secs.max(1)),
            idle_timeout: Duration::from_secs(cfg.idle_timeout_secs.max(1)),
            ..HttpConfig::default()
        },
        limits: Limits {
            max_blocks: cfg.max_request_blocks,
            max_active_requests: cfg.max_active_requests,
            max_active_per_worker: cfg.max_active_per_worker,
            max_active_blocks: cfg.max_active_blocks,
            max_request_id_bytes: cfg.max_request_id_bytes,
        },
        block_size: cfg.block_size,
        cost,
        selection: cfg.router_mode,
        remember_ms: cfg.remember_decisions_secs.saturating_mul(1000),
        kv_events: cfg.kv_events,
        replica_sync: cfg.replica_sync,
        router_id: cfg.router_id,
        subjects,
        nats,
        stale_after: Duration::from_secs(cfg.stale_after_secs),
        auth_token: cfg.auth_token.clone(),
        seed: cfg.seed,
        static_workers: cfg.static_workers()?,
        pool_readers: cfg.pool_readers()?,
        proxy,
        ..RouterConfig::default()
    };
    let api = router::start(
        rcfg,
        ingest.as_ref().map(Ingest::view),
        cfg.cpus.first().copied(),
        512 << 10,
    )
    .context("starting the routing API")?;
    // Both lines in one write, and a closed stdout ignored: a supervisor that read the
    // address and closed the pipe must not kill the router (println! would panic on EPIPE).
    let mut banner = format!("kvrouter serving on http://{}\n", api.addr());
    if let Some(a) = api.proxy_addr() {
        banner.push_str(&format!("kvrouter OpenAI front on http://{a}\n"));
    }
    {
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(banner.as_bytes()).and_then(|()| out.flush());
    }
    // Stop cleanly on SIGTERM / SIGINT: the API first, then the ingest (which writes its
    // snapshot on stop).
    let mut signals = signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGINT,
    ])
    .context("installing signal handlers")?;
    if args_stop_on_eof {
        std::thread::spawn(|| {
            // `copy` retries interrupted reads: only the end of the pipe (or a broken one)
            // returns.
            let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
            tracing::info!("stdin closed: stopping");
            let _ = signal_hook::low_level::raise(signal_hook::consts::SIGTERM);
        });
    }
    if let Some(sig) = signals.forever().next() {
        tracing::info!(signal = sig, "stopping (a second signal exits at once)");
    }
    std::thread::spawn(move || {
        if signals.forever().next().is_some() {
            tracing::warn!("second signal: exiting without a clean stop");
            std::process::exit(130);
        }
    });
    api.stop();
    if let Some(ingest) = ingest {
        ingest.stop();
    }
    Ok(ExitCode::SUCCESS)
}

/// Raises the soft limit of open files to the hard one (systemd's default soft limit is
/// 1,024, a shell's often 256: a few hundred clients would lock the rest out); returns the
/// limit now in force.
fn raise_fd_limit() -> u64 {
    use rlimit::Resource;
    let Ok((soft, hard)) = rlimit::getrlimit(Resource::NOFILE) else {
        return 1024;
    };
    // An unlimited hard limit still stops at the kernel's `nr_open`.
    let target = if hard == u64::MAX {
        std::fs::read_to_string("/proc/sys/fs/nr_open")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(1 << 20)
    } else {
        hard
    };
    if soft >= target {
        return soft;
    }
    match rlimit::setrlimit(Resource::NOFILE, target, hard) {
        Ok(()) => {
            tracing::info!(from = soft, to = target, "open-file limit raised");
            target
        }
        Err(e) => {
            tracing::warn!(error = %e, limit = soft, "could not raise the open-file limit");
            soft
        }
    }
}

/// The connection cap, lowered to leave descriptors for everything else when the
/// open-file limit would not hold it (past the limit, accepting fails for every client
/// instead of refusing the extra ones).
fn connection_cap(wanted: usize, fd_limit: u64) -> usize {
    const RESERVE: u64 = 128;
    let room = fd_limit.saturating_sub(RESERVE).max(16) as usize;
    if wanted > room {
        tracing::warn!(
            wanted,
            cap = room,
            fd_limit,
            "--max-connections lowered to fit the open-file limit"
        );
        return room;
    }
    wanted
}

/// The NATS URL without its user info, for the effective-configuration line.
fn redacted_urls<S: serde::Serializer>(urls: &[String], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(urls.iter().map(|u| kvrouter_io::nats::redact(u)))
}

fn redacted_opt_url<S: serde::Serializer>(url: &Option<String>, s: S) -> Result<S::Ok, S::Error> {
    match url {
        Some(u) => s.serialize_some(&kvrouter_io::nats::redact(u)),
        None => s.serialize_none(),
    }
}

fn redacted_url<S: serde::Serializer>(url: &str, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&kvrouter_io::nats::redact(url))
}

fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 255
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engines_from_flags_and_toml() {
        let e = EngineEntry::parse(
            "vllm-0=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558,dp=2,id=42,url=http://10.0.0.5:8000",
        )
        .unwrap();
        let z = e.engine(16).unwrap();
        assert_eq!(
            (z.name.as_str(), z.worker_id, z.dp_size, z.block_size),
            ("vllm-0", 42, 2, 16)
        );
        assert_eq!(z.replay.unwrap().addr, "10.0.0.5:5558");
        assert_eq!(z.http_url.as_deref(), Some("http://10.0.0.5:8000"));
        let bound = EngineEntry::parse("sglang=tcp://*:5600")
            .unwrap()
            .engine(64)
            .unwrap();
        assert!(bound.events.wildcard);
        assert_eq!(bound.worker_id, ZmqEngine::id_of("sglang"));
        for bad in [
            "noequals",
            "=tcp://h:1",
            "a=tcp://h:1,dp",
            "a=tcp://h:1,colour=red",
        ] {
            assert!(EngineEntry::parse(bad).is_err(), "{bad}");
        }
        assert!(EngineEntry::parse("a=nope").unwrap().engine(16).is_err());
        let cfg: ServeConfig = toml::from_str(
            r#"
            nats = "off"
            dynamo_discovery = "file:/var/lib/dynamo"
            [[engines]]
            name = "a"
            events = "tcp://127.0.0.1:5557"
            dp_size = 4
            [[engines]]
            name = "b"
            id = 7
            events = "tcp://*:5600"
            block_size = 32
            "#,
        )
        .unwrap();
        assert_eq!(cfg.engines.len(), 2);
        assert_eq!(cfg.engines[1].engine(16).unwrap().block_size, 32);
        assert!(
            toml::from_str::<ServeConfig>("[[engines]]\nname = \"a\"\nevents = \"x\"\nport = 1\n")
                .is_err()
        );
    }

    #[test]
    fn a_lora_adapter_is_served_with_its_base_models_card() {
        let cfg: ServeConfig = toml::from_str(
            r#"
            openai_listen = "127.0.0.1:0"
            models = ["tiny=/cards/tiny"]
            loras = ["tiny-sql=tiny"]
            worker_urls = ["1=http://127.0.0.1:9"]
            "#,
        )
        .unwrap();
        let p = cfg.proxy(&[]).unwrap().unwrap();
        let sql = p.models.iter().find(|m| m.name == "tiny-sql").unwrap();
        assert_eq!(sql.dir, PathBuf::from("/cards/tiny"));
        assert_eq!(sql.lora_name.as_deref(), Some("tiny-sql"));
        assert_eq!(p.models[0].lora_name, None);
        for bad in [r#"["x=nope"]"#, r#"["tiny=tiny"]"#, r#"["no-equals"]"#] {
            let cfg: ServeConfig = toml::from_str(&format!(
                "openai_listen = \"127.0.0.1:0\"\nmodels = [\"tiny=/c\"]\nloras = {bad}\nworker_urls = [\"1=http://127.0.0.1:9\"]"
            ))
            .unwrap();
            assert!(cfg.proxy(&[]).is_err(), "{bad}");
        }
    }

    #[test]
    fn session_settings_from_toml_and_flags() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            serve: ServeArgs,
        }
        let front = "openai_listen = \"127.0.0.1:0\"\nmodels = [\"tiny=/c\"]\nworker_urls = [\"1=http://127.0.0.1:9\"]\n";
        let cfg: ServeConfig = toml::from_str(front).unwrap();
        let p = cfg.proxy(&[]).unwrap().unwrap();
        assert_eq!(
            (p.session_sync, p.max_sessions, p.session_ttl.as_secs()),
            (true, 100_000, 600)
        );
        let cfg: ServeConfig = toml::from_str(&format!(
            "{front}session_sync = false\nmax_sessions = 5000\nsession_ttl_secs = 60\n"
        ))
        .unwrap();
        let p = cfg.proxy(&[]).unwrap().unwrap();
        assert_eq!(
            (p.session_sync, p.max_sessions, p.session_ttl.as_secs()),
            (false, 5000, 60)
        );
        let cli = Cli::try_parse_from([
            "x",
            "--openai-listen",
            "127.0.0.1:0",
            "--model",
            "tiny=/c",
            "--worker-url",
            "1=http://127.0.0.1:9",
            "--session-sync",
            "false",
            "--max-sessions",
            "7",
        ])
        .unwrap();
        let p = ServeConfig::resolve(&cli.serve)
            .unwrap()
            .proxy(&[])
            .unwrap()
            .unwrap();
        assert_eq!((p.session_sync, p.max_sessions), (false, 7));
    }

    #[test]
    fn dynamo_discovery_is_a_file_tree_or_etcd_endpoints() {
        assert_eq!(
            dynamo_discovery("file:/var/lib/dynamo", None).unwrap(),
            DynamoDiscovery::File(PathBuf::from("/var/lib/dynamo"))
        );
        let etcd = |spec: &str, env: Option<&str>| match dynamo_discovery(spec, env).unwrap() {
            DynamoDiscovery::Etcd(t) => t.iter().map(|t| t.addr.to_string()).collect::<Vec<_>>(),
            other => panic!("{other:?}"),
        };
        assert_eq!(
            etcd("etcd:http://127.0.0.1:2379,http://127.0.0.2:2380", None),
            ["127.0.0.1:2379", "127.0.0.2:2380"]
        );
        // `etcd` alone: Dynamo's ETCD_ENDPOINTS, else its default.
        assert_eq!(
            etcd("etcd", Some("http://127.0.0.3:1234")),
            ["127.0.0.3:1234"]
        );
        assert!(etcd("etcd", None)[0].ends_with(":2379"));
        for bad in [
            "etcd:https://127.0.0.1:2379",
            "etcd:",
            "consul:x",
            "/var/lib/dynamo",
        ] {
            assert!(dynamo_discovery(bad, None).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_cost_formula_from_toml_and_flags() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            serve: ServeArgs,
        }
        let d = ServeConfig::default();
        assert_eq!((d.cost_formula, d.credit_inflight), (Formula::Blocks, true));
        let cfg: ServeConfig = toml::from_str(
            r#"
            cost_formula = "time"
            credit_inflight = false
            decode_delay_weight = 0.5
            [prefill_prior]
            ms_per_ktoken = 60.0
            "#,
        )
        .unwrap();
        assert_eq!(cfg.cost_formula, Formula::Time);
        assert!(!cfg.credit_inflight);
        assert_eq!(cfg.decode_delay_weight, 0.5);
        assert_eq!(cfg.prefill_prior.ms_per_ktoken, 60.0);
        assert_eq!(cfg.prefill_prior.base_ms, Prior::default().base_ms);
        assert!(toml::from_str::<ServeConfig>("cost_formula = \"tokens\"").is_err());
        assert!(toml::from_str::<ServeConfig>("[prefill_prior]\nbase = 1.0").is_err());
        // Flags over the defaults.
        let cli = Cli::try_parse_from([
            "x",
            "--cost-formula",
            "time",
            "--credit-inflight",
            "false",
            "--decode-delay-weight",
            "2",
        ])
        .unwrap();
        let cfg = ServeConfig::resolve(&cli.serve).unwrap();
        assert_eq!(
            (
                cfg.cost_formula,
                cfg.credit_inflight,
                cfg.decode_delay_weight
            ),
            (Formula::Time, false, 2.0)
        );
        assert!(Cli::try_parse_from(["x", "--cost-formula", "tokens"]).is_err());
    }

    #[test]
    fn the_router_mode_from_toml_and_flags() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            serve: ServeArgs,
        }
        assert_eq!(ServeConfig::default().router_mode, Selection::Cost);
        let cfg: ServeConfig = toml::from_str("router_mode = \"round-robin\"").unwrap();
        assert_eq!(cfg.router_mode, Selection::RoundRobin);
        assert!(toml::from_str::<ServeConfig>("router_mode = \"fastest\"").is_err());
        for (name, mode) in [
            ("kv", Selection::Cost),
            ("random", Selection::Random),
            ("least-loaded", Selection::LeastLoaded),
        ] {
            let cli = Cli::try_parse_from(["x", "--router-mode", name]).unwrap();
            assert_eq!(ServeConfig::resolve(&cli.serve).unwrap().router_mode, mode);
        }
        assert!(Cli::try_parse_from(["x", "--router-mode", "kv-aware"]).is_err());
        assert_eq!(ServeConfig::default().remember_decisions_secs, 0);
        let cli = Cli::try_parse_from(["x", "--remember-decisions-secs", "600"]).unwrap();
        let cfg = ServeConfig::resolve(&cli.serve).unwrap();
        assert_eq!(cfg.remember_decisions_secs, 600);
    }

    #[test]
    fn pool_readers_from_toml_and_flags() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            serve: ServeArgs,
        }
        assert!(ServeConfig::default().pool_readers().unwrap().is_empty());
        let cfg: ServeConfig = toml::from_str("pool_readers = [\"9=1,2\", \"10=3\"]").unwrap();
        let r = cfg.pool_readers().unwrap();
        assert_eq!(
            (r.readers(9), r.readers(10)),
            (Some(&[1, 2][..]), Some(&[3][..]))
        );
        let cli = Cli::try_parse_from(["x", "--pool-readers", "9=1", "--pool-readers", "10=2,3"])
            .unwrap();
        let r = ServeConfig::resolve(&cli.serve)
            .unwrap()
            .pool_readers()
            .unwrap();
        assert_eq!(
            (r.readers(9), r.readers(10)),
            (Some(&[1][..]), Some(&[2, 3][..]))
        );
        // The environment's form: rules separated by `;`.
        let cli = Cli::try_parse_from(["x", "--pool-readers", "9=1;10=2,3"]).unwrap();
        let r = ServeConfig::resolve(&cli.serve)
            .unwrap()
            .pool_readers()
            .unwrap();
        assert_eq!(r.readers(10), Some(&[2, 3][..]));
        // A bad rule fails the start with the rule named.
        for bad in ["9", "9=a", "9=1;9=2"] {
            let cli = Cli::try_parse_from(["x", "--pool-readers", bad]).unwrap();
            let e = ServeConfig::resolve(&cli.serve).unwrap_err();
            assert!(e.to_string().contains("pool readers"), "{e}");
        }
    }
}
