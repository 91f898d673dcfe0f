//! The engines' native KV-event wire: vLLM's `--kv-events-config` publisher, which SGLang,
//! TensorRT-LLM and LMCache publish too (and Dynamo's mocker with `--zmq-kv-events-ports`).
//!
//! A ZMQ message is `[topic, seq (8 bytes big-endian), payload]`; the payload is a
//! msgspec/MessagePack `EventBatch`: an array `[ts, events, dp_rank]` (SGLang names the rank
//! `attn_dp_rank`; the oldest form has no rank; a map form is accepted too). Each event is
//! tagged by its class name, either as a map with a `"type"` key (vLLM from 0.24 or so) or as
//! an array whose first element is the tag (older vLLM, SGLang):
//!
//! | event | positional fields after the tag |
//! |---|---|
//! | `BlockStored` | `block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window` |
//! | `BlockRemoved` | `block_hashes, medium, group_idx` |
//! | `AllBlocksCleared` | — |
//!
//! Trailing fields may be absent (msgspec omits defaults) and fields or elements we do not
//! know are ignored, so newer engines decode. SGLang puts a metadata map (`cache_salt`) where
//! vLLM has `lora_name`; the type tells them apart. Block hashes come as signed or unsigned
//! 64-bit integers (folded to `u64` as two's complement) or as bytes (a raw digest: its last
//! eight bytes, big-endian, as vLLM folds them). Events of an unknown type decode as
//! [`EngineEvent::Unknown`], for the caller to count. Anything else malformed is a
//! [`CodecError`] for the whole batch (fuzzed by `fuzz/fuzz_targets/codec_decode.rs`). The
//! decoder reads MessagePack directly, not through serde: a batch is mostly token ids, and
//! one integer through serde cost several times what it costs here.

use serde::Serialize;

use super::CodecError;

/// One decoded `EventBatch`.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// The engine's timestamp, seconds.
    pub ts: f64,
    /// Its events, in order.
    pub events: Vec<EngineEvent>,
    /// The data-parallel (or attention-DP) rank that published it, when it says.
    pub dp_rank: Option<u32>,
}

/// One engine event.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum EngineEvent {
    /// Blocks stored.
    Stored(BlockStored),
    /// Blocks removed.
    Removed(BlockRemoved),
    /// Everything removed.
    AllCleared,
    /// An event type this decoder does not know (its tag).
    Unknown(String),
}

/// `BlockStored`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockStored {
    /// The engine's hash of each block, in chain order.
    pub block_hashes: Vec<u64>,
    /// The engine's hash of the block before the first, if any.
    pub parent_block_hash: Option<u64>,
    /// Every block's tokens, concatenated.
    pub token_ids: Vec<u32>,
    /// Tokens per block (0 when absent).
    pub block_size: u32,
    /// The LoRA adapter's name.
    pub lora_name: Option<String>,
    /// Where the blocks are (`GPU`, `CPU`, `CPU_PINNED`, `DISK`, ...; absent: the device).
    pub medium: Option<String>,
    /// The KV-cache group (hybrid models).
    pub group_idx: Option<u32>,
    /// The group's attention kind (`full_attention`, `sliding_window`, ...).
    pub kv_cache_spec_kind: Option<String>,
    /// `LOCAL` or `REMOTE` (newer vLLM).
    pub locality: Option<String>,
    /// SGLang's cache salt.
    pub cache_salt: Option<String>,
}

/// `BlockRemoved`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockRemoved {
    /// The engine's hashes of the removed blocks.
    pub block_hashes: Vec<u64>,
    /// Where they were removed from.
    pub medium: Option<String>,
    /// The KV-cache group.
    pub group_idx: Option<u32>,
    /// `LOCAL` or `REMOTE`.
    pub locality: Option<String>,
}

/// Decodes one payload.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, CodecError> {
    let mut r = Reader { b: payload, pos: 0 };
    let batch = r.batch().map_err(|why| CodecError::Malformed {
        what: "engine event batch",
        at: r.pos,
        why,
    })?;
    Ok(batch)
}

/// The bytes of each element of the MessagePack array `bytes` (which must hold nothing
/// else), so that each element can be decoded on its own.
pub(crate) fn array_elements(bytes: &[u8]) -> Result<Vec<&[u8]>, &'static str> {
    let mut r = Reader { b: bytes, pos: 0 };
    let Kind::Array(n) = r.kind()? else {
        return Err("expected an array");
    };
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let start = r.pos;
        r.skip(1)?;
        out.push(&bytes[start..r.pos]);
    }
    if r.pos != bytes.len() {
        return Err("bytes after the array");
    }
    Ok(out)
}

/// A direct MessagePack reader for the batch: a prompt's token ids are thousands of
/// integers, and read through serde each costs several times what its byte does (the
/// decoder was the ingest's largest cost); here an integer is one match on its marker.
/// Nesting is bounded ([`MAX_DEPTH`]) and every length is checked against the input.
struct Reader<'a> {
    b: &'a [u8],
    pos: usize,
}

type R<T> = Result<T, &'static str>;

/// Deepest nesting skipped inside a value we do not read.
const MAX_DEPTH: u32 = 64;

/// What a marker starts.
enum Kind {
    Nil,
    Bool,
    Int,
    Float,
    Str(usize),
    Bin(usize),
    Array(usize),
    Map(usize),
    Ext(usize),
}

impl<'a> Reader<'a> {
    fn byte(&mut self) -> R<u8> {
        let v = *self.b.get(self.pos).ok_or("truncated")?;
        self.pos += 1;
        Ok(v)
    }

    fn take(&mut self, n: usize) -> R<&'a [u8]> {
        let end = self.pos.checked_add(n).ok_or("length overflow")?;
        let s = self.b.get(self.pos..end).ok_or("truncated")?;
        self.pos = end;
        Ok(s)
    }

    fn be(&mut self, n: usize) -> R<u64> {
        let s = self.take(n)?;
        let mut a = [0u8; 8];
        a[8 - n..].copy_from_slice(s);
        Ok(u64::from_be_bytes(a))
    }

    fn peek(&self) -> R<u8> {
        self.b.get(self.pos).copied().ok_or("truncated")
    }

    /// The kind of the next value; its marker (and length bytes) consumed, except for
    /// scalars, which stay to be read.
    fn kind(&mut self) -> R<Kind> {
        let m = self.peek()?;
        let k = match m {
            0x00..=0x7f | 0xe0..=0xff | 0xcc..=0xd3 => return Ok(Kind::Int),
            0xc0 => return Ok(Kind::Nil),
            0xc2 | 0xc3 => return Ok(Kind::Bool),
            0xca | 0xcb => return Ok(Kind::Float),
            _ => {
                self.pos += 1;
                match m {
                    0x80..=0x8f => Kind::Map(usize::from(m & 0x0f)),
                    0x90..=0x9f => Kind::Array(usize::from(m & 0x0f)),
                    0xa0..=0xbf => Kind::Str(usize::from(m & 0x1f)),
                    0xc4 => Kind::Bin(self.be(1)? as usize),
                    0xc5 => Kind::Bin(self.be(2)? as usize),
                    0xc6 => Kind::Bin(self.be(4)? as usize),
                    0xc7 => Kind::Ext(self.be(1)? as usize + 1),
                    0xc8 => Kind::Ext(self.be(2)? as usize + 1),
                    0xc9 => Kind::Ext(self.be(4)? as usize + 1),
                    0xd4 => Kind::Ext(2),
                    0xd5 => Kind::Ext(3),
                    0xd6 => Kind::Ext(5),
                    0xd7 => Kind::Ext(9),
                    0xd8 => Kind::Ext(17),
                    0xd9 => Kind::Str(self.be(1)? as usize),
                    0xda => Kind::Str(self.be(2)? as usize),
                    0xdb => Kind::Str(self.be(4)? as usize),
                    0xdc => Kind::Array(self.be(2)? as usize),
                    0xdd => Kind::Array(self.be(4)? as usize),
                    0xde => Kind::Map(self.be(2)? as usize),
                    0xdf => Kind::Map(self.be(4)? as usize),
                    _ => return Err("reserved marker"),
                }
            }
        };
        // A collection cannot hold more elements than bytes remain.
        if let Kind::Array(n) | Kind::Map(n) = k
            && n > self.b.len() - self.pos
        {
            return Err("collection longer than the input");
        }
        Ok(k)
    }

    /// An integer as `u64`, negative ones two's complement.
    fn int(&mut self) -> R<u64> {
        let m = self.byte()?;
        Ok(match m {
            0x00..=0x7f => u64::from(m),
            0xe0..=0xff => i64::from(m as i8) as u64,
            0xcc => self.be(1)?,
            0xcd => self.be(2)?,
            0xce => self.be(4)?,
            0xcf => self.be(8)?,
            0xd0 => i64::from(self.be(1)? as u8 as i8) as u64,
            0xd1 => i64::from(self.be(2)? as u16 as i16) as u64,
            0xd2 => i64::from(self.be(4)? as u32 as i32) as u64,
            0xd3 => self.be(8)?,
            _ => return Err("expected an integer"),
        })
    }

    fn u32(&mut self) -> R<u32> {
        let v = self.int()?;
        u32::try_from(v).map_err(|_| "integer out of range")
    }

    fn nil(&mut self) -> R<bool> {
        if self.peek()? == 0xc0 {
            self.pos += 1;
            return Ok(true);
        }
        Ok(false)
    }

    fn float(&mut self) -> R<f64> {
        match self.peek()? {
            0xca => {
                self.pos += 1;
                Ok(f64::from(f32::from_bits(self.be(4)? as u32)))
            }
            0xcb => {
                self.pos += 1;
                Ok(f64::from_bits(self.be(8)?))
            }
            _ => Ok(self.int()? as i64 as f64),
        }
    }

    fn str(&mut self) -> R<&'a str> {
        match self.kind()? {
            Kind::Str(n) => std::str::from_utf8(self.take(n)?).map_err(|_| "invalid UTF-8"),
            _ => Err("expected a string"),
        }
    }

    fn opt_str(&mut self) -> R<Option<String>> {
        if self.nil()? {
            return Ok(None);
        }
        Ok(Some(self.str()?.to_owned()).filter(|s| !s.is_empty()))
    }

    fn opt_u32(&mut self) -> R<Option<u32>> {
        if self.nil()? {
            return Ok(None);
        }
        self.u32().map(Some)
    }

    /// Skips one value of any kind.
    fn skip(&mut self, depth: u32) -> R<()> {
        if depth > MAX_DEPTH {
            return Err("nested too deep");
        }
        match self.kind()? {
            Kind::Nil | Kind::Bool => self.pos += 1,
            Kind::Int => {
                self.int()?;
            }
            Kind::Float => {
                self.float()?;
            }
            Kind::Str(n) | Kind::Bin(n) | Kind::Ext(n) => {
                self.take(n)?;
            }
            Kind::Array(n) => {
                for _ in 0..n {
                    self.skip(depth + 1)?;
                }
            }
            Kind::Map(n) => {
                for _ in 0..2 * n {
                    self.skip(depth + 1)?;
                }
            }
        }
        Ok(())
    }

    /// A block hash: an integer, or a digest's bytes folded as vLLM folds them.
    fn hash(&mut self) -> R<u64> {
        match self.kind()? {
            Kind::Int => self.int(),
            Kind::Bin(n) | Kind::Str(n) => Ok(fold(self.take(n)?)),
            _ => Err("expected a block hash"),
        }
    }

    fn hashes(&mut self) -> R<Vec<u64>> {
        if self.nil()? {
            return Ok(Vec::new());
        }
        let Kind::Array(n) = self.kind()? else {
            return Err("expected a list of block hashes");
        };
        (0..n).map(|_| self.hash()).collect()
    }

    /// Token ids, or EAGLE's pairs (the firsts, then the last second).
    fn tokens(&mut self) -> R<Vec<u32>> {
        if self.nil()? {
            return Ok(Vec::new());
        }
        let Kind::Array(n) = self.kind()? else {
            return Err("expected token ids");
        };
        let mut ids = Vec::with_capacity(n + 1);
        let mut last_second = None;
        let mut left = n;
        while left > 0 {
            // The hot loop: plain ids read straight off the bytes by their marker, with the
            // position in a local (one bounds check per id).
            let b = self.b;
            let mut p = self.pos;
            while left > 0 {
                let (id, len) = match b.get(p..p + 5).or_else(|| b.get(p..)) {
                    Some([m @ 0x00..=0x7f, ..]) => (u32::from(*m), 1),
                    Some([0xcc, x, ..]) => (u32::from(*x), 2),
                    Some([0xcd, x, y, ..]) => (u32::from(u16::from_be_bytes([*x, *y])), 3),
                    Some([0xce, x, y, z, w]) => (u32::from_be_bytes([*x, *y, *z, *w]), 5),
                    _ => break,
                };
                ids.push(id);
                p += len;
                left -= 1;
            }
            self.pos = p;
            if left == 0 {
                break;
            }
            // Anything else: an EAGLE pair, or an id in another encoding (or an error).
            left -= 1;
            if matches!(self.peek()?, 0x90..=0x9f | 0xdc | 0xdd) {
                let Kind::Array(k) = self.kind()? else {
                    return Err("expected an EAGLE pair");
                };
                if k < 2 {
                    return Err("an EAGLE pair of fewer than two ids");
                }
                ids.push(self.u32()?);
                last_second = Some(self.u32()?);
                for _ in 2..k {
                    self.skip(1)?;
                }
            } else {
                ids.push(self.u32()?);
            }
        }
        ids.extend(last_second);
        Ok(ids)
    }

    /// vLLM's `lora_name` (a string) or SGLang's metadata map (`cache_salt`) at one slot.
    fn lora_or_meta(&mut self, f: &mut Fields) -> R<()> {
        match self.kind()? {
            Kind::Nil => self.pos += 1,
            Kind::Str(n) => {
                let s = std::str::from_utf8(self.take(n)?).map_err(|_| "invalid UTF-8")?;
                f.lora_name = Some(s.to_owned()).filter(|s| !s.is_empty());
            }
            Kind::Map(n) => {
                for _ in 0..n {
                    if self.str()? == "cache_salt" {
                        f.cache_salt = self.opt_str()?;
                    } else {
                        self.skip(1)?;
                    }
                }
            }
            _ => return Err("expected lora_name"),
        }
        Ok(())
    }

    /// One field of an event, by name.
    fn field(&mut self, name: &str, f: &mut Fields) -> R<()> {
        match name {
            "block_hashes" => f.block_hashes = self.hashes()?,
            "parent_block_hash" => {
                f.parent_block_hash = if self.nil()? {
                    None
                } else {
                    Some(self.hash()?)
                }
            }
            "token_ids" => f.token_ids = self.tokens()?,
            "block_size" => f.block_size = self.opt_u32()?,
            "medium" => f.medium = self.opt_str()?,
            "lora_name" => self.lora_or_meta(f)?,
            "group_idx" => f.group_idx = self.opt_u32()?,
            "kv_cache_spec_kind" => f.kv_cache_spec_kind = self.opt_str()?,
            "locality" => f.locality = self.opt_str()?,
            "cache_salt" => f.cache_salt = self.opt_str()?,
            _ => self.skip(1)?,
        }
        Ok(())
    }

    fn event(&mut self) -> R<EngineEvent> {
        let mut f = Fields::default();
        match self.kind()? {
            Kind::Array(n) => {
                if n == 0 {
                    return Err("an event without its tag");
                }
                let tag = self.str()?;
                let names = match tag {
                    "BlockStored" => STORED,
                    "BlockRemoved" => REMOVED,
                    _ => &[],
                };
                for i in 1..n {
                    match names.get(i - 1) {
                        Some(name) => self.field(name, &mut f)?,
                        // Newer trailing fields, and every field of an unknown event.
                        None => self.skip(1)?,
                    }
                }
                Ok(f.into_event(tag))
            }
            Kind::Map(n) => {
                let mut tag = None;
                for _ in 0..n {
                    let key = self.str()?;
                    if key == "type" {
                        tag = Some(self.str()?);
                    } else {
                        self.field(key, &mut f)?;
                    }
                }
                Ok(f.into_event(tag.ok_or("an event without its type")?))
            }
            _ => Err("expected an event (array or map)"),
        }
    }

    fn events(&mut self) -> R<Vec<EngineEvent>> {
        let Kind::Array(n) = self.kind()? else {
            return Err("expected a list of events");
        };
        (0..n).map(|_| self.event()).collect()
    }

    fn rank(&mut self) -> R<Option<u32>> {
        self.opt_u32()
    }

    fn batch(&mut self) -> R<EventBatch> {
        let batch = match self.kind()? {
            Kind::Array(n) => {
                if n < 2 {
                    return Err("a batch of fewer than two elements");
                }
                let ts = self.float()?;
                let events = self.events()?;
                let dp_rank = if n > 2 { self.rank()? } else { None };
                for _ in 3..n {
                    self.skip(1)?;
                }
                EventBatch {
                    ts,
                    events,
                    dp_rank,
                }
            }
            Kind::Map(n) => {
                let (mut ts, mut events, mut dp_rank) = (0.0, None, None);
                for _ in 0..n {
                    match self.str()? {
                        "ts" => ts = self.float()?,
                        "events" => events = Some(self.events()?),
                        "data_parallel_rank" | "attn_dp_rank" | "dp_rank" => {
                            dp_rank = self.rank()?
                        }
                        _ => self.skip(1)?,
                    }
                }
                EventBatch {
                    ts,
                    events: events.ok_or("a batch without events")?,
                    dp_rank,
                }
            }
            _ => return Err("expected a batch (array or map)"),
        };
        if self.pos != self.b.len() {
            return Err("trailing bytes after the batch");
        }
        Ok(batch)
    }
}

/// A digest folded to 64 bits: its last eight bytes, big-endian (zero-padded in front when
/// shorter), as vLLM folds them for integer hashes.
pub fn fold(bytes: &[u8]) -> u64 {
    let tail = &bytes[bytes.len().saturating_sub(8)..];
    tail.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b))
}

/// Every field an event may carry, by name (the map form) or position (the array form).
#[derive(Debug, Default)]
struct Fields {
    block_hashes: Vec<u64>,
    parent_block_hash: Option<u64>,
    token_ids: Vec<u32>,
    block_size: Option<u32>,
    medium: Option<String>,
    lora_name: Option<String>,
    group_idx: Option<u32>,
    kv_cache_spec_kind: Option<String>,
    locality: Option<String>,
    cache_salt: Option<String>,
}

/// Positions after the tag, per event type.
const STORED: &[&str] = &[
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
];
const REMOVED: &[&str] = &["block_hashes", "medium", "group_idx"];

impl Fields {
    fn into_event(self, tag: &str) -> EngineEvent {
        match tag {
            "BlockStored" => EngineEvent::Stored(BlockStored {
                block_hashes: self.block_hashes,
                parent_block_hash: self.parent_block_hash,
                token_ids: self.token_ids,
                block_size: self.block_size.unwrap_or(0),
                lora_name: self.lora_name,
                medium: self.medium,
                group_idx: self.group_idx,
                kv_cache_spec_kind: self.kv_cache_spec_kind,
                locality: self.locality,
                cache_salt: self.cache_salt,
            }),
            "BlockRemoved" => EngineEvent::Removed(BlockRemoved {
                block_hashes: self.block_hashes,
                medium: self.medium,
                group_idx: self.group_idx,
                locality: self.locality,
            }),
            "AllBlocksCleared" => EngineEvent::AllCleared,
            other => EngineEvent::Unknown(other.to_owned()),
        }
    }
}

/// An `EventBatch` in vLLM's current form (array batch, tagged-map events), for tests and
/// benchmarks that play an engine.
#[derive(Debug, Clone, Serialize)]
pub struct WireBatch<'a> {
    /// Timestamp.
    pub ts: f64,
    /// Events.
    pub events: Vec<WireEvent<'a>>,
    /// Rank.
    pub dp_rank: Option<u32>,
}

/// One event of a [`WireBatch`].
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "type")]
pub enum WireEvent<'a> {
    /// `BlockStored`.
    BlockStored {
        /// Hashes.
        block_hashes: &'a [u64],
        /// Parent.
        parent_block_hash: Option<u64>,
        /// Tokens.
        token_ids: &'a [u32],
        /// Block size.
        block_size: u32,
        /// Always null.
        lora_id: Option<u32>,
        /// Medium.
        medium: Option<&'a str>,
        /// LoRA name.
        lora_name: Option<&'a str>,
    },
    /// `BlockRemoved`.
    BlockRemoved {
        /// Hashes.
        block_hashes: &'a [u64],
        /// Medium.
        medium: Option<&'a str>,
    },
    /// `AllBlocksCleared`.
    AllBlocksCleared,
}

impl WireBatch<'_> {
    /// The payload: `[ts, events, dp_rank]`, events as maps.
    pub fn encode(&self) -> Result<Vec<u8>, CodecError> {
        let tuple = (self.ts, &self.events, self.dp_rank);
        rmp_serde::to_vec_named(&tuple).map_err(|source| CodecError::Encode {
            what: "engine event batch",
            source,
        })
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn mp(v: &serde_json::Value) -> Vec<u8> {
        rmp_serde::to_vec(v).unwrap()
    }

    #[test]
    fn map_events_in_an_array_batch() {
        let v = serde_json::json!([1.5, [
            {"type": "BlockStored", "block_hashes": [15760518052499183552u64, 7], "parent_block_hash": null,
             "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": null, "medium": "GPU",
             "lora_name": null, "extra_keys": [null], "group_idx": 0, "kv_cache_spec_kind": "full_attention",
             "newer_field": {"x": 1}},
            {"type": "BlockRemoved", "block_hashes": [-1], "medium": "CPU"},
            {"type": "AllBlocksCleared"},
            {"type": "SomethingNew", "a": 1}
        ], 3]);
        let b = decode_batch(&mp(&v)).unwrap();
        assert_eq!(b.dp_rank, Some(3));
        assert_eq!(b.events.len(), 4);
        let EngineEvent::Stored(s) = &b.events[0] else {
            panic!("{b:?}")
        };
        assert_eq!(s.block_hashes, [15760518052499183552u64, 7]);
        assert_eq!((s.token_ids.len(), s.block_size), (4, 2));
        assert_eq!(s.medium.as_deref(), Some("GPU"));
        assert_eq!(s.kv_cache_spec_kind.as_deref(), Some("full_attention"));
        let EngineEvent::Removed(r) = &b.events[1] else {
            panic!()
        };
        assert_eq!(r.block_hashes, [u64::MAX]);
        assert_eq!(b.events[2], EngineEvent::AllCleared);
        assert_eq!(b.events[3], EngineEvent::Unknown("SomethingNew".into()));
    }

    #[test]
    fn positional_events_sglang_and_old_vllm() {
        let v = serde_json::json!([2.0, [
            ["BlockStored", [10, 11], 9, [5, 6, 7, 8], 2, null, "CPU_PINNED", {"cache_salt": "s"}],
            ["BlockStored", [12], null, [1, 2], 2, null, null, "adapter", [null], 1, "sliding_window", 128, "x", "y"],
            ["BlockStored", [13], 12, [3, 4], 2],
            ["BlockRemoved", [10]],
            ["AllBlocksCleared"]
        ]]);
        let b = decode_batch(&mp(&v)).unwrap();
        assert_eq!(b.dp_rank, None);
        let s: Vec<&BlockStored> = b
            .events
            .iter()
            .filter_map(|e| match e {
                EngineEvent::Stored(s) => Some(s),
                _ => None,
            })
            .collect();
        assert_eq!(s[0].parent_block_hash, Some(9));
        assert_eq!(s[0].cache_salt.as_deref(), Some("s"));
        assert_eq!(s[0].medium.as_deref(), Some("CPU_PINNED"));
        assert_eq!(s[1].lora_name.as_deref(), Some("adapter"));
        assert_eq!(
            (s[1].group_idx, s[1].kv_cache_spec_kind.as_deref()),
            (Some(1), Some("sliding_window"))
        );
        assert_eq!((s[2].block_size, s[2].medium.as_deref()), (2, None));
        assert!(matches!(b.events[3], EngineEvent::Removed(_)));
        assert_eq!(b.events[4], EngineEvent::AllCleared);
    }

    #[test]
    fn bytes_hashes_fold_like_vllm_and_eagle_pairs_flatten() {
        let mut digest = vec![0xAAu8; 24];
        digest.extend_from_slice(&[0, 0, 0, 0, 0, 0, 1, 2]);
        let batch = (
            0.0f64,
            vec![(
                "BlockStored",
                vec![serde_bytes::ByteBuf::from(digest)],
                Option::<u64>::None,
                vec![(1u32, 2u32), (2, 3)],
                2u32,
            )],
            Some(0u32),
        );
        let bytes = rmp_serde::to_vec(&batch).unwrap();
        let b = decode_batch(&bytes).unwrap();
        let EngineEvent::Stored(s) = &b.events[0] else {
            panic!()
        };
        assert_eq!(s.block_hashes, [0x0102]);
        assert_eq!(s.token_ids, [1, 2, 3]);
        assert_eq!(fold(&[1, 2]), 0x0102);
    }

    #[test]
    fn a_map_batch_and_what_is_refused() {
        let v = serde_json::json!({"ts": 1.0, "events": [], "attn_dp_rank": 2, "extra": 1});
        assert_eq!(decode_batch(&mp(&v)).unwrap().dp_rank, Some(2));
        for bad in [
            serde_json::json!([]),
            serde_json::json!([1.0]),
            serde_json::json!([1.0, [["BlockStored", "not hashes"]]]),
            serde_json::json!([1.0, [{"block_hashes": [1]}]]),
            serde_json::json!("nope"),
        ] {
            assert!(decode_batch(&mp(&bad)).is_err(), "{bad}");
        }
        assert!(decode_batch(b"\xc1").is_err());
    }

    #[test]
    fn the_wire_form_round_trips() {
        let hashes = [1u64, 2];
        let tokens = [1u32, 2, 3, 4];
        let b = WireBatch {
            ts: 3.0,
            events: vec![
                WireEvent::BlockStored {
                    block_hashes: &hashes,
                    parent_block_hash: Some(7),
                    token_ids: &tokens,
                    block_size: 2,
                    lora_id: None,
                    medium: Some("GPU"),
                    lora_name: None,
                },
                WireEvent::BlockRemoved {
                    block_hashes: &hashes[..1],
                    medium: None,
                },
                WireEvent::AllBlocksCleared,
            ],
            dp_rank: Some(1),
        };
        let d = decode_batch(&b.encode().unwrap()).unwrap();
        assert_eq!(d.dp_rank, Some(1));
        let EngineEvent::Stored(s) = &d.events[0] else {
            panic!()
        };
        assert_eq!((s.parent_block_hash, s.token_ids.len()), (Some(7), 4));
        assert!(matches!(d.events[1], EngineEvent::Removed(_)));
        assert_eq!(d.events[2], EngineEvent::AllCleared);
    }
}
