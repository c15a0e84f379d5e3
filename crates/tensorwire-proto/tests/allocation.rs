//! A METADATA frame claiming a 1 TB tensor is refused without touching the allocator.
//!
//! `allocation-counter` counts this thread's allocations while the closure runs.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use tensorwire_proto::{ErrorCode, FrameDecoder, Limits};

#[test]
fn a_one_terabyte_claim_is_refused_without_allocating() {
    let mut body = Vec::new();
    body.extend_from_slice(&(1u64 << 40).to_le_bytes()); // byte_len: 1 TiB
    body.extend_from_slice(&[2, 1, 0, 0, 0, 1]); // U8, CRC32C, any device, 1 dim
    body.extend_from_slice(&1u16.to_le_bytes()); // name_len
    body.extend_from_slice(&0u16.to_le_bytes()); // attr_count
    body.extend_from_slice(&(1u64 << 40).to_le_bytes()); // dims[0]
    body.push(b'x');
    let mut frame = vec![0x01];
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(&body);

    let mut decoder = FrameDecoder::new(Limits::default());
    decoder.push(frame.into());
    let mut result = None;
    let allocations = allocation_counter::measure(|| result = Some(decoder.next_frame()));

    assert_eq!(
        result.unwrap().unwrap_err().code(),
        ErrorCode::TENSOR_TOO_LARGE
    );
    assert_eq!(
        allocations.count_total, 0,
        "refusing the claim allocated: {allocations:?}"
    );
}

/// The counter sees allocations, so the zero above means something.
#[test]
fn the_counter_counts() {
    let allocations = allocation_counter::measure(|| drop(std::hint::black_box(vec![0u8; 100])));
    assert_eq!(allocations.count_total, 1);
}
