//! Hostile-client soak: a real `kvrouter serve` process, one well-behaved client routing
//! small requests at a fixed rate, and phases in which hostile clients join it.
//!
//! Phases (each `phase` long):
//! 1. `baseline`: the small-route client alone;
//! 2. `huge`: beside it, one client routing requests of `huge_blocks` blocks (binary
//!    framing) at `huge_rate`, freeing each: how long one huge decision stalls the small
//!    ones;
//! 3. `hostile` and 4. `hostile-again`: every hostile client at once: the huge client
//!    sending back to back (the routing thread saturated with huge work), a
//!    leaker that routes huge requests and never frees them (bounded by the block budget and
//!    the active-request limits), over-limit bodies (413), malformed and smuggling-shaped
//!    requests (400/411/431/501) on fresh connections, slow clients sending a header a byte
//!    a second (closed at the header deadline), and a connection flood past the cap (503);
//! 5. `after`: the small-route client alone again.
//!
//! Reported per phase: the small routes' client-side latency (p50/p99/p999/max, loopback
//! included) and failures, and the server's RSS (from `/proc/PID/status`) at the phase's
//! start, end and peak. RSS that is the same at the end of both hostile phases is flat: what
//! hostile clients pin is bounded.

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;

use crate::perf::percentile;
use crate::route::{Served, free_routed, metrics_text, request, request_with, serve};

/// Settings of one soak.
#[derive(Debug, Clone)]
pub struct HostileConfig {
    /// Workers the router is started with (`--workers 1,2,...`).
    pub workers: u64,
    /// Small routes per second.
    pub rate: f64,
    /// Blocks of each small route.
    pub small_blocks: usize,
    /// Blocks of each huge route (at most the router's `--max-request-blocks`).
    pub huge_blocks: usize,
    /// Huge routes per second in the `huge` phase (the hostile phases send them back to
    /// back).
    pub huge_rate: f64,
    /// Length of each phase.
    pub phase: Duration,
    /// Slow clients held open at once.
    pub slow_clients: usize,
    /// Connections the flood holds open at once (more than the cap is refused).
    pub flood: usize,
    /// The router's `--max-connections`.
    pub max_connections: usize,
    /// The router's `--max-active-blocks`.
    pub max_active_blocks: u64,
    /// The router's `--header-timeout-secs`.
    pub header_timeout_secs: u64,
}

/// One phase as the small-route client and the RSS sampler saw it.
#[derive(Debug, Clone, Serialize)]
pub struct PhaseReport {
    /// Phase name.
    pub phase: &'static str,
    /// Small routes answered 200.
    pub routes: u64,
    /// Small routes that failed (anything but 200, or a connection error).
    pub failures: u64,
    /// Client-side latency of the small routes, ns.
    pub p50_ns: u64,
    /// 99th percentile, ns.
    pub p99_ns: u64,
    /// 99.9th percentile, ns.
    pub p999_ns: u64,
    /// Slowest, ns.
    pub max_ns: u64,
    /// Server RSS at the phase's start, KiB.
    pub rss_start_kib: u64,
    /// At its end, KiB.
    pub rss_end_kib: u64,
    /// Peak during it, KiB.
    pub rss_peak_kib: u64,
}

/// What the hostile clients got, over the whole soak.
#[derive(Debug, Clone, Default, Serialize)]
pub struct HostileCounts {
    /// Huge routes answered 200 (freed or pinned).
    pub huge_routed: u64,
    /// Huge routes refused with 429 (limits reached).
    pub huge_refused: u64,
    /// Over-limit bodies answered 413.
    pub too_large: u64,
    /// Malformed requests answered 4xx/5xx.
    pub malformed_rejected: u64,
    /// Malformed requests answered anything else (must be 0).
    pub malformed_accepted: u64,
    /// Slow clients closed by the server.
    pub slow_closed: u64,
    /// Flood connections refused (503).
    pub flood_refused: u64,
    /// Flood connections the server held at peak.
    pub flood_held_peak: u64,
}

/// The whole soak.
#[derive(Debug, Clone, Serialize)]
pub struct HostileReport {
    /// Per phase.
    pub phases: Vec<PhaseReport>,
    /// The hostile clients' results.
    pub hostile: HostileCounts,
    /// The router's own counters at the end (`/metrics` lines that count refusals).
    pub metrics: Vec<(String, f64)>,
}

#[derive(Default)]
struct Shared {
    huge_routed: AtomicU64,
    huge_refused: AtomicU64,
    too_large: AtomicU64,
    malformed_rejected: AtomicU64,
    malformed_accepted: AtomicU64,
    slow_closed: AtomicU64,
    flood_refused: AtomicU64,
    flood_held: AtomicU64,
    flood_held_peak: AtomicU64,
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// The status code of an HTTP response head in `buf` (0: none).
fn status_of(buf: &[u8]) -> u16 {
    std::str::from_utf8(buf.get(9..12).unwrap_or_default())
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// One request on a fresh connection; the status of its answer (0: none).
fn one_shot(addr: SocketAddr, bytes: &[u8]) -> u16 {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return 0;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    if s.write_all(bytes).is_err() {
        return 0;
    }
    let mut buf = [0u8; 512];
    let mut n = 0;
    while n < 12 {
        match s.read(&mut buf[n..]) {
            Ok(0) | Err(_) => break,
            Ok(k) => n += k,
        }
    }
    status_of(&buf[..n])
}

/// Routes one request with the binary framing (`body`: little-endian hashes); the status
/// and the answer's body.
fn route_binary(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
    body: &[u8],
    id: &str,
) -> std::io::Result<(u16, Vec<u8>)> {
    let headers = format!(
        "Content-Type: {}\r\nX-Request-Id: {id}\r\n",
        kvrouter_io::router::BINARY_HASHES
    );
    let answer = request_with(stream, buf, "POST", "/v1/route", &headers, body)?;
    Ok((status_of(buf), answer))
}

/// A split-mix generator, so that every client's hashes are distinct and repeatable.
fn mix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Routes small requests at `rate` on `stream` (connected before any hostile client
/// starts, as a client already in the fleet is), freeing each.
fn small_client(
    addr: SocketAddr,
    mut stream: TcpStream,
    rate: f64,
    blocks: usize,
    run: Duration,
) -> anyhow::Result<(Vec<u64>, u64)> {
    stream.set_nodelay(true)?;
    let mut buf = Vec::new();
    let mut lat = Vec::new();
    let mut failures = 0;
    let mut seed = 1u64;
    let t0 = Instant::now();
    let mut sent = 0u64;
    while t0.elapsed() < run {
        let due = Duration::from_secs_f64(sent as f64 / rate);
        if let Some(wait) = due.checked_sub(t0.elapsed()) {
            std::thread::sleep(wait);
        }
        sent += 1;
        let hashes: Vec<u64> = (0..blocks).map(|_| mix(&mut seed)).collect();
        let body = format!(
            "{{\"block_hashes\":{}}}",
            serde_json::to_string(&hashes).unwrap_or_default()
        );
        let t = Instant::now();
        let answer = match request(&mut stream, &mut buf, "POST", "/v1/route", &body) {
            Ok(a) => a,
            Err(_) => {
                failures += 1;
                stream = TcpStream::connect(addr)?;
                stream.set_nodelay(true)?;
                continue;
            }
        };
        let took = t.elapsed().as_nanos() as u64;
        if status_of(&buf) != 200 {
            failures += 1;
            continue;
        }
        lat.push(took);
        free_routed(&mut stream, &mut buf, &answer)?;
    }
    Ok((lat, failures))
}

/// Huge routes, one every `pace` or back to back; `free` says whether each is freed after
/// its decision.
fn huge_client(
    addr: SocketAddr,
    blocks: usize,
    free: bool,
    pace: Option<Duration>,
    stop: &AtomicBool,
    s: &Shared,
) {
    let Ok(mut stream) = TcpStream::connect(addr) else {
        return;
    };
    let _ = stream.set_nodelay(true);
    let mut buf = Vec::new();
    let mut seed = if free { 1 << 60 } else { 2 << 60 };
    // One body, its first hash changed per request: every request is then a chain of its
    // own (a sequence hash names the whole prefix), at no cost to the client's core.
    let mut body: Vec<u8> = (0..blocks)
        .flat_map(|_| mix(&mut seed).to_le_bytes())
        .collect();
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        if let Some(p) = pace {
            std::thread::sleep(p);
        }
        n += 1;
        body[..8].copy_from_slice(&mix(&mut seed).to_le_bytes());
        let id = format!("huge-{free}-{n}");
        let Ok((status, _)) = route_binary(&mut stream, &mut buf, &body, &id) else {
            break;
        };
        match status {
            200 => {
                s.huge_routed.fetch_add(1, Ordering::Relaxed);
                if free {
                    let _ = request(
                        &mut stream,
                        &mut buf,
                        "POST",
                        &format!("/v1/requests/{id}/free"),
                        "",
                    );
                }
            }
            429 => {
                s.huge_refused.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(50));
            }
            _ => {}
        }
    }
}

/// Bodies past the block limit, and malformed or smuggling-shaped requests, each on a
/// fresh connection, every 10 ms.
fn malformed_client(addr: SocketAddr, huge_blocks: usize, stop: &AtomicBool, s: &Shared) {
    let big = vec![0u8; (huge_blocks + 1024) * 8];
    let mut too_large = format!(
        "POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Type: {}\r\nContent-Length: {}\r\n\r\n",
        kvrouter_io::router::BINARY_HASHES,
        big.len()
    )
    .into_bytes();
    too_large.extend_from_slice(&big);
    let long_header = format!(
        "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: {}\r\n\r\n",
        "a".repeat(70_000)
    );
    let bad: Vec<Vec<u8>> = vec![
        b"POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\n{\"block_h".to_vec(),
        b"POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 40\r\n\r\n{}".to_vec(),
        b"POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Length: +2\r\n\r\n{}".to_vec(),
        b"POST /v1/route HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n".to_vec(),
        b"POST /v1/route HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n{}".to_vec(),
        b"GET /healthz HTTP/1.1\r\n\r\n".to_vec(),
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n".to_vec(),
        long_header.into_bytes(),
    ];
    let mut i = 0usize;
    while !stop.load(Ordering::Relaxed) {
        if i.is_multiple_of(bad.len() + 1) {
            if one_shot(addr, &too_large) == 413 {
                s.too_large.fetch_add(1, Ordering::Relaxed);
            }
        } else {
            let status = one_shot(addr, &bad[i % (bad.len() + 1) - 1]);
            if status >= 400 {
                s.malformed_rejected.fetch_add(1, Ordering::Relaxed);
            } else if status != 0 {
                s.malformed_accepted.fetch_add(1, Ordering::Relaxed);
            }
        }
        i += 1;
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `n` connections, each sending a request head one byte a second; a closed one is
/// counted and replaced.
fn slow_clients(addr: SocketAddr, n: usize, stop: &AtomicBool, s: &Shared) {
    let head = b"GET /v1/workers HTTP/1.1\r\nHost: slow\r\nX-Slow: ";
    let mut conns: Vec<(TcpStream, usize)> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        while conns.len() < n {
            match TcpStream::connect(addr) {
                Ok(c) => conns.push((c, 0)),
                Err(_) => break,
            }
        }
        conns.retain_mut(|(c, sent)| {
            let byte = head.get(*sent).copied().unwrap_or(b'a');
            *sent += 1;
            if c.write_all(&[byte]).is_err() {
                s.slow_closed.fetch_add(1, Ordering::Relaxed);
                return false;
            }
            true
        });
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// Bursts of `n` idle connections: opened at once, held for a second (those refused are
/// not replaced), dropped, a second's pause
/// (in which the other clients get their connections); one answered 503 is a refusal.
fn flood(addr: SocketAddr, n: usize, stop: &AtomicBool, s: &Shared) {
    let mut conns: Vec<TcpStream> = Vec::new();
    let mut burst = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        if burst.elapsed() > Duration::from_secs(1) {
            conns.clear();
            s.flood_held.store(0, Ordering::Relaxed);
            std::thread::sleep(Duration::from_secs(1));
            burst = Instant::now();
        }
        if conns.is_empty() {
            for _ in 0..n {
                let Ok(c) = TcpStream::connect(addr) else {
                    break;
                };
                let _ = c.set_nonblocking(true);
                conns.push(c);
            }
        }
        conns.retain_mut(|c| {
            let mut b = [0u8; 64];
            match c.read(&mut b) {
                Ok(0) => false,
                Ok(k) => {
                    if status_of(&b[..k]) == 503 {
                        s.flood_refused.fetch_add(1, Ordering::Relaxed);
                    }
                    false
                }
                Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
            }
        });
        let held = conns.len() as u64;
        s.flood_held.store(held, Ordering::Relaxed);
        s.flood_held_peak.fetch_max(held, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn start_server(kvrouter: &Path, nats: &str, cfg: &HostileConfig) -> anyhow::Result<Served> {
    let workers: Vec<String> = (1..=cfg.workers).map(|w| w.to_string()).collect();
    let flags = [
        ("--workers", workers.join(",")),
        ("--max-connections", cfg.max_connections.to_string()),
        ("--max-active-blocks", cfg.max_active_blocks.to_string()),
        ("--max-request-blocks", cfg.huge_blocks.to_string()),
        ("--header-timeout-secs", cfg.header_timeout_secs.to_string()),
    ];
    let extra: Vec<&OsStr> = flags
        .iter()
        .flat_map(|(k, v)| [OsStr::new(k), OsStr::new(v)])
        .collect();
    serve(kvrouter, nats, &extra)
}

/// Runs the soak against a fresh `kvrouter serve` (the binary at `kvrouter`, its NATS at
/// `nats`).
pub fn run(kvrouter: &Path, nats: &str, cfg: &HostileConfig) -> anyhow::Result<HostileReport> {
    let server = start_server(kvrouter, nats, cfg)?;
    let addr: SocketAddr = server.addr.parse().context("the server's address")?;
    let pid = server.child.id();
    let shared = Arc::new(Shared::default());
    let mut phases = Vec::new();
    type Hostile = fn(SocketAddr, &HostileConfig, &AtomicBool, &Shared);
    let paced: Hostile = |a, c, stop, s| {
        let pace = Duration::from_secs_f64(1.0 / c.huge_rate);
        huge_client(a, c.huge_blocks, true, Some(pace), stop, s)
    };
    let huge: Hostile = |a, c, stop, s| huge_client(a, c.huge_blocks, true, None, stop, s);
    let leak: Hostile = |a, c, stop, s| huge_client(a, c.huge_blocks, false, None, stop, s);
    let bad: Hostile = |a, c, stop, s| malformed_client(a, c.huge_blocks, stop, s);
    let slow: Hostile = |a, c, stop, s| slow_clients(a, c.slow_clients, stop, s);
    let many: Hostile = |a, c, stop, s| flood(a, c.flood, stop, s);
    let plan: [(&'static str, Vec<Hostile>); 5] = [
        ("baseline", vec![]),
        ("huge", vec![paced]),
        ("hostile", vec![huge, leak, bad, slow, many]),
        ("hostile-again", vec![huge, leak, bad, slow, many]),
        ("after", vec![]),
    ];
    for (name, clients) in plan {
        let stop = Arc::new(AtomicBool::new(false));
        let stream = TcpStream::connect(addr)?;
        let threads: Vec<_> = clients
            .into_iter()
            .map(|f| {
                let (stop, s, c) = (stop.clone(), shared.clone(), cfg.clone());
                std::thread::spawn(move || f(addr, &c, &stop, &s))
            })
            .collect();
        let rss_start_kib = rss_kib(pid);
        let (rate, blocks, phase) = (cfg.rate, cfg.small_blocks, cfg.phase);
        let small = std::thread::spawn(move || small_client(addr, stream, rate, blocks, phase));
        let mut rss_peak_kib = rss_start_kib;
        while !small.is_finished() {
            rss_peak_kib = rss_peak_kib.max(rss_kib(pid));
            std::thread::sleep(Duration::from_millis(50));
        }
        let (mut lat, failures) = small
            .join()
            .map_err(|_| anyhow::anyhow!("small-route client panicked"))??;
        let rss_end_kib = rss_kib(pid);
        stop.store(true, Ordering::Relaxed);
        for t in threads {
            let _ = t.join();
        }
        lat.sort_unstable();
        let p = PhaseReport {
            phase: name,
            routes: lat.len() as u64,
            failures,
            p50_ns: percentile(&lat, 0.5),
            p99_ns: percentile(&lat, 0.99),
            p999_ns: percentile(&lat, 0.999),
            max_ns: lat.last().copied().unwrap_or(0),
            rss_start_kib,
            rss_end_kib,
            rss_peak_kib: rss_peak_kib.max(rss_end_kib),
        };
        eprintln!("{}", serde_json::to_string(&p)?);
        phases.push(p);
    }
    let metrics = {
        let text = metrics_text(addr)?;
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .filter(|l| {
                [
                    "kvrouter_router_too_large_total",
                    "kvrouter_router_overloaded_total",
                    "kvrouter_router_bad_request_ids_total",
                    "kvrouter_http_",
                    "kvrouter_slots_",
                ]
                .iter()
                .any(|p| l.starts_with(p))
            })
            .filter_map(|l| {
                let (k, v) = l.rsplit_once(' ')?;
                Some((k.to_owned(), v.parse().ok()?))
            })
            .collect()
    };
    let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let s = &shared;
    let hostile = HostileCounts {
        huge_routed: l(&s.huge_routed),
        huge_refused: l(&s.huge_refused),
        too_large: l(&s.too_large),
        malformed_rejected: l(&s.malformed_rejected),
        malformed_accepted: l(&s.malformed_accepted),
        slow_closed: l(&s.slow_closed),
        flood_refused: l(&s.flood_refused),
        flood_held_peak: l(&s.flood_held_peak),
    };
    drop(server);
    Ok(HostileReport {
        phases,
        hostile,
        metrics,
    })
}
