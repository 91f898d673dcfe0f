//! A small HTTP/1.1 server on glommio's io_uring sockets, for the routing API: keep-alive,
//! pipelining, `Content-Length` bodies up to a configurable limit, requests parsed with
//! `httparse`. Handlers are synchronous functions of the request (routing decisions never
//! wait), so a connection task reads, answers and reads again without locks.
//!
//! Bad input gets a 4xx with a clear message and closes nothing else: oversized headers or
//! bodies (413/431), malformed request lines (400), chunked bodies (411: send a
//! `Content-Length`).

use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;

use futures_lite::future;
use futures_lite::io::{AsyncReadExt, AsyncWriteExt};
use glommio::net::{TcpListener, TcpStream};

/// Limits of the server.
#[derive(Debug, Clone)]
pub struct HttpConfig {
    /// Largest accepted body, bytes (4 MiB by default).
    pub max_body_bytes: usize,
    /// Largest accepted header block, bytes.
    pub max_header_bytes: usize,
    /// Close a keep-alive connection idle this long.
    pub idle_timeout: Duration,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: 4 << 20,
            max_header_bytes: 64 << 10,
            idle_timeout: Duration::from_secs(60),
        }
    }
}

/// A parsed request.
#[derive(Debug, Clone, Default)]
pub struct Request {
    /// `GET`, `POST`, ...
    pub method: String,
    /// The path, without the query string.
    pub path: String,
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

/// A response.
#[derive(Debug, Clone)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// `Content-Type`.
    pub content_type: &'static str,
    /// Body.
    pub body: Vec<u8>,
}

impl Response {
    /// A JSON response.
    pub fn json(status: u16, body: Vec<u8>) -> Self {
        Self {
            status,
            content_type: "application/json",
            body,
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
        }
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        405 => "Method Not Allowed",
        409 => "Conflict",
        411 => "Length Required",
        413 => "Payload Too Large",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "",
    }
}

fn write_response(out: &mut Vec<u8>, r: &Response, keep_alive: bool) {
    out.extend_from_slice(
        format!(
            "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: {}\r\n\r\n",
            r.status,
            reason(r.status),
            r.content_type,
            r.body.len(),
            if keep_alive { "keep-alive" } else { "close" }
        )
        .as_bytes(),
    );
    out.extend_from_slice(&r.body);
}

/// What parsing the buffered bytes gave.
enum Parsed {
    Need,
    Request(Request, usize, bool),
    Reject(Response),
}

fn parse(buf: &[u8], cfg: &HttpConfig) -> Parsed {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    let head = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => {
            if buf.len() > cfg.max_header_bytes {
                return Parsed::Reject(Response::error(431, "request headers too large"));
            }
            return Parsed::Need;
        }
        Err(httparse::Error::TooManyHeaders) => {
            return Parsed::Reject(Response::error(431, "too many headers"));
        }
        Err(e) => return Parsed::Reject(Response::error(400, format!("malformed request: {e}"))),
    };
    let method = req.method.unwrap_or("").to_owned();
    let path = req
        .path
        .unwrap_or("/")
        .split('?')
        .next()
        .unwrap_or("/")
        .to_owned();
    let version = req.version.unwrap_or(1);
    let hdrs: Vec<(String, String)> = req
        .headers
        .iter()
        .map(|h| {
            (
                h.name.to_ascii_lowercase(),
                String::from_utf8_lossy(h.value).into_owned(),
            )
        })
        .collect();
    let find = |n: &str| hdrs.iter().find(|(k, _)| k == n).map(|(_, v)| v.as_str());
    if find("transfer-encoding").is_some_and(|v| v.to_ascii_lowercase().contains("chunked")) {
        return Parsed::Reject(Response::error(
            411,
            "chunked bodies are not supported: send a Content-Length",
        ));
    }
    let len = match find("content-length").map(|v| v.trim().parse::<usize>()) {
        None => 0,
        Some(Ok(n)) => n,
        Some(Err(_)) => return Parsed::Reject(Response::error(400, "malformed Content-Length")),
    };
    if len > cfg.max_body_bytes {
        return Parsed::Reject(Response::error(
            413,
            format!(
                "body of {len} bytes exceeds the limit of {} bytes",
                cfg.max_body_bytes
            ),
        ));
    }
    if buf.len() < head + len {
        return Parsed::Need;
    }
    let connection = find("connection").map(str::to_ascii_lowercase);
    let keep_alive = match (version, connection.as_deref()) {
        (_, Some(c)) if c.contains("close") => false,
        (0, Some(c)) => c.contains("keep-alive"),
        (0, None) => false,
        _ => true,
    };
    let body = buf[head..head + len].to_vec();
    Parsed::Request(
        Request {
            method,
            path,
            headers: hdrs,
            body,
        },
        head + len,
        keep_alive,
    )
}

/// Serves connections from `listener` forever, answering each request with `handler`.
pub async fn serve(
    listener: TcpListener,
    cfg: HttpConfig,
    handler: Rc<dyn Fn(Request) -> Response>,
) {
    loop {
        match listener.accept().await {
            Ok(stream) => {
                let (cfg, handler) = (cfg.clone(), Rc::clone(&handler));
                glommio::spawn_local(async move { connection(stream, cfg, handler).await })
                    .detach();
            }
            Err(e) => {
                tracing::warn!(error = %e, "http: accept failed");
                glommio::timer::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

async fn connection(
    mut stream: TcpStream,
    cfg: HttpConfig,
    handler: Rc<dyn Fn(Request) -> Response>,
) {
    let _ = stream.set_nodelay(true);
    let mut buf: Vec<u8> = Vec::with_capacity(16 << 10);
    let mut chunk = vec![0u8; 64 << 10];
    let mut out = Vec::with_capacity(16 << 10);
    loop {
        // Answer every complete request already buffered (pipelining), then read more.
        loop {
            match parse(&buf, &cfg) {
                Parsed::Need => break,
                Parsed::Request(req, used, keep_alive) => {
                    buf.drain(..used);
                    let resp = handler(req);
                    write_response(&mut out, &resp, keep_alive);
                    if !keep_alive {
                        let _ = stream.write_all(&out).await;
                        return;
                    }
                }
                Parsed::Reject(resp) => {
                    write_response(&mut out, &resp, false);
                    let _ = stream.write_all(&out).await;
                    return;
                }
            }
        }
        if !out.is_empty() {
            if stream.write_all(&out).await.is_err() {
                return;
            }
            out.clear();
        }
        let read = async { stream.read(&mut chunk).await.ok() };
        let idle = async {
            glommio::timer::sleep(cfg.idle_timeout).await;
            None
        };
        match future::or(read, idle).await {
            Some(0) | None => return,
            Some(n) => buf.extend_from_slice(&chunk[..n]),
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
    fn parses_requests_and_rejects_bad_ones() {
        let cfg = HttpConfig {
            max_body_bytes: 10,
            ..Default::default()
        };
        let wire = b"POST /v1/route?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}GET /healthz HTTP/1.1\r\n\r\n";
        let Parsed::Request(r, used, ka) = parse(wire, &cfg) else {
            panic!()
        };
        assert_eq!(
            (r.method.as_str(), r.path.as_str(), r.body.as_slice(), ka),
            ("POST", "/v1/route", &b"{}"[..], true)
        );
        assert_eq!(r.header("host"), Some("a"));
        let Parsed::Request(r2, _, _) = parse(&wire[used..], &cfg) else {
            panic!()
        };
        assert_eq!(r2.path, "/healthz");
        assert!(matches!(
            parse(b"POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\nab", &cfg),
            Parsed::Need
        ));
        for (bad, status) in [
            (&b"POST / HTTP/1.1\r\nContent-Length: 11\r\n\r\n"[..], 413),
            (
                b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
                411,
            ),
            (b"POST / HTTP/1.1\r\nContent-Length: x\r\n\r\n", 400),
            (b"\x00\x01 garbage\r\n\r\n", 400),
        ] {
            let Parsed::Reject(resp) = parse(bad, &cfg) else {
                panic!("{bad:?}")
            };
            assert_eq!(resp.status, status);
        }
        let Parsed::Request(_, _, ka) = parse(b"GET / HTTP/1.0\r\n\r\n", &cfg) else {
            panic!()
        };
        assert!(!ka);
    }
}
