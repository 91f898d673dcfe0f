//! Routing-API load generator over loopback: the router serves `/v1/route` from an index
//! loaded with a replay log's events; a client thread sends the log's queries over
//! keep-alive HTTP connections and frees each request after its decision, or, with
//! `active`, keeps that many routed requests running (the oldest is freed when a route
//! would pass it), so that the slot manager holds what a busy fleet's would.
//!
//! * **open loop** at a fixed rate (`--rate`): decision latency p50/p99/p999 as the client
//!   sees it (send to full answer, loopback included);
//! * **closed loop** (`--rate 0`): the maximum sustained routes/s with `connections`
//!   connections.
//!
//! With `overlaps`, the same queries go to `/v1/overlaps` instead (read-only: nothing to
//! free; the server-side quantiles count routing decisions only, so only the client-side
//! figures apply).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};

use anyhow::Context;
use std::time::{Duration, Instant};

use kvrouter_core::index::{Index, TreeIndex};
use kvrouter_io::ingest::IngestView;
use kvrouter_io::router::{self, RouterConfig};
use serde::Serialize;

use crate::perf::{LoadedLog, PerfOp, percentile};

/// One load-generator run. Field names are the JSON keys.
#[derive(Debug, Clone, Serialize)]
pub struct RouteReport {
    /// Target rate, routes/s (0: closed loop).
    pub rate: f64,
    /// Routes answered.
    pub routes: u64,
    /// Achieved routes/s.
    pub routes_per_s: f64,
    /// Client-side decision latency, median, ns.
    pub p50_ns: u64,
    /// 99th percentile, ns.
    pub p99_ns: u64,
    /// 99.9th percentile, ns.
    pub p999_ns: u64,
    /// Server-side decision time (the handler), median, ns.
    pub server_p50_ns: u64,
    /// Server-side decision time, 99th percentile, ns.
    pub server_p99_ns: u64,
    /// Server-side decision time, 99.9th percentile, ns.
    pub server_p999_ns: u64,
    /// Cached blocks in the index.
    pub cached_blocks: u64,
}

/// One HTTP/1.1 request on a keep-alive connection; returns the response body.
pub(crate) fn request(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
    method: &str,
    path: &str,
    body: &str,
) -> std::io::Result<Vec<u8>> {
    request_with(stream, buf, method, path, "", body.as_bytes())
}

/// [`request`] with extra header lines (each ending in `\r\n`) and a byte body.
pub(crate) fn request_with(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
    method: &str,
    path: &str,
    headers: &str,
    body: &[u8],
) -> std::io::Result<Vec<u8>> {
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: bench\r\nContent-Length: {}\r\n{headers}\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body)?;
    buf.clear();
    let mut chunk = [0u8; 16 << 10];
    loop {
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Err(std::io::Error::other("connection closed"));
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = memchr::memmem::find(buf, b"\r\n\r\n") {
            let head = std::str::from_utf8(&buf[..end]).unwrap_or("");
            let len: usize = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse().unwrap_or(0))
                })
                .unwrap_or(0);
            if buf.len() >= end + 4 + len {
                return Ok(buf[end + 4..end + 4 + len].to_vec());
            }
        }
    }
}

/// The router's `/metrics` text, on a connection of its own.
pub(crate) fn metrics_text(addr: impl std::net::ToSocketAddrs) -> anyhow::Result<String> {
    let mut stream = TcpStream::connect(addr)?;
    let body = request(&mut stream, &mut Vec::new(), "GET", "/metrics", "")?;
    Ok(String::from_utf8(body)?)
}

/// Frees, on the same connection, the request a `/v1/route` answer names.
pub(crate) fn free_routed(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
    answer: &[u8],
) -> anyhow::Result<()> {
    let v: serde_json::Value = serde_json::from_slice(answer)?;
    let id = v["request_id"].as_str().unwrap_or_default();
    request(stream, buf, "POST", &format!("/v1/requests/{id}/free"), "")?;
    Ok(())
}

/// A `kvrouter serve` process of a benchmark, killed when dropped.
pub(crate) struct Served {
    pub(crate) child: Child,
    /// `host:port` from its banner.
    pub(crate) addr: String,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `kvrouter serve` (the binary at `kvrouter`) on a free loopback port with `nats`,
/// without replica sync or snapshots of its own, plus `extra` flags; returns once its
/// banner names the address.
pub(crate) fn serve(
    kvrouter: &Path,
    nats: &str,
    extra: &[&std::ffi::OsStr],
) -> anyhow::Result<Served> {
    let mut child = Command::new(kvrouter)
        .args(["serve", "--nats", nats, "--listen", "127.0.0.1:0"])
        .args(["--replica-sync", "false", "--snapshot-on-stop", "false"])
        .args(["--snapshot-interval-secs", "0"])
        .args(extra)
        .env("KVROUTER_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", kvrouter.display()))?;
    let stdout = child.stdout.take().context("stdout")?;
    // Owned from here on: an early return kills it.
    let mut served = Served {
        child,
        addr: String::new(),
    };
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line)?;
    served.addr = line
        .trim()
        .rsplit("http://")
        .next()
        .context("no address in the banner")?
        .to_owned();
    Ok(served)
}

/// Loads the log's events into an index, starts the routing API on it, and drives
/// `/v1/route` for `duration`.
pub fn run(
    log: &LoadedLog,
    rate: f64,
    duration: Duration,
    connections: usize,
    binary: bool,
    overlaps: bool,
    active: usize,
) -> anyhow::Result<RouteReport> {
    let path = if overlaps {
        "/v1/overlaps"
    } else {
        "/v1/route"
    };
    let mut index = TreeIndex::new(1);
    for op in &log.ops {
        if let PerfOp::Event(e) = op {
            let _ = index.apply(e.clone());
        }
    }
    let cached_blocks = index.block_count() as u64;
    let view = IngestView::fixed(index.reader(), index.workers());
    let cfg = RouterConfig {
        listen: "127.0.0.1:0".parse()?,
        replica_sync: false,
        block_size: log.header.block_tokens.max(1) as u32,
        spin_before_park: std::env::var("KVROUTER_SPIN_US")
            .ok()
            .and_then(|v| v.parse().ok())
            .map(Duration::from_micros),
        ..RouterConfig::default()
    };
    let api = router::start(cfg, Some(view), None, 512 << 10)?;
    let addr = api.addr();
    let bodies: Vec<Vec<u8>> = log
        .queries()
        .map(|q| {
            if binary {
                return q.iter().flat_map(|l| l.0.to_le_bytes()).collect();
            }
            let hashes: Vec<u64> = q.iter().map(|l| l.0).collect();
            format!(
                "{{\"block_hashes\":{}}}",
                serde_json::to_string(&hashes).unwrap_or_default()
            )
            .into_bytes()
        })
        .collect();
    let headers = if binary {
        format!("Content-Type: {}\r\n", kvrouter_io::router::BINARY_HASHES)
    } else {
        String::new()
    };
    let per_conn_rate = if rate > 0.0 {
        rate / connections as f64
    } else {
        0.0
    };
    let start = Instant::now();
    let threads: Vec<_> = (0..connections)
        .map(|c| {
            let bodies = bodies.clone();
            let headers = headers.clone();
            let path = path.to_owned();
            std::thread::spawn(move || -> anyhow::Result<Vec<u64>> {
                let mut stream = TcpStream::connect(addr)?;
                stream.set_nodelay(true)?;
                let mut buf = Vec::new();
                let mut lat = Vec::new();
                let t0 = Instant::now();
                let mut i = c * 7919;
                let keep = active / connections + usize::from(c < active % connections);
                let mut running = std::collections::VecDeque::with_capacity(keep + 1);
                let mut sent = 0u64;
                while t0.elapsed() < duration {
                    if per_conn_rate > 0.0 {
                        let due = Duration::from_secs_f64(sent as f64 / per_conn_rate);
                        if let Some(wait) = due.checked_sub(t0.elapsed()) {
                            std::thread::sleep(wait);
                        }
                    }
                    let body = &bodies[i % bodies.len()];
                    i += 1;
                    sent += 1;
                    let t = Instant::now();
                    let answer =
                        request_with(&mut stream, &mut buf, "POST", &path, &headers, body)?;
                    lat.push(t.elapsed().as_nanos() as u64);
                    if !overlaps {
                        running.push_back(answer);
                        while running.len() > keep {
                            if let Some(oldest) = running.pop_front() {
                                free_routed(&mut stream, &mut buf, &oldest)?;
                            }
                        }
                    }
                }
                for answer in running {
                    free_routed(&mut stream, &mut buf, &answer)?;
                }
                Ok(lat)
            })
        })
        .collect();
    let mut lat = Vec::new();
    for t in threads {
        lat.extend(
            t.join()
                .map_err(|_| anyhow::anyhow!("client thread panicked"))??,
        );
    }
    let elapsed = start.elapsed().as_secs_f64();
    // Server-side decision time (handler only, recent decisions), from /metrics.
    let metrics = metrics_text(addr)?;
    let quantile = |q: &str| -> u64 {
        metrics
            .lines()
            .find(|l| {
                l.starts_with(&format!(
                    "kvrouter_router_decision_seconds{{quantile=\"{q}\"}}"
                ))
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .map_or(0, |s| (s * 1e9) as u64)
    };
    let (server_p50_ns, server_p99_ns, server_p999_ns) =
        (quantile("0.5"), quantile("0.99"), quantile("0.999"));
    api.stop();
    lat.sort_unstable();
    Ok(RouteReport {
        rate,
        routes: lat.len() as u64,
        routes_per_s: lat.len() as f64 / elapsed,
        p50_ns: percentile(&lat, 0.5),
        p99_ns: percentile(&lat, 0.99),
        p999_ns: percentile(&lat, 0.999),
        server_p50_ns,
        server_p99_ns,
        server_p999_ns,
        cached_blocks,
    })
}
