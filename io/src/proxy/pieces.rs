//! A rendered prompt encoded in pieces cut at special tokens, with a cache of the pieces
//! the fleet keeps sending.
//!
//! An agentic session sends its whole conversation again on every turn (about 126 k tokens
//! per request on the agentic dev trace, tens of milliseconds of encoding each), almost all
//! of it text the router encoded on the turn before; a chat fleet sends the same system
//! prompt with every request. This module encodes only what it has not seen
//! (docs/BENCHMARKS.md, "Prompts encoded in pieces").
//!
//! **Why pieces are exact.** The `tokenizers` crate first splits its input at every added
//! token that is matched on the raw text (`normalized: false`, leftmost-longest), then
//! normalises, pre-tokenises and encodes each remaining split on its own: no token ever
//! spans a split, and a split's ids depend only on its text and on one fact about its
//! place, whether it starts the input (Metaspace's `prepend_scheme: first` reads that). So a
//! prompt cut at the start of such a token encodes, piece by piece, to the ids of the whole
//! when each piece is encoded in the context the whole gives it: a piece after the first is
//! encoded with the token that opens it, which is then dropped (it was the previous piece's
//! last id), and every piece but the last is encoded through the token that closes it, so
//! that `lstrip` and `rstrip` take the same whitespace as in the whole. Padding, truncation
//! and the post-processor act on the whole encoding: pieces are used only where the
//! tokenizer neither pads nor truncates, and where special tokens are to be added (a
//! completion's text prompt), only when the post-processor adds the same ids before and after
//! any single sequence (found at load by encoding probes with and without them; Llama's BOS,
//! for one), which then frame the pieces.
//!
//! **Where pieces are cut.** At the first cut token at least [`MIN_PIECE_BYTES`] past the
//! previous cut: the rule reads only the text before the cut, so the next turn of a session,
//! which repeats this turn's text and adds to it, is cut at the same places and finds every
//! piece but this turn's last in the cache. The last piece, which the next turn extends, is
//! encoded and not kept.
//!
//! **Who encodes a piece.** The byte-level encoder ([`super::bpe`]) where it reproduces
//! the card's tokenizer, the tokenizer's own `encode_fast` otherwise. With the byte-level
//! encoder, a prompt too short to cut, or with nothing to cut at, is encoded as one piece
//! (not kept), so that its ids too are checked below.
//!
//! **Checked, not trusted.** Each piece's encoding must begin and end with the ids of the
//! tokens it was cut at (otherwise the request is encoded whole and a fallback counted). The
//! first [`VERIFY_FIRST`] prompts are also encoded whole and compared before they are
//! answered: a difference turns pieces off for the card for good, counted and logged, and
//! the whole encoding is what the request gets. After them, one prompt in [`VERIFY_EVERY`]
//! is compared the same way on a thread of the card's own, so that the check never delays a
//! request (a whole encoding on the front's executor would stall every stream it relays: it
//! showed in the added p99); a difference found there turns pieces off for the prompts that
//! follow. The checker runs as `SCHED_IDLE` (`crate::threads`): woken at the default
//! class, it took the front's CPU for the whole encoding. Samples that find the checker
//! busy are skipped and counted. Cached pieces are
//! found by a hash under a per-process random key and confirmed by comparing their text.
//!
//! **Memory.** Bounded by `capacity` bytes (the text and the ids of each piece), least
//! recently used first out. One lock guards the cache; it is held for a lookup or an insert,
//! never while encoding.
//!
//! **Timing.** As with the engines' own prefix caches, a prompt whose pieces another client
//! sent recently is tokenised faster, which a client could time; deployments whose tenants
//! must not learn of each other's prompts turn the cache off (capacity 0).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use aho_corasick::{AhoCorasick, MatchKind};
use lru::LruCache;
use tokenizers::Tokenizer;

use super::bpe::ByteBpe;

/// A piece ends at the first cut token this many bytes or more past its start.
pub const MIN_PIECE_BYTES: usize = 256;

/// Prompts of a card encoded whole as well, first, to check the pieces.
pub const VERIFY_FIRST: u64 = 16;

/// After those, one prompt in this many is.
pub const VERIFY_EVERY: u64 = 256;

/// Bytes an entry costs beyond its text and ids (the map's slot, the list's links, the two
/// boxes' headers), for the capacity's accounting.
const ENTRY_OVERHEAD: usize = 96;

/// What the piece cache did, per card (relaxed counters, read for `/metrics`).
#[derive(Debug, Default)]
pub struct PieceStats {
    /// Prompts encoded in pieces (one piece or more).
    pub prompts: AtomicU64,
    /// Pieces found in the cache.
    pub hits: AtomicU64,
    /// Tokens of the pieces found in the cache.
    pub hit_tokens: AtomicU64,
    /// Pieces encoded (the last piece of each prompt included).
    pub misses: AtomicU64,
    /// Tokens of the pieces encoded.
    pub miss_tokens: AtomicU64,
    /// Prompts also encoded whole, and found equal.
    pub verified: AtomicU64,
    /// Prompts whose pieces differed from the whole (pieces are then off for the card).
    pub mismatches: AtomicU64,
    /// Prompts encoded whole because a piece did not begin or end with its cut token.
    pub fallbacks: AtomicU64,
    /// Pieces evicted to stay within the capacity.
    pub evictions: AtomicU64,
    /// Sampled prompts not compared because the checker was still busy with one.
    pub checks_skipped: AtomicU64,
    /// Bytes held now.
    pub bytes: AtomicU64,
}

struct Entry {
    first: bool,
    text: Box<str>,
    ids: Arc<[u32]>,
}

impl Entry {
    fn cost(&self) -> usize {
        self.text.len() + 4 * self.ids.len() + ENTRY_OVERHEAD
    }
}

struct Cache {
    map: LruCache<u64, Entry>,
    bytes: usize,
}

/// What the request path and the checker thread share. Every access is `Relaxed`: `off` is
/// a flag that publishes no other data (a prompt racing with its switch may still be
/// encoded in pieces once), and the counters are only summed for `/metrics`.
#[derive(Debug, Default)]
struct Shared {
    off: AtomicBool,
    stats: PieceStats,
}

impl Shared {
    /// Compares a prompt's pieces with its whole encoding; a difference turns pieces off
    /// (logged once). Whether they were equal.
    fn check(&self, whole: &[u32], pieces: &[u32], prompt_bytes: usize) -> bool {
        if whole == pieces {
            self.stats.verified.fetch_add(1, Relaxed);
            return true;
        }
        self.stats.mismatches.fetch_add(1, Relaxed);
        if !self.off.swap(true, Relaxed) {
            let at = whole.iter().zip(pieces).take_while(|(a, b)| a == b).count();
            tracing::error!(
                prompt_bytes,
                whole_tokens = whole.len(),
                piece_tokens = pieces.len(),
                first_difference = at,
                "a prompt encoded in pieces differs from its whole encoding: pieces are off for this tokenizer"
            );
        }
        false
    }
}

/// A sampled prompt for the checker: its text, whether special tokens were added, and its
/// ids from pieces.
type Sample = (Box<str>, bool, Vec<u32>);

/// A card's piecewise encoder.
pub(crate) struct Pieces {
    /// Every added token matched on the raw text, as the tokenizer matches them.
    /// None where the tokenizer has no added token matched on the raw text: each prompt is
    /// then one piece, for the byte-level encoder.
    matcher: Option<AhoCorasick>,
    /// Per pattern: its id, and whether a piece may be cut at it (`single_word` tokens may
    /// be skipped by the tokenizer where they touch a word: never cut there).
    tokens: Vec<(u32, bool)>,
    min_piece: usize,
    capacity: usize,
    /// The ids the post-processor puts before and after a single sequence when special
    /// tokens are added (none: such prompts are encoded whole).
    framing: Option<(Vec<u32>, Vec<u32>)>,
    cache: Mutex<Cache>,
    key: ahash::RandomState,
    shared: Arc<Shared>,
    /// The checker thread's queue (none: it could not be started, and samples are compared
    /// on the caller's thread). It ends when this is dropped.
    checker: Option<flume::Sender<Sample>>,
    /// The encoder of the pieces where it reproduces the tokenizer ([`super::bpe`]); the
    /// tokenizer's own `encode_fast` otherwise. With it, a prompt too short to cut, or with
    /// nothing to cut at, is one piece, checked like the others.
    fast: Option<ByteBpe>,
}

impl std::fmt::Debug for Pieces {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pieces")
            .field("cut_tokens", &self.tokens.iter().filter(|t| t.1).count())
            .field("capacity", &self.capacity)
            .field("off", &self.is_off())
            .field("byte_level", &self.fast.is_some())
            .finish_non_exhaustive()
    }
}

impl Pieces {
    /// The encoder for `tok`, holding at most `capacity` bytes of pieces; `Err` says why
    /// this tokenizer is encoded whole.
    pub(crate) fn new(tok: &Arc<Tokenizer>, capacity: usize) -> Result<Self, &'static str> {
        Self::with_min_piece(tok, capacity, MIN_PIECE_BYTES)
    }

    /// [`Self::new`] with pieces of at least `min_piece` bytes (the tests cut small texts).
    pub(crate) fn with_min_piece(
        tok: &Arc<Tokenizer>,
        capacity: usize,
        min_piece: usize,
    ) -> Result<Self, &'static str> {
        if capacity == 0 {
            return Err("the piece cache is off");
        }
        if tok.get_truncation().is_some() || tok.get_padding().is_some() {
            return Err("the tokenizer truncates or pads");
        }
        if tok.get_encode_special_tokens() {
            return Err("the tokenizer does not split at special tokens");
        }
        let mut added: Vec<(u32, tokenizers::AddedToken)> = tok
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| !t.normalized && !t.content.is_empty())
            .collect();
        added.sort_by_key(|(id, _)| *id);
        let fast = ByteBpe::new(tok)
            .map_err(|why| tracing::debug!(why, "pieces are encoded by the tokenizer itself"))
            .ok();
        // Without a token to cut at, each prompt is one piece: only worth it when the
        // byte-level encoder encodes it (GPT-2's own card matches its one added token
        // after normalising).
        if fast.is_none() && !added.iter().any(|(_, t)| !t.single_word) {
            return Err("no added token to cut at");
        }
        let matcher = if added.is_empty() {
            None
        } else {
            let m = AhoCorasick::builder()
                .match_kind(MatchKind::LeftmostLongest)
                .build(added.iter().map(|(_, t)| t.content.as_str()))
                .map_err(|_| "the added tokens do not build a matcher")?;
            Some(m)
        };
        let shared = Arc::new(Shared::default());
        let (tx, rx) = flume::bounded::<Sample>(1);
        let checker = {
            let (tok, shared) = (Arc::clone(tok), Arc::clone(&shared));
            std::thread::Builder::new()
                .name("kvrouter-tok-check".into())
                .spawn(move || {
                    crate::threads::run_as_background();
                    while let Ok((text, special, pieces)) = rx.recv() {
                        if let Ok(e) = tok.encode_fast(&*text, special) {
                            shared.check(e.get_ids(), &pieces, text.len());
                        }
                    }
                })
                .map(|_| tx)
                .map_err(|e| tracing::warn!(error = %e, "no checker thread: sampled prompts are compared inline"))
                .ok()
        };
        Ok(Self {
            fast,
            framing: framing(tok),
            matcher,
            tokens: added.iter().map(|(id, t)| (*id, !t.single_word)).collect(),
            min_piece: min_piece.max(1),
            capacity,
            cache: Mutex::new(Cache {
                map: LruCache::unbounded(),
                bytes: 0,
            }),
            key: ahash::RandomState::new(),
            shared,
            checker,
        })
    }

    pub(crate) fn stats(&self) -> &PieceStats {
        &self.shared.stats
    }

    /// Whether pieces are encoded by the byte-level encoder ([`super::bpe`]).
    pub(crate) fn byte_level(&self) -> bool {
        self.fast.is_some()
    }

    /// Whether a difference from the whole encoding turned pieces off.
    pub(crate) fn is_off(&self) -> bool {
        self.shared.off.load(Relaxed)
    }

    /// Where `text` is cut: each cut token's start, end and id.
    fn cuts(&self, text: &str) -> Vec<(usize, usize, u32)> {
        let mut out = Vec::new();
        let Some(matcher) = &self.matcher else {
            return out;
        };
        let mut from = 0;
        for m in matcher.find_iter(text) {
            let (id, cut) = self.tokens[m.pattern().as_usize()];
            if cut && m.start() >= from + self.min_piece {
                out.push((m.start(), m.end(), id));
                from = m.start();
            }
        }
        out
    }

    /// The ids of `text`, with the post-processor's special tokens where `special`, or
    /// `None` where the caller must encode it whole (too short to cut or nothing to cut at,
    /// unless the byte-level encoder encodes it as one piece; pieces off; a piece that did
    /// not end at its token; or special tokens this tokenizer adds otherwise than around
    /// the sequence).
    pub(crate) fn encode(
        &self,
        tok: &Tokenizer,
        text: &str,
        special: bool,
    ) -> Result<Option<Vec<u32>>, tokenizers::Error> {
        if self.is_off() {
            return Ok(None);
        }
        let (before, after) = match (&self.framing, special) {
            (_, false) => (&[][..], &[][..]),
            (Some((b, a)), true) => (&b[..], &a[..]),
            (None, true) => return Ok(None),
        };
        let cuts = if text.len() < 2 * self.min_piece {
            Vec::new()
        } else {
            self.cuts(text)
        };
        if cuts.is_empty() && self.fast.is_none() {
            return Ok(None);
        }
        let mut ids = Vec::with_capacity(text.len() / 3);
        ids.extend_from_slice(before);
        let mut start = 0;
        let mut lead = None;
        for &(at, end, id) in &cuts {
            match self.piece(tok, &text[start..end], lead, Some(id))? {
                Some(p) => ids.extend_from_slice(&p),
                None => return Ok(self.fell_back()),
            }
            start = at;
            lead = Some(id);
        }
        match self.piece(tok, &text[start..], lead, None)? {
            Some(p) => ids.extend_from_slice(&p),
            None => return Ok(self.fell_back()),
        }
        ids.extend_from_slice(after);
        let n = self.stats().prompts.fetch_add(1, Relaxed);
        let sampled = n >= VERIFY_FIRST && n.is_multiple_of(VERIFY_EVERY);
        if let (true, Some(tx)) = (sampled, &self.checker) {
            if tx.try_send((text.into(), special, ids.clone())).is_err() {
                self.stats().checks_skipped.fetch_add(1, Relaxed);
            }
        } else if n < VERIFY_FIRST || sampled {
            let whole = tok.encode_fast(text, special)?.get_ids().to_vec();
            if !self.shared.check(&whole, &ids, text.len()) {
                return Ok(Some(whole));
            }
        }
        Ok(Some(ids))
    }

    fn fell_back(&self) -> Option<Vec<u32>> {
        self.stats().fallbacks.fetch_add(1, Relaxed);
        None
    }

    /// The ids of one piece: `lead` is the id of the token that opens it (none for the
    /// first piece), which is dropped; `trail` the id of the token that closes it (none for
    /// the last piece, which is not cached). `None`: the encoding did not begin or end with
    /// them.
    fn piece(
        &self,
        tok: &Tokenizer,
        text: &str,
        lead: Option<u32>,
        trail: Option<u32>,
    ) -> Result<Option<Arc<[u32]>>, tokenizers::Error> {
        let first = lead.is_none();
        let key = trail.map(|_| self.key.hash_one((first, text)));
        if let Some(k) = key {
            let mut c = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(e) = c.map.get(&k)
                && e.first == first
                && *e.text == *text
            {
                self.stats().hits.fetch_add(1, Relaxed);
                self.stats()
                    .hit_tokens
                    .fetch_add(e.ids.len() as u64, Relaxed);
                return Ok(Some(Arc::clone(&e.ids)));
            }
        }
        let enc;
        let mut own = Vec::new();
        let all = match &self.fast {
            Some(f) => {
                own.reserve(text.len() / 3);
                f.encode(text, &mut own);
                &own[..]
            }
            None => {
                enc = tok.encode_fast(text, false)?;
                enc.get_ids()
            }
        };
        if lead.is_some_and(|l| all.first() != Some(&l))
            || trail.is_some_and(|t| all.last() != Some(&t))
        {
            return Ok(None);
        }
        let ids: Arc<[u32]> = all[usize::from(!first)..].into();
        self.stats().misses.fetch_add(1, Relaxed);
        self.stats()
            .miss_tokens
            .fetch_add(ids.len() as u64, Relaxed);
        if let Some(k) = key {
            self.insert(
                k,
                Entry {
                    first,
                    text: text.into(),
                    ids: Arc::clone(&ids),
                },
            );
        }
        Ok(Some(ids))
    }

    fn insert(&self, key: u64, e: Entry) {
        let cost = e.cost();
        if cost > self.capacity {
            return;
        }
        let mut c = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(old) = c.map.put(key, e) {
            c.bytes -= old.cost();
        }
        c.bytes += cost;
        let mut evicted = 0;
        while c.bytes > self.capacity {
            match c.map.pop_lru() {
                Some((_, old)) => {
                    c.bytes -= old.cost();
                    evicted += 1;
                }
                None => break,
            }
        }
        self.stats().evictions.fetch_add(evicted, Relaxed);
        self.stats().bytes.store(c.bytes as u64, Relaxed);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.cache.lock().map(|c| c.map.len()).unwrap_or(0)
    }
}

/// The ids the post-processor adds before and after a single sequence, if it adds the same
/// around every one: each probe's ids with special tokens must be its ids without them,
/// framed by the same two runs.
fn framing(tok: &Tokenizer) -> Option<(Vec<u32>, Vec<u32>)> {
    let mut found: Option<(Vec<u32>, Vec<u32>)> = None;
    for probe in ["a", "hello world", "0 1\n2"] {
        let with = tok.encode_fast(probe, true).ok()?.get_ids().to_vec();
        let bare = tok.encode_fast(probe, false).ok()?.get_ids().to_vec();
        if bare.is_empty() {
            return None;
        }
        let at = with.windows(bare.len()).position(|w| w == bare)?;
        let frame = (with[..at].to_vec(), with[at + bare.len()..].to_vec());
        match &found {
            Some(f) if *f != frame => return None,
            _ => found = Some(frame),
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const FRAGMENTS: &[&str] = &[
        "hello",
        " ",
        "the",
        "cat",
        "\n",
        "  ",
        "x y",
        "é",
        "<s>",
        "<|im_start|>",
        "<|im_end|>",
        "<tool>",
        "<w>",
        " <w> ",
        "the cat",
        "▁",
        "<n>",
        " <n>",
    ];

    /// A small BPE over letters with a few merges; added tokens of every kind (special or
    /// not, `lstrip`/`rstrip`, `single_word`, one matched after normalisation).
    fn tokenizer(normalizer: serde_json::Value, pre: serde_json::Value) -> Tokenizer {
        tokenizer_with(normalizer, pre, serde_json::Value::Null)
    }

    /// [`tokenizer`] with a post-processor.
    fn tokenizer_with(
        normalizer: serde_json::Value,
        pre: serde_json::Value,
        post: serde_json::Value,
    ) -> Tokenizer {
        let added = [
            ("<unk>", true, false, false, false, false),
            ("<s>", true, false, false, false, false),
            ("<|im_start|>", true, false, false, false, false),
            ("<|im_end|>", true, true, true, false, false),
            ("<tool>", false, false, false, false, false),
            ("<w>", true, false, false, true, false),
            ("<n>", true, false, false, false, true),
        ];
        let mut vocab = serde_json::Map::new();
        let mut tokens = Vec::new();
        for (i, (content, special, lstrip, rstrip, single_word, normalized)) in
            added.iter().enumerate()
        {
            vocab.insert((*content).into(), json!(i));
            tokens.push(
                json!({"id": i, "content": content, "single_word": single_word,
                "lstrip": lstrip, "rstrip": rstrip, "normalized": normalized, "special": special}),
            );
        }
        let mut symbols: Vec<String> = "▁abcdefghijklmnopqrstuvwxyz\n<>|_"
            .chars()
            .map(String::from)
            .collect();
        let merges = [
            ("▁", "t"),
            ("h", "e"),
            ("▁t", "he"),
            ("c", "a"),
            ("ca", "t"),
        ];
        for (a, b) in merges {
            symbols.push(format!("{a}{b}"));
        }
        for s in symbols {
            let n = vocab.len();
            vocab.entry(s).or_insert(json!(n));
        }
        let merges: Vec<_> = merges.iter().map(|(a, b)| json!([a, b])).collect();
        let spec = json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": tokens,
            "normalizer": normalizer, "pre_tokenizer": pre, "post_processor": post, "decoder": null,
            "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
                "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
                "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": merges}
        });
        Tokenizer::from_bytes(spec.to_string().as_bytes()).expect("tokenizer")
    }

    fn metaspace_raw(scheme: &str) -> Tokenizer {
        tokenizer(
            serde_json::Value::Null,
            json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": scheme, "split": true}),
        )
    }

    fn metaspace(scheme: &str) -> Arc<Tokenizer> {
        Arc::new(metaspace_raw(scheme))
    }

    fn llama2_normalizer() -> Arc<Tokenizer> {
        Arc::new(tokenizer(
            json!({"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}),
            serde_json::Value::Null,
        ))
    }

    /// A fixed-seed stream of texts made of [`FRAGMENTS`].
    fn texts(seed: u64, n: usize) -> Vec<String> {
        let mut next = super::super::bpe::tests::xorshift(seed);
        (0..n)
            .map(|_| {
                let len = 1 + next() % 80;
                (0..len)
                    .map(|_| FRAGMENTS[(next() % FRAGMENTS.len() as u64) as usize])
                    .collect()
            })
            .collect()
    }

    fn whole(tok: &Tokenizer, text: &str) -> Vec<u32> {
        tok.encode(text, false).expect("encodes").get_ids().to_vec()
    }

    /// A byte-level card: its pieces, and prompts too short to cut or with nothing to cut
    /// at, are encoded by the byte-level encoder as one piece, checked like the others.
    #[test]
    fn byte_level_pieces_and_short_prompts_give_the_whole_encoding() {
        use super::super::bpe::tests::{load, texts, trained};
        let tok = Arc::new(load(&trained(false)));
        let p = Pieces::with_min_piece(&tok, 1 << 20, 16).expect("pieces");
        assert!(p.byte_level());
        let (mut short, mut cut) = (0, 0);
        for pass in 0..2 {
            for text in texts(11, 400) {
                let want = whole(&tok, &text);
                let got = p.encode(&tok, &text, false).expect("encodes");
                assert_eq!(got.as_ref(), Some(&want), "pass {pass}: {text:?}");
                if p.cuts(&text).is_empty() || text.len() < 32 {
                    short += 1;
                } else {
                    cut += 1;
                }
            }
        }
        assert!(short > 50 && cut > 50, "{short} short, {cut} cut");
        let s = p.stats();
        assert_eq!(s.prompts.load(Relaxed), 800);
        assert_eq!(s.mismatches.load(Relaxed), 0);
        assert!(s.verified.load(Relaxed) >= VERIFY_FIRST);
        assert!(s.hits.load(Relaxed) > 0, "the second pass hits");
        // Off after a difference: every prompt, short ones too, goes back to the crate.
        let q = Pieces::with_min_piece(&tok, 1 << 20, 16).expect("pieces");
        let text = "x".repeat(40) + "<|im_start|>" + &"y".repeat(40) + "<|im_end|>";
        assert_eq!(
            q.encode(&tok, &text, false).expect("encodes"),
            Some(whole(&tok, &text))
        );
        corrupt_first_piece(&q);
        assert_eq!(
            q.encode(&tok, &text, false).expect("encodes"),
            Some(whole(&tok, &text))
        );
        assert!(q.is_off());
        assert_eq!(q.encode(&tok, "short", false).expect("encodes"), None);
    }

    /// GPT-2's own card matches its one added token (`<|endoftext|>`) after normalising:
    /// nothing to cut at, but every prompt is one piece for the byte-level encoder.
    #[test]
    fn a_byte_level_card_with_nothing_to_cut_at_is_one_piece_per_prompt() {
        use super::super::bpe::tests::{load, texts, trained};
        let mut spec = trained(false);
        let added = spec["added_tokens"].as_array_mut().expect("added");
        added.retain(|t| t["content"] == "<|im_end|>");
        added[0]["normalized"] = serde_json::Value::Bool(true);
        let tok = Arc::new(load(&spec));
        let p = Pieces::with_min_piece(&tok, 1 << 20, 16).expect("pieces");
        assert!(p.byte_level());
        for text in texts(13, 200) {
            assert!(p.cuts(&text).is_empty());
            let got = p.encode(&tok, &text, false).expect("encodes");
            assert_eq!(got, Some(whole(&tok, &text)), "{text:?}");
        }
        assert_eq!(p.stats().mismatches.load(Relaxed), 0);
        // Without the byte-level encoder, such a card is encoded whole.
        spec["normalizer"] = serde_json::json!({"type": "NFKC"});
        let tok = Arc::new(load(&spec));
        assert_eq!(
            Pieces::with_min_piece(&tok, 1 << 20, 16).unwrap_err(),
            "no added token to cut at"
        );
    }

    #[test]
    fn pieces_give_the_whole_encoding_for_every_kind_of_tokenizer() {
        for (name, tok) in [
            ("metaspace first", metaspace("first")),
            ("metaspace always", metaspace("always")),
            ("metaspace never", metaspace("never")),
            ("llama-2 normaliser", llama2_normalizer()),
        ] {
            for min_piece in [1, 4, 16] {
                let p = Pieces::with_min_piece(&tok, 1 << 20, min_piece).expect("pieces");
                let mut cut = 0;
                // Twice: the second pass finds the pieces in the cache.
                for pass in 0..2 {
                    for text in texts(7, 400) {
                        let want = whole(&tok, &text);
                        if let Some(got) = p.encode(&tok, &text, false).expect("encodes") {
                            assert_eq!(got, want, "{name}, min {min_piece}, pass {pass}: {text:?}");
                            cut += 1;
                        }
                    }
                }
                let s = p.stats();
                assert!(cut > 400, "{name}: {cut} prompts cut");
                assert_eq!(s.mismatches.load(Relaxed), 0, "{name}");
                assert!(!p.is_off(), "{name}");
                assert!(s.hits.load(Relaxed) > 0, "{name}: the second pass hits");
                assert!(s.verified.load(Relaxed) >= VERIFY_FIRST, "{name}");
            }
        }
    }

    /// Llama's framing: `<s>` before every sequence when special tokens are added, and,
    /// for the test, `<|im_end|>` after it.
    fn with_bos() -> Arc<Tokenizer> {
        let t = |id: &str| json!({"SpecialToken": {"id": id, "type_id": 0}});
        let seq = |id: &str| json!({"Sequence": {"id": id, "type_id": 0}});
        Arc::new(tokenizer_with(
            serde_json::Value::Null,
            json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": true}),
            json!({"type": "TemplateProcessing",
                "single": [t("<s>"), seq("A"), t("<|im_end|>")],
                "pair": [t("<s>"), seq("A"), seq("B")],
                "special_tokens": {
                    "<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]},
                    "<|im_end|>": {"id": "<|im_end|>", "ids": [3], "tokens": ["<|im_end|>"]}}}),
        ))
    }

    #[test]
    fn special_tokens_the_post_processor_adds_frame_the_pieces() {
        let tok = with_bos();
        let p = Pieces::with_min_piece(&tok, 1 << 20, 4).expect("pieces");
        assert_eq!(p.framing, Some((vec![1], vec![3])));
        let mut cut = 0;
        for text in texts(11, 300) {
            for special in [false, true] {
                let want = tok.encode(text.as_str(), special).expect("encodes");
                if let Some(got) = p.encode(&tok, &text, special).expect("encodes") {
                    assert_eq!(got, want.get_ids(), "special {special}: {text:?}");
                    cut += 1;
                }
            }
        }
        assert!(cut > 300, "{cut}");
        assert_eq!(p.stats().mismatches.load(Relaxed), 0);
        // No post-processor: nothing added either way.
        let plain = metaspace("first");
        assert_eq!(framing(&plain), Some((vec![], vec![])));
    }

    #[test]
    fn a_sessions_next_turn_encodes_only_what_it_added() {
        let tok = metaspace("first");
        let p = Pieces::with_min_piece(&tok, 1 << 20, 64).expect("pieces");
        let turn = |n: usize| -> String {
            (0..n)
                .map(|i| {
                    format!(
                        "<|im_start|>user\nthe cat {i} {}<|im_end|>\n",
                        "hello ".repeat(20)
                    )
                })
                .collect::<String>()
                + "<|im_start|>assistant\n"
        };
        let first = p.encode(&tok, &turn(20), false).expect("ok").expect("cut");
        assert_eq!(first, whole(&tok, &turn(20)));
        let missed = p.stats().miss_tokens.load(Relaxed);
        let second = p.encode(&tok, &turn(21), false).expect("ok").expect("cut");
        assert_eq!(second, whole(&tok, &turn(21)));
        let new = p.stats().miss_tokens.load(Relaxed) - missed;
        let hit = p.stats().hit_tokens.load(Relaxed);
        assert!(
            hit > 10 * new,
            "the next turn re-encodes {new} tokens and finds {hit} in the cache"
        );
    }

    #[test]
    fn the_cache_stays_within_its_bytes() {
        let tok = metaspace("first");
        let p = Pieces::with_min_piece(&tok, 4096, 8).expect("pieces");
        for text in texts(3, 300) {
            if let Some(got) = p.encode(&tok, &text, false).expect("encodes") {
                assert_eq!(got, whole(&tok, &text));
            }
        }
        let s = p.stats();
        assert!(s.evictions.load(Relaxed) > 0);
        assert!(s.bytes.load(Relaxed) <= 4096);
        assert!(p.len() > 0);
    }

    /// Corrupts the first piece's ids in place, as a tokenizer whose pieces are not
    /// independent would have produced them.
    fn corrupt_first_piece(p: &Pieces) {
        let mut c = p.cache.lock().expect("lock");
        let (_, e) = c
            .map
            .iter_mut()
            .find(|(_, e)| e.first)
            .expect("first piece");
        let mut ids = e.ids.to_vec();
        ids.push(ids[0]);
        e.ids = ids.into();
    }

    #[test]
    fn a_wrong_piece_is_caught_by_the_whole_encoding_and_turns_pieces_off() {
        let tok = metaspace("first");
        let p = Pieces::with_min_piece(&tok, 1 << 20, 4).expect("pieces");
        let text = "the cat<|im_start|>hello the cat<|im_end|>cat cat";
        assert_eq!(
            p.encode(&tok, text, false).expect("ok"),
            Some(whole(&tok, text))
        );
        corrupt_first_piece(&p);
        assert_eq!(
            p.encode(&tok, text, false).expect("ok"),
            Some(whole(&tok, text))
        );
        assert_eq!(p.stats().mismatches.load(Relaxed), 1);
        assert!(p.is_off());
        assert_eq!(
            p.encode(&tok, text, false).expect("ok"),
            None,
            "off: whole from now on"
        );
    }

    #[test]
    fn tokenizers_that_pad_truncate_or_have_nothing_to_cut_at_are_encoded_whole() {
        assert!(
            Pieces::new(&metaspace("first"), 0).is_err(),
            "capacity 0: off"
        );
        let mut tok = metaspace_raw("first");
        tok.with_truncation(Some(tokenizers::TruncationParams::default()))
            .expect("truncation");
        assert!(Pieces::new(&Arc::new(tok), 1 << 20).is_err());
        let mut tok = metaspace_raw("first");
        tok.set_encode_special_tokens(true);
        assert!(Pieces::new(&Arc::new(tok), 1 << 20).is_err());
    }

    #[test]
    fn a_sampled_prompt_is_checked_off_the_request_path() {
        let tok = metaspace("first");
        let p = Pieces::with_min_piece(&tok, 1 << 20, 4).expect("pieces");
        let text = "the cat<|im_start|>hello the cat<|im_end|>cat cat";
        // Up to the first prompt sampled after the ones checked inline.
        for _ in 0..VERIFY_EVERY {
            assert_eq!(
                p.encode(&tok, text, false).expect("ok"),
                Some(whole(&tok, text))
            );
        }
        assert_eq!(p.stats().verified.load(Relaxed), VERIFY_FIRST);
        corrupt_first_piece(&p);
        // This one is answered from pieces (wrong, as a broken tokenizer's would be) and
        // compared on the checker thread, which turns pieces off for what follows.
        let wrong = p.encode(&tok, text, false).expect("ok").expect("pieces");
        assert_ne!(wrong, whole(&tok, text));
        let t = std::time::Instant::now();
        while !p.is_off() {
            assert!(
                t.elapsed() < std::time::Duration::from_secs(10),
                "never checked"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(p.stats().mismatches.load(Relaxed), 1);
        assert_eq!(p.encode(&tok, text, false).expect("ok"), None);
    }
}
