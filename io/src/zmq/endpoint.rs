//! ZeroMQ endpoints: `tcp://host:port`.

use std::net::{SocketAddr, ToSocketAddrs};

/// A TCP endpoint, to connect to or to bind.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Endpoint {
    /// `host:port` (`0.0.0.0:port` for a wildcard bind).
    pub addr: String,
    /// Whether the endpoint names a wildcard host (`*`, `0.0.0.0`, `::`): a socket there is
    /// bound, as vLLM binds its publisher when its endpoint is a wildcard.
    pub wildcard: bool,
}

/// Why an endpoint does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad ZMQ endpoint {0:?}: expected tcp://host:port")]
pub struct BadEndpoint(pub String);

impl Endpoint {
    /// Parses `tcp://host:port` (also `host:port`); `*` as the host means every interface.
    pub fn parse(s: &str) -> Result<Endpoint, BadEndpoint> {
        let bad = || BadEndpoint(s.to_owned());
        let rest = s.strip_prefix("tcp://").unwrap_or(s);
        let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
        let port: u16 = port.parse().map_err(|_| bad())?;
        if host.is_empty() || host.contains(['/', ' ', '@']) {
            return Err(bad());
        }
        let wildcard = matches!(host, "*" | "0.0.0.0" | "[::]" | "::");
        let host = if host == "*" { "0.0.0.0" } else { host };
        Ok(Endpoint {
            addr: format!("{host}:{port}"),
            wildcard,
        })
    }

    /// The same host, port + `offset` (vLLM and SGLang put dp rank `r` on base port + `r`).
    pub fn offset(&self, offset: u16) -> Option<Endpoint> {
        let (host, port) = self.addr.rsplit_once(':')?;
        let port: u16 = port.parse().ok()?;
        Some(Endpoint {
            addr: format!("{host}:{}", port.checked_add(offset)?),
            wildcard: self.wildcard,
        })
    }

    /// The address to bind or connect (resolved).
    pub fn socket_addr(&self) -> std::io::Result<SocketAddr> {
        self.addr.to_socket_addrs()?.next().ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::NotFound, "no address for the endpoint")
        })
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "tcp://{}", self.addr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        let e = Endpoint::parse("tcp://*:5557").unwrap();
        assert_eq!((e.addr.as_str(), e.wildcard), ("0.0.0.0:5557", true));
        let e = Endpoint::parse("tcp://10.1.2.3:5557").unwrap();
        assert!(!e.wildcard);
        assert_eq!(e.offset(2).unwrap().addr, "10.1.2.3:5559");
        assert_eq!(e.to_string(), "tcp://10.1.2.3:5557");
        assert!(Endpoint::parse("localhost:1").is_ok());
        for bad in ["tcp://", "tcp://h", "tcp://h:x", "tcp://:5", "ipc:///tmp/x"] {
            assert!(Endpoint::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(Endpoint::parse("h:65535").unwrap().offset(1), None);
    }
}
