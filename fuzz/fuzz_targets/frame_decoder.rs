//! Arbitrary bytes, fed at split points the input chooses; decoded frames must re-encode to
//! the bytes they came from.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tensorwire_proto::fuzzing::decode_round_trip(data));
