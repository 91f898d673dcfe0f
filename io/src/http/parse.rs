//! Request framing (RFC 9112), sans I/O: what the buffered bytes of a connection hold.
//!
//! Strict where leniency lets two parties disagree about where a request ends (request
//! smuggling behind a proxy): a body is framed by one `Content-Length` of plain digits
//! (repeated only with the same value), never by both a length and a transfer coding; a
//! chunked body is refused with 411 (RFC 9110 §15.5.12: send a `Content-Length`), any other
//! transfer coding with 501; an HTTP/1.1 request needs its `Host`. Sizes are checked on the
//! bytes themselves, never on how they happened to arrive: a request line over
//! `max_target_bytes` is 414 and a header block over `max_header_bytes` is 431, whether it
//! came in one read or many.

use super::{HttpConfig, Request, Response};

/// What parsing the buffered bytes gave.
#[derive(Debug)]
pub enum Parsed {
    /// More bytes are needed; `head_done`: the header block is complete (a body is due).
    Need {
        /// The header block is complete.
        head_done: bool,
    },
    /// A whole request, the bytes it used, and whether the connection stays open.
    Request(Request, usize, bool),
    /// A request that is answered with this and the connection closed.
    Reject(Response),
}

/// Why a request's framing is refused.
fn reject(status: u16, message: impl AsRef<str>) -> Parsed {
    Parsed::Reject(Response::error(status, message))
}

/// The body length of a `Content-Length` field list: every value (each field may be a
/// comma-separated list) plain ASCII digits, all equal.
fn content_length<'a>(values: impl Iterator<Item = &'a str>) -> Result<Option<u64>, &'static str> {
    let mut len = None;
    for field in values {
        for v in field.split(',') {
            let v = v.trim_matches([' ', '\t']);
            if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
                return Err("malformed Content-Length");
            }
            let n: u64 = v.parse().map_err(|_| "malformed Content-Length")?;
            match len {
                Some(m) if m != n => return Err("conflicting Content-Length values"),
                _ => len = Some(n),
            }
        }
    }
    Ok(len)
}

/// The length of the request line, if its end is buffered.
fn request_line_len(buf: &[u8]) -> Option<usize> {
    buf.iter().position(|&b| b == b'\n')
}

/// The request at the start of `buf`, framed strictly (the module docs), within `cfg`'s
/// sizes.
pub fn parse(buf: &[u8], cfg: &HttpConfig) -> Parsed {
    match request_line_len(buf) {
        Some(n) if n > cfg.max_target_bytes + 16 => return reject(414, "request target too long"),
        None if buf.len() > cfg.max_target_bytes + 16 => {
            return reject(414, "request target too long");
        }
        _ => {}
    }
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    let head = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => {
            if buf.len() > cfg.max_header_bytes {
                return reject(431, "request headers too large");
            }
            return Parsed::Need { head_done: false };
        }
        Err(httparse::Error::TooManyHeaders) => return reject(431, "too many headers"),
        Err(e) => return reject(400, format!("malformed request: {e}")),
    };
    if head > cfg.max_header_bytes {
        return reject(431, "request headers too large");
    }
    let target = req.path.unwrap_or("/");
    if target.len() > cfg.max_target_bytes {
        return reject(414, "request target too long");
    }
    let method = req.method.unwrap_or("").to_owned();
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p.to_owned(), Some(q.to_owned())),
        None => (target.to_owned(), None),
    };
    let version = req.version.unwrap_or(1);
    let mut hdrs: Vec<(String, String)> = Vec::with_capacity(req.headers.len());
    for h in req.headers.iter() {
        let Ok(value) = std::str::from_utf8(h.value) else {
            return reject(400, format!("header {:?} is not UTF-8", h.name));
        };
        hdrs.push((h.name.to_ascii_lowercase(), value.to_owned()));
    }
    let all = |n: &'static str| {
        hdrs.iter()
            .filter(move |(k, _)| k == n)
            .map(|(_, v)| v.as_str())
    };
    if version == 1 && all("host").next().is_none() {
        return reject(400, "an HTTP/1.1 request needs a Host header");
    }
    if all("host").count() > 1 {
        return reject(400, "more than one Host header");
    }
    let length = match content_length(all("content-length")) {
        Ok(l) => l,
        Err(e) => return reject(400, e),
    };
    if all("transfer-encoding").next().is_some() {
        if version == 0 {
            return reject(400, "Transfer-Encoding in an HTTP/1.0 request");
        }
        if length.is_some() {
            return reject(400, "both Content-Length and Transfer-Encoding");
        }
        let codings: Vec<String> = all("transfer-encoding")
            .flat_map(|v| v.split(','))
            .map(|c| c.trim().to_ascii_lowercase())
            .filter(|c| !c.is_empty())
            .collect();
        return if codings == ["chunked"] {
            reject(
                411,
                "chunked bodies are not supported: send a Content-Length",
            )
        } else {
            reject(
                501,
                format!("unsupported transfer coding {:?}", codings.join(", ")),
            )
        };
    }
    let len = length.unwrap_or(0);
    if len > cfg.max_body_bytes as u64 {
        return reject(
            413,
            format!(
                "body of {len} bytes exceeds the limit of {} bytes",
                cfg.max_body_bytes
            ),
        );
    }
    let len = len as usize;
    if buf.len() < head + len {
        return Parsed::Need { head_done: true };
    }
    let connection = hdrs
        .iter()
        .filter(|(k, _)| k == "connection")
        .map(|(_, v)| v.to_ascii_lowercase())
        .collect::<Vec<_>>()
        .join(",");
    let has = |token: &str| connection.split(',').any(|t| t.trim() == token);
    let keep_alive = if has("close") {
        false
    } else {
        version != 0 || has("keep-alive")
    };
    let body = buf[head..head + len].to_vec();
    Parsed::Request(
        Request {
            method,
            path,
            query,
            headers: hdrs,
            body,
        },
        head + len,
        keep_alive,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> HttpConfig {
        HttpConfig {
            max_body_bytes: 10,
            max_header_bytes: 256,
            max_target_bytes: 64,
            ..Default::default()
        }
    }

    fn status(wire: &[u8]) -> u16 {
        match parse(wire, &cfg()) {
            Parsed::Reject(r) => r.status,
            Parsed::Request(..) => 200,
            Parsed::Need { .. } => 0,
        }
    }

    #[test]
    fn parses_pipelined_requests() {
        let wire = b"POST /v1/route?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n";
        let Parsed::Request(r, used, ka) = parse(wire, &cfg()) else {
            panic!()
        };
        assert_eq!(
            (r.method.as_str(), r.path.as_str(), r.body.as_slice(), ka),
            ("POST", "/v1/route", &b"{}"[..], true)
        );
        assert_eq!(r.query.as_deref(), Some("x=1"));
        assert_eq!(r.header("host"), Some("a"));
        let Parsed::Request(r2, _, _) = parse(&wire[used..], &cfg()) else {
            panic!()
        };
        assert_eq!(r2.path, "/healthz");
        assert!(matches!(
            parse(
                b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nab",
                &cfg()
            ),
            Parsed::Need { head_done: true }
        ));
        assert!(matches!(
            parse(b"POST / HTTP/1.1\r\nHost: a\r\n", &cfg()),
            Parsed::Need { head_done: false }
        ));
        let Parsed::Request(_, _, ka) = parse(b"GET / HTTP/1.0\r\n\r\n", &cfg()) else {
            panic!()
        };
        assert!(!ka);
        let Parsed::Request(_, _, ka) = parse(
            b"GET / HTTP/1.1\r\nHost: a\r\nConnection: Keep-Alive, Close\r\n\r\n",
            &cfg(),
        ) else {
            panic!()
        };
        assert!(!ka);
    }

    #[test]
    fn framing_is_strict() {
        for (wire, want) in [
            // Conflicting lengths: two requests to one party, one to another.
            (
                &b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nContent-Length: 4\r\n\r\n{}{}"[..],
                400,
            ),
            (
                b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 2, 4\r\n\r\n{}{}",
                400,
            ),
            // Repeating the same length is allowed.
            (
                b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}",
                200,
            ),
            (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: +2\r\n\r\n{}", 400),
            (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n", 400),
            (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 0x2\r\n\r\n{}", 400),
            (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: \r\n\r\n", 400),
            (
                b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 99999999999999999999999\r\n\r\n",
                400,
            ),
            (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 11\r\n\r\n", 413),
            (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n", 411),
            (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
            (
                b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
                501,
            ),
            (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: \r\n\r\n", 501),
            (
                b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}",
                400,
            ),
            (b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
            (b"GET / HTTP/1.1\r\n\r\n", 400),
            (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
            (b"GET / HTTP/1.1\r\nHost: \xff\r\n\r\n", 400),
            (b"\x00\x01 garbage\r\n\r\n", 400),
        ] {
            assert_eq!(status(wire), want, "{}", String::from_utf8_lossy(wire));
        }
    }

    #[test]
    fn sizes_are_checked_however_the_bytes_arrive() {
        // A header block over the limit, complete in one buffer.
        let big = format!(
            "GET / HTTP/1.1\r\nHost: a\r\nX: {}\r\n\r\n",
            "v".repeat(300)
        );
        assert_eq!(status(big.as_bytes()), 431);
        // ... and still partial.
        assert_eq!(status(&big.as_bytes()[..big.len() - 4]), 431);
        // A long request target, complete or not.
        let url = format!("GET /{} HTTP/1.1\r\nHost: a\r\n\r\n", "p".repeat(100));
        assert_eq!(status(url.as_bytes()), 414);
        assert_eq!(status(&url.as_bytes()[..90]), 414);
        let many: String = (0..70).map(|i| format!("X{i}: v\r\n")).collect();
        assert_eq!(
            status(format!("GET / HTTP/1.1\r\nHost: a\r\n{many}\r\n").as_bytes()),
            431
        );
    }
}
