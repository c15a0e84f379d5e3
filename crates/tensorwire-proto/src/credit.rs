//! Byte-credit flow control with high and low watermarks (spec §7).

use std::collections::HashMap;
use std::net::IpAddr;

use crate::error::{ErrorCode, ProtocolError};

/// Who a grant goes to, for sharing the budget fairly between peers (spec §7.1): a peer's
/// address. Connections of one peer are one party.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Party(u128);

impl From<IpAddr> for Party {
    /// The party of the peer at `addr` (an IPv4 address and its IPv6-mapped form are one).
    fn from(addr: IpAddr) -> Self {
        let v6 = match addr.to_canonical() {
            IpAddr::V4(v4) => v4.to_ipv6_mapped(),
            IpAddr::V6(v6) => v6,
        };
        Party(u128::from(v6))
    }
}

impl Party {
    /// A party from its raw bits (the IPv6 form of its address), e.g. for a party that never
    /// joins: its grants are bounded by the budget alone.
    pub const fn from_bits(bits: u128) -> Self {
        Party(bits)
    }
}

/// A party's connections and the credit granted to them not yet arrived.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct PartyCredit {
    connections: usize,
    in_flight: u64,
    /// A grant was cut short by the party's fair share since its credit last came back.
    held_to_share: bool,
}

/// A receiver-wide byte budget shared by all its tensors (spec §7.1).
///
/// Bytes move through three states: *available* → [`grant`](Self::grant) → *in flight*
/// (granted, not yet arrived) → [`consume`](Self::consume) → *held* (arrived, not yet
/// durable in the sink) → [`release`](Self::release) → available again. Granted bytes a
/// tensor will never receive (it ended early) go back with [`revoke`](Self::revoke).
///
/// `outstanding = in_flight + held` never exceeds `budget`. When it reaches the high
/// watermark, granting pauses; it resumes once releases bring it down to the low watermark,
/// so credit flows in large batches rather than one small grant per release, or once
/// nothing is held below the high watermark (bytes in flight that never arrive cannot
/// hold the pause).
///
/// Parties that [`join`](Self::join) share the budget fairly: while more than one has joined,
/// each may have at most `budget / parties` in flight, so a peer whose granted bytes never
/// arrive holds at most its share. A lone party, and grants to a party that has not joined,
/// are bounded by the budget alone.
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
    parties: HashMap<Party, PartyCredit>,
    /// Credit came back to a party held to its share, or shares grew: its tensors may be
    /// granted again though the budget was never paused.
    share_reopened: bool,
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
            parties: HashMap::new(),
            share_reopened: false,
        })
    }

    /// A connection of `party` starts: the party shares the budget with the others that
    /// joined until its last connection [`leave`](Self::leave)s.
    pub fn join(&mut self, party: Party) {
        self.parties.entry(party).or_default().connections += 1;
    }

    /// A connection of `party` ended (after its credit was revoked).
    pub fn leave(&mut self, party: Party) {
        if let Some(credit) = self.parties.get_mut(&party) {
            credit.connections -= 1;
            if credit.connections == 0 {
                self.parties.remove(&party);
                // Every other party's share grew.
                self.share_reopened |= self.parties.values().any(|p| p.held_to_share);
            }
        }
    }

    /// Whether a party held to its fair share may be granted again since this was last
    /// asked (its credit arrived or came back, or a party left): the driver wakes the
    /// tensors waiting for credit, as it does when a pause ends.
    #[must_use = "on true, wake the tensors waiting for credit"]
    pub fn take_share_reopened(&mut self) -> bool {
        std::mem::take(&mut self.share_reopened)
    }

    /// Parties that joined and have a connection now.
    pub fn parties(&self) -> usize {
        self.parties.len()
    }

    /// Credit granted to `party` and not yet arrived (0 for one that has not joined).
    pub fn party_in_flight(&self, party: Party) -> u64 {
        self.parties
            .get(&party)
            .map_or(0, |credit| credit.in_flight)
    }

    /// Cuts `want` to what `party` may still be granted under its fair share.
    fn within_fair_share(&mut self, party: Party, want: u64) -> u64 {
        let parties = self.parties.len() as u64;
        let share = self.budget / parties.max(1);
        match self.parties.get_mut(&party) {
            Some(credit) if parties > 1 => {
                let left = share.saturating_sub(credit.in_flight);
                if want > left {
                    credit.held_to_share = true;
                }
                want.min(left)
            }
            _ => want,
        }
    }

    fn add_in_flight(&mut self, party: Party, n: u64) {
        self.in_flight += n;
        if let Some(credit) = self.parties.get_mut(&party) {
            credit.in_flight += n;
        }
    }

    /// Takes `n` (checked by the caller) out of flight, for the whole and for `party`.
    fn remove_in_flight(&mut self, party: Party, n: u64) {
        self.in_flight -= n;
        if let Some(credit) = self.parties.get_mut(&party) {
            // A party that left and joined again may return credit granted before.
            credit.in_flight = credit.in_flight.saturating_sub(n);
            if n > 0 && std::mem::take(&mut credit.held_to_share) {
                self.share_reopened = true;
            }
        }
    }

    /// Grants up to `want` bytes to `party`; returns how many were granted (0 while paused
    /// or while the party holds its fair share in flight).
    #[must_use = "granted bytes must be sent to the peer as CREDIT or revoked"]
    pub fn grant(&mut self, party: Party, want: u64) -> u64 {
        if self.paused {
            return 0;
        }
        let granted = want.min(self.budget - self.outstanding());
        let granted = self.within_fair_share(party, granted);
        self.add_in_flight(party, granted);
        if self.outstanding() >= self.high {
            self.paused = true;
        }
        granted
    }

    /// Grants up to `want` bytes of early credit (spec §7.6): only while outstanding stays at
    /// or below the low watermark, so early credit that peers leave unused can never keep
    /// granting paused, and within `party`'s fair share. Returns how many were granted.
    #[must_use = "granted bytes must be sent to the peer as EARLY_CREDIT or revoked"]
    pub fn grant_early(&mut self, party: Party, want: u64) -> u64 {
        if self.paused {
            return 0;
        }
        let granted = want.min(self.low.saturating_sub(self.outstanding()));
        let granted = self.within_fair_share(party, granted);
        self.add_in_flight(party, granted);
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
    pub fn revoke_early(&mut self, party: Party, n: u64) -> Result<bool, ProtocolError> {
        self.claim_early(n)?;
        self.revoke(party, n)
    }

    /// Early credit offered to peers and not yet claimed (part of [`in_flight`](Self::in_flight)).
    pub fn early_offered(&self) -> u64 {
        self.early
    }

    /// Records `n` bytes granted to `party` as arrived; more than is in flight is a
    /// CREDIT_VIOLATION.
    pub fn consume(&mut self, party: Party, n: u64) -> Result<(), ProtocolError> {
        if n > self.in_flight {
            return Err(ProtocolError::violation(
                ErrorCode::CREDIT_VIOLATION,
                format!(
                    "{n} bytes arrived with only {} granted and in flight",
                    self.in_flight
                ),
            ));
        }
        self.remove_in_flight(party, n);
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

    /// Returns `n` bytes granted to `party` that will never arrive (the tensor ended early).
    ///
    /// Returns `true` when this ended a pause.
    #[must_use = "on true, granting resumes: hand out credit again"]
    pub fn revoke(&mut self, party: Party, n: u64) -> Result<bool, ProtocolError> {
        if n > self.in_flight {
            return Err(ProtocolError::Misuse(
                "revoked more credit bytes than are in flight",
            ));
        }
        self.remove_in_flight(party, n);
        Ok(self.update_pause())
    }

    /// A pause ends at the low watermark, or below the high one once nothing is held: then
    /// no release is coming, and credit peers leave unused (granted bytes that do not
    /// arrive) must not stop granting to the others (spec §7.1).
    fn update_pause(&mut self) -> bool {
        let drained = self.held == 0 && self.outstanding() < self.high;
        let resumed = self.paused && (self.outstanding() <= self.low || drained);
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
