//! The allocator on the frame path: a METADATA frame claiming a 1 TB tensor is refused
//! without touching it, and a small tensor's frames are encoded in one allocation and decoded
//! without collecting their bodies.
//!
//! `allocation-counter` counts this thread's allocations while the closure runs.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use bytes::{Bytes, BytesMut};
use tensorwire_proto::frame::{Accept, Complete, Credit, Data, End, Metadata};
use tensorwire_proto::{DType, ErrorCode, Frame, FrameDecoder, Limits, TensorMeta, WireChunks};

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

/// A 4 KiB tensor sent early: METADATA, DATA and END.
fn small_tensor() -> Vec<Frame> {
    let meta = TensorMeta::new(vec![1024], DType::F32)
        .unwrap()
        .with_name("kv.block.7");
    vec![
        Metadata { meta }.into(),
        Data::new(0, vec![7u8; 4096]).into(),
        End { checksum: 0x1234 }.into(),
    ]
}

#[test]
fn a_small_tensors_frames_are_laid_out_in_one_allocation() {
    let frames = small_tensor();
    let mut chunks = None;
    let allocations = allocation_counter::measure(|| chunks = Some(WireChunks::encode(&frames)));
    let chunks = chunks.unwrap();
    assert_eq!(
        allocations.count_total, 1,
        "one buffer at its exact length: {allocations:?}"
    );
    assert_eq!(chunks.chunks().len(), 1, "one write of one chunk");
    let mut expected = BytesMut::new();
    frames.iter().for_each(|f| f.encode(&mut expected));
    assert_eq!(chunks.chunks()[0], expected.freeze());
}

#[test]
fn a_small_tensors_frames_decode_without_collecting_their_bodies() {
    let mut wire = BytesMut::new();
    small_tensor().iter().for_each(|f| f.encode(&mut wire));
    let mut decoder = FrameDecoder::new(Limits::default());
    decoder.push(wire.freeze());
    // METADATA owns its name and shape; DATA's payload and END are read in place.
    let mut metadata = None;
    let allocations = allocation_counter::measure(|| metadata = Some(decoder.next_frame()));
    assert!(matches!(metadata, Some(Ok(Some(Frame::Metadata(_))))));
    assert_eq!(
        allocations.count_total, 2,
        "name and shape: {allocations:?}"
    );
    for expected in ["DATA", "END"] {
        let mut frame = None;
        let allocations = allocation_counter::measure(|| frame = Some(decoder.next_frame()));
        let frame = frame.unwrap().unwrap().unwrap();
        assert_eq!(frame.frame_type().to_string(), expected);
        assert_eq!(
            allocations.count_total, 0,
            "{expected} allocated: {allocations:?}"
        );
    }
}

#[test]
fn the_receivers_replies_decode_without_allocating() {
    let replies: [Frame; 4] = [
        Accept {
            max_data_payload: 1 << 20,
        }
        .into(),
        Credit { bytes: 4 << 20 }.into(),
        Complete::default().into(),
        End { checksum: 9 }.into(),
    ];
    let wire: Bytes = replies.iter().flat_map(|f| f.to_bytes()).collect();
    let mut decoder = FrameDecoder::new(Limits::default());
    decoder.push(wire);
    for expected in replies {
        let mut frame = None;
        let allocations = allocation_counter::measure(|| frame = Some(decoder.next_frame()));
        assert_eq!(frame.unwrap().unwrap(), Some(expected.clone()));
        assert_eq!(
            allocations.count_total,
            0,
            "{} allocated: {allocations:?}",
            expected.frame_type()
        );
    }
}
