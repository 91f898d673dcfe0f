//! The glommio NATS client against a real `nats-server` (each test starts its own).

use std::time::Duration;

use kvrouter_io::nats::{Client, NatsError, Options};
use kvrouter_tests::{NatsServer, on_glommio};

const T: Duration = Duration::from_secs(5);

fn opts(url: &str) -> Options {
    Options {
        servers: vec![url.to_owned()],
        ping_interval: Duration::from_millis(200),
        ..Default::default()
    }
}

#[test]
fn publish_subscribe_request_flush() {
    let server = NatsServer::start();
    let url = server.url();
    on_glommio(move || async move {
        let c = Client::connect(opts(&url)).await.unwrap();
        let sub = c.subscribe("t.*", None).unwrap();
        c.flush(T).await.unwrap();
        for i in 0..1000u32 {
            c.publish(&format!("t.{}", i % 7), &i.to_le_bytes())
                .await
                .unwrap();
        }
        c.flush(T).await.unwrap();
        for i in 0..1000u32 {
            let m = sub.next().await.unwrap();
            assert_eq!(m.payload, i.to_le_bytes());
            assert_eq!(m.subject, format!("t.{}", i % 7));
        }
        // Request/reply with a responder on the same client.
        let svc = c.subscribe("svc.echo", None).unwrap();
        let responder = c.clone();
        glommio::spawn_local(async move {
            while let Some(m) = svc.next().await {
                let reply = m.reply.clone().unwrap();
                responder
                    .publish(&reply, &[&b"re:"[..], &m.payload].concat())
                    .await
                    .unwrap();
            }
        })
        .detach();
        let r = c.request("svc.echo", b"ping", T).await.unwrap();
        assert_eq!(r.payload, b"re:ping");
        assert_eq!(
            c.request("svc.nobody", b"x", T).await.unwrap_err(),
            NatsError::NoResponders
        );
        assert!(c.stats().msgs_in >= 1001);
        assert!(matches!(
            c.publish("bad subject", b"").await,
            Err(NatsError::InvalidSubject(_))
        ));
        c.close();
    });
}

#[test]
fn token_and_user_password_auth() {
    let server = NatsServer::start_with(&["--auth", "s3cret"]);
    let url = server.url();
    on_glommio(move || async move {
        let good = Client::connect(Options {
            token: Some("s3cret".into()),
            ..opts(&url)
        })
        .await
        .unwrap();
        good.flush(T).await.unwrap();
        good.close();
        let bad = Client::connect(Options {
            token: Some("nope".into()),
            ..opts(&url)
        })
        .await
        .unwrap_err();
        assert!(
            matches!(bad, NatsError::Server(ref e) if e.contains("Authorization")),
            "{bad:?}"
        );
    });
    let server = NatsServer::start_with(&["--user", "ana", "--pass", "pw"]);
    let url = server.url();
    on_glommio(move || async move {
        let c = Client::connect(Options {
            user: Some("ana".into()),
            password: Some("pw".into()),
            ..opts(&url)
        })
        .await
        .unwrap();
        c.flush(T).await.unwrap();
        c.close();
        let bad = Client::connect(Options {
            user: Some("ana".into()),
            password: Some("x".into()),
            ..opts(&url)
        })
        .await;
        assert!(matches!(bad, Err(NatsError::Server(_))));
    });
}

#[test]
fn max_payload_is_honoured_and_large_payloads_work() {
    let conf = NatsServer::config_file("max_payload: 4MB\n");
    let server = NatsServer::start_with(&["-c", conf.to_str().unwrap()]);
    let url = server.url();
    on_glommio(move || async move {
        let c = Client::connect(opts(&url)).await.unwrap();
        assert_eq!(c.max_payload(), 4 << 20);
        let sub = c.subscribe("big", None).unwrap();
        c.flush(T).await.unwrap();
        let payload: Vec<u8> = (0..3_000_000u32).map(|i| i as u8).collect();
        c.publish("big", &payload).await.unwrap();
        let m = sub.next().await.unwrap();
        assert_eq!(m.payload, payload);
        let too_big = vec![0u8; (4 << 20) + 1];
        assert_eq!(
            c.publish("big", &too_big).await,
            Err(NatsError::PayloadTooLarge {
                size: too_big.len(),
                max: 4 << 20
            })
        );
        c.close();
    });
}

#[test]
fn reconnects_and_resubscribes_after_a_server_restart() {
    let mut server = NatsServer::start();
    let url = server.url();
    let (tx, rx) = std::sync::mpsc::channel::<&'static str>();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let handle = std::thread::spawn(move || {
        on_glommio(move || async move {
            let c = Client::connect(opts(&url)).await.unwrap();
            let sub = c.subscribe("r.x", None).unwrap();
            c.flush(T).await.unwrap();
            tx.send("subscribed").unwrap();
            // Wait for the restart, then for the reconnect, then publish.
            while go_rx.try_recv().is_err() {
                glommio::timer::sleep(Duration::from_millis(10)).await;
            }
            let start = std::time::Instant::now();
            loop {
                if c.is_connected() && c.flush(Duration::from_millis(500)).await.is_ok() {
                    break;
                }
                assert!(start.elapsed() < Duration::from_secs(10), "no reconnect");
                glommio::timer::sleep(Duration::from_millis(20)).await;
            }
            c.publish("r.x", b"after").await.unwrap();
            let m = sub.next().await.unwrap();
            assert_eq!(m.payload, b"after");
            assert!(c.stats().reconnects >= 1);
            c.close();
        })
    });
    assert_eq!(rx.recv().unwrap(), "subscribed");
    server.restart();
    go_tx.send(()).unwrap();
    handle.join().unwrap();
}

/// A scripted NATS server for one connection: sends INFO, answers the handshake's PING and
/// returns what it read after it.
fn fake_handshake(s: &mut std::net::TcpStream) -> Vec<u8> {
    use std::io::{Read, Write};
    s.write_all(
        b"INFO {\"server_id\":\"fake\",\"version\":\"2.10.0\",\"proto\":1,\"headers\":true,\"max_payload\":1048576}\r\n",
    )
    .unwrap();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(i) = buf.windows(6).position(|w| w == b"PING\r\n") {
            s.write_all(b"PONG\r\n").unwrap();
            return buf.split_off(i + 6);
        }
        let n = s.read(&mut chunk).unwrap();
        assert!(n > 0, "client left during the handshake");
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Reads PUBs, answering PINGs, until the first PING after a PUB on `end` (`ended` is set
/// when that PUB is read); returns the payloads.
fn fake_collect(
    s: &mut std::net::TcpStream,
    mut buf: Vec<u8>,
    end: &str,
    ended: &std::sync::atomic::AtomicBool,
) -> Vec<Vec<u8>> {
    use std::io::{Read, Write};
    use std::sync::atomic::Ordering;
    let mut payloads = Vec::new();
    let mut chunk = vec![0u8; 1 << 16];
    loop {
        // Every complete operation in `buf`.
        while let Some(eol) = buf.windows(2).position(|w| w == b"\r\n") {
            let line = String::from_utf8_lossy(&buf[..eol]).into_owned();
            if let Some(rest) = line.strip_prefix("PUB ") {
                let parts: Vec<&str> = rest.split(' ').collect();
                let size: usize = parts.last().unwrap().parse().unwrap();
                if buf.len() < eol + 2 + size + 2 {
                    break;
                }
                let payload = buf[eol + 2..eol + 2 + size].to_vec();
                buf.drain(..eol + 2 + size + 2);
                if parts[0] == end {
                    ended.store(true, Ordering::SeqCst);
                } else {
                    payloads.push(payload);
                }
            } else {
                buf.drain(..eol + 2);
                if line == "PING" {
                    s.write_all(b"PONG\r\n").unwrap();
                    if ended.load(Ordering::SeqCst) {
                        return payloads;
                    }
                    // Time for a client that took this PONG for a later PING's to show it.
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        }
        let n = s.read(&mut chunk).unwrap();
        assert!(n > 0, "client left before the end marker");
        buf.extend_from_slice(&chunk[..n]);
    }
}

#[test]
fn a_batch_cut_off_by_a_dropped_connection_is_sent_again() {
    // The first connection stops reading, so the client's writer blocks on a full socket
    // in the middle of a large batch; then the server drops it (with unread data: a reset,
    // seen by the client's reader). Every message must reach the second connection. The
    // batch also carries a flush's PING, which fails with the connection; sent again, its
    // PONG must not end the flush made after the reconnect.
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    const N: u32 = 4000;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("nats://{}", listener.local_addr().unwrap());
    let (stalled_tx, stalled_rx) = std::sync::mpsc::channel::<()>();
    let ended = Arc::new(AtomicBool::new(false));
    let server_ended = ended.clone();
    let server = std::thread::spawn(move || {
        let (mut first, _) = listener.accept().unwrap();
        fake_handshake(&mut first);
        stalled_rx.recv().unwrap();
        drop(first);
        let (mut second, _) = listener.accept().unwrap();
        let rest = fake_handshake(&mut second);
        // Time for the client to queue its last flush before the resent PING is answered.
        std::thread::sleep(Duration::from_millis(300));
        fake_collect(&mut second, rest, "end", &server_ended)
    });
    let client = std::thread::spawn(move || {
        on_glommio(move || async move {
            let c = Client::connect(Options {
                servers: vec![url],
                ping_interval: Duration::from_secs(60),
                max_pending_bytes: 64 << 20,
                ..Default::default()
            })
            .await
            .unwrap();
            let mut payload = vec![0u8; 4096];
            for i in 0..N {
                payload[..4].copy_from_slice(&i.to_le_bytes());
                c.publish("data", &payload).await.unwrap();
            }
            let early = c.clone();
            let early = glommio::spawn_local(async move { early.flush(T).await });
            // The writer takes the 16 MB batch and blocks once the socket buffers are full.
            glommio::timer::sleep(Duration::from_millis(300)).await;
            stalled_tx.send(()).unwrap();
            let start = std::time::Instant::now();
            while c.stats().reconnects == 0 {
                assert!(start.elapsed() < Duration::from_secs(10), "no reconnect");
                glommio::timer::sleep(Duration::from_millis(10)).await;
            }
            assert_eq!(early.await, Err(NatsError::NotConnected));
            c.publish("end", b"").await.unwrap();
            c.flush(Duration::from_secs(10)).await.unwrap();
            assert!(
                ended.load(Ordering::SeqCst),
                "the flush returned before the server read what preceded it"
            );
            c.close();
        })
    });
    client.join().unwrap();
    let payloads = server.join().unwrap();
    let mut seen = vec![false; N as usize];
    for p in &payloads {
        seen[u32::from_le_bytes(p[..4].try_into().unwrap()) as usize] = true;
    }
    let missing = seen.iter().filter(|s| !**s).count();
    assert_eq!(missing, 0, "{missing} of {N} messages never arrived");
}

#[test]
fn flush_waits_for_its_own_pong_not_a_keepalive_one() {
    // The server answers a keepalive PING before it has read what the client published
    // after it: that PONG must not end the flush that follows the publication.
    use std::io::{Read, Write};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("nats://{}", listener.local_addr().unwrap());
    let got_x = Arc::new(AtomicBool::new(false));
    let (keepalive_tx, keepalive_rx) = std::sync::mpsc::channel::<()>();
    let seen = got_x.clone();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut buf = fake_handshake(&mut s);
        let mut chunk = [0u8; 4096];
        // Up to the first keepalive PING, left unanswered for now.
        let after_ping = loop {
            if let Some(i) = buf.windows(6).position(|w| w == b"PING\r\n") {
                break buf.split_off(i + 6);
            }
            let n = s.read(&mut chunk).unwrap();
            assert!(n > 0);
            buf.extend_from_slice(&chunk[..n]);
        };
        keepalive_tx.send(()).unwrap();
        // The client publishes and flushes now; its bytes wait unread while the keepalive
        // PING is answered.
        std::thread::sleep(Duration::from_millis(50));
        s.write_all(b"PONG\r\n").unwrap();
        std::thread::sleep(Duration::from_millis(100));
        // The publication to `x` marks the end: the flush's PING follows it.
        fake_collect(&mut s, after_ping, "x", &seen);
    });
    on_glommio(move || async move {
        let c = Client::connect(Options {
            servers: vec![url],
            ping_interval: Duration::from_millis(200),
            ..Default::default()
        })
        .await
        .unwrap();
        while keepalive_rx.try_recv().is_err() {
            glommio::timer::sleep(Duration::from_millis(1)).await;
        }
        c.publish("x", b"!").await.unwrap();
        c.flush(Duration::from_secs(5)).await.unwrap();
        assert!(
            got_x.load(Ordering::SeqCst),
            "flush returned before the server read the publication"
        );
        c.close();
    });
    server.join().unwrap();
}
