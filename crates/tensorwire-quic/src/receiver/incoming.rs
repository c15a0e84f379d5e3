//! Admission: an [`IncomingTensor`] waits for the application's accept or reject, and a
//! [`TensorHandle`] follows an accepted tensor to its end.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tensorwire_proto::{ErrorCode, ProtocolError, TensorMeta};
use tensorwire_sink::{Carrier, HostSink, MemoryBudget, MemoryShares, Sink, SinkError};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use super::tensor::accepted::{Accepted, Ended};
use crate::error::TransportError;
use crate::session::ConnectionSession;

/// A tensor whose METADATA arrived: accept it into a sink, or reject it.
///
/// Dropping it without deciding rejects it with REJECTED.
pub struct IncomingTensor {
    pub(super) meta: TensorMeta,
    pub(super) peer: SocketAddr,
    pub(super) decision: oneshot::Sender<Decision>,
    /// Why the stream ended before a decision, once it has.
    pub(super) ended: Ended,
    /// The connection it came on and its session, to send tensors back.
    pub(super) connection: quinn::Connection,
    pub(super) binding: crate::binding::Binding,
    pub(super) session: ConnectionSession,
    /// Where the connection's work runs (its endpoint's runtime), for tensors sent back.
    pub(super) runtime: tokio::runtime::Handle,
    pub(super) host_memory: MemoryBudget,
    /// Its connection's shares of every memory budget.
    pub(super) memory_shares: MemoryShares,
    /// Its connection, closed when the connection ends.
    pub(super) carrier: Carrier,
    /// When the admission timeout ends: memory waits give up then.
    pub(super) deadline: tokio::time::Instant,
    pub(super) admission_timeout: Duration,
}

pub(super) type Run = Box<dyn FnOnce(Accepted) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

pub(super) enum Decision {
    Accept(Run),
    Reject(ErrorCode, String),
}

impl IncomingTensor {
    /// The tensor's metadata.
    pub fn meta(&self) -> &TensorMeta {
        &self.meta
    }

    /// Its connection, as [`SplitTensors`](tensorwire_sink::SplitTensors) follows it: a split
    /// tensor whose parts' connections have all closed fails at once.
    pub fn carrier(&self) -> &Carrier {
        &self.carrier
    }

    /// The sender's address when its METADATA arrived.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// Admits the tensor; its bytes stream into `sink`.
    pub fn accept<S: Sink>(self, sink: S) -> TensorHandle<S::Output> {
        let (done, result) = oneshot::channel();
        let received = Arc::new(AtomicU64::new(0));
        let cancel = CancellationToken::new();
        let (progress, token) = (received.clone(), cancel.clone());
        let run: Run =
            Box::new(move |accepted| Box::pin(accepted.receive_into(sink, done, progress, token)));
        let handle = TensorHandle {
            ended: self.ended.clone(),
            meta: self.meta,
            received,
            cancel,
            result,
        };
        // If the stream already ended, the handle reports it: `done` is dropped with `run`.
        let _ = self.decision.send(Decision::Accept(run));
        handle
    }

    /// The connection this tensor came on, to send tensors back to its sender (spec §3:
    /// either endpoint may open tensor streams) under the peer's credit, with `config`'s
    /// chunk size and progress timeout. The peer receives them with
    /// [`Connection::incoming`](crate::Connection::incoming).
    pub fn connection(
        &self,
        config: &crate::config::SenderConfig,
    ) -> crate::connection::Connection {
        crate::connection::Connection::accepted(
            self.connection.clone(),
            self.binding,
            self.session.clone(),
            self.runtime.clone(),
            config,
        )
    }

    /// Whether the stream already ended (the sender cancelled, reset it or timed out): a
    /// decision would go nowhere.
    pub fn is_closed(&self) -> bool {
        self.decision.is_closed()
    }

    /// Admits the tensor into a host-memory buffer admitted against the receiver's
    /// host-memory budget (spec §7.5), waiting up to the admission timeout for memory; on
    /// timeout (or a tensor larger than the whole budget) rejects it with RESOURCE_EXHAUSTED.
    pub async fn accept_host(mut self) -> Result<TensorHandle<Bytes>, SinkError> {
        let len = self.meta.byte_len();
        let host = self.memory_shares.of(&self.host_memory);
        let reserved = tokio::select! {
            reserved = tokio::time::timeout_at(self.deadline, host.reserve(len)) => {
                reserved.unwrap_or_else(|_| Err(SinkError::exhausted(format!(
                    "waited {:.1} s for {len} bytes of {} memory: {} of the {} byte budget \
                     stayed in use",
                    self.admission_timeout.as_secs_f64(),
                    host.what(),
                    host.snapshot().reserved,
                    host.limit(),
                ))))
            }
            () = self.decision.closed() => {
                // The stream already ended: the handle reports why.
                return Ok(self.accept(HostSink::new(0)?));
            }
        };
        match reserved.and_then(HostSink::reserved) {
            Ok(sink) => Ok(self.accept(sink)),
            Err(e) => {
                self.reject(e.code, e.message.clone());
                Err(e)
            }
        }
    }

    /// The receiver's host-memory budget, for sinks of the application's own that land
    /// tensors in host memory: reserve through [`memory_shares`](Self::memory_shares)
    /// before accepting.
    pub fn host_memory(&self) -> &MemoryBudget {
        &self.host_memory
    }

    /// This tensor's connection's shares of any memory budget (host, or a device's):
    /// reserving through `memory_shares().of(&budget)` keeps one peer from holding more than
    /// its share (spec §7.5).
    pub fn memory_shares(&self) -> &MemoryShares {
        &self.memory_shares
    }

    /// Refuses the tensor with `code` and `reason`.
    pub fn reject(self, code: ErrorCode, reason: impl Into<String>) {
        let _ = self.decision.send(Decision::Reject(code, reason.into()));
    }
}

/// An accepted tensor in progress.
pub struct TensorHandle<T> {
    meta: TensorMeta,
    received: Arc<AtomicU64>,
    cancel: CancellationToken,
    result: oneshot::Receiver<Result<T, TransportError>>,
    ended: Ended,
}

impl<T> std::fmt::Debug for TensorHandle<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorHandle")
            .field("name", &self.meta.name())
            .field("bytes", &self.meta.byte_len())
            .field("received", &self.received_bytes())
            .finish()
    }
}

impl<T> TensorHandle<T> {
    /// The tensor's metadata.
    pub fn meta(&self) -> &TensorMeta {
        &self.meta
    }

    /// Payload bytes received so far.
    pub fn received_bytes(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    /// Cancels the tensor: the sender gets CANCEL(CANCELLED) and the sink is dropped.
    pub fn cancel(&self) {
        self.cancel.cancel();
    }

    /// Resolves when the tensor completed (COMPLETE sent) or failed.
    pub async fn finished(self) -> Result<(TensorMeta, T), TransportError> {
        match self.result.await {
            Ok(result) => result.map(|output| (self.meta, output)),
            Err(_) => Err(self
                .ended
                .get()
                .cloned()
                .unwrap_or(ProtocolError::Local {
                    code: ErrorCode::SHUTDOWN,
                    reason: "the stream ended before the tensor was accepted".into(),
                })
                .into()),
        }
    }
}
