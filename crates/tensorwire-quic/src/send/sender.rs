//! A [`Sender`]: one QUIC connection to a receiver, and the tensors sent on it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use quinn::VarInt;
use quinn::crypto::rustls::QuicClientConfig;
use tensorwire_proto::{SessionConfig, TensorMeta, Version};
use tokio::runtime::Handle;

use super::connection::ConnectionSender;
use super::handle::SendHandle;
use super::report::SendReport;
use crate::config::{ReceiverConfig, SenderConfig};
use crate::control::read_control_stream;
use crate::error::TransportError;
use crate::metrics::{Metrics, MetricsSnapshot};
use crate::receiver::Receiver;
use crate::session::ConnectionSession;
use crate::source::Source;
use crate::transport::CLOSE_DRAIN;

/// A connection to a receiver that sends tensors, each on its own stream; it can also
/// receive the tensors the receiver sends back on it ([`receive`](Self::receive)).
pub struct Sender {
    /// The connection's own endpoint (UDP socket), held for the sender's life.
    pub(crate) _endpoint: quinn::Endpoint,
    pub(crate) sender: ConnectionSender,
    /// What the handshake selected (spec §3.1), read once.
    pub(crate) peer_version: Version,
}

impl Sender {
    /// Connects to the receiver at `addr` on an endpoint (UDP socket) of its own.
    pub async fn connect(addr: SocketAddr, config: SenderConfig) -> Result<Self, TransportError> {
        let crypto = crate::tls::client_crypto(&config.tls, addr.port())?;
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
        let mut client = quinn::ClientConfig::new(crypto);
        client.transport_config(config.transport.transport_config()?);
        let bind: SocketAddr = if addr.is_ipv6() {
            "[::]:0"
        } else {
            "0.0.0.0:0"
        }
        .parse()
        .map_err(|_| TransportError::Config("bind address".into()))?;
        let (endpoint, runtime) = config.transport.endpoint_with_runtime(bind, None)?;
        let connection = endpoint
            .connect_with(client, addr, &config.server_name)?
            .await?;
        // The handshake completed, so an ALPN was selected; a server that selected none of
        // ours is treated as the oldest.
        let peer_version = crate::tls::negotiated_version(&connection).unwrap_or(Version::V1_0);
        // Its receiving policy is set once `receive` is called; until then the peer's streams
        // wait unread.
        let session = ConnectionSession::new(SessionConfig::default());
        // Spec §4.1: the receiver's EARLY_CREDIT lets small tensors go in one round trip.
        runtime.spawn(read_control_stream(connection.clone(), session.clone()));
        let mut sender = ConnectionSender::new(connection, session, runtime, &config);
        sender.metrics = metrics;
        Ok(Self {
            _endpoint: endpoint,
            sender,
            peer_version,
        })
    }

    /// Starts sending one tensor; resolves (through the handle) on the receiver's COMPLETE.
    /// Large tensors take turns: see [`ConnectionSender::send`].
    pub fn send(&self, meta: TensorMeta, source: impl Into<Source>) -> SendHandle {
        self.sender.send(meta, source)
    }

    /// Starts sending one part of a split tensor, beside the connection's other tensors.
    pub(crate) fn send_part(&self, meta: TensorMeta, source: Source) -> SendHandle {
        self.sender.send_part(meta, source)
    }

    /// Sends one tensor on the calling task, with no task spawned: see
    /// [`ConnectionSender::send_inline`].
    pub async fn send_inline(
        &self,
        meta: TensorMeta,
        source: impl Into<Source>,
    ) -> Result<SendReport, TransportError> {
        self.sender.send_inline(meta, source).await
    }

    /// Receives the tensors the receiver sends back on this connection (spec §3), under
    /// `config`'s budgets, limits and timeouts (its listening address, TLS, transport and
    /// endpoint count are not used). Until this is called, the receiver's streams wait.
    pub fn receive(&self, config: ReceiverConfig) -> Result<Receiver, TransportError> {
        Receiver::on_connection(
            self.sender.connection.clone(),
            self.sender.session.clone(),
            &self.sender.runtime,
            config,
        )
    }

    /// Tensor and byte counters of this connection's sends.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.sender.metrics()
    }

    /// The protocol version the connection negotiated (spec §3.1): what the receiver has.
    /// A receiver that predates 1.4 reads as 1.0, since it cannot say which it is.
    pub fn peer_version(&self) -> Version {
        self.peer_version
    }

    /// The receiver's address.
    pub fn peer_address(&self) -> SocketAddr {
        self.sender.connection.remote_address()
    }

    /// Bytes of tensors the receiver's early credit still lets go in one round trip (spec
    /// §7.6); `None` until its first EARLY_CREDIT arrived (or if it offers none). A tensor
    /// whose whole length fits is sent early.
    pub fn early_allowance(&self) -> Option<u64> {
        self.sender.early_allowance()
    }

    /// The QUIC connection's own statistics (packets, losses, path MTU, RTT).
    pub fn connection_stats(&self) -> quinn::ConnectionStats {
        self.sender.connection.stats()
    }

    /// The runtime this connection's work runs on: see [`ConnectionSender::runtime`].
    pub fn runtime(&self) -> &Handle {
        self.sender.runtime()
    }

    /// Closes the connection cleanly; returns once its CONNECTION_CLOSE has gone out (at most
    /// 100 ms), so a process may exit right after and its peer still learns of the close.
    ///
    /// Tensors still in flight fail; await each send first. It does not wait out QUIC's
    /// draining period (three probe timeouts, 75 ms or more even on loopback), which only
    /// answers a peer that missed the close: such a peer times the connection out. In a
    /// process that goes on, quinn drains it in the background.
    pub async fn close(self) {
        let connection = &self.sender.connection;
        if connection.close_reason().is_some() {
            return; // Closed already (by the peer, or timed out): there is nothing to send.
        }
        // A closed connection sends nothing but its close, so the next datagram is it (quinn
        // counts no CONNECTION_CLOSE it sends in `frame_tx`). Counted before `close`: the
        // endpoint's thread often sends the close before `close` returns here, and a count
        // taken after it then waited out the whole 100 ms (most runs of an 8-connection
        // `sender` on a 2-core host). An ACK sent between the two calls would end the wait
        // early; the close still goes out unless the process exits at once.
        let before = connection.stats().udp_tx.datagrams;
        connection.close(VarInt::from_u32(0), b"done");
        let close_sent = async {
            // The connection's driver writes it on its next poll: here, or on the endpoint's
            // thread.
            tokio::task::yield_now().await;
            while connection.stats().udp_tx.datagrams == before {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        let _ = tokio::time::timeout(CLOSE_DRAIN, close_sent).await;
    }
}
