//! One tensor's stream: METADATA, DATA within credit, END, and the receiver's answer.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use quinn::VarInt;
use tensorwire_proto::{
    ErrorCode, Limits, OutgoingEvent, Receipt, StreamId, TensorMeta, TensorSender,
};
use tokio_util::sync::CancellationToken;
use tracing::debug;

use super::report::{SendReport, SendWaits, timed};
use crate::error::TransportError;
use crate::metrics::Metrics;
use crate::session::{ConnectionSession, Turn, until};
use crate::source::Source;
use crate::source::SourceReader;
use crate::stream::FrameStream;

/// Whether a tensor's DATA waits its turn on the connection
/// ([`ConnectionSession::take_turn`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Sharing {
    /// A tensor of more than one DATA frame waits for the large tensors before it on the
    /// connection to be done with the turn (spec §7.4); a smaller one goes at once.
    InTurn,
    /// At once, beside the others: the parts of a split tensor (spec §15). A part waiting
    /// behind a whole tensor that waits for memory at the receiver, memory held by the
    /// part's own parent, would wait until that tensor's admission timed out.
    Alongside,
}

/// The parts of [`SenderConfig`](crate::SenderConfig) each send uses.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SendOptions {
    pub(crate) progress_timeout: Duration,
    pub(crate) chunk_size: u64,
}

#[allow(clippy::too_many_arguments)] // One send's parts, passed once from `send`.
pub(crate) async fn send_tensor(
    connection: quinn::Connection,
    session: ConnectionSession,
    meta: TensorMeta,
    source: Source,
    sent: &AtomicU64,
    cancel: Option<&CancellationToken>,
    metrics: Arc<Metrics>,
    options: SendOptions,
    sharing: Sharing,
) -> Result<SendReport, TransportError> {
    let mut count = CountedSend::start(metrics);
    let started = count.started;
    let total = meta.byte_len();
    let mut waited = SendWaits::default();
    let result = async {
        // Built before the stream is opened: building checks the metadata fits the wire.
        let machine = TensorSender::new(meta)?;
        let turn = if sharing == Sharing::InTurn && total > options.chunk_size {
            let turn = async { Ok(Some(session.take_turn().await)) };
            timed(&mut waited.turn, unless_cancelled(cancel, turn)).await?
        } else {
            None
        };
        // Opened once the tensor's turn has come, not while it queues (a file's pages would
        // be read long before they are sent): its first batches are checksummed while
        // METADATA waits for credit.
        let chunk_len = usize::try_from(options.chunk_size).unwrap_or(usize::MAX);
        let reader = SourceReader::open(source, total, chunk_len).await?;
        // The receiver's stream limit (QUIC's MAX_STREAMS) can hold the open.
        let (send, recv) = timed(&mut waited.receiver, connection.open_bi()).await?;
        let id = VarInt::from(send.id()).into_inner();
        session
            .lock()
            .start_sending(id, machine, Instant::now(), options.progress_timeout)?;
        let mut tensor = OutgoingTensor {
            id,
            session: session.clone(),
            stream: FrameStream::new(send, recv, Limits::default()),
            settled: false,
            turn,
        };
        let outcome = tensor
            .drive(
                &connection,
                reader,
                total,
                sent,
                cancel,
                options,
                &mut waited,
            )
            .await;
        let outcome = match outcome {
            Err(e) => Err(tensor.explain_stop(e).await),
            ok => ok,
        };
        let code = outcome
            .as_ref()
            .err()
            .map(|e| e.code().unwrap_or(ErrorCode::INTERNAL));
        if let Some(code) = code {
            let reason = outcome
                .as_ref()
                .err()
                .map(ToString::to_string)
                .unwrap_or_default();
            session.lock().cancel(id, code, reason);
            let _ = tensor.flush().await;
        }
        let bytes = tensor.settle();
        tensor.stream.close(code);
        if code.is_some() {
            // Our CANCEL must reach the receiver before the application closes the connection,
            // which would discard it.
            tensor.stream.delivered(CANCEL_GRACE).await;
        }
        count.metrics.add_bytes(bytes);
        outcome.map(|receipt| (bytes, receipt))
    }
    .await;
    count.finish(result.as_ref().map(drop).map_err(TransportError::code));
    debug!(ok = result.is_ok(), elapsed = ?started.elapsed(), "send finished");
    result.map(|(bytes, receipt)| SendReport {
        bytes,
        elapsed: started.elapsed(),
        waited,
        receipt,
    })
}

/// One send in a sender's metrics: started when made, failed if dropped unfinished (a send
/// future dropped midway).
pub(crate) struct CountedSend {
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) started: Instant,
    pub(crate) finished: bool,
}

impl CountedSend {
    pub(crate) fn start(metrics: Arc<Metrics>) -> Self {
        metrics.started();
        Self {
            metrics,
            started: Instant::now(),
            finished: false,
        }
    }

    /// Counts the outcome: completed, or failed with the code where one is known.
    pub(crate) fn finish(&mut self, outcome: Result<(), Option<ErrorCode>>) {
        match outcome {
            Ok(()) => self.metrics.completed(self.started.elapsed()),
            Err(code) => self.metrics.failed(code),
        }
        self.finished = true;
    }
}

impl Drop for CountedSend {
    fn drop(&mut self) {
        if !self.finished {
            self.metrics.failed(Some(ErrorCode::CANCELLED));
        }
    }
}

/// How long a stopped stream is read for the CANCEL or REJECT that explains the stop.
pub(crate) const STOP_EXPLAINED_WITHIN: Duration = Duration::from_secs(1);

/// How long a failed tensor waits for its CANCEL to be acknowledged before giving up.
pub(crate) const CANCEL_GRACE: Duration = Duration::from_secs(2);

/// One tensor we send: its stream, pumped through the connection's session.
pub(crate) struct OutgoingTensor {
    pub(crate) id: StreamId,
    pub(crate) session: ConnectionSession,
    pub(crate) stream: FrameStream,
    /// Whether the session let go of the stream; if not when dropped (a send future dropped
    /// midway), the tensor is cancelled.
    pub(crate) settled: bool,
    /// The connection's turn for large tensors' DATA, while this one holds it.
    pub(crate) turn: Option<Turn>,
}

impl Drop for OutgoingTensor {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        self.session
            .lock()
            .cancel(self.id, ErrorCode::CANCELLED, "the sender dropped the send");
        self.settle();
        self.stream.abandon(ErrorCode::CANCELLED);
    }
}

impl OutgoingTensor {
    /// Has the session let go of the stream; returns the payload bytes sent on it.
    pub(crate) fn settle(&mut self) -> u64 {
        let mut session = self.session.lock();
        let bytes = session.sent(self.id);
        let _ = session.close_outgoing(self.id, Instant::now());
        self.settled = true;
        bytes
    }

    /// Sends METADATA, then DATA as credit allows, then END; returns on COMPLETE. Gives up
    /// the connection's turn (if held) once the session says it is done with it (spec §7.4),
    /// or once all its DATA is QUIC's. Adds what it waited for to `waited`.
    ///
    /// The progress timeout counts time without progress, not silence: while the receiver has
    /// nothing to say (all credit granted, bytes still crossing a slow path), our data being
    /// sent and resent shows that the transfer moves.
    #[allow(clippy::too_many_arguments)] // One send's parts, passed once from `send_tensor`.
    pub(crate) async fn drive(
        &mut self,
        connection: &quinn::Connection,
        mut reader: SourceReader,
        total: u64,
        sent: &AtomicU64,
        cancel: Option<&CancellationToken>,
        options: SendOptions,
        waited: &mut SendWaits,
    ) -> Result<Receipt, TransportError> {
        let chunk_size = options.chunk_size;
        let id = self.id;
        // Read once: quinn locks the connection's state for it, which its driver holds while
        // it builds packets, and the session judges turns by the smallest round trip given.
        let rtt_at_start = connection.rtt();
        loop {
            loop {
                let (allowed, done, turn_done) = {
                    let mut session = self.session.lock();
                    let turn_done =
                        self.turn.is_some() && session.turn_done(id, Instant::now(), rtt_at_start);
                    (session.next_chunk_len(id), session.sent(id), turn_done)
                };
                if turn_done {
                    // Spec §7.4: the next large tensor's METADATA and admission round trip
                    // overlap our last bytes, rather than follow them.
                    self.turn = None;
                }
                if allowed == 0 || done >= total {
                    break;
                }
                let max = allowed.min(total - done).min(chunk_size);
                // Checksummed already, batches ahead and off this task (which shares its
                // thread with the connection's driver): the session, shared by every stream
                // of the connection, is locked only to queue it.
                let chunk = timed(
                    &mut waited.source,
                    reader.next(usize::try_from(max).unwrap_or(usize::MAX)),
                )
                .await?;
                if chunk.is_empty() {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!("source ended after {done} of {total} bytes"),
                    )
                    .into());
                }
                let len = chunk.len() as u64;
                self.session.lock().send_checked(id, chunk)?;
                if done + len == total {
                    // The last DATA goes out with END, in the write below.
                    sent.store(total, Ordering::Relaxed);
                    break;
                }
                timed(
                    &mut waited.transport,
                    unless_cancelled(cancel, self.flush()),
                )
                .await?;
                sent.store(done + len, Ordering::Relaxed);
            }
            let all_queued = {
                let mut session = self.session.lock();
                let all_queued = session.sent(id) == total;
                if all_queued && session.is_sending(id) {
                    session.finish(id)?;
                }
                all_queued
            };
            // Our half stays open after END, so that a CANCEL can still follow it (spec §4).
            timed(&mut waited.transport, self.flush()).await?;
            if all_queued {
                // The next large tensor's METADATA and admission overlap our last DATA in
                // QUIC's send buffer and our wait for COMPLETE.
                self.turn = None;
            }
            let reply = next_reply(&mut self.stream, connection, &self.session, id);
            let frame = timed(&mut waited.receiver, unless_cancelled(cancel, reply)).await?;
            let reply = self
                .session
                .lock()
                .handle_reply(id, frame, Instant::now())?;
            if let OutgoingEvent::Complete(receipt) = reply {
                // The receiver's FIN comes with COMPLETE.
                self.stream.read_fin_if_arrived();
                return Ok(receipt);
            }
        }
    }

    /// Writes what the session queued for this stream.
    pub(crate) async fn flush(&mut self) -> Result<(), TransportError> {
        self.session.flush(self.id, &mut self.stream).await
    }

    /// When the receiver stopped the stream, its CANCEL or REJECT says why
    /// ([`FrameStream::explain_stop`]), unless the tensor already ended otherwise.
    pub(crate) async fn explain_stop(&mut self, error: TransportError) -> TransportError {
        if self.session.lock().ending(self.id).is_some() {
            return error;
        }
        let (session, id) = (&self.session, self.id);
        self.stream
            .explain_stop(error, STOP_EXPLAINED_WITHIN, |frame| {
                session
                    .lock()
                    .handle_reply(id, frame, Instant::now())
                    .map(drop)
            })
            .await
    }
}

/// `future`'s output, or CANCELLED once `cancel` (if any) is cancelled. `future` is polled
/// first: no random draw per poll, and an outcome that is in wins.
pub(crate) async fn unless_cancelled<T>(
    cancel: Option<&CancellationToken>,
    future: impl Future<Output = Result<T, TransportError>>,
) -> Result<T, TransportError> {
    tokio::select! {
        biased;
        out = future => out,
        () = cancelled(cancel) => Err(TransportError::cancelled_by("sending")),
    }
}

/// Resolves once `cancel` (if any) is cancelled.
pub(crate) async fn cancelled(cancel: Option<&CancellationToken>) {
    match cancel {
        Some(cancel) => cancel.cancelled().await,
        None => std::future::pending().await,
    }
}

/// The receiver's next frame on our stream `id`, or PROGRESS_TIMEOUT once the session says
/// its answer is overdue (spec §10.1). The session is told when our bytes move: once here,
/// as they were just handed to QUIC, and again at a deadline if QUIC has sent or resent any
/// STREAM frame on the connection since (our data still crossing the path). Keep-alives and
/// their acknowledgements are not progress.
pub(crate) async fn next_reply(
    stream: &mut FrameStream,
    connection: &quinn::Connection,
    session: &ConnectionSession,
    id: StreamId,
) -> Result<tensorwire_proto::Frame, TransportError> {
    // A reply that came with the last one (COMPLETE with ACCEPT) needs no timer.
    if let Some(frame) = stream.buffered_frame()? {
        return Ok(frame);
    }
    let next = stream.next_frame();
    tokio::pin!(next);
    let mut sent = connection.stats().frame_tx.stream;
    let mut deadline = {
        let mut session = session.lock();
        session.data_moved(id, Instant::now());
        session.stream_deadline(id)
    };
    loop {
        if let Some(frame) = until(deadline, &mut next).await {
            return frame;
        }
        let (now, sent_now) = (Instant::now(), connection.stats().frame_tx.stream);
        let mut session = session.lock();
        if sent_now != sent {
            sent = sent_now;
            session.data_moved(id, now);
        } else if let Some(overdue) = session.handle_stream_timeout(id, now) {
            return Err(overdue.into());
        }
        deadline = session.stream_deadline(id);
    }
}
