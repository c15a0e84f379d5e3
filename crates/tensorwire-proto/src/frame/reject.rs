//! REJECT (spec §6.6): the receiver refuses the tensor after METADATA.
//!
//! `type = 0x11 | length | code: u32 | reason_len: u16 | reason: [u8; reason_len] (UTF-8)`

use bytes::BytesMut;

use super::header::FrameType;
use super::wire;
use crate::error::{ErrorCode, ProtocolError};

/// Refuses the tensor; the sender must send nothing more on the stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reject {
    /// Why, as a wire code.
    pub code: ErrorCode,
    /// Why, in words; at most [`MAX_REASON_LEN`](crate::MAX_REASON_LEN) bytes.
    pub reason: String,
}

impl Reject {
    /// A REJECT whose reason is cut to the spec's maximum on a character boundary.
    pub fn new(code: ErrorCode, reason: impl Into<String>) -> Self {
        Self {
            code,
            reason: wire::truncate_reason(reason.into(), crate::MAX_REASON_LEN),
        }
    }

    pub(crate) fn body_len(&self) -> usize {
        wire::REASON_FIXED_LEN + self.reason.len()
    }

    pub(crate) fn decode(body: &[u8]) -> Result<Self, ProtocolError> {
        let (code, reason) = wire::decode_reason(FrameType::REJECT, body)?;
        Ok(Self { code, reason })
    }

    pub(crate) fn encode_body(&self, dst: &mut BytesMut) {
        wire::encode_reason(self.code, &self.reason, dst);
    }
}
