//! What an engine's native KV events ([`crate::codec::vllm`]) mean for the index: one
//! publisher's batches turned into [`RouterEvent`]s of one worker, in order.
//!
//! # Identity
//!
//! The router hashes a request's tokens itself (Dynamo's local block hashes, with the LoRA
//! name), so that `/v1/route` with token ids finds what an engine cached without knowing the
//! engine's hash seed. A stored event's blocks therefore get **local hashes computed from
//! the event's `token_ids`** the same way, and **the engine's block hash is kept as the
//! sequence hash**: the worker's own name for the block, which its removals use, and which
//! `parent_block_hash` links to. Blocks are whole: an event whose `token_ids` do not cover
//! `block_size` tokens per block keeps the blocks they cover; an event whose `block_size`
//! is not the engine's configured one is dropped and counted (its blocks could never match
//! a request hashed at the configured size), as are the blocks of offload connectors that
//! publish no tokens.
//!
//! # Attention groups
//!
//! Hybrid models publish one group per attention kind. Only full attention (and MLA and
//! sink-full, which cache whole prefixes the same way) is indexed: a sliding-window group
//! holds only the last window's blocks, so its prefix never matches what a request can
//! reuse (llm-d learned this the hard way). An event names its group's kind, or its group
//! index whose kind an earlier event of the publisher named; a group never named is kept only
//! if it is group 0, and an event without group information is kept.
//!
//! # Tiers
//!
//! `medium` names where the blocks are: `GPU` (or absent) is the device; vLLM's `CPU`,
//! SGLang's `CPU_PINNED` host memory; `DISK`, `STORAGE` disk; `EXTERNAL`, `SHARED_STORAGE`,
//! `REMOTE` a shared or remote pool. The event carries its tier ([`StorageTier`]); an
//! unknown medium is counted and its event dropped from every credit. Events whose
//! `locality` is `REMOTE` describe another engine's cache and are dropped, as Dynamo does.

use std::collections::HashMap;

use crate::codec::vllm::{BlockRemoved, BlockStored, EngineEvent, EventBatch};
use crate::event::{KvCacheEvent, RouterEvent};
use crate::hash::{HashOptions, LocalBlockHash, SequenceBlockHash, local_block_hashes};
use crate::worker::{DpRank, StorageTier, WorkerId};

/// What a batch's conversion set aside, to be counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Dropped {
    /// Events of a group that is not full attention.
    pub other_groups: u64,
    /// Events whose block size is not the engine's.
    pub block_size: u64,
    /// Stored blocks without the tokens to hash them.
    pub no_tokens: u64,
    /// Events on a medium we do not know.
    pub unknown_medium: u64,
    /// Events of another engine (`locality` REMOTE).
    pub remote: u64,
    /// Events of a type we do not know.
    pub unknown_type: u64,
}

impl Dropped {
    /// Adds `o`.
    pub fn add(&mut self, o: &Dropped) {
        self.other_groups += o.other_groups;
        self.block_size += o.block_size;
        self.no_tokens += o.no_tokens;
        self.unknown_medium += o.unknown_medium;
        self.remote += o.remote;
        self.unknown_type += o.unknown_type;
    }

    /// Whether nothing was set aside.
    pub fn is_empty(&self) -> bool {
        *self == Dropped::default()
    }
}

/// The tier a `medium` names; `None` for a name we do not know.
pub fn tier_of(medium: Option<&str>) -> Option<StorageTier> {
    let Some(m) = medium else {
        return Some(StorageTier::Device);
    };
    Some(match m.to_ascii_uppercase().as_str() {
        "GPU" | "DEVICE" | "CUDA" => StorageTier::Device,
        "CPU" | "CPU_PINNED" | "CPU_TIER1" | "HOST" => StorageTier::HostPinned,
        "DISK" | "STORAGE" | "NVME" | "CPU_TIER2" => StorageTier::Disk,
        "EXTERNAL" | "SHARED_STORAGE" | "SHARED" | "REMOTE" | "NETWORK" => StorageTier::External,
        _ => return None,
    })
}

/// Attention kinds whose blocks are cached prefixes.
fn is_prefix_kind(kind: &str) -> bool {
    matches!(
        kind,
        "full_attention" | "mla_attention" | "sink_full_attention"
    )
}

/// One publisher's converter: its worker, configured block size and learnt groups, and the
/// event ids it numbers its output with.
#[derive(Debug, Clone)]
pub struct Converter {
    worker_id: WorkerId,
    block_size: u32,
    /// Kinds named so far, per (dp rank, group).
    kinds: HashMap<(DpRank, u32), bool>,
    next_event_id: u64,
}

impl Converter {
    /// A converter for `worker_id`'s engine at `block_size` tokens per block; its events are
    /// numbered from 0.
    pub fn new(worker_id: WorkerId, block_size: u32) -> Self {
        Self {
            worker_id,
            block_size,
            kinds: HashMap::new(),
            next_event_id: 0,
        }
    }

    /// The id the next event gets.
    pub fn next_event_id(&self) -> u64 {
        self.next_event_id
    }

    /// Forgets the groups learnt so far (the publisher restarted, or was reset). The
    /// numbering goes on: a reset is a [`Self::cleared`] event in the same stream.
    pub fn reset(&mut self) {
        self.kinds.clear();
    }

    fn id(&mut self) -> u64 {
        let id = self.next_event_id;
        self.next_event_id += 1;
        id
    }

    /// A `Cleared` event of `dp_rank` (to reset the worker's state there), numbered.
    pub fn cleared(&mut self, dp_rank: DpRank) -> RouterEvent {
        let id = self.id();
        RouterEvent::new(self.worker_id, KvCacheEvent::cleared(id, dp_rank))
    }

    /// Whether events of this group (with this kind, if named) are indexed; learns kinds.
    fn keep_group(&mut self, dp: DpRank, group: Option<u32>, kind: Option<&str>) -> bool {
        match (group, kind) {
            (g, Some(kind)) => {
                let keep = is_prefix_kind(kind);
                if let Some(g) = g {
                    self.kinds.insert((dp, g), keep);
                }
                keep
            }
            (Some(g), None) => self.kinds.get(&(dp, g)).copied().unwrap_or(g == 0),
            (None, None) => true,
        }
    }

    /// Converts one batch published by rank `dp_rank` (the batch's own rank wins when it
    /// names one); what was set aside is added to `dropped`.
    pub fn convert(
        &mut self,
        batch: EventBatch,
        dp_rank: DpRank,
        dropped: &mut Dropped,
    ) -> Vec<RouterEvent> {
        let dp = batch.dp_rank.unwrap_or(dp_rank);
        let mut out = Vec::with_capacity(batch.events.len());
        for e in batch.events {
            match e {
                EngineEvent::Stored(s) => {
                    if let Some(ev) = self.stored(s, dp, dropped) {
                        out.push(ev);
                    }
                }
                EngineEvent::Removed(r) => {
                    if let Some(ev) = self.removed(r, dp, dropped) {
                        out.push(ev);
                    }
                }
                EngineEvent::AllCleared => out.push(self.cleared(dp)),
                EngineEvent::Unknown(_) => dropped.unknown_type += 1,
            }
        }
        out
    }

    /// The tier of an event on `medium` from `locality`, or why it is dropped.
    fn placed(
        medium: Option<&str>,
        locality: Option<&str>,
        dropped: &mut Dropped,
    ) -> Option<StorageTier> {
        if locality.is_some_and(|l| !l.eq_ignore_ascii_case("LOCAL")) {
            dropped.remote += 1;
            return None;
        }
        let tier = tier_of(medium);
        if tier.is_none() {
            dropped.unknown_medium += 1;
        }
        tier
    }

    fn stored(&mut self, s: BlockStored, dp: DpRank, dropped: &mut Dropped) -> Option<RouterEvent> {
        if !self.keep_group(dp, s.group_idx, s.kv_cache_spec_kind.as_deref()) {
            dropped.other_groups += 1;
            return None;
        }
        let tier = Self::placed(s.medium.as_deref(), s.locality.as_deref(), dropped)?;
        if s.block_size != 0 && s.block_size != self.block_size {
            dropped.block_size += 1;
            return None;
        }
        let opts = HashOptions {
            lora_name: s.lora_name.as_deref(),
            cache_namespace: s.cache_salt.as_deref(),
            ..Default::default()
        };
        let locals = local_block_hashes(&s.token_ids, self.block_size, &opts);
        let n = locals.len().min(s.block_hashes.len());
        dropped.no_tokens += (s.block_hashes.len() - n) as u64;
        if n == 0 {
            return None;
        }
        let blocks: Vec<(LocalBlockHash, SequenceBlockHash)> = locals
            .into_iter()
            .zip(s.block_hashes.into_iter().map(SequenceBlockHash))
            .take(n)
            .collect();
        let id = self.id();
        let parent = s.parent_block_hash.map(SequenceBlockHash);
        let mut ev = RouterEvent::new(self.worker_id, KvCacheEvent::stored(id, dp, parent, blocks));
        ev.storage_tier = tier;
        Some(ev)
    }

    fn removed(
        &mut self,
        r: BlockRemoved,
        dp: DpRank,
        dropped: &mut Dropped,
    ) -> Option<RouterEvent> {
        if !self.keep_group(dp, r.group_idx, None) {
            dropped.other_groups += 1;
            return None;
        }
        let tier = Self::placed(r.medium.as_deref(), r.locality.as_deref(), dropped)?;
        if r.block_hashes.is_empty() {
            return None;
        }
        let id = self.id();
        let blocks = r.block_hashes.into_iter().map(SequenceBlockHash);
        let mut ev = RouterEvent::new(self.worker_id, KvCacheEvent::removed(id, dp, blocks));
        ev.storage_tier = tier;
        Some(ev)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::event::KvEventData;

    fn stored(hashes: &[u64], tokens: &[u32]) -> BlockStored {
        BlockStored {
            block_hashes: hashes.to_vec(),
            token_ids: tokens.to_vec(),
            block_size: 2,
            ..Default::default()
        }
    }

    fn batch(events: Vec<EngineEvent>) -> EventBatch {
        EventBatch {
            ts: 0.0,
            events,
            dp_rank: None,
        }
    }

    #[test]
    fn local_hashes_from_tokens_engine_hashes_as_names() {
        let mut c = Converter::new(7, 2);
        let mut d = Dropped::default();
        let mut s = stored(&[100, 101], &[1, 2, 3, 4]);
        s.parent_block_hash = Some(99);
        let out = c.convert(batch(vec![EngineEvent::Stored(s)]), 3, &mut d);
        assert!(d.is_empty());
        assert_eq!(out.len(), 1);
        assert_eq!(
            (
                out[0].worker_id,
                out[0].event.dp_rank,
                out[0].event.event_id
            ),
            (7, 3, 0)
        );
        let KvEventData::Stored(sd) = &out[0].event.data else {
            panic!()
        };
        let want = local_block_hashes(&[1, 2, 3, 4], 2, &HashOptions::default());
        let got: Vec<LocalBlockHash> = sd.blocks.iter().map(|b| b.tokens_hash).collect();
        assert_eq!(got, want);
        assert_eq!(sd.blocks[1].block_hash, SequenceBlockHash(101));
        assert_eq!(sd.parent_hash, Some(SequenceBlockHash(99)));
        // LoRA changes the local hashes, as the router's hashing of a request does.
        let mut l = stored(&[5], &[1, 2]);
        l.lora_name = Some("a".into());
        let out = c.convert(batch(vec![EngineEvent::Stored(l)]), 3, &mut d);
        let KvEventData::Stored(sd) = &out[0].event.data else {
            panic!()
        };
        let opts = HashOptions {
            lora_name: Some("a"),
            ..Default::default()
        };
        assert_eq!(
            sd.blocks[0].tokens_hash,
            local_block_hashes(&[1, 2], 2, &opts)[0]
        );
        assert_eq!(out[0].event.event_id, 1);
    }

    #[test]
    fn groups_sizes_tiers_and_locality() {
        let mut c = Converter::new(1, 2);
        let mut d = Dropped::default();
        let mut swa = stored(&[1], &[1, 2]);
        swa.group_idx = Some(1);
        swa.kv_cache_spec_kind = Some("sliding_window".into());
        let mut full = stored(&[2], &[1, 2]);
        full.group_idx = Some(0);
        full.kv_cache_spec_kind = Some("full_attention".into());
        let removed_swa = BlockRemoved {
            block_hashes: vec![1],
            group_idx: Some(1),
            ..Default::default()
        };
        let unnamed_group = BlockRemoved {
            block_hashes: vec![9],
            group_idx: Some(5),
            ..Default::default()
        };
        let mut wrong_size = stored(&[3], &[1, 2, 3, 4]);
        wrong_size.block_size = 4;
        let mut host = stored(&[4], &[1, 2]);
        host.medium = Some("CPU".into());
        let mut odd = stored(&[5], &[1, 2]);
        odd.medium = Some("HOLOGRAM".into());
        let mut remote = stored(&[6], &[1, 2]);
        remote.locality = Some("REMOTE".into());
        let short = stored(&[7, 8], &[1, 2, 3]);
        let out = c.convert(
            batch(vec![
                EngineEvent::Stored(swa),
                EngineEvent::Stored(full),
                EngineEvent::Removed(removed_swa),
                EngineEvent::Removed(unnamed_group),
                EngineEvent::Stored(wrong_size),
                EngineEvent::Stored(host),
                EngineEvent::Stored(odd),
                EngineEvent::Stored(remote),
                EngineEvent::Stored(short),
                EngineEvent::Unknown("X".into()),
            ]),
            0,
            &mut d,
        );
        assert_eq!(
            d,
            Dropped {
                other_groups: 3,
                block_size: 1,
                no_tokens: 1,
                unknown_medium: 1,
                remote: 1,
                unknown_type: 1,
            }
        );
        // Kept: the full-attention store, the host-tier store, one block of the short one.
        assert_eq!(out.len(), 3);
        assert_eq!(out[1].storage_tier, StorageTier::HostPinned);
        assert_eq!(out[2].block_count(), 1);
        let ids: Vec<u64> = out.iter().map(|e| e.event.event_id).collect();
        assert_eq!(ids, [0, 1, 2]);
    }

    #[test]
    fn mediums_of_every_engine() {
        assert_eq!(tier_of(None), Some(StorageTier::Device));
        for (m, t) in [
            ("GPU", StorageTier::Device),
            ("CPU", StorageTier::HostPinned),
            ("CPU_PINNED", StorageTier::HostPinned),
            ("DISK", StorageTier::Disk),
            ("STORAGE", StorageTier::Disk),
            ("EXTERNAL", StorageTier::External),
            ("SHARED_STORAGE", StorageTier::External),
        ] {
            assert_eq!(tier_of(Some(m)), Some(t), "{m}");
        }
        assert_eq!(tier_of(Some("TAPE")), None);
    }
}
