//! A receiver's TCP listener (spec §16): each TCP connection gets an endpoint of its own,
//! which serves the one QUIC connection it carries exactly as a UDP endpoint serves its
//! connections, on the runtime of the receiver's least loaded UDP endpoint.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use quinn::VarInt;
use tensorwire_proto::{CapExceeded, ErrorCode, PeerCaps};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tracing::{Instrument, info_span, warn};

use super::Shared;
use super::connection::serve_connection;
use super::incoming::IncomingTensor;
use crate::binding::Binding;
use crate::endpoint::socket_for;
use crate::error::TransportError;
use crate::runtime::EndpointRuntime;
use crate::steering::ConnectionSlot;
use crate::tcp_link::LinkEnd;
use crate::transport::TransportSettings;

/// Binds a TCP listener on `addr` (the UDP endpoints' address and port).
pub(super) fn listen(addr: SocketAddr) -> Result<TcpListener, std::io::Error> {
    let socket = socket_for(addr, socket2::Type::STREAM, socket2::Protocol::TCP)?;
    // A restarted receiver binds its port again while the last one's connections linger.
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    TcpListener::from_std(socket.into())
}

/// What serving TCP connections needs from the receiver.
pub(super) struct TcpServing {
    pub(super) listener: TcpListener,
    /// The server configuration for the TCP binding's transport settings.
    pub(super) server: quinn::ServerConfig,
    pub(super) settings: TransportSettings,
    /// The UDP endpoints' runtimes; the least loaded serves each TCP connection.
    pub(super) runtimes: Vec<EndpointRuntime>,
}

/// Accepts TCP connections until the receiver shuts down. Those that have not yet started
/// their QUIC handshake are capped as connections are (per peer and in all: spec §10), and
/// more are closed at once; once its handshake starts, a connection counts against the
/// receiver's connection caps as one over UDP does.
pub(super) async fn accept_links(
    serving: TcpServing,
    shared: Arc<Shared>,
    tx: mpsc::Sender<IncomingTensor>,
) {
    let waiting = Arc::new(Mutex::new(PeerCaps::new(
        shared.config.max_connections_per_peer,
        shared.config.max_connections,
    )));
    let mut turn = 0usize;
    loop {
        let accepted = tokio::select! {
            () = shared.shutdown.cancelled() => return,
            accepted = serving.listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of descriptors, or a connection reset before it was taken: wait a
                // little rather than spin.
                warn!(error = %e, "accepting a TCP connection failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let slot = match WaitingSlot::take(&waiting, peer.ip()) {
            Ok(slot) => slot,
            Err(cap) => {
                warn!(%peer, %cap, "closing a TCP connection that would wait for its handshake beyond a cap");
                continue;
            }
        };
        let stream = match stream.into_std() {
            Ok(stream) => stream,
            Err(e) => {
                warn!(%peer, error = %e, "taking a TCP connection failed");
                continue;
            }
        };
        let index = least_loaded(&shared, serving.runtimes.len(), turn);
        turn = turn.wrapping_add(1);
        let runtime = serving.runtimes[index].clone();
        let link = Link {
            index,
            peer,
            server: serving.server.clone(),
            settings: serving.settings.clone(),
        };
        let span = info_span!("connection", remote = %peer, endpoint = index, binding = "tcp");
        let (shared, tx) = (shared.clone(), tx.clone());
        runtime.handle.clone().spawn(
            async move {
                if let Err(e) = link.serve(stream, runtime, shared, tx, slot).await {
                    warn!(error = %e, "serving a TCP connection failed");
                }
            }
            .instrument(span),
        );
    }
}

/// A TCP connection waiting for its QUIC handshake to start, counted against its peer's and
/// the receiver's caps until dropped.
struct WaitingSlot {
    caps: Arc<Mutex<PeerCaps<IpAddr>>>,
    peer: IpAddr,
}

impl WaitingSlot {
    fn take(caps: &Arc<Mutex<PeerCaps<IpAddr>>>, peer: IpAddr) -> Result<Self, CapExceeded> {
        lock(caps).admit(&peer)?;
        Ok(Self {
            caps: caps.clone(),
            peer,
        })
    }
}

impl Drop for WaitingSlot {
    fn drop(&mut self) {
        lock(&self.caps).release(&self.peer);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Counting only: nothing a panic could leave half done.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Refuses every further connection attempt on a TCP connection's endpoint, until it closes.
async fn refuse_others(endpoint: quinn::Endpoint) {
    while let Some(incoming) = endpoint.accept().await {
        warn!(
            peer = %incoming.remote_address(),
            "refusing a second QUIC connection on one TCP connection (spec §16)"
        );
        incoming.refuse();
    }
}

/// The endpoint serving the fewest connections, of `endpoints`; ties go in turn from `turn`.
fn least_loaded(shared: &Shared, endpoints: usize, turn: usize) -> usize {
    let mut loads = vec![0usize; endpoints];
    for connection in shared.connections.iter() {
        if let Some(load) = loads.get_mut(connection.endpoint) {
            *load += 1;
        }
    }
    (0..endpoints)
        .map(|i| (turn + i) % endpoints)
        .min_by_key(|&i| loads[i])
        .unwrap_or(0)
}

/// One accepted TCP connection.
struct Link {
    /// The UDP endpoint whose runtime serves it.
    index: usize,
    peer: SocketAddr,
    server: quinn::ServerConfig,
    settings: TransportSettings,
}

/// Numbers the endpoints of TCP connections, for the receiver's list of them.
static LINK_IDS: AtomicU64 = AtomicU64::new(0);

impl Link {
    /// Serves the one QUIC connection the TCP connection carries (spec §16), then closes it.
    async fn serve(
        self,
        stream: std::net::TcpStream,
        runtime: EndpointRuntime,
        shared: Arc<Shared>,
        tx: mpsc::Sender<IncomingTensor>,
        waiting: WaitingSlot,
    ) -> Result<(), TransportError> {
        let (endpoint, link) =
            self.settings
                .endpoint_over_tcp(stream, Some(self.server.clone()), runtime)?;
        let id = LINK_IDS.fetch_add(1, Ordering::Relaxed);
        shared.tcp_endpoints.insert(id, endpoint.clone());
        let incoming = tokio::select! {
            incoming = endpoint.accept() => incoming,
            () = link.ended() => None,
            () = shared.shutdown.cancelled() => None,
            // A silent TCP connection ends as a silent QUIC connection would, so idle ones
            // cannot hold the receiver's TCP slots.
            () = tokio::time::sleep(self.settings.idle_timeout) => {
                warn!(
                    "closing a TCP connection that started no QUIC handshake within the idle \
                     timeout ({:?})",
                    self.settings.idle_timeout
                );
                None
            }
        };
        // Its handshake has started (or it has ended): the connection caps take over.
        drop(waiting);
        if let Some(incoming) = incoming {
            // Spec §16: one QUIC connection per TCP connection; any other is refused.
            tokio::spawn(refuse_others(endpoint.clone()));
            self.serve_admitted(incoming, (&endpoint, &link), shared.clone(), tx)
                .await;
        }
        shared.tcp_endpoints.remove(&id);
        endpoint.close(VarInt::from_u32(0), b"done");
        // The close leaves through the link, which quinn drops once the endpoint is idle.
        let _ = tokio::time::timeout(Duration::from_secs(1), endpoint.wait_idle()).await;
        Ok(())
    }

    /// Serves the QUIC connection `incoming` starts if the receiver's caps admit it; ends
    /// it at once if the TCP connection under it ends.
    async fn serve_admitted(
        &self,
        incoming: quinn::Incoming,
        (endpoint, link): (&quinn::Endpoint, &LinkEnd),
        shared: Arc<Shared>,
        tx: mpsc::Sender<IncomingTensor>,
    ) {
        let peer_slot = match shared.admit_connection(self.peer.ip()) {
            Ok(peer_slot) => peer_slot,
            Err(cap) => {
                warn!(%cap, "refusing a connection");
                incoming.refuse();
                return;
            }
        };
        let slots = (ConnectionSlot::unbalanced(), peer_slot);
        let serving = serve_connection(self.index, Binding::Tcp, shared, incoming, slots, tx);
        tokio::pin!(serving);
        tokio::select! {
            () = &mut serving => {}
            () = link.ended() => {
                let why = link.failure().unwrap_or_else(|| "the peer closed it".into());
                warn!(%why, "the TCP connection under a QUIC connection ended");
                endpoint.close(
                    VarInt::from_u32(ErrorCode::CANCELLED.0),
                    b"the TCP connection ended",
                );
                serving.await;
            }
        }
    }
}
