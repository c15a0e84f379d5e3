//! EARLY_CREDIT (spec §6.10): the receiver lets the sender send tensors early (spec §7.6).
//! Only on the receiver's control stream (spec §4.1).
//!
//! `type = 0x14 | length = 12 | bytes: u64 | max_data_payload: u32`

use bytes::{BufMut, BytesMut};

use super::header::FrameType;
use super::wire::Reader;
use crate::error::ProtocolError;

/// Adds to the sender's early allowance on this connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EarlyCredit {
    /// Payload bytes added to the early allowance (an increment, not a total).
    pub bytes: u64,
    /// The largest DATA payload of a tensor sent early (non-zero).
    pub max_data_payload: u32,
}

impl EarlyCredit {
    pub(crate) const BODY_LEN: usize = 12;

    pub(crate) fn decode(body: &[u8]) -> Result<Self, ProtocolError> {
        let mut r = Reader::new(body, FrameType::EARLY_CREDIT);
        let bytes = r.u64()?;
        let max_data_payload = r.u32()?;
        r.finish()?;
        Ok(Self {
            bytes,
            max_data_payload,
        })
    }

    pub(crate) fn encode_body(&self, dst: &mut BytesMut) {
        dst.put_u64_le(self.bytes);
        dst.put_u32_le(self.max_data_payload);
    }
}
