//! Byte-credit flow control with high and low watermarks (spec §7).

use crate::error::{ErrorCode, ProtocolError};

/// A receiver-wide byte budget shared by all its tensors (spec §7.1).
///
/// Bytes move through three states: *available* → [`grant`](Self::grant) → *in flight*
/// (granted, not yet arrived) → [`consume`](Self::consume) → *held* (arrived, not yet
/// durable in the sink) → [`release`](Self::release) → available again. Granted bytes a
/// tensor will never receive (it ended early) go back with [`revoke`](Self::revoke).
///
/// `outstanding = in_flight + held` never exceeds `budget`. When it reaches the high
/// watermark, granting pauses; it resumes once releases bring it down to the low watermark,
/// so credit flows in large batches rather than one small grant per release.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CreditTracker {
    budget: u64,
    high: u64,
    low: u64,
    in_flight: u64,
    /// Of `in_flight`, early credit offered to peers and not yet claimed by a tensor.
    early: u64,
    held: u64,
    paused: bool,
}

impl CreditTracker {
    /// A tracker with `budget` bytes in all, pausing at `high` and resuming at `low`.
    ///
    /// Requires `0 < budget`, `low <= high <= budget`.
    pub fn new(budget: u64, high: u64, low: u64) -> Result<Self, ProtocolError> {
        if budget == 0 || high > budget || low > high {
            return Err(ProtocolError::Misuse(
                "credit budget needs 0 < budget and low <= high <= budget",
            ));
        }
        Ok(Self {
            budget,
            high,
            low,
            in_flight: 0,
            early: 0,
            held: 0,
            paused: false,
        })
    }

    /// Grants up to `want` bytes; returns how many were granted (0 while paused).
    #[must_use = "granted bytes must be sent to the peer as CREDIT or revoked"]
    pub fn grant(&mut self, want: u64) -> u64 {
        if self.paused {
            return 0;
        }
        let granted = want.min(self.budget - self.outstanding());
        self.in_flight += granted;
        if self.outstanding() >= self.high {
            self.paused = true;
        }
        granted
    }

    /// Grants up to `want` bytes of early credit (spec §7.6): only while outstanding stays at
    /// or below the low watermark, so early credit that peers leave unused can never keep
    /// granting paused. Returns how many were granted.
    #[must_use = "granted bytes must be sent to the peer as EARLY_CREDIT or revoked"]
    pub fn grant_early(&mut self, want: u64) -> u64 {
        if self.paused {
            return 0;
        }
        let granted = want.min(self.low.saturating_sub(self.outstanding()));
        self.in_flight += granted;
        self.early += granted;
        if self.outstanding() >= self.high {
            self.paused = true;
        }
        granted
    }

    /// A tensor sent early claims `n` bytes of the early credit offered: they stay in flight,
    /// now as that tensor's credit.
    pub fn claim_early(&mut self, n: u64) -> Result<(), ProtocolError> {
        if n > self.early {
            return Err(ProtocolError::Misuse(
                "claimed more early credit than was offered",
            ));
        }
        self.early -= n;
        Ok(())
    }

    /// Takes back `n` bytes of early credit offered and never claimed (the connection ended,
    /// or the peer refused the offers). Returns `true` when this ended a pause.
    #[must_use = "on true, granting resumes: hand out credit again"]
    pub fn revoke_early(&mut self, n: u64) -> Result<bool, ProtocolError> {
        self.claim_early(n)?;
        self.revoke(n)
    }

    /// Early credit offered to peers and not yet claimed (part of [`in_flight`](Self::in_flight)).
    pub fn early_offered(&self) -> u64 {
        self.early
    }

    /// Records `n` granted bytes as arrived; more than is in flight is a CREDIT_VIOLATION.
    pub fn consume(&mut self, n: u64) -> Result<(), ProtocolError> {
        if n > self.in_flight {
            return Err(ProtocolError::violation(
                ErrorCode::CREDIT_VIOLATION,
                format!(
                    "{n} bytes arrived with only {} granted and in flight",
                    self.in_flight
                ),
            ));
        }
        self.in_flight -= n;
        self.held += n;
        Ok(())
    }

    /// Returns `n` held bytes to the budget once the sink made them durable.
    ///
    /// Returns `true` when this release ended a pause: the caller should grant again.
    #[must_use = "on true, granting resumes: hand out credit again"]
    pub fn release(&mut self, n: u64) -> Result<bool, ProtocolError> {
        if n > self.held {
            return Err(ProtocolError::Misuse(
                "released more credit bytes than are held",
            ));
        }
        self.held -= n;
        Ok(self.update_pause())
    }

    /// Returns `n` granted bytes that will never arrive (the tensor ended early).
    ///
    /// Returns `true` when this ended a pause.
    #[must_use = "on true, granting resumes: hand out credit again"]
    pub fn revoke(&mut self, n: u64) -> Result<bool, ProtocolError> {
        if n > self.in_flight {
            return Err(ProtocolError::Misuse(
                "revoked more credit bytes than are in flight",
            ));
        }
        self.in_flight -= n;
        Ok(self.update_pause())
    }

    fn update_pause(&mut self) -> bool {
        let resumed = self.paused && self.outstanding() <= self.low;
        if resumed {
            self.paused = false;
        }
        resumed
    }

    /// Whether granting is paused (outstanding reached `high` and has not fallen to `low`).
    pub fn should_pause(&self) -> bool {
        self.paused
    }

    /// Bytes [`grant`](Self::grant) would hand out now.
    pub fn available(&self) -> u64 {
        if self.paused {
            0
        } else {
            self.budget - self.outstanding()
        }
    }

    /// Granted bytes not yet arrived.
    pub fn in_flight(&self) -> u64 {
        self.in_flight
    }

    /// Arrived bytes not yet durable.
    pub fn held(&self) -> u64 {
        self.held
    }

    /// In flight plus held: everything the budget is committed to.
    pub fn outstanding(&self) -> u64 {
        self.in_flight + self.held
    }

    /// The whole budget.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// The high watermark.
    pub fn high(&self) -> u64 {
        self.high
    }

    /// The low watermark.
    pub fn low(&self) -> u64 {
        self.low
    }
}
