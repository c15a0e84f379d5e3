//! The receiver-wide byte budget, shared by every stream, and the RAII permits that return
//! bytes to it once a sink has made them durable (spec §7.1).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tensorwire_proto::{CreditTracker, ProtocolError};
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

    fn release(&self, n: u64) {
        let result = self.lock().release(n);
        debug_assert!(result.is_ok(), "released more than held");
        self.released.notify_waiters();
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

/// Bytes of one tensor that a sink holds; dropping the permit says they are durable, returns
/// them to the receiver's budget, and lets the receiver grant them again as CREDIT.
///
/// A sink keeps the permit until its copy is done (for a GPU sink: until the copy's event has
/// completed and the staging buffer is back in its pool). Permits cannot leak credit: every
/// way of dropping one returns its bytes.
#[derive(Debug)]
pub struct CreditPermit {
    bytes: u64,
    /// `None` for a permit that belongs to no receiver (sinks fed without a network).
    budget: Option<Arc<Budget>>,
    pending: Arc<AtomicU64>,
}

impl CreditPermit {
    pub(crate) fn new(bytes: u64, budget: Arc<Budget>, pending: Arc<AtomicU64>) -> Self {
        pending.fetch_add(bytes, Ordering::AcqRel);
        Self {
            bytes,
            budget: Some(budget),
            pending,
        }
    }

    /// A permit for `bytes` that returns credit to no receiver: for feeding a [`Sink`]
    /// directly, without a network (tests, ingest benchmarks).
    ///
    /// [`Sink`]: crate::Sink
    pub fn unbudgeted(bytes: u64) -> Self {
        Self {
            bytes,
            budget: None,
            pending: Arc::new(AtomicU64::new(bytes)),
        }
    }

    /// Bytes this permit holds.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Takes over `other`'s bytes (both of the same tensor), so one permit covers a
    /// coalesced buffer.
    pub fn merge(&mut self, mut other: CreditPermit) {
        self.bytes += std::mem::take(&mut other.bytes);
    }

    /// Splits off the last `n` bytes (at most all of them) into a permit of their own.
    pub fn split_off(&mut self, n: u64) -> CreditPermit {
        let n = n.min(self.bytes);
        self.bytes -= n;
        CreditPermit {
            bytes: n,
            budget: self.budget.clone(),
            pending: self.pending.clone(),
        }
    }
}

impl Drop for CreditPermit {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.pending.fetch_sub(self.bytes, Ordering::AcqRel);
            if let Some(budget) = &self.budget {
                budget.release(self.bytes);
            }
        }
    }
}
