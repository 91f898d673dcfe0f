//! The reference index: small, obviously correct, and the oracle for every other index.
//!
//! Paths are interned in a global table (`(parent path, local hash) -> path id`), each
//! worker keeps plain hash maps from its sequence hashes to path ids and back, plus the
//! held children of each held path. `find_matches` walks the interned paths and checks each
//! worker's map at every step. Nothing here is tuned for speed; every rule of
//! [`crate::index`]'s semantics is one visible branch.
//!
//! Lower tiers are kept here as Dynamo 1.6.1 keeps them: per worker and tier, edges
//! `(parent engine name, local hash) -> child name`, followed from the worker's last device
//! block (the oracle for [`super::tiers`], which keys them by path instead).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use super::tiers::{TierOverlap, TierScores, lower_index};
use super::{ApplyError, ApplyOutcome, Index, OverlapScores, WorkerSummary};
use crate::event::{KvCacheEvent, KvEventData, RouterEvent, StoredBlock};
use crate::hash::{LocalBlockHash, SequenceBlockHash};
use crate::worker::{WorkerDp, WorkerId};

type PathId = u64;
const ROOT: PathId = 0;

#[derive(Debug)]
struct PathNode {
    parent: PathId,
    local: LocalBlockHash,
    /// Workers holding this path plus interned child paths. Freed at zero.
    refs: u32,
}

/// Interned paths: each id stands for one sequence of local hashes from the root.
#[derive(Debug, Default)]
struct Paths {
    last_id: PathId,
    nodes: HashMap<PathId, PathNode>,
    edges: HashMap<(PathId, LocalBlockHash), PathId>,
}

impl Paths {
    fn child(&self, parent: PathId, local: LocalBlockHash) -> Option<PathId> {
        self.edges.get(&(parent, local)).copied()
    }

    fn intern(&mut self, parent: PathId, local: LocalBlockHash) -> PathId {
        if let Some(id) = self.child(parent, local) {
            return id;
        }
        self.last_id += 1;
        let id = self.last_id;
        self.nodes.insert(
            id,
            PathNode {
                parent,
                local,
                refs: 0,
            },
        );
        self.edges.insert((parent, local), id);
        if parent != ROOT {
            self.retain(parent);
        }
        id
    }

    fn retain(&mut self, id: PathId) {
        self.nodes
            .get_mut(&id)
            .expect("retain of a freed path")
            .refs += 1;
    }

    fn release(&mut self, mut id: PathId) {
        while id != ROOT {
            let node = self.nodes.get_mut(&id).expect("release of a freed path");
            node.refs -= 1;
            if node.refs > 0 {
                return;
            }
            let node = self.nodes.remove(&id).expect("present");
            self.edges.remove(&(node.parent, node.local));
            id = node.parent;
        }
    }

    fn parent(&self, id: PathId) -> PathId {
        self.nodes[&id].parent
    }

    fn local(&self, id: PathId) -> LocalBlockHash {
        self.nodes[&id].local
    }
}

#[derive(Debug, Default)]
struct WorkerState {
    by_hash: HashMap<SequenceBlockHash, PathId>,
    by_path: HashMap<PathId, SequenceBlockHash>,
    /// Held children of each held path (and of `ROOT`).
    children: HashMap<PathId, BTreeSet<PathId>>,
    last_event_id: Option<u64>,
    /// Host-pinned, disk, external.
    lower: [Edges; 3],
    /// Per lower-tier block name, the local hashes from the root to it as they were when
    /// it was stored (what the tree's path hash stands for), for shared-pool chains that
    /// hang under it.
    lower_paths: HashMap<SequenceBlockHash, Vec<LocalBlockHash>>,
}

type EdgeKey = (Option<SequenceBlockHash>, LocalBlockHash);

/// One lower tier of one worker: Dynamo's edges.
#[derive(Debug, Default)]
struct Edges {
    child: HashMap<EdgeKey, SequenceBlockHash>,
    key_of: HashMap<SequenceBlockHash, EdgeKey>,
}

impl Edges {
    fn unlink(&mut self, name: SequenceBlockHash) -> bool {
        match self.key_of.remove(&name) {
            Some(k) => {
                if self.child.get(&k) == Some(&name) {
                    self.child.remove(&k);
                }
                true
            }
            None => false,
        }
    }
}

/// See the [module docs](self).
#[derive(Debug, Default)]
pub struct ReferenceIndex {
    paths: Paths,
    workers: BTreeMap<WorkerDp, WorkerState>,
    /// Shared pools (`cache_owner` events), per source: block name -> the local hashes
    /// from the root to it. A source is not a worker.
    pool: BTreeMap<WorkerDp, HashMap<SequenceBlockHash, Vec<LocalBlockHash>>>,
}

impl ReferenceIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of interned paths (tree nodes); for leak checks.
    pub fn path_count(&self) -> usize {
        self.paths.nodes.len()
    }

    fn apply_stored(
        paths: &mut Paths,
        w: &mut WorkerState,
        worker: WorkerDp,
        event_id: u64,
        parent: Option<SequenceBlockHash>,
        blocks: &[StoredBlock],
    ) -> Result<ApplyOutcome, ApplyError> {
        let mut out = ApplyOutcome::default();
        let base = match parent {
            None => ROOT,
            Some(h) => *w.by_hash.get(&h).ok_or(ApplyError::ParentNotFound {
                worker,
                event_id,
                parent: h,
            })?,
        };
        let invalid = |block| ApplyError::InvalidBlockSequence {
            worker,
            event_id,
            block,
        };
        let mut chain = HashSet::with_capacity(blocks.len());
        for b in blocks {
            if !chain.insert(b.block_hash) {
                return Err(invalid(b.block_hash));
            }
        }
        let mut ancestor = base;
        while ancestor != ROOT {
            let h = w.by_path[&ancestor];
            if chain.contains(&h) {
                return Err(invalid(h));
            }
            ancestor = paths.parent(ancestor);
        }

        let mut cur = base;
        for b in blocks {
            let p = paths.intern(cur, b.tokens_hash);
            match w.by_hash.get(&b.block_hash) {
                Some(&q) if q == p => {
                    out.duplicate += 1;
                    cur = p;
                    continue;
                }
                // A moved hash: drop its old block and what hangs below it.
                Some(&q) => out.removed += Self::drop_subtree(paths, w, q) as u32,
                None => {}
            }
            if let Some(old) = w.by_path.insert(p, b.block_hash) {
                // A renamed path: same block, new name.
                w.by_hash.remove(&old);
            } else {
                w.children.entry(cur).or_default().insert(p);
                paths.retain(p);
            }
            w.by_hash.insert(b.block_hash, p);
            out.stored += 1;
            cur = p;
        }
        Ok(out)
    }

    /// Drops `p` and every path the worker holds below it; returns how many.
    fn drop_subtree(paths: &mut Paths, w: &mut WorkerState, p: PathId) -> usize {
        let parent = paths.parent(p);
        if let Some(siblings) = w.children.get_mut(&parent) {
            siblings.remove(&p);
            if siblings.is_empty() {
                w.children.remove(&parent);
            }
        }
        let mut dropped = 0;
        let mut stack = vec![p];
        while let Some(x) = stack.pop() {
            if let Some(kids) = w.children.remove(&x) {
                stack.extend(kids);
            }
            let h = w.by_path.remove(&x).expect("held path has a hash");
            w.by_hash.remove(&h);
            paths.release(x);
            dropped += 1;
        }
        dropped
    }

    /// A lower-tier event (tier `t`): Dynamo's edges, with our rule for orphans (a chain
    /// whose parent the worker holds on no tier is not indexed).
    fn apply_lower(
        paths: &Paths,
        w: &mut WorkerState,
        t: usize,
        data: &KvEventData,
    ) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        match data {
            KvEventData::Stored(s) => {
                if let Some(p) = s.parent_hash {
                    let known = w.by_hash.contains_key(&p)
                        || w.lower.iter().any(|e| e.key_of.contains_key(&p));
                    if !known {
                        return out;
                    }
                }
                let mut path = match s.parent_hash {
                    None => Vec::new(),
                    Some(p) => Self::path_of_name(paths, w, p).unwrap_or_default(),
                };
                for b in &s.blocks {
                    path.push(b.tokens_hash);
                    w.lower_paths.insert(b.block_hash, path.clone());
                }
                let edges = &mut w.lower[t];
                let mut cur = s.parent_hash;
                for b in &s.blocks {
                    let key = (cur, b.tokens_hash);
                    if edges.key_of.get(&b.block_hash) == Some(&key) {
                        out.duplicate += 1;
                    } else {
                        edges.unlink(b.block_hash);
                        if let Some(old) = edges.child.insert(key, b.block_hash) {
                            edges.key_of.remove(&old);
                        }
                        edges.key_of.insert(b.block_hash, key);
                        out.stored += 1;
                    }
                    cur = Some(b.block_hash);
                }
            }
            KvEventData::Removed(r) => {
                for &h in &r.block_hashes {
                    if w.lower[t].unlink(h) {
                        out.removed += 1;
                    } else {
                        out.not_found += 1;
                    }
                }
            }
            KvEventData::Cleared => {
                out.removed = w.lower[t].key_of.len() as u32;
                w.lower[t] = Edges::default();
            }
        }
        out
    }

    /// The local hashes from the root to the block `w` names `name`: its device block's
    /// path now, else its lower-tier block's path when stored.
    fn path_of_name(
        paths: &Paths,
        w: &WorkerState,
        name: SequenceBlockHash,
    ) -> Option<Vec<LocalBlockHash>> {
        if let Some(&id) = w.by_hash.get(&name) {
            let mut rev = Vec::new();
            let mut x = id;
            while x != ROOT {
                rev.push(paths.local(x));
                x = paths.parent(x);
            }
            rev.reverse();
            return Some(rev);
        }
        if w.lower.iter().any(|e| e.key_of.contains_key(&name)) {
            return w.lower_paths.get(&name).cloned();
        }
        None
    }

    /// A shared-pool event of `source`: a chain hangs under the source's pool block of the
    /// parent's name, else under its own block of that name on any tier, else is dropped
    /// (an orphan), as in the tree ([`crate::index::tiers`], "The shared pool").
    fn apply_pool(&mut self, source: WorkerDp, data: &KvEventData) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        match data {
            KvEventData::Stored(s) => {
                let parent = match s.parent_hash {
                    None => Some(Vec::new()),
                    Some(p) => self
                        .pool
                        .get(&source)
                        .and_then(|m| m.get(&p).cloned())
                        .or_else(|| {
                            let w = self.workers.get(&source)?;
                            Self::path_of_name(&self.paths, w, p)
                        }),
                };
                let Some(mut path) = parent else {
                    return out;
                };
                let held = self.pool.entry(source).or_default();
                for b in &s.blocks {
                    path.push(b.tokens_hash);
                    match held.insert(b.block_hash, path.clone()) {
                        Some(old) if old == path => out.duplicate += 1,
                        _ => out.stored += 1,
                    }
                }
            }
            KvEventData::Removed(r) => {
                if let Some(held) = self.pool.get_mut(&source) {
                    for h in &r.block_hashes {
                        match held.remove(h) {
                            Some(_) => out.removed += 1,
                            None => out.not_found += 1,
                        }
                    }
                    if held.is_empty() {
                        self.pool.remove(&source);
                    }
                }
            }
            KvEventData::Cleared => {
                out.removed = self.pool.remove(&source).map_or(0, |m| m.len() as u32);
            }
        }
        out
    }

    fn clear_state(paths: &mut Paths, w: &mut WorkerState) -> usize {
        w.lower = Default::default();
        w.lower_paths.clear();
        let n = w.by_path.len();
        for (&p, _) in w.by_path.iter() {
            paths.release(p);
        }
        w.by_path.clear();
        w.by_hash.clear();
        w.children.clear();
        n
    }
}

impl Index for ReferenceIndex {
    fn name(&self) -> &'static str {
        "reference"
    }

    fn apply(&mut self, event: RouterEvent) -> Result<ApplyOutcome, ApplyError> {
        let worker = event.worker();
        let event_id = event.event.event_id;
        if event.is_shared_pool() {
            return Ok(self.apply_pool(worker, &event.event.data));
        }
        if !event.is_worker_owned() {
            return Ok(ApplyOutcome::default());
        }
        let w = self.workers.entry(worker).or_default();
        w.last_event_id = Some(event_id);
        if let Some(t) = lower_index(event.storage_tier) {
            return Ok(Self::apply_lower(&self.paths, w, t, &event.event.data));
        }
        match &event.event.data {
            KvEventData::Stored(s) => Self::apply_stored(
                &mut self.paths,
                w,
                worker,
                event_id,
                s.parent_hash,
                &s.blocks,
            ),
            KvEventData::Removed(r) => {
                let mut out = ApplyOutcome::default();
                for h in &r.block_hashes {
                    match w.by_hash.get(h) {
                        Some(&p) => out.removed += Self::drop_subtree(&mut self.paths, w, p) as u32,
                        None => out.not_found += 1,
                    }
                }
                Ok(out)
            }
            KvEventData::Cleared => {
                let removed = Self::clear_state(&mut self.paths, w) as u32;
                Ok(ApplyOutcome {
                    removed,
                    ..Default::default()
                })
            }
        }
    }

    fn find_matches_into(&self, query: &[LocalBlockHash], out: &mut OverlapScores) {
        out.clear();
        let mut active: Vec<(WorkerDp, &WorkerState)> = self
            .workers
            .iter()
            .filter(|(_, w)| !w.by_path.is_empty())
            .map(|(&k, w)| (k, w))
            .collect();
        let mut cur = ROOT;
        let mut depth = 0u32;
        for &local in query {
            if active.is_empty() {
                break;
            }
            let Some(next) = self.paths.child(cur, local) else {
                break;
            };
            active.retain(|(worker, w)| {
                let holds = w.by_path.contains_key(&next);
                if !holds {
                    out.push(*worker, depth);
                }
                holds
            });
            cur = next;
            depth += 1;
        }
        for (worker, _) in active {
            out.push(worker, depth);
        }
        out.finish();
    }

    fn tier_overlaps_into(
        &self,
        query: &[LocalBlockHash],
        _paths: &[u64],
        device: &OverlapScores,
        out: &mut TierScores,
    ) {
        out.clear();
        // Shared pools: position `i` is a hit when a pool holds the block at `query[..=i]`.
        for (&source, names) in &self.pool {
            let held: std::collections::HashSet<&[LocalBlockHash]> =
                names.values().map(Vec::as_slice).collect();
            let mut bits = vec![0u64; query.len().div_ceil(64)];
            for i in 0..query.len() {
                if held.contains(&query[..=i]) {
                    out.mark_shared(i, query.len());
                    bits[i / 64] |= 1 << (i % 64);
                }
            }
            if out.attributes_sources() && bits.iter().any(|&b| b != 0) {
                out.mark_source(source, &bits);
            }
        }
        for (&worker, w) in &self.workers {
            if w.lower.iter().all(|e| e.child.is_empty()) {
                continue;
            }
            let d = device.get(worker) as usize;
            // The worker's name of its last device block of the request.
            let mut cur = None;
            if d > 0 {
                let mut p = ROOT;
                for &local in &query[..d] {
                    p = self
                        .paths
                        .child(p, local)
                        .expect("a device match is interned");
                }
                cur = Some(w.by_path[&p]);
            }
            let mut pos = d;
            let mut run = [0u32; 3];
            for (t, r) in run.iter_mut().enumerate() {
                while let Some(&c) = query
                    .get(pos)
                    .and_then(|&l| w.lower[t].child.get(&(cur, l)))
                {
                    cur = Some(c);
                    *r += 1;
                    pos += 1;
                }
            }
            out.push(
                worker,
                TierOverlap {
                    host: run[0],
                    disk: run[1] + run[2],
                },
            );
        }
        out.finish();
    }

    fn lower_block_count(&self) -> usize {
        let pool: usize = self.pool.values().map(HashMap::len).sum();
        self.workers
            .values()
            .map(|w| w.lower.iter().map(|e| e.key_of.len()).sum::<usize>())
            .sum::<usize>()
            + pool
    }

    fn clear(&mut self, worker: WorkerDp) -> usize {
        match self.workers.get_mut(&worker) {
            Some(w) => Self::clear_state(&mut self.paths, w),
            None => 0,
        }
    }

    fn remove_worker(&mut self, worker_id: WorkerId) -> usize {
        let keys: Vec<WorkerDp> = self
            .workers
            .range(WorkerDp::new(worker_id, 0)..=WorkerDp::new(worker_id, u32::MAX))
            .map(|(&k, _)| k)
            .collect();
        let mut dropped = 0;
        for k in keys {
            let mut w = self.workers.remove(&k).expect("listed");
            dropped += Self::clear_state(&mut self.paths, &mut w);
        }
        // A source that leaves takes its pool blocks with it.
        self.pool.retain(|s, _| s.worker_id != worker_id);
        dropped
    }

    fn workers(&self) -> Vec<WorkerSummary> {
        self.workers
            .iter()
            .map(|(&worker, w)| WorkerSummary {
                worker,
                blocks: w.by_path.len(),
                last_event_id: w.last_event_id,
            })
            .collect()
    }

    fn block_count(&self) -> usize {
        self.workers.values().map(|w| w.by_path.len()).sum()
    }

    fn dump(&self) -> Vec<RouterEvent> {
        let mut events = Vec::new();
        for (&worker, w) in &self.workers {
            let id = w.last_event_id.unwrap_or(0);
            events.push(RouterEvent::new(
                worker.worker_id,
                KvCacheEvent::cleared(id, worker.dp_rank),
            ));
            // Children are visited in local-hash order, so that the dump depends on the
            // state only, not on the history of path ids.
            let sorted_kids = |p: PathId| -> Vec<PathId> {
                let mut kids: Vec<PathId> = w
                    .children
                    .get(&p)
                    .map(|c| c.iter().copied().collect())
                    .unwrap_or_default();
                kids.sort_unstable_by_key(|&k| std::cmp::Reverse(self.paths.local(k)));
                kids
            };
            let mut starts: Vec<(PathId, Option<SequenceBlockHash>)> =
                sorted_kids(ROOT).into_iter().map(|p| (p, None)).collect();
            while let Some((start, parent)) = starts.pop() {
                let mut chain = vec![start];
                let mut last = start;
                while let Some(kids) = w.children.get(&last).filter(|k| k.len() == 1) {
                    last = *kids.first().expect("one child");
                    chain.push(last);
                }
                let blocks = chain.iter().map(|&p| (self.paths.local(p), w.by_path[&p]));
                events.push(RouterEvent::new(
                    worker.worker_id,
                    KvCacheEvent::stored(id, worker.dp_rank, parent, blocks),
                ));
                let last_hash = w.by_path[&last];
                starts.extend(sorted_kids(last).into_iter().map(|p| (p, Some(last_hash))));
            }
        }
        events
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::{LocalBlockHash as L, SequenceBlockHash as S};

    const W0: WorkerDp = WorkerDp::new(0, 0);
    const W1: WorkerDp = WorkerDp::new(1, 0);

    fn store(
        idx: &mut ReferenceIndex,
        w: WorkerDp,
        parent: Option<u64>,
        blocks: &[(u64, u64)],
    ) -> Result<ApplyOutcome, ApplyError> {
        idx.apply(RouterEvent::new(
            w.worker_id,
            KvCacheEvent::stored(
                0,
                w.dp_rank,
                parent.map(S),
                blocks.iter().map(|&(l, s)| (L(l), S(s))),
            ),
        ))
    }

    fn remove(idx: &mut ReferenceIndex, w: WorkerDp, hashes: &[u64]) -> ApplyOutcome {
        idx.apply(RouterEvent::new(
            w.worker_id,
            KvCacheEvent::removed(0, w.dp_rank, hashes.iter().map(|&h| S(h))),
        ))
        .unwrap()
    }

    fn q(idx: &ReferenceIndex, locals: &[u64]) -> Vec<(WorkerDp, u32)> {
        idx.find_matches(&locals.iter().map(|&l| L(l)).collect::<Vec<_>>())
            .as_slice()
            .to_vec()
    }

    #[test]
    fn shared_prefix_scores_per_worker() {
        let mut idx = ReferenceIndex::new();
        store(&mut idx, W0, None, &[(1, 101), (2, 102), (3, 103)]).unwrap();
        store(&mut idx, W1, None, &[(1, 201), (2, 202)]).unwrap();
        assert_eq!(q(&idx, &[1, 2, 3, 4]), vec![(W0, 3), (W1, 2)]);
        assert_eq!(q(&idx, &[2]), vec![]);
        assert_eq!(q(&idx, &[]), vec![]);
        assert_eq!(idx.path_count(), 3);
    }

    #[test]
    fn unknown_parent_rejects_whole_event() {
        let mut idx = ReferenceIndex::new();
        let err = store(&mut idx, W0, Some(9), &[(1, 101)]).unwrap_err();
        assert!(matches!(err, ApplyError::ParentNotFound { .. }));
        assert_eq!(idx.block_count(), 0);
        assert_eq!(idx.path_count(), 0);
        // The worker is known, with its last event id.
        assert_eq!(idx.workers().len(), 1);
    }

    #[test]
    fn duplicate_store_is_idempotent() {
        let mut idx = ReferenceIndex::new();
        store(&mut idx, W0, None, &[(1, 101), (2, 102)]).unwrap();
        let o = store(&mut idx, W0, None, &[(1, 101), (2, 102), (3, 103)]).unwrap();
        assert_eq!((o.duplicate, o.stored), (2, 1));
        assert_eq!(idx.block_count(), 3);
    }

    #[test]
    fn removal_cascades_and_unknown_is_counted() {
        let mut idx = ReferenceIndex::new();
        store(&mut idx, W0, None, &[(1, 101), (2, 102), (3, 103)]).unwrap();
        store(&mut idx, W0, Some(102), &[(4, 104)]).unwrap();
        let o = remove(&mut idx, W0, &[102, 999, 103]);
        assert_eq!((o.removed, o.not_found), (3, 2));
        assert_eq!(q(&idx, &[1, 2, 3]), vec![(W0, 1)]);
        assert_eq!(idx.block_count(), 1);
        assert_eq!(idx.path_count(), 1);
        // Re-storing the removed block does not revive its old descendants.
        store(&mut idx, W0, Some(101), &[(2, 102)]).unwrap();
        assert_eq!(q(&idx, &[1, 2, 3]), vec![(W0, 2)]);
    }

    #[test]
    fn invalid_chains_are_rejected() {
        let mut idx = ReferenceIndex::new();
        store(&mut idx, W0, None, &[(1, 101), (2, 102)]).unwrap();
        assert!(store(&mut idx, W0, None, &[(5, 105), (6, 105)]).is_err());
        assert!(store(&mut idx, W0, Some(102), &[(3, 101)]).is_err());
        assert!(store(&mut idx, W0, Some(102), &[(3, 102)]).is_err());
        assert_eq!(idx.block_count(), 2);
    }

    #[test]
    fn moved_hash_and_renamed_path() {
        let mut idx = ReferenceIndex::new();
        store(&mut idx, W0, None, &[(1, 101), (2, 102), (3, 103)]).unwrap();
        // Hash 103 moves under a new path [1, 5]; the old [1,2,3] is dropped.
        let o = store(&mut idx, W0, Some(101), &[(5, 103)]).unwrap();
        assert_eq!((o.stored, o.removed), (1, 1));
        assert_eq!(q(&idx, &[1, 2, 3]), vec![(W0, 2)]);
        assert_eq!(q(&idx, &[1, 5]), vec![(W0, 2)]);
        // Path [1, 2] is renamed 202; its child keeps hanging under it.
        store(&mut idx, W0, Some(102), &[(3, 303)]).unwrap();
        store(&mut idx, W0, Some(101), &[(2, 202)]).unwrap();
        assert_eq!(q(&idx, &[1, 2, 3]), vec![(W0, 3)]);
        assert_eq!(remove(&mut idx, W0, &[102]).not_found, 1);
        assert_eq!(remove(&mut idx, W0, &[202]).removed, 2);
        assert_eq!(idx.block_count(), 2);
    }

    #[test]
    fn clear_is_per_dp_rank_and_remove_worker_takes_all() {
        let mut idx = ReferenceIndex::new();
        let r1 = WorkerDp::new(0, 1);
        store(&mut idx, W0, None, &[(1, 101)]).unwrap();
        store(&mut idx, r1, None, &[(1, 101), (2, 102)]).unwrap();
        store(&mut idx, W1, None, &[(1, 201)]).unwrap();
        idx.apply(RouterEvent::new(0, KvCacheEvent::cleared(7, 1)))
            .unwrap();
        assert_eq!(q(&idx, &[1, 2]), vec![(W0, 1), (W1, 1)]);
        assert_eq!(
            idx.workers()
                .iter()
                .find(|s| s.worker == r1)
                .unwrap()
                .last_event_id,
            Some(7)
        );
        assert_eq!(idx.remove_worker(0), 1);
        assert_eq!(idx.workers().len(), 1);
        assert_eq!(idx.clear(W1), 1);
        assert_eq!(idx.path_count(), 0);
    }

    #[test]
    fn dump_rebuilds_the_same_state() {
        let mut idx = ReferenceIndex::new();
        store(&mut idx, W0, None, &[(1, 101), (2, 102), (3, 103)]).unwrap();
        store(&mut idx, W0, Some(101), &[(7, 107), (8, 108)]).unwrap();
        store(&mut idx, W0, None, &[(9, 109)]).unwrap();
        store(&mut idx, W1, None, &[(1, 201)]).unwrap();
        idx.apply(RouterEvent::new(2, KvCacheEvent::cleared(4, 0)))
            .unwrap();
        let mut copy = ReferenceIndex::new();
        for e in idx.dump() {
            copy.apply(e).unwrap();
        }
        assert_eq!(copy.workers(), idx.workers());
        assert_eq!(copy.dump(), idx.dump());
        for query in [&[1, 2, 3][..], &[1, 7, 8], &[9], &[1, 2, 4]] {
            assert_eq!(q(&copy, query), q(&idx, query));
        }
    }
}
