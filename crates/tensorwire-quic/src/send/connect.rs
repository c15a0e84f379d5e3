//! Opening a connection to a receiver over the binding a sender chose (spec §16): UDP, TCP,
//! or UDP with TCP raced beside it once UDP has had its head start.

use std::net::SocketAddr;
use std::sync::Arc;

use quinn::VarInt;
use quinn::crypto::rustls::QuicClientConfig;
use tensorwire_proto::ErrorCode;
use tokio::runtime::Handle;
use tracing::{info, warn};

use crate::binding::{Binding, BindingChoice, UDP_HEAD_START};
use crate::config::SenderConfig;
use crate::error::TransportError;
use crate::runtime::EndpointRuntime;
use crate::transport::CONNECTING_THREAD;

/// A handshake completed on an endpoint of the connection's own.
pub(super) struct Opened {
    pub(super) endpoint: quinn::Endpoint,
    pub(super) connection: quinn::Connection,
    /// Where the endpoint's work runs.
    pub(super) runtime: Handle,
    pub(super) binding: Binding,
}

/// Connects to `addr` over what `config.binding` chooses.
pub(super) async fn open(
    addr: SocketAddr,
    config: &SenderConfig,
    crypto: Arc<QuicClientConfig>,
) -> Result<Opened, TransportError> {
    match config.binding {
        BindingChoice::Udp => open_udp(addr, config, crypto).await,
        BindingChoice::Tcp => open_tcp(addr, config, crypto).await,
        BindingChoice::Auto => race(addr, config, crypto).await,
    }
}

/// UDP first; after [`UDP_HEAD_START`] with no handshake, TCP beside it. The first to
/// connect wins. An answer over UDP within the head start, even a refusal, ends the race:
/// UDP reaches the receiver.
async fn race(
    addr: SocketAddr,
    config: &SenderConfig,
    crypto: Arc<QuicClientConfig>,
) -> Result<Opened, TransportError> {
    let udp = open_udp(addr, config, crypto.clone());
    tokio::pin!(udp);
    if let Ok(answered) = tokio::time::timeout(UDP_HEAD_START, &mut udp).await {
        return answered;
    }
    let tcp = open_tcp(addr, config, crypto);
    tokio::pin!(tcp);
    let (mut udp_failed, mut tcp_failed) = (None, None);
    loop {
        tokio::select! {
            opened = &mut udp, if udp_failed.is_none() => match (opened, tcp_failed.take()) {
                (Ok(opened), _) => return Ok(opened),
                (Err(udp), Some(tcp)) => return Err(unreachable(addr, udp, tcp)),
                (Err(udp), None) => udp_failed = Some(udp),
            },
            opened = &mut tcp, if tcp_failed.is_none() => match (opened, udp_failed.take()) {
                (Ok(opened), _) => {
                    info!(
                        %addr,
                        head_start_ms = UDP_HEAD_START.as_millis(),
                        "UDP completed no handshake in its head start: connected over TCP"
                    );
                    return Ok(opened);
                }
                (Err(tcp), Some(udp)) => return Err(unreachable(addr, udp, tcp)),
                (Err(tcp), None) => tcp_failed = Some(tcp),
            },
        }
    }
}

fn unreachable(addr: SocketAddr, udp: TransportError, tcp: TransportError) -> TransportError {
    TransportError::Unreachable {
        addr,
        udp: Box::new(udp),
        tcp: Box::new(tcp),
    }
}

/// A QUIC connection over UDP, from an endpoint (UDP socket) of its own.
async fn open_udp(
    addr: SocketAddr,
    config: &SenderConfig,
    crypto: Arc<QuicClientConfig>,
) -> Result<Opened, TransportError> {
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
    Ok(Opened {
        endpoint,
        connection,
        runtime,
        binding: Binding::Udp,
    })
}

/// A QUIC connection over a TCP connection of its own (spec §16).
async fn open_tcp(
    addr: SocketAddr,
    config: &SenderConfig,
    crypto: Arc<QuicClientConfig>,
) -> Result<Opened, TransportError> {
    let settings = config.transport.clone().over_tcp();
    let mut client = quinn::ClientConfig::new(crypto);
    client.transport_config(settings.transport_config()?);
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .and_then(tokio::net::TcpStream::into_std)
        .map_err(|source| TransportError::TcpConnect { addr, source })?;
    let runtime = EndpointRuntime::start(settings.endpoint_threads, CONNECTING_THREAD)?;
    let handle = runtime.handle.clone();
    let (endpoint, link) = settings.endpoint_over_tcp(stream, None, runtime)?;
    let connecting = endpoint.connect_with(client, addr, &config.server_name)?;
    // A TCP connection closed before the handshake is a refusal (the receiver's caps), not
    // a silence to wait out.
    let connection = tokio::select! {
        connected = connecting => connected?,
        () = link.ended() => {
            return Err(TransportError::TcpClosed {
                addr,
                why: link.failure().unwrap_or_else(|| "closed".into()),
            });
        }
    };
    // A lost TCP connection ends the QUIC connection now, not at its idle timeout.
    let watched = connection.clone();
    handle.spawn(async move {
        tokio::select! {
            () = link.ended() => {}
            _ = watched.closed() => return,
        }
        let why = link
            .failure()
            .unwrap_or_else(|| "the receiver closed it".into());
        warn!(peer = %addr, %why, "the TCP connection under a QUIC connection ended");
        watched.close(
            VarInt::from_u32(ErrorCode::CANCELLED.0),
            b"the TCP connection ended",
        );
    });
    Ok(Opened {
        endpoint,
        connection,
        runtime: handle,
        binding: Binding::Tcp,
    })
}
