//! What the kernel knows of the path to a peer before any packet is sent: the MTU of the
//! route (the outgoing interface's, or a smaller path MTU the kernel learned).

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};

/// The largest UDP payload the route to `peer` carries by the kernel's account (its MTU less
/// the IP and UDP headers); `None` where the system cannot say (no route, or not Linux).
/// Connecting a UDP socket sends nothing.
pub(crate) fn route_payload(peer: SocketAddr) -> Option<u32> {
    let (bind, headers): (SocketAddr, u32) = match peer {
        SocketAddr::V4(_) => ((Ipv4Addr::UNSPECIFIED, 0).into(), 20 + 8),
        SocketAddr::V6(_) => ((Ipv6Addr::UNSPECIFIED, 0).into(), 40 + 8),
    };
    let socket = UdpSocket::bind(bind).ok()?;
    socket.connect(peer).ok()?;
    Some(route_mtu(&socket, peer)?.saturating_sub(headers))
}

#[cfg(target_os = "linux")]
fn route_mtu(socket: &UdpSocket, peer: SocketAddr) -> Option<u32> {
    match peer {
        SocketAddr::V4(_) => rustix::net::sockopt::ip_mtu(socket).ok(),
        SocketAddr::V6(_) => rustix::net::sockopt::ipv6_mtu(socket).ok(),
    }
}

#[cfg(not(target_os = "linux"))]
fn route_mtu(_socket: &UdpSocket, _peer: SocketAddr) -> Option<u32> {
    None
}
