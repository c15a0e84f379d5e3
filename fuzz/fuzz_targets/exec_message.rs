//! Arbitrary bytes as a remote-execution request and reply (spec §14); whatever decodes must
//! re-encode to the bytes it came from.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tensorwire_exec::fuzzing::exec_round_trip(data));
