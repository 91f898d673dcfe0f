//! Snapshot files on disk: written to a temporary file, fsynced, renamed over the previous
//! snapshot atomically (and the directory fsynced), loaded by a read-only mmap and fully
//! validated (see [`kvrouter_core::snapshot`]) before any offset in it is trusted.
//!
//! A failed write (a full disk, a read-only directory) leaves the previous snapshot in
//! place; a corrupt, truncated or foreign file is a typed error, and the caller falls back
//! to a full resync.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use kvrouter_core::snapshot::{self, SnapshotError, SnapshotView};

/// The file name of the current snapshot in its directory.
pub const FILE_NAME: &str = "kvrouter.snap";

/// Why a snapshot could not be written or read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SnapshotIoError {
    /// The file system refused (with the path concerned).
    #[error("{}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What failed.
        #[source]
        error: std::io::Error,
    },
    /// The file is not a valid snapshot.
    #[error("{}: not a valid snapshot", path.display())]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        #[source]
        error: SnapshotError,
    },
}

impl SnapshotIoError {
    /// A short stable label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            SnapshotIoError::Io { .. } => "io",
            SnapshotIoError::Format { error, .. } => error.kind(),
        }
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> SnapshotIoError + '_ {
    move |error| SnapshotIoError::Io {
        path: path.to_path_buf(),
        error,
    }
}

/// A snapshot file, mapped read-only.
#[derive(Debug)]
pub struct MappedSnapshot {
    path: PathBuf,
    map: memmap2::Mmap,
}

impl MappedSnapshot {
    /// Maps `path` (it is not validated yet: see [`MappedSnapshot::view`]).
    pub fn open(path: &Path) -> Result<Self, SnapshotIoError> {
        let file = File::open(path).map_err(io_err(path))?;
        let len = file.metadata().map_err(io_err(path))?.len();
        if len == 0 {
            return Err(SnapshotIoError::Format {
                path: path.to_path_buf(),
                error: SnapshotError::Truncated { have: 0, need: 64 },
            });
        }
        // SAFETY: the map is read-only and private to this process. kvrouter never writes a
        // snapshot in place: a new one is written to a temporary file and renamed over the
        // old name, which leaves the mapped inode untouched. Another program truncating or
        // rewriting the file in place while it is mapped is outside our contract (as for
        // any mmap); every byte read is still bounds-checked against the map's length.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io_err(path))?;
        Ok(Self {
            path: path.to_path_buf(),
            map,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the file is empty (never, for a mapped file).
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Validates the whole file and returns a view of it.
    pub fn view(&self) -> Result<SnapshotView<'_>, SnapshotIoError> {
        snapshot::parse(&self.map).map_err(|error| SnapshotIoError::Format {
            path: self.path.clone(),
            error,
        })
    }
}

/// A directory holding the current snapshot.
#[derive(Debug, Clone)]
pub struct SnapshotStore {
    dir: PathBuf,
}

impl SnapshotStore {
    /// Snapshots in `dir` (created on the first write when missing).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The current snapshot's path.
    pub fn path(&self) -> PathBuf {
        self.dir.join(FILE_NAME)
    }

    /// Removes temporary files left by a process killed while writing (their names carry
    /// another process id). Call at start, before writing.
    pub fn remove_stale_temporaries(&self) {
        let ours = format!(".{FILE_NAME}.tmp.{}", std::process::id());
        let prefix = format!(".{FILE_NAME}.tmp.");
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            let name = name.to_string_lossy();
            if name.starts_with(&prefix) && name != ours && e.path().is_file() {
                match std::fs::remove_file(e.path()) {
                    Ok(()) => {
                        tracing::info!(file = %e.path().display(), "removed a stale temporary snapshot")
                    }
                    Err(err) => {
                        tracing::warn!(file = %e.path().display(), error = %err, "cannot remove a stale temporary snapshot")
                    }
                }
            }
        }
    }

    /// Maps the current snapshot; `Ok(None)` when there is none.
    pub fn open(&self) -> Result<Option<MappedSnapshot>, SnapshotIoError> {
        let path = self.path();
        match MappedSnapshot::open(&path) {
            Err(SnapshotIoError::Io { error, .. })
                if error.kind() == std::io::ErrorKind::NotFound =>
            {
                Ok(None)
            }
            other => other.map(Some),
        }
    }

    /// Replaces the current snapshot with `bytes`: temporary file, `fsync`, atomic rename,
    /// `fsync` of the directory. On any error the previous snapshot is left as it was.
    pub fn write(&self, bytes: &[u8]) -> Result<PathBuf, SnapshotIoError> {
        std::fs::create_dir_all(&self.dir).map_err(io_err(&self.dir))?;
        let tmp = self
            .dir
            .join(format!(".{FILE_NAME}.tmp.{}", std::process::id()));
        let result = (|| {
            let mut f = File::create(&tmp).map_err(io_err(&tmp))?;
            f.write_all(bytes).map_err(io_err(&tmp))?;
            f.sync_all().map_err(io_err(&tmp))?;
            drop(f);
            let path = self.path();
            std::fs::rename(&tmp, &path).map_err(io_err(&path))?;
            File::open(&self.dir)
                .and_then(|d| d.sync_all())
                .map_err(io_err(&self.dir))?;
            Ok(path)
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrouter_core::snapshot::{SnapshotMeta, encode};

    fn tmpdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kvrouter-snap-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn write_then_open() {
        let store = SnapshotStore::new(tmpdir("rw"));
        assert!(store.open().unwrap().is_none());
        let meta = SnapshotMeta {
            router_id: 3,
            ..SnapshotMeta::default()
        };
        store.write(&encode(&meta, &[], &[]).unwrap()).unwrap();
        let stale = store.dir().join(".kvrouter.snap.tmp.999999999");
        std::fs::write(&stale, b"torn").unwrap();
        store.remove_stale_temporaries();
        assert!(!stale.exists());
        let m = store.open().unwrap().unwrap();
        assert_eq!(m.view().unwrap().meta().router_id, 3);
        // A corrupt file is a typed error, never a panic.
        std::fs::write(store.path(), b"KVRSNAP\0garbage").unwrap();
        let err = store.open().unwrap().unwrap().view().unwrap_err();
        assert_eq!(err.kind(), "truncated");
        std::fs::write(store.path(), b"").unwrap();
        assert!(store.open().is_err());
        let _ = std::fs::remove_dir_all(store.dir());
    }
}
