//! The sending side: one connection, many tensors at once, each on its own stream, never
//! more bytes in flight than the receiver granted.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures_core::Stream;
use quinn::VarInt;
use tensorwire_proto::{
    ErrorCode, Limits, ProtocolError, SenderEvent, SenderState, TensorMeta, TensorSender,
};
use tokio::io::{AsyncReadExt, AsyncSeekExt};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info_span};

use crate::config::{ReceiverConfig, SenderConfig};
use crate::error::TransportError;
use crate::metrics::{Metrics, MetricsSnapshot};
use crate::receiver::Receiver;
use crate::stream::FrameStream;

/// Where a tensor's bytes come from.
pub enum Source {
    /// Bytes in memory, sent without copying.
    Bytes(Bytes),
    /// A region of a file starting at `offset`, as long as the tensor.
    File {
        /// The file.
        path: PathBuf,
        /// Where the tensor's first byte is.
        offset: u64,
    },
    /// An async stream of chunks of any size, in order, adding up to the tensor's length.
    Stream(Pin<Box<dyn Stream<Item = std::io::Result<Bytes>> + Send>>),
}

impl From<Bytes> for Source {
    fn from(bytes: Bytes) -> Self {
        Source::Bytes(bytes)
    }
}

impl From<Vec<u8>> for Source {
    fn from(bytes: Vec<u8>) -> Self {
        Source::Bytes(bytes.into())
    }
}

/// Reads a [`Source`] in pieces of at most a requested length.
enum SourceReader {
    Bytes(Bytes),
    File(tokio::fs::File),
    Stream {
        inner: Pin<Box<dyn Stream<Item = std::io::Result<Bytes>> + Send>>,
        leftover: Bytes,
    },
}

impl SourceReader {
    async fn open(source: Source) -> std::io::Result<Self> {
        Ok(match source {
            Source::Bytes(bytes) => SourceReader::Bytes(bytes),
            Source::File { path, offset } => {
                let mut file = tokio::fs::File::open(&path).await?;
                file.seek(std::io::SeekFrom::Start(offset)).await?;
                SourceReader::File(file)
            }
            Source::Stream(inner) => SourceReader::Stream {
                inner,
                leftover: Bytes::new(),
            },
        })
    }

    /// Up to `max` bytes; empty at the end of the source.
    async fn next(&mut self, max: usize) -> std::io::Result<Bytes> {
        match self {
            SourceReader::Bytes(bytes) => Ok(bytes.split_to(max.min(bytes.len()))),
            SourceReader::File(file) => {
                let mut buf = BytesMut::with_capacity(max);
                while buf.len() < max && file.read_buf(&mut buf).await? > 0 {}
                Ok(buf.freeze())
            }
            SourceReader::Stream { inner, leftover } => {
                if leftover.is_empty() {
                    let next = std::future::poll_fn(|cx| inner.as_mut().poll_next(cx)).await;
                    *leftover = next.transpose()?.unwrap_or_default();
                }
                Ok(leftover.split_to(max.min(leftover.len())))
            }
        }
    }
}

/// A connection to a receiver that sends tensors, each on its own stream; it can also
/// receive the tensors the receiver sends back on it ([`receive`](Self::receive)).
pub struct Sender {
    endpoint: quinn::Endpoint,
    sender: ConnectionSender,
}

/// Sends tensors on a connection someone else owns: the way back of a [`Receiver`]'s
/// connection ([`IncomingTensor::reply_sender`]), or a [`Sender`]'s own. Cheap to clone.
///
/// [`Receiver`]: crate::Receiver
/// [`IncomingTensor::reply_sender`]: crate::IncomingTensor::reply_sender
#[derive(Clone)]
pub struct ConnectionSender {
    connection: quinn::Connection,
    metrics: Arc<Metrics>,
    options: SendOptions,
}

/// The parts of [`SenderConfig`] each send uses.
#[derive(Clone, Copy, Debug)]
struct SendOptions {
    progress_timeout: Duration,
    chunk_size: u64,
}

/// What a completed send did.
#[derive(Clone, Debug)]
pub struct SendReport {
    /// Payload bytes sent.
    pub bytes: u64,
    /// From opening the stream to COMPLETE.
    pub elapsed: Duration,
}

impl Sender {
    /// Connects to the receiver at `addr` on an endpoint (UDP socket) of its own.
    pub async fn connect(addr: SocketAddr, config: SenderConfig) -> Result<Self, TransportError> {
        let crypto = crate::tls::client_crypto(&config.tls, addr.port())?;
        let mut client = quinn::ClientConfig::new(crypto);
        client.transport_config(config.transport.transport_config()?);
        let bind: SocketAddr = if addr.is_ipv6() {
            "[::]:0"
        } else {
            "0.0.0.0:0"
        }
        .parse()
        .map_err(|_| TransportError::Config("bind address".into()))?;
        let endpoint = config.transport.endpoint(bind, None)?;
        let connection = endpoint
            .connect_with(client, addr, &config.server_name)?
            .await?;
        tokio::spawn(stop_unidirectional_streams(connection.clone()));
        Ok(Self {
            endpoint,
            sender: ConnectionSender::new(connection, &config),
        })
    }

    /// Starts sending one tensor; resolves (through the handle) on the receiver's COMPLETE.
    pub fn send(&self, meta: TensorMeta, source: impl Into<Source>) -> SendHandle {
        self.sender.send(meta, source)
    }

    /// Receives the tensors the receiver sends back on this connection (spec §3), under
    /// `config`'s budgets, limits and timeouts (its listening address, TLS, transport and
    /// endpoint count are not used). Until this is called, the receiver's streams wait.
    pub fn receive(&self, config: ReceiverConfig) -> Result<Receiver, TransportError> {
        Receiver::on_connection(self.sender.connection.clone(), config)
    }

    /// Tensor and byte counters of this connection's sends.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.sender.metrics()
    }

    /// The QUIC connection's own statistics (packets, losses, path MTU, RTT).
    pub fn connection_stats(&self) -> quinn::ConnectionStats {
        self.sender.connection.stats()
    }

    /// Closes the connection cleanly and waits for the endpoint to go idle.
    pub async fn close(self) {
        self.sender.connection.close(VarInt::from_u32(0), b"done");
        self.endpoint.wait_idle().await;
    }
}

impl ConnectionSender {
    pub(crate) fn new(connection: quinn::Connection, config: &SenderConfig) -> Self {
        Self {
            connection,
            metrics: Arc::new(Metrics::default()),
            options: SendOptions {
                progress_timeout: config.progress_timeout,
                chunk_size: config.chunk_size.max(1),
            },
        }
    }

    /// Starts sending one tensor; resolves (through the handle) on the peer's COMPLETE.
    pub fn send(&self, meta: TensorMeta, source: impl Into<Source>) -> SendHandle {
        let sent = Arc::new(AtomicU64::new(0));
        let cancel = CancellationToken::new();
        let total = meta.byte_len();
        let span = info_span!("send", name = meta.name(), bytes = total);
        let task = tokio::spawn(
            send_tensor(
                self.connection.clone(),
                meta,
                source.into(),
                sent.clone(),
                cancel.clone(),
                self.metrics.clone(),
                self.options,
            )
            .instrument(span),
        );
        SendHandle {
            task,
            sent,
            total,
            cancel,
        }
    }

    /// Tensor and byte counters of the tensors sent through this handle (and its clones).
    pub fn metrics(&self) -> MetricsSnapshot {
        self.metrics.snapshot()
    }

    /// The peer's address.
    pub fn peer(&self) -> SocketAddr {
        self.connection.remote_address()
    }
}

/// One tensor being sent.
pub struct SendHandle {
    task: JoinHandle<Result<SendReport, TransportError>>,
    sent: Arc<AtomicU64>,
    total: u64,
    cancel: CancellationToken,
}

impl SendHandle {
    /// Payload bytes handed to QUIC so far.
    pub fn sent_bytes(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// The tensor's length.
    pub fn total_bytes(&self) -> u64 {
        self.total
    }

    /// A progress reader that outlives [`finished`](Self::finished)'s borrow of the handle.
    pub fn progress(&self) -> SendProgress {
        SendProgress {
            sent: self.sent.clone(),
            total: self.total,
        }
    }

    /// Cancels the tensor: the receiver gets CANCEL(CANCELLED).
    pub fn cancel(&self) {
        self.cancel.cancel();
    }

    /// A token that cancels this tensor, for use from other tasks.
    pub fn cancel_token(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// Resolves on COMPLETE, or with the error that ended the tensor.
    pub async fn finished(self) -> Result<SendReport, TransportError> {
        self.task
            .await
            .map_err(|e| TransportError::Io(std::io::Error::other(e)))?
    }
}

/// Reads how far one tensor's send has got.
#[derive(Clone, Debug)]
pub struct SendProgress {
    sent: Arc<AtomicU64>,
    total: u64,
}

impl SendProgress {
    /// Payload bytes handed to QUIC so far.
    pub fn sent_bytes(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// The tensor's length.
    pub fn total_bytes(&self) -> u64 {
        self.total
    }
}

/// Spec §3: unidirectional streams are unused; stop each with UNEXPECTED_FRAME.
async fn stop_unidirectional_streams(connection: quinn::Connection) {
    while let Ok(mut recv) = connection.accept_uni().await {
        let _ = recv.stop(VarInt::from_u32(ErrorCode::UNEXPECTED_FRAME.0));
    }
}

async fn send_tensor(
    connection: quinn::Connection,
    meta: TensorMeta,
    source: Source,
    sent: Arc<AtomicU64>,
    cancel: CancellationToken,
    metrics: Arc<Metrics>,
    options: SendOptions,
) -> Result<SendReport, TransportError> {
    let started = Instant::now();
    metrics.started();
    let mut machine = TensorSender::new(meta)?;
    let result = async {
        let (send, recv) = connection.open_bi().await?;
        let mut stream = FrameStream::new(send, recv, Limits::default());
        let outcome = drive(
            &mut machine,
            &mut stream,
            &connection,
            source,
            &sent,
            &cancel,
            options,
        )
        .await;
        let outcome = match outcome {
            Err(e) => Err(explain_stop(&mut machine, &mut stream, e).await),
            ok => ok,
        };
        let code = outcome
            .as_ref()
            .err()
            .map(|e| e.code().unwrap_or(ErrorCode::INTERNAL));
        if let Some(code) = code {
            let reason = outcome
                .as_ref()
                .err()
                .map(ToString::to_string)
                .unwrap_or_default();
            let _ = machine.cancel(code, reason);
            let _ = flush(&mut machine, &mut stream).await;
        }
        stream.close(code);
        if code.is_some() {
            // Our CANCEL must reach the receiver before the application closes the connection,
            // which would discard it.
            stream.delivered(CANCEL_GRACE).await;
        }
        outcome
    }
    .await;
    metrics.add_bytes(machine.sent());
    metrics.finished(result.is_ok(), started.elapsed());
    debug!(ok = result.is_ok(), elapsed = ?started.elapsed(), "send finished");
    result.map(|()| SendReport {
        bytes: machine.sent(),
        elapsed: started.elapsed(),
    })
}

/// How long a failed tensor waits for its CANCEL to be acknowledged before giving up.
const CANCEL_GRACE: Duration = Duration::from_secs(2);

/// Sends METADATA, then DATA as credit allows, then END; returns on COMPLETE.
///
/// The progress timeout counts time without progress, not silence: while the receiver has
/// nothing to say (all credit granted, bytes still crossing a slow path), our data being
/// sent and resent shows that the transfer moves.
async fn drive(
    machine: &mut TensorSender,
    stream: &mut FrameStream,
    connection: &quinn::Connection,
    source: Source,
    sent: &AtomicU64,
    cancel: &CancellationToken,
    options: SendOptions,
) -> Result<(), TransportError> {
    let SendOptions {
        progress_timeout,
        chunk_size,
    } = options;
    let total = machine.meta().byte_len();
    let mut reader = SourceReader::open(source).await?;
    loop {
        while machine.state() == SenderState::Sending
            && machine.sent() < total
            && machine.next_chunk_len() > 0
        {
            let max = machine
                .next_chunk_len()
                .min(total - machine.sent())
                .min(chunk_size);
            let chunk = reader
                .next(usize::try_from(max).unwrap_or(usize::MAX))
                .await?;
            if chunk.is_empty() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("source ended after {} of {total} bytes", machine.sent()),
                )
                .into());
            }
            machine.send_data(chunk)?;
            tokio::select! {
                written = flush(machine, stream) => written?,
                _ = cancel.cancelled() => return Err(TransportError::cancelled_by("sending")),
            }
            sent.store(machine.sent(), Ordering::Relaxed);
        }
        if machine.state() == SenderState::Sending && machine.sent() == total {
            machine.finish()?;
        }
        flush(machine, stream).await?;
        let frame = tokio::select! {
            frame = next_frame_while_progressing(stream, connection, progress_timeout) => frame?,
            _ = cancel.cancelled() => return Err(TransportError::cancelled_by("sending")),
        };
        if machine.handle_frame(frame)? == SenderEvent::Complete {
            return Ok(());
        }
    }
}

/// The receiver's next frame; PROGRESS_TIMEOUT only after `timeout` with neither a frame nor
/// any STREAM frame sent on the connection (first sends and retransmissions: our data is
/// still crossing the path). Keep-alives and their acknowledgements are not progress.
async fn next_frame_while_progressing(
    stream: &mut FrameStream,
    connection: &quinn::Connection,
    timeout: Duration,
) -> Result<tensorwire_proto::Frame, TransportError> {
    let next = stream.next_frame();
    tokio::pin!(next);
    let mut sent = connection.stats().frame_tx.stream;
    loop {
        match tokio::time::timeout(timeout, &mut next).await {
            Ok(frame) => return frame,
            Err(_) => {
                let now = connection.stats().frame_tx.stream;
                if now == sent {
                    return Err(TransportError::timed_out(
                        "frame from the receiver while no data was moving",
                        timeout,
                    ));
                }
                sent = now;
            }
        }
    }
}

async fn flush(machine: &mut TensorSender, stream: &mut FrameStream) -> Result<(), TransportError> {
    stream
        .write_frames(std::iter::from_fn(|| machine.poll_frame()))
        .await
}

/// When the receiver stopped the stream, its CANCEL or REJECT says why: read it if it came.
async fn explain_stop(
    machine: &mut TensorSender,
    stream: &mut FrameStream,
    error: TransportError,
) -> TransportError {
    let stopped = matches!(
        &error,
        TransportError::Protocol(ProtocolError::Remote { .. })
    );
    if !stopped || machine.ending().is_some() {
        return error;
    }
    loop {
        match tokio::time::timeout(Duration::from_secs(1), stream.next_frame()).await {
            Ok(Ok(frame)) => match machine.handle_frame(frame) {
                Ok(_) => continue,
                Err(reason) => return reason.into(),
            },
            _ => return error,
        }
    }
}
