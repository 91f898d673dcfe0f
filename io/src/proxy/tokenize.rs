//! Tokenisation off the front's executor.
//!
//! Encoding costs about half a microsecond per prompt token with the Hugging Face
//! tokenizer (measured: 0.26 ms for 520 tokens, 26 ms for 29 k), and the front's executor
//! also relays every stream: a long prompt tokenised there stalls every other request's
//! chunks for that long, and the front can use only that one core. Bodies above a size
//! (`inline_tokenize_bytes`) go to a pool of plain threads instead; the executor awaits
//! the answer on a channel and keeps relaying. Small bodies stay inline: their encoding is
//! shorter than a hand-off between threads. Each card is shared (`Arc`): the tokenizer and
//! the template environment are `Send + Sync`, and encoding takes `&self`.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value as Json;

use super::front::Endpoint;
use super::model::{ModelCard, PromptError};

/// A tokenised request: its parsed body back, its ids (or why not), the encoding's time.
pub(super) struct Done {
    pub(super) json: Json,
    pub(super) tokens: Result<Vec<u32>, PromptError>,
    pub(super) took: Duration,
}

struct Job {
    card: Arc<ModelCard>,
    json: Json,
    ep: Endpoint,
    reply: flume::Sender<Done>,
}

/// The pool: threads taking jobs from one channel.
pub(super) struct Tokenizers {
    tx: Option<flume::Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
    inline_bytes: usize,
}

fn run(card: &ModelCard, json: Json, ep: Endpoint) -> Done {
    let t = Instant::now();
    let tokens = match ep {
        Endpoint::Chat => card.chat_tokens(&json),
        Endpoint::Completions => card.completion_tokens(&json),
    };
    Done {
        json,
        tokens,
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
                            let _ = job.reply.send(run(&job.card, job.json, job.ep));
                        }
                    })?,
            );
        }
        Ok(Self {
            tx: (threads > 0).then_some(tx),
            threads: handles,
            inline_bytes,
        })
    }

    /// The ids of a request of `body_len` bytes, on a worker thread or inline.
    pub(super) async fn tokenize(
        &self,
        card: &Arc<ModelCard>,
        json: Json,
        ep: Endpoint,
        body_len: usize,
    ) -> Done {
        let Some(tx) = self.tx.as_ref().filter(|_| body_len > self.inline_bytes) else {
            return run(card, json, ep);
        };
        let (reply, answer) = flume::bounded(1);
        let job = Job {
            card: Arc::clone(card),
            json,
            ep,
            reply,
        };
        if let Err(e) = tx.send_async(job).await {
            // The pool is gone (shutting down): do it here.
            let job = e.into_inner();
            return run(&job.card, job.json, job.ep);
        }
        match answer.recv_async().await {
            Ok(done) => done,
            // A worker cannot drop a job unanswered unless it panicked in the tokenizer.
            Err(_) => Done {
                json: Json::Null,
                tokens: Err(PromptError::Tokenize("the tokenizer thread failed".into())),
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
