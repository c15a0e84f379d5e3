//! The receiver's per-tensor state machine (spec §7.2, §7.3).

use std::collections::VecDeque;

use crate::ChecksumAlgorithm;
use crate::error::{ErrorCode, ProtocolError};
use crate::frame::{Accept, Cancel, Complete, Credit, Data, Frame, Reject};
use crate::limits::Limits;
use crate::meta::TensorMeta;
use crate::ranges::ReceivedRanges;
use crate::receipt::Receipt;

/// A frame from the sender with its DATA payload's CRC-32C computed, so that a driver can make
/// the pass over the bytes before it takes the locks the session sits behind (spec §7.3), or
/// marked to have it computed while the bytes are stored.
#[derive(Debug)]
pub struct CheckedFrame {
    frame: Frame,
    payload_crc: PayloadCrc,
}

#[derive(Clone, Copy, Debug)]
enum PayloadCrc {
    /// Not DATA, or DATA to checksum when handled.
    Unknown,
    /// Computed beforehand.
    Computed(u32),
    /// The driver reports it after storing the bytes.
    Later,
    /// Never computed per payload: the driver checksums the landed tensor after END.
    OfLandedBytes,
}

impl CheckedFrame {
    /// Checksums `frame`'s payload if it is DATA; any other frame is kept as it is.
    pub fn new(frame: Frame) -> Self {
        let payload_crc = match &frame {
            Frame::Data(data) => PayloadCrc::Computed(data.payload.crc32c()),
            _ => PayloadCrc::Unknown,
        };
        Self { frame, payload_crc }
    }

    /// A frame whose DATA payload the driver checksums in the same pass that stores it (its
    /// sink's copy), after the session checked the frame: the driver then reports the CRC
    /// with [`TensorReceiver::record_payload_crc`], in the order the DATA was handled. Up to
    /// [`MAX_CHECKSUMS_OWED`] may be owed at once, so later DATA can be handled (and its
    /// credit counted) while earlier bytes are still being stored; END waits for them all.
    pub fn checksum_later(frame: Frame) -> Self {
        let payload_crc = match &frame {
            Frame::Data(_) => PayloadCrc::Later,
            _ => PayloadCrc::Unknown,
        };
        Self { frame, payload_crc }
    }

    /// A frame whose DATA payload is not checksummed on its own: the driver's sink computes
    /// the CRC-32C of the whole tensor over its landed bytes after END (on a GPU, say) and
    /// reports it with [`TensorReceiver::verify_landed_crc`] before COMPLETE (spec §7.3).
    /// Every DATA of a tensor goes this way or none does, and only once it is accepted.
    pub fn checksum_landed(frame: Frame) -> Self {
        let payload_crc = match &frame {
            Frame::Data(_) => PayloadCrc::OfLandedBytes,
            _ => PayloadCrc::Unknown,
        };
        Self { frame, payload_crc }
    }

    /// The frame, its checksum dropped.
    pub fn into_frame(self) -> Frame {
        self.frame
    }
}

/// Where a tensor's checksum is checked (spec §7.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LandedChecksum {
    /// Per range, as DATA arrives: no landed checksum.
    Unused,
    /// DATA arrives with its checksum left to the landed bytes.
    Deferred,
    /// END arrived with this checksum; the landed bytes' CRC is owed.
    Owed(u64),
    /// The landed bytes matched END's checksum.
    Verified,
}

/// The most DATA payloads a driver may have handled with
/// [`CheckedFrame::checksum_later`] and not yet reported the CRC of.
pub const MAX_CHECKSUMS_OWED: usize = 64;

/// Where a receiving stream stands (spec §7.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReceiverState {
    /// Nothing received yet.
    AwaitingMetadata,
    /// EARLY received: the tensor is sent early, its METADATA comes next (spec §7.6).
    AwaitingEarlyMetadata,
    /// METADATA received; the application must accept or reject.
    AwaitingDecision,
    /// An early tensor's METADATA received: DATA arrives while the application decides.
    ReceivingEarly,
    /// Every byte of an early tensor arrived and matched END's checksum; the application
    /// has not decided yet.
    EndedEarly,
    /// Accepted: DATA arrives against granted credit.
    Receiving,
    /// END verified every byte and the checksum (or the landed bytes' checksum is owed);
    /// waiting for the sink to make them durable.
    AwaitingResidency,
    /// COMPLETE queued. Terminal.
    Complete,
    /// Rejected, cancelled by either side, or failed. Terminal.
    Closed,
}

impl ReceiverState {
    /// Whether the application owes its accept or reject: METADATA arrived (early DATA may be
    /// arriving or have arrived) and nothing is decided yet.
    pub fn awaits_decision(self) -> bool {
        matches!(
            self,
            Self::AwaitingDecision | Self::ReceivingEarly | Self::EndedEarly
        )
    }
}

/// What can happen to a receiving stream (spec §7.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReceiverInput {
    /// An EARLY frame arrived.
    RecvEarly,
    /// A METADATA frame arrived.
    RecvMetadata,
    /// A DATA frame arrived.
    RecvData,
    /// An END frame arrived.
    RecvEnd,
    /// A CANCEL frame arrived.
    RecvCancel,
    /// A frame only a receiver sends arrived (ACCEPT, REJECT, CREDIT, COMPLETE).
    RecvReceiverFrame,
    /// The application accepted the tensor.
    Accept,
    /// The application rejected the tensor.
    Reject,
    /// The sink made every byte durable.
    Resident,
    /// The application cancelled, or a frame broke a rule.
    Abort,
}

impl ReceiverState {
    /// Every state, in table order.
    pub const ALL: &'static [ReceiverState] = &[
        Self::AwaitingMetadata,
        Self::AwaitingEarlyMetadata,
        Self::AwaitingDecision,
        Self::ReceivingEarly,
        Self::EndedEarly,
        Self::Receiving,
        Self::AwaitingResidency,
        Self::Complete,
        Self::Closed,
    ];

    /// The state after `input`, or `None` if `input` is not allowed here.
    pub fn transition(self, input: ReceiverInput) -> Option<ReceiverState> {
        use ReceiverInput as I;
        use ReceiverState as S;
        match (self, input) {
            (S::Complete | S::Closed, _) => None,
            (S::AwaitingMetadata, I::RecvMetadata) => Some(S::AwaitingDecision),
            (S::AwaitingMetadata, I::RecvEarly) => Some(S::AwaitingEarlyMetadata),
            (S::AwaitingEarlyMetadata, I::RecvMetadata) => Some(S::ReceivingEarly),
            (S::AwaitingDecision | S::ReceivingEarly, I::Accept) => Some(S::Receiving),
            (S::AwaitingDecision | S::ReceivingEarly | S::EndedEarly, I::Reject) => Some(S::Closed),
            (S::ReceivingEarly, I::RecvData) => Some(S::ReceivingEarly),
            (S::ReceivingEarly, I::RecvEnd) => Some(S::EndedEarly),
            (S::EndedEarly, I::Accept) => Some(S::AwaitingResidency),
            (S::Receiving, I::RecvData) => Some(S::Receiving),
            (S::Receiving, I::RecvEnd) => Some(S::AwaitingResidency),
            (S::AwaitingResidency, I::Resident) => Some(S::Complete),
            (_, I::RecvCancel | I::Abort) => Some(S::Closed),
            _ => None,
        }
    }
}

impl ReceiverInput {
    /// Every input, in table order.
    pub const ALL: &'static [ReceiverInput] = &[
        Self::RecvEarly,
        Self::RecvMetadata,
        Self::RecvData,
        Self::RecvEnd,
        Self::RecvCancel,
        Self::RecvReceiverFrame,
        Self::Accept,
        Self::Reject,
        Self::Resident,
        Self::Abort,
    ];
}

/// What a frame from the sender meant, for the driver to act on.
#[derive(Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReceiverEvent {
    /// EARLY arrived: METADATA follows, then the tensor's bytes, before the decision.
    Early,
    /// METADATA arrived: read [`TensorReceiver::meta`], then accept or reject (for an early
    /// tensor, once [`TensorReceiver::grant_early`] gave it its whole length).
    Metadata,
    /// Verified DATA: give it to the sink, release its credit once durable.
    Data(Data),
    /// Every byte arrived and the checksum matched (for DATA left to the landed checksum,
    /// it is owed: [`TensorReceiver::verify_landed_crc`]): flush the sink, then
    /// [`TensorReceiver::mark_resident`].
    End,
}

/// One tensor's receiving side, without IO or clocks (spec §7).
///
/// Contract: feed each frame decoded from the stream to [`handle_frame`](Self::handle_frame);
/// call [`accept`](Self::accept) or [`reject`](Self::reject) after
/// [`ReceiverEvent::Metadata`], [`grant`](Self::grant) credit as the budget allows, and
/// [`mark_resident`](Self::mark_resident) after [`ReceiverEvent::End`] once the sink is
/// durable (and, for DATA handled with [`CheckedFrame::checksum_landed`], once
/// [`verify_landed_crc`](Self::verify_landed_crc) accepted the landed bytes' CRC). After
/// every call, send what [`poll_frame`](Self::poll_frame) returns, in order.
/// Any error closes the tensor and queues the REJECT (before ACCEPT) or CANCEL (after)
/// that tells the sender why; [`revocable_credit`](Self::revocable_credit) then says how
/// many granted bytes will never arrive.
#[derive(Debug)]
pub struct TensorReceiver {
    limits: Limits,
    state: ReceiverState,
    meta: Option<TensorMeta>,
    /// The ranges whose CRCs are known, in the order they were reported.
    ranges: ReceivedRanges,
    /// Every range handled, CRC known or owed: the rules of spec §7.3 are checked here, so
    /// they hold at the frame whenever its CRC comes (their CRCs are not kept).
    claimed: ReceivedRanges,
    granted: u64,
    received: u64,
    /// The ranges of DATA handled with their checksums to follow, oldest first.
    crc_owed: VecDeque<(u64, u64)>,
    landed: LandedChecksum,
    outgoing: VecDeque<Frame>,
    ending: Option<ProtocolError>,
}

impl TensorReceiver {
    /// A stream that enforces `limits`.
    pub fn new(limits: Limits) -> Self {
        // Ranges with owed CRCs join in report order, so `ranges` may briefly hold more
        // separate ranges than `claimed`, never more than the owed ones add.
        let ranges = ReceivedRanges::new(limits.max_ranges.saturating_add(MAX_CHECKSUMS_OWED));
        let claimed = ReceivedRanges::new(limits.max_ranges);
        Self {
            limits,
            state: ReceiverState::AwaitingMetadata,
            meta: None,
            ranges,
            claimed,
            granted: 0,
            received: 0,
            crc_owed: VecDeque::new(),
            landed: LandedChecksum::Unused,
            outgoing: VecDeque::new(),
            ending: None,
        }
    }

    /// The current state.
    pub fn state(&self) -> ReceiverState {
        self.state
    }

    /// The tensor's metadata, once received.
    pub fn meta(&self) -> Option<&TensorMeta> {
        self.meta.as_ref()
    }

    /// Why the tensor closed, if it did without completing.
    pub fn ending(&self) -> Option<&ProtocolError> {
        self.ending.as_ref()
    }

    /// Payload bytes granted to the sender so far.
    pub fn granted(&self) -> u64 {
        self.granted
    }

    /// Payload bytes received so far.
    pub fn received(&self) -> u64 {
        self.received
    }

    /// Granted bytes that have not arrived; after the tensor closes, they never will.
    pub fn revocable_credit(&self) -> u64 {
        self.granted - self.received
    }

    /// Bytes the sender still needs credit for.
    pub fn ungranted(&self) -> u64 {
        self.meta
            .as_ref()
            .map_or(0, |m| m.byte_len() - self.granted)
    }

    /// The next frame to send to the sender.
    pub fn poll_frame(&mut self) -> Option<Frame> {
        self.outgoing.pop_front()
    }

    /// Feeds one frame from the sender.
    pub fn handle_frame(&mut self, frame: Frame) -> Result<ReceiverEvent, ProtocolError> {
        self.handle_checked(CheckedFrame::new(frame))
    }

    /// Feeds one frame from the sender whose DATA checksum was computed beforehand.
    pub fn handle_checked(&mut self, frame: CheckedFrame) -> Result<ReceiverEvent, ProtocolError> {
        if let Some(err) = self.closed_error(&frame.frame) {
            return Err(err);
        }
        let result = self.dispatch(frame);
        if let Err(err) = &result {
            self.abort(err.clone());
        }
        result
    }

    fn dispatch(&mut self, checked: CheckedFrame) -> Result<ReceiverEvent, ProtocolError> {
        let CheckedFrame { frame, payload_crc } = checked;
        match &frame {
            Frame::Data(_) if self.crc_owed.len() >= MAX_CHECKSUMS_OWED => {
                return Err(ProtocolError::Misuse(
                    "DATA with the checksums of MAX_CHECKSUMS_OWED earlier DATA not recorded",
                ));
            }
            Frame::End(_) if !self.crc_owed.is_empty() => {
                return Err(ProtocolError::Misuse(
                    "END before every DATA's checksum was recorded",
                ));
            }
            Frame::Data(_) => self.check_checksum_mode(payload_crc)?,
            _ => {}
        }
        let input = match &frame {
            Frame::Early(_) => ReceiverInput::RecvEarly,
            Frame::Metadata(_) => ReceiverInput::RecvMetadata,
            Frame::Data(_) => ReceiverInput::RecvData,
            Frame::End(_) => ReceiverInput::RecvEnd,
            Frame::Cancel(_) => ReceiverInput::RecvCancel,
            _ => ReceiverInput::RecvReceiverFrame,
        };
        let next = self.state.transition(input).ok_or_else(|| {
            ProtocolError::violation(
                ErrorCode::UNEXPECTED_FRAME,
                format!("{} in receiver state {:?}", frame.frame_type(), self.state),
            )
        })?;
        let event = match frame {
            Frame::Early(_) => ReceiverEvent::Early,
            Frame::Metadata(m) => self.on_metadata(m.meta)?,
            Frame::Data(data) => match payload_crc {
                PayloadCrc::Computed(crc) => self.on_data(data, crc)?,
                PayloadCrc::Unknown => {
                    let crc = data.payload.crc32c();
                    self.on_data(data, crc)?
                }
                PayloadCrc::Later => self.on_data_checksum_later(data)?,
                PayloadCrc::OfLandedBytes => self.on_data_checksum_landed(data)?,
            },
            Frame::End(end) => self.on_end(end.checksum)?,
            Frame::Cancel(cancel) => {
                return Err(ProtocolError::Remote {
                    code: cancel.code,
                    reason: cancel.reason,
                });
            }
            other => {
                return Err(ProtocolError::violation(
                    ErrorCode::UNEXPECTED_FRAME,
                    format!("{} is sent by receivers only", other.frame_type()),
                ));
            }
        };
        self.state = next;
        Ok(event)
    }

    /// A tensor's DATA are all checksummed per payload, or all over the landed bytes, and
    /// the latter only once accepted (early DATA may be rejected, and is checked as it comes).
    fn check_checksum_mode(&self, payload_crc: PayloadCrc) -> Result<(), ProtocolError> {
        let landed = matches!(payload_crc, PayloadCrc::OfLandedBytes);
        let per_payload_so_far = self.ranges.range_count() != 0 || !self.crc_owed.is_empty();
        if landed && (per_payload_so_far || self.state != ReceiverState::Receiving) {
            return Err(ProtocolError::Misuse(
                "DATA left to the landed checksum after DATA checksummed on its own, or before ACCEPT",
            ));
        }
        if !landed && self.landed != LandedChecksum::Unused {
            return Err(ProtocolError::Misuse(
                "DATA checksummed on its own after DATA left to the landed checksum",
            ));
        }
        Ok(())
    }

    fn on_metadata(&mut self, meta: TensorMeta) -> Result<ReceiverEvent, ProtocolError> {
        if meta.checksum() != ChecksumAlgorithm::CRC32C {
            return Err(ProtocolError::Local {
                code: ErrorCode::UNSUPPORTED_CHECKSUM,
                reason: format!("checksum algorithm {} is not supported", meta.checksum().0),
            });
        }
        self.meta = Some(meta);
        Ok(ReceiverEvent::Metadata)
    }

    /// Spec §7.3: credit first, then bounds, then overlap and gap count.
    fn on_data(&mut self, data: Data, payload_crc: u32) -> Result<ReceiverEvent, ProtocolError> {
        let (start, end) = self.claim(&data)?;
        self.ranges.insert(start, end, payload_crc)?;
        Ok(ReceiverEvent::Data(data))
    }

    /// As [`on_data`](Self::on_data), the range's CRC recorded once it is reported.
    fn on_data_checksum_later(&mut self, data: Data) -> Result<ReceiverEvent, ProtocolError> {
        let range = self.claim(&data)?;
        self.crc_owed.push_back(range);
        Ok(ReceiverEvent::Data(data))
    }

    /// As [`on_data`](Self::on_data), the tensor's CRC left to its landed bytes.
    fn on_data_checksum_landed(&mut self, data: Data) -> Result<ReceiverEvent, ProtocolError> {
        self.claim(&data)?;
        self.landed = LandedChecksum::Deferred;
        Ok(ReceiverEvent::Data(data))
    }

    /// Checks DATA by spec §7.3's rules, then counts its bytes as received; its byte range.
    fn claim(&mut self, data: &Data) -> Result<(u64, u64), ProtocolError> {
        let (start, end) = self.check_data(data)?;
        // The CRCs of `claimed` are never read: its ranges carry the rules.
        self.claimed.insert_with(start, end, |_| 0)?;
        self.received += end - start;
        Ok((start, end))
    }

    /// DATA's credit and bounds (spec §7.3); its byte range.
    fn check_data(&self, data: &Data) -> Result<(u64, u64), ProtocolError> {
        let byte_len = self.meta.as_ref().map_or(0, TensorMeta::byte_len);
        let len = data.payload.len() as u64;
        if len > self.granted - self.received {
            return Err(ProtocolError::violation(
                ErrorCode::CREDIT_VIOLATION,
                format!(
                    "{len} byte DATA with {} bytes of credit",
                    self.granted - self.received
                ),
            ));
        }
        let end = data.end().filter(|&end| end <= byte_len).ok_or_else(|| {
            ProtocolError::violation(
                ErrorCode::DATA_PAST_END,
                format!(
                    "DATA at {} + {len} past the tensor's {byte_len} bytes",
                    data.offset
                ),
            )
        })?;
        Ok((data.offset, end))
    }

    /// The CRC-32C of the oldest DATA payload handled with [`CheckedFrame::checksum_later`]
    /// whose CRC is owed, since stored by the driver.
    pub fn record_payload_crc(&mut self, crc: u32) -> Result<(), ProtocolError> {
        let (start, end) = self
            .crc_owed
            .pop_front()
            .ok_or(ProtocolError::Misuse("no DATA is waiting for its checksum"))?;
        let recorded = self.ranges.insert(start, end, crc);
        if let Err(err) = &recorded {
            self.abort(err.clone());
        }
        recorded
    }

    fn on_end(&mut self, checksum: u64) -> Result<ReceiverEvent, ProtocolError> {
        let byte_len = self.meta.as_ref().map_or(0, TensorMeta::byte_len);
        if self.landed == LandedChecksum::Deferred {
            if let Some((from, to)) = self.claimed.first_gap(byte_len) {
                return Err(end_with_gaps(from, to));
            }
            self.landed = LandedChecksum::Owed(checksum);
            return Ok(ReceiverEvent::End);
        }
        let Some(crc) = self.ranges.whole_crc(byte_len) else {
            let (from, to) = self.ranges.first_gap(byte_len).unwrap_or((0, byte_len));
            return Err(end_with_gaps(from, to));
        };
        if u64::from(crc) != checksum {
            return Err(ProtocolError::violation(
                ErrorCode::CHECKSUM_MISMATCH,
                format!("END says CRC-32C {checksum:#x}, bytes have {crc:#x}"),
            ));
        }
        Ok(ReceiverEvent::End)
    }

    /// The CRC-32C of the landed tensor, whose DATA were handled with
    /// [`CheckedFrame::checksum_landed`]: after
    /// [`ReceiverEvent::End`], before [`mark_resident`](Self::mark_resident). A CRC that
    /// differs from END's closes the tensor with CHECKSUM_MISMATCH (spec §7.3).
    pub fn verify_landed_crc(&mut self, crc: u32) -> Result<(), ProtocolError> {
        let LandedChecksum::Owed(checksum) = self.landed else {
            return Err(ProtocolError::Misuse(
                "a landed checksum for a tensor that owes none",
            ));
        };
        if self.state != ReceiverState::AwaitingResidency {
            return Err(self
                .ending
                .clone()
                .unwrap_or(ProtocolError::Misuse("tensor closed")));
        }
        if u64::from(crc) != checksum {
            let err = ProtocolError::violation(
                ErrorCode::CHECKSUM_MISMATCH,
                format!("END says CRC-32C {checksum:#x}, the landed bytes have {crc:#x}"),
            );
            self.abort(err.clone());
            return Err(err);
        }
        self.landed = LandedChecksum::Verified;
        Ok(())
    }

    /// Admits the tensor; queues ACCEPT advertising `limits.max_data_payload`.
    pub fn accept(&mut self) -> Result<(), ProtocolError> {
        self.local(ReceiverInput::Accept)?;
        self.outgoing.push_back(Frame::Accept(Accept {
            max_data_payload: self.limits.max_data_payload,
        }));
        Ok(())
    }

    /// Refuses the tensor; queues REJECT.
    pub fn reject(
        &mut self,
        code: ErrorCode,
        reason: impl Into<String>,
    ) -> Result<(), ProtocolError> {
        self.local(ReceiverInput::Reject)?;
        let reject = Reject::new(code, reason);
        self.ending = Some(ProtocolError::Local {
            code,
            reason: reject.reason.clone(),
        });
        self.outgoing.push_back(Frame::Reject(reject));
        Ok(())
    }

    /// Grants up to `bytes` more, capped at what the tensor still needs; queues CREDIT.
    ///
    /// Returns the bytes granted: 0 unless the tensor is [`ReceiverState::Receiving`].
    #[must_use = "bytes not granted must go back to the budget"]
    pub fn grant(&mut self, bytes: u64) -> u64 {
        if self.state != ReceiverState::Receiving {
            return 0;
        }
        let granted = bytes.min(self.ungranted());
        if granted > 0 {
            self.granted += granted;
            self.outgoing
                .push_back(Frame::Credit(Credit { bytes: granted }));
        }
        granted
    }

    /// Gives an early tensor its whole length as credit, taken from the connection's early
    /// allowance (spec §7.6); the session checked the allowance. Returns the bytes granted.
    pub fn grant_early(&mut self) -> Result<u64, ProtocolError> {
        if self.state != ReceiverState::ReceivingEarly || self.granted != 0 {
            return Err(ProtocolError::Misuse(
                "grant_early outside an early tensor's first step",
            ));
        }
        self.granted = self.ungranted();
        Ok(self.granted)
    }

    /// The sink made every byte durable: queues COMPLETE with `receipt`, what the receiver
    /// made of the tensor (spec §6.8). The receipt must be empty on a connection older than
    /// 1.5; [`Session::mark_resident`](crate::Session::mark_resident) sees to that.
    pub fn mark_resident(&mut self, receipt: Receipt) -> Result<(), ProtocolError> {
        if let LandedChecksum::Owed(_) = self.landed {
            return Err(ProtocolError::Misuse(
                "COMPLETE before the landed bytes' checksum was verified",
            ));
        }
        self.local(ReceiverInput::Resident)?;
        self.outgoing
            .push_back(Frame::Complete(Complete { receipt }));
        Ok(())
    }

    /// Ends the tensor from this side; queues REJECT before ACCEPT, CANCEL after.
    pub fn cancel(
        &mut self,
        code: ErrorCode,
        reason: impl Into<String>,
    ) -> Result<(), ProtocolError> {
        if self.state.transition(ReceiverInput::Abort).is_none() {
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

    /// Closes on `err`, a rule the session found broken, and tells the sender why.
    pub(crate) fn fail(&mut self, err: ProtocolError) {
        self.abort(err);
    }

    /// Closes on `err` and tells the sender why, unless the sender ended it first.
    fn abort(&mut self, err: ProtocolError) {
        if self.state.transition(ReceiverInput::Abort).is_none() {
            return;
        }
        if !matches!(err, ProtocolError::Remote { .. }) {
            let reason = err.wire_reason();
            // Before a decision the refusal is a REJECT; after it, a CANCEL.
            let undecided = matches!(
                self.state,
                ReceiverState::AwaitingMetadata | ReceiverState::AwaitingEarlyMetadata
            ) || self.state.awaits_decision();
            let frame = if undecided {
                Frame::Reject(Reject::new(err.code(), reason))
            } else {
                Frame::Cancel(Cancel::new(err.code(), reason))
            };
            self.outgoing.push_back(frame);
        }
        self.state = ReceiverState::Closed;
        self.ending = Some(err);
    }

    fn local(&mut self, input: ReceiverInput) -> Result<(), ProtocolError> {
        match self.state.transition(input) {
            Some(next) => {
                self.state = next;
                Ok(())
            }
            None => Err(ProtocolError::Misuse(
                "receiver call not allowed in this state",
            )),
        }
    }

    /// What `frame` means to a tensor that has ended (Complete or Closed); `None` before.
    fn closed_error(&self, frame: &Frame) -> Option<ProtocolError> {
        match (self.state, frame) {
            (ReceiverState::Closed, _) => Some(
                self.ending
                    .clone()
                    .unwrap_or(ProtocolError::Misuse("tensor closed")),
            ),
            // Spec §7.2: a CANCEL that crossed our COMPLETE is the sender's cancel, not a
            // broken rule; the tensor stays complete.
            (ReceiverState::Complete, Frame::Cancel(cancel)) => Some(ProtocolError::Remote {
                code: cancel.code,
                reason: cancel.reason.clone(),
            }),
            (ReceiverState::Complete, _) => Some(ProtocolError::violation(
                ErrorCode::UNEXPECTED_FRAME,
                "frame after COMPLETE",
            )),
            _ => None,
        }
    }
}

fn end_with_gaps(from: u64, to: u64) -> ProtocolError {
    ProtocolError::violation(
        ErrorCode::END_WITH_GAPS,
        format!("END with bytes [{from}, {to}) missing"),
    )
}
