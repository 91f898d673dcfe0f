//! Shared helpers for the workspace-level tests.

use std::path::PathBuf;

/// The repository root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// `tests/fixtures/<rel>`.
pub fn fixture(rel: &str) -> PathBuf {
    repo_root().join("tests").join("fixtures").join(rel)
}

/// The shared corpus next to the checkout (`../shared`), when this machine has it.
pub fn shared_dir() -> Option<PathBuf> {
    let dir = repo_root().parent()?.join("shared");
    dir.is_dir().then_some(dir)
}
