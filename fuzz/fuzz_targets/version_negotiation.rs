//! A server of an arbitrary minor version against arbitrary client ALPN offers: it chooses
//! the newest version both offer, and identifiers parse and print back the same.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tensorwire_proto::fuzzing::negotiate_versions(data));
