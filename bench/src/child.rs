//! Child processes and loopback ports of the benches: one guard that kills a child when
//! dropped, and the free-port and wait-for-listener helpers every process-spawning bench
//! uses.

use std::net::{TcpListener, TcpStream};
use std::process::Child;
use std::time::{Duration, Instant};

/// Kills a child process (and reaps it) when dropped.
pub(crate) struct Reaped(pub(crate) Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A free loopback port (bound, then released for a child to take).
pub(crate) fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Waits until something accepts connections on `addr`, at most `limit`.
pub(crate) fn wait_port(addr: &str, what: &str, limit: Duration) -> anyhow::Result<()> {
    let t = Instant::now();
    while TcpStream::connect(addr).is_err() {
        anyhow::ensure!(t.elapsed() < limit, "{what} did not listen on {addr}");
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}
