//! One tensor's stream, from METADATA to COMPLETE: the driver reads frames, hands them to the
//! connection's [`Session`](tensorwire_proto::Session), writes what it queues, and moves DATA
//! into the sink. Every protocol decision (credit, limits, budgets, timers) is the session's.
//!
//! Here: what a stream holds, its frames into the session, and its end. Admission (to the
//! application's decision) is in `admission.rs`; receiving an accepted tensor in `receive.rs`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use tensorwire_proto::{
    CheckedFrame, ErrorCode, Frame, IncomingEvent, ProtocolError, StreamClosed, StreamId,
};
use tokio::sync::mpsc;
use tracing::warn;

use super::incoming::IncomingTensor;
use super::offload::{Checksums, OnStored};
use super::state::ConnectionState;
use super::{CLOSE_GRACE, Shared};
use crate::error::TransportError;
use crate::stream::FrameStream;
pub(super) use accepted::Accepted;
use accepted::Ended;

pub(super) mod accepted;
mod admission;
mod receive;

/// Hands one frame of stream `id` to its connection's session, which moves its credit.
fn handle_checked(
    connection: &ConnectionState,
    shared: &Shared,
    id: StreamId,
    frame: CheckedFrame,
) -> Result<IncomingEvent, ProtocolError> {
    let mut session = connection.session();
    let window_was_full = session.connection_window_left() == 0;
    let event = shared
        .budget
        .with_tracker(|credit| session.handle_checked(id, frame, credit, Instant::now()));
    if window_was_full && session.connection_window_left() > 0 {
        // DATA reopened the connection's window: its streams waiting on it may grant.
        connection.window_opened.notify_waiters();
    }
    event
}

/// How long a stopped stream is read for the CANCEL that explains the stop.
const STOP_EXPLAINED_WITHIN: std::time::Duration = std::time::Duration::from_millis(200);

pub(super) async fn serve_stream(
    shared: Arc<Shared>,
    connection: Arc<ConnectionState>,
    id: StreamId,
    stream: FrameStream,
    tx: mpsc::Sender<IncomingTensor>,
) {
    let mut st = Accepted {
        id,
        ended: Ended::default(),
        shared,
        connection,
        stream,
        started: Instant::now(),
        pending: Arc::new(AtomicU64::new(0)),
        early: Vec::new(),
        early_ended: false,
        receiving: None,
        metadata: None,
    };
    st.shared.metrics.started();
    st.connection.metrics.started();
    match st.admit(tx).await {
        Ok(Some(run)) => run(st).await,
        Ok(None) => {
            st.end(None).await;
            st.linger().await;
        }
        Err(e) => {
            st.end(Some(&e)).await;
            st.linger().await;
        }
    }
}

impl Accepted {
    /// Hands one frame from the peer to the session (which moves its credit).
    fn handle(&self, frame: Frame) -> Result<IncomingEvent, ProtocolError> {
        // The pass over DATA's bytes, before the connection's and the receiver-wide locks.
        self.handle_checked(CheckedFrame::new(frame))
    }

    /// As [`handle`](Self::handle), DATA's checksum computed later: per payload while its
    /// bytes are stored, reported through [`stored`](Self::stored), or over the landed tensor
    /// by its sink after END.
    fn handle_checksum_later(
        &self,
        frame: Frame,
        checksums: Checksums,
    ) -> Result<IncomingEvent, ProtocolError> {
        self.handle_checked(match checksums {
            Checksums::PerPayload => CheckedFrame::checksum_later(frame),
            Checksums::OfLandedBytes => CheckedFrame::checksum_landed(frame),
        })
    }

    /// What each payload handled by [`handle_checksum_later`](Self::handle_checksum_later)
    /// does once stored, wherever that is: its CRC-32C goes to the session (spec §7.3: one
    /// read of each byte), its bytes to the counters.
    fn stored(
        connection: &ConnectionState,
        shared: &Shared,
        id: StreamId,
        progress: &AtomicU64,
        crc: Option<u32>,
        len: u64,
    ) -> Result<(), TransportError> {
        if let Some(crc) = crc {
            connection.session().record_payload_crc(id, crc)?;
        }
        Self::count_stored(connection, shared, progress, len);
        Ok(())
    }

    /// Counts `len` more bytes stored, for the tensor, its connection and the receiver.
    fn count_stored(connection: &ConnectionState, shared: &Shared, progress: &AtomicU64, len: u64) {
        progress.fetch_add(len, Ordering::Relaxed);
        shared.metrics.add_bytes(len);
        connection.metrics.add_bytes(len);
    }

    /// [`stored`](Self::stored) for stores off this thread.
    fn on_stored_elsewhere(
        connection: &Arc<ConnectionState>,
        shared: &Arc<Shared>,
        id: StreamId,
        progress: &Arc<AtomicU64>,
    ) -> OnStored {
        let (connection, shared, progress) = (connection.clone(), shared.clone(), progress.clone());
        Box::new(move |crc, len| Self::stored(&connection, &shared, id, &progress, crc, len))
    }

    fn handle_checked(&self, frame: CheckedFrame) -> Result<IncomingEvent, ProtocolError> {
        handle_checked(&self.connection, &self.shared, self.id, frame)
    }

    /// After a wait's deadline passed: the error that ends the stream, if the session says
    /// the wait ended (it queued the REJECT or CANCEL); `Ok` if a frame or a grant moved the
    /// deadline meanwhile.
    fn timed_out(&self) -> Result<(), TransportError> {
        let mut session = self.connection.session();
        match session.handle_stream_timeout(self.id, Instant::now()) {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// When the sender stopped our half (a write failed), the CANCEL it sent first says why
    /// ([`FrameStream::explain_stop`]), unless the tensor already ended otherwise.
    async fn explain_stop(&mut self, error: TransportError) -> TransportError {
        if self.connection.session().ending(self.id).is_some() {
            return error;
        }
        let (connection, shared, id) = (&self.connection, &self.shared, self.id);
        self.stream
            .explain_stop(error, STOP_EXPLAINED_WITHIN, |frame| {
                handle_checked(connection, shared, id, CheckedFrame::new(frame)).map(drop)
            })
            .await
    }

    /// Writes what the session queued for this stream.
    async fn flush(&mut self) -> Result<(), TransportError> {
        let session = &self.connection.session;
        session.flush(self.id, &mut self.stream).await
    }

    /// Tells the peer why (if the session has not already), closes the stream, returns its
    /// unused credit through the session, and counts the outcome against the connection's
    /// failure budget.
    async fn end(&mut self, error: Option<&TransportError>) {
        if let Some(e) = error {
            let code = e.code().unwrap_or(ErrorCode::INTERNAL);
            self.connection
                .session()
                .cancel(self.id, code, e.to_string());
            warn!(error = %e, "tensor failed");
        }
        let _ = self.flush().await;
        // Early DATA never handed to a sink: its credit returns now, not after the linger.
        self.early.clear();
        self.stream
            .close(error.map(|e| e.code().unwrap_or(ErrorCode::INTERNAL)));
        let (closed, topped_up, window, ending) = {
            let mut session = self.connection.session();
            let window = session.stream_window(self.id).unwrap_or(0);
            // Why it ended, whoever ended it (a REJECT, either side's CANCEL), for the metrics.
            let ending = session.ending(self.id).map(|e| e.code());
            let closed = self
                .shared
                .budget
                .with_tracker(|credit| session.close_stream(self.id, credit, Instant::now()));
            (closed, session.has_control_frames(), window, ending)
        };
        self.shared.budget.wake();
        // A stream closed while undecided frees its place among the undecided.
        self.connection.decision_slot_freed.notify_waiters();
        if topped_up {
            // Closing topped up the peer's early credit: the control stream sends it.
            self.connection.control_queued.notify_one();
        }
        self.shared.metrics.window_reached(window);
        self.connection.metrics.window_reached(window);
        for metrics in [&self.shared.metrics, &self.connection.metrics] {
            match closed {
                StreamClosed::Completed => metrics.completed(self.started.elapsed()),
                _ => metrics.failed(ending.or_else(|| error.and_then(TransportError::code))),
            }
        }
        if let StreamClosed::Flood(flood) = closed {
            let reason: &[u8] = if flood.code == ErrorCode::PROGRESS_TIMEOUT {
                b"too many streams made no progress"
            } else {
                b"too many failed, cancelled or refused streams"
            };
            warn!(
                burst = flood.burst,
                window = ?flood.window,
                code = %flood.code,
                "closing connection: {}",
                String::from_utf8_lossy(reason)
            );
            self.connection.close(flood.code, reason);
        }
    }

    /// Keeps the stream (and so the connection) until the peer has our last frame, such as
    /// COMPLETE, and has finished its half; credit and the outcome were settled by `end`
    /// already. The connection keeps it, so this task ends now; once the connection's loop
    /// has ended, this task waits instead.
    async fn linger(self) {
        // The sender finishes its half on our last frame; its FIN can come after its
        // acknowledgement of that frame. Dropped before the FIN, the stream would be stopped:
        // one more datagram and wake-up per tensor for the sender, which acknowledges the
        // STOP_SENDING at once, and that acknowledgement can again overtake the next
        // tensor's FIN (a third of 4 KiB tensors on a 16-core host).
        let token = self.shared.streams.token();
        if let Some(mut stream) = self.connection.keep_until_closed(self.stream, token) {
            stream.delivered_and_finished(CLOSE_GRACE).await;
        }
    }
}
