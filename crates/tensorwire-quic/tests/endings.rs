//! Every ending is clean: cancel in each state from each side, rejection, protocol
//! violations from a raw QUIC peer, timeouts, lost connections and TLS failures. Both sides
//! learn the wire code, other tensors go on, and the budget is counted back.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{
    assert_budget_returned, cancel_code, init_tracing, pattern, raw_connection, raw_exchange,
    receive_host, receiver, receiver_config, remote_code, sender, u8_meta,
};
use quinn::VarInt;
use tensorwire_quic::proto::checksum::crc32c;
use tensorwire_quic::proto::frame::{Data, End};
use tensorwire_quic::proto::{ErrorCode, Frame, FrameDecoder, Limits, Payload, ProtocolError};
use tensorwire_quic::{
    ClientTls, CreditPermit, IncomingTensor, Receiver, ReceiverConfig, SendHandle, Sender,
    SenderConfig, Sink, SinkError, TensorHandle, TransportError, TransportSettings,
};
use tokio::sync::Notify;

/// The sender cancels: it reports CANCELLED, the receiver's handle the peer's CANCELLED, and
/// every credit byte returns to the budget.
async fn cancel_sender_and_check<T: std::fmt::Debug>(
    send: SendHandle,
    handle: TensorHandle<T>,
    rx: &Receiver,
) {
    send.cancel();
    assert_eq!(
        send.finished().await.unwrap_err().code(),
        Some(ErrorCode::CANCELLED)
    );
    let received = handle.finished().await.unwrap_err();
    assert_eq!(
        remote_code(&received),
        Some(ErrorCode::CANCELLED),
        "{received}"
    );
    assert_budget_returned(rx).await;
}

/// A 256 MiB tensor under way (a 2 MiB budget keeps it so): the receiver, the sender, and
/// both sides' handles, once the first bytes have arrived.
async fn tensor_in_flight(
    config: ReceiverConfig,
) -> (Receiver, Sender, SendHandle, TensorHandle<Bytes>) {
    let (mut rx, addr) = receiver(config.with_budget(2 << 20)).await;
    let tx = sender(addr).await;
    let send = tx.send(u8_meta("t", 256 << 20), pattern(256 << 20, 1));
    let handle = rx.next().await.unwrap().accept_host().await.unwrap();
    while handle.received_bytes() == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    (rx, tx, send, handle)
}

/// Stores nothing; `finish` waits until the test opens the gate.
struct GatedSink {
    gate: Arc<Notify>,
}

impl Sink for GatedSink {
    type Output = ();

    async fn store(
        &mut self,
        _: u64,
        payload: Payload,
        permit: CreditPermit,
        crc: Option<&mut u32>,
    ) -> Result<(), SinkError> {
        payload.continue_crc(crc);
        drop(permit);
        Ok(())
    }

    async fn finish(self) -> Result<(), SinkError> {
        self.gate.notified().await;
        Ok(())
    }
}

#[tokio::test]
async fn the_sender_cancels_before_the_tensor_is_accepted() {
    let (mut rx, addr) = receiver(receiver_config()).await;
    let tx = sender(addr).await;
    let send = tx.send(u8_meta("t", 1000), pattern(1000, 1));
    let incoming = rx.next().await.unwrap();
    cancel_undecided_and_check(send, incoming, &rx).await;
}

/// The sender cancels `send` while the receiver has not decided on `incoming`: the sender
/// reports CANCELLED once the receiver has the CANCEL, so accepting then fails with the
/// peer's CANCELLED, and every credit byte returns to the budget.
async fn cancel_undecided_and_check(send: SendHandle, incoming: IncomingTensor, rx: &Receiver) {
    send.cancel();
    let sent = send.finished().await.unwrap_err();
    assert_eq!(sent.code(), Some(ErrorCode::CANCELLED));
    let received = incoming
        .accept_host()
        .await
        .unwrap()
        .finished()
        .await
        .unwrap_err();
    assert_eq!(
        remote_code(&received),
        Some(ErrorCode::CANCELLED),
        "{received}"
    );
    assert_budget_returned(rx).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sender_cancels_while_sending() {
    let (rx, _tx, send, handle) = tensor_in_flight(receiver_config()).await;
    cancel_sender_and_check(send, handle, &rx).await;
}

#[tokio::test]
async fn the_sender_cancels_while_awaiting_complete() {
    let (mut rx, addr) = receiver(receiver_config()).await;
    let tx = sender(addr).await;
    let send = tx.send(u8_meta("t", 5000), pattern(5000, 1));
    let gate = Arc::new(Notify::new());
    let handle = rx
        .next()
        .await
        .unwrap()
        .accept(GatedSink { gate: gate.clone() });
    while handle.received_bytes() < 5000 || send.sent_bytes() < 5000 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await; // END reaches the receiver
    cancel_sender_and_check(send, handle, &rx).await;
}

/// Spec §4, §7.6: a tensor sent early keeps its half open after END, so a cancel after END
/// still goes as CANCEL, and the sender reports it only once the receiver has it. The
/// receiver, still deciding, finds it on ACCEPT, and the early bytes return to the budget.
/// (A sender that finished its half with END could only stop the receiver's, unacknowledged:
/// the receiver could land the tensor after the sender reported it cancelled.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sender_cancels_an_early_tensor_after_its_end() {
    let (mut rx, addr) = receiver(receiver_config()).await;
    let tx = sender(addr).await;
    for _ in 0..500 {
        if tx.early_allowance().is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(tx.early_allowance().is_some(), "no early credit offered");
    let send = tx.send(u8_meta("early", 4096), pattern(4096, 1));
    let incoming = rx.next().await.unwrap();
    while rx.budget().held < 4096 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(send.sent_bytes(), 4096, "sent early, END included");
    cancel_undecided_and_check(send, incoming, &rx).await;
}

#[tokio::test]
async fn the_receiver_rejects_with_a_code_and_reason() {
    let (mut rx, addr) = receiver(receiver_config()).await;
    let tx = sender(addr).await;
    let send = tx.send(u8_meta("t", 10), pattern(10, 1));
    rx.next()
        .await
        .unwrap()
        .reject(ErrorCode::UNSUPPORTED_DTYPE, "U8 is not welcome here");
    let err = send.finished().await.unwrap_err();
    match err {
        TransportError::Protocol(ProtocolError::Remote { code, reason }) => {
            assert_eq!(code, ErrorCode::UNSUPPORTED_DTYPE);
            assert_eq!(reason, "U8 is not welcome here");
        }
        other => panic!("{other}"),
    }
    // Dropping an incoming tensor undecided rejects it too.
    let send = tx.send(u8_meta("t2", 10), pattern(10, 1));
    drop(rx.next().await.unwrap());
    assert_eq!(
        remote_code(&send.finished().await.unwrap_err()),
        Some(ErrorCode::REJECTED)
    );
    assert_eq!(rx.metrics().tensors_failed, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_receiver_cancels_while_receiving() {
    let (rx, _tx, send, handle) = tensor_in_flight(receiver_config()).await;
    handle.cancel();
    assert_eq!(
        handle.finished().await.unwrap_err().code(),
        Some(ErrorCode::CANCELLED)
    );
    let sent = send.finished().await.unwrap_err();
    assert_eq!(remote_code(&sent), Some(ErrorCode::CANCELLED), "{sent}");
    assert!(sent.to_string().contains("receiving application"), "{sent}");
    assert_budget_returned(&rx).await;
}

#[tokio::test]
async fn the_receiver_cancels_while_making_the_tensor_resident() {
    let (mut rx, addr) = receiver(receiver_config()).await;
    let tx = sender(addr).await;
    let send = tx.send(u8_meta("t", 5000), pattern(5000, 1));
    let handle = rx.next().await.unwrap().accept(GatedSink {
        gate: Arc::new(Notify::new()),
    });
    while handle.received_bytes() < 5000 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    handle.cancel();
    assert_eq!(
        handle.finished().await.unwrap_err().code(),
        Some(ErrorCode::CANCELLED)
    );
    assert_eq!(
        remote_code(&send.finished().await.unwrap_err()),
        Some(ErrorCode::CANCELLED)
    );
    assert_budget_returned(&rx).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rule_breakers_get_the_documented_code_while_others_are_served() {
    init_tracing();
    let mut config = receiver_config();
    config.session.grant_unit = 1000;
    config.session.stream_window = 1000; // each rule breaker holds exactly 1000 bytes of credit
    let (mut rx, addr) = receiver(config).await;
    let server = tokio::spawn(async move {
        let mut results = Vec::new();
        while let Some(incoming) = rx.next().await {
            let handle = incoming.accept_host().await.unwrap();
            results.push(tokio::spawn(handle.finished()));
            if results.len() == 6 {
                break;
            }
        }
        let mut out = Vec::new();
        for r in results {
            out.push(r.await.unwrap().map(|(m, b)| (m.name().to_owned(), b)));
        }
        (out, rx)
    });
    let good = sender(addr).await;
    let good_send = good.send(u8_meta("good", 1 << 20), pattern(1 << 20, 3));
    let raw = raw_connection(addr, b"tensorwire/1").await.unwrap();
    let meta: Frame = u8_meta("bad", 5000).into();
    let cases: Vec<(Vec<Frame>, ErrorCode)> = vec![
        (
            vec![meta.clone(), Data::new(0, vec![1u8; 1500]).into()],
            ErrorCode::CREDIT_VIOLATION,
        ),
        (
            vec![
                meta.clone(),
                Data::new(0, vec![1u8; 500]).into(),
                Data::new(400, vec![1u8; 200]).into(),
            ],
            ErrorCode::DATA_OVERLAP,
        ),
        (
            vec![meta.clone(), Data::new(4900, vec![1u8; 200]).into()],
            ErrorCode::DATA_PAST_END,
        ),
        (
            vec![meta.clone(), End { checksum: 0 }.into()],
            ErrorCode::END_WITH_GAPS,
        ),
        // The receiver checksums DATA as it stores it: bytes that do not match END are
        // caught all the same.
        (
            vec![
                u8_meta("bad", 1000).into(),
                Data::new(0, vec![1u8; 1000]).into(),
                End {
                    checksum: crc32c(&[2u8; 1000]).into(),
                }
                .into(),
            ],
            ErrorCode::CHECKSUM_MISMATCH,
        ),
    ];
    for (frames, expected) in cases {
        let answers = raw_exchange(&raw, &frames, true).await;
        assert_eq!(cancel_code(&answers), Some(expected), "{answers:?}");
        assert!(!answers.iter().any(|f| matches!(f, Frame::Complete(_))));
    }
    good_send.finished().await.unwrap();
    let (results, rx) = server.await.unwrap();
    let codes: Vec<_> = results
        .iter()
        .filter_map(|r| r.as_ref().err().and_then(|e| e.code()))
        .collect();
    assert_eq!(codes.len(), 5, "{results:?}");
    let good_result = results.iter().find_map(|r| r.as_ref().ok()).unwrap();
    assert_eq!(good_result, &("good".to_owned(), pattern(1 << 20, 3)));
    assert_budget_returned(&rx).await;
}

#[tokio::test]
async fn unknown_frames_and_garbage_are_refused_before_metadata() {
    let (mut rx, addr) = receiver(receiver_config()).await;
    let raw = raw_connection(addr, b"tensorwire/1").await.unwrap();
    let (mut send, mut recv) = raw.open_bi().await.unwrap();
    send.write_all(&[0x7f, 0, 0, 0, 0]).await.unwrap();
    let _ = send.finish();
    let mut decoder = FrameDecoder::new(Limits::default());
    while let Ok(Some(chunk)) = recv.read_chunk(usize::MAX, true).await {
        decoder.push(chunk.bytes);
    }
    let frame = decoder.next_frame().unwrap().unwrap();
    assert!(
        matches!(&frame, Frame::Reject(r) if r.code == ErrorCode::UNKNOWN_FRAME_TYPE),
        "{frame:?}"
    );
    // The application never saw it; the receiver still serves.
    let tx = sender(addr).await;
    let send = tx.send(u8_meta("ok", 10), pattern(10, 1));
    receive_host(&mut rx).await.unwrap();
    send.finished().await.unwrap();
}

#[tokio::test]
async fn a_stalled_sender_times_out_and_its_credit_returns() {
    let mut config = receiver_config();
    config.session.progress_timeout = Duration::from_millis(300);
    let (mut rx, addr) = receiver(config).await;
    let raw = raw_connection(addr, b"tensorwire/1").await.unwrap();
    let server = tokio::spawn(async move {
        let result = receive_host(&mut rx).await;
        (result, rx)
    });
    let (mut send, mut recv) = raw.open_bi().await.unwrap();
    send.write_all(&Frame::from(u8_meta("stall", 5000)).to_bytes())
        .await
        .unwrap();
    let mut decoder = FrameDecoder::new(Limits::default());
    let mut answers = Vec::new();
    while let Ok(Some(chunk)) = recv.read_chunk(usize::MAX, true).await {
        decoder.push(chunk.bytes);
        while let Ok(Some(f)) = decoder.next_frame() {
            answers.push(f);
        }
    }
    assert_eq!(
        cancel_code(&answers),
        Some(ErrorCode::PROGRESS_TIMEOUT),
        "{answers:?}"
    );
    let (result, rx) = server.await.unwrap();
    assert_eq!(
        result.unwrap_err().code(),
        Some(ErrorCode::PROGRESS_TIMEOUT)
    );
    assert_budget_returned(&rx).await;
    drop(send);
}

/// A sender that vanishes mid-tensor: the receiver learns from the connection close if it
/// arrives, else from its progress timeout; either way the tensor fails and credit returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_sender_fails_the_tensor_and_returns_its_credit() {
    let mut config = receiver_config();
    config.session.progress_timeout = Duration::from_millis(500);
    let (rx, tx, send, handle) = tensor_in_flight(config).await;
    tx.close().await;
    let err = handle.finished().await.unwrap_err();
    let timed_out = err.code() == Some(ErrorCode::PROGRESS_TIMEOUT);
    assert!(
        matches!(err, TransportError::Connection(_)) || timed_out,
        "{err}"
    );
    assert!(send.finished().await.is_err());
    assert_budget_returned(&rx).await;
}

#[tokio::test]
async fn a_wrong_alpn_is_refused_with_a_clear_error() {
    let (_rx, addr) = receiver(receiver_config()).await;
    let err = raw_connection(addr, b"h3").await.unwrap_err();
    // TLS alert 120, no_application_protocol.
    assert!(
        err.contains("error 120") && err.contains("protocol"),
        "{err}"
    );
}

#[tokio::test]
async fn a_wrong_certificate_is_refused_with_a_clear_error() {
    let (_rx, addr) = receiver(receiver_config()).await;
    let other = tensorwire_quic::tls::DevCertificate::generate().unwrap();
    let dir = std::env::temp_dir().join(format!("tensorwire-wrong-ca-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca = dir.join("other.pem");
    std::fs::write(&ca, &other.pem).unwrap();
    let mut config = SenderConfig::new(ClientTls::Development);
    config.tls = ClientTls::Pem { ca, identity: None };
    config.transport = TransportSettings::jumbo();
    let err = Sender::connect(addr, config)
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(err.to_lowercase().contains("certificate"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
    // With no development certificate to find, development trust says what to do.
    let err = Sender::connect(
        "127.0.0.1:9".parse().unwrap(),
        SenderConfig::new(ClientTls::Development),
    )
    .await
    .err()
    .unwrap();
    assert!(
        err.to_string().contains("no development certificate"),
        "{err}"
    );
}

#[test]
fn an_mtu_outside_what_udp_carries_is_refused() {
    let fixed = |mtu| TransportSettings::default().fixed_mtu(mtu);
    let err = fixed(65_508).validate().unwrap_err().to_string();
    assert!(err.contains("65508") && err.contains("65507"), "{err}");
    let err = fixed(1000).validate().unwrap_err().to_string();
    assert!(err.contains("1200"), "{err}");
    // Segmentation offload no longer bounds it: batches are cut to fit (see loopback.rs).
    for mtu in [1200, 8000, 65_507] {
        fixed(mtu).validate().unwrap();
    }
    // A start above the largest size could never be sent.
    let mut start_above = TransportSettings::default();
    start_above.mtu = 9000;
    start_above.max_mtu = 6000;
    let err = start_above.validate().unwrap_err().to_string();
    assert!(err.contains("9000") && err.contains("6000"), "{err}");
}

#[test]
fn loopback_gets_the_largest_packets_and_other_addresses_probe_up_from_the_safe_size() {
    let largest = tensorwire_quic::MAX_MTU;
    // Receivers on every address, and loopback, probe up to the largest; a peer elsewhere up
    // to what the route to it carries (on this host's interfaces: anything from the safe
    // size up), so `None`.
    for (addr, start, up_to) in [
        ("127.0.0.1:7000", largest, Some(largest)),
        ("127.3.2.1:7000", largest, Some(largest)),
        ("[::1]:7000", largest, Some(largest)),
        ("[::ffff:127.0.0.1]:7000", largest, Some(largest)),
        ("0.0.0.0:7000", 1200, Some(largest)),
        ("[::]:7000", 1200, Some(largest)),
        ("10.1.2.3:7000", 1200, None),
    ] {
        let settings = TransportSettings::jumbo().automatic_mtu(addr.parse().unwrap());
        assert_eq!(settings.mtu, start, "{addr}");
        match up_to {
            Some(up_to) => assert_eq!(settings.max_mtu, up_to, "{addr}"),
            None => assert!((1200..=largest).contains(&settings.max_mtu), "{addr}"),
        }
        settings.validate().unwrap();
        // A given MTU is kept, fixed, wherever the address; none is the automatic sizes.
        let given = TransportSettings::default().with_mtu(Some(6000), addr.parse().unwrap());
        assert_eq!((given.mtu, given.max_mtu), (6000, 6000), "{addr}");
        let none = TransportSettings::default().with_mtu(None, addr.parse().unwrap());
        assert_eq!(
            (none.mtu, none.max_mtu),
            (start, settings.max_mtu),
            "{addr}"
        );
    }
}

#[tokio::test]
async fn a_cancel_flood_closes_the_connection() {
    let mut config = receiver_config();
    config.session.max_failed_streams = 5;
    let (mut rx, addr) = receiver(config).await;
    tokio::spawn(async move {
        while let Some(incoming) = rx.next().await {
            incoming.reject(ErrorCode::REJECTED, "no");
        }
    });
    let tx = sender(addr).await;
    let mut last = None;
    for i in 0..20 {
        match tx
            .send(u8_meta(&format!("f{i}"), 10), pattern(10, i))
            .finished()
            .await
        {
            Err(TransportError::Connection(e)) => {
                last = Some(e.to_string());
                break;
            }
            Err(_) => {}
            Ok(_) => panic!("rejected tensors cannot complete"),
        }
    }
    let last = last.expect("the connection was closed");
    assert!(
        last.contains(&format!("{}", VarInt::from_u32(ErrorCode::CANCEL_FLOOD.0)))
            || last.contains("528"),
        "{last}"
    );
    let _ = Bytes::new();
}
