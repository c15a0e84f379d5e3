//! CRC-32C (spec §5.3), through `crc-fast` (SIMD; measured 1.7× the `crc32c` crate on
//! 6 KB pieces, the size QUIC delivers at MTU 6000).

use crc_fast::CrcAlgorithm::Crc32Iscsi;

/// CRC-32C of `data`.
pub fn crc32c(data: &[u8]) -> u32 {
    crc32c_append(0, data)
}

/// CRC-32C of the bytes whose CRC is `crc` followed by `data`.
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    // crc-fast continues from a finalized CRC-32C when given it as the running state.
    let mut digest =
        crc_fast::Digest::new_with_init_state(Crc32Iscsi, u64::from(crc ^ 0xFFFF_FFFF));
    digest.update(data);
    digest.finalize() as u32
}

/// CRC-32C of `A ‖ B` from `crc(A)`, `crc(B)` and `len(B)`.
pub fn crc32c_combine(crc_a: u32, crc_b: u32, len_b: u64) -> u32 {
    crc_fast::checksum_combine(Crc32Iscsi, u64::from(crc_a), u64::from(crc_b), len_b) as u32
}
