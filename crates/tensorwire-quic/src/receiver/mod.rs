//! The receiving endpoint: binds its UDP sockets, accepts connections, yields each incoming
//! tensor for admission, and streams its DATA into the application's [`Sink`] under one
//! receiver-wide credit budget and memory budget.
//!
//! - this module: the [`Receiver`] and what all its connections share;
//! - `connection`: one connection, its sans-IO session and its stream loop;
//! - `incoming`: [`IncomingTensor`] (admission) and [`TensorHandle`] (progress, result);
//! - `offload`: where large payloads are stored ([`StoreOffload`](crate::StoreOffload));
//! - `tensor`: one tensor's stream, from METADATA to COMPLETE, pumped through the session.
//!
//! [`Sink`]: tensorwire_sink::Sink

mod connection;
mod incoming;
mod offload;
mod state;
mod tcp;
mod tensor;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use dashmap::DashMap;
use quinn::VarInt;
use tensorwire_proto::{CapExceeded, ErrorCode, PeerCaps};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

use crate::binding::{Binding, Listening};
use crate::budget::{Budget, BudgetSnapshot};
use crate::config::ReceiverConfig;
use crate::connection::Connection;
use crate::error::TransportError;
use crate::metrics::{AdmissionSnapshot, Admissions, Metrics, MetricsSnapshot};
use crate::steering::ServerEndpoint;
use crate::transport::CLOSE_DRAIN;
use connection::accept_connections;
pub use incoming::{IncomingTensor, TensorHandle};
use offload::Offloader;
use state::ConnectionState;
use tensorwire_sink::{MemoryBudget, MemorySnapshot, PeerShares};

/// Incoming tensors waiting for the application before streams wait in turn.
const INCOMING_QUEUE: usize = 1024;

/// How long [`Receiver::close`] lets tensors in progress finish, and how long a finished
/// stream waits for its last frame to be acknowledged.
pub const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// A listening receiver, or the receiving half of one connection
/// ([`Connection::incoming`]). Call [`next`](Self::next) to admit incoming tensors.
pub struct Receiver {
    /// Empty for the receiving half of a connection this side opened.
    endpoints: Vec<quinn::Endpoint>,
    local: SocketAddr,
    incoming: mpsc::Receiver<IncomingTensor>,
    shared: Arc<Shared>,
    /// The development certificate's file (removed on drop) and PEM text.
    dev_cert: Option<(PathBuf, String)>,
}

/// A connection counted against its peer's and the receiver's caps; counted back when
/// dropped (its connection ended).
struct PeerSlot {
    shared: Arc<Shared>,
    peer: IpAddr,
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        self.shared.peers().release(&self.peer);
    }
}

impl Shared {
    fn peers(&self) -> std::sync::MutexGuard<'_, PeerCaps<IpAddr>> {
        // Counting only: nothing a panic could leave half done.
        self.peers.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts a new connection from `peer`, or says which cap it would break (spec §10).
    /// At the cap in all, peers are served in turn: an idle connection (no tensor stream
    /// open) of a peer holding more connections than `peer` is closed to make room.
    fn admit_connection(self: &Arc<Self>, peer: IpAddr) -> Result<PeerSlot, CapExceeded> {
        let admitted = self.peers().admit(&peer);
        match admitted {
            Ok(()) => {}
            Err(CapExceeded::Total { .. }) if self.close_idle_connection_for(peer) => {
                self.peers()
                    .admit_in_place_of_another(&peer)
                    .inspect_err(|cap| self.admissions.refused(*cap))?;
            }
            Err(cap) => {
                self.admissions.refused(cap);
                return Err(cap);
            }
        }
        Ok(PeerSlot {
            shared: self.clone(),
            peer,
        })
    }

    /// Closes the idle connection that makes the most room for `peer`: of the peer holding
    /// the most connections, more than `peer` holds; whether there was one.
    fn close_idle_connection_for(&self, peer: IpAddr) -> bool {
        let newcomer_holds = self.peers().held(&peer);
        let mut victim: Option<(usize, Arc<ConnectionState>)> = None;
        for entry in self.connections.iter() {
            let state = entry.value();
            let ip = state.connection.remote_address().ip();
            if ip == peer || state.connection.close_reason().is_some() {
                continue;
            }
            if state.session().open_streams() > 0 {
                continue;
            }
            let holds = self.peers().held(&ip);
            if holds > newcomer_holds + 1 && victim.as_ref().is_none_or(|(most, _)| holds > *most) {
                victim = Some((holds, state.clone()));
            }
        }
        let Some((holds, state)) = victim else {
            return false;
        };
        warn!(
            victim = %state.connection.remote_address(),
            holds,
            %peer,
            "closing an idle connection to make room for another peer"
        );
        state.close(
            ErrorCode::RESOURCE_EXHAUSTED,
            b"closed while idle: the receiver's connections are full and another peer needs one",
        );
        true
    }

    fn new(config: ReceiverConfig) -> Result<Arc<Self>, TransportError> {
        if config.session.grant_unit == 0 || config.session.stream_window == 0 {
            return Err(TransportError::Config(
                "grant_unit and stream_window must be at least one byte".into(),
            ));
        }
        let budget = Budget::new(config.budget, config.high_watermark, config.low_watermark)
            .map_err(|e| TransportError::Config(format!("budget and watermarks: {e}")))?;
        let host_memory = MemoryBudget::new("host", config.host_memory_budget)
            .keeping_spares(config.kept_host_memory.min(config.host_memory_budget / 8));
        Ok(Arc::new(Self {
            budget: Arc::new(budget),
            host_memory,
            metrics: Metrics::default(),
            admissions: Admissions::default(),
            connections: DashMap::new(),
            tcp_endpoints: DashMap::new(),
            shutdown: CancellationToken::new(),
            streams: TaskTracker::new(),
            admission: OnceLock::new(),
            offload: Arc::new(Offloader::new(
                config.store_offload,
                config.transport.endpoint_threads,
            )),
            metadata: MemoryBudget::new("METADATA", config.metadata_budget),
            peer_shares: PeerShares::new(),
            peers: Mutex::new(PeerCaps::new(
                config.max_connections_per_peer,
                config.max_connections,
            )),
            config,
        }))
    }
}

struct Shared {
    config: ReceiverConfig,
    budget: Arc<Budget>,
    host_memory: MemoryBudget,
    metrics: Metrics,
    /// Connections refused at the caps, and failed handshakes.
    admissions: Admissions,
    connections: DashMap<usize, Arc<ConnectionState>>,
    /// The endpoint of each open TCP connection (spec §16), to close them with the receiver.
    tcp_endpoints: DashMap<u64, quinn::Endpoint>,
    shutdown: CancellationToken,
    streams: TaskTracker,
    /// Decides tensors on their own stream's task, once set ([`Receiver::admit_with`]).
    admission: OnceLock<AdmissionPolicy>,
    /// Where large payloads are stored: on their stream's thread or beside it.
    offload: Arc<Offloader>,
    /// Connections served now, by peer address, against their caps (spec §10).
    peers: Mutex<PeerCaps<IpAddr>>,
    /// METADATA bytes of the open tensor streams (spec §10).
    metadata: MemoryBudget,
    /// Each connected peer's fair shares of the memory budgets (spec §7.5).
    peer_shares: PeerShares,
}

/// An application's decision on incoming tensors, called on each tensor's own task.
type AdmissionPolicy = Box<dyn Fn(IncomingTensor) + Send + Sync>;

/// Counters of one connection.
#[derive(Clone, Debug)]
pub struct ConnectionSnapshot {
    /// The peer's address now (it changes if the peer migrates).
    pub remote: SocketAddr,
    /// Which of the receiver's endpoints (UDP sockets) carries it; for one over TCP, the
    /// endpoint whose runtime serves it.
    pub endpoint: usize,
    /// What carries its packets.
    pub binding: Binding,
    /// Its tensors and bytes.
    pub metrics: MetricsSnapshot,
    /// Streams whose tensor ended and that are kept until the peer has finished its half
    /// and has our last frame (spec §4), for [`CLOSE_GRACE`] at most. A few at a time;
    /// many means the peer leaves its streams open after its tensors.
    pub closing_streams: usize,
}

/// The connections a receiver has open now ([`ReceiverObserver::open_connections`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpenConnections {
    /// Over UDP.
    pub udp: usize,
    /// Over TCP (spec §16).
    pub tcp: usize,
    /// Streams whose tensor ended, kept until the peer finishes its half (spec §4).
    pub closing_streams: usize,
}

/// Reads a receiver's counters from anywhere; cloned freely, it keeps only the counters
/// alive, not the receiver's endpoints.
#[derive(Clone)]
pub struct ReceiverObserver {
    shared: Arc<Shared>,
}

impl ReceiverObserver {
    /// Tensor and byte counters over all connections.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.shared.metrics.snapshot()
    }

    /// The shared byte budget's state.
    pub fn budget(&self) -> BudgetSnapshot {
        self.shared.budget.snapshot()
    }

    /// The host-memory budget's state.
    pub fn host_memory(&self) -> MemorySnapshot {
        self.shared.host_memory.snapshot()
    }

    /// The METADATA budget's state: bytes of METADATA the open tensor streams hold (spec
    /// §10).
    pub fn metadata_memory(&self) -> MemorySnapshot {
        self.shared.metadata.snapshot()
    }

    /// Connections refused at the caps, and failed handshakes.
    pub fn admissions(&self) -> AdmissionSnapshot {
        self.shared.admissions.snapshot()
    }

    /// How many connections are open, by binding, and their closing streams: cheap enough
    /// to read often (no connection's histogram is read, unlike
    /// [`connections`](Self::connections)).
    pub fn open_connections(&self) -> OpenConnections {
        let mut open = OpenConnections::default();
        for c in self.shared.connections.iter() {
            match c.binding {
                Binding::Udp => open.udp += 1,
                Binding::Tcp => open.tcp += 1,
            }
            open.closing_streams += c.closing_streams();
        }
        open
    }

    /// Counters of each open connection.
    pub fn connections(&self) -> Vec<ConnectionSnapshot> {
        self.shared
            .connections
            .iter()
            .map(|c| ConnectionSnapshot {
                remote: c.connection.remote_address(),
                endpoint: c.endpoint,
                binding: c.binding,
                metrics: c.metrics.snapshot(),
                closing_streams: c.closing_streams(),
            })
            .collect()
    }
}

impl std::fmt::Debug for ReceiverObserver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReceiverObserver")
            .field("metrics", &self.metrics())
            .finish_non_exhaustive()
    }
}

impl Receiver {
    /// Binds and starts accepting connections.
    pub async fn bind(config: ReceiverConfig) -> Result<Self, TransportError> {
        let (crypto, dev) = crate::tls::server_crypto(&config.tls)?;
        let mut server = quinn::ServerConfig::with_crypto(crypto);
        server.transport_config(config.receiving_transport().server_transport_config()?);
        if config.endpoints == 0 {
            return Err(TransportError::Config(
                "a receiver needs at least one endpoint".into(),
            ));
        }
        let (group, tcp) = bind_listening(&config, &server)?;
        let endpoints: Vec<quinn::Endpoint> = group.iter().map(|e| e.endpoint().clone()).collect();
        let local = endpoints[0].local_addr()?;
        let dev_cert = match dev {
            Some(dev) => {
                let path = crate::dev_trust::write_dev_cert(local, &dev.pem)?;
                warn!(
                    path = %path.display(),
                    fingerprint = %dev.fingerprint(),
                    "development trust: self-signed certificate for localhost; senders on this \
                     host trust it with no flags. Use PEM certificates in production"
                );
                Some((path, dev.pem))
            }
            None => None,
        };
        let shared = Shared::new(config)?;
        let (tx, incoming) = mpsc::channel(INCOMING_QUEUE);
        let steered = group.first().is_some_and(|e| e.is_steered());
        if let Some(serving) = tcp {
            tokio::spawn(tcp::accept_links(serving, shared.clone(), tx.clone()));
        }
        for endpoint in group {
            // Each endpoint's connections and their streams are served on its own runtime.
            let runtime = endpoint.runtime().clone();
            runtime.spawn(accept_connections(endpoint, shared.clone(), tx.clone()));
        }
        info!(%local, endpoints = endpoints.len(), steered, listening = ?shared.config.listening, "receiver listening");
        Ok(Self {
            endpoints,
            local,
            incoming,
            shared,
            dev_cert,
        })
    }

    /// The address the receiver listens on (for one on a connection this side opened, its
    /// local IP and port 0).
    pub fn local_addr(&self) -> Result<SocketAddr, TransportError> {
        match self.endpoints.first() {
            Some(endpoint) => Ok(endpoint.local_addr()?),
            None => Ok(self.local),
        }
    }

    /// The PEM of the self-signed certificate a development receiver
    /// ([`ServerTls::Development`](crate::ServerTls::Development))
    /// made, for senders that get it by a channel they trust; `None` with PEM certificates.
    pub fn development_certificate(&self) -> Option<&str> {
        self.dev_cert.as_ref().map(|(_, pem)| pem.as_str())
    }

    /// How many UDP sockets (endpoints) share the listening address.
    pub fn endpoint_count(&self) -> usize {
        self.endpoints.len()
    }

    /// The next incoming tensor, after its METADATA; `None` once the receiver is closed.
    pub async fn next(&mut self) -> Option<IncomingTensor> {
        self.incoming.recv().await
    }

    /// Decides each incoming tensor with `policy`, called on the tensor's own task as soon
    /// as its METADATA arrives, instead of queueing it for [`next`](Self::next).
    ///
    /// Through [`next`](Self::next), a tensor crosses two hand-offs between tasks (often
    /// between threads) before ACCEPT: to the application's task and back. For small
    /// tensors they are a large part of the latency; here there are none. The policy should
    /// decide at once ([`IncomingTensor::accept`] or [`reject`](IncomingTensor::reject)) and
    /// keep or hand off the [`TensorHandle`]; it must not block or panic. A policy may also
    /// move the tensor to a task of its own and decide there, as [`next`](Self::next)'s
    /// caller would.
    ///
    /// Tensors already queued for [`next`](Self::next) stay there. A receiver takes one
    /// policy: a second call is refused.
    pub fn admit_with(
        &self,
        policy: impl Fn(IncomingTensor) + Send + Sync + 'static,
    ) -> Result<(), TransportError> {
        self.shared.admission.set(Box::new(policy)).map_err(|_| {
            TransportError::Config("the receiver already has an admission policy".into())
        })
    }

    /// Tensor and byte counters over all connections.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.observer().metrics()
    }

    /// The shared byte budget's state.
    pub fn budget(&self) -> BudgetSnapshot {
        self.observer().budget()
    }

    /// The host-memory budget that [`IncomingTensor::accept_host`] admits tensors against.
    pub fn host_memory(&self) -> MemorySnapshot {
        self.observer().host_memory()
    }

    /// The receiver's host-memory budget itself (shared, not a copy), to watch it from other
    /// tasks or to admit memory of the application's own against it.
    pub fn host_memory_budget(&self) -> MemoryBudget {
        self.shared.host_memory.clone()
    }

    /// Counters of each open connection.
    pub fn connections(&self) -> Vec<ConnectionSnapshot> {
        self.observer().connections()
    }

    /// A handle that reads this receiver's counters from other tasks (a metrics endpoint),
    /// while the receiver itself is busy in [`next`](Self::next).
    pub fn observer(&self) -> ReceiverObserver {
        ReceiverObserver {
            shared: self.shared.clone(),
        }
    }

    /// Stops accepting, lets tensors in progress finish for up to [`CLOSE_GRACE`], then
    /// closes every connection with SHUTDOWN and waits, briefly, for the endpoints to go idle.
    pub async fn close(self) {
        self.shared.shutdown.cancel();
        self.shared.streams.close();
        let _ = tokio::time::timeout(CLOSE_GRACE, self.shared.streams.wait()).await;
        let links: Vec<quinn::Endpoint> = self
            .shared
            .tcp_endpoints
            .iter()
            .map(|e| e.value().clone())
            .collect();
        for endpoint in self.endpoints.iter().chain(&links) {
            endpoint.close(
                VarInt::from_u32(ErrorCode::SHUTDOWN.0),
                b"receiver shutting down",
            );
        }
        let idle = async {
            for endpoint in self.endpoints.iter().chain(&links) {
                endpoint.wait_idle().await;
            }
        };
        let _ = tokio::time::timeout(CLOSE_DRAIN, idle).await;
    }
}

/// Binds the receiver's UDP endpoints and, unless it listens on UDP only, a TCP listener on
/// the same port number (spec §16). With port 0, a port whose TCP number another process
/// holds is given up and another claimed.
fn bind_listening(
    config: &ReceiverConfig,
    server: &quinn::ServerConfig,
) -> Result<(Vec<ServerEndpoint>, Option<tcp::TcpServing>), TransportError> {
    let attempts = if config.listen.port() == 0 { 8 } else { 1 };
    let mut attempt = 0;
    loop {
        attempt += 1;
        let group = config.transport.reuse_port_endpoints(
            config.listen,
            config.endpoints,
            server.clone(),
            config.steering,
        )?;
        if config.listening == Listening::Udp {
            return Ok((group, None));
        }
        let local = group[0].endpoint().local_addr()?;
        match tcp::listen(local) {
            Ok(listener) => {
                let settings = config.receiving_transport().over_tcp();
                let mut tcp_server = server.clone();
                tcp_server.transport_config(settings.server_transport_config()?);
                let runtimes = group.iter().map(|e| e.endpoint_runtime().clone()).collect();
                let serving = tcp::TcpServing {
                    listener,
                    server: tcp_server,
                    settings,
                    runtimes,
                };
                return Ok((group, Some(serving)));
            }
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && attempt < attempts => {
                tracing::debug!(port = local.port(), "TCP port taken: claiming another");
            }
            Err(e) => {
                return Err(TransportError::Config(format!(
                    "listening on TCP {local} (a receiver listens on UDP and TCP with one port \
                     number; listen on UDP only to do without): {e}"
                )));
            }
        }
    }
}

impl Connection {
    /// Receives the tensors the peer sends on this connection (spec §3: either endpoint may
    /// send), under `config`'s budgets, limits and timeouts. Its `listen`, `tls`, `transport`
    /// and `endpoints` are not used, and the connection is never closed for idleness from
    /// this side. Until this is called, the peer's streams wait.
    ///
    /// One receiver per connection: a second call, or a call on a connection a
    /// [`Receiver`] accepted (whose tensors go to that receiver), is refused.
    pub fn incoming(&self, mut config: ReceiverConfig) -> Result<Receiver, TransportError> {
        let shared = Shared::new({
            config.session.idle_timeout = Duration::MAX;
            config
        })?;
        if !self.claim_incoming() {
            return Err(TransportError::Config(
                "something already receives this connection's tensors: a Receiver that \
                 accepted it, or an earlier call to incoming"
                    .into(),
            ));
        }
        let local = SocketAddr::new(
            self.connection
                .local_ip()
                .unwrap_or(std::net::Ipv4Addr::UNSPECIFIED.into()),
            0,
        );
        let (tx, incoming) = mpsc::channel(INCOMING_QUEUE);
        self.runtime.spawn(connection::serve_streams(
            0,
            shared.clone(),
            (self.connection.clone(), self.binding()),
            tx,
            Some(self.session.clone()),
        ));
        Ok(Receiver {
            endpoints: Vec::new(),
            local,
            incoming,
            shared,
            dev_cert: None,
        })
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.shared.shutdown.cancel();
        if let Some((path, _)) = &self.dev_cert {
            let _ = std::fs::remove_file(path);
        }
    }
}
