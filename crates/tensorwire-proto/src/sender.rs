//! The sender's per-tensor state machine (spec §7.2, §7.5).

use std::collections::VecDeque;

use bytes::Bytes;

use crate::error::{ErrorCode, ProtocolError};
use crate::frame::{Cancel, Data, Early, End, Frame, Metadata};
use crate::meta::TensorMeta;
use crate::receipt::Receipt;

/// Where a sending stream stands (spec §7.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SenderState {
    /// METADATA queued; waiting for ACCEPT or REJECT.
    AwaitingDecision,
    /// EARLY and METADATA queued: DATA goes out before the decision, from the connection's
    /// early allowance (spec §7.6).
    SendingEarly,
    /// An early tensor's END queued; waiting for ACCEPT or REJECT.
    FinishedEarly,
    /// Accepted: DATA may be sent within credit.
    Sending,
    /// END queued; waiting for COMPLETE.
    AwaitingComplete,
    /// COMPLETE received. Terminal.
    Complete,
    /// Rejected, cancelled by either side, or failed. Terminal.
    Closed,
}

/// What can happen to a sending stream (spec §7.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SenderInput {
    /// An ACCEPT frame arrived.
    RecvAccept,
    /// A REJECT frame arrived.
    RecvReject,
    /// A CREDIT frame arrived.
    RecvCredit,
    /// A COMPLETE frame arrived.
    RecvComplete,
    /// A CANCEL frame arrived.
    RecvCancel,
    /// A frame only a sender sends arrived (METADATA, DATA, END).
    RecvSenderFrame,
    /// The application queued DATA.
    SendData,
    /// The application queued END.
    Finish,
    /// The application cancelled, or a frame broke a rule.
    Abort,
}

impl SenderState {
    /// Every state, in table order.
    pub const ALL: &'static [SenderState] = &[
        Self::AwaitingDecision,
        Self::SendingEarly,
        Self::FinishedEarly,
        Self::Sending,
        Self::AwaitingComplete,
        Self::Complete,
        Self::Closed,
    ];

    /// The state after `input`, or `None` if `input` is not allowed here.
    pub fn transition(self, input: SenderInput) -> Option<SenderState> {
        use SenderInput as I;
        use SenderState as S;
        match (self, input) {
            (S::Complete | S::Closed, _) => None,
            (S::AwaitingDecision | S::SendingEarly, I::RecvAccept) => Some(S::Sending),
            (S::AwaitingDecision | S::SendingEarly | S::FinishedEarly, I::RecvReject) => {
                Some(S::Closed)
            }
            (S::SendingEarly, I::SendData) => Some(S::SendingEarly),
            (S::SendingEarly, I::Finish) => Some(S::FinishedEarly),
            (S::FinishedEarly, I::RecvAccept) => Some(S::AwaitingComplete),
            (S::Sending, I::RecvCredit | I::SendData) => Some(S::Sending),
            (S::Sending, I::Finish) => Some(S::AwaitingComplete),
            (S::AwaitingComplete, I::RecvComplete) => Some(S::Complete),
            (_, I::RecvCancel | I::Abort) => Some(S::Closed),
            _ => None,
        }
    }
}

impl SenderInput {
    /// Every input, in table order.
    pub const ALL: &'static [SenderInput] = &[
        Self::RecvAccept,
        Self::RecvReject,
        Self::RecvCredit,
        Self::RecvComplete,
        Self::RecvCancel,
        Self::RecvSenderFrame,
        Self::SendData,
        Self::Finish,
        Self::Abort,
    ];
}

/// What a frame from the receiver meant, for the driver to act on.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SenderEvent {
    /// ACCEPT: DATA may follow once credit arrives.
    Accepted,
    /// CREDIT: this many more bytes may be sent.
    Credit(u64),
    /// COMPLETE: the receiver verified and stored every byte, and says what it made of
    /// them (empty before version 1.5). Done.
    Complete(Receipt),
}

/// One tensor's sending side, without IO or clocks (spec §7).
///
/// Contract: [`new`](Self::new) queues METADATA. Feed each frame from the receiver to
/// [`handle_frame`](Self::handle_frame). Send bytes in order with
/// [`send_data`](Self::send_data), each at most [`next_chunk_len`](Self::next_chunk_len)
/// long, then [`finish`](Self::finish). After every call, send what
/// [`poll_frame`](Self::poll_frame) returns, in order. Any error closes the tensor and
/// queues a CANCEL, unless the receiver ended it.
#[derive(Debug)]
pub struct TensorSender {
    meta: TensorMeta,
    state: SenderState,
    max_data_payload: u64,
    granted: u64,
    sent: u64,
    crc: u32,
    outgoing: VecDeque<Frame>,
    ending: Option<ProtocolError>,
}

impl TensorSender {
    /// Starts sending `meta`; queues METADATA. Fails if `meta` does not fit the wire format.
    pub fn new(meta: TensorMeta) -> Result<Self, ProtocolError> {
        let metadata = Frame::Metadata(Metadata { meta: meta.clone() });
        check_fits_wire(&meta, &metadata)?;
        // EARLY, METADATA, DATA and END of a small tensor fit without growing the queue.
        let mut outgoing = VecDeque::with_capacity(4);
        outgoing.push_back(metadata);
        Ok(Self {
            meta,
            state: SenderState::AwaitingDecision,
            max_data_payload: 0,
            granted: 0,
            sent: 0,
            crc: 0,
            outgoing,
            ending: None,
        })
    }

    /// The tensor being sent.
    pub fn meta(&self) -> &TensorMeta {
        &self.meta
    }

    /// The current state.
    pub fn state(&self) -> SenderState {
        self.state
    }

    /// Why the tensor closed, if it did without completing.
    pub fn ending(&self) -> Option<&ProtocolError> {
        self.ending.as_ref()
    }

    /// Payload bytes sent so far.
    pub fn sent(&self) -> u64 {
        self.sent
    }

    /// Bytes granted and not yet sent.
    pub fn credit(&self) -> u64 {
        self.granted - self.sent
    }

    /// The longest DATA payload that may be sent now: 0 when out of credit.
    pub fn next_chunk_len(&self) -> u64 {
        if !self.may_send() {
            return 0;
        }
        self.credit().min(self.max_data_payload)
    }

    /// Whether DATA may be sent (within credit): accepted, or sent early.
    pub fn may_send(&self) -> bool {
        matches!(self.state, SenderState::Sending | SenderState::SendingEarly)
    }

    /// Sends the tensor early (spec §7.6): queues EARLY before METADATA and takes the whole
    /// length as credit, DATA payloads at most `max_data_payload` (from EARLY_CREDIT). Only
    /// before anything was sent; the caller took `byte_len` from the early allowance.
    pub fn send_early(&mut self, max_data_payload: u32) -> Result<(), ProtocolError> {
        let untouched = self.state == SenderState::AwaitingDecision
            && matches!(self.outgoing.front(), Some(Frame::Metadata(_)))
            && self.outgoing.len() == 1;
        if !untouched || max_data_payload == 0 {
            return Err(ProtocolError::Misuse(
                "send_early after the first frame went out, or with a 0-byte payload limit",
            ));
        }
        self.outgoing.push_front(Frame::Early(Early));
        self.state = SenderState::SendingEarly;
        self.granted = self.meta.byte_len();
        self.max_data_payload = max_data_payload.into();
        Ok(())
    }

    /// The next frame to send to the receiver.
    pub fn poll_frame(&mut self) -> Option<Frame> {
        self.outgoing.pop_front()
    }

    /// Feeds one frame from the receiver.
    pub fn handle_frame(&mut self, frame: Frame) -> Result<SenderEvent, ProtocolError> {
        if let Some(err) = self.closed_error() {
            return Err(err);
        }
        let result = self.dispatch(frame);
        if let Err(err) = &result {
            self.abort(err.clone());
        }
        result
    }

    fn dispatch(&mut self, frame: Frame) -> Result<SenderEvent, ProtocolError> {
        let input = match &frame {
            Frame::Accept(_) => SenderInput::RecvAccept,
            Frame::Reject(_) => SenderInput::RecvReject,
            Frame::Credit(_) => SenderInput::RecvCredit,
            Frame::Complete(_) => SenderInput::RecvComplete,
            Frame::Cancel(_) => SenderInput::RecvCancel,
            _ => SenderInput::RecvSenderFrame,
        };
        let next = self.state.transition(input).ok_or_else(|| {
            ProtocolError::violation(
                ErrorCode::UNEXPECTED_FRAME,
                format!("{} in sender state {:?}", frame.frame_type(), self.state),
            )
        })?;
        let event = match frame {
            Frame::Accept(accept) => {
                if accept.max_data_payload == 0 {
                    return Err(ProtocolError::violation(
                        ErrorCode::CHUNK_SIZE,
                        "ACCEPT allows DATA payloads of 0 bytes",
                    ));
                }
                self.max_data_payload = accept.max_data_payload.into();
                SenderEvent::Accepted
            }
            Frame::Credit(credit) => self.on_credit(credit.bytes)?,
            Frame::Complete(complete) => SenderEvent::Complete(complete.receipt),
            Frame::Reject(r) => {
                return Err(ProtocolError::Remote {
                    code: r.code,
                    reason: r.reason,
                });
            }
            Frame::Cancel(c) => {
                return Err(ProtocolError::Remote {
                    code: c.code,
                    reason: c.reason,
                });
            }
            other => {
                return Err(ProtocolError::violation(
                    ErrorCode::UNEXPECTED_FRAME,
                    format!("{} is sent by senders only", other.frame_type()),
                ));
            }
        };
        self.state = next;
        Ok(event)
    }

    /// Spec §7.5: a receiver may not grant past the tensor's end.
    fn on_credit(&mut self, bytes: u64) -> Result<SenderEvent, ProtocolError> {
        match self.granted.checked_add(bytes) {
            Some(total) if total <= self.meta.byte_len() => {
                self.granted = total;
                Ok(SenderEvent::Credit(bytes))
            }
            _ => Err(ProtocolError::violation(
                ErrorCode::CREDIT_VIOLATION,
                format!(
                    "CREDIT of {bytes} after {} granted exceeds the tensor's {} bytes",
                    self.granted,
                    self.meta.byte_len()
                ),
            )),
        }
    }

    /// Queues DATA with the next `payload.len()` bytes of the tensor.
    pub fn send_data(&mut self, payload: Bytes) -> Result<(), ProtocolError> {
        self.send_checked(CheckedChunk::new(payload))
    }

    /// Queues DATA with the next bytes of the tensor, their CRC-32C already computed (so a
    /// driver computes it before taking a lock shared with other streams).
    pub fn send_checked(&mut self, chunk: CheckedChunk) -> Result<(), ProtocolError> {
        let CheckedChunk { payload, crc } = chunk;
        if self.state.transition(SenderInput::SendData).is_none() {
            return Err(ProtocolError::Misuse(
                "send_data before ACCEPT or after the tensor ended",
            ));
        }
        let len = payload.len() as u64;
        if len == 0 || len > self.next_chunk_len() {
            return Err(ProtocolError::Misuse(
                "DATA payload empty or longer than next_chunk_len()",
            ));
        }
        self.crc = crate::checksum::crc32c_combine(self.crc, crc, len);
        self.outgoing
            .push_back(Frame::Data(Data::new(self.sent, payload)));
        self.sent += len;
        Ok(())
    }

    /// Queues END once every byte is sent.
    pub fn finish(&mut self) -> Result<(), ProtocolError> {
        let next = self.state.transition(SenderInput::Finish);
        match next {
            Some(next) if self.sent == self.meta.byte_len() => {
                self.outgoing.push_back(Frame::End(End {
                    checksum: self.crc.into(),
                }));
                self.state = next;
                Ok(())
            }
            Some(_) => Err(ProtocolError::Misuse("finish before every byte was sent")),
            None => Err(ProtocolError::Misuse(
                "finish before ACCEPT or after the tensor ended",
            )),
        }
    }

    /// Ends the tensor from this side; queues CANCEL.
    pub fn cancel(
        &mut self,
        code: ErrorCode,
        reason: impl Into<String>,
    ) -> Result<(), ProtocolError> {
        if self.state.transition(SenderInput::Abort).is_none() {
            return Err(ProtocolError::Misuse(
                "cancel of a tensor that already ended",
            ));
        }
        self.abort(ProtocolError::Local {
            code,
            reason: reason.into(),
        });
        Ok(())
    }

    fn abort(&mut self, err: ProtocolError) {
        if self.state.transition(SenderInput::Abort).is_none() {
            return;
        }
        if !matches!(err, ProtocolError::Remote { .. }) {
            self.outgoing
                .push_back(Frame::Cancel(Cancel::new(err.code(), err.wire_reason())));
        }
        self.state = SenderState::Closed;
        self.ending = Some(err);
    }

    fn closed_error(&self) -> Option<ProtocolError> {
        match self.state {
            SenderState::Closed => Some(
                self.ending
                    .clone()
                    .unwrap_or(ProtocolError::Misuse("tensor closed")),
            ),
            SenderState::Complete => Some(ProtocolError::violation(
                ErrorCode::UNEXPECTED_FRAME,
                "frame after COMPLETE",
            )),
            _ => None,
        }
    }
}

/// A DATA payload with its CRC-32C (spec §5.3), computed when it is made: the one pass over
/// the bytes happens wherever the caller builds it, not inside [`TensorSender`].
#[derive(Clone, Debug)]
pub struct CheckedChunk {
    payload: Bytes,
    crc: u32,
}

impl CheckedChunk {
    /// Computes `payload`'s CRC-32C.
    pub fn new(payload: Bytes) -> Self {
        let crc = crate::checksum::crc32c(&payload);
        Self { payload, crc }
    }

    /// The payload.
    pub fn payload(&self) -> &Bytes {
        &self.payload
    }

    /// The payload's CRC-32C.
    pub fn crc(&self) -> u32 {
        self.crc
    }

    /// The payload's length in bytes.
    pub fn len(&self) -> usize {
        self.payload.len()
    }

    /// Whether the payload is empty.
    pub fn is_empty(&self) -> bool {
        self.payload.is_empty()
    }

    /// Splits off the first `at` bytes (all of them where `at` is longer) and returns them
    /// checked; what stays keeps a checksum derived without a second pass over it.
    ///
    /// Only the part split off is read: `crc(tail) = crc(whole) ⊕ crc(head) · x^(8·len(tail))`,
    /// since CRC-32C is linear over concatenation.
    pub fn split_to(&mut self, at: usize) -> CheckedChunk {
        if at >= self.payload.len() {
            return std::mem::replace(self, CheckedChunk::new(Bytes::new()));
        }
        let head = CheckedChunk::new(self.payload.split_to(at));
        let tail_len = self.payload.len() as u64;
        self.crc ^= crate::checksum::crc32c_combine(head.crc, 0, tail_len);
        head
    }
}

/// Checks that `meta` fits the METADATA layout's field widths (spec §6.1).
fn check_fits_wire(meta: &TensorMeta, metadata: &Frame) -> Result<(), ProtocolError> {
    let short = |s: &str| s.len() <= u16::MAX as usize;
    let fits = meta.shape().len() <= u8::MAX as usize
        && short(meta.name())
        && meta.attributes().len() <= u16::MAX as usize
        && meta.attributes().iter().all(|(k, v)| short(k) && short(v))
        && metadata.body_len() <= u32::MAX as usize;
    if fits {
        Ok(())
    } else {
        Err(ProtocolError::Misuse(
            "tensor metadata exceeds the wire format's field widths",
        ))
    }
}
