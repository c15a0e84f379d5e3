//! Frame codec: proptest round trips for every frame type, zero-copy payloads, limits
//! checked before the body is awaited.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use bytes::{Bytes, BytesMut};
use proptest::prelude::*;
use tensorwire_proto::Receipt;
use tensorwire_proto::frame::{Accept, Cancel, Complete, Credit, Data, End, Reject};
use tensorwire_proto::{
    Blame, ChecksumAlgorithm, DType, Device, ErrorCode, Frame, FrameDecoder, INLINE_PAYLOAD_MAX,
    Limits, TensorMeta, WireChunks,
};

fn dtype() -> impl Strategy<Value = DType> {
    proptest::sample::select(DType::ALL)
}

fn device() -> impl Strategy<Value = Device> {
    prop_oneof![
        Just(Device::Any),
        Just(Device::Host),
        any::<u16>().prop_map(Device::Cuda)
    ]
}

fn meta() -> impl Strategy<Value = TensorMeta> {
    (
        proptest::collection::vec(0u64..1000, 0..6),
        dtype(),
        device(),
        ".{0,40}",
        proptest::collection::vec((".{0,20}", ".{0,60}"), 0..5),
    )
        .prop_map(|(shape, dtype, device, name, attrs)| {
            attrs.into_iter().fold(
                TensorMeta::new(shape, dtype)
                    .unwrap()
                    .with_device(device)
                    .with_name(name),
                |m, (k, v)| m.with_attribute(k, v),
            )
        })
}

fn code() -> impl Strategy<Value = ErrorCode> {
    prop_oneof![
        proptest::sample::select(ErrorCode::ALL),
        any::<u32>().prop_map(ErrorCode)
    ]
}

fn frame() -> impl Strategy<Value = Frame> {
    prop_oneof![
        meta().prop_map(Frame::from),
        (
            any::<u64>(),
            proptest::collection::vec(any::<u8>(), 1..3000)
        )
            .prop_map(|(offset, bytes)| Data::new(offset, bytes).into()),
        any::<u64>().prop_map(|checksum| End { checksum }.into()),
        (code(), ".{0,100}").prop_map(|(c, r)| Cancel::new(c, r).into()),
        (1u32..).prop_map(|max_data_payload| Accept { max_data_payload }.into()),
        (code(), ".{0,100}").prop_map(|(c, r)| Reject::new(c, r).into()),
        any::<u64>().prop_map(|bytes| Credit { bytes }.into()),
        proptest::collection::vec(("[a-z.]{0,40}", ".{0,60}"), 0..8).prop_map(|entries| {
            let receipt = entries
                .into_iter()
                .fold(Receipt::new(), |receipt, (k, v)| receipt.with(k, v));
            Complete { receipt }.into()
        }),
    ]
}

/// DATA on either side of the size that [`WireChunks`] copies in beside the headers.
fn large_data() -> impl Strategy<Value = Frame> {
    (
        any::<u64>(),
        INLINE_PAYLOAD_MAX - 2..INLINE_PAYLOAD_MAX + 3000,
        any::<u8>(),
    )
        .prop_map(|(offset, len, byte)| Data::new(offset, vec![byte; len]).into())
}

fn decode_all(decoder: &mut FrameDecoder) -> Vec<Frame> {
    std::iter::from_fn(|| decoder.next_frame().unwrap()).collect()
}

proptest! {
    #[test]
    fn frames_round_trip_through_any_split(frames in proptest::collection::vec(frame(), 1..8), cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..6)) {
        let mut wire = BytesMut::new();
        frames.iter().for_each(|f| f.encode(&mut wire));
        let wire = wire.freeze();
        let mut points: Vec<usize> = cuts.iter().map(|i| i.index(wire.len())).collect();
        points.extend([0, wire.len()]);
        points.sort_unstable();
        // Random shapes reach terabytes; the size policy is tested elsewhere.
        let mut limits = Limits::default();
        limits.max_tensor_len = u64::MAX;
        let mut decoder = FrameDecoder::new(limits);
        let mut decoded = Vec::new();
        for w in points.windows(2) {
            decoder.push(wire.slice(w[0]..w[1]));
            decoded.extend(decode_all(&mut decoder));
        }
        decoder.finish().unwrap();
        prop_assert_eq!(decoded, frames);
    }

    #[test]
    fn wire_chunks_carry_the_frames_in_order(frames in proptest::collection::vec(prop_oneof![frame(), large_data()], 0..8)) {
        let mut expected = BytesMut::new();
        frames.iter().for_each(|f| f.encode(&mut expected));
        let chunks = WireChunks::encode(&frames);
        let written: Vec<u8> = chunks.chunks().iter().flat_map(|c| c.iter().copied()).collect();
        prop_assert_eq!(written, expected.to_vec());
        prop_assert_eq!(chunks.is_empty(), frames.is_empty());
        // A payload past a page goes as the caller's own bytes, not a copy.
        for payload in frames.iter().filter_map(Frame::payload).filter(|p| p.len() > INLINE_PAYLOAD_MAX) {
            let first = payload.parts()[0].as_ptr();
            prop_assert!(chunks.chunks().iter().any(|c| c.as_ptr() == first));
        }
    }

    #[test]
    fn encoded_len_matches_the_bytes_written(frame in frame()) {
        let mut header = BytesMut::new();
        frame.encode_header(&mut header);
        let payload = frame.payload().map_or(0, |p| p.len());
        prop_assert_eq!(header.len() + payload, frame.encoded_len());
    }

    #[test]
    fn arbitrary_bytes_never_panic_the_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        tensorwire_proto::fuzzing::decode_round_trip(&bytes);
        tensorwire_proto::fuzzing::receiver_ops(&bytes);
    }
}

#[test]
fn data_payloads_share_the_received_buffers() {
    let frame = Frame::from(Data::new(7, vec![0xab; 10_000]));
    let wire = frame.to_bytes();
    let (first, second) = (wire.slice(..4000), wire.slice(4000..));
    let mut decoder = FrameDecoder::new(Limits::default());
    decoder.push(first.clone());
    decoder.push(second.clone());
    let Some(Frame::Data(data)) = decoder.next_frame().unwrap() else {
        panic!("not DATA")
    };
    let parts = data.payload.parts();
    assert_eq!(parts.len(), 2, "one slice per received chunk");
    // The slices point into the pushed buffers: nothing was copied.
    assert_eq!(parts[0].as_ptr(), first[13..].as_ptr());
    assert_eq!(parts[1].as_ptr(), second.as_ptr());
    assert_eq!(data.payload.len(), 10_000);
}

#[test]
fn encode_header_leaves_the_payload_to_the_caller() {
    let payload = Bytes::from(vec![1u8; 100]);
    let frame = Frame::from(Data::new(0, payload.clone()));
    let mut header = BytesMut::new();
    frame.encode_header(&mut header);
    assert_eq!(header.len(), 13, "type, length, offset");
    assert_eq!(
        frame.payload().unwrap().parts()[0].as_ptr(),
        payload.as_ptr()
    );
}

/// Each limit is enforced from the header alone: only 5 bytes are pushed, the body never is.
#[test]
fn oversized_headers_are_refused_before_their_body_arrives() {
    let limits = Limits::default();
    let cases: [(u8, u32, ErrorCode); 4] = [
        (
            0x01,
            limits.max_metadata_len + 1,
            ErrorCode::METADATA_TOO_LARGE,
        ),
        (0x02, 8 + limits.max_data_payload + 1, ErrorCode::CHUNK_SIZE),
        (
            0x04,
            6 + u32::from(limits.max_reason_len) + 1,
            ErrorCode::REASON_TOO_LONG,
        ),
        (0x11, u32::MAX, ErrorCode::REASON_TOO_LONG),
    ];
    for (ty, len, code) in cases {
        let mut decoder = FrameDecoder::new(limits.clone());
        let mut header = vec![ty];
        header.extend_from_slice(&len.to_le_bytes());
        decoder.push(header.into());
        let err = decoder.next_frame().unwrap_err();
        assert_eq!(err.code(), code);
        assert_eq!(err.blame(), Blame::PeerBrokeRule);
        assert_eq!(decoder.next_frame().unwrap_err(), err, "errors are sticky");
    }
}

#[test]
fn a_smaller_configured_limit_is_enforced() {
    let mut limits = Limits::default();
    limits.max_data_payload = 1024;
    limits.max_dims = 2;
    let mut decoder = FrameDecoder::new(limits.clone());
    decoder.push(Frame::from(Data::new(0, vec![1u8; 1025])).to_bytes());
    assert_eq!(
        decoder.next_frame().unwrap_err().code(),
        ErrorCode::CHUNK_SIZE
    );

    let mut decoder = FrameDecoder::new(limits);
    decoder.push(Frame::from(TensorMeta::new([1, 1, 1], DType::U8).unwrap()).to_bytes());
    assert_eq!(
        decoder.next_frame().unwrap_err().code(),
        ErrorCode::TOO_MANY_DIMS
    );
}

#[test]
fn unknown_checksum_algorithms_survive_decoding() {
    let meta = TensorMeta::new([1], DType::U8)
        .unwrap()
        .with_checksum(ChecksumAlgorithm(77));
    let mut decoder = FrameDecoder::new(Limits::default());
    decoder.push(Frame::from(meta.clone()).to_bytes());
    assert_eq!(decoder.next_frame().unwrap(), Some(Frame::from(meta)));
}

#[test]
fn tensor_meta_computes_byte_length_with_checked_arithmetic() {
    assert_eq!(
        TensorMeta::new([2, 3, 4], DType::BF16).unwrap().byte_len(),
        48
    );
    assert_eq!(
        TensorMeta::new(Vec::<u64>::new(), DType::F64)
            .unwrap()
            .byte_len(),
        8
    );
    assert_eq!(TensorMeta::new([0, 5], DType::F32).unwrap().byte_len(), 0);
    let err = TensorMeta::new([u64::MAX, 2], DType::U8).unwrap_err();
    assert_eq!(err.code(), ErrorCode::LENGTH_MISMATCH);
    for &dtype in DType::ALL {
        assert_eq!(DType::from_code(dtype.code()), Some(dtype));
        assert_eq!(DType::from_name(dtype.name()), Some(dtype));
        let lower = dtype.name().to_ascii_lowercase();
        assert_eq!(DType::from_name_any_case(&lower), Some(dtype));
    }
    assert_eq!(DType::ALL.len(), 15);
}
