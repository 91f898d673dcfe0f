//! Replica sync: this router's slot changes out to the other replicas, theirs in, over
//! NATS on Dynamo 1.6.1's `active_sequences_events` subject and wire (so Dynamo's own
//! routers and ours can share one fleet's load picture).
//!
//! Outgoing events go through a bounded queue to a publisher task that batches up to 256
//! events or 1 ms; a full queue drops the event and counts it (the decision itself never
//! waits on NATS). Incoming messages are applied in arrival order; a router skips its own.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use kvrouter_core::codec::replica::{self, ActiveSequenceEvent};
use kvrouter_core::codec::{Envelope, TOPIC_ACTIVE_SEQUENCES};

use super::RouterConfig;
use super::endpoints::State;
use crate::nats::{Client, NatsError};

/// Events a router may queue for the publisher before it drops them.
pub(super) const QUEUE: usize = 1 << 16;

/// Subscribes to the other replicas' events and starts the publisher of ours.
pub(super) async fn start(
    client: Client,
    state: Rc<RefCell<State>>,
    out: flume::Receiver<ActiveSequenceEvent>,
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
                Err(e) => tracing::warn!(error = %e, "replica sync: undecodable message"),
            }
        }
    })
    .detach();
    let publisher_id = cfg.router_id;
    glommio::spawn_local(async move { publish(client, subject, publisher_id, out).await }).detach();
    Ok(())
}

/// Batches of up to 256 events or 1 ms, each in one envelope.
async fn publish(
    client: Client,
    subject: String,
    publisher_id: u64,
    out: flume::Receiver<ActiveSequenceEvent>,
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
        let payload = if batch.len() == 1 {
            replica::encode(&batch[0])
        } else {
            replica::encode_batch(&batch)
        };
        let payload = match payload {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %e, events = batch.len(), "replica sync: cannot encode a batch");
                continue;
            }
        };
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
        if let Err(e) = client.publish(&subject, &env.encode()).await {
            tracing::warn!(error = %e, "replica sync: publish failed");
        }
    }
}
