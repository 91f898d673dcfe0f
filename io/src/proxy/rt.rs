//! hyper on glommio: the socket adapter hyper's I/O traits need, and a timer for its
//! deadlines.
//!
//! hyper 1.x takes any I/O that implements its own `Read` / `Write`; glommio's
//! [`TcpStream`] implements the futures ones. [`Io`] maps one onto the other on the
//! executor's thread (nothing here is `Send`, and hyper's HTTP/1 connections do not ask it).
//!
//! hyper's timer must hand out `Send + Sync` sleeps, which glommio's timers are not. The
//! [`Timer`] here keeps every pending deadline in one ordered map per executor thread and
//! one local task that wakes at the earliest of them (at most every [`TICK`] late): a
//! sleep is an `Arc` of a flag and a waker, which is `Send`. A sleep dropped before its
//! deadline leaves the map with it, so a connection's header timeout costs a map entry for
//! the time the headers take to arrive, not a task for the whole timeout.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use futures_lite::io::{AsyncRead, AsyncWrite};
use glommio::net::TcpStream;

/// The most bytes one read may ask of the socket.
const READ_CHUNK: usize = 16 << 10;

/// A glommio socket as hyper's I/O.
///
/// hyper hands `poll_read` an uninitialised buffer (up to hundreds of KiB), and glommio
/// reads only into initialised memory. Initialising hyper's buffer on every call cost a
/// memset of the whole chunk per read, twice when the first poll was pending (12 % of the
/// proxy's instructions, measured with callgrind). Instead each connection owns one
/// scratch chunk, zeroed once: the socket reads into it and the bytes it got are copied
/// into hyper's buffer, so a read costs what it carries.
#[derive(Debug)]
pub(crate) struct Io {
    stream: TcpStream,
    scratch: Box<[u8]>,
}

impl Io {
    pub(crate) fn new(stream: TcpStream) -> Self {
        Self {
            stream,
            scratch: vec![0; READ_CHUNK].into_boxed_slice(),
        }
    }
}

impl hyper::rt::Read for Io {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        mut buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let len = buf.remaining().min(this.scratch.len());
        match Pin::new(&mut this.stream).poll_read(cx, &mut this.scratch[..len]) {
            Poll::Ready(Ok(n)) => {
                buf.put_slice(&this.scratch[..n]);
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl hyper::rt::Write for Io {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_close(cx)
    }
}

/// How late a deadline may fire at most (the wheel's task sleeps no longer than this
/// when it has nothing earlier to wait for).
pub(crate) const TICK: Duration = Duration::from_millis(50);

/// One deadline's shared state.
#[derive(Debug, Default)]
struct Shared {
    fired: AtomicBool,
    waker: Mutex<Option<Waker>>,
}

impl Shared {
    fn fire(&self) {
        self.fired.store(true, Ordering::Release);
        let w = self.waker.lock().map(|mut w| w.take()).unwrap_or(None);
        if let Some(w) = w {
            w.wake();
        }
    }
}

#[derive(Default)]
struct Wheel {
    pending: BTreeMap<(Instant, u64), Arc<Shared>>,
    next_id: u64,
    running: bool,
}

thread_local! {
    static WHEEL: RefCell<Wheel> = RefCell::new(Wheel::default());
}

/// Fires every due deadline; returns the earliest one left.
fn fire_due(now: Instant) -> Option<Instant> {
    let due: Vec<Arc<Shared>> = WHEEL.with(|w| {
        let mut w = w.borrow_mut();
        let later = w.pending.split_off(&(now, u64::MAX));
        let due = std::mem::replace(&mut w.pending, later);
        due.into_values().collect()
    });
    for s in due {
        s.fire();
    }
    WHEEL.with(|w| w.borrow().pending.keys().next().map(|k| k.0))
}

/// The wheel's task: runs while deadlines are pending.
fn ensure_running() {
    let start = WHEEL.with(|w| {
        let mut w = w.borrow_mut();
        !std::mem::replace(&mut w.running, true)
    });
    if !start {
        return;
    }
    glommio::spawn_local(async {
        loop {
            let next = fire_due(Instant::now());
            let Some(next) = next else {
                WHEEL.with(|w| w.borrow_mut().running = false);
                return;
            };
            let wait = next.saturating_duration_since(Instant::now()).min(TICK);
            glommio::timer::sleep(wait.max(Duration::from_millis(1))).await;
        }
    })
    .detach();
}

/// A deadline hyper waits on.
#[derive(Debug)]
struct Deadline {
    key: (Instant, u64),
    shared: Arc<Shared>,
}

impl Deadline {
    fn new(at: Instant) -> Self {
        let shared = Arc::new(Shared::default());
        let key = WHEEL.with(|w| {
            let mut w = w.borrow_mut();
            w.next_id += 1;
            let key = (at, w.next_id);
            w.pending.insert(key, Arc::clone(&shared));
            key
        });
        ensure_running();
        Deadline { key, shared }
    }
}

impl Future for Deadline {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.shared.fired.load(Ordering::Acquire) || Instant::now() >= self.key.0 {
            return Poll::Ready(());
        }
        if let Ok(mut w) = self.shared.waker.lock() {
            *w = Some(cx.waker().clone());
        }
        // It may have fired between the check and the registration.
        if self.shared.fired.load(Ordering::Acquire) {
            return Poll::Ready(());
        }
        Poll::Pending
    }
}

impl Drop for Deadline {
    fn drop(&mut self) {
        // Dropped on another thread (hyper never does), the entry fires harmlessly later.
        let _ = WHEEL.try_with(|w| {
            if let Ok(mut w) = w.try_borrow_mut() {
                w.pending.remove(&self.key);
            }
        });
    }
}

impl hyper::rt::Sleep for Deadline {}

/// hyper's timer on the executor's thread (see the [module docs](self)).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Timer;

impl hyper::rt::Timer for Timer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(Deadline::new(Instant::now() + duration))
    }

    fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(Deadline::new(deadline))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadlines_fire_in_order_and_dropped_ones_leave() {
        let ex = glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
            .io_memory(1 << 20)
            .make()
            .expect("executor");
        ex.run(async {
            let t0 = Instant::now();
            let early = Deadline::new(t0 + Duration::from_millis(20));
            let dropped = Deadline::new(t0 + Duration::from_secs(30));
            drop(dropped);
            assert_eq!(WHEEL.with(|w| w.borrow().pending.len()), 1);
            early.await;
            let took = t0.elapsed();
            assert!(took >= Duration::from_millis(20), "{took:?}");
            assert!(took < Duration::from_secs(2), "{took:?}");
            assert_eq!(WHEEL.with(|w| w.borrow().pending.len()), 0);
        });
    }
}
