//! Admission: a tensor's stream from its first frame to the application's decision. The
//! stream is read all the while, so a peer that gives up is heard at once (spec §10).

use std::future::Future;

use tensorwire_proto::{ErrorCode, IncomingEvent, ProtocolError, TensorMeta};
use tensorwire_sink::CreditPermit;
use tokio::sync::{mpsc, oneshot};
use tracing::debug;

use super::super::incoming::{Decision, IncomingTensor, Run};
use super::Accepted;
use crate::error::TransportError;
use crate::session::until;

/// A wait with no deadline, as a tokio deadline: 30 years.
const NEVER: std::time::Duration = std::time::Duration::from_secs(30 * 365 * 86400);

impl Accepted {
    /// Reads METADATA and asks the application; `None` if the tensor was rejected.
    ///
    /// While the tensor waits (for a slot in the connection's share of the queue, then for the
    /// decision) the stream is still read: a CANCEL, a reset or a FIN ends it at once, so
    /// waiting tensors cannot pile up behind a peer that gave up on them.
    pub(super) async fn admit(
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
        // Spec §10.1: the session says when the decision is due (memory waits end then), and
        // when the stream is refused without one (a grace later).
        let (due, refused_at) = {
            let session = self.connection.session();
            (
                session.decision_due(self.id),
                session.stream_deadline(self.id),
            )
        };
        let never = || tokio::time::Instant::now() + NEVER;
        let deadline = due.map_or_else(never, tokio::time::Instant::from_std);
        let refused_at = refused_at.map_or_else(never, tokio::time::Instant::from_std);
        // Kept here, not in the wait, so it outlives the recording of why the wait ended.
        let (decision, mut decided) = oneshot::channel();
        let mut decision = Some(decision);
        let waited = tokio::time::timeout_at(refused_at, async {
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
                binding: connection.binding,
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
            // Past the deadline and its grace: the session's PROGRESS_TIMEOUT.
            Err(_) => self.timed_out().and(Err(ProtocolError::Misuse(
                "the admission wait ended before its deadline",
            )
            .into())),
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
