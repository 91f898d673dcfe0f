//! # kvrouter-bench
//!
//! The benchmark harness (mock engines, trace replay, policy comparison) and side-by-side
//! comparisons with NVIDIA Dynamo's indexer. Sample inputs for fresh clones live in
//! `bench/data/` (see its README).
