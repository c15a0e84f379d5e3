//! COMPLETE (spec §6.8): every byte is verified and resident where the receiver put it.
//!
//! `type = 0x13 | length = 0`

/// Every byte arrived, the checksum matched, and the bytes are durable in the sink (on the
/// GPU, for a GPU sink). Never sent on mere arrival.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Complete;

impl Complete {
    pub(crate) const BODY_LEN: usize = 0;
}
