//! The TCP binding (spec §16): tensors arrive over TCP as over UDP; `Auto` keeps UDP where
//! it answers and falls back to TCP where UDP is silent; a receiver refuses what breaks the
//! framing, closes TCP connections that never start a handshake, and caps how many it holds.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::{eventually, init_tracing, land_host, pattern, receiver, receiver_config, u8_meta};
use tensorwire_quic::{
    Binding, BindingChoice, ClientTls, Listening, Receiver, Sender, SenderConfig, TransportError,
    TransportSettings,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn sender_config(binding: BindingChoice) -> SenderConfig {
    let mut config = SenderConfig::new(ClientTls::Development);
    config.transport = TransportSettings::jumbo();
    config.binding = binding;
    config
}

/// Sends tensors of `lens` bytes on `sender` and checks each lands intact at `rx`.
async fn send_and_land(sender: &Sender, rx: &mut Receiver, lens: &[usize]) {
    for (seed, &len) in lens.iter().enumerate() {
        let bytes = pattern(len, seed as u64);
        let sending = sender.send(u8_meta(&format!("t{seed}"), len), bytes.clone());
        let (meta, landed) = land_host(rx.next().await.unwrap()).await;
        assert_eq!(meta.name(), format!("t{seed}"));
        assert!(landed == bytes, "tensor {seed} of {len} bytes differs");
        sending.finished().await.unwrap();
    }
}

/// A tensor of `len` bytes from a new sender over TCP lands intact at `rx`.
async fn lands_over_tcp(addr: SocketAddr, rx: &mut Receiver, len: usize) {
    let sender = Sender::connect(addr, sender_config(BindingChoice::Tcp))
        .await
        .unwrap();
    send_and_land(&sender, rx, &[len]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tensors_arrive_over_tcp_as_over_udp() {
    init_tracing();
    let (mut rx, addr) = receiver(receiver_config()).await;
    let sender = Sender::connect(addr, sender_config(BindingChoice::Tcp))
        .await
        .unwrap();
    assert_eq!(sender.binding(), Binding::Tcp);
    send_and_land(&sender, &mut rx, &[0, 1, 4096, 3 << 20, 64 << 20]).await;
    let connections = rx.connections();
    assert_eq!(connections.len(), 1);
    assert_eq!(connections[0].binding, Binding::Tcp);
    // The QUIC connection inside carries packets far larger than an Ethernet frame.
    assert!(sender.connection_stats().path.current_mtu > 60_000);
    sender.close().await;
    common::assert_budget_returned(&rx).await;
    rx.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_keeps_udp_where_it_answers() {
    init_tracing();
    let (mut rx, addr) = receiver(receiver_config()).await;
    let sender = Sender::connect(addr, sender_config(BindingChoice::Auto))
        .await
        .unwrap();
    assert_eq!(sender.binding(), Binding::Udp);
    send_and_land(&sender, &mut rx, &[1000]).await;
    assert_eq!(rx.connections()[0].binding, Binding::Udp);
}

/// A pool under `Auto` lets its first connection find the binding and opens the others
/// over it: with UDP silent, every connection goes over TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_opens_every_connection_over_what_its_first_found() {
    let mut config = receiver_config();
    config.listening = Listening::Tcp;
    let (mut rx, addr) = receiver(config).await;
    let pool = tensorwire_quic::SenderPool::connect(addr, sender_config(BindingChoice::Auto), 3)
        .await
        .unwrap();
    assert_eq!((pool.connections(), pool.binding()), (3, Binding::Tcp));
    let sending = pool.send(u8_meta("pooled", 4096), pattern(4096, 9));
    land_host(rx.next().await.unwrap()).await;
    sending.finished().await.unwrap();
    // The receiver serves a connection once its side of the handshake is done, which may
    // come after the pool's.
    eventually(&rx, "serving the pool's three connections", |rx| {
        rx.connections().len() == 3
    })
    .await;
    let bindings: Vec<Binding> = rx.connections().iter().map(|c| c.binding).collect();
    assert_eq!(bindings, [Binding::Tcp; 3]);
}

/// UDP silent (a receiver on TCP only answers nothing over UDP, as a firewall that drops
/// UDP would): `Auto` connects over TCP after UDP's head start, and the tensor arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_falls_back_to_tcp_where_udp_is_silent() {
    init_tracing();
    let mut config = receiver_config();
    config.listening = Listening::Tcp;
    let (mut rx, addr) = receiver(config).await;
    let sender = Sender::connect(addr, sender_config(BindingChoice::Auto))
        .await
        .unwrap();
    assert_eq!(sender.binding(), Binding::Tcp);
    send_and_land(&sender, &mut rx, &[5000, 2 << 20]).await;
    // UDP alone gets nowhere.
    let mut udp = sender_config(BindingChoice::Udp);
    udp.transport.idle_timeout = Duration::from_millis(1500);
    udp.transport.keep_alive = Duration::from_millis(500);
    assert!(Sender::connect(addr, udp).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_to_a_receiver_on_udp_only_names_the_cause() {
    let mut config = receiver_config();
    config.listening = Listening::Udp;
    let (_rx, addr) = receiver(config).await;
    let error = Sender::connect(addr, sender_config(BindingChoice::Tcp))
        .await
        .err()
        .unwrap();
    assert!(
        matches!(&error, TransportError::TcpConnect { addr: at, .. } if *at == addr),
        "{error}"
    );
    assert!(error.to_string().contains("over TCP"), "{error}");
}

/// Nothing answers on either binding: `Auto` fails naming both causes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_with_nothing_listening_names_both_causes() {
    // A UDP port that swallows datagrams, with no TCP listener on its number.
    let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = silent.local_addr().unwrap();
    // Development trust looks for the certificate of a receiver on that port: lend it one.
    let (_rx, real) = receiver(receiver_config()).await;
    let cert = tensorwire_quic::dev_cert_path(addr);
    std::fs::copy(tensorwire_quic::dev_cert_path(real), &cert).unwrap();
    let mut config = sender_config(BindingChoice::Auto);
    config.transport.idle_timeout = Duration::from_millis(2500);
    config.transport.keep_alive = Duration::from_millis(500);
    let error = Sender::connect(addr, config).await.err().unwrap();
    let _ = std::fs::remove_file(&cert);
    let TransportError::Unreachable { udp, tcp, .. } = &error else {
        panic!("{error}");
    };
    assert!(matches!(**udp, TransportError::Connection(_)), "{udp}");
    assert!(matches!(**tcp, TransportError::TcpConnect { .. }), "{tcp}");
}

/// Reads from `stream` until the peer closes it; whether it did within `within`.
async fn closed_within(stream: &mut tokio::net::TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 4096];
    tokio::time::timeout(within, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .is_ok()
}

/// Broken framing (a length above QUIC's largest packet) closes that TCP connection; a
/// silent one is closed at the idle timeout; both leave the receiver serving others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_framing_and_silence_close_the_tcp_connection() {
    init_tracing();
    let mut config = receiver_config();
    config.transport.idle_timeout = Duration::from_millis(1500);
    config.transport.keep_alive = Duration::from_millis(500);
    let (mut rx, addr) = receiver(config).await;
    let mut broken = tokio::net::TcpStream::connect(addr).await.unwrap();
    broken.write_all(&[0xff, 0xff, 1, 2, 3]).await.unwrap();
    assert!(closed_within(&mut broken, Duration::from_secs(5)).await);
    let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();
    assert!(closed_within(&mut silent, Duration::from_secs(10)).await);
    lands_over_tcp(addr, &mut rx, 777).await;
}

/// TCP connections that have not started a handshake are capped per peer (spec §10, §16):
/// past the cap the peer's next one is closed at once, those within it wait, and another
/// peer is not affected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_tcp_connections_are_capped_per_peer() {
    let mut config = receiver_config();
    config.max_connections_per_peer = 2;
    let (mut rx, addr) = receiver(config).await;
    let silent = || async {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        socket.connect(addr).await.unwrap()
    };
    let mut first = silent().await;
    let _second = silent().await;
    let mut third = silent().await;
    assert!(closed_within(&mut third, Duration::from_secs(5)).await);
    assert!(!closed_within(&mut first, Duration::from_millis(300)).await);
    lands_over_tcp(addr, &mut rx, 4096).await;
}

/// One QUIC connection per TCP connection (spec §16): a second one on the same TCP
/// connection is refused, and the first goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_quic_connection_on_one_tcp_connection_is_refused() {
    let (_rx, addr) = receiver(receiver_config()).await;
    let endpoint = common::raw_tcp_endpoint(addr, "127.0.0.1".parse().unwrap()).await;
    let alpn = tensorwire_quic::proto::ALPN;
    let config = common::raw_client_config(addr, alpn);
    let first = endpoint
        .connect_with(config.clone(), addr, "localhost")
        .unwrap()
        .await
        .unwrap();
    let second = endpoint
        .connect_with(config, addr, "localhost")
        .unwrap()
        .await;
    assert!(
        matches!(second, Err(quinn::ConnectionError::ConnectionClosed(ref close))
            if close.error_code == quinn::TransportErrorCode::CONNECTION_REFUSED),
        "{second:?}"
    );
    // The first still works: it opens a stream, which the receiver reads.
    let (mut send, _recv) = first.open_bi().await.unwrap();
    send.write_all(&[0x01]).await.unwrap();
    assert!(first.close_reason().is_none());
}

/// Every address a receiver reports for a TCP connection is its peer's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tcp_connection_reports_its_peer() {
    let (mut rx, addr) = receiver(receiver_config()).await;
    let sender = Sender::connect(addr, sender_config(BindingChoice::Tcp))
        .await
        .unwrap();
    send_and_land(&sender, &mut rx, &[10]).await;
    let remote: SocketAddr = rx.connections()[0].remote;
    assert_eq!(remote.ip(), addr.ip());
    assert_eq!(sender.peer(), addr);
}
