//! Real third-party peers in Python (pyzmq's libzmq, msgspec), from the venv of
//! `scripts/pyenv.sh`: a vLLM-style KV-event publisher (`tests/py/vllm_engine.py`) the test
//! drives line by line.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::OnceLock;

use crate::repo_root;

/// The venv's interpreter (made on first use; every test process shares it).
pub fn python() -> PathBuf {
    static PY: OnceLock<PathBuf> = OnceLock::new();
    PY.get_or_init(|| {
        let out = Command::new("bash")
            .arg(repo_root().join("scripts/pyenv.sh"))
            .output()
            .expect("scripts/pyenv.sh runs");
        assert!(
            out.status.success(),
            "scripts/pyenv.sh failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
    })
    .clone()
}

/// A running `vllm_engine.py`; killed when dropped.
#[derive(Debug)]
pub struct PyEngine {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
}

impl PyEngine {
    /// Starts the publisher with these arguments (`--pub`, `--replay`, `--form`, ...) and
    /// waits until its sockets are up.
    pub fn start(args: &[&str]) -> PyEngine {
        let mut child = Command::new(python())
            .arg(repo_root().join("tests/py/vllm_engine.py"))
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python starts");
        let stdin = child.stdin.take();
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        stdout.read_line(&mut line).expect("ready line");
        assert_eq!(line.trim(), "ready", "the engine did not start");
        PyEngine {
            child,
            stdin,
            stdout,
        }
    }

    /// Sends one command (a JSON object).
    pub fn send(&mut self, cmd: &serde_json::Value) {
        let stdin = self.stdin.as_mut().expect("engine still open");
        writeln!(stdin, "{cmd}").expect("engine stdin");
        stdin.flush().expect("engine stdin");
    }

    /// Closes its input and waits for it to say it is done.
    pub fn finish(mut self) {
        drop(self.stdin.take());
        let mut line = String::new();
        let _ = self.stdout.read_line(&mut line);
        let _ = self.child.wait();
    }
}

impl Drop for PyEngine {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
