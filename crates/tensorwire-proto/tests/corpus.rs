//! Replays the committed fuzz corpora and every golden vector through the fuzz entry points,
//! so plain `cargo test` (and CI) exercises what fuzzing found.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::path::Path;

use tensorwire_proto::fuzzing::{decode_round_trip, deframe_round_trip, receiver_ops, session_ops};

fn replay(dir: &Path, run: fn(&[u8])) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut count = 0;
    for entry in entries {
        let path = entry.unwrap().path();
        if path.is_file() {
            run(&std::fs::read(&path).unwrap());
            count += 1;
        }
    }
    count
}

fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

#[test]
fn the_frame_decoder_corpus_replays_cleanly() {
    let n = replay(&root().join("fuzz/corpus/frame_decoder"), decode_round_trip);
    assert!(n >= 50, "only {n} corpus inputs: run fuzz/seed.sh");
}

/// Inputs that once crashed a target, kept by name so a fix stays fixed.
#[test]
fn past_crashes_stay_fixed() {
    let n = replay(
        &root().join("fuzz/regressions/frame_decoder"),
        decode_round_trip,
    );
    assert!(n >= 1);
}

#[test]
fn the_receiver_state_corpus_replays_cleanly() {
    let n = replay(&root().join("fuzz/corpus/receiver_state"), receiver_ops);
    assert!(n >= 16, "only {n} corpus inputs: run fuzz/seed.sh");
}

#[test]
fn the_tcp_framing_corpus_replays_cleanly() {
    let n = replay(&root().join("fuzz/corpus/tcp_framing"), deframe_round_trip);
    assert!(n >= 16, "only {n} corpus inputs: run fuzz/seed.sh");
}

#[test]
fn the_session_corpus_replays_cleanly() {
    let n = replay(&root().join("fuzz/corpus/session_ops"), session_ops);
    assert!(n >= 16, "only {n} corpus inputs: run fuzz/seed.sh");
}

#[test]
fn every_vector_replays_through_every_target() {
    for sub in ["spec/vectors/frames", "spec/vectors/sequences"] {
        let n = replay(&root().join(sub), |bytes| {
            // Prefix a split step or an empty op list, as the fuzz inputs do.
            decode_round_trip(&[&[1u8][..], bytes].concat());
            receiver_ops(&[&[0u8][..], bytes].concat());
            session_ops(&[&[0u8][..], bytes].concat());
        });
        assert!(n > 10, "{sub}");
    }
}

#[test]
fn the_version_negotiation_corpus_replays_cleanly() {
    let n = replay(
        &root().join("fuzz/corpus/version_negotiation"),
        tensorwire_proto::fuzzing::negotiate_versions,
    );
    assert!(n >= 8, "only {n} corpus inputs: run fuzz/seed.sh");
}
