//! A connection session under arbitrary frames, local calls and a fake clock.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tensorwire_proto::fuzzing::session_ops(data));
