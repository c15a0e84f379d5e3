//! One tensor received from frames that arrive by any means (a file, another transport, a
//! test), landed where a [`Placement`] says: the protocol state machine and a sink, no QUIC.

use bytes::Bytes;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, PoisonError};
use tensorwire_proto::ErrorCode;

use tensorwire_proto::{
    CreditTracker, Frame, FrameDecoder, GrantClock, IncomingEvent, Limits, ProtocolError, Session,
    SessionConfig, StreamId, TensorMeta,
};
use tensorwire_sink::CreditRelease;
use tensorwire_sink::{CreditPermit, Sink, SinkError};

/// The one stream this receiver's session holds.
const STREAM: StreamId = 0;

use crate::buffer::TensorBuffer;
use crate::placement::{Placement, TensorSink};

/// What one step of a [`GpuTensorReceiver`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum GpuReceiverEvent {
    /// EARLY arrived (spec §7.6): METADATA follows; keep reading. This receiver offers no
    /// early credit, so a tensor sent early is refused at its METADATA.
    Early,
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
/// from [`poll_frame`](Self::poll_frame) for callers that have a way back. The tensor goes
/// through the same sans-IO [`Session`] as on a QUIC receiver; credit is granted in full,
/// since its destination is admitted whole before ACCEPT.
pub struct GpuTensorReceiver {
    placement: Placement,
    session: Session,
    credit: Arc<LocalCredit>,
    /// Bytes handed to the sink and not yet durable.
    pending: Arc<AtomicU64>,
    decoder: FrameDecoder,
    sink: Option<TensorSink>,
    output: Option<TensorBuffer>,
    meta: Option<TensorMeta>,
    complete: bool,
}

/// This receiver's own credit tracker, which the sink's permits release into.
#[derive(Debug)]
struct LocalCredit(Mutex<CreditTracker>);

impl LocalCredit {
    fn with<T>(&self, f: impl FnOnce(&mut CreditTracker) -> T) -> T {
        f(&mut self.0.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

impl CreditRelease for LocalCredit {
    fn release(&self, bytes: u64) {
        let _ = self.with(|credit| credit.release(bytes));
    }
}

impl GpuTensorReceiver {
    /// A receiver landing the tensor per `placement`, enforcing `limits`.
    pub fn new(placement: Placement, limits: Limits) -> Self {
        let mut config = SessionConfig::default();
        config.limits = limits.clone();
        config.grant_unit = u64::MAX;
        config.stream_window = u64::MAX;
        config.connection_window = u64::MAX;
        // One tensor fed in memory: no control stream, no early data.
        config.early_credit = 0;
        let mut session = Session::new(config, std::time::Instant::now());
        let _ = session.open_stream(STREAM, std::time::Instant::now());
        let credit = CreditTracker::new(u64::MAX, u64::MAX, u64::MAX / 2)
            .unwrap_or_else(|_| unreachable!("0 < low <= high <= budget"));
        Self {
            placement,
            session,
            credit: Arc::new(LocalCredit(Mutex::new(credit))),
            pending: Arc::new(AtomicU64::new(0)),
            decoder: FrameDecoder::new(limits),
            sink: None,
            output: None,
            meta: None,
            complete: false,
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
        let session = &mut self.session;
        let event = match self
            .credit
            .with(|credit| session.handle_frame(STREAM, frame, credit, std::time::Instant::now()))
        {
            Err(ProtocolError::Remote { reason, .. }) => {
                self.sink = None;
                return Ok(GpuReceiverEvent::Cancelled(reason));
            }
            other => other?,
        };
        match event {
            IncomingEvent::Metadata(meta) => {
                self.sink = Some(self.placement.sink(&meta)?);
                self.session.accept(STREAM, std::time::Instant::now())?;
                let session = &mut self.session;
                // Fed from memory: no path, so the window (all of the tensor) stays.
                let clock = GrantClock::without_path(std::time::Instant::now());
                let _ = self
                    .credit
                    .with(|credit| session.grant(STREAM, credit, clock));
                self.meta = Some(meta.clone());
                Ok(GpuReceiverEvent::Metadata(meta))
            }
            IncomingEvent::Data(data) => {
                let (offset, size) = (data.offset, data.payload.len() as u64);
                let sink = self
                    .sink
                    .as_mut()
                    .ok_or(ProtocolError::Misuse("DATA before METADATA"))?;
                let permit = CreditPermit::new(size, self.credit.clone(), self.pending.clone());
                sink.write(offset, data.payload, permit).await?;
                Ok(GpuReceiverEvent::Data { offset, size })
            }
            IncomingEvent::End => {
                let sink = self
                    .sink
                    .take()
                    .ok_or(ProtocolError::Misuse("END before METADATA"))?;
                let output = sink.finish().await?;
                self.session
                    .mark_resident(STREAM, TensorSink::receipt(&output))?;
                self.output = Some(output);
                self.complete = true;
                Ok(GpuReceiverEvent::End)
            }
            IncomingEvent::Early => Ok(GpuReceiverEvent::Early),
        }
    }

    /// The next frame for the sender (ACCEPT or REJECT, CREDIT, COMPLETE or CANCEL).
    pub fn poll_frame(&mut self) -> Option<Frame> {
        self.session.poll_frame(STREAM)
    }

    /// The tensor's length, once METADATA arrived (0 before).
    pub fn expected_bytes(&self) -> u64 {
        self.meta.as_ref().map_or(0, TensorMeta::byte_len)
    }

    /// Payload bytes received so far.
    pub fn received_bytes(&self) -> u64 {
        self.session.received(STREAM)
    }

    /// Whether every byte arrived, verified and resident.
    pub fn is_complete(&self) -> bool {
        self.complete
    }

    /// The completed tensor and its buffer (once).
    pub fn take(&mut self) -> Option<(TensorMeta, TensorBuffer)> {
        let meta = self.meta.clone()?;
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
