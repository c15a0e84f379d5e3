//! A METADATA frame claiming a 1 TB tensor is refused without touching the allocator.
//!
//! This binary counts every allocation with a global allocator; it holds one test so no
//! other thread allocates while it measures.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use tensorwire_proto::{ErrorCode, FrameDecoder, Limits};

struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts calls.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::SeqCst);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

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
    let before = ALLOCATIONS.load(Ordering::SeqCst);
    let result = decoder.next_frame();
    let allocations = ALLOCATIONS.load(Ordering::SeqCst) - before;

    assert_eq!(result.unwrap_err().code(), ErrorCode::TENSOR_TOO_LARGE);
    assert_eq!(
        allocations, 0,
        "refusing the claim allocated {allocations} times"
    );
}
