//! ACCEPT (spec §6.5): the receiver admits the tensor.
//!
//! `type = 0x10 | length = 4 | max_data_payload: u32`

use bytes::{BufMut, BytesMut};

use super::header::FrameType;
use super::wire::Reader;
use crate::error::ProtocolError;

/// Admits the tensor; DATA may follow once CREDIT grants bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Accept {
    /// The largest DATA payload the receiver takes, in bytes (non-zero).
    pub max_data_payload: u32,
}

impl Accept {
    pub(crate) const BODY_LEN: usize = 4;

    pub(crate) fn decode(body: &[u8]) -> Result<Self, ProtocolError> {
        let mut r = Reader::new(body, FrameType::ACCEPT);
        let max_data_payload = r.u32()?;
        r.finish()?;
        Ok(Self { max_data_payload })
    }

    pub(crate) fn encode_body(&self, dst: &mut BytesMut) {
        dst.put_u32_le(self.max_data_payload);
    }
}
