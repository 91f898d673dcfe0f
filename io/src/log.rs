//! Replay-log files: JSON lines, optionally in one zstd frame (`*.zst`), read as a stream
//! so that a log never has to fit in memory as text.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use kvrouter_core::replay::{ReplayError, ReplayHeader, ReplayLine, ReplayOp, parse_line};

/// zstd frames in the shared corpus use long-distance matching with windows up to 2^27;
/// accept up to 2^31 as the reference decoder does.
const ZSTD_WINDOW_LOG_MAX: u32 = 31;

/// Why a log could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LogError {
    /// The file could not be opened or read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A line is not a valid operation.
    #[error("{path}:{line}: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: u64,
        /// What is wrong with it.
        #[source]
        source: ReplayError,
    },
    /// The first line is not a header.
    #[error("{path}: the first line is not a kv-replay-log header")]
    NoHeader {
        /// The file.
        path: PathBuf,
    },
}

/// A streaming reader of one replay log.
pub struct LogReader {
    path: PathBuf,
    lines: Box<dyn BufRead + Send>,
    buf: Vec<u8>,
    line: u64,
    /// The log's header.
    pub header: ReplayHeader,
}

impl std::fmt::Debug for LogReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogReader")
            .field("path", &self.path)
            .field("line", &self.line)
            .finish()
    }
}

impl LogReader {
    /// Opens a log file; `*.zst` files are decompressed on the fly.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, LogError> {
        let path = path.as_ref().to_path_buf();
        let io = |source| LogError::Io {
            path: path.clone(),
            source,
        };
        let file = File::open(&path).map_err(io)?;
        let zst = path.extension().is_some_and(|e| e == "zst");
        Self::from_reader(path.clone(), Box::new(file), zst)
    }

    /// Reads a log held in memory (the sample bundled into the binary).
    pub fn from_bytes(name: &str, bytes: &'static [u8]) -> Result<Self, LogError> {
        let zst = bytes.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]);
        Self::from_reader(PathBuf::from(name), Box::new(bytes), zst)
    }

    fn from_reader(path: PathBuf, raw: Box<dyn Read + Send>, zst: bool) -> Result<Self, LogError> {
        let io = |source| LogError::Io {
            path: path.clone(),
            source,
        };
        let lines: Box<dyn BufRead + Send> = if zst {
            let mut dec = zstd::Decoder::new(raw).map_err(io)?;
            dec.window_log_max(ZSTD_WINDOW_LOG_MAX).map_err(io)?;
            Box::new(BufReader::with_capacity(1 << 20, dec))
        } else {
            Box::new(BufReader::with_capacity(1 << 20, raw))
        };
        let mut reader = LogReader {
            path,
            lines,
            buf: Vec::with_capacity(1 << 16),
            line: 0,
            header: ReplayHeader::default(),
        };
        match reader.next_line()? {
            Some(ReplayLine::Header(h)) => reader.header = h,
            _ => return Err(LogError::NoHeader { path: reader.path }),
        }
        Ok(reader)
    }

    fn next_line(&mut self) -> Result<Option<ReplayLine>, LogError> {
        loop {
            self.buf.clear();
            let n = self
                .lines
                .read_until(b'\n', &mut self.buf)
                .map_err(|source| LogError::Io {
                    path: self.path.clone(),
                    source,
                })?;
            if n == 0 {
                return Ok(None);
            }
            self.line += 1;
            let text = self.buf.trim_ascii();
            if text.is_empty() {
                continue;
            }
            return parse_line(text)
                .map(Some)
                .map_err(|source| LogError::Parse {
                    path: self.path.clone(),
                    line: self.line,
                    source,
                });
        }
    }

    /// The next operation with its 1-based line number, or `None` at the end.
    pub fn next_op(&mut self) -> Result<Option<(u64, ReplayOp)>, LogError> {
        match self.next_line()? {
            None => Ok(None),
            Some(ReplayLine::Op(op)) => Ok(Some((self.line, op))),
            Some(ReplayLine::Header(_)) => Err(LogError::Parse {
                path: self.path.clone(),
                line: self.line,
                source: ReplayError::UnknownOp("header (again)".into()),
            }),
        }
    }

    /// Reads every remaining operation into memory (for timed replays).
    pub fn read_all(mut self) -> Result<Vec<(u64, ReplayOp)>, LogError> {
        let mut ops = Vec::new();
        while let Some(op) = self.next_op()? {
            ops.push(op);
        }
        Ok(ops)
    }
}
