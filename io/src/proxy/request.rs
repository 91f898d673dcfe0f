//! A proxied request as the router needs it: its body read within its size limit and
//! deadline, parsed, its model's card found and its prompt tokenised as the engine will
//! see it (see the [module docs](super)).
//!
//! Everything after the read costs CPU in proportion to the body ([`prepare`]), so a large
//! body is prepared on a tokenizer thread, off the executor that relays every stream
//! ([`super::tokenize`]). A completion's `prompt` of token ids is parsed straight into
//! ids ([`kvrouter_core::codec::openai`]), never into one JSON value per token.

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::Response;
use hyper::body::Incoming;
use hyper::header::{self, HeaderMap};
use kvrouter_core::codec::openai::{RequestBody, parse_request};
use serde_json::Value as Json;

use super::front::{Endpoint, Front, error};
use super::model::ModelCard;
use super::relay::ProxyBody;

/// A request, read and tokenised.
pub(super) struct Prompt {
    /// The body as the client sent it.
    pub(super) body: Bytes,
    /// The body parsed (a JSON object), without a `prompt` of token ids: those are
    /// `tokens` (`prompt_ids`).
    pub(super) json: Json,
    /// The model it names (one this front serves).
    pub(super) model: String,
    /// Its prompt's token ids, as the engine will see them.
    pub(super) tokens: Vec<u32>,
    /// Whether the client sent `prompt` as token ids (they are `tokens`, and not in `json`).
    pub(super) prompt_ids: bool,
    /// Whether the client asked for a stream.
    pub(super) stream: bool,
    /// The LoRA adapter its model names.
    pub(super) lora: Option<String>,
}

/// The models a front serves: served name, card (shared by every name of one
/// directory), LoRA adapter. Shared with the tokenizer threads.
pub(super) struct Models(pub(super) Vec<(String, Arc<ModelCard>, Option<String>)>);

impl Models {
    /// The card and the adapter of a served name.
    pub(super) fn find(&self, name: &str) -> Option<(&Arc<ModelCard>, Option<&str>)> {
        self.0
            .iter()
            .find(|(n, _, _)| n == name)
            .map(|(_, c, l)| (c, l.as_deref()))
    }
}

/// Why a body is refused: the answer's status, OpenAI error type and message. (Made where
/// the body was prepared, maybe on a tokenizer thread; the answer is built on the
/// executor.)
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Reject {
    pub(super) status: u16,
    pub(super) kind: &'static str,
    pub(super) message: String,
}

impl Reject {
    fn bad(message: impl Into<String>) -> Self {
        Self {
            status: 400,
            kind: "invalid_request_error",
            message: message.into(),
        }
    }
}

/// A body prepared: parsed, its model found, its prompt tokenised.
pub(super) struct Prepared {
    json: Json,
    model: String,
    tokens: Vec<u32>,
    prompt_ids: bool,
    lora: Option<String>,
}

/// Parses a body, finds its model's card and tokenises its prompt as the engine will see
/// it.
pub(super) fn prepare(models: &Models, body: &[u8], ep: Endpoint) -> Result<Prepared, Reject> {
    let RequestBody {
        fields,
        prompt_ids: ids,
    } = match parse_request(body, ep == Endpoint::Completions) {
        Ok(b) => b,
        // Valid JSON, but not an object.
        Err(e) if e.classify() == serde_json::error::Category::Data => {
            return Err(Reject::bad("the body must be a JSON object"));
        }
        Err(e) => return Err(Reject::bad(format!("malformed JSON: {e}"))),
    };
    let Some(model) = fields
        .get("model")
        .and_then(Json::as_str)
        .map(str::to_owned)
    else {
        return Err(Reject::bad("`model` is required"));
    };
    let Some((card, lora)) = models.find(&model) else {
        return Err(Reject {
            status: 404,
            kind: "model_not_found",
            message: format!("the model `{model}` does not exist (GET /v1/models lists them)"),
        });
    };
    let lora = lora.map(str::to_owned);
    let json = Json::Object(fields);
    let (tokens, prompt_ids) = match ids {
        Some(ids) => (ids, true),
        None => {
            let t = match ep {
                Endpoint::Chat => card.chat_tokens(&json),
                Endpoint::Completions => card.completion_tokens(&json),
            };
            (t.map_err(|e| Reject::bad(e.to_string()))?, false)
        }
    };
    Ok(Prepared {
        json,
        model,
        tokens,
        prompt_ids,
        lora,
    })
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
        let done = self
            .tokenizers
            .prepare(&self.models, body.clone(), ep)
            .await;
        let p = match done.prepared {
            Ok(p) => p,
            Err(r) => return Err(error(r.status, r.kind, r.message)),
        };
        self.stats.tokenize.observe(done.took.as_secs_f64());
        let stream = p
            .json
            .get("stream")
            .and_then(Json::as_bool)
            .unwrap_or(false);
        Ok(Prompt {
            body,
            json: p.json,
            model: p.model,
            tokens: p.tokens,
            prompt_ids: p.prompt_ids,
            stream,
            lora: p.lora,
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
