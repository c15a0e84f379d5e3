//! Helpers for the loopback tests: receivers on ephemeral ports, senders, patterned data.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used)] // Test helpers; each binary uses some.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use tensorwire_quic::proto::{DType, TensorMeta};
use tensorwire_quic::{
    Receiver, ReceiverConfig, Sender, SenderConfig, TransportError, TransportSettings,
};

/// Loopback, development TLS, jumbo MTU, short timeouts.
pub fn receiver_config() -> ReceiverConfig {
    let mut config = ReceiverConfig::new("127.0.0.1:0".parse().unwrap());
    config.transport = TransportSettings::jumbo();
    config.progress_timeout = Duration::from_secs(10);
    config
}

/// Binds a receiver; returns it with its address.
pub async fn receiver(config: ReceiverConfig) -> (Receiver, SocketAddr) {
    let receiver = Receiver::bind(config).await.unwrap();
    let addr = receiver.local_addr().unwrap();
    (receiver, addr)
}

/// Connects a sender with development trust and jumbo MTU.
pub async fn sender(addr: SocketAddr) -> Sender {
    let config = SenderConfig {
        transport: TransportSettings::jumbo(),
        ..SenderConfig::default()
    };
    Sender::connect(addr, config).await.unwrap()
}

/// Deterministic bytes that differ per seed and are never all zero.
pub fn pattern(len: usize, seed: u64) -> Bytes {
    tensorwire_proto::testing::pattern(len, seed).into()
}

/// The next tensor, accepted into host memory, once it has finished (or failed).
pub async fn receive_host(rx: &mut Receiver) -> Result<(TensorMeta, Bytes), TransportError> {
    let incoming = rx.next().await.expect("a tensor arrives");
    incoming
        .accept_host()
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
