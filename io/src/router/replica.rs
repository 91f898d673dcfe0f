//! Replica sync: this router's slot changes out to the other replicas, theirs in, over
//! NATS on Dynamo 1.6.1's `active_sequences_events` subject and wire (so Dynamo's own
//! routers and ours can share one fleet's load picture).
//!
//! Outgoing events go through a bounded queue to a publisher task that batches up to 256
//! events or 1 ms; a full queue drops the event and counts it (the decision itself never
//! waits on NATS). Incoming messages are applied in arrival order; a router skips its own.
//!
//! Every message fits the broker's `max_payload`: a batch that does not is split in
//! halves until each part fits, so one big event never costs the others their message. An
//! `AddRequest` that does not fit alone goes in a degraded form, its `token_sequence` cut
//! to the longest prefix that fits (the other replicas then count fewer of its blocks, but
//! they know the request, its prefill load, and its free); only an event that fits in no
//! form is not sent. [`ReplicaStats`] counts each of these: `out` is what the client took,
//! never what was merely queued.
//!
//! With the OpenAI front's session affinity, session bindings travel the same way on a
//! subject of their own (`kvrouter_session_bindings`, see
//! [`kvrouter_core::codec::session`]); how a replica takes them is
//! [`kvrouter_core::sessions`]'.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::{Duration, Instant};

use kvrouter_core::codec::replica::{self, ActiveSequenceEvent, ActiveSequenceEventData};
use kvrouter_core::codec::session::{self, SessionBinding};
use kvrouter_core::codec::{Envelope, TOPIC_ACTIVE_SEQUENCES, TOPIC_SESSION_BINDINGS};

use super::RouterConfig;
use super::endpoints::State;
use crate::nats::{Client, NatsError};

/// Events a router may queue for the publisher before it drops them.
pub(super) const QUEUE: usize = 1 << 16;

/// What the publisher did with the events it was handed (one executor: plain cells).
#[derive(Debug, Default)]
pub(super) struct ReplicaStats {
    /// Events in messages the NATS client accepted.
    pub(super) out: Cell<u64>,
    /// `AddRequest`s sent with their `token_sequence` cut to fit `max_payload`.
    pub(super) degraded: Cell<u64>,
    /// Events not sent: too big in every form, or their publish failed.
    pub(super) unsent: Cell<u64>,
    /// Messages published.
    pub(super) messages: Cell<u64>,
}

fn add(c: &Cell<u64>, n: u64) {
    c.set(c.get() + n);
}

/// Bytes the envelope adds around a payload (its header fields), with room to spare.
const ENVELOPE_ROOM: usize = 256;

/// The encoded payload of `batch` (one event: the single-event form, as before).
fn encode(batch: &[ActiveSequenceEvent]) -> Option<Vec<u8>> {
    let r = if batch.len() == 1 {
        replica::encode(&batch[0])
    } else {
        replica::encode_batch(batch)
    };
    match r {
        Ok(p) => Some(p),
        Err(e) => {
            crate::warn_throttled!(error = %e, events = batch.len(), "replica sync: cannot encode");
            None
        }
    }
}

/// Payloads of at most `max` bytes carrying `batch`, in order: split in halves until each
/// part fits, an oversized `AddRequest` cut to fit; what fits in no form is counted.
pub(super) fn pack(
    batch: &[ActiveSequenceEvent],
    max: usize,
    stats: &ReplicaStats,
) -> Vec<(Vec<u8>, usize)> {
    let mut out = Vec::new();
    let alone = |e: &ActiveSequenceEvent, size: usize| {
        let cut = degrade(e, size, max);
        if cut.is_some() {
            add(&stats.degraded, 1);
            crate::warn_throttled!(
                request_id = %e.request_id,
                bytes = size,
                max,
                "replica sync: a request's blocks exceed max_payload; sent cut to fit"
            );
        }
        cut
    };
    pack_into(batch, max, &encode, &alone, stats, &mut out);
    out
}

/// The payloads of session bindings, split as [`pack`] splits events (a binding is never
/// cut: one that fits in no message is counted and not sent).
fn pack_sessions(
    batch: &[SessionBinding],
    max: usize,
    stats: &ReplicaStats,
) -> Vec<(Vec<u8>, usize)> {
    let encode = |b: &[SessionBinding]| match session::encode_batch(b) {
        Ok(p) => Some(p),
        Err(e) => {
            crate::warn_throttled!(error = %e, "session sync: cannot encode");
            None
        }
    };
    let mut out = Vec::new();
    pack_into(batch, max, &encode, &|_, _| None, stats, &mut out);
    out
}

/// Splits `batch` in halves until each part's payload (`encode`) fits in `max`; a single
/// item that does not goes as `alone` makes it fit, or is counted unsent.
fn pack_into<T>(
    batch: &[T],
    max: usize,
    encode: &impl Fn(&[T]) -> Option<Vec<u8>>,
    alone: &impl Fn(&T, usize) -> Option<Vec<u8>>,
    stats: &ReplicaStats,
    out: &mut Vec<(Vec<u8>, usize)>,
) {
    if batch.is_empty() {
        return;
    }
    let size = match encode(batch) {
        Some(p) if p.len() <= max => {
            out.push((p, batch.len()));
            return;
        }
        size => size.map(|p| p.len()),
    };
    if batch.len() > 1 {
        let (a, b) = batch.split_at(batch.len() / 2);
        pack_into(a, max, encode, alone, stats, out);
        pack_into(b, max, encode, alone, stats, out);
        return;
    }
    match size.and_then(|size| alone(&batch[0], size)) {
        Some(p) => out.push((p, 1)),
        None => {
            add(&stats.unsent, 1);
            crate::warn_throttled!(
                bytes = size,
                max,
                "replica sync: a message exceeds max_payload in every form; not sent"
            );
        }
    }
}

/// `e` with its `token_sequence` cut to the longest prefix that encodes in `max` bytes
/// (`size`: its full encoding), or `None` when it is no `AddRequest` or nothing fits.
fn degrade(e: &ActiveSequenceEvent, size: usize, max: usize) -> Option<Vec<u8>> {
    let ActiveSequenceEventData::AddRequest {
        token_sequence: Some(seq),
        ..
    } = &e.data
    else {
        return None;
    };
    // Each hash takes up to 9 bytes; start from the estimate, then halve until it fits.
    let over = size - max;
    let mut keep = seq.len().saturating_sub(over.div_ceil(9) + 1);
    loop {
        let mut cut = e.clone();
        if let ActiveSequenceEventData::AddRequest { token_sequence, .. } = &mut cut.data {
            *token_sequence = Some(seq[..keep].to_vec());
        }
        if let Ok(p) = replica::encode(&cut)
            && p.len() <= max
        {
            return Some(p);
        }
        if keep == 0 {
            return None;
        }
        keep /= 2;
    }
}

/// Session bindings to announce, and the counters of their publisher (the OpenAI front
/// with session affinity and `session_sync` on).
pub(super) struct SessionSync {
    pub(super) out: flume::Receiver<SessionBinding>,
    pub(super) stats: Rc<ReplicaStats>,
}

/// Subscribes to the other replicas' events (and session bindings) and starts the
/// publishers of ours.
pub(super) async fn start(
    client: Client,
    state: Rc<RefCell<State>>,
    out: flume::Receiver<ActiveSequenceEvent>,
    stats: Rc<ReplicaStats>,
    sessions: Option<SessionSync>,
    cfg: &RouterConfig,
) -> Result<(), NatsError> {
    let subject = cfg.subjects.subject(TOPIC_ACTIVE_SEQUENCES);
    let sub = client.subscribe(&subject, None)?;
    let sessions = match sessions {
        Some(sync) => {
            let subject = cfg.subjects.subject(TOPIC_SESSION_BINDINGS);
            Some((client.subscribe(&subject, None)?, subject, sync))
        }
        None => None,
    };
    client.flush(Duration::from_secs(5)).await?;
    let st = Rc::clone(&state);
    glommio::spawn_local(async move {
        while let Some(msg) = sub.next().await {
            match replica::decode_message(&msg.payload) {
                Ok((_, events)) => {
                    let mut s = st.borrow_mut();
                    for e in events {
                        s.apply_replica(e);
                    }
                }
                Err(e) => crate::warn_throttled!(error = %e, "replica sync: undecodable message"),
            }
        }
    })
    .detach();
    let publisher_id = cfg.router_id;
    if let Some((sub, subject, sync)) = sessions {
        glommio::spawn_local(async move {
            while let Some(msg) = sub.next().await {
                match session::decode_message(&msg.payload) {
                    Ok((env, bindings)) => state
                        .borrow_mut()
                        .apply_sessions(env.publisher_id, bindings),
                    Err(e) => {
                        state.borrow_mut().session_undecodable();
                        crate::warn_throttled!(error = %e, "session sync: undecodable message");
                    }
                }
            }
        })
        .detach();
        let (client, topic) = (client.clone(), TOPIC_SESSION_BINDINGS);
        glommio::spawn_local(async move {
            let to = Publisher {
                client,
                subject,
                publisher_id,
                topic,
            };
            to.run(sync.out, &sync.stats, pack_sessions).await
        })
        .detach();
    }
    glommio::spawn_local(async move {
        let to = Publisher {
            client,
            subject,
            publisher_id,
            topic: TOPIC_ACTIVE_SEQUENCES,
        };
        to.run(out, &stats, pack).await
    })
    .detach();
    Ok(())
}

/// Payloads of at most `max` bytes carrying a batch, each with how many items it holds.
type Pack<T> = fn(&[T], usize, &ReplicaStats) -> Vec<(Vec<u8>, usize)>;

/// Where one publisher sends: a subject, with this router's envelopes of one topic.
struct Publisher {
    client: Client,
    subject: String,
    publisher_id: u64,
    topic: &'static str,
}

impl Publisher {
    /// Batches of up to 256 items or 1 ms, in as many envelopes as `max_payload` needs.
    async fn run<T>(self, out: flume::Receiver<T>, stats: &ReplicaStats, pack: Pack<T>) {
        let mut seq = 0u64;
        while let Ok(first) = out.recv_async().await {
            let mut batch = vec![first];
            let deadline = Instant::now() + Duration::from_millis(1);
            while batch.len() < 256 {
                match out.try_recv() {
                    Ok(e) => batch.push(e),
                    Err(_) if Instant::now() < deadline => {
                        glommio::timer::sleep(Duration::from_micros(100)).await
                    }
                    Err(_) => break,
                }
            }
            let max = self.client.max_payload().saturating_sub(ENVELOPE_ROOM);
            for (payload, items) in pack(&batch, max, stats) {
                let env = Envelope {
                    publisher_id: self.publisher_id,
                    sequence: seq,
                    published_at: std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_millis() as u64),
                    topic: self.topic,
                    payload: &payload,
                };
                seq += 1;
                match self.client.publish(&self.subject, &env.encode()).await {
                    Ok(()) => {
                        add(&stats.out, items as u64);
                        add(&stats.messages, 1);
                    }
                    Err(e) => {
                        add(&stats.unsent, items as u64);
                        crate::warn_throttled!(error = %e, items, topic = self.topic, "replica sync: publish failed");
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrouter_core::worker::WorkerDp;

    fn add_request(id: &str, blocks: u64) -> ActiveSequenceEvent {
        ActiveSequenceEvent {
            request_id: id.into(),
            worker: WorkerDp::new(1, 0),
            data: ActiveSequenceEventData::AddRequest {
                token_sequence: Some((0..blocks).map(|b| b * 0x1234_5678_9abc).collect()),
                track_prefill_tokens: true,
                expected_output_tokens: None,
                prefill_load_hint: None,
            },
            router_id: 7,
            lora_name: None,
        }
    }

    #[test]
    fn batches_split_to_fit_and_big_adds_are_cut() {
        let stats = ReplicaStats::default();
        let mut batch: Vec<ActiveSequenceEvent> =
            (0..100).map(|i| add_request(&format!("s{i}"), 4)).collect();
        batch.insert(50, add_request("huge", 2000));
        let max = 2048;
        let parts = pack(&batch, max, &stats);
        assert!(parts.iter().all(|(p, _)| p.len() <= max));
        assert_eq!(parts.iter().map(|(_, n)| n).sum::<usize>(), 101);
        // Everything arrives, in order; the huge one with a prefix of its blocks.
        let got: Vec<ActiveSequenceEvent> = parts
            .iter()
            .flat_map(|(p, _)| replica::decode(p).unwrap())
            .collect();
        let ids: Vec<&str> = got.iter().map(|e| e.request_id.as_str()).collect();
        let want: Vec<&str> = batch.iter().map(|e| e.request_id.as_str()).collect();
        assert_eq!(ids, want);
        let ActiveSequenceEventData::AddRequest {
            token_sequence: Some(seq),
            ..
        } = &got[50].data
        else {
            panic!()
        };
        let ActiveSequenceEventData::AddRequest {
            token_sequence: Some(full),
            ..
        } = &batch[50].data
        else {
            panic!()
        };
        assert!(!seq.is_empty() && seq.len() < full.len());
        assert_eq!(seq[..], full[..seq.len()]);
        assert_eq!((stats.degraded.get(), stats.unsent.get()), (1, 0));
        // Nothing fits in 8 bytes: counted, not sent.
        let stats = ReplicaStats::default();
        assert!(pack(&batch[..2], 8, &stats).is_empty());
        assert_eq!(stats.unsent.get(), 2);
    }

    #[test]
    fn session_bindings_split_to_fit_and_are_never_cut() {
        let batch: Vec<SessionBinding> = (0..256)
            .map(|i| SessionBinding {
                session: format!("session-{i}-{}", "x".repeat(i % 200)),
                worker: WorkerDp::new(i as u64 % 16, 0),
                bound_at_ms: 1_780_000_000_000 + i as u64,
                router_id: 7,
            })
            .collect();
        let stats = ReplicaStats::default();
        let parts = pack_sessions(&batch, 4096, &stats);
        assert!(parts.len() > 1 && parts.iter().all(|(p, _)| p.len() <= 4096));
        let got: Vec<SessionBinding> = parts
            .iter()
            .flat_map(|(p, _)| session::decode(p).unwrap())
            .collect();
        assert_eq!(got, batch);
        assert_eq!((stats.degraded.get(), stats.unsent.get()), (0, 0));
        // A binding bigger than a message is counted, not sent, and costs the others
        // nothing.
        let mut three = batch[..3].to_vec();
        three[1].session = "y".repeat(5000);
        let stats = ReplicaStats::default();
        let parts = pack_sessions(&three, 4096, &stats);
        let got: Vec<SessionBinding> = parts
            .iter()
            .flat_map(|(p, _)| session::decode(p).unwrap())
            .collect();
        assert_eq!(got, [three[0].clone(), three[2].clone()]);
        assert_eq!(stats.unsent.get(), 1);
    }
}
