//! The sending side: one connection, many tensors at once, each on its own stream, never
//! more bytes in flight than the receiver granted.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_core::Stream;
use quinn::VarInt;
use quinn::crypto::rustls::QuicClientConfig;
use tensorwire_proto::{
    ErrorCode, Limits, SessionConfig, SessionEvent, StreamId, TensorMeta, TensorSender, Version,
};
use tokio::runtime::Handle;
use tokio::sync::OwnedSemaphorePermit;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info_span};

use crate::config::{ReceiverConfig, SenderConfig};
use crate::control::read_control_stream;
use crate::error::TransportError;
use crate::metrics::{Metrics, MetricsSnapshot};
use crate::receiver::Receiver;
use crate::session::ConnectionSession;
use crate::source::SourceReader;
use crate::stream::FrameStream;
use crate::transport::CLOSE_DRAIN;

/// Where a tensor's bytes come from.
pub enum Source {
    /// Bytes in memory, sent without copying.
    Bytes(Bytes),
    /// A region of a regular file starting at `offset`, as long as the tensor. It is mapped and sent
    /// from the page cache without a copy; the file must not be truncated while it is sent
    /// (the process would get SIGBUS, as with any mapped file), and bytes changed meanwhile
    /// fail the receiver's checksum.
    File {
        /// The file.
        path: PathBuf,
        /// Where the tensor's first byte is.
        offset: u64,
    },
    /// An async stream of chunks of any size, in order, adding up to the tensor's length.
    Stream(Pin<Box<dyn Stream<Item = std::io::Result<Bytes>> + Send>>),
}

impl Source {
    /// Its bytes `[offset, offset + len)`, for one part of a split tensor; `None` for a
    /// stream, which can only be read in order, and for bytes past the end of memory.
    pub fn slice(&self, offset: u64, len: u64) -> Option<Source> {
        match self {
            Source::Bytes(bytes) => {
                let start = usize::try_from(offset).ok()?;
                let end = start.checked_add(usize::try_from(len).ok()?)?;
                (end <= bytes.len()).then(|| Source::Bytes(bytes.slice(start..end)))
            }
            Source::File { path, offset: at } => Some(Source::File {
                path: path.clone(),
                offset: at.checked_add(offset)?,
            }),
            Source::Stream(_) => None,
        }
    }
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

/// A connection to a receiver that sends tensors, each on its own stream; it can also
/// receive the tensors the receiver sends back on it ([`receive`](Self::receive)).
pub struct Sender {
    /// The connection's own endpoint (UDP socket), held for the sender's life.
    _endpoint: quinn::Endpoint,
    sender: ConnectionSender,
    /// What the handshake selected (spec §3.1), read once.
    peer_version: Version,
}

/// Sends tensors on a connection someone else owns: the way back of a [`Receiver`]'s
/// connection ([`IncomingTensor::reply_sender`]), or a [`Sender`]'s own. Cheap to clone.
///
/// [`Receiver`]: crate::Receiver
/// [`IncomingTensor::reply_sender`]: crate::IncomingTensor::reply_sender
#[derive(Clone)]
pub struct ConnectionSender {
    connection: quinn::Connection,
    /// The connection's one session, shared with its receiving side.
    session: ConnectionSession,
    /// Where the connection's work runs: each tensor's task is spawned there.
    runtime: Handle,
    metrics: Arc<Metrics>,
    options: SendOptions,
}

/// Whether a tensor's DATA waits its turn on the connection
/// ([`ConnectionSession::take_turn`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Sharing {
    /// A tensor of more than one DATA frame waits for the large tensors before it on the
    /// connection to be done with the turn (spec §7.4); a smaller one goes at once.
    InTurn,
    /// At once, beside the others: the parts of a split tensor (spec §15). A part waiting
    /// behind a whole tensor that waits for memory at the receiver, memory held by the
    /// part's own parent, would wait until that tensor's admission timed out.
    Alongside,
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
    /// From the send's start, its turn on the connection waited for included, to COMPLETE.
    pub elapsed: Duration,
    /// What the send waited for, and how long: which side held it up.
    pub waited: SendWaits,
}

/// How long a send waited for each thing it needs; the rest of its time is its own work
/// (opening its source, laying out frames, handing bytes to QUIC). A split tensor's are
/// summed over its parts, which wait at once.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SendWaits {
    /// For the large tensors before it on its connection to be done with the turn (spec §7.4).
    pub turn: Duration,
    /// For the receiver: a stream it allows (QUIC's stream limit), its ACCEPT, CREDIT once
    /// the bytes granted were sent, and COMPLETE once every byte was. A slow or full
    /// receiver shows here.
    pub receiver: Duration,
    /// For the source's next checksummed chunk: a file's pages from disk, a stream's items.
    pub source: Duration,
    /// For QUIC to take the bytes: its send buffer full, so congestion control or a slow path
    /// holds them.
    pub transport: Duration,
}

impl std::fmt::Display for SendWaits {
    /// "receiver 1.20 s, source 0.00 s, QUIC 0.03 s, turn 0.50 s".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "receiver {:.2} s, source {:.2} s, QUIC {:.2} s, turn {:.2} s",
            self.receiver.as_secs_f64(),
            self.source.as_secs_f64(),
            self.transport.as_secs_f64(),
            self.turn.as_secs_f64()
        )
    }
}

impl std::ops::AddAssign for SendWaits {
    fn add_assign(&mut self, other: Self) {
        self.turn += other.turn;
        self.receiver += other.receiver;
        self.source += other.source;
        self.transport += other.transport;
    }
}

/// Awaits `future`, adding the time it took to `waited`.
async fn timed<T>(waited: &mut Duration, future: impl Future<Output = T>) -> T {
    let started = Instant::now();
    let out = future.await;
    *waited += started.elapsed();
    out
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

    fn spawn_send(&self, meta: TensorMeta, source: Source, sharing: Sharing) -> SendHandle {
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

/// One tensor being sent (on one stream, or as the parts of a split tensor).
pub struct SendHandle {
    task: JoinHandle<Result<SendReport, TransportError>>,
    progress: SendProgress,
    cancel: CancellationToken,
}

impl SendHandle {
    /// Payload bytes handed to QUIC so far.
    pub fn sent_bytes(&self) -> u64 {
        self.progress.sent_bytes()
    }

    /// The tensor's length.
    pub fn total_bytes(&self) -> u64 {
        self.progress.total
    }

    /// A progress reader that outlives [`finished`](Self::finished)'s borrow of the handle.
    pub fn progress(&self) -> SendProgress {
        self.progress.clone()
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

    /// One handle for the parts of a split tensor: it resolves when every part is
    /// COMPLETE, or with the first part's error, cancelling the others.
    pub(crate) fn joined(parts: Vec<SendHandle>, total: u64) -> SendHandle {
        let cancel = CancellationToken::new();
        let progress = SendProgress {
            sent: parts
                .iter()
                .flat_map(|p| p.progress.sent.iter().cloned())
                .collect(),
            total,
        };
        let tokens: Vec<_> = parts.iter().map(SendHandle::cancel_token).collect();
        let cancelled = cancel.clone();
        let task = tokio::spawn(async move {
            let cancel_all = || tokens.iter().for_each(CancellationToken::cancel);
            let started = std::time::Instant::now();
            let mut waiting: tokio::task::JoinSet<_> = parts
                .into_iter()
                .enumerate()
                .map(|(i, part)| async move { (i, part.finished().await) })
                .collect();
            let (mut bytes, mut waited, mut cancelling) = (0, SendWaits::default(), false);
            loop {
                let joined = tokio::select! {
                    joined = waiting.join_next() => joined,
                    () = cancelled.cancelled(), if !cancelling => {
                        cancel_all();
                        cancelling = true;
                        continue;
                    }
                };
                let Some(joined) = joined else { break };
                let (i, outcome) =
                    joined.map_err(|e| TransportError::Io(std::io::Error::other(e)))?;
                match outcome {
                    Ok(report) => {
                        bytes += report.bytes;
                        waited += report.waited;
                    }
                    Err(e) => {
                        cancel_all();
                        debug!(part = i, error = %e, "a part of a split tensor failed");
                        return Err(e);
                    }
                }
            }
            Ok(SendReport {
                bytes,
                elapsed: started.elapsed(),
                waited,
            })
        });
        SendHandle {
            task,
            progress,
            cancel,
        }
    }
}

/// Reads how far one tensor's send has got.
#[derive(Clone, Debug)]
pub struct SendProgress {
    /// One counter per stream the tensor goes on.
    sent: Arc<[Arc<AtomicU64>]>,
    total: u64,
}

impl SendProgress {
    /// Payload bytes handed to QUIC so far.
    pub fn sent_bytes(&self) -> u64 {
        self.sent.iter().map(|s| s.load(Ordering::Relaxed)).sum()
    }

    /// The tensor's length.
    pub fn total_bytes(&self) -> u64 {
        self.total
    }
}

#[allow(clippy::too_many_arguments)] // One send's parts, passed once from `send`.
async fn send_tensor(
    connection: quinn::Connection,
    session: ConnectionSession,
    meta: TensorMeta,
    source: Source,
    sent: &AtomicU64,
    cancel: Option<&CancellationToken>,
    metrics: Arc<Metrics>,
    options: SendOptions,
    sharing: Sharing,
) -> Result<SendReport, TransportError> {
    let mut count = CountedSend::start(metrics);
    let started = count.started;
    let total = meta.byte_len();
    let mut waited = SendWaits::default();
    let result = async {
        // Built before the stream is opened: building checks the metadata fits the wire.
        let machine = TensorSender::new(meta)?;
        let turn = if sharing == Sharing::InTurn && total > options.chunk_size {
            let turn = async { Ok(session.take_turn().await) };
            timed(&mut waited.turn, unless_cancelled(cancel, turn)).await?
        } else {
            None
        };
        // Opened once the tensor's turn has come, not while it queues (a file's pages would
        // be read long before they are sent): its first batches are checksummed while
        // METADATA waits for credit.
        let chunk_len = usize::try_from(options.chunk_size).unwrap_or(usize::MAX);
        let reader = SourceReader::open(source, total, chunk_len).await?;
        // The receiver's stream limit (QUIC's MAX_STREAMS) can hold the open.
        let (send, recv) = timed(&mut waited.receiver, connection.open_bi()).await?;
        let id = VarInt::from(send.id()).into_inner();
        session.lock().start_sending(id, machine)?;
        let mut tensor = OutgoingTensor {
            id,
            session: session.clone(),
            stream: FrameStream::new(send, recv, Limits::default()),
            settled: false,
            turn,
        };
        let outcome = tensor
            .drive(
                &connection,
                reader,
                total,
                sent,
                cancel,
                options,
                &mut waited,
            )
            .await;
        let outcome = match outcome {
            Err(e) => Err(tensor.explain_stop(e).await),
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
            session.lock().cancel(id, code, reason);
            let _ = tensor.flush().await;
        }
        let bytes = tensor.settle();
        tensor.stream.close(code);
        if code.is_some() {
            // Our CANCEL must reach the receiver before the application closes the connection,
            // which would discard it.
            tensor.stream.delivered(CANCEL_GRACE).await;
        }
        count.metrics.add_bytes(bytes);
        outcome.map(|()| bytes)
    }
    .await;
    count.finish(result.is_ok());
    debug!(ok = result.is_ok(), elapsed = ?started.elapsed(), "send finished");
    result.map(|bytes| SendReport {
        bytes,
        elapsed: started.elapsed(),
        waited,
    })
}

/// One send in a sender's metrics: started when made, failed if dropped unfinished (a send
/// future dropped midway).
struct CountedSend {
    metrics: Arc<Metrics>,
    started: Instant,
    finished: bool,
}

impl CountedSend {
    fn start(metrics: Arc<Metrics>) -> Self {
        metrics.started();
        Self {
            metrics,
            started: Instant::now(),
            finished: false,
        }
    }

    fn finish(&mut self, ok: bool) {
        self.metrics.finished(ok, self.started.elapsed());
        self.finished = true;
    }
}

impl Drop for CountedSend {
    fn drop(&mut self) {
        if !self.finished {
            self.metrics.finished(false, self.started.elapsed());
        }
    }
}

/// How long a stopped stream is read for the CANCEL or REJECT that explains the stop.
const STOP_EXPLAINED_WITHIN: Duration = Duration::from_secs(1);

/// How long a failed tensor waits for its CANCEL to be acknowledged before giving up.
const CANCEL_GRACE: Duration = Duration::from_secs(2);

/// One tensor we send: its stream, pumped through the connection's session.
struct OutgoingTensor {
    id: StreamId,
    session: ConnectionSession,
    stream: FrameStream,
    /// Whether the session let go of the stream; if not when dropped (a send future dropped
    /// midway), the tensor is cancelled.
    settled: bool,
    /// The connection's turn for large tensors' DATA, while this one holds it.
    turn: Option<OwnedSemaphorePermit>,
}

impl Drop for OutgoingTensor {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        self.session
            .lock()
            .cancel(self.id, ErrorCode::CANCELLED, "the sender dropped the send");
        self.settle();
        self.stream.abandon(ErrorCode::CANCELLED);
    }
}

impl OutgoingTensor {
    /// Has the session let go of the stream; returns the payload bytes sent on it.
    fn settle(&mut self) -> u64 {
        let mut session = self.session.lock();
        let bytes = session.sent(self.id);
        let _ = session.close_outgoing(self.id, Instant::now());
        self.settled = true;
        bytes
    }

    /// Sends METADATA, then DATA as credit allows, then END; returns on COMPLETE. Gives up
    /// the connection's turn (if held) once the session says it is done with it (spec §7.4),
    /// or once all its DATA is QUIC's. Adds what it waited for to `waited`.
    ///
    /// The progress timeout counts time without progress, not silence: while the receiver has
    /// nothing to say (all credit granted, bytes still crossing a slow path), our data being
    /// sent and resent shows that the transfer moves.
    #[allow(clippy::too_many_arguments)] // One send's parts, passed once from `send_tensor`.
    async fn drive(
        &mut self,
        connection: &quinn::Connection,
        mut reader: SourceReader,
        total: u64,
        sent: &AtomicU64,
        cancel: Option<&CancellationToken>,
        options: SendOptions,
        waited: &mut SendWaits,
    ) -> Result<(), TransportError> {
        let SendOptions {
            progress_timeout,
            chunk_size,
        } = options;
        let id = self.id;
        // Read once: quinn locks the connection's state for it, which its driver holds while
        // it builds packets, and the session judges turns by the smallest round trip given.
        let rtt_at_start = connection.rtt();
        loop {
            loop {
                let (allowed, done, turn_done) = {
                    let mut session = self.session.lock();
                    let turn_done =
                        self.turn.is_some() && session.turn_done(id, Instant::now(), rtt_at_start);
                    (session.next_chunk_len(id), session.sent(id), turn_done)
                };
                if turn_done {
                    // Spec §7.4: the next large tensor's METADATA and admission round trip
                    // overlap our last bytes, rather than follow them.
                    self.turn = None;
                }
                if allowed == 0 || done >= total {
                    break;
                }
                let max = allowed.min(total - done).min(chunk_size);
                // Checksummed already, batches ahead and off this task (which shares its
                // thread with the connection's driver): the session, shared by every stream
                // of the connection, is locked only to queue it.
                let chunk = timed(
                    &mut waited.source,
                    reader.next(usize::try_from(max).unwrap_or(usize::MAX)),
                )
                .await?;
                if chunk.is_empty() {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!("source ended after {done} of {total} bytes"),
                    )
                    .into());
                }
                let len = chunk.len() as u64;
                self.session.lock().send_checked(id, chunk)?;
                if done + len == total {
                    // The last DATA goes out with END, in the write below.
                    sent.store(total, Ordering::Relaxed);
                    break;
                }
                timed(
                    &mut waited.transport,
                    unless_cancelled(cancel, self.flush()),
                )
                .await?;
                sent.store(done + len, Ordering::Relaxed);
            }
            let all_queued = {
                let mut session = self.session.lock();
                let all_queued = session.sent(id) == total;
                if all_queued && session.is_sending(id) {
                    session.finish(id)?;
                }
                all_queued
            };
            // Our half stays open after END, so that a CANCEL can still follow it (spec §4).
            timed(&mut waited.transport, self.flush()).await?;
            if all_queued {
                // The next large tensor's METADATA and admission overlap our last DATA in
                // QUIC's send buffer and our wait for COMPLETE.
                self.turn = None;
            }
            let reply =
                next_frame_while_progressing(&mut self.stream, connection, progress_timeout);
            let frame = timed(&mut waited.receiver, unless_cancelled(cancel, reply)).await?;
            if self.session.lock().handle_reply(id, frame)? == SessionEvent::Complete {
                // The receiver's FIN comes with COMPLETE.
                self.stream.read_fin_if_arrived();
                return Ok(());
            }
        }
    }

    /// Writes what the session queued for this stream.
    async fn flush(&mut self) -> Result<(), TransportError> {
        self.session.flush(self.id, &mut self.stream).await
    }

    /// When the receiver stopped the stream, its CANCEL or REJECT says why
    /// ([`FrameStream::explain_stop`]), unless the tensor already ended otherwise.
    async fn explain_stop(&mut self, error: TransportError) -> TransportError {
        if self.session.lock().ending(self.id).is_some() {
            return error;
        }
        let (session, id) = (&self.session, self.id);
        self.stream
            .explain_stop(error, STOP_EXPLAINED_WITHIN, |frame| {
                session.lock().handle_reply(id, frame).map(drop)
            })
            .await
    }
}

/// `future`'s output, or CANCELLED once `cancel` (if any) is cancelled. `future` is polled
/// first: no random draw per poll, and an outcome that is in wins.
async fn unless_cancelled<T>(
    cancel: Option<&CancellationToken>,
    future: impl Future<Output = Result<T, TransportError>>,
) -> Result<T, TransportError> {
    tokio::select! {
        biased;
        out = future => out,
        () = cancelled(cancel) => Err(TransportError::cancelled_by("sending")),
    }
}

/// Resolves once `cancel` (if any) is cancelled.
async fn cancelled(cancel: Option<&CancellationToken>) {
    match cancel {
        Some(cancel) => cancel.cancelled().await,
        None => std::future::pending().await,
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
    // A reply that came with the last one (COMPLETE with ACCEPT) needs no timer.
    if let Some(frame) = stream.buffered_frame()? {
        return Ok(frame);
    }
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
