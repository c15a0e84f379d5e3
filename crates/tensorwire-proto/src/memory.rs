//! Destination memory admitted against a limit before a tensor is accepted (spec §7.5).

/// What [`MemoryLedger::reserve`] decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use = "a reservation must be released, a refusal reported"]
pub enum Admission {
    /// The bytes are reserved; release them when the destination is freed.
    Reserved,
    /// Not now: other destinations hold the memory. Wait for a release and ask again.
    Wait,
    /// Never: the request alone is larger than the whole limit.
    TooLarge,
}

/// Bytes of destination memory (host, or one device) reserved for accepted tensors.
///
/// Credit (spec §7.1) bounds bytes in transit; this ledger bounds the buffers they land in, so
/// that a METADATA claiming gigabytes commits nothing until the memory is admitted.
/// `reserved` never exceeds `limit`, except in a [share](Self::share) holding one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryLedger {
    limit: u64,
    reserved: u64,
    peak: u64,
    /// A share admits one request above its limit while it holds nothing else.
    sole_above_limit: bool,
}

impl MemoryLedger {
    /// A ledger admitting at most `limit` bytes at once.
    pub fn new(limit: u64) -> Self {
        Self {
            limit,
            reserved: 0,
            peak: 0,
            sole_above_limit: false,
        }
    }

    /// One party's share of a larger budget (spec §7.5): at most `limit` bytes at once, or
    /// one request of any size while it holds nothing else, so a party with one tensor
    /// larger than its share still gets it when the budget has room (the budget's own ledger
    /// decides that).
    pub fn share(limit: u64) -> Self {
        Self {
            sole_above_limit: true,
            ..Self::new(limit)
        }
    }

    /// Reserves `bytes` if they fit beside what is reserved.
    pub fn reserve(&mut self, bytes: u64) -> Admission {
        if bytes > self.limit {
            if !self.sole_above_limit {
                return Admission::TooLarge;
            }
            if self.reserved > 0 {
                return Admission::Wait;
            }
            self.reserved = bytes;
            self.peak = self.peak.max(bytes);
            return Admission::Reserved;
        }
        if bytes > self.limit.saturating_sub(self.reserved) {
            return Admission::Wait;
        }
        self.reserved += bytes;
        self.peak = self.peak.max(self.reserved);
        Admission::Reserved
    }

    /// Returns `bytes` reserved earlier; more than is reserved is clamped (and a bug upstream).
    pub fn release(&mut self, bytes: u64) {
        debug_assert!(bytes <= self.reserved, "released more memory than reserved");
        self.reserved -= bytes.min(self.reserved);
    }

    /// Changes the limit (a share whose party count changed): reservations above a lower
    /// limit stay until released, and new ones wait.
    pub fn set_limit(&mut self, limit: u64) {
        self.limit = limit;
    }

    /// The most that may be reserved at once.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes reserved now.
    pub fn reserved(&self) -> u64 {
        self.reserved
    }

    /// The most that was ever reserved at once.
    pub fn peak(&self) -> u64 {
        self.peak
    }
}
