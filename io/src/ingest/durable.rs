//! The JetStream durable mode: the kv-events subject captured by a stream, read through
//! this replica's durable consumer, acknowledged once every shard has applied what was
//! handed to it. Restarts resume from the snapshot's stream position.

use std::cell::{Cell, RefCell};
use std::time::Duration;

use super::hub::Hub;
use super::nats_source::NatsSource;
use crate::nats::jetstream::{self, ConsumerSpec, StreamSpec};
use crate::nats::{Client, NatsError};

/// The durable mode's state on the source core.
#[derive(Debug, Default)]
pub(super) struct Durable {
    /// The stream sequence of the last message handed to the shards in full.
    pub(super) dispatched_seq: Cell<u64>,
    /// The ack subject of the last message handed to the shards, not yet acknowledged.
    pub(super) ack_reply: RefCell<Option<String>>,
    /// The consumer exists and delivers.
    pub(super) consumer_ready: Cell<bool>,
}

impl Durable {
    pub(super) fn new(stream_seq: u64) -> Self {
        Self {
            dispatched_seq: Cell::new(stream_seq),
            ..Self::default()
        }
    }
}

/// Binds the stream (created when missing) and checks it against the snapshot's
/// position: a stream behind the snapshot was re-created and is replayed from its start.
pub(super) async fn bind_stream(hub: &Hub, client: &Client) -> Result<(), jetstream::JsError> {
    let Some(d) = &hub.cfg.durable else {
        return Ok(());
    };
    let spec = StreamSpec {
        name: d.stream.clone(),
        subjects: vec![hub.cfg.subjects.kv_events()],
        max_age: d.max_age,
        max_bytes: None,
    };
    let st = jetstream::ensure_stream(client, &spec, Duration::from_secs(5)).await?;
    let from = hub.durable.dispatched_seq.get();
    if from > st.last_seq {
        // The stream was re-created (or its store wiped) since the snapshot: its
        // numbering started over. Replay all of it.
        tracing::warn!(
            snapshot_seq = from,
            last_seq = st.last_seq,
            "the stream is behind the snapshot (re-created?): replaying it from the start"
        );
        hub.durable.dispatched_seq.set(0);
    } else if from > 0 && st.first_seq > from + 1 {
        tracing::warn!(
            snapshot_seq = from,
            first_seq = st.first_seq,
            "the stream no longer holds every message after the snapshot: workers with a local indexer will be resynchronised by gap recovery"
        );
    }
    tracing::info!(stream = %d.stream, first_seq = st.first_seq, last_seq = st.last_seq, "stream bound");
    Ok(())
}

impl NatsSource {
    /// Durable mode: (re)creates this replica's consumer right after the last message
    /// handed to the shards and feeds its deliveries to the shards in order. A delivery
    /// that skips consumer sequences (messages lost in flight: a full subscription buffer,
    /// a broker restart) re-creates the consumer after the last message applied, so that
    /// events are never applied out of order; redeliveries of applied messages are skipped.
    pub(super) async fn consume_durable(&self, client: &Client) {
        let Some(d) = self.hub.cfg.durable.clone() else {
            return;
        };
        let mut generation = 0u64;
        let mut backoff = Duration::from_millis(50);
        loop {
            generation += 1;
            let deliver = format!("_KVROUTER.{:x}.{generation}", self.hub.cfg.router_id);
            let sub = match client.subscribe(&deliver, None) {
                Ok(s) => s,
                Err(NatsError::Closed) => return,
                Err(e) => {
                    crate::warn_throttled!(error = %e, "cannot subscribe the delivery subject; retrying");
                    glommio::timer::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                    continue;
                }
            };
            let after = self.hub.durable.dispatched_seq.get();
            let spec = ConsumerSpec {
                stream: d.stream.clone(),
                durable: d.consumer.clone(),
                deliver_subject: deliver.clone(),
                start_seq: (after > 0).then_some(after + 1),
                max_ack_pending: d.max_ack_pending,
                ack_wait: d.ack_wait,
                idle_heartbeat: Some(d.idle_heartbeat),
            };
            self.hub.durable.consumer_ready.set(false);
            if let Err(e) =
                jetstream::recreate_consumer(client, &spec, Duration::from_secs(5)).await
            {
                if matches!(e, jetstream::JsError::Nats(NatsError::Closed)) {
                    return;
                }
                crate::warn_throttled!(error = %crate::Chain(&e), "cannot create the durable consumer; retrying");
                glommio::timer::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
            backoff = Duration::from_millis(50);
            self.hub.durable.consumer_ready.set(true);
            tracing::info!(consumer = %d.consumer, from_seq = after + 1, "durable consumer ready");
            let mut last_cseq = 0u64;
            // The server sends an idle heartbeat when it has nothing to deliver; silence
            // while connected means the consumer is gone (deleted, or lost with the broker's
            // store).
            let silence = d.idle_heartbeat * 3;
            loop {
                let next = async { Some(sub.next().await) };
                let timeout = async {
                    glommio::timer::sleep(silence).await;
                    None
                };
                let msg = match futures_lite::future::or(next, timeout).await {
                    Some(Some(m)) => m,
                    Some(None) => return, // the client closed
                    None if client.is_connected() => {
                        self.hub.bump(|s| s.js_resets += 1);
                        crate::warn_throttled!(
                            "no deliveries nor heartbeats from the consumer: re-creating it"
                        );
                        break;
                    }
                    None => continue, // disconnected: the client reconnects
                };
                let Some(reply) = msg.reply else {
                    continue; // a status message (idle heartbeat)
                };
                let Some(dl) = jetstream::parse_ack_subject(&reply) else {
                    self.hub.bump(|s| s.decode_errors += 1);
                    crate::warn_throttled!(%reply, "delivery without a JetStream ack subject skipped");
                    continue;
                };
                let applied = dl.stream_seq <= self.hub.durable.dispatched_seq.get();
                if dl.delivered == 1 && (dl.consumer_seq <= last_cseq || applied) {
                    // A first delivery can neither repeat a consumer sequence nor go back in
                    // the stream: the consumer or the stream was re-created behind our back.
                    self.hub.bump(|s| s.js_resets += 1);
                    if applied {
                        crate::warn_throttled!(
                            stream_seq = dl.stream_seq,
                            applied = self.hub.durable.dispatched_seq.get(),
                            "the stream's numbering went back (re-created?): replaying it from the start"
                        );
                        self.hub.durable.dispatched_seq.set(0);
                    } else {
                        crate::warn_throttled!(
                            "the consumer was re-created by someone else (two replicas with one consumer name?)"
                        );
                    }
                    break;
                }
                if dl.consumer_seq <= last_cseq || applied {
                    self.hub.bump(|s| s.js_redelivered += 1);
                    last_cseq = last_cseq.max(dl.consumer_seq);
                    continue;
                }
                if dl.consumer_seq > last_cseq + 1 {
                    self.hub.bump(|s| s.js_resets += 1);
                    crate::warn_throttled!(
                        expected = last_cseq + 1,
                        got = dl.consumer_seq,
                        "deliveries lost in flight: re-creating the consumer after the last applied message"
                    );
                    break;
                }
                last_cseq = dl.consumer_seq;
                self.on_events(&msg.payload).await;
                self.hub.durable.dispatched_seq.set(dl.stream_seq);
                *self.hub.durable.ack_reply.borrow_mut() = Some(reply);
            }
        }
    }

    /// Durable mode: once every shard has applied what was handed to it, acknowledges the
    /// last message (acknowledgement policy `all` covers every earlier one).
    pub(super) async fn ack_applied(&self, client: &Client) {
        let Some(reply) = self.hub.durable.ack_reply.borrow_mut().take() else {
            return;
        };
        self.hub.shards.barrier().await;
        if client.publish(&reply, b"+ACK").await.is_ok() {
            self.hub.bump(|s| s.js_acks += 1);
        }
    }
}
