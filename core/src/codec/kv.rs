//! `kv-events` payloads: a list of [`RouterEvent`]s, in MessagePack (the event plane) or
//! JSON (Dynamo's legacy NATS path and what its `RadixTree` tests feed it).

use super::{CodecError, Envelope, TOPIC_KV_EVENTS, from_msgpack, to_msgpack};
use crate::event::RouterEvent;

/// Decodes a `kv-events` payload: a MessagePack list of events (what Dynamo 1.6.1 sends),
/// or a single event map (older publishers).
pub fn decode(payload: &[u8]) -> Result<Vec<RouterEvent>, CodecError> {
    match payload.first() {
        Some(0x80..=0x8f | 0xde | 0xdf) => Ok(vec![from_msgpack("kv event", payload)?]),
        _ => from_msgpack("kv event list", payload),
    }
}

/// A payload decoded event by event: the events that decode, how many did not, and the
/// first error.
#[derive(Debug)]
pub struct Lenient {
    /// The events that decoded, in order.
    pub events: Vec<RouterEvent>,
    /// Events of the list that did not decode (skipped).
    pub bad: usize,
    /// Why the first of them did not.
    pub first_error: Option<CodecError>,
}

/// [`decode`], but one malformed event of a list costs only itself: a list that does not
/// decode whole is decoded element by element. `Err` only when the payload is no list
/// (or single event) at all.
pub fn decode_lenient(payload: &[u8]) -> Result<Lenient, CodecError> {
    let whole = match decode(payload) {
        Ok(events) => {
            return Ok(Lenient {
                events,
                bad: 0,
                first_error: None,
            });
        }
        Err(e) => e,
    };
    let Ok(elements) = super::vllm::array_elements(payload) else {
        return Err(whole);
    };
    let mut out = Lenient {
        events: Vec::with_capacity(elements.len()),
        bad: 0,
        first_error: None,
    };
    for el in elements {
        match from_msgpack::<RouterEvent>("kv event", el) {
            Ok(e) => out.events.push(e),
            Err(e) => {
                out.bad += 1;
                out.first_error.get_or_insert(e);
            }
        }
    }
    Ok(out)
}

/// [`decode_message`] with [`decode_lenient`].
pub fn decode_message_lenient(message: &[u8]) -> Result<(Envelope<'_>, Lenient), CodecError> {
    let env = Envelope::decode_topic(message, TOPIC_KV_EVENTS)?;
    let events = decode_lenient(env.payload)?;
    Ok((env, events))
}

/// Encodes events as a `kv-events` payload (a MessagePack list of named maps).
pub fn encode(events: &[RouterEvent]) -> Result<Vec<u8>, CodecError> {
    to_msgpack("kv event list", events)
}

/// Decodes a whole NATS message: the envelope, then its events.
pub fn decode_message(message: &[u8]) -> Result<(Envelope<'_>, Vec<RouterEvent>), CodecError> {
    let env = Envelope::decode_topic(message, TOPIC_KV_EVENTS)?;
    let events = decode(env.payload)?;
    Ok((env, events))
}

/// Encodes events as a whole NATS message.
pub fn encode_message(
    publisher_id: u64,
    sequence: u64,
    published_at: u64,
    events: &[RouterEvent],
) -> Result<Vec<u8>, CodecError> {
    let payload = encode(events)?;
    Ok(Envelope {
        publisher_id,
        sequence,
        published_at,
        topic: TOPIC_KV_EVENTS,
        payload: &payload,
    }
    .encode())
}

/// Decodes Dynamo's JSON form: one event object, or an array of them.
pub fn decode_json(bytes: &[u8]) -> Result<Vec<RouterEvent>, CodecError> {
    let first = bytes.iter().find(|b| !b.is_ascii_whitespace());
    let res = if first == Some(&b'[') {
        serde_json::from_slice(bytes)
    } else {
        serde_json::from_slice(bytes).map(|e| vec![e])
    };
    res.map_err(|source| CodecError::Json {
        what: "kv event",
        source,
    })
}

/// Encodes one event in Dynamo's JSON form.
pub fn encode_json(event: &RouterEvent) -> String {
    // Every field is a number, string, bool, null, list or map: serialisation cannot fail.
    serde_json::to_string(event).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{KvCacheEvent, ResidencyDomain};
    use crate::hash::{LocalBlockHash as L, SequenceBlockHash as S};

    fn sample() -> Vec<RouterEvent> {
        vec![
            RouterEvent::new(
                u64::MAX - 1,
                KvCacheEvent::stored(1, 0, None, [(L(1), S(2)), (L(3), S(u64::MAX))]),
            ),
            RouterEvent::new(5, KvCacheEvent::removed(2, 3, [S(2)])),
            RouterEvent::new(5, KvCacheEvent::cleared(3, 3)),
        ]
    }

    #[test]
    fn msgpack_round_trip() {
        let events = sample();
        let bytes = encode(&events).unwrap();
        assert_eq!(decode(&bytes).unwrap(), events);
        let msg = encode_message(1, 2, 3, &events).unwrap();
        let (env, back) = decode_message(&msg).unwrap();
        assert_eq!(
            (env.publisher_id, env.sequence, env.published_at),
            (1, 2, 3)
        );
        assert_eq!(back, events);
    }

    #[test]
    fn json_shape_is_dynamos() {
        let e = &sample()[0];
        let json = encode_json(e);
        assert!(json.starts_with(r#"{"worker_id":18446744073709551614,"storage_tier":"device","residency_domain":"worker","event":{"event_id":1,"data":{"stored":{"parent_hash":null"#), "{json}");
        assert_eq!(decode_json(json.as_bytes()).unwrap(), vec![e.clone()]);
        let cleared = encode_json(&sample()[2]);
        assert!(cleared.contains(r#""data":"cleared""#), "{cleared}");
        let arr = format!("[{json},{cleared}]");
        assert_eq!(decode_json(arr.as_bytes()).unwrap().len(), 2);
    }

    #[test]
    fn storage_tiers_by_dynamos_names() {
        use crate::worker::StorageTier as T;
        for (name, tier) in [
            ("device", T::Device),
            ("host_pinned", T::HostPinned),
            ("disk", T::Disk),
            ("external", T::External),
        ] {
            let json = format!(
                r#"{{"worker_id":7,"storage_tier":"{name}","event":{{"event_id":9,"data":{{"removed":{{"block_hashes":[1]}}}}}}}}"#
            );
            assert_eq!(decode_json(json.as_bytes()).unwrap()[0].storage_tier, tier);
        }
        // A tier nobody knows fails its event alone (the lenient decoder counts it).
        let one = |tier: &str| {
            format!(
                r#"{{"worker_id":7,"storage_tier":"{tier}","event":{{"event_id":9,"data":"cleared"}}}}"#
            )
        };
        assert!(decode_json(one("tape").as_bytes()).is_err());
        let events: Vec<serde_json::Value> = [one("tape"), one("disk")]
            .iter()
            .map(|j| serde_json::from_str(j).unwrap())
            .collect();
        let payload = rmp_serde::to_vec_named(&events).unwrap();
        let lenient = decode_lenient(&payload).unwrap();
        assert_eq!(lenient.bad, 1);
        assert_eq!(lenient.events.len(), 1);
        assert_eq!(lenient.events[0].storage_tier, T::Disk);
    }

    #[test]
    fn unknown_fields_and_missing_optionals() {
        let json = r#"{"worker_id":7,"future":[1,2],"event":{"event_id":9,"data":{"removed":{"block_hashes":[1],"x":1}}}}"#;
        let ev = &decode_json(json.as_bytes()).unwrap()[0];
        assert_eq!(ev.worker_id, 7);
        assert_eq!(ev.event.dp_rank, 0);
        assert_eq!(ev.residency_domain, None);
        assert!(ev.is_worker_owned());
        let json = r#"{"worker_id":7,"residency_domain":"someday","event":{"event_id":9,"data":"cleared"}}"#;
        let ev = &decode_json(json.as_bytes()).unwrap()[0];
        assert_eq!(
            ev.residency_domain,
            Some(ResidencyDomain::Unknown("someday".into()))
        );
        assert!(!ev.is_worker_owned());
    }

    #[test]
    fn malformed_is_an_error() {
        for bad in [
            &b""[..],
            b"\x91",
            b"\x91\x80",
            b"\xc1",
            b"\x91\x84\xa9worker_id\xc0",
        ] {
            assert!(decode(bad).is_err(), "{bad:?}");
        }
        for bad in [
            "",
            "{",
            "[{}]",
            r#"{"worker_id":1.5,"event":{"event_id":1,"data":"cleared"}}"#,
            r#"{"worker_id":1,"event":{"event_id":1,"data":"exploded"}}"#,
        ] {
            assert!(decode_json(bad.as_bytes()).is_err(), "{bad}");
        }
    }

    #[test]
    fn one_bad_event_costs_only_itself() {
        let events = sample();
        let good: Vec<Vec<u8>> = events.iter().map(|e| to_msgpack("e", e).unwrap()).collect();
        // [good, {worker_id: nil}, good, good]
        let mut list = vec![0x94];
        list.extend_from_slice(&good[0]);
        list.extend_from_slice(b"\x81\xa9worker_id\xc0");
        list.extend_from_slice(&good[1]);
        list.extend_from_slice(&good[2]);
        assert!(decode(&list).is_err());
        let l = decode_lenient(&list).unwrap();
        assert_eq!(l.events, events);
        assert_eq!(l.bad, 1);
        assert!(l.first_error.is_some());
        // A valid list takes the fast path; a broken list structure is still an error.
        assert_eq!(decode_lenient(&encode(&events).unwrap()).unwrap().bad, 0);
        for bad in [&b"\x92\x80"[..], b"\xc1", b""] {
            assert!(decode_lenient(bad).is_err(), "{bad:?}");
        }
    }
}
