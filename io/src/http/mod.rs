//! A small HTTP/1.1 server on glommio's io_uring sockets, for the routing API: keep-alive,
//! pipelining, `Content-Length` bodies up to a configurable limit, requests parsed with
//! `httparse` and framed strictly ([`parse`](self::parse)). Handlers are synchronous
//! functions of the request (routing decisions never wait), so a connection task reads,
//! answers and reads again without locks.
//!
//! Every client is bounded in what it can hold: a connection cap per listener (past it, a
//! new connection is answered 503 and closed), a deadline for the whole header block and
//! another for the body, counted from their first byte (a client that trickles one byte a
//! second does not keep its connection for ever), an idle limit between requests, and a
//! deadline for each write (a client that stops reading its answers is dropped). Bad input
//! gets a 4xx/5xx with a clear message and closes only its own connection. [`HttpStats`]
//! counts all of it.
//!
//! Handlers run on one thread, so a request whose handling takes milliseconds (a 65,536-
//! block route) delays every request behind it. Requests with a body of
//! [`HttpConfig::bulk_body_bytes`] or more pass a *bulk gate* shared by the listener's
//! connections: one runs at a time, and after it the gate stays shut for as long as it
//! ran, so bulk work takes at most half the thread and a small request waits behind at
//! most one bulk request, however many clients send them back to back. Work a handler
//! leaves until its answer is written (`answered`, the decision's settle) runs after the
//! write, or earlier in the next handler on any connection (the state settles before it
//! reads); after a bulk request, the gate stays shut for however long that first handler
//! or hook ran, whichever connection it served.

use std::cell::Cell;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use futures_lite::future;
use futures_lite::io::{AsyncReadExt, AsyncWriteExt};
use glommio::net::{TcpListener, TcpStream};

pub mod chunked;
mod parse;

pub use parse::{Parsed, parse};

/// Limits of the server.
#[derive(Debug, Clone)]
pub struct HttpConfig {
    /// Largest accepted body, bytes (4 MiB by default).
    pub max_body_bytes: usize,
    /// Largest accepted header block, bytes (64 KiB).
    pub max_header_bytes: usize,
    /// Longest accepted request target (path and query), bytes (8 KiB).
    pub max_target_bytes: usize,
    /// Close a keep-alive connection idle this long between requests (60 s).
    pub idle_timeout: Duration,
    /// The whole header block must arrive within this of its first byte (10 s).
    pub header_timeout: Duration,
    /// The whole body must arrive within this of the end of the headers (30 s).
    pub body_timeout: Duration,
    /// Each response must be written within this (30 s).
    pub write_timeout: Duration,
    /// Open connections per listener; past it, new ones are refused with 503 (8,192).
    pub max_connections: usize,
    /// Requests with a body this large or larger pass the bulk gate (64 KiB: 8,192 hashes
    /// in the binary framing, about 3,000 in JSON); see the [module docs](self).
    pub bulk_body_bytes: usize,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: 4 << 20,
            max_header_bytes: 64 << 10,
            max_target_bytes: 8 << 10,
            idle_timeout: Duration::from_secs(60),
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(30),
            max_connections: 8192,
            bulk_body_bytes: 64 << 10,
        }
    }
}

/// Counters of one listener (single executor: plain cells).
#[derive(Debug, Default)]
pub struct HttpStats {
    /// Connections accepted (refused ones included).
    pub accepted: Cell<u64>,
    /// Connections open now.
    pub open: Cell<u64>,
    /// Connections refused at the connection cap.
    pub refused: Cell<u64>,
    /// Requests refused for their framing or size (400, 411, 413, 414, 431, 501).
    pub rejected: Cell<u64>,
    /// Connections closed because a header block or body missed its deadline (408).
    pub read_timeouts: Cell<u64>,
    /// Connections dropped because a response could not be written in time.
    pub write_timeouts: Cell<u64>,
    /// Bulk requests that waited at the bulk gate.
    pub bulk_waits: Cell<u64>,
}

/// The listener's bulk gate (see the [module docs](self)): shut until `open_at`.
#[derive(Debug)]
struct BulkGate {
    open_at: Cell<Instant>,
    /// A bulk request was answered and what its handler left for later (the decision's
    /// settle, `answered`) may not have run yet: whichever handler or hook runs next on
    /// this server does it, and its time is the gate's.
    deferred: Cell<bool>,
}

impl BulkGate {
    /// Waits until the gate is open (counting a wait), runs `f`, then shuts the gate for
    /// as long as `f` took. Handlers are synchronous, so nothing else runs between the
    /// last check and `f`: one bulk request at a time.
    async fn pass<T>(&self, stats: &HttpStats, f: impl FnOnce() -> T) -> T {
        let mut waited = false;
        loop {
            let now = Instant::now();
            let open_at = self.open_at.get();
            if now >= open_at {
                break;
            }
            waited = true;
            glommio::timer::sleep(open_at - now).await;
        }
        if waited {
            bump(&stats.bulk_waits);
        }
        let started = Instant::now();
        let out = f();
        let ran = started.elapsed();
        self.open_at.set(Instant::now() + ran);
        out
    }

    /// Keeps the gate shut `ran` longer: bulk work done after its handler.
    fn extend(&self, ran: Duration) {
        let from = self.open_at.get().max(Instant::now());
        self.open_at.set(from + ran);
    }

    /// Runs `f` (a non-bulk handler, or the hook after a write); when a bulk request's
    /// deferred work may be pending, `f` does it first, so its time counts in the gate.
    fn after_bulk<T>(&self, f: impl FnOnce() -> T) -> T {
        if !self.deferred.replace(false) {
            return f();
        }
        let started = Instant::now();
        let out = f();
        self.extend(started.elapsed());
        out
    }
}

fn bump(c: &Cell<u64>) {
    c.set(c.get() + 1);
}

/// A parsed request.
#[derive(Debug, Clone, Default)]
pub struct Request {
    /// `GET`, `POST`, ...
    pub method: String,
    /// The path as sent (still percent-encoded), without the query string.
    pub path: String,
    /// The query string, without its `?`.
    pub query: Option<String>,
    /// Headers, names lower-cased.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Vec<u8>,
}

impl Request {
    /// A header's value (name lower-case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// One path segment, percent-decoded (RFC 3986 §2.1); `None` when the escapes are
/// malformed or the result is not UTF-8.
pub fn decode_segment(segment: &str) -> Option<String> {
    let b = segment.as_bytes();
    if b.contains(&b'%') {
        let ok = b
            .iter()
            .enumerate()
            .filter(|(_, c)| **c == b'%')
            .all(|(i, _)| {
                b.get(i + 1..i + 3)
                    .is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit))
            });
        if !ok {
            return None;
        }
    }
    percent_encoding::percent_decode_str(segment)
        .decode_utf8()
        .ok()
        .map(|c| c.into_owned())
}

/// A response.
#[derive(Debug, Clone)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// `Content-Type`.
    pub content_type: &'static str,
    /// Body.
    pub body: Vec<u8>,
    /// A `Retry-After` (seconds), for 429 and 503.
    pub retry_after: Option<u32>,
}

impl Response {
    /// A JSON response.
    pub fn json(status: u16, body: Vec<u8>) -> Self {
        Self {
            status,
            content_type: "application/json",
            body,
            retry_after: None,
        }
    }

    /// A JSON error `{"error": message}`.
    pub fn error(status: u16, message: impl AsRef<str>) -> Self {
        let body = serde_json::to_vec(&serde_json::json!({ "error": message.as_ref() }))
            .unwrap_or_default();
        Self::json(status, body)
    }

    /// A plain-text response.
    pub fn text(status: u16, body: impl Into<Vec<u8>>) -> Self {
        Self {
            status,
            content_type: "text/plain; version=0.0.4",
            body: body.into(),
            retry_after: None,
        }
    }

    /// The same response with a `Retry-After`.
    pub fn with_retry_after(mut self, secs: u32) -> Self {
        self.retry_after = Some(secs);
        self
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        411 => "Length Required",
        413 => "Content Too Large",
        414 => "URI Too Long",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        503 => "Service Unavailable",
        _ => "",
    }
}

/// Appends `r` as an HTTP/1.1 answer to `out`.
pub fn write_response(out: &mut Vec<u8>, r: &Response, keep_alive: bool) {
    use std::io::Write;
    let _ = write!(
        out,
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: {}\r\n",
        r.status,
        reason(r.status),
        r.content_type,
        r.body.len(),
        if keep_alive { "keep-alive" } else { "close" }
    );
    if let Some(s) = r.retry_after {
        let _ = write!(out, "Retry-After: {s}\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(&r.body);
}

/// Counts an open connection while it lives.
struct OpenGuard(Rc<HttpStats>);

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.open.set(self.0.open.get() - 1);
    }
}

/// Serves connections from `listener` forever, answering each request with `handler`, and
/// calling `answered` each time a connection's answers have been written (work a handler
/// deferred until its answer was out runs there; after a bulk request the bulk gate counts
/// it, module docs).
pub async fn serve(
    listener: TcpListener,
    cfg: HttpConfig,
    stats: Rc<HttpStats>,
    handler: Rc<dyn Fn(Request) -> Response>,
    answered: Rc<dyn Fn()>,
) {
    let warn = crate::throttle::Throttle::new(Duration::from_secs(10));
    let refusing = Rc::new(Cell::new(0usize));
    let gate = Rc::new(BulkGate {
        open_at: Cell::new(Instant::now()),
        deferred: Cell::new(false),
    });
    loop {
        match listener.accept().await {
            Ok(stream) => {
                bump(&stats.accepted);
                if stats.open.get() as usize >= cfg.max_connections {
                    bump(&stats.refused);
                    if let Some(suppressed) = warn.allow() {
                        tracing::warn!(
                            max = cfg.max_connections,
                            suppressed,
                            "http: connection cap reached, refusing new connections"
                        );
                    }
                    // A few refusals at a time are answered; past them, a flood is
                    // dropped at once.
                    if refusing.get() < MAX_REFUSING {
                        refusing.set(refusing.get() + 1);
                        let refusing = Rc::clone(&refusing);
                        glommio::spawn_local(async move {
                            refuse(stream).await;
                            refusing.set(refusing.get() - 1);
                        })
                        .detach();
                    }
                    continue;
                }
                stats.open.set(stats.open.get() + 1);
                let guard = OpenGuard(Rc::clone(&stats));
                let (cfg, handler, gate) = (cfg.clone(), Rc::clone(&handler), Rc::clone(&gate));
                let answered = Rc::clone(&answered);
                glommio::spawn_local(async move {
                    connection(stream, &cfg, &guard.0, &gate, handler, answered).await;
                    drop(guard);
                })
                .detach();
            }
            Err(e) => {
                // Out of descriptors, mostly: wait a little rather than spin.
                if let Some(suppressed) = warn.allow() {
                    tracing::warn!(error = %e, suppressed, "http: accept failed");
                }
                glommio::timer::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

/// Refusals answered at once; more connections past the cap are closed unanswered.
const MAX_REFUSING: usize = 64;

/// Answers a connection past the cap with 503 and closes it gently: its request is read
/// (briefly) before the close, so that the client sees the answer, not a reset.
async fn refuse(stream: TcpStream) {
    let mut out = Vec::new();
    let busy = Response::error(503, "too many connections").with_retry_after(1);
    write_response(&mut out, &busy, false);
    close_gently(stream, &out).await;
}

/// Writes a last answer and closes: the write side first, then what the client still
/// sends is read and dropped for a moment, so that the close does not reset the
/// connection (and lose the answer) while the client's bytes are unread.
async fn close_gently(mut stream: TcpStream, out: &[u8]) {
    let linger = async {
        if stream.write_all(out).await.is_err() {
            return;
        }
        let _ = stream.shutdown(std::net::Shutdown::Write).await;
        let mut sink = [0u8; 4096];
        while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
    };
    let _ = with_deadline(Duration::from_millis(200), linger).await;
}

/// `fut`'s output, or `None` past `limit`.
async fn with_deadline<T>(limit: Duration, fut: impl Future<Output = T>) -> Option<T> {
    let expired = async {
        glommio::timer::sleep(limit).await;
        None
    };
    future::or(async { Some(fut.await) }, expired).await
}

/// Where a connection is between its reads, for the deadline of the next one.
#[derive(Debug, Clone, Copy)]
enum Phase {
    /// Between requests, since this instant.
    Idle(Instant),
    /// In a header block that began then.
    Head(Instant),
    /// In a body whose headers ended then.
    Body(Instant),
}

impl Phase {
    fn deadline(self, cfg: &HttpConfig) -> Instant {
        match self {
            Phase::Idle(t) => t + cfg.idle_timeout,
            Phase::Head(t) => t + cfg.header_timeout,
            Phase::Body(t) => t + cfg.body_timeout,
        }
    }
}

async fn connection(
    mut stream: TcpStream,
    cfg: &HttpConfig,
    stats: &HttpStats,
    gate: &BulkGate,
    handler: Rc<dyn Fn(Request) -> Response>,
    answered: Rc<dyn Fn()>,
) {
    let _ = stream.set_nodelay(true);
    let mut buf: Vec<u8> = Vec::with_capacity(16 << 10);
    let mut chunk = vec![0u8; 64 << 10];
    let mut out = Vec::with_capacity(16 << 10);
    let mut phase = Phase::Idle(Instant::now());
    loop {
        // Answer every complete request already buffered (pipelining), then read more.
        let mut close = false;
        loop {
            match parse(&buf, cfg) {
                Parsed::Need { head_done } => {
                    let now = Instant::now();
                    phase = match (phase, head_done, buf.is_empty()) {
                        (_, _, true) => Phase::Idle(match phase {
                            Phase::Idle(t) => t,
                            _ => now,
                        }),
                        (Phase::Body(t), true, _) => Phase::Body(t),
                        (_, true, _) => Phase::Body(now),
                        (Phase::Head(t), false, _) => Phase::Head(t),
                        (_, false, _) => Phase::Head(now),
                    };
                    break;
                }
                Parsed::Request(req, used, keep_alive) => {
                    buf.drain(..used);
                    let resp = if req.body.len() >= cfg.bulk_body_bytes {
                        // The gate counts this handler's whole time, a deferred settle
                        // it ran included; what it defers itself is flagged after it.
                        let resp = gate.pass(stats, || handler(req)).await;
                        gate.deferred.set(true);
                        resp
                    } else {
                        gate.after_bulk(|| handler(req))
                    };
                    write_response(&mut out, &resp, keep_alive);
                    // The next request (pipelined or not) starts its own clock.
                    phase = Phase::Idle(Instant::now());
                    if !keep_alive {
                        close = true;
                        break;
                    }
                }
                Parsed::Reject(resp) => {
                    bump(&stats.rejected);
                    write_response(&mut out, &resp, false);
                    close_gently(stream, &out).await;
                    // Answers of this batch went out with the rejection.
                    answered();
                    return;
                }
            }
        }
        if !out.is_empty() {
            let write = async { stream.write_all(&out).await.is_ok() };
            let written = with_deadline(cfg.write_timeout, write).await;
            // A bulk request's deferred work counts in the gate's share, here or in the
            // handler that runs first on another connection while this write waits.
            gate.after_bulk(|| answered());
            match written {
                Some(true) => out.clear(),
                Some(false) => return,
                None => {
                    bump(&stats.write_timeouts);
                    return;
                }
            }
        }
        if close {
            return;
        }
        let left = phase
            .deadline(cfg)
            .saturating_duration_since(Instant::now());
        let read = async { stream.read(&mut chunk).await.ok() };
        match with_deadline(left, read).await {
            Some(Some(0) | None) => return,
            Some(Some(n)) => buf.extend_from_slice(&chunk[..n]),
            None => {
                if let Phase::Idle(_) = phase {
                    return;
                }
                bump(&stats.read_timeouts);
                let what = if let Phase::Head(_) = phase {
                    "the request headers did not arrive in time"
                } else {
                    "the request body did not arrive in time"
                };
                write_response(&mut out, &Response::error(408, what), false);
                close_gently(stream, &out).await;
                return;
            }
        }
    }
}

/// Binds a listener on `addr`.
pub fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).map_err(|e| std::io::Error::other(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bulk_requests_deferred_work_shuts_the_gate_wherever_it_runs() {
        let gate = BulkGate {
            open_at: Cell::new(Instant::now()),
            deferred: Cell::new(false),
        };
        let work = Duration::from_millis(20);
        // Nothing deferred: a handler's time is its own.
        gate.after_bulk(|| std::thread::sleep(work));
        assert!(gate.open_at.get() <= Instant::now());
        // After a bulk answer, the first handler (or hook) to run does the deferred work:
        // its time keeps the gate shut; the next one's does not.
        gate.deferred.set(true);
        let before = Instant::now();
        gate.after_bulk(|| std::thread::sleep(work));
        // Shut from when it ended for at least as long as it ran.
        let shut = gate.open_at.get();
        assert!(shut >= before + 2 * work, "the gate was not extended");
        gate.after_bulk(|| std::thread::sleep(work));
        assert_eq!(gate.open_at.get(), shut);
    }

    #[test]
    fn segments_decode_or_refuse() {
        assert_eq!(
            decode_segment("a%20b%3F%2F%C3%A9").as_deref(),
            Some("a b?/é")
        );
        assert_eq!(decode_segment("plain").as_deref(), Some("plain"));
        assert_eq!(decode_segment("bad%2"), None);
        assert_eq!(decode_segment("bad%zz"), None);
        assert_eq!(decode_segment("%ff"), None);
    }

    #[test]
    fn responses_carry_retry_after() {
        let mut out = Vec::new();
        write_response(
            &mut out,
            &Response::error(429, "busy").with_retry_after(1),
            true,
        );
        let text = String::from_utf8(out).unwrap();
        assert!(text.starts_with("HTTP/1.1 429 Too Many Requests\r\n"));
        assert!(text.contains("\r\nRetry-After: 1\r\n"));
    }
}
