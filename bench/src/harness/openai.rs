//! The networked harness over the OpenAI front (`kvrouter bench --nats URL --openai`):
//! every request of the trace goes, as an OpenAI client sends it, to `kvrouter serve
//! --openai-listen`, which routes it and relays it to a mock engine that speaks the OpenAI
//! API. The policy comparison then covers the whole request path: the front reads and
//! hashes the prompt, decides, forwards, sees the first streamed token (prefill done) and
//! the end of the stream (freed), exactly as in a deployment.
//!
//! - **Engines** (`kvrouter bench-engine --openai`): the same mock engine as the NATS mode,
//!   in wall-clock time, publishing its KV events over NATS; its jobs arrive as
//!   `POST /v1/completions` with the prompt as token ids (the trace's tokens), `max_tokens`
//!   as the trace's output length and `stream: true`. Every token is one SSE chunk; the
//!   last chunk carries `usage` with `prompt_tokens_details.cached_tokens` (the blocks the
//!   engine found cached), as vLLM reports it. A task per connection, on the engine
//!   loop's executor, reads requests and writes answers; the engine loop hands tokens to
//!   them over channels. A client that goes
//!   away does not cancel the engine's work (the mock has no preemption).
//! - **The router** serves a model card of its own (a one-word tokenizer: prompts are token
//!   ids, never text) and every policy, the cache-blind ones too (`--router-mode`).
//! - **The client**: a task per request on one glommio executor (the load generator's),
//!   started at its arrival time, on keep-alive connections; TTFT is from sending to the first token chunk, ITL the mean gap between
//!   token chunks, the worker the one the front names in `x-kvrouter-worker-id`, and the
//!   hits the engine's `cached_tokens`.

use std::cell::{Cell, RefCell};
use std::io::Write;
use std::path::Path;
use std::rc::Rc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures_lite::{AsyncReadExt, AsyncWriteExt};
use glommio::net::TcpStream as GlommioStream;
use kvrouter_core::hash::{
    HashOptions, LocalBlockHash, SequenceBlockHash, local_block_hashes, sequence_hashes,
};
use kvrouter_io::http::{
    self,
    chunked::{self, Step},
};
use memchr::memmem;
use serde::Deserialize;

use super::engine::EngineRequest;

/// The model name the router serves and the client asks for.
pub const MODEL: &str = "bench";

/// Writes the router's model card into `dir`: a tokenizer that knows one word (prompts
/// are sent as token ids, so it never encodes anything) and no chat template.
pub fn write_card(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let tokenizer = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"<unk>": 0}, "unk_token": "<unk>"}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string())?;
    std::fs::write(dir.join("tokenizer_config.json"), "{}")
}

/// What the engine loop tells a request's connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tok {
    /// The first token, and the prompt blocks found cached.
    First {
        /// Blocks served from the engine's cache.
        cached_blocks: usize,
    },
    /// A later token.
    Token,
    /// The last token has been sent.
    Done,
}

/// A request for the engine loop, with where its tokens go.
#[derive(Debug)]
pub struct HttpJob {
    /// The request.
    pub request: EngineRequest,
    /// Its connection.
    pub tokens: flume::Sender<Tok>,
}

#[derive(Debug, Deserialize)]
struct CompletionBody {
    prompt: Vec<u32>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
}

#[derive(Debug, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// Listens on a free loopback port for the engine's OpenAI API; jobs go to `jobs`.
/// Returns the port. Must be called on a glommio executor: every connection is a task on
/// it.
///
/// The engine loop runs on that executor too, so a token it hands a connection wakes a
/// task on the same thread: no thread switch, no system call. A thread per connection,
/// woken through a futex for every token, made the mock engines the largest CPU consumer
/// of a networked run, and an executor thread of its own for the connections, woken from
/// the engine's, cost more still (docs/BENCHMARKS.md). Tokens that arrive together leave
/// in one write. Large bodies are parsed on the executor's blocking thread.
pub fn serve_engine(block_size: u32, jobs: flume::Sender<HttpJob>) -> std::io::Result<u16> {
    let listener = glommio::net::TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    glommio::spawn_local(async move {
        let ids = Rc::new(Cell::new(0usize));
        loop {
            match listener.accept().await {
                Ok(conn) => {
                    let (jobs, ids) = (jobs.clone(), Rc::clone(&ids));
                    glommio::spawn_local(async move {
                        if let Err(e) = engine_conn(conn, block_size, &jobs, &ids).await {
                            tracing::debug!(error = %e, "bench engine: connection closed");
                        }
                    })
                    .detach();
                }
                Err(e) => {
                    // Out of descriptors, say: wait rather than spin.
                    tracing::warn!(error = %e, "bench engine: accept failed");
                    glommio::timer::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    })
    .detach();
    Ok(port)
}

/// Reads more of the connection into `buf`; `false` at its end.
async fn read_more(conn: &mut GlommioStream, buf: &mut Vec<u8>) -> std::io::Result<bool> {
    const READ: usize = 64 << 10;
    let at = buf.len();
    buf.resize(at + READ, 0);
    let n = conn.read(&mut buf[at..]).await;
    buf.truncate(at + *n.as_ref().unwrap_or(&0));
    Ok(n? > 0)
}

/// The next request on the connection, framed by the routing API's parser
/// (`kvrouter_io::http::parse`: heads up to 64 KiB, here bodies up to 256 MiB), or the
/// answer that refuses it; the bytes after it stay in `buf`. `None` at a clean end of
/// the connection.
async fn read_request(
    conn: &mut GlommioStream,
    buf: &mut Vec<u8>,
) -> std::io::Result<Option<Result<http::Request, http::Response>>> {
    let cfg = http::HttpConfig {
        max_body_bytes: 256 << 20,
        ..http::HttpConfig::default()
    };
    loop {
        match http::parse(buf, &cfg) {
            http::Parsed::Request(req, used, _) => {
                buf.drain(..used);
                return Ok(Some(Ok(req)));
            }
            http::Parsed::Reject(r) => return Ok(Some(Err(r))),
            http::Parsed::Need { .. } => {
                if !read_more(conn, buf).await? {
                    if buf.iter().all(u8::is_ascii_whitespace) {
                        return Ok(None);
                    }
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
            }
        }
    }
}

fn chunk(w: &mut Vec<u8>, s: &str) {
    // Writing to a Vec cannot fail.
    let _ = write!(w, "{:x}\r\n{s}\r\n", s.len());
}

async fn respond(conn: &mut GlommioStream, status: &str, body: &str) -> std::io::Result<()> {
    let answer = format!(
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(answer.as_bytes()).await?;
    conn.flush().await
}

fn blocks_of(tokens: &[u32], block_size: u32) -> Vec<(LocalBlockHash, SequenceBlockHash)> {
    let locals = local_block_hashes(tokens, block_size, &HashOptions::default());
    let seqs = sequence_hashes(&locals);
    locals.into_iter().zip(seqs).collect()
}

/// Waits for a request's next tokens: `n` tokens have come (the first one notes its
/// cached blocks) and then, with `true`, the request's end. Takes every token already
/// sent, so that tokens that arrive together are answered together.
async fn next_tokens(rx: &flume::Receiver<Tok>, cached: &mut usize) -> (u32, bool) {
    let mut next = rx.recv_async().await.ok();
    let mut n = 0;
    loop {
        match next {
            Some(Tok::First { cached_blocks }) => {
                *cached = cached_blocks;
                n += 1;
            }
            Some(Tok::Token) => n += 1,
            Some(Tok::Done) | None => return (n, true),
        }
        next = match rx.try_recv() {
            Ok(t) => Some(t),
            Err(flume::TryRecvError::Empty) => return (n, false),
            Err(flume::TryRecvError::Disconnected) => None,
        };
    }
}

/// What the engine needs of a completion request.
struct Parsed {
    prompt_tokens: u32,
    output: u32,
    blocks: Vec<(LocalBlockHash, SequenceBlockHash)>,
    stream: bool,
    include_usage: bool,
}

fn parse_job(body: &[u8], block_size: u32) -> Result<Parsed, serde_json::Error> {
    let req: CompletionBody = serde_json::from_slice(body)?;
    Ok(Parsed {
        prompt_tokens: req.prompt.len() as u32,
        output: req.max_tokens.unwrap_or(16).max(1),
        blocks: blocks_of(&req.prompt, block_size),
        stream: req.stream,
        include_usage: req.stream_options.as_ref().is_some_and(|o| o.include_usage),
    })
}

async fn engine_conn(
    mut conn: GlommioStream,
    block_size: u32,
    jobs: &flume::Sender<HttpJob>,
    ids: &Cell<usize>,
) -> std::io::Result<()> {
    conn.set_nodelay(true)?;
    let mut buf = Vec::new();
    while let Some(req) = read_request(&mut conn, &mut buf).await? {
        let req = match req {
            Ok(req) => req,
            Err(refused) => {
                // Its framing is broken: answered, and the connection closed.
                let mut out = Vec::new();
                http::write_response(&mut out, &refused, false);
                conn.write_all(&out).await?;
                return conn.flush().await;
            }
        };
        let body = req.body;
        if req.method != "POST" || req.path != "/v1/completions" {
            respond(
                &mut conn,
                "404 Not Found",
                r#"{"error":{"message":"only POST /v1/completions","type":"not_found"}}"#,
            )
            .await?;
            continue;
        }
        // A large body is parsed, and its blocks hashed, on the executor's blocking thread:
        // an agentic prompt takes milliseconds, and the engine loop's steps, on this
        // thread, would end that much late.
        const INLINE: usize = 64 << 10;
        let parsed = if body.len() > INLINE {
            glommio::executor()
                .spawn_blocking(move || parse_job(&body, block_size))
                .await
        } else {
            parse_job(&body, block_size)
        };
        let Parsed {
            prompt_tokens,
            output,
            blocks,
            stream,
            include_usage,
        } = match parsed {
            Ok(p) => p,
            Err(e) => {
                let msg = serde_json::json!({"error": {"message": format!("bad request: {e}"), "type": "invalid_request_error"}});
                respond(&mut conn, "400 Bad Request", &msg.to_string()).await?;
                continue;
            }
        };
        // Only uniqueness is needed: no other memory is published with the id.
        let id = ids.get();
        ids.set(id + 1);
        let (tx, rx) = flume::unbounded();
        let job = HttpJob {
            request: EngineRequest::new(id, prompt_tokens, output, blocks),
            tokens: tx,
        };
        if jobs.send(job).is_err() {
            respond(
                &mut conn,
                "503 Service Unavailable",
                r#"{"error":{"message":"engine stopped","type":"unavailable"}}"#,
            )
            .await?;
            return Ok(());
        }
        let usage = |generated: u32, cached: usize| {
            serde_json::json!({
                "prompt_tokens": prompt_tokens,
                "completion_tokens": generated,
                "total_tokens": prompt_tokens + generated,
                "prompt_tokens_details": {"cached_tokens": cached as u64 * u64::from(block_size)},
            })
        };
        let cmpl = format!("cmpl-{id}");
        let (mut generated, mut cached) = (0u32, 0usize);
        if stream {
            conn.write_all(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
            )
            .await?;
            conn.flush().await?;
            let mut out = Vec::new();
            loop {
                let (n, ended) = next_tokens(&rx, &mut cached).await;
                for _ in 0..n {
                    generated += 1;
                    let last = generated >= output;
                    let event = serde_json::json!({
                        "id": cmpl, "object": "text_completion", "model": MODEL,
                        "choices": [{"index": 0, "text": " t", "finish_reason": if last { Some("length") } else { None }}],
                    });
                    chunk(&mut out, &format!("data: {event}\n\n"));
                }
                if ended {
                    break;
                }
                conn.write_all(&out).await?;
                conn.flush().await?;
                out.clear();
            }
            if include_usage {
                let event = serde_json::json!({
                    "id": cmpl, "object": "text_completion", "model": MODEL,
                    "choices": [], "usage": usage(generated, cached),
                });
                chunk(&mut out, &format!("data: {event}\n\n"));
            }
            chunk(&mut out, "data: [DONE]\n\n");
            out.extend_from_slice(b"0\r\n\r\n");
            conn.write_all(&out).await?;
            conn.flush().await?;
        } else {
            loop {
                let (n, ended) = next_tokens(&rx, &mut cached).await;
                generated += n;
                if ended {
                    break;
                }
            }
            let text = " t".repeat(generated as usize);
            let answer = serde_json::json!({
                "id": cmpl, "object": "text_completion", "model": MODEL,
                "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                "usage": usage(generated, cached),
            });
            respond(&mut conn, "200 OK", &answer.to_string()).await?;
        }
    }
    Ok(())
}

/// What became of one request sent through the front.
#[derive(Debug, Clone)]
pub struct Answer {
    /// Trace index.
    pub index: usize,
    /// Worker index (worker id − 1) the front chose.
    pub worker: usize,
    /// When the load generator took the request up, ms since the run's start.
    pub sent_ms: f64,
    /// First token, ms since the run's start.
    pub first_ms: f64,
    /// Last event, ms since the run's start.
    pub done_ms: f64,
    /// Mean gap between token chunks, ms (none with one token).
    pub itl_ms: Option<f64>,
    /// Prompt tokens the engine found cached.
    pub cached_tokens: u64,
}

/// Keep-alive connections to the front, shared by the requests in flight: every request
/// is a task on the load generator's executor ([`Client::complete`]).
#[derive(Debug, Clone)]
pub struct Client {
    addr: String,
    idle: Rc<RefCell<Vec<GlommioStream>>>,
    timeout: Duration,
}

impl Client {
    /// A client of the front at `addr`; a read or a write that waits longer than `timeout` fails.
    pub fn new(addr: String, timeout: Duration) -> Self {
        Self {
            addr,
            idle: Rc::new(RefCell::new(Vec::new())),
            timeout,
        }
    }

    /// A pooled connection (`true`) or a new one.
    async fn connection(&self, pooled: bool) -> anyhow::Result<(GlommioStream, bool)> {
        if pooled && let Some(c) = self.idle.borrow_mut().pop() {
            return Ok((c, true));
        }
        let c = GlommioStream::connect(self.addr.as_str())
            .await
            .map_err(std::io::Error::from)
            .with_context(|| format!("connecting to the front at {}", self.addr))?;
        c.set_nodelay(true).map_err(std::io::Error::from)?;
        c.set_read_timeout(Some(self.timeout))
            .map_err(std::io::Error::from)?;
        c.set_write_timeout(Some(self.timeout))
            .map_err(std::io::Error::from)?;
        Ok((c, false))
    }

    /// Writes the request on a pooled connection and reads the first answer bytes. When
    /// the pooled connection turns out to be closed (the front closes idle connections)
    /// before any answer byte, the request is written again on a new one. A front that
    /// only fails to answer in time is not asked twice: it may be serving the first.
    async fn send<I: Iterator<Item = u32>>(
        &self,
        request: &Request<'_, I>,
    ) -> anyhow::Result<(GlommioStream, Vec<u8>)> {
        let (mut conn, pooled) = self.connection(true).await?;
        let first = async {
            request.write_to(&mut conn).await?;
            let mut first = [0u8; 16 << 10];
            let n = conn.read(&mut first).await?;
            Ok::<_, std::io::Error>(first[..n].to_vec())
        }
        .await;
        match first {
            Ok(first) if !first.is_empty() => Ok((conn, first)),
            Ok(_) if pooled => self.resend(request).await,
            Err(e) if pooled && closed(&e) => self.resend(request).await,
            Ok(_) => bail!("the front closed a new connection without answering"),
            Err(e) => Err(e).context("no answer from the front"),
        }
    }

    /// Writes the request again on a new connection; the caller reads its answer.
    async fn resend<I: Iterator<Item = u32>>(
        &self,
        request: &Request<'_, I>,
    ) -> anyhow::Result<(GlommioStream, Vec<u8>)> {
        let (mut conn, _) = self.connection(false).await?;
        request.write_to(&mut conn).await?;
        Ok((conn, Vec::new()))
    }

    /// Sends a streaming completion of the prompt `ids` gives (called once to size the
    /// body and once for each write of it) asking for `max_tokens`, and reads its answer;
    /// `start` is the run's time origin.
    ///
    /// The body is written straight from the ids, never held whole: an agentic prompt is
    /// megabytes of JSON, and an overloaded front leaves thousands of requests in flight.
    /// A request in flight holds its connection, a 64 KiB write buffer while it writes
    /// and what its answer's next event needs; when requests had a thread each, every
    /// thread kept its allocator's pages and its stack (about 1.5 MB a request, 7 MB
    /// while the bodies were made whole).
    pub async fn complete<I: Iterator<Item = u32>>(
        &self,
        index: usize,
        ids: impl Fn() -> I,
        max_tokens: u32,
        start: Instant,
    ) -> anyhow::Result<Answer> {
        let sent_ms = start.elapsed().as_secs_f64() * 1000.0;
        let (mut conn, first) = self
            .send(&Request {
                ids: &ids,
                max_tokens,
            })
            .await?;
        let mut stream = SseReader::new(&mut conn);
        stream.buf = first;
        let status = stream
            .head()
            .await
            .with_context(|| format!("request {index}"))?;
        if status.code != 200 {
            let text = stream.body_text().await?;
            bail!("request {index}: HTTP {}: {text}", status.code);
        }
        let worker = status
            .worker
            .and_then(|w| (w as usize).checked_sub(1))
            .with_context(|| format!("request {index}: no x-kvrouter-worker-id"))?;
        let (mut first, mut last, mut n, mut cached) = (None, 0.0, 0u64, 0u64);
        while let Some(event) = stream.next_event().await? {
            let now = start.elapsed().as_secs_f64() * 1000.0;
            if event == "[DONE]" {
                if n == 0 {
                    last = now;
                }
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(&event)
                .with_context(|| format!("request {index}: a malformed event {event:?}"))?;
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                cached = u["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap_or(0);
            }
            if v["choices"].as_array().is_some_and(|c| !c.is_empty()) {
                first.get_or_insert(now);
                last = now;
                n += 1;
            }
        }
        self.idle.borrow_mut().push(conn);
        let first_ms = first.with_context(|| format!("request {index}: no token"))?;
        Ok(Answer {
            index,
            worker,
            sent_ms,
            first_ms,
            done_ms: last,
            itl_ms: (n > 1).then(|| (last - first_ms) / (n - 1) as f64),
            cached_tokens: cached,
        })
    }
}

/// A response's status and the worker the front chose.
struct Status {
    code: u16,
    worker: Option<u64>,
}

/// Reads one HTTP/1.1 response: its head, then its body's SSE events (chunked, or by
/// content length).
struct SseReader<'a> {
    conn: &'a mut GlommioStream,
    buf: Vec<u8>,
    /// Decoded body bytes not yet split into events.
    body: Vec<u8>,
    /// `Some(n)`: a content-length body with n bytes left; `None`: chunked.
    left: Option<usize>,
    ended: bool,
}

impl<'a> SseReader<'a> {
    fn new(conn: &'a mut GlommioStream) -> Self {
        Self {
            conn,
            buf: Vec::new(),
            body: Vec::new(),
            left: None,
            ended: false,
        }
    }

    async fn fill(&mut self) -> anyhow::Result<()> {
        let mut tmp = [0u8; 16 << 10];
        let n = self
            .conn
            .read(&mut tmp)
            .await
            .context("reading the answer")?;
        if n == 0 {
            bail!("the front closed the connection mid-answer");
        }
        self.buf.extend_from_slice(&tmp[..n]);
        Ok(())
    }

    async fn head(&mut self) -> anyhow::Result<Status> {
        let end = loop {
            if let Some(p) = memmem::find(&self.buf, b"\r\n\r\n") {
                break p;
            }
            self.fill().await?;
        };
        let head = String::from_utf8_lossy(&self.buf[..end]).into_owned();
        self.buf.drain(..end + 4);
        let mut lines = head.split("\r\n");
        let code = lines
            .next()
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|c| c.parse().ok())
            .context("a malformed status line")?;
        let (mut worker, mut chunked, mut len) = (None, false, 0usize);
        for l in lines {
            let Some((k, v)) = l.split_once(':') else {
                continue;
            };
            let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
            match k.as_str() {
                "x-kvrouter-worker-id" => worker = v.parse().ok(),
                "transfer-encoding" => chunked = v.eq_ignore_ascii_case("chunked"),
                "content-length" => len = v.parse().unwrap_or(0),
                _ => {}
            }
        }
        self.left = (!chunked).then_some(len);
        Ok(Status { code, worker })
    }

    /// Moves decoded body bytes from `buf` to `body`; `false` when more must be read.
    fn decode(&mut self) -> anyhow::Result<bool> {
        match &mut self.left {
            Some(left) => {
                let take = (*left).min(self.buf.len());
                self.body.extend(self.buf.drain(..take));
                *left -= take;
                self.ended = *left == 0;
                Ok(take > 0 || self.ended)
            }
            None => match chunked::step(&self.buf)? {
                Step::More => Ok(false),
                Step::Chunk { data, used } => {
                    self.body.extend_from_slice(&self.buf[data]);
                    self.buf.drain(..used);
                    Ok(true)
                }
                Step::End { used } => {
                    self.buf.drain(..used);
                    self.ended = true;
                    Ok(true)
                }
            },
        }
    }

    /// The next `data:` payload; `None` at the body's end.
    async fn next_event(&mut self) -> anyhow::Result<Option<String>> {
        loop {
            if let Some(p) = memmem::find(&self.body, b"\n\n") {
                let event: Vec<u8> = self.body.drain(..p + 2).collect();
                let text = String::from_utf8_lossy(&event);
                if let Some(data) = text.trim().strip_prefix("data:") {
                    return Ok(Some(data.trim().to_owned()));
                }
                continue;
            }
            if self.ended {
                return Ok(None);
            }
            if !self.decode()? {
                self.fill().await?;
            }
        }
    }

    /// The whole body as text (an error answer).
    async fn body_text(&mut self) -> anyhow::Result<String> {
        while !self.ended {
            if !self.decode()? {
                self.fill().await?;
            }
        }
        Ok(String::from_utf8_lossy(&self.body).into_owned())
    }
}

/// Whether `e` says the peer closed the connection (not that it was slow).
fn closed(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionReset | ConnectionAborted | BrokenPipe | NotConnected | UnexpectedEof
    )
}

/// A streaming completion request: the prompt's ids and the tokens asked for.
struct Request<'a, I> {
    ids: &'a dyn Fn() -> I,
    max_tokens: u32,
}

impl<I: Iterator<Item = u32>> Request<'_, I> {
    /// Writes the request, its `content-length` counted from the ids first, through a
    /// buffer of 64 KiB.
    async fn write_to(&self, conn: &mut GlommioStream) -> std::io::Result<()> {
        const PIECE: usize = 64 << 10;
        let open = format!("{{\"model\":\"{MODEL}\",\"prompt\":[");
        let close = format!(
            "],\"max_tokens\":{},\"stream\":true,\"stream_options\":{{\"include_usage\":true}}}}",
            self.max_tokens
        );
        let (n, digits) = (self.ids)().fold((0usize, 0usize), |(n, d), id| {
            (n + 1, d + id.checked_ilog10().map_or(1, |l| l as usize + 1))
        });
        let len = open.len() + digits + n.saturating_sub(1) + close.len();
        let mut w = Vec::with_capacity(PIECE + 16);
        write!(
            w,
            "POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\ncontent-length: {len}\r\n\r\n{open}"
        )?;
        let mut text = itoa::Buffer::new();
        for (k, id) in (self.ids)().enumerate() {
            if k > 0 {
                w.push(b',');
            }
            w.extend_from_slice(text.format(id).as_bytes());
            if w.len() >= PIECE {
                conn.write_all(&w).await?;
                w.clear();
            }
        }
        w.extend_from_slice(close.as_bytes());
        conn.write_all(&w).await?;
        conn.flush().await
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Read};
    use std::net::{TcpListener, TcpStream};
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Runs `f` on a glommio executor of its own, as the load generator runs its client.
    fn on_executor<T: Send + 'static, F: std::future::Future<Output = T> + 'static>(
        f: impl FnOnce() -> F + Send + 'static,
    ) -> T {
        glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
            .io_memory(256 << 10)
            .spawn(move || async move { f().await })
            .expect("an executor")
            .join()
            .expect("the executor ran")
    }

    /// Reads one request from `conn`: its head, then its body (by its content length).
    fn read_one(conn: &mut BufReader<TcpStream>) -> Vec<u8> {
        let (mut first, mut len) = (String::new(), 0);
        loop {
            let mut line = String::new();
            assert!(
                conn.read_line(&mut line).unwrap() > 0,
                "the request ended early"
            );
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if first.is_empty() {
                first = l.to_owned();
            } else if let Some((k, v)) = l.split_once(':')
                && k.eq_ignore_ascii_case("content-length")
            {
                len = v.trim().parse().unwrap();
            }
        }
        assert!(first.starts_with("POST /v1/completions "), "{first}");
        let mut body = vec![0; len];
        conn.read_exact(&mut body).unwrap();
        body
    }

    /// The bench engine's API on one kept-alive connection, four requests written at once:
    /// a streamed completion with a body of over 100 KB (one event per token, then the
    /// usage with the cached tokens, then `[DONE]`), one that is not streamed, a wrong path
    /// after empty lines, and a malformed body; every job reaches the engine with its
    /// prompt and output length.
    #[test]
    fn the_bench_engine_answers_every_request_on_one_connection() {
        let (jobs, taken) = flume::unbounded::<HttpJob>();
        let (port_tx, port_rx) = flume::bounded(1);
        // The server's executor, alive until `stop` is dropped.
        let (stop, stopped) = flume::bounded::<()>(1);
        let server = std::thread::spawn(move || {
            on_executor(move || async move {
                port_tx.send(serve_engine(64, jobs).unwrap()).unwrap();
                let _ = stopped.recv_async().await;
            })
        });
        let port = port_rx.recv().unwrap();
        let engine = std::thread::spawn(move || {
            let mut seen = Vec::new();
            for job in taken.iter().take(2) {
                let r = &job.request;
                seen.push((r.input_tokens, r.output_tokens, r.blocks.len()));
                job.tokens.send(Tok::First { cached_blocks: 1 }).unwrap();
                for _ in 1..r.output_tokens {
                    job.tokens.send(Tok::Token).unwrap();
                }
                job.tokens.send(Tok::Done).unwrap();
            }
            seen
        });
        // Four requests written at once, each answer read with the load generator's own
        // decoder: a body of over 100 KB, streamed; one not streamed; a wrong path after
        // empty lines; a malformed body.
        let answers = on_executor(move || async move {
            let post = |path: &str, body: &str| {
                format!(
                    "POST {path} HTTP/1.1\r\nhost: e\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                )
            };
            let prompt: Vec<u32> = (0..20_000).collect();
            let streamed = serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 5,
                "stream": true, "stream_options": {"include_usage": true}});
            let whole = serde_json::json!({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 3});
            let requests = [
                post("/v1/completions", &streamed.to_string()),
                post("/v1/completions", &whole.to_string()),
                "\r\n\r\n".to_owned() + &post("/v1/chat/completions", "{}"),
                post("/v1/completions", "{\"prompt\": [1,"),
            ];
            let mut conn = GlommioStream::connect(("127.0.0.1", port)).await.unwrap();
            conn.set_read_timeout(Some(Duration::from_secs(30)))
                .unwrap();
            conn.write_all(requests.concat().as_bytes()).await.unwrap();
            let (mut answers, mut left) = (Vec::new(), Vec::new());
            for k in 0..requests.len() {
                let mut reader = SseReader::new(&mut conn);
                reader.buf = std::mem::take(&mut left);
                let code = reader.head().await.unwrap().code;
                let mut parts = Vec::new();
                if k == 0 {
                    while let Some(event) = reader.next_event().await.unwrap() {
                        parts.push(event);
                    }
                } else {
                    parts.push(reader.body_text().await.unwrap());
                }
                left = std::mem::take(&mut reader.buf);
                answers.push((code, parts));
            }
            answers
        });
        let codes: Vec<u16> = answers.iter().map(|a| a.0).collect();
        assert_eq!(codes, [200, 200, 404, 400]);
        let events = &answers[0].1;
        assert_eq!(events.len(), 7, "{events:?}");
        assert_eq!(events[6], "[DONE]");
        for (k, e) in events[..5].iter().enumerate() {
            let v: serde_json::Value = serde_json::from_str(e).unwrap();
            let finish = if k == 4 {
                "length".into()
            } else {
                serde_json::Value::Null
            };
            assert_eq!(v["choices"][0]["finish_reason"], finish, "{e}");
        }
        let usage: serde_json::Value = serde_json::from_str(&events[5]).unwrap();
        assert_eq!(usage["usage"]["completion_tokens"], 5);
        assert_eq!(usage["usage"]["prompt_tokens"], 20_000);
        assert_eq!(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 64);
        let v: serde_json::Value = serde_json::from_str(&answers[1].1[0]).unwrap();
        assert_eq!(v["choices"][0]["text"], " t t t");
        assert_eq!(v["usage"]["completion_tokens"], 3);
        // 312 full blocks of 64 in the first prompt, none in the second.
        assert_eq!(engine.join().unwrap(), [(20_000, 5, 312), (3, 3, 0)]);
        drop(stop);
        server.join().unwrap();
    }

    fn answer(conn: &mut TcpStream) {
        let body = "data: {\"choices\":[{\"text\":\" t\"}]}\n\ndata: [DONE]\n\n";
        write!(
            conn,
            "HTTP/1.1 200 OK\r\nx-kvrouter-worker-id: 2\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
    }

    /// The body as the front parses it: every id, in order, and the streaming options.
    fn check_body(body: &[u8], ids: &[u32], max_tokens: u32) {
        let v: serde_json::Value = serde_json::from_slice(body).unwrap();
        assert_eq!(v["model"], MODEL);
        assert_eq!(v["prompt"], serde_json::json!(ids));
        assert_eq!(v["max_tokens"], max_tokens);
        assert_eq!(v["stream"], true);
        assert_eq!(v["stream_options"]["include_usage"], true);
    }

    /// The front closes a kept-alive connection while idle: the next request, written
    /// to it, gets no answer, and is written again (its ids asked for again) on a new
    /// connection. Each body arrives whole, at its content length: the second request
    /// on a connection would not parse otherwise.
    #[test]
    fn a_request_on_a_closed_pooled_connection_is_written_again() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let front = std::thread::spawn(move || {
            let mut bodies = Vec::new();
            // Two requests on the first connection, then it is closed while idle.
            let (conn, _) = listener.accept().unwrap();
            let mut r = BufReader::new(conn.try_clone().unwrap());
            let mut w = conn;
            for _ in 0..2 {
                bodies.push(read_one(&mut r));
                answer(&mut w);
            }
            drop((r, w));
            let (conn, _) = listener.accept().unwrap();
            let mut r = BufReader::new(conn.try_clone().unwrap());
            bodies.push(read_one(&mut r));
            let mut w = conn;
            answer(&mut w);
            bodies
        });
        const PROMPTS: [&[u32]; 3] = [&[0, 9, 10, 99_999, u32::MAX, 7], &[], &[3, 4, 5]];
        let calls = on_executor(move || async move {
            let client = Client::new(addr, Duration::from_secs(10));
            let start = Instant::now();
            let asked = AtomicUsize::new(0);
            let mut calls = Vec::new();
            for (i, p) in PROMPTS.iter().enumerate() {
                let ids = || {
                    asked.fetch_add(1, Ordering::Relaxed);
                    p.iter().copied()
                };
                let a = client.complete(i, ids, 2, start).await.unwrap();
                assert_eq!((a.index, a.worker, a.cached_tokens), (i, 1, 0));
                calls.push(asked.swap(0, Ordering::Relaxed));
            }
            calls
        });
        // Sized, then written: twice more for the third, on the closed connection first.
        assert_eq!(calls, [2, 2, 4]);
        let bodies = front.join().unwrap();
        assert_eq!(bodies.len(), 3);
        for (body, p) in bodies.iter().zip(PROMPTS) {
            check_body(body, p, 2);
        }
    }

    /// A kept-alive connection whose front does not answer in time: the request fails
    /// and is not sent a second time (the front may be serving the first).
    #[test]
    fn a_request_the_front_is_slow_to_answer_is_not_sent_twice() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (done, finished) = flume::bounded::<()>(1);
        let front = std::thread::spawn(move || {
            let (conn, _) = listener.accept().unwrap();
            let mut r = BufReader::new(conn.try_clone().unwrap());
            let mut w = conn;
            read_one(&mut r);
            answer(&mut w);
            read_one(&mut r);
            // No answer to the second request until the client has given up on it.
            finished.recv().unwrap();
            listener.set_nonblocking(true).unwrap();
            let again = listener.accept();
            assert!(
                again
                    .as_ref()
                    .is_err_and(|e| e.kind() == std::io::ErrorKind::WouldBlock),
                "{again:?}"
            );
        });
        // Long enough for the first answer on a loaded host; the second never comes.
        let slow = on_executor(move || async move {
            let client = Client::new(addr, Duration::from_secs(1));
            let start = Instant::now();
            client
                .complete(0, || [1u32].into_iter(), 1, start)
                .await
                .unwrap();
            client
                .complete(1, || [2u32].into_iter(), 1, start)
                .await
                .map(|a| a.index)
        });
        assert!(slow.is_err());
        done.send(()).unwrap();
        front.join().unwrap();
    }
}
