//! `kvrouter serve` at the edges of its process: started under a soft open-file limit of
//! 256 (a shell's default), it raises the limit to the hard one and keeps serving new
//! clients while 400 idle connections are held; a steady trickle of garbage on the
//! kv-events subject and a flood of refused connections are counted one by one but logged
//! once per interval, not once per message. Real nats-server, the real binary.

use std::io::{BufRead, BufReader, Read};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvrouter_core::codec::Subjects;
use kvrouter_io::nats::Client;
use kvrouter_tests::fleet::nats_opts;
use kvrouter_tests::{NatsServer, http, metric, on_glommio};

struct Serve {
    child: Child,
    addr: String,
    stderr: Option<std::thread::JoinHandle<String>>,
}

impl Serve {
    /// Starts `kvrouter serve` through `sh`, which first runs `prelude` (a `ulimit`).
    fn start(prelude: &str, args: &[&str]) -> Serve {
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(format!("{prelude}\nexec \"$0\" \"$@\""))
            .arg(env!("CARGO_BIN_EXE_kvrouter"))
            .args(["serve", "--listen", "127.0.0.1:0", "--workers", "1,2"])
            .args(args)
            .env("KVROUTER_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kvrouter serve starts");
        let mut stderr = child.stderr.take().expect("stderr");
        let stderr = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = stderr.read_to_string(&mut s);
            s
        });
        let mut banner = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut banner)
            .expect("banner");
        let addr = banner
            .trim()
            .rsplit("http://")
            .next()
            .unwrap_or_default()
            .to_owned();
        assert!(!addr.is_empty(), "no banner: {banner:?}");
        Serve {
            child,
            addr,
            stderr: Some(stderr),
        }
    }

    /// The process's soft and hard open-file limits, from `/proc`.
    fn nofile(&self) -> (String, String) {
        let limits = std::fs::read_to_string(format!("/proc/{}/limits", self.child.id()))
            .expect("/proc/PID/limits");
        let line = limits
            .lines()
            .find(|l| l.starts_with("Max open files"))
            .expect("a Max open files line");
        let mut f = line["Max open files".len()..].split_whitespace();
        (f.next().unwrap().to_owned(), f.next().unwrap().to_owned())
    }

    /// Stops it and returns everything it logged.
    fn log(mut self) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.stderr.take().unwrap().join().expect("stderr reader")
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn the_open_file_limit_is_raised_so_held_connections_lock_no_one_out() {
    let hard: u64 = String::from_utf8(
        Command::new("sh")
            .args(["-c", "ulimit -Hn"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap()
    .trim()
    .parse()
    .unwrap_or(u64::MAX);
    assert!(
        hard >= 1024,
        "this test needs a hard open-file limit of 1024 or more, not {hard}"
    );
    let server = NatsServer::start();
    let s = Serve::start(
        "ulimit -Sn 256",
        &["--nats", &server.url(), "--header-timeout-secs", "60"],
    );
    let (soft, hard_seen) = s.nofile();
    assert_eq!(
        soft, hard_seen,
        "the soft limit was not raised to the hard one"
    );
    // 400 clients that connect and say nothing: past the old limit of 256.
    let held: Vec<TcpStream> = (0..400)
        .map(|_| TcpStream::connect(&s.addr).expect("connect"))
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    for _ in 0..5 {
        let (status, body) = http(&s.addr, "GET", "/v1/workers", "", &[]);
        assert_eq!(status, 200, "{body}");
    }
    let (status, body) = http(
        &s.addr,
        "POST",
        "/v1/route",
        r#"{"block_hashes": [1, 2]}"#,
        &[],
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        metric(&s.addr, "kvrouter_http_connections_refused_total"),
        0.0
    );
    drop(held);
    let log = s.log();
    assert!(log.contains("open-file limit raised"), "{log}");
}

#[test]
fn repeated_warnings_are_counted_each_and_logged_once_per_interval() {
    let server = NatsServer::start();
    let s = Serve::start("", &["--nats", &server.url(), "--max-connections", "16"]);
    // Garbage on the kv-events subject, 20 a second for 3 s.
    const GARBAGE: u64 = 60;
    let url = server.url();
    std::thread::spawn(move || {
        on_glommio(move || async move {
            let client = Client::connect(nats_opts(&url)).await.unwrap();
            let subject = Subjects::default().kv_events();
            for i in 0..GARBAGE {
                client
                    .publish(&subject, format!("not msgpack {i}").as_bytes())
                    .await
                    .unwrap();
                glommio::timer::sleep(Duration::from_millis(50)).await;
            }
            client.flush(Duration::from_secs(5)).await.unwrap();
        })
    })
    .join()
    .unwrap();
    // A flood past the connection cap: 16 held, 200 more refused.
    let held: Vec<TcpStream> = (0..16)
        .map(|_| TcpStream::connect(&s.addr).expect("connect"))
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    for _ in 0..200 {
        if let Ok(mut c) = TcpStream::connect(&s.addr) {
            let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
            let _ = c.read(&mut [0u8; 256]);
        }
    }
    drop(held);
    let started = Instant::now();
    while metric(&s.addr, "kvrouter_ingest_decode_errors_total") < GARBAGE as f64 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "garbage not counted"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // A scrape itself may be refused while the flood's connections are still being torn
    // down (`metric` then reads NaN): scrape until one is answered.
    let answered = |name: &str| {
        let started = Instant::now();
        loop {
            let v = metric(&s.addr, name);
            if !v.is_nan() || started.elapsed() > Duration::from_secs(10) {
                return v;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    assert_eq!(
        answered("kvrouter_ingest_decode_errors_total"),
        GARBAGE as f64
    );
    let refused = answered("kvrouter_http_connections_refused_total");
    assert!(refused >= 150.0, "{refused} refused");
    let log = s.log();
    let lines = |what: &str| log.lines().filter(|l| l.contains(what)).count();
    // Within one 10 s interval: the first of each is logged, the rest only counted.
    assert_eq!(lines("undecodable kv-events message skipped"), 1, "{log}");
    assert_eq!(lines("connection cap reached"), 1, "{log}");
}
