//! Arbitrary bytes as a TCP connection of the TCP binding (spec §16), fed in pieces the
//! input chooses; deframed packets must frame back to the bytes they came from.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tensorwire_proto::fuzzing::deframe_round_trip(data));
