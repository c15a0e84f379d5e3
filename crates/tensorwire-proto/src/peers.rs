//! Caps on what each peer, and all peers together, may hold at once (spec §10): one peer
//! reaching its cap leaves room for the others.

use std::collections::HashMap;
use std::fmt;
use std::hash::Hash;

/// How many of one kind of thing (connections, split assemblies) each peer holds, against a
/// cap per peer and a cap in all.
#[derive(Clone, Debug)]
pub struct PeerCaps<K> {
    per_peer: usize,
    total: usize,
    held: HashMap<K, usize>,
    held_total: usize,
}

/// A cap that admitting one more would break.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CapExceeded {
    /// The peer holds its cap already.
    Peer {
        /// What the peer holds.
        held: usize,
        /// Its cap.
        cap: usize,
    },
    /// All peers together hold the cap in all.
    Total {
        /// What all peers hold.
        held: usize,
        /// The cap in all.
        cap: usize,
    },
}

impl fmt::Display for CapExceeded {
    /// "this peer holds 64, its cap" / "all peers hold 1024, the cap in all".
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CapExceeded::Peer { held, cap } => {
                write!(
                    f,
                    "this peer holds {held} already (the cap per peer is {cap})"
                )
            }
            CapExceeded::Total { held, cap } => {
                write!(f, "all peers hold {held} already (the cap in all is {cap})")
            }
        }
    }
}

impl<K: Hash + Eq + Clone> PeerCaps<K> {
    /// Caps of `per_peer` for each peer and `total` in all.
    pub fn new(per_peer: usize, total: usize) -> Self {
        Self {
            per_peer,
            total,
            held: HashMap::new(),
            held_total: 0,
        }
    }

    /// Counts one more for `peer`, unless a cap forbids it; the peer's cap is judged first,
    /// so a peer at its own cap is told so whatever the others hold.
    pub fn admit(&mut self, peer: &K) -> Result<(), CapExceeded> {
        self.within_peer_cap(peer)?;
        if self.held_total >= self.total {
            return Err(CapExceeded::Total {
                held: self.held_total,
                cap: self.total,
            });
        }
        self.count(peer);
        Ok(())
    }

    /// Counts one more for `peer` beyond the cap in all (never beyond its own), where the
    /// caller has just ended one of another peer's that will be counted back soon.
    pub fn admit_in_place_of_another(&mut self, peer: &K) -> Result<(), CapExceeded> {
        self.within_peer_cap(peer)?;
        self.count(peer);
        Ok(())
    }

    fn within_peer_cap(&self, peer: &K) -> Result<(), CapExceeded> {
        let held = self.held(peer);
        if held >= self.per_peer {
            return Err(CapExceeded::Peer {
                held,
                cap: self.per_peer,
            });
        }
        Ok(())
    }

    fn count(&mut self, peer: &K) {
        *self.held.entry(peer.clone()).or_default() += 1;
        self.held_total += 1;
    }

    /// Counts one fewer for `peer` (one it was admitted); a peer that holds none is
    /// forgotten, so the map never outgrows what is held.
    pub fn release(&mut self, peer: &K) {
        let Some(held) = self.held.get_mut(peer) else {
            return;
        };
        *held -= 1;
        self.held_total -= 1;
        if *held == 0 {
            self.held.remove(peer);
        }
    }

    /// What `peer` holds.
    pub fn held(&self, peer: &K) -> usize {
        self.held.get(peer).copied().unwrap_or(0)
    }

    /// What all peers hold.
    pub fn held_total(&self) -> usize {
        self.held_total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_at_its_cap_leaves_room_for_others_until_the_total() {
        let mut caps = PeerCaps::new(2, 3);
        assert_eq!(caps.admit(&"a"), Ok(()));
        assert_eq!(caps.admit(&"a"), Ok(()));
        assert_eq!(caps.admit(&"a"), Err(CapExceeded::Peer { held: 2, cap: 2 }));
        assert_eq!(caps.admit(&"b"), Ok(()));
        assert_eq!(
            caps.admit(&"c"),
            Err(CapExceeded::Total { held: 3, cap: 3 })
        );
        caps.release(&"a");
        assert_eq!(caps.admit(&"c"), Ok(()));
        assert_eq!(caps.held(&"a"), 1);
        assert_eq!(caps.held_total(), 3);
    }

    #[test]
    fn releases_are_counted_back_and_forgotten() {
        let mut caps = PeerCaps::new(1, 1);
        caps.admit(&7).unwrap();
        caps.release(&7);
        caps.release(&7); // Not held: nothing to count back.
        assert_eq!(caps.held_total(), 0);
        assert!(caps.held.is_empty());
        caps.admit(&8).unwrap();
    }
}
