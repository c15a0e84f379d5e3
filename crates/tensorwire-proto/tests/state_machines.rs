//! The per-tensor state machines, driven through an in-memory pair: whole transfers, every
//! rule violation, cancel from each side in each state, and credit counted back.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use common::pair::Pair;
use common::vectors::pattern;
use tensorwire_proto::Receipt;
use tensorwire_proto::checksum::crc32c;
use tensorwire_proto::frame::{Accept, Credit, Data, End};
use tensorwire_proto::{
    Blame, CheckedFrame, CreditTracker, DType, ErrorCode, Frame, Limits, MAX_CHECKSUMS_OWED,
    ProtocolError, ReceiverEvent, ReceiverInput, ReceiverState, SenderInput, SenderState,
    TensorMeta, TensorReceiver, TensorSender,
};

fn meta(len: u64) -> TensorMeta {
    TensorMeta::new([len], DType::U8).unwrap().with_name("t")
}

/// A pair whose receiver takes DATA of at most 1000 bytes.
fn small_chunks(len: usize) -> Pair {
    let mut limits = Limits::default();
    limits.max_data_payload = 1000;
    let credit = CreditTracker::new(1 << 20, 1 << 20, 1 << 19).unwrap();
    Pair::with_limits(meta(len as u64), pattern(len, 5), limits, credit)
}

fn assert_credit_returned(pair: &mut Pair) {
    pair.close_out();
    assert_eq!(
        pair.credit.outstanding(),
        0,
        "every granted byte is counted back"
    );
}

fn code_of(result: &Result<(), ProtocolError>) -> ErrorCode {
    result.as_ref().expect_err("expected an error").code()
}

/// A pair that sent a `len`-byte tensor whole, both sides Complete.
fn completed(len: usize) -> Pair {
    let mut pair = small_chunks(len);
    let (sent, received) = pair.transfer();
    sent.unwrap();
    received.unwrap();
    assert_eq!(pair.receiver.state(), ReceiverState::Complete);
    assert_eq!(pair.sender.state(), SenderState::Complete);
    pair
}

#[test]
fn a_tensor_arrives_whole_and_completes() {
    let mut pair = completed(10_000);
    assert_eq!(pair.dest, pattern(10_000, 5));
    assert_credit_returned(&mut pair);
}

/// Spec §7.2: a CANCEL that crossed COMPLETE is the sender's cancel, and the tensor stays
/// complete; any other frame after COMPLETE breaks a rule.
#[test]
fn a_cancel_that_crossed_complete_is_the_senders_not_a_broken_rule() {
    let mut pair = completed(3000);
    let crossed = pair
        .receiver
        .handle_frame(Frame::Cancel(tensorwire_proto::frame::Cancel::new(
            ErrorCode::CANCELLED,
            "the user gave up",
        )));
    assert_eq!(
        crossed,
        Err(ProtocolError::Remote {
            code: ErrorCode::CANCELLED,
            reason: "the user gave up".into()
        })
    );
    assert_eq!(pair.receiver.state(), ReceiverState::Complete);
    let late = pair.receiver.handle_frame(Frame::End(End { checksum: 0 }));
    assert_eq!(
        late.map(drop).unwrap_err().code(),
        ErrorCode::UNEXPECTED_FRAME
    );
    assert_eq!(pair.receiver.state(), ReceiverState::Complete);
    assert_credit_returned(&mut pair);
}

#[test]
fn a_zero_byte_tensor_completes() {
    let mut pair = Pair::new(meta(0), Vec::new());
    let (sent, received) = pair.transfer();
    sent.unwrap();
    received.unwrap();
}

#[test]
fn small_grants_pace_the_sender() {
    let mut pair = small_chunks(10_000);
    pair.grant_step = 700;
    let (sent, received) = pair.transfer();
    sent.unwrap();
    received.unwrap();
    assert_eq!(pair.dest, pattern(10_000, 5));
}

#[test]
fn a_slow_sink_holds_at_most_the_budget() {
    let mut limits = Limits::default();
    limits.max_data_payload = 1000;
    let credit = CreditTracker::new(4000, 3000, 1000).unwrap();
    let mut pair = Pair::with_limits(meta(20_000), pattern(20_000, 1), limits, credit);
    pair.sink_is_instant = false;
    let mut max_held = 0;
    for _ in 0..1000 {
        pair.pump();
        max_held = max_held.max(pair.unreleased());
        assert!(pair.credit.outstanding() <= 4000);
        if pair.unreleased() >= 1000 {
            pair.release(1000); // the sink drains slowly
        }
        if pair.receiver.state() == ReceiverState::Complete {
            break;
        }
    }
    assert_eq!(pair.receiver.state(), ReceiverState::Complete);
    assert!(
        max_held <= 4000,
        "held {max_held} bytes with a 4000-byte budget"
    );
    assert_eq!(pair.dest, pattern(20_000, 1));
}

#[test]
fn data_in_reverse_order_reassembles() {
    let mut pair = small_chunks(10_000).altered(|frames| {
        let data: Vec<usize> = (0..frames.len())
            .filter(|&i| matches!(frames[i], Frame::Data(_)))
            .collect();
        for k in 0..data.len() / 2 {
            frames.swap(data[k], data[data.len() - 1 - k]);
        }
    });
    let (sent, received) = pair.transfer();
    sent.unwrap();
    received.unwrap();
    assert_eq!(pair.dest, pattern(10_000, 5));
}

#[test]
fn a_flipped_byte_fails_the_checksum_on_both_sides() {
    let mut pair = small_chunks(5000).altered(|frames| {
        for frame in frames.iter_mut() {
            if let Frame::Data(d) = frame
                && d.offset == 2000
            {
                let mut bytes = d.payload.to_bytes().to_vec();
                bytes[17] ^= 0x40;
                *d = Data::new(d.offset, bytes);
            }
        }
    });
    let (sent, received) = pair.transfer();
    assert_eq!(code_of(&received), ErrorCode::CHECKSUM_MISMATCH);
    assert_eq!(received.unwrap_err().blame(), Blame::PeerBrokeRule);
    let sent = sent.unwrap_err();
    assert!(
        matches!(
            sent,
            ProtocolError::Remote {
                code: ErrorCode::CHECKSUM_MISMATCH,
                ..
            }
        ),
        "{sent}"
    );
    assert_eq!(pair.receiver.state(), ReceiverState::Closed);
    assert_credit_returned(&mut pair);
}

#[test]
fn a_dropped_chunk_fails_end_with_gaps() {
    let mut pair = small_chunks(5000).altered(|frames| {
        frames.retain(|f| !matches!(f, Frame::Data(d) if d.offset == 3000));
    });
    let (sent, received) = pair.transfer();
    assert_eq!(code_of(&received), ErrorCode::END_WITH_GAPS);
    assert_eq!(code_of(&sent), ErrorCode::END_WITH_GAPS);
    assert_credit_returned(&mut pair);
}

#[test]
fn a_duplicated_chunk_fails_with_overlap() {
    let mut pair = small_chunks(5000).altered(|frames| {
        if let Some(i) = frames.iter().position(|f| matches!(f, Frame::Data(_))) {
            let copy = frames[i].clone();
            frames.insert(i + 1, copy);
        }
    });
    let (sent, received) = pair.transfer();
    assert_eq!(code_of(&received), ErrorCode::DATA_OVERLAP);
    assert_eq!(code_of(&sent), ErrorCode::DATA_OVERLAP);
    assert_credit_returned(&mut pair);
}

#[test]
fn a_sender_exceeding_its_credit_is_stopped() {
    let mut pair = small_chunks(5000).altered(|frames| {
        if frames
            .iter()
            .any(|f| matches!(f, Frame::Data(d) if d.offset == 0))
        {
            frames.push(Data::new(4000, vec![1; 1000]).into());
        }
    });
    pair.grant_step = 2000;
    let (sent, received) = pair.transfer();
    assert_eq!(code_of(&received), ErrorCode::CREDIT_VIOLATION);
    assert_eq!(code_of(&sent), ErrorCode::CREDIT_VIOLATION);
    assert_credit_returned(&mut pair);
}

#[test]
fn a_receiver_granting_past_the_end_is_a_violation() {
    let mut sender = TensorSender::new(meta(100)).unwrap();
    assert!(matches!(sender.poll_frame(), Some(Frame::Metadata(_))));
    sender
        .handle_frame(
            Accept {
                max_data_payload: 64,
            }
            .into(),
        )
        .unwrap();
    sender.handle_frame(Credit { bytes: 60 }.into()).unwrap();
    let err = sender
        .handle_frame(Credit { bytes: 41 }.into())
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::CREDIT_VIOLATION);
    assert!(
        matches!(sender.poll_frame(), Some(Frame::Cancel(c)) if c.code == ErrorCode::CREDIT_VIOLATION)
    );
    assert_eq!(sender.state(), SenderState::Closed);
    let overflow = TensorSender::new(meta(100))
        .unwrap()
        .handle_frame(Credit { bytes: u64::MAX }.into());
    assert_eq!(
        overflow.unwrap_err().code(),
        ErrorCode::UNEXPECTED_FRAME,
        "CREDIT before ACCEPT"
    );
}

#[test]
fn accept_with_a_zero_payload_limit_is_refused() {
    let mut sender = TensorSender::new(meta(100)).unwrap();
    let err = sender
        .handle_frame(
            Accept {
                max_data_payload: 0,
            }
            .into(),
        )
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::CHUNK_SIZE);
}

#[test]
fn the_sender_cancels_before_accept_and_while_sending() {
    for (rounds, expected) in [
        (0, SenderState::AwaitingDecision),
        (1, SenderState::Sending),
    ] {
        let mut pair = small_chunks(5000);
        pair.grant_step = 1000;
        for _ in 0..rounds {
            pair.pump();
        }
        assert_eq!(pair.sender.state(), expected);
        pair.cancel_sender();
        let (_, received) = pair.transfer();
        let err = received.unwrap_err();
        assert!(
            matches!(
                err,
                ProtocolError::Remote {
                    code: ErrorCode::CANCELLED,
                    ..
                }
            ),
            "{expected:?}: {err}"
        );
        assert_eq!(err.blame(), Blame::Application);
        assert_eq!(pair.receiver.state(), ReceiverState::Closed, "{expected:?}");
        assert_credit_returned(&mut pair);
    }
}

#[test]
fn the_sender_cancels_while_awaiting_complete() {
    let mut sender = TensorSender::new(meta(4)).unwrap();
    sender
        .handle_frame(
            Accept {
                max_data_payload: 4,
            }
            .into(),
        )
        .unwrap();
    sender.handle_frame(Credit { bytes: 4 }.into()).unwrap();
    sender.send_data(vec![9; 4].into()).unwrap();
    sender.finish().unwrap();
    assert_eq!(sender.state(), SenderState::AwaitingComplete);
    sender
        .cancel(ErrorCode::PROGRESS_TIMEOUT, "no COMPLETE in 30 s")
        .unwrap();
    let last = std::iter::from_fn(|| sender.poll_frame()).last();
    assert!(matches!(last, Some(Frame::Cancel(c)) if c.code == ErrorCode::PROGRESS_TIMEOUT));
    let late = sender
        .handle_frame(tensorwire_proto::frame::Complete::default().into())
        .unwrap_err();
    assert_eq!(
        late.code(),
        ErrorCode::PROGRESS_TIMEOUT,
        "a closed tensor stays closed"
    );
}

#[test]
fn the_receiver_cancels_before_accept_and_while_receiving() {
    for target in [ReceiverState::AwaitingDecision, ReceiverState::Receiving] {
        let mut pair = small_chunks(3000);
        pair.auto_accept = target != ReceiverState::AwaitingDecision;
        pair.grant_step = 1000;
        pair.pump();
        assert_eq!(pair.receiver.state(), target);
        pair.receiver
            .cancel(ErrorCode::SHUTDOWN, "going down")
            .unwrap();
        assert!(pair.receiver.cancel(ErrorCode::SHUTDOWN, "twice").is_err());
        let frame = std::iter::from_fn(|| pair.receiver.poll_frame())
            .last()
            .unwrap();
        // Spec §7.2: before ACCEPT the answer is REJECT, after it CANCEL.
        match (target, &frame) {
            (ReceiverState::AwaitingDecision, Frame::Reject(r)) => {
                assert_eq!(r.code, ErrorCode::SHUTDOWN)
            }
            (ReceiverState::Receiving, Frame::Cancel(c)) => assert_eq!(c.code, ErrorCode::SHUTDOWN),
            other => panic!("unexpected {other:?}"),
        }
        let err = pair.sender.handle_frame(frame).unwrap_err();
        assert_eq!(
            err,
            ProtocolError::Remote {
                code: ErrorCode::SHUTDOWN,
                reason: "going down".into()
            }
        );
        assert_eq!(pair.sender.state(), SenderState::Closed);
        assert_credit_returned(&mut pair);
    }
}

#[test]
fn the_receiver_cancels_while_awaiting_residency() {
    let mut receiver = TensorReceiver::new(Limits::default());
    let bytes = pattern(10, 2);
    receiver.handle_frame(meta(10).into()).unwrap();
    receiver.accept().unwrap();
    assert_eq!(
        receiver.grant(100),
        10,
        "grants stop at the tensor's length"
    );
    receiver
        .handle_frame(Data::new(0, bytes.clone()).into())
        .unwrap();
    let end = tensorwire_proto::frame::End {
        checksum: tensorwire_proto::checksum::crc32c(&bytes).into(),
    };
    assert_eq!(
        receiver.handle_frame(end.into()).unwrap(),
        ReceiverEvent::End
    );
    assert_eq!(receiver.state(), ReceiverState::AwaitingResidency);
    receiver
        .cancel(ErrorCode::SINK_FAILED, "copy failed")
        .unwrap();
    let frames: Vec<Frame> = std::iter::from_fn(|| receiver.poll_frame()).collect();
    assert!(matches!(frames.last(), Some(Frame::Cancel(c)) if c.code == ErrorCode::SINK_FAILED));
    assert!(
        !frames.iter().any(|f| matches!(f, Frame::Complete(_))),
        "no COMPLETE after a failed sink"
    );
    assert_eq!(receiver.ending().unwrap().blame(), Blame::LocalResource);
}

#[test]
fn complete_is_queued_only_by_mark_resident() {
    let mut receiver = TensorReceiver::new(Limits::default());
    assert!(
        receiver.mark_resident(Receipt::new()).is_err(),
        "not before END"
    );
    receiver.handle_frame(meta(4).into()).unwrap();
    receiver.accept().unwrap();
    let _ = receiver.grant(4);
    receiver
        .handle_frame(Data::new(0, vec![1, 2, 3, 4]).into())
        .unwrap();
    assert!(
        receiver.mark_resident(Receipt::new()).is_err(),
        "not before END"
    );
    let end = tensorwire_proto::frame::End {
        checksum: tensorwire_proto::checksum::crc32c(&[1, 2, 3, 4]).into(),
    };
    receiver.handle_frame(end.into()).unwrap();
    let before: Vec<Frame> = std::iter::from_fn(|| receiver.poll_frame()).collect();
    assert!(
        !before.iter().any(|f| matches!(f, Frame::Complete(_))),
        "END alone sends no COMPLETE"
    );
    receiver.mark_resident(Receipt::new()).unwrap();
    assert!(matches!(receiver.poll_frame(), Some(Frame::Complete(_))));
    let late = receiver
        .handle_frame(Data::new(0, vec![1]).into())
        .unwrap_err();
    assert_eq!(late.code(), ErrorCode::UNEXPECTED_FRAME);
}

#[test]
fn sender_misuse_is_reported_not_sent() {
    let mut sender = TensorSender::new(meta(10)).unwrap();
    assert!(
        matches!(
            sender.send_data(vec![1].into()),
            Err(ProtocolError::Misuse(_))
        ),
        "before ACCEPT"
    );
    sender
        .handle_frame(
            Accept {
                max_data_payload: 4,
            }
            .into(),
        )
        .unwrap();
    sender.handle_frame(Credit { bytes: 10 }.into()).unwrap();
    assert_eq!(sender.next_chunk_len(), 4);
    assert!(
        sender.send_data(vec![1; 5].into()).is_err(),
        "longer than max payload"
    );
    assert!(sender.finish().is_err(), "before every byte was sent");
    let _ = sender.poll_frame();
    assert!(sender.poll_frame().is_none(), "no frame queued by misuse");
    assert_eq!(
        TensorSender::new(
            TensorMeta::new([1], DType::U8)
                .unwrap()
                .with_name("x".repeat(70_000))
        )
        .unwrap_err()
        .code(),
        ErrorCode::INTERNAL
    );
}

#[test]
fn a_rejected_tensor_tells_the_sender_why() {
    let mut pair = Pair::new(meta(10), pattern(10, 1));
    pair.auto_accept = false;
    pair.pump();
    assert_eq!(pair.receiver.state(), ReceiverState::AwaitingDecision);
    pair.receiver
        .reject(ErrorCode::UNSUPPORTED_DEVICE, "no GPU 3")
        .unwrap();
    let (sent, _) = pair.transfer();
    let err = sent.unwrap_err();
    assert_eq!(
        err,
        ProtocolError::Remote {
            code: ErrorCode::UNSUPPORTED_DEVICE,
            reason: "no GPU 3".into()
        }
    );
    assert_eq!(pair.sender.state(), SenderState::Closed);
}

fn render<S: Copy + std::fmt::Debug, I: Copy + std::fmt::Debug>(
    states: &[S],
    inputs: &[I],
    transition: impl Fn(S, I) -> Option<S>,
) -> String {
    let mut out = String::from("| state | input | next state |\n| --- | --- | --- |\n");
    for &s in states {
        for &i in inputs {
            if let Some(next) = transition(s, i) {
                out += &format!("| {s:?} | {i:?} | {next:?} |\n");
            }
        }
    }
    out
}

/// The spec's tables are the code's tables: any change to either shows up here (spec §7.2).
#[test]
fn the_spec_contains_the_transition_tables() {
    let spec = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../spec/protocol.md"
    ))
    .unwrap();
    let receiver = render(
        ReceiverState::ALL,
        ReceiverInput::ALL,
        ReceiverState::transition,
    );
    let sender = render(SenderState::ALL, SenderInput::ALL, SenderState::transition);
    if std::env::var_os("TENSORWIRE_PRINT_TABLES").is_some() {
        println!("{receiver}\n{sender}");
    }
    assert!(
        spec.contains(&receiver),
        "spec/protocol.md lacks the receiver table:\n{receiver}"
    );
    assert!(
        spec.contains(&sender),
        "spec/protocol.md lacks the sender table:\n{sender}"
    );
}

/// Spec §5.3: chunks checksummed apart (before a driver takes its lock) give END the same
/// CRC-32C as the whole tensor, however the tensor is cut.
#[test]
fn checked_chunks_combine_into_the_whole_tensors_checksum() {
    let source = bytes::Bytes::from(tensorwire_proto::testing::pattern(10_007, 3));
    for cut in [1usize, 7, 4096, 10_007] {
        let mut sender = TensorSender::new(meta(10_007)).unwrap();
        let _metadata = sender.poll_frame().unwrap();
        sender
            .handle_frame(Frame::Accept(tensorwire_proto::frame::Accept {
                max_data_payload: u32::MAX,
            }))
            .unwrap();
        sender
            .handle_frame(Frame::Credit(tensorwire_proto::frame::Credit {
                bytes: 10_007,
            }))
            .unwrap();
        for start in (0..source.len()).step_by(cut) {
            let end = (start + cut).min(source.len());
            let chunk = tensorwire_proto::CheckedChunk::new(source.slice(start..end));
            sender.send_checked(chunk).unwrap();
        }
        sender.finish().unwrap();
        let end = std::iter::from_fn(|| sender.poll_frame()).last().unwrap();
        let Frame::End(end) = end else {
            panic!("last frame {end:?}")
        };
        assert_eq!(
            end.checksum,
            u64::from(tensorwire_proto::checksum::crc32c(&source)),
            "cut every {cut} bytes"
        );
    }
}

/// DATA of `len` bytes at `offset`, its CRC to be reported after it is stored.
fn later(offset: u64, len: usize) -> CheckedFrame {
    CheckedFrame::checksum_later(Data::new(offset, vec![7; len]).into())
}

/// A receiver accepted for `len` bytes, all granted.
fn receiving(len: u64) -> TensorReceiver {
    let mut rx = TensorReceiver::new(Limits::default());
    rx.handle_frame(meta(len).into()).unwrap();
    rx.accept().unwrap();
    assert_eq!(rx.grant(len), len);
    rx
}

/// DATA whose checksum the driver computes while storing the bytes (spec §7.3, one pass over
/// them) is verified at END as any other: a wrong piece fails with CHECKSUM_MISMATCH. Later
/// DATA is handled, its bytes counted against credit, while earlier CRCs are still owed;
/// each is reported in the order its DATA came.
#[test]
fn data_checksummed_while_stored_is_verified_at_end() {
    let bytes = pattern(4000, 9);
    let run = |owed_at_once: usize, corrupt_piece: Option<usize>| {
        let mut rx = receiving(4000);
        let mut owed = std::collections::VecDeque::new();
        for (i, piece) in bytes.chunks(1000).enumerate() {
            let data = Data::new(i as u64 * 1000, piece.to_vec());
            let event = rx.handle_checked(CheckedFrame::checksum_later(data.into()))?;
            assert!(matches!(event, ReceiverEvent::Data(_)));
            assert_eq!(rx.received(), (i as u64 + 1) * 1000, "counted at the frame");
            let mut crc = crc32c(piece);
            if corrupt_piece == Some(i) {
                crc ^= 1;
            }
            owed.push_back(crc);
            if owed.len() == owed_at_once {
                rx.record_payload_crc(owed.pop_front().unwrap())?;
            }
        }
        for crc in owed {
            rx.record_payload_crc(crc)?;
        }
        let end = End {
            checksum: crc32c(&bytes).into(),
        };
        rx.handle_frame(end.into())?;
        assert_eq!(rx.state(), ReceiverState::AwaitingResidency);
        Ok::<_, ProtocolError>(())
    };
    for owed_at_once in [1, 3, 4] {
        run(owed_at_once, None).unwrap();
        assert_eq!(
            code_of(&run(owed_at_once, Some(1))),
            ErrorCode::CHECKSUM_MISMATCH
        );
    }
}

/// The checks come before the bytes are stored: overlap and bounds fail at the
/// frame, with nothing owed.
#[test]
fn data_checksummed_later_is_checked_before_it_is_stored() {
    let mut rx = receiving(3000);
    rx.handle_checked(later(0, 1000)).unwrap();
    rx.record_payload_crc(crc32c(&[7; 1000])).unwrap();
    let overlap = rx.handle_checked(later(500, 1000)).map(drop);
    assert_eq!(code_of(&overlap), ErrorCode::DATA_OVERLAP);

    let mut rx = receiving(3000);
    let past_end = rx.handle_checked(later(2500, 1000)).map(drop);
    assert_eq!(code_of(&past_end), ErrorCode::DATA_PAST_END);
}

/// A driver that reports a checksum nobody asked for, hands over END with checksums still
/// owed, or lets more than `MAX_CHECKSUMS_OWED` pile up, is told so.
#[test]
fn checksums_owed_are_bounded_and_all_come_before_end() {
    let mut rx = receiving(2000);
    assert!(matches!(
        rx.record_payload_crc(0),
        Err(ProtocolError::Misuse(_))
    ));
    rx.handle_checked(later(0, 1000)).unwrap();
    rx.handle_checked(later(1000, 1000)).unwrap();
    rx.record_payload_crc(crc32c(&[7; 1000])).unwrap();
    let end = End {
        checksum: crc32c(&[7; 2000]).into(),
    };
    let early_end = rx.handle_frame(end.into()).map(drop);
    assert!(
        matches!(early_end, Err(ProtocolError::Misuse(_))),
        "{early_end:?}"
    );

    let owed = MAX_CHECKSUMS_OWED as u64;
    let mut rx = receiving(owed + 1);
    for offset in 0..owed {
        rx.handle_checked(later(offset, 1)).unwrap();
    }
    let one_more = rx.handle_checked(later(owed, 1)).map(drop);
    assert!(
        matches!(one_more, Err(ProtocolError::Misuse(_))),
        "{one_more:?}"
    );
}

/// Spec §7.3's rules hold at the frame, whether or not earlier CRCs are still owed: DATA
/// overlapping a range whose CRC is owed is DATA_OVERLAP, and owed ranges count toward
/// TOO_MANY_GAPS.
#[test]
fn ranges_with_checksums_owed_count_for_overlap_and_gaps() {
    let mut rx = receiving(3000);
    rx.handle_checked(later(0, 1000)).unwrap();
    let overlap = rx.handle_checked(later(500, 1000)).map(drop);
    assert_eq!(code_of(&overlap), ErrorCode::DATA_OVERLAP);

    let mut limits = Limits::default();
    limits.max_ranges = 2;
    let mut rx = TensorReceiver::new(limits);
    rx.handle_frame(meta(5000).into()).unwrap();
    rx.accept().unwrap();
    assert_eq!(rx.grant(5000), 5000);
    rx.handle_checked(later(0, 1000)).unwrap();
    rx.handle_checked(later(2000, 1000)).unwrap();
    let third = rx.handle_checked(later(4000, 1000)).map(drop);
    assert_eq!(code_of(&third), ErrorCode::TOO_MANY_GAPS);
}

/// DATA of `len` bytes at `offset`, left to the checksum of the landed tensor.
fn landed(offset: u64, bytes: &[u8]) -> CheckedFrame {
    CheckedFrame::checksum_landed(Data::new(offset, bytes.to_vec()).into())
}

/// A tensor checksummed over its landed bytes (spec §7.3): DATA is checked at the frame,
/// END checks the ranges, and COMPLETE waits for the landed CRC, which must match END's:
/// a wrong one closes the tensor with CHECKSUM_MISMATCH and queues the CANCEL.
#[test]
fn a_tensor_checksummed_over_its_landed_bytes_completes_only_on_a_matching_crc() {
    let bytes = pattern(3000, 4);
    let end = End {
        checksum: crc32c(&bytes).into(),
    };
    for corrupt in [false, true] {
        let mut rx = receiving(3000);
        // Out of order: the landed bytes' CRC does not care.
        for i in [2usize, 0, 1] {
            let piece = &bytes[i * 1000..(i + 1) * 1000];
            let event = rx.handle_checked(landed(i as u64 * 1000, piece)).unwrap();
            assert!(matches!(event, ReceiverEvent::Data(_)));
        }
        assert_eq!(rx.handle_frame(end.into()).unwrap(), ReceiverEvent::End);
        assert_eq!(rx.state(), ReceiverState::AwaitingResidency);
        assert!(
            matches!(
                rx.mark_resident(Receipt::new()),
                Err(ProtocolError::Misuse(_))
            ),
            "COMPLETE before the landed checksum"
        );
        let landed_crc = crc32c(&bytes) ^ u32::from(corrupt);
        let verified = rx.verify_landed_crc(landed_crc);
        while rx.poll_frame().is_some() {}
        if corrupt {
            assert_eq!(code_of(&verified), ErrorCode::CHECKSUM_MISMATCH);
            assert_eq!(rx.state(), ReceiverState::Closed);
            continue;
        }
        verified.unwrap();
        rx.mark_resident(Receipt::new()).unwrap();
        assert!(matches!(rx.poll_frame(), Some(Frame::Complete(_))));
        assert!(matches!(
            rx.verify_landed_crc(landed_crc),
            Err(ProtocolError::Misuse(_))
        ));
    }
}

/// The frame's rules hold without per-payload checksums: overlap, bounds and gaps at END.
#[test]
fn data_left_to_the_landed_checksum_is_still_checked_at_the_frame() {
    let mut rx = receiving(3000);
    rx.handle_checked(landed(0, &[1; 1000])).unwrap();
    let overlap = rx.handle_checked(landed(500, &[1; 1000])).map(drop);
    assert_eq!(code_of(&overlap), ErrorCode::DATA_OVERLAP);

    let mut rx = receiving(3000);
    let past_end = rx.handle_checked(landed(2500, &[1; 1000])).map(drop);
    assert_eq!(code_of(&past_end), ErrorCode::DATA_PAST_END);

    let mut rx = receiving(3000);
    rx.handle_checked(landed(0, &[1; 1000])).unwrap();
    rx.handle_checked(landed(2000, &[1; 1000])).unwrap();
    let end = End { checksum: 0 };
    let gaps = rx.handle_frame(end.into()).map(drop);
    assert_eq!(code_of(&gaps), ErrorCode::END_WITH_GAPS);
}

/// A driver that mixes per-payload and landed checksums in one tensor, leaves early DATA to
/// the landed checksum, or reports a landed CRC nobody owes, is told so.
#[test]
fn a_tensors_checksums_are_all_per_payload_or_all_landed() {
    let mut rx = receiving(2000);
    rx.handle_checked(landed(0, &[1; 1000])).unwrap();
    let mixed = rx.handle_checked(later(1000, 1000)).map(drop);
    assert!(matches!(mixed, Err(ProtocolError::Misuse(_))), "{mixed:?}");

    let mut rx = receiving(2000);
    rx.handle_checked(later(0, 1000)).unwrap();
    let mixed = rx.handle_checked(landed(1000, &[1; 1000])).map(drop);
    assert!(matches!(mixed, Err(ProtocolError::Misuse(_))), "{mixed:?}");

    let mut rx = receiving(2000);
    assert!(matches!(
        rx.verify_landed_crc(0),
        Err(ProtocolError::Misuse(_))
    ));

    // Before ACCEPT (a tensor sent early), DATA is checksummed as it comes.
    let mut rx = TensorReceiver::new(Limits::default());
    rx.handle_frame(Frame::Early(Default::default())).unwrap();
    rx.handle_frame(meta(1000).into()).unwrap();
    rx.grant_early().unwrap();
    let early = rx.handle_checked(landed(0, &[1; 1000])).map(drop);
    assert!(matches!(early, Err(ProtocolError::Misuse(_))), "{early:?}");
}
