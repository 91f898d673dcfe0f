//! Dynamo's ZMQ event plane, found through Dynamo's discovery: its file backend
//! (`DYN_FILE_KV`) or its etcd.
//!
//! A stock Dynamo 1.6.1 deployment with file (or in-memory) discovery publishes its events
//! on ZMQ: each publisher binds a PUB socket and advertises it in discovery (with etcd
//! discovery Dynamo defaults to NATS, and `--event-plane zmq` advertises the same
//! channels). Both backends hold the same entries under the same keys, each a small JSON
//! value (in the file tree, one file per key, names percent-encoded):
//!
//! * `v1/instances/`: `{"type": "Endpoint", "namespace", "component", "endpoint",
//!   "instance_id", ...}`: the workers serving an endpoint (the instance id is the worker id
//!   of its KV events);
//! * `v1/mdc/`: `{"type": "Model", ..., "instance_id", "card_json": {"runtime_config":
//!   {"data_parallel_size", "data_parallel_start_rank", ...}}}`: each worker's model card,
//!   which says its dp ranks;
//! * `v1/event_channels/`: `{"type": "EventChannel", "scope": {"endpoint": {"namespace",
//!   "component", "name"}}, "topic", "instance_id", "transport": {"kind": "Zmq", "config":
//!   {"endpoint": "tcp://..."}}}`: one PUB per publisher and topic.
//!
//! Every half second discovery is read again (the file tree walked, or one etcd listing of
//! `v1/` at one revision, see [`super::etcd`]): a worker that appears is registered
//! (routable at once, with no blocks) and pinned alive for as long as discovery lists it;
//! one that disappears is removed from the index and so from routing. An etcd that cannot
//! be read is counted and logged and changes nothing: what the last listing said stands
//! until a listing succeeds (a discovery outage must not empty the fleet). Each advertised
//! channel of the kv-events, `kv_metrics` and `forward-pass-metrics` topics gets a
//! subscriber; its messages are `[topic, publisher id, seq, frame]`, the frame holding the
//! NATS plane's envelope ([`kvrouter_core::codec::zmq_plane_envelope`]), so kv-events go to
//! the shards exactly as from NATS and metrics count as heartbeats.
//!
//! Gaps: the envelope's events carry Dynamo's event ids, so the shard sees a gap as it
//! does on NATS. Repairing it would take the worker's local indexer, which Dynamo serves on
//! its own TCP request plane (the `worker_kv_query_source_*` endpoints), not on ZMQ or NATS;
//! kvrouter does not speak that plane, so a gap on this plane is counted and logged and the
//! event applied, as for a worker without a local indexer.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::{Duration, Instant};

use kvrouter_core::codec;
use kvrouter_core::worker::{WorkerDp, WorkerId};
use serde_json::Value;

use super::config::DynamoDiscovery;
use super::etcd::Etcd;
use super::hub::Hub;
use super::messages::ShardCmd;
use crate::zmq::{Endpoint, SubEvent, Subscriber};

/// How often the discovery tree is read.
const POLL: Duration = Duration::from_millis(500);

/// Topics whose channels are subscribed.
const TOPICS: [&str; 3] = [
    codec::TOPIC_KV_EVENTS,
    codec::TOPIC_KV_METRICS,
    codec::TOPIC_FORWARD_PASS_METRICS,
];

/// Starts the discovery watcher (it starts and stops the subscribers).
pub(super) fn start(hub: &Rc<Hub>, discovery: DynamoDiscovery) -> glommio::Task<()> {
    let hub = Rc::clone(hub);
    let source = match discovery {
        DynamoDiscovery::File(dir) => Source::File(dir),
        DynamoDiscovery::Etcd(targets) => Source::Etcd(Etcd::new(targets)),
    };
    glommio::spawn_local(async move { watch(hub, source).await })
}

/// Where the entries are read from.
enum Source {
    File(PathBuf),
    Etcd(Etcd),
}

impl Source {
    /// The entries of one read, or why discovery could not be read (nothing is known
    /// then, which is not the same as an empty discovery).
    async fn entries(&self) -> Result<Entries, super::etcd::EtcdError> {
        match self {
            Source::File(dir) => Ok(Entries::of_dir(dir)),
            Source::Etcd(etcd) => {
                let kvs = etcd.list(b"v1/").await?;
                Ok(Entries::of_kvs(kvs))
            }
        }
    }
}

/// The parsed entries of the three sections we read.
#[derive(Debug, Default)]
pub(super) struct Entries {
    instances: Vec<Value>,
    mdc: Vec<Value>,
    channels: Vec<Value>,
    /// Entries that did not parse.
    errors: u64,
}

impl Entries {
    /// The file backend's tree under `dir` (an absent directory has no entries).
    fn of_dir(dir: &Path) -> Self {
        let mut e = Entries::default();
        e.instances = files(&dir.join("v1/instances"), &mut e.errors);
        e.mdc = files(&dir.join("v1/mdc"), &mut e.errors);
        e.channels = files(&dir.join("v1/event_channels"), &mut e.errors);
        e
    }

    /// A key-value listing of `v1/` (etcd's).
    fn of_kvs(kvs: Vec<(Vec<u8>, Vec<u8>)>) -> Self {
        let mut e = Entries::default();
        for (key, value) in kvs {
            let section = if key.starts_with(b"v1/instances/") {
                &mut e.instances
            } else if key.starts_with(b"v1/mdc/") {
                &mut e.mdc
            } else if key.starts_with(b"v1/event_channels/") {
                &mut e.channels
            } else {
                continue;
            };
            match serde_json::from_slice::<Value>(&value) {
                Ok(v) => section.push(v),
                Err(_) => e.errors += 1,
            }
        }
        e
    }
}

/// What one read of the tree found.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Found {
    /// The workers of our endpoint, with their ranks.
    pub(super) workers: HashSet<WorkerDp>,
    /// The channels to subscribe to.
    pub(super) channels: HashSet<String>,
    /// Entries that could not be read.
    pub(super) errors: u64,
}

async fn watch(hub: Rc<Hub>, source: Source) {
    let mut workers: HashSet<WorkerDp> = HashSet::new();
    let mut subs: HashMap<String, glommio::Task<()>> = HashMap::new();
    let mut warned_missing = false;
    match &source {
        Source::File(dir) => {
            tracing::info!(dir = %dir.display(), "watching Dynamo's file discovery");
        }
        Source::Etcd(_) => tracing::info!("watching Dynamo's etcd discovery"),
    }
    loop {
        let s = &hub.cfg.subjects;
        let found = match source.entries().await {
            Ok(entries) => entries.found(&s.namespace, &s.component, &s.endpoint),
            Err(e) => {
                hub.bump(|c| c.discovery_errors += 1);
                crate::warn_throttled!(error = %e, "discovery not readable: keeping what it said last");
                glommio::timer::sleep(POLL).await;
                continue;
            }
        };
        if found.errors > 0 {
            hub.bump(|c| c.discovery_errors += found.errors);
        }
        if let Source::File(dir) = &source
            && !dir.join("v1").is_dir()
            && !warned_missing
        {
            warned_missing = true;
            tracing::warn!(dir = %dir.display(), "no discovery tree yet (v1/ missing)");
        }
        let now = Instant::now();
        let added: Vec<WorkerDp> = found.workers.difference(&workers).copied().collect();
        let gone: Vec<WorkerDp> = workers.difference(&found.workers).copied().collect();
        let ids = |ws: &HashSet<WorkerDp>| -> HashSet<WorkerId> {
            ws.iter().map(|w| w.worker_id).collect()
        };
        let (before, after) = (ids(&workers), ids(&found.workers));
        for &id in after.difference(&before) {
            hub.workers.pin(id, now);
        }
        if !added.is_empty() {
            tracing::info!(workers = ?added, "workers discovered");
            for w in &added {
                hub.workers.first_sight(*w);
            }
            hub.register(added).await;
        }
        for &id in before.difference(&after) {
            tracing::info!(worker_id = id, "worker left discovery: removing it");
            hub.workers.unpin(id, now);
            hub.workers.forget(id);
            let _ = hub
                .shards
                .to_worker(id, ShardCmd::Remove { worker_id: id })
                .await;
        }
        // A rank gone while its worker stays: its blocks go at the worker's removal or
        // restart; nothing routes to a rank the index no longer lists.
        drop(gone);
        workers = found.workers;
        subs.retain(|ep, _| found.channels.contains(ep));
        for ep in found.channels {
            if subs.contains_key(&ep) {
                continue;
            }
            match Endpoint::parse(&ep) {
                Ok(endpoint) => {
                    let h = Rc::clone(&hub);
                    let task = glommio::spawn_local(async move { channel(h, endpoint).await });
                    subs.insert(ep, task);
                }
                Err(e) => {
                    hub.bump(|c| c.discovery_errors += 1);
                    crate::warn_throttled!(error = %e, "discovery names an endpoint we cannot use");
                }
            }
        }
        glommio::timer::sleep(POLL).await;
    }
}

/// Reads the discovery tree under `dir` for `namespace/component/endpoint`.
#[cfg(test)]
pub(super) fn read(dir: &Path, namespace: &str, component: &str, endpoint: &str) -> Found {
    Entries::of_dir(dir).found(namespace, component, endpoint)
}

impl Entries {
    /// What the entries say about `namespace/component/endpoint`.
    fn found(&self, namespace: &str, component: &str, endpoint: &str) -> Found {
        let mut found = Found {
            errors: self.errors,
            ..Found::default()
        };
        let ours = |v: &Value| {
            v["namespace"].as_str() == Some(namespace)
                && v["component"].as_str() == Some(component)
                && v["endpoint"].as_str() == Some(endpoint)
        };
        let mut instances: HashSet<WorkerId> = HashSet::new();
        for v in &self.instances {
            if v["type"] == "Endpoint"
                && ours(v)
                && let Some(id) = v["instance_id"].as_u64()
            {
                instances.insert(id);
            }
        }
        let mut ranks: HashMap<WorkerId, (u32, u32)> = HashMap::new();
        for v in &self.mdc {
            if v["type"] == "Model"
                && ours(v)
                && let Some(id) = v["instance_id"].as_u64()
            {
                let rc = &v["card_json"]["runtime_config"];
                let size = rc["data_parallel_size"]
                    .as_u64()
                    .unwrap_or(1)
                    .clamp(1, 4096) as u32;
                let start = rc["data_parallel_start_rank"].as_u64().unwrap_or(0) as u32;
                ranks.insert(id, (start, size));
            }
        }
        for id in instances {
            let (start, size) = ranks.get(&id).copied().unwrap_or((0, 1));
            for r in start..start.saturating_add(size) {
                found.workers.insert(WorkerDp::new(id, r));
            }
        }
        for v in &self.channels {
            let scope = &v["scope"]["endpoint"];
            let scoped = scope["namespace"].as_str() == Some(namespace)
                && scope["component"].as_str() == Some(component)
                && scope["name"].as_str() == Some(endpoint);
            let topic = v["topic"].as_str().unwrap_or_default();
            if v["type"] == "EventChannel"
                && scoped
                && TOPICS.contains(&topic)
                && v["transport"]["kind"] == "Zmq"
                && let Some(ep) = v["transport"]["config"]["endpoint"].as_str()
            {
                found.channels.insert(ep.to_owned());
            }
        }
        found
    }
}

/// The JSON entries in `dir` and below (an absent directory has none).
fn files(dir: &Path, errors: &mut u64) -> Vec<Value> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in rd.flatten() {
        let path = e.path();
        if path.is_dir() {
            out.extend(files(&path, errors));
            continue;
        }
        // Writers replace entries atomically, but a file may vanish between the listing and
        // the read: only a file that reads and does not parse is an error.
        let Ok(bytes) = std::fs::read(&path) else {
            continue;
        };
        match serde_json::from_slice::<Value>(&bytes) {
            Ok(v) => out.push(v),
            Err(_) => *errors += 1,
        }
    }
    out
}

/// One advertised publisher: its messages, until the watcher drops the task.
async fn channel(hub: Rc<Hub>, endpoint: Endpoint) {
    let sub = Subscriber::connect(&endpoint, hub.cfg.zmq.sub);
    let mut last: HashMap<u64, u64> = HashMap::new();
    while let Some(ev) = sub.next().await {
        match ev {
            SubEvent::Connected { .. } => hub.bump(|s| s.zmq_connects += 1),
            SubEvent::Disconnected { .. } => hub.bump(|s| s.zmq_disconnects += 1),
            SubEvent::Failed { .. } => {}
            SubEvent::Message { frames, .. } => on_message(&hub, &mut last, frames).await,
        }
    }
}

async fn on_message(hub: &Hub, last: &mut HashMap<u64, u64>, frames: Vec<Vec<u8>>) {
    let arrived = Instant::now();
    hub.bump(|s| s.zmq_messages += 1);
    let [topic, publisher, seq, frame] = frames.as_slice() else {
        hub.bump(|s| s.decode_errors += 1);
        crate::warn_throttled!(
            frames = frames.len(),
            "ZMQ plane message without four frames skipped"
        );
        return;
    };
    let be = |b: &[u8]| <[u8; 8]>::try_from(b).ok().map(u64::from_be_bytes);
    let (Some(publisher), Some(seq)) = (be(publisher), be(seq)) else {
        hub.bump(|s| s.decode_errors += 1);
        crate::warn_throttled!("ZMQ plane message with a malformed publisher id or seq skipped");
        return;
    };
    if let Some(prev) = last.insert(publisher, seq)
        && seq != prev.wrapping_add(1)
        && seq > prev
    {
        hub.bump(|s| s.zmq_gaps += 1);
    }
    let inner = match codec::zmq_plane_envelope(frame) {
        Ok(i) => i,
        Err(e) => {
            hub.bump(|s| s.decode_errors += 1);
            crate::warn_throttled!(error = %e, "undecodable ZMQ plane frame skipped");
            return;
        }
    };
    if topic.as_slice() == codec::TOPIC_KV_EVENTS.as_bytes() {
        hub.kv_events(inner, arrived).await;
    } else {
        hub.heartbeat(inner, arrived).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_captured_tree_names_every_worker_rank_and_channel() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/dynamo-1.6.1/zmq/discovery");
        let f = read(&dir, "dynamo", "backend", "generate");
        assert_eq!(f.errors, 0);
        let mut ws: Vec<WorkerDp> = f.workers.iter().copied().collect();
        ws.sort();
        assert_eq!(
            ws,
            [
                WorkerDp::new(271_054_210_061_231_132, 0),
                WorkerDp::new(271_054_210_061_231_132, 1),
                WorkerDp::new(16_549_099_362_383_150_345, 0),
                WorkerDp::new(16_549_099_362_383_150_345, 1),
            ]
        );
        // Four kv-events publishers and two of each metrics topic; not replica sync.
        assert_eq!(f.channels.len(), 8, "{:?}", f.channels);
        assert!(
            read(&dir, "other", "backend", "generate")
                .workers
                .is_empty()
        );
        assert_eq!(
            read(Path::new("/nonexistent"), "a", "b", "c"),
            Found::default()
        );
    }
}
