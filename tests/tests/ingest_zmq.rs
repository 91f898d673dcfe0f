//! The vLLM-native ZMQ source end to end against real libzmq publishers (pyzmq, msgspec:
//! `tests/py/vllm_engine.py`, vLLM's wire): the ingest's index equals the reference index
//! fed the same events, with one message in ten lost from the live stream and recovered
//! through the replay socket, an engine restart, a replay window exceeded, malformed
//! frames; the router's SUB both connects to a bound engine and is bound for an engine
//! that connects; workers are listed before their first event; every engine's `medium`
//! reaches its storage tier.

use std::time::Duration;

use kvrouter_core::codec::vllm;
use kvrouter_core::decision::Lookup;
use kvrouter_core::engine::{Converter, Dropped};
use kvrouter_core::hash::{HashOptions, LocalBlockHash, local_block_hashes, sequence_hashes};
use kvrouter_core::index::{Index, OverlapScores, ReferenceIndex, TierOverlap, TierScores};
use kvrouter_core::worker::WorkerDp;
use kvrouter_io::ingest::{Ingest, IngestConfig, SnapshotConfig, ZmqEngine};
use kvrouter_io::zmq::Endpoint;
use kvrouter_tests::engine::PyEngine;
use kvrouter_tests::fleet::wait_until;
use kvrouter_tests::free_port;
use serde_json::{Value, json};

const BS: u32 = 16;

/// A small deterministic generator.
struct Gen(u64);

impl Gen {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// One simulated engine's cache: the blocks it holds (hash, tokens of its whole prefix).
struct Cache {
    blocks: Vec<(u64, Vec<u32>)>,
    g: Gen,
}

impl Cache {
    fn new(seed: u64) -> Self {
        Cache {
            blocks: Vec::new(),
            g: Gen(seed | 1),
        }
    }

    /// A batch of 1–3 events: stores that extend a held prefix (or start one), removals.
    fn batch(&mut self) -> Vec<Value> {
        let mut events = Vec::new();
        for _ in 0..1 + self.g.below(3) {
            if self.blocks.len() > 4 && self.g.below(4) == 0 {
                let n = 1 + self.g.below(3) as usize;
                let mut hashes = Vec::new();
                for _ in 0..n {
                    if self.blocks.is_empty() {
                        break;
                    }
                    let i = self.g.below(self.blocks.len() as u64) as usize;
                    let (h, prefix) = self.blocks.swap_remove(i);
                    hashes.push(h);
                    // What hangs below a removed block goes with it in the index.
                    self.blocks.retain(|(_, p)| !p.starts_with(&prefix));
                }
                events
                    .push(json!({"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}));
                continue;
            }
            let parent = (!self.blocks.is_empty() && self.g.below(3) != 0).then(|| {
                let i = self.g.below(self.blocks.len() as u64) as usize;
                self.blocks[i].clone()
            });
            let mut prefix = parent.as_ref().map(|p| p.1.clone()).unwrap_or_default();
            let (mut hashes, mut tokens) = (Vec::new(), Vec::new());
            for _ in 0..1 + self.g.below(4) {
                let block: Vec<u32> = (0..BS).map(|_| (self.g.below(50_000)) as u32).collect();
                prefix.extend_from_slice(&block);
                tokens.extend_from_slice(&block);
                let h = self.g.next();
                hashes.push(h);
                self.blocks.push((h, prefix.clone()));
            }
            events.push(json!({
                "type": "BlockStored", "block_hashes": hashes,
                "parent_block_hash": parent.map(|p| p.0), "token_ids": tokens,
                "block_size": BS, "lora_id": null, "medium": "GPU", "lora_name": null
            }));
        }
        events
    }

    /// Every held block's whole prefix, as a query.
    fn queries(&self) -> Vec<Vec<LocalBlockHash>> {
        self.blocks
            .iter()
            .map(|(_, tokens)| local_block_hashes(tokens, BS, &HashOptions::default()))
            .collect()
    }
}

/// The expected side: the same batches through the converter into the reference index.
struct Expected {
    converter: Converter,
    index: ReferenceIndex,
}

impl Expected {
    fn new(worker_id: u64) -> Self {
        Expected {
            converter: Converter::new(worker_id, BS),
            index: ReferenceIndex::new(),
        }
    }

    fn apply(&mut self, events: &[Value]) {
        let payload = rmp_serde::to_vec_named(&json!([0.0, events, 0])).unwrap();
        let batch = vllm::decode_batch(&payload).unwrap();
        let mut d = Dropped::default();
        for e in self.converter.convert(batch, 0, &mut d) {
            self.index.apply(e).unwrap();
        }
        assert!(d.is_empty(), "{d:?}");
    }

    fn reset(&mut self) {
        self.converter.reset();
        let e = self.converter.cleared(0);
        self.index.apply(e).unwrap();
    }

    fn last_id(&self) -> u64 {
        self.converter.next_event_id() - 1
    }
}

fn engine(name: &str, events: &str, replay: &str) -> ZmqEngine {
    ZmqEngine {
        replay: Some(Endpoint::parse(replay).unwrap()),
        ..ZmqEngine::new(name, Endpoint::parse(events).unwrap(), BS)
    }
}

/// A stand-in engine whose PUB and replay sockets bind on all interfaces at these ports,
/// with `extra` arguments.
fn py_engine(pub_port: u16, replay_port: u16, extra: &[&str]) -> PyEngine {
    let (p, r) = (
        format!("tcp://*:{pub_port}"),
        format!("tcp://*:{replay_port}"),
    );
    let mut args = vec!["--pub", p.as_str(), "--replay", r.as_str()];
    args.extend_from_slice(extra);
    PyEngine::start(&args)
}

fn ingest(engines: Vec<ZmqEngine>) -> Ingest {
    Ingest::start(IngestConfig {
        nats: None,
        zmq_engines: engines,
        ..IngestConfig::default()
    })
    .expect("the ingest starts without NATS")
}

fn assert_same(ingest: &Ingest, expected: &ReferenceIndex, queries: &[Vec<LocalBlockHash>]) {
    assert!(!queries.is_empty());
    for q in queries {
        assert_eq!(
            ingest.reader().find_matches(q),
            expected.find_matches(q),
            "query of {} blocks",
            q.len()
        );
    }
}

fn wait_applied(ingest: &Ingest, w: WorkerDp, last: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while ingest.last_event_id(w).is_none_or(|id| id < last) {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for event {last} of {w} (at {:?}): {:?}",
            ingest.last_event_id(w),
            ingest.stats()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn two_engines_equal_the_reference_with_losses_recovered_by_replay() {
    let (pa, ra, pb, rb) = (free_port(), free_port(), free_port(), free_port());
    // A binds (as vLLM does for tcp://*:port) and the router connects to it; B connects to
    // the router's bound SUB. A sends tagged maps and answers replays vLLM 0.26's way, B
    // positional arrays and the older three-frame replies.
    let a = engine(
        "a",
        &format!("tcp://127.0.0.1:{pa}"),
        &format!("tcp://127.0.0.1:{ra}"),
    );
    let b = engine(
        "b",
        &format!("tcp://*:{pb}"),
        &format!("tcp://127.0.0.1:{rb}"),
    );
    let (wa, wb) = (WorkerDp::new(a.worker_id, 0), WorkerDp::new(b.worker_id, 0));
    let ingest = ingest(vec![a.clone(), b.clone()]);
    // Routable before any event.
    wait_until("both engines listed", Duration::from_secs(10), || {
        let ws: Vec<WorkerDp> = ingest.workers().iter().map(|s| s.worker).collect();
        ws.contains(&wa) && ws.contains(&wb)
    });
    let mut ea = py_engine(pa, ra, &["--form", "map", "--replay-form", "new"]);
    let mut eb = PyEngine::start(&[
        "--pub",
        &format!("tcp://127.0.0.1:{pb}"),
        "--replay",
        &format!("tcp://*:{rb}"),
        "--form",
        "array",
        "--replay-form",
        "old",
    ]);
    wait_until("both publishers connected", Duration::from_secs(10), || {
        ingest.stats().zmq_connects >= 2
    });
    let (mut ca, mut cb) = (Cache::new(1), Cache::new(2));
    let (mut xa, mut xb) = (Expected::new(a.worker_id), Expected::new(b.worker_id));
    for i in 0..300u64 {
        for (cache, exp, eng) in [(&mut ca, &mut xa, &mut ea), (&mut cb, &mut xb, &mut eb)] {
            let events = cache.batch();
            exp.apply(&events);
            // One batch in ten never reaches the live stream (the last always does).
            let send = i % 10 != 7 || i == 299;
            eng.send(&json!({"op": "batch", "events": events, "dp_rank": 0, "send": send}));
        }
    }
    wait_applied(&ingest, wa, xa.last_id());
    wait_applied(&ingest, wb, xb.last_id());
    assert_same(&ingest, &xa.index, &ca.queries());
    assert_same(&ingest, &xb.index, &cb.queries());
    let st = ingest.stats();
    assert!(st.zmq_gaps >= 60 && st.zmq_replays >= 60, "{st:?}");
    assert_eq!((st.zmq_replay_failures, st.zmq_restarts), (0, 0), "{st:?}");
    ea.finish();
    eb.finish();
    ingest.stop();
}

#[test]
fn restarts_exceeded_windows_and_garbage_reset_or_skip_without_losing_state() {
    let (p, r) = (free_port(), free_port());
    let e = engine(
        "c",
        &format!("tcp://127.0.0.1:{p}"),
        &format!("tcp://127.0.0.1:{r}"),
    );
    let w = WorkerDp::new(e.worker_id, 0);
    let ingest = ingest(vec![e.clone()]);
    // The engine keeps only its last 4 batches for replay.
    let mut eng = py_engine(p, r, &["--buffer", "4"]);
    wait_until("connected", Duration::from_secs(10), || {
        ingest.stats().zmq_connects >= 1
    });
    let mut cache = Cache::new(3);
    let mut x = Expected::new(e.worker_id);
    let batch = |eng: &mut PyEngine, x: &mut Expected, cache: &mut Cache, send: bool| {
        let events = cache.batch();
        x.apply(&events);
        eng.send(&json!({"op": "batch", "events": events, "dp_rank": 0, "send": send}));
    };
    for _ in 0..20 {
        batch(&mut eng, &mut x, &mut cache, true);
    }
    // Garbage between good batches: counted, skipped, nothing else changes.
    for frames in [
        json!(["00"]),
        json!(["", "0102", "c1"]),
        json!(["", "00", "01", "02", "03"]),
    ] {
        eng.send(&json!({"op": "raw", "frames_hex": frames}));
    }
    batch(&mut eng, &mut x, &mut cache, true);
    wait_applied(&ingest, w, x.last_id());
    assert_same(&ingest, &x.index, &cache.queries());
    assert!(ingest.stats().decode_errors >= 3);
    assert_eq!(ingest.stats().rejected, 0, "{:?}", ingest.stats());

    // The engine restarts: an empty cache, numbering from 0 (its first batch lost live,
    // then replayed).
    eng.send(&json!({"op": "restart"}));
    x.reset();
    cache = Cache::new(4);
    batch(&mut eng, &mut x, &mut cache, false);
    batch(&mut eng, &mut x, &mut cache, true);
    // (The replay must find batch 0 among the buffer's four: let it catch up first.)
    wait_applied(&ingest, w, x.last_id());
    for _ in 0..5 {
        batch(&mut eng, &mut x, &mut cache, true);
    }
    wait_applied(&ingest, w, x.last_id());
    assert_same(&ingest, &x.index, &cache.queries());
    assert_eq!(ingest.stats().zmq_restarts, 1);

    // Six batches lost where the replay buffer holds four: the worker is reset and
    // refills from what follows.
    for _ in 0..6 {
        let events = cache.batch();
        eng.send(&json!({"op": "batch", "events": events, "dp_rank": 0, "send": false}));
    }
    x.reset();
    cache = Cache::new(5);
    for _ in 0..3 {
        batch(&mut eng, &mut x, &mut cache, true);
    }
    wait_applied(&ingest, w, x.last_id());
    assert_same(&ingest, &x.index, &cache.queries());
    let st = ingest.stats();
    assert_eq!(st.zmq_replay_failures, 1, "{st:?}");
    eng.finish();
    ingest.stop();
}

/// Each worker's device overlap and its lower tiers' continuation of `q`.
fn tiered(index: &dyn Lookup, q: &[LocalBlockHash]) -> Vec<(WorkerDp, u32, TierOverlap)> {
    let paths: Vec<u64> = sequence_hashes(q).into_iter().map(|h| h.0).collect();
    let mut device = OverlapScores::new();
    index.find_matches_into(q, &mut device);
    let mut tiers = TierScores::new();
    index.tier_overlaps_into(q, &paths, &device, &mut tiers);
    let mut out: Vec<(WorkerDp, u32, TierOverlap)> = tiers.with_device(&device).collect();
    out.sort_by_key(|e| e.0);
    out
}

#[test]
fn every_medium_of_vllm_and_sglang_reaches_its_tier() {
    // A: vLLM's names (GPU, CPU, DISK) as tagged maps; B: SGLang's (GPU, CPU_PINNED, DISK)
    // as positional arrays. Both offload a prefix to host memory, lose its tail from the
    // device, continue it on disk, and send one event on a medium nobody knows.
    // Each with a replay socket, so nothing sent before the subscription reached the
    // publisher is lost.
    let (pa, ra, pb, rb) = (free_port(), free_port(), free_port(), free_port());
    let a = engine(
        "tier-a",
        &format!("tcp://127.0.0.1:{pa}"),
        &format!("tcp://127.0.0.1:{ra}"),
    );
    let b = engine(
        "tier-b",
        &format!("tcp://127.0.0.1:{pb}"),
        &format!("tcp://127.0.0.1:{rb}"),
    );
    let snaps = std::env::temp_dir().join(format!("kvrouter-tiers-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&snaps);
    let with_snapshots = |engines: Vec<ZmqEngine>| {
        Ingest::start(IngestConfig {
            nats: None,
            zmq_engines: engines,
            snapshot: Some(SnapshotConfig {
                dir: snaps.clone(),
                interval: None,
                on_stop: false,
            }),
            ..IngestConfig::default()
        })
        .expect("the ingest starts without NATS")
    };
    let ingest = with_snapshots(vec![a.clone(), b.clone()]);
    let mut engines = [
        (a.worker_id, "CPU", py_engine(pa, ra, &["--form", "map"])),
        (
            b.worker_id,
            "CPU_PINNED",
            py_engine(pb, rb, &["--form", "array"]),
        ),
    ];
    wait_until("both publishers connected", Duration::from_secs(10), || {
        ingest.stats().zmq_connects >= 2
    });
    let mut g = Gen(11);
    let tokens: Vec<u32> = (0..9 * BS).map(|_| g.below(50_000) as u32).collect();
    let block = |i: usize| tokens[i * BS as usize..(i + 1) * BS as usize].to_vec();
    let span = |r: std::ops::Range<usize>| r.flat_map(block).collect::<Vec<u32>>();
    let q = local_block_hashes(&tokens, BS, &HashOptions::default());
    let mut reference = ReferenceIndex::new();
    for (worker_id, host, eng) in &mut engines {
        let h = |i: u64| *worker_id ^ (1000 + i);
        let names = |r: std::ops::Range<u64>| r.map(h).collect::<Vec<u64>>();
        let stored = |medium: &str, r: std::ops::Range<usize>, parent: Option<u64>| {
            json!({"type": "BlockStored", "block_hashes": names(r.start as u64..r.end as u64),
                   "parent_block_hash": parent, "token_ids": span(r), "block_size": BS,
                   "lora_id": null, "medium": medium, "lora_name": null})
        };
        let batches = [
            vec![stored("GPU", 0..6, None)],
            vec![stored(host, 0..6, None)],
            vec![json!({"type": "BlockRemoved", "block_hashes": names(4..6), "medium": "GPU"})],
            vec![stored("DISK", 6..8, Some(h(5)))],
            vec![stored("TAPE", 8..9, Some(h(7)))],
        ];
        let mut conv = Converter::new(*worker_id, BS);
        let mut dropped = Dropped::default();
        for events in &batches {
            let payload = rmp_serde::to_vec_named(&json!([0.0, events, 0])).unwrap();
            for e in conv.convert(vllm::decode_batch(&payload).unwrap(), 0, &mut dropped) {
                reference.apply(e).unwrap();
            }
            eng.send(&json!({"op": "batch", "events": events, "dp_rank": 0}));
        }
        assert_eq!(dropped.unknown_medium, 1, "{dropped:?}");
        wait_applied(
            &ingest,
            WorkerDp::new(*worker_id, 0),
            conv.next_event_id() - 1,
        );
    }
    // By hand: 4 blocks on the device, the 2 it lost still in host memory, 2 more on disk;
    // the block on the unknown medium earns nothing.
    let (wa, wb) = (WorkerDp::new(a.worker_id, 0), WorkerDp::new(b.worker_id, 0));
    let mut expected = vec![
        (wa, 4, TierOverlap { host: 2, disk: 2 }),
        (wb, 4, TierOverlap { host: 2, disk: 2 }),
    ];
    expected.sort_by_key(|e| e.0);
    assert_eq!(tiered(&ingest.reader(), &q), expected);
    assert_eq!(tiered(&reference, &q), expected);
    let st = ingest.stats();
    assert_eq!(
        (st.engine_unknown_medium, st.pool_events, st.rejected),
        (2, 0, 0),
        "{st:?}"
    );

    // A snapshot keeps every tier: a second router restored from it, with no engine
    // publishing, sees the same.
    ingest.snapshot_now().expect("snapshot written");
    let restored = with_snapshots(Vec::new());
    assert_eq!(tiered(&restored.reader(), &q), expected);
    assert_eq!(restored.reader().lower_block_count(), 2 * (6 + 2));
    assert_eq!(restored.stats().snapshot_restored_blocks, 2 * (4 + 6 + 2));
    restored.stop();
    let _ = std::fs::remove_dir_all(&snaps);

    // The host copy of block 4 goes: the continuation stops at the device prefix. Then the
    // engine clears everything, on every tier.
    for (worker_id, host, eng) in &mut engines {
        let removed =
            json!({"type": "BlockRemoved", "block_hashes": [*worker_id ^ 1004], "medium": *host});
        eng.send(&json!({"op": "batch", "events": [removed], "dp_rank": 0}));
    }
    wait_until("host copies removed", Duration::from_secs(10), || {
        tiered(&ingest.reader(), &q)
            .iter()
            .all(|e| e.2 == TierOverlap::default())
    });
    assert_eq!(ingest.reader().lower_block_count(), 2 * (5 + 2));
    for (_, _, eng) in &mut engines {
        eng.send(&json!({"op": "batch", "events": [{"type": "AllBlocksCleared"}], "dp_rank": 0}));
    }
    wait_until("every tier cleared", Duration::from_secs(10), || {
        ingest.reader().lower_block_count() == 0 && ingest.reader().find_matches(&q).is_empty()
    });
    for (_, _, eng) in engines {
        eng.finish();
    }
    ingest.stop();
}

/// A configured engine is listed from the start and kept while its publisher is connected,
/// however long it is idle; once the publisher goes away it is removed (index and listing)
/// after the silence timeout, and listed again when it comes back.
#[test]
fn a_static_engine_that_goes_away_is_removed_after_the_silence_timeout() {
    let (p, r) = (free_port(), free_port());
    // With a replay socket, as vLLM has: what the PUB sent before our subscription reached
    // it (the slow joiner) is caught up from there rather than lost.
    let e = engine(
        "leaver",
        &format!("tcp://127.0.0.1:{p}"),
        &format!("tcp://127.0.0.1:{r}"),
    );
    let w = WorkerDp::new(e.worker_id, 0);
    let ingest = Ingest::start(IngestConfig {
        nats: None,
        zmq_engines: vec![e.clone()],
        silence_timeout: Duration::from_millis(800),
        ..IngestConfig::default()
    })
    .expect("the ingest starts without NATS");
    let listed = |ingest: &Ingest| ingest.workers().iter().any(|s| s.worker == w);
    wait_until("listed at start", Duration::from_secs(10), || {
        listed(&ingest)
    });
    let mut engine = py_engine(p, r, &[]);
    wait_until("connected", Duration::from_secs(10), || {
        ingest.stats().zmq_connects >= 1
    });
    let mut cache = Cache::new(9);
    let mut expected = Expected::new(e.worker_id);
    for _ in 0..20 {
        let events = cache.batch();
        expected.apply(&events);
        engine.send(&json!({"op": "batch", "events": events, "dp_rank": 0}));
    }
    wait_applied(&ingest, w, expected.last_id());
    assert_same(&ingest, &expected.index, &cache.queries());
    // Idle but connected, well past the timeout: kept.
    std::thread::sleep(Duration::from_millis(2_000));
    assert!(listed(&ingest), "an idle connected engine was removed");
    assert_same(&ingest, &expected.index, &cache.queries());
    // Gone: removed after the timeout, with its blocks.
    drop(engine);
    wait_until("removed once silent", Duration::from_secs(10), || {
        !listed(&ingest)
    });
    assert!(
        cache
            .queries()
            .iter()
            .all(|q| ingest.reader().find_matches(q).is_empty()),
        "the removed engine's blocks are still indexed"
    );
    // Back: listed again.
    let engine = py_engine(p, r, &[]);
    wait_until("listed again", Duration::from_secs(10), || listed(&ingest));
    engine.finish();
    ingest.stop();
}
