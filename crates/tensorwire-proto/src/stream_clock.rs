//! Each stream's clock (spec §10, §10.1): what the stream waits for, and when that wait
//! ends. The peer is timed only while it owes a frame; the application only while it owes a
//! decision; while the stream waits for this side's own credit, sink or source, nobody is.

use std::time::{Duration, Instant};

use crate::receiver::{ReceiverState, TensorReceiver};
use crate::sender::{SenderState, TensorSender};

/// How long after the admission timeout a tensor is refused, so that a decision the
/// application makes at the deadline (its memory waits end then: a refusal with
/// RESOURCE_EXHAUSTED) still reaches the sender with its own code (spec §10.1).
pub const DECISION_GRACE: Duration = Duration::from_secs(1);

/// When an incoming stream last moved, and when its METADATA arrived.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StreamClock {
    /// The peer's last frame on the stream, or the last credit we gave it, or the decision:
    /// whatever last gave the peer something to send.
    progress: Instant,
    /// When METADATA arrived: the application's decision is due from then.
    metadata: Option<Instant>,
}

/// Who a stream waits for, with how long that wait may last.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wait {
    /// The peer owes a frame: METADATA, DATA within the credit it holds, or END.
    Peer(Duration),
    /// The application owes its accept or reject.
    Decision(Duration),
    /// The peer owes an answer to a tensor we send (ACCEPT, CREDIT or COMPLETE) and none of
    /// our bytes moved meanwhile.
    Reply(Duration),
}

/// When a stream we send on last moved: the peer's last answer, or our bytes moving (handed
/// to the transport, or sent or resent by it). A slow path is not a silent peer: while our
/// data still crosses it, the peer has nothing to say.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ReplyClock {
    progress: Instant,
    /// How long the peer may owe an answer with nothing moving.
    timeout: Duration,
}

impl ReplyClock {
    /// A stream we opened at `now`.
    pub(crate) fn opened(now: Instant, timeout: Duration) -> Self {
        Self {
            progress: now,
            timeout,
        }
    }

    /// The peer answered, or our bytes moved, at `now`.
    pub(crate) fn progressed(&mut self, now: Instant) {
        self.progress = self.progress.max(now);
    }

    /// When the peer's answer is due, while it owes one: after METADATA (ACCEPT or REJECT),
    /// once the credit it granted is used up (CREDIT), after END (COMPLETE). `None` while we
    /// may send, once the tensor ended, or where the timeout is off.
    pub(crate) fn deadline(&self, tensor: &TensorSender) -> Option<(Instant, Wait)> {
        let owes = match tensor.state() {
            SenderState::AwaitingDecision
            | SenderState::FinishedEarly
            | SenderState::AwaitingComplete => true,
            SenderState::Sending => {
                tensor.next_chunk_len() == 0 && tensor.sent() < tensor.meta().byte_len()
            }
            SenderState::SendingEarly | SenderState::Complete | SenderState::Closed => false,
        };
        if !owes {
            return None;
        }
        let deadline = self.progress.checked_add(self.timeout)?;
        Some((deadline, Wait::Reply(self.timeout)))
    }
}

impl StreamClock {
    /// A stream the peer opened at `now`.
    pub(crate) fn opened(now: Instant) -> Self {
        Self {
            progress: now,
            metadata: None,
        }
    }

    /// The peer sent a frame, or was given credit or a decision, at `now`.
    pub(crate) fn progressed(&mut self, now: Instant) {
        self.progress = now;
    }

    /// METADATA arrived at `now`: the decision is due `admission` later.
    pub(crate) fn metadata_arrived(&mut self, now: Instant) {
        self.progress = now;
        self.metadata = Some(now);
    }

    /// When the application's decision on `tensor` is due (`admission` after METADATA), while
    /// it owes one; the stream is refused [`DECISION_GRACE`] later.
    pub(crate) fn decision_due(
        &self,
        tensor: &TensorReceiver,
        admission: Duration,
    ) -> Option<Instant> {
        if !tensor.state().awaits_decision() {
            return None;
        }
        self.metadata
            .unwrap_or(self.progress)
            .checked_add(admission)
    }

    /// Who `tensor` waits for and until when (`None`: nobody but this receiver, or never).
    pub(crate) fn deadline(
        &self,
        tensor: &TensorReceiver,
        progress: Duration,
        admission: Duration,
    ) -> Option<(Instant, Wait)> {
        let peer = || Some((self.progress.checked_add(progress)?, Wait::Peer(progress)));
        match tensor.state() {
            ReceiverState::AwaitingMetadata | ReceiverState::AwaitingEarlyMetadata => peer(),
            undecided if undecided.awaits_decision() => {
                let due = self.decision_due(tensor, admission)?;
                Some((due.checked_add(DECISION_GRACE)?, Wait::Decision(admission)))
            }
            // The peer holds credit, or has sent every byte and owes END (spec §10.1).
            ReceiverState::Receiving
                if tensor.revocable_credit() > 0 || tensor.ungranted() == 0 =>
            {
                peer()
            }
            _ => None,
        }
    }
}

impl Wait {
    /// Why a stream whose wait ran out ends (with PROGRESS_TIMEOUT, spec §10.1).
    pub(crate) fn reason(self) -> String {
        let (what, after) = match self {
            Wait::Peer(after) => ("frame from the peer", after),
            Wait::Decision(after) => ("decision from the application", after),
            Wait::Reply(after) => ("answer from the peer, and none of our data moved,", after),
        };
        format!("no {what} within {:.1} s", after.as_secs_f64())
    }
}
