//! A proxied request as the router needs it: its body read within its size limit and
//! deadline, parsed, its model's card found and its prompt tokenised as the engine will
//! see it (see the [module docs](super)).

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::Response;
use hyper::body::Incoming;
use hyper::header::{self, HeaderMap};
use serde_json::Value as Json;

use super::front::{Endpoint, Front, error};
use super::relay::ProxyBody;

/// A request, read and tokenised.
pub(super) struct Prompt {
    /// The body as the client sent it.
    pub(super) body: Bytes,
    /// The body parsed (a JSON object).
    pub(super) json: Json,
    /// The model it names (one this front serves).
    pub(super) model: String,
    /// Its prompt's token ids, as the engine will see them.
    pub(super) tokens: Vec<u32>,
    /// Whether the client asked for a stream.
    pub(super) stream: bool,
    /// The LoRA adapter its model names.
    pub(super) lora: Option<String>,
}

impl Front {
    /// The request's body, parsed and tokenised; or the error answer (413, 408, 400, 404).
    pub(super) async fn read_prompt(
        &self,
        headers: &HeaderMap,
        body: Incoming,
        ep: Endpoint,
    ) -> Result<Prompt, Response<ProxyBody>> {
        if let Some(n) = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<usize>().ok())
            && n > self.cfg.max_body_bytes
        {
            // Read (and drop) what the client is sending before answering, up to a bound:
            // a client still writing when the connection closes sees a broken pipe, not
            // the 413.
            self.drain(body, n.min(4 * self.cfg.max_body_bytes)).await;
            return Err(error(
                413,
                "invalid_request_error",
                format!("the body is over {} bytes", self.cfg.max_body_bytes),
            ));
        }
        let body = self.read_body(body).await?;
        let json: Json = match serde_json::from_slice(&body) {
            Ok(j @ Json::Object(_)) => j,
            Ok(_) => {
                return Err(error(
                    400,
                    "invalid_request_error",
                    "the body must be a JSON object",
                ));
            }
            Err(e) => {
                return Err(error(
                    400,
                    "invalid_request_error",
                    format!("malformed JSON: {e}"),
                ));
            }
        };
        let Some(model) = json.get("model").and_then(Json::as_str) else {
            return Err(error(400, "invalid_request_error", "`model` is required"));
        };
        let Some((card, lora)) = self.card(model) else {
            return Err(error(
                404,
                "model_not_found",
                format!("the model `{model}` does not exist (GET /v1/models lists them)"),
            ));
        };
        let model = model.to_owned();
        let lora = lora.map(str::to_owned);
        let card = std::sync::Arc::clone(card);
        let done = self.tokenizers.tokenize(&card, json, ep, body.len()).await;
        let (json, tokens) = match done.tokens {
            Ok(t) => (done.json, t),
            Err(e) => return Err(error(400, "invalid_request_error", e.to_string())),
        };
        self.stats.tokenize.observe(done.took.as_secs_f64());
        let stream = json.get("stream").and_then(Json::as_bool).unwrap_or(false);
        Ok(Prompt {
            body,
            json,
            model,
            tokens,
            stream,
            lora,
        })
    }

    /// The body, within its size limit and deadline.
    async fn read_body(&self, body: Incoming) -> Result<Bytes, Response<ProxyBody>> {
        let max = self.cfg.max_body_bytes;
        let read = async {
            match Limited::new(body, max).collect().await {
                Ok(c) => Ok(c.to_bytes()),
                Err(e)
                    if e.downcast_ref::<http_body_util::LengthLimitError>()
                        .is_some() =>
                {
                    Err(error(
                        413,
                        "invalid_request_error",
                        format!("the body is over {max} bytes"),
                    ))
                }
                Err(e) => Err(error(
                    400,
                    "invalid_request_error",
                    format!("cannot read the body: {e}"),
                )),
            }
        };
        let late = async {
            glommio::timer::sleep(self.cfg.body_timeout).await;
            Err(error(
                408,
                "invalid_request_error",
                "the body did not arrive in time",
            ))
        };
        futures_lite::future::or(read, late).await
    }

    /// Reads and drops up to `max` bytes of a body, within the body deadline.
    async fn drain(&self, mut body: Incoming, max: usize) {
        let read = async {
            let mut n = 0;
            while n < max {
                match body.frame().await {
                    Some(Ok(f)) => n += f.data_ref().map_or(0, Bytes::len),
                    _ => break,
                }
            }
        };
        let late = glommio::timer::sleep(self.cfg.body_timeout);
        futures_lite::future::or(read, late).await;
    }
}
