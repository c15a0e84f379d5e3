//! CREDIT (spec §6.7): the receiver lets the sender send more bytes.
//!
//! `type = 0x12 | length = 8 | bytes: u64` (an increment, not a total)

use bytes::{BufMut, BytesMut};

use super::header::FrameType;
use super::wire::Reader;
use crate::error::ProtocolError;

/// Grants the sender this many more payload bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Credit {
    /// Payload bytes added to the sender's allowance.
    pub bytes: u64,
}

impl Credit {
    pub(crate) const BODY_LEN: usize = 8;

    pub(crate) fn decode(body: &[u8]) -> Result<Self, ProtocolError> {
        let mut r = Reader::new(body, FrameType::CREDIT);
        let bytes = r.u64()?;
        r.finish()?;
        Ok(Self { bytes })
    }

    pub(crate) fn encode_body(&self, dst: &mut BytesMut) {
        dst.put_u64_le(self.bytes);
    }
}
