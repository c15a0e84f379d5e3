//! Pacing by the path: a tensor's stream window, grown to the path's bandwidth-delay product
//! (spec §7.1), and when a tensor we send lets the connection's next one start (spec §7.4).

use std::time::{Duration, Instant};

use crate::sender::TensorSender;

/// When a grant is asked for, and the connection's smoothed round-trip time then: what a
/// stream window's growth judges a tensor's arrival rate by (spec §7.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GrantClock {
    /// The time of the call.
    pub now: Instant,
    /// The connection's round-trip time (smoothed, as QUIC stacks report it: the session
    /// judges by the smallest it was given). [`Duration::ZERO`] (no path, or none measured
    /// yet) counts as none.
    pub rtt: Duration,
}

impl GrantClock {
    /// A clock for a receiver with no network path (a tensor fed from memory): windows
    /// stay at their initial size.
    pub fn without_path(now: Instant) -> Self {
        Self {
            now,
            rtt: Duration::ZERO,
        }
    }
}

/// The credit one incoming tensor may hold granted and not yet arrived.
///
/// It starts at the session's `stream_window` and doubles, up to `max_stream_window`, when
/// a whole window's bytes arrived faster than the window lets them over two round trips:
/// the sender then waited for credit, and the window, not the receiver or the path, set the
/// rate. The rate is taken over a whole window, not one grant's bytes, because a receiver
/// that fell behind takes a unit at once from its buffers, a burst far above the rate.
/// It never shrinks: a tensor's life is short.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StreamWindow {
    size: u64,
    /// A grant the rate is measured from, and how many of the tensor's bytes had arrived
    /// then; moved on each time a window's bytes have arrived since.
    mark: Option<(Instant, u64)>,
}

impl StreamWindow {
    /// A window of `size` bytes, before any grant.
    pub(crate) fn new(size: u64) -> Self {
        Self { size, mark: None }
    }

    /// The window's size now.
    pub(crate) fn size(&self) -> u64 {
        self.size
    }

    /// Before a grant, with `received` bytes of the tensor arrived: once a whole window's
    /// bytes arrived since the mark, doubles the window (up to `max`) if they came faster
    /// than `size / (2 × rtt)`, and moves the mark here.
    pub(crate) fn tune(&mut self, received: u64, clock: GrantClock, max: u64) {
        let Some((marked_at, received_then)) = self.mark else {
            return;
        };
        let arrived = received.saturating_sub(received_then);
        if arrived < self.size {
            return;
        }
        self.mark = Some((clock.now, received));
        if self.size >= max || clock.rtt.is_zero() {
            return;
        }
        let elapsed = clock.now.saturating_duration_since(marked_at).as_nanos();
        // arrived / elapsed × 2 rtt > size, without dividing (and without overflow for any
        // rtt a caller passes).
        let needed = u128::from(arrived).saturating_mul(2 * clock.rtt.as_nanos());
        if needed > u128::from(self.size).saturating_mul(elapsed) {
            self.size = self.size.saturating_mul(2).min(max);
        }
    }

    /// The tensor was granted credit at `now`, with `received` of its bytes arrived: the
    /// first grant sets the mark the rate is measured from.
    pub(crate) fn granted(&mut self, now: Instant, received: u64) {
        if self.mark.is_none() {
            self.mark = Some((now, received));
        }
    }
}

/// When one of our large tensors lets the connection's next one start (spec §7.4): the
/// rate the receiver has taken its bytes at, read from the credit it granted since its
/// first grant (a receiver grants as bytes arrive, so grants follow the path's rate; the
/// sender's own hand-offs to QUIC come in bursts as credit does).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SendPace {
    /// When the tensor was first granted credit, and how much.
    since: Option<(Instant, u64)>,
}

impl SendPace {
    /// Whether `tensor` is done with the connection's turn: every byte is sent, or the rest
    /// leaves within two round trips at the rate credit came since the first grant. The
    /// next tensor's first DATA reaches the receiver a round trip and a half after its
    /// METADATA leaves (METADATA, then ACCEPT and CREDIT back, then DATA); the other half
    /// leaves room for the receiver's admission.
    pub(crate) fn turn_done(&mut self, tensor: &TensorSender, now: Instant, rtt: Duration) -> bool {
        let sent = tensor.sent();
        let left = tensor.meta().byte_len().saturating_sub(sent);
        if left == 0 {
            return true;
        }
        let granted = sent + tensor.credit();
        let Some((since, granted_then)) = self.since else {
            if granted > 0 {
                self.since = Some((now, granted));
            }
            return false;
        };
        let elapsed = now.saturating_duration_since(since).as_nanos();
        let moved = u128::from(granted.saturating_sub(granted_then));
        if rtt.is_zero() || elapsed < rtt.as_nanos() {
            // No path to judge by, or a rate over less than a round trip: the initial
            // window's grants come together.
            return false;
        }
        // left / rate ≤ 2 rtt, with rate = moved / elapsed, without dividing.
        u128::from(left).saturating_mul(elapsed) <= moved.saturating_mul(2 * rtt.as_nanos())
    }
}
