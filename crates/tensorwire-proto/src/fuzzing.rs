//! Entry points shared by the fuzz targets and the corpus replay test. Not a stable API.

use bytes::{Bytes, BytesMut};

use crate::{ErrorCode, FrameDecoder, Limits, ReceiverEvent, ReceiverState, TensorReceiver};

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
                }
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
    let _ = decoder.finish();
}

/// Drives a receiver with local calls and frames from `data`, checking its accounting after
/// every step.
///
/// Layout: `op_count: u8 | ops: [u8; op_count] | frame bytes`. Op `k % 6`: 0–1 feed the next
/// decoded frame, 2 accept, 3 grant (next op byte shifted by `k >> 4`), 4 mark resident,
/// 5 cancel. When the ops run out, the remaining frames are fed to a receiver that accepts,
/// grants everything and marks the tensor resident after END.
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
    loop {
        let op = ops.next();
        match op.map_or(0, |k| k % 6) {
            0 | 1 => match decoder.next_frame() {
                Ok(Some(frame)) => match receiver.handle_frame(frame) {
                    Ok(ReceiverEvent::Data(data)) => {
                        let byte_len = receiver.meta().map_or(0, |m| m.byte_len());
                        assert!(data.end().is_some_and(|end| end <= byte_len));
                    }
                    // Once the ops run out, act as a well-behaved driver would.
                    Ok(ReceiverEvent::Metadata) if op.is_none() => {
                        let _ = receiver.accept();
                        granted_total += receiver.grant(u64::MAX);
                    }
                    Ok(ReceiverEvent::End) if op.is_none() => drop(receiver.mark_resident()),
                    _ => {}
                },
                _ if op.is_none() => break,
                _ => {}
            },
            2 => drop(receiver.accept()),
            3 => {
                let shift = op.unwrap_or(0) >> 4;
                granted_total += receiver.grant(u64::from(ops.next().unwrap_or(0)) << shift);
            }
            4 => drop(receiver.mark_resident()),
            _ => drop(receiver.cancel(ErrorCode::CANCELLED, "fuzz")),
        }
        assert_eq!(receiver.granted(), granted_total);
        assert!(receiver.received() <= receiver.granted());
        let byte_len = receiver.meta().map_or(0, |m| m.byte_len());
        assert!(receiver.granted() <= byte_len);
        if receiver.state() == ReceiverState::Complete {
            assert_eq!(receiver.received(), byte_len);
        }
        while receiver.poll_frame().is_some() {}
    }
}
