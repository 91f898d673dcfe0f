//! The proxy's tokenisation against the reference: for a set of chat requests, the prompt
//! our chat template rendering (minijinja) writes and the token ids our tokenizer (the
//! `tokenizers` crate) gives are those of Python `transformers`' `apply_chat_template` on
//! the same card. Cards: the tiny card of `../shared/dynamo/make_tiny_model.py`, and the
//! tiny tokenizer under Qwen2.5's template (system prompt, tools, tool calls, tool
//! responses). Then two cards with real vocabularies (`scripts/real-cards.sh`): Llama 3's
//! under its template and Qwen's under Qwen2.5's, on the requests, on sessions and on 300
//! texts of every kind. A mismatch here would silently destroy the proxy's hit ratio. Long
//! multi-turn sessions go through the piece cache (`kvrouter_io::proxy::pieces`): their ids
//! must be `transformers`' too, turn after turn.

use kvrouter_io::proxy::model::ModelCard;
use kvrouter_tests::openai::{card_with_template, real_cards, reference_tokens, tiny_card};
use kvrouter_tests::repo_root;
use serde_json::json;

fn requests() -> Vec<serde_json::Value> {
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city, today.",
         "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"},
         "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "search", "description": "Search the web – fast.",
         "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
    ]);
    vec![
        json!({"messages": [{"role": "user", "content": "Hello there!"}]}),
        json!({"messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is a KV cache?\nAnswer in a line."}]}),
        json!({"messages": [
            {"role": "user", "content": "Write a haiku."},
            {"role": "assistant", "content": "Blocks hashed in a row,\nthe router knows where they live,\nprefill is skipped now."},
            {"role": "user", "content": "Another, about caches — in Français: déjà vu ✓"}]}),
        json!({"messages": [{"role": "user", "content": "No generation prompt."}], "add_generation_prompt": false}),
        json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "Part one."}, {"type": "text", "text": "Part two."}]}]}),
        json!({"tools": tools, "messages": [
            {"role": "system", "content": "You plan trips."},
            {"role": "user", "content": "Weather in Paris, and search for museums?"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"c\"}"}},
                {"id": "c2", "type": "function", "function": {"name": "search", "arguments": "{\"q\": \"musées Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"},
            {"role": "tool", "tool_call_id": "c2", "content": "Louvre, Orsay"},
            {"role": "user", "content": "Thanks!"}]}),
        json!({"tools": tools, "messages": [{"role": "user", "content": "Tools, no system prompt."}]}),
    ]
}

fn check(card_dir: &std::path::Path, requests: &[serde_json::Value]) -> ModelCard {
    let card = ModelCard::load(card_dir).expect("card loads");
    let reference = reference_tokens(card_dir, requests);
    assert_eq!(reference.len(), requests.len());
    for (req, want) in requests.iter().zip(&reference) {
        assert!(
            want.get("error").is_none(),
            "transformers failed on {req}: {want}"
        );
        let text = card.render_chat(req).expect("renders");
        assert_eq!(
            text,
            want["text"].as_str().expect("text"),
            "rendering of {req}"
        );
        let ids: Vec<u64> = card
            .chat_tokens(req)
            .expect("tokenises")
            .into_iter()
            .map(u64::from)
            .collect();
        let want_ids: Vec<u64> = want["ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|v| v.as_u64().expect("id"))
            .collect();
        assert!(!ids.is_empty());
        assert_eq!(ids, want_ids, "token ids of {req}");
    }
    card
}

/// Three turns of one session whose messages are long enough to be cut into pieces: each
/// turn repeats the previous one and adds an answer and a question (with `tools`, an
/// assistant tool call and its result too).
fn session(tools: bool) -> Vec<serde_json::Value> {
    let long = |t: usize| -> String {
        (0..120)
            .map(|i| {
                format!(
                    "line {t}.{i}: the cache holds block {} (cafe\u{301}, 日本語) \n",
                    i * 37 % 101
                )
            })
            .collect()
    };
    let mut messages = vec![
        json!({"role": "system", "content": format!("You review code.\n{}", long(0))}),
        json!({"role": "user", "content": long(1)}),
    ];
    let mut turns = vec![json!({"messages": messages.clone()})];
    for t in 2..4 {
        if tools {
            messages.push(json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": format!("c{t}"), "type": "function", "function": {"name": "search",
                 "arguments": format!("{{\"q\": \"block {t}\"}}")}}]}));
            messages.push(
                json!({"role": "tool", "tool_call_id": format!("c{t}"), "content": long(t * 10)}),
            );
        }
        messages.push(json!({"role": "assistant", "content": long(t * 10 + 1)}));
        messages.push(json!({"role": "user", "content": long(t * 10 + 2)}));
        turns.push(json!({"messages": messages.clone()}));
    }
    if tools {
        let tools = requests()
            .into_iter()
            .find_map(|r| r.get("tools").cloned())
            .expect("tools");
        for t in &mut turns {
            t["tools"] = tools.clone();
        }
    }
    turns
}

fn check_session(card_dir: &std::path::Path, tools: bool) {
    let turns = session(tools);
    let card = check(card_dir, &turns);
    let s = card.piece_stats().expect("the card encodes in pieces");
    let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(load(&s.prompts), 3, "every turn was cut into pieces");
    assert_eq!(load(&s.verified), 3, "and checked against the whole");
    assert_eq!(load(&s.mismatches) + load(&s.fallbacks), 0);
    assert!(
        load(&s.hits) > 0,
        "later turns find the earlier turns' pieces"
    );
    // The last turn again: only its last piece (the last message and the generation
    // prompt) is encoded.
    let (hit, miss) = (load(&s.hit_tokens), load(&s.miss_tokens));
    let last = turns.last().expect("turns");
    let ids = card.chat_tokens(last).expect("tokenises");
    let text = card.render_chat(last).expect("renders");
    assert_eq!(ids, card.encode_whole(&text, false).expect("whole"));
    let (hit, miss) = (load(&s.hit_tokens) - hit, load(&s.miss_tokens) - miss);
    assert_eq!((hit + miss) as usize, ids.len());
    assert!(
        hit > 2 * miss,
        "{hit} tokens from the cache, {miss} encoded"
    );
}

#[test]
fn tiny_card_sessions_in_pieces_match_transformers() {
    check_session(&tiny_card(), false);
}

#[test]
fn qwen_sessions_with_tools_in_pieces_match_transformers() {
    let template =
        std::fs::read_to_string(repo_root().join("tests/fixtures/chat-templates/qwen2.5.jinja"))
            .expect("template");
    let dir = card_with_template("qwen2.5-session", &template);
    // Qwen's own added tokens, so that its template's markers are cut at as in Qwen's
    // tokenizer (special ones, and `<tool_call>` as a plain added token).
    let path = dir.join("tokenizer.json");
    let mut tok: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("json");
    let next = tok["model"]["vocab"].as_object().expect("vocab").len()
        + tok["added_tokens"].as_array().expect("added").len();
    for (i, (content, special)) in [
        ("<|im_start|>", true),
        ("<|im_end|>", true),
        ("<tool_call>", false),
        ("</tool_call>", false),
    ]
    .into_iter()
    .enumerate()
    {
        tok["added_tokens"]
            .as_array_mut()
            .expect("added")
            .push(json!({
            "id": next + i, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": special}));
    }
    // Qwen 2's steps before the vocabulary: NFC, then its pattern, then the byte-level
    // alphabet (the tiny card's merges and vocabulary stay).
    tok["normalizer"] = json!({"type": "NFC"});
    tok["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN2_PATTERN}, "behavior": "Isolated",
         "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false,
         "use_regex": false}]});
    std::fs::write(&path, tok.to_string()).expect("write");
    check_session(&dir, true);
    let card = ModelCard::load(&dir).expect("card loads");
    assert!(card.byte_level(), "Qwen 2's shape is encoded by the router");
}

/// Qwen 2's `Split` pattern, as its `tokenizer.json` has it.
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

#[test]
fn tiny_card_ids_match_transformers() {
    // The tiny template prints content as a string: no tools there.
    let reqs: Vec<_> = requests()
        .into_iter()
        .filter(|r| r.get("tools").is_none())
        .collect();
    check(&tiny_card(), &reqs);
}

#[test]
fn qwen_template_with_tools_matches_transformers() {
    let template =
        std::fs::read_to_string(repo_root().join("tests/fixtures/chat-templates/qwen2.5.jinja"))
            .expect("template");
    let dir = card_with_template("qwen2.5", &template);
    check(&dir, &requests());
}

#[test]
fn a_failing_template_is_an_error_not_a_panic() {
    let dir = card_with_template(
        "strict",
        "{% for m in messages %}{% if m.role not in ['user', 'assistant', 'system'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}{{ m.content }}{% endfor %}",
    );
    let card = ModelCard::load(&dir).expect("card loads");
    let err = card
        .chat_tokens(&json!({"messages": [{"role": "tool", "content": "x"}]}))
        .expect_err("raises");
    assert!(err.to_string().contains("bad role tool"), "{err}");
    for bad in [
        json!({}),
        json!({"messages": "x"}),
        json!({"messages": [1]}),
    ] {
        assert!(card.chat_tokens(&bad).is_err(), "{bad}");
    }
    assert!(
        card.completion_tokens(&json!({"prompt": [1, 2, 3]}))
            .expect("ids")
            == vec![1, 2, 3]
    );
    assert!(
        card.completion_tokens(&json!({"prompt": ["a", "b"]}))
            .is_err()
    );
    assert!(card.completion_tokens(&json!({"prompt": [-1]})).is_err());
}

/// Fragments of the texts the real vocabularies are checked on: prose, code, numbers,
/// contractions in either case, text NFC changes (decomposed accents, Hangul jamo),
/// scripts without spaces, emoji sequences and whitespace of every kind.
const REAL_FRAGMENTS: &[&str] = &[
    "The router keeps",
    " a global index",
    " of every block.",
    " It's",
    " they'LL",
    " WE'VE",
    "I'm",
    "don't",
    "fn main() {\n",
    "    let x = vec![1, 2, 3];\n",
    "}\n",
    "\tif x:\n\t\treturn",
    "def f(a, b):\n    return a**b\n",
    "<div class=\"x\">",
    "</div>",
    "SELECT * FROM t;",
    "1234567890",
    "3.14159",
    " 42",
    "v1.2.3-rc4",
    "0x7fff_ffff",
    "2026-12-07T20:23:07Z",
    "cafe\u{301}",
    "e\u{301}\u{301}",
    "\u{1100}\u{1161}\u{11a8}",
    "Å",
    "A\u{30a}",
    "ﬁ",
    "Ⅻ",
    "日本語のテキスト",
    "中文文本，标点。",
    "한국어",
    "Привет, мир",
    "مرحبا",
    "שלום",
    "ไทย",
    "🙂",
    "👩\u{200d}💻",
    "🇫🇷",
    "∑∫√",
    "“quoted”",
    "—",
    "…",
    "€100",
    "\u{a0}",
    "\u{3000}",
    " ",
    "  ",
    "   ",
    "\n",
    "\n\n",
    "\r\n",
    " \n ",
    "\t",
    "    \n",
    "\u{b}",
    "\u{c}",
    "\u{85}",
    "\u{2028}",
    "\u{0}",
    "\u{7f}",
    "'",
    "'s",
    "''",
    "(x)",
    "[]",
    "{}",
    "__init__",
    "a_b_c",
    "https://example.com/a?b=c",
    "user@example.com",
    "C++",
    "#include <stdio.h>",
];

/// `n` texts of 1 to 400 fragments, with `added` (a card's added tokens, and a broken one)
/// among them; seeded, so a failure names its text again.
fn real_texts(seed: u64, n: usize, added: &[&str]) -> Vec<String> {
    let mut x = seed | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    (0..n)
        .map(|i| {
            let len = if i % 10 == 0 {
                200 + next() % 200
            } else {
                1 + next() % 40
            };
            (0..len)
                .map(|_| {
                    if next() % 25 == 0 {
                        added[next() as usize % added.len()]
                    } else {
                        REAL_FRAGMENTS[next() as usize % REAL_FRAGMENTS.len()]
                    }
                })
                .collect()
        })
        .collect()
}

/// A real card: its ids are `transformers`' for the chat requests (and a session turn by
/// turn, cut into pieces), and for 300 texts of every kind as a user's message; all of it
/// encoded by the router's byte-level encoder, not the `tokenizers` crate.
fn check_real_card(
    name: &str,
    reqs: &[serde_json::Value],
    added: &[&str],
    published: &[(&str, bool, Vec<u32>)],
    tools: bool,
) {
    let dir = real_cards().join(name);
    let card = check(&dir, reqs);
    assert!(card.byte_level(), "{name} is encoded by the router");
    // The published models' ids, so that a card built wrong on both sides is caught.
    for (text, special, want) in published {
        let got = card.encode_whole(text, *special).expect("encodes");
        assert_eq!(&got, want, "{name}: {text:?}");
        assert_eq!(
            &card.encode(text, *special).expect("encodes"),
            want,
            "{name}: {text:?}"
        );
    }
    let texts: Vec<_> = real_texts(0x5eed_0001, 300, added)
        .into_iter()
        .map(|t| json!({"messages": [{"role": "user", "content": t}]}))
        .collect();
    let card = check(&dir, &texts);
    let s = card.piece_stats().expect("the card encodes in pieces");
    let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(load(&s.mismatches) + load(&s.fallbacks), 0);
    assert!(
        load(&s.prompts) >= 300,
        "every text went through the encoder"
    );
    check_session(&dir, tools);
}

#[test]
fn llama3s_real_vocabulary_matches_transformers() {
    // Llama 3's template prints each message's content as a string, and knows no tools.
    let reqs: Vec<_> = requests()
        .into_iter()
        .filter(|r| r.get("tools").is_none())
        .collect();
    let added = [
        "<|eot_id|>",
        "<|begin_of_text|>",
        "<|reserved_special_token_7|>",
        "<|eot_id",
    ];
    let published = [
        ("Hello world", true, vec![128000, 9906, 1917]),
        ("<|eot_id|>", false, vec![128009]),
        ("<|reserved_special_token_250|>", false, vec![128255]),
    ];
    check_real_card("llama3", &reqs, &added, &published, false);
}

#[test]
fn qwen25s_real_vocabulary_matches_transformers() {
    let added = [
        "<|im_end|>",
        "<|im_start|>",
        "<tool_call>",
        "</tool_call>",
        "<|endoftext|>",
        "<|im_",
    ];
    let published = [
        ("Hello world", true, vec![9707, 1879]),
        ("<|im_end|>", false, vec![151645]),
        ("<|file_sep|>", false, vec![151664]),
    ];
    check_real_card("qwen2.5", &requests(), &added, &published, true);
}

/// Texts of the tiny card's special tokens, whitespace of every kind, multi-byte characters
/// and words, in any order: whatever the cut, pieces give the whole encoding.
mod any_text {
    use super::*;
    use proptest::prelude::*;
    use std::sync::OnceLock;
    use std::sync::atomic::Ordering::Relaxed;

    const FRAGMENTS: &[&str] = &[
        "<|begin_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
        "<|end_of_text|>",
        "<unk>",
        "<|eot_id",
        " ",
        "  ",
        "\n",
        "\n\n",
        "\t",
        " \n ",
        "hello",
        "world",
        "def main():",
        "    return 1",
        "déjà vu",
        "🙂",
        "ñ",
        "w12",
        "1234567",
        "'s",
        "(x)",
    ];

    fn card() -> &'static ModelCard {
        static CARD: OnceLock<ModelCard> = OnceLock::new();
        CARD.get_or_init(|| ModelCard::load(&tiny_card()).expect("card loads"))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]

        #[test]
        fn pieces_equal_the_whole_encoding(parts in prop::collection::vec(0..FRAGMENTS.len(), 60..400)) {
            let text: String = parts.iter().map(|&i| FRAGMENTS[i]).collect();
            let card = card();
            let s = card.piece_stats().expect("pieces");
            let before = s.prompts.load(Relaxed);
            for special in [false, true] {
                let whole = card.encode_whole(&text, special).expect("encodes");
                prop_assert_eq!(card.encode(&text, special).expect("encodes"), whole);
            }
            // A text of 512 bytes or more with a cut token past its first 256 was cut.
            let cuttable = text.len() >= 512
                && text.get(256..).is_some_and(|t| t.contains("<|eot_id|>"));
            prop_assert!(!cuttable || s.prompts.load(Relaxed) > before, "not cut: {text:?}");
            prop_assert!(!card.pieces_off(), "a prompt's pieces differed from its whole");
        }
    }

    #[test]
    fn and_they_were_cut() {
        // Runs after or beside the property; on its own it cuts one text itself.
        let text: String = (0..200).map(|i| FRAGMENTS[i % FRAGMENTS.len()]).collect();
        let card = card();
        assert_eq!(
            card.encode(&text, false).expect("encodes"),
            card.encode_whole(&text, false).expect("encodes")
        );
        let s = card.piece_stats().expect("pieces");
        assert!(s.prompts.load(Relaxed) >= 1);
        assert_eq!(s.mismatches.load(Relaxed), 0);
    }
}
