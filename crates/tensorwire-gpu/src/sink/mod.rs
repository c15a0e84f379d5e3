//! The GPU sink: DATA chunks are copied into pinned staging buffers, coalesced to about
//! 4 MiB, and copied to the destination on the device's copy stream; a staging buffer and
//! the credit of its bytes come back only once its copy's event has completed. Payload pieces
//! that quinn decrypted into pinned memory ([`PinnedDatagrams`](crate::PinnedDatagrams)) skip
//! staging: about 4 MiB of them are copied to the device in one batch, straight from there.

mod copy;
mod factory;

pub use copy::{GpuSink, Handoff};
pub use factory::{GpuSinkFactory, HostFallback};

/// Staging buffer size: a host-to-device copy pays a fixed cost, which copies this large
/// spread thin enough to run near the link's rate (benches/results/LOG.md).
pub const STAGING_BUFFER: usize = 4 << 20;

/// The default staging pool: 128 MiB of pinned memory, allocated up front.
pub const DEFAULT_STAGING_POOL: usize = 128 << 20;

/// The shortest payload piece copied to the device straight from its pinned datagram: a
/// shorter one (packets under 16 KiB, as GRO batches them) goes through staging, where the
/// copy engine would spend more on a copy's fixed cost than on its bytes.
const DIRECT_FROM: usize = 16 << 10;

/// Tensors at least this long (one staging buffer) are checksummed on the device once landed
/// ([`ChecksumOn::Device`]); shorter ones as they arrive, where a kernel's round trip would
/// cost more time than the CPU saves.
pub const CHECKSUM_ON_DEVICE_FROM: usize = STAGING_BUFFER;

/// Bytes each GPU thread checksums: smaller pieces finish the kernel sooner but leave the host
/// more CRCs to combine (benches/results/LOG.md).
const CHECKSUM_PIECE: usize = 16 << 10;

/// The piece each GPU thread checksums in a tensor of `len` bytes: one staging buffer holds
/// the pieces' CRCs (4 bytes each), so pieces grow past 16 GiB tensors.
fn checksum_piece(len: usize) -> usize {
    let most_pieces = STAGING_BUFFER / 4;
    CHECKSUM_PIECE
        .max(len.div_ceil(most_pieces))
        .next_multiple_of(16)
}

/// Where a GPU receiver computes the CRC-32C that END's checksum is checked against
/// (spec §7.3).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ChecksumOn {
    /// Over the landed tensor, on the device, for tensors of [`CHECKSUM_ON_DEVICE_FROM`]
    /// bytes or more: no CPU core reads their bytes but the copy into staging. Shorter
    /// tensors, and every tensor where the kernel does not load (a warning says why), are
    /// checksummed on the host.
    #[default]
    Device,
    /// On the host, each payload in the same pass as its copy into staging.
    Host,
}

impl std::str::FromStr for ChecksumOn {
    type Err = String;

    /// `device` or `host`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "device" => Ok(Self::Device),
            "host" => Ok(Self::Host),
            _ => Err(format!("checksum on {s:?}: expected device or host")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every tensor's pieces' CRCs fit in one staging buffer.
    #[test]
    fn the_pieces_crcs_of_any_tensor_fit_one_staging_buffer() {
        for len in [
            1,
            16 << 10,
            16 << 30,
            (16 << 30) + 1,
            1 << 40,
            usize::MAX / 2,
        ] {
            let piece = checksum_piece(len);
            assert!(
                piece >= CHECKSUM_PIECE && piece.is_multiple_of(16),
                "{len}: {piece}"
            );
            assert!(len.div_ceil(piece) * 4 <= STAGING_BUFFER, "{len}: {piece}");
        }
        assert_eq!(checksum_piece(16 << 30), CHECKSUM_PIECE);
    }
}
