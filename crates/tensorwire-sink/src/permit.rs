//! Credit permits: bytes of one tensor held by a sink until they are durable (spec §7.1).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Where a permit's bytes go back once a sink has made them durable: a receiver's credit
/// budget, which may then grant them again.
pub trait CreditRelease: Send + Sync + fmt::Debug {
    /// `bytes` that arrived earlier are durable.
    fn release(&self, bytes: u64);
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
    budget: Option<Arc<dyn CreditRelease>>,
    /// Bytes of this tensor not yet durable, shared by all its permits.
    pending: Arc<AtomicU64>,
}

impl CreditPermit {
    /// A permit for `bytes` that arrived for a tensor whose not-yet-durable bytes `pending`
    /// counts; `budget` gets them back on drop. For transport drivers.
    pub fn new(bytes: u64, budget: Arc<dyn CreditRelease>, pending: Arc<AtomicU64>) -> Self {
        pending.fetch_add(bytes, Ordering::AcqRel);
        Self {
            bytes,
            budget: Some(budget),
            pending,
        }
    }

    /// A permit for `bytes` that returns credit to no receiver: for feeding a [`Sink`]
    /// directly, without a network (tests, ingest benchmarks, frames from a file).
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
