//! Every decoder of untrusted bytes: the event-plane envelope (and its ZMQ-plane frame),
//! kv-events (msgpack and JSON), the engines' native event batches (and their conversion
//! to events), replica sync, session bindings, metrics, and replay-log lines. None may
//! panic; whatever decodes must encode again and decode to the same value.
#![no_main]

use kvrouter_core::codec::{self, Envelope, kv, metrics, replica, session, vllm};
use kvrouter_core::engine::{Converter, Dropped};
use kvrouter_core::replay::parse_line;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(env) = Envelope::decode(data) {
        let again = env.encode();
        assert_eq!(Envelope::decode(&again).unwrap(), env);
        let _ = metrics::heartbeat_worker(&env);
    }
    if let Ok(events) = kv::decode(data) {
        let bytes = kv::encode(&events).unwrap();
        assert_eq!(kv::decode(&bytes).unwrap(), events);
    }
    // Lenient decoding keeps every event the whole decode keeps, and what it keeps
    // round-trips.
    if let Ok(l) = kv::decode_lenient(data) {
        if let Ok(whole) = kv::decode(data) {
            assert_eq!((&l.events, l.bad), (&whole, 0));
        }
        let bytes = kv::encode(&l.events).unwrap();
        assert_eq!(kv::decode(&bytes).unwrap(), l.events);
    }
    if let Ok(events) = kv::decode_json(data) {
        for e in &events {
            assert_eq!(&kv::decode_json(kv::encode_json(e).as_bytes()).unwrap()[0], e);
        }
    }
    if let Ok(events) = replica::decode(data) {
        let bytes = replica::encode_batch(&events).unwrap();
        assert_eq!(replica::decode(&bytes).unwrap(), events);
    }
    if let Ok(bindings) = session::decode(data) {
        let bytes = session::encode_batch(&bindings).unwrap();
        assert_eq!(session::decode(&bytes).unwrap(), bindings);
    }
    if let Ok(inner) = codec::zmq_plane_envelope(data) {
        let _ = kv::decode_message(inner);
    }
    if let Ok(batch) = vllm::decode_batch(data) {
        let mut d = Dropped::default();
        let _ = Converter::new(1, 16).convert(batch, 0, &mut d);
    }
    let _ = metrics::decode_kv_metrics(data);
    let _ = metrics::decode_forward_pass(data);
    let _ = parse_line(data);
});
