//! Binding quinn endpoints: UDP sockets sized and bound (alone, or as a SO_REUSEPORT group
//! with connection-ID steering), each endpoint on its own runtime.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::runtime::Handle;

use crate::error::TransportError;
use crate::runtime::EndpointRuntime;
use crate::socket::BatchSplitter;
use crate::steering::{
    Balance, MAX_STEERED_ENDPOINTS, ServerEndpoint, Steering, attach_steering, steered_ids,
};
use crate::tcp_link::{LinkEnd, TcpLink};
use crate::transport::{ACCEPTING_THREAD, CONNECTING_THREAD, MAX_MTU, TransportSettings};

impl TransportSettings {
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
                let endpoint =
                    self.endpoint_on(socket, Some(server.clone()), ids, runtime.clone())?;
                Ok(ServerEndpoint::new(
                    endpoint,
                    index,
                    balance.clone(),
                    runtime,
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
        let socket = socket_for(addr, socket2::Type::DGRAM, socket2::Protocol::UDP)?;
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
}

impl TransportSettings {
    /// These settings for the TCP binding (spec §16): packets as large as QUIC allows from
    /// the first, since TCP segments them, and no path MTU discovery.
    pub fn over_tcp(self) -> Self {
        self.fixed_mtu(MAX_MTU)
    }

    /// A quinn endpoint whose packets travel on `stream`, a TCP connection (spec §16), on a
    /// runtime of its own ([`Self::endpoint_threads`]): raw QUIC over the TCP binding, as
    /// [`endpoint`](Self::endpoint) is over UDP. It carries one connection, to the stream's
    /// peer; the TCP connection closes once the endpoint and its connection are gone.
    pub fn tcp_endpoint(
        &self,
        stream: std::net::TcpStream,
        server: Option<quinn::ServerConfig>,
    ) -> Result<quinn::Endpoint, TransportError> {
        let name = match server {
            Some(_) => ACCEPTING_THREAD,
            None => CONNECTING_THREAD,
        };
        let runtime = EndpointRuntime::start(self.endpoint_threads, name)?;
        Ok(self.endpoint_over_tcp(stream, server, runtime)?.0)
    }

    /// A quinn endpoint whose packets travel on one TCP connection (spec §16), run on
    /// `runtime`, which the stream moves to; and the link's end, to watch.
    pub(crate) fn endpoint_over_tcp(
        &self,
        stream: std::net::TcpStream,
        server: Option<quinn::ServerConfig>,
        runtime: EndpointRuntime,
    ) -> Result<(quinn::Endpoint, LinkEnd), TransportError> {
        let (link, end) = {
            // Registered with the endpoint's runtime, whose tasks read and write it.
            let _on = runtime.handle.enter();
            TcpLink::start(tokio::net::TcpStream::from_std(stream)?)?
        };
        let mut endpoint = quinn::EndpointConfig::default();
        endpoint
            .max_udp_payload_size(MAX_MTU)
            .map_err(|e| TransportError::Config(format!("MTU {MAX_MTU}: {e}")))?;
        let endpoint =
            quinn::Endpoint::new_with_abstract_socket(endpoint, server, link, runtime.quinn)?;
        Ok((endpoint, end))
    }
}

/// An unbound socket of `kind` for `addr`'s family; on IPv6, dual-stack, so that `[::]`
/// serves IPv4 peers too.
pub(crate) fn socket_for(
    addr: SocketAddr,
    kind: socket2::Type,
    protocol: socket2::Protocol,
) -> std::io::Result<socket2::Socket> {
    let socket = socket2::Socket::new(socket2::Domain::for_address(addr), kind, Some(protocol))?;
    if addr.is_ipv6() {
        socket.set_only_v6(false)?;
    }
    Ok(socket)
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
