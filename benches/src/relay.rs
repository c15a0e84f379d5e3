//! A UDP relay that holds every datagram for a fixed time in each direction: a long path
//! on loopback (`bench --delay-ms`), for raw quinn and tensorwire alike.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::net::UdpSocket;
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

/// Datagrams one direction of one client's path holds at most; past it the relay drops
/// them, as a router's full queue would.
const QUEUE: usize = 1 << 16;

/// Largest datagram relayed (the largest UDP payload).
const DATAGRAM: usize = 65_535;

/// Socket buffers asked for: a long path holds many datagrams in flight.
const SOCKET_BUFFER: usize = 64 << 20;

/// A running relay: dropping it stops it, its sockets and every task it started.
pub(crate) struct Relay {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Relay {
    /// The address clients send to.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts a relay in front of `server` that delays each datagram by `one_way` in each
/// direction. Each client address gets a socket of its own toward the server, so the
/// server sees as many peers as there are clients.
pub(crate) async fn delayed_path(server: SocketAddr, one_way: Duration) -> anyhow::Result<Relay> {
    let front = Arc::new(udp_socket("127.0.0.1:0".parse()?)?);
    let addr = front.local_addr()?;
    let task = tokio::spawn(async move {
        if let Err(e) = relay(front, server, one_way).await {
            eprintln!("delay relay stopped: {e}");
        }
    });
    Ok(Relay { addr, task })
}

/// Forwards what clients send to `server` through one socket per client, and the
/// server's answers back, each `one_way` later.
async fn relay(front: Arc<UdpSocket>, server: SocketAddr, one_way: Duration) -> anyhow::Result<()> {
    let mut toward_server: HashMap<SocketAddr, mpsc::Sender<(Instant, Bytes)>> = HashMap::new();
    // Owned here, so that aborting the relay aborts them too.
    let mut tasks = JoinSet::new();
    let mut buf = vec![0u8; DATAGRAM];
    loop {
        let (n, client) = front.recv_from(&mut buf).await?;
        let lane = match toward_server.get(&client) {
            Some(lane) => lane.clone(),
            None => {
                let back = Arc::new(udp_socket("127.0.0.1:0".parse()?)?);
                back.connect(server).await?;
                let lane = delayed_lane(&mut tasks, back.clone(), None);
                let back_lane = delayed_lane(&mut tasks, front.clone(), Some(client));
                tasks.spawn(async move {
                    let mut buf = vec![0u8; DATAGRAM];
                    while let Ok(n) = back.recv(&mut buf).await {
                        let datagram = Bytes::copy_from_slice(&buf[..n]);
                        let _ = back_lane.try_send((Instant::now() + one_way, datagram));
                    }
                });
                toward_server.insert(client, lane.clone());
                lane
            }
        };
        let datagram = Bytes::copy_from_slice(&buf[..n]);
        let _ = lane.try_send((Instant::now() + one_way, datagram));
    }
}

/// A queue whose datagrams go out on `socket` (to `to`, or where it is connected) once
/// their time comes, in order.
fn delayed_lane(
    tasks: &mut JoinSet<()>,
    socket: Arc<UdpSocket>,
    to: Option<SocketAddr>,
) -> mpsc::Sender<(Instant, Bytes)> {
    let (tx, mut rx) = mpsc::channel::<(Instant, Bytes)>(QUEUE);
    tasks.spawn(async move {
        while let Some((at, datagram)) = rx.recv().await {
            tokio::time::sleep_until(at).await;
            let sent = match to {
                Some(to) => socket.send_to(&datagram, to).await,
                None => socket.send(&datagram).await,
            };
            if sent.is_err() {
                break;
            }
        }
    });
    tx
}

/// A non-blocking UDP socket bound to `addr` with large buffers (as the OS allows).
fn udp_socket(addr: SocketAddr) -> anyhow::Result<UdpSocket> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::DGRAM,
        Some(socket2::Protocol::UDP),
    )?;
    let _ = socket.set_recv_buffer_size(SOCKET_BUFFER);
    let _ = socket.set_send_buffer_size(SOCKET_BUFFER);
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    Ok(UdpSocket::from_std(socket.into())?)
}
