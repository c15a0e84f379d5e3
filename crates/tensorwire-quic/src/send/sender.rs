//! A [`Sender`]: one QUIC connection to a receiver, and the tensors sent on it.

use std::net::SocketAddr;
use std::sync::Arc;

use quinn::crypto::rustls::QuicClientConfig;
use tensorwire_proto::{SessionConfig, TensorMeta, Version};
use tokio::runtime::Handle;

use super::connect::Opened;
use super::handle::SendHandle;
use super::report::SendReport;
use crate::binding::Binding;
use crate::config::SenderConfig;
use crate::connection::Connection;
use crate::control::read_control_stream;
use crate::error::TransportError;
use crate::metrics::{Metrics, MetricsSnapshot};
use crate::session::ConnectionSession;
use crate::source::Source;

/// A [`Connection`] to a receiver on an endpoint (UDP socket, or TCP connection) of its own: connects, sends
/// tensors, each on its own stream, and closes. The receiver's tensors sent back on it are
/// received with [`Connection::incoming`].
pub struct Sender {
    /// The connection's own endpoint, held for the sender's life.
    _endpoint: quinn::Endpoint,
    connection: Connection,
}

impl Sender {
    /// Connects to the receiver at `addr` on an endpoint (UDP socket) of its own.
    pub async fn connect(addr: SocketAddr, config: SenderConfig) -> Result<Self, TransportError> {
        let crypto = crate::tls::client_crypto(&config.tls, addr)?;
        Self::connect_counting(addr, config, crypto, Arc::default()).await
    }

    /// As [`connect`](Self::connect) with `crypto` already built from `config.tls` (a pool
    /// builds it once for all its connections), counting its sends in `metrics` (a pool's,
    /// shared).
    pub(crate) async fn connect_counting(
        addr: SocketAddr,
        config: SenderConfig,
        crypto: Arc<QuicClientConfig>,
        metrics: Arc<Metrics>,
    ) -> Result<Self, TransportError> {
        let Opened {
            endpoint,
            connection,
            runtime,
            binding,
        } = super::connect::open(addr, &config, crypto).await?;
        // Its receiving policy is set once `receive` is called; until then the peer's streams
        // wait unread.
        let session = ConnectionSession::new(SessionConfig::default());
        // Spec §4.1: the receiver's EARLY_CREDIT lets small tensors go in one round trip.
        runtime.spawn(read_control_stream(connection.clone(), session.clone()));
        let mut connection = Connection::opened(connection, binding, session, runtime, &config);
        connection.metrics = metrics;
        Ok(Self {
            _endpoint: endpoint,
            connection,
        })
    }

    /// Its connection: to receive the tensors the receiver sends back
    /// ([`Connection::incoming`]), or to share it with other tasks.
    pub fn connection(&self) -> &Connection {
        &self.connection
    }

    /// Starts sending one tensor; resolves (through the handle) on the receiver's COMPLETE.
    /// Large tensors take turns: see [`Connection::send`].
    pub fn send(&self, meta: TensorMeta, source: impl Into<Source>) -> SendHandle {
        self.connection.send(meta, source)
    }

    /// Starts sending one part of a split tensor, beside the connection's other tensors.
    pub(crate) fn send_part(&self, meta: TensorMeta, source: Source) -> SendHandle {
        self.connection.send_part(meta, source)
    }

    /// Sends one tensor on the calling task, with no task spawned: see
    /// [`Connection::send_inline`].
    pub async fn send_inline(
        &self,
        meta: TensorMeta,
        source: impl Into<Source>,
    ) -> Result<SendReport, TransportError> {
        self.connection.send_inline(meta, source).await
    }

    /// Tensor and byte counters of this connection's sends.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.connection.metrics()
    }

    /// The protocol version the connection negotiated: see [`Connection::peer_version`].
    pub fn peer_version(&self) -> Version {
        self.connection.peer_version()
    }

    /// The receiver's address.
    pub fn peer(&self) -> SocketAddr {
        self.connection.peer()
    }

    /// What carries the connection's packets: UDP, or TCP (spec §16).
    pub fn binding(&self) -> Binding {
        self.connection.binding()
    }

    /// Bytes of tensors the receiver's early credit still lets go in one round trip (spec
    /// §7.6); `None` until its first EARLY_CREDIT arrived (or if it offers none). A tensor
    /// whose whole length fits is sent early.
    pub fn early_allowance(&self) -> Option<u64> {
        self.connection.early_allowance()
    }

    /// The QUIC connection's own statistics (packets, losses, path MTU, RTT).
    pub fn connection_stats(&self) -> quinn::ConnectionStats {
        self.connection.stats()
    }

    /// The runtime this connection's work runs on: see [`Connection::runtime`].
    pub fn runtime(&self) -> &Handle {
        self.connection.runtime()
    }

    /// Closes the connection cleanly: see [`Connection::close`].
    pub async fn close(self) {
        self.connection.close().await;
    }
}
