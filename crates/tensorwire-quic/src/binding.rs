//! What carries a connection's QUIC packets (spec §16): UDP datagrams, or one TCP
//! connection where UDP is blocked or lost. Everything above the packets is the same.

use std::time::Duration;

/// What carries one connection's packets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Binding {
    /// UDP datagrams: QUIC as RFC 9000 describes it.
    Udp,
    /// One TCP connection, each packet framed by its length (spec §16).
    Tcp,
}

impl std::fmt::Display for Binding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Udp => "QUIC over UDP",
            Self::Tcp => "QUIC over TCP",
        })
    }
}

/// How a sender reaches a receiver ([`SenderConfig::binding`], `sender --transport`).
///
/// [`SenderConfig::binding`]: crate::SenderConfig::binding
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum BindingChoice {
    /// UDP only.
    Udp,
    /// TCP only.
    Tcp,
    /// UDP, and TCP too if UDP has not completed a handshake within [`UDP_HEAD_START`]:
    /// whichever connects first is kept, UDP if both do (as browsers race QUIC and TCP).
    /// A receiver that answers over UDP, even to refuse, is not tried over TCP.
    #[default]
    Auto,
}

impl From<Binding> for BindingChoice {
    /// The choice of exactly `binding`.
    fn from(binding: Binding) -> Self {
        match binding {
            Binding::Udp => Self::Udp,
            Binding::Tcp => Self::Tcp,
        }
    }
}

/// How long [`BindingChoice::Auto`] waits for a UDP handshake before it tries TCP beside it.
pub const UDP_HEAD_START: Duration = Duration::from_millis(1000);

impl std::str::FromStr for BindingChoice {
    type Err = String;

    /// `quic` (or `udp`), `tcp` or `auto`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "quic" | "udp" => Ok(Self::Udp),
            "tcp" => Ok(Self::Tcp),
            "auto" => Ok(Self::Auto),
            _ => Err(format!("transport {s:?}: expected quic, tcp or auto")),
        }
    }
}

/// Which bindings a receiver listens on ([`ReceiverConfig::listening`], `receiver
/// --transport`): both on the same port number by default.
///
/// [`ReceiverConfig::listening`]: crate::ReceiverConfig::listening
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Listening {
    /// UDP and TCP, on the same port number.
    #[default]
    UdpAndTcp,
    /// UDP only.
    Udp,
    /// TCP only. The UDP port is still bound, so that TCP can have the same number, but
    /// nothing it receives is answered.
    Tcp,
}

impl Listening {
    /// Whether connections over `binding` are served.
    pub fn serves(self, binding: Binding) -> bool {
        matches!(
            (self, binding),
            (Self::UdpAndTcp, _) | (Self::Udp, Binding::Udp) | (Self::Tcp, Binding::Tcp)
        )
    }
}

impl std::str::FromStr for Listening {
    type Err = String;

    /// `both`, `quic` (or `udp`) or `tcp`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "both" => Ok(Self::UdpAndTcp),
            "quic" | "udp" => Ok(Self::Udp),
            "tcp" => Ok(Self::Tcp),
            _ => Err(format!("transport {s:?}: expected both, quic or tcp")),
        }
    }
}
