//! One tensor's stream, from METADATA to COMPLETE: the driver reads frames, hands them to the
//! connection's [`Session`](tensorwire_proto::Session), writes what it queues, and moves DATA
//! into the sink. Every protocol decision (credit, limits, budgets) is the session's.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use tensorwire_proto::frame::Data;
use tensorwire_proto::{
    CheckedFrame, ErrorCode, Frame, GrantClock, IncomingEvent, ProtocolError, StreamClosed,
    StreamId, TensorMeta,
};
use tensorwire_sink::{CreditPermit, MemoryReservation, Sink, SinkError};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::incoming::{DECISION_GRACE, Decision, Ended, IncomingTensor, Run};
use super::offload::{Checksums, OnStored, Receiving, Stores};
use super::state::ConnectionState;
use super::{CLOSE_GRACE, Shared};
use crate::error::TransportError;
use crate::stream::FrameStream;

/// One tensor's stream, handed to the sink-specific receive loop once accepted.
pub(super) struct Accepted {
    id: StreamId,
    ended: Ended,
    shared: Arc<Shared>,
    connection: Arc<ConnectionState>,
    stream: FrameStream,
    started: Instant,
    /// Bytes of this tensor held and not yet made durable (by the sink, or here).
    pending: Arc<AtomicU64>,
    /// DATA of a tensor sent early that arrived before the decision, with its credit: handed
    /// to the sink on ACCEPT, dropped (the credit returning) otherwise (spec §7.6).
    early: Vec<(Data, CreditPermit)>,
    /// Whether the early tensor's END arrived (and was verified) before the decision.
    early_ended: bool,
    /// Counts the connection as carrying a large tensor, from its first large payload.
    receiving: Option<Receiving>,
    /// Its METADATA's bytes in the receiver's METADATA budget, for as long as the stream
    /// lives (spec §10): many live streams with large METADATA are memory a peer holds.
    metadata: Option<MemoryReservation>,
}

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

/// `future`, unless `deadline` (the session's, spec §10.1) passes first: `None` then.
async fn until<T>(deadline: Option<Instant>, future: impl Future<Output = T>) -> Option<T> {
    match deadline {
        Some(deadline) => tokio::time::timeout_at(deadline.into(), future).await.ok(),
        None => Some(future.await),
    }
}

/// A wait with no deadline, as a tokio deadline: 30 years.
const NEVER: std::time::Duration = std::time::Duration::from_secs(30 * 365 * 86400);

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
        match self.expired_now() {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    fn expired_now(&self) -> Option<ProtocolError> {
        let mut session = self.connection.session();
        session.handle_stream_timeout(self.id, Instant::now())
    }

    /// The admission wait ran past its deadline and grace: the session's PROGRESS_TIMEOUT.
    fn expired(&self) -> TransportError {
        self.expired_now()
            .unwrap_or(ProtocolError::Misuse(
                "the admission wait ended before its deadline",
            ))
            .into()
    }

    /// Reads METADATA and asks the application; `None` if the tensor was rejected.
    ///
    /// While the tensor waits (for a slot in the connection's share of the queue, then for the
    /// decision) the stream is still read: a CANCEL, a reset or a FIN ends it at once, so
    /// waiting tensors cannot pile up behind a peer that gave up on them.
    async fn admit(
        &mut self,
        tx: mpsc::Sender<IncomingTensor>,
    ) -> Result<Option<Run>, TransportError> {
        let shared = self.shared.clone();
        let config = &shared.config;
        let meta = loop {
            let deadline = self.connection.session().stream_deadline(self.id);
            let Some(frame) = until(deadline, self.stream.next_frame()).await else {
                self.timed_out()?;
                continue;
            };
            let frame = frame?;
            match self.handle(frame)? {
                IncomingEvent::Metadata(meta) => break meta,
                // Spec §7.6: EARLY comes first; METADATA follows.
                IncomingEvent::Early => continue,
                _ => return Err(ProtocolError::Misuse("first event was not METADATA").into()),
            }
        };
        debug!(name = meta.name(), bytes = meta.byte_len(), dtype = %meta.dtype(), "metadata");
        let connection = self.connection.clone();
        // Held while the stream lives: METADATA on many streams, decided or not, is memory
        // a peer makes the receiver hold (spec §10).
        let reserved = connection
            .metadata_share
            .try_reserve(metadata_bytes(&meta))
            .map_err(|e| ProtocolError::Local {
                code: ErrorCode::RESOURCE_EXHAUSTED,
                reason: format!("METADATA of the streams open now: {}", e.message),
            })?;
        self.metadata = Some(reserved);
        // Spec §10.1: the session says when the decision is due.
        let deadline = match self.connection.session().stream_deadline(self.id) {
            Some(deadline) => tokio::time::Instant::from_std(deadline),
            None => tokio::time::Instant::now() + NEVER,
        };
        // Kept here, not in the wait, so it outlives the recording of why the wait ended.
        let (decision, mut decided) = oneshot::channel();
        let mut decision = Some(decision);
        let waited = tokio::time::timeout_at(deadline + DECISION_GRACE, async {
            // Spec §10: the connection's share of the admission queue; more wait here.
            loop {
                // Armed before asking, so a slot freed in between is not missed.
                let freed = connection.decision_slot_freed.notified();
                if connection.session().offer(self.id) {
                    break;
                }
                self.while_reading(freed).await?;
            }
            let incoming = IncomingTensor {
                meta,
                peer: connection.connection.remote_address(),
                decision: decision
                    .take()
                    .ok_or(ProtocolError::Misuse("decision taken twice"))?,
                ended: self.ended.clone(),
                connection: connection.connection.clone(),
                session: connection.session.clone(),
                // This stream's task runs on its connection's runtime.
                runtime: tokio::runtime::Handle::current(),
                host_memory: shared.host_memory.clone(),
                memory_shares: connection.memory_shares.clone(),
                carrier: connection.carrier.clone(),
                deadline,
                admission_timeout: config.session.admission_timeout,
            };
            match shared.admission.get() {
                // Decided here, on this task: no hand-off before ACCEPT.
                Some(policy) => policy(incoming),
                None => {
                    if self.while_reading(tx.send(incoming)).await?.is_err() {
                        return Ok(None);
                    }
                }
            }
            self.while_reading(&mut decided).await.map(|d| Some(d.ok()))
        })
        .await;
        let waited = match waited {
            Err(_) => Err(self.expired()),
            Ok(waited) => waited,
        };
        if let Err(e) = &waited {
            let _ = self.ended.set(match e {
                TransportError::Protocol(e) => e.clone(),
                other => ProtocolError::Local {
                    code: other.code().unwrap_or(ErrorCode::INTERNAL),
                    reason: other.to_string(),
                },
            });
        }
        drop(decided);
        let id = self.id;
        let decided = match waited? {
            None => {
                let mut session = self.connection.session();
                session.reject(id, ErrorCode::SHUTDOWN, "receiver is shutting down")?;
                Ok(None)
            }
            Some(Some(Decision::Accept(run))) => Ok(Some(run)),
            Some(Some(Decision::Reject(code, reason))) => {
                self.connection.session().reject(id, code, reason)?;
                Ok(None)
            }
            Some(None) => {
                self.connection.session().reject(
                    id,
                    ErrorCode::REJECTED,
                    "the application dropped the tensor undecided",
                )?;
                Ok(None)
            }
        };
        // A refusal freed this tensor's place among the undecided.
        self.connection.decision_slot_freed.notify_waiters();
        decided
    }

    /// Awaits `wait` while reading the stream. Before ACCEPT, a tensor sent early keeps its
    /// DATA (with its credit) and notes its END (spec §7.6); any other frame (a CANCEL, DATA
    /// without credit), a reset or a FIN ends the tensor with the matching error.
    async fn while_reading<T>(
        &mut self,
        wait: impl Future<Output = T>,
    ) -> Result<T, TransportError> {
        tokio::pin!(wait);
        loop {
            // Frames that came with METADATA (a tensor sent early and whole) are handled
            // before the wait: the decision then finds END, and ACCEPT leaves with COMPLETE
            // in one write.
            let frame = match self.stream.buffered_frame()? {
                Some(frame) => Some(frame),
                // After END only a CANCEL, a reset or the sender's FIN can come (spec §4). A
                // frame that is in goes first, so a decision cannot overtake a CANCEL that
                // arrived with it; before ACCEPT the early allowance bounds what can come.
                None => tokio::select! {
                    biased;
                    frame = self.stream.next_frame_or_fin() => frame?,
                    out = &mut wait => return Ok(out),
                },
            };
            let Some(frame) = frame else {
                if self.early_ended {
                    return Ok(wait.await);
                }
                return Err(ProtocolError::Remote {
                    code: ErrorCode::TRUNCATED_FRAME,
                    reason: "peer ended the stream before its last frame".into(),
                }
                .into());
            };
            match self.handle(frame)? {
                IncomingEvent::Data(data) => {
                    let n = data.payload.len() as u64;
                    let permit =
                        CreditPermit::new(n, self.shared.budget.clone(), self.pending.clone());
                    self.early.push((data, permit));
                }
                IncomingEvent::End => self.early_ended = true,
                _ => {
                    return Err(ProtocolError::Misuse("a frame was accepted before ACCEPT").into());
                }
            }
        }
    }

    pub(super) async fn receive_into<S: Sink>(
        mut self,
        sink: S,
        done: oneshot::Sender<Result<S::Output, TransportError>>,
        progress: Arc<AtomicU64>,
        cancel: CancellationToken,
    ) {
        let result = tokio::select! {
            // A tensor that completes at its first poll never registers for the cancel.
            biased;
            result = self.receive_loop(sink, progress) => result,
            _ = cancel.cancelled() => Err(TransportError::cancelled_by("receiving")),
        };
        // The connection carries this tensor no longer.
        self.receiving = None;
        let result = match result {
            Err(e) => Err(self.explain_stop(e).await),
            Ok(output) => {
                // COMPLETE is written: the connection's driver, which shares this thread,
                // sends it before the bookkeeping below (the stream's close, the session's
                // ledger, metrics), which would otherwise delay every small tensor's reply.
                tokio::task::yield_now().await;
                Ok(output)
            }
        };
        self.end(result.as_ref().err()).await;
        // The application hears now; the stream is kept below until the peer has our last
        // frame, which takes a round trip and the peer's ACK delay (tens of ms).
        let _ = done.send(result);
        self.linger().await;
    }

    async fn receive_loop<S: Sink>(
        &mut self,
        mut sink: S,
        progress: Arc<AtomicU64>,
    ) -> Result<S::Output, TransportError> {
        let shared = self.shared.clone();
        let connection = self.connection.clone();
        let pending = self.pending.clone();
        self.connection.session().accept(self.id, Instant::now())?;
        self.connection.decision_slot_freed.notify_waiters();
        if !self.early_ended {
            // A tensor whose every byte arrived early sends ACCEPT with COMPLETE, in one write.
            self.flush().await?;
        }
        let stored_early = !self.early.is_empty();
        for (data, permit) in std::mem::take(&mut self.early) {
            let n = data.payload.len() as u64;
            sink.write(data.offset, data.payload, permit).await?;
            Self::count_stored(&connection, &shared, &progress, n);
        }
        if self.early_ended {
            return self.complete(sink, &pending).await;
        }
        // Early DATA was checksummed as it came; the rest may be left to the landed tensor.
        let checksums = if !stored_early && sink.take_checksum() {
            Checksums::OfLandedBytes
        } else {
            Checksums::PerPayload
        };
        let mut stores = Stores::Here(sink);
        // Whether the sink stored bytes since it was last flushed.
        let mut stored_since_flush = stored_early;
        loop {
            // Armed before asking, so a release between the two is not missed.
            let returned = shared.budget.credit_returned();
            let window_opened = connection.window_opened.notified();
            // The receiver-wide tracker is locked only when a grant is due (once per grant
            // unit), not for every DATA. Granting nothing leaves the want unchanged.
            let (granted, wants_more, out_of_credit, deadline) = {
                let mut session = self.connection.session();
                let wants = session.wants_credit(self.id);
                let granted = if wants {
                    // Spec §7.1: the window grows by the arrival rate over the path's RTT.
                    let clock = GrantClock {
                        now: Instant::now(),
                        rtt: self.connection.connection.rtt(),
                    };
                    shared
                        .budget
                        .with_tracker(|credit| session.grant(self.id, credit, clock))
                } else {
                    0
                };
                // Asked only when nothing was granted: one lookup less per DATA.
                let out_of_credit = wants && granted == 0 && session.out_of_credit(self.id);
                // Spec §10.1: how long the next frame may take, while the peer owes one.
                let deadline = if granted == 0 {
                    session.stream_deadline(self.id)
                } else {
                    None
                };
                (granted, wants, out_of_credit, deadline)
            };
            if granted > 0 {
                self.flush().await?;
                continue;
            }
            // Spec §7.1: no bytes of this tensor arrive until credit comes back, and what its
            // sink holds back may be what keeps the budget from coming back.
            if out_of_credit && stored_since_flush {
                stores.flush().await?;
                stored_since_flush = false;
            }
            tokio::select! {
                biased;
                () = returned, if wants_more => {}
                () = window_opened, if wants_more => {}
                failure = stores.failed() => return Err(failure),
                frame = until(deadline, self.stream.next_frame()) => {
                    let Some(frame) = frame else {
                        self.timed_out()?;
                        continue;
                    };
                    let frame = frame?;
                    if matches!(frame, Frame::End(_)) {
                        // END is checked against every payload's CRC: all stored first.
                        let mut sink = stores.into_sink().await?;
                        return match self.handle_checksum_later(frame, checksums)? {
                            IncomingEvent::End => {
                                if checksums == Checksums::OfLandedBytes {
                                    self.verify_landed(&mut sink).await?;
                                }
                                self.complete(sink, &pending).await
                            }
                            _ => Err(ProtocolError::Misuse("END handled as another frame").into()),
                        };
                    }
                    match self.handle_checksum_later(frame, checksums)? {
                        IncomingEvent::Data(data) => {
                            let n = data.payload.len() as u64;
                            let permit = CreditPermit::new(n, shared.budget.clone(), pending.clone());
                            let on_stored = || Self::on_stored_elsewhere(&connection, &shared, self.id, &progress);
                            stores = stores.for_payload(data.payload.len(), &shared.offload, &connection.load, &mut self.receiving, checksums, on_stored).await?;
                            stored_since_flush = true;
                            match &mut stores {
                                Stores::OffThread(off_thread) => off_thread.store(data, permit).await?,
                                Stores::Here(sink) => {
                                    let crc = checksums.store(sink, data, permit).await?;
                                    Self::stored(&connection, &shared, self.id, &progress, crc, n)?;
                                }
                            }
                        }
                        _ => return Err(ProtocolError::Misuse("second METADATA event").into()),
                    }
                }
            }
        }
    }

    /// Every byte arrived: the sink checksums the landed tensor, which must match END's
    /// checksum (spec §7.3). A mismatch fails the tensor with CHECKSUM_MISMATCH.
    async fn verify_landed<S: Sink>(&mut self, sink: &mut S) -> Result<(), TransportError> {
        let crc = self.finish_watching(sink.landed_checksum()).await??;
        self.connection.session().verify_landed_crc(self.id, crc)?;
        Ok(())
    }

    /// Every byte arrived and matched END's checksum: finishes the sink, then sends COMPLETE.
    async fn complete<S: Sink>(
        &mut self,
        sink: S,
        pending: &AtomicU64,
    ) -> Result<S::Output, TransportError> {
        let output = self.finish_watching(sink.finish()).await??;
        let left = pending.load(Ordering::Acquire);
        if left != 0 {
            return Err(
                SinkError::failed(format!("sink finished with {left} bytes not durable")).into(),
            );
        }
        // Spec §6.8: COMPLETE only now, with every byte verified and durable.
        self.connection.session().mark_resident(self.id)?;
        self.flush().await?;
        // COMPLETE is our half's last frame: its FIN goes in the same packet.
        self.stream.finish();
        Ok(output)
    }

    /// Awaits the sink after END while the sender may still CANCEL or reset; its FIN right
    /// after END is legal (spec §4) and ends only the watching.
    async fn finish_watching<T>(
        &mut self,
        finish: impl Future<Output = T>,
    ) -> Result<T, TransportError> {
        tokio::pin!(finish);
        tokio::select! {
            // A sink that finishes at once (host memory) needs no read of the stream.
            biased;
            out = &mut finish => return Ok(out),
            frame = self.stream.next_frame_or_fin() => match frame? {
                None => {}
                Some(frame) => {
                    return Err(match self.handle(frame) {
                        Err(e) => e.into(),
                        Ok(_) => ProtocolError::Misuse("frame accepted after END").into(),
                    });
                }
            },
        }
        Ok(finish.await)
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
        let (closed, topped_up, window) = {
            let mut session = self.connection.session();
            let window = session.stream_window(self.id).unwrap_or(0);
            let closed = self
                .shared
                .budget
                .with_tracker(|credit| session.close_stream(self.id, credit, Instant::now()));
            (closed, session.has_control_frames(), window)
        };
        self.shared.budget.wake();
        // A stream closed while undecided frees its place among the undecided.
        self.connection.decision_slot_freed.notify_waiters();
        if topped_up {
            // Closing topped up the peer's early credit: the control stream sends it.
            self.connection.control_queued.notify_one();
        }
        let ok = closed == StreamClosed::Completed;
        let elapsed = self.started.elapsed();
        self.shared.metrics.window_reached(window);
        self.connection.metrics.window_reached(window);
        self.shared.metrics.finished(ok, elapsed);
        self.connection.metrics.finished(ok, elapsed);
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

/// About what a tensor's METADATA holds in memory: its name, shape and attributes, and a
/// little for the rest.
fn metadata_bytes(meta: &TensorMeta) -> u64 {
    let attributes: usize = meta
        .attributes()
        .iter()
        .map(|(key, value)| 48 + key.len() + value.len())
        .sum();
    (64 + meta.name().len() + 8 * meta.shape().len() + attributes) as u64
}
