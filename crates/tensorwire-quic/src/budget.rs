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
    /// Granted, not yet arrived (early credit offered included).
    pub in_flight: u64,
    /// Of `in_flight`, early credit offered to peers and not yet used by a tensor (spec
    /// §7.6): it stays out while their connections last.
    pub early_offered: u64,
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

    /// Runs `f` on the tracker (a sans-IO call that moves credit), records the peak, and
    /// wakes the streams waiting for credit if a peer held to its fair share may be granted
    /// again (spec §7.1).
    pub(crate) fn with_tracker<T>(&self, f: impl FnOnce(&mut CreditTracker) -> T) -> T {
        let mut tracker = self.lock();
        let out = f(&mut tracker);
        self.peak_outstanding
            .fetch_max(tracker.outstanding(), Ordering::Relaxed);
        let reopened = tracker.take_share_reopened();
        drop(tracker);
        if reopened {
            self.released.notify_waiters();
        }
        out
    }

    /// Resolves once credit may have come back (a release or a revoke) after `armed` was
    /// taken: take it, try to grant, and await it if nothing was granted.
    pub(crate) fn credit_returned(&self) -> tokio::sync::futures::Notified<'_> {
        self.released.notified()
    }

    /// Wakes every stream waiting for credit (some came back).
    pub(crate) fn wake(&self) {
        self.released.notify_waiters();
    }

    pub(crate) fn snapshot(&self) -> BudgetSnapshot {
        let tracker = self.lock();
        BudgetSnapshot {
            budget: tracker.budget(),
            in_flight: tracker.in_flight(),
            early_offered: tracker.early_offered(),
            held: tracker.held(),
            peak_outstanding: self.peak_outstanding.load(Ordering::Relaxed),
        }
    }
}

impl CreditRelease for Budget {
    fn release(&self, n: u64) {
        let result = self.lock().release(n);
        debug_assert!(result.is_ok(), "released more than held");
        // Streams wait on the tracker only while it is paused (below the high watermark a
        // grant always finds credit), so only a release that ends the pause wakes them.
        if matches!(result, Ok(true)) {
            self.released.notify_waiters();
        }
    }
}
