//! Test data shared by the test suites, benchmarks and the demo. Not a stable API.

/// `len` deterministic bytes (xorshift64), different per `seed`, never all zero: random
/// enough that a misplaced chunk or a dropped offset cannot match by accident.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.extend_from_slice(&state.to_le_bytes());
    }
    out.truncate(len);
    out
}
