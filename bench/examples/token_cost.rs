//! Where the OpenAI front's tokenisation time goes: the chat template's rendering and the
//! encoding, timed apart, for prompts of several sizes (the encoding by the tokenizer
//! crate, and as the front encodes a prompt it has not seen: in pieces, by the byte-level
//! encoder where the card allows it); then a session's next turn encoded whole and in
//! pieces with the previous turn's pieces cached.
//! `cargo run --release -p kvrouter-bench --example token_cost -- CARD_DIR [TEXT_FILE]`
//! (with TEXT_FILE, the prompts are its words, whitespace kept, from its start and again;
//! otherwise made-up words `w1 w2 ...`).
use std::time::Instant;

use kvrouter_io::proxy::model::ModelCard;

fn main() -> anyhow::Result<()> {
    let dir = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "target/tiny-model".into());
    let card = ModelCard::load(std::path::Path::new(&dir))?;
    let source = std::env::args()
        .nth(2)
        .map(std::fs::read_to_string)
        .transpose()?;
    for words in [10usize, 200, 1_000, 10_000] {
        let text: String = match &source {
            Some(src) => {
                anyhow::ensure!(
                    src.split_whitespace().next().is_some(),
                    "the text file has no words"
                );
                // `words` words and the whitespace after each (the file's end counts as a
                // newline when its words start again).
                let mut left = words;
                let mut text = String::new();
                for w in src.split_inclusive(char::is_whitespace).cycle() {
                    if !w.trim().is_empty() {
                        if left == 0 {
                            break;
                        }
                        left -= 1;
                        if text.ends_with(|c: char| !c.is_whitespace()) {
                            text.push('\n');
                        }
                    }
                    text.push_str(w);
                }
                text
            }
            None => (0..words).map(|i| format!("w{} ", i % 997)).collect(),
        };
        let req =
            serde_json::json!({"model": "tiny", "messages": [{"role": "user", "content": text}]});
        let time = |f: &mut dyn FnMut()| {
            let mut v: Vec<u128> = (0..7)
                .map(|_| {
                    let t = Instant::now();
                    f();
                    t.elapsed().as_nanos()
                })
                .collect();
            v.sort_unstable();
            v[3] as f64 / 1e3
        };
        let rendered = card.render_chat(&req)?;
        let render = time(&mut || {
            card.render_chat(&req).unwrap();
        });
        let encode = time(&mut || {
            card.encode_whole(&rendered, false).unwrap();
        });
        let n = card.encode_whole(&rendered, false)?.len();
        // A prompt the card has not seen each time (a piece once encoded is kept); after
        // the card's first prompts, which are also encoded whole to check them.
        let mut unseen = (0..).map(|k| format!("{k} {rendered}"));
        for _ in 0..kvrouter_io::proxy::pieces::VERIFY_FIRST {
            card.encode(&unseen.next().unwrap_or_default(), false)?;
        }
        let front = time(&mut || {
            card.encode(&unseen.next().unwrap_or_default(), false)
                .unwrap();
        });
        println!(
            "{words} words, {n} tokens: render {render:.0} us, encode {encode:.0} us ({:.0} ns/token), as the front does {front:.0} us ({:.0} ns/token{})",
            encode * 1e3 / n as f64,
            front * 1e3 / n as f64,
            if card.byte_level() {
                ", byte-level"
            } else {
                ""
            }
        );
    }
    session_turns(std::path::Path::new(&dir))
}

/// A chat of `turns` messages of about 150 words each, alternating user and assistant.
fn chat(turns: usize) -> serde_json::Value {
    let messages: Vec<_> = (0..turns)
        .map(|t| {
            let text: String = (0..150)
                .map(|i| format!("w{} ", (t * 7919 + i * 31) % 2003))
                .collect();
            let role = if t % 2 == 0 { "user" } else { "assistant" };
            serde_json::json!({"role": role, "content": text})
        })
        .collect();
    serde_json::json!({"model": "tiny", "messages": messages})
}

/// The next turn of a session (one message more than the turn before), encoded whole and
/// in pieces with the turn before already seen, each on a fresh card.
fn session_turns(dir: &std::path::Path) -> anyhow::Result<()> {
    for turns in [4usize, 40, 400] {
        let card = ModelCard::load(dir)?;
        let before = card.render_chat(&chat(turns))?;
        let next = card.render_chat(&chat(turns + 1))?;
        let n = card.encode_whole(&next, false)?.len();
        let mut whole = Vec::new();
        let mut pieces = Vec::new();
        for _ in 0..7 {
            let t = Instant::now();
            card.encode_whole(&next, false)?;
            whole.push(t.elapsed().as_nanos());
            let card = ModelCard::load(dir)?;
            // Past the prompts whose pieces are checked against a whole encoding.
            for _ in 0..kvrouter_io::proxy::pieces::VERIFY_FIRST {
                card.encode(&before, false)?;
            }
            let t = Instant::now();
            let ids = card.encode(&next, false)?;
            pieces.push(t.elapsed().as_nanos());
            assert_eq!(ids, card.encode_whole(&next, false)?);
        }
        whole.sort_unstable();
        pieces.sort_unstable();
        // The cache after one turn: bytes held per token of that turn.
        let card = ModelCard::load(dir)?;
        card.encode(&before, false)?;
        let held = card
            .piece_stats()
            .map_or(0, |s| s.bytes.load(std::sync::atomic::Ordering::Relaxed));
        let before_tokens = card.encode_whole(&before, false)?.len();
        println!(
            "next turn of {} messages, {n} tokens: whole {:.0} us, in pieces {:.0} us; cache {:.1} bytes per token of the turn before",
            turns + 1,
            whole[3] as f64 / 1e3,
            pieces[3] as f64 / 1e3,
            held as f64 / before_tokens.max(1) as f64
        );
    }
    Ok(())
}
