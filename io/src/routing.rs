//! What a front asks of the routing state: the seam between the routing API's executor
//! state ([`crate::router`], which implements [`Routing`]) and the fronts that route
//! through it (the routing API's own endpoints, the OpenAI proxy in [`crate::proxy`]).
//!
//! It lives below both so that the layers point one way: the router owns the state and
//! starts the proxy; the proxy sees the state only through this trait and never imports
//! the router.

use kvrouter_core::decision::{DecideError, Decision};
use kvrouter_core::hash::LocalBlockHash;
use kvrouter_core::slots::SlotError;
use kvrouter_core::worker::WorkerDp;

use crate::http::Response;

/// What a front asks of [`Routing::decide`].
#[derive(Debug, Clone)]
pub(crate) struct Ask<'a> {
    /// The request's local block hashes.
    pub(crate) locals: &'a [LocalBlockHash],
    /// Its prompt tokens.
    pub(crate) tokens: u64,
    /// Its id (`None`: one is made up).
    pub(crate) request_id: Option<&'a str>,
    /// Its LoRA adapter (replica sync names it).
    pub(crate) lora_name: Option<String>,
    /// Keep every candidate's cost terms.
    pub(crate) explain: bool,
}

/// What a front reports of an active request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Update {
    /// Its first token came: its prefill is done.
    FirstToken,
    /// It finished (answered, failed, or its client left).
    Free,
}

/// The routing state as a front sees it: one executor owns it (no locks), every front on
/// that executor borrows it per call.
pub(crate) trait Routing {
    /// The one decision every front makes (`/v1/route`, the OpenAI proxy): `workers`
    /// (sorted, distinct) are the candidates; the request becomes active on the worker
    /// chosen and, with replica sync, the other replicas hear of it.
    fn decide(&mut self, ask: Ask<'_>, workers: &[WorkerDp]) -> Result<Decision, DecideError>;

    /// Finishes what the last decision left until its answer was out (its slot insert,
    /// `Decider::settle`); a front calls it once the answer is sent (the routing API) or
    /// the request is forwarded (the proxy). Any later call into the state does it anyway.
    fn settle(&mut self);

    /// The answer to a decision that was refused, counted by its cause.
    fn refusal(&mut self, e: &DecideError) -> Response;

    /// A request's prefill is done or it finished, as every front reports it; the other
    /// replicas hear of it.
    fn update(&mut self, id: &str, update: Update) -> Result<WorkerDp, SlotError>;

    /// The candidates of a decision now: every known worker, less those in `exclude`.
    fn candidates(&mut self, exclude: &[WorkerDp]) -> Vec<WorkerDp>;

    /// Whether `worker` is a candidate now and has room for one more request.
    fn is_open(&mut self, worker: WorkerDp) -> bool;

    /// The worker `session` is bound to now (session affinity), if any.
    fn session_worker(&mut self, session: &str) -> Option<WorkerDp>;

    /// Binds `session` to `worker` for the session TTL from now (one of its requests was
    /// routed there); with session sync, the other replicas hear of it.
    fn bind_session(&mut self, session: &str, worker: WorkerDp);

    /// Whether the index is ready (the routing API's `/healthz`).
    fn is_healthy(&self) -> bool;

    /// The routing API's `/metrics` text.
    fn metrics_text(&self) -> String;

    /// Tokens per KV block.
    fn block_size(&self) -> u32;

    /// The most blocks one request may have (413 past it), checked before any hashing.
    fn check_blocks(&self, blocks: usize) -> Result<(), DecideError>;
}
