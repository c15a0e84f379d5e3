//! Split tensors (spec §15): planning parts, reading them back, and assembling a whole.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use tensorwire_proto::split::{
    MAX_PARTS, SPLIT_ID, SPLIT_PARTS, SPLIT_ROW, SPLIT_ROWS, SplitAssembly, SplitId, SplitPart,
    plan_split,
};
use tensorwire_proto::{DType, Device, ErrorCode, ProtocolError, TensorMeta};

mod common;

const ID: SplitId = SplitId(0x0123_4567_89ab_cdef_0011_2233_4455_6677);

fn whole() -> TensorMeta {
    TensorMeta::new(vec![10, 3], DType::F32)
        .unwrap()
        .with_name("embed")
        .with_device(Device::Cuda(0))
        .with_attribute("layer", "7")
}

fn parts_of(whole: &TensorMeta, parts: u64) -> Vec<SplitPart> {
    plan_split(whole, parts, ID)
        .unwrap()
        .iter()
        .map(|p| SplitPart::of(&p.meta, u64::MAX).unwrap().unwrap())
        .collect()
}

fn code(e: ProtocolError) -> ErrorCode {
    e.code()
}

#[test]
fn a_plan_covers_the_whole_in_consecutive_rows_and_reads_back() {
    let planned = plan_split(&whole(), 4, ID).unwrap();
    let rows: Vec<u64> = planned.iter().map(|p| p.meta.shape()[0]).collect();
    assert_eq!(rows, [3, 3, 2, 2]);
    let offsets: Vec<u64> = planned.iter().map(|p| p.offset).collect();
    assert_eq!(offsets, [0, 36, 72, 96]);
    let first = &planned[1].meta;
    assert_eq!(first.name(), "embed");
    assert_eq!(first.attribute("layer"), Some("7"));
    assert_eq!(
        first.attribute(SPLIT_ID),
        Some("0123456789abcdef0011223344556677")
    );
    assert_eq!(first.attribute(SPLIT_ROW), Some("3"));
    assert_eq!(first.attribute(SPLIT_ROWS), Some("10"));
    assert_eq!(first.attribute(SPLIT_PARTS), Some("4"));

    let part = SplitPart::of(first, u64::MAX).unwrap().unwrap();
    assert_eq!(part.id(), ID);
    assert_eq!((part.offset(), part.len(), part.first_row()), (36, 36, 3));
    // The whole comes back as the sender had it, split attributes gone.
    assert_eq!(part.whole(), &whole());
}

#[test]
fn a_tensor_without_split_attributes_is_not_a_part() {
    assert_eq!(SplitPart::of(&whole(), u64::MAX), Ok(None));
}

#[test]
fn tensors_that_cannot_be_split_are_refused_by_the_planner() {
    let scalar = TensorMeta::new(vec![], DType::F32).unwrap();
    assert!(plan_split(&scalar, 2, ID).is_err());
    assert!(plan_split(&whole(), 1, ID).is_err());
    assert!(
        plan_split(&whole(), 11, ID).is_err(),
        "more parts than rows"
    );
    let wide = TensorMeta::new(vec![1000, 1], DType::U8).unwrap();
    assert!(plan_split(&wide, MAX_PARTS + 1, ID).is_err());
    assert_eq!(plan_split(&wide, MAX_PARTS, ID).unwrap().len(), 256);
    let empty = TensorMeta::new(vec![4, 0], DType::U8).unwrap();
    assert!(plan_split(&empty, 2, ID).is_err());
    let part = plan_split(&whole(), 2, ID).unwrap().remove(0).meta;
    assert!(
        plan_split(&part, 2, ID).is_err(),
        "a part is not split again"
    );
}

/// A part's METADATA with one split attribute replaced.
fn with(key: &str, value: &str) -> TensorMeta {
    let part = &plan_split(&whole(), 2, ID).unwrap()[1].meta;
    let mut meta = TensorMeta::new(part.shape().to_vec(), part.dtype())
        .unwrap()
        .with_name(part.name());
    for (k, v) in part.attributes() {
        if k == key {
            if !value.is_empty() {
                meta = meta.with_attribute(k.clone(), value);
            }
        } else {
            meta = meta.with_attribute(k.clone(), v.clone());
        }
    }
    meta
}

#[test]
fn malformed_split_attributes_are_split_mismatch() {
    for (key, value, why) in [
        (SPLIT_ID, "", "attribute missing"),
        (SPLIT_ID, "0123456789ABCDEF0011223344556677", "uppercase id"),
        (SPLIT_ID, "0123", "short id"),
        (SPLIT_ROW, "+5", "signed"),
        (SPLIT_ROW, "8", "rows past the whole"),
        (SPLIT_ROW, "18446744073709551615", "row + rows overflows"),
        (SPLIT_ROWS, "99999999999999999999", "past 64 bits"),
        (SPLIT_PARTS, "1", "one part"),
        (SPLIT_PARTS, "257", "too many parts"),
        (SPLIT_PARTS, "11", "more parts than rows"),
    ] {
        let e = SplitPart::of(&with(key, value), u64::MAX).unwrap_err();
        assert_eq!(code(e), ErrorCode::SPLIT_MISMATCH, "{why}");
    }
    let scalar = TensorMeta::new(vec![], DType::F32)
        .unwrap()
        .with_attribute(SPLIT_ID, ID.to_string())
        .with_attribute(SPLIT_ROW, "0")
        .with_attribute(SPLIT_ROWS, "2")
        .with_attribute(SPLIT_PARTS, "2");
    assert_eq!(
        code(SplitPart::of(&scalar, u64::MAX).unwrap_err()),
        ErrorCode::SPLIT_MISMATCH
    );
    let huge = with(SPLIT_ROWS, "18446744073709551615");
    assert_eq!(
        code(SplitPart::of(&huge, u64::MAX).unwrap_err()),
        ErrorCode::SPLIT_MISMATCH,
        "a whole past 64 bits"
    );
}

#[test]
fn the_largest_tensor_limit_applies_to_the_whole() {
    let part = &plan_split(&whole(), 2, ID).unwrap()[0].meta;
    assert_eq!(part.byte_len(), 60);
    let e = SplitPart::of(part, 119).unwrap_err();
    assert_eq!(code(e), ErrorCode::TENSOR_TOO_LARGE);
    assert!(SplitPart::of(part, 120).unwrap().is_some());
}

#[test]
fn parts_in_any_order_assemble_once() {
    let parts = parts_of(&whole(), 4);
    let mut assembly = SplitAssembly::new(&parts[2]);
    for i in [2, 0, 3, 1] {
        assert!(!assembly.all_joined());
        assembly.join(&parts[i]).unwrap();
    }
    assert!(assembly.all_joined());
    assert_eq!(assembly.whole(), &whole());
    let landed: Vec<bool> = (0..4).map(|_| assembly.landed().unwrap()).collect();
    assert_eq!(landed, [false, false, false, true]);
    assert!(assembly.landed().is_err(), "a fifth landing");
}

#[test]
fn a_part_cannot_land_before_every_part_joined_and_completes_nothing_early() {
    let parts = parts_of(&whole(), 3);
    let mut assembly = SplitAssembly::new(&parts[0]);
    assembly.join(&parts[0]).unwrap();
    assert!(!assembly.landed().unwrap());
    assert!(assembly.landed().is_err(), "landed more than joined");
    assembly.join(&parts[1]).unwrap();
    assert!(!assembly.landed().unwrap());
    assembly.join(&parts[2]).unwrap();
    assert!(assembly.landed().unwrap());
}

#[test]
fn parts_that_disagree_overlap_or_leave_gaps_are_split_mismatch() {
    let parts = parts_of(&whole(), 2);
    let mismatch =
        |assembly: &mut SplitAssembly, part: &SplitPart| code(assembly.join(part).unwrap_err());

    let mut assembly = SplitAssembly::new(&parts[0]);
    assembly.join(&parts[0]).unwrap();
    assert_eq!(
        mismatch(&mut assembly, &parts[0]),
        ErrorCode::SPLIT_MISMATCH,
        "the same rows twice"
    );
    let renamed = parts_of(&whole().with_name("other"), 2);
    assert_eq!(
        mismatch(&mut assembly, &renamed[1]),
        ErrorCode::SPLIT_MISMATCH
    );
    let wider = parts_of(
        &TensorMeta::new(vec![10, 4], DType::F32)
            .unwrap()
            .with_name("embed")
            .with_device(Device::Cuda(0)),
        2,
    );
    assert_eq!(
        mismatch(&mut assembly, &wider[1]),
        ErrorCode::SPLIT_MISMATCH
    );
    let in_three = parts_of(&whole(), 3);
    assert_eq!(
        mismatch(&mut assembly, &in_three[2]),
        ErrorCode::SPLIT_MISMATCH,
        "another part count"
    );
    let other_id = plan_split(&whole(), 2, SplitId(7)).unwrap();
    let other = SplitPart::of(&other_id[1].meta, u64::MAX).unwrap().unwrap();
    assert_eq!(mismatch(&mut assembly, &other), ErrorCode::SPLIT_MISMATCH);
    // None of those joined: the right part still does.
    assembly.join(&parts[1]).unwrap();
    assert!(assembly.all_joined());
    assert_eq!(
        mismatch(&mut assembly, &parts[1]),
        ErrorCode::SPLIT_MISMATCH,
        "one part too many"
    );

    // Two parts announced; the second covers rows 6..10: rows 5..6 never come.
    let late = TensorMeta::new(vec![4, 3], DType::F32)
        .unwrap()
        .with_name("embed")
        .with_device(Device::Cuda(0))
        .with_attribute("layer", "7")
        .with_attribute(SPLIT_ID, ID.to_string())
        .with_attribute(SPLIT_ROW, "6")
        .with_attribute(SPLIT_ROWS, "10")
        .with_attribute(SPLIT_PARTS, "2");
    let late = SplitPart::of(&late, u64::MAX).unwrap().unwrap();
    let mut gappy = SplitAssembly::new(&parts[0]);
    gappy.join(&parts[0]).unwrap();
    assert_eq!(mismatch(&mut gappy, &late), ErrorCode::SPLIT_MISMATCH);
}

#[test]
fn the_split_vector_reads_as_the_spec_describes_it() {
    let bytes =
        std::fs::read(common::vectors::vectors_dir().join("frames/metadata_split_part.bin"))
            .unwrap();
    let mut decoder = tensorwire_proto::FrameDecoder::new(tensorwire_proto::Limits::default());
    decoder.push(bytes::Bytes::from(bytes));
    let Some(tensorwire_proto::Frame::Metadata(frame)) = decoder.next_frame().unwrap() else {
        panic!("not METADATA");
    };
    let meta = frame.meta;
    assert_eq!(meta.shape(), [1024, 1024]);
    let part = SplitPart::of(&meta, u64::MAX).unwrap().unwrap();
    assert_eq!(
        part.id(),
        SplitId(0x0011_2233_4455_6677_8899_aabb_ccdd_eeff)
    );
    assert_eq!((part.first_row(), part.parts()), (1024, 4));
    assert_eq!((part.offset(), part.len()), (2 << 20, 2 << 20));
    assert_eq!(part.whole().shape(), [4096, 1024]);
    assert_eq!(part.whole().name(), "model.embed_tokens.weight");
    assert!(part.whole().attributes().is_empty());
}
