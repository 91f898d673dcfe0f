//! Block hashing, byte-identical with NVIDIA Dynamo 1.6.1.
//!
//! Two hashes name a cached block:
//!
//! * the **local block hash** ([`LocalBlockHash`]) covers the block's own tokens only:
//!   XXH3-64 over the token ids as little-endian `u32`s, seeded with
//!   [`XXH3_SEED`] (1337) plus the request's LoRA name and cache namespace (see
//!   [`salt_seed`]). Only full blocks are hashed; a trailing partial block is not.
//! * the **sequence block hash** ([`SequenceBlockHash`], Dynamo's "external" hash) names
//!   the block *and everything before it*. Engines compute it themselves and publish it in
//!   their KV events; the router treats it as an opaque id. When the router needs one
//!   (approximate mode, the worker-side library), it chains them as Dynamo does: the first
//!   equals the local hash, each next is XXH3-64 (seed 1337) over the parent's sequence
//!   hash and the block's local hash, both as little-endian `u64`.
//!
//! `tests/tests/hash_dynamo.rs` proves the identity against the `dynamo-kv-router` crate on random
//! token sequences, block sizes, LoRA names, namespaces and multimodal hashes.

use serde::de::{Error as _, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Dynamo's XXH3 seed for block and chain hashes.
pub const XXH3_SEED: u64 = 1337;

macro_rules! hash_newtype {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
        #[repr(transparent)]
        pub struct $name(pub u64);

        impl std::fmt::Debug for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "{}({:#018x})", stringify!($name), self.0)
            }
        }

        impl From<u64> for $name {
            fn from(v: u64) -> Self {
                Self(v)
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_u64(self.0)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                d.deserialize_u64(HashVisitor).map(Self)
            }
        }
    };
}

hash_newtype!(
    /// Hash of one block's tokens (plus LoRA / namespace / multimodal identity), without
    /// its prefix. The radix tree is keyed by these: a request's path is its list of local
    /// hashes.
    LocalBlockHash
);
hash_newtype!(
    /// Engine-assigned id of a block *with* its whole prefix (Dynamo's
    /// `ExternalSequenceBlockHash`). Stored and removed events name blocks by it.
    SequenceBlockHash
);

/// Accepts any integer that fits 64 bits. Negative integers are taken bit for bit
/// (two's complement), as Dynamo does for `i64` hashes from Python publishers.
struct HashVisitor;

impl Visitor<'_> for HashVisitor {
    type Value = u64;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a 64-bit integer hash")
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<u64, E> {
        Ok(v)
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<u64, E> {
        Ok(v as u64)
    }

    fn visit_u128<E: serde::de::Error>(self, v: u128) -> Result<u64, E> {
        u64::try_from(v).map_err(|_| E::custom("hash does not fit in 64 bits"))
    }

    fn visit_i128<E: serde::de::Error>(self, v: i128) -> Result<u64, E> {
        i64::try_from(v)
            .map(|v| v as u64)
            .or_else(|_| u64::try_from(v))
            .map_err(|_| E::custom("hash does not fit in 64 bits"))
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<u64, E> {
        Err(E::invalid_type(serde::de::Unexpected::Float(v), &self))
    }
}

/// Views local hashes as their raw `u64`s (free: the newtype is `repr(transparent)`).
#[inline]
pub fn local_hashes_as_u64(hashes: &[LocalBlockHash]) -> &[u64] {
    // SAFETY: `LocalBlockHash` is `repr(transparent)` over `u64`, so a slice of one has the
    // layout of a slice of the other; the lifetime is carried over.
    unsafe { std::slice::from_raw_parts(hashes.as_ptr().cast::<u64>(), hashes.len()) }
}

/// Local hashes as their raw `u64`s, the allocation kept (no copy).
pub fn local_hashes_into_u64(hashes: Vec<LocalBlockHash>) -> Vec<u64> {
    let mut v = std::mem::ManuallyDrop::new(hashes);
    let (ptr, len, cap) = (v.as_mut_ptr(), v.len(), v.capacity());
    // SAFETY: `LocalBlockHash` is `repr(transparent)` over `u64` (same size and alignment),
    // so the allocation, length and capacity of one vector are those of the other; the
    // original is never dropped (`ManuallyDrop`), so the allocation has one owner.
    unsafe { Vec::from_raw_parts(ptr.cast::<u64>(), len, cap) }
}

/// Length of the common prefix of two slices, compared eight hashes at a time.
#[inline]
pub(crate) fn common_prefix(a: &[u64], b: &[u64]) -> usize {
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + 8 <= n {
        // A branch-free XOR-OR over eight hashes compiles to vector ops inline, where a
        // slice comparison calls `memcmp`.
        let (x, y) = (&a[i..i + 8], &b[i..i + 8]);
        if (0..8).fold(0u64, |d, k| d | (x[k] ^ y[k])) != 0 {
            break;
        }
        i += 8;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

/// Request-wide identity mixed into every local hash: which adapter and which cache
/// namespace the blocks belong to. Empty strings count as absent (as in Dynamo).
#[derive(Debug, Clone, Copy, Default)]
pub struct HashOptions<'a> {
    /// LoRA adapter name.
    pub lora_name: Option<&'a str>,
    /// Cache namespace (Dynamo's `cache_namespace`, its per-request "salt").
    pub cache_namespace: Option<&'a str>,
    /// Multimodal object hashes per block index (`mm_hashes[i]` for block `i`); blocks
    /// past the end, or with an empty list, hash their tokens only.
    pub mm_hashes: Option<&'a [Vec<u64>]>,
    /// Eagle speculative decoding: each block's window is `block_size + 1` tokens
    /// (overlapping the next block's first token) while blocks still start every
    /// `block_size` tokens.
    pub eagle: bool,
}

/// The XXH3 seed for local hashes under these options: 1337, plus XXH3-64 (seed 0) of the
/// LoRA name, plus XXH3-64 (seed 1) of the cache namespace, with wrapping addition.
pub fn salt_seed(lora_name: Option<&str>, cache_namespace: Option<&str>) -> u64 {
    let mut seed = XXH3_SEED;
    if let Some(name) = lora_name.filter(|s| !s.is_empty()) {
        seed = seed.wrapping_add(xxh3_64(name.as_bytes()));
    }
    if let Some(ns) = cache_namespace.filter(|s| !s.is_empty()) {
        seed = seed.wrapping_add(xxh3_64_with_seed(ns.as_bytes(), 1));
    }
    seed
}

/// Number of full blocks in `tokens` tokens.
pub fn full_block_count(tokens: usize, block_size: u32, eagle: bool) -> usize {
    if block_size == 0 {
        return 0;
    }
    if eagle {
        tokens.saturating_sub(1) / block_size as usize
    } else {
        tokens / block_size as usize
    }
}

/// Local hashes of every full block of `tokens` (a trailing partial block is skipped).
/// Returns an empty list when `block_size` is 0.
pub fn local_block_hashes(
    tokens: &[u32],
    block_size: u32,
    options: &HashOptions<'_>,
) -> Vec<LocalBlockHash> {
    let mut out = Vec::with_capacity(full_block_count(tokens.len(), block_size, options.eagle));
    for_each_local_hash(tokens, block_size, options, |h| out.push(h));
    out
}

/// Calls `visit` with the local hash of every full block, in order, without allocating
/// (except a scratch buffer for multimodal blocks or on big-endian targets).
pub fn for_each_local_hash(
    tokens: &[u32],
    block_size: u32,
    options: &HashOptions<'_>,
    mut visit: impl FnMut(LocalBlockHash),
) {
    if block_size == 0 {
        return;
    }
    let seed = salt_seed(options.lora_name, options.cache_namespace);
    let stride = block_size as usize;
    let window = if options.eagle { stride + 1 } else { stride };
    let mut scratch = Vec::new();
    let mut start = 0usize;
    let mut index = 0usize;
    while start + window <= tokens.len() {
        let chunk = &tokens[start..start + window];
        let mm = options
            .mm_hashes
            .and_then(|all| all.get(index))
            .filter(|m| !m.is_empty());
        let hash = match mm {
            Some(mm) => {
                scratch.clear();
                scratch.extend(chunk.iter().flat_map(|t| t.to_le_bytes()));
                let mut sorted = mm.clone();
                sorted.sort_unstable();
                scratch.extend(sorted.iter().flat_map(|h| h.to_le_bytes()));
                xxh3_64_with_seed(&scratch, seed)
            }
            None => hash_tokens(chunk, seed, &mut scratch),
        };
        visit(LocalBlockHash(hash));
        start += stride;
        index += 1;
    }
}

#[inline]
fn hash_tokens(chunk: &[u32], seed: u64, scratch: &mut Vec<u8>) -> u64 {
    #[cfg(target_endian = "little")]
    {
        let _ = scratch;
        // SAFETY: `u32` has no padding and no invalid bit patterns, so its memory may be
        // viewed as `4 * len` initialised bytes; the byte slice borrows `chunk` and lives no
        // longer than it; `u8` has alignment 1. On little-endian targets those bytes are
        // exactly each token's `to_le_bytes()`, which is what Dynamo hashes.
        let bytes = unsafe {
            std::slice::from_raw_parts(chunk.as_ptr().cast::<u8>(), std::mem::size_of_val(chunk))
        };
        xxh3_64_with_seed(bytes, seed)
    }
    #[cfg(not(target_endian = "little"))]
    {
        scratch.clear();
        scratch.extend(chunk.iter().flat_map(|t| t.to_le_bytes()));
        xxh3_64_with_seed(scratch, seed)
    }
}

/// The sequence hash of a block whose parent has sequence hash `parent`.
#[inline]
pub fn next_sequence_hash(parent: SequenceBlockHash, local: LocalBlockHash) -> SequenceBlockHash {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&parent.0.to_le_bytes());
    bytes[8..].copy_from_slice(&local.0.to_le_bytes());
    SequenceBlockHash(xxh3_64_with_seed(&bytes, XXH3_SEED))
}

/// Sequence hashes for a request's local hashes: the first equals its local hash, each
/// next chains its parent's.
pub fn sequence_hashes(locals: &[LocalBlockHash]) -> Vec<SequenceBlockHash> {
    let mut out = Vec::with_capacity(locals.len());
    let mut parent: Option<SequenceBlockHash> = None;
    for &local in locals {
        let seq = match parent {
            None => SequenceBlockHash(local.0),
            Some(p) => next_sequence_hash(p, local),
        };
        out.push(seq);
        parent = Some(seq);
    }
    out
}

/// A fast, fixed (repeatable) hasher for keys that are already well-spread integers — block
/// hashes, worker ids: the SplitMix64 finaliser. Not for attacker-chosen keys of a
/// long-lived table that must resist flooding.
#[derive(Debug, Default, Clone, Copy)]
pub struct MixHasher(u64);

/// `BuildHasher` for [`MixHasher`].
pub type MixBuildHasher = std::hash::BuildHasherDefault<MixHasher>;

impl std::hash::Hasher for MixHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.0 = mix(self.0 ^ u64::from_le_bytes(b));
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = mix(self.0 ^ v);
    }

    fn write_u32(&mut self, v: u32) {
        self.0 = mix(self.0 ^ v as u64);
    }
}

/// The SplitMix64 finaliser.
#[inline]
pub fn mix(k: u64) -> u64 {
    let mut z = k.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A helper for decoders: a `u64` that may arrive as a JSON/msgpack integer or as a decimal
/// string (Dynamo's `forward-pass-metrics` carries `worker_id` as a string).
pub(crate) fn deserialize_u64_or_string<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    struct V;
    impl Visitor<'_> for V {
        type Value = u64;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an unsigned integer or a decimal string")
        }
        fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<u64, E> {
            Ok(v)
        }
        fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<u64, E> {
            u64::try_from(v).map_err(|_| E::custom("negative id"))
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<u64, E> {
            v.parse().map_err(|_| E::custom("not a decimal u64"))
        }
    }
    d.deserialize_any(V).map_err(D::Error::custom)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_hashes_become_u64s_in_place() {
        let v = vec![
            LocalBlockHash(7),
            LocalBlockHash(u64::MAX),
            LocalBlockHash(0),
        ];
        let ptr = v.as_ptr() as usize;
        let u = local_hashes_into_u64(v);
        assert_eq!(u, [7, u64::MAX, 0]);
        assert_eq!(u.as_ptr() as usize, ptr);
    }

    #[test]
    fn first_sequence_hash_is_local_hash() {
        let tokens: Vec<u32> = (0..64).collect();
        let locals = local_block_hashes(&tokens, 16, &HashOptions::default());
        assert_eq!(locals.len(), 4);
        let seqs = sequence_hashes(&locals);
        assert_eq!(seqs[0].0, locals[0].0);
        assert_eq!(seqs[1], next_sequence_hash(seqs[0], locals[1]));
        assert_ne!(seqs[1].0, locals[1].0);
    }

    #[test]
    fn partial_blocks_are_not_hashed() {
        let tokens: Vec<u32> = (0..70).collect();
        assert_eq!(
            local_block_hashes(&tokens, 16, &HashOptions::default()).len(),
            4
        );
        assert!(local_block_hashes(&tokens, 0, &HashOptions::default()).is_empty());
        assert!(local_block_hashes(&tokens[..15], 16, &HashOptions::default()).is_empty());
    }

    #[test]
    fn lora_and_namespace_change_hashes_and_empty_is_absent() {
        let tokens: Vec<u32> = (0..32).collect();
        let plain = local_block_hashes(&tokens, 16, &HashOptions::default());
        let empty = HashOptions {
            lora_name: Some(""),
            cache_namespace: Some(""),
            ..Default::default()
        };
        assert_eq!(plain, local_block_hashes(&tokens, 16, &empty));
        let lora = HashOptions {
            lora_name: Some("a"),
            ..Default::default()
        };
        let ns = HashOptions {
            cache_namespace: Some("a"),
            ..Default::default()
        };
        let a = local_block_hashes(&tokens, 16, &lora);
        let b = local_block_hashes(&tokens, 16, &ns);
        assert_ne!(plain, a);
        assert_ne!(a, b);
    }

    #[test]
    fn known_vector_matches_dynamo_constant() {
        // Dynamo's own test vector (dynamo-tokens `SEQ_HASH_5_8`): the chain step is
        // XXH3(le64(parent) ++ le64(child), 1337); checked end to end in tests/tests/hash_dynamo.rs.
        let p = SequenceBlockHash(1);
        let c = LocalBlockHash(2);
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&1u64.to_le_bytes());
        bytes.extend_from_slice(&2u64.to_le_bytes());
        assert_eq!(next_sequence_hash(p, c).0, xxh3_64_with_seed(&bytes, 1337));
    }

    #[test]
    fn hashes_deserialize_from_signed_and_unsigned() {
        let a: LocalBlockHash = serde_json::from_str("18446744073709551615").unwrap();
        let b: LocalBlockHash = serde_json::from_str("-1").unwrap();
        assert_eq!(a, b);
        assert!(serde_json::from_str::<LocalBlockHash>("1.5").is_err());
        assert!(serde_json::from_str::<LocalBlockHash>("\"7\"").is_err());
    }
}
