//! Where received tensor bytes go, without any transport: the [`Sink`] trait that every
//! destination implements (host memory here, GPU memory in `tensorwire-gpu`), the
//! [`CreditPermit`]s that hand bytes back to a receiver's credit budget once they are
//! durable, the [`MemoryBudget`] that destination buffers are admitted against
//! (spec §7.1, §7.5), and [`SplitTensors`], which lands the parts of a split tensor in one
//! destination and delivers the whole once (spec §15).
//!
//! This crate depends on no QUIC stack, so crates that only land or share tensors
//! (`tensorwire-gpu`, `tensorwire-ipc`) compile none.
//!
//! # Example: host memory admitted against a budget
//!
//! ```
//! use tensorwire_sink::{HostSink, MemoryBudget};
//!
//! let budget = MemoryBudget::new("host memory", 1 << 20);
//! let reservation = budget.try_reserve(4096)?; // refused, not allocated, past the limit
//! let sink = HostSink::reserved(reservation)?;
//! assert_eq!(budget.snapshot().reserved, 4096);
//! assert!(budget.try_reserve(1 << 20).is_err());
//! drop(sink); // the bytes go back to the budget with the buffer
//! assert_eq!(budget.snapshot().reserved, 0);
//! # Ok::<(), tensorwire_sink::SinkError>(())
//! ```
#![forbid(unsafe_code)]

mod carrier;
mod host;
mod limit;
mod memory;
mod permit;
mod shares;
mod split;

use std::future::Future;

use tensorwire_proto::{ErrorCode, Payload, Receipt};

pub use carrier::Carrier;
pub use host::HostSink;
pub use limit::{LimitSource, MemoryLimit};
pub use memory::{MemoryBudget, MemoryReservation, MemorySnapshot};
pub use permit::{CreditPermit, CreditRelease};
pub use shares::{MemoryShares, PeerMembership, PeerShares};
pub use split::{
    Assembled, Assembling, Divisible, Landing, MAX_ASSEMBLING, MAX_ASSEMBLING_PER_PEER, PartSink,
    SplitTensors,
};

/// Bytes checksummed at a time by [`checksum_then_copy`]: small enough to stay in a core's
/// first-level cache between the checksum and the copy.
const FUSED_PIECE: usize = 16 << 10;

/// Copies `src` into `dst` (the same length) and returns the CRC-32C of the bytes whose CRC
/// is `crc` followed by `src`, reading each piece from memory once: it is checksummed, then
/// copied while still in cache.
pub fn checksum_then_copy(crc: u32, src: &[u8], dst: &mut [u8]) -> u32 {
    checksum_then_copy_with(crc, src, dst, |to, from| to.copy_from_slice(from))
}

/// As [`checksum_then_copy`], each piece copied by `copy(to, from)` (e.g. a GPU sink's
/// streaming stores into staging).
pub fn checksum_then_copy_with(
    mut crc: u32,
    src: &[u8],
    dst: &mut [u8],
    mut copy: impl FnMut(&mut [u8], &[u8]),
) -> u32 {
    for (from, to) in src.chunks(FUSED_PIECE).zip(dst.chunks_mut(FUSED_PIECE)) {
        crc = tensorwire_proto::checksum::crc32c_append(crc, from);
        copy(to, from);
    }
    crc
}

/// Copies `payload` into `dst` (the same length); with `crc`, continues it over the bytes in
/// the same pass ([`checksum_then_copy`]).
fn copy_payload(payload: &Payload, mut dst: &mut [u8], mut crc: Option<&mut u32>) {
    for part in payload.parts() {
        let (to, rest) = std::mem::take(&mut dst).split_at_mut(part.len());
        match crc.as_deref_mut() {
            Some(crc) => *crc = checksum_then_copy(*crc, part, to),
            None => to.copy_from_slice(part),
        }
        dst = rest;
    }
}

/// Copies `payload` into `buf` at byte `offset`, with `crc` continuing its CRC-32C over the
/// bytes in the same pass ([`checksum_then_copy`]); bytes past the end of `buf` are a
/// SINK_FAILED error and nothing is copied.
pub fn copy_payload_at(
    buf: &mut [u8],
    offset: u64,
    payload: &Payload,
    crc: Option<&mut u32>,
) -> Result<(), SinkError> {
    let size = buf.len();
    let start = usize::try_from(offset).unwrap_or(usize::MAX);
    let dst = start
        .checked_add(payload.len())
        .and_then(|end| buf.get_mut(start..end))
        .ok_or_else(|| {
            SinkError::failed(format!(
                "{} bytes at {offset} past the end of a {size}-byte destination",
                payload.len()
            ))
        })?;
    copy_payload(payload, dst, crc);
    Ok(())
}

/// A sink's failure; `code` is what the sender is told (RESOURCE_EXHAUSTED, SINK_FAILED or
/// UNSUPPORTED_DEVICE).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct SinkError {
    /// The wire code sent to the peer.
    pub code: ErrorCode,
    /// What went wrong.
    pub message: String,
}

impl SinkError {
    /// Memory or buffers for the tensor could not be had.
    pub fn exhausted(message: impl Into<String>) -> Self {
        Self {
            code: ErrorCode::RESOURCE_EXHAUSTED,
            message: message.into(),
        }
    }

    /// Storing bytes failed.
    pub fn failed(message: impl Into<String>) -> Self {
        Self {
            code: ErrorCode::SINK_FAILED,
            message: message.into(),
        }
    }

    /// The tensor asked for a device this receiver cannot land it on (spec §5.2).
    pub fn unsupported_device(message: impl Into<String>) -> Self {
        Self {
            code: ErrorCode::UNSUPPORTED_DEVICE,
            message: message.into(),
        }
    }
}

/// Owns one tensor's destination memory and stores its bytes as they arrive.
///
/// The receiver stores each verified DATA frame ([`write_checksummed`](Sink::write_checksummed),
/// or [`write`](Sink::write) for bytes it checksummed already; both go through
/// [`store`](Sink::store)) in arrival order, offsets already checked against the tensor's
/// length and for overlap, then calls [`finish`](Sink::finish) after END verified every
/// byte (with the CRC from [`landed_checksum`](Sink::landed_checksum) where the sink
/// checksums its landed bytes). COMPLETE is sent only after `finish` resolves. A sink that
/// is dropped instead was cancelled: it frees its memory.
pub trait Sink: Send + 'static {
    /// What a finished sink hands to the application, such as the filled buffer.
    type Output: Send + 'static;

    /// Stores `payload` at byte `offset`; drops `permit` once those bytes are durable. With
    /// `crc`, continues that CRC-32C over the bytes (spec §5.3): a sink that copies
    /// checksums each piece right before copying it, so that the bytes come from memory
    /// once ([`copy_payload_at`]); one that does not copy has nothing to fuse it with
    /// ([`Payload::crc32c_append`]).
    ///
    /// Should return promptly (copy, or enqueue a copy) so the stream keeps reading; holding
    /// the permit is what applies back-pressure. A sink may hold stored bytes back to copy
    /// them with later ones, but only until [`flush`](Sink::flush).
    fn store(
        &mut self,
        offset: u64,
        payload: Payload,
        permit: CreditPermit,
        crc: Option<&mut u32>,
    ) -> impl Future<Output = Result<(), SinkError>> + Send;

    /// Stores `payload` at byte `offset`, with no checksum.
    fn write(
        &mut self,
        offset: u64,
        payload: Payload,
        permit: CreditPermit,
    ) -> impl Future<Output = Result<(), SinkError>> + Send {
        self.store(offset, payload, permit, None)
    }

    /// Stores `payload` at byte `offset` and returns its CRC-32C, which the receiver checks
    /// against END.
    fn write_checksummed(
        &mut self,
        offset: u64,
        payload: Payload,
        permit: CreditPermit,
    ) -> impl Future<Output = Result<u32, SinkError>> + Send {
        async move {
            let mut crc = 0;
            self.store(offset, payload, permit, Some(&mut crc)).await?;
            Ok(crc)
        }
    }

    /// Starts making every byte stored so far durable without waiting for more, so that their
    /// permits drop. The receiver calls it when the tensor has no credit in flight and gets
    /// none: no more bytes arrive until credit comes back, so bytes held back for a larger
    /// copy could hold the budget forever (spec §7.1). The default does nothing, for sinks
    /// that drop each permit once its own bytes are durable.
    fn flush(&mut self) -> impl Future<Output = Result<(), SinkError>> + Send {
        std::future::ready(Ok(()))
    }

    /// Offers this sink the tensor's checksum: a sink that computes the CRC-32C over its
    /// landed bytes ([`landed_checksum`](Sink::landed_checksum)) takes it and returns true,
    /// and the receiver then reads no payload to checksum it (spec §7.3). Offered once, by a
    /// receiver, when the tensor is accepted and before any store; the default declines.
    fn take_checksum(&mut self) -> bool {
        false
    }

    /// The CRC-32C of the tensor's bytes as they landed, all of them: asked once every byte
    /// was stored and END checked their ranges, before [`finish`](Sink::finish), of a sink
    /// whose [`take_checksum`](Sink::take_checksum) said yes.
    fn landed_checksum(&mut self) -> impl Future<Output = Result<u32, SinkError>> + Send {
        std::future::ready(Err(SinkError::failed(
            "this sink does not checksum its landed bytes",
        )))
    }

    /// Resolves once every written byte is durable; returns the output.
    fn finish(self) -> impl Future<Output = Result<Self::Output, SinkError>> + Send;

    /// What the receiver made of the tensor, told to the sender in COMPLETE (spec §6.8):
    /// where `output` landed and, for a sink that shares or saves it, its id or file. Asked
    /// once, after [`finish`](Sink::finish) and before COMPLETE. The default says nothing.
    fn receipt(output: &Self::Output) -> Receipt {
        let _ = output;
        Receipt::new()
    }
}
