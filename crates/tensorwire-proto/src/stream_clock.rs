//! Each incoming stream's clock (spec §10, §10.1): what the stream waits for, and when that
//! wait ends. The peer is timed only while it owes a frame; the application only while it
//! owes a decision; while the stream waits for this receiver's own credit or sink, nobody is.

use std::time::{Duration, Instant};

use crate::receiver::{ReceiverState, TensorReceiver};

/// When an incoming stream last moved, and when its METADATA arrived.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StreamClock {
    /// The peer's last frame on the stream, or the last credit we gave it, or the decision:
    /// whatever last gave the peer something to send.
    progress: Instant,
    /// When METADATA arrived: the application's decision is due from then.
    metadata: Option<Instant>,
}

/// Who an incoming stream waits for, with its deadline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wait {
    /// The peer owes a frame: METADATA, DATA within the credit it holds, or END.
    Peer,
    /// The application owes its accept or reject.
    Decision,
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

    /// Who `tensor` waits for and until when (`None`: nobody but this receiver, or never).
    pub(crate) fn deadline(
        &self,
        tensor: &TensorReceiver,
        progress: Duration,
        admission: Duration,
    ) -> Option<(Instant, Wait)> {
        let peer = || Some((self.progress.checked_add(progress)?, Wait::Peer));
        match tensor.state() {
            ReceiverState::AwaitingMetadata | ReceiverState::AwaitingEarlyMetadata => peer(),
            ReceiverState::AwaitingDecision
            | ReceiverState::ReceivingEarly
            | ReceiverState::EndedEarly => {
                let since = self.metadata.unwrap_or(self.progress);
                Some((since.checked_add(admission)?, Wait::Decision))
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
    /// Why a stream whose wait ran out ends (with PROGRESS_TIMEOUT either way, spec §10.1),
    /// given the session's two timeouts.
    pub(crate) fn reason(self, progress: Duration, admission: Duration) -> String {
        let (what, after) = match self {
            Wait::Peer => ("frame from the peer", progress),
            Wait::Decision => ("decision from the application", admission),
        };
        format!("no {what} within {:.1} s", after.as_secs_f64())
    }
}
