//! The mock engine: one inference worker's KV cache and scheduler, in virtual time.
//!
//! * **KV block manager**: `capacity` blocks of `block_size` tokens; a request reuses the
//!   longest cached prefix of its blocks; memory for its missing blocks is promised when it
//!   is admitted (its prefill starts), evicting least-recently-used *leaves* (cached blocks
//!   with no cached child and no running request) one by one, each eviction published as a
//!   removed event, and admission waits while those blocks do not fit beside the ones
//!   already promised to other prefills; the full blocks of each prefill chunk are cached
//!   and published as one stored event when the chunk is scheduled, as vLLM does (below).
//!   Output tokens are not cached (the next turn's prompt carries them) and take no
//!   blocks.
//! * **Continuous batching with chunked prefill**, as vLLM v1 schedules: each step runs one
//!   decode token for every running request past its prefill, plus prefill chunks of the
//!   others in arrival order, up to `max_batch_tokens` tokens in all (and, with
//!   `long_prefill_token_threshold`, at most that many to any one request). A waiting request is
//!   admitted only with budget left over, and looks its prefix up then: it finds every
//!   block of the prefills scheduled ahead of it, since vLLM caches a chunk's blocks when it
//!   schedules the chunk. Without the cap an unfinished prefill takes the rest of the
//!   step's budget, so a request starts only once the prefills ahead of it have completed
//!   and finds them whole: one that shares a prefix with a prefill still running reuses it
//!   rather than computing it a second time beside it. With the cap a request can start
//!   beside an unfinished prefill: it finds the chunks scheduled so far and computes the
//!   rest itself, as in vLLM. Either way the router's index learns a long prefill's blocks
//!   chunk by chunk, as vLLM publishes them, not only when it completes.
//! * **Host tier** (optional, `host_capacity_blocks` > 0): a block evicted from the device
//!   is offloaded to host memory first (published as stored on the host-pinned tier, before
//!   the device removal, so its parent is still known), host memory evicting its own least
//!   recently used blocks (published as removed from the host tier). A request whose
//!   device prefix continues in host memory onloads those blocks instead of prefilling
//!   them (they stay in host memory too), at `onload_ms_per_block` each, added to the
//!   step that admits it.
//! * **Shared pool** (optional, one [`SharedPool`] for the whole fleet): a cache every
//!   engine reads and writes, as an LMCache server, a Mooncake store or SGLang HiCache's
//!   storage tier are. An engine writes each prompt's blocks through to it when the prefill
//!   completes (not charged: such stores are asynchronous); the pool evicts its least
//!   recently used blocks and publishes its own KV events, residency `cache_owner`, as a
//!   source that is no worker. A request whose device and host prefix continues in the pool
//!   onloads those blocks at the pool's (slower) cost per block.
//! * **Timing model** (documented in `docs/HARNESS.md`): a step with `T` prefill tokens and
//!   `D` decode requests over `K` cached tokens of running requests takes
//!   `(prefill_c + prefill_b·T + prefill_a·T²) [if T > 0] + decode_base + decode_per_ktoken·K/1000`
//!   milliseconds, divided by `speedup`.

use std::cell::RefCell;
use std::collections::{BTreeSet, VecDeque};
use std::rc::Rc;

use ahash::{AHashMap as HashMap, AHashSet};

use kvrouter_core::event::{KvCacheEvent, ResidencyDomain, RouterEvent};
use kvrouter_core::hash::{LocalBlockHash, SequenceBlockHash};
use kvrouter_core::worker::{StorageTier, WorkerId};

/// Settings of a mock engine.
#[derive(Debug, Clone, Copy)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV cache capacity, blocks.
    pub capacity_blocks: usize,
    /// Token budget of one step (prefill chunks + one token per decoding request).
    pub max_batch_tokens: u32,
    /// Most requests in the running batch.
    pub max_running: usize,
    /// Most prefill tokens one request gets in a step (0: no cap, vLLM v1's default).
    /// vLLM's `long_prefill_token_threshold`: with it a long prefill leaves the rest of
    /// the step's budget to the prefills behind it and to waiting requests, which then
    /// start beside it rather than after it.
    pub long_prefill_token_threshold: u32,
    /// Prefill time, quadratic term (ms per token²).
    pub prefill_a: f64,
    /// Prefill time, linear term (ms per token).
    pub prefill_b: f64,
    /// Prefill time, constant (ms per step with prefill).
    pub prefill_c: f64,
    /// Decode step base time (ms).
    pub decode_base: f64,
    /// Decode step time per 1000 cached tokens of running requests (ms).
    pub decode_per_ktoken: f64,
    /// Divides every duration.
    pub speedup: f64,
    /// Host-memory tier capacity, blocks (0: no host tier).
    pub host_capacity_blocks: usize,
    /// Time to copy one block from host memory to the device (ms, before `speedup`).
    pub onload_ms_per_block: f64,
    /// Capacity of the fleet's shared pool, blocks (0: none; [`SharedPool`]).
    pub pool_capacity_blocks: usize,
    /// Time to copy one block from the shared pool to the device (ms, before `speedup`).
    pub pool_onload_ms_per_block: f64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 64,
            capacity_blocks: 65_536,
            max_batch_tokens: 8192,
            max_running: 256,
            long_prefill_token_threshold: 0,
            prefill_a: 2e-6,
            prefill_b: 0.12,
            prefill_c: 10.0,
            decode_base: 15.0,
            decode_per_ktoken: 0.04,
            speedup: 1.0,
            host_capacity_blocks: 0,
            onload_ms_per_block: 0.0,
            pool_capacity_blocks: 0,
            pool_onload_ms_per_block: 0.0,
        }
    }
}

impl EngineConfig {
    /// Duration of a step, ms.
    pub fn step_ms(&self, prefill_tokens: u32, kv_tokens: u64) -> f64 {
        let t = prefill_tokens as f64;
        let prefill = if prefill_tokens > 0 {
            self.prefill_c + self.prefill_b * t + self.prefill_a * t * t
        } else {
            0.0
        };
        (prefill + self.decode_base + self.decode_per_ktoken * kv_tokens as f64 / 1000.0)
            / self.speedup
    }
}

impl EngineConfig {
    /// The most prefill tokens one request gets in a step.
    fn chunk_cap(&self) -> u32 {
        match self.long_prefill_token_threshold {
            0 => self.max_batch_tokens,
            cap => cap.min(self.max_batch_tokens),
        }
    }

    /// A lower bound of the TTFT of a request that must prefill `tokens` tokens, ms: what
    /// it would take alone on an idle engine, in the best chunking. `k` steps cost
    /// `k·(prefill_c + decode_base) + prefill_b·n + prefill_a·n²/k` at best (equal chunks;
    /// the KV term, ≥ 0, left out), minimised over real `k ≥ ⌈n / chunk⌉` (`chunk`: the step's budget, or
    /// `long_prefill_token_threshold` when lower),
    /// which no integer chunking nor any queue can beat.
    pub fn ttft_floor_ms(&self, tokens: u32) -> f64 {
        let n = f64::from(tokens);
        let fixed = self.prefill_c + self.decode_base;
        if tokens == 0 {
            return self.decode_base / self.speedup;
        }
        let fewest = (n / f64::from(self.chunk_cap().max(1))).ceil().max(1.0);
        let k = (n * (self.prefill_a / fixed).sqrt()).max(fewest);
        (k * fixed + self.prefill_b * n + self.prefill_a * n * n / k) / self.speedup
    }
}

#[derive(Debug, Clone, Copy)]
struct Block {
    parent: Option<u64>,
    local: u64,
    children: u32,
    /// Running requests using the block.
    refs: u32,
    last_used: u64,
}

/// The host-memory tier: blocks by sequence hash with their last use, least recently used
/// first.
#[derive(Debug, Default)]
struct HostTier {
    blocks: HashMap<u64, u64>,
    lru: BTreeSet<(u64, u64)>,
}

impl HostTier {
    /// Marks `seq` used at `clock` (held or not: it is then held).
    fn touch(&mut self, seq: u64, clock: u64) {
        if let Some(old) = self.blocks.insert(seq, clock) {
            self.lru.remove(&(old, seq));
        }
        self.lru.insert((clock, seq));
    }

    /// Drops the least recently used block; returns it (`None` when empty).
    fn pop_oldest(&mut self) -> Option<u64> {
        let (_, victim) = self.lru.pop_first()?;
        self.blocks.remove(&victim);
        Some(victim)
    }
}

/// The fleet's shared pool (see the [module docs](self)): blocks by sequence hash, least
/// recently used first, and the KV events it publishes as `source`, residency
/// `cache_owner`.
#[derive(Debug)]
pub struct SharedPool {
    source: WorkerId,
    capacity: usize,
    held: HostTier,
    clock: u64,
    next_event_id: u64,
    /// Prompt blocks the engines onloaded from it.
    pub hit_blocks: u64,
}

impl SharedPool {
    /// An empty pool of `capacity` blocks publishing as `source`.
    pub fn new(source: WorkerId, capacity: usize) -> Self {
        Self {
            source,
            capacity,
            held: HostTier::default(),
            clock: 0,
            next_event_id: 0,
            hit_blocks: 0,
        }
    }

    /// Blocks held now.
    pub fn blocks(&self) -> usize {
        self.held.blocks.len()
    }

    /// How many blocks of `chain` from `from` on it holds, contiguously.
    fn continuation(&self, chain: &[(LocalBlockHash, SequenceBlockHash)], from: usize) -> usize {
        chain[from..]
            .iter()
            .take_while(|(_, s)| self.held.blocks.contains_key(&s.0))
            .count()
    }

    /// Marks `chain`'s blocks used (read by an onload).
    fn touch(&mut self, chain: &[(LocalBlockHash, SequenceBlockHash)]) {
        for (_, s) in chain {
            self.clock += 1;
            self.held.touch(s.0, self.clock);
        }
    }

    /// Writes a prompt's blocks through (parent first), evicting the least recently used
    /// to make room; appends its events to `out` in the order things happened. A prompt
    /// longer than the pool is written up to the pool's size: the blocks it writes are the
    /// most recently used, so they never evict its own earlier ones.
    fn write_through(
        &mut self,
        chain: &[(LocalBlockHash, SequenceBlockHash)],
        out: &mut Vec<RouterEvent>,
    ) {
        let chain = &chain[..chain.len().min(self.capacity)];
        // The run of new blocks not yet published, under its parent.
        let mut stored: Option<(Option<u64>, Chain)> = None;
        for (i, &(l, s)) in chain.iter().enumerate() {
            self.clock += 1;
            if self.held.blocks.contains_key(&s.0) {
                self.held.touch(s.0, self.clock);
                self.publish_stored(stored.take(), out);
                continue;
            }
            let mut removed = Vec::new();
            while self.held.blocks.len() >= self.capacity {
                let Some(victim) = self.held.pop_oldest() else {
                    break;
                };
                removed.push(SequenceBlockHash(victim));
            }
            if !removed.is_empty() {
                // The stores before the removals, as they happened.
                self.publish_stored(stored.take(), out);
                self.emit(out, KvCacheEvent::removed(0, 0, removed));
            }
            self.held.touch(s.0, self.clock);
            match &mut stored {
                Some((_, blocks)) => blocks.push((l, s)),
                None => stored = Some(((i > 0).then(|| chain[i - 1].1.0), vec![(l, s)])),
            }
        }
        self.publish_stored(stored, out);
    }

    /// Publishes a run of new blocks under its parent, if there is one.
    fn publish_stored(&mut self, run: Option<(Option<u64>, Chain)>, out: &mut Vec<RouterEvent>) {
        if let Some((parent, blocks)) = run {
            let event = KvCacheEvent::stored(0, 0, parent.map(SequenceBlockHash), blocks);
            self.emit(out, event);
        }
    }

    /// Numbers `event` in the pool's sequence and queues it as the pool's.
    fn emit(&mut self, out: &mut Vec<RouterEvent>, mut event: KvCacheEvent) {
        event.event_id = self.next_event_id;
        self.next_event_id += 1;
        let mut e = RouterEvent::new(self.source, event);
        e.residency_domain = Some(ResidencyDomain::CacheOwner);
        out.push(e);
    }
}

/// A request inside an engine.
#[derive(Debug, Clone)]
pub struct EngineRequest {
    /// Harness request index.
    pub id: usize,
    /// Prompt tokens.
    pub input_tokens: u32,
    /// Tokens to generate.
    pub output_tokens: u32,
    /// Full prompt blocks: (local, sequence) hashes.
    pub blocks: Vec<(LocalBlockHash, SequenceBlockHash)>,
    cached_blocks: usize,
    /// Blocks found cached (device or host) when it was admitted.
    hit_blocks: usize,
    /// Memory promised to its fresh blocks at admission, released block by block as they
    /// are cached (blocks).
    reserved: usize,
    prefilled: u32,
    generated: u32,
}

impl EngineRequest {
    /// A request with its prompt blocks.
    pub fn new(
        id: usize,
        input_tokens: u32,
        output_tokens: u32,
        blocks: Vec<(LocalBlockHash, SequenceBlockHash)>,
    ) -> Self {
        Self {
            id,
            input_tokens,
            output_tokens,
            blocks,
            cached_blocks: 0,
            hit_blocks: 0,
            reserved: 0,
            prefilled: 0,
            generated: 0,
        }
    }
}

/// What a step produced.
#[derive(Debug, Default)]
pub struct StepOutcome {
    /// Requests admitted (given their memory and their first chunk) in this step.
    pub admitted: Vec<usize>,
    /// Requests that produced their first token.
    pub first_tokens: Vec<usize>,
    /// Prompt blocks each of `first_tokens` found cached (device or host memory), in order.
    pub first_cached: Vec<usize>,
    /// Requests that produced a later token.
    pub tokens: Vec<usize>,
    /// Requests that finished (after their last token).
    pub finished: Vec<usize>,
}

/// Blocks of a chain, parent first: (local, sequence hash).
type Chain = Vec<(LocalBlockHash, SequenceBlockHash)>;

/// Host-tier changes of one round of evictions, published together: only their net effect
/// (a block copied and dropped again in one round is neither; one dropped and copied again
/// stays where it was).
#[derive(Debug, Default)]
struct Offloads {
    /// Blocks copied to host memory, in order: (parent, local, sequence hash).
    stored: Vec<(Option<u64>, LocalBlockHash, SequenceBlockHash)>,
    /// Those of `stored` still there.
    live: AHashSet<u64>,
    /// Blocks host memory dropped to make room (held before this round).
    removed: AHashSet<u64>,
}

/// See the [module docs](self).
#[derive(Debug)]
pub struct Engine {
    /// The worker id it publishes as.
    pub worker_id: WorkerId,
    cfg: EngineConfig,
    blocks: HashMap<u64, Block>,
    /// Evictable leaves by (last use, sequence hash).
    leaves: BTreeSet<(u64, u64)>,
    waiting: VecDeque<EngineRequest>,
    running: Vec<EngineRequest>,
    clock: u64,
    next_event_id: u64,
    events: Vec<RouterEvent>,
    host: HostTier,
    /// The fleet's shared pool, when there is one.
    pool: Option<Rc<RefCell<SharedPool>>>,
    /// Onload time owed by requests admitted since the last step (ms).
    onload_ms: f64,
    /// Bumped by every change that can let a waiting request in: a block cached or
    /// evicted, a leaf gained or lost, the batch changed.
    generation: u64,
    /// The generation at which the head of the queue last did not fit: until it changes,
    /// admission has nothing to try (decode-only steps skip it).
    blocked_at: Option<u64>,
    /// Blocks promised to admitted requests for their fresh blocks not yet cached: each is
    /// cached when the chunk holding it is scheduled, and the memory must be there then.
    reserved: usize,
    /// Cached blocks some running request uses (`refs > 0`). A request holds its whole
    /// cached prefix, so these are closed under parents, and every other cached block can
    /// be evicted, leaf after leaf.
    in_use: usize,
    /// Prompt blocks served from the device cache (for hit ratios).
    pub hit_blocks: u64,
    /// Prompt blocks onloaded from host memory.
    pub host_hit_blocks: u64,
    /// Prompt blocks in all.
    pub prompt_blocks: u64,
}

impl Engine {
    /// An idle engine with an empty cache.
    pub fn new(worker_id: WorkerId, cfg: EngineConfig) -> Self {
        Self {
            worker_id,
            cfg,
            blocks: HashMap::new(),
            leaves: BTreeSet::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            clock: 0,
            next_event_id: 0,
            events: Vec::new(),
            host: HostTier::default(),
            pool: None,
            onload_ms: 0.0,
            generation: 0,
            blocked_at: None,
            reserved: 0,
            in_use: 0,
            hit_blocks: 0,
            host_hit_blocks: 0,
            prompt_blocks: 0,
        }
    }

    /// Reads and writes through `pool`, the fleet's shared pool.
    pub fn attach_pool(&mut self, pool: Rc<RefCell<SharedPool>>) {
        self.pool = Some(pool);
    }

    /// Queues a request.
    pub fn submit(&mut self, r: EngineRequest) {
        self.waiting.push_back(r);
    }

    /// Whether it has anything to do.
    pub fn busy(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Requests waiting or running.
    pub fn load(&self) -> usize {
        self.waiting.len() + self.running.len()
    }

    /// KV events published since the last call.
    pub fn take_events(&mut self) -> Vec<RouterEvent> {
        std::mem::take(&mut self.events)
    }

    /// Marks `seq` used and takes a reference on it for a request (one lookup: what
    /// `touch` then `set_refs(seq, 1)` do).
    fn hold(&mut self, seq: u64) {
        self.clock += 1;
        let Some(b) = self.blocks.get_mut(&seq) else {
            return;
        };
        if b.refs == 0 && b.children == 0 {
            self.leaves.remove(&(b.last_used, seq));
            self.generation += 1;
        }
        b.last_used = self.clock;
        if b.refs == 0 {
            self.in_use += 1;
        }
        b.refs += 1;
    }

    fn set_refs(&mut self, seq: u64, delta: i32) {
        let Some(b) = self.blocks.get_mut(&seq) else {
            return;
        };
        self.generation += 1;
        let was_leaf = b.refs == 0 && b.children == 0;
        let was_used = b.refs > 0;
        b.refs = (b.refs as i32 + delta) as u32;
        let is_leaf = b.refs == 0 && b.children == 0;
        match (was_used, b.refs > 0) {
            (false, true) => self.in_use += 1,
            (true, false) => self.in_use -= 1,
            _ => {}
        }
        let key = (b.last_used, seq);
        if was_leaf && !is_leaf {
            self.leaves.remove(&key);
        } else if !was_leaf && is_leaf {
            self.leaves.insert(key);
        }
    }

    /// Evicts the least recently used leaf from the device; offloads it to host memory
    /// when there is a host tier (its host events queued in `offloaded`).
    fn evict_one(&mut self, offloaded: &mut Offloads) -> Option<u64> {
        let (stamp, seq) = *self.leaves.iter().next()?;
        self.generation += 1;
        self.leaves.remove(&(stamp, seq));
        // Every leaf is cached (the leaf set mirrors the block map).
        let b = self.blocks.remove(&seq)?;
        if self.cfg.host_capacity_blocks > 0 {
            self.offload(seq, b, offloaded);
        }
        if let Some(p) = b.parent
            && let Some(pb) = self.blocks.get_mut(&p)
        {
            pb.children -= 1;
            if pb.children == 0 && pb.refs == 0 {
                self.leaves.insert((pb.last_used, p));
            }
        }
        Some(seq)
    }

    /// Copies an evicted device block into host memory, making room there first.
    fn offload(&mut self, seq: u64, b: Block, out: &mut Offloads) {
        self.clock += 1;
        if !self.host.blocks.contains_key(&seq) {
            while self.host.blocks.len() >= self.cfg.host_capacity_blocks {
                let Some(victim) = self.host.pop_oldest() else {
                    break;
                };
                if !out.live.remove(&victim) {
                    out.removed.insert(victim);
                }
            }
            if !out.removed.remove(&seq) {
                out.stored
                    .push((b.parent, LocalBlockHash(b.local), SequenceBlockHash(seq)));
                out.live.insert(seq);
            }
        }
        self.host.touch(seq, self.clock);
    }

    /// Publishes what eviction did: host stores first (their parents are still on the
    /// device), then host removals, then the device removals.
    ///
    /// Leaves go first, so a run of evictions is a chain child first: reversed, it is
    /// published as chains parent first, each one stored event under its first block's
    /// parent (as engines publish offloads), which the router places with one walk of the
    /// tree per chain rather than per block.
    fn publish_evictions(&mut self, off: Offloads, removed: Vec<SequenceBlockHash>) {
        let mut chains: Vec<(Option<u64>, Chain)> = Vec::new();
        for (parent, l, s) in off.stored.into_iter().rev() {
            if !off.live.contains(&s.0) {
                continue;
            }
            match chains.last_mut() {
                Some((_, c)) if c.last().map(|b| b.1.0) == parent => c.push((l, s)),
                _ => chains.push((parent, vec![(l, s)])),
            }
        }
        for (parent, chain) in chains {
            self.emit_on(StorageTier::HostPinned, |id| {
                KvCacheEvent::stored(id, 0, parent.map(SequenceBlockHash), chain)
            });
        }
        if !off.removed.is_empty() {
            let mut gone: Vec<u64> = off.removed.into_iter().collect();
            gone.sort_unstable();
            self.emit_on(StorageTier::HostPinned, |id| {
                KvCacheEvent::removed(id, 0, gone.into_iter().map(SequenceBlockHash))
            });
        }
        if !removed.is_empty() {
            self.emit(|id| KvCacheEvent::removed(id, 0, removed));
        }
    }

    /// Moves the head of the queue into the batch if its blocks fit (and the batch has
    /// room); returns its index in `running`.
    fn admit_one(&mut self) -> Option<usize> {
        if self.blocked_at == Some(self.generation) || self.running.len() >= self.cfg.max_running {
            return None;
        }
        let mut r = self.waiting.pop_front()?;
        // Longest cached prefix.
        let hit = r
            .blocks
            .iter()
            .take_while(|(_, s)| self.blocks.contains_key(&s.0))
            .count();
        // Its continuation in host memory, onloaded rather than prefilled.
        let onload = r.blocks[hit..]
            .iter()
            .take_while(|(_, s)| self.host.blocks.contains_key(&s.0))
            .count();
        // And its continuation in the shared pool.
        let pooled = self
            .pool
            .as_ref()
            .map_or(0, |p| p.borrow().continuation(&r.blocks, hit + onload));
        let need = r.blocks.len() - hit;
        let free = self
            .cfg
            .capacity_blocks
            .saturating_sub(self.blocks.len() + self.reserved);
        // Every cached block no running request uses can go, leaf after leaf, but for the
        // request's own cached prefix, which it holds from now on.
        let own_idle = r.blocks[..hit]
            .iter()
            .filter(|(_, s)| self.blocks.get(&s.0).is_some_and(|b| b.refs == 0))
            .count();
        let evictable = self.blocks.len() - self.in_use - own_idle;
        if need > free + evictable && !self.running.is_empty() {
            // Not enough room until running requests finish.
            self.waiting.push_front(r);
            self.blocked_at = Some(self.generation);
            return None;
        }
        for (_, s) in &r.blocks[..hit] {
            self.hold(s.0);
        }
        // The copies to onload are read first: refreshed in host memory before the
        // evictions below offload anything there.
        for (_, s) in &r.blocks[hit..hit + onload] {
            self.clock += 1;
            self.host.touch(s.0, self.clock);
        }
        if let Some(p) = &self.pool {
            p.borrow_mut()
                .touch(&r.blocks[hit + onload..hit + onload + pooled]);
        }
        let mut removed = Vec::new();
        let mut off = Offloads::default();
        while self.blocks.len() + self.reserved + need > self.cfg.capacity_blocks {
            match self.evict_one(&mut off) {
                Some(seq) => removed.push(SequenceBlockHash(seq)),
                None => break,
            }
        }
        self.publish_evictions(off, removed);
        let onloaded = self.onload(&r.blocks, hit, onload, self.cfg.onload_ms_per_block);
        // The pool's blocks continue the prefix only if all of host memory's came.
        let from_pool = if onloaded == onload && pooled > 0 {
            let n = self.onload(
                &r.blocks,
                hit + onload,
                pooled,
                self.cfg.pool_onload_ms_per_block,
            );
            if let Some(p) = &self.pool {
                p.borrow_mut().hit_blocks += n as u64;
            }
            n
        } else {
            0
        };
        let cached = hit + onloaded + from_pool;
        self.hit_blocks += hit as u64;
        self.host_hit_blocks += onloaded as u64;
        self.prompt_blocks += r.blocks.len() as u64;
        r.cached_blocks = cached;
        r.hit_blocks = cached;
        r.reserved = need - onloaded - from_pool;
        self.reserved += r.reserved;
        // As real engines do, the last prompt token is always computed, even when the
        // whole prompt is cached: it yields the first token.
        r.prefilled = (cached as u32 * self.cfg.block_size).min(r.input_tokens.saturating_sub(1));
        self.running.push(r);
        self.generation += 1;
        Some(self.running.len() - 1)
    }

    /// Copies `blocks[hit..hit + n]` from host memory or the shared pool to the device (room
    /// was made), holding a reference on each for the request; publishes them as stored on
    /// the device and charges `ms_per_block` each. Returns how many were onloaded (fewer
    /// when the device is full of blocks in use).
    fn onload(
        &mut self,
        blocks: &[(LocalBlockHash, SequenceBlockHash)],
        hit: usize,
        n: usize,
        ms_per_block: f64,
    ) -> usize {
        let mut stored = Vec::new();
        let mut parent = (hit > 0).then(|| blocks[hit - 1].1.0);
        let first_parent = parent;
        for &(l, s) in &blocks[hit..hit + n] {
            if self.blocks.len() >= self.cfg.capacity_blocks {
                break;
            }
            self.insert_in_use(parent, l, s);
            stored.push((l, s));
            parent = Some(s.0);
        }
        let n = stored.len();
        if n > 0 {
            self.onload_ms += n as f64 * ms_per_block;
            self.emit(|id| {
                KvCacheEvent::stored(id, 0, first_parent.map(SequenceBlockHash), stored)
            });
        }
        n
    }

    /// Caches block `s` under `parent`, referenced by the request that brings it (so not
    /// an evictable leaf); the parent gains a child (and is no leaf either).
    fn insert_in_use(&mut self, parent: Option<u64>, l: LocalBlockHash, s: SequenceBlockHash) {
        self.clock += 1;
        self.generation += 1;
        if let Some(p) = parent
            && let Some(pb) = self.blocks.get_mut(&p)
        {
            if pb.children == 0 && pb.refs == 0 {
                self.leaves.remove(&(pb.last_used, p));
            }
            pb.children += 1;
        }
        self.in_use += 1;
        self.blocks.insert(
            s.0,
            Block {
                parent,
                local: l.0,
                children: 0,
                refs: 1,
                last_used: self.clock,
            },
        );
    }

    /// Caches the request's new blocks up to `upto` (those its prefill has computed) and
    /// publishes them; `done`: its prefill completed, every block is cached and what it
    /// still had reserved is released (the blocks it could not cache, in a cache full of
    /// blocks in use, are not).
    fn store(&mut self, idx: usize, upto: usize, done: bool) {
        // The request's blocks, taken for the walk (no copy) and put back after it.
        let blocks = std::mem::take(&mut self.running[idx].blocks);
        let hit = self.running[idx].cached_blocks;
        let upto = upto.clamp(hit, blocks.len());
        let mut parent = if hit > 0 {
            Some(blocks[hit - 1].1.0)
        } else {
            None
        };
        let first_parent = parent;
        let mut stored = Vec::new();
        let mut removed = Vec::new();
        let mut off = Offloads::default();
        // Blocks this request holds a reference on (a prefix of its blocks).
        let mut held = hit;
        for &(l, s) in &blocks[hit..upto] {
            // One block of the request's reservation is this block's room.
            let promised = usize::from(self.running[idx].reserved > 0);
            // Cached meanwhile by a sibling request: reused below.
            let sibling = self.blocks.contains_key(&s.0);
            if !sibling && self.blocks.len() + self.reserved - promised >= self.cfg.capacity_blocks
            {
                match self.evict_one(&mut off) {
                    Some(seq) => removed.push(SequenceBlockHash(seq)),
                    // Full of blocks in use (a prompt larger than the whole cache, let in
                    // alone): the rest of the prompt is not cached now. The reservation
                    // stays, for a later chunk or for the release when it is done.
                    None => break,
                }
            }
            self.running[idx].reserved -= promised;
            self.reserved -= promised;
            if sibling {
                self.hold(s.0);
                parent = Some(s.0);
                held += 1;
                continue;
            }
            self.insert_in_use(parent, l, s);
            stored.push((l, s));
            parent = Some(s.0);
            held += 1;
        }
        if done {
            self.reserved -= std::mem::take(&mut self.running[idx].reserved);
        }
        self.running[idx].cached_blocks = held;
        self.publish_evictions(off, removed);
        if done && let Some(p) = &self.pool {
            p.borrow_mut().write_through(&blocks, &mut self.events);
        }
        self.running[idx].blocks = blocks;
        if !stored.is_empty() {
            // One stored event, under the parent of its first block.
            let first = stored[0].1.0;
            let p = self
                .blocks
                .get(&first)
                .and_then(|b| b.parent)
                .or(first_parent);
            self.emit(|id| KvCacheEvent::stored(id, 0, p.map(SequenceBlockHash), stored));
        }
    }

    /// Queues the next device event (numbered from 0, one sequence for every tier).
    fn emit(&mut self, event: impl FnOnce(u64) -> KvCacheEvent) {
        self.emit_on(StorageTier::Device, event);
    }

    fn emit_on(&mut self, tier: StorageTier, event: impl FnOnce(u64) -> KvCacheEvent) {
        let id = self.next_event_id;
        self.next_event_id += 1;
        let mut e = RouterEvent::new(self.worker_id, event(id));
        e.storage_tier = tier;
        self.events.push(e);
    }

    /// Runs one step; returns its duration (ms) and what it produced, or `None` when idle.
    ///
    /// As vLLM v1 schedules: the step's token budget goes first to the running requests
    /// (one decode token each, then prefill chunks in arrival order), and a waiting request
    /// starts only with budget left over. It looks its prefix up then, after the prefills
    /// scheduled before it in this step have been cached: vLLM caches a chunk's blocks when
    /// it schedules the chunk, so a request sees every block of the prefills that run
    /// ahead of it, even one completing in the same step (with the long-prefill cap, the
    /// full blocks of the chunks scheduled so far).
    pub fn step(&mut self) -> Option<(f64, StepOutcome)> {
        if !self.busy() {
            return None;
        }
        let mut budget = self.cfg.max_batch_tokens;
        let mut prefill_tokens = 0u32;
        let mut kv_tokens = 0u64;
        let mut out = StepOutcome::default();
        let mut decoding = Vec::new();
        let mut prefilling = Vec::new();
        for (i, r) in self.running.iter().enumerate() {
            kv_tokens += (r.prefilled + r.generated) as u64;
            if r.prefilled >= r.input_tokens {
                decoding.push(i);
            } else {
                prefilling.push(i);
            }
        }
        budget = budget.saturating_sub(decoding.len() as u32);
        for i in prefilling {
            if budget == 0 {
                break;
            }
            self.prefill_chunk(i, &mut budget, &mut prefill_tokens, &mut out);
        }
        while budget > 0 {
            let Some(i) = self.admit_one() else {
                break;
            };
            out.admitted.push(self.running[i].id);
            kv_tokens += self.running[i].prefilled as u64;
            self.prefill_chunk(i, &mut budget, &mut prefill_tokens, &mut out);
        }
        let ms = self.cfg.step_ms(prefill_tokens, kv_tokens)
            + std::mem::take(&mut self.onload_ms) / self.cfg.speedup;
        for &i in &decoding {
            let r = &mut self.running[i];
            r.generated += 1;
            out.tokens.push(r.id);
        }
        // Finished requests release their blocks; the rest keep their arrival order.
        let mut k = 0;
        while k < self.running.len() {
            let r = &self.running[k];
            if r.prefilled >= r.input_tokens && r.generated >= r.output_tokens.max(1) {
                let r = self.running.remove(k);
                self.generation += 1;
                for (_, s) in &r.blocks[..r.cached_blocks] {
                    self.set_refs(s.0, -1);
                }
                out.finished.push(r.id);
            } else {
                k += 1;
            }
        }
        Some((ms, out))
    }

    /// Gives running request `i` its next prefill chunk from `budget` and caches the
    /// chunk's full blocks at once (later admissions in this step see them); when that
    /// completes its prefill, caches the rest and reports its first token.
    fn prefill_chunk(
        &mut self,
        i: usize,
        budget: &mut u32,
        prefill_tokens: &mut u32,
        out: &mut StepOutcome,
    ) {
        let cap = self.cfg.chunk_cap();
        let r = &mut self.running[i];
        let chunk = (r.input_tokens - r.prefilled).min(*budget).min(cap);
        r.prefilled += chunk;
        *budget -= chunk;
        *prefill_tokens += chunk;
        if r.prefilled < r.input_tokens {
            // vLLM caches (and publishes) a chunk's full blocks when it schedules it, so
            // a request admitted beside the prefill (capped, a prefill leaves budget over)
            // or routed while it runs finds the chunks scheduled so far.
            let upto = (r.prefilled / self.cfg.block_size) as usize;
            if upto > r.cached_blocks {
                self.store(i, upto, false);
            }
        } else {
            self.store(i, usize::MAX, true);
            let r = &mut self.running[i];
            r.generated = 1;
            out.first_tokens.push(r.id);
            out.first_cached.push(r.hit_blocks);
        }
    }

    /// Blocks cached now.
    pub fn cached_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks in host memory now.
    pub fn host_blocks(&self) -> usize {
        self.host.blocks.len()
    }

    /// Blocks in the shared pool now (`None` without one).
    pub fn pool_blocks(&self) -> Option<usize> {
        self.pool.as_ref().map(|p| p.borrow().blocks())
    }

    /// The local hash of a cached block (for tests).
    pub fn local_of(&self, seq: u64) -> Option<u64> {
        self.blocks.get(&seq).map(|b| b.local)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrouter_core::index::{Index, ReferenceIndex};

    #[test]
    fn the_ttft_floor_is_under_a_lone_requests_ttft_and_close_to_it() {
        for (speedup, cap) in [(1.0, 0), (4.0, 0), (1.0, 2_048)] {
            let cfg = EngineConfig {
                speedup,
                long_prefill_token_threshold: cap,
                ..EngineConfig::default()
            };
            for n in [1u32, 100, 3_000, 8_192, 20_000, 100_000] {
                let mut e = Engine::new(1, cfg);
                e.submit(EngineRequest::new(0, n, 4, Vec::new()));
                let mut ttft = 0.0;
                loop {
                    let (ms, out) = e.step().expect("running");
                    ttft += ms;
                    if !out.first_tokens.is_empty() {
                        break;
                    }
                }
                let floor = cfg.ttft_floor_ms(n);
                assert!(
                    floor <= ttft + 1e-9,
                    "{n} tokens: floor {floor} over {ttft}"
                );
                assert!(
                    floor > 0.85 * ttft,
                    "{n} tokens: floor {floor}, TTFT {ttft}"
                );
            }
            assert_eq!(cfg.ttft_floor_ms(0), cfg.decode_base / speedup);
        }
    }

    /// 4-token blocks, room for `capacity` of them, 100 tokens a step.
    fn small(capacity: usize) -> EngineConfig {
        EngineConfig {
            block_size: 4,
            capacity_blocks: capacity,
            max_batch_tokens: 100,
            ..Default::default()
        }
    }

    /// `in_use` is the number of cached blocks some running request uses.
    fn assert_in_use_counted(e: &Engine) {
        assert_eq!(e.in_use, e.blocks.values().filter(|b| b.refs > 0).count());
    }

    fn chain(ids: &[u64]) -> Vec<(LocalBlockHash, SequenceBlockHash)> {
        let locals: Vec<LocalBlockHash> = ids.iter().map(|&i| LocalBlockHash(i)).collect();
        locals
            .iter()
            .copied()
            .zip(kvrouter_core::hash::sequence_hashes(&locals))
            .collect()
    }

    /// Runs `r` on `e` until it is idle and applies what it published (its own events and
    /// its pool's) to `index`; returns the steps' durations.
    fn run(e: &mut Engine, index: &mut ReferenceIndex, r: EngineRequest) -> Vec<f64> {
        e.submit(r);
        let mut ms = Vec::new();
        while let Some((t, _)) = e.step() {
            ms.push(t);
        }
        for ev in e.take_events() {
            index.apply(ev).expect("the engine's events apply cleanly");
        }
        ms
    }

    #[test]
    fn a_prompt_cached_whole_still_has_a_first_token() {
        let cfg = small(6);
        let mut e = Engine::new(1, cfg);
        for id in 0..2 {
            e.submit(EngineRequest::new(id, 8, 2, chain(&[1, 2])));
            let mut firsts = Vec::new();
            while let Some((_, out)) = e.step() {
                firsts.extend(out.first_tokens);
            }
            assert_eq!(firsts, vec![id]);
        }
        assert_eq!(e.hit_blocks, 2);
    }

    #[test]
    fn a_request_waits_for_the_budget_and_then_sees_the_prefill_ahead_of_it() {
        // A: 250 tokens (62 full blocks), 100 tokens a step. B shares A's 62 blocks and
        // adds 3. Submitted together, B does not start while A's chunks take the whole
        // budget; it starts in A's last step, with the 50 tokens A leaves, and finds all of
        // A's blocks cached, as vLLM schedules. Looked up when submitted, it would find none.
        let mut e = Engine::new(1, small(200));
        let a: Vec<u64> = (1..=62).collect();
        let b: Vec<u64> = (1..=65).collect();
        e.submit(EngineRequest::new(0, 250, 2, chain(&a)));
        e.submit(EngineRequest::new(1, 260, 2, chain(&b)));
        let mut steps = Vec::new();
        while let Some((_, out)) = e.step() {
            assert_in_use_counted(&e);
            steps.push((out.admitted, out.first_tokens, out.first_cached));
        }
        assert_eq!(
            steps[..3],
            [
                (vec![0], vec![], vec![]),
                (vec![], vec![], vec![]),
                (vec![1], vec![0, 1], vec![0, 62]),
            ]
        );
        assert_eq!((e.hit_blocks, e.prompt_blocks), (62, 127));
    }

    #[test]
    fn a_long_prefill_capped_per_step_lets_a_short_request_start_beside_it() {
        // A: 400 tokens; B: 20 tokens of its own, submitted after A started. Uncapped, A
        // takes each step's whole budget of 100 and B starts after A's last step; with
        // `long_prefill_token_threshold` 40, A gets 40 tokens a step and B starts in the
        // next step with the 60 left, its first token there too, as vLLM v1 schedules.
        for (cap, b_first) in [(0, 4), (40, 1)] {
            let cfg = EngineConfig {
                long_prefill_token_threshold: cap,
                ..small(200)
            };
            let mut e = Engine::new(1, cfg);
            let a: Vec<u64> = (1..=100).collect();
            e.submit(EngineRequest::new(0, 400, 2, chain(&a)));
            let (_, first) = e.step().expect("running");
            assert_eq!(first.admitted, vec![0]);
            e.submit(EngineRequest::new(
                1,
                20,
                2,
                chain(&[500, 501, 502, 503, 504]),
            ));
            let mut step = 0;
            let mut b_at = None;
            let mut a_at = None;
            while let Some((_, out)) = e.step() {
                step += 1;
                assert_in_use_counted(&e);
                if out.first_tokens.contains(&1) {
                    b_at.get_or_insert(step);
                }
                if out.first_tokens.contains(&0) {
                    a_at.get_or_insert(step);
                }
            }
            assert_eq!(b_at, Some(b_first), "cap {cap}");
            // A's 400 tokens take 4 steps uncapped (3 after the first), 10 capped.
            assert_eq!(a_at, Some(if cap == 0 { 3 } else { 9 }), "cap {cap}");
        }
        // The floor of a lone prefill respects the cap: at least ⌈n / cap⌉ steps.
        let capped = EngineConfig {
            long_prefill_token_threshold: 40,
            ..small(200)
        };
        assert!(capped.ttft_floor_ms(400) >= 10.0 * (capped.prefill_c + capped.decode_base));
    }

    #[test]
    fn a_request_started_beside_a_capped_prefill_finds_its_chunks_so_far() {
        // A: 400 tokens (100 blocks of 4), capped at 40 tokens a step. B shares A's first
        // 30 blocks and adds 2, submitted after A's first step. In the next step A's chunk
        // reaches 80 tokens (20 blocks), cached as it is scheduled, and B, started beside
        // it with the budget A leaves, finds those 20 and computes only the rest, as vLLM
        // caches a chunk's full blocks when it schedules it. The router hears of A's
        // blocks chunk by chunk, and its index always holds what the engine caches.
        let cfg = EngineConfig {
            long_prefill_token_threshold: 40,
            ..small(400)
        };
        let mut e = Engine::new(1, cfg);
        let mut index = ReferenceIndex::new();
        let a: Vec<u64> = (1..=100).collect();
        let mut b: Vec<u64> = (1..=30).collect();
        b.extend([900, 901]);
        e.submit(EngineRequest::new(0, 400, 2, chain(&a)));
        let (_, first) = e.step().expect("running");
        assert_eq!(first.admitted, vec![0]);
        e.submit(EngineRequest::new(1, 128, 2, chain(&b)));
        let mut b_cached = None;
        while let Some((_, out)) = e.step() {
            assert_in_use_counted(&e);
            assert!(e.blocks.len() + e.reserved <= cfg.capacity_blocks);
            for ev in e.take_events() {
                index.apply(ev).expect("the engine's events apply cleanly");
            }
            assert_eq!(index.block_count(), e.cached_blocks());
            if let Some(k) = out.first_tokens.iter().position(|&id| id == 1) {
                b_cached = Some(out.first_cached[k]);
            }
        }
        assert_eq!(b_cached, Some(20));
        assert_eq!(e.reserved, 0);
        // A's 100 blocks and B's own 2. B computed blocks 21..=30 itself (A had not
        // scheduled them when B started); A's later chunks found them cached.
        assert_eq!(e.cached_blocks(), 102);
    }

    #[test]
    fn a_request_whose_cached_prefix_would_be_counted_as_room_waits() {
        // Room for 100 blocks. A (30 blocks) and B (20) run and end: 50 idle blocks. X
        // (50 blocks) runs and holds them. N continues A's 30 with 40 more: 50 blocks are
        // evictable, but 30 of them are N's own prefix, which it holds once admitted, so
        // only 20 can make room for its 40. N waits for X to end; memory is never
        // promised past the capacity.
        let cfg = small(100);
        let mut e = Engine::new(1, cfg);
        let a: Vec<u64> = (1..=30).collect();
        let mut n = a.clone();
        n.extend(100..140);
        e.submit(EngineRequest::new(0, 120, 1, chain(&a)));
        while e.step().is_some() {}
        e.submit(EngineRequest::new(
            1,
            80,
            1,
            chain(&(200..220).collect::<Vec<_>>()),
        ));
        while e.step().is_some() {}
        e.submit(EngineRequest::new(
            2,
            200,
            6,
            chain(&(300..350).collect::<Vec<_>>()),
        ));
        let (_, out) = e.step().expect("running");
        assert_eq!(out.admitted, vec![2]);
        e.submit(EngineRequest::new(3, 280, 1, chain(&n)));
        let (mut x_done, mut n_hit) = (false, None);
        while let Some((_, out)) = e.step() {
            assert!(e.blocks.len() + e.reserved <= cfg.capacity_blocks);
            assert_in_use_counted(&e);
            if out.admitted.contains(&3) {
                assert!(x_done, "N admitted while X holds its memory");
            }
            x_done |= out.finished.contains(&2);
            if let Some(k) = out.first_tokens.iter().position(|&id| id == 3) {
                n_hit = Some(out.first_cached[k]);
            }
        }
        assert_eq!(n_hit, Some(30));
        assert_eq!(e.reserved, 0);
    }

    #[test]
    fn an_uncapped_prefill_publishes_each_chunks_blocks_as_it_is_scheduled() {
        // A: 400 tokens (100 blocks of 4) with no cap and 100 tokens a step: four chunks
        // of 25 blocks. vLLM caches, and publishes, a chunk's full blocks when it schedules
        // it, so the router's index holds 25, 50, 75 and then 100 of A's blocks, each
        // step's before A's first token, and always what the engine caches.
        let cfg = small(400);
        let mut e = Engine::new(1, cfg);
        let mut index = ReferenceIndex::new();
        let a: Vec<u64> = (1..=100).collect();
        e.submit(EngineRequest::new(0, 400, 2, chain(&a)));
        let mut seen = Vec::new();
        while let Some((_, out)) = e.step() {
            for ev in e.take_events() {
                index.apply(ev).expect("the engine's events apply cleanly");
            }
            assert_eq!(index.block_count(), e.cached_blocks());
            assert!(e.blocks.len() + e.reserved <= cfg.capacity_blocks);
            seen.push((index.block_count(), out.first_tokens.contains(&0)));
        }
        assert_eq!(
            seen,
            [
                (25, false),
                (50, false),
                (75, false),
                (100, true),
                (100, false)
            ]
        );
        assert_eq!(e.reserved, 0);
    }

    #[test]
    fn a_cached_chain_nobody_uses_makes_room_whole() {
        // Room for 8 blocks. A's 5-block chain stays cached after A ends: one leaf, five
        // evictable blocks. C (2 blocks, a long answer) runs; D needs 4 fresh blocks with
        // 1 free. It is admitted at once, A's chain evicted leaf after leaf, rather than
        // waiting for C to end because only one leaf could be seen.
        let cfg = small(8);
        let mut e = Engine::new(1, cfg);
        e.submit(EngineRequest::new(0, 20, 1, chain(&[1, 2, 3, 4, 5])));
        while e.step().is_some() {}
        e.submit(EngineRequest::new(1, 8, 50, chain(&[10, 11])));
        let (_, out) = e.step().expect("running");
        assert_eq!(out.admitted, vec![1]);
        assert_eq!((e.blocks.len(), e.in_use), (7, 2));
        e.submit(EngineRequest::new(2, 16, 1, chain(&[20, 21, 22, 23])));
        let (_, out) = e.step().expect("running");
        assert_eq!(out.admitted, vec![2]);
        let mut finished = out.finished;
        while let Some((_, out)) = e.step() {
            assert_in_use_counted(&e);
            finished.extend(out.finished);
        }
        assert_eq!(finished, vec![2, 1]);
        assert_eq!(e.in_use, 0);
    }

    #[test]
    fn prefills_that_do_not_fit_together_are_admitted_one_after_another() {
        // Room for 6 blocks; two prompts of 5 fresh blocks each, submitted together. The
        // second waits until the first has finished and released its blocks, so each is
        // cached whole: memory is promised at admission, not only when a prefill ends.
        let cfg = small(6);
        let mut e = Engine::new(1, cfg);
        let mut index = ReferenceIndex::new();
        e.submit(EngineRequest::new(0, 20, 3, chain(&[1, 2, 3, 4, 5])));
        e.submit(EngineRequest::new(1, 20, 3, chain(&[6, 7, 8, 9, 10])));
        let (mut admitted, mut firsts, mut finished) = (Vec::new(), Vec::new(), Vec::new());
        while let Some((_, out)) = e.step() {
            assert!(e.blocks.len() + e.reserved <= cfg.capacity_blocks);
            assert_in_use_counted(&e);
            admitted.push(out.admitted);
            firsts.extend(out.first_tokens);
            finished.extend(out.finished.iter().map(|&id| (id, admitted.len())));
            for ev in e.take_events() {
                index.apply(ev).expect("the engine's events apply cleanly");
            }
            assert!(index.block_count() <= cfg.capacity_blocks);
        }
        assert_eq!(admitted[0], vec![0], "{admitted:?}");
        let second = admitted
            .iter()
            .position(|a| a == &vec![1])
            .expect("admitted");
        assert!(second >= finished[0].1, "{admitted:?} {finished:?}");
        assert_eq!(firsts, vec![0, 1]);
        // Both prompts were cached whole in their turn: the second evicted all but the
        // first's root to make room for its five.
        assert_eq!(e.prompt_blocks, 10);
        assert_eq!(e.cached_blocks(), 6);
        assert_eq!(index.block_count(), 6);
        assert_eq!(e.reserved, 0);
    }

    #[test]
    fn reuses_prefixes_evicts_leaves_and_publishes_exact_events() {
        let cfg = small(6);
        let mut e = Engine::new(1, cfg);
        let mut index = ReferenceIndex::new();
        run(
            &mut e,
            &mut index,
            EngineRequest::new(0, 16, 2, chain(&[1, 2, 3, 4])),
        );
        assert_eq!(e.cached_blocks(), 4);
        run(
            &mut e,
            &mut index,
            EngineRequest::new(1, 16, 2, chain(&[1, 2, 7, 8])),
        );
        assert_eq!(e.hit_blocks, 2);
        // Capacity 6: [1,2,3,4] + [7,8] = 6; a third prompt evicts LRU leaves.
        run(
            &mut e,
            &mut index,
            EngineRequest::new(2, 12, 1, chain(&[9, 10, 11])),
        );
        assert!(e.cached_blocks() <= 6);
        let q: Vec<LocalBlockHash> = [9, 10, 11].iter().map(|&i| LocalBlockHash(i)).collect();
        assert_eq!(
            index
                .find_matches(&q)
                .get(kvrouter_core::worker::WorkerDp::new(1, 0)),
            3
        );
        assert_eq!(index.block_count(), e.cached_blocks());
    }

    #[test]
    fn evicted_blocks_go_to_host_memory_and_come_back_without_prefill() {
        use kvrouter_core::index::TierScores;
        use kvrouter_core::worker::WorkerDp;
        let cfg = EngineConfig {
            block_size: 4,
            capacity_blocks: 4,
            max_batch_tokens: 100,
            host_capacity_blocks: 6,
            onload_ms_per_block: 1.0,
            ..Default::default()
        };
        let mut e = Engine::new(1, cfg);
        let mut index = ReferenceIndex::new();
        let w = WorkerDp::new(1, 0);
        let tiers_of = |index: &ReferenceIndex, ids: &[u64]| {
            let q: Vec<LocalBlockHash> = ids.iter().map(|&i| LocalBlockHash(i)).collect();
            let paths: Vec<u64> = kvrouter_core::hash::sequence_hashes(&q)
                .iter()
                .map(|s| s.0)
                .collect();
            let device = index.find_matches(&q);
            let mut t = TierScores::new();
            index.tier_overlaps_into(&q, &paths, &device, &mut t);
            t.finish();
            (device.get(w), t.get(w).host)
        };
        run(
            &mut e,
            &mut index,
            EngineRequest::new(0, 16, 1, chain(&[1, 2, 3, 4])),
        );
        // B takes the whole device: A's blocks are offloaded, published on the host tier.
        run(
            &mut e,
            &mut index,
            EngineRequest::new(1, 16, 1, chain(&[5, 6, 7, 8])),
        );
        assert_eq!((e.cached_blocks(), e.host_blocks()), (4, 4));
        assert_eq!(tiers_of(&index, &[1, 2, 3, 4]), (0, 4));
        // A again: onloaded (4 ms on its first step, which computes only its last token),
        // not prefilled; B goes to host memory, which (6 blocks) keeps B's 4 and 2 of A's
        // copies.
        let ms = run(
            &mut e,
            &mut index,
            EngineRequest::new(2, 16, 1, chain(&[1, 2, 3, 4])),
        );
        assert_eq!((e.hit_blocks, e.host_hit_blocks), (0, 4));
        assert_eq!(ms[0], cfg.step_ms(1, 15) + 4.0, "{ms:?}");
        assert_eq!(e.host_blocks(), 6);
        assert_eq!(tiers_of(&index, &[1, 2, 3, 4]), (4, 0));
        assert_eq!(index.block_count(), e.cached_blocks());
        assert_eq!(index.lower_block_count(), e.host_blocks());
        assert_eq!(tiers_of(&index, &[5, 6, 7, 8]).0, 0);
    }

    #[test]
    fn a_shared_pool_serves_one_engines_prefill_to_another_and_publishes_it() {
        use kvrouter_core::index::TierScores;
        let cfg = EngineConfig {
            block_size: 4,
            capacity_blocks: 5,
            max_batch_tokens: 100,
            pool_capacity_blocks: 6,
            pool_onload_ms_per_block: 2.0,
            ..Default::default()
        };
        let pool = Rc::new(RefCell::new(SharedPool::new(99, cfg.pool_capacity_blocks)));
        let mut engines = [Engine::new(1, cfg), Engine::new(2, cfg)];
        for e in &mut engines {
            e.attach_pool(Rc::clone(&pool));
        }
        let mut index = ReferenceIndex::new();
        // Engine 1 prefills A; the pool gets A's blocks.
        run(
            &mut engines[0],
            &mut index,
            EngineRequest::new(0, 16, 1, chain(&[1, 2, 3, 4])),
        );
        assert_eq!(pool.borrow().blocks(), 4);
        // Engine 2 onloads A's four blocks from the pool (8 ms on its first step) and
        // prefills only the fifth.
        let ms = run(
            &mut engines[1],
            &mut index,
            EngineRequest::new(1, 20, 1, chain(&[1, 2, 3, 4, 9])),
        );
        assert_eq!(engines[1].hit_blocks, 0);
        assert_eq!(pool.borrow().hit_blocks, 4);
        assert_eq!(ms[0], cfg.step_ms(4, 16) + 8.0, "{ms:?}");
        let q: Vec<LocalBlockHash> = [1, 2, 3, 4, 9].iter().map(|&i| LocalBlockHash(i)).collect();
        let paths: Vec<u64> = kvrouter_core::hash::sequence_hashes(&q)
            .iter()
            .map(|s| s.0)
            .collect();
        let shared = |index: &ReferenceIndex| {
            let device = index.find_matches(&q);
            let mut t = TierScores::new();
            // The index finishes the scores itself.
            index.tier_overlaps_into(&q, &paths, &device, &mut t);
            t.shared_beyond(0)
        };
        assert_eq!(shared(&index), 5);
        // A prompt of three new blocks: the pool (6) drops its least recently used.
        run(
            &mut engines[0],
            &mut index,
            EngineRequest::new(2, 12, 1, chain(&[5, 6, 7])),
        );
        assert_eq!(pool.borrow().blocks(), 6);
        assert_eq!(
            index.lower_block_count(),
            6,
            "the index holds exactly the pool's blocks"
        );
        assert_eq!(shared(&index), 3, "A's first two blocks were the oldest");
        assert_eq!(
            index.block_count(),
            engines.iter().map(Engine::cached_blocks).sum::<usize>()
        );
    }

    #[test]
    fn timing_model() {
        let c = EngineConfig {
            prefill_a: 1.0,
            prefill_b: 2.0,
            prefill_c: 3.0,
            decode_base: 4.0,
            decode_per_ktoken: 5.0,
            speedup: 2.0,
            ..Default::default()
        };
        assert_eq!(c.step_ms(10, 2000), (3.0 + 20.0 + 100.0 + 4.0 + 10.0) / 2.0);
        assert_eq!(c.step_ms(0, 0), 2.0);
    }
}
