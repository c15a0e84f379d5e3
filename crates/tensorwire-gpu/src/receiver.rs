//! One tensor received from frames that arrive by any means (a file, another transport, a
//! test), landed where a [`Placement`] says: the protocol state machine and a sink, no QUIC.

use bytes::Bytes;
use tensorwire_proto::ErrorCode;
use tensorwire_proto::{
    Frame, FrameDecoder, Limits, ProtocolError, ReceiverEvent, ReceiverState, TensorMeta,
    TensorReceiver,
};
use tensorwire_sink::{CreditPermit, Sink, SinkError};

use crate::buffer::TensorBuffer;
use crate::placement::{Placement, TensorSink};

/// What one step of a [`GpuTensorReceiver`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum GpuReceiverEvent {
    /// METADATA arrived; the tensor was admitted and its destination allocated.
    Metadata(TensorMeta),
    /// `size` bytes at `offset` were handed to the sink.
    Data {
        /// Where in the tensor.
        offset: u64,
        /// How many bytes.
        size: u64,
    },
    /// Every byte arrived, the checksum matched, and the last copy has completed.
    End,
    /// No whole frame is buffered: push more bytes.
    NeedMoreData,
    /// The sender cancelled, with this reason.
    Cancelled(String),
}

/// Why landing a tensor from frames failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LandError {
    /// The frames broke the protocol, or the caller misused the receiver.
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// The destination could not be had or written.
    #[error("sink: {0}")]
    Sink(#[from] SinkError),
}

impl LandError {
    /// The wire code a sender would be told.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Protocol(e) => e.code(),
            Self::Sink(e) => e.code,
        }
    }
}

/// Receives one tensor into GPU (or host) memory from frames or raw bytes.
///
/// Contract: [`push`](Self::push) bytes and call [`next_event`](Self::next_event) until it
/// returns [`GpuReceiverEvent::NeedMoreData`], or feed decoded frames to
/// [`handle_frame`](Self::handle_frame). Frames for the sender (ACCEPT, CREDIT, COMPLETE) come
/// from [`poll_frame`](Self::poll_frame) for callers that have a way back; credit is granted
/// in full, since memory is allocated for the whole tensor up front.
pub struct GpuTensorReceiver {
    placement: Placement,
    machine: TensorReceiver,
    decoder: FrameDecoder,
    sink: Option<TensorSink>,
    output: Option<TensorBuffer>,
}

impl GpuTensorReceiver {
    /// A receiver landing the tensor per `placement`, enforcing `limits`.
    pub fn new(placement: Placement, limits: Limits) -> Self {
        Self {
            placement,
            machine: TensorReceiver::new(limits.clone()),
            decoder: FrameDecoder::new(limits),
            sink: None,
            output: None,
        }
    }

    /// Appends received bytes.
    pub fn push(&mut self, bytes: Bytes) {
        self.decoder.push(bytes);
    }

    /// Decodes and handles the next whole frame, or says more bytes are needed.
    pub async fn next_event(&mut self) -> Result<GpuReceiverEvent, LandError> {
        match self.decoder.next_frame()? {
            Some(frame) => self.handle_frame(frame).await,
            None => Ok(GpuReceiverEvent::NeedMoreData),
        }
    }

    /// Handles one frame from the sender.
    pub async fn handle_frame(&mut self, frame: Frame) -> Result<GpuReceiverEvent, LandError> {
        let event = match self.machine.handle_frame(frame) {
            Err(ProtocolError::Remote { reason, .. }) => {
                self.sink = None;
                return Ok(GpuReceiverEvent::Cancelled(reason));
            }
            other => other?,
        };
        match event {
            ReceiverEvent::Metadata => {
                let meta = self
                    .machine
                    .meta()
                    .cloned()
                    .ok_or(ProtocolError::Misuse("METADATA without meta"))?;
                self.sink = Some(self.placement.sink(&meta)?);
                self.machine.accept()?;
                let _ = self.machine.grant(meta.byte_len());
                Ok(GpuReceiverEvent::Metadata(meta))
            }
            ReceiverEvent::Data(data) => {
                let (offset, size) = (data.offset, data.payload.len() as u64);
                let sink = self
                    .sink
                    .as_mut()
                    .ok_or(ProtocolError::Misuse("DATA before METADATA"))?;
                sink.write(offset, data.payload, CreditPermit::unbudgeted(size))
                    .await?;
                Ok(GpuReceiverEvent::Data { offset, size })
            }
            ReceiverEvent::End => {
                let sink = self
                    .sink
                    .take()
                    .ok_or(ProtocolError::Misuse("END before METADATA"))?;
                self.output = Some(sink.finish().await?);
                self.machine.mark_resident()?;
                Ok(GpuReceiverEvent::End)
            }
            _ => Err(ProtocolError::Misuse("unexpected receiver event").into()),
        }
    }

    /// The next frame for the sender (ACCEPT or REJECT, CREDIT, COMPLETE or CANCEL).
    pub fn poll_frame(&mut self) -> Option<Frame> {
        self.machine.poll_frame()
    }

    /// The tensor's length, once METADATA arrived (0 before).
    pub fn expected_bytes(&self) -> u64 {
        self.machine.meta().map_or(0, TensorMeta::byte_len)
    }

    /// Payload bytes received so far.
    pub fn received_bytes(&self) -> u64 {
        self.machine.received()
    }

    /// Whether every byte arrived, verified and resident.
    pub fn is_complete(&self) -> bool {
        self.machine.state() == ReceiverState::Complete
    }

    /// The completed tensor and its buffer (once).
    pub fn take(&mut self) -> Option<(TensorMeta, TensorBuffer)> {
        let meta = self.machine.meta()?.clone();
        self.output.take().map(|buffer| (meta, buffer))
    }

    /// The completed tensor copied to host memory (once).
    pub fn take_tensor(&mut self) -> Result<Option<(TensorMeta, Bytes)>, LandError> {
        match self.take() {
            Some((meta, buffer)) => {
                let bytes = buffer.to_host().map_err(|e| LandError::Sink(e.into()))?;
                Ok(Some((meta, bytes)))
            }
            None => Ok(None),
        }
    }
}
