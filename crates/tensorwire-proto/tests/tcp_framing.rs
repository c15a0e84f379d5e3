//! The TCP binding's framing (spec §16) against `spec/vectors/tcp_framing.txt`: each stored
//! connection's bytes, fed whole and one byte at a time, yield its packets and end with its
//! error; framing the packets gives the bytes back.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use bytes::BytesMut;
use tensorwire_proto::{FramingError, MAX_TCP_PACKET, PacketDeframer, frame_packet};

fn hex(text: &str) -> Vec<u8> {
    if text == "-" {
        return Vec::new();
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
        .collect()
}

fn error_name(error: &FramingError) -> &'static str {
    match error {
        FramingError::EmptyPacket => "empty packet",
        FramingError::PacketTooLong { .. } => "packet too long",
        FramingError::Truncated { .. } => "truncated",
    }
}

/// Packets and the error a connection's bytes, pushed in pieces of `piece` bytes, give.
fn deframe(bytes: &[u8], piece: usize) -> (Vec<Vec<u8>>, Option<FramingError>) {
    let mut deframer = PacketDeframer::new();
    let mut packets = Vec::new();
    for chunk in bytes.chunks(piece.max(1)) {
        deframer.push(chunk);
        loop {
            match deframer.next_packet() {
                Ok(Some(packet)) => packets.push(packet.to_vec()),
                Ok(None) => break,
                Err(e) => return (packets, Some(e)),
            }
        }
    }
    (packets, deframer.finish().err())
}

#[test]
fn every_stored_case_deframes_as_documented() {
    let cases = common::text_cases("tcp_framing.txt", 3);
    assert!(cases.len() >= 8, "only {} cases", cases.len());
    for case in &cases {
        let [bytes, packets, error] = [&case[0], &case[1], &case[2]].map(String::as_str);
        let bytes = hex(bytes);
        let expected: Vec<Vec<u8>> = match packets {
            "-" => Vec::new(),
            list => list.split(',').map(hex).collect(),
        };
        for piece in [bytes.len(), 1] {
            let (packets, got) = deframe(&bytes, piece);
            assert_eq!(packets, expected, "{case:?} (pieces of {piece})");
            assert_eq!(
                got.as_ref().map(error_name).unwrap_or("-"),
                error,
                "{case:?}"
            );
        }
        if error == "-" {
            let mut framed = BytesMut::new();
            for packet in &expected {
                frame_packet(&mut framed, packet).unwrap();
            }
            assert_eq!(framed.to_vec(), bytes, "{case:?}");
        }
    }
}

#[test]
fn the_largest_packet_passes_and_one_byte_more_is_refused() {
    let packet = vec![7u8; MAX_TCP_PACKET];
    let mut framed = BytesMut::new();
    frame_packet(&mut framed, &packet).unwrap();
    assert_eq!(&framed[..2], &[0xf7, 0xff]);
    let (packets, error) = deframe(&framed, 4096);
    assert_eq!((packets, error), (vec![packet], None));
    assert_eq!(
        frame_packet(&mut framed, &vec![0u8; MAX_TCP_PACKET + 1]),
        Err(FramingError::PacketTooLong {
            length: MAX_TCP_PACKET + 1
        })
    );
    assert_eq!(
        frame_packet(&mut framed, &[]),
        Err(FramingError::EmptyPacket)
    );
}

/// A hostile length is refused when its two bytes arrive, before its packet is awaited, and
/// the deframer never holds more than one packet beyond what it was given.
#[test]
fn a_bad_length_fails_before_its_bytes_and_nothing_grows() {
    let mut deframer = PacketDeframer::new();
    deframer.push(&[0xff]);
    assert_eq!(deframer.next_packet(), Ok(None));
    deframer.push(&[0xff]);
    assert!(matches!(
        deframer.next_packet(),
        Err(FramingError::PacketTooLong { length: 65_535 })
    ));
    let mut deframer = PacketDeframer::new();
    deframer.push(&[0xf7, 0xff, 1, 2, 3]);
    assert_eq!(deframer.next_packet(), Ok(None));
    assert_eq!(deframer.buffered(), 5);
    assert!(deframer.buffer().capacity() <= 2 * (MAX_TCP_PACKET + 2));
    assert_eq!(
        deframer.finish(),
        Err(FramingError::Truncated {
            missing: MAX_TCP_PACKET - 3
        })
    );
}
