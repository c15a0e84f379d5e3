//! What a receiver and a sender are configured with: budgets, windows, caps and timeouts
//! beside their transport settings and certificates.

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::time::Duration;

use tensorwire_proto::SessionConfig;
use tensorwire_sink::MemoryLimit;

use crate::binding::{BindingChoice, Listening};
use crate::steering::Steering;
use crate::tls::{ClientTls, ServerTls};
use crate::transport::TransportSettings;

/// Everything a [`Receiver`](crate::Receiver) needs. Start from [`Self::new`] and set the
/// fields you change: settings added later do not break that code.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ReceiverConfig {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// UDP sockets (quinn endpoints) bound on `listen` with SO_REUSEPORT. One socket's
    /// receive path is one task on one core; connections spread over the sockets, and all of
    /// them share this receiver's budgets and admission queue. Default: one per core, at
    /// most [`MAX_DEFAULT_ENDPOINTS`].
    pub endpoints: usize,
    /// Which endpoint serves a connection (spec §3). Default: by connection ID, evenly.
    pub steering: Steering,
    /// Certificates.
    pub tls: ServerTls,
    /// QUIC settings.
    pub transport: TransportSettings,
    /// Each connection's protocol policy (spec §7, §8, §10): frame limits, grants and
    /// windows, the failed-stream budget, early credit and the idle timeout. The session of
    /// every connection gets a copy. Defaults: [`SessionConfig::default`], with the
    /// connection window at half the budget ([`Self::with_budget`]).
    pub session: SessionConfig,
    /// Receiver-wide byte budget: granted-but-unarrived plus arrived-but-not-durable bytes
    /// never exceed it, however many senders connect (spec §7.1).
    pub budget: u64,
    /// Granting pauses when outstanding bytes reach this.
    pub high_watermark: u64,
    /// Granting resumes when outstanding bytes fall to this.
    pub low_watermark: u64,
    /// Host memory that tensors accepted with [`IncomingTensor::accept_host`] may hold at
    /// once, landed and not yet dropped by the application (spec §7.5). A tensor that does
    /// not fit waits up to the admission timeout ([`SessionConfig::admission_timeout`]), then is rejected with
    /// RESOURCE_EXHAUSTED. Default: a quarter of what the process may use, its control
    /// group's limit where that is below physical memory ([`MemoryLimit`]).
    ///
    /// [`IncomingTensor::accept_host`]: crate::IncomingTensor::accept_host
    pub host_memory_budget: u64,
    /// The most of [`Self::host_memory_budget`] kept in host buffers of dropped tensors for
    /// the next tensors of the same length, which then land with no page faults and no
    /// zeroing. Kept buffers count against the budget and are freed first whenever a tensor
    /// needs the memory. Never more than an eighth of the budget; 0 keeps none.
    pub kept_host_memory: u64,
    /// Of each memory budget (host memory, and each device's budget an application admits
    /// through [`IncomingTensor::memory_shares`]), the most one connection's tensors may hold
    /// at once, in percent (1 to 100), so a peer whose accepted tensors idle cannot starve the
    /// others (spec §7.5). Default: 50. Each peer's connections together hold at most `1/n`
    /// of each budget, and of the credit in flight, while `n` peers are connected (§7.1).
    ///
    /// [`IncomingTensor::memory_shares`]: crate::IncomingTensor::memory_shares
    pub memory_share_percent: u64,
    /// Bytes of METADATA the tensor streams open now may hold, in all; each connection may
    /// hold [`Self::memory_share_percent`] of it. A METADATA that does not fit is refused
    /// at once with RESOURCE_EXHAUSTED, so legal but large METADATA on many streams cannot
    /// grow the receiver's memory (spec §10). Default: 64 MiB.
    pub metadata_budget: u64,
    /// Connections served at once from all peers; more are refused before their handshake
    /// (each costs about half a MiB of state). Default: 512.
    pub max_connections: usize,
    /// Connections served at once from one peer (one IP address), so one peer cannot take
    /// every connection slot (spec §10). Default: 64, room for several senders of 8
    /// connections on one host.
    pub max_connections_per_peer: usize,
    /// Where DATA payloads of 1 MiB or more are stored (copied and checksummed into the
    /// sink): beside their connection's packet processing, or on the runtime that bound the
    /// receiver while the host has cores to spare. Default: [`StoreOffload::Auto`].
    pub store_offload: StoreOffload,
    /// Which bindings to listen on (spec §16). Default: [`Listening::UdpAndTcp`], TCP on
    /// the UDP port's number. A connection over TCP holds a few MiB more than one over UDP
    /// (its packets queued both ways); both count against the same connection caps.
    pub listening: Listening,
}

impl ReceiverConfig {
    /// A receiver on `listen` proving itself with `tls` (an explicit choice: development
    /// trust writes a certificate file, see [`ServerTls::Development`]); defaults otherwise:
    /// 256 MiB budget (high 7/8, low 1/2), the reference policy's grants, stream window,
    /// failure budget and early credit ([`SessionConfig::default`]), one endpoint per core.
    pub fn new(listen: SocketAddr, tls: ServerTls) -> Self {
        Self {
            listen,
            endpoints: default_endpoints(),
            steering: Steering::default(),
            tls,
            transport: TransportSettings::default(),
            session: SessionConfig::default(),
            // Set below, with the watermarks and the connection window they imply.
            budget: 0,
            high_watermark: 0,
            low_watermark: 0,
            host_memory_budget: default_host_memory_budget(),
            kept_host_memory: 1 << 30,
            memory_share_percent: 50,
            metadata_budget: 64 << 20,
            max_connections: 512,
            max_connections_per_peer: 64,
            store_offload: StoreOffload::Auto,
            listening: Listening::default(),
        }
        .with_budget(256 << 20)
    }

    /// Sets the budget, with the high watermark at 7/8 and the low at 1/2 of it and each
    /// connection's window at half of it.
    pub fn with_budget(mut self, budget: u64) -> Self {
        self.budget = budget;
        self.high_watermark = budget / 8 * 7;
        self.low_watermark = budget / 2;
        self.session.connection_window = budget / 2;
        self
    }

    /// Sets the host memory budget.
    pub fn with_host_memory_budget(mut self, bytes: u64) -> Self {
        self.host_memory_budget = bytes;
        self
    }

    /// The transport settings the receiver's connections use: QUIC buffers what a peer
    /// sends before the receiver reads it, and credit bounds DATA, not those bytes; so a
    /// connection's QUIC receive window is at most its credit window plus room for the
    /// METADATA of 16 streams at the largest METADATA length, so unread bytes stay near the
    /// credit a connection holds (docs/operators.md: the memory bound).
    pub fn receiving_transport(&self) -> TransportSettings {
        let metadata = u64::from(self.session.limits.max_metadata_len) * METADATA_IN_QUIC_BUFFERS;
        let window = self.session.connection_window.saturating_add(metadata);
        let window = u32::try_from(window).unwrap_or(u32::MAX);
        let mut transport = self.transport.clone();
        transport.connection_receive_window = transport.connection_receive_window.min(window);
        transport.stream_receive_window = transport
            .stream_receive_window
            .min(transport.connection_receive_window);
        transport
    }
}

/// METADATA frames of largest size that a receiver's connection may have unread in its QUIC
/// buffers beside its credit window ([`ReceiverConfig::receiving_transport`]).
const METADATA_IN_QUIC_BUFFERS: u64 = 16;

/// The most endpoints a receiver binds by default.
pub const MAX_DEFAULT_ENDPOINTS: usize = 8;

/// One endpoint per core, at most [`MAX_DEFAULT_ENDPOINTS`].
fn default_endpoints() -> usize {
    std::thread::available_parallelism()
        .map_or(1, usize::from)
        .clamp(1, MAX_DEFAULT_ENDPOINTS)
}

/// A quarter of the memory this process may use: its control group's limit where one is
/// tighter than physical memory ([`MemoryLimit`]).
fn default_host_memory_budget() -> u64 {
    MemoryLimit::of_this_process().bytes / 4
}

/// Everything a [`Sender`](crate::Sender) needs. Start from [`Self::new`] and set the fields
/// you change: settings added later do not break that code.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SenderConfig {
    /// Certificates.
    pub tls: ClientTls,
    /// QUIC settings.
    pub transport: TransportSettings,
    /// Name the receiver's certificate must carry.
    pub server_name: String,
    /// A tensor with no frame from the receiver for this long is cancelled.
    pub progress_timeout: Duration,
    /// Largest DATA payload sent (the receiver's ACCEPT may lower it). Several chunks must
    /// fit in the receiver's per-stream credit window to keep the pipe full, since credit
    /// comes back only when a whole chunk has arrived.
    pub chunk_size: u64,
    /// How long a [`SenderPool`](crate::SenderPool) keeps asking a receiver that refuses
    /// every connection (at its connection caps it serves peers in turn, spec §10) before
    /// failing. Default: 10 s.
    pub refused_retry_for: Duration,
    /// What carries the connection's packets (spec §16). Default: [`BindingChoice::Auto`],
    /// UDP, or TCP where UDP gets no answer.
    pub binding: BindingChoice,
}

impl SenderConfig {
    /// A sender checking receivers with `tls` (an explicit choice); defaults otherwise: a 60 s
    /// progress timeout, 1 MiB DATA payloads, 1200-byte packets.
    pub fn new(tls: ClientTls) -> Self {
        Self {
            tls,
            transport: TransportSettings::default(),
            server_name: "localhost".into(),
            progress_timeout: Duration::from_secs(60),
            chunk_size: 1 << 20,
            refused_retry_for: Duration::from_secs(10),
            binding: BindingChoice::default(),
        }
    }
}

/// Where a receiver stores the DATA payloads of tensors sent in large ones (copies and
/// checksums them into the sink). A tensor's stores move off its stream's thread at its
/// first payload of 1 MiB or more, if they may; its later payloads follow them there, stored
/// in order, until the host has no core to spare for them (`Auto`), when they come back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreOffload {
    /// On the runtime that bound the receiver, beside the stream's own thread, while the
    /// host has cores to spare: each connection carrying a tensor with payloads that large
    /// counts two cores (one for its packets, one for its peer or the application), and
    /// the tensors storing off their streams' threads take the rest. Never where that
    /// runtime has one thread, or where the endpoints already run on it
    /// ([`EndpointThreads::Caller`](crate::EndpointThreads)).
    #[default]
    Auto,
    /// Always on the stream's own task, beside its connection's packet processing.
    Never,
    /// Up to this many tensors at once (across the process's receivers) storing on the
    /// runtime that bound the receiver, whatever the load.
    UpTo(NonZeroUsize),
}

impl std::str::FromStr for StoreOffload {
    type Err = String;

    /// `auto`, `never`, or the most tensors at once storing off their streams' threads.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "never" => Ok(Self::Never),
            n => n.parse::<NonZeroUsize>().map(Self::UpTo).map_err(|_| {
                format!(
                    "store offload {s:?}: expected auto, never or a number of tensors (1 or more)"
                )
            }),
        }
    }
}
