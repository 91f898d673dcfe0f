//! Helper threads beside the executors, and how background work gives way to them.
//!
//! An executor serves every connection of its core from one thread, so another thread that
//! takes the executor's CPU stalls every request behind it. When a thread wakes up, Linux
//! lets it preempt the thread running where it lands if it is owed CPU time, as a thread
//! that slept for a while is, and then lets it run for a slice. Measured through the
//! OpenAI front at 5,000 requests/s on two shared vCPUs (docs/BENCHMARKS.md, "The
//! checker's stall"), the piece cache's checker, woken for one prompt in 256, stalled the
//! front for about 0.6 ms every 51.2 ms: a third to three fifths of the requests slower
//! than 500 µs fell in those stalls (two runs).
//!
//! Work that no request waits for therefore runs as `SCHED_IDLE`: such a thread never
//! preempts another class, an executor that wakes up preempts it at once, and it runs on
//! CPU time nobody else wants. It is not starved: `SCHED_IDLE` has a small weight of its
//! own (by the kernel's weights, 3 against a nice-0 thread's 1,024: about 0.3 % of a CPU
//! that such a thread also wants), so a short job still ends
//! under full load, later. Threads that a request waits for (the tokenizer pool) keep the
//! default class: a request behind them must not wait on spare CPU.

/// Moves the calling thread to `SCHED_IDLE` (see the module docs). Where the call fails (a
/// platform or a sandbox without it), the thread stays as it was, with a debug line: it
/// works the same, with less regard for the executors.
pub(crate) fn run_as_background() {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: pid 0 names the calling thread; `param` is an initialised `sched_param`
        // that outlives the call, with the priority 0 that SCHED_IDLE requires. The call
        // reads nothing else and changes only this thread's scheduling.
        if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } != 0 {
            tracing::debug!(
                error = %std::io::Error::last_os_error(),
                "a background thread keeps the default scheduling class"
            );
        }
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn a_background_thread_runs_idle_and_others_keep_their_class() {
        let policy = std::thread::spawn(|| {
            run_as_background();
            // SAFETY: a plain query of the calling thread's policy.
            unsafe { libc::sched_getscheduler(0) }
        })
        .join()
        .expect("thread");
        assert_eq!(policy, libc::SCHED_IDLE);
        // The class is the thread's own: this one keeps the default.
        // SAFETY: as above.
        assert_eq!(unsafe { libc::sched_getscheduler(0) }, libc::SCHED_OTHER);
    }
}
