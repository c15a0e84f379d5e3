//! The error type of remote execution.

use std::time::Duration;

use tensorwire_proto::{Blame, ErrorCode, ProtocolError};
use tensorwire_quic::TransportError;

/// Why a remote-execution call or server failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExecError {
    /// The server answered with an error (spec §14.3), or refused one of the request's
    /// tensors with this code.
    #[error("the server refused: {code}: {message}")]
    Refused {
        /// The wire code.
        code: ErrorCode,
        /// The server's reason.
        message: String,
    },
    /// The connection or a tensor of the request failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// A request or reply broke the protocol (a limit, a malformed message).
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// No reply arrived in time: the server may not execute (a version 1.0 receiver keeps
    /// the request as data, spec §14.1), or is overloaded.
    #[error(
        "no reply within {} s: the receiver may not support remote execution (spec §14), \
         or is busy",
        .0.as_secs()
    )]
    NoReply(Duration),
    /// The server's protocol version predates remote execution, or cannot say it has it
    /// (spec §3.1): nothing was sent.
    #[error(
        "{peer} negotiated protocol version {version}, which has no remote execution (spec \
         §3.1, §14): it needs a receiver of version 1.4 or later"
    )]
    Unsupported {
        /// The server's address.
        peer: std::net::SocketAddr,
        /// The version the connection negotiated.
        version: tensorwire_proto::Version,
    },
    /// The configuration cannot work; nothing was started.
    #[error("configuration: {0}")]
    Config(String),
    /// A file could not be read or written.
    #[error("{path}: {error}")]
    File {
        /// The file.
        path: std::path::PathBuf,
        /// What failed.
        error: std::io::Error,
    },
}

impl ExecError {
    /// The wire code, where there is one.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ExecError::Refused { code, .. } => Some(*code),
            ExecError::Transport(e) => e.code(),
            ExecError::Protocol(e) => Some(e.code()),
            ExecError::NoReply(_) => Some(ErrorCode::PROGRESS_TIMEOUT),
            ExecError::Config(_) | ExecError::File { .. } | ExecError::Unsupported { .. } => None,
        }
    }

    /// Who is to blame, by the code's range (spec §9.1), as the server sees it: a
    /// `PeerBrokeRule` from a server means this client's request or kernel.
    pub fn blame(&self) -> Option<Blame> {
        self.code().map(ErrorCode::blame)
    }
}
