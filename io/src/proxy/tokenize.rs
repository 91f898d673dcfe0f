//! Preparing a request (parsing its body, tokenising its prompt:
//! [`super::request::prepare`]) off the front's executor.
//!
//! Encoding costs about half a microsecond per prompt token with the Hugging Face
//! tokenizer (measured: 0.26 ms for 520 tokens, 26 ms for 29 k), and the front's executor
//! also relays every stream: a long prompt tokenised there stalls every other request's
//! chunks for that long, and the front can use only that one core. Bodies above a size
//! (`inline_tokenize_bytes`) go to a pool of plain threads instead; the executor awaits
//! the answer on a channel and keeps relaying. Small bodies stay inline: their encoding is
//! shorter than a hand-off between threads. Between the two sizes, a body goes inline
//! while inline encoding has taken under [`INLINE_SHARE`] of the executor's recent time,
//! and to the pool past it: alone, inline is the shortest path (the hand-off adds about 0.1
//! ms at 1 k requests/s); under load, the front's one core is the limit, and the pool's
//! cores take the encoding off it. (Counting the requests being prepared does not work as
//! the signal: while the executor encodes, the requests queued behind it have not been
//! read, so it sees none.) Each card is shared (`Arc`): the tokenizer and the template
//! environment are `Send + Sync`, and encoding takes `&self`.

use std::cell::Cell;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::front::Endpoint;
use super::request::{Models, Prepared, Reject, prepare};

/// A prepared request (or why not), and the preparation's time.
pub(super) struct Done {
    pub(super) prepared: Result<Prepared, Reject>,
    pub(super) took: Duration,
}

struct Job {
    models: Arc<Models>,
    body: Bytes,
    ep: Endpoint,
    reply: flume::Sender<Done>,
}

/// The pool: threads taking jobs from one channel.
pub(super) struct Tokenizers {
    tx: Option<flume::Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
    inline_bytes: usize,
    /// Inline encoding time, ns, decayed with [`SHARE_WINDOW`]: over the window's length,
    /// the executor's recent share spent encoding (one executor: a `Cell`).
    inline_ns: Cell<f64>,
    /// When `inline_ns` was last decayed.
    decayed_at: Cell<Instant>,
}

/// Bodies of at most this many bytes are tokenised inline even under load: their encoding
/// (about 100 tokens, 50 µs) is not much longer than the hand-off.
const ALWAYS_INLINE_BYTES: usize = 512;

/// The share of the executor's time that inline encoding may take before mid-sized bodies
/// go to the pool.
const INLINE_SHARE: f64 = 0.3;

/// Time constant of the inline share's decay, ns.
const SHARE_WINDOW: f64 = 10e6;

fn run(models: &Models, body: &[u8], ep: Endpoint) -> Done {
    let t = Instant::now();
    let prepared = prepare(models, body, ep);
    Done {
        prepared,
        took: t.elapsed(),
    }
}

impl Tokenizers {
    /// `threads` workers (0: every request inline); bodies of at most `inline_bytes` are
    /// tokenised inline.
    pub(super) fn new(threads: usize, inline_bytes: usize) -> std::io::Result<Self> {
        let (tx, rx) = flume::bounded::<Job>(threads.max(1) * 64);
        let mut handles = Vec::with_capacity(threads);
        for i in 0..threads {
            let rx = rx.clone();
            handles.push(
                std::thread::Builder::new()
                    .name(format!("kvrouter-tok-{i}"))
                    .spawn(move || {
                        while let Ok(job) = rx.recv() {
                            // A client gone meanwhile drops the receiver: nothing to do.
                            let _ = job.reply.send(run(&job.models, &job.body, job.ep));
                        }
                    })?,
            );
        }
        Ok(Self {
            tx: (threads > 0).then_some(tx),
            threads: handles,
            inline_bytes,
            inline_ns: Cell::new(0.0),
            decayed_at: Cell::new(Instant::now()),
        })
    }

    /// The executor's recent share spent encoding inline, decayed to now.
    fn inline_share(&self) -> f64 {
        let now = Instant::now();
        let dt = now.duration_since(self.decayed_at.get()).as_nanos() as f64;
        let ns = self.inline_ns.get() * (-dt / SHARE_WINDOW).exp();
        self.inline_ns.set(ns);
        self.decayed_at.set(now);
        ns / SHARE_WINDOW
    }

    /// Whether a body of `body_len` bytes goes to the pool (when there is one).
    fn offload(&self, body_len: usize) -> bool {
        body_len > self.inline_bytes
            || (body_len > ALWAYS_INLINE_BYTES.min(self.inline_bytes)
                && self.inline_share() > INLINE_SHARE)
    }

    /// A request prepared, on a worker thread or inline.
    pub(super) async fn prepare(&self, models: &Arc<Models>, body: Bytes, ep: Endpoint) -> Done {
        let Some(tx) = self.tx.as_ref().filter(|_| self.offload(body.len())) else {
            let done = run(models, &body, ep);
            self.inline_ns
                .set(self.inline_ns.get() + done.took.as_nanos() as f64);
            return done;
        };
        let (reply, answer) = flume::bounded(1);
        let job = Job {
            models: Arc::clone(models),
            body,
            ep,
            reply,
        };
        if let Err(e) = tx.send_async(job).await {
            // The pool is gone (shutting down): do it here.
            let job = e.into_inner();
            return run(&job.models, &job.body, job.ep);
        }
        match answer.recv_async().await {
            Ok(done) => done,
            // A worker cannot drop a job unanswered unless it panicked in the tokenizer.
            Err(_) => Done {
                prepared: Err(Reject {
                    status: 500,
                    kind: "internal_error",
                    message: "the tokenizer thread failed".into(),
                }),
                took: Duration::ZERO,
            },
        }
    }
}

impl Drop for Tokenizers {
    fn drop(&mut self) {
        self.tx = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn mid_sized_bodies_leave_the_executor_only_when_inline_encoding_is_busy() {
        let t = Tokenizers::new(1, 2048).unwrap();
        assert!(!t.offload(ALWAYS_INLINE_BYTES));
        assert!(!t.offload(1000), "an idle front encodes inline");
        assert!(t.offload(2049), "past inline_bytes always to the pool");
        // Half of the last window spent encoding inline: mid-sized bodies go to the pool,
        // small ones stay.
        t.inline_ns.set(0.5 * SHARE_WINDOW);
        assert!(t.offload(1000));
        assert!(!t.offload(ALWAYS_INLINE_BYTES));
        // The share decays: after a few windows of idleness, inline again.
        t.decayed_at
            .set(Instant::now() - Duration::from_nanos(5 * SHARE_WINDOW as u64));
        assert!(!t.offload(1000));
        // Without a pool, everything is inline (tokenize's filter), whatever offload says.
        let none = Tokenizers::new(0, 2048).unwrap();
        assert!(none.tx.is_none());
    }
}
