//! The tensorwire protocol without IO: frames, the frame codec, per-tensor state machines and
//! byte-credit flow control. `spec/protocol.md` is the normative description; items cite
//! its sections.
//!
//! # How a driver uses this crate
//!
//! A driver (such as `tensorwire-quic`) owns the streams and the clock; this crate owns every
//! protocol decision. Per stream:
//!
//! 1. Push each chunk read from the stream into a [`FrameDecoder`] and drain
//!    [`FrameDecoder::next_frame`] until it returns `Ok(None)`.
//! 2. Hand each frame to the stream's [`TensorReceiver`] or [`TensorSender`]
//!    (`handle_frame`), and act on the event it returns.
//! 3. After every call into a state machine, write what its `poll_frame` returns, in order:
//!    [`WireChunks::encode`] lays the frames out for one write (headers and small DATA
//!    payloads in one buffer, larger payloads as their own `Bytes`).
//! 4. Across all streams, a [`CreditTracker`] decides how many bytes the receiver may grant.
//!
//! A driver uses one [`Session`] per connection instead of steps 2 and 4 by hand: it owns the
//! connection's tensors in both directions ([`TensorReceiver`]s for the peer's streams,
//! [`TensorSender`]s for ours), sizes grants within the stream and connection windows, keeps
//! both credit ledgers in step, and applies the connection's abuse budgets with time passed
//! in.
//!
//! Errors are [`ProtocolError`]s: each carries its wire [`ErrorCode`] and says who is to
//! [`Blame`]. Nothing here panics on input from the network, and every length is checked
//! against [`Limits`] before the bytes it announces are awaited or allocated.
//!
//! # Example: frames through the codec
//!
//! ```
//! use bytes::Bytes;
//! use tensorwire_proto::frame::{Credit, Metadata};
//! use tensorwire_proto::{DType, Frame, FrameDecoder, Limits, TensorMeta};
//!
//! let meta = TensorMeta::new([2, 3], DType::F32)?.with_name("w");
//! let sent = [Frame::Metadata(Metadata { meta }), Frame::Credit(Credit { bytes: 24 })];
//!
//! // What a stream carries: the frames' bytes, in any chunking the transport chooses.
//! let wire: Vec<u8> = sent.iter().flat_map(|frame| frame.to_bytes().to_vec()).collect();
//! let mut decoder = FrameDecoder::new(Limits::default());
//! for piece in wire.chunks(5) {
//!     decoder.push(Bytes::copy_from_slice(piece));
//! }
//! let mut received = Vec::new();
//! while let Some(frame) = decoder.next_frame()? {
//!     received.push(frame);
//! }
//! assert_eq!(received, sent);
//! # Ok::<(), tensorwire_proto::ProtocolError>(())
//! ```
#![forbid(unsafe_code)]

pub mod checksum;
mod codec;
mod credit;
mod dtype;
mod error;
mod flood;
pub mod frame;
mod limits;
mod memory;
mod meta;
mod payload;
mod peers;
mod ranges;
mod receipt;
mod receiver;
mod sender;
mod session;
pub mod split;
mod stream_clock;
mod tcp_framing;
mod turn;
mod version;
mod window;

#[cfg(feature = "test-util")]
#[doc(hidden)]
pub mod fuzzing;
#[cfg(feature = "test-util")]
#[doc(hidden)]
pub mod testing;

pub use codec::{FrameDecoder, INLINE_PAYLOAD_MAX, WireChunks};
pub use credit::{CreditTracker, Party};
pub use dtype::{ChecksumAlgorithm, DType, Device};
pub use error::{Blame, ErrorCode, ProtocolError};
pub use flood::{FloodBudget, FloodExceeded};
pub use frame::{Frame, FrameType};
pub use limits::Limits;
pub use memory::{Admission, MemoryLedger};
pub use meta::TensorMeta;
pub use payload::Payload;
pub use peers::{CapExceeded, PeerCaps};
pub use ranges::ReceivedRanges;
pub use receipt::{MAX_RECEIPT_LEN, Receipt};
pub use receiver::{
    CheckedFrame, MAX_CHECKSUMS_OWED, ReceiverEvent, ReceiverInput, ReceiverState, TensorReceiver,
};
pub use sender::{CheckedChunk, SenderEvent, SenderInput, SenderState, TensorSender};
pub use session::{
    ConnectionEnd, IncomingEvent, OutgoingEvent, Session, SessionConfig, StreamClosed, StreamId,
};
pub use stream_clock::DECISION_GRACE;
pub use tcp_framing::{
    FramingError, MAX_TCP_PACKET, PACKET_LENGTH_BYTES, PacketDeframer, frame_packet, packet_header,
    packet_length,
};
pub use turn::TurnTicket;
pub use version::{Feature, Version};
pub use window::GrantClock;

/// The ALPN identifier every version 1 peer offers, the only one before 1.4 (spec §3.1);
/// [`Version::alpn_offers`] lists what this version offers.
pub const ALPN: &[u8] = b"tensorwire/1";

/// The longest CANCEL or REJECT reason any peer sends, in bytes (spec §6.4).
pub const MAX_REASON_LEN: usize = 1024;
