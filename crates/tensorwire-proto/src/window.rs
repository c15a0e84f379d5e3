//! A tensor's stream window, grown to the path's bandwidth-delay product (spec §7.1).

use std::time::{Duration, Instant};

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
/// the bytes that arrived since the tensor's previous grant came faster than the window lets
/// them over two round trips: the sender then waited for credit, and the window, not the
/// receiver or the path, set the rate. It never shrinks: a tensor's life is short.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StreamWindow {
    size: u64,
    /// When the tensor was last granted credit, and how many of its bytes had arrived then.
    last_grant: Option<(Instant, u64)>,
}

impl StreamWindow {
    /// A window of `size` bytes, before any grant.
    pub(crate) fn new(size: u64) -> Self {
        Self {
            size,
            last_grant: None,
        }
    }

    /// The window's size now.
    pub(crate) fn size(&self) -> u64 {
        self.size
    }

    /// Before a grant, with `received` bytes of the tensor arrived: doubles the window (up
    /// to `max`) if they arrived since the previous grant faster than `size / (2 × rtt)`.
    pub(crate) fn tune(&mut self, received: u64, clock: GrantClock, max: u64) {
        let Some((granted_at, received_then)) = self.last_grant else {
            return;
        };
        if self.size >= max || clock.rtt.is_zero() {
            return;
        }
        let arrived = u128::from(received.saturating_sub(received_then));
        let elapsed = clock.now.saturating_duration_since(granted_at).as_nanos();
        // arrived / elapsed × 2 rtt > size, without dividing (and without overflow for any
        // rtt a caller passes).
        let needed = arrived.saturating_mul(2 * clock.rtt.as_nanos());
        if needed > u128::from(self.size).saturating_mul(elapsed) {
            self.size = self.size.saturating_mul(2).min(max);
        }
    }

    /// The tensor was granted credit at `now`, with `received` of its bytes arrived.
    pub(crate) fn granted(&mut self, now: Instant, received: u64) {
        self.last_grant = Some((now, received));
    }
}
