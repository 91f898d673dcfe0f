//! No secret in any log line: `kvrouter serve` started with every credential it takes (a
//! NATS user and password, in flags and inside the server URL, a NATS token, the API's
//! bearer token), logging at `trace`, routes, is scraped, stops; its whole output is
//! searched for each secret. Runs against a real nats-server that requires the password,
//! so the credentials are used, not only printed.

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvrouter_tests::{NatsServer, http};

const USER: &str = "kvr";
const PASSWORD: &str = "pw-Secret-1";
const NATS_TOKEN: &str = "tok-Secret-2";
const API_TOKEN: &str = "api-Secret-3";

/// Runs `kvrouter serve` with `args`, routes once and scrapes, stops it with SIGTERM, and
/// returns everything it wrote (stdout and stderr).
fn serve_and_capture(args: &[&str]) -> String {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args(["serve", "--listen", "127.0.0.1:0", "--workers", "1,2"])
        .args(args)
        .env("KVROUTER_LOG", "trace")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvrouter serve starts");
    let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
    let mut stderr = child.stderr.take().expect("stderr");
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let mut banner = String::new();
    stdout.read_line(&mut banner).expect("banner");
    let addr = banner
        .trim()
        .rsplit("http://")
        .next()
        .unwrap_or_default()
        .to_owned();
    assert!(!addr.is_empty(), "no banner: {banner:?}");
    let auth = format!("Bearer {API_TOKEN}");
    let (status, body) = http(
        &addr,
        "POST",
        "/v1/route",
        r#"{"block_hashes": [1, 2, 3]}"#,
        &[("Authorization", &auth)],
    );
    assert_eq!(status, 200, "{body}");
    // A refused one too: error paths log as well.
    let (status, _) = http(
        &addr,
        "POST",
        "/v1/route",
        "{}",
        &[("Authorization", "Bearer nope")],
    );
    assert_eq!(status, 401);
    let (status, _) = http(&addr, "GET", "/metrics", "", &[]);
    assert_eq!(status, 200);
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let deadline = Instant::now() + Duration::from_secs(20);
    while child.try_wait().expect("wait").is_none() {
        assert!(
            Instant::now() < deadline,
            "kvrouter did not stop on SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut out = banner;
    let _ = stdout.read_to_string(&mut out);
    out + &err_reader.join().expect("stderr reader")
}

fn assert_no_secret(log: &str) {
    // The log is the real thing: the effective configuration and the NATS connection are in it.
    assert!(log.contains("effective configuration"), "{log}");
    assert!(log.contains("routing API listening"), "{log}");
    for secret in [PASSWORD, NATS_TOKEN, API_TOKEN] {
        if let Some(line) = log.lines().find(|l| l.contains(secret)) {
            panic!("secret {secret:?} in a log line: {line}");
        }
    }
}

#[test]
fn no_credential_reaches_the_log() {
    let server = NatsServer::start_with(&["--user", USER, "--pass", PASSWORD]);
    let port = server.port();
    // Credentials as flags (with a token the server does not ask for, sent all the same).
    let flags = serve_and_capture(&[
        "--nats",
        &format!("nats://127.0.0.1:{port}"),
        "--nats-user",
        USER,
        "--nats-password",
        PASSWORD,
        "--nats-token",
        NATS_TOKEN,
        "--auth-token",
        API_TOKEN,
    ]);
    assert_no_secret(&flags);
    // Credentials inside the server URL.
    let url = serve_and_capture(&[
        "--nats",
        &format!("nats://{USER}:{PASSWORD}@127.0.0.1:{port}"),
        "--auth-token",
        API_TOKEN,
    ]);
    assert_no_secret(&url);
    assert!(url.contains("nats://<redacted>@127.0.0.1"), "{url}");
}
