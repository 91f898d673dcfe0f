//! End-to-end ingest of the vLLM-native ZMQ wire: real libzmq publishers (pyzmq,
//! `bench/py/zmq_bench.py`) play the replay log's workers, one PUB each, one `EventBatch`
//! per event; the router's ingest subscribes to them. Reported next to a raw pyzmq SUB loop
//! receiving the same messages from the same publishers.
//!
//! The log names blocks by local hash, the wire by tokens: each block's tokens are made up
//! from its local hash (the same hash, the same tokens), so the tree the ingest builds has
//! the log's shape, and the ingest pays for hashing every block's tokens as it would for a
//! real engine. The shared logs have 128-token blocks; vLLM's default is 16: the tokens, most
//! of the bytes, can be set per block (`--block-tokens`).
//!
//! * **ingest**: block events/s from the first send until every block is applied, and the
//!   latency from a message's arrival at the router to its events being visible to
//!   `find_matches` (p50/p99);
//! * **raw**: seconds from the first send until a plain pyzmq SUB has every message.
//!
//! Per core: everything shares the machine's cores with the publishers, so the rate is
//! bounded by what they push. Each side's CPU time over the run (the ingest's source and
//! shard threads from `/proc/self/task/*/schedstat`, the raw SUB process's
//! `time.process_time()`) gives block events per CPU-second: what one core would sustain.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvrouter_core::codec::vllm::{WireBatch, WireEvent};
use kvrouter_core::event::KvEventData;
use kvrouter_core::worker::WorkerId;
use kvrouter_io::ingest::{Ingest, IngestConfig, ZmqEngine};
use kvrouter_io::zmq::Endpoint;
use serde::Serialize;

use crate::child::Reaped;
use crate::perf::{LoadedLog, percentile};

/// One run. Field names are the JSON keys.
#[derive(Debug, Clone, Serialize)]
pub struct ZmqIngestReport {
    /// Shard cores.
    pub shards: usize,
    /// Tokens per block on the wire.
    pub block_tokens: usize,
    /// Target sending rate, block events/s (`None`: as fast as the publishers go).
    pub rate: Option<f64>,
    /// Messages (batches) sent.
    pub messages: u64,
    /// Block events (stored + removed blocks).
    pub block_events: u64,
    /// Ingest: seconds from the first send to the last block applied.
    pub ingest_s: f64,
    /// Ingest: block events per second.
    pub ingest_block_events_per_s: f64,
    /// Arrival-to-visible latency, median, ns.
    pub visible_p50_ns: u64,
    /// Arrival-to-visible latency, 99th percentile, ns.
    pub visible_p99_ns: u64,
    /// Raw pyzmq SUB: seconds from the first send to the last message.
    pub raw_s: f64,
    /// Raw pyzmq SUB: block events per second.
    pub raw_block_events_per_s: f64,
    /// CPU seconds of the ingest's source thread (ZMQ sockets, ZMTP, decoding, hashing).
    pub source_cpu_s: f64,
    /// CPU seconds of the busiest shard thread (applying to the tree).
    pub shard_cpu_s: f64,
    /// Block events per CPU-second of the busiest ingest thread.
    pub ingest_block_events_per_core_s: f64,
    /// CPU seconds of the raw SUB process (libzmq's I/O thread and the receive loop).
    pub raw_cpu_s: f64,
    /// Block events per CPU-second of the raw SUB process.
    pub raw_block_events_per_cpu_s: f64,
}

/// CPU nanoseconds so far of each of this process's threads whose name starts with
/// `prefix` (`/proc/self/task/*/comm`, names cut at 15 bytes), by thread id.
fn thread_cpu_ns(prefix: &str) -> HashMap<u64, u64> {
    let mut out = HashMap::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for t in tasks.flatten() {
        let dir = t.path();
        let named = std::fs::read_to_string(dir.join("comm"))
            .is_ok_and(|c| c.trim_end().starts_with(prefix));
        let tid = t.file_name().to_string_lossy().parse::<u64>();
        let ns = std::fs::read_to_string(dir.join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok());
        if let (true, Ok(tid), Some(ns)) = (named, tid, ns) {
            out.insert(tid, ns);
        }
    }
    out
}

/// The most CPU seconds any thread spent between two [`thread_cpu_ns`] readings.
fn busiest_s(before: &HashMap<u64, u64>, after: &HashMap<u64, u64>) -> f64 {
    after
        .iter()
        .map(|(tid, &ns)| ns.saturating_sub(before.get(tid).copied().unwrap_or(0)))
        .max()
        .unwrap_or(0) as f64
        / 1e9
}

/// Made-up tokens of a block: `n` tokens from its local hash.
fn tokens_of(local: u64, n: usize, out: &mut Vec<u32>) {
    let mut x = local;
    for _ in 0..n {
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        out.push((z >> 40) as u32);
    }
}

/// One wire message: `(publisher index, block events, payload)`.
pub type WireMessage = (u32, u32, Vec<u8>);

/// The log's events as wire messages, and the workers in publisher order.
pub fn encode(
    log: &LoadedLog,
    block_tokens: usize,
) -> anyhow::Result<(Vec<WireMessage>, Vec<WorkerId>)> {
    let bs = block_tokens.max(1);
    let mut index: HashMap<WorkerId, u32> = HashMap::new();
    let mut workers = Vec::new();
    let mut out = Vec::new();
    for e in log.events() {
        let next = index.len() as u32;
        let p = *index.entry(e.worker_id).or_insert_with(|| {
            workers.push(e.worker_id);
            next
        });
        let (hashes, tokens): (Vec<u64>, Vec<u32>) = match &e.event.data {
            KvEventData::Stored(s) => {
                let mut t = Vec::with_capacity(s.blocks.len() * bs);
                for b in &s.blocks {
                    tokens_of(b.tokens_hash.0, bs, &mut t);
                }
                (s.blocks.iter().map(|b| b.block_hash.0).collect(), t)
            }
            KvEventData::Removed(r) => (r.block_hashes.iter().map(|h| h.0).collect(), Vec::new()),
            KvEventData::Cleared => (Vec::new(), Vec::new()),
        };
        let event = match &e.event.data {
            KvEventData::Stored(s) => WireEvent::BlockStored {
                block_hashes: &hashes,
                parent_block_hash: s.parent_hash.map(|h| h.0),
                token_ids: &tokens,
                block_size: bs as u32,
                lora_id: None,
                medium: Some("GPU"),
                lora_name: None,
            },
            KvEventData::Removed(_) => WireEvent::BlockRemoved {
                block_hashes: &hashes,
                medium: Some("GPU"),
            },
            KvEventData::Cleared => WireEvent::AllBlocksCleared,
        };
        let payload = WireBatch {
            ts: 0.0,
            events: vec![event],
            dp_rank: Some(e.event.dp_rank),
        }
        .encode()?;
        out.push((p, e.block_count() as u32, payload));
    }
    Ok((out, workers))
}

/// The ports of a publisher's "ready P1,P2,..." line.
fn ports_of(line: &str, n: u16) -> anyhow::Result<Vec<u16>> {
    let ports = line
        .strip_prefix("ready ")
        .map(|p| {
            p.split(',')
                .map(str::parse)
                .collect::<Result<Vec<u16>, _>>()
        })
        .and_then(Result::ok)
        .filter(|p| p.len() == usize::from(n));
    ports.ok_or_else(|| anyhow::anyhow!("the publisher did not start: {line:?}"))
}

fn line_of(r: &mut impl BufRead) -> anyhow::Result<String> {
    let mut s = String::new();
    r.read_line(&mut s)?;
    Ok(s.trim().to_owned())
}

fn stamp(line: &str, word: &str) -> anyhow::Result<f64> {
    line.strip_prefix(word)
        .and_then(|t| t.trim().parse().ok())
        .ok_or_else(|| anyhow::anyhow!("expected {word:?}, got {line:?}"))
}

/// Runs the ingest and raw measurements once. `python` is an interpreter with pyzmq
/// (`scripts/pyenv.sh` makes one).
pub fn run(
    log: &LoadedLog,
    python: &Path,
    shards: usize,
    rate: Option<f64>,
    block_tokens: Option<usize>,
) -> anyhow::Result<ZmqIngestReport> {
    let bt = block_tokens
        .unwrap_or(log.header.block_tokens as usize)
        .max(1);
    let (msgs, workers) = encode(log, bt)?;
    let block_events: u64 = msgs.iter().map(|m| u64::from(m.1)).sum();
    let file = std::env::temp_dir().join(format!("kvrouter-zmq-bench-{}.bin", std::process::id()));
    {
        let mut f = std::io::BufWriter::new(std::fs::File::create(&file)?);
        for (p, b, payload) in &msgs {
            f.write_all(&p.to_le_bytes())?;
            f.write_all(&b.to_le_bytes())?;
            f.write_all(&(payload.len() as u32).to_le_bytes())?;
            f.write_all(payload)?;
        }
    }
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("py/zmq_bench.py");
    let n = workers.len() as u16;
    let bs = bt as u32;
    // Each publisher socket binds a port the system picks and says which.
    let publisher = || -> anyhow::Result<Reaped> {
        let mut cmd = Command::new(python);
        cmd.arg(&script)
            .args(["pub", &file.to_string_lossy(), &n.to_string()]);
        if let Some(r) = rate {
            cmd.args(["--rate", &r.to_string()]);
        }
        Ok(Reaped(
            cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn()?,
        ))
    };

    // Ingest.
    let mut p = publisher()?;
    let mut out = BufReader::new(p.0.stdout.take().expect("stdout"));
    let ports = ports_of(&line_of(&mut out)?, n)?;
    let engines = workers
        .iter()
        .zip(&ports)
        .enumerate()
        .map(|(k, (&w, port))| {
            let ep = Endpoint::parse(&format!("tcp://127.0.0.1:{port}"))?;
            Ok(ZmqEngine {
                worker_id: w,
                ..ZmqEngine::new(format!("w{k}"), ep, bs)
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let ingest = Ingest::start(IngestConfig {
        nats: None,
        zmq_engines: engines,
        shards,
        record_latency: true,
        silence_timeout: Duration::from_secs(600),
        ..IngestConfig::default()
    })?;
    let t = Instant::now();
    while ingest.stats().zmq_connects < u64::from(n) {
        anyhow::ensure!(
            t.elapsed() < Duration::from_secs(10),
            "the ingest did not connect"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // Past libzmq's subscription handshake.
    std::thread::sleep(Duration::from_millis(200));
    let (source0, shards0) = (
        thread_cpu_ns("kvrouter-source"),
        thread_cpu_ns("kvrouter-shard"),
    );
    let mut stdin = p.0.stdin.take().expect("stdin");
    writeln!(stdin, "go")?;
    let start = Instant::now();
    let _ = line_of(&mut out)?; // start T
    while ingest.stats().event_blocks < block_events {
        anyhow::ensure!(
            start.elapsed() < Duration::from_secs(600),
            "the ingest did not catch up: {:?}",
            ingest.stats()
        );
        std::thread::sleep(Duration::from_micros(200));
    }
    let ingest_s = start.elapsed().as_secs_f64();
    let source_cpu_s = busiest_s(&source0, &thread_cpu_ns("kvrouter-source"));
    let shard_cpu_s = busiest_s(&shards0, &thread_cpu_ns("kvrouter-shard"));
    anyhow::ensure!(
        source_cpu_s > 0.0 && shard_cpu_s > 0.0,
        "no CPU time read for the ingest's threads (/proc/self/task/*/schedstat)"
    );
    let mut lat = ingest.take_latencies();
    lat.sort_unstable();
    ingest.stop();
    let _ = writeln!(stdin, "quit");
    drop(p);

    // Raw pyzmq SUB on the same messages.
    let mut p = publisher()?;
    let mut pout = BufReader::new(p.0.stdout.take().expect("stdout"));
    let ports = ports_of(&line_of(&mut pout)?, n)?;
    let ports = ports
        .iter()
        .map(u16::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let mut s = Reaped(
        Command::new(python)
            .arg(&script)
            .args(["sub", &ports, &msgs.len().to_string()])
            .stdout(Stdio::piped())
            .spawn()?,
    );
    let mut sout = BufReader::new(s.0.stdout.take().expect("stdout"));
    anyhow::ensure!(
        line_of(&mut sout)? == "ready",
        "the subscriber did not start"
    );
    let mut pin = p.0.stdin.take().expect("stdin");
    writeln!(pin, "go")?;
    let t0 = stamp(&line_of(&mut pout)?, "start")?;
    let t1 = stamp(&line_of(&mut sout)?, "end")?;
    let raw_cpu_s = stamp(&line_of(&mut sout)?, "cpu")?.max(1e-9);
    let _ = writeln!(pin, "quit");
    drop((p, s));
    let _ = std::fs::remove_file(&file);
    let raw_s = (t1 - t0).max(1e-9);
    Ok(ZmqIngestReport {
        shards,
        block_tokens: bt,
        rate,
        messages: msgs.len() as u64,
        block_events,
        ingest_s,
        ingest_block_events_per_s: block_events as f64 / ingest_s,
        visible_p50_ns: percentile(&lat, 0.5),
        visible_p99_ns: percentile(&lat, 0.99),
        raw_s,
        raw_block_events_per_s: block_events as f64 / raw_s,
        source_cpu_s,
        shard_cpu_s,
        ingest_block_events_per_core_s: block_events as f64 / source_cpu_s.max(shard_cpu_s),
        raw_cpu_s,
        raw_block_events_per_cpu_s: block_events as f64 / raw_cpu_s,
    })
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::ports_of;

    #[test]
    fn a_publishers_ready_line_gives_one_port_per_socket() {
        assert_eq!(
            ports_of("ready 40001,40002,9", 3).unwrap(),
            [40001, 40002, 9]
        );
        for (line, n) in [
            ("ready 40001,40002", 3),
            ("ready 40001,x,9", 3),
            ("ready 70000", 1),
            ("ready", 1),
            ("Traceback (most recent call last):", 1),
            ("", 1),
        ] {
            let e = ports_of(line, n).unwrap_err().to_string();
            assert!(e.contains("did not start"), "{line:?}: {e}");
        }
    }
}
