//! A [`Connection`]: one tensorwire connection, whichever side opened it. Either endpoint
//! may send tensors on it (spec §3), each on its own stream within the credit its one
//! session grants; the peer's tensors are received with [`Connection::incoming`] or, on a
//! connection a [`Receiver`](crate::Receiver) accepted, by that receiver.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use quinn::VarInt;
use tensorwire_proto::{TensorMeta, Version};
use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info_span};

use crate::binding::Binding;
use crate::config::SenderConfig;
use crate::error::TransportError;
use crate::metrics::{Metrics, MetricsSnapshot};
use crate::send::{SendHandle, SendOptions, SendProgress, SendReport, Sharing, send_tensor};
use crate::session::ConnectionSession;
use crate::source::Source;
use crate::transport::CLOSE_DRAIN;

/// One connection to a peer, whichever side opened it: sends tensors on it
/// ([`send`](Self::send)) and receives the peer's ([`incoming`](Self::incoming)). A
/// [`Sender`](crate::Sender) holds one it opened; [`IncomingTensor::connection`] gives the one
/// a tensor came on. Cheap to clone: clones share the connection and its session.
///
/// [`IncomingTensor::connection`]: crate::IncomingTensor::connection
#[derive(Clone)]
pub struct Connection {
    pub(crate) connection: quinn::Connection,
    /// What carries its packets.
    binding: Binding,
    /// The connection's one session: every tensor on it in both directions, and its credit.
    pub(crate) session: ConnectionSession,
    /// Where the connection's work runs: each tensor's task is spawned there.
    pub(crate) runtime: Handle,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) options: SendOptions,
    /// What the handshake selected (spec §3.1), read once.
    peer_version: Version,
    /// Set once something receives the peer's tensors: the [`Receiver`](crate::Receiver)
    /// that accepted the connection, or [`incoming`](Self::incoming).
    receiving: Arc<AtomicBool>,
}

impl Connection {
    /// A connection this side opened: nothing receives the peer's tensors until
    /// [`incoming`](Self::incoming) is called.
    pub(crate) fn opened(
        connection: quinn::Connection,
        binding: Binding,
        session: ConnectionSession,
        runtime: Handle,
        config: &SenderConfig,
    ) -> Self {
        Self::new(connection, binding, session, runtime, config)
    }

    /// A connection a receiver accepted: the receiver already takes the peer's tensors.
    pub(crate) fn accepted(
        connection: quinn::Connection,
        binding: Binding,
        session: ConnectionSession,
        runtime: Handle,
        config: &SenderConfig,
    ) -> Self {
        let accepted = Self::new(connection, binding, session, runtime, config);
        accepted.receiving.store(true, Ordering::Release);
        accepted
    }

    fn new(
        connection: quinn::Connection,
        binding: Binding,
        session: ConnectionSession,
        runtime: Handle,
        config: &SenderConfig,
    ) -> Self {
        // The handshake completed, so an ALPN was selected; a peer that selected none of
        // ours is treated as the oldest.
        let peer_version = crate::tls::negotiated_version(&connection).unwrap_or(Version::V1_0);
        session.lock().set_version(peer_version);
        Self {
            connection,
            binding,
            session,
            runtime,
            metrics: Arc::new(Metrics::default()),
            options: SendOptions {
                progress_timeout: config.progress_timeout,
                chunk_size: config.chunk_size.max(1),
            },
            peer_version,
            receiving: Arc::default(),
        }
    }

    /// Claims the peer's tensors for one receiver: `false` if something already takes them.
    pub(crate) fn claim_incoming(&self) -> bool {
        !self.receiving.swap(true, Ordering::AcqRel)
    }

    /// Starts sending one tensor; resolves (through the handle) on the peer's COMPLETE.
    ///
    /// Tensors of more than one DATA frame ([`SenderConfig::chunk_size`]) sent at once on
    /// the connection take turns, in the order they were sent: each opens its stream once
    /// the one before has at most two round trips' worth of bytes left to hand to QUIC (spec
    /// §7.4), so its admission overlaps them. Smaller tensors go at once. So a
    /// receiving application that leaves a large tensor undecided until a later one from the
    /// same connection arrives waits until the first fails (its progress timeout): decide
    /// each tensor as it comes.
    ///
    /// [`SenderConfig::chunk_size`]: crate::SenderConfig::chunk_size
    pub fn send(&self, meta: TensorMeta, source: impl Into<Source>) -> SendHandle {
        self.spawn_send(meta, source.into(), Sharing::InTurn)
    }

    /// Starts sending one part of a split tensor, beside the connection's other tensors.
    pub(crate) fn send_part(&self, meta: TensorMeta, source: Source) -> SendHandle {
        self.spawn_send(meta, source, Sharing::Alongside)
    }

    pub(crate) fn spawn_send(
        &self,
        meta: TensorMeta,
        source: Source,
        sharing: Sharing,
    ) -> SendHandle {
        let sent = Arc::new(AtomicU64::new(0));
        let cancel = CancellationToken::new();
        let total = meta.byte_len();
        let span = info_span!("send", name = meta.name(), bytes = total);
        // Beside the connection's packet processing (its endpoint's runtime).
        let (connection, session) = (self.connection.clone(), self.session.clone());
        let (progress, token, metrics) = (sent.clone(), cancel.clone(), self.metrics.clone());
        let options = self.options;
        let task = self.runtime.spawn(
            async move {
                send_tensor(
                    connection,
                    session,
                    meta,
                    source,
                    &progress,
                    Some(&token),
                    metrics,
                    options,
                    sharing,
                )
                .await
            }
            .instrument(span),
        );
        SendHandle {
            task,
            progress: SendProgress {
                sent: Arc::new([sent]),
                total,
            },
            cancel,
        }
    }

    /// Sends one tensor on the calling task and resolves on the peer's COMPLETE.
    ///
    /// [`send`](Self::send) runs each tensor on a task of its own, and its handle hears the
    /// outcome from that task: two hand-offs between tasks (often between threads), a large
    /// part of a small tensor's latency. This runs on the caller's task instead. Dropping the
    /// future cancels the tensor: its stream is reset with CANCELLED.
    pub async fn send_inline(
        &self,
        meta: TensorMeta,
        source: impl Into<Source>,
    ) -> Result<SendReport, TransportError> {
        let span = info_span!("send", name = meta.name(), bytes = meta.byte_len());
        send_tensor(
            self.connection.clone(),
            self.session.clone(),
            meta,
            source.into(),
            // Nobody else watches this send's progress or can cancel it (dropping the future
            // does): nothing to share, so nothing allocated for it.
            &AtomicU64::new(0),
            None,
            self.metrics.clone(),
            self.options,
            Sharing::InTurn,
        )
        .instrument(span)
        .await
    }

    /// Tensor and byte counters of the tensors sent through this handle and its clones.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.metrics.snapshot()
    }

    /// The runtime this connection's work runs on (its endpoint's, see
    /// [`EndpointThreads`](crate::EndpointThreads)). A caller that runs
    /// [`send_inline`](Self::send_inline) on a task there reaches the connection without
    /// crossing threads: the lowest latency for small tensors.
    pub fn runtime(&self) -> &Handle {
        &self.runtime
    }

    /// Bytes of tensors the peer's early credit still lets go in one round trip (spec §7.6);
    /// `None` until its first EARLY_CREDIT arrived.
    pub fn early_allowance(&self) -> Option<u64> {
        self.session.lock().early_allowance()
    }

    /// The peer's address.
    pub fn peer(&self) -> SocketAddr {
        self.connection.remote_address()
    }

    /// What carries the connection's packets: UDP, or TCP (spec §16).
    pub fn binding(&self) -> Binding {
        self.binding
    }

    /// The protocol version the connection negotiated (spec §3.1): what the peer has. A
    /// peer that predates 1.4 reads as 1.0, since it cannot say which it is.
    pub fn peer_version(&self) -> Version {
        self.peer_version
    }

    /// The QUIC connection's own statistics (packets, losses, path MTU, RTT).
    pub fn stats(&self) -> quinn::ConnectionStats {
        self.connection.stats()
    }

    /// Closes the connection cleanly; returns once its CONNECTION_CLOSE has gone out (at most
    /// 100 ms), so a process may exit right after and its peer still learns of the close.
    ///
    /// Tensors still in flight fail; await each send first. It does not wait out QUIC's
    /// draining period (three probe timeouts, 75 ms or more even on loopback), which only
    /// answers a peer that missed the close: such a peer times the connection out. In a
    /// process that goes on, quinn drains it in the background.
    pub async fn close(&self) {
        let connection = &self.connection;
        if connection.close_reason().is_some() {
            return; // Closed already (by the peer, or timed out): there is nothing to send.
        }
        // A closed connection sends nothing but its close, so the next datagram is it (quinn
        // counts no CONNECTION_CLOSE it sends in `frame_tx`). Counted before `close`: the
        // endpoint's thread often sends the close before `close` returns here, and a count
        // taken after it would then wait out the whole 100 ms. An ACK sent between the two
        // calls would end the wait early; the close still goes out unless the process exits
        // at once.
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
