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
