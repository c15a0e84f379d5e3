//! The receiving side of one connection, without IO or clock: every tensor the peer sends
//! on it, the credit they are granted against the receiver-wide [`CreditTracker`], and the
//! connection's abuse budgets (spec §7, §10).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::credit::CreditTracker;
use crate::error::{ErrorCode, ProtocolError};
use crate::flood::{FloodBudget, FloodExceeded};
use crate::frame::{Data, Frame};
use crate::limits::Limits;
use crate::meta::TensorMeta;
use crate::receiver::{ReceiverEvent, ReceiverState, TensorReceiver};

/// A tensor's stream on its connection: the QUIC stream ID, or any number unique among the
/// connection's open streams.
pub type StreamId = u64;

/// The receiver's policy for one connection.
#[derive(Clone, Debug)]
pub struct SessionConfig {
    /// Limits checked on every frame (spec §8).
    pub limits: Limits,
    /// Bytes granted to a tensor in one CREDIT.
    pub grant_unit: u64,
    /// Most credit one tensor may hold granted and not yet arrived, so one tensor cannot
    /// take the whole budget.
    pub stream_window: u64,
    /// Failed, cancelled, reset or refused streams allowed at once (spec §10) ...
    pub max_failed_streams: u32,
    /// ... refilled at `max_failed_streams` per this window.
    pub failure_window: Duration,
}

impl Default for SessionConfig {
    /// The reference implementation's policy: 4 MiB grants, a 16 MiB window, 1000 failed
    /// streams per 10 s.
    fn default() -> Self {
        Self {
            limits: Limits::default(),
            grant_unit: 4 << 20,
            stream_window: 16 << 20,
            max_failed_streams: 1000,
            failure_window: Duration::from_secs(10),
        }
    }
}

/// What a frame from the peer meant, for the driver to act on.
#[derive(Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SessionEvent {
    /// METADATA arrived: admit with [`Session::accept`] or refuse with [`Session::reject`].
    Metadata(TensorMeta),
    /// Verified DATA, its bytes counted as held in the credit tracker: hand it to the sink,
    /// and release the bytes to the tracker once the sink made them durable.
    Data(Data),
    /// Every byte arrived and the checksum matched: finish the sink, then
    /// [`Session::mark_resident`].
    End,
}

/// How a stream ended, as [`Session::close_stream`] counted it.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a flood closes the connection"]
pub enum StreamClosed {
    /// COMPLETE was queued: the tensor landed.
    Completed,
    /// It failed, was cancelled or refused; the connection's budget still allows more.
    Failed,
    /// It failed and the connection's failure budget is spent: close the connection with
    /// CANCEL_FLOOD (spec §10).
    Flood(FloodExceeded),
}

/// The receiving side of one connection (spec §7, §10).
///
/// Contract: call [`open_stream`](Self::open_stream) for each stream the peer opens and feed
/// every frame decoded from it to [`handle_frame`](Self::handle_frame); decide each
/// [`SessionEvent::Metadata`] with [`accept`](Self::accept) or [`reject`](Self::reject);
/// ask [`grant`](Self::grant) for credit while [`wants_credit`](Self::wants_credit) (waiting
/// for the tracker to have some when it grants 0); call
/// [`mark_resident`](Self::mark_resident) after [`SessionEvent::End`] once the sink is
/// durable. After every call, send what [`poll_frame`](Self::poll_frame) returns for that
/// stream, in order. When a stream ends, for whatever reason, call
/// [`close_stream`](Self::close_stream): it returns the stream's unreceived credit to the
/// tracker and counts failures against the flood budget. Time is always an argument.
///
/// Credit moves in the tracker only through these calls, so a tensor's own ledger (granted,
/// received) and the receiver-wide one (in flight, held) cannot drift apart.
#[derive(Debug)]
pub struct Session {
    config: SessionConfig,
    tensors: BTreeMap<StreamId, TensorReceiver>,
    failures: FloodBudget,
    /// When the last stream closed, while none is open (the idle timeout counts from it).
    idle_since: Option<Instant>,
}

impl Session {
    /// A session with `config`, idle from `now`.
    pub fn new(config: SessionConfig, now: Instant) -> Self {
        let failures = FloodBudget::new(config.max_failed_streams, config.failure_window);
        Self {
            config,
            tensors: BTreeMap::new(),
            failures,
            idle_since: Some(now),
        }
    }

    /// The peer opened stream `id`.
    pub fn open_stream(&mut self, id: StreamId) -> Result<(), ProtocolError> {
        if self.tensors.contains_key(&id) {
            return Err(ProtocolError::Misuse("stream opened twice"));
        }
        self.tensors
            .insert(id, TensorReceiver::new(self.config.limits.clone()));
        self.idle_since = None;
        Ok(())
    }

    fn tensor(&mut self, id: StreamId) -> Result<&mut TensorReceiver, ProtocolError> {
        self.tensors
            .get_mut(&id)
            .ok_or(ProtocolError::Misuse("no such stream in the session"))
    }

    /// Feeds one frame from stream `id`. DATA is checked against the tensor's credit and
    /// moves its bytes from in flight to held in `credit`, in the same step.
    ///
    /// An error closes the tensor and queues the REJECT or CANCEL that says why (unless the
    /// peer ended it); the driver then calls [`close_stream`](Self::close_stream).
    pub fn handle_frame(
        &mut self,
        id: StreamId,
        frame: Frame,
        credit: &mut CreditTracker,
    ) -> Result<SessionEvent, ProtocolError> {
        let tensor = self.tensor(id)?;
        match tensor.handle_frame(frame)? {
            ReceiverEvent::Metadata => tensor
                .meta()
                .cloned()
                .map(SessionEvent::Metadata)
                .ok_or(ProtocolError::Misuse("METADATA without meta")),
            ReceiverEvent::Data(data) => {
                if let Err(e) = credit.consume(data.payload.len() as u64) {
                    // The tensor's own check passed, so the ledgers disagree: a bug here.
                    let _ = tensor.cancel(ErrorCode::INTERNAL, e.to_string());
                    return Err(e);
                }
                Ok(SessionEvent::Data(data))
            }
            ReceiverEvent::End => Ok(SessionEvent::End),
        }
    }

    /// Admits the tensor on stream `id`; queues ACCEPT.
    pub fn accept(&mut self, id: StreamId) -> Result<(), ProtocolError> {
        self.tensor(id)?.accept()
    }

    /// Refuses the tensor on stream `id`; queues REJECT.
    pub fn reject(
        &mut self,
        id: StreamId,
        code: ErrorCode,
        reason: impl Into<String>,
    ) -> Result<(), ProtocolError> {
        self.tensor(id)?.reject(code, reason)
    }

    /// Ends the tensor on stream `id` from this side (REJECT before ACCEPT, CANCEL after).
    /// A tensor that already ended is left as it is.
    pub fn cancel(&mut self, id: StreamId, code: ErrorCode, reason: impl Into<String>) {
        if let Ok(tensor) = self.tensor(id) {
            let _ = tensor.cancel(code, reason);
        }
    }

    /// Whether the tensor on `id` is accepted and still needs credit its window allows.
    pub fn wants_credit(&self, id: StreamId) -> bool {
        self.tensors.get(&id).is_some_and(|t| self.wanted(t) > 0)
    }

    /// Spec §7.1: what a tensor may be granted now, by its needs, the grant unit and its
    /// window of granted-but-unarrived bytes.
    fn wanted(&self, tensor: &TensorReceiver) -> u64 {
        if tensor.state() != ReceiverState::Receiving {
            return 0;
        }
        let window_left = self
            .config
            .stream_window
            .saturating_sub(tensor.revocable_credit());
        tensor
            .ungranted()
            .min(self.config.grant_unit)
            .min(window_left)
    }

    /// Grants the tensor on `id` what the tracker allows of what it wants; queues CREDIT.
    /// Returns the bytes granted: 0 while the tracker is paused or full (wait for a release)
    /// or when the tensor wants none.
    #[must_use = "granted bytes are sent as CREDIT by flushing poll_frame"]
    pub fn grant(&mut self, id: StreamId, credit: &mut CreditTracker) -> u64 {
        let Some(tensor) = self.tensors.get(&id) else {
            return 0;
        };
        let want = self.wanted(tensor);
        if want == 0 {
            return 0;
        }
        let granted = credit.grant(want);
        let Some(tensor) = self.tensors.get_mut(&id) else {
            return 0;
        };
        let used = tensor.grant(granted);
        // `want` never exceeds what the tensor takes; return any rest all the same.
        let _ = credit.revoke(granted - used);
        used
    }

    /// The sink made every byte of `id` durable: queues COMPLETE (spec §6.8).
    pub fn mark_resident(&mut self, id: StreamId) -> Result<(), ProtocolError> {
        self.tensor(id)?.mark_resident()
    }

    /// The next frame to send on stream `id`.
    pub fn poll_frame(&mut self, id: StreamId) -> Option<Frame> {
        self.tensors.get_mut(&id)?.poll_frame()
    }

    /// The tensor's metadata, once received.
    pub fn meta(&self, id: StreamId) -> Option<&TensorMeta> {
        self.tensors.get(&id)?.meta()
    }

    /// Why the tensor on `id` closed, if it did without completing.
    pub fn ending(&self, id: StreamId) -> Option<&ProtocolError> {
        self.tensors.get(&id)?.ending()
    }

    /// Payload bytes received on `id` so far.
    pub fn received(&self, id: StreamId) -> u64 {
        self.tensors.get(&id).map_or(0, TensorReceiver::received)
    }

    /// Stream `id` is done: its granted, unreceived credit returns to `credit`, and a tensor
    /// that did not complete counts against the connection's failure budget at `now`.
    /// Frames still queued for it are dropped: flush [`poll_frame`](Self::poll_frame) first.
    pub fn close_stream(
        &mut self,
        id: StreamId,
        credit: &mut CreditTracker,
        now: Instant,
    ) -> StreamClosed {
        let Some(tensor) = self.tensors.remove(&id) else {
            return StreamClosed::Failed;
        };
        let _ = credit.revoke(tensor.revocable_credit());
        if self.tensors.is_empty() {
            self.idle_since = Some(now);
        }
        if tensor.state() == ReceiverState::Complete {
            return StreamClosed::Completed;
        }
        match self.failures.record_failure(now) {
            Ok(()) => StreamClosed::Failed,
            Err(flood) => StreamClosed::Flood(flood),
        }
    }

    /// Streams open now.
    pub fn open_streams(&self) -> usize {
        self.tensors.len()
    }

    /// How long the connection has had no stream open at `now` (zero while one is).
    pub fn idle_for(&self, now: Instant) -> Duration {
        self.idle_since
            .map_or(Duration::ZERO, |since| now.saturating_duration_since(since))
    }

    /// The policy this session applies.
    pub fn config(&self) -> &SessionConfig {
        &self.config
    }
}
