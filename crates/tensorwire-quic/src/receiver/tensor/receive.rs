//! Receiving an accepted tensor: credit granted as the session allows, DATA stored into the
//! sink (here or off this thread), END verified, COMPLETE once the sink made it durable
//! (spec §7).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use tensorwire_proto::{Frame, GrantClock, IncomingEvent, ProtocolError};
use tensorwire_sink::{CreditPermit, Sink, SinkError};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use super::super::offload::{Checksums, Stores};
use super::Accepted;
use crate::error::TransportError;
use crate::session::until;

impl Accepted {
    pub(in crate::receiver) async fn receive_into<S: Sink>(
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
        // Spec §6.8: COMPLETE only now, with every byte verified and durable, saying what
        // the sink made of the tensor.
        let receipt = S::receipt(&output);
        self.connection.session().mark_resident(self.id, receipt)?;
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
}
