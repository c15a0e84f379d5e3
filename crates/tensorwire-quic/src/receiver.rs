//! The receiving endpoint: accepts connections, yields each incoming tensor for admission,
//! and streams its DATA into the application's [`Sink`] under one shared byte budget.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use dashmap::DashMap;
use quinn::VarInt;
use tensorwire_proto::{ErrorCode, ProtocolError, ReceiverEvent, TensorMeta, TensorReceiver};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::budget::{Budget, BudgetSnapshot};
use crate::config::{ReceiverConfig, dev_cert_path};
use crate::error::TransportError;
use crate::metrics::{Metrics, MetricsSnapshot};
use crate::stream::FrameStream;
use tensorwire_sink::{CreditPermit, HostSink, Sink, SinkError};

/// Incoming tensors waiting for the application before streams wait in turn.
const INCOMING_QUEUE: usize = 1024;

/// How long [`Receiver::close`] lets tensors in progress finish, and how long a finished
/// stream waits for its last frame to be acknowledged.
pub const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// A listening receiver. Call [`next`](Self::next) to admit incoming tensors.
pub struct Receiver {
    endpoint: quinn::Endpoint,
    incoming: mpsc::Receiver<IncomingTensor>,
    shared: Arc<Shared>,
    dev_cert: Option<PathBuf>,
}

struct Shared {
    config: ReceiverConfig,
    budget: Arc<Budget>,
    metrics: Metrics,
    connections: DashMap<usize, Arc<ConnectionState>>,
    shutdown: CancellationToken,
    streams: TaskTracker,
}

struct ConnectionState {
    remote: SocketAddr,
    connection: quinn::Connection,
    metrics: Metrics,
    failures: Mutex<(Instant, u32)>,
}

/// Counters of one connection.
#[derive(Clone, Debug)]
pub struct ConnectionSnapshot {
    /// The peer's address.
    pub remote: SocketAddr,
    /// Its tensors and bytes.
    pub metrics: MetricsSnapshot,
}

impl Receiver {
    /// Binds and starts accepting connections.
    pub async fn bind(config: ReceiverConfig) -> Result<Self, TransportError> {
        let (crypto, dev) = crate::tls::server_crypto(&config.tls)?;
        let mut server = quinn::ServerConfig::with_crypto(crypto);
        server.transport_config(config.transport.transport_config()?);
        let endpoint = config.transport.endpoint(config.listen, Some(server))?;
        let local = endpoint.local_addr()?;
        let dev_cert = match dev {
            Some(dev) => {
                let path = dev_cert_path(local.port());
                if let Some(dir) = path.parent() {
                    std::fs::create_dir_all(dir)?;
                }
                std::fs::write(&path, &dev.pem)?;
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
        let shared = Arc::new(Shared {
            config,
            budget: Arc::new(budget),
            metrics: Metrics::default(),
            connections: DashMap::new(),
            shutdown: CancellationToken::new(),
            streams: TaskTracker::new(),
        });
        let (tx, incoming) = mpsc::channel(INCOMING_QUEUE);
        tokio::spawn(accept_connections(endpoint.clone(), shared.clone(), tx));
        info!(%local, "receiver listening");
        Ok(Self {
            endpoint,
            incoming,
            shared,
            dev_cert,
        })
    }

    /// The address the receiver listens on.
    pub fn local_addr(&self) -> Result<SocketAddr, TransportError> {
        Ok(self.endpoint.local_addr()?)
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

    /// Counters of each open connection.
    pub fn connections(&self) -> Vec<ConnectionSnapshot> {
        self.shared
            .connections
            .iter()
            .map(|c| ConnectionSnapshot {
                remote: c.remote,
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
        self.endpoint.close(
            VarInt::from_u32(ErrorCode::SHUTDOWN.0),
            b"receiver shutting down",
        );
        self.endpoint.wait_idle().await;
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
}

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
            meta: self.meta.clone(),
            received,
            cancel,
            result,
        };
        // If the stream already ended, the handle reports it: `done` is dropped with `run`.
        let _ = self.decision.send(Decision::Accept(run));
        handle
    }

    /// Admits the tensor into a new host-memory buffer; rejects it with RESOURCE_EXHAUSTED
    /// if that memory cannot be had.
    pub fn accept_host(self) -> Result<TensorHandle<Bytes>, SinkError> {
        match HostSink::new(self.meta.byte_len()) {
            Ok(sink) => Ok(self.accept(sink)),
            Err(e) => {
                self.reject(e.code, e.message.clone());
                Err(e)
            }
        }
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
            Err(_) => Err(ProtocolError::Local {
                code: ErrorCode::SHUTDOWN,
                reason: "the stream ended before the tensor was accepted".into(),
            }
            .into()),
        }
    }
}

async fn accept_connections(
    endpoint: quinn::Endpoint,
    shared: Arc<Shared>,
    tx: mpsc::Sender<IncomingTensor>,
) {
    while let Some(incoming) = endpoint.accept().await {
        let span = info_span!("connection", remote = %incoming.remote_address());
        tokio::spawn(serve_connection(shared.clone(), incoming, tx.clone()).instrument(span));
    }
}

async fn serve_connection(
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
    let state = Arc::new(ConnectionState {
        remote: connection.remote_address(),
        connection: connection.clone(),
        metrics: Metrics::default(),
        failures: Mutex::new((Instant::now(), 0)),
    });
    shared.connections.insert(id, state.clone());
    info!("connection established");
    loop {
        let accepted = tokio::select! {
            _ = shared.shutdown.cancelled() => break,
            accepted = connection.accept_bi() => accepted,
        };
        match accepted {
            Ok((send, recv)) => {
                let span = info_span!("tensor", stream = %send.id());
                let stream = FrameStream::new(send, recv, shared.config.limits.clone());
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

/// One accepted stream, handed to the sink-specific receive loop.
struct Accepted {
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
    async fn admit(
        &mut self,
        tx: mpsc::Sender<IncomingTensor>,
    ) -> Result<Option<Run>, TransportError> {
        let config = &self.shared.config;
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
        let (decision, decided) = oneshot::channel();
        let peer = self.connection.remote;
        if tx
            .send(IncomingTensor {
                meta,
                peer,
                decision,
            })
            .await
            .is_err()
        {
            self.machine
                .reject(ErrorCode::SHUTDOWN, "receiver is shutting down")?;
            return Ok(None);
        }
        match tokio::time::timeout(config.admission_timeout, decided).await {
            Ok(Ok(Decision::Accept(run))) => Ok(Some(run)),
            Ok(Ok(Decision::Reject(code, reason))) => {
                self.machine.reject(code, reason)?;
                Ok(None)
            }
            Ok(Err(_)) => {
                self.machine.reject(
                    ErrorCode::REJECTED,
                    "the application dropped the tensor undecided",
                )?;
                Ok(None)
            }
            Err(_) => Err(TransportError::timed_out(
                "the application's decision",
                config.admission_timeout,
            )),
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
                            let output = tokio::select! {
                                output = sink.finish() => output?,
                                frame = self.stream.next_frame() => {
                                    return Err(match self.machine.handle_frame(frame?) {
                                        Err(e) => e.into(),
                                        Ok(_) => ProtocolError::Misuse("frame accepted after END").into(),
                                    });
                                }
                            };
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
    }

    /// Spec §10: too many failed or cancelled streams in a window closes the connection.
    fn count_failure(&self) {
        let config = &self.shared.config;
        let mut failures = self
            .connection
            .failures
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        if now.duration_since(failures.0) > config.failure_window {
            *failures = (now, 0);
        }
        failures.1 += 1;
        if failures.1 > config.max_failed_streams {
            warn!(
                failed = failures.1,
                "closing connection: too many failed streams"
            );
            self.connection.connection.close(
                VarInt::from_u32(ErrorCode::CANCEL_FLOOD.0),
                b"too many failed or cancelled streams",
            );
        }
    }
}
