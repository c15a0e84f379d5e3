//! Memory budgets and the host sink, through the public API.

use std::time::Duration;

use bytes::Bytes;
use tensorwire_proto::{ErrorCode, Payload};
use tensorwire_sink::{CreditPermit, HostSink, MemoryBudget, Sink};

#[test]
fn a_reservation_larger_than_the_budget_is_refused_at_once() {
    let budget = MemoryBudget::new("host", 1 << 20);
    let err = budget.try_reserve(2 << 20).unwrap_err();
    assert_eq!(err.code, ErrorCode::RESOURCE_EXHAUSTED);
    assert!(err.message.contains("whole host memory budget"), "{err}");
    assert_eq!(budget.snapshot().reserved, 0);
}

#[test]
fn reservations_never_exceed_the_limit_and_come_back_on_drop() {
    let budget = MemoryBudget::new("cuda:0", 10);
    let a = budget.try_reserve(6).unwrap();
    let refused = budget.try_reserve(5).unwrap_err();
    assert!(refused.message.contains("6 of the 10"), "{refused}");
    let b = budget.try_reserve(4).unwrap();
    assert_eq!(budget.snapshot().reserved, 10);
    drop(a);
    drop(b);
    let snapshot = budget.snapshot();
    assert_eq!((snapshot.reserved, snapshot.peak), (0, 10));
}

#[tokio::test]
async fn a_waiting_reservation_is_admitted_when_memory_comes_back() {
    let budget = MemoryBudget::new("host", 8);
    let held = budget.try_reserve(8).unwrap();
    let waiter = tokio::spawn({
        let budget = budget.clone();
        async move { budget.reserve(5).await.map(|r| r.bytes()) }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(!waiter.is_finished(), "admitted while the budget was full");
    drop(held);
    assert_eq!(waiter.await.unwrap().unwrap(), 5);
    assert_eq!(
        budget.snapshot().reserved,
        0,
        "the waiter's reservation was dropped"
    );
}

/// A host tensor keeps its reservation for as long as its bytes are referenced, in both the
/// heap (small) and mapped (large) buffers.
#[tokio::test]
async fn landed_host_bytes_hold_their_reservation_until_dropped() {
    for len in [4096u64, 3 << 20] {
        let budget = MemoryBudget::new("host", 4 << 20);
        let mut sink = HostSink::reserved(budget.try_reserve(len).unwrap()).unwrap();
        let payload = Payload::from(Bytes::from(vec![7u8; 100]));
        sink.write(len - 100, payload, CreditPermit::unbudgeted(100))
            .await
            .unwrap();
        let bytes = sink.finish().await.unwrap();
        assert_eq!(bytes.len() as u64, len);
        assert!(bytes[..len as usize - 100].iter().all(|&b| b == 0));
        assert!(bytes[len as usize - 100..].iter().all(|&b| b == 7));
        let tail = bytes.slice(len as usize - 10..);
        drop(bytes);
        assert_eq!(
            budget.snapshot().reserved,
            len,
            "a slice still refers to it"
        );
        drop(tail);
        assert_eq!(budget.snapshot().reserved, 0);
    }
}

#[tokio::test]
async fn a_write_past_the_buffer_is_a_sink_failure() {
    let mut sink = HostSink::new(10).unwrap();
    let err = sink
        .write(
            8,
            Payload::from(Bytes::from_static(b"abcd")),
            CreditPermit::unbudgeted(4),
        )
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::SINK_FAILED);
}

/// A share holds at most its limit of the whole, counts against the whole, and a share
/// waiting on a full whole is admitted once another share gives memory back.
#[tokio::test]
async fn a_share_is_bounded_by_its_limit_and_by_the_whole() {
    let whole = MemoryBudget::new("host", 10);
    let first = whole.share("host (connection a)", 6);
    let second = whole.share("host (connection b)", 6);
    let a = first.try_reserve(6).unwrap();
    let over = first.try_reserve(1).unwrap_err();
    assert!(over.message.contains("connection a"), "{over}");
    assert_eq!(whole.snapshot().reserved, 6);
    // Four of the whole are left: the second share gets them, then waits on the whole.
    let b = second.try_reserve(4).unwrap();
    assert!(second.try_reserve(1).is_err(), "the whole is full");
    let waiter = tokio::spawn({
        let second = second.clone();
        async move { second.reserve(2).await.map(|r| r.bytes()) }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(!waiter.is_finished(), "admitted past the whole budget");
    assert_eq!(
        second.snapshot().reserved,
        4,
        "a waiter holds none of its share"
    );
    drop(a);
    assert_eq!(waiter.await.unwrap().unwrap(), 2);
    drop(b);
    assert_eq!(whole.snapshot().reserved, 0);
    assert_eq!(whole.snapshot().peak, 10);
    assert!(first.try_reserve(11).unwrap_err().message.contains("whole"));
    // One tensor larger than the share is admitted while the share holds nothing else;
    // another waits for it.
    let sole = first.try_reserve(9).unwrap();
    assert!(
        first.try_reserve(1).is_err(),
        "a second beside the sole one"
    );
    drop(sole);
    assert_eq!(whole.snapshot().reserved, 0);
}
