//! A fast path for the hot input, `{"block_hashes": [u64, ...], ...}`: long prompts carry
//! thousands of 20-digit hashes, which serde_json parses one digit at a time (about 50 ns a
//! hash, the largest single cost of a decision). Here eight digits are converted at once.
//! Anything outside the plain shape (another key first, strings, signs, fractions,
//! exponents, leading zeros, overflow, odd whitespace) declines with `None`, and serde_json
//! parses the body instead, so the accepted language and every error stay serde_json's.

use super::{RouteInput, U64Lenient};

fn ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && matches!(b[i], b' ' | b'\t' | b'\n' | b'\r') {
        i += 1;
    }
    i
}

/// Eight ASCII digits at `b[..8]` as a number (first digit most significant), or `None`
/// when any of them is not a digit.
#[inline]
fn eight_digits(b: &[u8]) -> Option<u64> {
    let x = u64::from_le_bytes(b.get(..8)?.try_into().ok()?);
    // Every byte 0x30..=0x39 (simdjson's test: a carry out of a byte can only come from
    // a byte that fails the test itself).
    if (x & 0xF0F0_F0F0_F0F0_F0F0)
        | ((x.wrapping_add(0x0606_0606_0606_0606) & 0xF0F0_F0F0_F0F0_F0F0) >> 4)
        != 0x3333_3333_3333_3333
    {
        return None;
    }
    let mut v = x - 0x3030_3030_3030_3030;
    v = (v.wrapping_mul(10) + (v >> 8)) & 0x00FF_00FF_00FF_00FF;
    v = (v.wrapping_mul(100) + (v >> 16)) & 0x0000_FFFF_0000_FFFF;
    v = (v.wrapping_mul(10_000) + (v >> 32)) & 0x0000_0000_FFFF_FFFF;
    Some(v)
}

fn number(b: &[u8], mut i: usize) -> Option<(u64, usize)> {
    let start = i;
    let mut v: u64 = 0;
    while let Some(x) = b.get(i..).and_then(eight_digits) {
        v = v.checked_mul(100_000_000)?.checked_add(x)?;
        i += 8;
    }
    while let Some(d) = b.get(i).filter(|c| c.is_ascii_digit()) {
        v = v.checked_mul(10)?.checked_add(u64::from(d - b'0'))?;
        i += 1;
    }
    // No digits, or a leading zero (invalid JSON): let serde_json say so.
    if i == start || (b[start] == b'0' && i - start > 1) {
        return None;
    }
    Some((v, i))
}

pub(super) fn route_input(b: &[u8]) -> Option<RouteInput> {
    const KEY: &[u8] = b"\"block_hashes\"";
    let mut i = ws(b, 0);
    if b.get(i) != Some(&b'{') {
        return None;
    }
    i = ws(b, i + 1);
    if !b.get(i..)?.starts_with(KEY) {
        return None;
    }
    i = ws(b, i + KEY.len());
    if b.get(i) != Some(&b':') {
        return None;
    }
    i = ws(b, i + 1);
    if b.get(i) != Some(&b'[') {
        return None;
    }
    i = ws(b, i + 1);
    let mut hashes = Vec::with_capacity(b.len() / 21 + 1);
    if b.get(i) == Some(&b']') {
        i += 1;
    } else {
        loop {
            let (v, next) = number(b, i)?;
            hashes.push(U64Lenient(v));
            i = ws(b, next);
            match b.get(i)? {
                b',' => i = ws(b, i + 1),
                b']' => {
                    i += 1;
                    break;
                }
                _ => return None,
            }
        }
    }
    i = ws(b, i);
    match b.get(i)? {
        b'}' => (ws(b, i + 1) == b.len()).then_some(RouteInput {
            token_ids: None,
            block_hashes: Some(hashes),
            lora_name: None,
            request_id: None,
            explain: false,
        }),
        b',' => {
            // The other keys (few and short): serde_json on `{` + the rest.
            let mut rest = Vec::with_capacity(b.len() - i);
            rest.push(b'{');
            rest.extend_from_slice(&b[i + 1..]);
            let mut input: RouteInput = serde_json::from_slice(&rest).ok()?;
            if input.block_hashes.is_some() || input.token_ids.is_some() {
                return None; // a duplicate key, or both inputs: serde_json's verdict
            }
            input.block_hashes = Some(hashes);
            Some(input)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Checks the fast path against serde_json; returns whether the fast path took it.
    fn same(body: &str) -> bool {
        let slow: Result<RouteInput, _> = serde_json::from_str(body);
        // `None`: serde_json decides.
        let Some(fast) = route_input(body.as_bytes()) else {
            return false;
        };
        let slow = slow.unwrap_or_else(|e| panic!("fast accepted {body:?}, serde: {e}"));
        assert_eq!(format!("{fast:?}"), format!("{slow:?}"), "{body}");
        true
    }

    #[test]
    fn agrees_with_serde_json() {
        for body in [
            r#"{"block_hashes":[]}"#,
            r#"{"block_hashes":[0]}"#,
            r#"{"block_hashes":[18446744073709551615]}"#,
            r#"{"block_hashes":[18446744073709551616]}"#,
            r#"{"block_hashes":[12345678,123456789,1234567812345678]}"#,
            r#" { "block_hashes" : [ 1 , 2 ,3 ] , "request_id" : "r" , "explain": true } "#,
            r#"{"block_hashes":[1,2],"lora_name":"x"}"#,
            r#"{"block_hashes":[01]}"#,
            r#"{"block_hashes":[-1]}"#,
            r#"{"block_hashes":[1.5]}"#,
            r#"{"block_hashes":[1e3]}"#,
            r#"{"block_hashes":["7"]}"#,
            r#"{"block_hashes":[1,]}"#,
            r#"{"block_hashes":[1],"block_hashes":[2]}"#,
            r#"{"block_hashes":[1],"token_ids":[2]}"#,
            r#"{"block_hashes":[1]} x"#,
            r#"{"block_hashes":[1],"nope":1}"#,
            r#"{"request_id":"r","block_hashes":[1]}"#,
        ] {
            same(body);
        }
        let big = format!(
            "{{\"block_hashes\":{:?},\"request_id\":\"q\"}}",
            (0..2000u64)
                .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
                .collect::<Vec<_>>()
        );
        assert!(route_input(big.as_bytes()).is_some());
        same(&big);
        // Every prefix of a valid body: never a wrong acceptance.
        for n in 0..big.len().min(300) {
            same(&big[..n]);
        }
    }

    #[test]
    fn random_mutations_never_accept_what_serde_json_refuses() {
        let base = br#" {"block_hashes": [18446744073709551615, 0, 12345678901234567890, 7],"request_id":"a"} "#;
        let alphabet = b"0123456789 ,[]{}\":-.eE\"\\ab";
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut taken = [0u32; 2];
        for _ in 0..20_000 {
            let mut b = base.to_vec();
            for _ in 0..(next() % 4 + 1) {
                let at = (next() % b.len() as u64) as usize;
                let c = alphabet[(next() % alphabet.len() as u64) as usize];
                match next() % 3 {
                    0 => b[at] = c,
                    1 => b.insert(at, c),
                    _ => {
                        b.remove(at);
                    }
                }
            }
            if let Ok(text) = std::str::from_utf8(&b) {
                taken[usize::from(same(text))] += 1;
            }
        }
        // Both ways were exercised: mutants the fast path took, and ones it left.
        assert!(taken[0] > 1000 && taken[1] > 1000, "{taken:?}");
    }

    #[test]
    fn eight_digit_blocks() {
        assert_eq!(eight_digits(b"12345678"), Some(12_345_678));
        assert_eq!(eight_digits(b"00000000"), Some(0));
        assert_eq!(eight_digits(b"99999999"), Some(99_999_999));
        assert_eq!(eight_digits(b"1234567a"), None);
        assert_eq!(eight_digits(b"/2345678"), None);
        assert_eq!(eight_digits(b"1234:678"), None);
        assert_eq!(eight_digits(b"1234"), None);
    }
}
