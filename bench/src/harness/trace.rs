//! Mooncake-format traces: one JSON object per line with `timestamp` (ms), `input_length`,
//! `output_length` and `hash_ids` (one id per 512-token block, prefix-chained).
//!
//! Token ids are synthesised from the hash ids: block `id` becomes 512 tokens
//! `id * 512 + j`, so equal ids give equal tokens and the real hashing path (local hashes
//! of token ids, then sequence hashes) produces the trace's prefix structure at any block
//! size that divides 512.

use std::collections::HashSet;

use ahash::AHashMap;
use kvrouter_core::hash::{HashOptions, LocalBlockHash, local_block_hashes, sequence_hashes};
use serde::Deserialize;

use super::engine::{Engine, EngineConfig, EngineRequest};

/// One request of a trace.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct TraceRequest {
    /// Arrival, ms from the first request.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: u32,
    /// Tokens to generate.
    pub output_length: u32,
    /// 512-token block ids.
    pub hash_ids: Vec<u64>,
}

impl TraceRequest {
    /// Synthetic prompt token ids (`input_length` of them).
    pub fn tokens(&self) -> Vec<u32> {
        let mut t = Vec::with_capacity(self.input_length as usize);
        t.extend(self.token_ids());
        t
    }

    /// The ids of [`TraceRequest::tokens`], made one at a time.
    pub fn token_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.hash_ids
            .iter()
            .flat_map(|&id| {
                (0..512u64)
                    .map(move |j| (id.wrapping_mul(512).wrapping_add(j) & 0x7fff_ffff) as u32)
            })
            .take(self.input_length as usize)
    }
}

/// The local block hashes of a trace's synthetic prompts, computed once per 512-token
/// hash id: block `k` of a prompt lies inside hash id `k * block_size / 512` and its tokens
/// depend on that id alone, so a prompt's hashes are its ids' hashes laid end to end.
/// Shared read-only by every policy's simulation (hashing every prompt's tokens again
/// was a fifth of a simulation's time on long prompts).
#[derive(Debug)]
pub struct TraceHashes {
    block_size: u32,
    per_id: AHashMap<u64, Box<[LocalBlockHash]>>,
}

impl TraceHashes {
    /// The hashes of every hash id of `trace` at `block_size` (which divides 512).
    pub fn new(trace: &[TraceRequest], block_size: u32) -> Self {
        assert!(
            block_size > 0 && 512 % block_size == 0,
            "the block size must divide 512"
        );
        let mut per_id = AHashMap::new();
        let mut tokens = Vec::with_capacity(512);
        for r in trace {
            for &id in &r.hash_ids {
                per_id.entry(id).or_insert_with(|| {
                    tokens.clear();
                    tokens.extend(
                        (0..512u64)
                            .map(|j| (id.wrapping_mul(512).wrapping_add(j) & 0x7fff_ffff) as u32),
                    );
                    local_block_hashes(&tokens, block_size, &HashOptions::default()).into()
                });
            }
        }
        Self { block_size, per_id }
    }

    /// Tokens per block of these hashes.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// The local hashes of `r`'s full blocks: equal to hashing [`TraceRequest::tokens`].
    pub fn locals(&self, r: &TraceRequest) -> Vec<LocalBlockHash> {
        let tokens = (r.input_length as usize).min(512 * r.hash_ids.len());
        let n = tokens / self.block_size as usize;
        let mut out = Vec::with_capacity(n);
        for id in &r.hash_ids {
            if out.len() >= n {
                break;
            }
            let take = (n - out.len()).min(512 / self.block_size as usize);
            out.extend_from_slice(&self.per_id[id][..take]);
        }
        out
    }
}

/// Parses a trace (JSON lines); `limit` keeps the first N requests.
pub fn load_trace(text: &str, limit: Option<usize>) -> anyhow::Result<Vec<TraceRequest>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        if limit.is_some_and(|n| out.len() >= n) {
            break;
        }
        let r: TraceRequest =
            serde_json::from_str(line).map_err(|e| anyhow::anyhow!("trace line {}: {e}", i + 1))?;
        out.push(r);
    }
    Ok(out)
}

/// Fraction of prompt blocks (of `hashes`' block size) that one cache of `capacity_blocks`
/// shared by all workers would serve when the requests run one after another in arrival
/// order, evicting least-recently-used leaves: what the cache capacity allows a perfect
/// router. With `usize::MAX` it is the infinite-cache ideal, the best any router can do.
pub fn ideal_hit_ratio(
    trace: &[TraceRequest],
    hashes: &TraceHashes,
    capacity_blocks: usize,
) -> f64 {
    ideal_hits(trace, hashes, capacity_blocks).0
}

/// [`ideal_hit_ratio`], and the blocks each request found cached in that one cache.
pub fn ideal_hits(
    trace: &[TraceRequest],
    hashes: &TraceHashes,
    capacity_blocks: usize,
) -> (f64, Vec<usize>) {
    let cfg = EngineConfig {
        block_size: hashes.block_size(),
        capacity_blocks,
        max_batch_tokens: u32::MAX,
        max_running: 1,
        ..EngineConfig::default()
    };
    let mut cache = Engine::new(0, cfg);
    let mut hits = vec![0; trace.len()];
    for (i, r) in trace.iter().enumerate() {
        let locals = hashes.locals(r);
        let blocks = locals
            .iter()
            .copied()
            .zip(sequence_hashes(&locals))
            .collect();
        cache.submit(EngineRequest::new(i, r.input_length, 1, blocks));
        while let Some((_, out)) = cache.step() {
            for (&id, &h) in out.first_tokens.iter().zip(&out.first_cached) {
                hits[id] = h;
            }
        }
        cache.take_events();
    }
    let ratio = if cache.prompt_blocks == 0 {
        0.0
    } else {
        cache.hit_blocks as f64 / cache.prompt_blocks as f64
    };
    (ratio, hits)
}

/// The same in the trace's own unit (512-token blocks, by id): 36.6 % on the Mooncake
/// conversation trace, as its README reports.
pub fn ideal_hit_ratio_trace_blocks(trace: &[TraceRequest]) -> f64 {
    let mut seen = HashSet::new();
    let (mut hit, mut total) = (0u64, 0u64);
    for r in trace {
        for id in &r.hash_ids {
            total += 1;
            if !seen.insert(*id) {
                hit += 1;
            }
        }
    }
    if total == 0 {
        0.0
    } else {
        hit as f64 / total as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_follow_hash_ids() {
        let t = load_trace(
            "{\"timestamp\":0,\"input_length\":600,\"output_length\":3,\"hash_ids\":[7,8]}\n",
            None,
        )
        .unwrap();
        let tok = t[0].tokens();
        assert_eq!(tok.len(), 600);
        assert_eq!(tok[0], 7 * 512);
        assert_eq!(tok[512], 8 * 512);
        let twice = [t[0].clone(), t[0].clone()];
        assert!((ideal_hit_ratio_trace_blocks(&twice) - 0.5).abs() < 1e-9);
        // 600 tokens = 9 blocks of 64; the second request hits all 9.
        let hashes = TraceHashes::new(&twice, 64);
        assert!((ideal_hit_ratio(&twice, &hashes, usize::MAX) - 0.5).abs() < 1e-9);
        // A cache of 4 blocks keeps only part of the prompt: fewer hits.
        assert!(ideal_hit_ratio(&twice, &hashes, 4) < 0.5);
        assert!(load_trace("{bad", None).is_err());
    }

    #[test]
    fn memoised_hashes_equal_hashing_the_tokens() {
        let text = "{\"timestamp\":0,\"input_length\":1100,\"output_length\":3,\"hash_ids\":[7,8,9]}\n\
                    {\"timestamp\":1,\"input_length\":2000,\"output_length\":3,\"hash_ids\":[7,8]}\n\
                    {\"timestamp\":2,\"input_length\":40,\"output_length\":3,\"hash_ids\":[5]}\n";
        let trace = load_trace(text, None).unwrap();
        for bs in [16, 64, 512] {
            let hashes = TraceHashes::new(&trace, bs);
            for r in &trace {
                let direct = local_block_hashes(&r.tokens(), bs, &HashOptions::default());
                assert_eq!(hashes.locals(r), direct, "block size {bs}");
            }
        }
    }
}
