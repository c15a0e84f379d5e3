//! Checksumming bytes in the pass that stores them (spec §7.3), through the public API.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use bytes::Bytes;
use tensorwire_proto::Payload;
use tensorwire_proto::checksum::crc32c;
use tensorwire_sink::{CreditPermit, HostSink, Sink, checksum_then_copy, checksum_then_copy_with};

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn checksum_then_copy_copies_and_continues_a_checksum() {
    // Around the piece size it works in, and a running checksum continued across calls.
    for len in [0, 1, 16 << 10, (16 << 10) + 1, 100_000] {
        let (first, second) = (pattern(len, 1), pattern(len / 3 + 7, 2));
        let mut dst = vec![0; first.len() + second.len()];
        let (a, b) = dst.split_at_mut(first.len());
        let crc = checksum_then_copy(0, &first, a);
        assert_eq!(crc, crc32c(&first), "{len} bytes");
        let crc = checksum_then_copy(crc, &second, b);
        assert_eq!(dst, [first.clone(), second.clone()].concat());
        assert_eq!(crc, crc32c(&dst), "{len} bytes, continued");
    }
}

#[test]
fn checksum_then_copy_with_hands_each_piece_to_the_copy_once() {
    let src = pattern(100_000, 4);
    let mut dst = vec![0; src.len()];
    let mut pieces = Vec::new();
    let crc = checksum_then_copy_with(0, &src, &mut dst, |to, from| {
        pieces.push(from.len());
        to.copy_from_slice(from);
    });
    assert_eq!((crc, &dst), (crc32c(&src), &src));
    // Pieces of 16 KiB, checksummed right before each is copied.
    assert_eq!(pieces.iter().sum::<usize>(), src.len());
    assert!(pieces.iter().all(|&n| n <= 16 << 10), "{pieces:?}");
    assert_eq!(pieces.len(), src.len().div_ceil(16 << 10));
}

#[tokio::test]
async fn a_host_sink_returns_the_checksum_of_what_it_stored() {
    let bytes = pattern(50_000, 3);
    let mut sink = HostSink::new(bytes.len() as u64).unwrap();
    // A payload of several parts, as DATA read from the network is.
    let mut payload = Payload::from(Bytes::copy_from_slice(&bytes[10_000..30_000]));
    payload.push(Bytes::copy_from_slice(&bytes[30_000..]));
    let crc = sink
        .write_checksummed(10_000, payload, CreditPermit::unbudgeted(40_000))
        .await
        .unwrap();
    assert_eq!(crc, crc32c(&bytes[10_000..]));
    let head = Payload::from(Bytes::copy_from_slice(&bytes[..10_000]));
    let crc = sink
        .write_checksummed(0, head, CreditPermit::unbudgeted(10_000))
        .await
        .unwrap();
    assert_eq!(crc, crc32c(&bytes[..10_000]));
    assert_eq!(sink.finish().await.unwrap(), bytes);
    // Past the end: refused, nothing checksummed.
    let mut sink = HostSink::new(10).unwrap();
    let past = Payload::from(Bytes::from_static(&[1; 11]));
    assert!(
        sink.write_checksummed(0, past, CreditPermit::unbudgeted(11))
            .await
            .is_err()
    );
}
