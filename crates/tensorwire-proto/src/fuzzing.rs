//! Entry points shared by the fuzz targets and the corpus replay test. Not a stable API.

use std::collections::VecDeque;

use bytes::{Bytes, BytesMut};

use crate::{
    CheckedFrame, ErrorCode, Frame, FrameDecoder, Limits, Receipt, ReceiverEvent, ReceiverState,
    TensorReceiver,
};

/// Limits small enough that fuzzing explores every limit quickly.
pub fn fuzz_limits() -> Limits {
    Limits {
        max_metadata_len: 4096,
        max_dims: 8,
        max_name_len: 256,
        max_attributes: 8,
        max_attribute_len: 256,
        max_reason_len: 256,
        max_data_payload: 4096,
        max_tensor_len: 1 << 20,
        max_ranges: 16,
    }
}

/// Decodes `data` fed in pieces cut at the split points its first byte chooses; every
/// decoded frame must re-encode to exactly the bytes it came from.
pub fn decode_round_trip(data: &[u8]) {
    let Some((&seed, input)) = data.split_first() else {
        return;
    };
    let mut decoder = FrameDecoder::new(fuzz_limits());
    let step = usize::from(seed % 17) + 1;
    let input = Bytes::copy_from_slice(input);
    let mut frame_start = 0;
    let mut fed = 0;
    while fed < input.len() {
        let next = (fed + step).min(input.len());
        decoder.push(input.slice(fed..next));
        fed = next;
        loop {
            match decoder.next_frame() {
                Ok(Some(frame)) => {
                    let consumed = fed - decoder.buffered();
                    let mut encoded = BytesMut::new();
                    frame.encode(&mut encoded);
                    assert_eq!(&encoded[..], &input[frame_start..consumed], "{frame:?}");
                    assert_eq!(frame.encoded_len(), encoded.len());
                    frame_start = consumed;
                    if let crate::Frame::Metadata(metadata) = &frame {
                        check_split_part(&metadata.meta);
                    }
                }
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
    let _ = decoder.finish();
}

/// A METADATA read as a part of a split tensor (spec §15) either fails cleanly or describes a
/// slice that lies inside its whole and joins an assembly of its own.
fn check_split_part(meta: &crate::TensorMeta) {
    use crate::split::{SplitAssembly, SplitPart};
    let Ok(Some(part)) = SplitPart::of(meta, u64::MAX) else {
        return;
    };
    let whole = part.whole();
    assert!(part.offset() + part.len() <= whole.byte_len(), "{meta:?}");
    assert_eq!(whole.shape()[1..], meta.shape()[1..]);
    assert_eq!(whole.dtype(), meta.dtype());
    let mut assembly = SplitAssembly::new(&part);
    assert_eq!(assembly.join(&part), Ok(()));
    assert!(assembly.join(&part).is_err(), "the same rows twice");
}

/// Drives a receiver with local calls and frames from `data`, checking its accounting after
/// every step.
///
/// Layout: `op_count: u8 | ops: [u8; op_count] | frame bytes`. Op `k % 8`: 0 feeds the next
/// decoded frame, 1 feeds it with DATA's CRC to follow (`CheckedFrame::checksum_later`),
/// 2 accept, 3 grant (next op byte shifted by `k >> 4`), 4 mark resident, 5 cancel, 6 report
/// the oldest CRC owed and END's checksum as the landed bytes' (each wrong where `k >> 4` is
/// odd), 7 feeds the next frame with DATA left to the landed checksum
/// (`CheckedFrame::checksum_landed`). When the ops run out, the remaining frames are fed to a
/// receiver that accepts, grants everything, reports every CRC owed before each frame and,
/// after END, the landed checksum, then marks the tensor resident.
pub fn receiver_ops(data: &[u8]) {
    let Some((&op_count, rest)) = data.split_first() else {
        return;
    };
    let (ops, frames) = rest.split_at(usize::from(op_count).min(rest.len()));
    let limits = fuzz_limits();
    let mut receiver = TensorReceiver::new(limits.clone());
    let mut decoder = FrameDecoder::new(limits);
    decoder.push(Bytes::copy_from_slice(frames));
    let mut ops = ops.iter().copied();
    let mut granted_total = 0u64;
    // The CRCs of DATA handled with its checksum to follow, oldest first.
    let mut owed: VecDeque<u32> = VecDeque::new();
    // END's checksum, which a landed checksum is reported as; whether one was verified.
    let mut end_checksum = None;
    let mut landed_verified = false;
    let mut landed_used = false;
    loop {
        let op = ops.next();
        if op.is_none() {
            for crc in owed.drain(..) {
                let _ = receiver.record_payload_crc(crc);
            }
        }
        match op.map_or(0, |k| k % 8) {
            feed @ (0 | 1 | 7) => match decoder.next_frame() {
                Ok(Some(frame)) => {
                    if let Frame::End(end) = &frame {
                        end_checksum = Some(end.checksum);
                    }
                    let crc_later = match &frame {
                        Frame::Data(data) if op.is_some() && feed == 1 => {
                            Some(data.payload.crc32c())
                        }
                        _ => None,
                    };
                    let handled = match crc_later {
                        Some(_) => receiver.handle_checked(CheckedFrame::checksum_later(frame)),
                        None if feed == 7 => {
                            receiver.handle_checked(CheckedFrame::checksum_landed(frame))
                        }
                        None => receiver.handle_frame(frame),
                    };
                    landed_used |= feed == 7 && matches!(handled, Ok(ReceiverEvent::Data(_)));
                    if let (Ok(ReceiverEvent::Data(_)), Some(crc)) = (&handled, crc_later) {
                        owed.push_back(crc);
                    }
                    match handled {
                        Ok(ReceiverEvent::Data(data)) => {
                            let byte_len = receiver.meta().map_or(0, |m| m.byte_len());
                            assert!(data.end().is_some_and(|end| end <= byte_len));
                        }
                        // Once the ops run out, act as a well-behaved driver would.
                        Ok(ReceiverEvent::Metadata) if op.is_none() => {
                            let _ = receiver.accept();
                            granted_total += receiver.grant(u64::MAX);
                        }
                        Ok(ReceiverEvent::End) if op.is_none() => {
                            if let Some(checksum) = end_checksum {
                                landed_verified |=
                                    receiver.verify_landed_crc(checksum as u32).is_ok();
                            }
                            drop(receiver.mark_resident(Receipt::new()));
                        }
                        _ => {}
                    }
                }
                _ if op.is_none() => break,
                _ => {}
            },
            2 => drop(receiver.accept()),
            3 => {
                let shift = op.unwrap_or(0) >> 4;
                granted_total += receiver.grant(u64::from(ops.next().unwrap_or(0)) << shift);
            }
            4 => drop(receiver.mark_resident(Receipt::new())),
            5 => drop(receiver.cancel(ErrorCode::CANCELLED, "fuzz")),
            _ => {
                // `k >> 4` odd reports it wrong.
                let wrong = u32::from(op.unwrap_or(0) >> 4 & 1);
                if let Some(crc) = owed.pop_front() {
                    drop(receiver.record_payload_crc(crc ^ wrong));
                }
                if let Some(checksum) = end_checksum {
                    let verified = receiver.verify_landed_crc(checksum as u32 ^ wrong);
                    assert!(
                        wrong == 0 || verified.is_err(),
                        "a wrong landed CRC verified"
                    );
                    landed_verified |= verified.is_ok();
                }
            }
        }
        assert!(owed.len() <= crate::MAX_CHECKSUMS_OWED);
        assert_eq!(receiver.granted(), granted_total);
        assert!(receiver.received() <= receiver.granted());
        let byte_len = receiver.meta().map_or(0, |m| m.byte_len());
        assert!(receiver.granted() <= byte_len);
        if receiver.state() == ReceiverState::Complete {
            assert_eq!(receiver.received(), byte_len);
            assert!(
                !landed_used || landed_verified,
                "COMPLETE with no landed CRC verified"
            );
        }
        while receiver.poll_frame().is_some() {}
    }
}

/// Streams a fuzzed session juggles at once: the first half the peer's, the rest ours.
const SESSION_STREAMS: u64 = 4;

/// Bytes of each tensor the fuzzed session sends.
const SENT_TENSOR_LEN: u64 = 3000;

/// Drives a connection [`Session`](crate::Session) in both directions with arbitrary frames on
/// several streams, arbitrary local calls and a fake clock, checking after every step that the
/// session and the receiver-wide tracker agree: held bytes are exactly those the sink has not
/// released, the connection's granted-but-unarrived credit is the tracker's in-flight credit,
/// nothing exceeds a window or the budget, and once every stream is closed and every byte
/// released, all credit is back.
///
/// Layout: `op_count: u8 | ops: [u8; op_count] | frame bytes`. Op `k`: stream `(k >> 4) % 4`
/// (streams 0 and 1 receive, 2 and 3 send); `k % 8`: 0–2 feed it the next decoded frame,
/// 3 accept (receiving) or send the next chunk and ask whether the tensor is done with the
/// connection's turn, with a round trip of `k >> 5` ms (sending), 4 grant with a round trip of
/// `k >> 5` ms (receiving) or finish (sending), 5 release held bytes, 6 cancel, 7 close and
/// reopen it. Each op advances the clock by `k` milliseconds.
pub fn session_ops(data: &[u8]) {
    use std::time::{Duration, Instant};

    use crate::{
        CreditTracker, DType, IncomingEvent, Session, SessionConfig, StreamId, TensorMeta,
    };

    let Some((&op_count, rest)) = data.split_first() else {
        return;
    };
    let (ops, frames) = rest.split_at(usize::from(op_count).min(rest.len()));
    let limits = fuzz_limits();
    let config = SessionConfig {
        limits: limits.clone(),
        grant_unit: 1024,
        stream_window: 4096,
        max_stream_window: 16384,
        connection_window: 6144,
        max_failed_streams: 8,
        failure_window: Duration::from_secs(1),
        early_credit: 2048,
        idle_timeout: Duration::from_secs(1),
        // Short, so that ops (each moves the clock up to 255 ms) reach both.
        progress_timeout: Duration::from_millis(400),
        admission_timeout: Duration::from_millis(600),
        max_undecided: 2,
    };
    let connection_window = config.connection_window;
    let max_stream_window = config.max_stream_window;
    let early_credit = config.early_credit;
    let budget = 16 << 10;
    let Ok(mut credit) = CreditTracker::new(budget, budget / 4 * 3, budget / 4) else {
        return;
    };
    let Ok(sent_meta) = TensorMeta::new([SENT_TENSOR_LEN], DType::U8) else {
        return;
    };
    #[allow(clippy::disallowed_methods)] // The fake clock's origin; ops move it.
    let mut now = Instant::now();
    let mut session = Session::new(config, now);
    // Another peer is connected: this connection's peer keeps to half the budget (§7.1).
    let party = crate::Party::from_bits(1);
    credit.join(crate::Party::from_bits(2));
    session.join(party, &mut credit);
    let _ = session.offer_early_credit(&mut credit);
    let mut decoder = FrameDecoder::new(limits);
    decoder.push(Bytes::copy_from_slice(frames));
    let receiving = |slot: usize| (slot as u64) < SESSION_STREAMS / 2;
    let open = |session: &mut Session, slot: usize, id: StreamId, now: Instant| {
        if receiving(slot) {
            let _ = session.open_stream(id, now);
        } else if let Ok(tensor) = crate::TensorSender::new(sent_meta.clone()) {
            // Our tensors wait for the peer's answers as long as it waits for its frames.
            let reply_timeout = session.config().progress_timeout;
            let _ = session.start_sending(id, tensor, now, reply_timeout);
        }
    };
    // Stream slot -> its current id; held bytes per slot, as a sink would keep them.
    let mut ids: Vec<StreamId> = (0..SESSION_STREAMS).collect();
    let mut held = vec![0u64; SESSION_STREAMS as usize];
    let mut next_id = SESSION_STREAMS;
    for (slot, &id) in ids.iter().enumerate() {
        open(&mut session, slot, id, now);
    }
    let filler = Bytes::from(vec![0x5a; SENT_TENSOR_LEN as usize]);
    for &k in ops {
        now += Duration::from_millis(u64::from(k));
        let slot = usize::from(k >> 4) % ids.len();
        let id = ids[slot];
        match (k % 8, receiving(slot)) {
            (0..=2, incoming) => {
                match decoder.next_frame() {
                    // The peer's control stream: early credit for the tensors we send.
                    Ok(Some(frame @ crate::Frame::EarlyCredit(_))) => {
                        let _ = session.handle_control_frame(frame);
                    }
                    // The peer's answer on one of our streams.
                    Ok(Some(frame)) if !incoming => drop(session.handle_reply(id, frame, now)),
                    Ok(Some(frame)) => {
                        match session.handle_frame(id, frame, &mut credit, now) {
                            Ok(IncomingEvent::Data(d)) => held[slot] += d.payload.len() as u64,
                            // Offered to the application if the connection's share allows.
                            Ok(IncomingEvent::Metadata(_)) => drop(session.offer(id)),
                            _ => {}
                        }
                    }
                    _ => {}
                }
            }
            (3, true) => drop(session.accept(id, now)),
            (3, false) => {
                let len = session
                    .next_chunk_len(id)
                    .min(SENT_TENSOR_LEN - session.sent(id));
                if len > 0 {
                    let start = session.sent(id) as usize;
                    let chunk = filler.slice(start..start + len as usize);
                    let _ = session.send_data(id, chunk);
                    // Handed to the transport: the peer owes nothing while it crosses.
                    session.data_moved(id, now);
                }
                // Spec §7.4: a tensor with every byte sent holds no turn.
                let rtt = Duration::from_millis(u64::from(k >> 5));
                let turn_done = session.turn_done(id, now, rtt);
                assert!(turn_done || session.sent(id) < SENT_TENSOR_LEN);
            }
            (4, true) => {
                // A round trip of 0–7 ms: windows grow when bytes arrive fast.
                let rtt = Duration::from_millis(u64::from(k >> 5));
                let _ = session.grant(id, &mut credit, crate::GrantClock { now, rtt });
            }
            (4, false) => drop(session.finish(id)),
            (5, _) => {
                let n = held[slot].min(u64::from(k) * 64);
                held[slot] -= n;
                let _ = credit.release(n);
            }
            (6, _) => session.cancel(id, ErrorCode::CANCELLED, "fuzz"),
            _ => {
                let _ = credit.release(std::mem::take(&mut held[slot]));
                let _ = session.close_stream(id, &mut credit, now);
                ids[slot] = next_id;
                open(&mut session, slot, next_id, now);
                next_id += 1;
            }
        }
        // Spec §10: never more undecided tensors offered than the connection's share.
        assert!(session.undecided() <= 2, "past the undecided cap");
        // Spec §10.1: a wait that has run out ends its tensor, and only then.
        if let Some(deadline) = session.stream_deadline(id) {
            let expired = session.handle_stream_timeout(id, now);
            assert_eq!(
                expired.is_some(),
                now >= deadline,
                "a stream timed out off its deadline"
            );
            if let Some(e) = expired {
                assert_eq!(e.code(), ErrorCode::PROGRESS_TIMEOUT);
            }
        }
        if let Some(first) = session.poll_timeout() {
            assert!(session.stream_deadline(id).is_none_or(|d| d >= first));
        }
        assert_eq!(
            credit.held(),
            held.iter().sum::<u64>(),
            "held bytes disagree"
        );
        assert!(credit.outstanding() <= budget);
        assert_eq!(
            session.outstanding_credit() + session.early_credit_offered(),
            credit.in_flight(),
            "the session's unarrived credit disagrees with the tracker's"
        );
        assert!(session.outstanding_credit() <= connection_window + early_credit);
        assert_eq!(credit.party_in_flight(party), credit.in_flight());
        assert!(
            credit.party_in_flight(party) <= budget / 2,
            "past the peer's share"
        );
        assert!(
            session
                .stream_window(id)
                .is_none_or(|w| w <= max_stream_window)
        );
        while session.poll_control_frame().is_some() {}
        assert!(session.sent(id) <= SENT_TENSOR_LEN);
        // Spec §10: streams are open, so the connection is not idle however long it runs;
        // what the session waits for is its streams'.
        assert_eq!(session.handle_timeout(now), None);
        while session.poll_frame(id).is_some() {}
    }
    for (slot, &id) in ids.iter().enumerate() {
        let _ = credit.release(std::mem::take(&mut held[slot]));
        let _ = session.close_stream(id, &mut credit, now);
    }
    assert_eq!(session.poll_timeout(), Some(now + Duration::from_secs(1)));
    session.withdraw_early_credit(&mut credit);
    assert_eq!(credit.outstanding(), 0, "credit not counted back");
    assert_eq!(session.outstanding_credit(), 0);
    assert_eq!(session.open_streams(), 0);
}

/// Version negotiation (spec §3.1): a server of the minor version the first byte names (at
/// least 1.4) against a client offering the comma-separated identifiers that follow. The
/// server's choice (the first of its own offers the client offers too) must parse, be no
/// newer than the server, and be the newest version both offered; every identifier that
/// parses must print back as itself.
pub fn negotiate_versions(data: &[u8]) {
    use crate::Version;
    let Some((&minor, rest)) = data.split_first() else {
        return;
    };
    let server = Version {
        minor: minor.max(Version::V1_4.minor),
        ..Version::CURRENT
    };
    let client: Vec<&[u8]> = rest.split(|&b| b == b',').collect();
    let offers = server.alpn_offers();
    let chosen = offers
        .iter()
        .find(|id| client.contains(&id.as_slice()))
        .map(|id| Version::from_alpn(id).expect("a server offers only identifiers it parses"));
    for id in &client {
        let Some(offered) = Version::from_alpn(id) else {
            continue;
        };
        assert_eq!(Version::from_alpn(&offered.alpn()), Some(offered));
        if offered <= server {
            let chosen = chosen.expect("a version both offer was not chosen");
            assert!(
                offered <= chosen,
                "{offered} offered by both, {chosen} chosen"
            );
        }
    }
    if let Some(chosen) = chosen {
        assert!(chosen <= server, "{chosen} chosen by a {server} server");
    }
}

/// The TCP binding's framing (spec §16): arbitrary bytes after a split-step byte, fed in
/// pieces of that step, yield packets that frame back to exactly the bytes consumed, or a
/// framing error; the deframer never holds more than one packet and its length beyond what
/// it was last given.
pub fn deframe_round_trip(data: &[u8]) {
    use crate::tcp_framing::{MAX_TCP_PACKET, PACKET_LENGTH_BYTES, PacketDeframer, frame_packet};
    let Some((&seed, input)) = data.split_first() else {
        return;
    };
    let step = usize::from(seed) * 61 + 1;
    let mut deframer = PacketDeframer::new();
    let mut reframed = BytesMut::new();
    let mut fed = 0;
    while fed < input.len() {
        let next = (fed + step).min(input.len());
        deframer.push(&input[fed..next]);
        fed = next;
        loop {
            match deframer.next_packet() {
                Ok(Some(packet)) => {
                    assert!(!packet.is_empty() && packet.len() <= MAX_TCP_PACKET);
                    frame_packet(&mut reframed, &packet).expect("a deframed packet frames");
                }
                Ok(None) => break,
                Err(_) => return,
            }
        }
        assert!(deframer.buffered() < PACKET_LENGTH_BYTES + MAX_TCP_PACKET);
        assert_eq!(&reframed[..], &input[..fed - deframer.buffered()]);
    }
    let _ = deframer.finish();
}
