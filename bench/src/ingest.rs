//! End-to-end ingest over a real NATS server: workers publish a replay log's events through
//! the worker library, the router's ingest applies them; reported next to the broker's own
//! raw PUB/SUB rate for the same messages, measured the same way.
//!
//! * **ingest**: block events/s from the first publish until every block is applied, and
//!   the latency from a message's arrival at the router to its events being visible to
//!   `find_matches` (p50/p99);
//! * **raw**: the same messages (pre-encoded) published to a plain subject and counted by a
//!   plain subscriber: what the broker and one connection can carry.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvrouter_core::codec::{Envelope, Subjects, TOPIC_KV_EVENTS, kv};
use kvrouter_core::event::RouterEvent;
use kvrouter_core::worker::WorkerId;
use kvrouter_io::ingest::{Ingest, IngestConfig};
use kvrouter_io::nats::{Client, Options};
use kvrouter_io::worker::{KvPublisher, PublisherOptions};
use serde::Serialize;

use crate::perf::{LoadedLog, percentile};

/// One ingest run. Field names are the JSON keys.
#[derive(Debug, Clone, Serialize)]
pub struct IngestReport {
    /// Shard cores.
    pub shards: usize,
    /// Target publishing rate, block events/s (`None`: as fast as possible).
    pub rate: Option<f64>,
    /// Messages published.
    pub messages: u64,
    /// Block events (stored + removed blocks).
    pub block_events: u64,
    /// Ingest: seconds from the first publish to the last block applied.
    pub ingest_s: f64,
    /// Ingest: block events per second.
    pub ingest_block_events_per_s: f64,
    /// Arrival-to-visible latency, median, ns.
    pub visible_p50_ns: u64,
    /// Arrival-to-visible latency, 99th percentile, ns.
    pub visible_p99_ns: u64,
    /// Raw PUB/SUB: seconds to carry the same messages.
    pub raw_s: f64,
    /// Raw PUB/SUB: block events per second (same messages).
    pub raw_block_events_per_s: f64,
}

/// Runs the ingest and raw measurements once against the server at `url`. With `rate`
/// (block events per second) the workers pace their publishing, so that the latency is
/// measured at a sustained load rather than with queues filling up.
pub fn run(
    log: &LoadedLog,
    url: &str,
    shards: usize,
    tag: &str,
    rate: Option<f64>,
) -> anyhow::Result<IngestReport> {
    let subjects = Subjects {
        namespace: format!("bench{tag}"),
        ..Subjects::default()
    };
    let opts = Options {
        servers: vec![url.to_owned()],
        ..Options::default()
    };
    let events: Vec<RouterEvent> = log.events().cloned().collect();
    let block_events = log.event_blocks;

    // Ingest.
    let ingest = Ingest::start(IngestConfig {
        nats: Some(opts.clone()),
        subjects: subjects.clone(),
        shards,
        record_latency: true,
        silence_timeout: Duration::from_secs(600),
        spin_before_park: std::env::var("KVROUTER_SPIN_US")
            .ok()
            .and_then(|v| v.parse().ok())
            .map(Duration::from_micros),
        ..IngestConfig::default()
    })?;
    let (evs, o, s) = (events.clone(), opts.clone(), subjects.clone());
    let start = Instant::now();
    let publisher = std::thread::spawn(move || {
        glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
            .io_memory(512 << 10)
            .spawn(move || async move {
                let client = Client::connect(o).await.expect("connect");
                let mut pubs: HashMap<WorkerId, KvPublisher> = HashMap::new();
                let t0 = Instant::now();
                let mut sent = 0u64;
                for e in evs {
                    if let Some(rate) = rate {
                        let due = Duration::from_secs_f64(sent as f64 / rate);
                        if let Some(wait) = due.checked_sub(t0.elapsed()) {
                            glommio::timer::sleep(wait).await;
                        }
                    }
                    sent += e.block_count() as u64;
                    if let std::collections::hash_map::Entry::Vacant(slot) = pubs.entry(e.worker_id)
                    {
                        let po = PublisherOptions {
                            announce: false,
                            subjects: s.clone(),
                            ..PublisherOptions::new(e.worker_id)
                        };
                        slot.insert(
                            KvPublisher::start(client.clone(), po)
                                .await
                                .expect("publisher"),
                        );
                    }
                    pubs[&e.worker_id]
                        .publish(e.event.dp_rank, vec![e.event.data])
                        .await
                        .expect("publish");
                }
                client.flush(Duration::from_secs(30)).await.expect("flush");
            })
            .expect("executor")
            .join()
            .expect("publisher thread")
    });
    while ingest.stats().event_blocks < block_events {
        if start.elapsed() > Duration::from_secs(600) {
            anyhow::bail!("ingest did not catch up: {:?}", ingest.stats());
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    let ingest_s = start.elapsed().as_secs_f64();
    publisher
        .join()
        .map_err(|_| anyhow::anyhow!("publisher panicked"))?;
    let mut lat = ingest.take_latencies();
    lat.sort_unstable();
    let messages = ingest.stats().messages;
    ingest.stop();

    // Raw PUB/SUB of the same messages.
    let raw: Vec<Vec<u8>> = events
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let payload = kv::encode(std::slice::from_ref(e)).expect("encode");
            Envelope {
                publisher_id: 1,
                sequence: i as u64,
                published_at: 0,
                topic: TOPIC_KV_EVENTS,
                payload: &payload,
            }
            .encode()
        })
        .collect();
    let n = raw.len();
    let raw_subject = format!("bench{tag}.raw");
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
    let (o1, s1) = (opts.clone(), raw_subject.clone());
    let sub = std::thread::spawn(move || {
        glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
            .io_memory(512 << 10)
            .spawn(move || async move {
                let client = Client::connect(Options {
                    subscription_capacity: 1 << 20,
                    ..o1
                })
                .await
                .expect("connect");
                let sub = client.subscribe(&s1, None).expect("subscribe");
                client.flush(Duration::from_secs(5)).await.expect("flush");
                ready_tx.send(()).expect("ready");
                for _ in 0..n {
                    sub.next().await.expect("message");
                }
                Instant::now()
            })
            .expect("executor")
            .join()
            .expect("subscriber thread")
    });
    ready_rx.recv()?;
    let (o2, s2) = (opts, raw_subject);
    let raw_start = Instant::now();
    let publisher = std::thread::spawn(move || {
        glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
            .io_memory(512 << 10)
            .spawn(move || async move {
                let client = Client::connect(o2).await.expect("connect");
                for m in raw {
                    client.publish(&s2, &m).await.expect("publish");
                }
                client.flush(Duration::from_secs(30)).await.expect("flush");
            })
            .expect("executor")
            .join()
            .expect("publisher thread")
    });
    publisher
        .join()
        .map_err(|_| anyhow::anyhow!("raw publisher panicked"))?;
    let raw_end = sub
        .join()
        .map_err(|_| anyhow::anyhow!("raw subscriber panicked"))?;
    let raw_s = raw_end.duration_since(raw_start).as_secs_f64();

    Ok(IngestReport {
        shards,
        rate,
        messages,
        block_events,
        ingest_s,
        ingest_block_events_per_s: block_events as f64 / ingest_s,
        visible_p50_ns: percentile(&lat, 0.5),
        visible_p99_ns: percentile(&lat, 0.99),
        raw_s,
        raw_block_events_per_s: block_events as f64 / raw_s,
    })
}
