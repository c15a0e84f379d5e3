//! Where received bytes go: the [`Sink`] trait, and [`HostSink`] for host memory.

use std::future::Future;

use bytes::Bytes;
use tensorwire_proto::{ErrorCode, Payload};

use crate::budget::CreditPermit;

/// A sink's failure; `code` is what the sender is told (RESOURCE_EXHAUSTED or SINK_FAILED).
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
}

/// Owns one tensor's destination memory and stores its bytes as they arrive.
///
/// The receiver calls [`write`](Sink::write) once per verified DATA frame (in arrival order,
/// offsets already checked against the tensor's length and for overlap), then
/// [`finish`](Sink::finish) after END verified every byte. COMPLETE is sent only after
/// `finish` resolves. A sink that is dropped instead was cancelled: it frees its memory.
pub trait Sink: Send + 'static {
    /// What a finished sink hands to the application, such as the filled buffer.
    type Output: Send + 'static;

    /// Stores `payload` at byte `offset`; drops `permit` once those bytes are durable.
    ///
    /// Should return promptly (copy, or enqueue a copy) so the stream keeps reading; holding
    /// the permit is what applies back-pressure.
    fn write(
        &mut self,
        offset: u64,
        payload: Payload,
        permit: CreditPermit,
    ) -> impl Future<Output = Result<(), SinkError>> + Send;

    /// Resolves once every written byte is durable; returns the output.
    fn finish(self) -> impl Future<Output = Result<Self::Output, SinkError>> + Send;
}

/// A sink into one host-memory buffer of the tensor's length.
#[derive(Debug)]
pub struct HostSink {
    buf: Vec<u8>,
}

impl HostSink {
    /// A zeroed buffer of `len` bytes; fails cleanly if the memory cannot be had.
    pub fn new(len: u64) -> Result<Self, SinkError> {
        let len = usize::try_from(len)
            .map_err(|_| SinkError::exhausted("tensor larger than the address space"))?;
        let mut buf = Vec::new();
        buf.try_reserve_exact(len)
            .map_err(|e| SinkError::exhausted(format!("{len} bytes of host memory: {e}")))?;
        buf.resize(len, 0);
        Ok(Self { buf })
    }
}

impl Sink for HostSink {
    type Output = Bytes;

    async fn write(
        &mut self,
        offset: u64,
        payload: Payload,
        permit: CreditPermit,
    ) -> Result<(), SinkError> {
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        let dst = start
            .checked_add(payload.len())
            .and_then(|end| self.buf.get_mut(start..end))
            .ok_or_else(|| SinkError::failed(format!("write at {offset} past the buffer")))?;
        payload.copy_to_slice(dst);
        drop(permit); // The bytes are in their final place: durable.
        Ok(())
    }

    async fn finish(self) -> Result<Bytes, SinkError> {
        Ok(self.buf.into())
    }
}
