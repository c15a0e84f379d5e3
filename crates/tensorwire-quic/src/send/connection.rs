//! A [`ConnectionSender`]: sends tensors on a connection either side opened, within the
//! credit its session grants, one stream each.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use tensorwire_proto::TensorMeta;
use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info_span};

use super::handle::SendHandle;
use super::report::{SendProgress, SendReport};
use super::tensor::{SendOptions, Sharing, send_tensor};
use crate::config::SenderConfig;
use crate::error::TransportError;
use crate::metrics::{Metrics, MetricsSnapshot};
use crate::session::ConnectionSession;
use crate::source::Source;

/// Sends tensors on a connection someone else owns: the way back of a [`Receiver`]'s
/// connection ([`IncomingTensor::reply_sender`]), or a [`Sender`](super::Sender)'s own. Cheap
/// to clone.
///
/// [`Receiver`]: crate::Receiver
/// [`IncomingTensor::reply_sender`]: crate::IncomingTensor::reply_sender
#[derive(Clone)]
pub struct ConnectionSender {
    pub(crate) connection: quinn::Connection,
    /// The connection's one session, shared with its receiving side.
    pub(crate) session: ConnectionSession,
    /// Where the connection's work runs: each tensor's task is spawned there.
    pub(crate) runtime: Handle,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) options: SendOptions,
}

impl ConnectionSender {
    pub(crate) fn new(
        connection: quinn::Connection,
        session: ConnectionSession,
        runtime: Handle,
        config: &SenderConfig,
    ) -> Self {
        Self {
            connection,
            session,
            runtime,
            metrics: Arc::new(Metrics::default()),
            options: SendOptions {
                progress_timeout: config.progress_timeout,
                chunk_size: config.chunk_size.max(1),
            },
        }
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

    /// Tensor and byte counters of the tensors sent through this handle (and its clones).
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
}
