//! An etcd server of a test's own (Debian's `etcd-server`, which `scripts/test.sh` installs):
//! free client and peer ports, its own data directory, control over its life, and entries
//! written and deleted with `etcdctl`, as any etcd client would.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::free_port;

/// A running single-member etcd.
#[derive(Debug)]
pub struct Etcd {
    child: Option<Child>,
    port: u16,
    peer: u16,
    dir: PathBuf,
}

impl Etcd {
    /// Starts one on free ports and waits until it answers.
    pub fn start() -> Self {
        let (port, peer) = (free_port(), free_port());
        let dir = std::env::temp_dir().join(format!("kvrouter-etcd-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut e = Etcd {
            child: None,
            port,
            peer,
            dir,
        };
        e.spawn();
        e
    }

    fn spawn(&mut self) {
        let client = self.url();
        let peer = format!("http://127.0.0.1:{}", self.peer);
        let child = Command::new("etcd")
            .args(["--name", "t", "--data-dir"])
            .arg(&self.dir)
            .args([
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .args(["--initial-cluster", &format!("t={peer}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("etcd runs (scripts/test.sh installs Debian's etcd-server)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.ctl(&["put", "kvrouter-test/ready", "1"]) {
            assert!(
                Instant::now() < deadline,
                "etcd did not start on {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn ctl(&self, args: &[&str]) -> bool {
        Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", &self.url(), "--dial-timeout", "1s"])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Writes `key` = `value`.
    pub fn put(&self, key: &str, value: &str) {
        assert!(self.ctl(&["put", key, value]), "etcdctl put {key}");
    }

    /// The keys under `prefix`.
    pub fn keys(&self, prefix: &str) -> Vec<String> {
        let out = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", &self.url(), "--dial-timeout", "1s"])
            .args(["get", "--prefix", "--keys-only", prefix])
            .output()
            .expect("etcdctl runs");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect()
    }

    /// Deletes `key`.
    pub fn delete(&self, key: &str) {
        assert!(self.ctl(&["del", key]), "etcdctl del {key}");
    }

    /// kill -9.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts again on the same ports and data directory (the entries survive).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
