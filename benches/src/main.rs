//! One harness, one run, side by side on loopback, with the same QUIC configuration:
//! (a) raw quinn bulk transfer on streams, (b) tensorwire sending the same bytes as tensors,
//! (c) TCP + TLS 1.3 (tokio-rustls, same provider and AES-128-GCM), for 1 and N connections;
//! plus small-tensor latency p50/p99.
//!
//! `cargo run --release -p tensorwire-bench -- --quick` finishes in under a minute.

use std::alloc::{GlobalAlloc, Layout};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use hdrhistogram::Histogram;
use serde::Serialize;
use tensorwire::proto::{DType, Payload, TensorMeta};
use tensorwire::quic::{
    CreditPermit, EndpointThreads, IncomingTensor, Receiver, ReceiverConfig, Sender, SenderConfig,
    Sink, SinkError, TransportSettings,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

mod relay;

/// The programs' allocator (their allocator's doc says why): mimalloc, with received
/// datagrams in pinned memory once a GPU row opens its device, counting allocations (and
/// reallocations) while a latency row runs, so the rows can print them per message. Raw quinn,
/// TCP+TLS and tensorwire run on it alike.
struct CountingAllocator {
    counting: AtomicBool,
    allocations: AtomicU64,
}

/// What [`CountingAllocator`] passes every call on to.
static PROGRAMS_ALLOCATOR: tensorwire::gpu::PinnedDatagrams<mimalloc::MiMalloc> =
    tensorwire::gpu::PinnedDatagrams::new(mimalloc::MiMalloc);

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator {
    counting: AtomicBool::new(false),
    allocations: AtomicU64::new(0),
};

impl CountingAllocator {
    fn note(&self) {
        // Read-only between latency rows: throughput runs share no written cache line.
        if self.counting.load(Ordering::Relaxed) {
            self.allocations.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts while `on`.
    fn count(&self, on: Counting) {
        self.counting
            .store(matches!(on, Counting::On), Ordering::Relaxed);
    }

    /// Allocations counted so far.
    fn allocations(&self) -> u64 {
        self.allocations.load(Ordering::Relaxed)
    }
}

/// Whether [`CountingAllocator`] counts.
#[derive(Clone, Copy)]
enum Counting {
    On,
    Off,
}

#[allow(unsafe_code)]
// SAFETY: every call is passed on unchanged to the programs' allocator, which upholds
// `GlobalAlloc`'s contract; the counting touches only two atomics and never allocates.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        self.note();
        // SAFETY: the caller's contract for `alloc`, passed on.
        unsafe { PROGRAMS_ALLOCATOR.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        self.note();
        // SAFETY: the caller's contract for `alloc_zeroed`, passed on.
        unsafe { PROGRAMS_ALLOCATOR.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract for `dealloc`, passed on.
        unsafe { PROGRAMS_ALLOCATOR.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        self.note();
        // SAFETY: the caller's contract for `realloc`, passed on.
        unsafe { PROGRAMS_ALLOCATOR.realloc(ptr, layout, new_size) }
    }
}

/// Benchmark tensorwire beside raw quinn and TCP + TLS.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Under a minute: less data, fewer latency samples.
    #[arg(long)]
    quick: bool,
    /// Write the results as JSON to this file.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Connection counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    connections: Vec<usize>,
    /// UDP payload size for both QUIC runs.
    #[arg(long, default_value_t = 6000)]
    mtu: u16,
    /// MiB moved per connection in each throughput run (default 2048, quick 512).
    #[arg(long)]
    mib: Option<u64>,
    /// Tensor size in MiB for tensorwire's throughput run.
    #[arg(long, default_value_t = 64)]
    tensor_mib: u64,
    /// tensorwire's DATA payload size in KiB.
    #[arg(long, default_value_t = 1024)]
    chunk_kib: u64,
    /// tensorwire receiver: credit one tensor may hold unused, in MiB.
    #[arg(long, default_value_t = 8)]
    window_mib: u64,
    /// tensorwire receiver: most a tensor's window grows to on a long path, in MiB (at or
    /// below --window-mib, windows stay fixed).
    #[arg(long, default_value_t = 16)]
    max_window_mib: u64,
    /// tensorwire receiver: bytes per CREDIT, in MiB.
    #[arg(long, default_value_t = 4)]
    grant_mib: u64,
    /// tensorwire: tensors in flight per connection.
    #[arg(long, default_value_t = 2)]
    inflight: usize,
    /// Also measure the GPU path: pinned H2D peak, ingest from memory into GPU sinks, and
    /// network→GPU beside network→host (needs a CUDA GPU).
    #[arg(long)]
    gpu: bool,
    /// With --gpu: the device memory pool's size in MiB (free destination buffers it keeps;
    /// a tensor past it is allocated, and freed, on its own). The default holds what ingest
    /// has in flight (16 tensors of 64 MiB) twice over; 0 takes the library's (256 MiB).
    #[arg(long, default_value_t = 2048)]
    device_pool_mib: usize,
    /// With --gpu: the pinned staging pool's size in MiB (4 MiB buffers). Default: the
    /// library's (128).
    #[arg(long)]
    staging_pool_mib: Option<usize>,
    /// Where each QUIC endpoint's work runs, for raw quinn and tensorwire alike: a number of
    /// threads of its own (its connections' tasks spawned there too), or `caller` (all on
    /// this program's runtime, spread over its workers).
    #[arg(long, default_value = "1")]
    endpoint_threads: EndpointThreads,
    /// tensorwire receivers: where a tensor's DATA payloads are stored from its first of
    /// 1 MiB or more (auto, never, or at most N tensors at once off their connection's
    /// thread).
    #[arg(long, default_value = "auto")]
    store_offload: tensorwire::quic::StoreOffload,
    /// Run only these transports' throughput, comma-separated (raw-quinn, raw-quinn-hot,
    /// tensorwire, tcp-tls), e.g. `raw-quinn,tensorwire` for more rounds in the same time or
    /// one of them to profile it; or only the small-tensor latency (latency); latency-inline
    /// or latency-raw measure one latency row alone (tensorwire inline, raw quinn), for a
    /// profile of that path; gpu measures only the GPU section (as --gpu does).
    #[arg(long)]
    only: Option<String>,
    /// Small-tensor latency samples per row (default 20000, quick 300): on a 16-core host
    /// the ratio of two p50s of 2,000 samples moved by a third between runs, of 20,000 by
    /// less than a tenth.
    #[arg(long)]
    samples: Option<u64>,
    /// Repeat each throughput run this many times, the transports taking turns in each
    /// round (raw quinn first in the first round, tensorwire first in the next, and so on);
    /// keeps each one's best and prints the median of the rounds' ratios. The GPU section's
    /// ingest from memory runs as many rounds and keeps the best.
    #[arg(long, default_value_t = 4)]
    runs: usize,
    /// After each throughput run, print the threads busy more than a tenth of its time:
    /// which one limits a connection.
    #[arg(long)]
    thread_usage: bool,
    /// Serve raw quinn to client processes (`--raw-client`) instead of measuring: bind as
    /// many endpoints on one port as the first `--connections`, write the certificate (DER)
    /// to this file, print `listening on ADDR`, and exit once that many connections have
    /// sent everything. Raw quinn the way the programs run: one process per side.
    #[arg(long, value_name = "CERT_FILE", conflicts_with = "raw_client")]
    raw_server: Option<std::path::PathBuf>,
    /// Send `--mib` MiB over each of the first `--connections` raw quinn connections to a
    /// `--raw-server` at this address, trusting the certificate in `--cert`.
    #[arg(long, value_name = "ADDR", requires = "cert")]
    raw_client: Option<SocketAddr>,
    /// The `--raw-server`'s certificate file, for `--raw-client`.
    #[arg(long)]
    cert: Option<std::path::PathBuf>,
    /// How the `--raw-server`'s endpoints share connections: connection-id (evenly, as a
    /// `receiver` does by default) or address (the kernel's hash).
    #[arg(long, default_value = "connection-id", requires = "raw_server")]
    steering: tensorwire::quic::Steering,
    /// What raw quinn and TCP + TLS send: by default a buffer in memory of `--tensor-mib`,
    /// as large as each tensor of tensorwire's run, so all three read the same memory;
    /// `hot`, one 4 MiB buffer sent again and again, which stays in the CPU's cache (the
    /// anchor of earlier figures); or a file's bytes, mapped read-only as
    /// `sender` maps the files it sends (cycled through where `--mib` is larger).
    #[arg(long, value_name = "hot|FILE")]
    source: Option<RawSource>,
    /// Put a relay in each QUIC throughput run's path that holds every datagram this many
    /// milliseconds each way: a long path on loopback (a round trip of twice this), for raw
    /// quinn and tensorwire alike. Needs `--only` without tcp-tls; latency rows keep the
    /// direct path.
    #[arg(long, default_value_t = 0)]
    delay_ms: u64,
}

/// What the raw transports send (`--source`).
#[derive(Clone, Debug)]
enum RawSource {
    /// One `CHUNK` buffer, again and again: stays in the CPU's cache.
    Hot,
    /// A file's bytes, mapped read-only.
    File(std::path::PathBuf),
}

impl std::str::FromStr for RawSource {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "hot" => RawSource::Hot,
            path => RawSource::File(path.into()),
        })
    }
}

impl RawSource {
    /// The bytes to send; `None` is a buffer of `tensor_bytes`, as tensorwire's run sends.
    fn load(source: Option<&RawSource>, tensor_bytes: u64) -> anyhow::Result<Loaded> {
        match source {
            None => Ok(Loaded::Memory(payload(tensor_bytes as usize))),
            Some(RawSource::Hot) => Ok(Loaded::Memory(payload(CHUNK))),
            Some(RawSource::File(path)) => {
                let file = std::fs::File::open(path)
                    .map_err(|e| anyhow::anyhow!("--source {}: {e}", path.display()))?;
                anyhow::ensure!(
                    file.metadata()?.len() > 0,
                    "--source {}: empty",
                    path.display()
                );
                #[allow(unsafe_code)]
                // SAFETY: a read-only private mapping of the benchmark's own input file, which
                // nothing writes while the benchmark runs.
                let map = unsafe { memmap2::Mmap::map(&file)? };
                let _ = map.advise(memmap2::Advice::Sequential);
                Ok(Loaded::Mapped(Bytes::from_owner(map)))
            }
        }
    }
}

/// The bytes the raw transports send, and where they lie.
#[derive(Clone)]
enum Loaded {
    /// In this process's memory.
    Memory(Bytes),
    /// A file's read-only mapping, faulted in as it is sent.
    Mapped(Bytes),
}

impl Loaded {
    /// The pieces the `k`th of `n` connections sends, `bytes` in all: from its own `k/n` of
    /// these bytes, so that no two connections read the same memory at once, going round
    /// as often as needed.
    fn pieces(&self, (k, n): (usize, usize), bytes: u64) -> Pieces {
        let (Loaded::Memory(data) | Loaded::Mapped(data)) = self;
        let mut pieces = Pieces {
            data: data.clone(),
            at: (data.len() / n.max(1) * k) & !4095,
            left: bytes,
            upcoming: None,
            faulting: None,
            fault_ahead: matches!(self, Loaded::Mapped(_)),
        };
        pieces.upcoming = pieces.cut();
        pieces
    }
}

/// Pieces of at most `CHUNK` for one connection (`Loaded::pieces`). A mapping's pages are
/// faulted in one piece ahead on the blocking pool, as `sender` does, so that no fault
/// stalls the sending task.
struct Pieces {
    data: Bytes,
    at: usize,
    left: u64,
    upcoming: Option<Bytes>,
    faulting: Option<tokio::task::JoinHandle<u8>>,
    fault_ahead: bool,
}

impl Pieces {
    /// The next piece to send, its pages in memory; `None` after the last.
    async fn next(&mut self) -> anyhow::Result<Option<Bytes>> {
        let Some(piece) = self.upcoming.take() else {
            return Ok(None);
        };
        if let Some(faulting) = self.faulting.take() {
            faulting.await?;
        }
        self.upcoming = self.cut();
        if let (true, Some(upcoming)) = (self.fault_ahead, &self.upcoming) {
            let upcoming = upcoming.clone();
            // Reading a byte of each page faults it in.
            self.faulting = Some(tokio::task::spawn_blocking(move || {
                std::hint::black_box(upcoming.iter().step_by(4096).fold(0, |a, b| a ^ b))
            }));
        }
        Ok(Some(piece))
    }

    fn cut(&mut self) -> Option<Bytes> {
        if self.left == 0 {
            return None;
        }
        let n = self
            .left
            .min(CHUNK as u64)
            .min((self.data.len() - self.at) as u64) as usize;
        let piece = self.data.slice(self.at..self.at + n);
        self.at = (self.at + n) % self.data.len();
        self.left -= n as u64;
        Some(piece)
    }
}

/// Write granularity for the raw transports, like tensorwire's DATA payloads.
const CHUNK: usize = 4 << 20;

#[derive(Serialize, Debug, Clone)]
struct Throughput {
    transport: &'static str,
    connections: usize,
    bytes: u64,
    seconds: f64,
    gbit_per_s: f64,
}

#[derive(Serialize, Debug, Clone)]
struct Latency {
    transport: &'static str,
    message_bytes: usize,
    samples: u64,
    p50_us: u64,
    p99_us: u64,
    /// The whole process's CPU time per message, both ends included.
    cpu_us_per_message: Option<f64>,
    /// The whole process's context switches per message, both ends included.
    context_switches_per_message: Option<f64>,
    /// Heap allocations (and reallocations) per message, both ends included.
    allocations_per_message: Option<f64>,
}

/// One ingest-from-memory run and its two anchors at the same count.
#[derive(Serialize, Debug)]
struct IngestRun {
    /// Sinks fed at once; threads, for the anchors.
    sinks: usize,
    /// The best of `--runs` rounds.
    #[serde(flatten)]
    ingest: SinkIngest,
    /// Every round's rate, in the order run.
    rounds_gb_per_s: Vec<f64>,
    /// Plain memory copies as ingest's into staging, no GPU involved.
    host_copy_gb_per_s: f64,
    /// Ingest's copies into staging and to the device, without the sink.
    staged_h2d_gb_per_s: f64,
}

/// Network → host beside network → GPU at one connection count, the sinks taking turns in
/// each round.
#[derive(Serialize, Debug)]
struct NetworkRun {
    connections: usize,
    /// The best round's rate into host memory (budgeted, kept buffers).
    host_gbit_per_s: f64,
    /// The best round's rate into GPU memory.
    gpu_gbit_per_s: f64,
    /// The best GPU rate over the best host rate.
    gpu_over_host: f64,
    /// The median over rounds of GPU / host within the round.
    median_round_gpu_over_host: f64,
    /// The lowest and highest of those rounds' ratios.
    round_gpu_over_host_range: (f64, f64),
}

#[derive(Serialize, Debug)]
struct GpuReport {
    device: String,
    /// The pools the sinks drew from (free buffers each keeps at most).
    staging_pool_mib: usize,
    device_pool_mib: usize,
    pinned_h2d_gb_per_s: f64,
    ingest_from_memory: Vec<IngestRun>,
    network: Vec<NetworkRun>,
    staging_hit_rate: f64,
    device_pool_hit_rate: f64,
}

#[derive(Serialize, Debug)]
struct Report {
    host: String,
    cores: usize,
    mtu: u16,
    /// `--delay-ms`: what the relay in the QUIC throughput runs' path held each datagram
    /// each way (0: no relay)
    one_way_delay_ms: u64,
    /// tensorwire's credit window per tensor at its start, and the most it may grow to
    stream_window_mib: u64,
    max_stream_window_mib: u64,
    throughput: Vec<Throughput>,
    /// (connections, tensorwire's rate / raw quinn's from `--source`)
    ratio_tensorwire_over_quinn: Vec<(usize, f64)>,
    /// (connections, the median over rounds of tensorwire's rate / raw quinn's in that round)
    median_round_ratio_tensorwire_over_quinn: Vec<(usize, f64)>,
    /// (connections, the lowest and highest of those rounds' ratios): how far one host's
    /// rounds spread, which a median of few rounds hides
    round_ratio_range_tensorwire_over_quinn: Vec<(usize, (f64, f64))>,
    /// (connections, every round's ratio in the order run): whether the host drifted
    round_ratios_tensorwire_over_quinn: Vec<(usize, Vec<f64>)>,
    /// (connections, a 95% confidence interval of the median round ratio, where there were
    /// 6 rounds or more): whether a target lies within the rounds' spread
    median_interval_95_tensorwire_over_quinn: Vec<(usize, Option<(f64, f64)>)>,
    /// (connections, tensorwire's rate / raw quinn's from a cache-hot 4 MiB buffer)
    ratio_tensorwire_over_hot_quinn: Vec<(usize, f64)>,
    latency: Vec<Latency>,
    gpu: Option<GpuReport>,
}

/// `--endpoint-threads`, set once at start.
static ENDPOINT_THREADS: std::sync::OnceLock<EndpointThreads> = std::sync::OnceLock::new();

/// `--thread-usage`, set once at start.
static THREAD_USAGE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// With `--thread-usage`, prints what each thread busy more than a tenth of the `seconds`
/// since `before` spent on a CPU, as a fraction of them.
fn print_busy_threads(run: &str, before: &ThreadUsage, seconds: f64) {
    if THREAD_USAGE.get().copied().unwrap_or_default() {
        eprintln!(
            "  {run}: busy threads {}",
            ThreadUsage::now().busy_since(before, seconds)
        );
    }
}

/// With `--thread-usage`, prints what tensorwire's sends waited for over a run of `seconds`,
/// summed over its tensors (several at once per connection, so a sum can pass the run).
fn print_send_waits(waited: &tensorwire::quic::SendWaits, seconds: f64) {
    if THREAD_USAGE.get().copied().unwrap_or_default() {
        eprintln!("  tensorwire: sends waited (summed over tensors, run {seconds:.3} s): {waited}");
    }
}

/// With `BENCH_STATS` set, prints what a throughput run's connection saw of its path.
fn print_path_stats(who: &str, stats: &quinn::ConnectionStats) {
    if std::env::var_os("BENCH_STATS").is_some() {
        eprintln!(
            "{who}: sent {} packets, lost {}, mtu {}, congestion window {} KiB, rtt {:?}, congestion events {}, received {} datagrams",
            stats.path.sent_packets,
            stats.path.lost_packets,
            stats.path.current_mtu,
            stats.path.cwnd >> 10,
            stats.path.rtt,
            stats.path.congestion_events,
            stats.udp_rx.datagrams
        );
    }
}

/// `--delay-ms`: how long the relay in each QUIC throughput run's path holds datagrams.
static ONE_WAY_DELAY: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();

/// How a throughput run's client reaches `server`: through a delaying relay with
/// `--delay-ms` (which runs while the caller keeps it), straight otherwise.
async fn path_to(server: SocketAddr) -> anyhow::Result<(SocketAddr, Option<relay::Relay>)> {
    match ONE_WAY_DELAY.get() {
        Some(&one_way) => {
            let relay = relay::delayed_path(server, one_way).await?;
            Ok((relay.addr(), Some(relay)))
        }
        _ => Ok((server, None)),
    }
}

/// `--store-offload`, set once at start.
static STORE_OFFLOAD: std::sync::OnceLock<tensorwire::quic::StoreOffload> =
    std::sync::OnceLock::new();

fn transport(mtu: u16) -> TransportSettings {
    TransportSettings {
        endpoint_threads: ENDPOINT_THREADS.get().copied().unwrap_or_default(),
        ..TransportSettings::default()
    }
    .fixed_mtu(mtu)
}

fn payload(len: usize) -> Bytes {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) | 1)
        .collect::<Vec<u8>>()
        .into()
}

// ---------------------------------------------------------------- (a) raw quinn

/// A server endpoint with tensorwire's TLS and transport settings; returns its address.
fn quinn_server(
    mtu: u16,
) -> anyhow::Result<(
    quinn::Endpoint,
    tokio::runtime::Handle,
    rustls::pki_types::CertificateDer<'static>,
)> {
    let (config, cert) = quinn_server_config(mtu)?;
    let (endpoint, runtime) =
        transport(mtu).endpoint_with_runtime("127.0.0.1:0".parse()?, Some(config))?;
    Ok((endpoint, runtime, cert))
}

/// A server configuration with tensorwire's TLS and transport settings and a fresh
/// self-signed certificate, which it returns too.
fn quinn_server_config(
    mtu: u16,
) -> anyhow::Result<(
    quinn::ServerConfig,
    rustls::pki_types::CertificateDer<'static>,
)> {
    let cert = tensorwire::quic::tls::DevCertificate::generate()?;
    let dir = std::env::temp_dir().join(format!("tensorwire-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let (cert_path, key_path) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert_path, &cert.pem)?;
    std::fs::write(&key_path, cert.key_pem())?;
    let tls = tensorwire::quic::ServerTls::Pem {
        cert: cert_path,
        key: key_path,
        client_ca: None,
    };
    let (crypto, _) = tensorwire::quic::tls::server_crypto(&tls)?;
    let mut config = quinn::ServerConfig::with_crypto(crypto);
    config.transport_config(transport(mtu).transport_config()?);
    Ok((config, cert.cert))
}

/// Reads one raw quinn connection's stream to its end, answers with the byte count, and
/// waits for the client to close.
async fn raw_quinn_serve(conn: quinn::Connection) -> anyhow::Result<u64> {
    let (mut send, mut recv) = conn.accept_bi().await?;
    let mut got = 0u64;
    while let Some(chunk) = recv.read_chunk(usize::MAX, true).await? {
        got += chunk.bytes.len() as u64;
    }
    send.write_all(&got.to_le_bytes()).await?;
    send.finish()?;
    conn.closed().await;
    Ok(got)
}

/// Sends `bytes` of `data` on one stream of `conn`, the `part.0`th of `part.1` connections,
/// in `CHUNK` writes, finishes it, and checks the server's count.
async fn raw_quinn_send(
    conn: &quinn::Connection,
    data: &Loaded,
    part: (usize, usize),
    bytes: u64,
) -> anyhow::Result<()> {
    let (mut send, mut recv) = conn.open_bi().await?;
    let mut pieces = data.pieces(part, bytes);
    while let Some(piece) = pieces.next().await? {
        send.write_chunk(piece).await?;
    }
    send.finish()?;
    let mut ack = [0u8; 8];
    recv.read_exact(&mut ack).await?;
    anyhow::ensure!(u64::from_le_bytes(ack) == bytes, "raw quinn lost bytes");
    Ok(())
}

/// A raw quinn client's endpoint, the runtime its work runs on, and its connection.
type RawClient = (quinn::Endpoint, tokio::runtime::Handle, quinn::Connection);

/// Sends `bytes` on every connection of `clients` at once, each on a task beside its
/// connection (its endpoint's runtime, as tensorwire's sends run).
async fn raw_quinn_send_on_each(
    clients: &[RawClient],
    data: &Loaded,
    bytes: u64,
) -> anyhow::Result<()> {
    let mut sends = Vec::new();
    for (k, (_, runtime, conn)) in clients.iter().enumerate() {
        let (conn, data, part) = (conn.clone(), data.clone(), (k, clients.len()));
        sends.push(runtime.spawn(async move { raw_quinn_send(&conn, &data, part, bytes).await }));
    }
    for send in sends {
        send.await??;
    }
    Ok(())
}

/// `--raw-server`: `count` connections over `count` endpoints sharing one port.
async fn raw_quinn_server_process(
    cert_file: &std::path::Path,
    count: usize,
    mtu: u16,
    steering: tensorwire::quic::Steering,
) -> anyhow::Result<()> {
    let (config, cert) = quinn_server_config(mtu)?;
    std::fs::write(cert_file, cert.as_ref())?;
    let endpoints = transport(mtu).reuse_port_endpoints(
        "127.0.0.1:0".parse()?,
        count.max(1),
        config,
        steering,
    )?;
    println!("listening on {}", endpoints[0].endpoint().local_addr()?);
    let (done, mut finished) = tokio::sync::mpsc::unbounded_channel();
    for endpoint in &endpoints {
        let (endpoint, done) = (endpoint.clone(), done.clone());
        // Its connections are served on its runtime, as a receiver serves them.
        endpoint.runtime().clone().spawn(async move {
            while let Some((incoming, slot)) = endpoint.accept().await {
                let done = done.clone();
                tokio::spawn(async move {
                    let served = async { raw_quinn_serve(incoming.await?).await }.await;
                    drop(slot);
                    let _ = done.send(served);
                });
            }
        });
    }
    for _ in 0..count {
        let got = finished
            .recv()
            .await
            .ok_or_else(|| anyhow::anyhow!("endpoints closed"))??;
        eprintln!("raw quinn server: a connection sent {got} bytes");
    }
    Ok(())
}

/// `--raw-client`: `connections` connections to a `--raw-server`, each on an endpoint of its
/// own (as `sender --connections` opens them), `bytes` on one stream of each.
async fn raw_quinn_client_process(
    addr: SocketAddr,
    cert_file: &std::path::Path,
    connections: usize,
    bytes: u64,
    mtu: u16,
    data: Loaded,
) -> anyhow::Result<()> {
    let cert = rustls::pki_types::CertificateDer::from(std::fs::read(cert_file)?);
    let mut clients = Vec::new();
    for _ in 0..connections.max(1) {
        let (client, runtime, config) = quinn_client(mtu, &cert)?;
        let conn = client.connect_with(config, addr, "localhost")?.await?;
        clients.push((client, runtime, conn));
    }
    raw_quinn_send_on_each(&clients, &data, bytes).await?;
    // As `sender` closes (`Sender::close`): until each CONNECTION_CLOSE has gone out (a closed
    // connection's next datagram), at most 100 ms, all together, without waiting out QUIC's
    // draining period.
    // Counted before each close, as `sender` counts: the close may go out before `close`
    // returns.
    let mut sent_before = Vec::new();
    for (_, _, conn) in &clients {
        sent_before.push(conn.stats().udp_tx.datagrams);
        conn.close(0u32.into(), b"done");
    }
    let close_sent = async {
        tokio::task::yield_now().await;
        while clients
            .iter()
            .zip(&sent_before)
            .any(|((_, _, conn), before)| conn.stats().udp_tx.datagrams == *before)
        {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    let _ = tokio::time::timeout(Duration::from_millis(100), close_sent).await;
    Ok(())
}

fn quinn_client(
    mtu: u16,
    cert: &rustls::pki_types::CertificateDer<'static>,
) -> anyhow::Result<(quinn::Endpoint, tokio::runtime::Handle, quinn::ClientConfig)> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.clone())?;
    let mut tls =
        rustls::ClientConfig::builder_with_provider(tensorwire::quic::tls::crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_root_certificates(roots)
            .with_no_client_auth();
    tls.alpn_protocols = vec![tensorwire::proto::ALPN.to_vec()];
    let mut config = quinn::ClientConfig::new(Arc::new(
        quinn::crypto::rustls::QuicClientConfig::try_from(tls)?,
    ));
    config.transport_config(transport(mtu).transport_config()?);
    let (endpoint, runtime) = transport(mtu).endpoint_with_runtime("127.0.0.1:0".parse()?, None)?;
    Ok((endpoint, runtime, config))
}

/// The first connection a raw quinn server endpoint accepts, once its handshake is done.
async fn first_connection(server: quinn::Endpoint) -> anyhow::Result<quinn::Connection> {
    Ok(server
        .accept()
        .await
        .ok_or_else(|| anyhow::anyhow!("no connection"))?
        .await?)
}

async fn raw_quinn(
    connections: usize,
    bytes_per_conn: u64,
    mtu: u16,
    data: &Loaded,
) -> anyhow::Result<f64> {
    let mut servers = Vec::new();
    let mut clients = Vec::new();
    let mut relays = Vec::new();
    for _ in 0..connections {
        let (server, server_runtime, cert) = quinn_server(mtu)?;
        let (addr, relay) = path_to(server.local_addr()?).await?;
        relays.extend(relay);
        let (client, client_runtime, config) = quinn_client(mtu, &cert)?;
        let server_task = server_runtime
            .spawn(async move { raw_quinn_serve(first_connection(server).await?).await });
        let conn = client.connect_with(config, addr, "localhost")?.await?;
        servers.push(server_task);
        clients.push((client, client_runtime, conn));
    }
    let (usage, started) = (ThreadUsage::now(), Instant::now());
    raw_quinn_send_on_each(&clients, data, bytes_per_conn).await?;
    let seconds = started.elapsed().as_secs_f64();
    print_busy_threads("raw quinn", &usage, seconds);
    for (client, _, conn) in clients {
        print_path_stats("raw quinn", &conn.stats());
        conn.close(0u32.into(), b"done");
        client.wait_idle().await;
    }
    for s in servers {
        s.await??;
    }
    Ok(seconds)
}

// ---------------------------------------------------------------- (b) tensorwire

/// Where tensorwire's throughput runs put the bytes.
#[derive(Clone)]
enum SinkKind {
    /// Drop them: the transport alone.
    Discard,
    /// A placement (the GPU runs use one).
    Placed(tensorwire::gpu::Placement),
    /// Host memory as a receiving application gets it: `accept_host`, under the receiver's
    /// host-memory budget, landing in the kept buffers of tensors already dropped.
    Host,
}

impl SinkKind {
    /// Accepts `incoming` into this kind of sink; the future resolves when it has landed.
    async fn accept(&self, incoming: IncomingTensor) -> anyhow::Result<Landing> {
        Ok(match self {
            SinkKind::Discard => landing(incoming.accept(DiscardSink)),
            SinkKind::Placed(placement) => {
                let sink = placement.sink(incoming.meta())?;
                landing(incoming.accept(sink))
            }
            SinkKind::Host => landing(incoming.accept_host().await?),
        })
    }
}

/// Resolves once the tensor of `handle` has landed, its output dropped.
fn landing<T: Send + 'static>(handle: tensorwire::quic::TensorHandle<T>) -> Landing {
    Box::pin(async move { handle.finished().await.map(drop) })
}

/// Counts bytes and drops them: measures the transport, not a memcpy into a buffer.
struct DiscardSink;

impl Sink for DiscardSink {
    type Output = ();

    async fn store(
        &mut self,
        _: u64,
        payload: Payload,
        permit: CreditPermit,
        crc: Option<&mut u32>,
    ) -> Result<(), SinkError> {
        std::hint::black_box(payload.len());
        payload.continue_crc(crc);
        drop(permit);
        Ok(())
    }

    async fn finish(self) -> Result<(), SinkError> {
        Ok(())
    }
}

/// A tensor accepted by a throughput run's receiver: resolves once it has landed (the
/// receive runs on the tensor's own task, whether or not this is polled).
type Landing =
    std::pin::Pin<Box<dyn Future<Output = Result<(), tensorwire::quic::TransportError>> + Send>>;

/// tensorwire's knobs for one throughput run.
#[derive(Clone)]
struct TensorwireRun {
    sink: SinkKind,
    tensor_bytes: u64,
    mtu: u16,
    chunk: u64,
    window: u64,
    max_window: u64,
    grant: u64,
    inflight: usize,
}

impl TensorwireRun {
    /// The knobs the command line set, for tensors of `tensor_bytes` landing in `sink`.
    fn from_args(args: &Args, sink: SinkKind, tensor_bytes: u64) -> Self {
        Self {
            sink,
            tensor_bytes,
            mtu: args.mtu,
            chunk: args.chunk_kib << 10,
            window: args.window_mib << 20,
            max_window: args.max_window_mib << 20,
            grant: args.grant_mib << 20,
            inflight: args.inflight,
        }
    }
}

async fn tensorwire_run(
    connections: usize,
    bytes_per_conn: u64,
    run: TensorwireRun,
) -> anyhow::Result<f64> {
    let TensorwireRun {
        sink,
        tensor_bytes,
        mtu,
        chunk,
        window,
        max_window,
        grant,
        inflight: in_flight,
    } = run;
    let tensors_per_conn = bytes_per_conn.div_ceil(tensor_bytes);
    let data = payload(tensor_bytes as usize);
    let mut receivers = Vec::new();
    let mut senders = Vec::new();
    let mut relays = Vec::new();
    for _ in 0..connections {
        // One receiving endpoint (socket) per connection: quinn's receive path is one task
        // per endpoint.
        let mut config = ReceiverConfig::new(
            "127.0.0.1:0".parse()?,
            tensorwire::quic::ServerTls::Development,
        )
        .with_budget((window * 8).max(256 << 20));
        config.transport = transport(mtu);
        config.endpoints = 1;
        config.store_offload = STORE_OFFLOAD.get().copied().unwrap_or_default();
        config.stream_window = window;
        config.max_stream_window = max_window;
        config.grant_unit = grant;
        let mut receiver = Receiver::bind(config).await?;
        let addr = receiver.local_addr()?;
        let sink = sink.clone();
        receivers.push(tokio::spawn(async move {
            // As a consuming application does: each tensor is dropped once it has landed
            // (at most the sender's tensors in flight are held), so its memory goes back to
            // the pools or the kept host buffers for the next.
            let mut landing = std::collections::VecDeque::new();
            for _ in 0..tensors_per_conn {
                let incoming = receiver
                    .next()
                    .await
                    .ok_or_else(|| anyhow::anyhow!("closed"))?;
                landing.push_back(sink.accept(incoming).await?);
                if landing.len() > in_flight.max(1) {
                    landing.pop_front().expect("held").await?;
                }
            }
            for landed in landing {
                landed.await?;
            }
            anyhow::Ok(receiver)
        }));
        let (path, relay) = path_to(addr).await?;
        relays.extend(relay);
        // Development trust finds a receiver's certificate by the port connected to, which a
        // relay changes: the certificate it left is trusted by its path instead.
        let tls = tensorwire::quic::ClientTls::Pem {
            ca: tensorwire::quic::dev_cert_path(addr.port()),
            identity: None,
        };
        let config = SenderConfig {
            transport: transport(mtu),
            chunk_size: chunk,
            ..SenderConfig::new(tls)
        };
        senders.push(Sender::connect(path, config).await?);
    }
    let meta = TensorMeta::new([tensor_bytes], DType::U8)?.with_name("bench");
    let senders: Vec<Arc<Sender>> = senders.into_iter().map(Arc::new).collect();
    let (usage, started) = (ThreadUsage::now(), Instant::now());
    let mut tasks = Vec::new();
    for sender in &senders {
        let (sender, meta, data) = (sender.clone(), meta.clone(), data.clone());
        // `in_flight` tensors per connection: the next starts as soon as the oldest completes.
        tasks.push(tokio::spawn(async move {
            let mut inflight = std::collections::VecDeque::new();
            let mut waited = tensorwire::quic::SendWaits::default();
            for _ in 0..tensors_per_conn {
                if inflight.len() == in_flight.max(1) {
                    let oldest: tensorwire::quic::SendHandle =
                        inflight.pop_front().expect("in flight");
                    waited += oldest.finished().await?.waited;
                }
                inflight.push_back(sender.send(meta.clone(), data.clone()));
            }
            for send in inflight {
                waited += send.finished().await?.waited;
            }
            anyhow::Ok(waited)
        }));
    }
    let mut waited = tensorwire::quic::SendWaits::default();
    for task in tasks {
        waited += task.await??;
    }
    let seconds = started.elapsed().as_secs_f64();
    print_busy_threads("tensorwire", &usage, seconds);
    print_send_waits(&waited, seconds);
    for s in senders {
        let s = Arc::into_inner(s).ok_or_else(|| anyhow::anyhow!("sender still shared"))?;
        print_path_stats("tensorwire", &s.connection_stats());
        s.close().await;
    }
    let mut largest_window = 0;
    for r in receivers {
        let receiver = r.await??;
        largest_window = largest_window.max(receiver.metrics().largest_stream_window);
        receiver.close().await;
    }
    if largest_window > window {
        // Spec §7.1: the arrival rate over the path's RTT outgrew the initial window.
        println!(
            "    tensorwire: credit windows grew to {} MiB (from {} MiB)",
            largest_window >> 20,
            window >> 20
        );
    }
    Ok(seconds)
}

// ---------------------------------------------------------------- (c) TCP + TLS

async fn tcp_tls(connections: usize, bytes_per_conn: u64, data: &Loaded) -> anyhow::Result<f64> {
    let cert = tensorwire::quic::tls::DevCertificate::generate()?;
    let key = rustls::pki_types::PrivateKeyDer::try_from(cert.key_der())
        .map_err(|e| anyhow::anyhow!("key: {e}"))?;
    let server_tls =
        rustls::ServerConfig::builder_with_provider(tensorwire::quic::tls::crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_no_client_auth()
            .with_single_cert(vec![cert.cert.clone()], key)?;
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server_tls));
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.cert.clone())?;
    let client_tls =
        rustls::ClientConfig::builder_with_provider(tensorwire::quic::tls::crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_root_certificates(roots)
            .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(client_tls));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        let mut tasks = Vec::new();
        for _ in 0..connections {
            let (tcp, _) = listener.accept().await?;
            let acceptor = acceptor.clone();
            tasks.push(tokio::spawn(async move {
                let mut tls = acceptor.accept(tcp).await?;
                let mut buf = vec![0u8; 1 << 20];
                let mut got = 0u64;
                loop {
                    let n = tls.read(&mut buf).await?;
                    if n == 0 {
                        break;
                    }
                    got += n as u64;
                }
                tls.write_all(&got.to_le_bytes()).await?;
                tls.shutdown().await?;
                anyhow::Ok(got)
            }));
        }
        for t in tasks {
            t.await??;
        }
        anyhow::Ok(())
    });
    let mut streams = Vec::new();
    for _ in 0..connections {
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        tcp.set_nodelay(true)?;
        streams.push(connector.connect("localhost".try_into()?, tcp).await?);
    }
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (k, mut tls) in streams.into_iter().enumerate() {
        let data = data.clone();
        tasks.push(tokio::spawn(async move {
            let mut pieces = data.pieces((k, connections), bytes_per_conn);
            while let Some(piece) = pieces.next().await? {
                tls.write_all(&piece).await?;
            }
            tls.shutdown().await?; // close_notify, then the TCP write half
            let mut ack = [0u8; 8];
            tls.read_exact(&mut ack).await?;
            anyhow::Ok(u64::from_le_bytes(ack))
        }));
    }
    for t in tasks {
        anyhow::ensure!(t.await?? == bytes_per_conn, "TCP lost bytes");
    }
    let seconds = started.elapsed().as_secs_f64();
    server.await??;
    Ok(seconds)
}

// ---------------------------------------------------------------- latency

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("constant bounds")
}

/// Runs a latency client on a runtime worker, as a server's tasks run, not on `main`'s own
/// thread (which every wake-up would have to cross to).
async fn on_worker(
    run: impl Future<Output = anyhow::Result<Histogram<u64>>> + Send + 'static,
) -> anyhow::Result<Histogram<u64>> {
    tokio::spawn(run).await?
}

/// How the latency run's two ends hand tensors to the application.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Admission {
    /// `Receiver::next` and `accept` on the application's task; `send` on a task of its own.
    Queued,
    /// `Receiver::admit_with` on each tensor's own task; `send_inline` on the caller's task.
    Inline,
}

/// One tensorwire connection for the latency runs: one tensor at a time, METADATA →
/// COMPLETE, in one round trip once the receiver's early credit (spec §7.6) has arrived,
/// which [`start`](Self::start) awaits.
struct TensorwireLatency {
    sender: Arc<Sender>,
    server: tokio::task::JoinHandle<anyhow::Result<Receiver>>,
    admission: Admission,
    meta: TensorMeta,
    data: Bytes,
    samples: u64,
}

impl TensorwireLatency {
    /// A receiver and a connected sender, for `samples` tensors of `size` bytes.
    async fn start(
        samples: u64,
        size: usize,
        mtu: u16,
        admission: Admission,
    ) -> anyhow::Result<Self> {
        let mut config = ReceiverConfig::new(
            "127.0.0.1:0".parse()?,
            tensorwire::quic::ServerTls::Development,
        );
        config.transport = transport(mtu);
        config.endpoints = 1;
        let mut receiver = Receiver::bind(config).await?;
        let addr = receiver.local_addr()?;
        // Accepting starts the receive on the tensor's own task, which goes on with the
        // handle dropped: the receiver's counts say at the end whether every tensor landed,
        // so nothing is spawned or kept per tensor on the measured path.
        if admission == Admission::Inline {
            receiver.admit_with(|incoming| drop(incoming.accept(DiscardSink)))?;
        }
        let server = tokio::spawn(async move {
            if admission == Admission::Queued {
                for _ in 0..samples {
                    let incoming = receiver
                        .next()
                        .await
                        .ok_or_else(|| anyhow::anyhow!("closed"))?;
                    drop(incoming.accept(DiscardSink));
                }
            }
            anyhow::Ok(receiver)
        });
        let sender = Sender::connect(
            addr,
            SenderConfig {
                transport: transport(mtu),
                ..SenderConfig::new(tensorwire::quic::ClientTls::Development)
            },
        )
        .await?;
        for _ in 0..1000 {
            if sender.early_allowance().is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        match sender.early_allowance() {
            Some(bytes) if bytes >= size as u64 => {
                println!("tensorwire latency: {size}-byte tensors go early, in one round trip");
            }
            other => println!("tensorwire latency: no early credit for {size} bytes ({other:?})"),
        }
        Ok(Self {
            sender: Arc::new(sender),
            server,
            admission,
            meta: TensorMeta::new([size as u64], DType::U8)?.with_name("small"),
            data: payload(size),
            samples,
        })
    }
}

impl LatencyConnection for TensorwireLatency {
    /// Sends the tensors on the connection's own runtime, where a latency-sensitive
    /// application runs its sends.
    async fn run(&self, count: u64) -> anyhow::Result<Histogram<u64>> {
        let (sender, meta, data, admission) = (
            self.sender.clone(),
            self.meta.clone(),
            self.data.clone(),
            self.admission,
        );
        self.sender
            .runtime()
            .spawn(async move {
                let mut h = histogram();
                for _ in 0..count {
                    let started = Instant::now();
                    match admission {
                        Admission::Queued => {
                            sender.send(meta.clone(), data.clone()).finished().await?
                        }
                        Admission::Inline => sender.send_inline(meta.clone(), data.clone()).await?,
                    };
                    h.saturating_record(started.elapsed().as_micros() as u64);
                }
                anyhow::Ok(h)
            })
            .await?
    }

    /// Also checks that every tensor was admitted and landed.
    async fn finish(self) -> anyhow::Result<()> {
        print_datagrams("tensorwire", &self.sender.connection_stats(), self.samples);
        Arc::into_inner(self.sender)
            .ok_or_else(|| anyhow::anyhow!("sender still shared"))?
            .close()
            .await;
        let receiver = self.server.await??;
        // A tensor's stream task counts it right after sending COMPLETE.
        let mut landed = receiver.metrics();
        for _ in 0..100 {
            if landed.tensors_completed + landed.tensors_failed >= self.samples {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            landed = receiver.metrics();
        }
        anyhow::ensure!(
            landed.tensors_completed == self.samples && landed.tensors_failed == 0,
            "{} of {} tensors landed, {} failed",
            landed.tensors_completed,
            self.samples,
            landed.tensors_failed
        );
        receiver.close().await;
        Ok(())
    }
}

/// A connection of a latency run, up: it exchanges messages one at a time, then closes.
trait LatencyConnection: Send + Sync + Sized + 'static {
    /// Exchanges `count` messages one after another and records each one's time.
    fn run(&self, count: u64) -> impl Future<Output = anyhow::Result<Histogram<u64>>> + Send;
    /// Closes both ends (and checks what the run left behind).
    fn finish(self) -> impl Future<Output = anyhow::Result<()>> + Send;
}

/// `samples` messages in a row over a connection `start` brings up, which is then closed;
/// prints, under `label`, the context switches and CPU time per message of each thread that
/// switched while the messages went (set-up and close left out).
async fn in_a_row<C: LatencyConnection>(
    label: &str,
    samples: u64,
    start: impl Future<Output = anyhow::Result<C>>,
) -> anyhow::Result<Histogram<u64>> {
    let connection = start.await?;
    let before = ThreadUsage::now();
    let h = connection.run(samples).await?;
    let by_thread = ThreadUsage::now().since(&before, samples);
    connection.finish().await?;
    if !by_thread.is_empty() {
        println!(
            "{label}: per message, by thread (oldest first): context switches (CPU) {by_thread}"
        );
    }
    Ok(h)
}

/// Each thread's context switches and CPU time so far (Linux: `/proc/self/task`), by thread
/// id: where a message's hand-offs and work happen, which the process's totals do not say.
struct ThreadUsage(std::collections::BTreeMap<u32, ThreadCounts>);

/// One thread's counts.
struct ThreadCounts {
    name: String,
    context_switches: u64,
    /// Of `context_switches`, those where the thread was taken off its CPU while it could
    /// still run (preempted), not parked to wait.
    preempted: u64,
    on_cpu_ns: u64,
    /// Nanoseconds runnable but waiting for a CPU.
    waiting_for_cpu_ns: u64,
}

impl ThreadUsage {
    fn now() -> Self {
        let read = |tid: &std::path::Path| -> Option<ThreadCounts> {
            let name = std::fs::read_to_string(tid.join("comm")).ok()?;
            let status = std::fs::read_to_string(tid.join("status")).ok()?;
            let count = |key: &str| -> u64 {
                status
                    .lines()
                    .filter(|l| l.starts_with(key))
                    .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                    .sum()
            };
            // Nanoseconds on a CPU, then nanoseconds runnable and waiting for one.
            let schedstat = std::fs::read_to_string(tid.join("schedstat")).unwrap_or_default();
            let mut fields = schedstat.split_whitespace().map(|f| f.parse().unwrap_or(0));
            let preempted = count("nonvoluntary_ctxt_switches:");
            Some(ThreadCounts {
                name: name.trim().to_owned(),
                context_switches: count("voluntary_ctxt_switches:") + preempted,
                preempted,
                on_cpu_ns: fields.next().unwrap_or(0),
                waiting_for_cpu_ns: fields.next().unwrap_or(0),
            })
        };
        let threads = std::fs::read_dir("/proc/self/task")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|entry| {
                let tid = entry.file_name().to_str()?.parse().ok()?;
                Some((tid, read(&entry.path())?))
            })
            .collect();
        Self(threads)
    }

    /// Threads on a CPU more than a tenth of the `seconds` since `before`, busiest first, as
    /// "name#tid 0.98 (20/s), name#tid 0.40 (3000/s; 0.05 waiting for a CPU, 900/s
    /// preempted)": the fraction of those seconds on a CPU, and how often per second the
    /// thread was switched out (mostly to wait: an endpoint thread with nothing to do parks,
    /// and each wake-up costs a switch back). Where the thread was kept from a CPU while it
    /// could run for more than a hundredth of the time, or preempted more than 10 times a
    /// second, it says so: then another thread took its core, not a lack of work.
    fn busy_since(&self, before: &Self, seconds: f64) -> String {
        let seconds = seconds.max(1e-9);
        let mut busy: Vec<(f64, String)> = self
            .0
            .iter()
            .filter_map(|(tid, now)| {
                let then = before.0.get(tid);
                let since = |count: fn(&ThreadCounts) -> u64| {
                    count(now).saturating_sub(then.map_or(0, count)) as f64 / seconds
                };
                let share = since(|c| c.on_cpu_ns) / 1e9;
                let per_second = since(|c| c.context_switches);
                let waiting = since(|c| c.waiting_for_cpu_ns) / 1e9;
                let preempted = since(|c| c.preempted);
                let kept_off = if waiting > 0.01 || preempted > 10.0 {
                    format!("; {waiting:.2} waiting for a CPU, {preempted:.0}/s preempted")
                } else {
                    String::new()
                };
                (share > 0.1).then(|| {
                    (
                        share,
                        format!(
                            "{}#{tid} {share:.2} ({per_second:.0}/s{kept_off})",
                            now.name
                        ),
                    )
                })
            })
            .collect();
        busy.sort_by(|a, b| b.0.total_cmp(&a.0));
        busy.into_iter()
            .map(|(_, thread)| thread)
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Per message since `before`, threads that switched at least once per 100 messages,
    /// as "name 1.00 (31 µs), name 0.02 (0 µs)": context switches and CPU time.
    fn since(&self, before: &Self, messages: u64) -> String {
        let per = |n: u64| n as f64 / messages.max(1) as f64;
        self.0
            .iter()
            .filter_map(|(tid, now)| {
                let (switches, ns) = before
                    .0
                    .get(tid)
                    .map_or((0, 0), |then| (then.context_switches, then.on_cpu_ns));
                let switched = per(now.context_switches.saturating_sub(switches));
                let cpu_us = per(now.on_cpu_ns.saturating_sub(ns)) / 1e3;
                (switched >= 0.01).then(|| format!("{} {switched:.2} ({cpu_us:.0} µs)", now.name))
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// What the raw quinn latency anchor exchanges on each fresh stream.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Exchange {
    /// `size` bytes and FIN, a 1-byte answer: a plain request/response.
    OneRoundTrip,
    /// tensorwire's two round trips on bare quinn: a 64-byte header and a 1-byte answer, then
    /// `size` bytes and FIN and a 1-byte answer (METADATA → ACCEPT, DATA + END → COMPLETE,
    /// without framing, credit or a sink).
    TwoRoundTrips,
}

/// One raw quinn connection for the latency runs: each message on a fresh stream, as
/// `exchange` says.
struct QuinnLatency {
    conn: quinn::Connection,
    client: quinn::Endpoint,
    client_runtime: tokio::runtime::Handle,
    server_task: tokio::task::JoinHandle<anyhow::Result<()>>,
    exchange: Exchange,
    data: Bytes,
    samples: u64,
}

impl QuinnLatency {
    async fn start(
        samples: u64,
        size: usize,
        mtu: u16,
        exchange: Exchange,
    ) -> anyhow::Result<Self> {
        let (server, server_runtime, cert) = quinn_server(mtu)?;
        let addr: SocketAddr = server.local_addr()?;
        let server_task = server_runtime.spawn(async move {
            let conn = first_connection(server).await?;
            while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                tokio::spawn(async move {
                    if exchange == Exchange::TwoRoundTrips {
                        let mut header = [0u8; 64];
                        recv.read_exact(&mut header).await?;
                        send.write_all(&[1]).await?;
                    }
                    let _ = recv.read_to_end(usize::MAX).await?;
                    send.write_all(&[2]).await?;
                    send.finish()?;
                    anyhow::Ok(())
                });
            }
            anyhow::Ok(())
        });
        let (client, client_runtime, config) = quinn_client(mtu, &cert)?;
        let conn = client.connect_with(config, addr, "localhost")?.await?;
        Ok(Self {
            conn,
            client,
            client_runtime,
            server_task,
            exchange,
            data: payload(size),
            samples,
        })
    }
}

impl LatencyConnection for QuinnLatency {
    /// Exchanges the messages on the client endpoint's runtime, as tensorwire's client runs.
    async fn run(&self, count: u64) -> anyhow::Result<Histogram<u64>> {
        let (conn, data, exchange) = (self.conn.clone(), self.data.clone(), self.exchange);
        self.client_runtime
            .spawn(async move {
                let mut h = histogram();
                let mut answer = [0u8; 1];
                for _ in 0..count {
                    let started = Instant::now();
                    let (mut send, mut recv) = conn.open_bi().await?;
                    if exchange == Exchange::TwoRoundTrips {
                        send.write_all(&[0u8; 64]).await?;
                        recv.read_exact(&mut answer).await?;
                    }
                    send.write_chunk(data.clone()).await?;
                    send.finish()?;
                    let _ = recv.read_to_end(16).await?;
                    h.saturating_record(started.elapsed().as_micros() as u64);
                }
                anyhow::Ok(h)
            })
            .await?
    }

    async fn finish(self) -> anyhow::Result<()> {
        print_datagrams("raw quinn", &self.conn.stats(), self.samples);
        self.conn.close(0u32.into(), b"done");
        self.client.wait_idle().await;
        self.server_task.abort();
        Ok(())
    }
}

/// The latency row of tensorwire in [`alternated_latency`].
const ALTERNATED_TENSORWIRE: &str = "tensorwire, inline, alt.";
/// The latency row of raw quinn in [`alternated_latency`].
const ALTERNATED_QUINN: &str = "raw quinn, alternated";

/// tensorwire (inline) and raw quinn's request/response with both connections up, taking
/// turns ten messages at a time (which goes first swapped every turn), so that both meet
/// the same state of the host: on a loaded or virtualised host one end-to-end wake-up costs
/// anywhere from a few to tens of µs, from one minute to the next.
async fn alternated_latency(
    samples: u64,
    size: usize,
    mtu: u16,
) -> anyhow::Result<(Histogram<u64>, Histogram<u64>)> {
    const TURN: u64 = 10;
    let tensorwire = TensorwireLatency::start(samples, size, mtu, Admission::Inline).await?;
    let quinn = QuinnLatency::start(samples, size, mtu, Exchange::OneRoundTrip).await?;
    let (mut tw, mut raw) = (histogram(), histogram());
    let mut done = 0;
    while done < samples {
        let n = TURN.min(samples - done);
        if (done / TURN).is_multiple_of(2) {
            tw.add(tensorwire.run(n).await?)?;
            raw.add(quinn.run(n).await?)?;
        } else {
            raw.add(quinn.run(n).await?)?;
            tw.add(tensorwire.run(n).await?)?;
        }
        done += n;
    }
    tensorwire.finish().await?;
    quinn.finish().await?;
    Ok((tw, raw))
}

/// UDP datagrams the client sent and received per message, handshake included: one each way
/// is the floor for a request/response.
fn print_datagrams(who: &str, stats: &quinn::ConnectionStats, samples: u64) {
    let per = |n: u64| n as f64 / samples.max(1) as f64;
    println!(
        "{who} latency client: {:.2} datagrams sent, {:.2} received per message",
        per(stats.udp_tx.datagrams),
        per(stats.udp_rx.datagrams)
    );
    println!(
        "{who} latency client, QUIC frames per message: sent {}; received {}",
        frames_per_message(&stats.frame_tx, samples),
        frames_per_message(&stats.frame_rx, samples)
    );
}

/// The kinds of QUIC frame a latency exchange can carry, per message, where one in a hundred
/// messages or more carries one: what an extra datagram held.
fn frames_per_message(frames: &quinn::FrameStats, samples: u64) -> String {
    let kinds = [
        ("STREAM", frames.stream),
        ("ACK", frames.acks),
        ("MAX_DATA", frames.max_data),
        ("MAX_STREAM_DATA", frames.max_stream_data),
        ("MAX_STREAMS (bidi)", frames.max_streams_bidi),
        ("MAX_STREAMS (uni)", frames.max_streams_uni),
        ("PING", frames.ping),
        ("RESET_STREAM", frames.reset_stream),
        ("STOP_SENDING", frames.stop_sending),
        ("DATA_BLOCKED", frames.data_blocked),
        ("STREAM_DATA_BLOCKED", frames.stream_data_blocked),
        ("STREAMS_BLOCKED (bidi)", frames.streams_blocked_bidi),
    ];
    kinds
        .iter()
        .map(|(kind, n)| (kind, *n as f64 / samples.max(1) as f64))
        .filter(|(_, per)| *per >= 0.01)
        .map(|(kind, per)| format!("{kind} {per:.2}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A latency row; `used` is what the whole process spent over the run, if it was measured
/// alone.
fn latency_row(
    transport: &'static str,
    size: usize,
    h: &Histogram<u64>,
    used: Option<ProcessUsage>,
) -> Latency {
    let per_message = |n: f64| n / h.len().max(1) as f64;
    Latency {
        transport,
        message_bytes: size,
        samples: h.len(),
        p50_us: h.value_at_quantile(0.5),
        p99_us: h.value_at_quantile(0.99),
        cpu_us_per_message: used.map(|u| per_message(u.cpu_seconds * 1e6)),
        context_switches_per_message: used.map(|u| per_message(u.context_switches as f64)),
        allocations_per_message: used.map(|u| per_message(u.allocations as f64)),
    }
}

/// The latency rows measured alone, one connection each: `samples` messages of `size` bytes.
struct LatencyRows {
    samples: u64,
    size: usize,
    mtu: u16,
}

impl LatencyRows {
    /// tensorwire's row for `admission`.
    async fn tensorwire(&self, admission: Admission) -> anyhow::Result<Latency> {
        let name = match admission {
            Admission::Queued => "tensorwire, queued",
            Admission::Inline => "tensorwire, inline",
        };
        let start = TensorwireLatency::start(self.samples, self.size, self.mtu, admission);
        self.measure(name, start).await
    }

    /// Raw quinn's row for `exchange`.
    async fn quinn(&self, exchange: Exchange) -> anyhow::Result<Latency> {
        let name = match exchange {
            Exchange::OneRoundTrip => "raw quinn",
            Exchange::TwoRoundTrips => "raw quinn, 2 round trips",
        };
        let start = QuinnLatency::start(self.samples, self.size, self.mtu, exchange);
        self.measure(name, start).await
    }

    /// The row `name` of the messages in a row over the connection `start` brings up.
    async fn measure<C: LatencyConnection>(
        &self,
        name: &'static str,
        start: impl Future<Output = anyhow::Result<C>> + Send + 'static,
    ) -> anyhow::Result<Latency> {
        measured_row(name, self.size, in_a_row(name, self.samples, start)).await
    }
}

/// Runs one latency measurement on a runtime worker and makes its row, with the process's
/// CPU time and context switches per message over the run (both ends live in this process;
/// set-up included).
async fn measured_row(
    transport: &'static str,
    size: usize,
    run: impl Future<Output = anyhow::Result<Histogram<u64>>> + Send + 'static,
) -> anyhow::Result<Latency> {
    ALLOCATOR.count(Counting::On);
    let before = ProcessUsage::now();
    let h = on_worker(run).await;
    let after = ProcessUsage::now();
    ALLOCATOR.count(Counting::Off);
    let used = before.zip(after).map(|(b, a)| a.since(&b));
    Ok(latency_row(transport, size, &h?, used))
}

/// This process's CPU time and context switches so far, every thread's (ended ones too),
/// and the allocations counted so far.
#[derive(Clone, Copy)]
struct ProcessUsage {
    cpu_seconds: f64,
    context_switches: i64,
    allocations: u64,
}

impl ProcessUsage {
    fn now() -> Option<Self> {
        use nix::sys::resource::{UsageWho, getrusage};
        let usage = getrusage(UsageWho::RUSAGE_SELF).ok()?;
        let seconds = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 / 1e6;
        Some(Self {
            cpu_seconds: seconds(usage.user_time()) + seconds(usage.system_time()),
            context_switches: usage.voluntary_context_switches()
                + usage.involuntary_context_switches(),
            allocations: ALLOCATOR.allocations(),
        })
    }

    fn since(&self, before: &Self) -> Self {
        Self {
            cpu_seconds: self.cpu_seconds - before.cpu_seconds,
            context_switches: self.context_switches - before.context_switches,
            allocations: self.allocations - before.allocations,
        }
    }
}

// ---------------------------------------------------------------- GPU

/// What ingest's anchors copy: pieces of ingest's chunk size from one source this large.
const ANCHOR_PIECE: usize = 1 << 20;
const ANCHOR_SOURCE: usize = 64 << 20;

/// Plain memory copies as ingest from memory makes them, without the GPU: `threads` threads
/// copy [`ANCHOR_PIECE`]s of one [`ANCHOR_SOURCE`] into a ring of their own, together
/// `staging_pool` bytes, for about a second. What the copies alone can do, beside what they
/// do while the GPU reads the staging buffers.
fn host_copy_rate(threads: usize, staging_pool: usize) -> f64 {
    const PIECE: usize = ANCHOR_PIECE;
    const SOURCE: usize = ANCHOR_SOURCE;
    let source = payload(SOURCE);
    let ring = (staging_pool / threads).max(PIECE) / PIECE * PIECE;
    std::thread::scope(|scope| {
        let copiers: Vec<_> = (0..threads)
            .map(|t| {
                let source = &source;
                scope.spawn(move || {
                    let mut ring = vec![0u8; ring];
                    let started = Instant::now();
                    let (mut copied, mut i) = (0usize, t * 7);
                    while started.elapsed() < Duration::from_secs(1) {
                        for _ in 0..16 {
                            let from = (i * PIECE) % SOURCE;
                            let to = (i * PIECE) % ring.len();
                            ring[to..to + PIECE].copy_from_slice(&source[from..from + PIECE]);
                            (copied, i) = (copied + PIECE, i + 1);
                        }
                    }
                    std::hint::black_box(&ring);
                    copied as f64 / started.elapsed().as_secs_f64()
                })
            })
            .collect();
        copiers
            .into_iter()
            .map(|c| c.join().unwrap_or(0.0))
            .sum::<f64>()
            / 1e9
    })
}

/// Ingest's data path without the sink: `threads` threads, each with a ring of pinned staging
/// buffers of its own (together `staging_pool` bytes) and a stream of its own, fill a buffer
/// from [`ANCHOR_PIECE`]s of one [`ANCHOR_SOURCE`] and copy it to the device, for about a
/// second. What the host's copies and the GPU's reads of staging do together on this
/// machine, beside what the sink makes of them.
fn staged_h2d_rate(threads: usize, staging_pool: usize) -> anyhow::Result<f64> {
    use tensorwire::gpu::{GpuDevice, PinnedAllocation};
    const PIECE: usize = ANCHOR_PIECE;
    const SOURCE: usize = ANCHOR_SOURCE;
    const STAGING: usize = tensorwire::gpu::STAGING_BUFFER;
    let device = GpuDevice::open(0)?;
    let source = payload(SOURCE);
    let ring = (staging_pool / STAGING / threads).max(1);
    std::thread::scope(|scope| {
        let copiers: Vec<_> = (0..threads)
            .map(|t| {
                let (device, source) = (&device, &source);
                scope.spawn(move || -> anyhow::Result<(usize, f64)> {
                    let ctx = device.cuda_context();
                    let stream = ctx.new_stream()?;
                    let mut dst = stream.alloc_zeros::<u8>(SOURCE)?;
                    let mut staging = (0..ring)
                        .map(|_| PinnedAllocation::new(device, STAGING))
                        .collect::<Result<Vec<_>, _>>()?;
                    let events = (0..ring)
                        .map(|_| ctx.new_event(None))
                        .collect::<Result<Vec<_>, _>>()?;
                    let started = Instant::now();
                    let (mut copied, mut i) = (0usize, t * 7);
                    let mut copy_for_a_second = || -> anyhow::Result<()> {
                        while started.elapsed() < Duration::from_secs(1) {
                            let slot = (copied / STAGING) % ring;
                            // Past the first lap, the copy that last read this buffer must be
                            // done before its refill.
                            if copied >= ring * STAGING {
                                events[slot].synchronize()?;
                            }
                            let buffer = staging[slot].as_mut_slice();
                            for at in (0..STAGING).step_by(PIECE) {
                                let from = (i * PIECE) % SOURCE;
                                buffer[at..at + PIECE].copy_from_slice(&source[from..from + PIECE]);
                                i += 1;
                            }
                            // The copy reads the pinned buffer after this call returns: the event
                            // above guards its refill, the stream's synchronize below its drop.
                            let to = copied % SOURCE;
                            stream.memcpy_htod(
                                staging[slot].as_slice(),
                                &mut dst.slice_mut(to..to + STAGING),
                            )?;
                            events[slot].record(&stream)?;
                            copied += STAGING;
                        }
                        Ok(())
                    };
                    let copying = copy_for_a_second();
                    // Whatever happened, no copy may still read a staging buffer once it drops.
                    stream.synchronize()?;
                    copying?;
                    Ok((copied, started.elapsed().as_secs_f64()))
                })
            })
            .collect();
        let mut rate = 0.0;
        for copier in copiers {
            let (copied, seconds) = copier
                .join()
                .map_err(|_| anyhow::anyhow!("a staging copier panicked"))??;
            rate += copied as f64 / seconds / 1e9;
        }
        Ok(rate)
    })
}

/// Pinned host → device copies of 256 MiB, the ceiling for every GPU figure.
fn pinned_h2d_peak() -> anyhow::Result<f64> {
    use tensorwire::gpu::{DeviceAllocation, GpuDevice, PinnedAllocation};
    let len = 256 << 20;
    let device = GpuDevice::open(0)?;
    let mut pinned = PinnedAllocation::new(&device, len)?;
    pinned.as_mut_slice().fill(7);
    let mut dst = DeviceAllocation::new(&device, len)?;
    dst.copy_from_host(0, pinned.as_slice())?; // warm-up
    let rounds = 8;
    let started = Instant::now();
    for _ in 0..rounds {
        dst.copy_from_host(0, pinned.as_slice())?;
    }
    Ok((rounds * len) as f64 / started.elapsed().as_secs_f64() / 1e9)
}

/// Bytes each ingest run moves: enough that the run lasts well past its start and its drain
/// (4 batches of 8 sinks, 2 GiB, took about 50 ms at 41 GB/s, the same order as both).
const INGEST_BYTES: usize = 8 << 30;

/// What one ingest-from-memory run measured.
#[derive(Serialize, Debug)]
struct SinkIngest {
    gb_per_s: f64,
    /// Mean host → device copy in MiB.
    mean_copy_mib: f64,
    /// Tensors whose destination the device pool could not serve.
    allocated_outside_pool: u64,
}

/// `tensors` GPU sinks at once, fed 1 MiB chunks from host memory, [`INGEST_BYTES`] in all
/// (at least four rounds), no network: the ceiling of the sink (memcpy into pinned staging,
/// async H2D, completion). As a receiver's connections do, a new tensor starts as soon as any
/// one ends, not once a whole round has. Each copy takes one staging buffer, and a sink
/// copies a buffer before it is full when the pool runs out: the mean copy size shows it.
async fn ingest_from_memory(
    pools: &tensorwire::gpu::PooledGpuReceiver,
    tensors: usize,
    tensor_bytes: usize,
) -> anyhow::Result<SinkIngest> {
    let staging_taken = || {
        let stats = pools.staging_stats();
        stats.hits + stats.misses
    };
    let taken_before = staging_taken();
    let outside_before = pools.allocations_outside_pool();
    let total = tensors * (INGEST_BYTES / (tensors * tensor_bytes)).max(4);
    let data = payload(tensor_bytes);
    let meta = TensorMeta::new([tensor_bytes as u64], DType::U8)?;
    let started = Instant::now();
    let mut running = tokio::task::JoinSet::new();
    for _ in 0..total {
        if running.len() == tensors
            && let Some(ended) = running.join_next().await
        {
            ended??;
        }
        let mut sink = pools.sink(&meta)?;
        let data = data.clone();
        running.spawn(async move {
            for at in (0..data.len()).step_by(1 << 20) {
                let piece = data.slice(at..(at + (1 << 20)).min(data.len()));
                let n = piece.len() as u64;
                sink.write(at as u64, Payload::from(piece), CreditPermit::unbudgeted(n))
                    .await?;
            }
            sink.finish().await.map(drop)
        });
    }
    while let Some(ended) = running.join_next().await {
        ended??;
    }
    let moved = (total * tensor_bytes) as f64;
    let gb_per_s = moved / started.elapsed().as_secs_f64() / 1e9;
    let copies = (staging_taken() - taken_before).max(1);
    Ok(SinkIngest {
        gb_per_s,
        mean_copy_mib: moved / copies as f64 / (1 << 20) as f64,
        allocated_outside_pool: pools.allocations_outside_pool() - outside_before,
    })
}

/// Share of pool requests served without allocating between two snapshots.
fn hit_rate_since(before: tensorwire::gpu::PoolStats, after: tensorwire::gpu::PoolStats) -> f64 {
    let (hits, misses) = (after.hits - before.hits, after.misses - before.misses);
    if hits + misses == 0 {
        1.0
    } else {
        hits as f64 / (hits + misses) as f64
    }
}

async fn gpu_section(
    args: &Args,
    bytes: u64,
    tensor_bytes: u64,
    runs: usize,
) -> anyhow::Result<GpuReport> {
    use tensorwire::gpu::{
        DEFAULT_STAGING_POOL, HostFallback, Placement, PoolConfig, PooledGpuReceiver,
    };
    let staging = PoolConfig {
        max_pool_bytes: args
            .staging_pool_mib
            .map_or(DEFAULT_STAGING_POOL, |mib| mib << 20),
        preallocate: true,
        ..PoolConfig::default()
    };
    let memory = match args.device_pool_mib {
        0 => PoolConfig::default(),
        mib => PoolConfig {
            max_pool_bytes: mib << 20,
            max_buffer: (mib << 20).max(64 << 20),
            ..PoolConfig::default()
        },
    };
    let staging_pool = staging.max_pool_bytes;
    let device_pool_mib = memory.max_pool_bytes >> 20;
    // A GPU measurement never lands a tensor in host memory instead.
    let pools =
        PooledGpuReceiver::new(0, staging, memory)?.with_host_fallback(HostFallback::Forbidden);
    let gpu = Placement::Gpu(pools.clone());
    let pinned_h2d_gb_per_s = pinned_h2d_peak()?;
    // Warm-up, with the most sinks measured: fills the pools.
    ingest_from_memory(&pools, 16, 64 << 20).await?;
    let (staging_before, device_before) = (pools.staging_stats(), pools.memory_stats());
    // Each sink's copy into pinned staging runs on one core: more sinks at once (as more
    // connections bring) show whether the copies or the host → device link set the rate.
    // 32 only where there are as many cores.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut ingest = Vec::new();
    for sinks in [4, 8, 16, 32].into_iter().filter(|&s| s <= cores.max(16)) {
        // As the throughput rows: the best of `runs`, every round kept (one round of 8 GiB
        // moved by a tenth between calls on one host).
        let mut rounds_gb_per_s = Vec::new();
        let mut best: Option<SinkIngest> = None;
        for _ in 0..runs.max(1) {
            let round = ingest_from_memory(&pools, sinks, 64 << 20).await?;
            rounds_gb_per_s.push(round.gb_per_s);
            if best.as_ref().is_none_or(|b| round.gb_per_s > b.gb_per_s) {
                best = Some(round);
            }
        }
        ingest.push(IngestRun {
            sinks,
            ingest: best.expect("one round at least"),
            rounds_gb_per_s,
            host_copy_gb_per_s: tokio::task::spawn_blocking(move || {
                host_copy_rate(sinks, staging_pool)
            })
            .await?,
            staged_h2d_gb_per_s: tokio::task::spawn_blocking(move || {
                staged_h2d_rate(sinks, staging_pool)
            })
            .await??,
        });
    }
    let mut network = Vec::new();
    for &n in &args.connections {
        let run_with = |sink: SinkKind| TensorwireRun::from_args(args, sink, tensor_bytes);
        let to_host = run_with(SinkKind::Host);
        let to_gpu = run_with(SinkKind::Placed(gpu.clone()));
        // The two sinks take turns in each round, the first changing between rounds: this
        // host's rate moves by a tenth or more from one minute to the next, more than the
        // gap being measured, so each round's ratio compares runs made side by side.
        let (mut best_host, mut best_gpu, mut ratios) = (f64::NAN, f64::NAN, Vec::new());
        for round in 0..runs.max(1) {
            let (host_s, gpu_s) = if round % 2 == 0 {
                let host_s = tensorwire_run(n, bytes, to_host.clone()).await?;
                (host_s, tensorwire_run(n, bytes, to_gpu.clone()).await?)
            } else {
                let gpu_s = tensorwire_run(n, bytes, to_gpu.clone()).await?;
                (tensorwire_run(n, bytes, to_host.clone()).await?, gpu_s)
            };
            keep_best(&mut best_host, host_s);
            keep_best(&mut best_gpu, gpu_s);
            ratios.push(host_s / gpu_s);
        }
        let gbit = |s: f64| (bytes * n as u64) as f64 * 8.0 / s / 1e9;
        let range = spread(&ratios);
        network.push(NetworkRun {
            connections: n,
            host_gbit_per_s: gbit(best_host),
            gpu_gbit_per_s: gbit(best_gpu),
            gpu_over_host: best_host / best_gpu,
            median_round_gpu_over_host: median(&mut ratios),
            round_gpu_over_host_range: range,
        });
    }
    Ok(GpuReport {
        device: gpu.describe(),
        staging_pool_mib: staging_pool >> 20,
        device_pool_mib,
        pinned_h2d_gb_per_s,
        ingest_from_memory: ingest,
        network,
        staging_hit_rate: hit_rate_since(staging_before, pools.staging_stats()),
        device_pool_hit_rate: hit_rate_since(device_before, pools.memory_stats()),
    })
}

// ---------------------------------------------------------------- main

/// Keeps the shorter of `best` and `seconds`; a skipped run (NaN) keeps the other.
fn keep_best(best: &mut f64, seconds: f64) {
    if best.is_nan() || seconds < *best {
        *best = seconds;
    }
}

/// The median of `values` (the mean of the middle two for an even count); NaN for none.
fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// The lowest and highest of the rounds' `values` (a skipped round, NaN, counts for neither).
fn spread(values: &[f64]) -> (f64, f64) {
    let lowest = values.iter().copied().fold(f64::NAN, f64::min);
    let highest = values.iter().copied().fold(f64::NAN, f64::max);
    (lowest, highest)
}

/// A 95% confidence interval of the median of `values`, free of any assumption about their
/// distribution: the order statistics `k` and `n + 1 - k` where fewer than 2.5% of
/// `Binomial(n, 1/2)` draws fall below `k`. `None` under 6 values, too few for one.
fn median_interval(values: &[f64]) -> Option<(f64, f64)> {
    let mut sorted: Vec<f64> = values.iter().copied().filter(|v| !v.is_nan()).collect();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    // P(X <= j) for X ~ Binomial(n, 1/2), summed term by term: C(n, j) / 2^n, kept as a
    // logarithm so that 2^-n does not underflow past about a thousand rounds.
    let mut ln_term = -(n as f64) * std::f64::consts::LN_2;
    let mut below = 0.0;
    let mut k = 0;
    for j in 0..n {
        below += ln_term.exp();
        if below > 0.025 {
            break;
        }
        k = j + 1;
        ln_term += ((n - j) as f64 / (j + 1) as f64).ln();
    }
    (k >= 1).then(|| (sorted[k - 1], sorted[n - k]))
}

/// " (best of N: A B C)", every round's rate in the order run, where there was more than one.
fn rounds_text(rates: &[f64]) -> String {
    if rates.len() > 1 {
        format!(" (best of {}: {})", rates.len(), joined(rates, 1))
    } else {
        String::new()
    }
}

/// `values` with `decimals` decimals each, separated by spaces.
fn joined(values: &[f64], decimals: usize) -> String {
    let values: Vec<String> = values.iter().map(|v| format!("{v:.decimals$}")).collect();
    values.join(" ")
}

/// What one connection count's rounds of tensorwire / raw quinn say.
struct RoundsSummary {
    median: f64,
    /// The lowest and highest round.
    range: (f64, f64),
    /// The median's 95% interval ([`median_interval`]).
    interval: Option<(f64, f64)>,
}

impl RoundsSummary {
    fn of(rounds: &[f64]) -> Self {
        Self {
            median: median(&mut rounds.to_vec()),
            range: spread(rounds),
            interval: median_interval(rounds),
        }
    }
}

/// ", rounds LOW to HIGH" where there was more than one round, else nothing.
fn spread_text(runs: usize, (lowest, highest): (f64, f64)) -> String {
    if runs > 1 {
        format!(", rounds {lowest:.3} to {highest:.3}")
    } else {
        String::new()
    }
}

/// Transports `--only` may list.
const TRANSPORTS: [&str; 4] = ["raw-quinn", "raw-quinn-hot", "tensorwire", "tcp-tls"];

/// Modes `--only` may name, each alone.
const MODES: [&str; 4] = ["latency", "latency-inline", "latency-raw", "gpu"];

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

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(only) = &args.only {
        check_only(only)?;
    }
    let _ = ENDPOINT_THREADS.set(args.endpoint_threads);
    let _ = STORE_OFFLOAD.set(args.store_offload);
    if args.delay_ms > 0 {
        let tcp_tls = args
            .only
            .as_deref()
            .is_none_or(|only| only.split(',').any(|one| one == "tcp-tls"));
        anyhow::ensure!(
            !tcp_tls,
            "--delay-ms delays UDP datagrams only: pass --only without tcp-tls (e.g. \
             --only raw-quinn,tensorwire)"
        );
        let _ = ONE_WAY_DELAY.set(Duration::from_millis(args.delay_ms));
    }
    let _ = THREAD_USAGE.set(args.thread_usage);
    let mib = args.mib.unwrap_or(if args.quick { 512 } else { 2048 });
    if let Some(cert) = &args.raw_server {
        let count = args.connections.first().copied().unwrap_or(1);
        return raw_quinn_server_process(cert, count, args.mtu, args.steering).await;
    }
    let bytes = mib << 20;
    let tensor_bytes = (args.tensor_mib << 20).min(bytes);
    let latency_only = matches!(
        args.only.as_deref(),
        Some("latency" | "latency-inline" | "latency-raw")
    );
    // `--only gpu` measures the GPU section alone, as if `--gpu` were given with it.
    let gpu_only = args.only.as_deref() == Some("gpu");
    let no_throughput = latency_only || gpu_only;
    // A run without throughput rows loads no throughput source: its setup stays out of the
    // measurement (and of a profile of it).
    let source = if no_throughput && args.raw_client.is_none() {
        Loaded::Memory(Bytes::new())
    } else {
        RawSource::load(args.source.as_ref(), tensor_bytes)?
    };
    if let (Some(addr), Some(cert)) = (args.raw_client, &args.cert) {
        let connections = args.connections.first().copied().unwrap_or(1);
        return raw_quinn_client_process(addr, cert, connections, bytes, args.mtu, source).await;
    }
    let runs = if args.quick { 1 } else { args.runs };
    // The anchor of earlier figures, beside the like-for-like one.
    let hot = match args.source {
        Some(RawSource::Hot) => None,
        _ => Some(Loaded::Memory(payload(CHUNK))),
    };
    let mut throughput = Vec::new();
    let mut ratios = Vec::new();
    let mut rounds_in_order = Vec::new();
    let mut hot_ratios = Vec::new();
    let connections: &[usize] = if no_throughput {
        &[]
    } else {
        &args.connections
    };
    for &n in connections {
        let wanted = |name: &str| {
            args.only
                .as_deref()
                .is_none_or(|only| only.split(',').any(|one| one == name))
        };
        let skipped = f64::NAN;
        let tw_run = TensorwireRun::from_args(&args, SinkKind::Discard, tensor_bytes);
        // Each round runs every transport once, so a machine that slows down or speeds up
        // between rounds moves both sides of that round's ratio. Raw quinn and tensorwire
        // swap places between rounds: in one block of runs each variant of a build beat the
        // default in both rounds when it ran later in them (benches/README.md), so a fixed
        // order can bias the ratio.
        let (mut quinn_s, mut hot_quinn_s, mut tw_s, mut tcp_s) =
            (skipped, skipped, skipped, skipped);
        let mut round_ratios = Vec::new();
        for round in 0..runs.max(1) {
            let tensorwire_first = round % 2 == 1;
            let mut tw = skipped;
            if tensorwire_first && wanted("tensorwire") {
                tw = tensorwire_run(n, bytes, tw_run.clone()).await?;
            }
            let quinn = if wanted("raw-quinn") {
                raw_quinn(n, bytes, args.mtu, &source).await?
            } else {
                skipped
            };
            if let Some(hot) = hot.as_ref().filter(|_| wanted("raw-quinn-hot")) {
                keep_best(&mut hot_quinn_s, raw_quinn(n, bytes, args.mtu, hot).await?);
            }
            if !tensorwire_first && wanted("tensorwire") {
                tw = tensorwire_run(n, bytes, tw_run.clone()).await?;
            }
            if wanted("tcp-tls") {
                keep_best(&mut tcp_s, tcp_tls(n, bytes, &source).await?);
            }
            keep_best(&mut quinn_s, quinn);
            keep_best(&mut tw_s, tw);
            round_ratios.push(quinn / tw);
        }
        // None where `--source hot` made the first anchor the hot one.
        let hot_quinn_s = hot.as_ref().map(|_| hot_quinn_s);
        rounds_in_order.push((n, round_ratios));
        let total = bytes * n as u64;
        let rows = [
            Some(("raw quinn", quinn_s)),
            hot_quinn_s.map(|s| ("raw quinn, hot", s)),
            Some(("tensorwire", tw_s)),
            Some(("TCP+TLS", tcp_s)),
        ];
        // A transport `--only` left out has no row.
        let measured = rows.into_iter().flatten().filter(|(_, s)| !s.is_nan());
        for (transport, seconds) in measured {
            let gbit_per_s = total as f64 * 8.0 / seconds / 1e9;
            throughput.push(Throughput {
                transport,
                connections: n,
                bytes: total,
                seconds,
                gbit_per_s,
            });
        }
        ratios.push((n, quinn_s / tw_s));
        if let Some(hot_quinn_s) = hot_quinn_s {
            hot_ratios.push((n, hot_quinn_s / tw_s));
        }
    }
    // What each connection count's rounds say, for the table and the JSON alike.
    let summaries: Vec<(usize, RoundsSummary)> = rounds_in_order
        .iter()
        .map(|(n, rounds)| (*n, RoundsSummary::of(rounds)))
        .collect();
    let default_samples = if args.quick { 300 } else { 20_000 };
    let samples = if args.only.is_none() || latency_only {
        args.samples.unwrap_or(default_samples)
    } else {
        0
    };
    let size = 4096;
    let mtu = args.mtu;
    let rows = LatencyRows { samples, size, mtu };
    let latency = match args.only.as_deref() {
        _ if samples == 0 => Vec::new(),
        Some("latency-inline") => vec![rows.tensorwire(Admission::Inline).await?],
        Some("latency-raw") => vec![rows.quinn(Exchange::OneRoundTrip).await?],
        _ => {
            let (alternated_tw, alternated_raw) =
                tokio::spawn(alternated_latency(samples, size, mtu)).await??;
            vec![
                rows.tensorwire(Admission::Queued).await?,
                rows.tensorwire(Admission::Inline).await?,
                rows.quinn(Exchange::OneRoundTrip).await?,
                rows.quinn(Exchange::TwoRoundTrips).await?,
                latency_row(ALTERNATED_TENSORWIRE, size, &alternated_tw, None),
                latency_row(ALTERNATED_QUINN, size, &alternated_raw, None),
            ]
        }
    };

    if !no_throughput {
        println!(
            "throughput, loopback, MTU {} ({mib} MiB per connection, best of {runs}):",
            args.mtu
        );
        let source_name = match &args.source {
            None => format!(
                "a {} MiB buffer, as tensorwire's tensors",
                tensor_bytes >> 20
            ),
            Some(RawSource::Hot) => "one 4 MiB buffer again and again (cache-hot)".to_owned(),
            Some(RawSource::File(path)) => format!("{}, mapped", path.display()),
        };
        println!("  raw quinn and TCP+TLS send from {source_name}");
        if hot.is_some() {
            println!("  \"raw quinn, hot\" sends one 4 MiB buffer again and again (cache-hot)");
        }
        println!(
            "  {:<15} {:>5} {:>12} {:>10}",
            "transport", "conns", "Gbit/s", "seconds"
        );
        for t in &throughput {
            println!(
                "  {:<15} {:>5} {:>12.2} {:>10.3}",
                t.transport, t.connections, t.gbit_per_s, t.seconds
            );
        }
        for (((n, ratio), (_, rounds)), (_, summary)) in
            ratios.iter().zip(&rounds_in_order).zip(&summaries)
        {
            if ratio.is_nan() {
                continue; // `--only` left tensorwire or raw quinn out.
            }
            let median_ratio = summary.median;
            let hot = hot_ratios.iter().find(|(m, r)| m == n && !r.is_nan());
            let hot = hot.map_or_else(String::new, |(_, hot_ratio)| {
                format!("; / raw quinn, hot: {hot_ratio:.3}")
            });
            let range = spread_text(runs, summary.range);
            let interval = summary.interval.map_or_else(String::new, |(low, high)| {
                format!("; 95% interval of the median {low:.3} to {high:.3}")
            });
            println!(
                "  tensorwire / raw quinn, {n} connection(s): {ratio:.3} (best of each), {median_ratio:.3} (median of the rounds' ratios{range}{interval}){hot}"
            );
            if rounds.len() > 1 {
                println!("    rounds in the order run: {}", joined(rounds, 3));
            }
        }
    }
    if !latency.is_empty() {
        println!("latency, one {size}-byte message at a time ({samples} samples):");
    }
    for l in &latency {
        let usage = l
            .cpu_us_per_message
            .zip(l.context_switches_per_message)
            .zip(l.allocations_per_message)
            .map_or_else(String::new, |((us, switches), allocations)| {
                format!(
                    "   per message: CPU {us:.0} µs, {switches:.1} context switches, {allocations:.1} allocations"
                )
            });
        println!(
            "  {:<25} p50 {:>6} µs   p99 {:>6} µs{usage}",
            l.transport, l.p50_us, l.p99_us
        );
    }
    let row = |name: &str| latency.iter().find(|l| l.transport == name);
    for (how, tw, raw) in [
        ("one after the other", "tensorwire, inline", "raw quinn"),
        ("alternated", ALTERNATED_TENSORWIRE, ALTERNATED_QUINN),
    ] {
        if let (Some(tw), Some(raw)) = (row(tw), row(raw)) {
            let times = |a: u64, b: u64| a as f64 / b.max(1) as f64;
            println!(
                "  tensorwire inline / raw quinn, {how}: p50 {:.2}×, p99 {:.2}×",
                times(tw.p50_us, raw.p50_us),
                times(tw.p99_us, raw.p99_us)
            );
        }
    }
    let gpu = if args.gpu || gpu_only {
        Some(gpu_section(&args, bytes, tensor_bytes, runs).await?)
    } else {
        None
    };
    if let Some(g) = &gpu {
        println!(
            "GPU path, {} (staging pool {} MiB, device pool {} MiB):",
            g.device, g.staging_pool_mib, g.device_pool_mib
        );
        println!(
            "  pinned host → device, 256 MiB copies: {:.1} GB/s",
            g.pinned_h2d_gb_per_s
        );
        for run in &g.ingest_from_memory {
            println!(
                "  ingest from memory, {} tensors of 64 MiB at once, {} GiB: {:.1} GB/s{}, copies of {:.2} MiB on average, {} tensors outside the device pool (the same copies without the GPU, {} threads: {:.1} GB/s; staging and device copies without the sink: {:.1} GB/s; ingest / that {:.2})",
                run.sinks,
                INGEST_BYTES >> 30,
                run.ingest.gb_per_s,
                rounds_text(&run.rounds_gb_per_s),
                run.ingest.mean_copy_mib,
                run.ingest.allocated_outside_pool,
                run.sinks,
                run.host_copy_gb_per_s,
                run.staged_h2d_gb_per_s,
                run.ingest.gb_per_s / run.staged_h2d_gb_per_s
            );
        }
        for run in &g.network {
            let spread = spread_text(runs, run.round_gpu_over_host_range);
            println!(
                "  network → host (budgeted, kept buffers) {:.2} Gbit/s, network → GPU {:.2} Gbit/s ({} conn; GPU/host {:.3} best of each, {:.3} median of the rounds' ratios{spread})",
                run.host_gbit_per_s,
                run.gpu_gbit_per_s,
                run.connections,
                run.gpu_over_host,
                run.median_round_gpu_over_host,
            );
        }
        println!(
            "  pool hit rate after warm-up (ingest and network runs): staging {:.4}, device {:.4}",
            g.staging_hit_rate, g.device_pool_hit_rate
        );
    }
    let report = Report {
        host: std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|c| {
                c.lines()
                    .find(|l| l.starts_with("model name"))
                    .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
            })
            .unwrap_or_default(),
        cores: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0),
        mtu: args.mtu,
        one_way_delay_ms: args.delay_ms,
        stream_window_mib: args.window_mib,
        max_stream_window_mib: args.max_window_mib,
        throughput,
        ratio_tensorwire_over_quinn: ratios,
        median_round_ratio_tensorwire_over_quinn: summaries
            .iter()
            .map(|(n, s)| (*n, s.median))
            .collect(),
        round_ratio_range_tensorwire_over_quinn: summaries
            .iter()
            .map(|(n, s)| (*n, s.range))
            .collect(),
        median_interval_95_tensorwire_over_quinn: summaries
            .iter()
            .map(|(n, s)| (*n, s.interval))
            .collect(),
        round_ratios_tensorwire_over_quinn: rounds_in_order,
        ratio_tensorwire_over_hot_quinn: hot_ratios,
        latency,
        gpu,
    };
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::median_interval;

    #[test]
    fn the_median_interval_takes_the_order_statistics_of_the_binomial() {
        // 12 rounds: P(X <= 2) = 0.019 and P(X <= 3) = 0.073, so the 3rd and 10th values.
        let rounds: Vec<f64> = (1..=12).rev().map(f64::from).collect();
        assert_eq!(median_interval(&rounds), Some((3.0, 10.0)));
        // 6 rounds: P(X = 0) = 0.016, the whole range.
        assert_eq!(
            median_interval(&[6.0, 1.0, 5.0, 2.0, 4.0, 3.0]),
            Some((1.0, 6.0))
        );
        // 100 rounds: the 40th and 61st (the textbook's k = 40).
        let rounds: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(median_interval(&rounds), Some((40.0, 61.0)));
        // 2,000 rounds, where 2^-n underflows: k = 956 (n/2 - 1.96 * sqrt(n)/2, rounded
        // down, as the normal approximation has it).
        let rounds: Vec<f64> = (1..=2000).map(f64::from).collect();
        assert_eq!(median_interval(&rounds), Some((956.0, 1045.0)));
    }

    #[test]
    fn too_few_rounds_have_no_median_interval() {
        assert_eq!(median_interval(&[1.0, 2.0, 3.0, 4.0, 5.0]), None);
        // A skipped round (NaN) is no round.
        let with_skipped = [1.0, 2.0, 3.0, 4.0, 5.0, f64::NAN];
        assert_eq!(median_interval(&with_skipped), None);
        assert_eq!(median_interval(&[]), None);
    }
}
