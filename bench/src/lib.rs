//! # kvrouter-bench
//!
//! The benchmark harness and side-by-side comparisons with NVIDIA Dynamo's indexer:
//!
//! * [`perf`]: timed replays of replay logs through an index (`kvrouter replay --perf`).
//! * [`concurrent`]: writers applying a log's events at full speed while readers look up.
//! * [`ingest`]: end-to-end ingest over a real NATS server, next to the broker's raw rate.
//! * [`heap`]: the counting allocator that measures an index's live heap in replays.
//! * [`harness`]: mock engines serving a Mooncake trace under each routing policy
//!   (`kvrouter bench`).
//! * [`route`]: a load generator for the routing API.
//! * [`recovery`]: restart recovery from a snapshot, process start to serving.
//! * `dynamo` (feature `dynamo`): the same replays through `dynamo-kv-router` 1.6.1's
//!   `RadixTree` and `ThreadPoolIndexer<ConcurrentRadixTreeCompressed>`.
//!
//! Sample inputs for fresh clones live in `bench/data/` (see its README).

mod child;
pub mod concurrent;
#[cfg(feature = "dynamo")]
pub mod dynamo;
pub mod harness;
pub mod heap;
pub mod hostile;
pub mod ingest;
pub mod perf;
pub mod proxy;
pub mod recovery;
pub mod route;
pub mod zmq_ingest;
