//! QUIC transport settings shared by senders and receivers, with safe defaults for bulk
//! transfer, and the quinn configuration they describe.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use quinn::{IdleTimeout, MtuDiscoveryConfig, TransportConfig, VarInt};

use crate::error::TransportError;
use crate::runtime::EndpointThreads;

/// Threads of an endpoint that accepts connections (a receiver's: `tensorwire-rx-0` for
/// its first), so that `top -H` and profilers tell them from a sender's. Linux keeps 15
/// characters of a thread's name.
pub const ACCEPTING_THREAD: &str = "tensorwire-rx";

/// Threads of an endpoint that connects (a [`Sender`](crate::Sender)'s).
pub const CONNECTING_THREAD: &str = "tensorwire-tx";

/// Smallest MTU: the datagram size QUIC requires every path to carry (RFC 9000 §14).
pub const MIN_MTU: u16 = 1200;

/// Largest MTU: a UDP datagram's largest payload over IPv4, which loopback carries. GSO
/// batches of packets this large go out one packet per send (the crate's `socket` module).
pub const MAX_MTU: u16 = 65_507;

/// Unidirectional streams a peer may have open at once: its control stream (spec §4.1) and a
/// few more, each stopped on arrival.
const UNI_STREAMS: u32 = 4;

/// The most a clean close waits: a receiver for its endpoints to go idle, QUIC's draining
/// period (three probe timeouts, which after a fast transfer that filled socket buffers
/// measured over a second); a sender only for its CONNECTION_CLOSE to go out.
pub(crate) const CLOSE_DRAIN: Duration = Duration::from_millis(100);

/// QUIC transport settings shared by senders and receivers.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct TransportSettings {
    /// UDP payload size to start with. [`MIN_MTU`] is safe anywhere; larger packets cost
    /// less CPU per byte: a jumbo-frame LAN carries its link MTU less 28, and loopback up to
    /// [`MAX_MTU`].
    pub mtu: u16,
    /// Largest UDP payload size: path MTU discovery (RFC 9000 §14.3) probes up to it and
    /// keeps the largest the path carries, and the peer may send up to it. At least `mtu`;
    /// equal to it, the size stays fixed. Two sides that differ use the smaller. quinn sizes
    /// each endpoint's receive buffers by it: at [`MAX_MTU`], about 134 MB of address space
    /// per endpoint, of which only what datagrams fill is ever committed.
    pub max_mtu: u16,
    /// Whether to batch packets with segmentation offload (GSO).
    pub segmentation_offload: bool,
    /// Bytes one stream may have unread in the peer's QUIC buffers.
    pub stream_receive_window: u32,
    /// Bytes the whole connection may have unread (quinn's default is unbounded).
    pub connection_receive_window: u32,
    /// Bytes this side may have unacknowledged in flight.
    pub send_window: u64,
    /// Concurrent tensors (bidirectional streams) the peer may open.
    pub max_concurrent_streams: u32,
    /// A connection silent this long is closed: how soon a dead peer is noticed. Both sides
    /// use the smaller of their two values.
    pub idle_timeout: Duration,
    /// Keep-alive interval, under the idle timeout.
    pub keep_alive: Duration,
    /// UDP socket send and receive buffer size requested from the OS. Linux caps it at
    /// `net.core.rmem_max` / `wmem_max` unless the process may exceed them (CAP_NET_ADMIN,
    /// which it then uses); a capped buffer is logged once. Small receive buffers drop
    /// bursts, and each drop halves a sender's congestion window.
    pub socket_buffer: usize,
    /// Congestion control.
    pub congestion: Congestion,
    /// Where each endpoint's work runs: by default one thread of its own per endpoint, so a
    /// connection's packets, timers and tensor streams stay on one core.
    pub endpoint_threads: EndpointThreads,
}

/// A QUIC congestion controller.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Congestion {
    /// CUBIC (loss-based): quinn's default, good on clean LANs and loopback.
    #[default]
    Cubic,
    /// BBR (model-based): far better on long paths with random loss, where loss-based
    /// control collapses to a fraction of the link.
    Bbr,
}

impl std::str::FromStr for Congestion {
    type Err = String;

    /// `cubic` or `bbr`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cubic" => Ok(Self::Cubic),
            "bbr" => Ok(Self::Bbr),
            other => Err(format!(
                "congestion control {other:?}: expected cubic or bbr"
            )),
        }
    }
}

impl Default for TransportSettings {
    fn default() -> Self {
        Self {
            mtu: MIN_MTU,
            max_mtu: MAX_MTU,
            segmentation_offload: true,
            stream_receive_window: 16 << 20,
            connection_receive_window: 64 << 20,
            send_window: 64 << 20,
            max_concurrent_streams: 1024,
            // A dead peer noticed within seconds on a LAN; a live one sends keep-alives six
            // times per timeout, so only a path silent that long ends a connection.
            idle_timeout: Duration::from_secs(6),
            keep_alive: Duration::from_secs(1),
            socket_buffer: 8 << 20,
            congestion: Congestion::Cubic,
            endpoint_threads: EndpointThreads::default(),
        }
    }
}

impl TransportSettings {
    /// Settings for loopback and jumbo-frame LANs: MTU 6000, fixed.
    pub fn jumbo() -> Self {
        Self::default().fixed_mtu(6000)
    }

    /// These settings with packets of `mtu` bytes from the start and never larger.
    pub fn fixed_mtu(self, mtu: u16) -> Self {
        Self {
            mtu,
            max_mtu: mtu,
            ..self
        }
    }

    /// These settings with `mtu` fixed where given ([`Self::fixed_mtu`]), else the automatic
    /// sizes for `addr` ([`Self::automatic_mtu`]): what a program's `--mtu` option means.
    pub fn with_mtu(self, mtu: Option<u16>, addr: SocketAddr) -> Self {
        match mtu {
            Some(mtu) => self.fixed_mtu(mtu),
            None => self.automatic_mtu(addr),
        }
    }

    /// These settings with the packet sizes for a connection to, or a receiver on, `addr`
    /// where none is given. On loopback: [`MAX_MTU`] from the start, which loopback carries
    /// and which moves several times as much per core. Elsewhere, including a receiver on
    /// every address: [`MIN_MTU`], safe on any path, and path MTU discovery up to what the
    /// route to `addr` carries by the kernel's account (its interface MTU less 28 over IPv4:
    /// 1472 on Ethernet, 8972 on 9000-byte jumbo frames), or [`MAX_MTU`] where it cannot
    /// say. Discovery then searches only sizes the first link can carry, and so finishes in
    /// a few round trips instead of losing probes far above it.
    pub fn automatic_mtu(self, addr: SocketAddr) -> Self {
        let loopback = addr.ip().to_canonical().is_loopback();
        if loopback {
            return Self {
                mtu: MAX_MTU,
                max_mtu: MAX_MTU,
                ..self
            };
        }
        // A receiver on every address has no one route; its peers' packets are bounded by
        // their own routes.
        let route = if addr.ip().is_unspecified() {
            None
        } else {
            crate::route::route_payload(addr)
                .map(|payload| payload.clamp(MIN_MTU.into(), MAX_MTU.into()))
                .and_then(|payload| u16::try_from(payload).ok())
        };
        Self {
            mtu: MIN_MTU,
            max_mtu: route.unwrap_or(MAX_MTU),
            ..self
        }
    }

    /// Checks the settings; refuses an MTU outside what QUIC and UDP carry ([`MIN_MTU`] to
    /// [`MAX_MTU`]), and a starting MTU above the largest.
    pub fn validate(&self) -> Result<(), TransportError> {
        if self.mtu < MIN_MTU {
            return Err(TransportError::Config(format!(
                "MTU {} is below QUIC's minimum of {MIN_MTU}",
                self.mtu
            )));
        }
        if self.max_mtu > MAX_MTU {
            return Err(TransportError::Config(format!(
                "MTU {} is above the largest UDP payload over IPv4, {MAX_MTU}",
                self.max_mtu
            )));
        }
        if self.mtu > self.max_mtu {
            return Err(TransportError::Config(format!(
                "starting MTU {} is above the largest MTU, {}",
                self.mtu, self.max_mtu
            )));
        }
        if self.keep_alive >= self.idle_timeout {
            return Err(TransportError::Config(
                "keep-alive must be shorter than the idle timeout".into(),
            ));
        }
        Ok(())
    }

    /// The quinn transport configuration these settings describe, for the connecting side:
    /// it sends keep-alives so a connection waiting on a slow receiver stays up.
    pub fn transport_config(&self) -> Result<Arc<TransportConfig>, TransportError> {
        self.build_transport(Some(self.keep_alive))
    }

    /// The transport configuration for a receiver: no keep-alives of its own, so a silent
    /// peer reaches the idle timeout and its connection ends (spec §10).
    pub fn server_transport_config(&self) -> Result<Arc<TransportConfig>, TransportError> {
        self.build_transport(None)
    }

    fn build_transport(
        &self,
        keep_alive: Option<Duration>,
    ) -> Result<Arc<TransportConfig>, TransportError> {
        self.validate()?;
        let mut t = TransportConfig::default();
        let idle = IdleTimeout::try_from(self.idle_timeout)
            .map_err(|_| TransportError::Config("idle timeout too large".into()))?;
        t.max_concurrent_bidi_streams(VarInt::from_u32(self.max_concurrent_streams))
            // Spec §3, §4.1: the peer's control stream, and a few more to stop with
            // UNEXPECTED_FRAME (stopping one needs it to be allowed).
            .max_concurrent_uni_streams(VarInt::from_u32(UNI_STREAMS))
            .stream_receive_window(VarInt::from_u32(self.stream_receive_window))
            .receive_window(VarInt::from_u32(self.connection_receive_window))
            .send_window(self.send_window)
            .max_idle_timeout(Some(idle))
            .keep_alive_interval(keep_alive)
            .initial_mtu(self.mtu)
            .enable_segmentation_offload(self.segmentation_offload);
        // RFC 9002 §7.2 sizes the initial window by the datagram size; quinn's default
        // assumes 1200 bytes, under which a first packet above about 11 KB never goes out.
        let mtu = u64::from(self.mtu);
        let window = (2 * mtu).max(14_720).min(10 * mtu);
        match self.congestion {
            Congestion::Cubic => t.congestion_controller_factory(Arc::new(
                quinn::congestion::CubicConfig::default()
                    .initial_window(window)
                    .clone(),
            )),
            Congestion::Bbr => t.congestion_controller_factory(Arc::new(
                quinn::congestion::BbrConfig::default()
                    .initial_window(window)
                    .clone(),
            )),
        };
        let mut mtu_discovery = MtuDiscoveryConfig::default();
        // `validate` above keeps both MTUs within QUIC's and UDP's bounds.
        mtu_discovery.upper_bound(self.max_mtu);
        t.mtu_discovery_config(Some(mtu_discovery));
        Ok(Arc::new(t))
    }
}
