//! The golden vectors of `spec/vectors`: how each is built, and the manifest that lists them.
//!
//! Valid frames are built with the encoder; invalid ones byte by byte, so they stay
//! invalid whatever the encoder does.

use std::path::PathBuf;

use bytes::{BufMut, Bytes, BytesMut};
use serde::{Deserialize, Serialize};
use tensorwire_proto::frame::{
    Accept, Cancel, Complete, Credit, Data, Early, EarlyCredit, End, Reject,
};
use tensorwire_proto::{DType, Device, ErrorCode, Frame, Receipt, TensorMeta};

/// `spec/vectors`, from this crate's directory.
pub fn vectors_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../spec/vectors")
}

/// `spec/vectors/manifest.json`.
#[derive(Serialize, Deserialize, Debug, PartialEq)]
pub struct Manifest {
    pub about: String,
    pub frames: Vec<FrameVector>,
    pub sequences: Vec<SequenceVector>,
}

/// One frame: `error` is `null` for a valid frame, else the code decoding must fail with
/// (default limits; TRUNCATED_FRAME is reported at the end of the stream).
#[derive(Serialize, Deserialize, Debug, PartialEq, Clone)]
pub struct FrameVector {
    pub file: String,
    pub description: String,
    pub error: Option<String>,
}

/// Frames a sender sends on one stream. The receiver (default limits) accepts after
/// METADATA, grants `credit` bytes at once, marks the tensor resident after END, and must
/// end with `outcome`: `COMPLETE` or an error code name. For a sequence that starts with
/// EARLY, `credit` is the early credit the receiver offered, and it accepts after END.
#[derive(Serialize, Deserialize, Debug, PartialEq, Clone)]
pub struct SequenceVector {
    pub file: String,
    pub description: String,
    pub credit: u64,
    pub outcome: String,
}

/// A vector with its bytes.
pub struct Built<V> {
    pub vector: V,
    pub bytes: Bytes,
}

fn frame(
    file: &str,
    description: &str,
    error: Option<ErrorCode>,
    bytes: Bytes,
) -> Built<FrameVector> {
    let error = error.map(|c| c.name().expect("registered code").to_owned());
    let vector = FrameVector {
        file: format!("frames/{file}.bin"),
        description: description.into(),
        error,
    };
    Built { vector, bytes }
}

fn valid(file: &str, description: &str, f: impl Into<Frame>) -> Built<FrameVector> {
    frame(file, description, None, f.into().to_bytes())
}

fn invalid(file: &str, description: &str, code: ErrorCode, bytes: Vec<u8>) -> Built<FrameVector> {
    frame(file, description, Some(code), bytes.into())
}

/// A raw frame: type, declared body length, then `body` (which may be shorter).
pub fn raw(ty: u8, declared_len: u32, body: &[u8]) -> Vec<u8> {
    let mut out = vec![ty];
    out.extend_from_slice(&declared_len.to_le_bytes());
    out.extend_from_slice(body);
    out
}

/// A METADATA body from raw fields (fixed part, dims, name, attributes), for invalid vectors.
#[derive(Clone)]
pub struct RawMeta {
    pub byte_len: u64,
    pub dtype: u8,
    pub checksum: u8,
    pub device: (u8, u16),
    pub dims: Vec<u64>,
    pub name: Vec<u8>,
    pub attrs: Vec<(Vec<u8>, Vec<u8>)>,
}

impl RawMeta {
    pub fn f32_2x3() -> Self {
        Self {
            byte_len: 24,
            dtype: DType::F32.code(),
            checksum: 1,
            device: (0, 0),
            dims: vec![2, 3],
            name: b"w".to_vec(),
            attrs: vec![],
        }
    }

    pub fn body(&self) -> Vec<u8> {
        let mut b = BytesMut::new();
        b.put_u64_le(self.byte_len);
        b.put_u8(self.dtype);
        b.put_u8(self.checksum);
        b.put_u8(self.device.0);
        b.put_u16_le(self.device.1);
        b.put_u8(self.dims.len() as u8);
        b.put_u16_le(self.name.len() as u16);
        b.put_u16_le(self.attrs.len() as u16);
        self.dims.iter().for_each(|&d| b.put_u64_le(d));
        b.put_slice(&self.name);
        for (k, v) in &self.attrs {
            b.put_u16_le(k.len() as u16);
            b.put_slice(k);
            b.put_u16_le(v.len() as u16);
            b.put_slice(v);
        }
        b.to_vec()
    }

    pub fn frame(&self) -> Vec<u8> {
        let body = self.body();
        raw(0x01, body.len() as u32, &body)
    }

    fn with(mut self, f: impl FnOnce(&mut Self)) -> Self {
        f(&mut self);
        self
    }
}

/// Deterministic non-zero test bytes.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) | 1)
        .collect()
}

fn reason_frame(ty: u8, code: u32, reason: &[u8], declared_reason_len: u16) -> Vec<u8> {
    let mut body = code.to_le_bytes().to_vec();
    body.extend_from_slice(&declared_reason_len.to_le_bytes());
    body.extend_from_slice(reason);
    raw(ty, body.len() as u32, &body)
}

/// Every frame vector.
pub fn frame_vectors() -> Vec<Built<FrameVector>> {
    let weight = TensorMeta::new([2, 3], DType::F32)
        .unwrap()
        .with_name("layer0.weight");
    let audio = TensorMeta::new([16000], DType::F32)
        .unwrap()
        .with_name("speech/utterance-7")
        .with_device(Device::Cuda(1))
        .with_attribute("sample_rate", "16000")
        .with_attribute("channels", "1");
    let scalar = TensorMeta::new(Vec::<u64>::new(), DType::BF16)
        .unwrap()
        .with_device(Device::Host);
    let fp8 = TensorMeta::new([4, 0, 8], DType::F8E4M3)
        .unwrap()
        .with_name("empty.kv");
    let embed = TensorMeta::new([4096, 1024], DType::BF16)
        .unwrap()
        .with_name("model.embed_tokens.weight");
    let split_part = tensorwire_proto::split::plan_split(
        &embed,
        4,
        tensorwire_proto::split::SplitId(0x0011_2233_4455_6677_8899_aabb_ccdd_eeff),
    )
    .unwrap()
    .swap_remove(1)
    .meta;
    let max_ok = RawMeta::f32_2x3().with(|m| {
        m.dims = vec![1; 32];
        m.dims[0] = 6;
        m.byte_len = 24;
        m.dtype = DType::I32.code();
    });
    vec![
        valid(
            "metadata_f32_2x3",
            "METADATA: named F32 [2, 3], no attributes",
            weight,
        ),
        valid(
            "metadata_audio",
            "METADATA: F32 audio with sample_rate, device hint cuda:1",
            audio,
        ),
        valid(
            "metadata_scalar_bf16",
            "METADATA: a BF16 scalar (shape []), host hint",
            scalar,
        ),
        valid(
            "metadata_empty_fp8",
            "METADATA: an F8_E4M3 tensor with a zero dimension (0 bytes)",
            fp8,
        ),
        valid(
            "metadata_split_part",
            "METADATA: the second of 4 parts of a split BF16 [4096, 1024] (rows 1024..2048, spec §15)",
            split_part,
        ),
        frame(
            "metadata_32_dims",
            "METADATA: exactly the default limit of 32 dims",
            None,
            max_ok.frame().into(),
        ),
        valid(
            "data_first",
            "DATA: 24 bytes at offset 0",
            Data::new(0, pattern(24, 7)),
        ),
        valid(
            "data_offset",
            "DATA: 16 bytes at offset 4096",
            Data::new(4096, pattern(16, 9)),
        ),
        valid(
            "end",
            "END: CRC-32C 0xE3069283 (of ASCII 123456789)",
            End {
                checksum: 0xE306_9283,
            },
        ),
        valid(
            "cancel",
            "CANCEL: CANCELLED with a reason",
            Cancel::new(ErrorCode::CANCELLED, "user pressed ctrl-c"),
        ),
        valid(
            "cancel_unknown_code",
            "CANCEL: an application code this version does not name",
            Cancel::new(ErrorCode(0x1000_0042), "app-specific"),
        ),
        valid(
            "accept",
            "ACCEPT: max DATA payload 16 MiB",
            Accept {
                max_data_payload: 16 << 20,
            },
        ),
        valid(
            "reject",
            "REJECT: UNSUPPORTED_DEVICE",
            Reject::new(ErrorCode::UNSUPPORTED_DEVICE, "no cuda:1 here"),
        ),
        valid(
            "reject_destination_mismatch",
            "REJECT: DESTINATION_MISMATCH (the registered destination is F32 [4096, 4096])",
            Reject::new(
                ErrorCode::DESTINATION_MISMATCH,
                "weights: F16 [4096, 4096] does not match its destination F32 [4096, 4096]",
            ),
        ),
        valid("credit", "CREDIT: 4 MiB", Credit { bytes: 4 << 20 }),
        valid(
            "complete",
            "COMPLETE without a receipt",
            Complete::default(),
        ),
        valid(
            "complete_receipt",
            "COMPLETE with a receipt (version 1.5): landed on cuda:0, shared as \
             4d2c1e2f-0b6a-4c47-9d1e-3a5f7c9b2e10, generation 3",
            Complete {
                receipt: Receipt::new()
                    .with(Receipt::DEVICE, "cuda:0")
                    .with(Receipt::SHARED_ID, "4d2c1e2f-0b6a-4c47-9d1e-3a5f7c9b2e10")
                    .with(Receipt::SHARED_GENERATION, "3"),
            },
        ),
        valid("early", "EARLY (version 1.2)", Early),
        valid(
            "early_credit",
            "EARLY_CREDIT: 1 MiB, DATA payloads up to 16 MiB (version 1.2)",
            EarlyCredit {
                bytes: 1 << 20,
                max_data_payload: 16 << 20,
            },
        ),
        invalid(
            "unknown_type",
            "frame type 0x7f",
            ErrorCode::UNKNOWN_FRAME_TYPE,
            raw(0x7f, 0, &[]),
        ),
        invalid(
            "metadata_too_large",
            "METADATA header announcing 70000 bytes (limit 65536); refused before the body",
            ErrorCode::METADATA_TOO_LARGE,
            raw(0x01, 70_000, &[]),
        ),
        invalid(
            "metadata_too_short",
            "METADATA body shorter than its fixed part",
            ErrorCode::FRAME_MALFORMED,
            raw(0x01, 10, &[0; 10]),
        ),
        invalid(
            "metadata_1tb",
            "METADATA claiming a 1 TB tensor (limit 64 GiB)",
            ErrorCode::TENSOR_TOO_LARGE,
            RawMeta::f32_2x3()
                .with(|m| {
                    m.dims = vec![1 << 38];
                    m.byte_len = 1 << 40;
                })
                .frame(),
        ),
        invalid(
            "metadata_33_dims",
            "METADATA with 33 dims (limit 32)",
            ErrorCode::TOO_MANY_DIMS,
            RawMeta::f32_2x3().with(|m| m.dims = vec![1; 33]).frame(),
        ),
        invalid(
            "metadata_name_too_long",
            "METADATA with a 1025-byte name (limit 1024)",
            ErrorCode::NAME_TOO_LONG,
            RawMeta::f32_2x3()
                .with(|m| m.name = vec![b'n'; 1025])
                .frame(),
        ),
        invalid(
            "metadata_too_many_attributes",
            "METADATA with 65 attributes (limit 64)",
            ErrorCode::TOO_MANY_ATTRIBUTES,
            RawMeta::f32_2x3()
                .with(|m| m.attrs = vec![(b"k".to_vec(), b"v".to_vec()); 65])
                .frame(),
        ),
        invalid(
            "metadata_attribute_too_long",
            "METADATA with a 4097-byte attribute value (limit 4096)",
            ErrorCode::ATTRIBUTE_TOO_LONG,
            RawMeta::f32_2x3()
                .with(|m| m.attrs = vec![(b"k".to_vec(), vec![b'v'; 4097])])
                .frame(),
        ),
        invalid(
            "metadata_length_mismatch",
            "METADATA: F32 [2, 3] declaring 25 bytes",
            ErrorCode::LENGTH_MISMATCH,
            RawMeta::f32_2x3().with(|m| m.byte_len = 25).frame(),
        ),
        invalid(
            "metadata_shape_overflow",
            "METADATA: U8 [2^32, 2^32, 2] overflows 64 bits",
            ErrorCode::LENGTH_MISMATCH,
            RawMeta::f32_2x3()
                .with(|m| {
                    m.dtype = DType::U8.code();
                    m.dims = vec![1 << 32, 1 << 32, 2];
                    m.byte_len = 0;
                })
                .frame(),
        ),
        invalid(
            "metadata_unknown_dtype",
            "METADATA with dtype code 99",
            ErrorCode::UNKNOWN_DTYPE,
            RawMeta::f32_2x3().with(|m| m.dtype = 99).frame(),
        ),
        invalid(
            "metadata_unknown_device",
            "METADATA with device kind 7",
            ErrorCode::UNKNOWN_DEVICE,
            RawMeta::f32_2x3().with(|m| m.device = (7, 0)).frame(),
        ),
        invalid(
            "metadata_host_with_index",
            "METADATA with device kind 1 (host) and index 3: one encoding per device",
            ErrorCode::UNKNOWN_DEVICE,
            RawMeta::f32_2x3().with(|m| m.device = (1, 3)).frame(),
        ),
        invalid(
            "metadata_bad_utf8",
            "METADATA whose name is not UTF-8",
            ErrorCode::INVALID_UTF8,
            RawMeta::f32_2x3()
                .with(|m| m.name = vec![0xff, 0xfe])
                .frame(),
        ),
        invalid(
            "metadata_trailing_bytes",
            "METADATA body with 3 bytes after its last field",
            ErrorCode::FRAME_MALFORMED,
            {
                let mut body = RawMeta::f32_2x3().body();
                body.extend_from_slice(&[0, 0, 0]);
                raw(0x01, body.len() as u32, &body)
            },
        ),
        invalid(
            "metadata_name_past_body",
            "METADATA whose name length runs past the body",
            ErrorCode::FRAME_MALFORMED,
            {
                let mut body = RawMeta::f32_2x3().body();
                body[14] = 200; // name_len, low byte
                raw(0x01, body.len() as u32, &body)
            },
        ),
        invalid(
            "data_empty",
            "DATA with no payload",
            ErrorCode::CHUNK_SIZE,
            raw(0x02, 8, &[0; 8]),
        ),
        invalid(
            "data_too_large",
            "DATA header announcing 16 MiB + 1 payload bytes; refused before the body",
            ErrorCode::CHUNK_SIZE,
            raw(0x02, 8 + (16 << 20) + 1, &[]),
        ),
        invalid(
            "data_short",
            "DATA body shorter than its offset",
            ErrorCode::FRAME_MALFORMED,
            raw(0x02, 4, &[0; 4]),
        ),
        invalid(
            "end_wrong_length",
            "END with a 4-byte body",
            ErrorCode::FRAME_MALFORMED,
            raw(0x03, 4, &[0; 4]),
        ),
        invalid(
            "credit_wrong_length",
            "CREDIT with a 9-byte body",
            ErrorCode::FRAME_MALFORMED,
            raw(0x12, 9, &[0; 9]),
        ),
        invalid(
            "accept_wrong_length",
            "ACCEPT with no body",
            ErrorCode::FRAME_MALFORMED,
            raw(0x10, 0, &[]),
        ),
        invalid(
            "early_with_body",
            "EARLY with a 1-byte body",
            ErrorCode::FRAME_MALFORMED,
            raw(0x05, 1, &[0]),
        ),
        invalid(
            "early_credit_wrong_length",
            "EARLY_CREDIT with an 8-byte body (the u32 is missing)",
            ErrorCode::FRAME_MALFORMED,
            raw(0x14, 8, &[0; 8]),
        ),
        invalid(
            "complete_with_body",
            "COMPLETE with a 1-byte body (too short for a receipt's entry count)",
            ErrorCode::FRAME_MALFORMED,
            raw(0x13, 1, &[0]),
        ),
        invalid(
            "complete_receipt_no_entries",
            "COMPLETE whose receipt counts 0 entries (an empty receipt is an empty body)",
            ErrorCode::FRAME_MALFORMED,
            raw(0x13, 2, &[0, 0]),
        ),
        invalid(
            "complete_receipt_too_long",
            "COMPLETE announcing a 4097-byte receipt (at most 4096); refused before the body",
            ErrorCode::FRAME_MALFORMED,
            raw(0x13, 4097, &[]),
        ),
        invalid(
            "complete_receipt_past_body",
            "COMPLETE whose receipt entry runs past the body",
            ErrorCode::FRAME_MALFORMED,
            raw(0x13, 6, &[1, 0, 9, 0, b'a', b'b']),
        ),
        invalid(
            "complete_receipt_bad_utf8",
            "COMPLETE whose receipt key is not UTF-8",
            ErrorCode::INVALID_UTF8,
            raw(0x13, 8, &[1, 0, 2, 0, 0xc3, 0x28, 0, 0]),
        ),
        invalid(
            "complete_receipt_trailing_bytes",
            "COMPLETE with a byte after its receipt's last entry",
            ErrorCode::FRAME_MALFORMED,
            raw(0x13, 8, &[1, 0, 1, 0, b'k', 0, 0, 0xff]),
        ),
        invalid(
            "cancel_reason_too_long",
            "CANCEL announcing a 1025-byte reason (limit 1024)",
            ErrorCode::REASON_TOO_LONG,
            raw(0x04, 6 + 1025, &[]),
        ),
        invalid(
            "cancel_bad_utf8",
            "CANCEL whose reason is not UTF-8",
            ErrorCode::INVALID_UTF8,
            reason_frame(0x04, 0x0401, &[0xc3, 0x28], 2),
        ),
        invalid(
            "reject_reason_length_mismatch",
            "REJECT whose reason length disagrees with the frame length",
            ErrorCode::FRAME_MALFORMED,
            reason_frame(0x11, 0x0402, b"abc", 5),
        ),
        invalid(
            "truncated_data",
            "DATA cut off mid-payload at the end of the stream",
            ErrorCode::TRUNCATED_FRAME,
            raw(0x02, 8 + 100, &[0; 50]),
        ),
    ]
}

fn frames(list: &[Frame]) -> Bytes {
    let mut out = BytesMut::new();
    list.iter().for_each(|f| f.encode(&mut out));
    out.freeze()
}

fn sequence(
    file: &str,
    description: &str,
    credit: u64,
    outcome: &str,
    list: &[Frame],
) -> Built<SequenceVector> {
    let vector = SequenceVector {
        file: format!("sequences/{file}.bin"),
        description: description.into(),
        credit,
        outcome: outcome.into(),
    };
    Built {
        vector,
        bytes: frames(list),
    }
}

fn meta_u8(len: u64) -> Frame {
    TensorMeta::new([len], DType::U8)
        .unwrap()
        .with_name("seq")
        .into()
}

fn data(offset: usize, bytes: &[u8]) -> Frame {
    Data::new(offset as u64, bytes.to_vec()).into()
}

fn end_of(bytes: &[u8]) -> Frame {
    End {
        checksum: tensorwire_proto::checksum::crc32c(bytes).into(),
    }
    .into()
}

/// Every sequence vector.
pub fn sequence_vectors() -> Vec<Built<SequenceVector>> {
    let t = pattern(64, 3);
    let gappy: Vec<Frame> = std::iter::once(meta_u8(8192))
        .chain((0..1025).map(|i| data(i * 4, &t[..1])))
        .collect();
    let unsupported = TensorMeta::new([4], DType::U8)
        .unwrap()
        .with_checksum(tensorwire_proto::ChecksumAlgorithm(9));
    vec![
        sequence(
            "early",
            "a tensor sent early: EARLY, METADATA, two DATA and END before the decision \
             (the receiver offered 64 bytes of early credit and accepts after END)",
            64,
            "COMPLETE",
            &[
                Early.into(),
                meta_u8(64),
                data(0, &t[..40]),
                data(40, &t[40..]),
                end_of(&t),
            ],
        ),
        sequence(
            "early_too_large",
            "a 64-byte tensor sent early with 32 bytes of early credit offered",
            32,
            "CREDIT_VIOLATION",
            &[Early.into(), meta_u8(64), data(0, &t[..32])],
        ),
        sequence(
            "early_twice",
            "EARLY twice",
            64,
            "UNEXPECTED_FRAME",
            &[Early.into(), Early.into(), meta_u8(64)],
        ),
        sequence(
            "early_after_metadata",
            "EARLY after METADATA",
            64,
            "UNEXPECTED_FRAME",
            &[meta_u8(64), Early.into()],
        ),
        sequence(
            "in_order",
            "64 bytes in two DATA frames, in order",
            64,
            "COMPLETE",
            &[
                meta_u8(64),
                data(0, &t[..40]),
                data(40, &t[40..]),
                end_of(&t),
            ],
        ),
        sequence(
            "out_of_order",
            "64 bytes in four DATA frames, out of order",
            64,
            "COMPLETE",
            &[
                meta_u8(64),
                data(48, &t[48..]),
                data(0, &t[..16]),
                data(32, &t[32..48]),
                data(16, &t[16..32]),
                end_of(&t),
            ],
        ),
        sequence(
            "zero_length",
            "a 0-byte tensor: METADATA then END",
            0,
            "COMPLETE",
            &[meta_u8(0), end_of(&[])],
        ),
        sequence(
            "data_past_end",
            "DATA reaching byte 65 of a 64-byte tensor",
            1000,
            "DATA_PAST_END",
            &[meta_u8(64), data(60, &t[..5])],
        ),
        sequence(
            "data_overlap",
            "DATA overlapping an earlier DATA by one byte",
            64,
            "DATA_OVERLAP",
            &[meta_u8(64), data(0, &t[..33]), data(32, &t[32..40])],
        ),
        sequence(
            "data_duplicate",
            "the same DATA twice",
            64,
            "DATA_OVERLAP",
            &[meta_u8(64), data(0, &t[..32]), data(0, &t[..32])],
        ),
        sequence(
            "end_with_gaps",
            "END while bytes [32, 48) are missing",
            64,
            "END_WITH_GAPS",
            &[
                meta_u8(64),
                data(0, &t[..32]),
                data(48, &t[48..]),
                end_of(&t),
            ],
        ),
        sequence(
            "checksum_mismatch",
            "END whose checksum does not match",
            64,
            "CHECKSUM_MISMATCH",
            &[
                meta_u8(64),
                data(0, &t),
                End {
                    checksum: 0xdead_beef,
                }
                .into(),
            ],
        ),
        sequence(
            "credit_exceeded",
            "40 bytes sent against 32 bytes of credit",
            32,
            "CREDIT_VIOLATION",
            &[meta_u8(64), data(0, &t[..40])],
        ),
        sequence(
            "data_before_metadata",
            "DATA as the first frame",
            64,
            "UNEXPECTED_FRAME",
            &[data(0, &t[..8])],
        ),
        sequence(
            "metadata_twice",
            "a second METADATA on the same stream",
            64,
            "UNEXPECTED_FRAME",
            &[meta_u8(64), meta_u8(64)],
        ),
        sequence(
            "data_after_end",
            "DATA after END",
            64,
            "UNEXPECTED_FRAME",
            &[
                meta_u8(8),
                data(0, &t[..8]),
                end_of(&t[..8]),
                data(0, &t[..8]),
            ],
        ),
        sequence(
            "receiver_frame_from_sender",
            "a sender sending CREDIT",
            64,
            "UNEXPECTED_FRAME",
            &[meta_u8(64), Credit { bytes: 1 }.into()],
        ),
        sequence(
            "too_many_gaps",
            "1025 one-byte DATA frames with gaps between (limit 1024 ranges)",
            8192,
            "TOO_MANY_GAPS",
            &gappy,
        ),
        sequence(
            "sender_cancels",
            "the sender cancels mid-tensor",
            64,
            "CANCELLED",
            &[
                meta_u8(64),
                data(0, &t[..8]),
                Cancel::new(ErrorCode::CANCELLED, "sender gave up").into(),
            ],
        ),
        sequence(
            "unsupported_checksum",
            "METADATA asking for checksum algorithm 9",
            4,
            "UNSUPPORTED_CHECKSUM",
            &[unsupported.into()],
        ),
    ]
}

/// The manifest listing every vector.
pub fn manifest() -> Manifest {
    Manifest {
        about: "Golden frames of the tensorwire protocol (spec/protocol.md). Regenerate with \
                TENSORWIRE_WRITE_VECTORS=1 cargo test -p tensorwire-proto --test vectors."
            .into(),
        frames: frame_vectors().into_iter().map(|b| b.vector).collect(),
        sequences: sequence_vectors().into_iter().map(|b| b.vector).collect(),
    }
}
