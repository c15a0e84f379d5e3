//! Endpoint, transport and receiver settings, with safe defaults for bulk transfer.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use quinn::{IdleTimeout, MtuDiscoveryConfig, TransportConfig, VarInt};
use tensorwire_proto::{Limits, SessionConfig};
use tensorwire_sink::MemoryLimit;
use tokio::runtime::Handle;

use crate::error::TransportError;
use crate::receiver::StoreOffload;
use crate::runtime::{EndpointRuntime, EndpointThreads};
use crate::socket::BatchSplitter;
use crate::steering::{
    Balance, MAX_STEERED_ENDPOINTS, ServerEndpoint, Steering, attach_steering, steered_ids,
};

/// Threads of an endpoint that accepts connections (a receiver's: `tensorwire-rx-0` for
/// its first), so that `top -H` and profilers tell them from a sender's. Linux keeps 15
/// characters of a thread's name.
pub const ACCEPTING_THREAD: &str = "tensorwire-rx";

/// Threads of an endpoint that connects (a [`Sender`](crate::Sender)'s).
pub const CONNECTING_THREAD: &str = "tensorwire-tx";

/// Smallest MTU: the datagram size QUIC requires every path to carry (RFC 9000 §14).
pub const MIN_MTU: u16 = 1200;

/// Largest MTU: a UDP datagram's largest payload over IPv4, which loopback carries. GSO
/// batches of packets this large go out one packet per send (the crate's `socket` module).
pub const MAX_MTU: u16 = 65_507;

/// Unidirectional streams a peer may have open at once: its control stream (spec §4.1) and a
/// few more, each stopped on arrival.
const UNI_STREAMS: u32 = 4;

/// The most a clean close waits: a receiver for its endpoints to go idle, QUIC's draining
/// period (three probe timeouts, which after a fast transfer that filled socket buffers
/// measured over a second); a sender only for its CONNECTION_CLOSE to go out.
pub(crate) const CLOSE_DRAIN: Duration = Duration::from_millis(100);

/// QUIC transport settings shared by senders and receivers.
#[derive(Clone, Debug)]
pub struct TransportSettings {
    /// UDP payload size to start with. [`MIN_MTU`] is safe anywhere; larger packets cost
    /// less CPU per byte: a jumbo-frame LAN carries its link MTU less 28, and loopback up to
    /// [`MAX_MTU`].
    pub mtu: u16,
    /// Largest UDP payload size: path MTU discovery (RFC 9000 §14.3) probes up to it and
    /// keeps the largest the path carries, and the peer may send up to it. At least `mtu`;
    /// equal to it, the size stays fixed. Two sides that differ use the smaller. quinn sizes
    /// each endpoint's receive buffers by it: at [`MAX_MTU`], about 134 MB of address space
    /// per endpoint, of which only what datagrams fill is ever committed.
    pub max_mtu: u16,
    /// Whether to batch packets with segmentation offload (GSO).
    pub segmentation_offload: bool,
    /// Bytes one stream may have unread in the peer's QUIC buffers.
    pub stream_receive_window: u32,
    /// Bytes the whole connection may have unread (quinn's default is unbounded).
    pub connection_receive_window: u32,
    /// Bytes this side may have unacknowledged in flight.
    pub send_window: u64,
    /// Concurrent tensors (bidirectional streams) the peer may open.
    pub max_concurrent_streams: u32,
    /// A connection silent this long is closed: how soon a dead peer is noticed. Both sides
    /// use the smaller of their two values.
    pub idle_timeout: Duration,
    /// Keep-alive interval, under the idle timeout.
    pub keep_alive: Duration,
    /// UDP socket send and receive buffer size requested from the OS. Linux caps it at
    /// `net.core.rmem_max` / `wmem_max` unless the process may exceed them (CAP_NET_ADMIN,
    /// which it then uses); a capped buffer is logged once. Small receive buffers drop
    /// bursts, and each drop halves a sender's congestion window.
    pub socket_buffer: usize,
    /// Congestion control.
    pub congestion: Congestion,
    /// Where each endpoint's work runs: by default one thread of its own per endpoint, so a
    /// connection's packets, timers and tensor streams stay on one core.
    pub endpoint_threads: EndpointThreads,
}

/// A QUIC congestion controller.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Congestion {
    /// CUBIC (loss-based): quinn's default, good on clean LANs and loopback.
    #[default]
    Cubic,
    /// BBR (model-based): far better on long paths with random loss, where loss-based
    /// control collapses to a fraction of the link.
    Bbr,
}

impl std::str::FromStr for Congestion {
    type Err = String;

    /// `cubic` or `bbr`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cubic" => Ok(Self::Cubic),
            "bbr" => Ok(Self::Bbr),
            other => Err(format!(
                "congestion control {other:?}: expected cubic or bbr"
            )),
        }
    }
}

impl Default for TransportSettings {
    fn default() -> Self {
        Self {
            mtu: MIN_MTU,
            max_mtu: MAX_MTU,
            segmentation_offload: true,
            stream_receive_window: 16 << 20,
            connection_receive_window: 64 << 20,
            send_window: 64 << 20,
            max_concurrent_streams: 1024,
            // A dead peer noticed within seconds on a LAN; a live one sends keep-alives six
            // times per timeout, so only a path silent that long ends a connection.
            idle_timeout: Duration::from_secs(6),
            keep_alive: Duration::from_secs(1),
            socket_buffer: 8 << 20,
            congestion: Congestion::Cubic,
            endpoint_threads: EndpointThreads::default(),
        }
    }
}

impl TransportSettings {
    /// Settings for loopback and jumbo-frame LANs: MTU 6000, fixed.
    pub fn jumbo() -> Self {
        Self::default().fixed_mtu(6000)
    }

    /// These settings with packets of `mtu` bytes from the start and never larger.
    pub fn fixed_mtu(self, mtu: u16) -> Self {
        Self {
            mtu,
            max_mtu: mtu,
            ..self
        }
    }

    /// These settings with `mtu` fixed where given ([`Self::fixed_mtu`]), else the automatic
    /// sizes for `addr` ([`Self::automatic_mtu`]): what a program's `--mtu` option means.
    pub fn with_mtu(self, mtu: Option<u16>, addr: SocketAddr) -> Self {
        match mtu {
            Some(mtu) => self.fixed_mtu(mtu),
            None => self.automatic_mtu(addr),
        }
    }

    /// These settings with the packet sizes for a connection to, or a receiver on, `addr`
    /// where none is given. On loopback: [`MAX_MTU`] from the start, which loopback carries
    /// and which moves several times as much per core. Elsewhere, including a receiver on
    /// every address: [`MIN_MTU`], safe on any path, and path MTU discovery up to
    /// [`MAX_MTU`], which finds 1472 on Ethernet and 8972 on 9000-byte jumbo frames.
    pub fn automatic_mtu(self, addr: SocketAddr) -> Self {
        let loopback = addr.ip().to_canonical().is_loopback();
        Self {
            mtu: if loopback { MAX_MTU } else { MIN_MTU },
            max_mtu: MAX_MTU,
            ..self
        }
    }

    /// Checks the settings; refuses an MTU outside what QUIC and UDP carry ([`MIN_MTU`] to
    /// [`MAX_MTU`]), and a starting MTU above the largest.
    pub fn validate(&self) -> Result<(), TransportError> {
        if self.mtu < MIN_MTU {
            return Err(TransportError::Config(format!(
                "MTU {} is below QUIC's minimum of {MIN_MTU}",
                self.mtu
            )));
        }
        if self.max_mtu > MAX_MTU {
            return Err(TransportError::Config(format!(
                "MTU {} is above the largest UDP payload over IPv4, {MAX_MTU}",
                self.max_mtu
            )));
        }
        if self.mtu > self.max_mtu {
            return Err(TransportError::Config(format!(
                "starting MTU {} is above the largest MTU, {}",
                self.mtu, self.max_mtu
            )));
        }
        if self.keep_alive >= self.idle_timeout {
            return Err(TransportError::Config(
                "keep-alive must be shorter than the idle timeout".into(),
            ));
        }
        Ok(())
    }

    /// A quinn endpoint on `addr` with these settings: socket buffers sized, and the largest
    /// UDP payload raised to `max_mtu` (quinn caps MTU discovery at 1472 otherwise).
    pub fn endpoint(
        &self,
        addr: SocketAddr,
        server: Option<quinn::ServerConfig>,
    ) -> Result<quinn::Endpoint, TransportError> {
        Ok(self.endpoint_with_runtime(addr, server)?.0)
    }

    /// As [`endpoint`](Self::endpoint), with the runtime its work runs on
    /// ([`Self::endpoint_threads`]): tasks that use its connections belong there.
    pub fn endpoint_with_runtime(
        &self,
        addr: SocketAddr,
        server: Option<quinn::ServerConfig>,
    ) -> Result<(quinn::Endpoint, Handle), TransportError> {
        // Bound first: a port that cannot be had starts no thread.
        let socket = self.socket(addr, PortSharing::Alone)?;
        let name = match server {
            Some(_) => ACCEPTING_THREAD,
            None => CONNECTING_THREAD,
        };
        let runtime = EndpointRuntime::start(self.endpoint_threads, name)?;
        let handle = runtime.handle.clone();
        Ok((self.endpoint_on(socket, server, None, runtime)?, handle))
    }

    /// `count` server endpoints on one address, each its own UDP socket bound with
    /// SO_REUSEPORT, each socket's receive path on its own task; `steering` decides which
    /// endpoint serves a connection (spec §3). With port 0, the first socket picks the port
    /// and the others join it.
    pub fn reuse_port_endpoints(
        &self,
        addr: SocketAddr,
        count: usize,
        server: quinn::ServerConfig,
        steering: Steering,
    ) -> Result<Vec<ServerEndpoint>, TransportError> {
        // Between the claim and the group's binds the port is free: receivers of this
        // process take turns, so none claims it in that gap.
        static CLAIMING: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _turn = CLAIMING
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Another process may take the claimed port in that gap (seen once on a busy host).
        // With port 0 the port is ours to choose, so claim another.
        let attempts = if count > 1 && addr.port() == 0 { 8 } else { 1 };
        let mut attempt = 0;
        let sockets = loop {
            attempt += 1;
            match self.bind_group(addr, count) {
                Err(TransportError::Io(e))
                    if e.kind() == std::io::ErrorKind::AddrInUse && attempt < attempts =>
                {
                    tracing::debug!(attempt, "claimed port taken before the group bound it");
                }
                bound => break bound?,
            }
        };
        let balance = (count > 1 && steering == Steering::ConnectionId)
            .then(|| steer(&sockets))
            .flatten();
        sockets
            .into_iter()
            .enumerate()
            .map(|(index, socket)| {
                // `steer` refuses groups whose index does not fit the ID's first byte.
                let ids = balance.as_ref().and_then(|_| u8::try_from(index).ok());
                let runtime = EndpointRuntime::start(
                    self.endpoint_threads,
                    &format!("{ACCEPTING_THREAD}-{index}"),
                )?;
                let handle = runtime.handle.clone();
                let endpoint = self.endpoint_on(socket, Some(server.clone()), ids, runtime)?;
                Ok(ServerEndpoint::new(
                    endpoint,
                    index,
                    balance.clone(),
                    handle,
                ))
            })
            .collect()
    }

    /// One try of [`reuse_port_endpoints`](Self::reuse_port_endpoints)'s binds.
    fn bind_group(
        &self,
        addr: SocketAddr,
        count: usize,
    ) -> Result<Vec<socket2::Socket>, TransportError> {
        let reuse = count > 1;
        let addr = if reuse {
            // Claim the address alone first. A socket with SO_REUSEPORT may be given, or bind
            // to, a port that another reuse-port socket of the same user holds, and the two
            // would then split each other's packets; a socket without it is refused (address
            // in use) or given a port nobody holds.
            let probe = self.socket(addr, PortSharing::Alone)?;
            probe
                .local_addr()?
                .as_socket()
                .ok_or_else(|| TransportError::Config("socket address".into()))?
        } else {
            addr
        };
        let sharing = if reuse {
            PortSharing::ReusePort
        } else {
            PortSharing::Alone
        };
        // The kernel numbers a group's sockets in the order they bind: the index that
        // steering names.
        (0..count).map(|_| self.socket(addr, sharing)).collect()
    }

    /// A UDP socket bound on `addr`, with these settings' buffer sizes.
    fn socket(
        &self,
        addr: SocketAddr,
        sharing: PortSharing,
    ) -> Result<socket2::Socket, TransportError> {
        self.validate()?;
        let socket = socket2::Socket::new(
            socket2::Domain::for_address(addr),
            socket2::Type::DGRAM,
            Some(socket2::Protocol::UDP),
        )?;
        if addr.is_ipv6() {
            socket.set_only_v6(false)?;
        }
        if sharing == PortSharing::ReusePort {
            // Linux admits only sockets of the same effective user to the group.
            socket.set_reuse_port(true)?;
        }
        size_buffers(&socket, self.socket_buffer);
        socket.bind(&addr.into())?;
        Ok(socket)
    }

    /// A quinn endpoint on a bound `socket`, run on `runtime`; `steered_index`, for an
    /// endpoint of a steered group, starts each of its connection IDs.
    fn endpoint_on(
        &self,
        socket: socket2::Socket,
        server: Option<quinn::ServerConfig>,
        steered_index: Option<u8>,
        runtime: EndpointRuntime,
    ) -> Result<quinn::Endpoint, TransportError> {
        let mut endpoint = quinn::EndpointConfig::default();
        if let Some(index) = steered_index {
            endpoint.cid_generator(steered_ids(index));
        }
        endpoint
            .max_udp_payload_size(self.max_mtu)
            .map_err(|e| TransportError::Config(format!("MTU {}: {e}", self.max_mtu)))?;
        let socket = runtime.quinn.wrap_udp_socket(socket.into())?;
        Ok(quinn::Endpoint::new_with_abstract_socket(
            endpoint,
            server,
            BatchSplitter::wrap(socket),
            runtime.quinn,
        )?)
    }

    /// The quinn transport configuration these settings describe, for the connecting side:
    /// it sends keep-alives so a connection waiting on a slow receiver stays up.
    pub fn transport_config(&self) -> Result<Arc<TransportConfig>, TransportError> {
        self.build_transport(Some(self.keep_alive))
    }

    /// The transport configuration for a receiver: no keep-alives of its own, so a silent
    /// peer reaches the idle timeout and its connection ends (spec §10).
    pub fn server_transport_config(&self) -> Result<Arc<TransportConfig>, TransportError> {
        self.build_transport(None)
    }

    fn build_transport(
        &self,
        keep_alive: Option<Duration>,
    ) -> Result<Arc<TransportConfig>, TransportError> {
        self.validate()?;
        let mut t = TransportConfig::default();
        let idle = IdleTimeout::try_from(self.idle_timeout)
            .map_err(|_| TransportError::Config("idle timeout too large".into()))?;
        t.max_concurrent_bidi_streams(VarInt::from_u32(self.max_concurrent_streams))
            // Spec §3, §4.1: the peer's control stream, and a few more to stop with
            // UNEXPECTED_FRAME (stopping one needs it to be allowed).
            .max_concurrent_uni_streams(VarInt::from_u32(UNI_STREAMS))
            .stream_receive_window(VarInt::from_u32(self.stream_receive_window))
            .receive_window(VarInt::from_u32(self.connection_receive_window))
            .send_window(self.send_window)
            .max_idle_timeout(Some(idle))
            .keep_alive_interval(keep_alive)
            .initial_mtu(self.mtu)
            .enable_segmentation_offload(self.segmentation_offload);
        // RFC 9002 §7.2 sizes the initial window by the datagram size; quinn's default
        // assumes 1200 bytes, under which a first packet above about 11 KB never goes out.
        let mtu = u64::from(self.mtu);
        let window = (2 * mtu).max(14_720).min(10 * mtu);
        match self.congestion {
            Congestion::Cubic => t.congestion_controller_factory(Arc::new(
                quinn::congestion::CubicConfig::default()
                    .initial_window(window)
                    .clone(),
            )),
            Congestion::Bbr => t.congestion_controller_factory(Arc::new(
                quinn::congestion::BbrConfig::default()
                    .initial_window(window)
                    .clone(),
            )),
        };
        let mut mtu_discovery = MtuDiscoveryConfig::default();
        // `validate` above keeps both MTUs within QUIC's and UDP's bounds.
        mtu_discovery.upper_bound(self.max_mtu);
        t.mtu_discovery_config(Some(mtu_discovery));
        Ok(Arc::new(t))
    }
}

/// How a receiver proves who it is, and whom it lets in.
#[derive(Clone, Debug)]
pub enum ServerTls {
    /// Development trust: a fresh self-signed certificate for `localhost`, whose PEM is
    /// written to [`dev_cert_path`](crate::dev_cert_path) so that senders on the same host find it.
    Development,
    /// Production: PEM certificate chain and private key files.
    Pem {
        /// Certificate chain, leaf first.
        cert: PathBuf,
        /// Private key (PKCS#8, PKCS#1 or SEC1).
        key: PathBuf,
        /// If set, clients must present a certificate issued by one of these CAs (mTLS).
        client_ca: Option<PathBuf>,
    },
}

/// How a sender checks the receiver, and proves who it is.
#[derive(Clone, Debug)]
pub enum ClientTls {
    /// Development trust: trust the certificate a development receiver on this host left at
    /// [`dev_cert_path`](crate::dev_cert_path) for the port being connected to.
    Development,
    /// Production: trust receivers whose certificate chains to one of these CAs.
    Pem {
        /// CA certificates (PEM).
        ca: PathBuf,
        /// Client certificate and key (PEM), for receivers that require mTLS.
        identity: Option<(PathBuf, PathBuf)>,
    },
}

/// Attaches connection-ID steering to a bound reuse-port group; `None`, logged, where the
/// kernel refuses it or the group is too large, and the kernel's address hash decides.
fn steer(sockets: &[socket2::Socket]) -> Option<Arc<Balance>> {
    if sockets.len() > MAX_STEERED_ENDPOINTS {
        tracing::warn!(
            endpoints = sockets.len(),
            "more endpoints than connection-ID steering can name ({MAX_STEERED_ENDPOINTS}): \
             connections spread by address hash"
        );
        return None;
    }
    match attach_steering(&sockets[0], sockets.len()) {
        Ok(()) => Some(Arc::new(Balance::new(sockets.len()))),
        Err(e) => {
            tracing::warn!(
                error = %e,
                "the kernel refused connection-ID steering: connections spread by address \
                 hash, unevenly, and a client that changes address loses its connection"
            );
            None
        }
    }
}

/// Whether a socket shares its port with the other endpoints of one receiver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PortSharing {
    /// The port is this socket's alone.
    Alone,
    /// SO_REUSEPORT: the kernel spreads connections over the sockets on the port.
    ReusePort,
}

/// Everything a [`Receiver`](crate::Receiver) needs.
#[derive(Clone, Debug)]
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
    /// Protocol limits enforced on every stream (spec §8).
    pub limits: Limits,
    /// Receiver-wide byte budget: granted-but-unarrived plus arrived-but-not-durable bytes
    /// never exceed it, however many senders connect (spec §7.1).
    pub budget: u64,
    /// Granting pauses when outstanding bytes reach this.
    pub high_watermark: u64,
    /// Granting resumes when outstanding bytes fall to this.
    pub low_watermark: u64,
    /// Bytes granted to a tensor in one CREDIT.
    pub grant_unit: u64,
    /// Most credit one tensor may hold unused, so one tensor cannot take the whole budget.
    /// Default 8 MiB: with 16 MiB, 8 receiving connections on a 16-core host moved 5–9%
    /// less (benches/README.md), likely because quinn copies a stream's waiting datagrams
    /// into one new buffer once more than 2,048 wait (about 2,800 at MTU 6000).
    pub stream_window: u64,
    /// Most a tensor's window grows to (spec §7.1): it doubles while a whole window of the
    /// tensor's bytes arrives faster than the window lets them over two of the connection's
    /// round trips (the smallest its QUIC stack reported), so a tensor alone on a long path
    /// is not held to `stream_window` per round trip. Default 16 MiB, QUIC's stream window
    /// ([`TransportSettings::stream_receive_window`]), which caps a stream's unread bytes
    /// whatever credit allows: raise both together. At or below `stream_window`, windows
    /// stay fixed.
    pub max_stream_window: u64,
    /// Most credit one connection may hold granted and not yet arrived, so one peer cannot
    /// take the whole budget from the others (spec §7.1). Default: half the budget.
    pub connection_window: u64,
    /// A stream with no frame for this long is cancelled with PROGRESS_TIMEOUT.
    pub progress_timeout: Duration,
    /// How long an incoming tensor may wait for the application's accept or reject.
    pub admission_timeout: Duration,
    /// Failed or cancelled streams a connection may have per [`Self::failure_window`] before
    /// it is closed with CANCEL_FLOOD (spec §10).
    pub max_failed_streams: u32,
    /// The failed-stream budget refills at [`Self::max_failed_streams`] per this window.
    pub failure_window: Duration,
    /// Host memory that tensors accepted with [`IncomingTensor::accept_host`] may hold at
    /// once, landed and not yet dropped by the application (spec §7.5). A tensor that does
    /// not fit waits up to [`Self::admission_timeout`], then is rejected with
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
    /// Tensors of one connection that may wait for the application's decision at once;
    /// more wait on their connection, so one peer cannot starve the others (spec §10).
    pub max_pending_per_connection: usize,
    /// A connection with no tensor stream open for this long is closed with
    /// PROGRESS_TIMEOUT, even if its peer keeps it alive (spec §10).
    pub connection_idle_timeout: Duration,
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
    /// Early credit offered to each connection (spec §7.6): a tensor up to this size goes
    /// in one round trip (EARLY, METADATA, DATA and END at once; ACCEPT and COMPLETE back).
    /// It comes out of [`Self::budget`], only while outstanding bytes stay at or below the
    /// low watermark. 0 offers none. Default: 1 MiB.
    pub early_credit: u64,
    /// Where DATA payloads of 1 MiB or more are stored (copied and checksummed into the
    /// sink): beside their connection's packet processing, or on the runtime that bound the
    /// receiver while the host has cores to spare. Default: [`StoreOffload::Auto`].
    pub store_offload: StoreOffload,
}

impl ReceiverConfig {
    /// A receiver on `listen` proving itself with `tls` (an explicit choice: development
    /// trust writes a certificate file, see [`ServerTls::Development`]); defaults otherwise:
    /// 256 MiB budget (high 7/8, low 1/2), the reference policy's grants, stream window,
    /// failure budget and early credit ([`SessionConfig::default`]), one endpoint per core.
    pub fn new(listen: SocketAddr, tls: ServerTls) -> Self {
        let budget = 256 << 20;
        let policy = SessionConfig::default();
        Self {
            listen,
            endpoints: default_endpoints(),
            steering: Steering::default(),
            tls,
            transport: TransportSettings::default(),
            limits: policy.limits,
            budget,
            high_watermark: budget / 8 * 7,
            low_watermark: budget / 2,
            grant_unit: policy.grant_unit,
            stream_window: policy.stream_window,
            max_stream_window: policy.max_stream_window,
            connection_window: budget / 2,
            progress_timeout: Duration::from_secs(30),
            admission_timeout: Duration::from_secs(30),
            max_failed_streams: policy.max_failed_streams,
            failure_window: policy.failure_window,
            host_memory_budget: default_host_memory_budget(),
            kept_host_memory: 1 << 30,
            memory_share_percent: 50,
            max_pending_per_connection: 64,
            connection_idle_timeout: Duration::from_secs(60),
            metadata_budget: 64 << 20,
            max_connections: 512,
            max_connections_per_peer: 64,
            early_credit: policy.early_credit,
            store_offload: StoreOffload::Auto,
        }
    }

    /// Sets the budget, with the high watermark at 7/8 and the low at 1/2 of it and each
    /// connection's window at half of it.
    pub fn with_budget(mut self, budget: u64) -> Self {
        self.budget = budget;
        self.high_watermark = budget / 8 * 7;
        self.low_watermark = budget / 2;
        self.connection_window = budget / 2;
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
    /// credit a connection holds (README: the memory bound).
    pub fn receiving_transport(&self) -> TransportSettings {
        let metadata = u64::from(self.limits.max_metadata_len) * METADATA_IN_QUIC_BUFFERS;
        let window = self.connection_window.saturating_add(metadata);
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

/// Everything a [`Sender`](crate::Sender) needs.
#[derive(Clone, Debug)]
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
        }
    }
}

/// Asks for `bytes` of send and receive buffer. Above `net.core.rmem_max` Linux silently caps
/// the request; a process with CAP_NET_ADMIN may go past the cap (`SO_RCVBUFFORCE`). A receive
/// buffer left under the request is logged once per process: on a fast path it overflows in
/// bursts (counted as `RcvbufErrors` in `/proc/net/snmp`), and every drop is a loss to the
/// sender's congestion control.
fn size_buffers(socket: &socket2::Socket, bytes: usize) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    // Best effort throughout: a smaller buffer still works, only slower.
    let _ = socket.set_recv_buffer_size(bytes);
    let _ = socket.set_send_buffer_size(bytes);
    // Linux reports twice what was set (the doubling is its bookkeeping overhead).
    let reported = |got: usize| {
        if cfg!(target_os = "linux") {
            got / 2
        } else {
            got
        }
    };
    let short = |got: std::io::Result<usize>| got.is_ok_and(|got| reported(got) < bytes);
    #[cfg(target_os = "linux")]
    {
        if short(socket.recv_buffer_size()) {
            let _ = rustix::net::sockopt::set_socket_recv_buffer_size_force(socket, bytes);
        }
        if short(socket.send_buffer_size()) {
            let _ = rustix::net::sockopt::set_socket_send_buffer_size_force(socket, bytes);
        }
    }
    if let Ok(got) = socket.recv_buffer_size().map(reported)
        && got < bytes
    {
        WARNED.call_once(|| {
            tracing::warn!(
                requested = bytes,
                granted = got,
                "UDP receive buffer capped by the OS: bursts may be dropped at high rates \
                 (raise net.core.rmem_max, e.g. sysctl -w net.core.rmem_max={bytes})"
            );
        });
    }
}
