//! One connection, without IO or clock: every tensor on it in both directions (spec §3),
//! the credit the peer's tensors are granted against the receiver-wide [`CreditTracker`],
//! the connection's credit window, and its abuse budgets (spec §7, §10).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use crate::credit::{CreditTracker, Party};
use crate::error::{ErrorCode, ProtocolError};
use crate::flood::{FloodBudget, FloodExceeded};
use crate::frame::{Data, EarlyCredit, Frame};
use crate::limits::Limits;
use crate::meta::TensorMeta;
use crate::receipt::Receipt;
use crate::receiver::{CheckedFrame, ReceiverEvent, ReceiverState, TensorReceiver};
use crate::sender::{CheckedChunk, SenderEvent, SenderState, TensorSender};
use crate::stream_clock::{ReplyClock, StreamClock, Wait};
use crate::turn::{TurnQueue, TurnTicket};
use crate::version::{Feature, Version};
use crate::window::{GrantClock, SendPace, StreamWindow};

/// One tensor of the connection, in the direction its stream runs.
#[derive(Debug)]
enum Tensor {
    /// The peer opened the stream and sends the tensor to us, within its window, on its
    /// clock.
    Incoming(TensorReceiver, StreamWindow, StreamClock),
    /// We opened the stream and send the tensor to the peer, timing its answers.
    Outgoing(TensorSender, SendPace, ReplyClock),
}

/// A tensor's stream on its connection: the QUIC stream ID, or any number unique among the
/// connection's open streams.
pub type StreamId = u64;

/// The receiver's policy for one connection.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SessionConfig {
    /// Limits checked on every frame (spec §8).
    pub limits: Limits,
    /// Bytes granted to a tensor in one CREDIT.
    pub grant_unit: u64,
    /// Most credit one tensor may hold granted and not yet arrived when it starts, so one
    /// tensor cannot take the whole budget. Over QUIC, windows much above 8 MiB moved less
    /// (benches/results/LOG.md), likely because quinn copies a stream's waiting datagrams
    /// into one new buffer once more than 2,048 wait.
    pub stream_window: u64,
    /// Most a tensor's window grows to (spec §7.1): it doubles whenever a whole window of the
    /// tensor's bytes arrives faster than the window lets them over two round trips, so a
    /// tensor alone on a long path is not held to `stream_window` per round trip. At or
    /// below `stream_window`, windows stay fixed. A QUIC driver caps a stream's unread bytes
    /// at its stream receive window whatever credit allows: raise both together.
    pub max_stream_window: u64,
    /// Most credit the whole connection may hold granted and not yet arrived, so one peer
    /// cannot take the receiver-wide budget from the others (spec §7.1).
    pub connection_window: u64,
    /// Failed, cancelled, reset or refused streams allowed at once (spec §10) ...
    pub max_failed_streams: u32,
    /// ... refilled at `max_failed_streams` per this window.
    pub failure_window: Duration,
    /// Early credit the peer is offered on this connection (spec §7.6): tensors up to this
    /// size go in one round trip. 0 offers none.
    pub early_credit: u64,
    /// A connection with no tensor stream open for this long is closed with
    /// PROGRESS_TIMEOUT (spec §10, §10.1): it keeps itself alive but carries nothing, and
    /// holds a connection slot. `Duration::MAX` never closes it.
    pub idle_timeout: Duration,
    /// A stream whose peer owes a frame (METADATA, DATA within the credit it holds, or END)
    /// and sends none for this long is cancelled with PROGRESS_TIMEOUT (spec §10.1). A
    /// stream waiting for this receiver's credit or sink owes nothing. `Duration::MAX`: never.
    pub progress_timeout: Duration,
    /// How long a tensor's METADATA may wait for the application's accept or reject (its
    /// memory waits end then); it is refused with PROGRESS_TIMEOUT
    /// [`DECISION_GRACE`](crate::DECISION_GRACE) later (spec §10.1). `Duration::MAX`: never.
    pub admission_timeout: Duration,
    /// Tensors of this connection offered to the application and not yet decided, at most
    /// ([`Session::offer`]); more wait on their streams, so one peer cannot fill the
    /// receiver's admission queue and starve the others (spec §10, queue share).
    pub max_undecided: usize,
}

impl Default for SessionConfig {
    /// The reference implementation's policy: 4 MiB grants, an 8 MiB window per tensor
    /// growing to 16 MiB on long paths, 128 MiB per connection, 1000 failed streams per
    /// 10 s, 1 MiB of early credit, connections closed after 60 s with no stream, 30 s for a
    /// peer's frame and for the application's decision, 64 tensors offered undecided at once.
    fn default() -> Self {
        Self {
            limits: Limits::default(),
            grant_unit: 4 << 20,
            stream_window: 8 << 20,
            max_stream_window: 16 << 20,
            connection_window: 128 << 20,
            max_failed_streams: 1000,
            failure_window: Duration::from_secs(10),
            early_credit: 1 << 20,
            idle_timeout: Duration::from_secs(60),
            progress_timeout: Duration::from_secs(30),
            admission_timeout: Duration::from_secs(30),
            max_undecided: 64,
        }
    }
}

/// What a frame on one of the peer's tensor streams meant, for the driver to act on. Every
/// variant is one a receiving driver must handle, so the enum is matched exhaustively.
#[derive(Debug, PartialEq, Eq)]
pub enum IncomingEvent {
    /// EARLY arrived (spec §7.6): METADATA follows, then the tensor's DATA and END may
    /// arrive before it is decided. Keep reading.
    Early,
    /// METADATA arrived: admit with [`Session::accept`] or refuse with [`Session::reject`].
    /// For an early tensor, DATA and END events may come before the decision: keep them for
    /// the sink, and drop them (returning their credit) if it is refused.
    Metadata(TensorMeta),
    /// Verified DATA, its bytes counted as held in the credit tracker: hand it to the sink,
    /// and release the bytes to the tracker once the sink made them durable.
    Data(Data),
    /// Every byte arrived and the checksum matched: finish the sink, then
    /// [`Session::mark_resident`].
    End,
}

/// What the peer's answer on one of our tensor streams meant (spec §6.5–§6.8). Every
/// variant is one a sending driver must handle, so the enum is matched exhaustively.
#[derive(Debug, PartialEq, Eq)]
pub enum OutgoingEvent {
    /// Our tensor was accepted: DATA follows as credit arrives.
    Accepted,
    /// The peer granted our tensor this many more bytes.
    Credit(u64),
    /// The peer verified and kept every byte of our tensor, and says what it made of it
    /// (empty before version 1.5). Done: close the stream.
    Complete(Receipt),
}

/// The session's word that its connection must end: the code to close it with, and why
/// (spec §10).
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use = "the connection must be closed"]
pub struct ConnectionEnd {
    /// The code to close the connection with.
    pub code: ErrorCode,
    /// Why, for the peer and the logs.
    pub reason: String,
}

impl std::fmt::Display for ConnectionEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code, self.reason)
    }
}

/// How a stream ended, as [`Session::close_stream`] counted it.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a flood closes the connection"]
#[non_exhaustive]
pub enum StreamClosed {
    /// COMPLETE was queued: the tensor landed.
    Completed,
    /// It failed, was cancelled or refused; the connection's budget still allows more.
    Failed,
    /// It failed and the connection's failure budget is spent: close the connection with
    /// the code it carries, CANCEL_FLOOD or PROGRESS_TIMEOUT (spec §10).
    Flood(FloodExceeded),
}

/// One connection's tensors in both directions (spec §3, §7, §10).
///
/// Receiving: call [`open_stream`](Self::open_stream) for each stream the peer opens and feed
/// every frame decoded from it to [`handle_frame`](Self::handle_frame); decide each
/// [`IncomingEvent::Metadata`] with [`accept`](Self::accept) or [`reject`](Self::reject);
/// ask [`grant`](Self::grant) for credit while [`wants_credit`](Self::wants_credit) (waiting
/// for the tracker to have some when it grants 0); call
/// [`mark_resident`](Self::mark_resident) after [`IncomingEvent::End`] once the sink is
/// durable. After every call, send what [`poll_frame`](Self::poll_frame) returns for that
/// stream, in order. When a stream ends, for whatever reason, call
/// [`close_stream`](Self::close_stream): it returns the stream's unreceived credit to the
/// tracker and counts failures against the flood budget. Time is always an argument.
///
/// Credit is granted, received and revoked in the tracker only through these calls, so a
/// tensor's own ledger (granted, received) and the receiver-wide one (in flight, held) cannot
/// drift apart; held bytes go back with [`CreditTracker::release`] when the sink has made them
/// durable, which the driver calls (the sink's credit permits), not the session. Join the
/// connection's peer ([`join`](Self::join)) before granting, so its connections share the
/// budget fairly with other peers (spec §7.1).
///
/// Sending: build a [`TensorSender`] (which checks the metadata fits the wire) before
/// opening the stream, hand it over with [`start_sending`](Self::start_sending), feed the
/// peer's frames to [`handle_frame`](Self::handle_frame) as for any stream, send bytes with
/// [`send_data`](Self::send_data) up to [`next_chunk_len`](Self::next_chunk_len), then
/// [`finish`](Self::finish); on [`OutgoingEvent::Complete`] or an error, close the stream.
#[derive(Debug)]
pub struct Session {
    config: SessionConfig,
    tensors: BTreeMap<StreamId, Tensor>,
    /// Credit granted to the peer's tensors and not yet arrived, over the connection: the sum
    /// of their revocable credit, kept as a running total because every grant reads it.
    outstanding: u64,
    failures: FloodBudget,
    /// When the last stream closed, while none is open (the idle timeout counts from it).
    idle_since: Option<Instant>,
    /// Early credit offered to the peer (EARLY_CREDIT) and not yet claimed by an early
    /// tensor: granted in the tracker, so it comes back when the connection ends.
    early_offered: u64,
    /// Whether the driver has a control stream to offer early credit on (it called
    /// `offer_early_credit`): only then do closing streams top the offer up.
    offering_early: bool,
    /// Frames for our control stream (spec §4.1): EARLY_CREDIT.
    control: VecDeque<Frame>,
    /// What the peer's EARLY_CREDIT allows our tensors, once one arrived.
    peer_early: Option<PeerEarly>,
    /// The smallest round-trip time the session was given, by grants or turns (zero before
    /// one): the path's own, as the smoothed RTT under load also counts the queues the
    /// tensors themselves build.
    min_rtt: Duration,
    /// The largest window a tensor grew to on this connection: the path's, so the peer's
    /// next tensors start there rather than growing again.
    grown_window: u64,
    /// Who the connection's grants go to in the credit tracker: its peer, once
    /// [`join`](Self::join)ed, so its connections together keep to a fair share (spec §7.1).
    party: Party,
    /// Incoming streams offered to the application and not yet decided (spec §10).
    offered: BTreeSet<StreamId>,
    /// Our large tensors holding or waiting for the turn to send DATA (spec §7.4).
    turn: TurnQueue,
    /// The connection's version (spec §3.1): what this side may send.
    version: Version,
}

/// The early allowance the peer gave our tensors (spec §7.6).
#[derive(Clone, Copy, Debug)]
struct PeerEarly {
    allowance: u64,
    max_data_payload: u32,
}

impl Session {
    /// A session with `config`, idle from `now`.
    pub fn new(config: SessionConfig, now: Instant) -> Self {
        let failures = FloodBudget::new(config.max_failed_streams, config.failure_window);
        Self {
            config,
            tensors: BTreeMap::new(),
            outstanding: 0,
            failures,
            idle_since: Some(now),
            early_offered: 0,
            offering_early: false,
            control: VecDeque::new(),
            peer_early: None,
            min_rtt: Duration::ZERO,
            grown_window: 0,
            party: Party::default(),
            offered: BTreeSet::new(),
            turn: TurnQueue::default(),
            version: Version::V1_0,
        }
    }

    /// The connection negotiated `version` (spec §3.1): from now on the session sends what
    /// that version has and nothing newer. Until this is called, a session keeps to 1.0.
    pub fn set_version(&mut self, version: Version) {
        self.version = version;
    }

    /// The connection belongs to `party` (its peer): from now on its grants count toward the
    /// party's fair share of `credit` (spec §7.1). Call once, before granting; call
    /// [`leave`](Self::leave) when the connection ends.
    pub fn join(&mut self, party: Party, credit: &mut CreditTracker) {
        self.party = party;
        credit.join(party);
    }

    /// The connection ended: after [`withdraw_early_credit`](Self::withdraw_early_credit)
    /// and every stream's [`close_stream`](Self::close_stream), its party stops counting it.
    pub fn leave(&mut self, credit: &mut CreditTracker) {
        credit.leave(self.party);
    }

    /// The peer opened stream `id` at `now`.
    pub fn open_stream(&mut self, id: StreamId, now: Instant) -> Result<(), ProtocolError> {
        let tensor = TensorReceiver::new(self.config.limits.clone());
        // Spec §7.1: a window grown on this connection's path is where the next one starts.
        let start = self
            .grown_window
            .min(self.config.max_stream_window)
            .max(self.config.stream_window);
        let window = StreamWindow::new(start);
        self.open(
            id,
            Tensor::Incoming(tensor, window, StreamClock::opened(now)),
        )
    }

    /// We opened stream `id` at `now` to send `tensor` on it; its METADATA is queued. While
    /// the peer owes an answer, it may stay silent for `reply_timeout` with none of our
    /// bytes moving ([`data_moved`](Self::data_moved)) before the tensor is cancelled with
    /// PROGRESS_TIMEOUT (spec §10.1); `Duration::MAX`: never.
    ///
    /// A tensor that fits the early allowance the peer gave (spec §7.6) is sent early: EARLY
    /// goes before METADATA and its bytes follow without waiting for ACCEPT.
    pub fn start_sending(
        &mut self,
        id: StreamId,
        mut tensor: TensorSender,
        now: Instant,
        reply_timeout: Duration,
    ) -> Result<(), ProtocolError> {
        if let Some(early) = &mut self.peer_early {
            let len = tensor.meta().byte_len();
            if len <= early.allowance {
                tensor.send_early(early.max_data_payload)?;
                early.allowance -= len;
            }
        }
        let clock = ReplyClock::opened(now, reply_timeout);
        self.open(id, Tensor::Outgoing(tensor, SendPace::default(), clock))
    }

    /// Feeds one frame from the peer's control stream (spec §4.1). An error is the
    /// connection's: close it with the error's code.
    pub fn handle_control_frame(&mut self, frame: Frame) -> Result<(), ProtocolError> {
        let Frame::EarlyCredit(credit) = frame else {
            return Err(ProtocolError::violation(
                ErrorCode::UNEXPECTED_FRAME,
                format!("{} on the control stream", frame.frame_type()),
            ));
        };
        if credit.max_data_payload == 0 {
            return Err(ProtocolError::violation(
                ErrorCode::CHUNK_SIZE,
                "EARLY_CREDIT allows DATA payloads of 0 bytes",
            ));
        }
        let allowance = self.peer_early.map_or(0, |e| e.allowance);
        let allowance = allowance.checked_add(credit.bytes).ok_or_else(|| {
            ProtocolError::violation(
                ErrorCode::CREDIT_VIOLATION,
                "EARLY_CREDIT overflows the early allowance",
            )
        })?;
        self.peer_early = Some(PeerEarly {
            allowance,
            max_data_payload: credit.max_data_payload,
        });
        Ok(())
    }

    /// What the peer's EARLY_CREDIT still allows our tensors to send early; `None` before
    /// the first one arrived.
    pub fn early_allowance(&self) -> Option<u64> {
        self.peer_early.map(|e| e.allowance)
    }

    /// Offers the peer early credit up to the configured amount (spec §7.6), as the tracker
    /// allows without reaching its low watermark; queues EARLY_CREDIT on the control stream.
    /// Call when the connection starts; [`close_stream`](Self::close_stream) tops it up as
    /// early tensors use it. Returns the bytes offered.
    pub fn offer_early_credit(&mut self, credit: &mut CreditTracker) -> u64 {
        self.offering_early = true;
        let want = self.config.early_credit.saturating_sub(self.early_offered);
        // Top up in halves of the target, not once per small tensor.
        if want == 0 || want < self.config.early_credit.div_ceil(2) && self.early_offered > 0 {
            return 0;
        }
        let granted = credit.grant_early(self.party, want);
        if granted > 0 {
            self.early_offered += granted;
            self.control.push_back(Frame::EarlyCredit(EarlyCredit {
                bytes: granted,
                max_data_payload: self.config.limits.max_data_payload,
            }));
        }
        granted
    }

    /// The next frame for our control stream.
    pub fn poll_control_frame(&mut self) -> Option<Frame> {
        self.control.pop_front()
    }

    /// Whether frames wait for our control stream: its writer needs waking only then.
    pub fn has_control_frames(&self) -> bool {
        !self.control.is_empty()
    }

    /// Early credit offered to the peer and not yet used.
    pub fn early_credit_offered(&self) -> u64 {
        self.early_offered
    }

    /// The connection ended: early credit the peer did not use returns to `credit` (each
    /// stream still open returns its own through [`close_stream`](Self::close_stream)).
    pub fn withdraw_early_credit(&mut self, credit: &mut CreditTracker) {
        let _ = credit.revoke_early(self.party, std::mem::take(&mut self.early_offered));
        self.offering_early = false;
        self.control.clear();
    }

    fn open(&mut self, id: StreamId, tensor: Tensor) -> Result<(), ProtocolError> {
        if self.tensors.contains_key(&id) {
            return Err(ProtocolError::Misuse("stream opened twice"));
        }
        self.tensors.insert(id, tensor);
        self.idle_since = None;
        Ok(())
    }

    fn incoming(&mut self, id: StreamId) -> Result<&mut TensorReceiver, ProtocolError> {
        self.incoming_timed(id).map(|(tensor, _)| tensor)
    }

    /// The peer's tensor on `id` and its stream's clock.
    fn incoming_timed(
        &mut self,
        id: StreamId,
    ) -> Result<(&mut TensorReceiver, &mut StreamClock), ProtocolError> {
        match self.tensors.get_mut(&id) {
            Some(Tensor::Incoming(tensor, _, clock)) => Ok((tensor, clock)),
            Some(Tensor::Outgoing(..)) => Err(ProtocolError::Misuse(
                "a receiving call on a tensor we send",
            )),
            None => Err(ProtocolError::Misuse("no such stream in the session")),
        }
    }

    fn outgoing(&mut self, id: StreamId) -> Result<&mut TensorSender, ProtocolError> {
        self.outgoing_timed(id).map(|(tensor, _)| tensor)
    }

    /// Our tensor on `id` and the clock of its peer's answers.
    fn outgoing_timed(
        &mut self,
        id: StreamId,
    ) -> Result<(&mut TensorSender, &mut ReplyClock), ProtocolError> {
        match self.tensors.get_mut(&id) {
            Some(Tensor::Outgoing(tensor, _, clock)) => Ok((tensor, clock)),
            Some(Tensor::Incoming(..)) => Err(ProtocolError::Misuse(
                "a sending call on a tensor we receive",
            )),
            None => Err(ProtocolError::Misuse("no such stream in the session")),
        }
    }

    /// Feeds one frame from the peer's tensor stream `id` (answers on our own streams go to
    /// [`handle_reply`](Self::handle_reply)). DATA is checked against the tensor's credit and
    /// moves its bytes from in flight to held in `credit`, in the same step.
    ///
    /// An error closes the tensor and queues the REJECT or CANCEL that says why (unless the
    /// peer ended it); the driver then calls [`close_stream`](Self::close_stream). The frame
    /// arrived at `now`: it restarts the stream's progress timeout.
    pub fn handle_frame(
        &mut self,
        id: StreamId,
        frame: Frame,
        credit: &mut CreditTracker,
        now: Instant,
    ) -> Result<IncomingEvent, ProtocolError> {
        self.handle_checked(id, CheckedFrame::new(frame), credit, now)
    }

    /// As [`handle_frame`](Self::handle_frame), for a frame whose DATA checksum the driver
    /// computed before it locked the session and the tracker.
    pub fn handle_checked(
        &mut self,
        id: StreamId,
        frame: CheckedFrame,
        credit: &mut CreditTracker,
        now: Instant,
    ) -> Result<IncomingEvent, ProtocolError> {
        let (tensor, clock) = match self.tensors.get_mut(&id) {
            Some(Tensor::Incoming(tensor, _, clock)) => (tensor, clock),
            Some(Tensor::Outgoing(..)) => {
                return Err(ProtocolError::Misuse(
                    "an answer on our own tensor's stream: pass it to handle_reply",
                ));
            }
            None => return Err(ProtocolError::Misuse("no such stream in the session")),
        };
        let event = tensor.handle_checked(frame)?;
        // Spec §10.1: every frame from the peer is progress; METADATA starts the decision.
        if matches!(event, ReceiverEvent::Metadata) {
            clock.metadata_arrived(now);
        } else {
            clock.progressed(now);
        }
        match event {
            ReceiverEvent::Early => Ok(IncomingEvent::Early),
            ReceiverEvent::Metadata => {
                if tensor.state() == ReceiverState::ReceivingEarly {
                    // Spec §7.6: the whole tensor comes out of the early credit offered.
                    let len = tensor.ungranted();
                    if len > self.early_offered {
                        let e = ProtocolError::violation(
                            ErrorCode::CREDIT_VIOLATION,
                            format!(
                                "a {len} byte tensor sent early with {} bytes of early credit",
                                self.early_offered
                            ),
                        );
                        tensor.fail(e.clone());
                        return Err(e);
                    }
                    let granted = tensor.grant_early()?;
                    credit.claim_early(granted)?;
                    self.early_offered -= granted;
                    self.outstanding += granted;
                }
                tensor
                    .meta()
                    .cloned()
                    .map(IncomingEvent::Metadata)
                    .ok_or(ProtocolError::Misuse("METADATA without meta"))
            }
            ReceiverEvent::Data(data) => {
                let len = data.payload.len() as u64;
                if let Err(e) = credit.consume(self.party, len) {
                    // The tensor's own check passed, so the ledgers disagree: a bug here.
                    let _ = tensor.cancel(ErrorCode::INTERNAL, e.to_string());
                    return Err(e);
                }
                self.outstanding = self.outstanding.saturating_sub(len);
                Ok(IncomingEvent::Data(data))
            }
            ReceiverEvent::End => Ok(IncomingEvent::End),
        }
    }

    /// The CRC-32C of the oldest DATA on incoming stream `id` handled with
    /// [`CheckedFrame::checksum_later`] whose CRC is owed, since stored (spec §7.3). CRCs are
    /// reported in the order their DATA was handled, all of them before END is handed over
    /// (at most [`MAX_CHECKSUMS_OWED`](crate::MAX_CHECKSUMS_OWED) owed at once). An error
    /// closes the tensor.
    pub fn record_payload_crc(&mut self, id: StreamId, crc: u32) -> Result<(), ProtocolError> {
        match self.tensors.get_mut(&id) {
            Some(Tensor::Incoming(tensor, _, _)) => tensor.record_payload_crc(crc),
            _ => Err(ProtocolError::Misuse("no incoming tensor on that stream")),
        }
    }

    /// The CRC-32C of the landed tensor on incoming stream `id`, whose DATA were handled with
    /// [`CheckedFrame::checksum_landed`], after END and before
    /// [`mark_resident`](Self::mark_resident) (spec §7.3). A CRC that differs from END's
    /// closes the tensor with CHECKSUM_MISMATCH and queues the CANCEL that says so.
    pub fn verify_landed_crc(&mut self, id: StreamId, crc: u32) -> Result<(), ProtocolError> {
        self.incoming(id)?.verify_landed_crc(crc)
    }

    /// Feeds one frame the peer sent at `now` on stream `id`, a stream we opened to send on
    /// (ACCEPT, REJECT, CREDIT, COMPLETE, CANCEL); it restarts the stream's reply clock.
    /// Needs no credit tracker: the peer's credit for our tensors is the tensor's own. An
    /// error closes the tensor and queues our CANCEL unless the peer ended it.
    pub fn handle_reply(
        &mut self,
        id: StreamId,
        frame: Frame,
        now: Instant,
    ) -> Result<OutgoingEvent, ProtocolError> {
        let (tensor, clock) = self.outgoing_timed(id)?;
        clock.progressed(now);
        Ok(match tensor.handle_frame(frame)? {
            SenderEvent::Accepted => OutgoingEvent::Accepted,
            SenderEvent::Credit(bytes) => OutgoingEvent::Credit(bytes),
            SenderEvent::Complete(receipt) => OutgoingEvent::Complete(receipt),
        })
    }

    /// Our bytes on stream `id` (a tensor we send) moved at `now`: handed to the transport,
    /// or sent or resent by it. The peer is not behind while they cross the path, so its
    /// answer's deadline starts again (spec §10.1). Keep-alives and acknowledgements are not
    /// data moving. A stream that is not ours is ignored.
    pub fn data_moved(&mut self, id: StreamId, now: Instant) {
        if let Some(Tensor::Outgoing(_, _, clock)) = self.tensors.get_mut(&id) {
            clock.progressed(now);
        }
    }

    /// Admits the tensor on stream `id` at `now`; queues ACCEPT.
    pub fn accept(&mut self, id: StreamId, now: Instant) -> Result<(), ProtocolError> {
        self.offered.remove(&id);
        let (tensor, clock) = self.incoming_timed(id)?;
        tensor.accept()?;
        // The peer may send from now (with the credit that follows): it is timed from now.
        clock.progressed(now);
        Ok(())
    }

    /// Refuses the tensor on stream `id`; queues REJECT.
    pub fn reject(
        &mut self,
        id: StreamId,
        code: ErrorCode,
        reason: impl Into<String>,
    ) -> Result<(), ProtocolError> {
        self.offered.remove(&id);
        self.incoming(id)?.reject(code, reason)
    }

    /// Whether the tensor on stream `id`, whose METADATA arrived, may be offered to the
    /// application now: yes while fewer than [`SessionConfig::max_undecided`] of the
    /// connection's tensors wait for a decision (it then counts until it is accepted,
    /// rejected or closed); no otherwise, and the stream waits for one of those (spec §10).
    pub fn offer(&mut self, id: StreamId) -> bool {
        if self.offered.contains(&id) {
            return true;
        }
        let waiting = matches!(
            self.tensors.get(&id),
            Some(Tensor::Incoming(tensor, _, _)) if tensor.state().awaits_decision()
        );
        if !waiting || self.offered.len() >= self.config.max_undecided {
            return false;
        }
        self.offered.insert(id)
    }

    /// Tensors offered to the application and not yet decided.
    pub fn undecided(&self) -> usize {
        self.offered.len()
    }

    /// Ends the tensor on stream `id` from this side (a receiver's REJECT before ACCEPT,
    /// CANCEL otherwise). A tensor that already ended is left as it is.
    pub fn cancel(&mut self, id: StreamId, code: ErrorCode, reason: impl Into<String>) {
        match self.tensors.get_mut(&id) {
            Some(Tensor::Incoming(tensor, _, _)) => {
                let _ = tensor.cancel(code, reason);
            }
            Some(Tensor::Outgoing(tensor, ..)) => {
                let _ = tensor.cancel(code, reason);
            }
            None => {}
        }
    }

    /// Whether the tensor on `id` is accepted and still needs credit its stream window
    /// allows: it waits for credit coming back to the tracker (or to this connection's
    /// window) while [`grant`](Self::grant) gives it none.
    pub fn wants_credit(&self, id: StreamId) -> bool {
        self.stream_wants(id) > 0
    }

    /// Spec §7.1: what a tensor may be granted by its needs, the grant unit and its window
    /// of granted-but-unarrived bytes. Grants are whole units (only a tensor's last grant may
    /// be smaller): a window with less than a unit free waits for more bytes to arrive, so
    /// CREDIT goes out once per unit, not once per DATA.
    fn stream_wants(&self, id: StreamId) -> u64 {
        let Some(Tensor::Incoming(tensor, window, _)) = self.tensors.get(&id) else {
            return 0;
        };
        if tensor.state() != ReceiverState::Receiving {
            return 0;
        }
        let unit = self
            .config
            .grant_unit
            .min(window.size())
            .min(tensor.ungranted());
        let stream_left = window.size().saturating_sub(tensor.revocable_credit());
        if stream_left < unit { 0 } else { unit }
    }

    /// The window of the peer's tensor on `id` now (spec §7.1): `stream_window`, or more once
    /// it grew; `None` for any other stream.
    pub fn stream_window(&self, id: StreamId) -> Option<u64> {
        match self.tensors.get(&id) {
            Some(Tensor::Incoming(_, window, _)) => Some(window.size()),
            _ => None,
        }
    }

    /// Whether the peer's tensor on `id` needs more credit and has none in flight: none of its
    /// bytes arrive until it is granted some, so a receiver holding arrived bytes of it back
    /// (to copy them with later ones) must release them now, not wait for more (spec §7.1).
    pub fn out_of_credit(&self, id: StreamId) -> bool {
        match self.tensors.get(&id) {
            Some(Tensor::Incoming(tensor, _, _)) => {
                tensor.state() == ReceiverState::Receiving
                    && tensor.ungranted() > 0
                    && tensor.revocable_credit() == 0
            }
            _ => false,
        }
    }

    /// Grants the tensor on `id` what the tracker allows of what it wants; queues CREDIT.
    /// Returns the bytes granted: 0 while the tracker is paused or full (wait for a release)
    /// or when the tensor wants none.
    ///
    /// First, once a whole window's bytes arrived since the tensor's window was last judged,
    /// the window doubles if they came faster than it lets them over two round trips (spec
    /// §7.1): the smallest round trip any grant on the connection was given, so that the
    /// queues a fast sender builds (which lengthen the smoothed RTT) do not count as path.
    #[must_use = "granted bytes are sent as CREDIT by flushing poll_frame"]
    pub fn grant(&mut self, id: StreamId, credit: &mut CreditTracker, clock: GrantClock) -> u64 {
        let path = GrantClock {
            now: clock.now,
            rtt: self.path_rtt(clock.rtt),
        };
        let max_window = self.config.max_stream_window;
        if let Some(Tensor::Incoming(tensor, window, _)) = self.tensors.get_mut(&id) {
            window.tune(tensor.received(), path, max_window);
            self.grown_window = self.grown_window.max(window.size());
        }
        let want = self.stream_wants(id).min(self.connection_window_left());
        if want == 0 {
            return 0;
        }
        let granted = credit.grant(self.party, want);
        let Some(Tensor::Incoming(tensor, window, stream_clock)) = self.tensors.get_mut(&id) else {
            let _ = credit.revoke(self.party, granted);
            return 0;
        };
        let used = tensor.grant(granted);
        // `want` never exceeds what the tensor takes; return any rest all the same.
        let _ = credit.revoke(self.party, granted - used);
        if used > 0 {
            window.granted(clock.now, tensor.received());
            // The peer can send again from now: it is timed from now (spec §10.1).
            stream_clock.progressed(clock.now);
        }
        self.outstanding += used;
        used
    }

    /// The sink made every byte of `id` durable: queues COMPLETE (spec §6.8), with
    /// `receipt` on a connection of version 1.5 or later and without it before
    /// ([`set_version`](Self::set_version)).
    pub fn mark_resident(&mut self, id: StreamId, receipt: Receipt) -> Result<(), ProtocolError> {
        let receipt = if self.version.has(Feature::Receipts) {
            receipt
        } else {
            Receipt::new()
        };
        self.incoming(id)?.mark_resident(receipt)
    }

    /// The longest DATA payload our tensor on `id` may send now: 0 while it waits for
    /// ACCEPT or credit, or once it ended.
    pub fn next_chunk_len(&self, id: StreamId) -> u64 {
        match self.tensors.get(&id) {
            Some(Tensor::Outgoing(tensor, ..)) => tensor.next_chunk_len(),
            _ => 0,
        }
    }

    /// Queues DATA with the next `payload.len()` bytes of our tensor on `id`.
    pub fn send_data(&mut self, id: StreamId, payload: bytes::Bytes) -> Result<(), ProtocolError> {
        self.outgoing(id)?.send_data(payload)
    }

    /// Queues DATA for our tensor on `id` whose CRC-32C was computed before this call (outside
    /// any lock the session sits behind).
    pub fn send_checked(&mut self, id: StreamId, chunk: CheckedChunk) -> Result<(), ProtocolError> {
        self.outgoing(id)?.send_checked(chunk)
    }

    /// Queues END for our tensor on `id` once every byte is sent.
    pub fn finish(&mut self, id: StreamId) -> Result<(), ProtocolError> {
        self.outgoing(id)?.finish()
    }

    /// Whether our tensor on `id` may send DATA (accepted, or sent early) and has not
    /// finished.
    pub fn is_sending(&self, id: StreamId) -> bool {
        matches!(self.tensors.get(&id), Some(Tensor::Outgoing(t, ..)) if t.may_send())
    }

    /// The next frame to send on stream `id`.
    pub fn poll_frame(&mut self, id: StreamId) -> Option<Frame> {
        match self.tensors.get_mut(&id)? {
            Tensor::Incoming(tensor, _, _) => tensor.poll_frame(),
            Tensor::Outgoing(tensor, ..) => tensor.poll_frame(),
        }
    }

    /// The tensor's metadata (of a peer's tensor, once received).
    pub fn meta(&self, id: StreamId) -> Option<&TensorMeta> {
        match self.tensors.get(&id)? {
            Tensor::Incoming(tensor, _, _) => tensor.meta(),
            Tensor::Outgoing(tensor, ..) => Some(tensor.meta()),
        }
    }

    /// Why the tensor on `id` closed, if it did without completing.
    pub fn ending(&self, id: StreamId) -> Option<&ProtocolError> {
        match self.tensors.get(&id)? {
            Tensor::Incoming(tensor, _, _) => tensor.ending(),
            Tensor::Outgoing(tensor, ..) => tensor.ending(),
        }
    }

    /// Payload bytes received on `id` so far (a peer's tensor).
    pub fn received(&self, id: StreamId) -> u64 {
        match self.tensors.get(&id) {
            Some(Tensor::Incoming(tensor, _, _)) => tensor.received(),
            _ => 0,
        }
    }

    /// Records `rtt`, the connection's as the QUIC stack reports it now (zero: none), and
    /// returns the path's: the smallest given on this connection.
    fn path_rtt(&mut self, rtt: Duration) -> Duration {
        if !rtt.is_zero() && (self.min_rtt.is_zero() || rtt < self.min_rtt) {
            self.min_rtt = rtt;
        }
        self.min_rtt
    }

    /// Joins the queue for the connection's turn to send a large tensor's DATA (spec §7.4),
    /// before its stream is opened; the tensor may open it once it
    /// [`has_turn`](Self::has_turn), and gives it up with [`leave_turn`](Self::leave_turn)
    /// once [`turn_done`](Self::turn_done) or it ends (or if it is dropped while waiting).
    pub fn queue_for_turn(&mut self) -> TurnTicket {
        self.turn.join()
    }

    /// Whether `ticket` holds the connection's turn: every tensor queued before it left.
    pub fn has_turn(&self, ticket: TurnTicket) -> bool {
        self.turn.holds(ticket)
    }

    /// Gives up `ticket`'s place in the queue, held or waited for; whether the turn passed to
    /// the next tensor, whose driver should be woken to ask [`has_turn`](Self::has_turn).
    pub fn leave_turn(&mut self, ticket: TurnTicket) -> bool {
        self.turn.leave(ticket)
    }

    /// Our tensors holding or waiting for the connection's turn.
    pub fn queued_for_turn(&self) -> usize {
        self.turn.len()
    }

    /// Whether our tensor on `id` is done with the connection's turn to send large tensors'
    /// DATA (spec §7.4), so the next may send its METADATA: every byte is sent, or those it
    /// has left leave within two of the path's round trips at the rate the peer granted
    /// credit since its first grant. The next tensor's admission round trip then overlaps
    /// this one's last bytes rather than follows them. `rtt` is the connection's as the QUIC
    /// stack reports it now; the path's is the smallest the session was given, as for window
    /// growth, so that queues on a loaded connection do not pass turns early. With none
    /// measured (zero), only the first applies. `true` for a stream that is not ours.
    pub fn turn_done(&mut self, id: StreamId, now: Instant, rtt: Duration) -> bool {
        let rtt = self.path_rtt(rtt);
        match self.tensors.get_mut(&id) {
            Some(Tensor::Outgoing(tensor, pace, _)) => pace.turn_done(tensor, now, rtt),
            _ => true,
        }
    }

    /// Payload bytes sent on `id` so far (our tensor).
    pub fn sent(&self, id: StreamId) -> u64 {
        match self.tensors.get(&id) {
            Some(Tensor::Outgoing(tensor, ..)) => tensor.sent(),
            _ => 0,
        }
    }

    /// Credit granted to the peer's tensors on this connection and not yet arrived.
    pub fn outstanding_credit(&self) -> u64 {
        self.outstanding
    }

    /// What the connection's window still allows to be granted.
    pub fn connection_window_left(&self) -> u64 {
        self.config
            .connection_window
            .saturating_sub(self.outstanding)
    }

    /// Stream `id` is done: a peer's tensor's granted, unreceived credit returns to
    /// `credit`, and one that did not complete counts against the connection's failure
    /// budget at `now` (our own tensors' failures do not: the peer refusing them is no
    /// abuse). Frames still queued for it are dropped: flush
    /// [`poll_frame`](Self::poll_frame) first.
    pub fn close_stream(
        &mut self,
        id: StreamId,
        credit: &mut CreditTracker,
        now: Instant,
    ) -> StreamClosed {
        let tensor = match self.remove(id, now) {
            Some(Tensor::Incoming(tensor, _, _)) => tensor,
            Some(Tensor::Outgoing(tensor, ..)) => return outcome_of_sending(&tensor),
            None => return StreamClosed::Failed,
        };
        let unarrived = tensor.revocable_credit();
        let _ = credit.revoke(self.party, unarrived);
        self.outstanding = self.outstanding.saturating_sub(unarrived);
        // Early credit that tensors used is offered again (in halves of the target).
        if self.offering_early {
            let _ = self.offer_early_credit(credit);
        }
        if tensor.state() == ReceiverState::Complete {
            return StreamClosed::Completed;
        }
        let cause = tensor
            .ending()
            .map_or(ErrorCode::CANCELLED, ProtocolError::code);
        match self.failures.record_failure(now, cause) {
            Ok(()) => StreamClosed::Failed,
            Err(flood) => StreamClosed::Flood(flood),
        }
    }

    /// Our stream `id` is done (closing it needs no credit tracker): whether the peer
    /// completed the tensor. Frames still queued for it are dropped.
    pub fn close_outgoing(&mut self, id: StreamId, now: Instant) -> StreamClosed {
        if !matches!(self.tensors.get(&id), Some(Tensor::Outgoing(..))) {
            return StreamClosed::Failed;
        }
        match self.remove(id, now) {
            Some(Tensor::Outgoing(tensor, ..)) => outcome_of_sending(&tensor),
            _ => StreamClosed::Failed,
        }
    }

    /// Takes stream `id` out; the connection is idle from `now` if it was the last.
    fn remove(&mut self, id: StreamId, now: Instant) -> Option<Tensor> {
        self.offered.remove(&id);
        let tensor = self.tensors.remove(&id)?;
        if self.tensors.is_empty() {
            self.idle_since = Some(now);
        }
        Some(tensor)
    }

    /// Streams open now, in both directions.
    pub fn open_streams(&self) -> usize {
        self.tensors.len()
    }

    /// When the session next needs the time (spec §10.1): the earliest of the connection's
    /// idle deadline (while no tensor stream is open) and every stream's
    /// [`stream_deadline`](Self::stream_deadline); `None` where nothing is timed. Sleep until
    /// then and call [`handle_timeout`](Self::handle_timeout) and, for streams,
    /// [`handle_stream_timeout`](Self::handle_stream_timeout); every call may move it.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let streams = self
            .tensors
            .values()
            .filter_map(|tensor| self.wait_of(tensor));
        let streams = streams.map(|(deadline, _)| deadline);
        self.idle_deadline().into_iter().chain(streams).min()
    }

    fn idle_deadline(&self) -> Option<Instant> {
        self.idle_since?.checked_add(self.config.idle_timeout)
    }

    /// When the application's decision on incoming stream `id` is due (spec §10.1): the
    /// admission timeout after METADATA. Waits made for the decision (memory) end then; the
    /// stream itself is refused [`DECISION_GRACE`](crate::DECISION_GRACE) later
    /// ([`stream_deadline`](Self::stream_deadline)), so that a refusal made at the deadline
    /// reaches the peer with its own code. `None` once decided, or where the timeout is off.
    pub fn decision_due(&self, id: StreamId) -> Option<Instant> {
        match self.tensors.get(&id)? {
            Tensor::Incoming(tensor, _, clock) => {
                clock.decision_due(tensor, self.config.admission_timeout)
            }
            Tensor::Outgoing(..) => None,
        }
    }

    /// When stream `id`'s wait ends (spec §10.1). A stream the peer sends on: the progress
    /// timeout while the peer owes a frame; while the application owes a decision, the
    /// admission timeout and [`DECISION_GRACE`](crate::DECISION_GRACE). A stream we send on: its reply timeout while the peer owes an answer and
    /// none of our bytes moved. `None` while the stream waits only for this side (its
    /// credit, sink or source), or where the timeout is off.
    pub fn stream_deadline(&self, id: StreamId) -> Option<Instant> {
        self.stream_wait(id).map(|(deadline, _)| deadline)
    }

    fn stream_wait(&self, id: StreamId) -> Option<(Instant, Wait)> {
        self.wait_of(self.tensors.get(&id)?)
    }

    fn wait_of(&self, tensor: &Tensor) -> Option<(Instant, Wait)> {
        match tensor {
            Tensor::Incoming(tensor, _, clock) => clock.deadline(
                tensor,
                self.config.progress_timeout,
                self.config.admission_timeout,
            ),
            Tensor::Outgoing(tensor, _, clock) => clock.deadline(tensor),
        }
    }

    /// Acts on the time for stream `id`: once its
    /// [`stream_deadline`](Self::stream_deadline) has passed, ends the tensor (queuing the
    /// REJECT or CANCEL, with PROGRESS_TIMEOUT) and returns why; the driver then closes the
    /// stream. `None` while the wait has not ended.
    pub fn handle_stream_timeout(&mut self, id: StreamId, now: Instant) -> Option<ProtocolError> {
        let (deadline, wait) = self.stream_wait(id)?;
        if now < deadline {
            return None;
        }
        let code = ErrorCode::PROGRESS_TIMEOUT;
        let reason = wait.reason();
        self.cancel(id, code, reason.clone());
        Some(ProtocolError::Local { code, reason })
    }

    /// Acts on the time: once the connection has had no tensor stream for the idle timeout,
    /// says to close it, with PROGRESS_TIMEOUT and why (spec §10).
    pub fn handle_timeout(&mut self, now: Instant) -> Option<ConnectionEnd> {
        match self.idle_deadline() {
            Some(deadline) if now >= deadline => Some(ConnectionEnd {
                code: ErrorCode::PROGRESS_TIMEOUT,
                reason: format!(
                    "no tensor stream within the receiver's idle timeout ({:?})",
                    self.config.idle_timeout
                ),
            }),
            _ => None,
        }
    }

    /// How long the connection has had no stream open at `now` (zero while one is).
    pub fn idle_for(&self, now: Instant) -> Duration {
        self.idle_since
            .map_or(Duration::ZERO, |since| now.saturating_duration_since(since))
    }

    /// The policy this session applies.
    pub fn config(&self) -> &SessionConfig {
        &self.config
    }

    /// Replaces the receiving policy, for a connection that starts receiving after it was
    /// opened to send; the peer's streams opened from now on get the new limits.
    pub fn set_config(&mut self, config: SessionConfig) {
        self.failures = FloodBudget::new(config.max_failed_streams, config.failure_window);
        self.config = config;
    }
}

/// How one of our tensors ended: COMPLETE from the peer, or anything else.
fn outcome_of_sending(tensor: &TensorSender) -> StreamClosed {
    if tensor.state() == SenderState::Complete {
        StreamClosed::Completed
    } else {
        StreamClosed::Failed
    }
}
