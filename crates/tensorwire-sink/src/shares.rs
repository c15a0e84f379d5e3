//! Shares of memory budgets (spec §7.5): each connection's, within its peer's, so that
//! neither one connection nor one peer with many connections can hold what the others need.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tensorwire_proto::Party;

use crate::memory::MemoryBudget;

/// One party's shares of any number of memory budgets (spec §7.5): a share is made the first
/// time a budget is asked for and lives as long as the party (and its reservations). A
/// connection's shares are each a percentage of the whole budget and, when the connection
/// is [`within`](Self::within) its peer's shares, held within the peer's share as well.
/// Cheap to clone.
#[derive(Clone, Debug)]
pub struct MemoryShares {
    inner: Arc<SharesInner>,
}

#[derive(Debug)]
struct SharesInner {
    /// Who holds the shares, for messages: "the connection from 10.0.0.7:50123".
    holder: String,
    /// The fraction of each whole budget a share holds at most.
    fraction: Mutex<Fraction>,
    /// The shares this party's are held within (its peer's), if any.
    within: Option<MemoryShares>,
    /// Each share made so far, with the whole budget it is a share of.
    shares: Mutex<Vec<(MemoryBudget, MemoryBudget)>>,
}

/// `numerator / denominator` of a whole budget.
#[derive(Clone, Copy, Debug)]
struct Fraction {
    numerator: u64,
    denominator: u64,
}

impl Fraction {
    fn of(self, limit: u64) -> u64 {
        let part = u128::from(limit) * u128::from(self.numerator) / u128::from(self.denominator);
        u64::try_from(part).unwrap_or(u64::MAX)
    }
}

impl MemoryShares {
    /// Shares for `holder` of `percent` (1 to 100) of each budget.
    pub fn new(holder: impl Into<String>, percent: u64) -> Self {
        Self::with_fraction(holder.into(), percent.clamp(1, 100), 100, None)
    }

    fn with_fraction(
        holder: String,
        numerator: u64,
        denominator: u64,
        within: Option<MemoryShares>,
    ) -> Self {
        Self {
            inner: Arc::new(SharesInner {
                holder,
                fraction: Mutex::new(Fraction {
                    numerator,
                    denominator,
                }),
                within,
                shares: Mutex::new(Vec::new()),
            }),
        }
    }

    /// These shares (a connection's), each held within the same budget's share of `peer`:
    /// a reservation counts against the connection's, the peer's and the whole budget.
    pub fn within(self, peer: &MemoryShares) -> Self {
        let fraction = *lock(&self.inner.fraction);
        Self::with_fraction(
            self.inner.holder.clone(),
            fraction.numerator,
            fraction.denominator,
            Some(peer.clone()),
        )
    }

    /// The holder's share of `whole`: reservations through it count against both, and hold
    /// at most the holder's fraction of `whole`'s limit.
    pub fn of(&self, whole: &MemoryBudget) -> MemoryBudget {
        let mut shares = lock(&self.inner.shares);
        if let Some((_, share)) = shares.iter().find(|(of, _)| of.same_as(whole)) {
            return share.clone();
        }
        let limit = lock(&self.inner.fraction).of(whole.limit());
        let what = format!("{} (the share of {})", whole.what(), self.inner.holder);
        let share = match &self.inner.within {
            Some(peer) => peer.of(whole).share_of_at_most(what, limit),
            None => whole.share(what, limit),
        };
        shares.push((whole.clone(), share.clone()));
        share
    }

    /// Every share now holds at most `numerator / denominator` of its whole budget.
    fn set_fraction(&self, numerator: u64, denominator: u64) {
        let fraction = Fraction {
            numerator,
            denominator: denominator.max(1),
        };
        *lock(&self.inner.fraction) = fraction;
        for (whole, share) in lock(&self.inner.shares).iter() {
            share.set_limit(fraction.of(whole.limit()));
        }
    }
}

/// Peers sharing memory budgets fairly (spec §7.5): while `n` peers have a connection, each
/// peer's connections together hold at most `1/n` of each budget (one reservation larger
/// than that while the peer holds nothing else in the budget), so a peer with many
/// connections holds no more than a peer with one. A lone peer may use the whole.
#[derive(Clone, Debug, Default)]
pub struct PeerShares {
    peers: Arc<Mutex<HashMap<Party, Member>>>,
}

#[derive(Debug)]
struct Member {
    connections: usize,
    shares: MemoryShares,
}

/// A connection's membership of its peer's shares: the peer stops counting it when dropped.
#[derive(Debug)]
pub struct PeerMembership {
    peers: PeerShares,
    party: Party,
    shares: MemoryShares,
}

impl PeerMembership {
    /// The peer's shares, for a connection's shares to be held [`within`](MemoryShares::within).
    pub fn shares(&self) -> &MemoryShares {
        &self.shares
    }
}

impl Drop for PeerMembership {
    fn drop(&mut self) {
        self.peers.leave(self.party);
    }
}

impl PeerShares {
    /// No peers yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// A connection of `party` (named `holder` in messages, "the peer 10.0.0.7") starts;
    /// the peer's shares are made or found, and every peer's shrink if it is a new peer.
    pub fn join(&self, party: Party, holder: impl FnOnce() -> String) -> PeerMembership {
        let mut peers = lock(&self.peers);
        let known = peers.len();
        let member = peers.entry(party).or_insert_with(|| Member {
            connections: 0,
            shares: MemoryShares::with_fraction(holder(), 1, 1, None),
        });
        member.connections += 1;
        let shares = member.shares.clone();
        if peers.len() != known {
            Self::reshare(&peers);
        }
        PeerMembership {
            peers: self.clone(),
            party,
            shares,
        }
    }

    fn leave(&self, party: Party) {
        let mut peers = lock(&self.peers);
        let Some(member) = peers.get_mut(&party) else {
            return;
        };
        member.connections -= 1;
        if member.connections == 0 {
            peers.remove(&party);
            Self::reshare(&peers);
        }
    }

    /// Peers with a connection now.
    pub fn peers(&self) -> usize {
        lock(&self.peers).len()
    }

    fn reshare(peers: &HashMap<Party, Member>) {
        let n = peers.len() as u64;
        for member in peers.values() {
            member.shares.set_fraction(1, n);
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Each lock covers a plain read or write: nothing a panic could leave half done.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
