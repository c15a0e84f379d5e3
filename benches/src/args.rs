//! The command line: every flag, and what the flags imply together.

use std::net::SocketAddr;

use clap::Parser;
use tensorwire::quic::EndpointThreads;

use crate::source::RawSource;

/// Benchmark tensorwire beside raw quinn and TCP + TLS.
#[derive(Parser, Debug)]
#[command(version)]
pub(crate) struct Args {
    /// Under a minute: less data, fewer latency samples.
    #[arg(long)]
    pub(crate) quick: bool,
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub(crate) json: Option<std::path::PathBuf>,
    /// Connection counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    pub(crate) connections: Vec<usize>,
    /// UDP payload size for both QUIC runs.
    #[arg(long, default_value_t = 6000)]
    pub(crate) mtu: u16,
    /// MiB moved per connection in each throughput run (default 2048, quick 512).
    #[arg(long)]
    pub(crate) mib: Option<u64>,
    /// Tensor size in MiB for tensorwire's throughput run.
    #[arg(long, default_value_t = 64)]
    pub(crate) tensor_mib: u64,
    /// tensorwire's DATA payload size in KiB.
    #[arg(long, default_value_t = 1024)]
    pub(crate) chunk_kib: u64,
    /// tensorwire receiver: credit one tensor may hold unused, in MiB.
    #[arg(long, default_value_t = 8)]
    pub(crate) window_mib: u64,
    /// tensorwire receiver: most a tensor's window grows to on a long path, in MiB (at or
    /// below --window-mib, windows stay fixed).
    #[arg(long, default_value_t = 16)]
    pub(crate) max_window_mib: u64,
    /// tensorwire receiver: bytes per CREDIT, in MiB.
    #[arg(long, default_value_t = 4)]
    pub(crate) grant_mib: u64,
    /// tensorwire: tensors in flight per connection.
    #[arg(long, default_value_t = 2)]
    pub(crate) inflight: usize,
    /// Also measure the GPU path: pinned H2D peak, ingest from memory into GPU sinks, and
    /// network→GPU beside network→host (needs a CUDA GPU).
    #[arg(long)]
    pub(crate) gpu: bool,
    /// With --gpu: the device memory pool's size in MiB (free destination buffers it keeps;
    /// a tensor past it is allocated, and freed, on its own). The default holds what ingest
    /// has in flight (16 tensors of 64 MiB) twice over; 0 takes the library's (256 MiB).
    #[arg(long, default_value_t = 2048)]
    pub(crate) device_pool_mib: usize,
    /// With --gpu: the pinned staging pool's size in MiB (4 MiB buffers). Default: the
    /// library's (128).
    #[arg(long)]
    pub(crate) staging_pool_mib: Option<usize>,
    /// Where each QUIC endpoint's work runs, for raw quinn and tensorwire alike: a number of
    /// threads of its own (its connections' tasks spawned there too), or `caller` (all on
    /// this program's runtime, spread over its workers).
    #[arg(long, default_value = "1")]
    pub(crate) endpoint_threads: EndpointThreads,
    /// tensorwire receivers: where a tensor's DATA payloads are stored from its first of
    /// 1 MiB or more (auto, never, or at most N tensors at once off their connection's
    /// thread).
    #[arg(long, default_value = "auto")]
    pub(crate) store_offload: tensorwire::quic::StoreOffload,
    /// Run only these transports' throughput, comma-separated (raw-quinn, raw-quinn-hot,
    /// tensorwire, tcp-tls), e.g. `raw-quinn,tensorwire` for more rounds in the same time or
    /// one of them to profile it; or only the small-tensor latency (latency); latency-inline
    /// or latency-raw measure one latency row alone (tensorwire inline, raw quinn), for a
    /// profile of that path; gpu measures only the GPU section (as --gpu does).
    #[arg(long)]
    pub(crate) only: Option<String>,
    /// Small-tensor latency samples per row (default 20000, quick 300): on a 16-core host
    /// the ratio of two p50s of 2,000 samples moved by a third between runs, of 20,000 by
    /// less than a tenth.
    #[arg(long)]
    pub(crate) samples: Option<u64>,
    /// Repeat each throughput run this many times, the transports taking turns in each
    /// round (raw quinn first in the first round, tensorwire first in the next, and so on);
    /// keeps each one's best and prints the median of the rounds' ratios. The GPU section's
    /// ingest from memory runs as many rounds and keeps the best.
    #[arg(long, default_value_t = 4)]
    pub(crate) runs: usize,
    /// After each throughput run, print the threads busy more than a tenth of its time:
    /// which one limits a connection.
    #[arg(long)]
    pub(crate) thread_usage: bool,
    /// Serve raw quinn to client processes (`--raw-client`) instead of measuring: bind as
    /// many endpoints on one port as the first `--connections`, write the certificate (DER)
    /// to this file, print `listening on ADDR`, and exit once that many connections have
    /// sent everything. Raw quinn the way the programs run: one process per side.
    #[arg(long, value_name = "CERT_FILE", conflicts_with_all = ["raw_client", "tls_server", "tls_client"])]
    pub(crate) raw_server: Option<std::path::PathBuf>,
    /// Send `--mib` MiB over each of the first `--connections` raw quinn connections to a
    /// `--raw-server` at this address, trusting the certificate in `--cert`.
    #[arg(long, value_name = "ADDR", requires = "cert", conflicts_with_all = ["tls_server", "tls_client"])]
    pub(crate) raw_client: Option<SocketAddr>,
    /// Serve TCP + TLS 1.3 to a client process (`--tls-client`) instead of measuring: write
    /// the certificate (DER) to this file, print `listening on ADDR`, and exit once the
    /// first `--connections` connections have sent everything.
    #[arg(long, value_name = "CERT_FILE", conflicts_with = "tls_client")]
    pub(crate) tls_server: Option<std::path::PathBuf>,
    /// Send `--mib` MiB over each of the first `--connections` TCP + TLS connections to a
    /// `--tls-server` at this address, trusting the certificate in `--cert`.
    #[arg(long, value_name = "ADDR", requires = "cert")]
    pub(crate) tls_client: Option<SocketAddr>,
    /// The server's certificate file, for `--raw-client` and `--tls-client`.
    #[arg(long)]
    pub(crate) cert: Option<std::path::PathBuf>,
    /// Where `--raw-server` and `--tls-server` listen (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub(crate) listen: SocketAddr,
    /// How the `--raw-server`'s endpoints share connections: connection-id (evenly, as a
    /// `receiver` does by default) or address (the kernel's hash).
    #[arg(long, default_value = "connection-id", requires = "raw_server")]
    pub(crate) steering: tensorwire::quic::Steering,
    /// What raw quinn and TCP + TLS send: by default a buffer in memory of `--tensor-mib`,
    /// as large as each tensor of tensorwire's run, so all three read the same memory;
    /// `hot`, one 4 MiB buffer sent again and again, which stays in the CPU's cache (the
    /// anchor of earlier figures); or a file's bytes, mapped read-only as
    /// `sender` maps the files it sends (cycled through where `--mib` is larger).
    #[arg(long, value_name = "hot|FILE")]
    pub(crate) source: Option<RawSource>,
    /// Put a relay in each QUIC throughput run's path that holds every datagram this many
    /// milliseconds each way: a long path on loopback (a round trip of twice this), for raw
    /// quinn and tensorwire alike. Needs `--only` without tcp-tls; latency rows keep the
    /// direct path.
    #[arg(long, default_value_t = 0)]
    pub(crate) delay_ms: u64,
}

/// Transports `--only` may list.
const TRANSPORTS: [&str; 4] = ["raw-quinn", "raw-quinn-hot", "tensorwire", "tcp-tls"];

/// Modes `--only` may name, each alone.
const MODES: [&str; 4] = ["latency", "latency-inline", "latency-raw", "gpu"];

impl Args {
    /// Refuses flags that cannot go together, naming them.
    pub(crate) fn check(&self) -> anyhow::Result<()> {
        if let Some(only) = &self.only {
            check_only(only)?;
        }
        anyhow::ensure!(
            self.delay_ms == 0 || !self.wants("tcp-tls"),
            "--delay-ms delays UDP datagrams only: pass --only without tcp-tls (e.g. \
             --only raw-quinn,tensorwire)"
        );
        Ok(())
    }

    /// Whether `--only` leaves this transport's throughput in (every one without it).
    pub(crate) fn wants(&self, transport: &str) -> bool {
        self.only
            .as_deref()
            .is_none_or(|only| only.split(',').any(|one| one == transport))
    }

    /// MiB moved per connection in each throughput run.
    pub(crate) fn mib_per_connection(&self) -> u64 {
        self.mib.unwrap_or(if self.quick { 512 } else { 2048 })
    }

    /// Rounds of each throughput run.
    pub(crate) fn rounds(&self) -> usize {
        if self.quick { 1 } else { self.runs }
    }

    /// Whether only latency rows run.
    pub(crate) fn latency_only(&self) -> bool {
        matches!(
            self.only.as_deref(),
            Some("latency" | "latency-inline" | "latency-raw")
        )
    }

    /// Whether only the GPU section runs (`--only gpu`, as if `--gpu` were given with it).
    pub(crate) fn gpu_only(&self) -> bool {
        self.only.as_deref() == Some("gpu")
    }

    /// Whether the GPU section runs.
    pub(crate) fn gpu_section(&self) -> bool {
        self.gpu || self.gpu_only()
    }

    /// Whether no throughput row runs.
    pub(crate) fn no_throughput(&self) -> bool {
        self.latency_only() || self.gpu_only()
    }

    /// Latency samples per row: none where `--only` picked throughput or the GPU.
    pub(crate) fn latency_samples(&self) -> u64 {
        let default_samples = if self.quick { 300 } else { 20_000 };
        if self.only.is_none() || self.latency_only() {
            self.samples.unwrap_or(default_samples)
        } else {
            0
        }
    }
}

/// `--only` names transports, or one mode: a misspelt name would otherwise measure nothing.
fn check_only(only: &str) -> anyhow::Result<()> {
    if MODES.contains(&only) {
        return Ok(());
    }
    for name in only.split(',') {
        anyhow::ensure!(
            TRANSPORTS.contains(&name),
            "--only {only:?}: {name:?} is not one of {} (comma-separated), nor one of {} (alone)",
            TRANSPORTS.join(", "),
            MODES.join(", ")
        );
    }
    Ok(())
}
