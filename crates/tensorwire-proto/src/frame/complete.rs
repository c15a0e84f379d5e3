//! COMPLETE (spec §6.8): every byte is verified and resident where the receiver put it.
//!
//! `type = 0x13 | length | receipt` where the receipt (version 1.5) is empty, or
//! `count: u16 (≥ 1) | count × (key_len: u16 | key | value_len: u16 | value)`, at most
//! [`MAX_RECEIPT_LEN`](crate::MAX_RECEIPT_LEN) bytes.

use bytes::BytesMut;

use crate::error::{ErrorCode, ProtocolError};
use crate::receipt::{MAX_RECEIPT_LEN, Receipt};

/// Every byte arrived, the checksum matched, and the bytes are durable in the sink (on the
/// GPU, for a GPU sink). Never sent on mere arrival. Carries what the receiver made of the
/// tensor on a connection of version 1.5 or later.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Complete {
    /// What the receiver made of the tensor; empty before version 1.5.
    pub receipt: Receipt,
}

impl Complete {
    pub(crate) fn body_len(&self) -> usize {
        self.receipt.encoded_len()
    }

    pub(crate) fn decode(body: &[u8]) -> Result<Self, ProtocolError> {
        Ok(Self {
            receipt: Receipt::decode(body)?,
        })
    }

    pub(crate) fn encode_body(&self, dst: &mut BytesMut) {
        self.receipt.encode(dst);
    }
}

/// A COMPLETE body is empty or a receipt of at most [`MAX_RECEIPT_LEN`] bytes: longer is
/// FRAME_MALFORMED before the body is awaited.
pub(crate) fn check_len(len: u32) -> Result<(), ProtocolError> {
    if len as usize <= MAX_RECEIPT_LEN {
        Ok(())
    } else {
        Err(ProtocolError::malformed(
            ErrorCode::FRAME_MALFORMED,
            format!("COMPLETE body is {len} bytes, at most {MAX_RECEIPT_LEN}"),
        ))
    }
}
