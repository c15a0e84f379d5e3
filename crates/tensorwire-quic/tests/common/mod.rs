//! Helpers for the loopback tests: receivers on ephemeral ports, senders, patterned data.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used)] // Test helpers; each binary uses some.

use std::net::SocketAddr;
use std::time::Duration;

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use tensorwire_quic::proto::{
    DType, ErrorCode, Frame, FrameDecoder, Limits, ProtocolError, TensorMeta,
};
use tensorwire_quic::{
    BindingChoice, Receiver, ReceiverConfig, Sender, SenderConfig, TransportError,
    TransportSettings,
};

/// Loopback, development TLS, jumbo MTU, short timeouts.
pub fn receiver_config() -> ReceiverConfig {
    let mut config = ReceiverConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        tensorwire_quic::ServerTls::Development,
    );
    config.transport = TransportSettings::jumbo();
    config.session.progress_timeout = Duration::from_secs(10);
    config
}

/// Binds a receiver; returns it with its address.
pub async fn receiver(config: ReceiverConfig) -> (Receiver, SocketAddr) {
    let receiver = Receiver::bind(config).await.unwrap();
    let addr = receiver.local_addr().unwrap();
    (receiver, addr)
}

/// Connects a sender with development trust and jumbo MTU, over the binding
/// [`test_binding`] names.
pub async fn sender(addr: SocketAddr) -> Sender {
    Sender::connect(addr, sender_config()).await.unwrap()
}

/// A sender's configuration: development trust, jumbo MTU, the binding [`test_binding`]
/// names.
pub fn sender_config() -> SenderConfig {
    let mut config = SenderConfig::new(tensorwire_quic::ClientTls::Development);
    config.transport = TransportSettings::jumbo();
    config.binding = test_binding();
    config
}

/// The binding the tests' senders use: `TENSORWIRE_TEST_BINDING` (`quic`, `tcp` or `auto`),
/// so that the same tests run over both (spec §16); UDP when unset.
pub fn test_binding() -> BindingChoice {
    match std::env::var("TENSORWIRE_TEST_BINDING") {
        Ok(name) => name
            .parse()
            .unwrap_or_else(|e| panic!("TENSORWIRE_TEST_BINDING: {e}")),
        Err(_) => BindingChoice::Udp,
    }
}

/// Deterministic bytes that differ per seed and are never all zero.
pub fn pattern(len: usize, seed: u64) -> Bytes {
    tensorwire_proto::testing::pattern(len, seed).into()
}

/// The next tensor, accepted into host memory, once it has finished (or failed).
pub async fn receive_host(rx: &mut Receiver) -> Result<(TensorMeta, Bytes), TransportError> {
    let incoming = rx.next().await.expect("a tensor arrives");
    finish_host(incoming).await
}

/// Accepts `incoming` into host memory and waits until it landed.
pub async fn land_host(incoming: tensorwire_quic::IncomingTensor) -> (TensorMeta, Bytes) {
    finish_host(incoming).await.expect("the tensor lands")
}

/// Accepts `incoming` into host memory; its end, landed or failed.
async fn finish_host(
    incoming: tensorwire_quic::IncomingTensor,
) -> Result<(TensorMeta, Bytes), TransportError> {
    incoming
        .accept_host()
        .await
        .expect("host memory")
        .finished()
        .await
}

/// A named one-dimensional U8 tensor of `len` bytes.
pub fn u8_meta(name: &str, len: usize) -> TensorMeta {
    TensorMeta::new([len as u64], DType::U8)
        .unwrap()
        .with_name(name)
}

/// Logs to the test output when `RUST_LOG` is set.
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

pub fn remote_code(err: &TransportError) -> Option<ErrorCode> {
    match err {
        TransportError::Protocol(ProtocolError::Remote { code, .. }) => Some(*code),
        _ => None,
    }
}

/// Every credit byte is back, but the early credit (spec §7.6) offered to connections still
/// open.
pub async fn assert_budget_returned(rx: &Receiver) {
    for _ in 0..100 {
        let b = rx.budget();
        if b.in_flight == b.early_offered && b.held == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("budget not returned: {:?}", rx.budget());
}

/// A raw QUIC connection with development trust, for peers that break the rules.
pub async fn raw_connection(
    addr: std::net::SocketAddr,
    alpn: &[u8],
) -> Result<quinn::Connection, String> {
    raw_endpoint_connection(addr, alpn)
        .await
        .map(|(_, connection)| connection)
}

/// A raw QUIC connection with development trust, and the client endpoint it runs on.
pub async fn raw_endpoint_connection(
    addr: std::net::SocketAddr,
    alpn: &[u8],
) -> Result<(quinn::Endpoint, quinn::Connection), String> {
    raw_connection_from(addr, alpn, "127.0.0.1".parse().unwrap()).await
}

/// As [`raw_endpoint_connection`], from the local address `from` (any of 127.0.0.0/8 is
/// this host's): a peer of its own, as the receiver counts peers. Over TCP (spec §16) when
/// [`test_binding`] says so.
pub async fn raw_connection_from(
    addr: std::net::SocketAddr,
    alpn: &[u8],
    from: std::net::IpAddr,
) -> Result<(quinn::Endpoint, quinn::Connection), String> {
    let endpoint = match test_binding() {
        BindingChoice::Tcp => raw_tcp_endpoint(addr, from).await,
        _ => quinn::Endpoint::client(std::net::SocketAddr::new(from, 0)).unwrap(),
    };
    raw_connection_on(endpoint, addr, alpn).await
}

/// As [`raw_endpoint_connection`], over UDP whatever [`test_binding`] says: for what only
/// UDP has (connection migration).
pub async fn raw_udp_connection(
    addr: std::net::SocketAddr,
    alpn: &[u8],
) -> Result<(quinn::Endpoint, quinn::Connection), String> {
    let endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    raw_connection_on(endpoint, addr, alpn).await
}

async fn raw_connection_on(
    endpoint: quinn::Endpoint,
    addr: std::net::SocketAddr,
    alpn: &[u8],
) -> Result<(quinn::Endpoint, quinn::Connection), String> {
    let connecting = endpoint
        .connect_with(raw_client_config(addr, alpn), addr, "localhost")
        .unwrap();
    let connection = connecting.await.map_err(|e| e.to_string())?;
    Ok((endpoint, connection))
}

/// A raw quinn client endpoint on a TCP connection from `from` to `addr` (spec §16).
pub async fn raw_tcp_endpoint(
    addr: std::net::SocketAddr,
    from: std::net::IpAddr,
) -> quinn::Endpoint {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(std::net::SocketAddr::new(from, 0)).unwrap();
    let stream = socket.connect(addr).await.unwrap().into_std().unwrap();
    TransportSettings::default()
        .over_tcp()
        .tcp_endpoint(stream, None)
        .unwrap()
}

/// A client configuration with development trust in the receiver at `addr`, offering `alpn`.
pub fn raw_client_config(addr: std::net::SocketAddr, alpn: &[u8]) -> quinn::ClientConfig {
    let cert = std::fs::read(tensorwire_quic::dev_cert_path(addr)).unwrap();
    let mut roots = rustls::RootCertStore::empty();
    use rustls::pki_types::pem::PemObject;
    roots
        .add(rustls::pki_types::CertificateDer::from_pem_slice(&cert).unwrap())
        .unwrap();
    let mut tls =
        rustls::ClientConfig::builder_with_provider(tensorwire_quic::tls::crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
    tls.alpn_protocols = vec![alpn.to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap();
    quinn::ClientConfig::new(Arc::new(crypto))
}

/// Writes `frames` on a new stream; returns the frames the receiver answers with.
pub async fn raw_exchange(
    conn: &quinn::Connection,
    frames: &[Frame],
    wait_for_credit: bool,
) -> Vec<Frame> {
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    let mut decoder = FrameDecoder::new(Limits::default());
    let mut answers = Vec::new();
    let (first, rest) = frames.split_first().unwrap();
    send.write_all(&first.to_bytes()).await.unwrap();
    if wait_for_credit {
        while !answers.iter().any(|f| matches!(f, Frame::Credit(_))) {
            let chunk = recv.read_chunk(usize::MAX, true).await.unwrap().unwrap();
            decoder.push(chunk.bytes);
            while let Some(f) = decoder.next_frame().unwrap() {
                answers.push(f);
            }
        }
    }
    let mut wire = BytesMut::new();
    rest.iter().for_each(|f| f.encode(&mut wire));
    let _ = send.write_all(&wire).await;
    let _ = send.finish();
    while let Ok(Some(chunk)) = recv.read_chunk(usize::MAX, true).await {
        decoder.push(chunk.bytes);
        while let Ok(Some(f)) = decoder.next_frame() {
            answers.push(f);
        }
    }
    answers
}

pub fn cancel_code(answers: &[Frame]) -> Option<ErrorCode> {
    answers.iter().find_map(|f| match f {
        Frame::Cancel(c) => Some(c.code),
        Frame::Reject(r) => Some(r.code),
        _ => None,
    })
}

/// A UDP relay on loopback standing for a network path that carries datagrams of at most
/// `path_mtu` bytes: larger ones are dropped both ways, as a router drops them. Returns the
/// address to connect to instead of `to`, and a count of the datagrams dropped for their size.
pub async fn narrow_path(
    to: SocketAddr,
    path_mtu: usize,
) -> (SocketAddr, Arc<std::sync::atomic::AtomicU64>) {
    use std::sync::atomic::{AtomicU64, Ordering};
    // Large buffers: datagrams the relay drops for want of room would look like a path that
    // lost its large packets (quinn's black-hole detection), not like congestion.
    let bind = || {
        let socket = socket2::Socket::new(
            socket2::Domain::IPV4,
            socket2::Type::DGRAM,
            Some(socket2::Protocol::UDP),
        )
        .unwrap();
        let _ = socket.set_recv_buffer_size(16 << 20);
        socket.set_nonblocking(true).unwrap();
        socket
            .bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into())
            .unwrap();
        tokio::net::UdpSocket::from_std(socket.into()).unwrap()
    };
    let (front, back) = (bind(), bind());
    back.connect(to).await.unwrap();
    let addr = front.local_addr().unwrap();
    let dropped = Arc::new(AtomicU64::new(0));
    let counter = dropped.clone();
    tokio::spawn(async move {
        let (mut forward, mut backward) = (vec![0; 1 << 16], vec![0; 1 << 16]);
        let mut peer = None;
        loop {
            tokio::select! {
                Ok((n, from)) = front.recv_from(&mut forward) => {
                    peer = Some(from);
                    if n > path_mtu {
                        counter.fetch_add(1, Ordering::Relaxed);
                    } else {
                        let _ = back.send(&forward[..n]).await;
                    }
                }
                Ok(n) = back.recv(&mut backward) => {
                    if n > path_mtu {
                        counter.fetch_add(1, Ordering::Relaxed);
                    } else if let Some(peer) = peer {
                        let _ = front.send_to(&backward[..n], peer).await;
                    }
                }
            }
        }
    });
    (addr, dropped)
}

/// A stream source whose items come when the test sends them.
pub struct ChannelStream(pub tokio::sync::mpsc::Receiver<std::io::Result<Bytes>>);

impl futures_core::Stream for ChannelStream {
    type Item = std::io::Result<Bytes>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.0.poll_recv(cx)
    }
}

/// Chunks as `Source::Stream` takes them.
pub type ChunkStream =
    std::pin::Pin<Box<dyn futures_core::Stream<Item = std::io::Result<Bytes>> + Send>>;

/// A stream over a list of chunks, without pulling in a stream-utilities crate.
pub fn chunk_stream(items: Vec<std::io::Result<Bytes>>) -> ChunkStream {
    let (feed, queued) = tokio::sync::mpsc::channel(items.len().max(1));
    for item in items {
        feed.try_send(item).unwrap();
    }
    Box::pin(ChannelStream(queued))
}

/// Waits (bounded, 10 s) until `done` holds for the receiver.
pub async fn eventually(rx: &Receiver, what: &str, done: impl Fn(&Receiver) -> bool) {
    for _ in 0..500 {
        if done(rx) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("not {what}: {:?} {:?}", rx.metrics(), rx.budget());
}
