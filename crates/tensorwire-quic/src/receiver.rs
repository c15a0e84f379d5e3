//! The receiving endpoint: accepts connections, yields each incoming tensor for admission,
//! and streams its DATA into the application's [`Sink`] under one shared byte budget.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use dashmap::DashMap;
use quinn::VarInt;
use tensorwire_proto::{
    ErrorCode, FloodBudget, ProtocolError, ReceiverEvent, TensorMeta, TensorReceiver,
};
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::budget::{Budget, BudgetSnapshot};
use crate::config::ReceiverConfig;
use crate::error::TransportError;
use crate::metrics::{Metrics, MetricsSnapshot};
use crate::stream::FrameStream;
use tensorwire_sink::{CreditPermit, HostSink, MemoryBudget, MemorySnapshot, Sink, SinkError};

/// Incoming tensors waiting for the application before streams wait in turn.
const INCOMING_QUEUE: usize = 1024;

/// How long [`Receiver::close`] lets tensors in progress finish, and how long a finished
/// stream waits for its last frame to be acknowledged.
pub const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// A listening receiver. Call [`next`](Self::next) to admit incoming tensors.
pub struct Receiver {
    endpoints: Vec<quinn::Endpoint>,
    incoming: mpsc::Receiver<IncomingTensor>,
    shared: Arc<Shared>,
    dev_cert: Option<PathBuf>,
}

struct Shared {
    config: ReceiverConfig,
    budget: Arc<Budget>,
    host_memory: MemoryBudget,
    metrics: Metrics,
    connections: DashMap<usize, Arc<ConnectionState>>,
    shutdown: CancellationToken,
    streams: TaskTracker,
}

struct ConnectionState {
    remote: SocketAddr,
    endpoint: usize,
    connection: quinn::Connection,
    metrics: Metrics,
    /// Spec §10: failed, cancelled, reset or refused streams.
    failures: Mutex<FloodBudget>,
    /// Tensors of this connection waiting for the application's decision: one peer cannot
    /// fill the receiver's queue and starve the others.
    pending: Semaphore,
    /// Tensor streams open now, and when the last one ended (for the idle timeout).
    open_streams: AtomicUsize,
    last_stream_ended: Mutex<Instant>,
}

/// Counters of one connection.
#[derive(Clone, Debug)]
pub struct ConnectionSnapshot {
    /// The peer's address.
    pub remote: SocketAddr,
    /// Which of the receiver's endpoints (UDP sockets) carries it.
    pub endpoint: usize,
    /// Its tensors and bytes.
    pub metrics: MetricsSnapshot,
}

impl Receiver {
    /// Binds and starts accepting connections.
    pub async fn bind(config: ReceiverConfig) -> Result<Self, TransportError> {
        let (crypto, dev) = crate::tls::server_crypto(&config.tls)?;
        let mut server = quinn::ServerConfig::with_crypto(crypto);
        server.transport_config(config.transport.server_transport_config()?);
        if config.endpoints == 0 {
            return Err(TransportError::Config(
                "a receiver needs at least one endpoint".into(),
            ));
        }
        let endpoints =
            config
                .transport
                .reuse_port_endpoints(config.listen, config.endpoints, server)?;
        let local = endpoints[0].local_addr()?;
        let dev_cert = match dev {
            Some(dev) => {
                let path = crate::dev_trust::write_dev_cert(local.port(), &dev.pem)?;
                warn!(
                    path = %path.display(),
                    fingerprint = %dev.fingerprint(),
                    "development trust: self-signed certificate for localhost; senders on this \
                     host trust it with no flags. Use PEM certificates in production"
                );
                Some(path)
            }
            None => None,
        };
        let budget = Budget::new(config.budget, config.high_watermark, config.low_watermark)
            .map_err(|e| TransportError::Config(format!("budget and watermarks: {e}")))?;
        let host_memory = MemoryBudget::new("host", config.host_memory_budget);
        let shared = Arc::new(Shared {
            config,
            budget: Arc::new(budget),
            host_memory,
            metrics: Metrics::default(),
            connections: DashMap::new(),
            shutdown: CancellationToken::new(),
            streams: TaskTracker::new(),
        });
        let (tx, incoming) = mpsc::channel(INCOMING_QUEUE);
        for (index, endpoint) in endpoints.iter().enumerate() {
            tokio::spawn(accept_connections(
                index,
                endpoint.clone(),
                shared.clone(),
                tx.clone(),
            ));
        }
        info!(%local, endpoints = endpoints.len(), "receiver listening");
        Ok(Self {
            endpoints,
            incoming,
            shared,
            dev_cert,
        })
    }

    /// The address the receiver listens on.
    pub fn local_addr(&self) -> Result<SocketAddr, TransportError> {
        Ok(self.endpoints[0].local_addr()?)
    }

    /// How many UDP sockets (endpoints) share the listening address.
    pub fn endpoint_count(&self) -> usize {
        self.endpoints.len()
    }

    /// The next incoming tensor, after its METADATA; `None` once the receiver is closed.
    pub async fn next(&mut self) -> Option<IncomingTensor> {
        self.incoming.recv().await
    }

    /// Tensor and byte counters over all connections.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.shared.metrics.snapshot()
    }

    /// The shared byte budget's state.
    pub fn budget(&self) -> BudgetSnapshot {
        self.shared.budget.snapshot()
    }

    /// The host-memory budget that [`IncomingTensor::accept_host`] admits tensors against.
    pub fn host_memory(&self) -> MemorySnapshot {
        self.shared.host_memory.snapshot()
    }

    /// Counters of each open connection.
    pub fn connections(&self) -> Vec<ConnectionSnapshot> {
        self.shared
            .connections
            .iter()
            .map(|c| ConnectionSnapshot {
                remote: c.remote,
                endpoint: c.endpoint,
                metrics: c.metrics.snapshot(),
            })
            .collect()
    }

    /// Stops accepting, lets tensors in progress finish for up to [`CLOSE_GRACE`], then
    /// closes every connection with SHUTDOWN and waits for the endpoint to go idle.
    pub async fn close(self) {
        self.shared.shutdown.cancel();
        self.shared.streams.close();
        let _ = tokio::time::timeout(CLOSE_GRACE, self.shared.streams.wait()).await;
        for endpoint in &self.endpoints {
            endpoint.close(
                VarInt::from_u32(ErrorCode::SHUTDOWN.0),
                b"receiver shutting down",
            );
        }
        for endpoint in &self.endpoints {
            endpoint.wait_idle().await;
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.shared.shutdown.cancel();
        if let Some(path) = &self.dev_cert {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// A tensor whose METADATA arrived: accept it into a sink, or reject it.
///
/// Dropping it without deciding rejects it with REJECTED.
pub struct IncomingTensor {
    meta: TensorMeta,
    peer: SocketAddr,
    decision: oneshot::Sender<Decision>,
    /// Why the stream ended before a decision, once it has.
    ended: Ended,
    host_memory: MemoryBudget,
    /// When the admission timeout ends: memory waits give up then.
    deadline: tokio::time::Instant,
    admission_timeout: Duration,
}

/// Why a stream ended while its tensor waited for the application, set before the stream
/// lets go of the decision channel, so a late accept reports the real cause.
type Ended = Arc<OnceLock<ProtocolError>>;

/// How long after the admission deadline the stream still waits for a decision, so that an
/// application's own refusal at the deadline (such as no memory) reaches the sender.
const DECISION_GRACE: Duration = Duration::from_secs(1);

type Run = Box<dyn FnOnce(Accepted) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

enum Decision {
    Accept(Run),
    Reject(ErrorCode, String),
}

impl IncomingTensor {
    /// The tensor's metadata.
    pub fn meta(&self) -> &TensorMeta {
        &self.meta
    }

    /// The sender's address.
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
            meta: self.meta.clone(),
            received,
            cancel,
            result,
        };
        // If the stream already ended, the handle reports it: `done` is dropped with `run`.
        let _ = self.decision.send(Decision::Accept(run));
        handle
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
        let reserved = tokio::select! {
            reserved = tokio::time::timeout_at(self.deadline, self.host_memory.reserve(len)) => {
                reserved.unwrap_or_else(|_| Err(SinkError::exhausted(format!(
                    "waited {:.1} s for {len} bytes of host memory: {} of the {} byte budget \
                     stayed in use",
                    self.admission_timeout.as_secs_f64(),
                    self.host_memory.snapshot().reserved,
                    self.host_memory.limit(),
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
    /// tensors in host memory (reserve before accepting).
    pub fn host_memory(&self) -> &MemoryBudget {
        &self.host_memory
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

async fn accept_connections(
    index: usize,
    endpoint: quinn::Endpoint,
    shared: Arc<Shared>,
    tx: mpsc::Sender<IncomingTensor>,
) {
    while let Some(incoming) = endpoint.accept().await {
        let span = info_span!("connection", remote = %incoming.remote_address(), endpoint = index);
        tokio::spawn(
            serve_connection(index, shared.clone(), incoming, tx.clone()).instrument(span),
        );
    }
}

async fn serve_connection(
    endpoint: usize,
    shared: Arc<Shared>,
    incoming: quinn::Incoming,
    tx: mpsc::Sender<IncomingTensor>,
) {
    // The handshake (client certificate included, for mTLS) completes before any stream is
    // accepted, so no frame is acted on from an unverified peer.
    let connection = match incoming.await {
        Ok(connection) => connection,
        Err(e) => {
            warn!(error = %e, "handshake failed");
            return;
        }
    };
    let alpn = connection
        .handshake_data()
        .and_then(|data| data.downcast::<quinn::crypto::rustls::HandshakeData>().ok())
        .and_then(|data| data.protocol);
    if alpn.as_deref() != Some(tensorwire_proto::ALPN) {
        warn!("refusing a connection that did not negotiate ALPN tensorwire/1");
        connection.close(
            VarInt::from_u32(ErrorCode::UNEXPECTED_FRAME.0),
            b"ALPN tensorwire/1 required",
        );
        return;
    }
    let id = connection.stable_id();
    let config = &shared.config;
    let state = Arc::new(ConnectionState {
        remote: connection.remote_address(),
        endpoint,
        connection: connection.clone(),
        metrics: Metrics::default(),
        failures: Mutex::new(FloodBudget::new(
            config.max_failed_streams,
            config.failure_window,
        )),
        pending: Semaphore::new(config.max_pending_per_connection),
        open_streams: AtomicUsize::new(0),
        last_stream_ended: Mutex::new(Instant::now()),
    });
    shared.connections.insert(id, state.clone());
    info!("connection established");
    let idle_check = config.connection_idle_timeout.min(Duration::from_secs(1));
    loop {
        let accepted = tokio::select! {
            _ = shared.shutdown.cancelled() => break,
            accepted = connection.accept_bi() => accepted,
            uni = connection.accept_uni() => {
                // Spec §3: unidirectional streams are not used; stop each at once.
                if let Ok(mut recv) = uni {
                    debug!("stopping a unidirectional stream");
                    let _ = recv.stop(VarInt::from_u32(ErrorCode::UNEXPECTED_FRAME.0));
                }
                continue;
            }
            () = tokio::time::sleep(idle_check) => {
                if state.idle_for() >= config.connection_idle_timeout {
                    info!(idle = ?config.connection_idle_timeout, "closing a connection with no tensor streams");
                    connection.close(
                        VarInt::from_u32(ErrorCode::PROGRESS_TIMEOUT.0),
                        b"no tensor stream within the receiver's idle timeout",
                    );
                    break;
                }
                continue;
            }
        };
        match accepted {
            Ok((send, recv)) => {
                let span = info_span!("tensor", stream = %send.id());
                let stream = FrameStream::new(send, recv, shared.config.limits.clone());
                state.open_streams.fetch_add(1, Ordering::AcqRel);
                shared.streams.spawn(
                    serve_stream(shared.clone(), state.clone(), stream, tx.clone())
                        .instrument(span),
                );
            }
            Err(e) => {
                info!(reason = %e, "connection closed");
                break;
            }
        }
    }
    shared.connections.remove(&id);
}

impl ConnectionState {
    /// How long the connection has had no tensor stream open.
    fn idle_for(&self) -> Duration {
        if self.open_streams.load(Ordering::Acquire) > 0 {
            return Duration::ZERO;
        }
        self.last_stream_ended
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .elapsed()
    }

    fn stream_ended(&self) {
        *self
            .last_stream_ended
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Instant::now();
        self.open_streams.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One accepted stream, handed to the sink-specific receive loop.
struct Accepted {
    ended: Ended,
    shared: Arc<Shared>,
    connection: Arc<ConnectionState>,
    stream: FrameStream,
    machine: TensorReceiver,
    started: Instant,
}

async fn serve_stream(
    shared: Arc<Shared>,
    connection: Arc<ConnectionState>,
    stream: FrameStream,
    tx: mpsc::Sender<IncomingTensor>,
) {
    let machine = TensorReceiver::new(shared.config.limits.clone());
    let mut st = Accepted {
        ended: Ended::default(),
        shared,
        connection,
        stream,
        machine,
        started: Instant::now(),
    };
    st.shared.metrics.started();
    st.connection.metrics.started();
    match st.admit(tx).await {
        Ok(Some(run)) => run(st).await,
        Ok(None) => st.end(None).await,
        Err(e) => st.end(Some(&e)).await,
    }
}

impl Accepted {
    /// Reads METADATA and asks the application; `None` if the tensor was rejected.
    ///
    /// While the tensor waits (for a slot in the connection's share of the queue, then for the
    /// decision) the stream is still read: a CANCEL, a reset or a FIN ends it at once, so
    /// waiting tensors cannot pile up behind a peer that gave up on them.
    async fn admit(
        &mut self,
        tx: mpsc::Sender<IncomingTensor>,
    ) -> Result<Option<Run>, TransportError> {
        let shared = self.shared.clone();
        let config = &shared.config;
        let frame = tokio::time::timeout(config.progress_timeout, self.stream.next_frame())
            .await
            .map_err(|_| TransportError::timed_out("METADATA", config.progress_timeout))??;
        self.machine.handle_frame(frame)?;
        let meta = self
            .machine
            .meta()
            .cloned()
            .ok_or(ProtocolError::Misuse("METADATA without meta"))?;
        debug!(name = meta.name(), bytes = meta.byte_len(), dtype = %meta.dtype(), "metadata");
        let connection = self.connection.clone();
        let deadline = tokio::time::Instant::now() + config.admission_timeout;
        // Kept here, not in the wait, so it outlives the recording of why the wait ended.
        let (decision, mut decided) = oneshot::channel();
        let mut decision = Some(decision);
        let waited = tokio::time::timeout_at(deadline + DECISION_GRACE, async {
            let _slot = self.while_reading(connection.pending.acquire()).await?;
            let incoming = IncomingTensor {
                meta,
                peer: connection.remote,
                decision: decision
                    .take()
                    .ok_or(ProtocolError::Misuse("decision taken twice"))?,
                ended: self.ended.clone(),
                host_memory: shared.host_memory.clone(),
                deadline,
                admission_timeout: config.admission_timeout,
            };
            if self.while_reading(tx.send(incoming)).await?.is_err() {
                return Ok(None);
            }
            self.while_reading(&mut decided).await.map(|d| Some(d.ok()))
        })
        .await;
        let waited = match waited {
            Err(_) => Err(TransportError::timed_out(
                "decision from the application",
                config.admission_timeout,
            )),
            Ok(waited) => waited,
        };
        if let Err(e) = &waited {
            let _ = self.ended.set(match e {
                TransportError::Protocol(e) => e.clone(),
                other => ProtocolError::Local {
                    code: other.code().unwrap_or(ErrorCode::INTERNAL),
                    reason: other.to_string(),
                },
            });
        }
        drop(decided);
        match waited {
            Err(e) => Err(e),
            Ok(None) => {
                self.machine
                    .reject(ErrorCode::SHUTDOWN, "receiver is shutting down")?;
                Ok(None)
            }
            Ok(Some(Some(Decision::Accept(run)))) => Ok(Some(run)),
            Ok(Some(Some(Decision::Reject(code, reason)))) => {
                self.machine.reject(code, reason)?;
                Ok(None)
            }
            Ok(Some(None)) => {
                self.machine.reject(
                    ErrorCode::REJECTED,
                    "the application dropped the tensor undecided",
                )?;
                Ok(None)
            }
        }
    }

    /// Awaits `wait` while reading the stream: before ACCEPT any frame (a CANCEL, DATA
    /// without credit), a reset or a FIN ends the tensor with the matching error.
    async fn while_reading<T>(
        &mut self,
        wait: impl Future<Output = T>,
    ) -> Result<T, TransportError> {
        tokio::select! {
            out = wait => Ok(out),
            frame = self.stream.next_frame() => {
                self.machine.handle_frame(frame?)?;
                Err(ProtocolError::Misuse("a frame was accepted before ACCEPT").into())
            }
        }
    }

    async fn receive_into<S: Sink>(
        mut self,
        sink: S,
        done: oneshot::Sender<Result<S::Output, TransportError>>,
        progress: Arc<AtomicU64>,
        cancel: CancellationToken,
    ) {
        let result = tokio::select! {
            result = self.receive_loop(sink, &progress) => result,
            _ = cancel.cancelled() => Err(TransportError::cancelled_by("receiving")),
        };
        self.end(result.as_ref().err()).await;
        let _ = done.send(result);
    }

    async fn receive_loop<S: Sink>(
        &mut self,
        mut sink: S,
        progress: &AtomicU64,
    ) -> Result<S::Output, TransportError> {
        let shared = self.shared.clone();
        let config = &shared.config;
        let budget = &shared.budget;
        let pending = Arc::new(AtomicU64::new(0));
        self.machine.accept()?;
        self.flush().await?;
        loop {
            let window_left = config
                .stream_window
                .saturating_sub(self.machine.revocable_credit());
            let want = self
                .machine
                .ungranted()
                .min(config.grant_unit)
                .min(window_left);
            tokio::select! {
                biased;
                granted = budget.acquire(want), if want > 0 => {
                    let used = self.machine.grant(granted);
                    budget.revoke(granted - used);
                    self.flush().await?;
                }
                frame = tokio::time::timeout(config.progress_timeout, self.stream.next_frame()) => {
                    let frame = frame.map_err(|_| TransportError::timed_out("DATA", config.progress_timeout))??;
                    match self.machine.handle_frame(frame)? {
                        ReceiverEvent::Data(data) => {
                            let n = data.payload.len() as u64;
                            budget.consume(n)?;
                            let permit = CreditPermit::new(n, budget.clone(), pending.clone());
                            sink.write(data.offset, data.payload, permit).await?;
                            progress.fetch_add(n, Ordering::Relaxed);
                            shared.metrics.add_bytes(n);
                            self.connection.metrics.add_bytes(n);
                        }
                        ReceiverEvent::End => {
                            // While the sink makes the bytes durable, the sender may still cancel.
                            let output = self.finish_watching(sink.finish()).await??;
                            let left = pending.load(Ordering::Acquire);
                            if left != 0 {
                                return Err(SinkError::failed(format!("sink finished with {left} bytes not durable")).into());
                            }
                            // Spec §6.8: COMPLETE only now, with every byte verified and durable.
                            self.machine.mark_resident()?;
                            self.flush().await?;
                            return Ok(output);
                        }
                        _ => return Err(ProtocolError::Misuse("second METADATA event").into()),
                    }
                }
            }
        }
    }

    /// Awaits the sink after END while the sender may still CANCEL or reset; its FIN right
    /// after END is legal (spec §4) and ends only the watching.
    async fn finish_watching<T>(
        &mut self,
        finish: impl Future<Output = T>,
    ) -> Result<T, TransportError> {
        tokio::pin!(finish);
        tokio::select! {
            out = &mut finish => return Ok(out),
            frame = self.stream.next_frame_or_fin() => match frame? {
                None => {}
                Some(frame) => {
                    return Err(match self.machine.handle_frame(frame) {
                        Err(e) => e.into(),
                        Ok(_) => ProtocolError::Misuse("frame accepted after END").into(),
                    });
                }
            },
        }
        Ok(finish.await)
    }

    async fn flush(&mut self) -> Result<(), TransportError> {
        let machine = &mut self.machine;
        self.stream
            .write_frames(std::iter::from_fn(|| machine.poll_frame()))
            .await
    }

    /// Tells the peer why (if the state machine has not already), returns unused credit,
    /// closes the stream, and counts the outcome.
    async fn end(&mut self, error: Option<&TransportError>) {
        if let Some(e) = error {
            let code = e.code().unwrap_or(ErrorCode::INTERNAL);
            let _ = self.machine.cancel(code, e.to_string());
            warn!(error = %e, "tensor failed");
        }
        let _ = self.flush().await;
        self.stream
            .close(error.map(|e| e.code().unwrap_or(ErrorCode::INTERNAL)));
        self.shared.budget.revoke(self.machine.revocable_credit());
        let ok = error.is_none() && self.machine.ending().is_none();
        let elapsed = self.started.elapsed();
        self.shared.metrics.finished(ok, elapsed);
        self.connection.metrics.finished(ok, elapsed);
        if !ok {
            self.count_failure();
        }
        // Credit is already back; keep the stream until the sender has our last frame.
        self.stream.delivered(CLOSE_GRACE).await;
        self.connection.stream_ended();
    }

    /// Spec §10: failed, cancelled, reset or refused streams beyond the budget close the
    /// connection with CANCEL_FLOOD.
    fn count_failure(&self) {
        let exceeded = self
            .connection
            .failures
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .record_failure(Instant::now());
        if let Err(exceeded) = exceeded {
            warn!(
                burst = exceeded.burst,
                window = ?exceeded.window,
                "closing connection: too many failed streams"
            );
            self.connection.connection.close(
                VarInt::from_u32(ErrorCode::CANCEL_FLOOD.0),
                b"too many failed, cancelled or refused streams",
            );
        }
    }
}
