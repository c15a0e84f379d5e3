//! What a receiver made of a tensor, carried back in COMPLETE (spec §6.8, version 1.5).

use bytes::BufMut;

use crate::error::ProtocolError;
use crate::frame::FrameType;
use crate::frame::wire::Reader;

/// Most bytes a COMPLETE body (a receipt) may have (spec §6.8).
pub const MAX_RECEIPT_LEN: usize = 4096;

/// Bytes a receipt's entry count takes.
const COUNT_LEN: usize = 2;

/// Bytes each entry's two length fields take.
const ENTRY_FIXED_LEN: usize = 4;

/// What a receiver made of a tensor, as key-value entries in COMPLETE (spec §6.8): where it
/// landed, the id local processes open it by, where it was saved. Keys starting with
/// `tensorwire.` are the spec's ([`Receipt::DEVICE`] and the others); the rest are the
/// application's. Empty on a connection older than 1.5, which cannot carry one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Receipt {
    entries: Vec<(String, String)>,
}

impl Receipt {
    /// Where the bytes landed: `cuda:N` or `host` (spec §5.2's names).
    pub const DEVICE: &'static str = "tensorwire.device";
    /// The id local processes open the tensor by, when the receiver shares it.
    pub const SHARED_ID: &'static str = "tensorwire.shared.id";
    /// The shared tensor's generation (decimal): how many times its id was updated.
    pub const SHARED_GENERATION: &'static str = "tensorwire.shared.generation";
    /// The file on the receiver's host the tensor is saved into.
    pub const SAVED: &'static str = "tensorwire.saved";

    /// A receipt with no entries (COMPLETE's empty body).
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds an entry. One that would take the body past [`MAX_RECEIPT_LEN`] is left out, so
    /// that a receipt always fits the wire: the receiver's own entries come first.
    pub fn with(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.push(key.into(), value.into());
        self
    }

    /// Adds an entry as [`with`](Self::with) does; says whether it fitted.
    pub fn push(&mut self, key: String, value: String) -> bool {
        let base = self.encoded_len().max(COUNT_LEN);
        if base + ENTRY_FIXED_LEN + key.len() + value.len() > MAX_RECEIPT_LEN {
            return false;
        }
        self.entries.push((key, value));
        true
    }

    /// Every entry, in order.
    pub fn entries(&self) -> &[(String, String)] {
        &self.entries
    }

    /// The value of the first entry named `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.entries
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Whether it has no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Where the bytes landed ([`Receipt::DEVICE`]).
    pub fn device(&self) -> Option<&str> {
        self.get(Self::DEVICE)
    }

    /// The shared id ([`Receipt::SHARED_ID`]).
    pub fn shared_id(&self) -> Option<&str> {
        self.get(Self::SHARED_ID)
    }

    /// The shared generation ([`Receipt::SHARED_GENERATION`]), if it is a number.
    pub fn shared_generation(&self) -> Option<u64> {
        self.get(Self::SHARED_GENERATION)?.parse().ok()
    }

    /// The file it was saved into ([`Receipt::SAVED`]).
    pub fn saved(&self) -> Option<&str> {
        self.get(Self::SAVED)
    }

    /// Its body's length on the wire: nothing when empty, else the count and the entries.
    pub(crate) fn encoded_len(&self) -> usize {
        if self.entries.is_empty() {
            return 0;
        }
        let entries: usize = self
            .entries
            .iter()
            .map(|(key, value)| ENTRY_FIXED_LEN + key.len() + value.len())
            .sum();
        COUNT_LEN + entries
    }

    /// Writes the body: nothing when empty, else `count: u16` and the entries.
    pub(crate) fn encode(&self, dst: &mut impl BufMut) {
        if self.entries.is_empty() {
            return;
        }
        dst.put_u16_le(self.entries.len() as u16);
        for (key, value) in &self.entries {
            dst.put_u16_le(key.len() as u16);
            dst.put_slice(key.as_bytes());
            dst.put_u16_le(value.len() as u16);
            dst.put_slice(value.as_bytes());
        }
    }

    /// Reads a body whose length the header check bounded. An empty body is an empty
    /// receipt; a count of 0 is FRAME_MALFORMED (the encoding is canonical).
    pub(crate) fn decode(body: &[u8]) -> Result<Self, ProtocolError> {
        let mut receipt = Self::default();
        if body.is_empty() {
            return Ok(receipt);
        }
        let mut r = Reader::new(body, FrameType::COMPLETE);
        let count = r.u16()?;
        if count == 0 {
            return Err(r.malformed("a receipt of 0 entries (send an empty body instead)"));
        }
        for _ in 0..count {
            let key_len = usize::from(r.u16()?);
            let key = r.string(key_len)?;
            let value_len = usize::from(r.u16()?);
            let value = r.string(value_len)?;
            receipt.entries.push((key, value));
        }
        r.finish()?;
        Ok(receipt)
    }
}
