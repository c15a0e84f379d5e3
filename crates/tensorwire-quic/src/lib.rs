//! tensorwire over QUIC: quinn + rustls endpoints that drive the sans-IO state machines of
//! `tensorwire-proto`.
//!
//! - [`Connection`] is one connection, whichever side opened it: it sends many tensors at
//!   once, one stream each, within credit, and receives its peer's
//!   ([`incoming`](Connection::incoming)): either endpoint may send (spec §3).
//! - [`Sender`] opens a connection to a receiver on an endpoint of its own.
//! - [`Receiver`] listens, yields each [`IncomingTensor`] for admission, and streams its bytes
//!   into a [`Sink`] under one receiver-wide byte budget ([`CreditPermit`]s return bytes to it).
//! - TLS 1.3 only, ALPN `tensorwire/1`, 0-RTT off; development certificates for one host,
//!   PEM files and optional mutual TLS for production.
//!
//! # Example: one tensor over loopback, into host memory
//!
//! ```
//! use tensorwire_proto::{DType, TensorMeta};
//! use tensorwire_quic::{ClientTls, Receiver, ReceiverConfig, Sender, SenderConfig, ServerTls};
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Development TLS: a self-signed certificate, trusted by senders of this user on this host.
//! let config = ReceiverConfig::new("127.0.0.1:0".parse()?, ServerTls::Development);
//! let mut receiver = Receiver::bind(config).await?;
//! let sender =
//!     Sender::connect(receiver.local_addr()?, SenderConfig::new(ClientTls::Development)).await?;
//!
//! let meta = TensorMeta::new([2, 3], DType::F32)?.with_name("w");
//! let sending = sender.send(meta, vec![7u8; 24]);
//!
//! // The receiver decides on each tensor as its METADATA arrives.
//! let incoming = receiver.next().await.ok_or("the receiver closed")?;
//! let (meta, bytes) = incoming.accept_host().await?.finished().await?;
//! assert_eq!((meta.name(), &bytes[..]), ("w", &[7u8; 24][..]));
//! sending.finished().await?; // COMPLETE: the receiver has the bytes
//! # Ok(())
//! # }
//! ```
// `unsafe_code` is denied workspace-wide; the one exception is mapping a file to send it
// (`source.rs`).

mod binding;
mod budget;
mod config;
mod connection;
mod control;
mod dev_trust;
mod endpoint;
mod error;
mod metrics;
mod receiver;
mod resolve;
mod route;
mod runtime;
mod send;
mod session;
mod socket;
mod source;
mod steering;
mod stream;
mod tcp_link;
pub mod tls;
mod transport;

pub use binding::{Binding, BindingChoice, Listening, UDP_HEAD_START};
pub use budget::BudgetSnapshot;
pub use config::{MAX_DEFAULT_ENDPOINTS, ReceiverConfig, SenderConfig, StoreOffload};
pub use connection::Connection;
pub use dev_trust::dev_cert_path;
pub use error::TransportError;
pub use metrics::{AdmissionSnapshot, LATENCY_BUCKETS_US, MetricsSnapshot};
pub use receiver::{
    CLOSE_GRACE, ConnectionSnapshot, IncomingTensor, OpenConnections, Receiver, ReceiverObserver,
    TensorHandle,
};
pub use resolve::resolve;
pub use runtime::EndpointThreads;
pub use send::{MIN_PART, SendHandle, SendProgress, SendReport, SendWaits, Sender, SenderPool};
pub use source::Source;
pub use steering::{ConnectionSlot, ServerEndpoint, Steering};
pub use tensorwire_proto as proto;
pub use tensorwire_sink::{
    Carrier, CreditPermit, HostSink, LimitSource, MemoryBudget, MemoryLimit, MemoryReservation,
    MemoryShares, MemorySnapshot, Sink, SinkError,
};
pub use tls::{ClientTls, ServerTls};
pub use transport::{
    ACCEPTING_THREAD, CONNECTING_THREAD, Congestion, MAX_MTU, MIN_MTU, TransportSettings,
};
