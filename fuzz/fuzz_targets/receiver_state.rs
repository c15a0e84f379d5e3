//! Arbitrary frame sequences and local calls into the receiver state machine; its credit and
//! range accounting must hold after every step.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tensorwire_proto::fuzzing::receiver_ops(data));
