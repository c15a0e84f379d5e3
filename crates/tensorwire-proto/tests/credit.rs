//! CreditTracker: invariants under random operation sequences, and the watermarks.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use proptest::prelude::*;
use tensorwire_proto::{CreditTracker, ErrorCode};

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
                    let g = credit.grant(n);
                    if was_paused { prop_assert_eq!(g, 0); }
                    prop_assert!(g <= n);
                    in_flight += g;
                }
                Op::Consume(n) => match credit.consume(n) {
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
                Op::Revoke(n) => match credit.revoke(n) {
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
    assert_eq!(credit.grant(50), 50);
    assert!(!credit.should_pause());
    assert_eq!(credit.grant(40), 40); // outstanding 90 ≥ high 80
    assert!(credit.should_pause());
    assert_eq!(credit.grant(10), 0, "no grants while paused");
    credit.consume(90).unwrap();
    assert!(!credit.release(50).unwrap(), "40 outstanding is above low");
    assert!(credit.should_pause());
    assert!(
        credit.release(20).unwrap(),
        "20 outstanding reaches low: resume"
    );
    assert_eq!(credit.grant(1000), 80, "capped by the budget");
}

#[test]
fn revoked_grants_return_to_the_budget() {
    let mut credit = CreditTracker::new(64, 64, 0).unwrap();
    assert_eq!(credit.grant(64), 64);
    credit.consume(10).unwrap();
    let _ = credit.revoke(54).unwrap();
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
