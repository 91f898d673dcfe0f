//! The ZMTP session on arbitrary peer bytes, fed whole and in arbitrary splits, as each
//! socket type we use: it never panics, and both feedings give the same events and the same
//! verdict.
#![no_main]

use kvrouter_core::zmtp::{Event, Limits, Session, SocketType, ZmtpError, greeting};
use libfuzzer_sys::fuzz_target;

fn drain(s: &mut Session, out: &mut Vec<Event>) -> Result<(), ZmtpError> {
    while let Some(e) = s.poll()? {
        out.push(e);
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let ours = [SocketType::Sub, SocketType::Pub, SocketType::Dealer][usize::from(sel % 3)];
    let split = usize::from(sel / 3).max(1);
    // Half the inputs start with a valid greeting, so the fuzzer reaches frames quickly.
    let mut bytes = Vec::new();
    if sel & 0x80 != 0 {
        bytes.extend_from_slice(&greeting());
    }
    bytes.extend_from_slice(rest);
    let limits = Limits {
        max_frame: 1 << 12,
        max_frames: 16,
        max_message: 1 << 14,
    };
    let mut whole = Session::new(ours, limits);
    whole.feed(&bytes);
    let mut a = Vec::new();
    let ra = drain(&mut whole, &mut a);
    let mut pieces = Session::new(ours, limits);
    let mut b = Vec::new();
    let mut rb = Ok(());
    for chunk in bytes.chunks(split) {
        pieces.feed(chunk);
        rb = drain(&mut pieces, &mut b);
        if rb.is_err() {
            break;
        }
    }
    assert_eq!(ra, rb);
    assert_eq!(a, b);
});
