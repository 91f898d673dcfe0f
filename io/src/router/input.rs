//! The input of `/v1/route` and `/v1/overlaps`: the binary framing (local block hashes as
//! little-endian u64s) or JSON, parsed by a fast path for the hot shape and serde_json for
//! everything else.

use serde::{Deserialize, Deserializer};

use crate::http::Request;

mod fast;

/// A `u64` given as a JSON integer or a decimal string.
#[derive(Debug, Clone, Copy)]
pub(super) struct U64Lenient(pub(super) u64);

impl<'de> Deserialize<'de> for U64Lenient {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = U64Lenient;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an unsigned 64-bit integer or its decimal string")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<U64Lenient, E> {
                Ok(U64Lenient(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<U64Lenient, E> {
                u64::try_from(v)
                    .map(U64Lenient)
                    .map_err(|_| E::custom("negative hash"))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<U64Lenient, E> {
                v.trim()
                    .parse()
                    .map(U64Lenient)
                    .map_err(|_| E::custom(format!("{v:?} is not a decimal u64")))
            }
        }
        d.deserialize_any(V)
    }
}

/// What a route or overlap query asks.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RouteInput {
    #[serde(default)]
    pub(super) token_ids: Option<Vec<u32>>,
    #[serde(default)]
    pub(super) block_hashes: Option<Vec<U64Lenient>>,
    #[serde(default)]
    pub(super) lora_name: Option<String>,
    #[serde(default)]
    pub(super) request_id: Option<String>,
    #[serde(default)]
    pub(super) explain: bool,
}

/// The binary framing's content type: the body is the request's local block hashes, each a
/// little-endian u64; `X-Request-Id` and `X-Lora-Name` headers stand for the JSON fields.
pub const BINARY_HASHES: &str = "application/x-kvrouter-block-hashes";

/// The input of `/v1/route` and `/v1/overlaps`, in the binary framing or as JSON.
pub(super) fn route_input(req: &Request) -> Result<RouteInput, String> {
    let content_type = req
        .header("content-type")
        .and_then(|v| v.split(';').next())
        .map(str::trim);
    if content_type == Some(BINARY_HASHES) {
        if !req.body.len().is_multiple_of(8) {
            return Err(format!(
                "a {BINARY_HASHES} body is a whole number of 8-byte hashes, not {} bytes",
                req.body.len()
            ));
        }
        let hashes = req
            .body
            .chunks_exact(8)
            .map(|c| {
                let mut b = [0u8; 8];
                b.copy_from_slice(c);
                U64Lenient(u64::from_le_bytes(b))
            })
            .collect();
        return Ok(RouteInput {
            token_ids: None,
            block_hashes: Some(hashes),
            lora_name: req.header("x-lora-name").map(str::to_owned),
            request_id: req.header("x-request-id").map(str::to_owned),
            explain: false,
        });
    }
    parse_route_input(&req.body).map_err(|e| format!("malformed JSON: {e}"))
}

/// Parses a route body: the fast path for the common shape (`block_hashes` first, as
/// integers), serde_json for everything else (and for every error message).
fn parse_route_input(body: &[u8]) -> Result<RouteInput, serde_json::Error> {
    match fast::route_input(body) {
        Some(input) => Ok(input),
        None => serde_json::from_slice(body),
    }
}
