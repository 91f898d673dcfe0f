//! Shared helpers for the workspace-level tests.

use kvrouter_io::http::chunked::{Step, step as chunk_step};
use std::path::PathBuf;

pub mod engine;
pub mod etcd;
pub mod fleet;
pub mod openai;

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

/// A `nats-server` of a test's own: a free port, its own store directory, and control
/// over its life (kill -9, restart on the same port and store).
#[derive(Debug)]
pub struct NatsServer {
    child: Option<std::process::Child>,
    port: u16,
    dir: PathBuf,
    extra: Vec<String>,
}

fn nats_server_bin() -> PathBuf {
    for p in [
        "/usr/sbin/nats-server",
        "/usr/bin/nats-server",
        "/usr/local/bin/nats-server",
    ] {
        if std::path::Path::new(p).exists() {
            return PathBuf::from(p);
        }
    }
    PathBuf::from("nats-server")
}

/// A TCP port nobody listens on now, for a process to bind a moment later
/// ([`free_ports`] with a run of one).
pub fn free_port() -> u16 {
    free_ports(1)
}

/// The first of `n` consecutive TCP ports nobody listens on now, for a process to bind a
/// moment later (a Dynamo mocker binds a worker's dp ranks on `base + rank`).
///
/// Taken below the kernel's ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`),
/// where the kernel hands out no port on its own. A port from that range, once released
/// here, can go to any socket bound to port 0 or to any outgoing connection before the
/// process it was meant for binds it, and the kernel's own picks for port 0 often come
/// one after another, so that one test's run of ports overlapped the next one's: a Dynamo
/// mocker then failed to bind a dp rank's port ("Address already in use") and never came
/// up. Runs are taken in turn from an offset drawn once per process (from its id and the
/// clock), so that one process never hands out a port twice before it has gone round the
/// range and processes running side by side try different ports; each port is checked by
/// binding it on every IPv4 address. Falls back to the kernel's ports if none is free.
pub fn free_ports(n: u16) -> u16 {
    use std::net::TcpListener;
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU32, Ordering};
    const FLOOR: u32 = 20_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    static START: OnceLock<u32> = OnceLock::new();
    let n = n.max(1);
    let free = |base: u16| (0..n).all(|k| TcpListener::bind(("0.0.0.0", base + k)).is_ok());
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768)
        .min(65_536);
    if ephemeral_low > FLOOR + 1_000 {
        let span = ephemeral_low - FLOOR;
        let start = *START.get_or_init(|| {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or(0);
            (std::process::id().wrapping_mul(2_654_435_761) ^ nanos) % span
        });
        for _ in 0..span.min(4_096) {
            let i = NEXT.fetch_add(u32::from(n), Ordering::Relaxed);
            let base = FLOOR + ((u64::from(start) + u64::from(i)) % u64::from(span)) as u32;
            if base + u32::from(n) <= ephemeral_low && free(base as u16) {
                return base as u16;
            }
        }
    }
    for _ in 0..1_000 {
        let base = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        if u32::from(base) + u32::from(n) <= 65_536 && free(base) {
            return base;
        }
    }
    panic!("no run of {n} free TCP ports in 1,000 tries");
}

impl NatsServer {
    /// Starts a server with JetStream on a free port.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts a server with extra command-line arguments (`--auth`, `--user`, `-c FILE`...).
    pub fn start_with(extra: &[&str]) -> Self {
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("kvrouter-nats-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("store dir");
        let mut s = NatsServer {
            child: None,
            port,
            dir,
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        s.spawn();
        s
    }

    /// Writes a config file into the server's directory (for settings without a flag).
    pub fn config_file(contents: &str) -> PathBuf {
        let path = std::env::temp_dir().join(format!(
            "kvrouter-nats-{}-{}.conf",
            std::process::id(),
            free_port()
        ));
        std::fs::write(&path, contents).expect("config file");
        path
    }

    fn spawn(&mut self) {
        let child = std::process::Command::new(nats_server_bin())
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(&self.dir)
            .args(&self.extra)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("nats-server runs (scripts/test.sh installs it)");
        self.child = Some(child);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "nats-server did not start on {}",
                self.port
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    /// `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// kill -9.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts again on the same port and store directory.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs `f` on a fresh glommio executor (with a small io memory, as the 8 MiB memlock
/// limit requires) and returns its result.
pub fn on_glommio<F, Fut, T>(f: F) -> T
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = T> + 'static,
    T: Send + 'static,
{
    glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
        .io_memory(256 << 10)
        .spawn(f)
        .expect("glommio executor")
        .join()
        .expect("executor thread")
}

/// One sample of the service's `/metrics` at `addr` (`name` with its labels, if any), NaN
/// when absent.
pub fn metric(addr: &str, name: &str) -> f64 {
    let (_, text) = http(addr, "GET", "/metrics", "", &[]);
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or(f64::NAN)
}

/// A minimal HTTP/1.1 client for tests: one request per connection.
pub fn http(
    addr: &str,
    method: &str,
    path: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> (u16, String) {
    http_bytes(addr, method, path, body.as_bytes(), headers)
}

/// [`http`] with a byte body (the binary framing).
pub fn http_bytes(
    addr: &str,
    method: &str,
    path: &str,
    body: &[u8],
    headers: &[(&str, &str)],
) -> (u16, String) {
    let resp = exchange(addr, method, path, body, headers);
    let status = resp
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = resp
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// One request on its own connection (`Connection: close`): the whole raw response.
fn exchange(addr: &str, method: &str, path: &str, body: &[u8], headers: &[(&str, &str)]) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Length: {}\r\n{extra}\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).expect("send");
    s.write_all(body).expect("send");
    let mut resp = String::new();
    s.read_to_string(&mut resp).expect("read");
    resp
}

/// A whole HTTP/1.1 response: status, headers (names lower-cased), body (de-chunked).
#[derive(Debug, Clone)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// Header lines in order, names lower-cased.
    pub headers: Vec<(String, String)>,
    /// The body, chunked transfer coding removed.
    pub body: String,
}

impl Response {
    /// The first header named `name` (lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// [`http`] that keeps the headers and removes chunked transfer coding.
pub fn http_response(
    addr: &str,
    method: &str,
    path: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> Response {
    let raw = exchange(addr, method, path, body.as_bytes(), headers);
    let (head, rest) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"));
    let body = if chunked {
        // What arrived whole: a body cut short or broken is kept up to there.
        let mut out = Vec::new();
        let mut rest = rest.as_bytes();
        while let Ok(Step::Chunk { data, used }) = chunk_step(rest) {
            out.extend_from_slice(&rest[data]);
            rest = &rest[used..];
        }
        String::from_utf8_lossy(&out).into_owned()
    } else {
        rest.to_owned()
    };
    Response {
        status,
        headers,
        body,
    }
}

/// A `kvrouter serve` process of a test, killed when dropped.
#[derive(Debug)]
pub struct Served {
    child: std::process::Child,
    /// Its routing API's address, from the banner.
    pub api: String,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `BIN serve --nats off --listen 127.0.0.1:0 ARGS...` (BIN: the binary under test,
/// `env!("CARGO_BIN_EXE_kvrouter")`) with warnings logged, and returns once its banner
/// names the API's address.
pub fn serve_binary(bin: &str, args: &[&str]) -> Served {
    use std::io::{BufRead, BufReader};
    let mut child = std::process::Command::new(bin)
        .args(["serve", "--nats", "off", "--listen", "127.0.0.1:0"])
        .args(args)
        .env("KVROUTER_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("kvrouter serve starts");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("the banner");
    let api = line
        .trim()
        .rsplit("http://")
        .next()
        .expect("an address")
        .to_owned();
    Served { child, api }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_of_free_ports_do_not_overlap_and_stay_below_the_ephemeral_range() {
        let runs: Vec<u16> = (0..50).map(|_| free_ports(2)).collect();
        let mut ports: Vec<u16> = runs.iter().flat_map(|&b| [b, b + 1]).collect();
        ports.sort_unstable();
        ports.dedup();
        assert_eq!(ports.len(), 100, "runs overlap: {runs:?}");
        let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok());
        if let Some(low) = low.filter(|&l| l > 21_000) {
            assert!(ports.iter().all(|&p| p < low), "{ports:?} reach {low}");
        }
        let one = free_port();
        assert!(!ports.contains(&one), "{one} handed out twice");
    }
}
