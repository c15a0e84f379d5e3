//! The golden vectors of `spec/vectors`: stored bytes equal what the code builds; every valid
//! frame decodes and re-encodes byte for byte, whole and split at every byte; every invalid
//! one fails with its documented code; every sequence ends as documented.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use bytes::{Bytes, BytesMut};
use common::vectors::{self, Manifest, vectors_dir};
use tensorwire_proto::Receipt;
use tensorwire_proto::{
    CreditTracker, ErrorCode, Frame, FrameDecoder, FrameType, IncomingEvent, Limits, ProtocolError,
    ReceiverEvent, Session, SessionConfig, StreamClosed, TensorReceiver,
};

fn read(file: &str) -> Bytes {
    std::fs::read(vectors_dir().join(file))
        .unwrap_or_else(|e| panic!("{file}: {e}"))
        .into()
}

fn stored_manifest() -> Manifest {
    let text = std::fs::read_to_string(vectors_dir().join("manifest.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Decodes a whole stream fed in `pieces`, including the end-of-stream check.
fn decode_stream(pieces: impl IntoIterator<Item = Bytes>) -> Result<Vec<Frame>, ProtocolError> {
    let mut decoder = FrameDecoder::new(Limits::default());
    let mut frames = Vec::new();
    for piece in pieces {
        decoder.push(piece);
        while let Some(frame) = decoder.next_frame()? {
            frames.push(frame);
        }
    }
    decoder.finish()?;
    Ok(frames)
}

#[test]
fn stored_vectors_match_what_the_code_builds() {
    let write = std::env::var_os("TENSORWIRE_WRITE_VECTORS").is_some();
    let dir = vectors_dir();
    let built_frames = vectors::frame_vectors()
        .into_iter()
        .map(|b| (b.vector.file, b.bytes));
    let built_sequences = vectors::sequence_vectors()
        .into_iter()
        .map(|b| (b.vector.file, b.bytes));
    let manifest = serde_json::to_string_pretty(&vectors::manifest()).unwrap() + "\n";
    if write {
        for sub in ["frames", "sequences"] {
            let _ = std::fs::remove_dir_all(dir.join(sub));
            std::fs::create_dir_all(dir.join(sub)).unwrap();
        }
        for (file, bytes) in built_frames.chain(built_sequences) {
            std::fs::write(dir.join(file), bytes).unwrap();
        }
        std::fs::write(dir.join("manifest.json"), manifest).unwrap();
        return;
    }
    assert_eq!(
        std::fs::read_to_string(dir.join("manifest.json")).unwrap(),
        manifest
    );
    for (file, bytes) in built_frames.chain(built_sequences) {
        assert_eq!(
            read(&file),
            bytes,
            "{file} differs from what the code builds"
        );
    }
}

#[test]
fn every_valid_frame_round_trips_byte_for_byte() {
    let manifest = stored_manifest();
    let valid: Vec<_> = manifest
        .frames
        .iter()
        .filter(|v| v.error.is_none())
        .collect();
    assert!(valid.len() >= 10);
    let mut types_seen = std::collections::HashSet::new();
    for vector in valid {
        let bytes = read(&vector.file);
        let frames =
            decode_stream([bytes.clone()]).unwrap_or_else(|e| panic!("{}: {e}", vector.file));
        assert_eq!(frames.len(), 1, "{}", vector.file);
        types_seen.insert(frames[0].frame_type());
        let mut encoded = BytesMut::new();
        frames[0].encode(&mut encoded);
        assert_eq!(
            &encoded[..],
            &bytes[..],
            "{} re-encodes differently",
            vector.file
        );
    }
    assert_eq!(types_seen.len(), 10, "a valid vector for every frame type");
}

#[test]
fn every_valid_frame_decodes_the_same_when_split_at_any_byte() {
    for vector in stored_manifest()
        .frames
        .iter()
        .filter(|v| v.error.is_none())
    {
        let bytes = read(&vector.file);
        let whole = decode_stream([bytes.clone()]).unwrap();
        for cut in 1..bytes.len() {
            let split = decode_stream([bytes.slice(..cut), bytes.slice(cut..)]).unwrap();
            assert_eq!(split, whole, "{} split at {cut}", vector.file);
        }
        let bytewise = decode_stream((0..bytes.len()).map(|i| bytes.slice(i..i + 1))).unwrap();
        assert_eq!(bytewise, whole, "{} fed byte by byte", vector.file);
    }
}

#[test]
fn every_invalid_frame_fails_with_its_documented_code() {
    let manifest = stored_manifest();
    let invalid: Vec<_> = manifest
        .frames
        .iter()
        .filter(|v| v.error.is_some())
        .collect();
    assert!(invalid.len() >= 20);
    for vector in invalid {
        let expected = vector.error.as_deref().unwrap();
        let bytes = read(&vector.file);
        let err = decode_stream([bytes.clone()]).expect_err(&vector.file);
        assert_eq!(
            err.code().name(),
            Some(expected),
            "{}: got {err}",
            vector.file
        );
        // Byte by byte, the same error: nothing depends on how the input was cut.
        let bytewise = decode_stream((0..bytes.len()).map(|i| bytes.slice(i..i + 1)));
        assert_eq!(
            bytewise.map(|_| ()),
            Err(err),
            "{} fed byte by byte",
            vector.file
        );
    }
}

/// Runs a sequence vector against a receiver as the manifest describes.
fn run_sequence(bytes: Bytes, credit: u64) -> Result<(), ProtocolError> {
    if bytes.first() == Some(&FrameType::EARLY.0) {
        return run_early_sequence(bytes, credit);
    }
    let mut receiver = TensorReceiver::new(Limits::default());
    let mut decoder = FrameDecoder::new(Limits::default());
    decoder.push(bytes);
    while let Some(frame) = decoder.next_frame()? {
        match receiver.handle_frame(frame)? {
            ReceiverEvent::Metadata => {
                receiver.accept()?;
                let _ = receiver.grant(credit);
            }
            ReceiverEvent::End => receiver.mark_resident(Receipt::new())?,
            _ => {}
        }
    }
    decoder.finish()?;
    match receiver.state() {
        tensorwire_proto::ReceiverState::Complete => Ok(()),
        other => panic!("sequence ended in state {other:?}"),
    }
}

/// Spec §7.6: a connection's session that offered `early_credit` bytes, accepting after END.
fn run_early_sequence(bytes: Bytes, early_credit: u64) -> Result<(), ProtocolError> {
    let mut config = SessionConfig::default();
    config.early_credit = early_credit;
    let mut credit = CreditTracker::new(1 << 30, 1 << 30, 1 << 29)?;
    #[allow(clippy::disallowed_methods)] // No timeouts are exercised: any instant will do.
    let now = std::time::Instant::now();
    let mut session = Session::new(config, now);
    assert_eq!(session.offer_early_credit(&mut credit), early_credit);
    assert!(matches!(
        session.poll_control_frame(),
        Some(Frame::EarlyCredit(_))
    ));
    session.open_stream(0, now)?;
    let mut decoder = FrameDecoder::new(Limits::default());
    decoder.push(bytes);
    let mut held = 0;
    while let Some(frame) = decoder.next_frame()? {
        match session.handle_frame(0, frame, &mut credit, now)? {
            IncomingEvent::Data(data) => held += data.payload.len() as u64,
            IncomingEvent::End => {
                session.accept(0, now)?;
                credit.release(std::mem::take(&mut held))?;
                session.mark_resident(0, Receipt::new())?;
            }
            _ => {}
        }
    }
    decoder.finish()?;
    let frames: Vec<Frame> = std::iter::from_fn(|| session.poll_frame(0)).collect();
    assert!(
        matches!(frames[..], [Frame::Accept(_), Frame::Complete(_)]),
        "ACCEPT and COMPLETE together, no CREDIT: {frames:?}"
    );
    assert_eq!(
        session.close_stream(0, &mut credit, now),
        StreamClosed::Completed
    );
    session.withdraw_early_credit(&mut credit);
    assert_eq!(credit.outstanding(), 0, "credit counted back");
    Ok(())
}

#[test]
fn every_sequence_ends_as_documented() {
    for vector in stored_manifest().sequences {
        let outcome = run_sequence(read(&vector.file), vector.credit);
        match (vector.outcome.as_str(), outcome) {
            ("COMPLETE", Ok(())) => {}
            (expected, Err(err)) => {
                assert_eq!(err.code().name(), Some(expected), "{}: {err}", vector.file)
            }
            (expected, Ok(())) => panic!("{}: completed, expected {expected}", vector.file),
        }
    }
}

#[test]
fn every_registered_error_code_has_a_blame_and_a_name() {
    for &code in ErrorCode::ALL {
        assert_ne!(code.blame(), tensorwire_proto::Blame::Unknown, "{code}");
        assert!(code.name().is_some());
    }
    assert_eq!(ErrorCode(0x7777).to_string(), "unknown code 0x7777");
}

/// The spec's registry (§9.2) and dtype table (§5.1) list exactly what the code defines.
#[test]
fn the_spec_registers_every_code_and_dtype() {
    let spec = std::fs::read_to_string(vectors_dir().join("../protocol.md")).unwrap();
    let registry: Vec<(u32, String)> = spec
        .lines()
        .filter_map(|line| {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let hex = cells.get(1)?.strip_prefix("0x")?;
            Some((
                u32::from_str_radix(&hex.replace('_', ""), 16).ok()?,
                cells.get(2)?.to_string(),
            ))
        })
        .filter(|(_, name)| {
            name.chars()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
        })
        .filter(|(code, _)| (0x0100..0x0500).contains(code))
        .collect();
    let code: Vec<(u32, String)> = ErrorCode::ALL
        .iter()
        .map(|c| (c.0, c.name().unwrap().to_owned()))
        .collect();
    assert_eq!(registry, code);
    for &dtype in tensorwire_proto::DType::ALL {
        let row = format!("| {} | {} | {} |", dtype.code(), dtype.name(), dtype.size());
        assert!(spec.contains(&row), "spec §5.1 lacks {row}");
    }
}
