//! CANCEL (spec §6.4): either side abandons the tensor.
//!
//! `type = 0x04 | length | code: u32 | reason_len: u16 | reason: [u8; reason_len] (UTF-8)`

use bytes::BytesMut;

use super::header::FrameType;
use super::wire;
use crate::error::{ErrorCode, ProtocolError};

/// Abandons the tensor; the stream carries nothing after it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cancel {
    /// Why, as a wire code.
    pub code: ErrorCode,
    /// Why, in words; at most [`MAX_REASON_LEN`](crate::MAX_REASON_LEN) bytes.
    pub reason: String,
}

impl Cancel {
    /// A CANCEL whose reason is cut to the spec's maximum on a character boundary.
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
        let (code, reason) = wire::decode_reason(FrameType::CANCEL, body)?;
        Ok(Self { code, reason })
    }

    pub(crate) fn encode_body(&self, dst: &mut BytesMut) {
        wire::encode_reason(self.code, &self.reason, dst);
    }
}
