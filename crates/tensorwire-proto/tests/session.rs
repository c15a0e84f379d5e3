//! The connection session without sockets: senders wired to sessions in memory, several
//! connections sharing one receiver-wide credit tracker, the sink's durability simulated by
//! releasing held bytes late. Every test uses the policy that ships (`SessionConfig`).
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tensorwire_proto::Receipt;
use tensorwire_proto::frame::Cancel;
use tensorwire_proto::testing::pattern;
use tensorwire_proto::{
    CreditTracker, DECISION_GRACE, DType, ErrorCode, Frame, GrantClock, IncomingEvent,
    OutgoingEvent, Session, SessionConfig, StreamClosed, StreamId, TensorMeta, TensorSender,
    Version,
};

/// The fake clock's origin: tests move time by adding durations to it.
#[allow(clippy::disallowed_methods)] // The one read of the real clock, as the origin.
fn epoch() -> Instant {
    Instant::now()
}

/// A grant's clock where no round trip was measured: windows keep their initial size.
fn no_path() -> GrantClock {
    GrantClock::without_path(epoch())
}

fn meta(name: &str, len: usize) -> TensorMeta {
    TensorMeta::new([len as u64], DType::U8)
        .unwrap()
        .with_name(name)
}

/// One tensor in flight: its sender, the bytes it sends, what landed, and bytes held by the
/// simulated sink (arrived, not yet durable).
struct Flow {
    conn: usize,
    id: StreamId,
    sender: TensorSender,
    source: Bytes,
    landed: Vec<u8>,
    held: Vec<u64>,
    closed: Option<StreamClosed>,
}

/// Several connections (sessions) sharing one credit tracker.
struct Receiver {
    sessions: Vec<Session>,
    credit: CreditTracker,
    flows: Vec<Flow>,
    peak_outstanding: u64,
    pauses: u32,
    now: Instant,
}

impl Receiver {
    fn new(connections: usize, config: &SessionConfig, credit: CreditTracker) -> Self {
        let now = epoch();
        Self {
            sessions: (0..connections)
                .map(|_| Session::new(config.clone(), now))
                .collect(),
            credit,
            flows: Vec::new(),
            peak_outstanding: 0,
            pauses: 0,
            now,
        }
    }

    fn send(&mut self, conn: usize, name: &str, len: usize, seed: u64) {
        let id = self.flows.len() as StreamId;
        self.sessions[conn].open_stream(id, epoch()).unwrap();
        let m = meta(name, len);
        self.flows.push(Flow {
            conn,
            id,
            sender: TensorSender::new(m).unwrap(),
            source: Bytes::from(pattern(len, seed)),
            landed: vec![0; len],
            held: Vec::new(),
            closed: None,
        });
    }

    /// One round over every flow; `release_lag` is how many DATA chunks a sink holds before
    /// the oldest becomes durable. Returns whether anything moved.
    fn pump(&mut self, release_lag: usize) -> bool {
        let mut moved = false;
        for i in 0..self.flows.len() {
            let flow = &mut self.flows[i];
            if flow.closed.is_some() {
                continue;
            }
            let session = &mut self.sessions[flow.conn];
            // Sender → session, through the codec.
            while flow.sender.next_chunk_len() > 0 && flow.sender.sent() < flow.source.len() as u64
            {
                let at = flow.sender.sent() as usize;
                let n = (flow.sender.next_chunk_len() as usize)
                    .min(flow.source.len() - at)
                    .min(256 << 10);
                flow.sender
                    .send_data(flow.source.slice(at..at + n))
                    .unwrap();
            }
            if flow.sender.sent() == flow.source.len() as u64
                && flow.sender.state() == tensorwire_proto::SenderState::Sending
            {
                flow.sender.finish().unwrap();
            }
            while let Some(frame) = flow.sender.poll_frame() {
                moved = true;
                let frame = Frame::decode_one(&frame.to_bytes());
                match session.handle_frame(flow.id, frame, &mut self.credit, epoch()) {
                    Ok(IncomingEvent::Metadata(_)) => session.accept(flow.id, epoch()).unwrap(),
                    Ok(IncomingEvent::Data(data)) => {
                        let at = data.offset as usize;
                        data.payload
                            .copy_to_slice(&mut flow.landed[at..at + data.payload.len()]);
                        flow.held.push(data.payload.len() as u64);
                    }
                    Ok(IncomingEvent::End) => {
                        for n in flow.held.drain(..) {
                            let _ = self.credit.release(n).unwrap();
                        }
                        session.mark_resident(flow.id, Receipt::new()).unwrap();
                    }
                    Ok(_) => {}
                    Err(_) => {}
                }
            }
            // The sink makes the oldest bytes durable once it holds more than the lag.
            while flow.held.len() > release_lag {
                let n = flow.held.remove(0);
                let _ = self.credit.release(n).unwrap();
                moved = true;
            }
            let paused_before = self.credit.should_pause();
            if session.grant(flow.id, &mut self.credit, no_path()) > 0 {
                moved = true;
            }
            if self.credit.should_pause() && !paused_before {
                self.pauses += 1;
            }
            self.peak_outstanding = self.peak_outstanding.max(self.credit.outstanding());
            // Session → sender.
            while let Some(frame) = session.poll_frame(flow.id) {
                moved = true;
                let _ = flow
                    .sender
                    .handle_frame(Frame::decode_one(&frame.to_bytes()));
            }
            let done = session.meta(flow.id).is_some()
                && (session.ending(flow.id).is_some()
                    || flow.sender.state() == tensorwire_proto::SenderState::Complete);
            if done {
                for n in flow.held.drain(..) {
                    let _ = self.credit.release(n).unwrap();
                }
                flow.closed = Some(session.close_stream(flow.id, &mut self.credit, self.now));
                moved = true;
            }
        }
        moved
    }

    fn run(&mut self, release_lag: usize) {
        for _ in 0..1_000_000 {
            if self.pump(release_lag) {
                continue;
            }
            // Nothing moved: the sinks' copies complete (the oldest held chunk of each
            // flow), as a GPU sink's would, or everything is done.
            let mut released = false;
            for flow in &mut self.flows {
                if !flow.held.is_empty() {
                    let _ = self.credit.release(flow.held.remove(0)).unwrap();
                    released = true;
                }
            }
            if !released {
                return;
            }
        }
        panic!("no quiescence");
    }
}

/// Decoding helper: the frame as a peer would see it.
trait DecodeOne {
    fn decode_one(bytes: &[u8]) -> Frame;
}

impl DecodeOne for Frame {
    fn decode_one(bytes: &[u8]) -> Frame {
        let mut decoder = tensorwire_proto::FrameDecoder::new(Default::default());
        decoder.push(Bytes::copy_from_slice(bytes));
        decoder.next_frame().unwrap().unwrap()
    }
}

/// `len` bytes of DATA arrive on stream 7 at `*offset`, which moves past them; the session
/// hands them on as DATA.
fn data_arrives(session: &mut Session, credit: &mut CreditTracker, offset: &mut u64, len: usize) {
    data_arrives_on(7, session, credit, offset, len);
}

/// As [`data_arrives`], on stream `id`.
fn data_arrives_on(
    id: StreamId,
    session: &mut Session,
    credit: &mut CreditTracker,
    offset: &mut u64,
    len: usize,
) {
    let data = tensorwire_proto::frame::Data {
        offset: *offset,
        payload: Bytes::from(vec![7u8; len]).into(),
    };
    *offset += len as u64;
    let event = session
        .handle_frame(id, Frame::Data(data), credit, epoch())
        .unwrap();
    assert!(matches!(event, IncomingEvent::Data(_)));
}

/// Spec §7.1: a tensor is out of credit once every byte granted to it arrived and more are
/// needed; then its held bytes must be released without waiting for more. Not before ACCEPT,
/// not while granted bytes are still to arrive, and not once every byte is granted.
#[test]
fn a_tensor_is_out_of_credit_when_its_granted_bytes_all_arrived() {
    let mut config = SessionConfig::default();
    config.grant_unit = 1 << 20;
    config.stream_window = 1 << 20;
    // Pauses at the first grant: the tracker gives nothing more until bytes are released.
    let mut credit = CreditTracker::new(2 << 20, 1 << 20, 0).unwrap();
    let mut session = Session::new(config, epoch());
    session.open_stream(7, epoch()).unwrap();
    session
        .handle_frame(7, meta("t", 2 << 20).into(), &mut credit, epoch())
        .unwrap();
    assert!(!session.out_of_credit(7), "not accepted yet");
    session.accept(7, epoch()).unwrap();
    assert!(session.out_of_credit(7), "accepted, nothing granted");
    assert_eq!(session.grant(7, &mut credit, no_path()), 1 << 20);
    let mut offset = 0;
    let mut arrive = |session: &mut Session, credit: &mut CreditTracker, len: usize| {
        data_arrives(session, credit, &mut offset, len);
    };
    arrive(&mut session, &mut credit, 512 << 10);
    assert!(!session.out_of_credit(7), "half the grant still to arrive");
    arrive(&mut session, &mut credit, 512 << 10);
    assert!(session.out_of_credit(7), "the grant arrived, 1 MiB to go");
    assert_eq!(
        session.grant(7, &mut credit, no_path()),
        0,
        "the tracker is paused"
    );
    // The sink releases what it held: granting resumes.
    assert!(credit.release(1 << 20).unwrap());
    assert_eq!(session.grant(7, &mut credit, no_path()), 1 << 20);
    assert!(!session.out_of_credit(7), "every byte granted");
    arrive(&mut session, &mut credit, 1 << 20);
    assert!(!session.out_of_credit(7), "every byte arrived");
    assert!(!session.out_of_credit(8), "no such stream");
}

#[test]
fn grants_come_in_units_up_to_the_stream_window() {
    let mut config = SessionConfig::default();
    config.grant_unit = 4 << 20;
    config.stream_window = 10 << 20;
    let mut credit = CreditTracker::new(1 << 30, 1 << 30, 1 << 29).unwrap();
    let mut session = Session::new(config, epoch());
    session.open_stream(7, epoch()).unwrap();
    let event = session
        .handle_frame(7, meta("big", 100 << 20).into(), &mut credit, epoch())
        .unwrap();
    assert!(matches!(event, IncomingEvent::Metadata(_)));
    assert!(!session.wants_credit(7), "no credit before ACCEPT");
    assert_eq!(session.grant(7, &mut credit, no_path()), 0);
    session.accept(7, epoch()).unwrap();
    let grants: Vec<u64> = (0..3)
        .map(|_| session.grant(7, &mut credit, no_path()))
        .collect();
    assert_eq!(
        grants,
        [4 << 20, 4 << 20, 0],
        "whole units only: the window's last 2 MiB is not granted"
    );
    assert!(!session.wants_credit(7));
    assert_eq!(credit.in_flight(), 8 << 20);
    // DATA smaller than a unit brings no CREDIT (spec §7.1: grants are large and few) ...
    let mut offset = 0;
    let mut arrive = |session: &mut Session, credit: &mut CreditTracker, len: usize| {
        data_arrives(session, credit, &mut offset, len);
    };
    for _ in 0..15 {
        arrive(&mut session, &mut credit, 100 << 10);
        assert!(!session.wants_credit(7), "a grant after {offset} bytes");
        assert_eq!(session.grant(7, &mut credit, no_path()), 0);
    }
    // ... until a whole unit fits the window again.
    arrive(&mut session, &mut credit, 548 << 10);
    assert!(session.wants_credit(7));
    assert_eq!(session.grant(7, &mut credit, no_path()), 4 << 20);
    let mut credits = 0;
    while let Some(frame) = session.poll_frame(7) {
        credits += u32::from(matches!(frame, Frame::Credit(_)));
    }
    assert_eq!(credits, 3, "one CREDIT per unit, none per DATA");
    assert_eq!(credit.held(), 2 << 20);
    // Closing returns every unreceived byte to the receiver-wide budget.
    assert_eq!(
        session.close_stream(7, &mut credit, epoch()),
        StreamClosed::Failed
    );
    assert_eq!(
        credit.outstanding(),
        2 << 20,
        "held bytes wait for the sink"
    );
    credit.release(2 << 20).unwrap();
}

/// Three connections, four tensors each, one 3 MiB budget that pauses at 2 MiB and resumes
/// at 1 MiB: every byte lands, the budget is never exceeded, granting pauses and resumes,
/// and all credit comes back.
#[test]
fn many_tensors_on_many_connections_stay_within_one_budget() {
    let mut config = SessionConfig::default();
    config.grant_unit = 256 << 10;
    config.stream_window = 1 << 20;
    let budget = 3 << 20;
    let credit = CreditTracker::new(budget, 2 << 20, 1 << 20).unwrap();
    let mut rx = Receiver::new(3, &config, credit);
    for conn in 0..3 {
        for t in 0..4 {
            let len = (1 << 20) + 4093 * (conn * 4 + t);
            rx.send(conn, &format!("c{conn}t{t}"), len, (conn * 4 + t) as u64);
        }
    }
    rx.run(3);
    for flow in &rx.flows {
        assert_eq!(flow.closed, Some(StreamClosed::Completed), "{}", flow.id);
        assert!(
            flow.landed[..] == flow.source[..],
            "stream {} differs",
            flow.id
        );
    }
    assert!(
        rx.peak_outstanding <= budget,
        "peak {}",
        rx.peak_outstanding
    );
    assert!(rx.pauses > 0, "the high watermark was never reached");
    assert_eq!(rx.credit.outstanding(), 0, "credit counted back");
    assert!(rx.sessions.iter().all(|s| s.open_streams() == 0));
}

/// A tensor cancelled mid-transfer gives back its unreceived credit; the others complete.
#[test]
fn a_cancelled_tensor_returns_its_credit_and_others_complete() {
    let mut config = SessionConfig::default();
    config.grant_unit = 64 << 10;
    config.stream_window = 256 << 10;
    let credit = CreditTracker::new(1 << 20, 1 << 20, 1 << 19).unwrap();
    let mut rx = Receiver::new(1, &config, credit);
    rx.send(0, "stays", 700 << 10, 1);
    rx.send(0, "goes", 700 << 10, 2);
    // Let both start, then the second sender cancels.
    rx.pump(1);
    rx.flows[1]
        .sender
        .cancel(ErrorCode::CANCELLED, "changed my mind")
        .unwrap();
    rx.run(1);
    assert_eq!(rx.flows[0].closed, Some(StreamClosed::Completed));
    assert_eq!(rx.flows[1].closed, Some(StreamClosed::Failed));
    assert_eq!(rx.credit.outstanding(), 0);
}

/// Spec §10 with a fake clock: cancelled streams beyond the budget close the connection,
/// and the budget refills with time.
#[test]
fn the_failure_budget_runs_dry_under_a_cancel_flood() {
    let mut config = SessionConfig::default();
    config.max_failed_streams = 3;
    config.failure_window = Duration::from_secs(3);
    let mut credit = CreditTracker::new(1 << 20, 1 << 20, 1 << 19).unwrap();
    let start = epoch();
    let mut session = Session::new(config, start);
    let mut cancel_one = |session: &mut Session, id: StreamId, now: Instant| {
        session.open_stream(id, epoch()).unwrap();
        let _ = session.handle_frame(id, meta("m", 10).into(), &mut credit, epoch());
        let cancel = Frame::from(Cancel::new(ErrorCode::CANCELLED, "flood"));
        assert!(
            session
                .handle_frame(id, cancel, &mut credit, epoch())
                .is_err()
        );
        session.close_stream(id, &mut credit, now)
    };
    for id in 0..3 {
        assert_eq!(cancel_one(&mut session, id, start), StreamClosed::Failed);
    }
    assert!(matches!(
        cancel_one(&mut session, 3, start),
        StreamClosed::Flood(_)
    ));
    // One second later, one more failure is allowed again.
    let later = start + Duration::from_secs(1);
    assert_eq!(cancel_one(&mut session, 4, later), StreamClosed::Failed);
    assert!(matches!(
        cancel_one(&mut session, 5, later),
        StreamClosed::Flood(_)
    ));
}

/// Spec §10: streams that time out also spend the failure budget, but the connection
/// they end closes with PROGRESS_TIMEOUT, the reason an operator should read, while a
/// cancelling peer's still gets CANCEL_FLOOD.
#[test]
fn a_budget_run_dry_by_timeouts_closes_with_progress_timeout() {
    let mut config = SessionConfig::default();
    config.max_failed_streams = 2;
    config.failure_window = Duration::from_secs(60);
    let mut credit = CreditTracker::new(1 << 20, 1 << 20, 1 << 19).unwrap();
    let now = epoch();
    let mut session = Session::new(config, now);
    let mut end_one = |session: &mut Session, id: StreamId, code: ErrorCode| {
        session.open_stream(id, epoch()).unwrap();
        let _ = session.handle_frame(id, meta("m", 10).into(), &mut credit, epoch());
        session.cancel(id, code, "no frame within 30 s");
        session.close_stream(id, &mut credit, now)
    };
    for id in 0..2 {
        let closed = end_one(&mut session, id, ErrorCode::PROGRESS_TIMEOUT);
        assert_eq!(closed, StreamClosed::Failed);
    }
    match end_one(&mut session, 2, ErrorCode::PROGRESS_TIMEOUT) {
        StreamClosed::Flood(flood) => assert_eq!(flood.code, ErrorCode::PROGRESS_TIMEOUT),
        other => panic!("{other:?}"),
    }
    match end_one(&mut session, 3, ErrorCode::CANCELLED) {
        StreamClosed::Flood(flood) => assert_eq!(flood.code, ErrorCode::CANCEL_FLOOD),
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_idle_timer_runs_only_while_no_stream_is_open_and_closes_the_connection() {
    let start = epoch();
    let idle = Duration::from_secs(60);
    let mut credit = CreditTracker::new(1 << 20, 1 << 20, 1 << 19).unwrap();
    let mut config = SessionConfig::default();
    config.idle_timeout = idle;
    // Streams' own timers are tested below.
    config.progress_timeout = Duration::MAX;
    let mut session = Session::new(config, start);
    assert_eq!(session.poll_timeout(), Some(start + idle));
    assert_eq!(
        session.handle_timeout(start + idle - Duration::from_millis(1)),
        None
    );

    // An open stream stops the timer, however long it stays open.
    session.open_stream(1, start).unwrap();
    assert_eq!(session.poll_timeout(), None);
    assert_eq!(session.handle_timeout(start + 10 * idle), None);

    // It starts again from the last stream's close.
    let closed_at = start + 10 * idle;
    let _ = session.close_stream(1, &mut credit, closed_at);
    assert_eq!(session.poll_timeout(), Some(closed_at + idle));
    assert_eq!(session.handle_timeout(closed_at + idle / 2), None);
    let end = session
        .handle_timeout(closed_at + idle)
        .expect("the connection ends");
    assert_eq!(end.code, ErrorCode::PROGRESS_TIMEOUT);
    assert!(end.reason.contains("idle timeout"), "{end}");
}

#[test]
fn an_idle_timeout_of_forever_never_fires() {
    let start = epoch();
    let mut config = SessionConfig::default();
    config.idle_timeout = Duration::MAX;
    let mut session = Session::new(config, start);
    assert_eq!(session.poll_timeout(), None);
    assert_eq!(
        session.handle_timeout(start + Duration::from_secs(1 << 40)),
        None
    );
}

#[test]
fn idle_time_counts_only_while_no_stream_is_open() {
    let start = epoch();
    let mut credit = CreditTracker::new(1 << 20, 1 << 20, 1 << 19).unwrap();
    let mut session = Session::new(SessionConfig::default(), start);
    assert_eq!(
        session.idle_for(start + Duration::from_secs(5)),
        Duration::from_secs(5)
    );
    session.open_stream(1, epoch()).unwrap();
    assert_eq!(
        session.idle_for(start + Duration::from_secs(50)),
        Duration::ZERO
    );
    let closed_at = start + Duration::from_secs(60);
    let _ = session.close_stream(1, &mut credit, closed_at);
    assert_eq!(
        session.idle_for(closed_at + Duration::from_secs(2)),
        Duration::from_secs(2)
    );
}

#[test]
fn a_stream_cannot_be_opened_twice() {
    let mut session = Session::new(SessionConfig::default(), epoch());
    session.open_stream(1, epoch()).unwrap();
    assert!(session.open_stream(1, epoch()).is_err());
}

/// One end of a connection: its session, its receiver-wide tracker, the tensors it sends and
/// what landed of the peer's.
struct Peer {
    session: Session,
    credit: CreditTracker,
    sending: Vec<(StreamId, Bytes)>,
    landed: std::collections::BTreeMap<StreamId, Vec<u8>>,
    completed: Vec<StreamId>,
    /// What this peer answers each tensor it lands with.
    answer: Receipt,
    /// What the peer answered each of our tensors with.
    receipts: Vec<Receipt>,
}

impl Peer {
    fn new(config: &SessionConfig) -> Self {
        Self {
            session: Session::new(config.clone(), epoch()),
            credit: CreditTracker::new(1 << 20, 1 << 20, 1 << 19).unwrap(),
            sending: Vec::new(),
            landed: Default::default(),
            completed: Vec::new(),
            answer: Receipt::new(),
            receipts: Vec::new(),
        }
    }

    fn send(&mut self, id: StreamId, name: &str, source: Bytes) {
        let sender = TensorSender::new(meta(name, source.len())).unwrap();
        self.session
            .start_sending(id, sender, epoch(), Duration::MAX)
            .unwrap();
        self.sending.push((id, source));
    }

    /// Local work: send what credit allows, finish, grant. Returns the streams to flush.
    fn work(&mut self) -> Vec<StreamId> {
        for (id, source) in &self.sending {
            let (id, len) = (*id, source.len() as u64);
            loop {
                let at = self.session.sent(id);
                let n = self.session.next_chunk_len(id).min(len - at);
                if n == 0 {
                    break;
                }
                let chunk = source.slice(at as usize..(at + n) as usize);
                self.session.send_data(id, chunk).unwrap();
            }
            if self.session.is_sending(id) && self.session.sent(id) == len {
                self.session.finish(id).unwrap();
            }
        }
        let ids: Vec<StreamId> = self
            .landed
            .keys()
            .copied()
            .chain(self.sending.iter().map(|(id, _)| *id))
            .collect();
        for &id in self.landed.keys() {
            let _ = self.session.grant(id, &mut self.credit, no_path());
        }
        ids
    }

    /// Does the local work and hands every queued frame to `to`; whether any moved.
    fn flush_to(&mut self, to: &mut Peer) -> bool {
        let mut moved = false;
        for id in self.work() {
            while let Some(frame) = self.session.poll_frame(id) {
                to.deliver(id, frame);
                moved = true;
            }
        }
        moved
    }

    /// A frame from the peer on stream `id`, through the codec.
    fn deliver(&mut self, id: StreamId, frame: Frame) {
        let frame = Frame::decode_one(&frame.to_bytes());
        let first = matches!(frame, Frame::Early(_))
            || matches!(frame, Frame::Metadata(_)) && !self.landed.contains_key(&id);
        if first {
            self.session.open_stream(id, epoch()).unwrap();
            self.landed.insert(id, Vec::new());
        }
        if !self.landed.contains_key(&id) {
            // An answer on one of our own streams.
            if let OutgoingEvent::Complete(receipt) =
                self.session.handle_reply(id, frame, epoch()).unwrap()
            {
                self.receipts.push(receipt);
                assert_eq!(
                    self.session.close_outgoing(id, epoch()),
                    StreamClosed::Completed
                );
                self.completed.push(id);
            }
            return;
        }
        match self
            .session
            .handle_frame(id, frame, &mut self.credit, epoch())
            .unwrap()
        {
            IncomingEvent::Metadata(_) => self.session.accept(id, epoch()).unwrap(),
            IncomingEvent::Data(data) => {
                let n = data.payload.len() as u64;
                let mut bytes = vec![0; data.payload.len()];
                data.payload.copy_to_slice(&mut bytes);
                self.landed.get_mut(&id).unwrap().extend_from_slice(&bytes);
                self.credit.release(n).unwrap(); // durable at once
            }
            IncomingEvent::End => {
                let receipt = self.answer.clone();
                self.session.mark_resident(id, receipt).unwrap();
            }
            IncomingEvent::Early => {}
        }
    }
}

/// Spec §6.8, §3.1: COMPLETE carries the receiver's receipt on a connection of 1.5 or later,
/// and is empty before, whatever the application hands the session.
#[test]
fn complete_carries_a_receipt_only_from_version_1_5() {
    let answer = Receipt::new()
        .with(Receipt::DEVICE, "cuda:0")
        .with(Receipt::SHARED_ID, "4d2c1e2f-0b6a-4c47-9d1e-3a5f7c9b2e10")
        .with(Receipt::SHARED_GENERATION, "3")
        .with("model.revision", "abc123");
    for (version, expected) in [
        (None, Receipt::new()),
        (Some(Version::V1_0), Receipt::new()),
        (Some(Version::V1_4), Receipt::new()),
        (Some(Version::V1_5), answer.clone()),
        (Some(Version::CURRENT), answer.clone()),
    ] {
        let config = SessionConfig::default();
        let mut sender = Peer::new(&config);
        let mut receiver = Peer::new(&config);
        receiver.answer = answer.clone();
        if let Some(version) = version {
            sender.session.set_version(version);
            receiver.session.set_version(version);
        }
        sender.send(0, "weights", pattern(10_000, 1).into());
        for _ in 0..100 {
            if !(sender.flush_to(&mut receiver) | receiver.flush_to(&mut sender)) {
                break;
            }
        }
        assert_eq!(sender.completed, [0], "{version:?}");
        assert_eq!(sender.receipts, [expected], "{version:?}");
        if let Some(receipt) = sender.receipts.first().filter(|r| !r.is_empty()) {
            assert_eq!(receipt.device(), Some("cuda:0"));
            assert_eq!(receipt.shared_generation(), Some(3));
            assert_eq!(receipt.get("model.revision"), Some("abc123"));
        }
    }
}

/// Spec §6.8: a receipt never outgrows COMPLETE's limit: an entry that would is left out,
/// and what is kept round-trips through the codec.
#[test]
fn a_receipt_keeps_to_its_limit() {
    let mut receipt = Receipt::new().with(Receipt::DEVICE, "host");
    let mut kept = 1;
    while receipt.push(format!("key-{kept}"), "v".repeat(500)) {
        kept += 1;
    }
    assert!(kept > 2, "several entries fit");
    assert!(
        !receipt.push("x".into(), "y".repeat(5000)),
        "one too large is refused"
    );
    let frame = Frame::Complete(tensorwire_proto::frame::Complete {
        receipt: receipt.clone(),
    });
    let bytes = frame.to_bytes();
    assert!(
        bytes.len() <= 5 + tensorwire_proto::MAX_RECEIPT_LEN,
        "{}",
        bytes.len()
    );
    assert_eq!(Frame::decode_one(&bytes), frame);
    assert_eq!(receipt.entries().len(), kept);
}

/// Spec §3: both ends send on one connection at once, each under the other's credit; one
/// session per end owns both directions, and all credit comes back.
#[test]
fn both_ends_send_on_one_connection_under_each_others_credit() {
    let mut config = SessionConfig::default();
    config.grant_unit = 64 << 10;
    config.stream_window = 128 << 10;
    config.connection_window = 192 << 10;
    let mut a = Peer::new(&config);
    let mut b = Peer::new(&config);
    // Like QUIC: the connecting side's streams are even, the accepting side's odd.
    a.send(0, "request-0", pattern(700_001, 1).into());
    a.send(4, "request-1", pattern(300_000, 2).into());
    b.send(1, "reply-0", pattern(500_000, 3).into());
    b.send(5, "reply-1", pattern(123, 4).into());
    let mut peak_window = 0;
    for _ in 0..10_000 {
        let moved = a.flush_to(&mut b) | b.flush_to(&mut a);
        peak_window = peak_window
            .max(a.session.outstanding_credit())
            .max(b.session.outstanding_credit());
        if !moved {
            break;
        }
    }
    for (peer, theirs) in [(&a, &b), (&b, &a)] {
        for (id, source) in &theirs.sending {
            assert!(peer.landed[id][..] == source[..], "stream {id} differs");
        }
        assert_eq!(peer.completed.len(), 2, "both sent tensors completed");
    }
    assert!(peak_window <= 192 << 10, "connection window {peak_window}");
    for peer in [&mut a, &mut b] {
        let ids: Vec<StreamId> = peer.landed.keys().copied().collect();
        for id in ids {
            assert_eq!(
                peer.session.close_stream(id, &mut peer.credit, epoch()),
                StreamClosed::Completed
            );
        }
        assert_eq!(peer.session.open_streams(), 0);
        assert_eq!(peer.credit.outstanding(), 0, "credit counted back");
    }
}

/// Spec §7.1: one connection's tensors together hold at most its window of unarrived
/// credit, whatever the tracker has left; arriving bytes reopen it.
#[test]
fn a_connection_holds_at_most_its_window_of_credit() {
    let mut config = SessionConfig::default();
    config.grant_unit = 1 << 20;
    config.stream_window = 1 << 20;
    config.connection_window = 2 << 20;
    let mut credit = CreditTracker::new(64 << 20, 64 << 20, 32 << 20).unwrap();
    let mut session = Session::new(config, epoch());
    let mut senders = Vec::new();
    for id in 0..4 {
        session.open_stream(id, epoch()).unwrap();
        let mut sender = TensorSender::new(meta("t", 4 << 20)).unwrap();
        let metadata = sender.poll_frame().unwrap();
        session
            .handle_frame(id, metadata, &mut credit, epoch())
            .unwrap();
        session.accept(id, epoch()).unwrap();
        while let Some(frame) = session.poll_frame(id) {
            sender.handle_frame(frame).unwrap();
        }
        senders.push(sender);
    }
    let grants: Vec<u64> = (0..4)
        .map(|id| session.grant(id, &mut credit, no_path()))
        .collect();
    assert_eq!(
        grants,
        [1 << 20, 1 << 20, 0, 0],
        "the window stops the rest"
    );
    assert!(session.wants_credit(2), "tensor 2 still waits for credit");
    assert_eq!(session.connection_window_left(), 0);
    assert_eq!(credit.in_flight(), 2 << 20);
    // Half a MiB arrives on stream 0: that much of the window reopens for the others.
    let sender = &mut senders[0];
    sender.handle_frame(session.poll_frame(0).unwrap()).unwrap();
    sender.send_data(Bytes::from(vec![7; 512 << 10])).unwrap();
    let data = sender.poll_frame().unwrap();
    assert!(matches!(
        session.handle_frame(0, data, &mut credit, epoch()).unwrap(),
        IncomingEvent::Data(_)
    ));
    assert_eq!(session.connection_window_left(), 512 << 10);
    assert_eq!(session.grant(2, &mut credit, no_path()), 512 << 10);
    for id in 0..4 {
        let _ = session.close_stream(id, &mut credit, epoch());
    }
    credit.release(512 << 10).unwrap();
    assert_eq!(credit.outstanding(), 0);
    assert_eq!(session.outstanding_credit(), 0);
}

/// Spec §7.6: with early credit offered, a small tensor goes as EARLY, METADATA, DATA and END
/// in one flight and is answered by ACCEPT and COMPLETE: one round trip. A tensor larger than
/// the allowance goes the usual way. All credit, early credit included, comes back.
#[test]
fn a_small_tensor_goes_in_one_round_trip_with_early_credit() {
    let mut config = SessionConfig::default();
    config.early_credit = 64 << 10;
    let mut sender = Peer::new(&config);
    let mut receiver = Peer::new(&config);
    assert_eq!(
        receiver.session.offer_early_credit(&mut receiver.credit),
        64 << 10
    );
    let control = receiver.session.poll_control_frame().unwrap();
    assert_eq!(
        control,
        Frame::EarlyCredit(tensorwire_proto::frame::EarlyCredit {
            bytes: 64 << 10,
            max_data_payload: config.limits.max_data_payload,
        })
    );
    sender
        .session
        .handle_control_frame(Frame::decode_one(&control.to_bytes()))
        .unwrap();
    assert_eq!(sender.session.early_allowance(), Some(64 << 10));

    sender.send(0, "small", pattern(4096, 1).into());
    sender.send(4, "large", pattern(100 << 10, 2).into());
    assert_eq!(sender.session.early_allowance(), Some(60 << 10));
    // One flight from the sender: the small tensor is whole at the receiver, the large one
    // only announced.
    sender.flush_to(&mut receiver);
    assert_eq!(receiver.landed[&0][..], pattern(4096, 1)[..]);
    assert!(receiver.landed[&4].is_empty());
    let replies: Vec<Frame> = std::iter::from_fn(|| receiver.session.poll_frame(0)).collect();
    assert!(
        matches!(replies[..], [Frame::Accept(_), Frame::Complete(_)]),
        "{replies:?}"
    );
    for frame in replies {
        sender.deliver(0, frame);
    }
    assert_eq!(sender.completed, [0], "complete after one round trip");
    for _ in 0..100 {
        if !(sender.flush_to(&mut receiver) | receiver.flush_to(&mut sender)) {
            break;
        }
    }
    assert_eq!(sender.completed, [0, 4]);
    assert_eq!(receiver.landed[&4][..], pattern(100 << 10, 2)[..]);
    for id in [0, 4] {
        assert_eq!(
            receiver
                .session
                .close_stream(id, &mut receiver.credit, epoch()),
            StreamClosed::Completed
        );
    }
    assert_eq!(
        receiver.credit.outstanding(),
        receiver.session.early_credit_offered(),
        "only the standing offer is outstanding"
    );
    receiver.session.withdraw_early_credit(&mut receiver.credit);
    assert_eq!(receiver.credit.outstanding(), 0, "credit counted back");
}

/// Spec §7.6: a REJECT discards the early bytes (they return to the budget); the allowance
/// is spent all the same, and the offer is topped up once half of it was used.
#[test]
fn a_rejected_early_tensor_returns_its_bytes_and_the_offer_is_topped_up() {
    let mut config = SessionConfig::default();
    config.early_credit = 64 << 10;
    let mut credit = CreditTracker::new(1 << 20, 1 << 20, 1 << 19).unwrap();
    let mut session = Session::new(config, epoch());
    assert_eq!(session.offer_early_credit(&mut credit), 64 << 10);
    assert!(session.poll_control_frame().is_some());
    let mut sender = TensorSender::new(meta("t", 40 << 10)).unwrap();
    sender.send_early(16 << 10).unwrap();
    sender.send_data(pattern(16 << 10, 3).into()).unwrap();
    session.open_stream(0, epoch()).unwrap();
    let mut held = 0;
    while let Some(frame) = sender.poll_frame() {
        if let IncomingEvent::Data(d) = session
            .handle_frame(0, frame, &mut credit, epoch())
            .unwrap()
        {
            held += d.payload.len() as u64;
        }
    }
    assert_eq!(held, 16 << 10);
    assert_eq!(session.early_credit_offered(), 24 << 10, "40 KiB claimed");
    session
        .reject(0, ErrorCode::REJECTED, "not this one")
        .unwrap();
    assert!(matches!(session.poll_frame(0), Some(Frame::Reject(_))));
    credit.release(held).unwrap(); // the driver drops what it held
    assert_eq!(
        session.close_stream(0, &mut credit, epoch()),
        StreamClosed::Failed
    );
    // 40 of 64 KiB used: more than half, so the offer is topped up to 64 KiB again.
    assert_eq!(session.early_credit_offered(), 64 << 10);
    let top_up = session.poll_control_frame();
    assert!(
        matches!(top_up, Some(Frame::EarlyCredit(c)) if c.bytes == 40 << 10),
        "{top_up:?}"
    );
    assert_eq!(credit.outstanding(), 64 << 10);
    session.withdraw_early_credit(&mut credit);
    assert_eq!(credit.outstanding(), 0);
}

/// Spec §7.6: early credit is offered only up to the low watermark, so offers peers leave
/// unused never keep granting paused; a tensor sent early past the offer is refused.
#[test]
fn early_credit_stays_under_the_low_watermark_and_bounds_early_tensors() {
    let mut config = SessionConfig::default();
    config.early_credit = 1 << 20;
    let mut credit = CreditTracker::new(4 << 20, 2 << 20, 512 << 10).unwrap();
    let mut session = Session::new(config.clone(), epoch());
    assert_eq!(session.offer_early_credit(&mut credit), 512 << 10);
    let mut other = Session::new(config, epoch());
    assert_eq!(
        other.offer_early_credit(&mut credit),
        0,
        "at the low watermark"
    );
    assert!(!credit.should_pause());

    let mut sender = TensorSender::new(meta("big", 600 << 10)).unwrap();
    sender.send_early(1 << 20).unwrap();
    session.open_stream(0, epoch()).unwrap();
    let early = sender.poll_frame().unwrap();
    assert!(matches!(
        session.handle_frame(0, early, &mut credit, epoch()),
        Ok(IncomingEvent::Early)
    ));
    let err = session
        .handle_frame(0, sender.poll_frame().unwrap(), &mut credit, epoch())
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::CREDIT_VIOLATION);
    assert!(matches!(session.poll_frame(0), Some(Frame::Reject(_))));
    assert_eq!(
        session.close_stream(0, &mut credit, epoch()),
        StreamClosed::Failed
    );
    session.withdraw_early_credit(&mut credit);
    assert_eq!(credit.outstanding(), 0);
}

/// Spec §4.1: the control stream carries EARLY_CREDIT only, with a non-zero payload limit.
#[test]
fn the_control_stream_takes_only_valid_early_credit() {
    let mut session = Session::new(SessionConfig::default(), epoch());
    assert_eq!(session.early_allowance(), None);
    let credit = Frame::Credit(tensorwire_proto::frame::Credit { bytes: 1 });
    assert_eq!(
        session.handle_control_frame(credit).unwrap_err().code(),
        ErrorCode::UNEXPECTED_FRAME
    );
    let zero = tensorwire_proto::frame::EarlyCredit {
        bytes: 1,
        max_data_payload: 0,
    };
    assert_eq!(
        session
            .handle_control_frame(zero.into())
            .unwrap_err()
            .code(),
        ErrorCode::CHUNK_SIZE
    );
    assert_eq!(session.early_allowance(), None);
}

/// Bytes per GiB and MiB, for rates.
const GIB: f64 = (1u64 << 30) as f64;
const MIB: f64 = (1u64 << 20) as f64;
/// Bytes per MiB, for tensor lengths and credit.
const MIB_BYTES: u64 = 1 << 20;

/// A path for the window tests: one-way delay, the link's rate and the receiver's (how fast
/// its sink takes bytes), in seconds and bytes per second.
struct SimulatedPath {
    one_way_s: f64,
    link_rate: f64,
    receiver_rate: f64,
    /// The round trip the receiver's QUIC stack reports once the tensor moves, where the
    /// flow's own queues lengthen it (the path's own before).
    rtt_under_load_s: Option<f64>,
    /// How often the receiver gets to run, if not always: it then takes every byte that
    /// arrived meanwhile at once, a burst (a thread descheduled, a busy event loop).
    wakes_every_s: Option<f64>,
}

impl SimulatedPath {
    /// A path with `one_way_s` of delay, a 1 GiB/s link and a receiver ten times as fast,
    /// its QUIC stack reporting the path's round trip, always running.
    fn new(one_way_s: f64) -> Self {
        Self {
            one_way_s,
            link_rate: GIB,
            receiver_rate: 10.0 * GIB,
            rtt_under_load_s: None,
            wakes_every_s: None,
        }
    }
}

/// Sends one 64 MiB tensor over `path` in simulated time: the sender sends 256 KiB DATA as
/// soon as it has credit, the receiver grants 1 MiB units from a 2 MiB window that may grow
/// to `max_stream_window`, with the path's round trip as the connection's RTT. Returns the
/// seconds until the last byte was taken and the largest window the tensor had.
fn send_over(path: &SimulatedPath, max_stream_window: u64) -> (f64, u64) {
    let (mut session, mut credit) = window_session(max_stream_window);
    send_one_over(path, &mut session, &mut credit, 7)
}

/// A session granting 1 MiB units from 2 MiB windows growing to `max_stream_window`, and
/// a tracker that never pauses it.
fn window_session(max_stream_window: u64) -> (Session, CreditTracker) {
    let mut config = SessionConfig::default();
    config.grant_unit = 1 << 20;
    config.stream_window = 2 << 20;
    config.max_stream_window = max_stream_window;
    let credit = CreditTracker::new(1 << 30, 1 << 30, 1 << 29).unwrap();
    (Session::new(config, epoch()), credit)
}

/// As [`send_over`], on stream `id` of `session`, starting at simulated time 0.
fn send_one_over(
    path: &SimulatedPath,
    session: &mut Session,
    credit: &mut CreditTracker,
    id: StreamId,
) -> (f64, u64) {
    const LEN: u64 = 64 << 20;
    const CHUNK: u64 = 256 << 10;
    let start = epoch();
    session.open_stream(id, epoch()).unwrap();
    session
        .handle_frame(id, meta("t", LEN as usize).into(), credit, epoch())
        .unwrap();
    session.accept(id, epoch()).unwrap();
    let path_rtt = Duration::from_secs_f64(2.0 * path.one_way_s);
    let loaded_rtt = path
        .rtt_under_load_s
        .map_or(path_rtt, Duration::from_secs_f64);
    // Both directions are FIFO with a fixed delay, so each is a queue in time order: CREDIT
    // reaching the sender, and DATA taken by the receiver (its arrival, then its turn).
    let mut credits: VecDeque<(f64, u64)> = VecDeque::new();
    let mut data: VecDeque<(f64, u64)> = VecDeque::new();
    let grant = |session: &mut Session,
                 credit: &mut CreditTracker,
                 t: f64,
                 to: &mut VecDeque<(f64, u64)>| {
        let now = start + Duration::from_secs_f64(t);
        let rtt = if t == 0.0 { path_rtt } else { loaded_rtt };
        while session.grant(id, credit, GrantClock { now, rtt }) > 0 {}
        while let Some(frame) = session.poll_frame(id) {
            if let Frame::Credit(c) = frame {
                to.push_back((t + path.one_way_s, c.bytes));
            }
        }
    };
    grant(session, credit, 0.0, &mut credits);
    let (mut allowance, mut sent, mut offset) = (0u64, 0u64, 0u64);
    let (mut link_free, mut receiver_free) = (0.0f64, 0.0f64);
    let mut largest_window = session.stream_window(id).unwrap();
    loop {
        let credit_first = match (credits.front(), data.front()) {
            (Some(c), Some(d)) => c.0 <= d.0,
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (None, None) => panic!("nothing in flight with {sent} of {LEN} bytes sent"),
        };
        if credit_first {
            let (t, bytes) = credits.pop_front().unwrap();
            allowance += bytes;
            while allowance > 0 && sent < LEN {
                let n = CHUNK.min(allowance).min(LEN - sent);
                link_free = link_free.max(t) + n as f64 / path.link_rate;
                let arrives = link_free + path.one_way_s;
                // A busy receiver takes the next DATA at once; an idle one at its next turn.
                let turn = match path.wakes_every_s {
                    Some(period) if arrives > receiver_free => (arrives / period).ceil() * period,
                    _ => receiver_free.max(arrives),
                };
                receiver_free = turn + n as f64 / path.receiver_rate;
                data.push_back((receiver_free, n));
                allowance -= n;
                sent += n;
            }
        } else {
            let (t, n) = data.pop_front().unwrap();
            data_arrives_on(id, session, credit, &mut offset, n as usize);
            // The sink took the bytes: durable at once.
            let _ = credit.release(n).unwrap();
            if offset == LEN {
                let _ = session.close_stream(id, credit, start + Duration::from_secs_f64(t));
                return (t, largest_window);
            }
            grant(session, credit, t, &mut credits);
            largest_window = largest_window.max(session.stream_window(id).unwrap());
        }
    }
}

/// Spec §7.1: on a long path a fixed window, not the link, sets a tensor's rate (a window
/// per round trip). The window doubles while bytes arrive faster than it lets them over two
/// round trips, up to `max_stream_window`, and the tensor then fills the link.
#[test]
fn a_window_grows_on_a_long_path_up_to_its_maximum() {
    let long = SimulatedPath::new(0.005);
    let (fixed_s, fixed_window) = send_over(&long, 2 << 20);
    assert_eq!(
        fixed_window,
        2 << 20,
        "a maximum at the initial size keeps it fixed"
    );
    // A window of 2 MiB per 10 ms round trip: 200 MiB/s, about 0.32 s for 64 MiB.
    assert!(fixed_s > 0.3, "fixed window took {fixed_s} s");
    let (grown_s, grown_window) = send_over(&long, 16 << 20);
    assert_eq!(
        grown_window,
        16 << 20,
        "grown to its maximum and no further"
    );
    // The link's rate (1 GiB/s) and a few round trips of growth: about a third of fixed.
    assert!(
        grown_s < fixed_s / 2.5,
        "grown window took {grown_s} s, fixed {fixed_s} s"
    );
}

/// Windows stay at their initial size where the window does not set the rate: a short
/// path, where a window's bytes take longer than two round trips at the link's rate, and a
/// receiver slower than the window allows (its sink, not credit, holds the sender back).
#[test]
fn a_window_stays_where_the_path_or_the_receiver_sets_the_rate() {
    let short = SimulatedPath::new(10e-6);
    assert_eq!(send_over(&short, 16 << 20).1, 2 << 20);
    let slow_receiver = SimulatedPath {
        receiver_rate: 50.0 * MIB,
        ..SimulatedPath::new(0.005)
    };
    assert_eq!(send_over(&slow_receiver, 16 << 20).1, 2 << 20);
}

/// A smoothed RTT lengthened by the queues the tensor builds (loopback under load reports
/// milliseconds) is not the path's: windows are judged by the smallest round trip seen.
#[test]
fn queues_the_flow_builds_do_not_grow_its_window() {
    let queued = SimulatedPath {
        rtt_under_load_s: Some(0.005),
        ..SimulatedPath::new(10e-6)
    };
    assert_eq!(send_over(&queued, 16 << 20).1, 2 << 20);
}

/// A receiver that runs in turns (every 3 ms here) takes a grant's bytes in a burst far
/// above any rate the path carries. Judged over a whole window, the rate is what the
/// receiver takes on average: its turns, not the 0.7 ms path, set the pace, and the window
/// stays. Judged per grant, it would grow to its maximum.
#[test]
fn bursts_of_a_receiver_that_runs_in_turns_do_not_grow_its_window() {
    let bursty = SimulatedPath {
        receiver_rate: 16.0 * GIB,
        wakes_every_s: Some(0.003),
        ..SimulatedPath::new(350e-6)
    };
    assert_eq!(send_over(&bursty, 16 << 20).1, 2 << 20);
}

/// The path is the connection's: a window grown by one tensor is where the peer's next
/// tensor on that connection starts, and a new connection starts afresh.
#[test]
fn the_next_tensor_starts_at_the_window_its_connection_grew_to() {
    let long = SimulatedPath::new(0.005);
    let (mut session, mut credit) = window_session(16 << 20);
    let (first_s, _) = send_one_over(&long, &mut session, &mut credit, 7);
    session.open_stream(9, epoch()).unwrap();
    assert_eq!(session.stream_window(9), Some(16 << 20));
    let _ = session.close_stream(9, &mut credit, epoch());
    let (second_s, _) = send_one_over(&long, &mut session, &mut credit, 11);
    assert!(second_s < first_s, "second {second_s} s, first {first_s} s");
    assert_eq!(credit.outstanding(), 0, "every credit back");
    let (mut fresh, _) = window_session(16 << 20);
    fresh.open_stream(7, epoch()).unwrap();
    assert_eq!(fresh.stream_window(7), Some(2 << 20));
}

/// A grant with no round trip measured (a receiver fed from memory) keeps the window, and
/// a window only ever belongs to the peer's tensors.
#[test]
fn a_window_needs_a_round_trip_to_grow() {
    let mut credit = CreditTracker::new(1 << 30, 1 << 30, 1 << 29).unwrap();
    let mut config = SessionConfig::default();
    config.grant_unit = 1 << 20;
    config.stream_window = 2 << 20;
    config.max_stream_window = 64 << 20;
    let start = epoch();
    let mut session = Session::new(config, start);
    session.open_stream(7, epoch()).unwrap();
    assert_eq!(session.stream_window(7), Some(2 << 20));
    assert_eq!(session.stream_window(8), None, "no such stream");
    session
        .handle_frame(7, meta("t", 64 << 20).into(), &mut credit, epoch())
        .unwrap();
    session.accept(7, epoch()).unwrap();
    let mut offset = 0;
    for step in 0..32u32 {
        // A unit arrives in a nanosecond: as fast as can be, but no round trip to judge by.
        let now = start + Duration::from_nanos(u64::from(step));
        while session.grant(7, &mut credit, GrantClock::without_path(now)) > 0 {}
        data_arrives(&mut session, &mut credit, &mut offset, 1 << 20);
    }
    assert_eq!(session.stream_window(7), Some(2 << 20));
}

/// Spec §7.4: large tensors take the connection's turn first come, first served; a place
/// given up while waiting is skipped, and only the holder's leaving passes the turn on.
#[test]
fn tensors_take_the_turn_in_the_order_they_asked() {
    let mut session = Session::new(SessionConfig::default(), epoch());
    let (a, b, c) = (
        session.queue_for_turn(),
        session.queue_for_turn(),
        session.queue_for_turn(),
    );
    assert!(session.has_turn(a) && !session.has_turn(b) && !session.has_turn(c));
    assert!(!session.leave_turn(b), "a waiter leaving passes nothing");
    assert!(!session.has_turn(c));
    assert!(session.leave_turn(a), "the holder leaving passes the turn");
    assert!(session.has_turn(c));
    assert!(!session.leave_turn(a), "a place is given up once");
    assert!(!session.leave_turn(c), "nobody waits for it");
    assert_eq!(session.queued_for_turn(), 0);
    let d = session.queue_for_turn();
    assert!(session.has_turn(d), "a free turn is taken at once");
}

/// How long the tests' peers may owe an answer to a tensor we send.
const REPLY_TIMEOUT: Duration = Duration::from_secs(60);

/// A session sending one tensor of `len` bytes on stream 0, accepted, no credit yet.
fn sending_session(len: u64) -> Session {
    let mut session = Session::new(SessionConfig::default(), epoch());
    let sender = TensorSender::new(meta("t", len as usize)).unwrap();
    session
        .start_sending(0, sender, epoch(), REPLY_TIMEOUT)
        .unwrap();
    let accept = tensorwire_proto::frame::Accept {
        max_data_payload: 1 << 20,
    };
    session.handle_reply(0, accept.into(), epoch()).unwrap();
    session
}

/// The receiver grants `bytes` more on stream 0.
fn credit_arrives(session: &mut Session, bytes: u64) {
    let credit = tensorwire_proto::frame::Credit { bytes };
    session.handle_reply(0, credit.into(), epoch()).unwrap();
}

/// Sends every byte credit allows on stream 0.
fn send_all_allowed(session: &mut Session) {
    loop {
        let n = session.next_chunk_len(0);
        if n == 0 {
            return;
        }
        session.send_data(0, pattern(n as usize, 1).into()).unwrap();
    }
}

/// A 64 MiB tensor whose credit arrives at 500 MiB/s (1 MiB every 2 ms after an initial
/// 8 MiB), its bytes sent as it comes: after each MiB granted, the MiB it has left and
/// whether the session said its turn was done. The connection reported `first_rtt` at the
/// first grant, `rtt` at the others.
fn turn_as_credit_comes(first_rtt: Duration, rtt: Duration) -> Vec<(u64, bool)> {
    let start = epoch();
    let mut session = sending_session(64 * MIB_BYTES);
    credit_arrives(&mut session, 8 * MIB_BYTES);
    assert!(
        !session.turn_done(0, start, first_rtt),
        "no rate measured yet"
    );
    send_all_allowed(&mut session);
    (9..=64)
        .map(|granted| {
            let now = start + Duration::from_millis(2 * (granted - 8));
            credit_arrives(&mut session, MIB_BYTES);
            send_all_allowed(&mut session);
            (64 - granted, session.turn_done(0, now, rtt))
        })
        .collect()
}

/// Spec §7.4: on a 20 ms path, the turn ends once what is left would leave within two
/// round trips at the rate credit comes, 20 MiB, and not a MiB before: the next tensor's
/// admission round trip overlaps those bytes.
#[test]
fn on_a_long_path_the_turn_passes_two_round_trips_before_the_last_byte() {
    let rtt = Duration::from_millis(20);
    for (left, done) in turn_as_credit_comes(rtt, rtt) {
        assert_eq!(done, left <= 20, "{left} MiB left");
    }
}

/// Spec §7.4: with no round trip measured, a tensor keeps the turn until it has sent every
/// byte, however fast credit comes, even once its credit covers them all.
#[test]
fn without_a_round_trip_the_turn_passes_once_every_byte_is_sent() {
    let start = epoch();
    let mut session = sending_session(16 * MIB_BYTES);
    credit_arrives(&mut session, 4 * MIB_BYTES);
    for granted in 5..=15 {
        credit_arrives(&mut session, MIB_BYTES);
        send_all_allowed(&mut session);
        let now = start + Duration::from_millis(granted);
        assert!(!session.turn_done(0, now, Duration::ZERO), "{granted} MiB");
    }
    credit_arrives(&mut session, MIB_BYTES);
    assert!(
        !session.turn_done(0, start, Duration::ZERO),
        "all granted, 1 MiB unsent"
    );
    send_all_allowed(&mut session);
    assert_eq!(session.sent(0), 16 * MIB_BYTES);
    assert!(session.turn_done(0, start, Duration::ZERO));
}

/// A receiver's first grants come together (ACCEPT's window in units): a rate over less
/// than a round trip would be a burst's, and would end the turn at once.
#[test]
fn the_first_grants_together_do_not_end_the_turn() {
    let start = epoch();
    let rtt = Duration::from_millis(20);
    let mut session = sending_session(64 * MIB_BYTES);
    credit_arrives(&mut session, 4 * MIB_BYTES);
    assert!(!session.turn_done(0, start, rtt));
    credit_arrives(&mut session, 4 * MIB_BYTES);
    send_all_allowed(&mut session);
    let soon = start + Duration::from_micros(30);
    assert!(!session.turn_done(0, soon, rtt), "4 MiB in 30 µs");
    // Not ours: no turn to hold.
    assert!(session.turn_done(2, soon, rtt));
}

/// A smoothed RTT lengthened by the queues a loaded connection builds (loopback under load
/// reports milliseconds) is not the path's: turns are judged by the smallest round trip
/// given, here 1 ms, so the tensor keeps its turn until 1 MiB is left, not 20.
#[test]
fn queues_on_the_connection_do_not_pass_the_turn_early() {
    let turns = turn_as_credit_comes(Duration::from_millis(1), Duration::from_millis(20));
    for (left, done) in turns {
        assert_eq!(done, left <= 1, "{left} MiB left");
    }
}

/// A session whose timeouts are `progress` and `admission`, its tracker, and stream 7 opened
/// at `start`.
fn timed_session(
    start: Instant,
    progress: Duration,
    admission: Duration,
) -> (Session, CreditTracker) {
    let mut config = SessionConfig::default();
    config.progress_timeout = progress;
    config.admission_timeout = admission;
    config.grant_unit = 1 << 20;
    config.stream_window = 1 << 20;
    let credit = CreditTracker::new(1 << 20, 1 << 20, 1 << 19).unwrap();
    let mut session = Session::new(config, start);
    session.open_stream(7, start).unwrap();
    (session, credit)
}

/// Spec §10.1: the peer owes METADATA from the stream's start; silence for the progress
/// timeout ends the stream with PROGRESS_TIMEOUT and queues the REJECT that says so; a frame
/// restarts the clock.
#[test]
fn a_peer_that_owes_a_frame_has_the_progress_timeout_to_send_it() {
    let start = epoch();
    let progress = Duration::from_secs(30);
    let (mut session, mut credit) = timed_session(start, progress, Duration::from_secs(5));
    assert_eq!(session.stream_deadline(7), Some(start + progress));
    assert_eq!(session.poll_timeout(), Some(start + progress));
    assert!(
        session
            .handle_stream_timeout(7, start + progress / 2)
            .is_none()
    );

    // METADATA: now the application owes its decision, within the admission timeout.
    let arrived = start + progress / 2;
    session
        .handle_frame(7, meta("t", 3 << 20).into(), &mut credit, arrived)
        .unwrap();
    // The decision is due after the admission timeout; the stream is refused a grace later,
    // so that the application's own refusal at the deadline reaches the peer.
    assert_eq!(
        session.decision_due(7),
        Some(arrived + Duration::from_secs(5))
    );
    let admission_ends = arrived + Duration::from_secs(5) + DECISION_GRACE;
    assert_eq!(session.stream_deadline(7), Some(admission_ends));
    assert!(
        session
            .handle_stream_timeout(7, admission_ends - Duration::from_millis(1))
            .is_none()
    );
    let err = session
        .handle_stream_timeout(7, admission_ends)
        .expect("the decision is late");
    assert_eq!(err.code(), ErrorCode::PROGRESS_TIMEOUT);
    assert!(err.to_string().contains("decision"), "{err}");
    match session.poll_frame(7) {
        Some(Frame::Reject(reject)) => assert_eq!(reject.code, ErrorCode::PROGRESS_TIMEOUT),
        other => panic!("expected REJECT, got {other:?}"),
    }
    assert_eq!(
        session.stream_deadline(7),
        None,
        "an ended stream waits for nobody"
    );
}

/// Spec §10.1: after ACCEPT the peer is timed only while it holds credit (or owes END); while
/// the stream waits for this receiver's credit nobody is timed, and a grant restarts the
/// peer's clock.
#[test]
fn an_accepted_stream_times_the_peer_only_while_it_holds_credit() {
    let start = epoch();
    let progress = Duration::from_secs(30);
    let (mut session, mut credit) = timed_session(start, progress, Duration::from_secs(30));
    session
        .handle_frame(7, meta("t", 2 << 20).into(), &mut credit, start)
        .unwrap();
    let accepted = start + Duration::from_secs(10);
    session.accept(7, accepted).unwrap();
    // Accepted, no credit yet: the peer owes nothing, and no decision is due.
    assert_eq!(session.stream_deadline(7), None);
    assert_eq!(session.decision_due(7), None);
    assert!(
        session
            .handle_stream_timeout(7, accepted + 10 * progress)
            .is_none()
    );

    // A grant much later: the peer has the progress timeout from then.
    let granted_at = accepted + 10 * progress;
    let granted = session.grant(7, &mut credit, GrantClock::without_path(granted_at));
    assert_eq!(granted, 1 << 20);
    assert_eq!(session.stream_deadline(7), Some(granted_at + progress));

    // Every granted byte arrives: the tracker has no more to give (it pauses at its high
    // watermark), so the stream waits for us, untimed.
    let mut offset = 0;
    let data = tensorwire_proto::frame::Data {
        offset,
        payload: Bytes::from(vec![7u8; 1 << 20]).into(),
    };
    offset += 1 << 20;
    let arrived = granted_at + Duration::from_secs(1);
    session
        .handle_frame(7, Frame::Data(data), &mut credit, arrived)
        .unwrap();
    assert_eq!(
        session.grant(7, &mut credit, GrantClock::without_path(arrived)),
        0
    );
    assert_eq!(session.stream_deadline(7), None);

    // Released and granted again; then silence past the timeout ends it with a CANCEL.
    credit.release(1 << 20).unwrap();
    let regranted = arrived + Duration::from_secs(100);
    assert!(session.grant(7, &mut credit, GrantClock::without_path(regranted)) > 0);
    assert_eq!(session.stream_deadline(7), Some(regranted + progress));
    let err = session
        .handle_stream_timeout(7, regranted + progress)
        .expect("the peer is late");
    assert_eq!(err.code(), ErrorCode::PROGRESS_TIMEOUT);
    assert!(err.to_string().contains("frame from the peer"), "{err}");
    // After the ACCEPT and CREDIT queued before it.
    let last = std::iter::from_fn(|| session.poll_frame(7)).last();
    match last {
        Some(Frame::Cancel(cancel)) => assert_eq!(cancel.code, ErrorCode::PROGRESS_TIMEOUT),
        other => panic!("expected CANCEL last, got {other:?}"),
    }
    assert_eq!(offset, 1 << 20);
}

/// Spec §10.1: a tensor we send times the peer only while it owes an answer (ACCEPT, CREDIT
/// once ours is spent, COMPLETE); its answers and our bytes moving restart the clock.
#[test]
fn a_tensor_we_send_times_the_peer_only_while_it_owes_an_answer() {
    let start = epoch();
    let mut session = Session::new(SessionConfig::default(), start);
    let sender = TensorSender::new(meta("t", 2 << 20)).unwrap();
    session
        .start_sending(0, sender, start, REPLY_TIMEOUT)
        .unwrap();
    // METADATA queued: the peer owes ACCEPT or REJECT.
    assert_eq!(session.stream_deadline(0), Some(start + REPLY_TIMEOUT));
    assert_eq!(session.poll_timeout(), Some(start + REPLY_TIMEOUT));

    // Accepted with no credit: it owes CREDIT, from the ACCEPT on.
    let accepted = start + Duration::from_secs(10);
    let accept = tensorwire_proto::frame::Accept {
        max_data_payload: 1 << 20,
    };
    session.handle_reply(0, accept.into(), accepted).unwrap();
    assert_eq!(session.stream_deadline(0), Some(accepted + REPLY_TIMEOUT));

    // Credit to spend: we owe bytes, and nobody is timed however long we take.
    let granted = accepted + Duration::from_secs(1);
    let credit = tensorwire_proto::frame::Credit { bytes: 1 << 20 };
    session.handle_reply(0, credit.into(), granted).unwrap();
    assert_eq!(session.stream_deadline(0), None);
    assert!(
        session
            .handle_stream_timeout(0, granted + 10 * REPLY_TIMEOUT)
            .is_none()
    );

    // Spent: it owes CREDIT again, and our bytes still crossing the path restart its clock.
    send_all_allowed(&mut session);
    let moved = granted + Duration::from_secs(100);
    session.data_moved(0, moved);
    session.data_moved(0, granted); // An older report does not turn the clock back.
    assert_eq!(session.stream_deadline(0), Some(moved + REPLY_TIMEOUT));
    assert!(
        session
            .handle_stream_timeout(0, moved + REPLY_TIMEOUT - Duration::from_millis(1))
            .is_none()
    );
    let err = session
        .handle_stream_timeout(0, moved + REPLY_TIMEOUT)
        .expect("the peer is late");
    assert_eq!(err.code(), ErrorCode::PROGRESS_TIMEOUT);
    assert!(err.to_string().contains("answer from the peer"), "{err}");
    let last = std::iter::from_fn(|| session.poll_frame(0)).last();
    match last {
        Some(Frame::Cancel(cancel)) => assert_eq!(cancel.code, ErrorCode::PROGRESS_TIMEOUT),
        other => panic!("expected CANCEL last, got {other:?}"),
    }
    assert_eq!(
        session.stream_deadline(0),
        None,
        "an ended tensor waits for nobody"
    );
}

/// After END the peer owes COMPLETE, timed from our last byte moving.
#[test]
fn a_finished_tensor_waits_for_complete_within_the_reply_timeout() {
    let mut session = sending_session(1 << 20);
    credit_arrives(&mut session, 1 << 20);
    send_all_allowed(&mut session);
    session.finish(0).unwrap();
    let moved = epoch() + Duration::from_secs(5);
    session.data_moved(0, moved);
    assert_eq!(session.stream_deadline(0), Some(moved + REPLY_TIMEOUT));
    let complete = tensorwire_proto::frame::Complete::default();
    let done = moved + Duration::from_secs(1);
    assert!(matches!(
        session.handle_reply(0, complete.into(), done).unwrap(),
        OutgoingEvent::Complete(_)
    ));
    assert_eq!(session.stream_deadline(0), None);
}

/// The session's next deadline is the earliest of its streams' (and the idle timer's, while
/// no stream is open); a timeout of `Duration::MAX` never fires.
#[test]
fn poll_timeout_is_the_earliest_wait_and_forever_is_never() {
    let start = epoch();
    let (mut session, _credit) =
        timed_session(start, Duration::from_secs(30), Duration::from_secs(5));
    session
        .open_stream(9, start + Duration::from_secs(3))
        .unwrap();
    assert_eq!(
        session.poll_timeout(),
        Some(start + Duration::from_secs(30))
    );

    let (mut forever, _credit) = timed_session(start, Duration::MAX, Duration::MAX);
    forever.open_stream(9, start).unwrap();
    assert_eq!(forever.poll_timeout(), None);
    assert!(
        forever
            .handle_stream_timeout(7, start + Duration::from_secs(1 << 40))
            .is_none()
    );
}

/// Spec §10 (queue share): at most `max_undecided` of a connection's tensors wait for the
/// application at once; a decision or a closed stream makes room for the next.
#[test]
fn only_the_connections_share_of_tensors_waits_for_a_decision() {
    let start = epoch();
    let mut config = SessionConfig::default();
    config.max_undecided = 2;
    let mut credit = CreditTracker::new(1 << 20, 1 << 20, 1 << 19).unwrap();
    let mut session = Session::new(config, start);
    for id in [1, 2, 3, 4] {
        session.open_stream(id, start).unwrap();
        assert!(!session.offer(id), "no METADATA yet");
        session
            .handle_frame(id, meta("t", 10).into(), &mut credit, start)
            .unwrap();
    }
    assert!(session.offer(1));
    assert!(session.offer(2));
    assert!(session.offer(2), "asking again keeps its place");
    assert!(!session.offer(3));
    assert_eq!(session.undecided(), 2);
    session.accept(1, start).unwrap();
    assert!(session.offer(3));
    assert!(!session.offer(4));
    session.reject(2, ErrorCode::REJECTED, "no").unwrap();
    assert!(session.offer(4));
    assert!(!session.offer(1), "a decided tensor is not offered again");
    let _ = session.close_stream(3, &mut credit, start);
    assert_eq!(session.undecided(), 1);
}
