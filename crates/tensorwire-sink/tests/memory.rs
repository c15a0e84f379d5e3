//! Memory budgets and the host sink, through the public API.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

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

/// Lands `bytes` in a host sink reserved through `budget`.
async fn land(budget: &MemoryBudget, bytes: &[u8]) -> Bytes {
    let reservation = budget.try_reserve(bytes.len() as u64).unwrap();
    let mut sink = HostSink::reserved(reservation).unwrap();
    let payload = Payload::from(Bytes::copy_from_slice(bytes));
    sink.write(0, payload, CreditPermit::unbudgeted(bytes.len() as u64))
        .await
        .unwrap();
    sink.finish().await.unwrap()
}

#[tokio::test]
async fn a_dropped_host_tensor_is_kept_for_the_next_of_its_length() {
    const MIB: u64 = 1 << 20;
    let budget = MemoryBudget::new("host", 8 * MIB).keeping_spares(2 * MIB);
    let first = land(&budget, &[1; MIB as usize]).await;
    let first_at = first.as_ptr();
    drop(first);
    // Kept, and counted apart from the tensors' reservations.
    let snapshot = budget.snapshot();
    assert_eq!((snapshot.reserved, snapshot.kept), (0, MIB));
    let second = land(&budget, &[2; MIB as usize]).await;
    assert_eq!(second.as_ptr(), first_at, "the same mapping, reused");
    assert!(
        second.iter().all(|&b| b == 2),
        "every byte is the new tensor's"
    );
    assert_eq!(budget.snapshot().kept, 0);
    assert_eq!(budget.snapshot().reserved, MIB, "counted once");
    assert_eq!(
        budget.snapshot().peak,
        2 * MIB,
        "the first and its kept buffer"
    );
    // Another length is not served from it.
    drop(second);
    let other = land(&budget, &[3; 2 * MIB as usize]).await;
    assert_eq!(budget.snapshot().kept, MIB);
    drop(other);
    assert_eq!(
        budget.snapshot().kept,
        MIB,
        "3 MiB would pass the 2 MiB kept at most"
    );
    drop(land(&budget, &[4; MIB as usize / 2]).await);
    assert_eq!(budget.snapshot().kept, 3 * MIB / 2);
    drop(land(&budget, &[4; 3 * MIB as usize / 4]).await);
    assert_eq!(
        budget.snapshot().kept,
        3 * MIB / 2,
        "nothing past the limit"
    );
}

#[tokio::test]
async fn kept_buffers_give_way_to_a_tensor_that_needs_the_memory() {
    const MIB: u64 = 1 << 20;
    let budget = MemoryBudget::new("host", 3 * MIB).keeping_spares(3 * MIB);
    drop(land(&budget, &[1; MIB as usize]).await);
    drop(land(&budget, &[1; 2 * MIB as usize]).await);
    assert_eq!(budget.snapshot().kept, 3 * MIB);
    // Neither fits beside the kept buffers: they are freed, at once and while waiting.
    let now = budget.try_reserve(3 * MIB).unwrap();
    assert_eq!(budget.snapshot().kept, 0);
    drop(now);
    drop(land(&budget, &[1; MIB as usize]).await);
    assert_eq!(budget.snapshot().kept, MIB);
    let waited = tokio::time::timeout(Duration::from_secs(1), budget.reserve(3 * MIB)).await;
    let held = waited.unwrap().unwrap();
    assert_eq!(budget.snapshot().reserved, 3 * MIB);
    assert_eq!((held.bytes(), budget.snapshot().kept), (3 * MIB, 0));
}

#[tokio::test]
async fn a_connection_share_keeps_buffers_in_its_whole_budget() {
    const MIB: u64 = 1 << 20;
    let whole = MemoryBudget::new("host", 4 * MIB).keeping_spares(MIB);
    let a = tensorwire_sink::MemoryShares::new("a", 50);
    let b = tensorwire_sink::MemoryShares::new("b", 50);
    drop(land(&a.of(&whole), &[5; MIB as usize]).await);
    assert_eq!(whole.snapshot().kept, MIB);
    let from_b = land(&b.of(&whole), &[6; MIB as usize]).await;
    assert_eq!(whole.snapshot().kept, 0, "b's tensor took a's kept buffer");
    assert_eq!(b.of(&whole).snapshot().reserved, MIB);
    assert_eq!(a.of(&whole).snapshot().reserved, 0);
    assert!(from_b.iter().all(|&x| x == 6));
}

#[tokio::test]
async fn a_reused_buffer_is_never_handed_over_partly_written() {
    const LEN: usize = 64 << 10;
    let budget = MemoryBudget::new("host", 1 << 20).keeping_spares(1 << 20);
    drop(land(&budget, &[9; LEN]).await);
    let mut sink = HostSink::reserved(budget.try_reserve(LEN as u64).unwrap()).unwrap();
    let half = Payload::from(Bytes::from(vec![1; LEN / 2]));
    sink.write(0, half, CreditPermit::unbudgeted(LEN as u64 / 2))
        .await
        .unwrap();
    let e = sink.finish().await.unwrap_err();
    assert_eq!(e.code, ErrorCode::SINK_FAILED);
    assert!(e.message.contains("reused"), "{e}");
}

fn party(last: u8) -> tensorwire_proto::Party {
    tensorwire_proto::Party::from(std::net::IpAddr::from([10, 0, 0, last]))
}

/// Spec §7.5: a peer's connections together hold at most `1/n` of a budget while `n` peers
/// are connected, however many connections it has; a lone peer may use the whole.
#[test]
fn peers_share_a_budget_equally_however_many_connections_each_has() {
    use tensorwire_sink::{MemoryShares, PeerShares};
    const MIB: u64 = 1 << 20;
    let whole = MemoryBudget::new("host", 8 * MIB);
    let peers = PeerShares::new();
    let hog = peers.join(party(1), || "the peer 10.0.0.1".into());
    let connections: Vec<MemoryShares> = (0..4)
        .map(|c| MemoryShares::new(format!("connection {c}"), 100).within(hog.shares()))
        .collect();
    // Alone, the peer may hold all of it.
    let all: Vec<_> = (0..8)
        .map(|i| connections[i % 4].of(&whole).try_reserve(MIB).unwrap())
        .collect();
    drop(all);
    let other = peers.join(party(2), || "the peer 10.0.0.2".into());
    assert_eq!(peers.peers(), 2);
    let held: Vec<_> = (0..4)
        .map(|c| connections[c].of(&whole).try_reserve(MIB).unwrap())
        .collect();
    let e = connections[0].of(&whole).try_reserve(MIB).unwrap_err();
    assert_eq!(e.code, ErrorCode::RESOURCE_EXHAUSTED);
    assert!(e.message.contains("10.0.0.1"), "{e}");
    // The other peer has its half.
    let theirs = MemoryShares::new("their connection", 100).within(other.shares());
    let half = theirs.of(&whole).try_reserve(4 * MIB).unwrap();
    assert_eq!(whole.snapshot().reserved, 8 * MIB);
    drop((held, half));
    assert_eq!(
        whole.snapshot().reserved,
        0,
        "every reservation counted back"
    );
}

/// Spec §7.5: a reservation held to its peer's share waits, and is admitted once a peer
/// leaves and the share grows.
#[tokio::test]
async fn a_peer_leaving_admits_what_waited_on_another_peers_share() {
    use tensorwire_sink::{MemoryShares, PeerShares};
    const MIB: u64 = 1 << 20;
    let whole = MemoryBudget::new("host", 4 * MIB);
    let peers = PeerShares::new();
    let first = peers.join(party(1), || "the peer 10.0.0.1".into());
    let second = peers.join(party(2), || "the peer 10.0.0.2".into());
    let shares = MemoryShares::new("a connection", 100).within(first.shares());
    let _held = shares.of(&whole).try_reserve(2 * MIB).unwrap();
    let budget = shares.of(&whole);
    let waiting = tokio::spawn(async move { budget.reserve(MIB).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!waiting.is_finished(), "held to its share");
    drop(second);
    let reserved = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("admitted once the other peer left")
        .unwrap()
        .unwrap();
    assert_eq!(reserved.bytes(), MIB);
}
