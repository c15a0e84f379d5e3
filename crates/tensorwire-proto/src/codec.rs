//! The incremental frame decoder (spec §6, §8).

use bytes::{Bytes, BytesMut};
use smallvec::SmallVec;

use crate::error::ProtocolError;
use crate::frame::{self, Frame, FrameType, HEADER_LEN};
use crate::limits::Limits;
use crate::payload::{ByteQueue, ByteQueueBody, Payload};

/// Cuts frames from a stream of received `Bytes`, without copying DATA payloads.
///
/// Contract: [`push`](Self::push) each chunk read from the stream, then call
/// [`next_frame`](Self::next_frame) until it returns `Ok(None)`; at the end of the stream
/// call [`finish`](Self::finish). A header is checked against [`Limits`] as soon as its five
/// bytes are buffered, before its body is awaited, so at most `limits.max_frame_len()` plus
/// one chunk is ever buffered. After an error the stream is unusable and every call returns
/// that error again.
#[derive(Debug)]
pub struct FrameDecoder {
    limits: Limits,
    input: ByteQueue,
    failed: Option<ProtocolError>,
}

impl FrameDecoder {
    /// A decoder enforcing `limits`.
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            input: ByteQueue::default(),
            failed: None,
        }
    }

    /// The limits this decoder enforces.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Appends bytes received from the stream.
    pub fn push(&mut self, bytes: Bytes) {
        self.input.push(bytes);
    }

    /// Bytes received but not yet returned as frames.
    pub fn buffered(&self) -> usize {
        self.input.len()
    }

    /// The next whole frame, `Ok(None)` if more bytes are needed, or the stream's error.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, ProtocolError> {
        if let Some(err) = &self.failed {
            return Err(err.clone());
        }
        let result = self.decode_one();
        if let Err(err) = &result {
            self.failed = Some(err.clone());
        }
        result
    }

    fn decode_one(&mut self) -> Result<Option<Frame>, ProtocolError> {
        let mut header = [0u8; HEADER_LEN];
        if !self.input.peek(&mut header) {
            return Ok(None);
        }
        let ty = FrameType(header[0]);
        let len = u32::from_le_bytes([header[1], header[2], header[3], header[4]]);
        frame::check_header(ty, len, &self.limits)?;
        if self.input.len() - HEADER_LEN < len as usize {
            self.check_metadata_prefix(ty)?;
            return Ok(None);
        }
        self.input.skip(HEADER_LEN);
        let mut body = ByteQueueBody::new(&mut self.input, len as usize);
        frame::decode_body(ty, &mut body, &self.limits).map(Some)
    }

    /// Spec §8: METADATA's limits are judged from its fixed part, not after the whole body.
    fn check_metadata_prefix(&self, ty: FrameType) -> Result<(), ProtocolError> {
        if ty != FrameType::METADATA {
            return Ok(());
        }
        let mut prefix = [0u8; HEADER_LEN + frame::METADATA_FIXED_LEN];
        if !self.input.peek(&mut prefix) {
            return Ok(());
        }
        let mut fixed = [0u8; frame::METADATA_FIXED_LEN];
        fixed.copy_from_slice(&prefix[HEADER_LEN..]);
        frame::check_metadata_fixed(&fixed, &self.limits)
    }

    /// Checks that the stream did not end inside a frame (spec §6: TRUNCATED_FRAME).
    pub fn finish(&self) -> Result<(), ProtocolError> {
        if let Some(err) = &self.failed {
            return Err(err.clone());
        }
        if self.input.len() == 0 {
            Ok(())
        } else {
            Err(ProtocolError::malformed(
                crate::ErrorCode::TRUNCATED_FRAME,
                format!(
                    "stream ended with {} bytes of an unfinished frame",
                    self.input.len()
                ),
            ))
        }
    }
}

/// DATA payloads of at most this many bytes are copied in beside the frame headers: below a
/// page, the copy costs less than a chunk of its own (an allocation for the shared headers, a
/// reference count, an entry in the transport's send queue), and a small tensor's frames
/// leave as one buffer.
pub const INLINE_PAYLOAD_MAX: usize = 4096;

/// Frames laid out for one write to a stream (spec §6): every header, and every DATA payload
/// up to [`INLINE_PAYLOAD_MAX`], in one buffer allocated once at its exact length; larger
/// payloads as their own `Bytes` in between, never copied.
#[derive(Debug, Default)]
pub struct WireChunks(SmallVec<[Bytes; 4]>);

impl WireChunks {
    /// `frames`, in order.
    pub fn encode(frames: &[Frame]) -> Self {
        let copied: usize = frames
            .iter()
            .map(|f| f.encoded_len() - separate_payload(f).map_or(0, Payload::len))
            .sum();
        if copied == 0 {
            return Self::default();
        }
        let mut buf = BytesMut::with_capacity(copied);
        // Where in `buf` each separate payload goes.
        let mut cuts: SmallVec<[(usize, &Payload); 2]> = SmallVec::new();
        for frame in frames {
            match separate_payload(frame) {
                Some(payload) => {
                    frame.encode_header(&mut buf);
                    cuts.push((buf.len(), payload));
                }
                None => frame.encode(&mut buf),
            }
        }
        debug_assert_eq!(
            buf.len(),
            copied,
            "frame lengths disagree with their encoding"
        );
        // At its exact capacity, the buffer becomes `Bytes` without another allocation.
        let all = buf.freeze();
        let mut chunks = SmallVec::new();
        let mut at = 0;
        for (cut, payload) in cuts {
            if cut > at {
                chunks.push(all.slice(at..cut));
            }
            chunks.extend(payload.parts().iter().cloned());
            at = cut;
        }
        if at == 0 {
            chunks.push(all);
        } else if at < all.len() {
            chunks.push(all.slice(at..));
        }
        Self(chunks)
    }

    /// The chunks, for a write that empties them as it goes (quinn's `write_all_chunks`).
    pub fn as_mut_slice(&mut self) -> &mut [Bytes] {
        &mut self.0
    }

    /// The chunks in order.
    pub fn chunks(&self) -> &[Bytes] {
        &self.0
    }

    /// Whether there is nothing to write.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The DATA payload of `frame` that goes as its own chunk: one over [`INLINE_PAYLOAD_MAX`].
fn separate_payload(frame: &Frame) -> Option<&Payload> {
    frame.payload().filter(|p| p.len() > INLINE_PAYLOAD_MAX)
}
