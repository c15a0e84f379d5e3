//! The one sans-IO [`Session`] of a connection, shared by the tasks that pump its streams in
//! both directions: the receiving side's streams and the tensors sent on it.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use smallvec::SmallVec;
use tensorwire_proto::{Frame, Session, SessionConfig, StreamId, TurnTicket, WireChunks};
use tokio::sync::Notify;

use crate::error::TransportError;
use crate::stream::FrameStream;

/// A connection's session. Lock it only for a sans-IO call, never across an await, and
/// before the receiver's credit tracker, never after. Cheap to clone.
#[derive(Clone, Debug)]
pub(crate) struct ConnectionSession(Arc<Shared>);

/// What the clones of a [`ConnectionSession`] share.
#[derive(Debug)]
struct Shared {
    session: Mutex<Session>,
    /// Woken when the turn to send a large tensor's DATA passes to the next tensor
    /// ([`ConnectionSession::take_turn`]).
    turn_passed: Notify,
}

impl ConnectionSession {
    /// A session with `config`, idle from now.
    pub(crate) fn new(config: SessionConfig) -> Self {
        Self(Arc::new(Shared {
            session: Mutex::new(Session::new(config, Instant::now())),
            turn_passed: Notify::new(),
        }))
    }

    /// The session, for one sans-IO call.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Session> {
        // The session's invariants hold between calls; a panic elsewhere cannot break them.
        self.0
            .session
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits, first come first served, until the large tensors before it on this connection
    /// are done with the turn, and holds it until the [`Turn`] is dropped. A tensor is done
    /// once the bytes it has left leave within two round trips
    /// ([`Session::turn_done`](tensorwire_proto::Session::turn_done), spec §7.4), so the
    /// next one's admission overlaps them.
    ///
    /// Tensors sent at once on one connection otherwise all open their streams, and QUIC
    /// interleaves their DATA: the receiver then admits every one of them (destination
    /// memory), spreads its credit over them and fills a staging buffer for each, and the
    /// connection moves less than taking turns (benches/results/LOG.md).
    pub(crate) async fn take_turn(&self) -> Turn {
        // The place is given up if this future is dropped while it waits.
        let turn = Turn {
            ticket: self.lock().queue_for_turn(),
            session: self.clone(),
        };
        loop {
            let passed = self.0.turn_passed.notified();
            tokio::pin!(passed);
            // Registered before the session is asked, so a turn passed in between wakes it.
            passed.as_mut().enable();
            if self.lock().has_turn(turn.ticket) {
                return turn;
            }
            passed.await;
        }
    }
}

/// A tensor's place in its connection's queue for the turn, held or waited for; given up
/// when dropped.
#[derive(Debug)]
pub(crate) struct Turn {
    session: ConnectionSession,
    ticket: TurnTicket,
}

impl Drop for Turn {
    fn drop(&mut self) {
        let passed = self.session.lock().leave_turn(self.ticket);
        if passed {
            self.session.0.turn_passed.notify_waiters();
        }
    }
}

impl ConnectionSession {
    /// Writes what the session queued for stream `id`: taken under the lock, laid out and
    /// written after it is released.
    pub(crate) async fn flush(
        &self,
        id: StreamId,
        stream: &mut FrameStream,
    ) -> Result<(), TransportError> {
        let chunks = {
            // A tensor's flush queues at most a few frames (METADATA, DATA, END; or ACCEPT
            // and COMPLETE): on the stack, and dropped before the write is awaited.
            let frames: SmallVec<[Frame; 4]> = {
                let mut session = self.lock();
                std::iter::from_fn(|| session.poll_frame(id)).collect()
            };
            WireChunks::encode(&frames)
        };
        stream.write_chunks(chunks).await
    }
}

/// `future`, unless `deadline` (the session's, spec §10.1) passes first: `None` then.
pub(crate) async fn until<T>(
    deadline: Option<Instant>,
    future: impl Future<Output = T>,
) -> Option<T> {
    match deadline {
        Some(deadline) => tokio::time::timeout_at(deadline.into(), future).await.ok(),
        None => Some(future.await),
    }
}
