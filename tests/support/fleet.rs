//! Fleets of workers publishing through the worker library, and checks of an ingest
//! against the reference index (shared by the ingest and durability tests).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvrouter_core::event::RouterEvent;
use kvrouter_core::hash::LocalBlockHash;
use kvrouter_core::index::{Index, ReferenceIndex};
use kvrouter_core::replay::ReplayOp;
use kvrouter_core::worker::{WorkerDp, WorkerId};
use kvrouter_io::ingest::Ingest;
use kvrouter_io::log::LogReader;
use kvrouter_io::nats::{Client, Options};
use kvrouter_io::worker::{KvPublisher, PublisherOptions};

use crate::{on_glommio, repo_root};

pub fn nats_opts(url: &str) -> Options {
    Options {
        servers: vec![url.to_owned()],
        ping_interval: Duration::from_millis(500),
        ..Default::default()
    }
}

/// The sample log's events and final queries: (events in order, queries).
pub fn sample() -> (Vec<RouterEvent>, Vec<Vec<LocalBlockHash>>) {
    let mut reader = LogReader::open(repo_root().join("bench/data/sample_w4.jsonl.zst")).unwrap();
    let (mut events, mut queries) = (Vec::new(), Vec::new());
    while let Some((_, op)) = reader.next_op().unwrap() {
        match op {
            ReplayOp::Match { blocks, .. } => queries.push(blocks),
            op => events.push(op.to_event().unwrap()),
        }
    }
    (events, queries)
}

pub fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Workers publishing from a glommio thread; they keep heartbeating and answering
/// recovery requests until [`Fleet::stop`].
#[derive(Debug)]
pub struct Fleet {
    stop: std::sync::mpsc::Sender<()>,
    handle: std::thread::JoinHandle<HashMap<WorkerId, u64>>,
}

impl Fleet {
    pub fn stop(self) -> HashMap<WorkerId, u64> {
        let _ = self.stop.send(());
        self.handle.join().unwrap()
    }
}

/// Publishes every event through one publisher per worker, from a glommio thread.
pub fn publish_all(
    url: String,
    events: Vec<RouterEvent>,
    announce: bool,
    drop_every: Option<u64>,
) -> Fleet {
    publish_with(
        url,
        events,
        Publishing {
            announce,
            drop_every,
            ..Publishing::default()
        },
    )
}

/// How [`publish_with`] publishes.
#[derive(Debug, Default, Clone)]
pub struct Publishing {
    /// Announce workers (they then have a local indexer).
    pub announce: bool,
    /// Test hook: skip every Nth message.
    pub drop_every: Option<u64>,
    /// JetStream durable publishing (resent until stored).
    pub durable: bool,
    /// Pause after each event (to stretch a run over a fault).
    pub pace: Option<Duration>,
    /// Events published so far.
    pub progress: Option<Arc<AtomicUsize>>,
    /// Per worker, the id of its first event (a fleet that carries on another's numbering).
    pub first_ids: HashMap<WorkerId, u64>,
}

/// Publishes every event through one publisher per worker, from a glommio thread.
pub fn publish_with(url: String, events: Vec<RouterEvent>, how: Publishing) -> Fleet {
    let (stop, stop_rx) = std::sync::mpsc::channel::<()>();
    let handle = std::thread::spawn(move || {
        on_glommio(move || async move {
            let client = Client::connect(nats_opts(&url)).await.unwrap();
            let mut pubs: HashMap<WorkerId, KvPublisher> = HashMap::new();
            let mut last = HashMap::new();
            for e in events {
                if let std::collections::hash_map::Entry::Vacant(slot) = pubs.entry(e.worker_id) {
                    let opts = PublisherOptions {
                        announce: how.announce,
                        drop_every: how.drop_every,
                        durable: how.durable,
                        first_event_id: how.first_ids.get(&e.worker_id).copied().unwrap_or(0),
                        heartbeat: Duration::from_millis(100),
                        ..PublisherOptions::new(e.worker_id)
                    };
                    slot.insert(KvPublisher::start(client.clone(), opts).await.unwrap());
                }
                let id = pubs[&e.worker_id]
                    .publish(e.event.dp_rank, vec![e.event.data.clone()])
                    .await
                    .unwrap();
                last.insert(e.worker_id, id);
                if let Some(p) = &how.progress {
                    p.fetch_add(1, Ordering::Relaxed);
                }
                if let Some(d) = how.pace {
                    glommio::timer::sleep(d).await;
                }
            }
            client
                .wait_connected(Duration::from_secs(20))
                .await
                .unwrap();
            client.flush(Duration::from_secs(5)).await.unwrap();
            // Keep answering recovery requests and heartbeating until told to stop.
            while stop_rx.try_recv().is_err() {
                glommio::timer::sleep(Duration::from_millis(20)).await;
            }
            last
        })
    });
    Fleet { stop, handle }
}

pub fn expected_last_ids(events: &[RouterEvent]) -> HashMap<WorkerId, u64> {
    let mut m = HashMap::new();
    let mut next: HashMap<WorkerId, u64> = HashMap::new();
    for e in events {
        let n = next.entry(e.worker_id).or_insert(0);
        m.insert(e.worker_id, *n);
        *n += 1;
    }
    m
}

pub fn shift(events: &[RouterEvent]) -> Vec<RouterEvent> {
    events
        .iter()
        .map(|e| RouterEvent {
            worker_id: e.worker_id + (1 << 60),
            ..e.clone()
        })
        .collect()
}

pub fn reference_of(events: &[RouterEvent]) -> ReferenceIndex {
    let mut r = ReferenceIndex::new();
    for e in events {
        r.apply(e.clone()).unwrap();
    }
    r
}

pub fn assert_same(ingest: &Ingest, reference: &ReferenceIndex, queries: &[Vec<LocalBlockHash>]) {
    let reader = ingest.reader();
    for q in queries {
        assert_eq!(reader.find_matches(q), reference.find_matches(q));
    }
    let blocks: usize = ingest.workers().iter().map(|s| s.blocks).sum();
    assert_eq!(blocks, reference.block_count());
}

pub fn wait_applied(ingest: &Ingest, last: &HashMap<WorkerId, u64>) {
    wait_until("every event applied", Duration::from_secs(20), || {
        last.iter()
            .all(|(&w, &id)| ingest.last_event_id(WorkerDp::new(w, 0)) == Some(id))
    });
}

/// Publishes `events` to the NATS server at `url` on the kv-events subject, one message
/// each in Dynamo 1.6.1's encoding (publisher id `publisher`, sequence numbers from 0),
/// and flushes: raw events, for what the worker library does not send (another residency
/// domain, say).
pub fn publish_encoded(url: &str, publisher: u64, events: Vec<RouterEvent>) {
    let url = url.to_owned();
    std::thread::spawn(move || {
        on_glommio(move || async move {
            let client = Client::connect(nats_opts(&url)).await.unwrap();
            let subject = kvrouter_core::codec::Subjects::default().kv_events();
            for (seq, e) in events.iter().enumerate() {
                let msg = kvrouter_core::codec::kv::encode_message(
                    publisher,
                    seq as u64,
                    0,
                    std::slice::from_ref(e),
                )
                .unwrap();
                client.publish(&subject, &msg).await.unwrap();
            }
            client.flush(Duration::from_secs(5)).await.unwrap();
        })
    })
    .join()
    .unwrap();
}
