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
    Binding, BindingChoice, EndpointThreads, SenderConfig, SenderPool, TransportError,
    UDP_HEAD_START,
};
use tensorwire_examples::cli::{
    ClientTlsArgs, TransportArgs, init_logging, micros, rate, seconds, shutdown_signal, size,
};
use tensorwire_examples::files::{Outgoing, SENDER_ATTR, load, parse_shape};
use tensorwire_examples::progress::{Drawing, PushProgress, TensorState};
use tokio_util::sync::CancellationToken;

/// Send tensors over QUIC.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Receiver address.
    #[arg(long, value_parser = tensorwire_examples::cli::address)]
    connect: SocketAddr,
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
    let mut config = SenderConfig::new(tensorwire::quic::ClientTls::Development);
    config.tls = args.tls.tls();
    config.transport = args.transport.settings(args.connect);
    config.server_name = args.tls.server_name.clone();
    config.progress_timeout = args.progress_timeout;
    config.binding = args.binding;
    let sender = SenderPool::connect(args.connect, config, connections)
        .await
        .with_context(|| format!("connecting to {}", args.connect))?;
    if sender.binding() == Binding::Tcp && args.binding == BindingChoice::Auto {
        eprintln!(
            "UDP to {} completed no handshake within {} ms (blocked or lost?): sending over TCP",
            args.connect,
            UDP_HEAD_START.as_millis()
        );
    }
    let version = sender.peer_version();
    if !version.has(tensorwire::proto::Feature::SplitTensors) {
        eprintln!(
            "the receiver at {} negotiated protocol version {version} (it predates 1.4): every \
             tensor goes whole, none split",
            args.connect
        );
    }
    // Largest first: each goes to the connection with the fewest bytes so far, so the
    // connections finish together and the last tensor to finish is small.
    outgoing.sort_by_key(|item| std::cmp::Reverse(item.meta.byte_len()));
    let drawing = match args.quiet {
        true => Drawing::Never,
        false => Drawing::OnTerminal,
    };
    let mut progress = PushProgress::new(total, drawing);
    let started = Instant::now();
    let mut sends = Vec::new();
    for item in outgoing {
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
        let status = progress.track(name.clone(), send.progress());
        sends.push((name, status, send));
    }
    let progress = progress.start();
    let tensors = sends.len();
    // Ctrl-C or SIGTERM cancels what is not yet delivered (the receiver gets CANCEL and
    // frees it at once); what was delivered is still reported.
    let cancels: Vec<_> = sends
        .iter()
        .map(|(_, _, send)| send.cancel_token())
        .collect();
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
    let (mut failed, mut delivered_bytes, mut results) = (Vec::new(), 0u64, Vec::new());
    let mut waited = tensorwire::quic::SendWaits::default();
    let peer = Peer {
        addr: args.connect,
        idle_timeout_s: args.transport.idle_timeout_s,
    };
    for task in tasks {
        let (name, len, ended, result) = task.await?;
        match &result {
            Ok(report) => {
                waited += report.waited;
                delivered_bytes += len;
            }
            Err(e) => {
                // With bars or without (--quiet, no terminal): name, code, and why.
                progress.println(&format!("failed: {name}: {}", explain(e, &peer)));
            }
        }
        results.push(tensor_json(&name, len, ended, &result, &peer));
        if result.is_err() {
            failed.push(name);
        }
    }
    progress.finished().await;
    on_signal.abort();
    let elapsed = started.elapsed().as_secs_f64();
    if args.json {
        let summary = serde_json::json!({
            "receiver": args.connect.to_string(),
            "transport": match sender.binding() {
                Binding::Udp => "udp",
                Binding::Tcp => "tcp",
            },
            "protocol_version": version.to_string(),
            "connections": sender.connections(),
            "packet_bytes": sender.path_mtu(),
            "seconds": elapsed,
            "tensors": tensors,
            "delivered_tensors": tensors - failed.len(),
            "delivered_bytes": delivered_bytes,
            "total_bytes": total,
            "failed_tensors": failed.len(),
            "interrupted": interrupted.load(Ordering::SeqCst),
            "waited_s": waits_json(&waited),
            "results": results,
        });
        println!("{summary}");
    } else {
        print_summary(&SummaryLine {
            tensors,
            failed: failed.len(),
            delivered_bytes,
            total,
            elapsed,
            sender: &sender,
            waited,
        });
    }
    sender.close().await;
    if interrupted.load(Ordering::SeqCst) {
        eprintln!(
            "interrupted: {} of {tensors} tensors delivered; not delivered: {}",
            tensors - failed.len(),
            failed.join(", ")
        );
        std::process::exit(130);
    }
    if !failed.is_empty() {
        std::process::exit(1);
    }
    Ok(())
}

/// What the human summary says.
struct SummaryLine<'a> {
    tensors: usize,
    failed: usize,
    delivered_bytes: u64,
    total: u64,
    elapsed: f64,
    sender: &'a SenderPool,
    waited: tensorwire::quic::SendWaits,
}

/// The summary for people: what was delivered, how fast, over what, and who waited.
fn print_summary(line: &SummaryLine) {
    let SummaryLine {
        tensors,
        failed,
        delivered_bytes,
        total,
        elapsed,
        sender,
        waited,
    } = line;
    let metrics = sender.metrics();
    println!(
        "sent {} of {tensors} tensors ({} streams), {} of {} in {elapsed:.2} s over {} \
         connections ({}): {}; packets of {} bytes; latency p50 {}, p99 {}; {} failed",
        tensors - failed,
        metrics.tensors_completed,
        size(*delivered_bytes),
        size(*total),
        sender.connections(),
        sender.binding(),
        rate(*delivered_bytes, *elapsed),
        sender.path_mtu(),
        micros(metrics.latency_p50_us),
        micros(metrics.latency_p99_us),
        failed,
    );
    // Which side held the tensors up: the receiver (credit, its decisions), the files, or
    // the network (QUIC's send buffer full).
    println!("waited, summed over the tensors sent: {waited}");
}

/// One tensor's result for `--json`: delivered with its waits, or failed with the code,
/// who is to blame, and why.
fn tensor_json(
    name: &str,
    bytes: u64,
    ended: Duration,
    result: &anyhow::Result<tensorwire::quic::SendReport>,
    peer: &Peer,
) -> serde_json::Value {
    let mut tensor = serde_json::json!({
        "name": name,
        "bytes": bytes,
        "seconds": ended.as_secs_f64(),
    });
    let fields = match result {
        Ok(report) => serde_json::json!({
            "outcome": "delivered",
            "waited_s": waits_json(&report.waited),
        }),
        Err(e) => {
            let transport = e.downcast_ref::<TransportError>();
            let code = transport.and_then(TransportError::code);
            serde_json::json!({
                "outcome": "failed",
                "code": code.map(|c| c.name().map_or_else(|| c.to_string(), str::to_owned)),
                "code_value": code.map(|c| c.0),
                "blame": transport.and_then(TransportError::blame).map(|b| format!("{b:?}")),
                "cause": explain(e, peer),
            })
        }
    };
    if let (Some(tensor), serde_json::Value::Object(fields)) = (tensor.as_object_mut(), fields) {
        tensor.extend(fields);
    }
    tensor
}

/// Seconds waited, by whom.
fn waits_json(waited: &tensorwire::quic::SendWaits) -> serde_json::Value {
    serde_json::json!({
        "receiver": waited.receiver.as_secs_f64(),
        "source": waited.source.as_secs_f64(),
        "transport": waited.transport.as_secs_f64(),
        "turn": waited.turn.as_secs_f64(),
    })
}

/// The receiver, as failures name it.
struct Peer {
    addr: SocketAddr,
    idle_timeout_s: u64,
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

/// A failure for people: the wire code (named, or hex) and who is to blame, then the message;
/// a connection that timed out names the receiver and how long it was silent.
fn explain(e: &anyhow::Error, peer: &Peer) -> String {
    let Some(t) = e.downcast_ref::<TransportError>() else {
        return format!("{e:#}");
    };
    if let TransportError::Connection(quinn::ConnectionError::TimedOut) = t {
        return format!(
            "no answer from {} for {} s: the receiver stopped, or the path is down \
             (--idle-timeout-s sets how long to wait)",
            peer.addr, peer.idle_timeout_s
        );
    }
    let message = t.to_string();
    let coded = match t.code() {
        Some(code) if !message.contains(&code.to_string()) => format!("{code}: {message}"),
        _ => message,
    };
    match t.blame() {
        Some(blame) => format!("{coded} [blame: {blame:?}]"),
        None => coded,
    }
}
