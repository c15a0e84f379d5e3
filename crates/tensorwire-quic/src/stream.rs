//! Frames over one QUIC bidirectional stream: decode what arrives, write what a state
//! machine queues (DATA payloads past a page as their own `Bytes`, never copied).

use std::future::Future;

use quinn::{ReadError, RecvStream, SendStream, VarInt, WriteError};
use tensorwire_proto::{ErrorCode, Frame, FrameDecoder, Limits, ProtocolError, WireChunks};

use crate::error::TransportError;

/// One tensor's stream: a decoder on the receive half, frame writes on the send half.
pub(crate) struct FrameStream {
    send: SendStream,
    recv: RecvStream,
    decoder: FrameDecoder,
    /// Bytes of received frames, for counters.
    pub(crate) bytes_read: u64,
    /// Whether the wait for the peer's FIN after its last frame has ended
    /// ([`read_fin`](Self::read_fin)).
    peer_finished: bool,
}

impl FrameStream {
    pub(crate) fn new(send: SendStream, recv: RecvStream, limits: Limits) -> Self {
        Self {
            send,
            recv,
            decoder: FrameDecoder::new(limits),
            bytes_read: 0,
            peer_finished: false,
        }
    }

    /// The next frame; a stream that ends before its terminal frame is TRUNCATED_FRAME
    /// (spec §4).
    pub(crate) async fn next_frame(&mut self) -> Result<Frame, TransportError> {
        self.next_frame_or_fin().await?.ok_or_else(|| {
            ProtocolError::Remote {
                code: ErrorCode::TRUNCATED_FRAME,
                reason: "peer ended the stream before its last frame".into(),
            }
            .into()
        })
    }

    /// When the peer stopped our half (`error`, from a failed write), the CANCEL or REJECT
    /// it sent first says why: reads frames for up to `within` each and returns the error
    /// `handle` makes of one, else `error`. The stop can overtake that frame: both leave in
    /// one packet, and the stop is acted on when the packet arrives, the frame only when the
    /// stream is read.
    pub(crate) async fn explain_stop(
        &mut self,
        error: TransportError,
        within: std::time::Duration,
        mut handle: impl FnMut(Frame) -> Result<(), ProtocolError>,
    ) -> TransportError {
        if !matches!(
            &error,
            TransportError::Protocol(ProtocolError::Remote { .. })
        ) {
            return error;
        }
        while let Ok(Ok(frame)) = tokio::time::timeout(within, self.next_frame()).await {
            if let Err(reason) = handle(frame) {
                return reason.into();
            }
        }
        error
    }

    /// The next frame already buffered, without reading the stream.
    pub(crate) fn buffered_frame(&mut self) -> Result<Option<Frame>, TransportError> {
        Ok(self.decoder.next_frame()?)
    }

    /// The next frame, or `None` when the peer finished its half at a frame boundary.
    pub(crate) async fn next_frame_or_fin(&mut self) -> Result<Option<Frame>, TransportError> {
        loop {
            if let Some(frame) = self.decoder.next_frame()? {
                return Ok(Some(frame));
            }
            match self.recv.read_chunk(usize::MAX, true).await {
                Ok(Some(chunk)) => {
                    self.bytes_read += chunk.bytes.len() as u64;
                    self.decoder.push(chunk.bytes);
                }
                Ok(None) => {
                    self.decoder.finish()?;
                    return Ok(None);
                }
                Err(e) => return Err(read_error(e)),
            }
        }
    }

    /// Writes frames laid out by [`WireChunks::encode`]: a small tensor's in one chunk, DATA
    /// payloads past a page as their own.
    pub(crate) async fn write_chunks(
        &mut self,
        mut chunks: WireChunks,
    ) -> Result<(), TransportError> {
        if chunks.is_empty() {
            return Ok(());
        }
        self.send
            .write_all_chunks(chunks.as_mut_slice())
            .await
            .map_err(write_error)
    }

    /// Reads the peer's FIN if it has already arrived, without waiting. quinn sends a
    /// STOP_SENDING for a receive half dropped before its FIN was read, even one that has all
    /// its data: one more frame, and often one more packet, per tensor.
    pub(crate) fn read_fin_if_arrived(&mut self) {
        let _ = ready_now(self.read_fin());
    }

    /// Waits for the peer's FIN after its last frame, reading one chunk at most: bytes after
    /// the last frame end the wait (the decoder reports them if read again), so a peer
    /// cannot make this buffer.
    async fn read_fin(&mut self) {
        if self.peer_finished {
            return;
        }
        if let Ok(Some(chunk)) = self.recv.read_chunk(usize::MAX, true).await {
            self.decoder.push(chunk.bytes);
        }
        self.peer_finished = true;
    }

    /// Whether, by now, what [`delivered_and_finished`](Self::delivered_and_finished) waits
    /// for has happened, checked without waiting or registering a wake-up.
    pub(crate) fn delivered_and_finished_now(&mut self) -> bool {
        ready_now(self.finished_then_delivered()).is_some()
    }

    /// Finishes the send half after its last frame, so that the FIN leaves in the same
    /// packet as that frame rather than in one of its own.
    pub(crate) fn finish(&mut self) {
        let _ = self.send.finish();
    }

    /// Finishes the send half (if not already) and, on failure, asks the peer to stop
    /// sending with `code`.
    pub(crate) fn close(&mut self, code: Option<ErrorCode>) {
        self.finish();
        if let Some(code) = code {
            let _ = self.recv.stop(VarInt::from_u32(code.0));
        }
    }

    /// Gives the stream up from this side: resets the send half and stops the receive half,
    /// both with `code`.
    pub(crate) fn abandon(&mut self, code: ErrorCode) {
        let _ = self.send.reset(VarInt::from_u32(code.0));
        let _ = self.recv.stop(VarInt::from_u32(code.0));
    }

    /// Waits, at most `grace`, until the peer has acknowledged everything sent (or stopped
    /// the stream). Dropping the last handle of a connection closes it at once and discards
    /// frames still buffered, such as a final COMPLETE: holding the stream until then keeps
    /// the connection open long enough.
    pub(crate) async fn delivered(&mut self, grace: std::time::Duration) {
        let _ = tokio::time::timeout(grace, self.send.stopped()).await;
    }

    /// Waits, at most `grace`, until the peer has finished its half
    /// ([`read_fin`](Self::read_fin), at once if its FIN was read already) and acknowledged
    /// our last frame ([`delivered`](Self::delivered)). In that order: a sender finishes its
    /// half after END (spec §4), ours once it has our last frame, so by its FIN the
    /// acknowledgement is almost always in and the wait takes one wake-up, not two. A half
    /// dropped before the FIN is stopped (see [`read_fin_if_arrived`](Self::read_fin_if_arrived)).
    pub(crate) async fn delivered_and_finished(&mut self, grace: std::time::Duration) {
        let _ = tokio::time::timeout(grace, self.finished_then_delivered()).await;
    }

    /// The peer's FIN read, then everything we sent acknowledged (or the stream stopped).
    async fn finished_then_delivered(&mut self) {
        self.read_fin().await;
        let _ = self.send.stopped().await;
    }
}

/// `future`'s output if it is ready at its first poll. The poll leaves a no-op waker with
/// whatever it waited on, so nothing is woken when that arrives later.
fn ready_now<F: Future>(future: F) -> Option<F::Output> {
    let future = std::pin::pin!(future);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match future.poll(&mut cx) {
        std::task::Poll::Ready(output) => Some(output),
        std::task::Poll::Pending => None,
    }
}

fn remote(code: VarInt, what: &str) -> TransportError {
    let code = ErrorCode(u32::try_from(code.into_inner()).unwrap_or(u32::MAX));
    ProtocolError::Remote {
        code,
        reason: format!("peer {what} the stream"),
    }
    .into()
}

fn read_error(e: ReadError) -> TransportError {
    match e {
        ReadError::Reset(code) => remote(code, "reset"),
        ReadError::ConnectionLost(e) => e.into(),
        other => TransportError::Io(std::io::Error::other(other)),
    }
}

pub(crate) fn write_error(e: WriteError) -> TransportError {
    match e {
        WriteError::Stopped(code) => remote(code, "stopped reading"),
        WriteError::ConnectionLost(e) => e.into(),
        other => TransportError::Io(std::io::Error::other(other)),
    }
}
