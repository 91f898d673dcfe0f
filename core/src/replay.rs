//! Replay logs (`kv-replay-log/1`): fixed sequences of index operations with the answer
//! every query must get. The format is described in `docs/REPLAY_LOGS.md` (a copy of the
//! shared corpus's `FORMAT.md` summary). This module parses lines and checks an [`Index`]
//! against the expected answers; reading files (and zstd) is the `io` crate's job.

use std::borrow::Cow;
use std::collections::BTreeMap;

use serde::de::{SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};

use crate::event::{KvCacheEvent, RouterEvent};
use crate::hash::{LocalBlockHash, SequenceBlockHash};
use crate::index::{Index, OverlapScores};
use crate::worker::WorkerId;

/// The format this module reads.
pub const FORMAT: &str = "kv-replay-log/1";

/// Line 1 of a log. Every field but `format` is informational.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[allow(missing_docs)]
pub struct ReplayHeader {
    pub format: String,
    #[serde(default)]
    pub generator: String,
    #[serde(default)]
    pub source: String,
    #[serde(default)]
    pub requests: u64,
    #[serde(default)]
    pub workers: u64,
    #[serde(default)]
    pub capacity: u64,
    #[serde(default)]
    pub expand: u64,
    #[serde(default)]
    pub assign: String,
    #[serde(default)]
    pub seed: u64,
    #[serde(default)]
    pub block_tokens: u64,
    #[serde(default)]
    pub hash_bits: u64,
    #[serde(default)]
    pub limit: Option<u64>,
}

/// One operation line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplayOp {
    /// Worker `worker` stored a chain under `parent`.
    Store {
        /// The worker (dp rank 0).
        worker: WorkerId,
        /// Its event id.
        event_id: u64,
        /// The chain's parent, `None` at the root.
        parent: Option<SequenceBlockHash>,
        /// `(local, sequence)` pairs in prefix order.
        blocks: Vec<(LocalBlockHash, SequenceBlockHash)>,
    },
    /// Worker `worker` evicted blocks, in order.
    Remove {
        /// The worker (dp rank 0).
        worker: WorkerId,
        /// Its event id.
        event_id: u64,
        /// Sequence hashes.
        blocks: Vec<SequenceBlockHash>,
    },
    /// A query and its answer.
    Match {
        /// The request's local hashes.
        blocks: Vec<LocalBlockHash>,
        /// Positive scores, sorted by worker.
        expect: Vec<(WorkerId, u32)>,
    },
}

impl ReplayOp {
    /// The event this line stands for (stores and removes), as a Dynamo worker at dp rank 0
    /// would publish it.
    pub fn to_event(&self) -> Option<RouterEvent> {
        match self {
            ReplayOp::Store {
                worker,
                event_id,
                parent,
                blocks,
            } => Some(RouterEvent::new(
                *worker,
                KvCacheEvent::stored(*event_id, 0, *parent, blocks.iter().copied()),
            )),
            ReplayOp::Remove {
                worker,
                event_id,
                blocks,
            } => Some(RouterEvent::new(
                *worker,
                KvCacheEvent::removed(*event_id, 0, blocks.iter().copied()),
            )),
            ReplayOp::Match { .. } => None,
        }
    }

    /// Blocks the line names (stored, removed or looked up).
    pub fn block_count(&self) -> usize {
        match self {
            ReplayOp::Store { blocks, .. } => blocks.len(),
            ReplayOp::Remove { blocks, .. } => blocks.len(),
            ReplayOp::Match { blocks, .. } => blocks.len(),
        }
    }
}

/// A parsed line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplayLine {
    /// The header.
    Header(ReplayHeader),
    /// An operation.
    Op(ReplayOp),
}

/// Why a line could not be parsed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplayError {
    /// Not JSON, or a field of the wrong type.
    #[error("malformed line: {0}")]
    Json(#[from] serde_json::Error),
    /// An `op` this version does not know.
    #[error("unknown op {0:?}")]
    UnknownOp(String),
    /// A field the op needs is missing.
    #[error("op {op:?} lacks {field:?}")]
    MissingField {
        /// The op.
        op: &'static str,
        /// The field.
        field: &'static str,
    },
    /// `blocks` holds pairs where hashes are expected or the other way round.
    #[error("op {0:?}: wrong block shape")]
    BlockShape(&'static str),
    /// The header names another format.
    #[error("unsupported format {0:?}, expected {FORMAT:?}")]
    Format(String),
}

enum BlockItem {
    One(u64),
    Pair(u64, u64),
}

impl<'de> Deserialize<'de> for BlockItem {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = BlockItem;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a hash or a [local, external] pair")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<BlockItem, E> {
                Ok(BlockItem::One(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<BlockItem, A::Error> {
                use serde::de::Error;
                let a = seq
                    .next_element()?
                    .ok_or_else(|| A::Error::invalid_length(0, &self))?;
                let b = seq
                    .next_element()?
                    .ok_or_else(|| A::Error::invalid_length(1, &self))?;
                if seq.next_element::<serde::de::IgnoredAny>()?.is_some() {
                    return Err(A::Error::invalid_length(3, &self));
                }
                Ok(BlockItem::Pair(a, b))
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Deserialize)]
struct RawLine<'a> {
    #[serde(borrow)]
    op: Cow<'a, str>,
    worker: Option<u64>,
    event_id: Option<u64>,
    #[serde(default)]
    parent: Option<u64>,
    blocks: Option<Vec<BlockItem>>,
    expect: Option<BTreeMap<u64, u32>>,
}

/// Parses one line (without its newline).
pub fn parse_line(line: &[u8]) -> Result<ReplayLine, ReplayError> {
    let raw: RawLine<'_> = serde_json::from_slice(line)?;
    let need = |op: &'static str, field: &'static str| ReplayError::MissingField { op, field };
    match &*raw.op {
        "header" => {
            let h: ReplayHeader = serde_json::from_slice(line)?;
            if h.format != FORMAT {
                return Err(ReplayError::Format(h.format));
            }
            Ok(ReplayLine::Header(h))
        }
        "store" => {
            let blocks = raw.blocks.ok_or(need("store", "blocks"))?;
            let blocks = blocks
                .into_iter()
                .map(|b| match b {
                    BlockItem::Pair(l, s) => Ok((LocalBlockHash(l), SequenceBlockHash(s))),
                    BlockItem::One(_) => Err(ReplayError::BlockShape("store")),
                })
                .collect::<Result<_, _>>()?;
            Ok(ReplayLine::Op(ReplayOp::Store {
                worker: raw.worker.ok_or(need("store", "worker"))?,
                event_id: raw.event_id.ok_or(need("store", "event_id"))?,
                parent: raw.parent.map(SequenceBlockHash),
                blocks,
            }))
        }
        "remove" => Ok(ReplayLine::Op(ReplayOp::Remove {
            worker: raw.worker.ok_or(need("remove", "worker"))?,
            event_id: raw.event_id.ok_or(need("remove", "event_id"))?,
            blocks: hashes(raw.blocks.ok_or(need("remove", "blocks"))?, "remove")?
                .map(SequenceBlockHash)
                .collect(),
        })),
        "match" => Ok(ReplayLine::Op(ReplayOp::Match {
            blocks: hashes(raw.blocks.ok_or(need("match", "blocks"))?, "match")?
                .map(LocalBlockHash)
                .collect(),
            expect: raw
                .expect
                .ok_or(need("match", "expect"))?
                .into_iter()
                .filter(|&(_, s)| s > 0)
                .collect(),
        })),
        other => Err(ReplayError::UnknownOp(other.to_owned())),
    }
}

fn hashes(
    items: Vec<BlockItem>,
    op: &'static str,
) -> Result<impl Iterator<Item = u64>, ReplayError> {
    let v = items
        .into_iter()
        .map(|b| match b {
            BlockItem::One(h) => Ok(h),
            BlockItem::Pair(..) => Err(ReplayError::BlockShape(op)),
        })
        .collect::<Result<Vec<u64>, _>>()?;
    Ok(v.into_iter())
}

/// One query whose answer differed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    /// 1-based line number in the log.
    pub line: u64,
    /// What the log expects.
    pub expected: Vec<(WorkerId, u32)>,
    /// What the index answered (non-zero dp ranks are reported as worker `u64::MAX`).
    pub got: Vec<(WorkerId, u32)>,
}

/// Streams operations through an index and checks every answer.
#[derive(Debug, Default)]
pub struct ReplayChecker {
    /// Queries checked.
    pub matches: u64,
    /// Queries whose answer differed.
    pub mismatches: u64,
    /// Events applied.
    pub events: u64,
    /// Events the index rejected (a conformance log has none).
    pub rejected: u64,
    /// The first few mismatches, for the report.
    pub first_mismatches: Vec<Mismatch>,
    /// The first few rejections, as text.
    pub first_rejections: Vec<String>,
    scratch: OverlapScores,
}

impl ReplayChecker {
    /// How many mismatches and rejections are kept for the report.
    pub const KEEP: usize = 5;

    /// A checker with nothing checked yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies or checks one operation found at `line`.
    pub fn step<I: Index + ?Sized>(&mut self, index: &mut I, line: u64, op: ReplayOp) {
        match op {
            ReplayOp::Match { blocks, expect } => {
                self.matches += 1;
                index.find_matches_into(&blocks, &mut self.scratch);
                let got: Vec<(WorkerId, u32)> = self
                    .scratch
                    .iter()
                    .map(|(w, s)| {
                        (
                            if w.dp_rank == 0 {
                                w.worker_id
                            } else {
                                u64::MAX
                            },
                            s,
                        )
                    })
                    .collect();
                if got != expect {
                    self.mismatches += 1;
                    if self.first_mismatches.len() < Self::KEEP {
                        self.first_mismatches.push(Mismatch {
                            line,
                            expected: expect,
                            got,
                        });
                    }
                }
            }
            op => {
                let event = op.to_event().expect("stores and removes are events");
                self.events += 1;
                if let Err(e) = index.apply(event) {
                    self.rejected += 1;
                    if self.first_rejections.len() < Self::KEEP {
                        self.first_rejections.push(format!("line {line}: {e}"));
                    }
                }
            }
        }
    }

    /// Whether every answer matched and every event applied.
    pub fn passed(&self) -> bool {
        self.mismatches == 0 && self.rejected == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::ReferenceIndex;

    const LINES: &[&str] = &[
        r#"{"op":"header","format":"kv-replay-log/1","generator":"t","requests":1,"workers":2,"limit":null,"new_key":1}"#,
        r#"{"op":"store","worker":1,"event_id":0,"parent":null,"blocks":[[11,101],[12,102]]}"#,
        r#"{"blocks":[[13,103]],"op":"store","worker":1,"event_id":1,"parent":102}"#,
        r#"{"op":"match","blocks":[11,12,13,14],"expect":{"1":3,"0":0}}"#,
        r#"{"op":"remove","worker":1,"event_id":2,"blocks":[103]}"#,
        r#"{"op":"match","blocks":[11,12,13],"expect":{"1":2}}"#,
    ];

    #[test]
    fn parses_every_line_type_in_any_key_order() {
        assert!(
            matches!(parse_line(LINES[0].as_bytes()).unwrap(), ReplayLine::Header(h) if h.workers == 2)
        );
        let ReplayLine::Op(ReplayOp::Store { parent, blocks, .. }) =
            parse_line(LINES[2].as_bytes()).unwrap()
        else {
            panic!()
        };
        assert_eq!(parent, Some(SequenceBlockHash(102)));
        assert_eq!(blocks, vec![(LocalBlockHash(13), SequenceBlockHash(103))]);
        let ReplayLine::Op(ReplayOp::Match { expect, .. }) =
            parse_line(LINES[3].as_bytes()).unwrap()
        else {
            panic!()
        };
        assert_eq!(expect, vec![(1, 3)]);
    }

    #[test]
    fn bad_lines_are_typed_errors() {
        for (line, want) in [
            (r#"{"op":"nope"}"#, "unknown op"),
            (
                r#"{"op":"store","worker":1,"event_id":0,"blocks":[5]}"#,
                "wrong block shape",
            ),
            (r#"{"op":"remove","worker":1,"blocks":[5]}"#, "lacks"),
            (
                r#"{"op":"match","blocks":[[1,2,3]],"expect":{}}"#,
                "malformed",
            ),
            (
                r#"{"op":"header","format":"kv-replay-log/9"}"#,
                "unsupported format",
            ),
            ("not json", "malformed"),
        ] {
            let err = parse_line(line.as_bytes()).unwrap_err().to_string();
            assert!(err.contains(want), "{line}: {err}");
        }
    }

    #[test]
    fn checker_counts_matches_and_mismatches() {
        let mut idx = ReferenceIndex::new();
        let mut check = ReplayChecker::new();
        for (i, l) in LINES.iter().enumerate() {
            if let ReplayLine::Op(op) = parse_line(l.as_bytes()).unwrap() {
                check.step(&mut idx, i as u64 + 1, op);
            }
        }
        assert_eq!((check.matches, check.mismatches, check.events), (2, 0, 3));
        assert!(check.passed());
        let wrong = r#"{"op":"match","blocks":[11],"expect":{"0":1}}"#;
        let ReplayLine::Op(op) = parse_line(wrong.as_bytes()).unwrap() else {
            panic!()
        };
        check.step(&mut idx, 9, op);
        assert_eq!(check.mismatches, 1);
        assert_eq!(
            check.first_mismatches[0],
            Mismatch {
                line: 9,
                expected: vec![(0, 1)],
                got: vec![(1, 1)]
            }
        );
        assert!(!check.passed());
    }
}
