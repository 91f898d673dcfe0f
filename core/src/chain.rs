//! A prompt's sequence hashes, computed only as far as they are needed.
//!
//! The slot manager names a worker's held blocks by sequence hashes ([`crate::hash`]), so a
//! decision used to chain every block of a prompt before it priced a single worker: about
//! 4.5 ns per block, each waiting on the one before (docs/BENCHMARKS.md, "the sequence-hash
//! chain"), tens of microseconds for an agentic prompt. Most of those hashes name blocks a
//! worker already holds, and the held runs know them: where a run also keeps the local
//! hashes its blocks were chained from, a prompt that agrees with the run on local hashes
//! agrees on sequence hashes, and the run's last sequence hash is the prompt's at that
//! position. A [`SequenceChain`] therefore holds the hashes computed so far as a few
//! stretches of known positions: position 0 (a chain's first hash is its local hash),
//! stretches hashed on demand from the known position before them, and single positions
//! *learnt* from a held run ([`SequenceChain::learn`]). Asking for a position hashes only
//! the gap before it.
//!
//! Every value it returns is the one [`crate::hash::sequence_hashes`] gives, provided what
//! it was taught is: the caller answers for that (a run's local and sequence hashes come
//! from one prompt, `core/src/slots.rs`). Tests compare it against the eager chain.

use std::borrow::Cow;

use smallvec::SmallVec;

use crate::hash::{LocalBlockHash, SequenceBlockHash, next_sequence_hash};

/// The sequence hashes of one prompt, computed on demand (see the [module docs](self)).
///
/// Only known positions take memory: a decision whose walks learn most of a long prompt
/// from held runs allocates nothing per block it did not hash.
#[derive(Debug, Clone)]
pub struct SequenceChain<'a> {
    /// The prompt's local hashes (`None`: only its sequence hashes are known, all of them).
    locals: Option<Cow<'a, [LocalBlockHash]>>,
    /// Blocks in the prompt.
    len: usize,
    /// Known stretches, each its first position and its hashes: sorted, disjoint and
    /// non-adjacent (touching stretches are joined).
    known: SmallVec<[(usize, Vec<u64>); 4]>,
    /// Hashes computed (not learnt, not given), for tests and cost accounting.
    hashed: usize,
}

impl<'a> SequenceChain<'a> {
    /// A prompt's chain, nothing hashed yet.
    pub fn new(locals: &'a [LocalBlockHash]) -> Self {
        let mut known = SmallVec::new();
        if let Some(first) = locals.first() {
            known.push((0, vec![first.0]));
        }
        Self {
            locals: Some(Cow::Borrowed(locals)),
            len: locals.len(),
            known,
            hashed: 0,
        }
    }

    /// A chain whose sequence hashes are all given (`locals`, when given, are the ones they
    /// were chained from; a replica's prompt comes without them).
    pub fn given(locals: Option<&'a [LocalBlockHash]>, seq: Vec<u64>) -> Self {
        debug_assert!(locals.is_none_or(|l| l.len() == seq.len()));
        let len = seq.len();
        let mut known = SmallVec::new();
        if len > 0 {
            known.push((0, seq));
        }
        Self {
            locals: locals.map(Cow::Borrowed),
            len,
            known,
            hashed: 0,
        }
    }

    /// Blocks in the prompt.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the prompt has no block.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The local hashes, when the chain has them.
    pub fn locals(&self) -> Option<&[LocalBlockHash]> {
        self.locals.as_deref()
    }

    /// The same chain, owning its local hashes (a copy, where they were borrowed), so that it
    /// may outlive the request it came from.
    pub fn into_owned(self) -> SequenceChain<'static> {
        SequenceChain {
            locals: self.locals.map(|l| Cow::Owned(l.into_owned())),
            len: self.len,
            known: self.known,
            hashed: self.hashed,
        }
    }

    /// Hashes computed so far.
    pub fn hashed(&self) -> usize {
        self.hashed
    }

    /// The stretch that holds `i` (`Ok`), or the last one before it (`Err`); a chain of at
    /// least one block always has one, position 0's.
    fn stretch(&self, i: usize) -> Result<usize, usize> {
        let k = self.known.partition_point(|(start, _)| *start <= i);
        debug_assert!(k > 0, "position 0 is always known");
        let k = k.saturating_sub(1);
        let (start, v) = &self.known[k];
        if i < start + v.len() { Ok(k) } else { Err(k) }
    }

    /// The sequence hash at `i` if it is known, without hashing.
    pub fn known(&self, i: usize) -> Option<u64> {
        if i >= self.len {
            return None;
        }
        let k = self.stretch(i).ok()?;
        let (start, v) = &self.known[k];
        Some(v[i - start])
    }

    /// The sequence hash at `i` (`i < len`), hashing the gap before it if needed.
    pub fn get(&mut self, i: usize) -> u64 {
        let k = match self.stretch(i) {
            Ok(k) => k,
            Err(k) => {
                self.extend(k, i + 1);
                k
            }
        };
        let (start, v) = &self.known[k];
        v[i - start]
    }

    /// The sequence hashes of positions `a..b` (`b <= len`), hashing every gap among them.
    pub fn range(&mut self, a: usize, b: usize) -> &[u64] {
        if a >= b {
            return &[];
        }
        let mut pos = a;
        while pos < b {
            match self.stretch(pos) {
                Ok(k) => pos = self.known[k].0 + self.known[k].1.len(),
                Err(k) => {
                    let next = self.known.get(k + 1).map_or(self.len, |s| s.0);
                    let upto = next.min(b);
                    self.extend(k, upto);
                    pos = upto;
                }
            }
        }
        // Touching stretches are joined, so one now holds all of `a..b`.
        let k = self.stretch(a).unwrap_or_default();
        let (start, v) = &self.known[k];
        &v[a - start..b - start]
    }

    /// Every sequence hash.
    pub fn full(&mut self) -> &[u64] {
        self.range(0, self.len)
    }

    /// Every sequence hash, the chain spent.
    pub fn into_vec(self) -> Vec<u64> {
        self.into_parts().1
    }

    /// Its local hashes (as [`Self::locals`]) and every sequence hash (as
    /// [`Self::into_vec`]), neither copied.
    pub fn into_parts(mut self) -> (Option<Cow<'a, [LocalBlockHash]>>, Vec<u64>) {
        self.full();
        let all = self.known.pop().map(|(_, v)| v).unwrap_or_default();
        (self.locals, all)
    }

    /// Hashes from the end of stretch `k` up to `end` (exclusive), which no other stretch
    /// starts before, and joins the next stretch if it now touches it.
    fn extend(&mut self, k: usize, end: usize) {
        let Some(locals) = self.locals.as_deref() else {
            debug_assert!(false, "a chain without locals is fully given");
            return;
        };
        let (start, v) = &mut self.known[k];
        let from = *start + v.len();
        debug_assert!(from > 0 && from < end);
        let mut parent = SequenceBlockHash(v.last().copied().unwrap_or_default());
        v.reserve(end - from);
        for &local in &locals[from..end] {
            parent = next_sequence_hash(parent, local);
            v.push(parent.0);
        }
        self.hashed += end - from;
        self.join(k);
    }

    /// Joins stretch `k` with the next one if they touch.
    fn join(&mut self, k: usize) {
        let touches = match (self.known.get(k), self.known.get(k + 1)) {
            (Some((start, v)), Some((next, _))) => start + v.len() == *next,
            _ => false,
        };
        if touches {
            let (_, next) = self.known.remove(k + 1);
            self.known[k].1.extend_from_slice(&next);
        }
    }

    /// Takes `v` as the sequence hash at `i`, learnt elsewhere (a held run whose local hashes
    /// agree with the prompt's up to `i`). A known position keeps its value.
    pub fn learn(&mut self, i: usize, v: u64) {
        if i >= self.len {
            return;
        }
        match self.stretch(i) {
            Ok(_) => debug_assert_eq!(self.known(i), Some(v), "a learnt hash disagrees"),
            Err(k) => {
                let (start, s) = &mut self.known[k];
                if *start + s.len() == i {
                    s.push(v);
                    self.join(k);
                } else {
                    self.known.insert(k + 1, (i, vec![v]));
                    self.join(k + 1);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::sequence_hashes;

    fn locals(n: u64) -> Vec<LocalBlockHash> {
        (0..n).map(|i| LocalBlockHash(i * 7 + 3)).collect()
    }

    #[test]
    fn hashes_only_what_is_asked() {
        let l = locals(100);
        let eager: Vec<u64> = sequence_hashes(&l).into_iter().map(|s| s.0).collect();
        let mut c = SequenceChain::new(&l);
        assert_eq!(c.get(0), eager[0]);
        assert_eq!(c.hashed(), 0);
        assert_eq!(c.get(10), eager[10]);
        assert_eq!(c.hashed(), 10);
        // Learnt positions cut the work after them.
        c.learn(59, eager[59]);
        assert_eq!(c.get(61), eager[61]);
        assert_eq!(c.hashed(), 12);
        assert_eq!(c.known(30), None);
        assert_eq!(c.range(5, 62), &eager[5..62]);
        assert_eq!(c.hashed(), 12 + 48);
        assert_eq!(c.known.len(), 1);
        assert_eq!(c.into_vec(), eager);
    }

    #[test]
    fn any_order_of_asks_and_lessons_gives_the_eager_chain() {
        let l = locals(64);
        let eager: Vec<u64> = sequence_hashes(&l).into_iter().map(|s| s.0).collect();
        let mut rng = crate::policy::Rng::new(7);
        for _ in 0..200 {
            let mut c = SequenceChain::new(&l);
            for _ in 0..6 {
                let i = rng.below(64);
                match rng.below(3) {
                    0 => c.learn(i, eager[i]),
                    1 => assert_eq!(c.get(i), eager[i]),
                    _ => {
                        let j = i + rng.below(64 - i) + 1;
                        assert_eq!(c.range(i, j), &eager[i..j]);
                    }
                }
                let s = &c.known;
                assert!(
                    s.windows(2).all(|w| w[0].0 + w[0].1.len() < w[1].0),
                    "{s:?}"
                );
            }
            assert!(c.hashed() <= 63);
            assert_eq!(c.into_vec(), eager);
        }
    }

    #[test]
    fn given_and_empty_chains() {
        let c = SequenceChain::given(None, vec![5, 6, 7]);
        assert_eq!(c.known(2), Some(7));
        assert_eq!(c.into_vec(), vec![5, 6, 7]);
        let mut e = SequenceChain::new(&[]);
        assert!(e.is_empty());
        assert!(e.full().is_empty());
        e.learn(0, 1);
        assert_eq!(e.known(0), None);
    }
}
