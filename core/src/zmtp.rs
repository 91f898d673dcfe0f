//! ZMTP 3.x (the ZeroMQ wire protocol, RFC 23 and RFC 37) with the NULL mechanism, sans
//! I/O: the greeting, the READY handshake, frames and multipart messages, and the commands a
//! SUB, PUB or DEALER peer exchanges (SUBSCRIBE / CANCEL, PING / PONG, ERROR). Bytes in,
//! events out; `kvrouter-io` drives it over glommio sockets (fuzzed by
//! `fuzz/fuzz_targets/zmtp_proto.rs`).
//!
//! # The handshake, as libzmq speaks it
//!
//! A peer sends its 64-byte greeting (signature `FF`, 8 bytes of padding, `7F`, version
//! major and minor, the 20-byte mechanism name, the as-server flag, filler), then, once it
//! has the other's greeting, a READY command whose properties name its socket type (and,
//! for DEALER / ROUTER / REQ, its identity). libzmq sends its greeting in parts and holds
//! back the rest until it has seen ours, so [`Session`] sends the whole greeting at once and
//! never waits for the peer's before sending; it accepts any padding (libzmq puts a length
//! there), any version from 3.0 on, and only the NULL mechanism. Socket types are checked
//! against the pairs libzmq allows.
//!
//! # Frames
//!
//! A frame is a flags byte (bit 0 MORE, bit 1 LONG, bit 2 COMMAND, the rest zero), a size
//! (one byte, or eight big-endian bytes when LONG) and the body. A message is its frames up
//! to the first without MORE. Commands are `name length, name, data`. A SUB subscribes with
//! the 3.0 form (a one-frame message `01 prefix`), which every libzmq 4.x PUB accepts; a PUB
//! accepts both that and 3.1's SUBSCRIBE / CANCEL commands. PINGs are answered with PONGs;
//! unknown commands are ignored, as libzmq does.
//!
//! Everything the peer sends is bounded ([`Limits`]): frames, frames per message, bytes per
//! message. Exceeding a limit, a malformed greeting or command, or a peer of the wrong type
//! is a [`ZmtpError`]; the connection must then be dropped (the stream is out of sync).

/// Length of a greeting.
pub const GREETING_LEN: usize = 64;

/// A ZeroMQ socket type (the `Socket-Type` property).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SocketType {
    /// Publisher.
    Pub,
    /// Subscriber.
    Sub,
    /// Raw publisher.
    XPub,
    /// Raw subscriber.
    XSub,
    /// Asynchronous request side.
    Dealer,
    /// Asynchronous reply side, addressing peers by identity.
    Router,
    /// Synchronous request.
    Req,
    /// Synchronous reply.
    Rep,
}

impl SocketType {
    /// The property value.
    pub fn name(self) -> &'static str {
        match self {
            SocketType::Pub => "PUB",
            SocketType::Sub => "SUB",
            SocketType::XPub => "XPUB",
            SocketType::XSub => "XSUB",
            SocketType::Dealer => "DEALER",
            SocketType::Router => "ROUTER",
            SocketType::Req => "REQ",
            SocketType::Rep => "REP",
        }
    }

    fn parse(v: &[u8]) -> Option<SocketType> {
        [
            SocketType::Pub,
            SocketType::Sub,
            SocketType::XPub,
            SocketType::XSub,
            SocketType::Dealer,
            SocketType::Router,
            SocketType::Req,
            SocketType::Rep,
        ]
        .into_iter()
        .find(|t| t.name().as_bytes() == v)
    }

    /// Whether a socket of this type may talk to one of `peer`'s (libzmq's table).
    pub fn accepts(self, peer: SocketType) -> bool {
        use SocketType::*;
        matches!(
            (self, peer),
            (Pub | XPub, Sub | XSub)
                | (Sub | XSub, Pub | XPub)
                | (Dealer, Rep | Dealer | Router)
                | (Router, Req | Dealer | Router)
                | (Req, Rep | Router)
                | (Rep, Req | Dealer)
        )
    }

    /// Whether this type sends its identity in READY.
    fn has_identity(self) -> bool {
        matches!(
            self,
            SocketType::Dealer | SocketType::Router | SocketType::Req
        )
    }
}

/// Bounds on what a peer may send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest frame body.
    pub max_frame: usize,
    /// Most frames in one message.
    pub max_frames: usize,
    /// Most bytes (frame bodies) in one message.
    pub max_message: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_frame: 64 << 20,
            max_frames: 64,
            max_message: 64 << 20,
        }
    }
}

/// Why a peer's bytes were refused. The connection must be dropped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ZmtpError {
    /// Not a ZMTP 3.x greeting (bad signature, or a version before 3.0).
    #[error("not a ZMTP 3 greeting")]
    BadGreeting,
    /// A security mechanism other than NULL.
    #[error("unsupported mechanism {0:?}")]
    Mechanism(String),
    /// A frame whose flags have reserved bits set, or a command with MORE.
    #[error("invalid frame flags {0:#04x}")]
    BadFlags(u8),
    /// A frame, a message or a message's frame count over its limit.
    #[error("{what} of {size} exceeds the limit of {limit}")]
    TooLarge {
        /// What was too large.
        what: &'static str,
        /// Its size.
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// A command that does not parse.
    #[error("malformed {0} command")]
    BadCommand(&'static str),
    /// A message before the handshake was done, or a second READY.
    #[error("unexpected {0} during the handshake")]
    Handshake(&'static str),
    /// The peer's socket type is missing, unknown, or cannot talk to ours.
    #[error("peer socket type {peer:?} cannot talk to {ours}")]
    SocketType {
        /// Ours.
        ours: &'static str,
        /// What the peer said.
        peer: String,
    },
    /// The peer sent ERROR (and will close).
    #[error("peer error: {0}")]
    Peer(String),
}

impl ZmtpError {
    /// A short stable label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            ZmtpError::BadGreeting => "greeting",
            ZmtpError::Mechanism(_) => "mechanism",
            ZmtpError::BadFlags(_) => "flags",
            ZmtpError::TooLarge { .. } => "too_large",
            ZmtpError::BadCommand(_) => "command",
            ZmtpError::Handshake(_) => "handshake",
            ZmtpError::SocketType { .. } => "socket_type",
            ZmtpError::Peer(_) => "peer_error",
        }
    }
}

/// Our greeting: ZMTP 3.1, NULL, as-server 0.
pub fn greeting() -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10] = 3;
    g[11] = 1;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// The peer's greeting: its version (major, minor).
pub fn parse_greeting(g: &[u8; GREETING_LEN]) -> Result<(u8, u8), ZmtpError> {
    if g[0] != 0xFF || g[9] & 1 == 0 || g[10] < 3 {
        return Err(ZmtpError::BadGreeting);
    }
    let mech = &g[12..32];
    let name_len = mech.iter().position(|&b| b == 0).unwrap_or(mech.len());
    if &mech[..name_len] != b"NULL" || mech[name_len..].iter().any(|&b| b != 0) {
        return Err(ZmtpError::Mechanism(
            String::from_utf8_lossy(&mech[..name_len]).into_owned(),
        ));
    }
    Ok((g[10], g[11]))
}

const MORE: u8 = 1;
const LONG: u8 = 2;
const COMMAND: u8 = 4;

fn put_frame(out: &mut Vec<u8>, flags: u8, body: &[u8]) {
    if body.len() > 255 {
        out.push(flags | LONG);
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    } else {
        out.push(flags);
        out.push(body.len() as u8);
    }
    out.extend_from_slice(body);
}

/// Appends a multipart message (at least one frame; an empty list sends one empty frame).
pub fn encode_message<B: AsRef<[u8]>>(out: &mut Vec<u8>, frames: &[B]) {
    if frames.is_empty() {
        put_frame(out, 0, &[]);
        return;
    }
    for (i, f) in frames.iter().enumerate() {
        let more = if i + 1 < frames.len() { MORE } else { 0 };
        put_frame(out, more, f.as_ref());
    }
}

fn put_command(out: &mut Vec<u8>, name: &str, data: &[u8]) {
    let mut body = Vec::with_capacity(1 + name.len() + data.len());
    body.push(name.len() as u8);
    body.extend_from_slice(name.as_bytes());
    body.extend_from_slice(data);
    put_frame(out, COMMAND, &body);
}

/// Appends READY with our socket type (and an empty identity where the type has one).
pub fn encode_ready(out: &mut Vec<u8>, ours: SocketType) {
    let mut props = Vec::new();
    let mut prop = |name: &str, value: &[u8]| {
        props.push(name.len() as u8);
        props.extend_from_slice(name.as_bytes());
        props.extend_from_slice(&(value.len() as u32).to_be_bytes());
        props.extend_from_slice(value);
    };
    prop("Socket-Type", ours.name().as_bytes());
    if ours.has_identity() {
        prop("Identity", b"");
    }
    put_command(out, "READY", &props);
}

/// Appends a subscription to `prefix` (the ZMTP 3.0 message form: `01 prefix`).
pub fn encode_subscribe(out: &mut Vec<u8>, prefix: &[u8]) {
    let mut body = Vec::with_capacity(1 + prefix.len());
    body.push(1);
    body.extend_from_slice(prefix);
    put_frame(out, 0, &body);
}

/// Appends a PING with this context (no TTL).
pub fn encode_ping(out: &mut Vec<u8>, context: &[u8]) {
    let mut data = vec![0, 0];
    data.extend_from_slice(&context[..context.len().min(16)]);
    put_command(out, "PING", &data);
}

fn encode_pong(out: &mut Vec<u8>, context: &[u8]) {
    put_command(out, "PONG", &context[..context.len().min(16)]);
}

/// What a [`Session`] has for its driver.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// The handshake is done: the peer's socket type and identity.
    Ready {
        /// Its type.
        peer: SocketType,
        /// Its identity (empty when it gave none).
        identity: Vec<u8>,
    },
    /// A whole message (its frames, in order).
    Message(Vec<Vec<u8>>),
    /// The peer (a SUB) subscribed to a prefix.
    Subscribe(Vec<u8>),
    /// The peer (a SUB) cancelled a subscription.
    Cancel(Vec<u8>),
    /// The peer answered one of our PINGs.
    Pong(Vec<u8>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Greeting,
    Ready,
    Traffic,
}

/// One connection's protocol state: feed it the peer's bytes, take the events, send what
/// it queues. It queues our greeting at once, READY once the peer's greeting is in, and a
/// PONG for each PING.
#[derive(Debug)]
pub struct Session {
    ours: SocketType,
    limits: Limits,
    phase: Phase,
    inbuf: Vec<u8>,
    /// Bytes of `inbuf` already consumed.
    pos: usize,
    out: Vec<u8>,
    /// Frames of the message being received, and their bytes.
    parts: Vec<Vec<u8>>,
    part_bytes: usize,
    peer_minor: u8,
}

impl Session {
    /// A session for a socket of type `ours`; our greeting is queued.
    pub fn new(ours: SocketType, limits: Limits) -> Self {
        Self {
            ours,
            limits,
            phase: Phase::Greeting,
            inbuf: Vec::new(),
            pos: 0,
            out: greeting().to_vec(),
            parts: Vec::new(),
            part_bytes: 0,
            peer_minor: 0,
        }
    }

    /// Whether the handshake is done.
    pub fn is_ready(&self) -> bool {
        self.phase == Phase::Traffic
    }

    /// The peer's ZMTP minor version (after its greeting).
    pub fn peer_minor(&self) -> u8 {
        self.peer_minor
    }

    /// Bytes to send (taken: the caller writes them out).
    pub fn take_output(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.out)
    }

    /// Whether bytes wait to be sent.
    pub fn has_output(&self) -> bool {
        !self.out.is_empty()
    }

    /// Queues a message (after the handshake).
    pub fn send<B: AsRef<[u8]>>(&mut self, frames: &[B]) {
        encode_message(&mut self.out, frames);
    }

    /// Queues a subscription to `prefix` (a SUB's).
    pub fn subscribe(&mut self, prefix: &[u8]) {
        encode_subscribe(&mut self.out, prefix);
    }

    /// Queues a PING.
    pub fn ping(&mut self, context: &[u8]) {
        encode_ping(&mut self.out, context);
    }

    /// Takes the peer's bytes.
    pub fn feed(&mut self, bytes: &[u8]) {
        if self.pos > 0 && self.pos == self.inbuf.len() {
            self.inbuf.clear();
            self.pos = 0;
        }
        self.inbuf.extend_from_slice(bytes);
    }

    /// The next event from the bytes fed so far; `Ok(None)` when more bytes are needed.
    pub fn poll(&mut self) -> Result<Option<Event>, ZmtpError> {
        loop {
            if self.phase == Phase::Greeting {
                let avail = &self.inbuf[self.pos..];
                // Fail fast on a non-ZMTP peer: the signature's first byte and, once there,
                // the version are known before the whole greeting.
                if avail.first().is_some_and(|&b| b != 0xFF)
                    || avail.get(9).is_some_and(|&b| b & 1 == 0)
                    || avail.get(10).is_some_and(|&b| b < 3)
                {
                    return Err(ZmtpError::BadGreeting);
                }
                if avail.len() < GREETING_LEN {
                    return Ok(None);
                }
                let mut g = [0u8; GREETING_LEN];
                g.copy_from_slice(&avail[..GREETING_LEN]);
                self.pos += GREETING_LEN;
                let (_, minor) = parse_greeting(&g)?;
                self.peer_minor = minor;
                self.phase = Phase::Ready;
                encode_ready(&mut self.out, self.ours);
                continue;
            }
            let Some((flags, body)) = self.frame()? else {
                self.compact();
                return Ok(None);
            };
            if flags & COMMAND != 0 {
                if let Some(ev) = self.command(&body)? {
                    return Ok(Some(ev));
                }
                continue;
            }
            if self.phase != Phase::Traffic {
                return Err(ZmtpError::Handshake("a message"));
            }
            self.part_bytes += body.len();
            if self.part_bytes > self.limits.max_message {
                return Err(ZmtpError::TooLarge {
                    what: "message",
                    size: self.part_bytes as u64,
                    limit: self.limits.max_message as u64,
                });
            }
            self.parts.push(body);
            if self.parts.len() > self.limits.max_frames {
                return Err(ZmtpError::TooLarge {
                    what: "frame count",
                    size: self.parts.len() as u64,
                    limit: self.limits.max_frames as u64,
                });
            }
            if flags & MORE != 0 {
                continue;
            }
            self.part_bytes = 0;
            let frames = std::mem::take(&mut self.parts);
            // A SUB's subscriptions in the 3.0 form, to a publisher.
            if matches!(self.ours, SocketType::Pub | SocketType::XPub) && frames.len() == 1 {
                match frames[0].split_first() {
                    Some((1, prefix)) => return Ok(Some(Event::Subscribe(prefix.to_vec()))),
                    Some((0, prefix)) => return Ok(Some(Event::Cancel(prefix.to_vec()))),
                    _ => {}
                }
            }
            return Ok(Some(Event::Message(frames)));
        }
    }

    fn compact(&mut self) {
        if self.pos > 64 << 10 && self.pos * 2 > self.inbuf.len() {
            self.inbuf.drain(..self.pos);
            self.pos = 0;
        }
    }

    /// The next whole frame: its flags and body.
    fn frame(&mut self) -> Result<Option<(u8, Vec<u8>)>, ZmtpError> {
        let b = &self.inbuf[self.pos..];
        let Some(&flags) = b.first() else {
            return Ok(None);
        };
        if flags & !(MORE | LONG | COMMAND) != 0 || (flags & COMMAND != 0 && flags & MORE != 0) {
            return Err(ZmtpError::BadFlags(flags));
        }
        let (size, header) = if flags & LONG != 0 {
            let Some(s) = b.get(1..9) else {
                return Ok(None);
            };
            let mut a = [0u8; 8];
            a.copy_from_slice(s);
            (u64::from_be_bytes(a), 9)
        } else {
            let Some(&s) = b.get(1) else {
                return Ok(None);
            };
            (u64::from(s), 2)
        };
        if size > self.limits.max_frame as u64 {
            return Err(ZmtpError::TooLarge {
                what: "frame",
                size,
                limit: self.limits.max_frame as u64,
            });
        }
        let size = size as usize;
        if b.len() < header + size {
            return Ok(None);
        }
        let body = b[header..header + size].to_vec();
        self.pos += header + size;
        Ok(Some((flags, body)))
    }

    fn command(&mut self, body: &[u8]) -> Result<Option<Event>, ZmtpError> {
        let (&n, rest) = body.split_first().ok_or(ZmtpError::BadCommand("empty"))?;
        let n = usize::from(n);
        if rest.len() < n {
            return Err(ZmtpError::BadCommand("truncated"));
        }
        let (name, data) = rest.split_at(n);
        match name {
            b"READY" => {
                if self.phase != Phase::Ready {
                    return Err(ZmtpError::Handshake("READY"));
                }
                let (peer, identity) = self.ready(data)?;
                self.phase = Phase::Traffic;
                Ok(Some(Event::Ready { peer, identity }))
            }
            b"ERROR" => {
                let reason = data
                    .split_first()
                    .map(|(&len, r)| &r[..usize::from(len).min(r.len())])
                    .unwrap_or_default();
                Err(ZmtpError::Peer(
                    String::from_utf8_lossy(reason).into_owned(),
                ))
            }
            _ if self.phase != Phase::Traffic => Err(ZmtpError::Handshake("a command")),
            b"PING" => {
                let context = data.get(2..).ok_or(ZmtpError::BadCommand("PING"))?;
                encode_pong(&mut self.out, context);
                Ok(None)
            }
            b"PONG" => Ok(Some(Event::Pong(data.to_vec()))),
            b"SUBSCRIBE" if matches!(self.ours, SocketType::Pub | SocketType::XPub) => {
                Ok(Some(Event::Subscribe(data.to_vec())))
            }
            b"CANCEL" if matches!(self.ours, SocketType::Pub | SocketType::XPub) => {
                Ok(Some(Event::Cancel(data.to_vec())))
            }
            _ => Ok(None),
        }
    }

    /// READY's properties: the peer's type (checked against ours) and identity.
    fn ready(&self, mut data: &[u8]) -> Result<(SocketType, Vec<u8>), ZmtpError> {
        let mut peer_type = None;
        let mut identity = Vec::new();
        while let Some((&n, rest)) = data.split_first() {
            let n = usize::from(n);
            let name = rest.get(..n).ok_or(ZmtpError::BadCommand("READY"))?;
            let len = rest
                .get(n..n + 4)
                .map(|l| u32::from_be_bytes([l[0], l[1], l[2], l[3]]) as usize)
                .ok_or(ZmtpError::BadCommand("READY"))?;
            let value = rest
                .get(n + 4..n + 4 + len)
                .ok_or(ZmtpError::BadCommand("READY"))?;
            if name.eq_ignore_ascii_case(b"Socket-Type") {
                peer_type = Some(value);
            } else if name.eq_ignore_ascii_case(b"Identity") {
                identity = value.to_vec();
            }
            data = &rest[n + 4 + len..];
        }
        let bad = |v: &[u8]| ZmtpError::SocketType {
            ours: self.ours.name(),
            peer: String::from_utf8_lossy(v).into_owned(),
        };
        let v = peer_type.ok_or_else(|| bad(b""))?;
        let peer = SocketType::parse(v).ok_or_else(|| bad(v))?;
        if !self.ours.accepts(peer) {
            return Err(bad(v));
        }
        Ok((peer, identity))
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// Runs two sessions against each other until neither has output; returns the events
    /// each saw.
    fn pump(a: &mut Session, b: &mut Session) -> (Vec<Event>, Vec<Event>) {
        let (mut ea, mut eb) = (Vec::new(), Vec::new());
        for _ in 0..16 {
            let to_b = a.take_output();
            let to_a = b.take_output();
            if to_a.is_empty() && to_b.is_empty() {
                break;
            }
            // Byte by byte one way, in one piece the other: framing must not care.
            for byte in &to_b {
                b.feed(std::slice::from_ref(byte));
                while let Some(e) = b.poll().unwrap() {
                    eb.push(e);
                }
            }
            a.feed(&to_a);
            while let Some(e) = a.poll().unwrap() {
                ea.push(e);
            }
        }
        (ea, eb)
    }

    #[test]
    fn pub_and_sub_handshake_subscribe_and_carry_multipart_messages() {
        let mut publisher = Session::new(SocketType::Pub, Limits::default());
        let mut sub = Session::new(SocketType::Sub, Limits::default());
        let (ep, es) = pump(&mut publisher, &mut sub);
        assert!(matches!(
            ep[0],
            Event::Ready {
                peer: SocketType::Sub,
                ..
            }
        ));
        assert!(matches!(
            es[0],
            Event::Ready {
                peer: SocketType::Pub,
                ..
            }
        ));
        sub.subscribe(b"");
        let long = vec![7u8; 300];
        publisher.send(&[&b"topic"[..], &[0, 0, 0, 0, 0, 0, 0, 1], &long]);
        let (ep, es) = pump(&mut publisher, &mut sub);
        assert_eq!(ep, [Event::Subscribe(Vec::new())]);
        assert_eq!(
            es,
            [Event::Message(vec![
                b"topic".to_vec(),
                vec![0, 0, 0, 0, 0, 0, 0, 1],
                long
            ])]
        );
    }

    #[test]
    fn pings_are_answered_and_unknown_commands_ignored() {
        let mut d = Session::new(SocketType::Dealer, Limits::default());
        let mut r = Session::new(SocketType::Router, Limits::default());
        pump(&mut d, &mut r);
        d.ping(b"ctx");
        put_command(&mut d.out, "NOPE", b"x");
        let (ed, er) = pump(&mut d, &mut r);
        assert!(er.is_empty());
        assert_eq!(ed, [Event::Pong(b"ctx".to_vec())]);
    }

    #[test]
    fn a_libzmq_style_greeting_in_parts_with_a_length_in_the_padding() {
        let mut s = Session::new(SocketType::Sub, Limits::default());
        let mut g = greeting();
        g[1..9].copy_from_slice(&1u64.to_be_bytes());
        s.feed(&g[..10]);
        assert_eq!(s.poll(), Ok(None));
        s.feed(&g[10..11]);
        assert_eq!(s.poll(), Ok(None));
        s.feed(&g[11..]);
        assert_eq!(s.poll(), Ok(None));
        // READY queued after our greeting.
        let out = s.take_output();
        assert_eq!(&out[..GREETING_LEN], &greeting());
        assert_eq!(out[GREETING_LEN], COMMAND);
    }

    #[test]
    fn refusals() {
        let fresh = || Session::new(SocketType::Sub, Limits::default());
        let mut s = fresh();
        s.feed(b"GET / HTTP/1.1\r\n");
        assert_eq!(s.poll(), Err(ZmtpError::BadGreeting));
        let mut s = fresh();
        let mut g = greeting();
        g[12..16].copy_from_slice(b"PLAI");
        s.feed(&g);
        assert!(matches!(s.poll(), Err(ZmtpError::Mechanism(_))));
        // A SUB talking to a SUB.
        let mut a = fresh();
        let mut b = fresh();
        let to_b = a.take_output();
        b.feed(&to_b);
        b.poll().unwrap();
        let to_a = b.take_output();
        a.feed(&to_a);
        assert!(matches!(a.poll(), Err(ZmtpError::SocketType { .. })));
        // A message before READY; reserved flag bits; a frame over the limit.
        for (bytes, want) in [
            (vec![0u8, 1, 9], "handshake"),
            (vec![0x80, 0], "flags"),
            (vec![0x02, 0xff, 0, 0, 0, 0, 0, 0, 0], "too_large"),
        ] {
            let mut s = fresh();
            s.feed(&greeting());
            s.feed(&bytes);
            assert_eq!(s.poll().unwrap_err().kind(), want);
        }
        let mut s = Session::new(
            SocketType::Sub,
            Limits {
                max_frames: 2,
                ..Limits::default()
            },
        );
        let mut p = Session::new(SocketType::Pub, Limits::default());
        pump(&mut p, &mut s);
        p.send(&[b"a", b"b", b"c"]);
        let bytes = p.take_output();
        s.feed(&bytes);
        assert_eq!(s.poll().unwrap_err().kind(), "too_large");
    }

    #[test]
    fn an_error_command_is_the_peers_last_word() {
        let mut s = Session::new(SocketType::Sub, Limits::default());
        s.feed(&greeting());
        let mut e = Vec::new();
        put_command(&mut e, "ERROR", b"\x06denied");
        s.feed(&e);
        assert_eq!(s.poll(), Err(ZmtpError::Peer("denied".into())));
    }
}
