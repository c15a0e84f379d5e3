//! Spec §8 and §10 defences without sockets: limits judged from METADATA's fixed part, the
//! failed-stream budget with a fake clock, and the destination-memory ledger.

use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use tensorwire_proto::{Admission, ErrorCode, FloodBudget, FrameDecoder, Limits, MemoryLedger};

/// The header and fixed part of a METADATA whose body claims `body_len` bytes.
fn metadata_prefix(byte_len: u64, body_len: u32) -> Bytes {
    let mut b = BytesMut::new();
    b.put_u8(0x01);
    b.put_u32_le(body_len);
    b.put_u64_le(byte_len);
    b.put_u8(1); // dtype U8
    b.put_u8(1); // CRC-32C
    b.put_u8(0); // device kind: none
    b.put_u16_le(0);
    b.put_u8(1); // ndim
    b.put_u16_le(0); // name length
    b.put_u16_le(0); // attribute count
    b.freeze()
}

/// The fake clock's origin: the tests move time by adding durations to it, never by reading
/// the clock again.
#[allow(clippy::disallowed_methods)] // The one read of the real clock, as the origin.
fn fake_clock_start() -> Instant {
    Instant::now()
}

#[test]
fn a_1_tb_metadata_is_refused_from_its_first_23_bytes() {
    let mut decoder = FrameDecoder::new(Limits::default());
    // The body claims 60 000 bytes; only the fixed part has arrived.
    decoder.push(metadata_prefix(1 << 40, 60_000));
    let err = decoder.next_frame().unwrap_err();
    assert_eq!(err.code(), ErrorCode::TENSOR_TOO_LARGE, "{err}");
}

#[test]
fn a_metadata_within_limits_waits_for_its_body() {
    let mut decoder = FrameDecoder::new(Limits::default());
    decoder.push(metadata_prefix(1 << 20, 60_000));
    assert!(decoder.next_frame().unwrap().is_none());
}

#[test]
fn the_flood_budget_allows_a_burst_then_refuses() {
    let start = fake_clock_start();
    let mut budget = FloodBudget::new(5, Duration::from_secs(10));
    for _ in 0..5 {
        budget.record_failure(start, ErrorCode::CANCELLED).unwrap();
    }
    let exceeded = budget
        .record_failure(start, ErrorCode::CANCELLED)
        .unwrap_err();
    assert_eq!(exceeded.burst, 5);
    assert_eq!(exceeded.code, ErrorCode::CANCEL_FLOOD);
    // A timed-out stream that runs it dry names the timeout instead.
    let timed_out = budget
        .record_failure(start, ErrorCode::PROGRESS_TIMEOUT)
        .unwrap_err();
    assert_eq!(timed_out.code, ErrorCode::PROGRESS_TIMEOUT);
}

#[test]
fn the_flood_budget_refills_at_its_rate_and_no_faster() {
    let start = fake_clock_start();
    let mut budget = FloodBudget::new(10, Duration::from_secs(10)); // one stream per second
    for _ in 0..10 {
        budget.record_failure(start, ErrorCode::CANCELLED).unwrap();
    }
    // 1.5 s later one failure has been earned back, not two.
    let later = start + Duration::from_millis(1500);
    budget.record_failure(later, ErrorCode::CANCELLED).unwrap();
    assert!(budget.record_failure(later, ErrorCode::CANCELLED).is_err());
    // A peer failing at exactly the refill rate is never cut off...
    let mut now = later;
    for _ in 0..100 {
        now += Duration::from_secs(1);
        budget.record_failure(now, ErrorCode::CANCELLED).unwrap();
    }
    // ...and a long quiet spell refills only up to the burst.
    now += Duration::from_secs(3600);
    for _ in 0..10 {
        budget.record_failure(now, ErrorCode::CANCELLED).unwrap();
    }
    assert!(budget.record_failure(now, ErrorCode::CANCELLED).is_err());
}

/// A flood spread across window boundaries is still caught: a fixed window that resets
/// would let 2 × burst through around each boundary.
#[test]
fn a_flood_straddling_windows_is_caught() {
    let start = fake_clock_start();
    let mut budget = FloodBudget::new(100, Duration::from_secs(10));
    let mut refused_at = None;
    for i in 0..1000u64 {
        // 50 failures a second: five times the refill rate.
        let now = start + Duration::from_millis(i * 20);
        if budget.record_failure(now, ErrorCode::CANCELLED).is_err() {
            refused_at = Some(i);
            break;
        }
    }
    let refused_at = refused_at.expect("the flood was caught");
    assert!(
        (100..=130).contains(&refused_at),
        "caught after {refused_at}"
    );
}

#[test]
fn the_memory_ledger_admits_within_its_limit_only() {
    let mut ledger = MemoryLedger::new(100);
    assert_eq!(ledger.reserve(101), Admission::TooLarge);
    assert_eq!(ledger.reserve(60), Admission::Reserved);
    assert_eq!(ledger.reserve(41), Admission::Wait);
    assert_eq!(ledger.reserve(40), Admission::Reserved);
    assert_eq!(ledger.reserved(), 100);
    ledger.release(60);
    assert_eq!(ledger.reserve(61), Admission::Wait);
    assert_eq!(ledger.reserve(60), Admission::Reserved);
    assert_eq!(ledger.peak(), 100);
}

/// Spec §7.5: a share admits at most its limit, or one request above it while it holds
/// nothing else; what is above the limit then waits, never is refused outright.
#[test]
fn a_share_admits_one_request_above_its_limit_alone() {
    let mut share = MemoryLedger::share(100);
    assert_eq!(share.reserve(60), Admission::Reserved);
    assert_eq!(share.reserve(150), Admission::Wait, "not beside another");
    assert_eq!(share.reserve(41), Admission::Wait);
    share.release(60);
    assert_eq!(share.reserve(150), Admission::Reserved, "alone it may");
    assert_eq!(share.reserve(1), Admission::Wait, "nothing beside it");
    share.release(150);
    assert_eq!(share.reserve(100), Admission::Reserved);
    assert_eq!((share.reserved(), share.peak()), (100, 150));
}
