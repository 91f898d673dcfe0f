//! The NATS protocol parser on arbitrary server bytes, fed in arbitrary splits: it never
//! panics, and parsing the same bytes whole or in pieces gives the same operations.
#![no_main]

use kvrouter_core::nats::{Parser, ServerOp};
use libfuzzer_sys::fuzz_target;

fn drain(p: &mut Parser, out: &mut Vec<ServerOp>) -> bool {
    loop {
        match p.next_op() {
            Ok(Some(op)) => out.push(op),
            Ok(None) => return true,
            Err(_) => return false,
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let split = data.first().copied().unwrap_or(1).max(1) as usize;
    let mut whole = Parser::new(1 << 16);
    whole.push(data);
    let mut a = Vec::new();
    let ok_whole = drain(&mut whole, &mut a);
    let mut pieces = Parser::new(1 << 16);
    let mut b = Vec::new();
    let mut ok_pieces = true;
    for chunk in data.chunks(split) {
        pieces.push(chunk);
        if !drain(&mut pieces, &mut b) {
            ok_pieces = false;
            break;
        }
    }
    if ok_whole && ok_pieces {
        assert_eq!(a, b);
    }
});
