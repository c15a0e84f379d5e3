//! Sends tensors from files over QUIC: `.safetensors`, `.npy`, `.wav`, or raw bytes.
//!
//! `sender --connect 127.0.0.1:7000 model.safetensors audio.wav`

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use tensorwire::proto::{DType, Device};
use tensorwire::quic::{
    Binding, BindingChoice, EndpointThreads, SenderConfig, SenderPool, UDP_HEAD_START,
};
use tensorwire_examples::cli::{
    ClientTlsArgs, TransportArgs, init_logging, seconds, shutdown_signal,
};
use tensorwire_examples::files::{Outgoing, SENDER_ATTR, load, parse_shape};
use tensorwire_examples::progress::{Drawing, PushProgress, TensorState};
use tensorwire_examples::report::{HostOutcome, HostPush, Peer, explain, unreachable_json};
use tokio_util::sync::CancellationToken;

/// Send tensors over QUIC.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Receiver address (HOST:PORT); repeat it, or list several with commas, to push the
    /// same tensors to each at once; `dns:NAME:PORT` means every address NAME resolves to
    /// (a Kubernetes headless Service's pods).
    #[arg(long, required = true, value_delimiter = ',', value_parser = receivers)]
    connect: Vec<Receivers>,
    /// Files to send.
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// Send other files as raw bytes of this dtype (safetensors names, any case: F32, BF16,
    /// U8, ...).
    #[arg(long, requires = "shape", value_parser = parse_dtype)]
    dtype: Option<DType>,
    /// Shape for --dtype, e.g. 1024,4096.
    #[arg(long, requires = "dtype")]
    shape: Option<String>,
    /// Where the receiver should land the tensors (the METADATA device hint): host or
    /// cuda:N. A receiver that cannot refuses them with UNSUPPORTED_DEVICE.
    #[arg(long, value_parser = parse_device)]
    device: Option<Device>,
    /// No progress bars.
    #[arg(long)]
    quiet: bool,
    /// Print the result as one JSON object on stdout instead of the summary lines (the
    /// fields are listed in docs/operators.md); failures are still told on stderr.
    #[arg(long)]
    json: bool,
    /// Connections to open to the receiver (0: one per core, at most 8 and at most one per
    /// tensor). One connection moves about one core's worth of QUIC; tensors are spread over
    /// them, largest first. The process runs two worker threads per connection (at most one
    /// per core; TOKIO_WORKER_THREADS sets another count).
    #[arg(long, default_value_t = 0)]
    connections: usize,
    /// Send every tensor whole. By default a tensor larger than its connection's fair share
    /// of the bytes goes as parts over several connections (spec §15), which a receiver
    /// older than protocol version 1.3 lands as separate tensors.
    #[arg(long)]
    no_split: bool,
    /// Seconds without any progress (a frame from the receiver, or tensor data still being sent
    /// or resent) before
    /// a tensor fails with PROGRESS_TIMEOUT.
    #[arg(long = "progress-timeout-s", default_value = "60", value_parser = seconds)]
    progress_timeout: Duration,
    /// How to reach the receiver: quic (over UDP), tcp (QUIC over TCP, where UDP is blocked
    /// or lost), or auto (UDP, and TCP too if UDP completes no handshake within a second;
    /// the first to connect is used, and said).
    #[arg(long = "transport", default_value = "auto")]
    binding: BindingChoice,
    #[command(flatten)]
    tls: ClientTlsArgs,
    #[command(flatten)]
    transport: TransportArgs,
}

fn main() -> anyhow::Result<()> {
    init_logging("warn");
    let args = Args::parse();
    let raw = match (&args.dtype, &args.shape) {
        (Some(dtype), Some(shape)) => Some((*dtype, parse_shape(shape)?)),
        _ => None,
    };
    let mut outgoing = Vec::new();
    for file in &args.files {
        outgoing.extend(load(file, raw.clone())?);
    }
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let total: u64 = outgoing.iter().map(|o| o.meta.byte_len()).sum();
    let splittable = if args.no_split { 0 } else { total };
    let connections = match args.connections {
        0 => SenderPool::automatic_connections(outgoing.len(), splittable),
        n => n,
    };
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    runtime.enable_all();
    // Each connection's endpoint runs on threads of its own by default, and this runtime
    // only maps files and waits: two workers. On the caller's runtime, about two busy
    // threads per connection (its driver, its streams): idle workers beyond that only add
    // wake-ups. TOKIO_WORKER_THREADS overrides.
    if std::env::var_os("TOKIO_WORKER_THREADS").is_none() {
        runtime.worker_threads(match args.transport.endpoint_threads {
            EndpointThreads::Caller => (2 * connections).clamp(2, cores.max(2)),
            _ => 2,
        });
    }
    runtime
        .build()?
        .block_on(send(args, outgoing, connections, total))
}

async fn send(
    args: Args,
    mut outgoing: Vec<Outgoing>,
    connections: usize,
    total: u64,
) -> anyhow::Result<()> {
    // One id for this run: its tensors may go over several connections, and a receiver
    // that saves files puts each file's tensors back together by it.
    let run = format!(
        "{:x}-{:x}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    );
    for item in &mut outgoing {
        item.meta = item.meta.clone().with_attribute(SENDER_ATTR, run.clone());
        if let Some(device) = args.device {
            item.meta = item.meta.clone().with_device(device);
        }
    }
    // Largest first: each goes to the connection with the fewest bytes so far, so the
    // connections finish together and the last tensor to finish is small.
    outgoing.sort_by_key(|item| std::cmp::Reverse(item.meta.byte_len()));
    let mut hosts: Vec<SocketAddr> = Vec::new();
    for addr in args.connect.iter().flat_map(|r| r.0.iter()) {
        // Named twice, pushed once.
        if !hosts.contains(addr) {
            hosts.push(*addr);
        }
    }
    let connecting = hosts.iter().map(|&addr| connect(&args, addr, connections));
    // Handshakes side by side.
    let connected = futures_util::future::join_all(connecting).await;
    if let ([Err(e)], false) = (&connected[..], args.json) {
        // One receiver, unreachable: that is the whole run's failure (with --json, its
        // object says so).
        return Err(anyhow::anyhow!("{e:#}"));
    }
    let drawing = match args.quiet {
        true => Drawing::Never,
        false => Drawing::OnTerminal,
    };
    let reached = connected.iter().filter(|c| c.is_ok()).count() as u64;
    let mut progress = PushProgress::new(total * reached, drawing);
    let started = Instant::now();
    let mut pushes = Vec::new();
    let mut cancels = Vec::new();
    for (addr, sender) in hosts.iter().zip(connected) {
        let sender = match sender {
            Ok(sender) => sender,
            Err(e) => {
                pushes.push(Err((*addr, e)));
                continue;
            }
        };
        // Each receiver gets its own view of the same sources (a file is mapped again).
        let items = outgoing
            .iter()
            .map(|item| {
                let source = item
                    .source
                    .slice(0, item.meta.byte_len())
                    .with_context(|| {
                        format!(
                            "{} is read once, so it goes to one receiver",
                            item.meta.name()
                        )
                    })?;
                Ok(Outgoing {
                    meta: item.meta.clone(),
                    source,
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let label = |name: &str| match hosts.len() {
            1 => name.to_owned(),
            _ => format!("{addr} {name}"),
        };
        let mut sends = Vec::new();
        for item in items {
            let name = item.meta.name().to_owned();
            // A tensor larger than a connection's fair share goes over several (spec §15).
            let parts = match args.no_split {
                true => 1,
                false => sender.parts_for(&item.meta, total),
            };
            let send = match parts {
                1 => sender.send(item.meta, item.source),
                parts => sender
                    .send_split(item.meta, item.source, parts)
                    .with_context(|| format!("splitting {name} into {parts} parts"))?,
            };
            cancels.push(send.cancel_token());
            let status = progress.track(label(&name), send.progress());
            sends.push((name, status, send));
        }
        pushes.push(Ok((*addr, sender, sends)));
    }
    let progress = progress.start();
    // Ctrl-C or SIGTERM cancels what is not yet delivered (the receiver gets CANCEL and
    // frees it at once); what was delivered is still reported.
    let interrupted = Arc::new(AtomicBool::new(false));
    let on_signal = {
        let (interrupted, signal) = (interrupted.clone(), shutdown_signal());
        tokio::spawn(async move {
            signal.await;
            interrupted.store(true, Ordering::SeqCst);
            eprintln!("interrupted: cancelling the tensors not yet delivered");
            cancels.iter().for_each(CancellationToken::cancel);
        })
    };
    let mut outcomes = Vec::new();
    for push in pushes {
        let (addr, sender, sends) = match push {
            Ok(push) => push,
            Err((addr, e)) => {
                progress.println(&format!("not connected: {addr}: {e:#}"));
                outcomes.push(HostOutcome::Unreachable(addr, e));
                continue;
            }
        };
        let peer = Peer {
            addr,
            idle_timeout_s: args.transport.idle_timeout_s,
        };
        let tasks: Vec<_> = sends
            .into_iter()
            .map(|(name, status, send)| {
                let len = send.total_bytes();
                tokio::spawn(async move {
                    let result = send.finished().await;
                    status.set(match result {
                        Ok(_) => TensorState::Delivered,
                        Err(_) => TensorState::Failed,
                    });
                    (
                        name,
                        len,
                        started.elapsed(),
                        result.map_err(anyhow::Error::from),
                    )
                })
            })
            .collect();
        let mut host = HostPush::new(addr, sender, tasks.len(), total);
        for task in tasks {
            let (name, len, ended, result) = task.await?;
            if let Err(e) = &result {
                // With bars or without (--quiet, no terminal): name, code, and why.
                let to = match hosts.len() {
                    1 => String::new(),
                    _ => format!(" (to {})", peer.addr),
                };
                progress.println(&format!("failed: {name}{to}: {}", explain(e, &peer)));
            }
            host.add(name, len, ended, &result, &peer);
        }
        host.elapsed = started.elapsed().as_secs_f64();
        outcomes.push(HostOutcome::Pushed(Box::new(host)));
    }
    progress.finished().await;
    on_signal.abort();
    let interrupted = interrupted.load(Ordering::SeqCst);
    let several = hosts.len() > 1;
    let mut complete = 0;
    for outcome in &outcomes {
        match outcome {
            HostOutcome::Pushed(host) if args.json => println!("{}", host.json(interrupted)),
            HostOutcome::Pushed(host) => host.print_summary(several),
            HostOutcome::Unreachable(addr, e) if args.json => {
                println!("{}", unreachable_json(*addr, e, total, outgoing.len()));
            }
            HostOutcome::Unreachable(..) => {}
        }
        if let HostOutcome::Pushed(host) = outcome
            && host.failed.is_empty()
        {
            complete += 1;
        }
    }
    if several && !args.json {
        println!("{complete} of {} receivers got every tensor", hosts.len());
    }
    let mut not_delivered = Vec::new();
    for outcome in outcomes {
        if let HostOutcome::Pushed(host) = outcome {
            not_delivered.extend(host.failed.iter().cloned());
            host.sender.close().await;
        }
    }
    if interrupted {
        eprintln!(
            "interrupted: not delivered: {}",
            match not_delivered.is_empty() {
                true => "none".to_owned(),
                false => not_delivered.join(", "),
            }
        );
        std::process::exit(130);
    }
    if complete < hosts.len() {
        std::process::exit(1);
    }
    Ok(())
}

/// Connects to one receiver, saying so when it fell back to TCP or is older.
async fn connect(args: &Args, addr: SocketAddr, connections: usize) -> anyhow::Result<SenderPool> {
    let mut config = SenderConfig::new(tensorwire::quic::ClientTls::Development);
    config.tls = args.tls.tls();
    config.transport = args.transport.settings(addr);
    config.server_name = args.tls.server_name.clone();
    config.progress_timeout = args.progress_timeout;
    config.binding = args.binding;
    let sender = SenderPool::connect(addr, config, connections)
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    if sender.binding() == Binding::Tcp && args.binding == BindingChoice::Auto {
        eprintln!(
            "UDP to {addr} completed no handshake within {} ms (blocked or lost?): sending over TCP",
            UDP_HEAD_START.as_millis()
        );
    }
    let version = sender.peer_version();
    if !version.has(tensorwire::proto::Feature::SplitTensors) {
        eprintln!(
            "the receiver at {addr} negotiated protocol version {version} (it predates 1.4): \
             every tensor goes whole, none split"
        );
    }
    Ok(sender)
}

/// The receivers one `--connect` value names: one address, or every address of a name.
#[derive(Clone, Debug)]
struct Receivers(Vec<SocketAddr>);

/// `HOST:PORT`, or `dns:NAME:PORT` for every address NAME resolves to.
fn receivers(s: &str) -> Result<Receivers, String> {
    match s.strip_prefix("dns:") {
        None => tensorwire_examples::cli::address(s).map(|addr| Receivers(vec![addr])),
        Some(name) => {
            use std::net::ToSocketAddrs;
            let mut found: Vec<SocketAddr> = name
                .to_socket_addrs()
                .map_err(|e| format!("dns:{name}: {e} (expected dns:NAME:PORT)"))?
                .collect();
            found.sort();
            found.dedup();
            match found.is_empty() {
                true => Err(format!("dns:{name} resolves to no address")),
                false => Ok(Receivers(found)),
            }
        }
    }
}

/// A safetensors dtype name in any case; an unknown one is answered with the known ones.
fn parse_dtype(s: &str) -> Result<DType, String> {
    DType::from_name_any_case(s).ok_or_else(|| {
        let known: Vec<&str> = DType::ALL.iter().map(|dtype| dtype.name()).collect();
        format!("unknown dtype {s:?}; expected one of {}", known.join(", "))
    })
}

/// `host` or `cuda:N`.
fn parse_device(s: &str) -> Result<Device, String> {
    match s {
        "host" | "cpu" => Ok(Device::Host),
        other => other
            .strip_prefix("cuda:")
            .and_then(|n| n.parse().ok())
            .map(Device::Cuda)
            .ok_or_else(|| format!("device {other:?}: expected host or cuda:N")),
    }
}
