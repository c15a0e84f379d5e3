//! The receiver's limits, checked before anything is buffered or allocated (spec §8).

/// Limits a decoder and receiver enforce on what a peer sends (spec §8).
///
/// Every length is checked against these before the bytes it announces are awaited or
/// allocated, so a peer can make a receiver hold at most about `max_frame_len()` bytes of
/// undecoded input per stream.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Limits {
    /// Largest METADATA body in bytes.
    pub max_metadata_len: u32,
    /// Most dimensions in a shape.
    pub max_dims: u8,
    /// Longest tensor name in bytes.
    pub max_name_len: u16,
    /// Most attributes on one tensor.
    pub max_attributes: u16,
    /// Longest attribute key or value in bytes.
    pub max_attribute_len: u16,
    /// Longest CANCEL or REJECT reason in bytes.
    pub max_reason_len: u16,
    /// Largest DATA payload in bytes; advertised to the sender in ACCEPT.
    pub max_data_payload: u32,
    /// Largest tensor the receiver accepts, in bytes.
    pub max_tensor_len: u64,
    /// Most disjoint received ranges one tensor may have while incomplete.
    pub max_ranges: usize,
}

impl Limits {
    /// Largest frame (header included) a decoder with these limits buffers.
    pub fn max_frame_len(&self) -> usize {
        let body = (self.max_metadata_len as usize)
            .max(8 + self.max_data_payload as usize)
            .max(6 + self.max_reason_len as usize)
            .max(crate::MAX_RECEIPT_LEN);
        crate::frame::header::HEADER_LEN + body
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_metadata_len: 64 * 1024,
            max_dims: 32,
            max_name_len: 1024,
            max_attributes: 64,
            max_attribute_len: 4096,
            max_reason_len: 1024,
            max_data_payload: 16 * 1024 * 1024,
            max_tensor_len: 64 * 1024 * 1024 * 1024,
            max_ranges: 1024,
        }
    }
}
