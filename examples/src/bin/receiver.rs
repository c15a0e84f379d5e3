//! Receives tensors over QUIC into host memory, optionally saving them as `.safetensors`.
//!
//! `receiver --listen 127.0.0.1:7000 --save DIR`
//!
//! With `--allow-exec` it also runs CUDA kernels peers send (`tensorwire-exec`, spec §14).

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use tensorwire::exec::{ExecAccess, ExecConfig, ExecServer, ExecToken, WorkerCommand, refuse_exec};
use tensorwire::gpu::{ChecksumOn, DeviceRequest, GpuRequirement, Placement};
use tensorwire::ipc::{OnExisting, ShareConfig, ShareService};
use tensorwire::metrics::{MetricsServer, ReceiverMetrics};
use tensorwire::proto::TensorMeta;
use tensorwire::proto::split::{SplitId, SplitPart};
use tensorwire::quic::Listening;
use tensorwire::quic::{IncomingTensor, Receiver, ReceiverConfig, Steering, StoreOffload};
use tensorwire::sink::{Landing, SinkError, SplitTensors};
use tensorwire_examples::cli::{
    ServerTlsArgs, TransportArgs, init_logging, mebibytes, rate, seconds, shutdown_signal, size,
};
use tensorwire_examples::metric_families::families;
use tensorwire_examples::progress::{Drawing, ReceiverProgress};
use tensorwire_examples::report::code_name;
use tensorwire_examples::save::{OnCollision, SaveDir, SaveJob, SpoolingSink};
use tensorwire_examples::sharing::{Landed, SharingSink};
use tokio::sync::mpsc;

/// Receive tensors over QUIC.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:7000", value_parser = tensorwire_examples::cli::address)]
    listen: SocketAddr,
    /// Save every received tensor as .safetensors in this directory (tensors sent from one
    /// .safetensors file are written back as that file).
    #[arg(long)]
    save: Option<PathBuf>,
    /// With --save, what a file whose name is already in the directory does: keep-both (the
    /// new one is saved as NAME.N.safetensors), overwrite, or refuse (the new one is not
    /// written; its bytes stay in DIR/.incoming, named in the error).
    #[arg(long, default_value = "keep-both", requires = "save")]
    on_collision: OnCollision,
    /// Receiver-wide byte budget in MiB: bytes granted but not yet stored never exceed it.
    #[arg(long = "budget-mib", default_value = "256", value_parser = mebibytes)]
    budget: u64,
    /// Stop granting credit at this percentage of the budget (1-100, above --low-percent).
    #[arg(long, default_value_t = 87, value_parser = clap::value_parser!(u64).range(1..=100))]
    high_percent: u64,
    /// Resume granting at this percentage of the budget (0-99, below --high-percent).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u64).range(0..=99))]
    low_percent: u64,
    /// Credit one tensor may hold unused, in MiB: with few tensors per connection and a long
    /// round trip, a larger window keeps the link full; on a LAN, beyond about 8 MiB at MTU
    /// 6000 the received bytes wait long enough to be copied once more.
    #[arg(long = "stream-window-mib", default_value = "8", value_parser = mebibytes)]
    stream_window: u64,
    /// Most a tensor's window grows to, in MiB: it doubles while the tensor's bytes arrive
    /// faster than it lets them over two round trips (a long path). QUIC's stream window
    /// (16 MiB) caps what one stream has in flight whatever credit allows. At or below
    /// --stream-window-mib, windows stay fixed.
    #[arg(long = "max-stream-window-mib", default_value = "16", value_parser = mebibytes)]
    max_stream_window: u64,
    /// Most of the credit budget and of host memory one connection may hold, in percent
    /// (1-100), so one peer cannot starve the others.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u64).range(1..=100))]
    connection_share_percent: u64,
    /// Bytes per CREDIT frame, in MiB.
    #[arg(long = "grant-mib", default_value = "4", value_parser = mebibytes)]
    grant_unit: u64,
    /// Early credit offered to each connection, in KiB: tensors up to this size arrive in one
    /// round trip (spec §7.6). 0 offers none.
    #[arg(long = "early-credit-kib", default_value_t = 1024)]
    early_credit_kib: u64,
    /// Largest tensor accepted, in MiB.
    #[arg(long = "max-tensor-mib", default_value = "65536", value_parser = mebibytes)]
    max_tensor: u64,
    /// Host memory that landed host tensors may hold at once, in MiB (default: a quarter of
    /// physical memory). A tensor that does not fit waits, then is rejected.
    #[arg(long = "host-memory-mib", value_parser = mebibytes)]
    host_memory: Option<u64>,
    /// Host buffers of dropped tensors kept for the next tensor of the same length, in MiB
    /// (at most an eighth of the host memory budget, and counted in it; 0 keeps none).
    #[arg(long = "kept-host-mib", default_value_t = 1024)]
    kept_host_mib: u64,
    /// Seconds a sender that owes a frame (it holds credit, or has sent no METADATA yet) may go
    /// without one before its tensor is cancelled (PROGRESS_TIMEOUT).
    #[arg(long = "progress-timeout-s", default_value = "30", value_parser = seconds)]
    progress_timeout: Duration,
    /// Seconds a tensor may wait for memory and admission before it is rejected.
    #[arg(long = "admission-timeout-s", default_value = "30", value_parser = seconds)]
    admission_timeout: Duration,
    /// METADATA that the tensor streams open now may hold, in MiB; more is refused at once
    /// (RESOURCE_EXHAUSTED).
    #[arg(long = "metadata-budget-mib", default_value = "64", value_parser = mebibytes)]
    metadata_budget: u64,
    /// Connections served at once from all peers; more are refused before their handshake.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..))]
    max_connections: u64,
    /// Connections served at once from one peer (IP address).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    max_connections_per_peer: u64,
    /// Seconds a connection may stay open with no tensor stream before it is closed.
    #[arg(long = "connection-idle-timeout-s", default_value = "60", value_parser = seconds)]
    connection_idle_timeout: Duration,
    /// Where tensors land: auto (GPU 0 if present, else host memory with a warning), host,
    /// cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    device: DeviceRequest,
    /// Fail instead of falling back to host memory when there is no usable GPU.
    #[arg(long)]
    require_gpu: bool,
    /// Share every received tensor with local processes on this Unix socket (its directory
    /// is created with mode 0700): GPU tensors with no copy (VMM memory exported as an fd),
    /// host tensors as shared memory. Consumers: `tensorwire-share`, python/consume.py.
    #[arg(long)]
    share: Option<PathBuf>,
    /// With --share, what a tensor whose name is already shared does: replace (it takes the
    /// name as the next generation; consumers holding the old one keep it until they
    /// release it), in-place (its bytes are copied into the shared memory, same address;
    /// dtype and shape must match), or reject (the sender gets REJECT).
    #[arg(long, default_value = "replace", requires = "share")]
    on_existing: OnExisting,
    /// Which transports to listen on: both (QUIC over UDP, and over TCP for senders that UDP
    /// does not reach, on the same port number), quic (UDP only) or tcp (TCP only; UDP is
    /// bound but not answered).
    #[arg(long = "transport", default_value = "both")]
    listening: Listening,
    /// UDP sockets bound on the listening address with SO_REUSEPORT, so connections spread
    /// over cores (0: one per core, at most 8). All share the budgets.
    #[arg(long, default_value_t = 0)]
    endpoints: usize,
    /// Which endpoint serves a connection: connection-id (the least loaded one, by a Retry
    /// when needed; clients may change address) or address (the kernel's hash: uneven, no
    /// migration, no extra round trip).
    #[arg(long, default_value = "connection-id")]
    steering: Steering,
    /// Where a tensor's DATA payloads are copied and checksummed into their destination,
    /// from its first payload of 1 MiB or more: auto (on other cores while the connections
    /// carrying such payloads leave two cores each to spare, else on their connection's own
    /// thread), never (always on the connection's thread), or N (at most N tensors at once
    /// on other cores, whatever the load).
    #[arg(long, default_value = "auto")]
    store_offload: StoreOffload,
    /// Where a GPU receiver computes each tensor's CRC-32C: device (over the landed tensor,
    /// for tensors of 4 MiB or more, so no CPU core reads their bytes a second time) or host
    /// (each payload as it is copied into staging).
    #[arg(long, default_value = "device")]
    checksum_on: ChecksumOn,
    /// Run CUDA kernels that peers send with their inputs (spec §14; `tensorwire-exec`), in
    /// worker processes of their own. Needs mutual TLS (--client-ca), an access token
    /// (--exec-token-file), or a loopback --listen address, so that only authenticated or
    /// local peers can run code here.
    #[arg(long)]
    allow_exec: bool,
    /// With --allow-exec: run kernels only for peers presenting the access token in this
    /// file (spec §14.6; readable by its owner only; `openssl rand -hex 32 > FILE`), from
    /// any address, with or without certificates.
    #[arg(long, requires = "allow_exec")]
    exec_token_file: Option<PathBuf>,
    /// With --allow-exec: worker processes, each running one kernel at a time.
    #[arg(long, default_value_t = 2, requires = "allow_exec")]
    exec_workers: usize,
    /// With --allow-exec: the longest a kernel may run, in ms (also the default limit).
    #[arg(long, default_value_t = 10_000, requires = "allow_exec")]
    exec_time_limit_ms: u32,
    /// With --allow-exec: the worker program (default: tensorwire-exec-worker beside this
    /// program).
    #[arg(long, requires = "allow_exec")]
    exec_worker: Option<PathBuf>,
    /// Serve Prometheus metrics at http://ADDR/metrics (e.g. 127.0.0.1:9400; docs/operators.md
    /// lists them). Plain HTTP with no authentication: bind it where only scrapers reach.
    #[arg(long, value_parser = tensorwire_examples::cli::address)]
    metrics_listen: Option<SocketAddr>,
    /// Print events as JSON lines on stdout (listening, received, received_part, shared,
    /// failed, saved, not_saved, summary; fields in docs/operators.md); the lines for people
    /// go to stderr instead.
    #[arg(long)]
    json: bool,
    /// Exit after this many tensors (0: run until interrupted).
    #[arg(long, default_value_t = 0)]
    count: u64,
    #[command(flatten)]
    tls: ServerTlsArgs,
    #[command(flatten)]
    transport: TransportArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    init_logging("warn");
    let args = Args::parse();
    if args.low_percent >= args.high_percent {
        anyhow::bail!(
            "--low-percent {} must be below --high-percent {}",
            args.low_percent,
            args.high_percent
        );
    }
    let budget = args.budget;
    let mut config = ReceiverConfig::new(args.listen, tensorwire::quic::ServerTls::Development);
    config.tls = args.tls.tls();
    config.transport = args.transport.settings(args.listen);
    config.listening = args.listening;
    config.budget = budget;
    config.high_watermark = budget / 100 * args.high_percent;
    config.low_watermark = budget / 100 * args.low_percent;
    config.session.limits.max_tensor_len = args.max_tensor;
    config.session.stream_window = args.stream_window;
    config.session.max_stream_window = args.max_stream_window;
    config.session.grant_unit = args.grant_unit;
    config.session.early_credit = args.early_credit_kib.saturating_mul(1024);
    let host_memory_from = match args.host_memory {
        Some(host_memory) => {
            config.host_memory_budget = host_memory;
            "--host-memory-mib".to_owned()
        }
        None => {
            let limit = tensorwire::quic::MemoryLimit::of_this_process();
            format!("a quarter of {}, from {}", size(limit.bytes), limit.source)
        }
    };
    config.kept_host_memory = args.kept_host_mib.saturating_mul(1 << 20);
    let share = args.connection_share_percent;
    config.session.connection_window = budget / 100 * share;
    config.memory_share_percent = share;
    config.session.progress_timeout = args.progress_timeout;
    config.session.admission_timeout = args.admission_timeout;
    config.session.idle_timeout = args.connection_idle_timeout;
    config.metadata_budget = args.metadata_budget;
    config.max_connections = usize::try_from(args.max_connections).unwrap_or(usize::MAX);
    config.max_connections_per_peer =
        usize::try_from(args.max_connections_per_peer).unwrap_or(usize::MAX);
    if args.endpoints > 0 {
        config.endpoints = args.endpoints;
    }
    config.steering = args.steering;
    config.store_offload = args.store_offload;
    // Refused before anything binds: running code for unauthenticated remote peers.
    let exec_access = match (&args.exec_token_file, args.allow_exec) {
        (Some(path), _) => Some(ExecAccess::TokenHolders(ExecToken::from_file(path)?)),
        (None, true) => Some(ExecAccess::for_listener(args.listen, &config.tls)?),
        (None, false) => None,
    };
    // Shared tensors and kernel inputs land in VMM memory, which other processes can map
    // with no copy.
    let gpu = GpuRequirement::required_if(args.require_gpu);
    let placement = if args.share.is_some() || args.allow_exec {
        Placement::choose_shareable(args.device, gpu)?
    } else {
        Placement::choose(args.device, gpu)?
    };
    let placement = match placement {
        Placement::Gpu(gpu) => Placement::Gpu(gpu.with_checksum_on(args.checksum_on)),
        host => host,
    };
    // Kernels use the receiver's own pools and device-memory budget.
    let exec = match exec_access {
        Some(access) => {
            let worker = match &args.exec_worker {
                Some(path) => WorkerCommand::new(path),
                None => WorkerCommand::beside_current_exe()?,
            };
            let mut exec_config = ExecConfig::new(access, worker);
            exec_config.workers = args.exec_workers;
            exec_config.limits.max_time_limit_ms = args.exec_time_limit_ms;
            exec_config.limits.default_time_limit_ms = args.exec_time_limit_ms;
            exec_config.admission_wait = args.admission_timeout;
            Some(ExecServer::with_placement(exec_config, &placement)?)
        }
        None => None,
    };
    // Every path is checked, and what a receiver before this one left is recovered, before
    // anything binds: a receiver that says it listens can save and share.
    let (mut save, recovered) = match &args.save {
        Some(dir) => {
            let (save, recovery) = SaveDir::open(dir, args.on_collision)
                .with_context(|| format!("--save {}", dir.display()))?;
            (Some(save), Some(recovery))
        }
        None => (None, None),
    };
    let share = match &args.share {
        Some(path) => {
            let mut config = ShareConfig::default();
            config.on_existing = args.on_existing;
            let service = ShareService::start(path, config)
                .with_context(|| format!("--share {}", path.display()))?;
            Some(std::sync::Arc::new(service))
        }
        None => None,
    };

    // Watched from before "listening on", so that a stop asked for at once still saves.
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    let json = args.json;
    // Lines for people: on stdout, or on stderr when stdout carries JSON events.
    macro_rules! say {
        ($($arg:tt)*) => {
            if json { eprintln!($($arg)*) } else { println!($($arg)*) }
        };
    }
    let mut receiver = Receiver::bind(config).await?;
    say!("listening on {}", receiver.local_addr()?);
    let (listening_at, host_limit) = (receiver.local_addr()?, receiver.host_memory().limit);
    say!(
        "{} endpoints (UDP sockets) share the address; {}",
        receiver.endpoint_count(),
        match args.listening {
            Listening::Udp => "UDP only",
            Listening::Tcp => "TCP only (UDP is not answered)",
            _ => "TCP on the same port too",
        }
    );
    say!("tensors land in {}", placement.describe());
    say!(
        "host memory for landed tensors: {} ({host_memory_from})",
        size(receiver.host_memory().limit)
    );
    let metrics = match args.metrics_listen {
        Some(addr) => {
            let metrics = exec.iter().flat_map(families).fold(
                ReceiverMetrics::for_placement(receiver.observer(), &placement),
                ReceiverMetrics::with_family,
            );
            let server = MetricsServer::bind(addr, metrics)
                .await
                .with_context(|| format!("--metrics-listen {addr}"))?;
            say!("metrics at http://{}/metrics", server.local_addr());
            Some(server)
        }
        None => None,
    };
    if let Some(path) = &args.share {
        say!(
            "sharing tensors on {} (a name shared again: {:?})",
            path.display(),
            args.on_existing
        );
    }
    if let Some(exec) = &exec {
        match exec.unavailable() {
            None => say!(
                "remote execution: on, {} worker(s), kernels limited to {} ms",
                args.exec_workers,
                args.exec_time_limit_ms
            ),
            Some(why) => say!("remote execution: on, but runs are refused: no GPU ({why})"),
        }
    }
    if json {
        event(serde_json::json!({
            "event": "listening",
            "address": listening_at.to_string(),
            "transports": match args.listening {
                Listening::Udp => "udp",
                Listening::Tcp => "tcp",
                _ => "udp+tcp",
            },
            "lands_in": placement.describe(),
            "host_memory_bytes": host_limit,
            "metrics": metrics.as_ref().map(|m| format!("http://{}/metrics", m.local_addr())),
            "share": args.share.as_ref().map(|p| p.display().to_string()),
        }));
    }
    let (done_tx, mut done_rx) =
        mpsc::unbounded_channel::<(Result<Arrival, Failure>, Duration, String)>();
    let mut saves: tokio::task::JoinSet<Saved> = tokio::task::JoinSet::new();
    if let Some(recovery) = recovered {
        if recovery.unconfirmed_removed > 0 {
            say!(
                "removed {} spooled tensor(s) a previous receiver never confirmed (their senders \
                 were told they failed)",
                recovery.unconfirmed_removed
            );
        }
        for job in recovery.jobs {
            say!(
                "recovering {} confirmed tensor(s) a previous receiver left as {}",
                job.tensor_count(),
                job.file()
            );
            spawn_save(&mut saves, job);
        }
    }
    // Parts of split tensors (spec §15) must all arrive within twice the admission timeout
    // (the whole's admission may itself wait that long).
    let splits = SplitTensors::new(2 * args.admission_timeout);
    let mut failed_wholes = HashSet::new();
    // Parts still to come of split tensors whose first part arrived.
    let mut arriving = HashMap::new();
    // One line on a terminal of what landed, how fast; people's lines go above it.
    let drawing = match json {
        true => Drawing::Never,
        false => Drawing::OnTerminal,
    };
    let progress = ReceiverProgress::start(receiver.observer(), drawing);
    macro_rules! tell {
        ($($arg:tt)*) => {
            progress.println(&format!($($arg)*))
        };
    }
    macro_rules! etell {
        ($($arg:tt)*) => {
            progress.eprintln(&format!($($arg)*))
        };
    }
    let started = Instant::now();
    let (mut accepted, mut finished, mut failed, mut bytes) = (0u64, 0u64, 0u64, 0u64);
    loop {
        // Finished tensors are reported before a stop is heeded, and a stop before more
        // tensors are taken: what landed before Ctrl-C is always told.
        tokio::select! {
            biased;
            Some((result, elapsed, origin)) = done_rx.recv() => {
                match result {
                    Ok(Arrival::Part(meta)) => {
                        let rows = meta.shape().first().copied().unwrap_or(0);
                        match json {
                            true => event(serde_json::json!({
                                "event": "received_part", "name": meta.name(), "rows": rows,
                                "bytes": meta.byte_len(), "seconds": elapsed.as_secs_f64(),
                                "from": origin,
                            })),
                            false => tell!(
                                "received {} rows of {} ({}) in {:.3} s",
                                rows, meta.name(), size(meta.byte_len()), elapsed.as_secs_f64()
                            ),
                        }
                        continue;
                    }
                    Ok(Arrival::Whole(meta, landed)) => {
                        finished += 1;
                        bytes += meta.byte_len();
                        match json {
                            true => event(serde_json::json!({
                                "event": "received", "name": meta.name(),
                                "dtype": meta.dtype().name(), "shape": meta.shape(),
                                "bytes": meta.byte_len(), "seconds": elapsed.as_secs_f64(),
                                "from": origin, "location": landed.location,
                            })),
                            false => tell!(
                                "received {} {} {:?} {} in {:.3} s ({}) -> {}",
                                meta.name(), meta.dtype(), meta.shape(), size(meta.byte_len()),
                                elapsed.as_secs_f64(), rate(meta.byte_len(), elapsed.as_secs_f64()),
                                landed.location
                            ),
                        }
                        // Published before COMPLETE (the sender's receipt names the id).
                        if let Some(published) = &landed.published {
                            match published {
                                Ok(shared) if json => event(serde_json::json!({
                                    "event": "shared", "name": meta.name(),
                                    "id": shared.id().to_string(),
                                    "export": shared.export().name(),
                                    "generation": shared.generation(),
                                })),
                                Ok(shared) => tell!(
                                    "shared {} as {} ({}), generation {}",
                                    meta.name(), shared.id(), shared.export().name(),
                                    shared.generation()
                                ),
                                Err(e) => etell!("not shared: {}: {e}", meta.name()),
                            }
                        }
                        // Assembled from the spool off the async path; a failed write is
                        // reported, never fatal, and the spooled bytes stay until it is done.
                        if let (Some(save), Some(spooled)) = (save.as_mut(), landed.spooled)
                            && let Some(job) = save.add(&origin, meta, spooled)
                        {
                            spawn_save(&mut saves, job);
                        }
                    }
                    Err(failure) => {
                        // A split tensor fails once, however many of its parts fail.
                        if failure.split.is_none_or(|id| failed_wholes.insert(id)) {
                            failed += 1;
                        }
                        etell!("tensor failed: {}", failure.message);
                        if json {
                            let code = failure.code;
                            event(serde_json::json!({
                                "event": "failed", "name": failure.name, "from": origin,
                                "code": code.map(code_name),
                                "code_value": code.map(|c| c.0),
                                "cause": failure.message,
                            }));
                        }
                    }
                }
                if args.count > 0 && finished + failed >= args.count {
                    break;
                }
            }
            () = &mut shutdown => {
                etell!("stopping: a signal asked the receiver to stop");
                break;
            }
            Some(saved) = saves.join_next(), if !saves.is_empty() => report_save(saved, json, &progress),
            incoming = receiver.next(),
                if args.count == 0 || accepted < args.count || !arriving.is_empty() =>
            {
                let Some(incoming) = incoming else { break };
                // Remote execution's tensors (spec §14) go to its server, or are refused.
                let incoming = match &exec {
                    Some(exec) => exec.offer(incoming),
                    None => refuse_exec(incoming),
                };
                let Some(incoming) = incoming else { continue };
                let part = match SplitPart::of(incoming.meta(), args.max_tensor) {
                    Ok(part) => part,
                    Err(e) => {
                        etell!("tensor refused: {} from {}: {e}", incoming.meta().name(), incoming.peer());
                        incoming.reject(e.code(), e.to_string());
                        continue;
                    }
                };
                // A split tensor counts once, as a whole, and its other parts are still taken
                // when the count is reached.
                match &part {
                    None => accepted += 1,
                    Some(part) => {
                        let left = arriving.entry(part.id()).or_insert_with(|| {
                            accepted += 1;
                            part.parts()
                        });
                        *left = left.saturating_sub(1);
                        if *left == 0 {
                            arriving.remove(&part.id());
                        }
                    }
                }
                let (placement, done_tx) = (placement.clone(), done_tx.clone());
                let spool = save.as_ref().map(SaveDir::spool);
                let (wait, max_tensor) = (args.admission_timeout, args.max_tensor);
                let (share, splits) = (share.clone(), splits.clone());
                // Admission may wait for memory: off the loop, so other tensors go on.
                tokio::spawn(async move {
                    let started = Instant::now();
                    let meta = incoming.meta().clone();
                    let peer = incoming.peer();
                    let origin = peer.to_string();
                    let record_origin = origin.clone();
                    // An update the sharing policy refuses is refused before any byte is
                    // sent; with --save, the bytes are on disk before the sender is told
                    // COMPLETE.
                    let (shares, host) =
                        (incoming.memory_shares().clone(), incoming.host_memory().clone());
                    let admit = |meta: TensorMeta| async move {
                        if let Some(share) = &share {
                            share.check_update(&meta).map_err(|refused| SinkError {
                                code: refused.code,
                                message: refused.message,
                            })?;
                        }
                        let sink = placement
                            .admit(&meta, &shares, &host, wait)
                            .await?;
                        let sink = SpoolingSink::new(sink, spool.as_ref(), &meta, &record_origin)?;
                        Ok(SharingSink::new(sink, share, &meta))
                    };
                    // A tensor sent whole gets a sink of its own; a part, its share of the
                    // whole's, which the whole's first part admits (spec §15).
                    let carrier = incoming.carrier().clone();
                    let result = match splits.admit(peer.ip(), &carrier, &meta, max_tensor, admit).await {
                        Ok(sink) => incoming
                            .accept(sink)
                            .finished()
                            .await
                            .map(|(meta, landing)| match landing {
                                Landing::Whole(whole) => Arrival::Whole(whole.meta, whole.output),
                                Landing::Part => Arrival::Part(meta),
                            })
                            .map_err(|e| (e.code(), e.to_string())),
                        Err(e) => Err((Some(e.code), refuse(incoming, e))),
                    };
                    let result = result.map_err(|(code, e)| {
                        let what = match &part {
                            Some(part) => format!(
                                "{} (rows from {} of a split tensor, {})",
                                meta.name(), part.first_row(), size(part.whole().byte_len())
                            ),
                            None => format!("{} ({})", meta.name(), size(meta.byte_len())),
                        };
                        Failure {
                            split: part.as_ref().map(SplitPart::id),
                            name: meta.name().to_owned(),
                            code,
                            message: format!("{what} from {origin}: {e}"),
                        }
                    });
                    let _ = done_tx.send((result, started.elapsed(), origin));
                });
            }
        }
    }
    progress.stop();
    let elapsed = started.elapsed().as_secs_f64();
    let credit = receiver.budget();
    let host = receiver.host_memory();
    // A tensor the device pool could not serve was allocated, and freed, on its own: its
    // free may have stalled the copies of the others.
    let outside_pool = match &placement {
        Placement::Gpu(gpu) => {
            let datagrams = tensorwire::gpu::pinned_datagram_stats();
            format!(
                ", {} tensors in device memory outside the pool; {} datagrams received into \
                 pinned memory (at most {} of its {} at once), {} past it",
                gpu.allocations_outside_pool(),
                datagrams.served,
                size(datagrams.reached as u64),
                size(datagrams.capacity as u64),
                datagrams.overflowed
            )
        }
        Placement::Host { .. } => String::new(),
    };
    // Streams the receiver refused or lost before they reached this program (a limit, a
    // budget, a protocol error) count as failures too.
    let streams_failed = receiver.metrics().tensors_failed;
    if json {
        event(serde_json::json!({
            "event": "summary", "tensors": finished, "bytes": bytes, "seconds": elapsed,
            "failed": failed, "streams_failed": streams_failed,
            "credit_peak_bytes": credit.peak_outstanding, "credit_budget_bytes": credit.budget,
            "host_peak_bytes": host.peak, "host_limit_bytes": host.limit,
        }));
    }
    say!(
        "{finished} tensors, {} in {elapsed:.2} s ({}), {failed} failed ({streams_failed} tensor \
         streams refused or failed in all, each logged with its code); peak credit held {} of \
         the {} budget (one tensor's window up to {}), peak host memory {} of {}{outside_pool}",
        size(bytes),
        rate(bytes, elapsed),
        size(credit.peak_outstanding),
        size(credit.budget),
        size(receiver.metrics().largest_stream_window),
        size(host.peak),
        size(host.limit)
    );
    if let Some(save) = &mut save {
        for (file, got, expected) in save.incomplete() {
            etell!(
                "incomplete: {file} has {got} of {expected} tensors; saving those as a partial file"
            );
        }
        for job in save.drain_partial() {
            spawn_save(&mut saves, job);
        }
    }
    while let Some(saved) = saves.join_next().await {
        report_save(saved, json, &progress);
    }
    receiver.close().await;
    if let Some(metrics) = metrics {
        metrics.close().await;
    }
    Ok(())
}

type Saved = Result<std::path::PathBuf, (String, anyhow::Error)>;

/// Writes `job`'s file off the async path.
fn spawn_save(saves: &mut tokio::task::JoinSet<Saved>, job: SaveJob) {
    let file = job.file().to_owned();
    saves.spawn_blocking(move || job.write().map_err(|e| (file, e)));
}

/// What a tensor's stream brought: a whole tensor, or a part of a split one that did not
/// complete its whole.
enum Arrival {
    Whole(TensorMeta, Landed),
    Part(TensorMeta),
}

/// Refuses `incoming` with the sink's code and reason, and says why.
fn refuse(incoming: IncomingTensor, e: SinkError) -> String {
    let why = format!("{}: {}", e.code, e.message);
    incoming.reject(e.code, e.message);
    format!("refused: {why}")
}

/// Says whether a file was saved: to people, and as an event with `--json`.
fn report_save(
    saved: Result<Saved, tokio::task::JoinError>,
    json: bool,
    progress: &ReceiverProgress,
) {
    let (file, failure) = match saved {
        Ok(Ok(path)) => (path.display().to_string(), None),
        Ok(Err((file, e))) => (file, Some(format!("{e:#}"))),
        Err(e) => (String::new(), Some(format!("the writer failed: {e}"))),
    };
    match &failure {
        None if json => event(serde_json::json!({"event": "saved", "file": file})),
        None => progress.println(&format!("saved {file}")),
        Some(why) => {
            eprintln!("not saved: {file}: {why}");
            if json {
                event(serde_json::json!({"event": "not_saved", "file": file, "cause": why}));
            }
        }
    }
}

/// One JSON event line on stdout (`--json`).
fn event(value: serde_json::Value) {
    println!("{value}");
}

/// A tensor that did not land: which, with what code, and the line for people.
struct Failure {
    /// The split tensor it was a part of.
    split: Option<SplitId>,
    name: String,
    code: Option<tensorwire::proto::ErrorCode>,
    message: String,
}
