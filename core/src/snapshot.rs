//! The snapshot file format: the router's index state, every worker's last event id, and
//! the JetStream position the state covers, in one self-validating file.
//!
//! The I/O (temporary file, fsync, atomic rename, mmap) lives in `kvrouter-io`; this module
//! only turns state into bytes and bytes back into state, and trusts nothing it reads.
//!
//! # Layout (little endian throughout)
//!
//! ```text
//! 0   header, 64 bytes
//!       0  magic            b"KVRSNAP\0"
//!       8  version          u32 (FORMAT_VERSION)
//!      12  section count    u32 (at most MAX_SECTIONS)
//!      16  created          u64, ms since the Unix epoch
//!      24  file length      u64, the whole file
//!      32  reserved         24 zero bytes
//!      56  header checksum  u64, xxh3 of bytes 0..56 and of the section table
//! 64  section table, 32 bytes per section
//!       0  kind             u32 (SectionKind)
//!       4  reserved         u32
//!       8  offset           u64, from the start of the file
//!      16  length           u64
//!      24  checksum         u64, xxh3 of the section's bytes
//! ..  sections
//!     META     JSON: SnapshotMeta
//!     WORKERS  u64 count, then count records of 40 bytes:
//!                worker_id u64, dp_rank u32, flags u32 (bit 0: has last id, bit 1:
//!                announced), last_event_id u64, publisher u64, heartbeat_ms u64
//!     CHAINS   records until the end of the section:
//!                worker u32 (index into WORKERS), flags u32 (bit 0: has parent),
//!                parent u64, count u64, then count × (sequence hash u64, local hash u64)
//!     LOWER    (version 2; optional) records of 24 bytes, the lower-tier blocks:
//!                worker u32 (index into WORKERS), tier u32 (1 host-pinned, 2 disk,
//!                3 external), engine name u64, path hash u64
//!     POOL     (version 3; optional) records of 32 bytes, the shared-pool blocks:
//!                source worker_id u64, source dp_rank u32, reserved u32 (0),
//!                engine name u64, path hash u64
//! ```
//!
//! Lower-tier blocks are kept as the index keeps them ([`crate::index::tiers`]): a name and
//! the path hash it was placed at, restored as they are (no parent to resolve again).
//!
//! # Versions
//!
//! Version 2 added the LOWER section. A version 1 file still loads: it holds the device
//! tier only, and lower tiers refill from the engines' events. A version 1 reader refuses a
//! version 2 file with [`SnapshotError::UnsupportedVersion`] (it would drop the tiers).
//! Version 3 added the POOL section (shared-pool blocks, [`crate::index::tiers`]), which
//! names its sources directly: a pool's publisher is no worker, so it has no WORKERS
//! record. A version 2 file loads with an empty pool (it refills from the pools' events);
//! a version 2 reader refuses a version 3 file the same way.
//!
//! Every length, offset, count and index is checked against the bytes actually present
//! before it is used; every section's checksum is verified before it is parsed. Any failure
//! is a typed [`SnapshotError`]: the caller falls back to a full resync.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::Xxh3;

use crate::event::{KvCacheEvent, KvEventData, RouterEvent};
use crate::hash::{LocalBlockHash, SequenceBlockHash};
use crate::worker::{DpRank, StorageTier, WorkerDp, WorkerId};

/// The first eight bytes of every snapshot.
pub const MAGIC: [u8; 8] = *b"KVRSNAP\0";
/// The format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 3;
/// The oldest format version this build still reads (device tier only).
pub const OLDEST_READABLE: u32 = 1;
/// Sections a valid file may declare.
pub const MAX_SECTIONS: u32 = 16;

const HEADER_LEN: usize = 64;
const ENTRY_LEN: usize = 32;
const WORKER_LEN: usize = 40;
const BLOCK_LEN: usize = 16;
const LOWER_LEN: usize = 24;
const POOL_LEN: usize = 32;

/// The kinds of section.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum SectionKind {
    /// [`SnapshotMeta`] as JSON.
    Meta = 1,
    /// Worker records.
    Workers = 2,
    /// Stored chains.
    Chains = 3,
    /// Lower-tier blocks (version 2).
    Lower = 4,
    /// Shared-pool blocks (version 3).
    Pool = 5,
}

impl SectionKind {
    fn name(self) -> &'static str {
        match self {
            SectionKind::Meta => "meta",
            SectionKind::Workers => "workers",
            SectionKind::Chains => "chains",
            SectionKind::Lower => "lower tiers",
            SectionKind::Pool => "shared pool",
        }
    }
}

/// Why a snapshot cannot be used. Each is detected before any of the file's offsets or
/// counts is trusted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SnapshotError {
    /// Shorter than its header, or than the length its header declares.
    #[error("truncated snapshot: {have} bytes, {need} needed")]
    Truncated {
        /// Bytes present.
        have: u64,
        /// Bytes needed.
        need: u64,
    },
    /// Not a kvrouter snapshot.
    #[error("not a kvrouter snapshot (bad magic)")]
    BadMagic,
    /// Written by another format version.
    #[error(
        "snapshot format version {found}, this build reads {OLDEST_READABLE} to {FORMAT_VERSION}"
    )]
    UnsupportedVersion {
        /// The file's version.
        found: u32,
    },
    /// The header or section table does not match its checksum.
    #[error("snapshot header checksum mismatch")]
    HeaderChecksum,
    /// A section's bytes do not match its checksum.
    #[error("snapshot section {section}: checksum mismatch")]
    SectionChecksum {
        /// The section.
        section: &'static str,
    },
    /// The header or a section is inconsistent.
    #[error("malformed snapshot ({section}): {why}")]
    Malformed {
        /// Where.
        section: &'static str,
        /// What.
        why: String,
    },
    /// A state that cannot be written (an event other than a stored chain).
    #[error("cannot snapshot: {0}")]
    Unencodable(String),
}

impl SnapshotError {
    /// A short stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            SnapshotError::Truncated { .. } => "truncated",
            SnapshotError::BadMagic => "bad_magic",
            SnapshotError::UnsupportedVersion { .. } => "unsupported_version",
            SnapshotError::HeaderChecksum => "header_checksum",
            SnapshotError::SectionChecksum { .. } => "section_checksum",
            SnapshotError::Malformed { .. } => "malformed",
            SnapshotError::Unencodable(_) => "unencodable",
        }
    }
}

fn malformed(section: &'static str, why: impl Into<String>) -> SnapshotError {
    SnapshotError::Malformed {
        section,
        why: why.into(),
    }
}

/// The JetStream position a snapshot covers: every message of `stream` up to `seq` is in
/// the state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamPosition {
    /// The stream's name.
    pub stream: String,
    /// The last stream sequence covered (0: none).
    pub seq: u64,
}

/// What a snapshot says about itself.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct SnapshotMeta {
    /// When it was taken, ms since the Unix epoch.
    pub created_unix_ms: u64,
    /// The router that wrote it.
    pub router_id: u64,
    /// The JetStream position covered (durable mode only).
    pub stream: Option<StreamPosition>,
    /// Blocks in the file (informational; the chains are authoritative).
    pub blocks: u64,
}

/// What the router knows of one (worker, dp rank) beyond its blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerRecord {
    /// The worker.
    pub worker: WorkerDp,
    /// The id of the last event applied for it.
    pub last_event_id: Option<u64>,
    /// The publisher of that event (restart detection).
    pub publisher: u64,
    /// Whether the worker announced itself (it has a local indexer).
    pub announced: bool,
    /// Its heartbeat interval when announced, ms (0 otherwise).
    pub heartbeat_ms: u64,
}

/// One block of a shared pool: its source (the publisher of its `cache_owner` events), its
/// engine name and the path hash it was placed at ([`crate::index::tiers`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolRecord {
    /// The source.
    pub source: WorkerDp,
    /// The engine's name of the block.
    pub name: u64,
    /// The router's path hash of the block.
    pub path: u64,
}

/// One block a worker holds on a lower tier: its engine name and the path hash it was
/// placed at ([`crate::index::tiers`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LowerRecord {
    /// The worker.
    pub worker: WorkerDp,
    /// Its tier (never the device).
    pub tier: StorageTier,
    /// The engine's name of the block.
    pub name: u64,
    /// The router's path hash of the block.
    pub path: u64,
}

fn tier_code(t: StorageTier) -> u32 {
    match t {
        StorageTier::Device => 0,
        StorageTier::HostPinned => 1,
        StorageTier::Disk => 2,
        StorageTier::External => 3,
    }
}

/// The lower tier a LOWER record's code names (`None` for the device or no tier).
fn lower_tier(code: u32) -> Option<StorageTier> {
    match code {
        1 => Some(StorageTier::HostPinned),
        2 => Some(StorageTier::Disk),
        3 => Some(StorageTier::External),
        _ => None,
    }
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn xxh3(parts: &[&[u8]]) -> u64 {
    let mut h = Xxh3::new();
    for p in parts {
        h.update(p);
    }
    h.digest()
}

/// Writes a snapshot of `workers` and their stored chains (`events`, as an index's `dump`
/// gives them: `Cleared` events are implied and skipped; every stored event's worker must be
/// among `workers`).
pub fn encode(
    meta: &SnapshotMeta,
    workers: &[WorkerRecord],
    events: &[RouterEvent],
) -> Result<Vec<u8>, SnapshotError> {
    encode_with_lower(meta, workers, events, &[])
}

/// [`encode`] with the workers' lower-tier blocks (each worker among `workers`, no record
/// on the device tier).
pub fn encode_with_lower(
    meta: &SnapshotMeta,
    workers: &[WorkerRecord],
    events: &[RouterEvent],
    lower: &[LowerRecord],
) -> Result<Vec<u8>, SnapshotError> {
    encode_with_tiers(meta, workers, events, lower, &[])
}

/// [`encode_with_lower`] with the shared pools' blocks.
pub fn encode_with_tiers(
    meta: &SnapshotMeta,
    workers: &[WorkerRecord],
    events: &[RouterEvent],
    lower: &[LowerRecord],
    pool: &[PoolRecord],
) -> Result<Vec<u8>, SnapshotError> {
    let mut meta = meta.clone();
    let mut slot = std::collections::HashMap::with_capacity(workers.len());
    let mut wsec = Vec::with_capacity(8 + workers.len() * WORKER_LEN);
    put_u64(&mut wsec, workers.len() as u64);
    for (i, w) in workers.iter().enumerate() {
        if slot.insert(w.worker, i as u32).is_some() {
            return Err(SnapshotError::Unencodable(format!(
                "worker {} listed twice",
                w.worker
            )));
        }
        put_u64(&mut wsec, w.worker.worker_id);
        put_u32(&mut wsec, w.worker.dp_rank);
        let flags = u32::from(w.last_event_id.is_some()) | (u32::from(w.announced) << 1);
        put_u32(&mut wsec, flags);
        put_u64(&mut wsec, w.last_event_id.unwrap_or(0));
        put_u64(&mut wsec, w.publisher);
        put_u64(&mut wsec, w.heartbeat_ms);
    }
    let mut csec = Vec::new();
    let mut blocks = 0u64;
    for e in events {
        let s = match &e.event.data {
            KvEventData::Cleared => continue,
            KvEventData::Stored(s) => s,
            KvEventData::Removed(_) => {
                return Err(SnapshotError::Unencodable(
                    "a removal is not state".to_owned(),
                ));
            }
        };
        if s.blocks.is_empty() {
            continue; // stores nothing (and `parse` refuses empty chains)
        }
        let Some(&i) = slot.get(&e.worker()) else {
            return Err(SnapshotError::Unencodable(format!(
                "chain of unlisted worker {}",
                e.worker()
            )));
        };
        put_u32(&mut csec, i);
        put_u32(&mut csec, u32::from(s.parent_hash.is_some()));
        put_u64(&mut csec, s.parent_hash.map_or(0, |p| p.0));
        put_u64(&mut csec, s.blocks.len() as u64);
        for b in &s.blocks {
            put_u64(&mut csec, b.block_hash.0);
            put_u64(&mut csec, b.tokens_hash.0);
        }
        blocks += s.blocks.len() as u64;
    }
    meta.blocks = blocks;
    let msec = serde_json::to_vec(&meta).map_err(|e| SnapshotError::Unencodable(e.to_string()))?;
    let mut lsec = Vec::with_capacity(lower.len() * LOWER_LEN);
    for r in lower {
        let Some(&i) = slot.get(&r.worker) else {
            return Err(SnapshotError::Unencodable(format!(
                "lower-tier block of unlisted worker {}",
                r.worker
            )));
        };
        if r.tier == StorageTier::Device {
            return Err(SnapshotError::Unencodable(
                "a device block among the lower tiers".to_owned(),
            ));
        }
        put_u32(&mut lsec, i);
        put_u32(&mut lsec, tier_code(r.tier));
        put_u64(&mut lsec, r.name);
        put_u64(&mut lsec, r.path);
    }

    let mut psec = Vec::with_capacity(pool.len() * POOL_LEN);
    for r in pool {
        put_u64(&mut psec, r.source.worker_id);
        put_u32(&mut psec, r.source.dp_rank);
        put_u32(&mut psec, 0);
        put_u64(&mut psec, r.name);
        put_u64(&mut psec, r.path);
    }

    let sections = [
        (SectionKind::Meta, msec),
        (SectionKind::Workers, wsec),
        (SectionKind::Chains, csec),
        (SectionKind::Lower, lsec),
        (SectionKind::Pool, psec),
    ];
    let body_start = HEADER_LEN + ENTRY_LEN * sections.len();
    let total = body_start + sections.iter().map(|(_, s)| s.len()).sum::<usize>();
    let mut table = Vec::with_capacity(ENTRY_LEN * sections.len());
    let mut offset = body_start as u64;
    for (kind, bytes) in &sections {
        put_u32(&mut table, *kind as u32);
        put_u32(&mut table, 0);
        put_u64(&mut table, offset);
        put_u64(&mut table, bytes.len() as u64);
        put_u64(&mut table, xxh3(&[bytes]));
        offset += bytes.len() as u64;
    }
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(&MAGIC);
    put_u32(&mut out, FORMAT_VERSION);
    put_u32(&mut out, sections.len() as u32);
    put_u64(&mut out, meta.created_unix_ms);
    put_u64(&mut out, total as u64);
    out.extend_from_slice(&[0; 24]);
    let sum = xxh3(&[&out[..56], &table]);
    put_u64(&mut out, sum);
    out.extend_from_slice(&table);
    for (_, bytes) in &sections {
        out.extend_from_slice(bytes);
    }
    debug_assert_eq!(out.len(), total);
    Ok(out)
}

/// Bounds-checked little-endian reads.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
    section: &'static str,
}

impl<'a> Cursor<'a> {
    fn new(bytes: &'a [u8], section: &'static str) -> Self {
        Self {
            bytes,
            at: 0,
            section,
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], SnapshotError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| {
                malformed(self.section, format!("record past the end at {}", self.at))
            })?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u32(&mut self) -> Result<u32, SnapshotError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, SnapshotError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    fn remaining(&self) -> usize {
        self.bytes.len() - self.at
    }
}

/// A validated snapshot, borrowing the file's bytes (typically a read-only mmap).
#[derive(Debug, Clone)]
pub struct SnapshotView<'a> {
    meta: SnapshotMeta,
    workers: Vec<WorkerRecord>,
    chains: &'a [u8],
    chain_count: usize,
    blocks: u64,
    lower: &'a [u8],
    pool: &'a [u8],
    version: u32,
}

/// Parses and fully validates a snapshot: header, checksums, every record's bounds and
/// every worker index. Nothing in the file is trusted before it is checked.
pub fn parse(bytes: &[u8]) -> Result<SnapshotView<'_>, SnapshotError> {
    let have = bytes.len() as u64;
    if bytes.len() < HEADER_LEN {
        return Err(SnapshotError::Truncated {
            have,
            need: HEADER_LEN as u64,
        });
    }
    if bytes[..8] != MAGIC {
        return Err(SnapshotError::BadMagic);
    }
    let mut h = Cursor::new(&bytes[8..HEADER_LEN], "header");
    let version = h.u32()?;
    if !(OLDEST_READABLE..=FORMAT_VERSION).contains(&version) {
        return Err(SnapshotError::UnsupportedVersion { found: version });
    }
    let count = h.u32()?;
    let _created = h.u64()?;
    let declared = h.u64()?;
    if count > MAX_SECTIONS {
        return Err(malformed("header", format!("{count} sections")));
    }
    if declared > have {
        return Err(SnapshotError::Truncated {
            have,
            need: declared,
        });
    }
    if declared < have {
        return Err(malformed(
            "header",
            format!("{} bytes after the declared end", have - declared),
        ));
    }
    let table_end = HEADER_LEN + ENTRY_LEN * count as usize;
    if table_end > bytes.len() {
        return Err(SnapshotError::Truncated {
            have,
            need: table_end as u64,
        });
    }
    let mut sum_bytes = [0u8; 8];
    sum_bytes.copy_from_slice(&bytes[56..64]);
    // Under cargo-fuzz checksums are not enforced, so that mutated inputs reach the
    // structural checks below (which must hold on their own).
    if xxh3(&[&bytes[..56], &bytes[HEADER_LEN..table_end]]) != u64::from_le_bytes(sum_bytes)
        && !cfg!(fuzzing)
    {
        return Err(SnapshotError::HeaderChecksum);
    }
    let mut sections: [Option<&[u8]>; 5] = [None; 5];
    let mut t = Cursor::new(&bytes[HEADER_LEN..table_end], "section table");
    for _ in 0..count {
        let kind = t.u32()?;
        let _reserved = t.u32()?;
        let offset = t.u64()?;
        let len = t.u64()?;
        let sum = t.u64()?;
        let kind = match kind {
            1 => SectionKind::Meta,
            2 => SectionKind::Workers,
            3 => SectionKind::Chains,
            4 if version >= 2 => SectionKind::Lower,
            5 if version >= 3 => SectionKind::Pool,
            // Unknown sections of a future minor revision are skipped (they are covered by
            // the header checksum, and their bounds are not needed).
            _ => continue,
        };
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= have && offset >= table_end as u64)
            .ok_or_else(|| malformed(kind.name(), "out of the file's bounds"))?;
        let s = &bytes[offset as usize..end as usize];
        if xxh3(&[s]) != sum && !cfg!(fuzzing) {
            return Err(SnapshotError::SectionChecksum {
                section: kind.name(),
            });
        }
        let idx = kind as usize - 1;
        if sections[idx].replace(s).is_some() {
            return Err(malformed(kind.name(), "declared twice"));
        }
    }
    let [Some(msec), Some(wsec), Some(csec), lsec, psec] = sections else {
        return Err(malformed("section table", "a required section is missing"));
    };
    let meta: SnapshotMeta =
        serde_json::from_slice(msec).map_err(|e| malformed("meta", e.to_string()))?;

    let mut w = Cursor::new(wsec, "workers");
    let n = w.u64()?;
    if n.checked_mul(WORKER_LEN as u64) != Some(w.remaining() as u64) {
        return Err(malformed(
            "workers",
            format!("{n} records in {} bytes", w.remaining()),
        ));
    }
    let mut workers = Vec::with_capacity(n as usize);
    let mut seen = std::collections::HashSet::with_capacity(n as usize);
    for _ in 0..n {
        let worker_id: WorkerId = w.u64()?;
        let dp_rank: DpRank = w.u32()?;
        let flags = w.u32()?;
        let last = w.u64()?;
        let publisher = w.u64()?;
        let heartbeat_ms = w.u64()?;
        let worker = WorkerDp::new(worker_id, dp_rank);
        if !seen.insert(worker) {
            return Err(malformed(
                "workers",
                format!("worker {worker} listed twice"),
            ));
        }
        workers.push(WorkerRecord {
            worker,
            last_event_id: (flags & 1 != 0).then_some(last),
            publisher,
            announced: flags & 2 != 0,
            heartbeat_ms,
        });
    }

    // Walk the chains once so that iterating them later cannot fail.
    let mut c = Cursor::new(csec, "chains");
    let mut chain_count = 0;
    let mut blocks = 0u64;
    while c.remaining() > 0 {
        let wi = c.u32()?;
        let flags = c.u32()?;
        let _parent = c.u64()?;
        let len = c.u64()?;
        if wi as usize >= workers.len() {
            return Err(malformed(
                "chains",
                format!("worker index {wi} out of range"),
            ));
        }
        if flags > 1 {
            return Err(malformed("chains", format!("unknown flags {flags:#x}")));
        }
        if len == 0 {
            return Err(malformed("chains", "an empty chain"));
        }
        let need = len
            .checked_mul(BLOCK_LEN as u64)
            .filter(|&b| b <= c.remaining() as u64)
            .ok_or_else(|| malformed("chains", format!("a chain of {len} blocks past the end")))?;
        c.take(need as usize)?;
        chain_count += 1;
        blocks += len;
    }
    let lsec = lsec.unwrap_or(&[]);
    if lsec.len() % LOWER_LEN != 0 {
        return Err(malformed(
            "lower tiers",
            format!("{} bytes is no whole number of records", lsec.len()),
        ));
    }
    let mut l = Cursor::new(lsec, "lower tiers");
    while l.remaining() > 0 {
        let wi = l.u32()?;
        let tier = l.u32()?;
        let _name = l.u64()?;
        let _path = l.u64()?;
        if wi as usize >= workers.len() {
            return Err(malformed(
                "lower tiers",
                format!("worker index {wi} out of range"),
            ));
        }
        if lower_tier(tier).is_none() {
            return Err(malformed("lower tiers", format!("tier {tier}")));
        }
    }
    let psec = psec.unwrap_or(&[]);
    if psec.len() % POOL_LEN != 0 {
        return Err(malformed(
            "shared pool",
            format!("{} bytes is no whole number of records", psec.len()),
        ));
    }
    Ok(SnapshotView {
        meta,
        workers,
        chains: csec,
        chain_count,
        blocks,
        lower: lsec,
        pool: psec,
        version,
    })
}

impl<'a> SnapshotView<'a> {
    /// What the snapshot says about itself.
    pub fn meta(&self) -> &SnapshotMeta {
        &self.meta
    }

    /// Every (worker, dp rank) it knows, in file order.
    pub fn workers(&self) -> &[WorkerRecord] {
        &self.workers
    }

    /// Stored chains in the file.
    pub fn chain_count(&self) -> usize {
        self.chain_count
    }

    /// The file's format version.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Device blocks in the file.
    pub fn block_count(&self) -> u64 {
        self.blocks
    }

    /// Lower-tier blocks in the file (0 in a version 1 file).
    pub fn lower_count(&self) -> usize {
        self.lower.len() / LOWER_LEN
    }

    /// The lower-tier blocks, in file order.
    pub fn lower(&self) -> impl Iterator<Item = LowerRecord> + '_ {
        let mut c = Cursor::new(self.lower, "lower tiers");
        std::iter::from_fn(move || {
            if c.remaining() == 0 {
                return None;
            }
            // Validated by `parse`: whole records, a worker index in range, a lower tier.
            let worker = self.workers[c.u32().ok()? as usize].worker;
            let tier = lower_tier(c.u32().ok()?)?;
            Some(LowerRecord {
                worker,
                tier,
                name: c.u64().ok()?,
                path: c.u64().ok()?,
            })
        })
    }

    /// Shared-pool blocks in the file (0 before version 3).
    pub fn pool_count(&self) -> usize {
        self.pool.len() / POOL_LEN
    }

    /// The shared-pool blocks, in file order.
    pub fn pool(&self) -> impl Iterator<Item = PoolRecord> + '_ {
        let mut c = Cursor::new(self.pool, "shared pool");
        std::iter::from_fn(move || {
            if c.remaining() == 0 {
                return None;
            }
            // Whole records (checked by `parse`); any source, name and path is valid.
            let worker_id = c.u64().ok()?;
            let dp_rank = c.u32().ok()?;
            let _reserved = c.u32().ok()?;
            Some(PoolRecord {
                source: WorkerDp::new(worker_id, dp_rank),
                name: c.u64().ok()?,
                path: c.u64().ok()?,
            })
        })
    }

    /// Events that rebuild the state in an empty index: per worker a `Cleared` carrying its
    /// last event id (so that workers without blocks are known too), then every chain as a
    /// `Stored` event, parent first.
    pub fn events(&self) -> impl Iterator<Item = RouterEvent> + '_ {
        let id = |w: &WorkerRecord| w.last_event_id.unwrap_or(0);
        let cleared = self.workers.iter().map(move |w| {
            RouterEvent::new(
                w.worker.worker_id,
                KvCacheEvent::cleared(id(w), w.worker.dp_rank),
            )
        });
        let mut c = Cursor::new(self.chains, "chains");
        let chains = std::iter::from_fn(move || {
            if c.remaining() == 0 {
                return None;
            }
            // Validated by `parse`: these reads cannot fail.
            let wi = c.u32().ok()? as usize;
            let has_parent = c.u32().ok()? == 1;
            let parent = c.u64().ok()?;
            let len = c.u64().ok()? as usize;
            let w = &self.workers[wi];
            let mut blocks = Vec::with_capacity(len);
            for _ in 0..len {
                let seq = c.u64().ok()?;
                let local = c.u64().ok()?;
                blocks.push((LocalBlockHash(local), SequenceBlockHash(seq)));
            }
            Some(RouterEvent::new(
                w.worker.worker_id,
                KvCacheEvent::stored(
                    id(w),
                    w.worker.dp_rank,
                    has_parent.then_some(SequenceBlockHash(parent)),
                    blocks,
                ),
            ))
        });
        cleared.chain(chains)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::index::{Index, ReferenceIndex};

    fn sample() -> (SnapshotMeta, Vec<WorkerRecord>, Vec<RouterEvent>) {
        let mut idx = ReferenceIndex::new();
        let s = |w, id, parent: Option<u64>, bs: &[u64]| {
            RouterEvent::new(
                w,
                KvCacheEvent::stored(
                    id,
                    0,
                    parent.map(SequenceBlockHash),
                    bs.iter()
                        .map(|&b| (LocalBlockHash(b * 10), SequenceBlockHash(b))),
                ),
            )
        };
        idx.apply(s(1, 0, None, &[1, 2, 3])).unwrap();
        idx.apply(s(1, 1, Some(2), &[4])).unwrap();
        idx.apply(s(u64::MAX, 7, None, &[1, 9])).unwrap();
        idx.apply(RouterEvent::new(5, KvCacheEvent::cleared(3, 2)))
            .unwrap();
        let workers: Vec<WorkerRecord> = idx
            .workers()
            .iter()
            .map(|s| WorkerRecord {
                worker: s.worker,
                last_event_id: s.last_event_id,
                publisher: 42,
                announced: s.worker.worker_id == 1,
                heartbeat_ms: 1000,
            })
            .collect();
        let meta = SnapshotMeta {
            created_unix_ms: 1_700_000_000_000,
            router_id: 9,
            stream: Some(StreamPosition {
                stream: "KV".into(),
                seq: 77,
            }),
            blocks: 0,
        };
        (meta, workers, idx.dump())
    }

    fn rebuild(view: &SnapshotView<'_>) -> ReferenceIndex {
        let mut idx = ReferenceIndex::new();
        for e in view.events() {
            idx.apply(e).unwrap();
        }
        idx
    }

    #[test]
    fn round_trip_rebuilds_the_same_state() {
        let (meta, workers, events) = sample();
        let bytes = encode(&meta, &workers, &events).unwrap();
        let view = parse(&bytes).unwrap();
        assert_eq!(view.meta().stream, meta.stream);
        assert_eq!(view.meta().blocks, 6);
        assert_eq!(view.block_count(), 6);
        assert_eq!(view.workers(), &workers[..]);
        let mut original = ReferenceIndex::new();
        for e in events {
            original.apply(e).unwrap();
        }
        let rebuilt = rebuild(&view);
        assert_eq!(rebuilt.dump(), original.dump());
        assert_eq!(rebuilt.workers(), original.workers());
    }

    fn lower_sample(workers: &[WorkerRecord]) -> Vec<LowerRecord> {
        let w = workers[0].worker;
        vec![
            LowerRecord {
                worker: w,
                tier: StorageTier::HostPinned,
                name: 3,
                path: 0xabc,
            },
            LowerRecord {
                worker: w,
                tier: StorageTier::External,
                name: 5,
                path: u64::MAX,
            },
        ]
    }

    /// `bytes` as a version 1 writer would have stamped them (same sections).
    fn restamp(bytes: &[u8], version: u32) -> Vec<u8> {
        let mut b = bytes.to_vec();
        b[8..12].copy_from_slice(&version.to_le_bytes());
        let count = u32::from_le_bytes([b[12], b[13], b[14], b[15]]) as usize;
        let sum = xxh3(&[&b[..56], &b[HEADER_LEN..HEADER_LEN + ENTRY_LEN * count]]);
        b[56..64].copy_from_slice(&sum.to_le_bytes());
        b
    }

    #[test]
    fn lower_tiers_round_trip_and_old_files_load_device_only() {
        let (meta, workers, events) = sample();
        let lower = lower_sample(&workers);
        let bytes = encode_with_lower(&meta, &workers, &events, &lower).unwrap();
        let view = parse(&bytes).unwrap();
        assert_eq!(view.lower().collect::<Vec<_>>(), lower);
        assert_eq!(view.lower_count(), 2);
        assert_eq!(view.block_count(), 6);
        // A version 1 file (device tier only) loads; a LOWER section in one is not read.
        let old = restamp(&encode(&meta, &workers, &events).unwrap(), 1);
        let v1 = parse(&old).unwrap();
        assert_eq!((v1.block_count(), v1.lower_count()), (6, 0));
        assert_eq!((v1.version(), view.version()), (1, FORMAT_VERSION));
        assert_eq!(rebuild(&v1).dump(), rebuild(&view).dump());
        assert_eq!(parse(&restamp(&bytes, 1)).unwrap().lower_count(), 0);
        // What is not a lower-tier block is refused on the way in.
        let mut bad = lower.clone();
        bad[0].tier = StorageTier::Device;
        assert!(encode_with_lower(&meta, &workers, &events, &bad).is_err());
        bad[0].tier = StorageTier::Disk;
        bad[0].worker = WorkerDp::new(12345, 0);
        assert!(encode_with_lower(&meta, &workers, &events, &bad).is_err());
    }

    /// Shared-pool blocks of sources that are no worker of [`sample`].
    fn pool_sample() -> Vec<PoolRecord> {
        vec![
            PoolRecord {
                source: WorkerDp::new(99, 0),
                name: 7,
                path: 0xdef,
            },
            PoolRecord {
                source: WorkerDp::new(u64::MAX, 3),
                name: u64::MAX,
                path: 1,
            },
        ]
    }

    #[test]
    fn shared_pools_round_trip_and_older_files_load_without_them() {
        let (meta, workers, events) = sample();
        let lower = lower_sample(&workers);
        let pool = pool_sample();
        let bytes = encode_with_tiers(&meta, &workers, &events, &lower, &pool).unwrap();
        let view = parse(&bytes).unwrap();
        assert_eq!(view.pool().collect::<Vec<_>>(), pool);
        assert_eq!((view.pool_count(), view.lower_count()), (2, 2));
        // A version 2 file loads with its lower tiers and no pool.
        let old = restamp(&bytes, 2);
        let v2 = parse(&old).unwrap();
        assert_eq!((v2.pool_count(), v2.lower_count()), (0, 2));
        assert_eq!(rebuild(&v2).dump(), rebuild(&view).dump());
    }

    #[test]
    fn every_corruption_is_a_typed_error() {
        let (meta, workers, events) = sample();
        let bytes = encode_with_tiers(
            &meta,
            &workers,
            &events,
            &lower_sample(&workers),
            &pool_sample(),
        )
        .unwrap();
        // Every truncation.
        for n in 0..bytes.len() {
            assert!(parse(&bytes[..n]).is_err(), "truncated to {n}");
        }
        // Every single-byte flip is detected (checksums cover every byte).
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x5a;
            assert!(parse(&b).is_err(), "flip at {i}");
        }
        let mut b = bytes.clone();
        b[8] = 4;
        assert_eq!(
            parse(&b).unwrap_err(),
            SnapshotError::UnsupportedVersion { found: 4 }
        );
        assert_eq!(
            parse(&restamp(&bytes, 0)).unwrap_err(),
            SnapshotError::UnsupportedVersion { found: 0 }
        );
        assert_eq!(
            parse(b"nonsense that is long enough to hold a header, surely, yes it is").unwrap_err(),
            SnapshotError::BadMagic
        );
        let mut b = bytes.clone();
        b.push(0);
        assert!(matches!(parse(&b), Err(SnapshotError::Malformed { .. })));
    }

    #[test]
    fn refuses_what_is_not_state() {
        let (meta, workers, _) = sample();
        let removed = RouterEvent::new(1, KvCacheEvent::removed(1, 0, [SequenceBlockHash(1)]));
        assert!(encode(&meta, &workers, &[removed]).is_err());
        let stray = RouterEvent::new(
            99,
            KvCacheEvent::stored(1, 0, None, [(LocalBlockHash(1), SequenceBlockHash(1))]),
        );
        assert!(encode(&meta, &workers, &[stray]).is_err());
    }

    #[test]
    fn empty_state() {
        let bytes = encode(&SnapshotMeta::default(), &[], &[]).unwrap();
        let view = parse(&bytes).unwrap();
        assert_eq!(view.events().count(), 0);
        assert_eq!(view.meta().stream, None);
    }
}
