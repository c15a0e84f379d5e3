//! Wire error codes, who is to blame for them, and the crate's error type (spec §9).

use std::fmt;

/// A wire error code carried by CANCEL and REJECT (spec §9).
///
/// Open: codes this version does not name survive decoding and print as hex.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ErrorCode(pub u32);

/// Who caused an error, derived from the code's range (spec §9.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Blame {
    /// The peer sent bytes that do not parse (0x01xx).
    MalformedBytes,
    /// The peer sent well-formed frames that break a rule or a limit (0x02xx).
    PeerBrokeRule,
    /// This side ran out of a local resource or failed internally (0x03xx).
    LocalResource,
    /// An application decided: cancelled, rejected by policy (0x04xx and 0x1000_0000 up).
    Application,
    /// A code outside every registered range.
    Unknown,
}

macro_rules! error_codes {
    ($($(#[doc = $doc:literal])* $name:ident = $value:literal,)*) => {
        impl ErrorCode {
            $($(#[doc = $doc])* pub const $name: ErrorCode = ErrorCode($value);)*

            /// The registered name of this code, if it has one.
            pub fn name(self) -> Option<&'static str> {
                match self.0 {
                    $($value => Some(stringify!($name)),)*
                    _ => None,
                }
            }

            /// Every registered code, in registry order.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$name,)*];
        }
    };
}

error_codes! {
    /// A frame's body does not match its type's layout.
    FRAME_MALFORMED = 0x0101,
    /// The frame type is not defined by this protocol version.
    UNKNOWN_FRAME_TYPE = 0x0102,
    /// METADATA names a dtype this version does not define.
    UNKNOWN_DTYPE = 0x0103,
    /// METADATA names a device kind this version does not define.
    UNKNOWN_DEVICE = 0x0104,
    /// A string field is not valid UTF-8.
    INVALID_UTF8 = 0x0105,
    /// The stream ended in the middle of a frame.
    TRUNCATED_FRAME = 0x0106,
    /// A remote-execution request or reply does not parse (spec §14).
    EXEC_MALFORMED = 0x0107,
    /// A frame arrived that the stream's state does not allow.
    UNEXPECTED_FRAME = 0x0201,
    /// METADATA's shape times dtype size differs from its byte length, or overflows.
    LENGTH_MISMATCH = 0x0202,
    /// A METADATA frame is longer than the receiver's limit.
    METADATA_TOO_LARGE = 0x0203,
    /// METADATA has more dimensions than the receiver's limit.
    TOO_MANY_DIMS = 0x0204,
    /// METADATA's name is longer than the receiver's limit.
    NAME_TOO_LONG = 0x0205,
    /// METADATA has more attributes than the receiver's limit.
    TOO_MANY_ATTRIBUTES = 0x0206,
    /// An attribute key or value is longer than the receiver's limit.
    ATTRIBUTE_TOO_LONG = 0x0207,
    /// A DATA payload is empty or longer than the receiver's limit.
    CHUNK_SIZE = 0x0208,
    /// A DATA frame reaches past the tensor's declared length.
    DATA_PAST_END = 0x0209,
    /// A DATA frame overlaps bytes already received.
    DATA_OVERLAP = 0x020A,
    /// END arrived while byte ranges were still missing.
    END_WITH_GAPS = 0x020B,
    /// The whole-tensor checksum in END does not match the bytes received.
    CHECKSUM_MISMATCH = 0x020C,
    /// The sender sent more bytes than it was granted, or the receiver granted past the end.
    CREDIT_VIOLATION = 0x020D,
    /// Out-of-order DATA left more separate ranges than the receiver's limit.
    TOO_MANY_GAPS = 0x020E,
    /// A CANCEL or REJECT reason is longer than the limit.
    REASON_TOO_LONG = 0x020F,
    /// The peer cancelled more streams than the connection's budget allows.
    CANCEL_FLOOD = 0x0210,
    /// METADATA declares a tensor larger than the receiver accepts.
    TENSOR_TOO_LARGE = 0x0211,
    /// A module is larger than the server's limit (spec §14.4).
    MODULE_TOO_LARGE = 0x0212,
    /// A request has more kernel arguments than the server's limit (spec §14.4).
    TOO_MANY_ARGUMENTS = 0x0213,
    /// A launch's grid, block or shared memory is zero or over the server's limits (spec §14.4).
    LAUNCH_TOO_LARGE = 0x0214,
    /// A kernel ran past its time limit, or a request asked for more than the server allows.
    RUN_TIME_EXCEEDED = 0x0215,
    /// A kernel faulted (illegal address, trap, misaligned access) (spec §14.5).
    KERNEL_FAULT = 0x0216,
    /// A module does not match its hash, does not load on the server's GPU, or lacks the
    /// function (spec §14.5).
    MODULE_INVALID = 0x0217,
    /// Arguments and tensors disagree: an input differs from its declaration, is missing,
    /// unknown or repeated (spec §14.2).
    ARGUMENT_MISMATCH = 0x0218,
    /// A part of a split tensor disagrees with its whole or the other parts: malformed split
    /// attributes, another name, dtype, shape or part count, overlapping or missing rows
    /// (spec §15).
    SPLIT_MISMATCH = 0x0219,
    /// No progress within the receiver's progress timeout.
    PROGRESS_TIMEOUT = 0x0301,
    /// This side could not get memory or buffers for the tensor.
    RESOURCE_EXHAUSTED = 0x0302,
    /// The sink failed to store the bytes.
    SINK_FAILED = 0x0303,
    /// An internal error of this implementation.
    INTERNAL = 0x0304,
    /// The application cancelled the tensor.
    CANCELLED = 0x0401,
    /// The application rejected the tensor.
    REJECTED = 0x0402,
    /// The receiver does not accept this dtype.
    UNSUPPORTED_DTYPE = 0x0404,
    /// The receiver cannot place the tensor on the requested device.
    UNSUPPORTED_DEVICE = 0x0405,
    /// The receiver does not support the requested checksum algorithm.
    UNSUPPORTED_CHECKSUM = 0x0406,
    /// The endpoint is shutting down.
    SHUTDOWN = 0x0407,
    /// The receiver lands this name in memory of its own whose dtype or shape differ.
    DESTINATION_MISMATCH = 0x0408,
    /// The server does not run kernels, or not for this peer (spec §14.6).
    EXEC_NOT_ALLOWED = 0x0409,
    /// The server has no module with the request's hash: send it again with the module.
    MODULE_NOT_CACHED = 0x040A,
}

impl ErrorCode {
    /// First code of the range left to applications (spec §9.1).
    pub const APPLICATION_BASE: u32 = 0x1000_0000;

    /// Who is to blame for this code, by its range.
    pub fn blame(self) -> Blame {
        match self.0 {
            0x0100..=0x01FF => Blame::MalformedBytes,
            0x0200..=0x02FF => Blame::PeerBrokeRule,
            0x0300..=0x03FF => Blame::LocalResource,
            0x0400..=0x04FF => Blame::Application,
            c if c >= Self::APPLICATION_BASE => Blame::Application,
            _ => Blame::Unknown,
        }
    }
}

impl fmt::Debug for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => write!(f, "{name} (0x{:04x})", self.0),
            None => write!(f, "unknown code 0x{:04x}", self.0),
        }
    }
}

/// An error of the tensorwire protocol layer.
///
/// Every variant maps to a wire code ([`ProtocolError::code`]) and says who is to blame.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// The peer sent bytes that do not parse as a frame.
    #[error("malformed frame from peer: {code}: {detail}")]
    Malformed {
        /// The wire code to send back.
        code: ErrorCode,
        /// What was wrong, for logs.
        detail: String,
    },
    /// The peer sent a well-formed frame that breaks a protocol rule or a limit.
    #[error("peer broke a protocol rule: {code}: {detail}")]
    PeerViolation {
        /// The wire code to send back.
        code: ErrorCode,
        /// What was wrong, for logs.
        detail: String,
    },
    /// The peer ended the tensor with CANCEL or REJECT.
    #[error("peer ended the tensor: {code}: {reason}")]
    Remote {
        /// The code the peer sent.
        code: ErrorCode,
        /// The reason text the peer sent.
        reason: String,
    },
    /// This side ended the tensor with CANCEL or REJECT.
    #[error("tensor ended locally: {code}: {reason}")]
    Local {
        /// The code sent to the peer.
        code: ErrorCode,
        /// The reason text sent to the peer.
        reason: String,
    },
    /// The peer exceeded one of the receiver's limits (spec §8); allocation-free to build.
    #[error("peer exceeded a limit: {code}: {what} is {value}, limit {limit}")]
    LimitExceeded {
        /// The wire code to send back.
        code: ErrorCode,
        /// Which quantity was too large.
        what: &'static str,
        /// Its value.
        value: u64,
        /// The limit it exceeded.
        limit: u64,
    },
    /// The local application called the API out of order or with bad arguments.
    #[error("local API misuse: {0}")]
    Misuse(&'static str),
}

impl ProtocolError {
    /// The wire code that describes this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Malformed { code, .. }
            | Self::PeerViolation { code, .. }
            | Self::LimitExceeded { code, .. }
            | Self::Remote { code, .. }
            | Self::Local { code, .. } => *code,
            Self::Misuse(_) => ErrorCode::INTERNAL,
        }
    }

    /// Who is to blame, as seen from this side.
    pub fn blame(&self) -> Blame {
        match self {
            Self::Malformed { .. } => Blame::MalformedBytes,
            Self::PeerViolation { .. } | Self::LimitExceeded { .. } => Blame::PeerBrokeRule,
            Self::Misuse(_) => Blame::LocalResource,
            Self::Remote { code, .. } | Self::Local { code, .. } => code.blame(),
        }
    }

    /// The reason text to put in a CANCEL or REJECT for this error.
    pub fn wire_reason(&self) -> String {
        match self {
            Self::Local { reason, .. } | Self::Remote { reason, .. } => reason.clone(),
            other => other.to_string(),
        }
    }

    /// Bytes from the peer that do not parse, answered with `code`.
    pub fn malformed(code: ErrorCode, detail: impl Into<String>) -> Self {
        Self::Malformed {
            code,
            detail: detail.into(),
        }
    }

    /// A well-formed message from the peer that breaks a rule, answered with `code`.
    pub fn violation(code: ErrorCode, detail: impl Into<String>) -> Self {
        Self::PeerViolation {
            code,
            detail: detail.into(),
        }
    }
}
