//! A model card as the engine reads it: `tokenizer.json` (the Hugging Face `tokenizers`
//! crate) and the chat template of `tokenizer_config.json` (minijinja), so that the token
//! ids the router hashes are the ids the engine will prefill.
//!
//! The template is rendered the way `transformers`' `apply_chat_template` renders it, which
//! is also what vLLM and SGLang do: a Jinja environment with `trim_blocks` and
//! `lstrip_blocks`, loop controls, Python's string and dict methods (`minijinja-contrib`'s
//! pycompat), `raise_exception`, `strftime_now`, and a `tojson` that writes what Python's
//! `json.dumps` writes (`", "` and `": "` separators, non-ASCII kept). Its variables are the
//! request's `messages` and `tools` (none when absent), `add_generation_prompt` (default
//! true), the card's special tokens (`bos_token`, `eos_token`, ...), and the request's
//! `chat_template_kwargs`. The rendered text is encoded without adding special tokens (the
//! template wrote them). A completion's text prompt is encoded with them, as vLLM does;
//! a prompt of token ids is taken as it is.
//!
//! Prompts go through [`super::pieces`]: cut at special tokens, each piece encoded once and
//! then found in a cache, so that a session's next turn encodes only its new messages (a
//! completion's prompt too, where the tokenizer adds its special tokens around it).
//!
//! Message content given as parts (`[{"type": "text", "text": ...}]`) reaches a template
//! that iterates over content as it is; any other template sees the text parts joined by
//! newlines (vLLM's "string" content format).

use std::path::Path;

use minijinja::value::Kwargs;
use minijinja::{Environment, Error as JinjaError, ErrorKind, Value};
use serde_json::Value as Json;

use super::pieces::{PieceStats, Pieces};

/// Why a model card could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CardError {
    /// A file of the card could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// `tokenizer.json` is not a tokenizer `tokenizers` can load.
    #[error("{path}: not a tokenizer: {message}")]
    Tokenizer {
        /// The file.
        path: String,
        /// What the crate said.
        message: String,
    },
    /// `tokenizer_config.json` is not JSON.
    #[error("{path}: malformed JSON")]
    Config {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// The chat template does not parse.
    #[error("the chat template does not parse: {0}")]
    Template(String),
}

/// Why a request's prompt could not be turned into token ids (a 400 for the client).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PromptError {
    /// A required field is missing or has the wrong type.
    #[error("{0}")]
    Shape(String),
    /// The card has no chat template.
    #[error("the model has no chat template")]
    NoTemplate,
    /// The template failed (its own `raise_exception`, or a type error).
    #[error("the chat template failed: {0}")]
    Render(String),
    /// The tokenizer failed.
    #[error("tokenization failed: {0}")]
    Tokenize(String),
}

/// One model's tokenizer and chat template.
pub struct ModelCard {
    tokenizer: std::sync::Arc<tokenizers::Tokenizer>,
    env: Option<Environment<'static>>,
    /// Whether the template iterates over a message's content parts.
    parts_content: bool,
    /// The special tokens the template sees (`bos_token`, ...).
    specials: Vec<(String, String)>,
    /// The piecewise encoder and its cache (none: every prompt encoded whole).
    pieces: Option<Pieces>,
}

/// Bytes of prompt pieces kept by default (128 MiB, the front's budget in all and a card's
/// when loaded alone: the text and ids of about 16 M tokens, some 130 agentic sessions of
/// 126 k tokens).
pub const DEFAULT_PIECE_CACHE_BYTES: usize = 128 << 20;

impl std::fmt::Debug for ModelCard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelCard")
            .field("chat_template", &self.env.is_some())
            .field("parts_content", &self.parts_content)
            .field("pieces", &self.pieces)
            .finish_non_exhaustive()
    }
}

fn read(path: &Path) -> Result<Vec<u8>, CardError> {
    std::fs::read(path).map_err(|source| CardError::Read {
        path: path.display().to_string(),
        source,
    })
}

/// A special token's text: a string, or an `AddedToken` map's `content`.
fn token_text(v: &Json) -> Option<String> {
    match v {
        Json::String(s) => Some(s.clone()),
        Json::Object(m) => m.get("content").and_then(Json::as_str).map(str::to_owned),
        _ => None,
    }
}

impl ModelCard {
    /// Loads `DIR/tokenizer.json` and `DIR/tokenizer_config.json` (the latter optional: no
    /// chat template then), with a piece cache of [`DEFAULT_PIECE_CACHE_BYTES`].
    pub fn load(dir: &Path) -> Result<Self, CardError> {
        Self::load_with(dir, DEFAULT_PIECE_CACHE_BYTES)
    }

    /// [`Self::load`] with a piece cache of `piece_cache_bytes` (0: every prompt encoded
    /// whole).
    pub fn load_with(dir: &Path, piece_cache_bytes: usize) -> Result<Self, CardError> {
        let tok_path = dir.join("tokenizer.json");
        let bytes = read(&tok_path)?;
        let tokenizer =
            tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| CardError::Tokenizer {
                path: tok_path.display().to_string(),
                message: e.to_string(),
            })?;
        let cfg_path = dir.join("tokenizer_config.json");
        let config: Json = if cfg_path.exists() {
            serde_json::from_slice(&read(&cfg_path)?).map_err(|source| CardError::Config {
                path: cfg_path.display().to_string(),
                source,
            })?
        } else {
            Json::Null
        };
        let template = match config.get("chat_template") {
            Some(Json::String(s)) => Some(s.clone()),
            // A list of named templates: the one called "default".
            Some(Json::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(Json::as_str)
                .map(str::to_owned),
            _ => None,
        };
        let template = match template {
            Some(t) => Some(t),
            None => {
                let p = dir.join("chat_template.jinja");
                std::fs::read_to_string(&p).ok()
            }
        };
        let mut specials = Vec::new();
        for key in [
            "bos_token",
            "eos_token",
            "unk_token",
            "pad_token",
            "sep_token",
            "cls_token",
            "mask_token",
        ] {
            if let Some(t) = config.get(key).and_then(token_text) {
                specials.push((key.to_owned(), t));
            }
        }
        let parts_content = template.as_deref().is_some_and(iterates_content);
        let env = template.map(environment).transpose()?;
        let tokenizer = std::sync::Arc::new(tokenizer);
        let pieces = match Pieces::new(&tokenizer, piece_cache_bytes) {
            Ok(p) => Some(p),
            Err(why) => {
                if piece_cache_bytes > 0 {
                    tracing::info!(card = %dir.display(), why, "prompts of this card are encoded whole");
                }
                None
            }
        };
        Ok(ModelCard {
            tokenizer,
            env,
            parts_content,
            specials,
            pieces,
        })
    }

    /// Whether the card has a chat template.
    pub fn has_chat_template(&self) -> bool {
        self.env.is_some()
    }

    /// The prompt a chat request renders to.
    pub fn render_chat(&self, request: &Json) -> Result<String, PromptError> {
        let env = self.env.as_ref().ok_or(PromptError::NoTemplate)?;
        let messages = request
            .get("messages")
            .and_then(Json::as_array)
            .ok_or_else(|| PromptError::Shape("`messages` must be an array".into()))?;
        let messages: Vec<Json> = messages
            .iter()
            .map(|m| self.message(m))
            .collect::<Result<_, _>>()?;
        let mut ctx = serde_json::Map::new();
        for (k, v) in &self.specials {
            ctx.insert(k.clone(), Json::String(v.clone()));
        }
        if let Some(Json::Object(extra)) = request.get("chat_template_kwargs") {
            for (k, v) in extra {
                ctx.insert(k.clone(), v.clone());
            }
        }
        ctx.insert("messages".into(), Json::Array(messages));
        ctx.insert(
            "tools".into(),
            request.get("tools").cloned().unwrap_or(Json::Null),
        );
        ctx.insert(
            "documents".into(),
            request.get("documents").cloned().unwrap_or(Json::Null),
        );
        let gen_prompt = request
            .get("add_generation_prompt")
            .and_then(Json::as_bool)
            .unwrap_or(true);
        ctx.insert("add_generation_prompt".into(), Json::Bool(gen_prompt));
        let tmpl = env
            .get_template("chat")
            .map_err(|e| PromptError::Render(e.to_string()))?;
        tmpl.render(Value::from(minijinja::value::Serde(&ctx)))
            .map_err(|e| PromptError::Render(describe(&e)))
    }

    /// A message as the template sees it, prepared as vLLM prepares it: content parts
    /// joined unless the template iterates over them, and tool-call arguments given as a
    /// JSON string parsed into the object templates expect.
    fn message(&self, m: &Json) -> Result<Json, PromptError> {
        let Json::Object(map) = m else {
            return Err(PromptError::Shape("each message must be an object".into()));
        };
        let mut out = map.clone();
        if !self.parts_content
            && let Some(Json::Array(parts)) = map.get("content")
        {
            let mut text = Vec::new();
            for p in parts {
                match p.get("type").and_then(Json::as_str) {
                    Some("text") => {
                        text.push(p.get("text").and_then(Json::as_str).ok_or_else(|| {
                            PromptError::Shape("a text content part needs `text`".into())
                        })?)
                    }
                    Some(other) => {
                        return Err(PromptError::Shape(format!(
                            "content parts of type {other:?} need a template that takes parts"
                        )));
                    }
                    None => {
                        return Err(PromptError::Shape(
                            "each content part needs a `type`".into(),
                        ));
                    }
                }
            }
            out.insert("content".into(), Json::String(text.join("\n")));
        }
        if let Some(Json::Array(calls)) = out.get_mut("tool_calls") {
            for c in calls {
                if let Some(a) = c.pointer_mut("/function/arguments")
                    && let Json::String(s) = a
                    && let Ok(v) = serde_json::from_str::<Json>(s)
                {
                    *a = v;
                }
            }
        }
        Ok(Json::Object(out))
    }

    /// The token ids of a chat request, as the engine will prefill them.
    pub fn chat_tokens(&self, request: &Json) -> Result<Vec<u32>, PromptError> {
        let text = self.render_chat(request)?;
        self.encode(&text, false)
    }

    /// The token ids of a completion request's `prompt` (text, or token ids; one prompt).
    pub fn completion_tokens(&self, request: &Json) -> Result<Vec<u32>, PromptError> {
        match request.get("prompt") {
            Some(Json::String(s)) => {
                let special = request
                    .get("add_special_tokens")
                    .and_then(Json::as_bool)
                    .unwrap_or(true);
                self.encode(s, special)
            }
            Some(Json::Array(a)) if a.iter().all(Json::is_u64) => a
                .iter()
                .map(|v| {
                    v.as_u64()
                        .and_then(|t| u32::try_from(t).ok())
                        .ok_or_else(|| PromptError::Shape("a token id must fit u32".into()))
                })
                .collect(),
            Some(Json::Array(a)) if a.len() == 1 => {
                let mut one = request.clone();
                one["prompt"] = a[0].clone();
                self.completion_tokens(&one)
            }
            Some(Json::Array(_)) => Err(PromptError::Shape(
                "one prompt per request (a batch of prompts is not routed as one)".into(),
            )),
            _ => Err(PromptError::Shape(
                "`prompt` must be a string or an array of token ids".into(),
            )),
        }
    }

    /// Encodes text: in pieces where it can ([`super::pieces`]), whole otherwise.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, PromptError> {
        if let Some(p) = &self.pieces
            && let Some(ids) = p
                .encode(&self.tokenizer, text, add_special_tokens)
                .map_err(tokenize_error)?
        {
            return Ok(ids);
        }
        self.encode_whole(text, add_special_tokens)
    }

    /// Encodes text in one call to the tokenizer, never from the piece cache.
    pub fn encode_whole(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, PromptError> {
        self.tokenizer
            .encode_fast(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(tokenize_error)
    }

    /// What the piece cache did (none: this card encodes every prompt whole).
    pub fn piece_stats(&self) -> Option<&PieceStats> {
        self.pieces.as_ref().map(Pieces::stats)
    }

    /// Whether pieces are encoded by the byte-level encoder (`super::bpe`).
    pub fn byte_level(&self) -> bool {
        self.pieces.as_ref().is_some_and(Pieces::byte_level)
    }

    /// Whether pieces were turned off by a difference from a whole encoding.
    pub fn pieces_off(&self) -> bool {
        self.pieces.as_ref().is_some_and(Pieces::is_off)
    }
}

fn tokenize_error(e: tokenizers::Error) -> PromptError {
    PromptError::Tokenize(e.to_string())
}

/// A template error with its cause chain (minijinja keeps the detail in sources).
fn describe(e: &JinjaError) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

/// Whether a template reads content parts itself (vLLM's "openai" content format): it
/// iterates over a message's content or tests it for being a string.
fn iterates_content(t: &str) -> bool {
    let t: String = t.chars().filter(|c| !c.is_whitespace()).collect();
    [
        "in message['content']",
        "inmessage['content']",
        "inmessage.content",
        "incontent",
        "['content']isstring",
        ".contentisstring",
        "contentisstring",
    ]
    .iter()
    .any(|p| t.contains(&p.replace(' ', "")))
}

/// The template's environment, configured as `transformers` configures Jinja.
fn environment(template: String) -> Result<Environment<'static>, CardError> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(|e| CardError::Template(e.to_string()))?;
    env.set_syntax(syntax);
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> Result<Value, JinjaError> {
            Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
        },
    );
    env.add_function("strftime_now", |fmt: String| -> String {
        strftime(&fmt, now_secs())
    });
    env.add_filter("tojson", tojson);
    env.add_template_owned("chat", template)
        .map_err(|e| CardError::Template(describe(&e)))?;
    Ok(env)
}

fn now_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// `tojson` as `transformers` defines it: Python's `json.dumps(x, ensure_ascii=False,
/// indent=None, separators=None, sort_keys=False)`.
fn tojson(v: Value, kwargs: Kwargs) -> Result<Value, JinjaError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let json: Json = serde_json::to_value(&v)
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let (item, key) = match &separators {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        Some(_) => {
            return Err(JinjaError::new(
                ErrorKind::InvalidOperation,
                "separators must be a pair",
            ));
        }
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let mut out = String::new();
    let style = PyJson {
        indent,
        item,
        key,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    style.write(&json, 0, &mut out);
    // Jinja's `tojson` output is safe: not escaped again.
    Ok(Value::from_safe_string(out))
}

/// Python's `json.dumps` formatting.
struct PyJson {
    indent: Option<usize>,
    item: String,
    key: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl PyJson {
    fn newline(&self, depth: usize, out: &mut String) {
        if let Some(n) = self.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    }

    fn write(&self, v: &Json, depth: usize, out: &mut String) {
        match v {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Number(n) => {
                if let Some(f) = n.as_f64().filter(|_| n.is_f64()) {
                    out.push_str(&py_float(f));
                } else {
                    out.push_str(&n.to_string());
                }
            }
            Json::String(s) => self.string(s, out),
            Json::Array(a) if a.is_empty() => out.push_str("[]"),
            Json::Array(a) => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item);
                    }
                    self.newline(depth + 1, out);
                    self.write(x, depth + 1, out);
                }
                self.newline(depth, out);
                out.push(']');
            }
            Json::Object(m) if m.is_empty() => out.push_str("{}"),
            Json::Object(m) => {
                let mut entries: Vec<(&String, &Json)> = m.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, x)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item);
                    }
                    self.newline(depth + 1, out);
                    self.string(k, out);
                    out.push_str(&self.key);
                    self.write(x, depth + 1, out);
                }
                self.newline(depth, out);
                out.push('}');
            }
        }
    }

    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !c.is_ascii()) => {
                    let mut buf = [0u16; 2];
                    for u in c.encode_utf16(&mut buf) {
                        out.push_str(&format!("\\u{u:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// Python's `repr` of a float (shortest round trip, `1.0` not `1`, exponents past 1e16).
fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let a = f.abs();
    if a != 0.0 && !(1e-4..1e16).contains(&a) {
        // Python: 1e+16, 1.5e-05.
        let s = format!("{f:e}");
        let (m, e) = s.split_once('e').unwrap_or((&s, "0"));
        let e: i32 = e.parse().unwrap_or(0);
        return format!("{m}e{}{:02}", if e < 0 { '-' } else { '+' }, e.abs());
    }
    let s = format!("{f}");
    if s.contains('.') { s } else { format!("{s}.0") }
}

/// A small `strftime` for `strftime_now` (UTC): `%d %m %Y %y %b %B %H %M %S %a %A %j %%`.
fn strftime(fmt: &str, secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (y, m, d) = civil(days);
    let yday = days - days_from_civil(y, 1, 1) + 1;
    let weekday = DAYS[days.rem_euclid(7) as usize];
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::new();
    let mut it = fmt.chars();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('b') => out.push_str(&month[..3]),
            Some('B') => out.push_str(month),
            Some('a') => out.push_str(&weekday[..3]),
            Some('A') => out.push_str(weekday),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", rem % 60)),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 of a civil date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The civil date of a day count since 1970-01-01.
fn civil(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (if m <= 2 { y + 1 } else { y }, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tojson_writes_what_python_writes() {
        let style = PyJson {
            indent: None,
            item: ", ".into(),
            key: ": ".into(),
            sort_keys: false,
            ensure_ascii: false,
        };
        let v: Json = serde_json::from_str(r#"{"b": [1, 2.0, "é\n\u0001"], "a": {}, "c": null}"#)
            .expect("json");
        let mut out = String::new();
        style.write(&v, 0, &mut out);
        assert_eq!(out, r#"{"b": [1, 2.0, "é\n\u0001"], "a": {}, "c": null}"#);
        assert_eq!(py_float(1e16), "1e+16");
        assert_eq!(py_float(1.5e-5), "1.5e-05");
        assert_eq!(py_float(0.5), "0.5");
    }

    #[test]
    fn strftime_knows_the_calendar() {
        // 2024-07-23 12:34:56 UTC, a Tuesday.
        assert_eq!(
            strftime("%d %b %Y %H:%M:%S %A %j", 1_721_738_096),
            "23 Jul 2024 12:34:56 Tuesday 205"
        );
        assert_eq!(strftime("%Y-%m-%d", 0), "1970-01-01");
    }
}
