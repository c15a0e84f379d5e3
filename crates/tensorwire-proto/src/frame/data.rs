//! DATA (spec §6.2): bytes of the tensor at an offset.
//!
//! `type = 0x02 | length = 8 + n | offset: u64 | payload: [u8; n]`, with 1 ≤ n ≤ the
//! receiver's `max_data_payload`.

use bytes::{BufMut, BytesMut};

use crate::error::{ErrorCode, ProtocolError};
use crate::limits::Limits;
use crate::payload::{ByteQueueBody, Payload};

/// Bytes `[offset, offset + payload.len())` of the tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Data {
    /// Where the payload starts in the tensor.
    pub offset: u64,
    /// The bytes, as shared slices of what was received.
    pub payload: Payload,
}

/// Bytes of the DATA body before the payload: the offset.
const OFFSET_LEN: usize = 8;

impl Data {
    /// DATA carrying `payload` at `offset`.
    pub fn new(offset: u64, payload: impl Into<Payload>) -> Self {
        Self {
            offset,
            payload: payload.into(),
        }
    }

    /// One past the last byte this frame covers, or `None` if that overflows `u64`.
    pub fn end(&self) -> Option<u64> {
        self.offset.checked_add(self.payload.len() as u64)
    }

    pub(crate) fn body_len(&self) -> usize {
        OFFSET_LEN + self.payload.len()
    }

    pub(crate) fn decode(body: &mut ByteQueueBody<'_>) -> Self {
        let offset = body.take_u64_le();
        Self {
            offset,
            payload: body.take_rest(),
        }
    }

    /// Writes the offset; the payload follows as its own `Bytes`.
    pub(crate) fn encode_body_header(&self, dst: &mut BytesMut) {
        dst.put_u64_le(self.offset);
    }
}

/// Checks a DATA header's body length (spec §8).
pub(crate) fn check_len(len: u32, limits: &Limits) -> Result<(), ProtocolError> {
    let Some(payload_len) = (len as usize).checked_sub(OFFSET_LEN) else {
        return Err(ProtocolError::malformed(
            ErrorCode::FRAME_MALFORMED,
            format!("DATA body is {len} bytes, shorter than its offset"),
        ));
    };
    if payload_len == 0 || payload_len > limits.max_data_payload as usize {
        return Err(ProtocolError::LimitExceeded {
            code: ErrorCode::CHUNK_SIZE,
            what: "DATA payload length (must be at least 1)",
            value: payload_len as u64,
            limit: limits.max_data_payload as u64,
        });
    }
    Ok(())
}
