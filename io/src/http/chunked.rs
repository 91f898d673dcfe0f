//! HTTP/1.1 chunked bodies as a client reads them (the load generators of `kvrouter-bench`,
//! the harness's OpenAI client, the tests' HTTP helper; the front's own client is hyper's):
//! sans I/O, one chunk at a time from the bytes read so far, each chunk-size line parsed
//! by `httparse`. Trailers are not expected (neither the front nor the engines send any):
//! the last chunk is `0\r\n\r\n`.

use std::ops::Range;

/// What the start of a buffer holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Not a whole chunk yet: read more.
    More,
    /// A chunk: its payload's bytes, and the bytes it takes with its framing.
    Chunk {
        /// The payload.
        data: Range<usize>,
        /// The chunk with its framing.
        used: usize,
    },
    /// The last chunk: the body ends.
    End {
        /// The last chunk with its framing.
        used: usize,
    },
}

/// A chunk's framing is broken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a malformed chunked body near {0:?}")]
pub struct Malformed(String);

/// The chunk at the start of `buf`.
pub fn step(buf: &[u8]) -> Result<Step, Malformed> {
    let bad = || Malformed(String::from_utf8_lossy(&buf[..buf.len().min(32)]).into_owned());
    // `httparse` reads a line with no digits as size 0, the last chunk: refuse it.
    if buf.first().is_some_and(|b| !b.is_ascii_hexdigit()) {
        return Err(bad());
    }
    let (line, size) = match httparse::parse_chunk_size(buf) {
        Ok(httparse::Status::Complete(c)) => c,
        Ok(httparse::Status::Partial) => return Ok(Step::More),
        Err(_) => return Err(bad()),
    };
    let size = usize::try_from(size).map_err(|_| bad())?;
    let end = line.checked_add(size).ok_or_else(bad)?;
    let used = end.checked_add(2).ok_or_else(bad)?;
    if buf.len() < used {
        return Ok(Step::More);
    }
    if &buf[end..used] != b"\r\n" {
        return Err(bad());
    }
    Ok(if size == 0 {
        Step::End { used }
    } else {
        Step::Chunk {
            data: line..end,
            used,
        }
    })
}

/// The payload of a whole chunked body (`None` when its framing is broken or it does not
/// end).
pub fn dechunk(mut body: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(body.len());
    loop {
        match step(body).ok()? {
            Step::More => return None,
            Step::End { .. } => return Some(out),
            Step::Chunk { data, used } => {
                out.extend_from_slice(&body[data]);
                body = &body[used..];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_taken_one_at_a_time_and_broken_framing_is_refused() {
        let body = b"2\r\nda\r\nf;ext=1\r\nta: {\"a\":1}\n\nda\r\n0\r\n\r\n";
        assert_eq!(
            step(body),
            Ok(Step::Chunk {
                data: 3..5,
                used: 7
            })
        );
        assert_eq!(
            dechunk(body).as_deref(),
            Some(&b"data: {\"a\":1}\n\nda"[..])
        );
        // Whatever is cut short asks for more.
        for cut in 0..body.len() - 1 {
            let mut b = &body[..cut];
            loop {
                match step(b).unwrap() {
                    Step::More => break,
                    Step::Chunk { used, .. } => b = &b[used..],
                    Step::End { .. } => panic!("ended at {cut}"),
                }
            }
        }
        assert_eq!(step(b"0\r\n\r\n"), Ok(Step::End { used: 5 }));
        // A payload longer than its size, a size that is no number, one of 18 digits.
        assert!(step(b"2\r\nabc\r\n").is_err());
        assert!(step(b"zz\r\n").is_err());
        assert!(step(b"ffffffffffffffffff\r\n").is_err());
        // Sizes that would run past the end of memory, lines with no size at all.
        assert!(step(b"ffffffffffffffed\r\n").is_err());
        assert!(step(b"ffffffffffffffee\r\n").is_err());
        assert!(step(b"\r\n\r\n").is_err());
        assert!(step(b";x\r\n\r\n").is_err());
        // A body that stops after a whole chunk has not ended.
        assert_eq!(dechunk(b"5\r\nab\r\n0\r\n\r\n"), None);
    }
}
