//! Token ids of text for the byte-level BPE tokenizers whose every step it can reproduce,
//! without building the `tokenizers` crate's `Encoding`. Those are GPT-2's shape (no
//! normaliser, the `ByteLevel` pre-tokenizer splitting with its own pattern, a plain BPE
//! model) and the shape of Llama 3, Qwen 2 and DeepSeek V3 (an `NFC` normaliser or none,
//! one or more `Split` steps by a regex, isolating what it matches, then `ByteLevel`
//! without its pattern).
//!
//! **Why.** For a short chat prompt, `Tokenizer::encode_fast` was about a fifth of the
//! front's CPU per request (docs/BENCHMARKS.md, "Prompts encoded by the byte-level
//! encoder"): the crate keeps, for every byte of the input, its alignment to the original
//! text through each step, and builds each token's string and offsets, where the router
//! needs the ids alone.
//!
//! **The same steps, in the same order.** As `tokenizers` 0.23 does for `encode(text,
//! false)`:
//! 1. the added tokens are split off the raw text, leftmost-longest: first those matched
//!    on the raw text (`normalized: false`), then each split between them is normalised
//!    (`NFC`, by the crate's own `unicode-normalization-alignments`) and, in it, the
//!    others are split off (their text normalised too);
//! 2. each remaining split is cut by each `Split` step's regex in turn into its matches and
//!    the gaps between them (on each split alone, as the crate runs it: by the same
//!    `fancy-regex`, where a match the engine gives up on ends the matches there, or, for
//!    patterns ending in GPT-2's `\s+(?!\S)|\s+`, by `regex-automata` with that
//!    look-ahead done here, which gives the same parts without the backtracking VM:
//!    [`Cutter`]); then
//!    each part gets a space in front where `add_prefix_space` asks for one and it has
//!    none, and, where the `ByteLevel` step uses its own pattern, is cut by GPT-2's
//!    pattern into words and the gaps between them (an empty part is dropped, as the crate
//!    drops empty splits);
//! 3. each word's bytes become the byte-level alphabet's symbols, one per byte, and are
//!    merged by rank, the lowest first and, among equal ranks, the leftmost, as the
//!    crate's `Word::merge_all` does (with `ignore_merges`, a word that is itself in the
//!    vocabulary is that one token);
//! 4. no special token is added: the post-processor adds none when asked for none.
//!
//! What it cannot reproduce it refuses at load ([`ByteBpe::new`] says why) and the card
//! is encoded by the crate, as before. **Checked, not trusted**: this encoder's ids reach
//! requests only through [`super::pieces`], whose checks compare them with the crate's own
//! whole encoding (every one of a card's first prompts, then a sample), and a difference
//! turns both off for the card. A sampled prompt is compared off the request path, so the
//! prompt that shows a difference has already been answered with this encoder's ids; a
//! difference that only a rare kind of text brings out would reach requests that way
//! until it is sampled. Short prompts, which the crate encoded whole before, share that.
//!
//! **Memory.** Words seen recently are kept with their ids, at most [`CACHE_WORDS`] of
//! them and each under [`CACHE_WORD_BYTES`]; when full the cache is emptied. One lock
//! guards it, tried and never waited for (a thread that finds it taken merges the word
//! itself).
//!
//! **Also compiled by the fuzz crate** (`fuzz/fuzz_targets/byte_bpe.rs` includes this file
//! by path): outside its tests, it names nothing of this crate.
//!
//! **Probes at load.** A few texts (unicode, whitespace of every kind, the card's added
//! tokens) must encode to the crate's ids, or the card is refused: this catches a
//! post-processor that adds ids even when asked for none, and the crate's pattern
//! running on another regex engine.

use std::borrow::Cow;
use std::sync::{Mutex, MutexGuard, TryLockError};

use ahash::AHashMap;
use aho_corasick::{AhoCorasick, MatchKind};
use serde_json::Value as Json;
use tokenizers::Tokenizer;
use unicode_normalization_alignments::UnicodeNormalization;

/// GPT-2's pattern, as the `ByteLevel` pre-tokenizer of `tokenizers` 0.23 has it.
const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Words whose ids are kept (the crate keeps 10,000).
pub(super) const CACHE_WORDS: usize = 16_384;

/// Words of this many bytes or more are not kept (as in the crate): 16,384 words of a
/// megabyte each would hold gigabytes.
pub(super) const CACHE_WORD_BYTES: usize = 256;

/// Texts encoded by the crate and by this encoder at load, which must agree: they would
/// not if a post-processor changed the ids of a sequence even when asked to add nothing,
/// or if the crate's pattern ran on another regex engine (its `onig` feature).
const PROBES: &[&str] = &[
    "",
    "Hello, world! It's 2026: naïve café 日本語 🙂\n\n  x",
    " leading space,\ttabs\t\tand\u{3000}ideographic\u{85}next\u{2028}line\u{b}\u{c} ends   ",
    "def f(x):\n    return {\"a\": [1, 2.5e-3]}  # ok?!",
    "e\u{301}\u{301} ''s 'll 'd 123456789012345 \u{0}\u{7f}\r\n",
];

/// One pass of added tokens: a matcher and, per pattern, its id.
struct Added {
    matcher: AhoCorasick,
    ids: Vec<u32>,
}

impl Added {
    fn new(tokens: &[(u32, String)]) -> Result<Option<Self>, &'static str> {
        if tokens.is_empty() {
            return Ok(None);
        }
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(tokens.iter().map(|(_, c)| c.as_str()))
            .map_err(|_| "the added tokens do not build a matcher")?;
        Ok(Some(Added {
            matcher,
            ids: tokens.iter().map(|(id, _)| *id).collect(),
        }))
    }
}

/// A card's byte-level BPE encoder.
pub(super) struct ByteBpe {
    /// The added tokens matched on the raw text, then those matched after normalising.
    raw: Option<Added>,
    normalized: Option<Added>,
    /// Whether the normaliser is `NFC` (otherwise there is none).
    nfc: bool,
    /// The `Split` steps' regexes, in order.
    splits: Vec<Cutter>,
    add_prefix_space: bool,
    /// GPT-2's pattern, where the `ByteLevel` step uses it.
    pattern: Option<Cutter>,
    /// Each byte's symbol: the id of its byte-level character.
    byte_ids: [u32; 256],
    /// Each byte's byte-level character (for `ignore_merges`' look-ups).
    byte_chars: [char; 256],
    /// A pair of ids → its merge's rank and the merged id.
    merges: AHashMap<(u32, u32), (u32, u32)>,
    /// With `ignore_merges`: the vocabulary, for whole words.
    whole_words: Option<AHashMap<String, u32>>,
    cache: Mutex<Words>,
}

/// A word's bytes → its ids.
type Words = AHashMap<Box<[u8]>, Box<[u32]>>;

impl std::fmt::Debug for ByteBpe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ByteBpe")
            .field("merges", &self.merges.len())
            .field("nfc", &self.nfc)
            .field("splits", &self.splits.len())
            .field("add_prefix_space", &self.add_prefix_space)
            .field("byte_level_pattern", &self.pattern.is_some())
            .finish_non_exhaustive()
    }
}

/// The NFC form of `text`, as the crate's `NFC` normaliser gives it (ASCII is its own).
fn nfc(text: &str) -> Cow<'_, str> {
    if text.is_ascii() {
        Cow::Borrowed(text)
    } else {
        Cow::Owned(text.nfc().map(|(c, _)| c).collect())
    }
}

/// Whether the normaliser is `NFC` (`false`: none): none, an empty `Sequence` (DeepSeek V3
/// has one), `NFC`, or a `Sequence` of `NFC` alone.
fn normaliser(n: &Json) -> Result<bool, &'static str> {
    let steps: Vec<&Json> = match n {
        Json::Null => Vec::new(),
        n if n["type"] == "Sequence" => n["normalizers"]
            .as_array()
            .ok_or("a malformed normaliser")?
            .iter()
            .collect(),
        n => vec![n],
    };
    match steps[..] {
        [] => Ok(false),
        [n] if n["type"] == "NFC" => Ok(true),
        _ => Err("a normaliser other than NFC"),
    }
}

/// The end of GPT-2's, Llama 3's, Qwen 2's and DeepSeek V3's patterns: whitespace up to the
/// last of its run that is followed by something else, or the run.
const SPACES_TAIL: &str = r"|\s+(?!\S)|\s+";

/// Whitespace runs of this many bytes or more are cut by `fancy-regex` (see [`Cutter`]).
const LONG_SPACES: usize = 1 << 16;

/// A pattern that cuts text into parts (its matches and the gaps between them, in order,
/// none empty), run as the crate runs it: by `fancy-regex` (a match the engine gives up on
/// ends the matches there, and the rest is one part, as in the crate), or by an engine
/// that gives the same parts.
///
/// **The fast path.** For `H|\s+(?!\S)|\s+` (GPT-2's, Llama 3's, Qwen 2's and DeepSeek
/// V3's patterns end so), where `H` has no look-around, matches no empty text and sets no
/// flag outside a group of its own (such a flag would reach the tail in `fancy-regex`):
/// `H` and `\s+` as two patterns of one `regex-automata` search, leftmost-first as the
/// alternation is, and the look-ahead done here. A match of `\s+` is a whole run of
/// whitespace (greedy), so it is followed by a non-space or the end: the backtracking
/// engine's `\s+(?!\S)` gives up the run's last character in the first case, when that
/// leaves any, and takes the whole run in the second; where it fails (one character before
/// a non-space) the last alternative, `\s+`, takes that one. `fancy-regex` runs the
/// look-ahead in its backtracking VM, which allocated its state for every match: 8 % of
/// the front's CPU per request at 1,000/s (docs/BENCHMARKS.md). That VM keeps a stack
/// entry per character of a whitespace run and gives up past a million, so a text with a
/// run of [`LONG_SPACES`] bytes or more is cut again by `fancy-regex` itself, the parts
/// already given dropped.
#[derive(Debug)]
struct Cutter {
    fancy: fancy_regex::Regex,
    fast: Option<regex_automata::meta::Regex>,
}

/// Whether `pattern` has a group of flags alone, such as `(?x)`, which sets them for the
/// rest of the pattern (a flag group with a body, `(?i:...)`, keeps them in it).
fn sets_flags(pattern: &str) -> bool {
    pattern.match_indices("(?").any(|(at, _)| {
        let rest = &pattern[at + 2..];
        let flags = rest
            .find(|c: char| !(c.is_ascii_alphabetic() || c == '-'))
            .unwrap_or(rest.len());
        rest[flags..].starts_with(')')
    })
}

impl Cutter {
    fn new(pattern: &str) -> Result<Self, &'static str> {
        let fancy =
            fancy_regex::Regex::new(pattern).map_err(|_| "a pattern fancy-regex rejects")?;
        let fast = pattern
            .strip_suffix(SPACES_TAIL)
            .filter(|head| !sets_flags(head))
            .and_then(|head| {
                let hir = regex_syntax::parse(head).ok()?;
                let props = hir.properties();
                if !props.look_set().is_empty() || props.minimum_len().is_none_or(|n| n == 0) {
                    return None;
                }
                regex_automata::meta::Regex::new_many(&[format!("(?:{head})"), r"\s+".into()]).ok()
            });
        Ok(Cutter { fancy, fast })
    }

    /// Calls `part` with each part of `text`, in order, and `out`, where it appends.
    fn cut<'t, T>(
        &self,
        text: &'t str,
        out: &mut Vec<T>,
        mut part: impl FnMut(&'t str, &mut Vec<T>),
    ) {
        let mark = out.len();
        if let Some(fast) = &self.fast {
            if Self::cut_fast(fast, text, out, &mut part) {
                return;
            }
            out.truncate(mark);
        }
        let mut from = 0;
        for m in self.fancy.find_iter(text) {
            let Ok(m) = m else { break };
            if m.start() > from {
                part(&text[from..m.start()], out);
            }
            part(m.as_str(), out);
            from = m.end();
        }
        if from < text.len() {
            part(&text[from..], out);
        }
    }

    /// The fast path; `false` where it gives the text up (a long run of whitespace).
    fn cut_fast<'t, T>(
        fast: &regex_automata::meta::Regex,
        text: &'t str,
        out: &mut Vec<T>,
        part: &mut impl FnMut(&'t str, &mut Vec<T>),
    ) -> bool {
        let mut from = 0;
        let mut input = regex_automata::Input::new(text);
        while let Some(m) = fast.search(&input) {
            let (start, mut end) = (m.start(), m.end());
            if m.pattern().as_usize() == 1 {
                if end - start >= LONG_SPACES {
                    return false;
                }
                let last = text[start..end]
                    .chars()
                    .next_back()
                    .map_or(0, char::len_utf8);
                if end < text.len() && end - start > last {
                    end -= last;
                }
            }
            if start > from {
                part(&text[from..start], out);
            }
            part(&text[start..end], out);
            from = end;
            input.set_start(end);
        }
        if from < text.len() {
            part(&text[from..], out);
        }
        true
    }
}

/// The pre-tokenizer's steps: the `Split` regexes in order, then the `ByteLevel` step's
/// `add_prefix_space` and `use_regex`.
type Steps = (Vec<Cutter>, bool, bool);

/// The steps of a `ByteLevel` pre-tokenizer, or of a `Sequence` of isolating `Split`
/// steps by a regex followed by one `ByteLevel`.
fn steps(pre: &Json) -> Result<Steps, &'static str> {
    let byte_level = |p: &Json| {
        (p["type"] == "ByteLevel").then(|| {
            (
                p["add_prefix_space"] == Json::Bool(true),
                p["use_regex"] != Json::Bool(false),
            )
        })
    };
    if let Some((prefix, regex)) = byte_level(pre) {
        return Ok((Vec::new(), prefix, regex));
    }
    let not_ours = "not a ByteLevel pre-tokenizer, alone or after isolating regex splits";
    if pre["type"] != "Sequence" {
        return Err(not_ours);
    }
    let list = pre["pretokenizers"].as_array().ok_or(not_ours)?;
    let (last, splits) = list.split_last().ok_or(not_ours)?;
    let (prefix, regex) = byte_level(last).ok_or(not_ours)?;
    let splits = splits
        .iter()
        .map(|p| {
            let regex = p["pattern"]["Regex"].as_str();
            match regex {
                Some(r)
                    if p["type"] == "Split"
                        && p["behavior"] == "Isolated"
                        && p["invert"] != Json::Bool(true) =>
                {
                    Cutter::new(r)
                }
                _ => Err(not_ours),
            }
        })
        .collect::<Result<_, _>>()?;
    Ok((splits, prefix, regex))
}

/// GPT-2's map of bytes to printable characters (the `ByteLevel` alphabet).
fn byte_chars() -> [char; 256] {
    let mut out = ['\0'; 256];
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut n = 0u32;
    for b in 0..=255u8 {
        out[usize::from(b)] = if printable(b) {
            char::from(b)
        } else {
            n += 1;
            // 256 + n - 1 is below 512: always a valid scalar value.
            char::from_u32(255 + n).unwrap_or('\0')
        };
    }
    out
}

impl ByteBpe {
    /// The encoder for `tok`, or why its steps are not ones this encoder reproduces.
    pub(super) fn new(tok: &Tokenizer) -> Result<Self, &'static str> {
        if tok.get_truncation().is_some() || tok.get_padding().is_some() {
            return Err("the tokenizer truncates or pads");
        }
        if tok.get_encode_special_tokens() {
            return Err("the tokenizer does not split at special tokens");
        }
        let spec: Json = serde_json::from_str(&tok.to_string(false).map_err(|_| "unreadable")?)
            .map_err(|_| "unreadable")?;
        let nfc = normaliser(&spec["normalizer"])?;
        let (splits, add_prefix_space, use_regex) = steps(&spec["pre_tokenizer"])?;
        let model = &spec["model"];
        if model["type"] != "BPE" {
            return Err("not a BPE model");
        }
        let empty = |v: &Json| v.is_null() || v.as_str() == Some("");
        if !model["dropout"].is_null()
            || !empty(&model["continuing_subword_prefix"])
            || !empty(&model["end_of_word_suffix"])
            || model["byte_fallback"] == Json::Bool(true)
        {
            return Err("BPE with dropout, affixes or byte fallback");
        }
        let vocab = tok.get_vocab(false);
        // The merges are read back as strings from the crate's id → string map: with two
        // strings of one id, the string a merge names could be the other one.
        let mut ids: Vec<u32> = vocab.values().copied().collect();
        ids.sort_unstable();
        if ids.windows(2).any(|w| w[0] == w[1]) {
            return Err("two vocabulary entries with one id");
        }
        let chars = byte_chars();
        let mut byte_ids = [0u32; 256];
        for (b, c) in chars.iter().enumerate() {
            byte_ids[b] = *vocab
                .get(c.to_string().as_str())
                .ok_or("a byte with no symbol in the vocabulary")?;
        }
        let Some(list) = model["merges"].as_array() else {
            return Err("no merges");
        };
        let mut merges = AHashMap::with_capacity(list.len());
        for (rank, m) in list.iter().enumerate() {
            // The crate writes each merge as a pair of strings.
            let (a, b) = match m {
                Json::Array(p) if p.len() == 2 => (
                    p[0].as_str().ok_or("a malformed merge")?,
                    p[1].as_str().ok_or("a malformed merge")?,
                ),
                _ => return Err("a malformed merge"),
            };
            let id = |s: &str| {
                vocab
                    .get(s)
                    .copied()
                    .ok_or("a merge outside the vocabulary")
            };
            let merged = id(&format!("{a}{b}"))?;
            let rank = u32::try_from(rank).map_err(|_| "too many merges")?;
            // A pair listed twice keeps its later rank, as the crate's map does.
            merges.insert((id(a)?, id(b)?), (rank, merged));
        }
        let mut raw = Vec::new();
        let mut normalized = Vec::new();
        let mut added: Vec<_> = tok.get_added_tokens_decoder().into_iter().collect();
        added.sort_by_key(|(id, _)| *id);
        for (id, t) in added {
            if t.single_word || t.lstrip || t.rstrip {
                return Err("an added token with single_word, lstrip or rstrip");
            }
            if t.content.is_empty() {
                continue;
            }
            if t.normalized {
                // Matched on normalised text, so normalised itself (as the crate does).
                let content = if nfc {
                    self::nfc(&t.content).into_owned()
                } else {
                    t.content
                };
                normalized.push((id, content));
            } else {
                raw.push((id, t.content));
            }
        }
        let whole_words = (model["ignore_merges"] == Json::Bool(true))
            .then(|| vocab.into_iter().collect::<AHashMap<_, _>>());
        let bpe = ByteBpe {
            raw: Added::new(&raw)?,
            normalized: Added::new(&normalized)?,
            nfc,
            splits,
            add_prefix_space,
            pattern: if use_regex {
                Some(Cutter::new(GPT2_PATTERN)?)
            } else {
                None
            },
            byte_ids,
            byte_chars: chars,
            merges,
            whole_words,
            cache: Mutex::new(AHashMap::new()),
        };
        // Each probe alone, and with every added token in it.
        let added: String = tok
            .get_added_tokens_decoder()
            .values()
            .map(|t| format!("{} {}x", t.content, t.content))
            .collect();
        for probe in PROBES {
            for text in [probe.to_string(), format!("{added}{probe}{added}")] {
                let want = tok
                    .encode_fast(text.as_str(), false)
                    .map_err(|_| "a probe the tokenizer cannot encode")?;
                let mut got = Vec::new();
                bpe.encode(&text, &mut got);
                if got != want.get_ids() {
                    return Err("the ids of a probe differ from the tokenizer's");
                }
            }
        }
        Ok(bpe)
    }

    /// The word cache, unless another thread holds it (a poisoned lock is taken: no
    /// update of the map can be left half done by a panic).
    fn cache(&self) -> Option<MutexGuard<'_, Words>> {
        match self.cache.try_lock() {
            Ok(g) => Some(g),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    /// Appends the ids of `text` (no special tokens added) to `out`.
    pub(super) fn encode(&self, text: &str, out: &mut Vec<u32>) {
        self.split_added(text, self.raw.as_ref(), true, out);
    }

    /// Splits `text` at the added tokens of `pass` (then at the next pass's), encoding what
    /// is between them.
    fn split_added(&self, text: &str, pass: Option<&Added>, first: bool, out: &mut Vec<u32>) {
        let next = |s: &str, out: &mut Vec<u32>| {
            if !first {
                self.split(0, s, out)
            } else if self.nfc {
                self.split_added(&nfc(s), self.normalized.as_ref(), false, out)
            } else {
                self.split_added(s, self.normalized.as_ref(), false, out)
            }
        };
        let Some(added) = pass else {
            return next(text, out);
        };
        let mut from = 0;
        for m in added.matcher.find_iter(text) {
            if m.start() > from {
                next(&text[from..m.start()], out);
            }
            out.push(added.ids[m.pattern().as_usize()]);
            from = m.end();
        }
        if from < text.len() {
            next(&text[from..], out);
        }
    }

    /// Encodes a part of a split with no added token in it, cut by the `Split` steps from
    /// the `step`th on.
    fn split(&self, step: usize, text: &str, out: &mut Vec<u32>) {
        if text.is_empty() {
            return;
        }
        match self.splits.get(step) {
            Some(cutter) => cutter.cut(text, out, |part, out| self.split(step + 1, part, out)),
            None => self.split_words(text, out),
        }
    }

    /// Encodes a part the `Split` steps left (not empty): the `ByteLevel` step's prefix
    /// space and, with its pattern, GPT-2's words and the gaps between them.
    fn split_words(&self, text: &str, out: &mut Vec<u32>) {
        let spaced;
        let text = if self.add_prefix_space && !text.starts_with(' ') {
            spaced = format!(" {text}");
            spaced.as_str()
        } else {
            text
        };
        match &self.pattern {
            Some(cutter) => cutter.cut(text, out, |word, out| self.word(word.as_bytes(), out)),
            None => self.word(text.as_bytes(), out),
        }
    }

    /// Appends the ids of one word.
    fn word(&self, bytes: &[u8], out: &mut Vec<u32>) {
        if bytes.is_empty() {
            return;
        }
        if bytes.len() >= CACHE_WORD_BYTES {
            return self.merge(bytes, out);
        }
        if let Some(cache) = self.cache()
            && let Some(ids) = cache.get(bytes)
        {
            out.extend_from_slice(ids);
            return;
        }
        let start = out.len();
        self.merge(bytes, out);
        if let Some(mut cache) = self.cache() {
            if cache.len() >= CACHE_WORDS {
                cache.clear();
            }
            cache.insert(bytes.into(), out[start..].into());
        }
    }

    /// Appends the ids of one word, merged by rank as the crate's `Word::merge_all` does.
    fn merge(&self, bytes: &[u8], out: &mut Vec<u32>) {
        if let Some(vocab) = &self.whole_words {
            let s: String = bytes
                .iter()
                .map(|&b| self.byte_chars[usize::from(b)])
                .collect();
            if let Some(&id) = vocab.get(&s) {
                out.push(id);
                return;
            }
        }
        // A doubly linked list of symbols over the bytes; a merged-away symbol is dead.
        struct Symbol {
            id: u32,
            prev: usize,
            next: usize,
            alive: bool,
        }
        const NONE: usize = usize::MAX;
        let n = bytes.len();
        let mut symbols: Vec<Symbol> = bytes
            .iter()
            .enumerate()
            .map(|(i, &b)| Symbol {
                id: self.byte_ids[usize::from(b)],
                prev: if i == 0 { NONE } else { i - 1 },
                next: if i + 1 == n { NONE } else { i + 1 },
                alive: true,
            })
            .collect();
        // Lowest rank first, then leftmost: (rank, position, merged id), reversed.
        let mut queue = std::collections::BinaryHeap::with_capacity(n);
        for i in 0..n.saturating_sub(1) {
            if let Some(&(rank, merged)) = self.merges.get(&(symbols[i].id, symbols[i + 1].id)) {
                queue.push(std::cmp::Reverse((rank, i, merged)));
            }
        }
        while let Some(std::cmp::Reverse((_, pos, merged))) = queue.pop() {
            let next = symbols[pos].next;
            if !symbols[pos].alive || next == NONE {
                continue;
            }
            // A stale entry: the pair at `pos` is no longer the one that merges to `merged`.
            if self
                .merges
                .get(&(symbols[pos].id, symbols[next].id))
                .is_none_or(|&(_, m)| m != merged)
            {
                continue;
            }
            symbols[pos].id = merged;
            symbols[next].alive = false;
            let after = symbols[next].next;
            symbols[pos].next = after;
            if after != NONE {
                symbols[after].prev = pos;
            }
            let before = symbols[pos].prev;
            if before != NONE
                && let Some(&(rank, m)) = self.merges.get(&(symbols[before].id, merged))
            {
                queue.push(std::cmp::Reverse((rank, before, m)));
            }
            if after != NONE
                && let Some(&(rank, m)) = self.merges.get(&(merged, symbols[after].id))
            {
                queue.push(std::cmp::Reverse((rank, pos, m)));
            }
        }
        let mut at = 0;
        while at != NONE {
            out.push(symbols[at].id);
            at = symbols[at].next;
        }
    }
}

/// Llama 3's `Split` pattern (as its `tokenizer.json` has it), for the tests and the fuzz
/// target.
#[cfg(any(test, fuzzing))]
pub(super) const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen 2's: one digit per part.
#[cfg(any(test, fuzzing))]
pub(super) const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A byte-level BPE of `vocab_size` tokens trained on `corpus` with this normaliser and
/// pre-tokenizer, with added tokens of each kind the encoder takes: two special ones, one
/// matched on the raw text and one matched after normalising whose text NFC changes. For
/// the tests and the fuzz target.
#[cfg(any(test, fuzzing))]
pub(super) fn trained_card<S: AsRef<str> + Send>(
    normalizer: Option<tokenizers::NormalizerWrapper>,
    pre: tokenizers::PreTokenizerWrapper,
    corpus: impl Iterator<Item = S> + Send,
    vocab_size: usize,
) -> Tokenizer {
    use tokenizers::AddedToken;
    use tokenizers::models::TrainerWrapper;
    use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
    let mut tok = Tokenizer::new(BPE::default());
    tok.with_normalizer(normalizer).expect("a normaliser");
    tok.with_pre_tokenizer(Some(pre));
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(1)
        .show_progress(false)
        .initial_alphabet(
            tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet()
                .into_iter()
                .collect(),
        )
        .build()
        .into();
    tok.train(&mut trainer, corpus).expect("trains");
    tok.add_special_tokens([
        AddedToken::from("<|im_start|>", true),
        AddedToken::from("<|im_end|>", true),
    ])
    .expect("adds");
    tok.add_tokens([
        AddedToken::from("<tool>", false).normalized(false),
        AddedToken::from("e\u{301}x", false).normalized(true),
    ])
    .expect("adds");
    tok
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use tokenizers::normalizers::NFC;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::sequence::Sequence;
    use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
    use tokenizers::{NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

    const FRAGMENTS: &[&str] = &[
        "the",
        " cat",
        " sat",
        "'s",
        "'ll",
        " don't",
        "  ",
        "   ",
        "\n",
        "\n\n",
        "\t",
        " ",
        "42",
        " 1234567",
        "3.14",
        "é",
        "café",
        " naïve",
        "日本語",
        " 🙂",
        "🙂🙂",
        "\u{a0}",
        "!!",
        " ?",
        "...",
        "<|im_start|>",
        "<|im_end|>",
        "<tool>",
        "<|im",
        "_",
        "\r\n",
        "x",
        "Hello",
        " World",
        "def f(x):",
        "    return",
        "{\"a\": 1}",
        "\u{0}",
        "\u{7f}",
        "\u{3000}",
        "\u{85}",
        "\u{2028}",
        "\u{b}",
        "\u{c}",
        "e\u{301}",
        " \u{301}",
        // Text that NFC changes: combining marks, the Angstrom sign, Hangul jamo.
        "e\u{301}x",
        "éx",
        "A\u{30a}",
        "\u{212b}",
        "\u{1100}\u{1161}\u{11a8}",
        "\u{1e0b}\u{323}",
        // For Llama 3's and Qwen 2's patterns: case-folded contractions, digit runs, a
        // letter run after a symbol, symbols before line breaks.
        "'S",
        "'LL",
        "'Re",
        "1234567890",
        "_private",
        "$var",
        ";\n",
        "}\r\n\r\n",
        " \n \n",
        "中文字符",
        "ひらがな",
        "カタカナ",
    ];

    /// xorshift64*: a fixed-seed stream of numbers for test texts.
    pub(in crate::proxy) fn xorshift(seed: u64) -> impl FnMut() -> u64 {
        let mut s = seed;
        move || {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            s.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
    }

    /// A fixed-seed stream of texts made of [`FRAGMENTS`] and random words.
    pub(in crate::proxy) fn texts(seed: u64, n: usize) -> Vec<String> {
        let mut next = xorshift(seed);
        (0..n)
            .map(|_| {
                let len = next() % 60;
                let mut text = String::new();
                for _ in 0..len {
                    // One in ten: a word of random letters, up to 300 of them (past the
                    // cache's 256 bytes), mostly unlike the training texts.
                    if next().is_multiple_of(10) {
                        let letters = 1 + next() % 300;
                        text.extend((0..letters).map(|_| char::from(b'a' + (next() % 6) as u8)));
                    } else {
                        text.push_str(FRAGMENTS[(next() % FRAGMENTS.len() as u64) as usize]);
                    }
                }
                text
            })
            .collect()
    }

    /// A byte-level BPE of GPT-2's shape trained on the texts, with added tokens of both
    /// kinds; its JSON.
    pub(in crate::proxy) fn trained(add_prefix_space: bool) -> Json {
        trained_as(None, ByteLevel::new(add_prefix_space, true, true).into())
    }

    /// The pre-tokenizer of Llama 3's shape for `splits`: each an isolating `Split`, then
    /// `ByteLevel` without its pattern.
    fn split_then_byte_level(splits: &[&str], byte_level: ByteLevel) -> PreTokenizerWrapper {
        let mut steps: Vec<PreTokenizerWrapper> = splits
            .iter()
            .map(|r| {
                Split::new(
                    SplitPattern::Regex((*r).into()),
                    SplitDelimiterBehavior::Isolated,
                    false,
                )
                .expect("a regex")
                .into()
            })
            .collect();
        steps.push(byte_level.into());
        Sequence::new(steps).into()
    }

    /// As [`trained`], with this normaliser and pre-tokenizer, and one more added token
    /// matched after normalising whose text NFC changes.
    fn trained_as(normalizer: Option<NormalizerWrapper>, pre: PreTokenizerWrapper) -> Json {
        let tok = trained_card(normalizer, pre, texts(1, 500).iter(), 600);
        serde_json::from_str(&tok.to_string(false).expect("serialises")).expect("json")
    }

    pub(in crate::proxy) fn load(spec: &Json) -> Tokenizer {
        Tokenizer::from_bytes(spec.to_string().as_bytes()).expect("loads")
    }

    fn same_as_the_crate(name: &str, tok: &Tokenizer) {
        let bpe = ByteBpe::new(tok).expect(name);
        // Twice: the second pass finds the words in the cache.
        for _ in 0..2 {
            for text in texts(7, 600) {
                let want = tok.encode_fast(text.as_str(), false).expect("encodes");
                let mut got = Vec::new();
                bpe.encode(&text, &mut got);
                assert_eq!(got, want.get_ids(), "{name}: {text:?}");
            }
        }
    }

    #[test]
    fn byte_level_ids_are_the_tokenizers_own() {
        let plain = trained(false);
        same_as_the_crate("plain", &load(&plain));
        same_as_the_crate("prefix space", &load(&trained(true)));
        // With a word in the vocabulary that no merge reaches: whole, it is one token.
        let mut ignore = plain.clone();
        ignore["model"]["ignore_merges"] = Json::Bool(true);
        let n = ignore["model"]["vocab"].as_object().expect("vocab").len();
        ignore["model"]["vocab"]["ĠZZZQ"] = serde_json::json!(n + 100);
        let tok = load(&ignore);
        same_as_the_crate("ignore_merges", &tok);
        let mut ids = Vec::new();
        ByteBpe::new(&tok)
            .expect("ignore_merges")
            .encode("a ZZZQ", &mut ids);
        assert_eq!(&ids[1..], &[n as u32 + 100], "{ids:?}");
        // An added token matched after normalising (there is no normaliser to change it).
        let mut normalized = plain.clone();
        for t in normalized["added_tokens"].as_array_mut().expect("added") {
            if t["content"] == "<tool>" {
                t["normalized"] = Json::Bool(true);
            }
        }
        same_as_the_crate("a normalized added token", &load(&normalized));
    }

    #[test]
    fn split_then_byte_level_ids_are_the_tokenizers_own() {
        // Llama 3: no normaliser, its pattern, `ignore_merges`.
        let mut llama = trained_as(
            None,
            split_then_byte_level(&[LLAMA3], ByteLevel::new(false, true, false)),
        );
        llama["model"]["ignore_merges"] = Json::Bool(true);
        same_as_the_crate("Llama 3", &load(&llama));
        // Qwen 2: NFC first, then its pattern.
        let qwen = trained_as(
            Some(NFC.into()),
            split_then_byte_level(&[QWEN2], ByteLevel::new(false, true, false)),
        );
        assert_eq!(qwen["normalizer"]["type"], "NFC");
        let tok = load(&qwen);
        same_as_the_crate("Qwen 2", &tok);
        // The added token whose text NFC changes is matched in its normal form.
        let bpe = ByteBpe::new(&tok).expect("Qwen 2");
        let id = tok.token_to_id("e\u{301}x").expect("added");
        for text in ["e\u{301}x", "éx"] {
            let mut ids = Vec::new();
            bpe.encode(text, &mut ids);
            assert_eq!(ids, [id], "{text:?}");
        }
        // Three splits before the bytes, as DeepSeek V3 has (digits, then CJK runs, then
        // words).
        let three = trained_as(
            Some(NFC.into()),
            split_then_byte_level(
                &[r"\p{N}{1,3}", "[一-龥\u{3040}-ゟ゠-ヿ]+", LLAMA3],
                ByteLevel::new(false, true, false),
            ),
        );
        same_as_the_crate("three splits", &load(&three));
        // DeepSeek V3 writes no normaliser as an empty `Sequence`; a `Sequence` of NFC
        // alone is NFC.
        let mut empty = three.clone();
        empty["normalizer"] = serde_json::json!({"type": "Sequence", "normalizers": []});
        same_as_the_crate("an empty normaliser sequence", &load(&empty));
        let mut one = three.clone();
        one["normalizer"] =
            serde_json::json!({"type": "Sequence", "normalizers": [{"type": "NFC"}]});
        same_as_the_crate("a sequence of NFC", &load(&one));
        // A split before `ByteLevel` with its own pattern and a prefix space: each part
        // gets its space.
        let lines = trained_as(
            None,
            split_then_byte_level(&[r"\n+"], ByteLevel::new(true, true, true)),
        );
        same_as_the_crate("lines, then GPT-2's words", &load(&lines));
        // `ByteLevel` alone without its pattern: each split is one word.
        same_as_the_crate(
            "no pattern",
            &load(&trained_as(None, ByteLevel::new(false, true, false).into())),
        );
    }

    /// The patterns of GPT-2, Llama 3 and Qwen 2 are cut without the backtracking VM, into
    /// the parts `fancy-regex` gives, on every test text and on runs of every kind of
    /// whitespace before every kind of character.
    #[test]
    fn patterns_cut_as_fancy_regex_cuts_them() {
        let spaces = [
            " ", "  ", "\t", "\n", "\r\n", "\u{a0}", "\u{3000}", " \n ", "\n\n  ",
        ];
        let after = ["", "x", "1", "!", " ", "\n", "'s", "日", "\u{301}"];
        let mut texts = texts(5, 400);
        for a in spaces {
            for b in spaces {
                for c in after {
                    texts.push(format!("{a}{c}{b}{c}"));
                    texts.push(format!("x{a}{b}{c}"));
                }
            }
        }
        // Runs long enough to be cut by fancy-regex: one that it still cuts, and one past
        // its stack, where it gives up and the rest of the text is one part.
        texts.push(format!("a{}b c", " ".repeat(LONG_SPACES)));
        texts.push(format!("a b{}c d", " ".repeat(1_000_001)));
        let parts = |cutter: &Cutter, text| {
            let mut parts = vec!["a dropped part"];
            cutter.cut(text, &mut parts, |p, out| out.push(p));
            parts
        };
        for pattern in [GPT2_PATTERN, LLAMA3, QWEN2] {
            let cutter = Cutter::new(pattern).expect("a pattern");
            assert!(cutter.fast.is_some(), "{pattern}");
            let fancy = Cutter {
                fast: None,
                ..Cutter::new(pattern).expect("a pattern")
            };
            for text in &texts {
                assert_eq!(
                    parts(&cutter, text),
                    parts(&fancy, text),
                    "{pattern}: {text:?}"
                );
            }
        }
        let given_up = parts(
            &Cutter::new(GPT2_PATTERN).expect("GPT-2"),
            &texts[texts.len() - 1],
        );
        assert_eq!(given_up[..3], ["a dropped part", "a", " b"]);
        assert_eq!(given_up.len(), 4, "the rest is one part");
        // Patterns with other look-around, that match empty text, or that set flags for
        // the tail, stay with fancy-regex.
        for pattern in [
            r"(?<=x)y|\s+(?!\S)|\s+",
            r"a*|\s+(?!\S)|\s+",
            r"(?U)x|\s+(?!\S)|\s+",
            r"(?x)x#|\s+(?!\S)|\s+",
            r"\s+(?!\S)",
            r"\p{N}{1,3}",
        ] {
            assert!(
                Cutter::new(pattern).expect("a pattern").fast.is_none(),
                "{pattern}"
            );
        }
    }

    #[test]
    fn steps_it_cannot_reproduce_are_refused() {
        let plain = trained(false);
        let refused = |edit: &dyn Fn(&mut Json), why: &str| {
            let mut spec = plain.clone();
            edit(&mut spec);
            assert_eq!(ByteBpe::new(&load(&spec)).unwrap_err(), why);
        };
        refused(
            &|s| s["normalizer"] = serde_json::json!({"type": "NFKC"}),
            "a normaliser other than NFC",
        );
        refused(
            &|s| {
                s["normalizer"] = serde_json::json!({"type": "Sequence",
                    "normalizers": [{"type": "NFC"}, {"type": "Lowercase"}]})
            },
            "a normaliser other than NFC",
        );
        // An alias: a second string with an existing id.
        refused(
            &|s| s["model"]["vocab"]["ZZalias"] = s["model"]["vocab"]["a"].clone(),
            "two vocabulary entries with one id",
        );
        let not_ours = "not a ByteLevel pre-tokenizer, alone or after isolating regex splits";
        let split = |behavior: &str, pattern: Json| {
            serde_json::json!({"type": "Split", "pattern": pattern, "behavior": behavior,
                "invert": false})
        };
        let sequence = |steps: Vec<Json>| {
            move |s: &mut Json| {
                s["pre_tokenizer"] = serde_json::json!({"type": "Sequence",
                    "pretokenizers": steps.clone()})
            }
        };
        let byte_level = plain["pre_tokenizer"].clone();
        for steps in [
            // Splits that keep the delimiter with a neighbour, drop it, or are inverted.
            vec![
                split("MergedWithPrevious", serde_json::json!({"Regex": "x"})),
                byte_level.clone(),
            ],
            vec![
                split("Removed", serde_json::json!({"Regex": "x"})),
                byte_level.clone(),
            ],
            vec![
                {
                    let mut s = split("Isolated", serde_json::json!({"Regex": "x"}));
                    s["invert"] = Json::Bool(true);
                    s
                },
                byte_level.clone(),
            ],
            // A literal pattern, another step, nothing after the split, nothing at all.
            vec![
                split("Isolated", serde_json::json!({"String": "x"})),
                byte_level.clone(),
            ],
            vec![
                serde_json::json!({"type": "Digits", "individual_digits": true}),
                byte_level.clone(),
            ],
            vec![
                byte_level.clone(),
                split("Isolated", serde_json::json!({"Regex": "x"})),
            ],
            vec![],
        ] {
            refused(&sequence(steps), not_ours);
        }
        refused(
            &|s| s["pre_tokenizer"] = serde_json::json!({"type": "Whitespace"}),
            not_ours,
        );
        refused(
            &|s| s["model"]["dropout"] = serde_json::json!(0.1),
            "BPE with dropout, affixes or byte fallback",
        );
        refused(
            &|s| {
                for t in s["added_tokens"].as_array_mut().unwrap() {
                    t["lstrip"] = Json::Bool(true);
                }
            },
            "an added token with single_word, lstrip or rstrip",
        );
        refused(
            &|s| s["truncation"] = serde_json::json!({"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}),
            "the tokenizer truncates or pads",
        );
        // A post-processor that adds to a sequence even when asked to add nothing.
        refused(
            &|s| {
                s["post_processor"] = serde_json::json!({"type": "TemplateProcessing",
                    "single": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                    "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                    "special_tokens": {}})
            },
            "the ids of a probe differ from the tokenizer's",
        );
    }
}
