//! The body of an OpenAI request (`/v1/completions`, `/v1/chat/completions`), parsed as
//! the router needs it: a `prompt` of token ids straight into ids, never into one JSON
//! value per token. An agentic prompt of 900 k ids is 6.4 MB of JSON; as `Value`s it
//! takes 29 MB and about three times as long to parse (docs/BENCHMARKS.md). Everything
//! else parses as a `Value` would (checked against serde_json by
//! `fuzz/fuzz_targets/openai_body.rs`).

use std::fmt;

use serde::Deserialize;
use serde::de::value::{MapAccessDeserializer, SeqAccessDeserializer};
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value as Json};

/// A request body parsed: its fields, and a `prompt` of token ids taken out of them.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestBody {
    /// The body's fields; `prompt` is not among them when it is `prompt_ids`.
    pub fields: Map<String, Json>,
    /// The `prompt`, when it was an array of token ids.
    pub prompt_ids: Option<Vec<u32>>,
}

/// Parses a request body, which must be one JSON object. With `take_prompt_ids`, a
/// `prompt` that is an array of integers that fit `u32` (empty included) becomes
/// `prompt_ids`; any other `prompt` stays a field, as a `Value` would hold it. A key given
/// twice keeps its last value, as in a `Value`.
///
/// Errors are serde_json's: [`Category::Data`](serde_json::error::Category::Data) when the
/// body is JSON but not an object, another category when it is not JSON.
pub fn parse_request(body: &[u8], take_prompt_ids: bool) -> Result<RequestBody, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let parsed = de.deserialize_map(BodyVisitor {
        take_ids: take_prompt_ids,
    })?;
    de.end()?;
    Ok(parsed)
}

struct BodyVisitor {
    take_ids: bool,
}

impl<'de> Visitor<'de> for BodyVisitor {
    type Value = RequestBody;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RequestBody, A::Error> {
        let mut fields = Map::new();
        let mut ids = None;
        while let Some(key) = map.next_key::<String>()? {
            if self.take_ids && key == "prompt" {
                match map.next_value_seed(Element { top: true })? {
                    Elem::Ids(v) => {
                        fields.remove("prompt");
                        ids = Some(v);
                    }
                    // (`Element { top: true }` gives no `Id`; as a value it would be a number.)
                    e @ (Elem::Id(_) | Elem::Value(_)) => {
                        ids = None;
                        fields.insert(key, e.into_value());
                    }
                }
            } else {
                let v = map.next_value::<Json>()?;
                fields.insert(key, v);
            }
        }
        Ok(RequestBody {
            fields,
            prompt_ids: ids,
        })
    }
}

/// `prompt` (`top`) or one element of its array.
enum Elem {
    /// The whole prompt, token ids.
    Ids(Vec<u32>),
    /// An element that is a token id.
    Id(u32),
    /// Anything else, as a `Value` would hold it.
    Value(Json),
}

impl Elem {
    fn into_value(self) -> Json {
        match self {
            Elem::Ids(ids) => Json::from(ids),
            Elem::Id(id) => Json::from(id),
            Elem::Value(v) => v,
        }
    }
}

#[derive(Clone, Copy)]
struct Element {
    top: bool,
}

impl Element {
    fn number(self, n: impl Into<serde_json::Number>) -> Elem {
        Elem::Value(Json::Number(n.into()))
    }
}

impl<'de> DeserializeSeed<'de> for Element {
    type Value = Elem;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Elem, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Element {
    type Value = Elem;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Elem, E> {
        Ok(Elem::Value(Json::Bool(v)))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Elem, E> {
        match u64::try_from(v) {
            Ok(u) => self.visit_u64(u),
            Err(_) => Ok(self.number(v)),
        }
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Elem, E> {
        Ok(match u32::try_from(v) {
            Ok(id) if !self.top => Elem::Id(id),
            _ => self.number(v),
        })
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Elem, E> {
        // serde_json hands a float here only when it is finite.
        Ok(serde_json::Number::from_f64(v)
            .map_or(Elem::Value(Json::Null), |n| Elem::Value(Json::Number(n))))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Elem, E> {
        Ok(Elem::Value(Json::String(v.to_owned())))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Elem, E> {
        Ok(Elem::Value(Json::String(v)))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Elem, E> {
        Ok(Elem::Value(Json::Null))
    }

    fn visit_none<E: de::Error>(self) -> Result<Elem, E> {
        Ok(Elem::Value(Json::Null))
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Elem, A::Error> {
        Json::deserialize(MapAccessDeserializer::new(map)).map(Elem::Value)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Elem, A::Error> {
        if !self.top {
            return Json::deserialize(SeqAccessDeserializer::new(seq)).map(Elem::Value);
        }
        // Ids while every element is one; values from the first that is not.
        let mut ids: Vec<u32> = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        let mut values: Option<Vec<Json>> = None;
        while let Some(e) = seq.next_element_seed(Element { top: false })? {
            match (e, &mut values) {
                (Elem::Id(id), None) => ids.push(id),
                (e, vs) => {
                    let vs = vs.get_or_insert_with(|| ids.drain(..).map(Json::from).collect());
                    vs.push(e.into_value());
                }
            }
        }
        Ok(match values {
            None => Elem::Ids(ids),
            Some(vs) => Elem::Value(Json::Array(vs)),
        })
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `parse_request` agrees with a plain `Value` parse: the fields and the ids together are the
    /// object, and ids are taken exactly when `prompt` is an array of `u32`s.
    fn agrees(body: &str) {
        let value: Json = serde_json::from_str(body).unwrap();
        let Json::Object(mut whole) = value else {
            panic!("{body} is not an object")
        };
        let parsed = parse_request(body.as_bytes(), true).unwrap();
        let as_ids = match whole.get("prompt") {
            Some(Json::Array(a)) => a
                .iter()
                .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
                .collect::<Option<Vec<u32>>>(),
            _ => None,
        };
        assert_eq!(parsed.prompt_ids, as_ids, "{body}");
        if as_ids.is_some() {
            whole.remove("prompt");
        }
        assert_eq!(parsed.fields, whole, "{body}");
        // Without take_ids, the fields are the whole object.
        let plain = parse_request(body.as_bytes(), false).unwrap();
        assert_eq!(plain.prompt_ids, None);
        let Json::Object(whole) = serde_json::from_str::<Json>(body).unwrap() else {
            unreachable!()
        };
        assert_eq!(plain.fields, whole, "{body}");
    }

    #[test]
    fn token_id_prompts_parse_into_ids_and_everything_else_as_values_would() {
        for body in [
            r#"{"model": "m", "prompt": [1, 2, 3], "stream": true}"#,
            r#"{"prompt": [], "model": "m"}"#,
            r#"{"prompt": [0, 4294967295]}"#,
            r#"{"prompt": [1, 4294967296]}"#,
            r#"{"prompt": [1, -1]}"#,
            r#"{"prompt": [1, 2.5]}"#,
            r#"{"prompt": [1, "a", null, true, {"k": [1]}, [2, 3]]}"#,
            r#"{"prompt": [[1, 2, 3]]}"#,
            r#"{"prompt": "text", "max_tokens": 4}"#,
            r#"{"prompt": null}"#,
            r#"{"prompt": 7}"#,
            r#"{"prompt": {"a": 1}}"#,
            r#"{"prompt": [1, 2], "prompt": "again"}"#,
            r#"{"prompt": "first", "prompt": [5, 6]}"#,
            r#"{"nested": {"prompt": [1]}, "n": -3, "f": 1e300, "s": "\u00e9\n"}"#,
            r#"  {"prompt" : [ 1 ,2 ] }  "#,
            r#"{}"#,
        ] {
            agrees(body);
        }
    }

    fn element() -> impl Strategy<Value = Json> {
        let leaf = prop_oneof![
            6 => any::<u32>().prop_map(Json::from),
            1 => any::<u64>().prop_map(Json::from),
            1 => any::<i64>().prop_map(Json::from),
            1 => (-1e6f64..1e6).prop_map(Json::from),
            1 => "[a-z\\\"é]{0,4}".prop_map(Json::from),
            1 => Just(Json::Null),
            1 => any::<bool>().prop_map(Json::from),
        ];
        leaf.prop_recursive(2, 8, 3, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..3).prop_map(Json::from),
                prop::collection::btree_map("[a-z]{1,2}", inner, 0..3)
                    .prop_map(|m| Json::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Prompts of ids, of ids with one other element, and of anything, in bodies
        /// with other fields and maybe a second `prompt`.
        #[test]
        fn any_body_parses_as_a_value_would(
            ids in prop::collection::vec(any::<u32>(), 0..40),
            odd in prop::option::of((element(), any::<prop::sample::Index>())),
            other in element(),
            again in prop::option::of(element()),
        ) {
            let mut prompt: Vec<Json> = ids.into_iter().map(Json::from).collect();
            if let Some((e, at)) = odd {
                prompt.insert(at.index(prompt.len() + 1), e);
            }
            let mut body = format!(
                r#"{{"model": "m", "prompt": {}, "other": {}"#,
                Json::from(prompt),
                other
            );
            if let Some(a) = again {
                body.push_str(&format!(r#", "prompt": {a}"#));
            }
            body.push('}');
            agrees(&body);
        }
    }

    #[test]
    fn a_body_that_is_not_one_object_is_told_apart_from_malformed_json() {
        let data = serde_json::error::Category::Data;
        for not_object in ["[1, 2]", "\"s\"", "3", "null"] {
            let e = parse_request(not_object.as_bytes(), true).unwrap_err();
            assert_eq!(e.classify(), data, "{not_object}");
        }
        for malformed in [
            "{",
            "{\"prompt\": [1, 2",
            "{\"prompt\": [1,, 2]}",
            "{} {}",
            "{\"a\": 1} x",
            "",
            "{\"prompt\": [1e]}",
        ] {
            let e = parse_request(malformed.as_bytes(), true).unwrap_err();
            assert_ne!(e.classify(), data, "{malformed}");
        }
    }
}
