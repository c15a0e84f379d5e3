//! What the streams of one connection share: its session, its shares of the receiver's
//! budgets, and the ended streams it keeps until they close (spec §4).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use quinn::VarInt;
use tensorwire_proto::{ErrorCode, Session};
use tensorwire_sink::{Carrier, MemoryBudget, MemoryShares};
use tokio::sync::Notify;
use tokio_util::task::task_tracker::TaskTrackerToken;

use super::CLOSE_GRACE;
use super::offload::ConnectionLoad;
use crate::binding::Binding;
use crate::metrics::Metrics;
use crate::session::ConnectionSession;
use crate::stream::FrameStream;

/// What the streams of one connection share.
pub(super) struct ConnectionState {
    pub(super) endpoint: usize,
    pub(super) connection: quinn::Connection,
    /// What carries its packets.
    pub(super) binding: Binding,
    pub(super) metrics: Metrics,
    /// Every tensor of the connection in both directions, its credit and its abuse budgets.
    pub(super) session: ConnectionSession,
    /// Woken when a tensor of this connection stops waiting for the application's decision
    /// (accepted, rejected or closed): streams waiting for a slot ask the session again.
    pub(super) decision_slot_freed: Notify,
    /// Woken when DATA reopens the connection's credit window after it was full.
    pub(super) window_opened: Notify,
    /// Woken when the session may have queued EARLY_CREDIT for our control stream.
    pub(super) control_queued: Notify,
    /// This connection's shares of the receiver's memory budgets.
    pub(super) memory_shares: MemoryShares,
    /// Its share of the receiver's METADATA budget, taken once: each stream reserves here.
    pub(super) metadata_share: MemoryBudget,
    /// Its large tensors being received now, which weigh on where their payloads are stored.
    pub(super) load: Arc<ConnectionLoad>,
    /// Closed when the connection ends: split tensors it carried parts of stop waiting.
    pub(super) carrier: Carrier,
    /// Streams whose tensor ended, kept until the peer has our last frame and has finished
    /// its half ([`keep_until_closed`](Self::keep_until_closed)).
    pub(super) closing: Mutex<Closing>,
}

/// Ended streams a connection keeps until they close (spec §4: a completed stream is read to
/// the sender's FIN, not stopped).
///
/// No task waits on them: each is looked at when a later stream of the connection ends and at
/// the connection's idle check. A waiting task would be woken by the sender's FIN, which
/// travels with its next tensor, and run before that tensor on the connection's thread.
#[derive(Default)]
pub(super) struct Closing {
    /// Oldest first, each with when it was kept and a token that makes the receiver's close
    /// wait for it.
    streams: VecDeque<(FrameStream, Instant, TaskTrackerToken)>,
    /// Set once the connection's loop has ended: streams are no longer kept here.
    ended: bool,
}

/// Kept streams looked at each time one more is kept: more than one, so the list shrinks to
/// the streams that have not closed, however many a peer leaves open; a few, so each
/// tensor's cost stays the same.
const LOOKED_AT_PER_KEPT: usize = 2;

impl Closing {
    /// Whether a kept stream can go: it closed, or was kept for [`CLOSE_GRACE`].
    fn done(stream: &mut FrameStream, since: Instant, now: Instant) -> bool {
        now.duration_since(since) >= CLOSE_GRACE || stream.delivered_and_finished_now()
    }

    /// Drops every kept stream that can go.
    fn sweep(&mut self, now: Instant) {
        self.streams
            .retain_mut(|(stream, since, _)| !Self::done(stream, *since, now));
    }

    /// Looks at the oldest few kept streams: drops those that can go, moves the others to
    /// the back.
    fn sweep_some(&mut self, now: Instant) {
        for _ in 0..LOOKED_AT_PER_KEPT.min(self.streams.len()) {
            let Some(mut kept) = self.streams.pop_front() else {
                break;
            };
            if !Self::done(&mut kept.0, kept.1, now) {
                self.streams.push_back(kept);
            }
        }
    }
}

impl ConnectionState {
    /// The connection's session (the lock is held only for a sans-IO call, never across an
    /// await).
    pub(super) fn session(&self) -> MutexGuard<'_, Session> {
        self.session.lock()
    }

    /// Closes the connection with `code`; its streams fail with it.
    pub(super) fn close(&self, code: ErrorCode, reason: &[u8]) {
        self.connection.close(VarInt::from_u32(code.0), reason);
    }

    fn closing(&self) -> MutexGuard<'_, Closing> {
        // Only sweeps and pushes happen under the lock: nothing a panic could leave half done.
        self.closing.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Keeps `stream`, whose tensor ended, until the peer has our last frame and has finished
    /// its half, or for [`CLOSE_GRACE`] at most; `token` (of the receiver's stream tracker)
    /// goes with it. Gives the stream back once the connection's loop has ended: the caller
    /// (a tracked task) then waits on it itself.
    pub(super) fn keep_until_closed(
        &self,
        mut stream: FrameStream,
        token: TaskTrackerToken,
    ) -> Option<FrameStream> {
        let now = Instant::now();
        let mut closing = self.closing();
        if closing.ended {
            return Some(stream);
        }
        closing.sweep_some(now);
        // Also leaves a no-op waker with the stream, so that the FIN wakes no task.
        if !stream.delivered_and_finished_now() {
            closing.streams.push_back((stream, now, token));
        }
        None
    }

    /// Drops the kept streams that have closed (see [`keep_until_closed`](Self::keep_until_closed)).
    pub(super) fn sweep_closing(&self) {
        self.closing().sweep(Instant::now());
    }

    /// Streams whose tensor ended, kept until the peer finishes its half.
    pub(super) fn closing_streams(&self) -> usize {
        self.closing().streams.len()
    }

    /// Once the connection's loop has ended: waits for each kept stream to close, within
    /// what is left of its [`CLOSE_GRACE`], so that a receiver closing down still delivers
    /// their last frames.
    pub(super) async fn close_kept_streams(&self) {
        let kept = {
            let mut closing = self.closing();
            closing.ended = true;
            std::mem::take(&mut closing.streams)
        };
        for (mut stream, since, _token) in kept {
            let left = CLOSE_GRACE.saturating_sub(since.elapsed());
            stream.delivered_and_finished(left).await;
        }
    }
}
