//! The connection's budget for failed and cancelled streams (spec §10), with time passed in.

use std::time::{Duration, Instant};

use crate::ErrorCode;

/// A token bucket of failed streams: `burst` may fail at once, and the budget refills at
/// `burst` per `window`. A peer that cancels, resets or gets refused faster than that runs
/// it dry, deterministically, however its failures fall across windows (spec §10).
#[derive(Clone, Debug)]
pub struct FloodBudget {
    burst: u32,
    window: Duration,
    /// Failures still allowed, in millionths of a stream so refilling never rounds away.
    available: u64,
    last: Option<Instant>,
}

/// The budget ran dry: close the connection with [`code`](Self::code).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FloodExceeded {
    /// The budget's burst, for the message.
    pub burst: u32,
    /// Its window, for the message.
    pub window: Duration,
    /// The code to close the connection with ([`FloodBudget::record_failure`]).
    pub code: ErrorCode,
}

const UNIT: u64 = 1_000_000;

impl FloodBudget {
    /// A budget of `burst` failed streams, refilled at `burst` per `window`.
    pub fn new(burst: u32, window: Duration) -> Self {
        Self {
            burst,
            window,
            available: u64::from(burst) * UNIT,
            last: None,
        }
    }

    /// Counts one failed, cancelled, reset or refused stream at `now`, which ended with
    /// `cause`. When it runs the budget dry, the connection closes with CANCEL_FLOOD, or
    /// with PROGRESS_TIMEOUT where `cause` was a timeout: a slow or silent peer is not
    /// flooding, and its operator should read why (spec §10).
    #[must_use = "on Err, close the connection with the code it carries"]
    pub fn record_failure(&mut self, now: Instant, cause: ErrorCode) -> Result<(), FloodExceeded> {
        self.refill(now);
        if self.available < UNIT {
            let code = match cause {
                ErrorCode::PROGRESS_TIMEOUT => ErrorCode::PROGRESS_TIMEOUT,
                _ => ErrorCode::CANCEL_FLOOD,
            };
            return Err(FloodExceeded {
                burst: self.burst,
                window: self.window,
                code,
            });
        }
        self.available -= UNIT;
        Ok(())
    }

    fn refill(&mut self, now: Instant) {
        let full = u64::from(self.burst) * UNIT;
        if let Some(last) = self.last {
            let elapsed = now.saturating_duration_since(last).as_nanos();
            let window = self.window.as_nanos().max(1);
            let earned = elapsed.saturating_mul(u128::from(full)) / window;
            self.available = full.min(
                self.available
                    .saturating_add(earned.min(u128::from(full)) as u64),
            );
        }
        self.last = Some(now);
    }

    /// Failures allowed right now (at the time of the last call).
    pub fn available(&self) -> u32 {
        u32::try_from(self.available / UNIT).unwrap_or(u32::MAX)
    }
}
