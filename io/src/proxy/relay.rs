//! The engine's answer on its way back to the client, and the life of an active request
//! until it is freed (see the [module docs](super)): a whole answer is read and forwarded
//! at once; a stream is relayed chunk by chunk (its first chunk marks the prefill done),
//! with the engine's usage counted as it passes.
//!
//! A stream ends for the client at the engine's `data: [DONE]` event, the OpenAI
//! protocol's last one: that chunk and the chunked body's terminator leave in one write,
//! and the request is freed then, without waiting for the engine's own terminator (one
//! executor turn later, one system call more per request). The rest of the engine's
//! answer is read by a task of its own ([`drain`]), which gives the connection back to
//! the pool at its end; anything the engine sends after `[DONE]` is dropped and counted
//! (`kvrouter_proxy_upstream_errors_total{kind="after_done"}`).

use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{HeaderMap, HeaderValue};
use hyper::{Response, StatusCode};
use kvrouter_core::decision::Decision;
use serde_json::Value as Json;

use super::front::{Front, error, hop_by_hop};
use super::stats::ProxyStats;
use super::upstream::Conn;
use crate::routing::Update;

impl Front {
    /// The engine's answer, relayed.
    pub(super) async fn answer(
        self: &Rc<Self>,
        resp: Response<Incoming>,
        conn: Conn,
        d: Decision,
        mut life: Life,
        stream: bool,
    ) -> Response<ProxyBody> {
        let (parts, body) = resp.into_parts();
        let mut out_headers = HeaderMap::new();
        for (k, v) in &parts.headers {
            if !hop_by_hop(k) {
                out_headers.append(k, v.clone());
            }
        }
        out_headers.insert(
            "x-kvrouter-worker-id",
            HeaderValue::from(d.worker.worker_id),
        );
        out_headers.insert("x-kvrouter-dp-rank", HeaderValue::from(d.worker.dp_rank));
        out_headers.insert(
            "x-kvrouter-overlap-blocks",
            HeaderValue::from(d.overlap_blocks),
        );
        if let Ok(v) = HeaderValue::from_str(&d.request_id) {
            out_headers.insert("x-kvrouter-request-id", v);
        }
        let streaming = stream && parts.status == StatusCode::OK;
        if streaming {
            let relay = Relay {
                upstream: Some(body),
                conn: Some(conn),
                idle: glommio::timer::Timer::new(self.cfg.upstream.idle_timeout),
                life,
                done: false,
            };
            let mut r = Response::new(ProxyBody::Relay(Box::new(relay)));
            *r.status_mut() = parts.status;
            *r.headers_mut() = out_headers;
            return r;
        }
        let idle = self.cfg.upstream.idle_timeout;
        let read = async {
            body.collect()
                .await
                .map(|c| c.to_bytes())
                .map_err(|e| e.to_string())
        };
        let late = async {
            glommio::timer::sleep(idle).await;
            Err(format!("no answer within {idle:?}"))
        };
        let bytes = futures_lite::future::or(read, late).await;
        match bytes {
            Ok(bytes) => {
                self.pool.put(conn, self.cfg.upstream.max_idle_per_engine);
                self.usage(&bytes);
                life.finish();
                let mut r = Response::new(ProxyBody::full(bytes.to_vec()));
                *r.status_mut() = parts.status;
                *r.headers_mut() = out_headers;
                r
            }
            Err(e) => {
                life.finish();
                self.stats.upstream_error("body");
                error(502, "upstream_error", format!("worker {}: {e}", d.worker))
            }
        }
    }

    /// Counts the cached tokens an engine reports in an answer's `usage` (a JSON body, or
    /// the `data:` lines of a stream chunk).
    fn usage(&self, bytes: &[u8]) {
        if memchr::memmem::find(bytes, b"cached_tokens").is_none() {
            return;
        }
        let seen = |v: &Json| {
            let u = &v["usage"];
            if let Some(c) = u["prompt_tokens_details"]["cached_tokens"].as_u64() {
                self.stats.add(&self.stats.engine_cached_tokens, c);
                self.stats.add(
                    &self.stats.engine_reported_prompt_tokens,
                    u["prompt_tokens"].as_u64().unwrap_or(0),
                );
            }
        };
        if let Ok(v) = serde_json::from_slice::<Json>(bytes) {
            seen(&v);
            return;
        }
        for line in bytes.split(|&b| b == b'\n') {
            if let Some(data) = line.strip_prefix(b"data: ")
                && let Ok(v) = serde_json::from_slice::<Json>(data)
            {
                seen(&v);
            }
        }
    }
}

/// Counts a request in flight until dropped.
pub(super) struct Inflight(Rc<ProxyStats>);

impl Inflight {
    pub(super) fn new(stats: Rc<ProxyStats>) -> Self {
        stats.inflight.set(stats.inflight.get() + 1);
        Inflight(stats)
    }
}

impl Drop for Inflight {
    fn drop(&mut self) {
        self.0.inflight.set(self.0.inflight.get().saturating_sub(1));
    }
}

/// An active request's slot, from its answer's headers to its end: the first chunk marks
/// its prefill done, its end frees it; dropped before the end (the client left), it is
/// freed and counted as a disconnect.
pub(super) struct Life {
    front: Rc<Front>,
    request_id: String,
    started: Instant,
    first: Option<Instant>,
    last: Instant,
    freed: bool,
    _inflight: Inflight,
}

impl Life {
    /// The life of `request_id`, from `started` (when its request arrived).
    pub(super) fn new(
        front: Rc<Front>,
        request_id: String,
        started: Instant,
        inflight: Inflight,
    ) -> Self {
        Life {
            front,
            request_id,
            started,
            first: None,
            last: started,
            freed: false,
            _inflight: inflight,
        }
    }

    fn chunk(&mut self) {
        let now = Instant::now();
        match self.first {
            None => {
                self.first = Some(now);
                let _ = self
                    .front
                    .state
                    .borrow_mut()
                    .update(&self.request_id, Update::FirstToken);
                self.front
                    .stats
                    .ttft
                    .observe((now - self.started).as_secs_f64());
            }
            Some(_) => self
                .front
                .stats
                .itl
                .observe((now - self.last).as_secs_f64()),
        }
        self.last = now;
    }

    fn finish(&mut self) {
        if !self.freed {
            self.freed = true;
            self.front.free(&self.request_id);
            self.front
                .stats
                .e2e
                .observe(self.started.elapsed().as_secs_f64());
        }
    }
}

impl Drop for Life {
    fn drop(&mut self) {
        if !self.freed {
            self.front
                .stats
                .add(&self.front.stats.client_disconnects, 1);
            self.finish();
        }
    }
}

/// A streamed answer on its way to the client.
pub(super) struct Relay {
    /// The engine's body; handed to [`drain`] when the stream ends at `[DONE]`.
    upstream: Option<Incoming>,
    /// The engine connection; back to the pool at the end, dropped (closed) otherwise.
    conn: Option<Conn>,
    idle: glommio::timer::Timer,
    life: Life,
    done: bool,
}

/// An SSE event the OpenAI SDKs raise as an error.
fn error_event(message: &str) -> Bytes {
    let v = serde_json::json!({"error": {"message": message, "type": "upstream_error", "param": null, "code": 502}});
    Bytes::from(format!("data: {v}\n\n"))
}

/// Whether an SSE chunk ends with the `data: [DONE]` event.
fn ends_with_done(data: &[u8]) -> bool {
    // An event ends with a blank line: at least two line ends (CRLF, LF or CR, each one)
    // after its last field.
    let mut end = data.len();
    let mut line_ends = 0;
    while end > 0 && matches!(data[end - 1], b'\n' | b'\r') {
        end -= if data[end - 1] == b'\n' && end >= 2 && data[end - 2] == b'\r' {
            2
        } else {
            1
        };
        line_ends += 1;
    }
    line_ends >= 2 && data[..end].ends_with(b"data: [DONE]") && {
        let start = end - b"data: [DONE]".len();
        start == 0 || matches!(data[start - 1], b'\n' | b'\r')
    }
}

/// Reads what is left of an engine's answer after its `[DONE]` (normally only the chunked
/// body's terminator), then gives its connection back to the pool. A stream that breaks or
/// goes idle here closes its connection; data after `[DONE]` is counted and dropped.
async fn drain(front: Rc<Front>, mut body: Incoming, conn: Conn) {
    let idle = front.cfg.upstream.idle_timeout;
    let mut extra = false;
    loop {
        let next = async { Some(body.frame().await) };
        let late = async {
            glommio::timer::sleep(idle).await;
            None
        };
        match futures_lite::future::or(next, late).await {
            Some(Some(Ok(frame))) => {
                if frame.data_ref().is_some_and(|d| !d.is_empty()) && !extra {
                    extra = true;
                    front.stats.upstream_error("after_done");
                    crate::warn_throttled!(
                        "an engine sent data after its stream's [DONE]; dropped (kind after_done)"
                    );
                }
            }
            Some(None) => {
                front.pool.put(conn, front.cfg.upstream.max_idle_per_engine);
                return;
            }
            Some(Some(Err(_))) | None => return,
        }
    }
}

impl Relay {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let Some(upstream) = self.upstream.as_mut() else {
            return Poll::Ready(None);
        };
        match Pin::new(upstream).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref()
                    && !data.is_empty()
                {
                    self.life.chunk();
                    self.life.front.usage(data);
                    if ends_with_done(data) {
                        // The client's stream ends with this chunk (`is_end_stream` is
                        // true from now on, so the terminator leaves with it).
                        self.done = true;
                        self.life.finish();
                        if let (Some(body), Some(conn)) = (self.upstream.take(), self.conn.take()) {
                            glommio::spawn_local(drain(self.life.front.clone(), body, conn))
                                .detach();
                        }
                        return Poll::Ready(Some(Ok(frame)));
                    }
                }
                self.idle.reset(self.life.front.cfg.upstream.idle_timeout);
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                self.done = true;
                self.life.front.stats.upstream_error("stream");
                self.life.finish();
                Poll::Ready(Some(Ok(Frame::data(error_event(&format!(
                    "the engine's stream broke: {e}"
                ))))))
            }
            Poll::Ready(None) => {
                self.done = true;
                self.life.finish();
                if let Some(c) = self.conn.take() {
                    self.life
                        .front
                        .pool
                        .put(c, self.life.front.cfg.upstream.max_idle_per_engine);
                }
                Poll::Ready(None)
            }
            Poll::Pending => {
                if Pin::new(&mut self.idle).poll(cx).is_ready() {
                    self.done = true;
                    self.life.front.stats.upstream_error("idle_timeout");
                    self.life.finish();
                    self.conn = None;
                    return Poll::Ready(Some(Ok(Frame::data(error_event(
                        "the engine sent nothing for too long",
                    )))));
                }
                Poll::Pending
            }
        }
    }
}

/// The body of a proxy answer: whole, or relayed.
pub(super) enum ProxyBody {
    Full(Option<Bytes>),
    Relay(Box<Relay>),
}

impl ProxyBody {
    pub(super) fn full(b: impl Into<Bytes>) -> Self {
        ProxyBody::Full(Some(b.into()))
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        match self.get_mut() {
            ProxyBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            ProxyBody::Relay(r) => r.poll(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ProxyBody::Full(b) => b.is_none(),
            ProxyBody::Relay(r) => r.done,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ProxyBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            ProxyBody::Full(None) => SizeHint::with_exact(0),
            ProxyBody::Relay(_) => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ends_with_done;

    #[test]
    fn a_stream_ends_only_at_a_whole_done_event() {
        for end in [
            &b"data: [DONE]\n\n"[..],
            b"data: {\"choices\":[]}\n\ndata: [DONE]\n\n",
            b"data: [DONE]\r\n\r\n",
            b"data: [DONE]\n\r\n",
            b"data: {}\r\rdata: [DONE]\r\r",
        ] {
            assert!(ends_with_done(end), "{:?}", String::from_utf8_lossy(end));
        }
        for not in [
            &b"data: [DONE]"[..],
            b"data: [DONE]\n",
            b"data: [DONE]\r\n",
            b"data: x[DONE]\n\n",
            b"data: {\"text\": \"data: [DONE]\"}\n\n",
            b"\n\n",
            b"",
        ] {
            assert!(!ends_with_done(not), "{:?}", String::from_utf8_lossy(not));
        }
    }
}
