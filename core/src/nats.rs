//! The NATS client protocol, sans I/O: an incremental parser of what the server sends and
//! an encoder of what a client sends. No sockets, no runtime: bytes in, operations out
//! (fuzzed by `fuzz/fuzz_targets/nats_proto.rs`).
//!
//! Server → client: `INFO {json}`, `MSG <subject> <sid> [reply] <#bytes>`,
//! `HMSG <subject> <sid> [reply] <#header bytes> <#total bytes>`, `PING`, `PONG`, `+OK`,
//! `-ERR '<message>'`, each line ending in CRLF, payloads followed by CRLF. Operation names
//! are case-insensitive. Client → server: `CONNECT {json}`, `PUB`, `HPUB`, `SUB`, `UNSUB`,
//! `PING`, `PONG`.

use serde::{Deserialize, Serialize};

/// Longest control line accepted (the server's default `max_control_line` is 4 KiB).
pub const MAX_CONTROL_LINE: usize = 4096;

/// Why server bytes could not be parsed. The connection must be dropped: the stream is no
/// longer in sync.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtoError {
    /// A control line longer than [`MAX_CONTROL_LINE`].
    #[error("control line longer than {MAX_CONTROL_LINE} bytes")]
    LineTooLong,
    /// An operation this client does not know.
    #[error("unknown operation {0:?}")]
    UnknownOp(String),
    /// A known operation with malformed arguments.
    #[error("malformed {op}: {line:?}")]
    Malformed {
        /// The operation.
        op: &'static str,
        /// The offending line (truncated).
        line: String,
    },
    /// A payload larger than the limit the client accepts.
    #[error("payload of {size} bytes exceeds the limit of {limit}")]
    PayloadTooLarge {
        /// Announced size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// A payload not followed by CRLF.
    #[error("payload not terminated by CRLF")]
    MissingCrlf,
    /// INFO whose JSON does not parse.
    #[error("malformed INFO: {0}")]
    Info(String),
}

/// The server's `INFO`. Unknown fields are ignored.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default)]
pub struct ServerInfo {
    /// Server id.
    pub server_id: String,
    /// Server version.
    pub version: String,
    /// Largest payload the server accepts.
    pub max_payload: usize,
    /// Whether the server supports headers (HPUB/HMSG).
    pub headers: bool,
    /// Whether the server requires authentication.
    pub auth_required: bool,
    /// Whether JetStream is enabled.
    pub jetstream: bool,
}

/// A delivered message.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Msg {
    /// The subject it was published to.
    pub subject: String,
    /// The subscription it was delivered on.
    pub sid: u64,
    /// Where to reply, if anywhere.
    pub reply: Option<String>,
    /// Raw header block (`NATS/1.0 ...`), for HMSG.
    pub headers: Option<Vec<u8>>,
    /// The payload.
    pub payload: Vec<u8>,
}

impl Msg {
    /// The status code of a header block (`NATS/1.0 503` → 503), used by the server for
    /// "no responders" and JetStream flow control.
    pub fn status(&self) -> Option<u16> {
        let h = self.headers.as_deref()?;
        let line = h.split(|&b| b == b'\r').next()?;
        let text = std::str::from_utf8(line).ok()?;
        text.strip_prefix("NATS/1.0")?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    }
}

/// One operation from the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerOp {
    /// Server information (on connect, and when the cluster changes).
    Info(Box<ServerInfo>),
    /// A message.
    Msg(Msg),
    /// Keep-alive request: answer PONG.
    Ping,
    /// Keep-alive answer.
    Pong,
    /// Acknowledgement in verbose mode.
    Ok,
    /// A server error (the server closes the connection after most of them).
    Err(String),
}

/// Incremental parser: feed it bytes as they arrive, take operations out.
#[derive(Debug)]
pub struct Parser {
    buf: Vec<u8>,
    start: usize,
    max_payload: usize,
}

fn find_crlf(b: &[u8]) -> Option<usize> {
    b.windows(2).position(|w| w == b"\r\n")
}

fn malformed(op: &'static str, line: &[u8]) -> ProtoError {
    let line = String::from_utf8_lossy(&line[..line.len().min(128)]).into_owned();
    ProtoError::Malformed { op, line }
}

impl Parser {
    /// A parser that accepts payloads up to `max_payload` bytes.
    pub fn new(max_payload: usize) -> Self {
        Self {
            buf: Vec::with_capacity(64 << 10),
            start: 0,
            max_payload,
        }
    }

    /// Changes the payload limit (after INFO announces the server's).
    pub fn set_max_payload(&mut self, max_payload: usize) {
        self.max_payload = max_payload;
    }

    /// Appends received bytes.
    pub fn push(&mut self, data: &[u8]) {
        if self.start > 0 && self.start == self.buf.len() {
            self.buf.clear();
            self.start = 0;
        } else if self.start > self.buf.len() / 2 && self.start > 4096 {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        self.buf.extend_from_slice(data);
    }

    /// Bytes received but not yet parsed.
    pub fn buffered(&self) -> usize {
        self.buf.len() - self.start
    }

    /// Forgets everything buffered (after a reconnect).
    pub fn reset(&mut self) {
        self.buf.clear();
        self.start = 0;
    }

    /// The next complete operation, `Ok(None)` when more bytes are needed.
    pub fn next_op(&mut self) -> Result<Option<ServerOp>, ProtoError> {
        let avail = &self.buf[self.start..];
        let Some(eol) = find_crlf(&avail[..avail.len().min(MAX_CONTROL_LINE + 2)]) else {
            if avail.len() > MAX_CONTROL_LINE {
                return Err(ProtoError::LineTooLong);
            }
            return Ok(None);
        };
        let line = &avail[..eol];
        let (op, args) = match line.iter().position(|&b| b == b' ' || b == b'\t') {
            Some(i) => (&line[..i], &line[i + 1..]),
            None => (line, &line[line.len()..]),
        };
        let head = eol + 2;
        let op_upper = op.to_ascii_uppercase();
        let parsed = match &op_upper[..] {
            b"MSG" => {
                let parts: Vec<&[u8]> = args
                    .split(|&b| b == b' ' || b == b'\t')
                    .filter(|p| !p.is_empty())
                    .collect();
                let (subject, sid, reply, size) = match parts.as_slice() {
                    [s, sid, n] => (*s, *sid, None, *n),
                    [s, sid, r, n] => (*s, *sid, Some(*r), *n),
                    _ => return Err(malformed("MSG", line)),
                };
                let size = parse_usize(size).ok_or_else(|| malformed("MSG", line))?;
                let sid = parse_u64(sid).ok_or_else(|| malformed("MSG", line))?;
                match self.take_payload(head, 0, size)? {
                    None => return Ok(None),
                    Some((_, payload, consumed)) => {
                        let msg = Msg {
                            subject: utf8(subject, "MSG", line)?,
                            sid,
                            reply: reply.map(|r| utf8(r, "MSG", line)).transpose()?,
                            headers: None,
                            payload,
                        };
                        (ServerOp::Msg(msg), consumed)
                    }
                }
            }
            b"HMSG" => {
                let parts: Vec<&[u8]> = args
                    .split(|&b| b == b' ' || b == b'\t')
                    .filter(|p| !p.is_empty())
                    .collect();
                let (subject, sid, reply, hlen, total) = match parts.as_slice() {
                    [s, sid, h, n] => (*s, *sid, None, *h, *n),
                    [s, sid, r, h, n] => (*s, *sid, Some(*r), *h, *n),
                    _ => return Err(malformed("HMSG", line)),
                };
                let hlen = parse_usize(hlen).ok_or_else(|| malformed("HMSG", line))?;
                let total = parse_usize(total).ok_or_else(|| malformed("HMSG", line))?;
                if hlen > total {
                    return Err(malformed("HMSG", line));
                }
                let sid = parse_u64(sid).ok_or_else(|| malformed("HMSG", line))?;
                match self.take_payload(head, hlen, total)? {
                    None => return Ok(None),
                    Some((headers, payload, consumed)) => {
                        let msg = Msg {
                            subject: utf8(subject, "HMSG", line)?,
                            sid,
                            reply: reply.map(|r| utf8(r, "HMSG", line)).transpose()?,
                            headers: Some(headers),
                            payload,
                        };
                        (ServerOp::Msg(msg), consumed)
                    }
                }
            }
            b"PING" => (ServerOp::Ping, head),
            b"PONG" => (ServerOp::Pong, head),
            b"+OK" => (ServerOp::Ok, head),
            b"-ERR" => {
                let text = String::from_utf8_lossy(args)
                    .trim()
                    .trim_matches('\'')
                    .to_owned();
                (ServerOp::Err(text), head)
            }
            b"INFO" => {
                let info: ServerInfo =
                    serde_json::from_slice(args).map_err(|e| ProtoError::Info(e.to_string()))?;
                (ServerOp::Info(Box::new(info)), head)
            }
            _ => {
                return Err(ProtoError::UnknownOp(
                    String::from_utf8_lossy(&op[..op.len().min(32)]).into_owned(),
                ));
            }
        };
        self.start += parsed.1;
        Ok(Some(parsed.0))
    }

    /// Splits `[headers][payload]\r\n` starting `head` bytes into the unparsed buffer.
    /// Returns (headers, payload, bytes consumed including the control line).
    #[allow(clippy::type_complexity)]
    fn take_payload(
        &self,
        head: usize,
        hlen: usize,
        total: usize,
    ) -> Result<Option<(Vec<u8>, Vec<u8>, usize)>, ProtoError> {
        if total > self.max_payload {
            return Err(ProtoError::PayloadTooLarge {
                size: total,
                limit: self.max_payload,
            });
        }
        let avail = &self.buf[self.start..];
        let end = head + total;
        if avail.len() < end + 2 {
            return Ok(None);
        }
        if &avail[end..end + 2] != b"\r\n" {
            return Err(ProtoError::MissingCrlf);
        }
        let headers = avail[head..head + hlen].to_vec();
        let payload = avail[head + hlen..end].to_vec();
        Ok(Some((headers, payload, end + 2)))
    }
}

fn parse_usize(b: &[u8]) -> Option<usize> {
    if b.is_empty() || b.len() > 12 || !b.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(b).ok()?.parse().ok()
}

fn parse_u64(b: &[u8]) -> Option<u64> {
    if b.is_empty() || b.len() > 20 || !b.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(b).ok()?.parse().ok()
}

fn utf8(b: &[u8], op: &'static str, line: &[u8]) -> Result<String, ProtoError> {
    String::from_utf8(b.to_vec()).map_err(|_| malformed(op, line))
}

/// The client's `CONNECT` options.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct ConnectInfo {
    /// Ask for +OK after every operation.
    pub verbose: bool,
    /// Ask the server to check subjects.
    pub pedantic: bool,
    /// Client name (shows in monitoring).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Client language.
    pub lang: String,
    /// Client version.
    pub version: String,
    /// Protocol level (1: dynamic INFO).
    pub protocol: u8,
    /// Whether we use headers.
    pub headers: bool,
    /// Ask for 503 "no responders" status messages on requests nobody answers.
    pub no_responders: bool,
    /// Token authentication.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auth_token: Option<String>,
    /// User authentication.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Password authentication.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pass: Option<String>,
    /// Whether to receive our own publications on matching subscriptions.
    pub echo: bool,
}

/// Encoders of client operations, appending to a write buffer.
pub mod encode {
    use super::ConnectInfo;

    /// `CONNECT {json}`.
    pub fn connect(out: &mut Vec<u8>, info: &ConnectInfo) {
        out.extend_from_slice(b"CONNECT ");
        // Strings, bools and integers only: serialisation cannot fail.
        out.extend_from_slice(&serde_json::to_vec(info).unwrap_or_default());
        out.extend_from_slice(b"\r\n");
    }

    /// `PUB subject [reply] #bytes` + payload.
    pub fn publish(out: &mut Vec<u8>, subject: &str, reply: Option<&str>, payload: &[u8]) {
        out.extend_from_slice(b"PUB ");
        out.extend_from_slice(subject.as_bytes());
        if let Some(r) = reply {
            out.push(b' ');
            out.extend_from_slice(r.as_bytes());
        }
        out.push(b' ');
        out.extend_from_slice(payload.len().to_string().as_bytes());
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(payload);
        out.extend_from_slice(b"\r\n");
    }

    /// `HPUB subject [reply] #header bytes #total bytes` + headers + payload.
    pub fn hpublish(
        out: &mut Vec<u8>,
        subject: &str,
        reply: Option<&str>,
        headers: &[u8],
        payload: &[u8],
    ) {
        out.extend_from_slice(b"HPUB ");
        out.extend_from_slice(subject.as_bytes());
        if let Some(r) = reply {
            out.push(b' ');
            out.extend_from_slice(r.as_bytes());
        }
        out.extend_from_slice(
            format!(" {} {}\r\n", headers.len(), headers.len() + payload.len()).as_bytes(),
        );
        out.extend_from_slice(headers);
        out.extend_from_slice(payload);
        out.extend_from_slice(b"\r\n");
    }

    /// `SUB subject [queue] sid`.
    pub fn subscribe(out: &mut Vec<u8>, subject: &str, queue: Option<&str>, sid: u64) {
        out.extend_from_slice(b"SUB ");
        out.extend_from_slice(subject.as_bytes());
        if let Some(q) = queue {
            out.push(b' ');
            out.extend_from_slice(q.as_bytes());
        }
        out.extend_from_slice(format!(" {sid}\r\n").as_bytes());
    }

    /// `UNSUB sid [max]`.
    pub fn unsubscribe(out: &mut Vec<u8>, sid: u64, max: Option<u64>) {
        match max {
            Some(m) => out.extend_from_slice(format!("UNSUB {sid} {m}\r\n").as_bytes()),
            None => out.extend_from_slice(format!("UNSUB {sid}\r\n").as_bytes()),
        }
    }

    /// `PING`.
    pub fn ping(out: &mut Vec<u8>) {
        out.extend_from_slice(b"PING\r\n");
    }

    /// `PONG`.
    pub fn pong(out: &mut Vec<u8>) {
        out.extend_from_slice(b"PONG\r\n");
    }
}

/// Whether `subject` is a valid subject to publish to (non-empty tokens, no whitespace,
/// no wildcards).
pub fn valid_publish_subject(subject: &str) -> bool {
    valid_subject(subject) && !subject.split('.').any(|t| t == "*" || t == ">")
}

/// Whether `subject` is a valid subscription subject (wildcards allowed, `>` last).
pub fn valid_subject(subject: &str) -> bool {
    if subject.is_empty() || subject.bytes().any(|b| b.is_ascii_whitespace()) {
        return false;
    }
    let tokens: Vec<&str> = subject.split('.').collect();
    tokens
        .iter()
        .enumerate()
        .all(|(i, t)| !t.is_empty() && (*t != ">" || i == tokens.len() - 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_all(p: &mut Parser) -> Vec<ServerOp> {
        let mut v = Vec::new();
        while let Some(op) = p.next_op().unwrap() {
            v.push(op);
        }
        v
    }

    #[test]
    fn parses_every_server_op_even_byte_by_byte() {
        let wire: &[u8] =
            b"INFO {\"server_id\":\"x\",\"max_payload\":1048576,\"headers\":true,\"new\":1}\r\n\
            +OK\r\nping\r\nPONG\r\nMSG a.b 7 5\r\nhello\r\nMSG a.b 8 _INBOX.1 0\r\n\r\n\
            HMSG c 9 reply 12 14\r\nNATS/1.0\r\n\r\nhi\r\n-ERR 'Authorization Violation'\r\n";
        let mut whole = Parser::new(1 << 20);
        whole.push(wire);
        let ops = parse_all(&mut whole);
        let mut bytes = Parser::new(1 << 20);
        let mut ops2 = Vec::new();
        for b in wire {
            bytes.push(std::slice::from_ref(b));
            ops2.extend(parse_all(&mut bytes));
        }
        assert_eq!(ops, ops2);
        assert_eq!(ops.len(), 8);
        assert!(matches!(&ops[0], ServerOp::Info(i) if i.max_payload == 1 << 20 && i.headers));
        assert_eq!(
            ops[4],
            ServerOp::Msg(Msg {
                subject: "a.b".into(),
                sid: 7,
                reply: None,
                headers: None,
                payload: b"hello".to_vec()
            })
        );
        assert!(
            matches!(&ops[5], ServerOp::Msg(m) if m.reply.as_deref() == Some("_INBOX.1") && m.payload.is_empty())
        );
        match &ops[6] {
            ServerOp::Msg(m) => {
                assert_eq!(m.headers.as_deref(), Some(&b"NATS/1.0\r\n\r\n"[..]));
                assert_eq!(m.payload, b"hi");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(ops[7], ServerOp::Err("Authorization Violation".into()));
        assert_eq!(whole.buffered(), 0);
    }

    #[test]
    fn status_headers() {
        let m = Msg {
            headers: Some(b"NATS/1.0 503\r\n\r\n".to_vec()),
            ..Default::default()
        };
        assert_eq!(m.status(), Some(503));
        assert_eq!(Msg::default().status(), None);
    }

    #[test]
    fn malformed_input_is_a_typed_error() {
        for (wire, kind) in [
            (&b"MSG a\r\n"[..], "malformed"),
            (b"MSG a 1 x\r\n", "malformed"),
            (b"HMSG a 1 5 3\r\n", "malformed"),
            (b"BOGUS\r\n", "unknown"),
            (b"MSG a 1 3\r\nabcXY", "CRLF"),
            (b"MSG a 1 99999999\r\n", "exceeds"),
            (b"INFO {\r\n", "INFO"),
        ] {
            let mut p = Parser::new(1 << 20);
            p.push(wire);
            let err = p.next_op().unwrap_err().to_string();
            assert!(
                err.contains(kind),
                "{:?}: {err}",
                String::from_utf8_lossy(wire)
            );
        }
        let mut p = Parser::new(1 << 20);
        p.push(&vec![b'x'; MAX_CONTROL_LINE + 10]);
        assert_eq!(p.next_op(), Err(ProtoError::LineTooLong));
    }

    #[test]
    fn encoders() {
        let mut out = Vec::new();
        encode::publish(&mut out, "a.b", Some("r"), b"xy");
        encode::subscribe(&mut out, "a.*", Some("q"), 3);
        encode::unsubscribe(&mut out, 3, Some(1));
        encode::hpublish(&mut out, "h", None, b"NATS/1.0\r\n\r\n", b"p");
        assert_eq!(
            out,
            b"PUB a.b r 2\r\nxy\r\nSUB a.* q 3\r\nUNSUB 3 1\r\nHPUB h 12 13\r\nNATS/1.0\r\n\r\np\r\n".to_vec()
        );
        let mut c = Vec::new();
        encode::connect(
            &mut c,
            &ConnectInfo {
                auth_token: Some("t".into()),
                ..Default::default()
            },
        );
        assert!(
            String::from_utf8(c)
                .unwrap()
                .contains("\"auth_token\":\"t\"")
        );
    }

    #[test]
    fn subject_validation() {
        assert!(valid_subject("a.*.>") && valid_subject("a"));
        assert!(
            !valid_subject("a..b")
                && !valid_subject("a.>.b")
                && !valid_subject("a b")
                && !valid_subject("")
        );
        assert!(valid_publish_subject("a.b") && !valid_publish_subject("a.*"));
    }
}
