//! The transport's error type: protocol errors with their wire codes, plus connection, TLS,
//! configuration, IO and sink failures.

use tensorwire_proto::{Blame, ErrorCode, ProtocolError};

/// Why a tensor, a connection or an endpoint failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The protocol layer failed: a peer broke a rule, cancelled, or the application misused
    /// the API. Carries the wire code.
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// The QUIC connection was lost or closed.
    #[error("connection: {0}")]
    Connection(#[from] quinn::ConnectionError),
    /// Connecting failed before the handshake started.
    #[error("connect: {0}")]
    Connect(#[from] quinn::ConnectError),
    /// Certificates or TLS settings are unusable.
    #[error("TLS: {0}")]
    Tls(String),
    /// Settings are invalid.
    #[error("configuration: {0}")]
    Config(String),
    /// A socket or file operation failed.
    #[error("IO: {0}")]
    Io(#[from] std::io::Error),
    /// The sink could not store the bytes.
    #[error("sink: {0}")]
    Sink(#[from] tensorwire_sink::SinkError),
    /// The receiver refused every connection for a while: it serves as many connections as
    /// its caps allow, per peer address and in all (spec §10), and had no room.
    #[error(
        "the receiver at {addr} refused every connection for {:.0} s: it is at its connection \
         cap (per address or in all; the receiver's --max-connections-per-peer and \
         --max-connections)",
        for_how_long.as_secs_f64()
    )]
    Refused {
        /// The receiver.
        addr: std::net::SocketAddr,
        /// How long connections were tried.
        for_how_long: std::time::Duration,
    },
    /// A TCP connection to the receiver could not be opened (spec §16).
    #[error("connecting over TCP to {addr}: {source}")]
    TcpConnect {
        /// The receiver.
        addr: std::net::SocketAddr,
        /// What the socket said.
        source: std::io::Error,
    },
    /// The receiver closed a TCP connection before its QUIC handshake completed, as it does
    /// at its connection caps (spec §16).
    #[error(
        "the receiver at {addr} closed the TCP connection before the QUIC handshake \
         completed ({why}): at its connection caps it closes new TCP connections at once"
    )]
    TcpClosed {
        /// The receiver.
        addr: std::net::SocketAddr,
        /// What the TCP connection said.
        why: String,
    },
    /// Neither binding reached the receiver ([`BindingChoice::Auto`]): UDP completed no
    /// handshake and TCP failed.
    ///
    /// [`BindingChoice::Auto`]: crate::BindingChoice::Auto
    #[error("the receiver at {addr} could not be reached over UDP ({udp}) nor over TCP ({tcp})")]
    Unreachable {
        /// The receiver.
        addr: std::net::SocketAddr,
        /// Why UDP failed.
        udp: Box<TransportError>,
        /// Why TCP failed.
        tcp: Box<TransportError>,
    },
}

impl TransportError {
    /// CANCELLED by this side's application (`side`: "sending" or "receiving").
    pub(crate) fn cancelled_by(side: &str) -> Self {
        ProtocolError::Local {
            code: ErrorCode::CANCELLED,
            reason: format!("cancelled by the {side} application"),
        }
        .into()
    }

    /// Whether the receiver refused the connection before its handshake (a cap, spec §10).
    pub(crate) fn is_refused_connection(&self) -> bool {
        match self {
            Self::Connection(quinn::ConnectionError::ConnectionClosed(close)) => {
                close.error_code == quinn::TransportErrorCode::CONNECTION_REFUSED
            }
            Self::TcpClosed { .. } => true,
            _ => false,
        }
    }

    /// The wire code, where the error has one.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            Self::Protocol(e) => Some(e.code()),
            Self::Sink(e) => Some(e.code),
            Self::Connection(quinn::ConnectionError::ApplicationClosed(close)) => {
                u32::try_from(close.error_code.into_inner())
                    .ok()
                    .map(ErrorCode)
            }
            _ => None,
        }
    }

    /// Who is to blame, where known.
    pub fn blame(&self) -> Option<Blame> {
        match self {
            Self::Protocol(e) => Some(e.blame()),
            Self::Sink(_) | Self::Io(_) => Some(Blame::LocalResource),
            Self::Tls(_) | Self::Config(_) => Some(Blame::Application),
            Self::Refused { .. } => Some(Blame::LocalResource),
            Self::Unreachable { udp, .. } => udp.blame(),
            _ => None,
        }
    }
}
