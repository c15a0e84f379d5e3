//! A sender and a receiver wired together in memory, with knobs to drop, reorder or tamper
//! with frames; every frame goes through the encoder and decoder on the way.

use bytes::Bytes;
use tensorwire_proto::Receipt;
use tensorwire_proto::{
    CreditTracker, ErrorCode, Frame, FrameDecoder, Limits, Party, ProtocolError, ReceiverEvent,
    ReceiverState, SenderEvent, SenderState, TensorMeta, TensorReceiver, TensorSender,
};

/// What a test may do to the frames the sender sends, per pump: edit, drop, reorder, add.
pub type Alter = Box<dyn FnMut(&mut Vec<Frame>)>;

/// A sender and a receiver of one tensor, with a receiver-wide credit budget.
pub struct Pair {
    pub sender: TensorSender,
    pub receiver: TensorReceiver,
    pub credit: CreditTracker,
    pub source: Bytes,
    pub dest: Vec<u8>,
    pub sender_result: Option<Result<(), ProtocolError>>,
    pub receiver_result: Option<Result<(), ProtocolError>>,
    /// Make received bytes durable (release their credit) as soon as they arrive.
    pub sink_is_instant: bool,
    /// Largest CREDIT a single grant sends.
    pub grant_step: u64,
    /// Accept the tensor after METADATA (else the test decides).
    pub auto_accept: bool,
    to_receiver: FrameDecoder,
    to_sender: FrameDecoder,
    alter: Option<Alter>,
    unreleased: u64,
}

impl Pair {
    /// A pair for `meta` with `source` bytes, a 1 MiB budget and default limits.
    pub fn new(meta: TensorMeta, source: impl Into<Bytes>) -> Self {
        Self::with_limits(
            meta,
            source,
            Limits::default(),
            CreditTracker::new(1 << 20, 1 << 20, 1 << 19).unwrap(),
        )
    }

    pub fn with_limits(
        meta: TensorMeta,
        source: impl Into<Bytes>,
        limits: Limits,
        credit: CreditTracker,
    ) -> Self {
        let len = meta.byte_len() as usize;
        Self {
            sender: TensorSender::new(meta).unwrap(),
            receiver: TensorReceiver::new(limits.clone()),
            credit,
            source: source.into(),
            dest: vec![0; len],
            sender_result: None,
            receiver_result: None,
            sink_is_instant: true,
            grant_step: u64::MAX,
            auto_accept: true,
            to_receiver: FrameDecoder::new(limits.clone()),
            to_sender: FrameDecoder::new(limits),
            alter: None,
            unreleased: 0,
        }
    }

    /// Alters every batch of frames going to the receiver.
    pub fn altered(mut self, alter: impl FnMut(&mut Vec<Frame>) + 'static) -> Self {
        self.alter = Some(Box::new(alter));
        self
    }

    /// Runs until neither side makes progress; returns both sides' results.
    pub fn transfer(&mut self) -> (Result<(), ProtocolError>, Result<(), ProtocolError>) {
        for _ in 0..100_000 {
            if !self.pump() {
                break;
            }
        }
        (
            self.sender_result
                .clone()
                .unwrap_or(Err(ProtocolError::Misuse("sender stalled"))),
            self.receiver_result
                .clone()
                .unwrap_or(Err(ProtocolError::Misuse("receiver stalled"))),
        )
    }

    /// One round: sender sends what it can, frames cross, receiver reacts, frames cross back.
    pub fn pump(&mut self) -> bool {
        self.feed_sender_data();
        let mut outgoing: Vec<Frame> = std::iter::from_fn(|| self.sender.poll_frame()).collect();
        if let Some(alter) = &mut self.alter {
            alter(&mut outgoing);
        }
        let mut progress = !outgoing.is_empty();
        for frame in outgoing {
            self.to_receiver.push(frame.to_bytes());
        }
        loop {
            match self.to_receiver.next_frame() {
                Ok(Some(frame)) => self.receiver_handle(frame),
                Ok(None) => break,
                Err(e) => {
                    self.receiver_result.get_or_insert(Err(e.clone()));
                    let _ = self.receiver.cancel(e.code(), e.to_string());
                    break;
                }
            }
        }
        self.grant();
        let back: Vec<Frame> = std::iter::from_fn(|| self.receiver.poll_frame()).collect();
        progress |= !back.is_empty();
        for frame in back {
            self.to_sender.push(frame.to_bytes());
        }
        while let Ok(Some(frame)) = self.to_sender.next_frame() {
            match self.sender.handle_frame(frame) {
                Ok(SenderEvent::Complete(_)) => self.sender_result = Some(Ok(())),
                Ok(_) => {}
                Err(e) => {
                    self.sender_result.get_or_insert(Err(e));
                }
            }
        }
        progress
    }

    /// Makes `n` held bytes durable, as a slow sink would later.
    pub fn release(&mut self, n: u64) {
        self.unreleased -= n;
        let _ = self.credit.release(n).unwrap();
    }

    /// Bytes received but not yet released by the sink.
    pub fn unreleased(&self) -> u64 {
        self.unreleased
    }

    /// Returns the credit a closed tensor will never use, as a driver must.
    pub fn close_out(&mut self) {
        let closed = matches!(
            self.receiver.state(),
            ReceiverState::Closed | ReceiverState::Complete
        );
        if closed {
            let revocable = self.receiver.revocable_credit();
            let _ = self.credit.revoke(Party::default(), revocable).unwrap();
            let unreleased = self.unreleased;
            self.release(unreleased);
        }
    }

    fn receiver_handle(&mut self, frame: Frame) {
        match self.receiver.handle_frame(frame) {
            Ok(ReceiverEvent::Metadata) if self.auto_accept => self.receiver.accept().unwrap(),
            Ok(ReceiverEvent::Data(data)) => {
                let at = data.offset as usize;
                data.payload
                    .copy_to_slice(&mut self.dest[at..at + data.payload.len()]);
                let n = data.payload.len() as u64;
                self.credit.consume(Party::default(), n).unwrap();
                self.unreleased += n;
                if self.sink_is_instant {
                    self.release(n);
                }
            }
            Ok(ReceiverEvent::End) => {
                if self.unreleased > 0 {
                    self.release(self.unreleased);
                }
                self.receiver.mark_resident(Receipt::new()).unwrap();
                self.receiver_result = Some(Ok(()));
            }
            Ok(_) => {}
            Err(e) => {
                self.receiver_result.get_or_insert(Err(e));
            }
        }
    }

    fn grant(&mut self) {
        let want = self.receiver.ungranted().min(self.grant_step);
        let granted = self.credit.grant(Party::default(), want);
        let used = self.receiver.grant(granted);
        let _ = self
            .credit
            .revoke(Party::default(), granted - used)
            .unwrap();
    }

    fn feed_sender_data(&mut self) {
        while self.sender.state() == SenderState::Sending {
            let sent = self.sender.sent() as usize;
            if sent == self.source.len() {
                self.sender.finish().unwrap();
                break;
            }
            let n = (self.sender.next_chunk_len() as usize).min(self.source.len() - sent);
            if n == 0 {
                break;
            }
            self.sender
                .send_data(self.source.slice(sent..sent + n))
                .unwrap();
        }
    }

    /// Cancels from the sender's side with CANCELLED.
    pub fn cancel_sender(&mut self) {
        self.sender
            .cancel(ErrorCode::CANCELLED, "test cancels")
            .unwrap();
        self.sender_result = Some(Err(self.sender.ending().unwrap().clone()));
    }
}
