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
//! [`CodecError`] for the whole batch (fuzzed by `fuzz/fuzz_targets/codec_decode.rs`).

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};

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
    super::from_msgpack::<EventBatch>("engine event batch", payload)
}

/// A block hash: an integer of either sign, or a digest's bytes.
#[derive(Debug, Clone, Copy)]
struct Hash(u64);

impl<'de> Deserialize<'de> for Hash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Hash;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a block hash (integer or bytes)")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Hash, E> {
                Ok(Hash(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Hash, E> {
                Ok(Hash(v as u64))
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Hash, E> {
                Ok(Hash(fold(v)))
            }
            fn visit_borrowed_bytes<E: de::Error>(self, v: &[u8]) -> Result<Hash, E> {
                Ok(Hash(fold(v)))
            }
            fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<Hash, E> {
                Ok(Hash(fold(&v)))
            }
        }
        d.deserialize_any(V)
    }
}

/// A digest folded to 64 bits: its last eight bytes, big-endian (zero-padded in front when
/// shorter), as vLLM folds them for integer hashes.
pub fn fold(bytes: &[u8]) -> u64 {
    let tail = &bytes[bytes.len().saturating_sub(8)..];
    tail.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b))
}

/// Token ids, or EAGLE's pairs (of which the firsts and the last second are the ids).
#[derive(Debug, Default)]
struct Tokens(Vec<u32>);

impl<'de> Deserialize<'de> for Tokens {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum One {
            Id(u32),
            Pair(u32, u32),
        }
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Tokens;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("token ids")
            }
            fn visit_unit<E: de::Error>(self) -> Result<Tokens, E> {
                Ok(Tokens(Vec::new()))
            }
            fn visit_none<E: de::Error>(self) -> Result<Tokens, E> {
                Ok(Tokens(Vec::new()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Tokens, A::Error> {
                let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
                let mut last_second = None;
                while let Some(t) = seq.next_element::<TokenId>()? {
                    match t {
                        TokenId(first, second) => {
                            ids.push(first);
                            last_second = second;
                        }
                    }
                }
                if let Some(s) = last_second {
                    ids.push(s);
                }
                Ok(Tokens(ids))
            }
        }
        /// A token id, or an EAGLE pair (first, second).
        struct TokenId(u32, Option<u32>);
        impl<'de> Deserialize<'de> for TokenId {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                Ok(match One::deserialize(d)? {
                    One::Id(t) => TokenId(t, None),
                    One::Pair(a, b) => TokenId(a, Some(b)),
                })
            }
        }
        d.deserialize_any(V)
    }
}

/// Where SGLang's metadata map or vLLM's `lora_name` sits.
#[derive(Debug, Default)]
struct LoraOrMeta {
    lora_name: Option<String>,
    cache_salt: Option<String>,
}

impl<'de> Deserialize<'de> for LoraOrMeta {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Either {
            Name(Option<String>),
            Meta {
                #[serde(default)]
                cache_salt: Option<String>,
            },
        }
        Ok(match Either::deserialize(d)? {
            Either::Name(lora_name) => LoraOrMeta {
                lora_name,
                cache_salt: None,
            },
            Either::Meta { cache_salt } => LoraOrMeta {
                lora_name: None,
                cache_salt,
            },
        })
    }
}

/// Every field an event may carry, by name (the map form) or position (the array form).
#[derive(Debug, Default)]
struct Fields {
    block_hashes: Option<Vec<Hash>>,
    parent_block_hash: Option<Hash>,
    token_ids: Tokens,
    block_size: Option<u32>,
    medium: Option<String>,
    lora: LoraOrMeta,
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
        let hashes = self
            .block_hashes
            .unwrap_or_default()
            .into_iter()
            .map(|h| h.0)
            .collect();
        match tag {
            "BlockStored" => EngineEvent::Stored(BlockStored {
                block_hashes: hashes,
                parent_block_hash: self.parent_block_hash.map(|h| h.0),
                token_ids: self.token_ids.0,
                block_size: self.block_size.unwrap_or(0),
                lora_name: self.lora.lora_name.filter(|n| !n.is_empty()),
                medium: self.medium.filter(|m| !m.is_empty()),
                group_idx: self.group_idx,
                kv_cache_spec_kind: self.kv_cache_spec_kind,
                locality: self.locality,
                cache_salt: self.cache_salt.or(self.lora.cache_salt),
            }),
            "BlockRemoved" => EngineEvent::Removed(BlockRemoved {
                block_hashes: hashes,
                medium: self.medium.filter(|m| !m.is_empty()),
                group_idx: self.group_idx,
                locality: self.locality,
            }),
            "AllBlocksCleared" => EngineEvent::AllCleared,
            other => EngineEvent::Unknown(other.to_owned()),
        }
    }
}

macro_rules! field {
    ($fields:ident, $name:expr, $next:expr) => {
        match $name {
            "block_hashes" => $fields.block_hashes = $next,
            "parent_block_hash" => $fields.parent_block_hash = $next,
            "token_ids" => $fields.token_ids = $next,
            "block_size" => $fields.block_size = $next,
            "medium" => $fields.medium = $next,
            "lora_name" => $fields.lora = $next,
            "group_idx" => $fields.group_idx = $next,
            "kv_cache_spec_kind" => $fields.kv_cache_spec_kind = $next,
            "locality" => $fields.locality = $next,
            "cache_salt" => $fields.cache_salt = $next,
            _ => {
                let _: IgnoredAny = $next;
            }
        }
    };
}

impl<'de> Deserialize<'de> for EngineEvent {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = EngineEvent;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a KV event (tagged map or array)")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<EngineEvent, A::Error> {
                let tag: String = seq
                    .next_element()?
                    .ok_or_else(|| de::Error::invalid_length(0, &"a tag"))?;
                let names = match tag.as_str() {
                    "BlockStored" => STORED,
                    "BlockRemoved" => REMOVED,
                    _ => &[],
                };
                let mut f = Fields::default();
                for &name in names {
                    let done = (|| -> Result<bool, A::Error> {
                        macro_rules! next {
                            () => {
                                match seq.next_element()? {
                                    Some(v) => v,
                                    None => return Ok(true),
                                }
                            };
                        }
                        field!(f, name, next!());
                        Ok(false)
                    })()?;
                    if done {
                        return Ok(f.into_event(&tag));
                    }
                }
                // Newer trailing fields, and every field of an unknown event.
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(f.into_event(&tag))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<EngineEvent, A::Error> {
                let mut tag: Option<String> = None;
                let mut f = Fields::default();
                while let Some(key) = map.next_key::<String>()? {
                    if key == "type" {
                        tag = Some(map.next_value()?);
                        continue;
                    }
                    field!(f, key.as_str(), map.next_value()?);
                }
                let tag = tag.ok_or_else(|| de::Error::missing_field("type"))?;
                Ok(f.into_event(&tag))
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for EventBatch {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = EventBatch;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an EventBatch [ts, events, dp_rank]")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<EventBatch, A::Error> {
                let ts: f64 = seq
                    .next_element()?
                    .ok_or_else(|| de::Error::invalid_length(0, &"ts, events"))?;
                let events: Vec<EngineEvent> = seq
                    .next_element()?
                    .ok_or_else(|| de::Error::invalid_length(1, &"ts, events"))?;
                let dp_rank: Option<u32> = seq.next_element::<Option<u32>>()?.flatten();
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(EventBatch {
                    ts,
                    events,
                    dp_rank,
                })
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<EventBatch, A::Error> {
                let (mut ts, mut events, mut dp_rank) = (None, None, None);
                while let Some(key) = map.next_key::<String>()? {
                    match key.as_str() {
                        "ts" => ts = Some(map.next_value()?),
                        "events" => events = Some(map.next_value()?),
                        "data_parallel_rank" | "attn_dp_rank" | "dp_rank" => {
                            dp_rank = map.next_value::<Option<u32>>()?
                        }
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(EventBatch {
                    ts: ts.unwrap_or(0.0),
                    events: events.ok_or_else(|| de::Error::missing_field("events"))?,
                    dp_rank,
                })
            }
        }
        d.deserialize_any(V)
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
