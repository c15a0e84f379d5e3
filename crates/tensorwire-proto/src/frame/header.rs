//! The frame header: its length and the registry of frame type codes (spec §6).

use std::fmt;

/// Bytes in a frame header: type (1) and body length (4).
pub const HEADER_LEN: usize = 5;

/// A frame type code (spec §6). Open: unknown codes are kept and printed.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct FrameType(pub u8);

impl FrameType {
    /// Sender → receiver: describes the tensor.
    pub const METADATA: FrameType = FrameType(0x01);
    /// Sender → receiver: bytes at an offset.
    pub const DATA: FrameType = FrameType(0x02);
    /// Sender → receiver: all bytes sent, with the whole-tensor checksum.
    pub const END: FrameType = FrameType(0x03);
    /// Either direction: abandon the tensor, with a code and reason.
    pub const CANCEL: FrameType = FrameType(0x04);
    /// Sender → receiver: the tensor's bytes follow without waiting for ACCEPT (version 1.2).
    pub const EARLY: FrameType = FrameType(0x05);
    /// Receiver → sender: the tensor is admitted.
    pub const ACCEPT: FrameType = FrameType(0x10);
    /// Receiver → sender: the tensor is refused.
    pub const REJECT: FrameType = FrameType(0x11);
    /// Receiver → sender: more bytes may be sent.
    pub const CREDIT: FrameType = FrameType(0x12);
    /// Receiver → sender: every byte is verified and resident.
    pub const COMPLETE: FrameType = FrameType(0x13);
    /// Receiver → sender, on the control stream: tensors may be sent early (version 1.2).
    pub const EARLY_CREDIT: FrameType = FrameType(0x14);

    /// The registered name of this type, if it has one.
    pub fn name(self) -> Option<&'static str> {
        Some(match self {
            Self::METADATA => "METADATA",
            Self::DATA => "DATA",
            Self::END => "END",
            Self::CANCEL => "CANCEL",
            Self::ACCEPT => "ACCEPT",
            Self::REJECT => "REJECT",
            Self::CREDIT => "CREDIT",
            Self::COMPLETE => "COMPLETE",
            Self::EARLY => "EARLY",
            Self::EARLY_CREDIT => "EARLY_CREDIT",
            _ => return None,
        })
    }
}

impl fmt::Display for FrameType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => f.write_str(name),
            None => write!(f, "unknown frame type 0x{:02x}", self.0),
        }
    }
}

impl fmt::Debug for FrameType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}
