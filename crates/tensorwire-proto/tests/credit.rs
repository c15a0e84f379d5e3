//! CreditTracker: invariants under random operation sequences, and the watermarks.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use proptest::prelude::*;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use tensorwire_proto::{CreditTracker, ErrorCode, Party};

/// A party that never joined: the budget alone bounds its grants.
const ANY: Party = Party::from_bits(0);

fn peer(last: u8) -> Party {
    Party::from(IpAddr::V4(Ipv4Addr::new(10, 0, 0, last)))
}

#[derive(Debug, Clone)]
enum Op {
    Grant(u64),
    Consume(u64),
    Release(u64),
    Revoke(u64),
}

fn op() -> impl Strategy<Value = Op> {
    let n = prop_oneof![0u64..5000, Just(u64::MAX), Just(0)];
    prop_oneof![
        n.clone().prop_map(Op::Grant),
        n.clone().prop_map(Op::Consume),
        n.clone().prop_map(Op::Release),
        n.prop_map(Op::Revoke),
    ]
}

proptest! {
    #[test]
    fn invariants_hold_under_any_sequence(
        budget in 1u64..20_000,
        high_frac in 0.0f64..=1.0,
        low_frac in 0.0f64..=1.0,
        ops in proptest::collection::vec(op(), 0..200),
    ) {
        let high = (budget as f64 * high_frac) as u64;
        let low = (high as f64 * low_frac) as u64;
        let mut credit = CreditTracker::new(budget, high, low).unwrap();
        // A model of the three buckets, kept independently.
        let (mut in_flight, mut held) = (0u64, 0u64);
        for op in ops {
            let was_paused = credit.should_pause();
            match op {
                Op::Grant(n) => {
                    let g = credit.grant(ANY, n);
                    if was_paused { prop_assert_eq!(g, 0); }
                    prop_assert!(g <= n);
                    in_flight += g;
                }
                Op::Consume(n) => match credit.consume(ANY, n) {
                    Ok(()) => { in_flight -= n; held += n; }
                    Err(e) => {
                        prop_assert!(n > in_flight);
                        prop_assert_eq!(e.code(), ErrorCode::CREDIT_VIOLATION);
                    }
                },
                Op::Release(n) => match credit.release(n) {
                    Ok(resumed) => {
                        held -= n;
                        prop_assert_eq!(resumed, was_paused && !credit.should_pause());
                    }
                    Err(_) => prop_assert!(n > held),
                },
                Op::Revoke(n) => match credit.revoke(ANY, n) {
                    Ok(_) => in_flight -= n,
                    Err(_) => prop_assert!(n > in_flight),
                },
            }
            prop_assert_eq!(credit.in_flight(), in_flight);
            prop_assert_eq!(credit.held(), held);
            prop_assert!(credit.outstanding() <= budget);
            let outstanding = credit.outstanding();
            // Hysteresis: at or above high (and above low) granting is paused; a pause
            // lasts until outstanding falls to low.
            if outstanding >= high && outstanding > low {
                prop_assert!(credit.should_pause(), "{outstanding} outstanding, not paused");
            }
            if credit.should_pause() {
                prop_assert!(outstanding > low || outstanding >= high);
                // Nothing held means no release is coming: only at high does it stay paused.
                if credit.held() == 0 {
                    prop_assert!(outstanding >= high, "paused on credit in flight alone");
                }
                prop_assert_eq!(credit.available(), 0);
            } else {
                prop_assert_eq!(credit.available(), budget - outstanding);
            }
        }
    }
}

#[test]
fn granting_pauses_at_high_and_resumes_at_low() {
    let mut credit = CreditTracker::new(100, 80, 20).unwrap();
    assert_eq!(credit.grant(ANY, 50), 50);
    assert!(!credit.should_pause());
    assert_eq!(credit.grant(ANY, 40), 40); // outstanding 90 ≥ high 80
    assert!(credit.should_pause());
    assert_eq!(credit.grant(ANY, 10), 0, "no grants while paused");
    credit.consume(ANY, 90).unwrap();
    assert!(!credit.release(50).unwrap(), "40 outstanding is above low");
    assert!(credit.should_pause());
    assert!(
        credit.release(20).unwrap(),
        "20 outstanding reaches low: resume"
    );
    assert_eq!(credit.grant(ANY, 1000), 80, "capped by the budget");
}

#[test]
fn credit_that_never_arrives_does_not_hold_a_pause() {
    let mut credit = CreditTracker::new(100, 80, 20).unwrap();
    credit.join(peer(1));
    credit.join(peer(2));
    // The first peer's 50 stay in flight for good; the second's 40 arrive.
    assert_eq!(credit.grant(peer(1), 50), 50);
    assert_eq!(credit.grant(peer(2), 40), 40);
    assert!(credit.should_pause());
    credit.consume(peer(2), 40).unwrap();
    assert!(
        !credit.release(30).unwrap(),
        "more is held: its release is coming"
    );
    assert!(
        credit.release(10).unwrap(),
        "nothing held: granting resumes at 50 outstanding, above low"
    );
    assert_eq!(credit.grant(peer(2), 60), 50, "up to its share");
}

#[test]
fn revoked_grants_return_to_the_budget() {
    let mut credit = CreditTracker::new(64, 64, 0).unwrap();
    assert_eq!(credit.grant(ANY, 64), 64);
    credit.consume(ANY, 10).unwrap();
    let _ = credit.revoke(ANY, 54).unwrap();
    let _ = credit.release(10).unwrap();
    assert_eq!(credit.outstanding(), 0);
    assert_eq!(credit.available(), 64);
}

#[test]
fn bad_watermarks_are_refused() {
    assert!(CreditTracker::new(0, 0, 0).is_err());
    assert!(CreditTracker::new(10, 11, 0).is_err());
    assert!(CreditTracker::new(10, 5, 6).is_err());
}

#[test]
fn a_lone_party_may_use_the_whole_budget() {
    let mut credit = CreditTracker::new(100, 100, 0).unwrap();
    credit.join(peer(1));
    credit.join(peer(1)); // a second connection of the same peer
    assert_eq!(credit.parties(), 1);
    assert_eq!(credit.grant(peer(1), 100), 100);
}

#[test]
fn parties_keep_to_equal_shares_of_credit_in_flight() {
    let mut credit = CreditTracker::new(100, 100, 100).unwrap();
    credit.join(peer(1));
    credit.join(peer(2));
    // The first peer's grants that never arrive hold half the budget at most.
    assert_eq!(credit.grant(peer(1), 80), 50);
    assert_eq!(credit.grant(peer(1), 10), 0, "held to its share");
    assert_eq!(credit.party_in_flight(peer(1)), 50);
    assert_eq!(
        credit.grant(peer(2), 50),
        50,
        "the other peer gets its share"
    );
    assert!(!credit.take_share_reopened());
    // Bytes arriving bring the first peer under its share again: its tensors are woken.
    credit.consume(peer(1), 20).unwrap();
    assert!(credit.take_share_reopened());
    assert!(!credit.take_share_reopened(), "said once");
    let _ = credit.release(20).unwrap();
    assert_eq!(credit.grant(peer(1), 80), 20);
}

#[test]
fn a_party_leaving_grows_the_others_shares() {
    let mut credit = CreditTracker::new(90, 90, 0).unwrap();
    for last in 1..=3 {
        credit.join(peer(last));
    }
    assert_eq!(credit.grant(peer(1), 90), 30);
    credit.join(peer(3)); // two connections of the third peer
    credit.leave(peer(3));
    assert!(
        !credit.take_share_reopened(),
        "the third peer still has a connection"
    );
    credit.leave(peer(3));
    assert_eq!(credit.parties(), 2);
    assert!(
        credit.take_share_reopened(),
        "the first peer was held to its share"
    );
    assert_eq!(credit.grant(peer(1), 90), 15, "a share of 45 now");
    // Early credit keeps to the share too; revoking it returns it to the party.
    let mut early = CreditTracker::new(90, 90, 90).unwrap();
    early.join(peer(1));
    early.join(peer(2));
    assert_eq!(early.grant_early(peer(1), 90), 45);
    let _ = early.revoke_early(peer(1), 45).unwrap();
    assert_eq!(early.party_in_flight(peer(1)), 0);
}

#[test]
fn an_ipv4_peer_and_its_mapped_form_are_one_party() {
    let v4 = Ipv4Addr::new(192, 0, 2, 7);
    assert_eq!(
        Party::from(IpAddr::V4(v4)),
        Party::from(IpAddr::V6(v4.to_ipv6_mapped()))
    );
    assert_ne!(
        Party::from(IpAddr::V4(v4)),
        Party::from(IpAddr::V6(Ipv6Addr::LOCALHOST))
    );
}
