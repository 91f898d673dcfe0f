//! Where the OpenAI front's tokenisation time goes: the chat template's rendering and the
//! tokenizer's encoding, timed apart, for prompts of several sizes.
//! `cargo run --release -p kvrouter-bench --example token_cost -- CARD_DIR`
use std::time::Instant;

use kvrouter_io::proxy::model::ModelCard;

fn main() -> anyhow::Result<()> {
    let dir = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "target/tiny-model".into());
    let card = ModelCard::load(std::path::Path::new(&dir))?;
    for words in [10usize, 200, 1_000, 10_000] {
        let text: String = (0..words).map(|i| format!("w{} ", i % 997)).collect();
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
            card.encode(&rendered, false).unwrap();
        });
        let n = card.encode(&rendered, false)?.len();
        println!(
            "{words} words, {n} tokens: render {render:.0} us, encode {encode:.0} us ({:.0} ns/token)",
            encode * 1e3 / n as f64
        );
    }
    Ok(())
}
