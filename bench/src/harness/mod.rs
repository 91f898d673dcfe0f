//! The benchmark harness: mock engines serve a Mooncake-format trace, a router picks the
//! worker of every request, and the same trace is replayed once per routing policy.
//!
//! Everything runs in one process, in **virtual time** (a discrete-event simulation): a
//! one-hour trace replays in seconds, and two runs with the same seed give the same
//! numbers. The router under test is the real code: the lock-free index fed by the
//! engines' KV events, the slot manager, the cost function, the approximate-mode index.
//! [`net`] runs the same in wall-clock time with engine processes over NATS and a
//! `kvrouter serve` process deciding. See `docs/HARNESS.md` for the models and how to read
//! the report.

pub mod engine;
pub mod net;
pub mod openai;
pub mod pacing;
pub mod report;
pub mod sim;
pub mod trace;

pub use engine::EngineConfig;
pub use report::{
    PolicyReport, Utilisation, WorkerUtilisation, lateness_lines, sweep_table, utilisation_lines,
    write_json, write_outcomes_csv, write_svg, write_sweep_json, write_sweep_svg,
};
pub use sim::{Ideals, Policy, SimConfig, simulate};
pub use trace::{
    TraceHashes, TraceRequest, ideal_hit_ratio, ideal_hit_ratio_trace_blocks, load_trace,
};
