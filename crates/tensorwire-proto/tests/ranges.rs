//! Reassembly: any order of disjoint chunks yields the whole tensor's CRC-32C; overlap,
//! and too many gaps, are refused without changing what was received.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use proptest::prelude::*;
use tensorwire_proto::checksum::{crc32c, crc32c_append, crc32c_combine, crc32c_of_pieces};
use tensorwire_proto::{CheckedChunk, ErrorCode, ReceivedRanges};

#[test]
fn crc32c_matches_the_standard_check_value() {
    assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    assert_eq!(crc32c(b""), 0);
    assert_eq!(crc32c_append(crc32c(b"1234"), b"56789"), 0xE306_9283);
    assert_eq!(
        crc32c_combine(crc32c(b"1234"), crc32c(b"56789"), 5),
        0xE306_9283
    );
    // An empty prefix (CRC 0), as a tensor's first chunk combines.
    assert_eq!(crc32c_combine(0, crc32c(b"123456789"), 9), 0xE306_9283);
}

proptest! {
    /// Combining two CRCs gives the CRC of the concatenation, for any split.
    #[test]
    fn combine_equals_the_crc_of_the_concatenation(
        data in proptest::collection::vec(any::<u8>(), 0..5000),
        cut in any::<proptest::sample::Index>(),
    ) {
        let at = cut.index(data.len() + 1);
        let (a, b) = data.split_at(at);
        prop_assert_eq!(crc32c_combine(crc32c(a), crc32c(b), b.len() as u64), crc32c(&data));
    }
}

proptest! {
    /// The CRCs of equal pieces (the last shorter) combine into the whole's CRC, by table
    /// or directly (the table is built from 1,024 pieces on).
    #[test]
    fn the_crcs_of_equal_pieces_combine_into_the_whole(
        data in proptest::collection::vec(any::<u8>(), 0..5000),
        piece_len in 1u64..70,
    ) {
        let pieces: Vec<u32> = data.chunks(piece_len as usize).map(crc32c).collect();
        let whole = crc32c_of_pieces(&pieces, piece_len, data.len() as u64);
        prop_assert_eq!(whole, Some(crc32c(&data)));
    }
}

#[test]
fn pieces_that_do_not_add_up_to_the_length_are_refused() {
    let data = [7u8; 100];
    let pieces: Vec<u32> = data.chunks(30).map(crc32c).collect();
    assert_eq!(crc32c_of_pieces(&pieces, 30, 100), Some(crc32c(&data)));
    assert_eq!(crc32c_of_pieces(&pieces, 30, 121), None);
    assert_eq!(crc32c_of_pieces(&pieces, 30, 90), None);
    assert_eq!(crc32c_of_pieces(&pieces[..3], 30, 100), None);
    assert_eq!(crc32c_of_pieces(&pieces, 0, 100), None);
    assert_eq!(crc32c_of_pieces(&[], 30, 0), Some(0));
    assert_eq!(crc32c_of_pieces(&[], 0, 0), Some(0));
    assert_eq!(crc32c_of_pieces(&[0], 30, 0), None);
}

proptest! {
    /// A checked chunk split in two (three where cut twice) carries each part's own CRC-32C.
    #[test]
    fn a_split_checked_chunk_keeps_each_parts_checksum(
        data in proptest::collection::vec(any::<u8>(), 0..5000),
        first in any::<proptest::sample::Index>(),
        second in any::<proptest::sample::Index>(),
    ) {
        let mut chunk = CheckedChunk::new(bytes::Bytes::from(data.clone()));
        let at = first.index(data.len() + 1);
        let head = chunk.split_to(at);
        prop_assert_eq!(head.payload().as_ref(), &data[..at]);
        prop_assert_eq!(head.crc(), crc32c(&data[..at]));
        prop_assert_eq!(chunk.crc(), crc32c(&data[at..]));
        let rest = &data[at..];
        let at = second.index(rest.len() + 1);
        let middle = chunk.split_to(at);
        prop_assert_eq!(middle.crc(), crc32c(&rest[..at]));
        prop_assert_eq!(chunk.payload().as_ref(), &rest[at..]);
        prop_assert_eq!(chunk.crc(), crc32c(&rest[at..]));
    }
}

/// Splitting off more than a chunk holds takes all of it and leaves it empty, checked.
#[test]
fn splitting_past_the_end_takes_the_whole_chunk() {
    let mut chunk = CheckedChunk::new(bytes::Bytes::from_static(b"123456789"));
    let all = chunk.split_to(100);
    assert_eq!(all.crc(), 0xE306_9283);
    assert_eq!(all.len(), 9);
    assert!(chunk.is_empty());
    assert_eq!(chunk.crc(), 0);
}

/// Long second parts: 1 MiB of zeros against appending them, then 5 GiB (past 2^32 bytes)
/// in one combine against 5,120 combines of the checked 1 MiB.
#[test]
fn combine_handles_long_second_parts() {
    let head = crc32c(b"tensorwire");
    let mib = vec![0u8; 1 << 20];
    let mib_crc = crc32c(&mib);
    let mib_len = mib.len() as u64;
    assert_eq!(
        crc32c_combine(head, mib_crc, mib_len),
        crc32c_append(head, &mib)
    );
    let (mut step_by_step, mut zeros_alone) = (head, 0);
    for _ in 0..5 * 1024 {
        step_by_step = crc32c_combine(step_by_step, mib_crc, mib_len);
        zeros_alone = crc32c_combine(zeros_alone, mib_crc, mib_len);
    }
    assert_eq!(crc32c_combine(head, zeros_alone, 5 << 30), step_by_step);
}

fn chunks(len: usize, cuts: &[usize]) -> Vec<(usize, usize)> {
    let mut points: Vec<usize> = cuts.iter().map(|c| c % len).chain([0, len]).collect();
    points.sort_unstable();
    points.dedup();
    points.windows(2).map(|w| (w[0], w[1])).collect()
}

proptest! {
    #[test]
    fn any_order_yields_the_whole_crc(
        data in proptest::collection::vec(any::<u8>(), 1..4096),
        cuts in proptest::collection::vec(any::<usize>(), 0..40),
        order in any::<prop::sample::Index>(),
        seed in any::<u64>(),
    ) {
        let mut pieces = chunks(data.len(), &cuts);
        // A deterministic shuffle from the seed.
        let mut state = seed | 1;
        for i in (1..pieces.len()).rev() {
            state ^= state << 13; state ^= state >> 7; state ^= state << 17;
            pieces.swap(i, (state % (i as u64 + 1)) as usize);
        }
        let _ = order;
        let mut ranges = ReceivedRanges::new(usize::MAX);
        for (i, &(s, e)) in pieces.iter().enumerate() {
            prop_assert_eq!(ranges.whole_crc(data.len() as u64), None);
            if i % 2 == 0 {
                ranges.insert(s as u64, e as u64, crc32c(&data[s..e])).unwrap();
            } else {
                // The receiver's path: extend the CRC of the range this piece continues.
                ranges.insert_with(s as u64, e as u64, |left| crc32c_append(left.unwrap_or(0), &data[s..e])).unwrap();
            }
            prop_assert!(ranges.range_count() <= i + 1);
        }
        prop_assert_eq!(ranges.covered(), data.len() as u64);
        prop_assert_eq!(ranges.first_gap(data.len() as u64), None);
        prop_assert_eq!(ranges.whole_crc(data.len() as u64), Some(crc32c(&data)));
    }

    #[test]
    fn overlaps_are_refused_and_change_nothing(
        a in 0u64..1000, alen in 1u64..100, b in 0u64..1000, blen in 1u64..100,
    ) {
        let mut ranges = ReceivedRanges::new(16);
        ranges.insert(a, a + alen, 1).unwrap();
        let overlaps = b < a + alen && a < b + blen;
        match ranges.insert(b, b + blen, 2) {
            Ok(()) => prop_assert!(!overlaps),
            Err(e) => {
                prop_assert!(overlaps);
                prop_assert_eq!(e.code(), ErrorCode::DATA_OVERLAP);
                prop_assert_eq!(ranges.covered(), alen);
            }
        }
    }
}

#[test]
fn the_gap_cap_counts_merges() {
    let mut ranges = ReceivedRanges::new(2);
    ranges.insert(0, 1, 0).unwrap();
    ranges.insert(4, 5, 0).unwrap();
    let err = ranges.insert(8, 9, 0).unwrap_err();
    assert_eq!(err.code(), ErrorCode::TOO_MANY_GAPS);
    // Filling a gap merges two ranges into one: allowed at the cap.
    ranges.insert(1, 4, 0).unwrap();
    assert_eq!(ranges.range_count(), 1);
    ranges.insert(8, 9, 0).unwrap();
    assert_eq!(ranges.first_gap(9), Some((5, 8)));
}
