//! A shared [`MemoryLedger`] that destination buffers are admitted against, with waiting.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use memmap2::MmapMut;
use tensorwire_proto::{Admission, MemoryLedger};
use tokio::sync::Notify;

use crate::SinkError;

/// Destination memory of one kind (host, or one GPU), shared by every tensor a receiver
/// lands there (spec §7.5). Cloning shares the budget.
#[derive(Clone, Debug)]
pub struct MemoryBudget {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// What the memory is, for messages: "host" or "cuda:0".
    what: String,
    ledger: Mutex<MemoryLedger>,
    released: Notify,
    /// The budget this one is a share of: every reservation counts against both.
    parent: Option<MemoryBudget>,
    /// Host mappings of landed tensors that were dropped, kept for the next tensor of the
    /// same length; their bytes count in `ledger` as reserved.
    spares: Mutex<Spares>,
}

/// Freed host mappings kept for reuse, by length.
#[derive(Debug, Default)]
struct Spares {
    by_len: HashMap<usize, Vec<MmapMut>>,
    /// Bytes kept.
    held: u64,
    /// The most kept at once (0: none).
    limit: u64,
}

/// Where a memory budget stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemorySnapshot {
    /// The most that may be reserved at once.
    pub limit: u64,
    /// Reserved now for destinations (landed tensors, and tensors landing).
    pub reserved: u64,
    /// Held now in buffers of dropped tensors kept for reuse
    /// ([`MemoryBudget::keeping_spares`]); with `reserved`, at most `limit`.
    pub kept: u64,
    /// The most ever held at once, kept buffers included.
    pub peak: u64,
}

impl MemoryBudget {
    /// A budget of `limit` bytes of `what` memory ("host", "cuda:0").
    pub fn new(what: impl Into<String>, limit: u64) -> Self {
        Self {
            inner: Arc::new(Inner {
                what: what.into(),
                ledger: Mutex::new(MemoryLedger::new(limit)),
                released: Notify::new(),
                parent: None,
                spares: Mutex::default(),
            }),
        }
    }

    /// Keeps up to `bytes` of host mappings of dropped tensors for the next tensors of the
    /// same lengths, so landing them takes no page faults and no zeroing by the kernel. Kept
    /// mappings count against the budget as reserved, and are freed first whenever a
    /// reservation would otherwise wait. For host budgets; a share keeps its whole's.
    pub fn keeping_spares(self, bytes: u64) -> Self {
        self.lock_spares().limit = bytes;
        self
    }

    fn root(&self) -> &MemoryBudget {
        match &self.inner.parent {
            Some(parent) => parent.root(),
            None => self,
        }
    }

    fn lock_spares(&self) -> MutexGuard<'_, Spares> {
        self.inner
            .spares
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// A kept mapping of exactly `len` bytes, if there is one; its bytes stop counting as
    /// kept (the caller's reservation covers them). It holds an earlier tensor's bytes.
    pub(crate) fn take_spare(&self, len: usize) -> Option<MmapMut> {
        let root = self.root();
        let map = {
            let mut spares = root.lock_spares();
            let map = spares.by_len.get_mut(&len)?.pop()?;
            spares.held -= len as u64;
            map
        };
        root.ledger().release(len as u64);
        Some(map)
    }

    /// Keeps `map` (whose reservation was just released) for reuse if there is room in the
    /// spares' limit and in the budget; otherwise it is unmapped.
    pub(crate) fn keep_spare(&self, map: MmapMut) {
        let root = self.root();
        let len = map.len() as u64;
        let mut spares = root.lock_spares();
        if spares.held + len > spares.limit {
            return;
        }
        if root.ledger().reserve(len) != Admission::Reserved {
            return;
        }
        spares.held += len;
        spares.by_len.entry(map.len()).or_default().push(map);
    }

    /// Frees every mapping this (root) budget kept; true if there were any.
    fn free_spares(&self) -> bool {
        let (kept, held) = {
            let mut spares = self.lock_spares();
            let held = std::mem::take(&mut spares.held);
            (std::mem::take(&mut spares.by_len), held)
        };
        if held == 0 {
            return false;
        }
        self.ledger().release(held);
        drop(kept);
        self.inner.released.notify_waiters();
        true
    }

    /// A share of this budget of at most `limit` bytes, for one party (a connection), so
    /// that no party can hold more than its share of the whole (spec §7.5), except one
    /// reservation of any size while it holds nothing else. Reservations through the share
    /// count against both; `what` names the share in messages.
    pub fn share(&self, what: impl Into<String>, limit: u64) -> Self {
        self.share_of_at_most(what, limit.min(self.limit()))
    }

    /// A share of at most `limit` bytes, even if that is more than this budget's own limit
    /// (a share of a share whose limit changes).
    pub(crate) fn share_of_at_most(&self, what: impl Into<String>, limit: u64) -> Self {
        Self {
            inner: Arc::new(Inner {
                what: what.into(),
                ledger: Mutex::new(MemoryLedger::share(limit)),
                released: Notify::new(),
                parent: Some(self.clone()),
                spares: Mutex::default(),
            }),
        }
    }

    /// Changes a share's limit (a party joined or left, spec §7.5); reservations above a
    /// lowered limit stay, and new ones wait. Waiters are woken if it grew.
    pub(crate) fn set_limit(&self, limit: u64) {
        let grew = {
            let mut ledger = self.ledger();
            let grew = limit > ledger.limit();
            ledger.set_limit(limit);
            grew
        };
        if grew {
            self.inner.released.notify_waiters();
            self.root().inner.released.notify_waiters();
        }
    }

    fn ledger(&self) -> MutexGuard<'_, MemoryLedger> {
        // The ledger's invariants hold between calls; a panic elsewhere cannot break them.
        self.inner
            .ledger
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Reserves `bytes` now, or says why not (RESOURCE_EXHAUSTED).
    pub fn try_reserve(&self, bytes: u64) -> Result<MemoryReservation, SinkError> {
        let mut admission = self.ledger().reserve(bytes);
        // Kept mappings give way to any reservation that needs their memory.
        if admission == Admission::Wait && self.free_spares() {
            admission = self.ledger().reserve(bytes);
        }
        let ledger = self.ledger();
        match admission {
            Admission::Reserved => {
                drop(ledger);
                let parent = match &self.inner.parent {
                    Some(parent) => match parent.try_reserve(bytes) {
                        Ok(reserved) => Some(Box::new(reserved)),
                        Err(e) => {
                            self.ledger().release(bytes);
                            return Err(e);
                        }
                    },
                    None => None,
                };
                Ok(self.reservation(bytes, parent))
            }
            Admission::Wait => Err(SinkError::exhausted(format!(
                "{bytes} bytes of {} memory: {} of the {} byte budget are in use",
                self.inner.what,
                ledger.reserved(),
                ledger.limit()
            ))),
            Admission::TooLarge => Err(self.too_large(bytes, ledger.limit())),
        }
    }

    /// Reserves `bytes`, waiting for other reservations to end; fails at once only if
    /// `bytes` exceeds the whole budget (or share). Callers bound the wait (the admission
    /// timeout).
    pub async fn reserve(&self, bytes: u64) -> Result<MemoryReservation, SinkError> {
        loop {
            let own = self.inner.released.notified();
            tokio::pin!(own);
            own.as_mut().enable();
            let admission = self.ledger().reserve(bytes);
            match admission {
                Admission::Reserved => {}
                Admission::TooLarge => return Err(self.too_large(bytes, self.limit())),
                // Kept mappings give way before anyone waits.
                Admission::Wait if self.free_spares() => continue,
                Admission::Wait => {
                    own.await;
                    continue;
                }
            }
            let Some(parent) = &self.inner.parent else {
                return Ok(self.reservation(bytes, None));
            };
            // Every release anywhere reaches the whole budget, and a share that grows wakes
            // it too: waiting there misses nothing a share of a share could wait for.
            let root = self.root();
            let freed = root.inner.released.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            let parent_freed = parent.inner.released.notified();
            tokio::pin!(parent_freed);
            parent_freed.as_mut().enable();
            match parent.try_reserve(bytes) {
                Ok(reserved) => return Ok(self.reservation(bytes, Some(Box::new(reserved)))),
                Err(e) if bytes > root.limit() => {
                    self.ledger().release(bytes);
                    return Err(e);
                }
                Err(_) => {
                    // Hold none of the share while the whole budget is full.
                    self.ledger().release(bytes);
                    self.inner.released.notify_waiters();
                    tokio::select! {
                        () = freed => {}
                        () = parent_freed => {}
                    }
                }
            }
        }
    }

    fn reservation(&self, bytes: u64, parent: Option<Box<MemoryReservation>>) -> MemoryReservation {
        MemoryReservation {
            bytes,
            budget: self.clone(),
            _parent: parent,
        }
    }

    fn too_large(&self, bytes: u64, limit: u64) -> SinkError {
        SinkError::exhausted(format!(
            "{bytes} bytes exceed the whole {} memory budget of {limit} bytes",
            self.inner.what
        ))
    }

    /// Whether `other` is this same budget (a clone of it), not merely an equal one.
    pub fn same_as(&self, other: &MemoryBudget) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// What memory this budget covers ("host", "cuda:0").
    pub fn what(&self) -> &str {
        &self.inner.what
    }

    /// The most that may be reserved at once.
    pub fn limit(&self) -> u64 {
        self.ledger().limit()
    }

    /// Where the budget stands.
    pub fn snapshot(&self) -> MemorySnapshot {
        // Only a whole budget keeps buffers; its ledger counts them as reserved.
        let kept = match &self.inner.parent {
            None => self.lock_spares().held,
            Some(_) => 0,
        };
        let ledger = self.ledger();
        MemorySnapshot {
            limit: ledger.limit(),
            // Saturating: a buffer taken for reuse leaves the kept count before the ledger.
            reserved: ledger.reserved().saturating_sub(kept),
            kept,
            peak: ledger.peak(),
        }
    }
}

/// Bytes of a [`MemoryBudget`] held for one destination buffer; returned on drop.
#[derive(Debug)]
pub struct MemoryReservation {
    bytes: u64,
    budget: MemoryBudget,
    /// The same bytes in the budget this one is a share of; released after this one.
    _parent: Option<Box<MemoryReservation>>,
}

impl MemoryReservation {
    /// Bytes reserved.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The budget the bytes are reserved in.
    pub(crate) fn budget(&self) -> &MemoryBudget {
        &self.budget
    }
}

impl Drop for MemoryReservation {
    fn drop(&mut self) {
        self.budget.ledger().release(self.bytes);
        self.budget.inner.released.notify_waiters();
    }
}
