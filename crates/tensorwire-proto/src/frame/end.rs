//! END (spec §6.3): the sender has sent every byte.
//!
//! `type = 0x03 | length = 8 | checksum: u64` (CRC-32C in the low 32 bits, high bits zero)

use bytes::{BufMut, BytesMut};

use super::header::FrameType;
use super::wire::Reader;
use crate::error::ProtocolError;

/// Every byte has been sent; carries the whole-tensor checksum.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct End {
    /// The checksum of the whole tensor under METADATA's algorithm.
    pub checksum: u64,
}

impl End {
    pub(crate) const BODY_LEN: usize = 8;

    pub(crate) fn decode(body: &[u8]) -> Result<Self, ProtocolError> {
        let mut r = Reader::new(body, FrameType::END);
        let checksum = r.u64()?;
        r.finish()?;
        Ok(Self { checksum })
    }

    pub(crate) fn encode_body(&self, dst: &mut BytesMut) {
        dst.put_u64_le(self.checksum);
    }
}
