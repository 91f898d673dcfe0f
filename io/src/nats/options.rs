//! Connection settings and server URLs.
//!
//! Secrets (a token, a password, credentials inside a server URL) never reach a log line:
//! `Options`' `Debug` redacts them, and [`ServerUrl`] displays a URL without its user info.

use std::time::Duration;

use super::error::NatsError;

/// Connection settings.
#[derive(Clone)]
pub struct Options {
    /// Server URLs (`nats://host:port`, `host:port`), tried in turn.
    pub servers: Vec<String>,
    /// Token authentication.
    pub token: Option<String>,
    /// User for user/password authentication.
    pub user: Option<String>,
    /// Password for user/password authentication.
    pub password: Option<String>,
    /// Client name shown by the server.
    pub name: String,
    /// First reconnect delay; doubles up to `reconnect_max`.
    pub reconnect_base: Duration,
    /// Longest reconnect delay.
    pub reconnect_max: Duration,
    /// Give up connecting after this many consecutive failures (`None`: never).
    pub max_reconnects: Option<u32>,
    /// Connect and handshake timeout.
    pub connect_timeout: Duration,
    /// Interval of keep-alive PINGs; two unanswered ones drop the connection.
    pub ping_interval: Duration,
    /// Bytes the write buffer may hold before `publish` waits.
    pub max_pending_bytes: usize,
    /// Messages buffered per subscription before new ones are dropped.
    pub subscription_capacity: usize,
    /// Largest payload accepted from the server (until INFO tells us its own limit).
    pub max_payload: usize,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            servers: vec!["nats://127.0.0.1:4222".into()],
            token: None,
            user: None,
            password: None,
            name: "kvrouter".into(),
            reconnect_base: Duration::from_millis(20),
            reconnect_max: Duration::from_secs(2),
            max_reconnects: None,
            connect_timeout: Duration::from_secs(2),
            ping_interval: Duration::from_secs(10),
            max_pending_bytes: 8 << 20,
            subscription_capacity: 1 << 16,
            max_payload: 64 << 20,
        }
    }
}

impl std::fmt::Debug for Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let redacted = |v: &Option<String>| v.as_ref().map(|_| "<redacted>");
        let servers: Vec<String> = self
            .servers
            .iter()
            .map(|s| ServerUrl::parse(s).map_or_else(|_| "<unparsable>".into(), |u| u.to_string()))
            .collect();
        f.debug_struct("Options")
            .field("servers", &servers)
            .field("token", &redacted(&self.token))
            .field("user", &self.user)
            .field("password", &redacted(&self.password))
            .field("name", &self.name)
            .field("reconnect_base", &self.reconnect_base)
            .field("reconnect_max", &self.reconnect_max)
            .field("max_reconnects", &self.max_reconnects)
            .field("connect_timeout", &self.connect_timeout)
            .field("ping_interval", &self.ping_interval)
            .field("max_pending_bytes", &self.max_pending_bytes)
            .field("subscription_capacity", &self.subscription_capacity)
            .field("max_payload", &self.max_payload)
            .finish()
    }
}

/// A server URL: `nats://[user[:password]@|token@]host[:port]` (also `tcp://`, or no
/// scheme), port 4222 when absent. User info is percent-decoded; `user:password` is
/// user/password authentication and a lone name is a token, as in the NATS clients.
#[derive(Clone, PartialEq, Eq)]
pub struct ServerUrl {
    /// `host:port`.
    pub addr: String,
    /// A user from the URL.
    pub user: Option<String>,
    /// A password from the URL.
    pub password: Option<String>,
    /// A token from the URL.
    pub token: Option<String>,
}

impl ServerUrl {
    /// Parses `url`; the error never holds the URL's user info.
    pub fn parse(url: &str) -> Result<ServerUrl, NatsError> {
        let rest = url
            .strip_prefix("nats://")
            .or_else(|| url.strip_prefix("tcp://"))
            .unwrap_or(url);
        let (userinfo, host) = match rest.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, rest),
        };
        let host = host.trim_end_matches('/');
        if host.is_empty() || host.contains(['/', '@', ' ']) {
            return Err(NatsError::BadUrl(redact(url)));
        }
        let addr = if host.rsplit_once(':').is_some_and(|(_, p)| !p.contains(']')) {
            host.to_owned()
        } else {
            format!("{host}:4222")
        };
        let decode = |s: &str| percent_decode(s).ok_or_else(|| NatsError::BadUrl(redact(url)));
        let (user, password, token) = match userinfo {
            None => (None, None, None),
            Some(u) => match u.split_once(':') {
                Some((user, pass)) => (Some(decode(user)?), Some(decode(pass)?), None),
                None => (None, None, Some(decode(u)?)),
            },
        };
        Ok(ServerUrl {
            addr,
            user,
            password,
            token,
        })
    }
}

/// `nats://host:port`, without user info.
impl std::fmt::Display for ServerUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "nats://{}", self.addr)
    }
}

impl std::fmt::Debug for ServerUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ServerUrl({self})")
    }
}

/// `url` with any user info replaced by `<redacted>`, for messages about a URL that may not
/// parse.
pub fn redact(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((s, r)) => (Some(s), r),
        None => (None, url),
    };
    let rest = match rest.rsplit_once('@') {
        Some((_, host)) => format!("<redacted>@{host}"),
        None => rest.to_owned(),
    };
    match scheme {
        Some(s) => format!("{s}://{rest}"),
        None => rest,
    }
}

fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_with_and_without_credentials() {
        let u = ServerUrl::parse("nats://alice:s%3Acret@10.0.0.1:4333").unwrap();
        assert_eq!(u.addr, "10.0.0.1:4333");
        assert_eq!(u.user.as_deref(), Some("alice"));
        assert_eq!(u.password.as_deref(), Some("s:cret"));
        assert_eq!(u.token, None);
        assert_eq!(u.to_string(), "nats://10.0.0.1:4333");
        assert!(!format!("{u:?}").contains("cret"));
        let t = ServerUrl::parse("tok3n@localhost").unwrap();
        assert_eq!(
            (t.addr.as_str(), t.token.as_deref()),
            ("localhost:4222", Some("tok3n"))
        );
        assert_eq!(
            ServerUrl::parse("127.0.0.1:4222/").unwrap().addr,
            "127.0.0.1:4222"
        );
        assert_eq!(ServerUrl::parse("[::1]:5000").unwrap().addr, "[::1]:5000");
        for bad in ["nats://", "nats://user:pa%zzss@h", "nats://x@"] {
            let e = ServerUrl::parse(bad).unwrap_err().to_string();
            assert!(!e.contains("pa%zz"), "{e}");
        }
        assert_eq!(redact("nats://u:p@h:1"), "nats://<redacted>@h:1");
        assert_eq!(redact("h:1"), "h:1");
    }

    #[test]
    fn options_debug_redacts_secrets() {
        let o = Options {
            servers: vec!["nats://u:hunter2@h:1".into()],
            token: Some("t0ken".into()),
            password: Some("pw-secret".into()),
            ..Options::default()
        };
        let d = format!("{o:?}");
        for secret in ["hunter2", "t0ken", "pw-secret"] {
            assert!(!d.contains(secret), "{d}");
        }
        assert!(d.contains("nats://h:1"), "{d}");
    }
}
