//! The receiver-wide byte budget, shared by every stream; sinks' credit permits return bytes
//! to it once they are durable (spec §7.1).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use tensorwire_proto::{CreditTracker, ProtocolError};
use tensorwire_sink::CreditRelease;
use tokio::sync::Notify;

/// A [`CreditTracker`] shared by all streams of a receiver; waiters wake on release.
#[derive(Debug)]
pub(crate) struct Budget {
    tracker: Mutex<CreditTracker>,
    released: Notify,
    peak_outstanding: AtomicU64,
}

/// Where a receiver's budget stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BudgetSnapshot {
    /// The whole budget.
    pub budget: u64,
    /// Granted, not yet arrived.
    pub in_flight: u64,
    /// Arrived, not yet durable in a sink.
    pub held: u64,
    /// The most that was ever outstanding (in flight plus held) at once.
    pub peak_outstanding: u64,
}

impl Budget {
    pub(crate) fn new(budget: u64, high: u64, low: u64) -> Result<Self, ProtocolError> {
        Ok(Self {
            tracker: Mutex::new(CreditTracker::new(budget, high, low)?),
            released: Notify::new(),
            peak_outstanding: AtomicU64::new(0),
        })
    }

    fn lock(&self) -> MutexGuard<'_, CreditTracker> {
        // The tracker's invariants hold between calls; a panic elsewhere cannot break them.
        self.tracker.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits until at least one byte can be granted; returns up to `want` granted bytes.
    pub(crate) async fn acquire(&self, want: u64) -> u64 {
        loop {
            let notified = self.released.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let granted = {
                let mut tracker = self.lock();
                let granted = tracker.grant(want);
                self.peak_outstanding
                    .fetch_max(tracker.outstanding(), Ordering::Relaxed);
                granted
            };
            if granted > 0 {
                return granted;
            }
            notified.await;
        }
    }

    /// Records arrived bytes (spec §7.1: in flight → held).
    pub(crate) fn consume(&self, n: u64) -> Result<(), ProtocolError> {
        self.lock().consume(n)
    }

    /// Returns granted bytes that will never arrive.
    pub(crate) fn revoke(&self, n: u64) {
        if n > 0 {
            let result = self.lock().revoke(n);
            debug_assert!(result.is_ok(), "revoked more than in flight");
            self.released.notify_waiters();
        }
    }

    pub(crate) fn snapshot(&self) -> BudgetSnapshot {
        let tracker = self.lock();
        BudgetSnapshot {
            budget: tracker.budget(),
            in_flight: tracker.in_flight(),
            held: tracker.held(),
            peak_outstanding: self.peak_outstanding.load(Ordering::Relaxed),
        }
    }
}

impl CreditRelease for Budget {
    fn release(&self, n: u64) {
        let result = self.lock().release(n);
        debug_assert!(result.is_ok(), "released more than held");
        self.released.notify_waiters();
    }
}
