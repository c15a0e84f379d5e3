//! Command-line options shared by the programs.

use std::net::SocketAddr;
use std::path::PathBuf;

use std::time::Duration;

use tensorwire::quic::{ClientTls, Congestion, EndpointThreads, ServerTls, TransportSettings};

/// QUIC options.
#[derive(clap::Args, Debug, Clone)]
pub struct TransportArgs {
    /// UDP payload size, 1200 to 65507, fixed. Larger packets cost less CPU per byte:
    /// loopback carries up to 65507, a jumbo-frame LAN its link MTU less 28 (8972 for 9000).
    /// Default: 65507 on a loopback address; elsewhere 1200 to start, then probing up to
    /// 65507 for what the path carries. Two sides that differ use the smaller.
    #[arg(long)]
    pub mtu: Option<u16>,
    /// Congestion control: cubic, or bbr for long paths with loss (far faster there).
    #[arg(long, default_value = "cubic")]
    pub congestion: Congestion,
    /// Seconds without any packet from the peer before the connection is declared dead
    /// (keep-alives go every sixth of it). Raise it for paths that can go silent longer.
    #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(u64).range(2..=3600))]
    pub idle_timeout_s: u64,
    /// Threads of each endpoint (UDP socket) of its own, which run its connections' packets
    /// and tensor streams together; `caller` spreads them over the program's runtime.
    #[arg(long, default_value = "1")]
    pub endpoint_threads: EndpointThreads,
}

impl TransportArgs {
    /// The transport settings these options describe, for a connection to or a receiver on
    /// `addr` (which picks the MTU where none is given).
    pub fn settings(&self, addr: SocketAddr) -> TransportSettings {
        let idle_timeout = Duration::from_secs(self.idle_timeout_s);
        let mut settings = TransportSettings::default();
        settings.congestion = self.congestion;
        settings.idle_timeout = idle_timeout;
        settings.keep_alive = (idle_timeout / 6).max(Duration::from_millis(250));
        settings.endpoint_threads = self.endpoint_threads;
        settings.with_mtu(self.mtu, addr)
    }
}

/// A whole number of seconds from the command line as a duration, refusing 0.
pub fn seconds(s: &str) -> Result<Duration, String> {
    match s.parse::<u64>() {
        Ok(0) => Err("must be at least 1 second".into()),
        Ok(n) if n <= 86_400 => Ok(Duration::from_secs(n)),
        Ok(_) => Err("must be at most 86400 seconds (a day)".into()),
        Err(e) => Err(format!("{s:?}: {e}")),
    }
}

/// MiB from the command line as bytes, refusing 0 and values that overflow.
pub fn mebibytes(s: &str) -> Result<u64, String> {
    let mib: u64 = s.parse().map_err(|e| format!("{s:?}: {e}"))?;
    match mib.checked_mul(1 << 20) {
        Some(0) => Err("must be at least 1 MiB".into()),
        Some(bytes) => Ok(bytes),
        None => Err(format!("{mib} MiB does not fit in 64 bits of bytes")),
    }
}

/// Receiver certificate options; none means development trust on one host.
#[derive(clap::Args, Debug, Clone)]
pub struct ServerTlsArgs {
    /// PEM certificate chain (production). Without it, a self-signed development
    /// certificate is made and left where senders on this host find it.
    #[arg(long, requires = "key")]
    pub cert: Option<PathBuf>,
    /// PEM private key for --cert.
    #[arg(long, requires = "cert")]
    pub key: Option<PathBuf>,
    /// Require client certificates issued by this PEM CA (mutual TLS).
    #[arg(long, requires = "cert")]
    pub client_ca: Option<PathBuf>,
}

impl ServerTlsArgs {
    /// The TLS mode these options describe.
    pub fn tls(&self) -> ServerTls {
        match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => ServerTls::Pem {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: self.client_ca.clone(),
            },
            _ => ServerTls::Development,
        }
    }
}

/// Sender certificate options; none means development trust on one host.
#[derive(clap::Args, Debug, Clone)]
pub struct ClientTlsArgs {
    /// PEM CA that issued the receiver's certificate (production).
    #[arg(long)]
    pub ca: Option<PathBuf>,
    /// PEM client certificate, for receivers that require mutual TLS.
    #[arg(long, requires_all = ["ca", "client_key"])]
    pub client_cert: Option<PathBuf>,
    /// PEM private key for --client-cert.
    #[arg(long, requires = "client_cert")]
    pub client_key: Option<PathBuf>,
    /// Name the receiver's certificate must carry.
    #[arg(long, default_value = "localhost")]
    pub server_name: String,
}

impl ClientTlsArgs {
    /// The TLS mode these options describe.
    pub fn tls(&self) -> ClientTls {
        match &self.ca {
            Some(ca) => ClientTls::Pem {
                ca: ca.clone(),
                identity: self.client_cert.clone().zip(self.client_key.clone()),
            },
            None => ClientTls::Development,
        }
    }
}

/// Logs to stderr; `RUST_LOG` overrides `default` (e.g. `RUST_LOG=tensorwire_quic=debug`).
pub fn init_logging(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colour_on_stderr())
        .init();
}

/// Whether stderr may carry colour: a terminal, and no `NO_COLOR` (no-color.org). A log
/// redirected to a file gets plain text.
pub fn colour_on_stderr() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// Bytes per second as a short human figure.
pub fn rate(bytes: u64, seconds: f64) -> String {
    let per_second = bytes as f64 / seconds.max(1e-9);
    format!(
        "{:.2} GB/s ({:.1} Gbit/s)",
        per_second / 1e9,
        per_second * 8.0 / 1e9
    )
}

/// Microseconds in the unit that reads best: `840 µs`, `12.3 ms`, `1.45 s`.
pub fn micros(us: u64) -> String {
    match us {
        0..1_000 => format!("{us} µs"),
        1_000..1_000_000 => format!("{:.1} ms", us as f64 / 1e3),
        _ => format!("{:.2} s", us as f64 / 1e6),
    }
}

/// A byte count as a short human figure.
pub fn size(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 => format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

/// Resolves on Ctrl-C (SIGINT) or SIGTERM. The handlers are installed by the call itself,
/// not when the future is first polled, so a signal that comes right after is not lost.
/// Call it inside the runtime; where signals cannot be watched it never resolves.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    use tokio::signal::unix::{SignalKind, signal};
    let interrupt = signal(SignalKind::interrupt()).ok();
    let terminate = signal(SignalKind::terminate()).ok();
    async move {
        match (interrupt, terminate) {
            (Some(mut interrupt), Some(mut terminate)) => tokio::select! {
                _ = interrupt.recv() => {}
                _ = terminate.recv() => {}
            },
            _ => std::future::pending().await,
        }
    }
}

/// An address from the command line: `IP:PORT`, or `HOST:PORT` resolved now.
pub fn address(s: &str) -> Result<SocketAddr, String> {
    tensorwire::quic::resolve(s).map_err(|e| e.to_string())
}
