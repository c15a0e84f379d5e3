//! Refused consumers are told why, off the accept loop (spec/ipc.md §1).

use std::time::{Duration, Instant};

use super::serve::{Refusal, send};
use crate::message::Reply;

/// Refused connections waiting to be told why; past this many, one is closed with no reason
/// rather than waited for.
pub(super) const REFUSALS_QUEUED: usize = 64;

/// How long a refused peer's first request is waited for: a consumer sends it as soon as it
/// connects, so only a silent peer waits this long.
const REFUSAL_WAIT: Duration = Duration::from_millis(250);

/// Tells refused peers why, off the accept loop and all at once. Each peer's first request
/// is read before the answer (closing with unread data would reset the connection, and the
/// peer would never see why); one that stays silent is closed after [`REFUSAL_WAIT`], so
/// silent peers never delay another's answer.
pub(super) fn refusal_loop(refusals: std::sync::mpsc::Receiver<Refusal>) {
    use rustix::event::{PollFd, PollFlags, poll};
    let mut waiting: Vec<(Refusal, Instant)> = Vec::new();
    loop {
        // Block for the next refusal only when none is waiting.
        if waiting.is_empty() {
            match refusals.recv() {
                Ok(refusal) => waiting.push((refusal, Instant::now() + REFUSAL_WAIT)),
                Err(_) => return, // The service stopped.
            }
        }
        while waiting.len() < REFUSALS_QUEUED {
            match refusals.try_recv() {
                Ok(refusal) => waiting.push((refusal, Instant::now() + REFUSAL_WAIT)),
                Err(_) => break,
            }
        }
        let now = Instant::now();
        let wait = waiting
            .iter()
            .map(|(_, deadline)| deadline.saturating_duration_since(now))
            .min()
            .unwrap_or_default()
            // Short, so refusals that came meanwhile join the wait.
            .min(Duration::from_millis(20));
        let timeout = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: i64::from(wait.subsec_nanos()),
        };
        let ready: Vec<bool> = {
            let mut fds: Vec<PollFd<'_>> = waiting
                .iter()
                .map(|((packets, _, _), _)| {
                    PollFd::from_borrowed_fd(packets.as_fd(), PollFlags::IN)
                })
                .collect();
            let _ = poll(&mut fds, Some(&timeout));
            fds.iter().map(|fd| !fd.revents().is_empty()).collect()
        };
        let now = Instant::now();
        let mut ready = ready.into_iter();
        waiting.retain(|((packets, code, why), deadline)| {
            let answered = ready.next().unwrap_or(false);
            if answered {
                let _ = packets.recv();
                let _ = send(packets, &Reply::error(code.clone(), why.clone()), None);
            }
            !answered && *deadline > now
        });
    }
}
