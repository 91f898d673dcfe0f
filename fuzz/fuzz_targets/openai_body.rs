//! The OpenAI request-body parser on arbitrary bytes, against serde_json's `Value`: it
//! accepts exactly the bodies that parse as an object, its fields and prompt ids together
//! are that object, and a body that is not JSON is never reported as JSON of the wrong
//! type.
#![no_main]

use kvrouter_core::codec::openai::parse_request;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use serde_json::error::Category;

fuzz_target!(|data: &[u8]| {
    let value = serde_json::from_slice::<Value>(data);
    for take in [false, true] {
        let parsed = parse_request(data, take);
        match (&value, parsed) {
            (Ok(Value::Object(whole)), Ok(p)) => {
                let mut whole = whole.clone();
                let as_ids = match whole.get("prompt") {
                    Some(Value::Array(a)) if take => a
                        .iter()
                        .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
                        .collect::<Option<Vec<u32>>>(),
                    _ => None,
                };
                if as_ids.is_some() {
                    whole.remove("prompt");
                }
                assert_eq!(p.prompt_ids, as_ids);
                assert_eq!(p.fields, whole);
            }
            (Ok(Value::Object(_)), Err(e)) => panic!("an object refused: {e}"),
            (Ok(_), Ok(_)) => panic!("a body that is not an object accepted"),
            (Ok(_), Err(e)) => assert_eq!(e.classify(), Category::Data, "{e}"),
            (Err(_), Ok(_)) => panic!("a body that is not JSON accepted"),
            (Err(_), Err(e)) => {
                if e.classify() == Category::Data {
                    let first = data.iter().find(|b| !b" \t\r\n".contains(b));
                    assert_ne!(first, Some(&b'{'), "an object's error reported as a type: {e}");
                }
            }
        }
    }
});
