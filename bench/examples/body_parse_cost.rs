//! The cost of parsing a completion body whose `prompt` is token ids, as the OpenAI front
//! gets them from the harness (and from clients that tokenise): into one `serde_json`
//! value per token, against `kvrouter_core::codec::openai::parse_request`, which parses the
//! ids straight into a `Vec<u32>`. Median of seven passes per size.
//!
//! `cargo run --release -p kvrouter-bench --example body_parse_cost`

use std::time::{Duration, Instant};

use kvrouter_core::codec::openai::parse_request;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    for n in [10_000usize, 126_000, 900_000] {
        // Ids spread over a 150 k vocabulary, so the digits are as long as real ones.
        let ids: Vec<u32> = (0..n as u32)
            .map(|i| i.wrapping_mul(2_654_435_761) % 150_000)
            .collect();
        let body = serde_json::to_vec(&serde_json::json!({
            "model": "m", "prompt": ids, "max_tokens": 16, "stream": true
        }))
        .expect("serialises");
        let (mut value, mut ours) = (Vec::new(), Vec::new());
        for _ in 0..7 {
            let t = Instant::now();
            let v: serde_json::Value = serde_json::from_slice(&body).expect("parses");
            value.push(t.elapsed());
            drop(v);
            let t = Instant::now();
            let p = parse_request(&body, true).expect("parses");
            ours.push(t.elapsed());
            assert_eq!(p.prompt_ids.as_deref(), Some(&ids[..]));
        }
        let (value, ours) = (median(value), median(ours));
        println!(
            "{n:>8} ids, {:>8} bytes: Value {:>9.3} ms, ids {:>8.3} ms, ×{:.2}",
            body.len(),
            value.as_secs_f64() * 1e3,
            ours.as_secs_f64() * 1e3,
            value.as_secs_f64() / ours.as_secs_f64()
        );
    }
}
