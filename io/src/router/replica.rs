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

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::{Duration, Instant};

use kvrouter_core::codec::replica::{self, ActiveSequenceEvent, ActiveSequenceEventData};
use kvrouter_core::codec::{Envelope, TOPIC_ACTIVE_SEQUENCES};

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
    pack_into(batch, max, stats, &mut out);
    out
}

fn pack_into(
    batch: &[ActiveSequenceEvent],
    max: usize,
    stats: &ReplicaStats,
    out: &mut Vec<(Vec<u8>, usize)>,
) {
    if batch.is_empty() {
        return;
    }
    let Some(payload) = encode(batch) else {
        if batch.len() == 1 {
            add(&stats.unsent, 1);
        } else {
            let (a, b) = batch.split_at(batch.len() / 2);
            pack_into(a, max, stats, out);
            pack_into(b, max, stats, out);
        }
        return;
    };
    if payload.len() <= max {
        out.push((payload, batch.len()));
        return;
    }
    if batch.len() > 1 {
        let (a, b) = batch.split_at(batch.len() / 2);
        pack_into(a, max, stats, out);
        pack_into(b, max, stats, out);
        return;
    }
    match degrade(&batch[0], payload.len(), max) {
        Some(p) => {
            add(&stats.degraded, 1);
            crate::warn_throttled!(
                request_id = %batch[0].request_id,
                bytes = payload.len(),
                max,
                "replica sync: a request's blocks exceed max_payload; sent cut to fit"
            );
            out.push((p, 1));
        }
        None => {
            add(&stats.unsent, 1);
            crate::warn_throttled!(
                bytes = payload.len(),
                max,
                "replica sync: an event exceeds max_payload in every form; not sent"
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

/// Subscribes to the other replicas' events and starts the publisher of ours.
pub(super) async fn start(
    client: Client,
    state: Rc<RefCell<State>>,
    out: flume::Receiver<ActiveSequenceEvent>,
    stats: Rc<ReplicaStats>,
    cfg: &RouterConfig,
) -> Result<(), NatsError> {
    let subject = cfg.subjects.subject(TOPIC_ACTIVE_SEQUENCES);
    let sub = client.subscribe(&subject, None)?;
    client.flush(Duration::from_secs(5)).await?;
    glommio::spawn_local(async move {
        while let Some(msg) = sub.next().await {
            match replica::decode_message(&msg.payload) {
                Ok((_, events)) => {
                    let mut s = state.borrow_mut();
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
    glommio::spawn_local(async move { publish(client, subject, publisher_id, out, &stats).await })
        .detach();
    Ok(())
}

/// Batches of up to 256 events or 1 ms, in as many envelopes as `max_payload` needs.
async fn publish(
    client: Client,
    subject: String,
    publisher_id: u64,
    out: flume::Receiver<ActiveSequenceEvent>,
    stats: &ReplicaStats,
) {
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
        let max = client.max_payload().saturating_sub(ENVELOPE_ROOM);
        for (payload, events) in pack(&batch, max, stats) {
            let env = Envelope {
                publisher_id,
                sequence: seq,
                published_at: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64),
                topic: TOPIC_ACTIVE_SEQUENCES,
                payload: &payload,
            };
            seq += 1;
            match client.publish(&subject, &env.encode()).await {
                Ok(()) => {
                    add(&stats.out, events as u64);
                    add(&stats.messages, 1);
                }
                Err(e) => {
                    add(&stats.unsent, events as u64);
                    crate::warn_throttled!(error = %e, events, "replica sync: publish failed");
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
}
