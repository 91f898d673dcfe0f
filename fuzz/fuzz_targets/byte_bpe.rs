//! The front's byte-level BPE encoder (`io/src/proxy/bpe.rs`) against the `tokenizers`
//! crate it stands in for: on any text, for a card of each shape it takes (GPT-2's with and
//! without a prefix space, Llama 3's with `ignore_merges`, Qwen 2's with its NFC
//! normaliser, DeepSeek V3's three splits with an empty normaliser sequence), its ids are
//! the crate's `encode_fast` ids.
//!
//! The first byte picks the card, the rest is the text (invalid UTF-8 replaced). The cards
//! are trained at start on a small fixed corpus, with added tokens of both kinds (one whose
//! text NFC changes).
//!
//! The encoder is compiled from its own source file, so that this crate does not carry the
//! front's runtime (glommio, hyper) into every fuzz build.
#![no_main]

use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use tokenizers::normalizers::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

#[path = "../../io/src/proxy/bpe.rs"]
#[allow(dead_code)]
mod bpe;

use bpe::{LLAMA3, QWEN2};

const CORPUS: &[&str] = &[
    "The cache holds block 42 of the session's prompt, and it'll hold 1234567 more.",
    "def f(x):\n    return {\"a\": [1, 2.5e-3]}  # ok?!\r\n\r\n",
    "naïve café, cafe\u{301}, \u{212b}ngström, 日本語のテキスト, 中文字符, 🙂🙂 \u{a0}\u{3000}",
    "<|im_start|>user\nWHAT'S UP? We'LL see.<|im_end|>\n<tool>{\"q\": 1}</tool>",
    "    indented\tcode;\n\t\t}\n\n\n  $var = _private + 0x1F;",
];

fn split(regex: &str) -> PreTokenizerWrapper {
    Split::new(
        SplitPattern::Regex(regex.into()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .expect("a regex")
    .into()
}

fn card(normalizer: Option<NormalizerWrapper>, pre: PreTokenizerWrapper) -> Tokenizer {
    bpe::trained_card(normalizer, pre, CORPUS.iter(), 500)
}

/// `tok` with its JSON edited.
fn edited(tok: &Tokenizer, edit: impl Fn(&mut serde_json::Value)) -> Tokenizer {
    let mut spec: serde_json::Value =
        serde_json::from_str(&tok.to_string(false).expect("serialises")).expect("json");
    edit(&mut spec);
    Tokenizer::from_bytes(spec.to_string().as_bytes()).expect("loads")
}

static CARDS: LazyLock<Vec<(Tokenizer, bpe::ByteBpe)>> = LazyLock::new(|| {
    let byte_level = |regex| ByteLevel::new(false, true, regex);
    [
        card(None, byte_level(true).into()),
        card(None, ByteLevel::new(true, true, true).into()),
        edited(
            &card(
                None,
                Sequence::new(vec![split(LLAMA3), byte_level(false).into()]).into(),
            ),
            |s| s["model"]["ignore_merges"] = true.into(),
        ),
        card(
            Some(NFC.into()),
            Sequence::new(vec![split(QWEN2), byte_level(false).into()]).into(),
        ),
        edited(
            &card(
                None,
                Sequence::new(vec![
                    split(r"\p{N}{1,3}"),
                    split("[一-龥\u{3040}-ゟ゠-ヿ]+"),
                    split(LLAMA3),
                    byte_level(false).into(),
                ])
                .into(),
            ),
            |s| s["normalizer"] = serde_json::json!({"type": "Sequence", "normalizers": []}),
        ),
    ]
    .into_iter()
    .map(|tok| {
        let bpe = bpe::ByteBpe::new(&tok).expect("a card the encoder takes");
        (tok, bpe)
    })
    .collect()
});

fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let text = String::from_utf8_lossy(rest);
    let (tok, bpe) = &CARDS[usize::from(pick) % CARDS.len()];
    let want = tok
        .encode_fast(&*text, false)
        .expect("the crate encodes any text");
    let mut got = Vec::new();
    bpe.encode(&text, &mut got);
    assert_eq!(
        got,
        want.get_ids(),
        "card {}: {text:?}",
        usize::from(pick) % CARDS.len()
    );
});
