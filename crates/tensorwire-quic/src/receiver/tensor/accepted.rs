//! What one tensor's stream holds while it is served: its place in the connection and the
//! receiver, its frames' bookkeeping, and why it ended once it has.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use tensorwire_proto::frame::Data;
use tensorwire_proto::{ProtocolError, StreamId};
use tensorwire_sink::{CreditPermit, MemoryReservation};

use super::super::Shared;
use super::super::offload::Receiving;
use super::super::state::ConnectionState;
use crate::stream::FrameStream;

/// Why a stream ended while its tensor waited for the application, set before the stream
/// lets go of the decision channel, so a late accept reports the real cause.
pub(in crate::receiver) type Ended = Arc<OnceLock<ProtocolError>>;

/// One tensor's stream, handed to the sink-specific receive loop once accepted.
pub(in crate::receiver) struct Accepted {
    pub(super) id: StreamId,
    pub(super) ended: Ended,
    pub(super) shared: Arc<Shared>,
    pub(super) connection: Arc<ConnectionState>,
    pub(super) stream: FrameStream,
    pub(super) started: Instant,
    /// Bytes of this tensor held and not yet made durable (by the sink, or here).
    pub(super) pending: Arc<AtomicU64>,
    /// DATA of a tensor sent early that arrived before the decision, with its credit: handed
    /// to the sink on ACCEPT, dropped (the credit returning) otherwise (spec §7.6).
    pub(super) early: Vec<(Data, CreditPermit)>,
    /// Whether the early tensor's END arrived (and was verified) before the decision.
    pub(super) early_ended: bool,
    /// Counts the connection as carrying a large tensor, from its first large payload.
    pub(super) receiving: Option<Receiving>,
    /// Its METADATA's bytes in the receiver's METADATA budget, for as long as the stream
    /// lives (spec §10): many live streams with large METADATA are memory a peer holds.
    pub(super) metadata: Option<MemoryReservation>,
}
