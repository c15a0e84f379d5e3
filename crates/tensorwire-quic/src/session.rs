//! The one sans-IO [`Session`] of a connection, shared by the tasks that pump its streams in
//! both directions: the receiving side's streams and the tensors sent on it.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use smallvec::SmallVec;
use tensorwire_proto::{Frame, Session, SessionConfig, StreamId, WireChunks};

use crate::error::TransportError;
use crate::stream::FrameStream;

/// A connection's session. Lock it only for a sans-IO call, never across an await, and
/// before the receiver's credit tracker, never after. Cheap to clone.
#[derive(Clone, Debug)]
pub(crate) struct ConnectionSession(Arc<Mutex<Session>>);

impl ConnectionSession {
    /// A session with `config`, idle from now.
    pub(crate) fn new(config: SessionConfig) -> Self {
        Self(Arc::new(Mutex::new(Session::new(config, Instant::now()))))
    }

    /// The session, for one sans-IO call.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Session> {
        // The session's invariants hold between calls; a panic elsewhere cannot break them.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
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
