//! Hostile and faulty peers, driven by a raw QUIC connection: every case ends with the
//! documented code, the stream or connection freed, and the budgets counted back.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::time::Duration;

use bytes::BytesMut;
use common::{
    assert_budget_returned, eventually, init_tracing, land_host, pattern, raw_connection,
    raw_exchange, receive_host, receiver, receiver_config, remote_code, sender, u8_meta,
};
use quinn::VarInt;
use tensorwire_quic::Receiver;
use tensorwire_quic::proto::frame::{Cancel, Data, End};
use tensorwire_quic::proto::{ErrorCode, Frame, checksum};

/// Spec §4: a sender may finish its half right after END. Each of these raw senders does,
/// at once; every tensor must complete (a FIN racing the sink used to read as TRUNCATED).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fin_right_after_end_is_not_truncation() {
    init_tracing();
    let (mut rx, addr) = receiver(receiver_config()).await;
    let server = tokio::spawn(async move {
        let mut done = Vec::new();
        for _ in 0..24 {
            let handle = rx.next().await.unwrap().accept_host().await.unwrap();
            done.push(handle.finished().await.map(|(m, _)| m.name().to_owned()));
        }
        (done, rx)
    });
    let raw = raw_connection(addr, b"tensorwire/1").await.unwrap();
    for i in 0..24u64 {
        let bytes = pattern(1000, i);
        let frames: Vec<Frame> = vec![
            u8_meta(&format!("t{i}"), 1000).into(),
            Data::new(0, bytes.clone()).into(),
            End {
                checksum: u64::from(checksum::crc32c(&bytes)),
            }
            .into(),
        ];
        let answers = raw_exchange(&raw, &frames, true).await;
        assert!(
            answers.iter().any(|f| matches!(f, Frame::Complete(_))),
            "tensor {i}: {answers:?}"
        );
    }
    let (done, rx) = server.await.unwrap();
    assert!(done.iter().all(Result::is_ok), "{done:?}");
    assert_budget_returned(&rx).await;
}

/// A peer that cancels or resets tensors the application has not decided on yet frees
/// them at once: the application sees them closed, and they count as failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tensors_cancelled_or_reset_while_awaiting_a_decision_end_at_once() {
    init_tracing();
    let (mut rx, addr) = receiver(receiver_config()).await;
    let raw = raw_connection(addr, b"tensorwire/1").await.unwrap();
    let mut wire = BytesMut::new();
    Frame::from(u8_meta("cancelled", 100)).encode(&mut wire);
    Frame::from(Cancel::new(ErrorCode::CANCELLED, "changed my mind")).encode(&mut wire);
    let (mut send, _recv_a) = raw.open_bi().await.unwrap();
    send.write_all(&wire).await.unwrap();
    send.finish().unwrap();
    let (mut send, _recv_b) = raw.open_bi().await.unwrap();
    send.write_all(&Frame::from(u8_meta("reset", 100)).to_bytes())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    send.reset(VarInt::from_u32(ErrorCode::CANCELLED.0))
        .unwrap();
    // Nobody decides: both streams must end on their own, well before any timeout.
    eventually(&rx, "both failed", |rx| rx.metrics().tensors_failed == 2).await;
    // Those that reached the queue before they ended are marked closed.
    while let Ok(Some(incoming)) = tokio::time::timeout(Duration::from_millis(300), rx.next()).await
    {
        assert!(
            incoming.is_closed(),
            "{} still open",
            incoming.meta().name()
        );
    }
    assert_budget_returned(&rx).await;
}

/// Spec §10: one connection's undecided tensors cannot fill the receiver's queue; a
/// legitimate sender on another connection is still served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_peer_holding_many_undecided_tensors_does_not_starve_another() {
    let mut config = receiver_config();
    config.session.max_undecided = 3;
    let (mut rx, addr) = receiver(config).await;
    let raw = raw_connection(addr, b"tensorwire/1").await.unwrap();
    let mut hogs = Vec::new();
    for i in 0..20 {
        let (mut send, recv) = raw.open_bi().await.unwrap();
        let meta = Frame::from(u8_meta(&format!("hog{i}"), 100)).to_bytes();
        send.write_all(&meta).await.unwrap();
        hogs.push((send, recv));
    }
    // The hog's first three reach the application, which holds them undecided.
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(rx.next().await.unwrap());
    }
    let good = sender(addr).await;
    let send = good.send(u8_meta("good", 1 << 20), pattern(1 << 20, 9));
    let incoming = tokio::time::timeout(Duration::from_secs(10), rx.next())
        .await
        .expect("the other connection's tensor reached the application")
        .unwrap();
    assert_eq!(incoming.meta().name(), "good");
    let (_, bytes) = land_host(incoming).await;
    assert_eq!(bytes, pattern(1 << 20, 9));
    send.finished().await.unwrap();
    drop(held);
}

/// Spec §3, §4.1: the first unidirectional stream is the peer's control stream; a second one
/// is stopped with UNEXPECTED_FRAME.
#[tokio::test]
async fn a_second_unidirectional_stream_is_stopped_with_unexpected_frame() {
    let (_rx, addr) = receiver(receiver_config()).await;
    let raw = raw_connection(addr, b"tensorwire/1").await.unwrap();
    let mut control = raw.open_uni().await.unwrap();
    let offer = tensorwire_proto::frame::EarlyCredit {
        bytes: 4096,
        max_data_payload: 4096,
    };
    control
        .write_all(&Frame::from(offer).to_bytes())
        .await
        .unwrap();
    let mut uni = raw.open_uni().await.unwrap();
    let _ = uni
        .write_all(&Frame::from(u8_meta("uni", 10)).to_bytes())
        .await;
    let stopped = tokio::time::timeout(Duration::from_secs(10), uni.stopped())
        .await
        .expect("the receiver stopped the stream")
        .unwrap();
    assert_eq!(
        stopped,
        Some(VarInt::from_u32(ErrorCode::UNEXPECTED_FRAME.0))
    );
}

/// Spec §4.1: a control stream that carries anything but EARLY_CREDIT closes the connection
/// with UNEXPECTED_FRAME.
#[tokio::test]
async fn a_control_stream_with_another_frame_closes_the_connection() {
    let (_rx, addr) = receiver(receiver_config()).await;
    let raw = raw_connection(addr, b"tensorwire/1").await.unwrap();
    let mut control = raw.open_uni().await.unwrap();
    let _ = control
        .write_all(&Frame::from(u8_meta("uni", 10)).to_bytes())
        .await;
    let closed = tokio::time::timeout(Duration::from_secs(10), raw.closed())
        .await
        .expect("the receiver closed the connection");
    assert!(
        matches!(&closed, quinn::ConnectionError::ApplicationClosed(c)
            if c.error_code == VarInt::from_u32(ErrorCode::UNEXPECTED_FRAME.0)),
        "{closed:?}"
    );
}

/// Spec §4.1, §7.6: the receiver offers early credit on its control stream; a peer that stops
/// it (as a version 1.0 or 1.1 peer does) refuses the offer, and the credit returns to the
/// budget while the connection lives.
#[tokio::test]
async fn a_refused_early_credit_offer_returns_to_the_budget() {
    let (rx, addr) = receiver(receiver_config()).await;
    let raw = raw_connection(addr, b"tensorwire/1").await.unwrap();
    let mut control = tokio::time::timeout(Duration::from_secs(10), raw.accept_uni())
        .await
        .expect("the receiver opened its control stream")
        .unwrap();
    let offer = control.read_chunk(usize::MAX, true).await.unwrap().unwrap();
    let mut decoder = tensorwire_proto::FrameDecoder::new(Default::default());
    decoder.push(offer.bytes);
    let Some(Frame::EarlyCredit(offer)) = decoder.next_frame().unwrap() else {
        panic!("the control stream starts with EARLY_CREDIT");
    };
    assert_eq!(offer.bytes, receiver_config().session.early_credit);
    assert_eq!(rx.budget().early_offered, offer.bytes);
    control
        .stop(VarInt::from_u32(ErrorCode::UNEXPECTED_FRAME.0))
        .unwrap();
    for _ in 0..500 {
        let budget = rx.budget();
        if budget.early_offered == 0 && budget.in_flight == 0 {
            assert_eq!(raw.close_reason(), None, "the connection lives on");
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the refused offer stayed out: {:?}", rx.budget());
}

/// Spec §10: a connection that opens no tensor stream ends, even if its peer keeps it alive.
#[tokio::test]
async fn a_connection_that_never_opens_a_stream_is_closed() {
    let mut config = receiver_config();
    config.session.idle_timeout = Duration::from_millis(500);
    let (_rx, addr) = receiver(config).await;
    let raw = raw_connection(addr, b"tensorwire/1").await.unwrap();
    let closed = tokio::time::timeout(Duration::from_secs(20), raw.closed())
        .await
        .expect("the receiver closed the silent connection");
    match closed {
        quinn::ConnectionError::ApplicationClosed(close) => {
            assert_eq!(
                close.error_code,
                VarInt::from_u32(ErrorCode::PROGRESS_TIMEOUT.0)
            );
        }
        other => panic!("closed otherwise: {other}"),
    }
}

/// Spec §7.5: host memory is admitted before ACCEPT. A tensor larger than the budget is
/// refused at once; one that does not fit beside landed tensors waits, then is refused;
/// once the application drops a landed tensor its memory is admitted again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_memory_is_admitted_against_its_budget() {
    let mut config = receiver_config();
    config.host_memory_budget = 1 << 20;
    config.session.admission_timeout = Duration::from_millis(300);
    let (mut rx, addr) = receiver(config).await;
    let tx = sender(addr).await;

    // Larger than the whole budget: RESOURCE_EXHAUSTED, nothing committed.
    let huge = tx.send(u8_meta("huge", 2 << 20), pattern(2 << 20, 1));
    let err = rx.next().await.unwrap().accept_host().await.unwrap_err();
    assert_eq!(err.code, ErrorCode::RESOURCE_EXHAUSTED);
    let sent = huge.finished().await.unwrap_err();
    assert_eq!(
        remote_code(&sent),
        Some(ErrorCode::RESOURCE_EXHAUSTED),
        "{sent}"
    );

    // 700 KiB lands and is held by the application.
    let first = tx.send(u8_meta("first", 700 << 10), pattern(700 << 10, 2));
    let (_, kept) = receive_host(&mut rx).await.unwrap();
    first.finished().await.unwrap();
    assert_eq!(rx.host_memory().reserved, 700 << 10);

    // 700 KiB more does not fit beside it: it waits, then is refused.
    let second = tx.send(u8_meta("second", 700 << 10), pattern(700 << 10, 3));
    let err = rx.next().await.unwrap().accept_host().await.unwrap_err();
    assert_eq!(err.code, ErrorCode::RESOURCE_EXHAUSTED);
    assert!(err.message.contains("waited"), "{err}");
    assert_eq!(
        remote_code(&second.finished().await.unwrap_err()),
        Some(ErrorCode::RESOURCE_EXHAUSTED)
    );

    // Dropping the landed tensor gives its memory back.
    drop(kept);
    assert_eq!(rx.host_memory().reserved, 0);
    let third = tx.send(u8_meta("third", 700 << 10), pattern(700 << 10, 4));
    let (_, bytes) = receive_host(&mut rx).await.unwrap();
    assert_eq!(bytes, pattern(700 << 10, 4));
    third.finished().await.unwrap();
    assert_eq!(rx.host_memory().peak, 700 << 10);
    drop(bytes);
    assert_budget_returned(&rx).await;
}

/// Keeps every credit permit it is given: the bytes are never durable, so their credit never
/// comes back.
struct HoardingSink(Vec<tensorwire_quic::CreditPermit>);

impl tensorwire_quic::Sink for HoardingSink {
    type Output = ();

    async fn store(
        &mut self,
        _offset: u64,
        payload: tensorwire_quic::proto::Payload,
        permit: tensorwire_quic::CreditPermit,
        crc: Option<&mut u32>,
    ) -> Result<(), tensorwire_quic::SinkError> {
        payload.continue_crc(crc);
        self.0.push(permit);
        Ok(())
    }

    async fn finish(self) -> Result<(), tensorwire_quic::SinkError> {
        std::future::pending().await
    }
}

/// A tensor accepted but never granted credit (the budget is held elsewhere) fails at the
/// sender with PROGRESS_TIMEOUT after its progress timeout, although the connection is alive
/// and keep-alives are answered: silence about this tensor is not progress.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_accepted_tensor_without_credit_times_out_at_the_sender() {
    let config = receiver_config().with_budget(1 << 20);
    let (mut rx, addr) = receiver(config).await;
    let tx = tensorwire_quic::Sender::connect(addr, {
        let mut config =
            tensorwire_quic::SenderConfig::new(tensorwire_quic::ClientTls::Development);
        config.transport = tensorwire_quic::TransportSettings::jumbo();
        config.progress_timeout = Duration::from_millis(1500);
        config
    })
    .await
    .unwrap();
    let hog = tx.send(u8_meta("hog", 4 << 20), pattern(4 << 20, 1));
    let _hog_handle = rx.next().await.unwrap().accept(HoardingSink(Vec::new()));
    let starved = tx.send(u8_meta("starved", 1 << 20), pattern(1 << 20, 2));
    let _starved_handle = rx.next().await.unwrap().accept(HoardingSink(Vec::new()));
    let err = tokio::time::timeout(Duration::from_secs(30), starved.finished())
        .await
        .expect("the sender gave up on its own")
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::PROGRESS_TIMEOUT), "{err}");
    assert!(err.to_string().contains("answer from the peer"), "{err}");
    let _ = hog.finished().await;
}

/// A sender whose tensor fails on its side (its source ends early) tells the receiver why
/// with CANCEL before the application closes the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_senders_cancel_reaches_the_receiver_before_close() {
    let (mut rx, addr) = receiver(receiver_config()).await;
    let tx = sender(addr).await;
    // Claims 2 MiB, has 1 MiB: the sender fails with an IO error mid-tensor.
    let short = tx.send(u8_meta("short", 2 << 20), pattern(1 << 20, 3));
    let handle = rx.next().await.unwrap().accept_host().await.unwrap();
    assert!(short.finished().await.is_err());
    tx.close().await; // At once, as a program does after a failure.
    let err = handle.finished().await.unwrap_err();
    assert!(
        remote_code(&err).is_some_and(|code| code != ErrorCode::TRUNCATED_FRAME),
        "the receiver learned the sender's code, not a lost connection: {err}"
    );
    assert_budget_returned(&rx).await;
}

/// Spec §7.1, §7.5: a peer whose accepted tensors idle (METADATA, then no DATA) holds at most
/// its connection's share of host memory and credit; a legitimate sender on another
/// connection is admitted and lands at once instead of waiting out the admission timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_idling_in_accepted_tensors_holds_only_its_share() {
    let mut config = receiver_config()
        .with_budget(8 << 20)
        .with_host_memory_budget(4 << 20);
    config.session.stream_window = 1 << 20;
    config.session.admission_timeout = Duration::from_secs(20);
    let (rx, addr) = receiver(config).await;
    let host = rx.host_memory_budget();
    let (app, mut landed) = accept_everything(rx);
    let hog = raw_connection(addr, b"tensorwire/1").await.unwrap();
    let mut idle = Vec::new();
    for i in 0..8 {
        let (mut send, recv) = hog.open_bi().await.unwrap();
        let meta = Frame::from(u8_meta(&format!("idle{i}"), 1 << 20)).to_bytes();
        send.write_all(&meta).await.unwrap();
        idle.push((send, recv));
    }
    // The hog's share (half of 4 MiB) fills; its other tensors wait on their connection.
    for _ in 0..500 {
        if host.snapshot().reserved == 2 << 20 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(host.snapshot().reserved, 2 << 20, "the hog's share is full");

    let good = sender(addr).await;
    let send = good.send(u8_meta("good", 2 << 20), pattern(2 << 20, 5));
    expect_landed(&mut landed, "good", pattern(2 << 20, 5), 10).await;
    send.finished().await.unwrap();
    assert!(host.snapshot().peak <= 4 << 20, "{:?}", host.snapshot());
    drop(idle);
    hog.close(VarInt::from_u32(0), b"done");
    app.abort();
}

/// Each landed tensor's name and bytes (or failure).
type Landed = tokio::sync::mpsc::UnboundedReceiver<(String, Result<bytes::Bytes, String>)>;

/// A raw connection, its endpoint and the streams it keeps open.
type IdleConnection = (
    quinn::Endpoint,
    quinn::Connection,
    Vec<(quinn::SendStream, quinn::RecvStream)>,
);

/// Accepts every tensor into host memory, as `receiver` does; each landed tensor goes to the
/// returned channel.
fn accept_everything(mut rx: Receiver) -> (tokio::task::JoinHandle<()>, Landed) {
    let (landed_tx, landed) = tokio::sync::mpsc::unbounded_channel();
    let app = tokio::spawn(async move {
        while let Some(incoming) = rx.next().await {
            let landed_tx = landed_tx.clone();
            tokio::spawn(async move {
                let name = incoming.meta().name().to_owned();
                let landed = match incoming.accept_host().await {
                    Ok(handle) => handle
                        .finished()
                        .await
                        .map(|(_, b)| b)
                        .map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                };
                let _ = landed_tx.send((name, landed));
            });
        }
    });
    (app, landed)
}

/// Waits up to `seconds` for the next tensor to land, which must be `name` with `bytes`
/// (another tensor, or a failure, is named in the panic).
async fn expect_landed(landed: &mut Landed, name: &str, bytes: bytes::Bytes, seconds: u64) {
    let (got, result) = tokio::time::timeout(Duration::from_secs(seconds), landed.recv())
        .await
        .unwrap_or_else(|_| panic!("{name} did not land within {seconds} s"))
        .unwrap();
    assert!(got == name, "{got} landed first: {result:?}");
    assert!(result.unwrap() == bytes, "{name} arrived intact");
}

/// A peer of its own (127.0.0.2) that opens `connections` connections and, on each,
/// `per_connection` tensors of `len` bytes whose METADATA arrives and whose DATA never does.
async fn idling_peer(
    addr: std::net::SocketAddr,
    connections: usize,
    per_connection: usize,
    len: usize,
) -> Vec<IdleConnection> {
    let mut peer = Vec::new();
    for c in 0..connections {
        let from = std::net::IpAddr::from([127, 0, 0, 2]);
        let (endpoint, conn) = common::raw_connection_from(addr, b"tensorwire/1.4", from)
            .await
            .unwrap();
        let mut streams = Vec::new();
        for i in 0..per_connection {
            let (mut send, recv) = conn.open_bi().await.unwrap();
            let meta = Frame::from(u8_meta(&format!("idle{c}.{i}"), len)).to_bytes();
            send.write_all(&meta).await.unwrap();
            streams.push((send, recv));
        }
        peer.push((endpoint, conn, streams));
    }
    peer
}

/// Spec §7.5: a peer's connections together hold at most an equal share of host memory
/// while another peer is connected, however many connections it opens; the other peer's
/// tensor is admitted while the first peer's idle tensors still hold theirs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_with_many_connections_holds_only_its_share_of_memory() {
    let mut config = receiver_config()
        .with_budget(64 << 20)
        .with_host_memory_budget(4 << 20);
    config.session.stream_window = 1 << 20;
    // No cap per connection: only the peer's share stands between the hog and the budget.
    config.memory_share_percent = 100;
    config.session.admission_timeout = Duration::from_secs(60);
    config.session.progress_timeout = Duration::from_secs(60);
    let (rx, addr) = receiver(config).await;
    let host = rx.host_memory_budget();
    let good = sender(addr).await;
    eventually(&rx, "the first peer's connection", |rx| {
        rx.connections().len() == 1
    })
    .await;
    let (app, mut landed) = accept_everything(rx);
    let hog = idling_peer(addr, 4, 4, 1 << 20).await;
    // Two peers: the hog's share is half of 4 MiB; the rest of its tensors wait.
    for _ in 0..500 {
        if host.snapshot().reserved == 2 << 20 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        host.snapshot().reserved,
        2 << 20,
        "the hog holds its share, no more"
    );

    let send = good.send(u8_meta("good", 2 << 20), pattern(2 << 20, 5));
    expect_landed(&mut landed, "good", pattern(2 << 20, 5), 20).await;
    send.finished().await.unwrap();
    assert!(host.snapshot().peak <= 4 << 20, "{:?}", host.snapshot());
    for (_, conn, _) in &hog {
        assert!(
            conn.close_reason().is_none(),
            "the hog's tensors were still held"
        );
        conn.close(VarInt::from_u32(0), b"done");
    }
    app.abort();
}

/// Spec §7.1: a peer's connections together hold at most an equal share of the credit
/// budget in flight while another peer is connected: accepted tensors whose DATA never
/// comes cannot stop the other peer's tensor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_with_many_connections_holds_only_its_share_of_credit() {
    let mut config = receiver_config()
        .with_budget(4 << 20)
        .with_host_memory_budget(256 << 20);
    config.session.stream_window = 1 << 20;
    config.session.grant_unit = 256 << 10;
    config.session.connection_window = 4 << 20;
    config.memory_share_percent = 100;
    config.session.admission_timeout = Duration::from_secs(60);
    config.session.progress_timeout = Duration::from_secs(60);
    let (rx, addr) = receiver(config).await;
    let good = sender(addr).await;
    eventually(&rx, "the first peer's connection", |rx| {
        rx.connections().len() == 1
    })
    .await;
    let (app, mut landed) = accept_everything(rx);
    // 16 tensors of 1 MiB, each wanting its whole window: 16 MiB of credit asked for.
    let hog = idling_peer(addr, 4, 4, 1 << 20).await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    let len = 8 << 20;
    let send = good.send(u8_meta("good", len), pattern(len, 6));
    expect_landed(&mut landed, "good", pattern(len, 6), 20).await;
    send.finished().await.unwrap();
    for (_, conn, _) in &hog {
        assert!(
            conn.close_reason().is_none(),
            "the hog's tensors were still held"
        );
        conn.close(VarInt::from_u32(0), b"done");
    }
    app.abort();
}

/// Spec §10: connections are capped per peer (IP address) and in all, judged before the
/// handshake. At the cap in all, peers are served in turn: an idle connection of a peer
/// holding more than the newcomer is closed to make room; when every peer holds as few,
/// the newcomer is refused at once. A closed connection is counted back.
#[tokio::test]
async fn connections_are_capped_per_peer_and_in_all() {
    let mut config = receiver_config();
    config.max_connections_per_peer = 2;
    config.max_connections = 3;
    let (_rx, addr) = receiver(config).await;
    let from = |last: u8| std::net::IpAddr::from([127, 0, 0, last]);
    let connect = |last: u8| common::raw_connection_from(addr, b"tensorwire/1.4", from(last));
    let (_e1, a1) = connect(1).await.unwrap();
    let (_e2, a2) = connect(1).await.unwrap();
    let third = connect(1).await.map(|_| ());
    assert!(
        third.unwrap_err().contains("refused"),
        "a third from one peer"
    );
    let (_e3, b) = connect(2).await.unwrap();
    // Full (3 of 3): peer 1 holds two, so one of its idle connections makes room.
    let (_e4, c) = connect(3).await.unwrap();
    let closed = tokio::time::timeout(Duration::from_secs(5), async {
        tokio::select! {
            e = a1.closed() => e,
            e = a2.closed() => e,
        }
    })
    .await
    .expect("one of peer 1's connections closed");
    assert!(
        matches!(&closed, quinn::ConnectionError::ApplicationClosed(close)
            if close.error_code == VarInt::from_u32(ErrorCode::RESOURCE_EXHAUSTED.0)),
        "{closed}"
    );
    // Every peer holds one now: a fourth peer is refused.
    let refused = connect(4).await.map(|_| ());
    assert!(
        refused.unwrap_err().contains("refused"),
        "a fourth peer at the cap"
    );
    b.close(VarInt::from_u32(0), b"done");
    // Counted back once the receiver has seen the close: bounded wait.
    for attempt in 0.. {
        match connect(4).await {
            Ok(_) => break,
            Err(e) if attempt < 50 => {
                assert!(e.contains("refused"), "{e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("the closed connection was never counted back: {e}"),
        }
    }
    drop(c);
}

/// Spec §10: METADATA of the open streams is held against a budget; legal but large
/// METADATA beyond it is refused at once (RESOURCE_EXHAUSTED), and the budget comes back
/// once those streams end.
#[tokio::test]
async fn undecided_metadata_is_held_within_its_budget() {
    let mut config = receiver_config();
    config.metadata_budget = 100_000;
    config.memory_share_percent = 100;
    config.session.admission_timeout = Duration::from_millis(500);
    let (mut rx, addr) = receiver(config).await;
    let conn = raw_connection(addr, b"tensorwire/1.4").await.unwrap();
    // About 32.5 KB each: three fit, a fourth does not.
    let large = |i: usize| {
        (0..8).fold(u8_meta(&format!("m{i}"), 4), |meta, a| {
            meta.with_attribute(format!("attribute.{a}"), "x".repeat(4000))
        })
    };
    let mut streams = tokio::task::JoinSet::new();
    for i in 0..4 {
        let (conn, meta) = (conn.clone(), large(i));
        streams.spawn(async move { metadata_answer(&conn, meta).await });
    }
    let mut codes = Vec::new();
    while let Some(answers) = streams.join_next().await {
        let answer = answers.unwrap();
        let refused_for_metadata = matches!(&answer, Frame::Reject(r)
            if r.code == ErrorCode::RESOURCE_EXHAUSTED && r.reason.contains("METADATA"));
        codes.push((
            common::cancel_code(std::slice::from_ref(&answer)),
            refused_for_metadata,
        ));
    }
    let refused = codes.iter().filter(|(_, metadata)| *metadata).count();
    assert_eq!(refused, 1, "{codes:?}");
    // The three that waited were refused when their admission timed out; the budget is
    // back, so a fourth is taken now.
    let conn2 = conn.clone();
    let last = tokio::spawn(async move { metadata_answer(&conn2, large(9)).await });
    let incoming = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let incoming = rx.next().await.unwrap();
            if incoming.meta().name() == "m9" {
                break incoming;
            }
        }
    })
    .await
    .expect("the fifth METADATA reaches the application");
    incoming.reject(ErrorCode::CANCELLED, "enough");
    let _ = last.await;
}

/// Sends `meta` on a new stream, leaving the stream open (no END, no FIN); returns the
/// receiver's first answer.
async fn metadata_answer(
    conn: &quinn::Connection,
    meta: tensorwire_quic::proto::TensorMeta,
) -> Frame {
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    send.write_all(&Frame::from(meta).to_bytes()).await.unwrap();
    let mut decoder =
        tensorwire_quic::proto::FrameDecoder::new(tensorwire_quic::proto::Limits::default());
    loop {
        if let Some(frame) = decoder.next_frame().unwrap() {
            return frame;
        }
        let chunk = recv.read_chunk(usize::MAX, true).await.unwrap().unwrap();
        decoder.push(chunk.bytes);
    }
}
