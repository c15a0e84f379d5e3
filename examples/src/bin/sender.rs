//! Sends tensors from files over QUIC: `.safetensors`, `.npy`, `.wav`, or raw bytes.
//!
//! `sender --connect 127.0.0.1:7000 model.safetensors audio.wav`

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Parser;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use tensorwire::proto::DType;
use tensorwire::quic::{Sender, SenderConfig};
use tensorwire_examples::cli::{ClientTlsArgs, TransportArgs, init_logging, rate, size};
use tensorwire_examples::files::{load, parse_shape};

/// Send tensors over QUIC.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Receiver address.
    #[arg(long)]
    connect: SocketAddr,
    /// Files to send.
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// Send other files as raw bytes of this dtype (safetensors names: F32, BF16, U8, ...).
    #[arg(long, requires = "shape")]
    dtype: Option<String>,
    /// Shape for --dtype, e.g. 1024,4096.
    #[arg(long, requires = "dtype")]
    shape: Option<String>,
    /// No progress bars.
    #[arg(long)]
    quiet: bool,
    #[command(flatten)]
    tls: ClientTlsArgs,
    #[command(flatten)]
    transport: TransportArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    init_logging("warn");
    let args = Args::parse();
    let raw = match (&args.dtype, &args.shape) {
        (Some(dtype), Some(shape)) => {
            let dtype =
                DType::from_name(dtype).ok_or_else(|| anyhow::anyhow!("unknown dtype {dtype}"))?;
            Some((dtype, parse_shape(shape)?))
        }
        _ => None,
    };
    let mut outgoing = Vec::new();
    for file in &args.files {
        outgoing.extend(load(file, raw.clone())?);
    }
    let config = SenderConfig {
        tls: args.tls.tls(),
        transport: args.transport.settings(),
        server_name: args.tls.server_name.clone(),
        ..SenderConfig::default()
    };
    let sender = Sender::connect(args.connect, config).await?;
    let bars = MultiProgress::new();
    if args.quiet {
        bars.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let style = ProgressStyle::with_template(
        "{msg:30!} {bar:30} {bytes:>10}/{total_bytes:10} {bytes_per_sec:>12}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    let started = Instant::now();
    let total: u64 = outgoing.iter().map(|o| o.meta.byte_len()).sum();
    let mut sends = Vec::new();
    for item in outgoing {
        let bar = bars.add(ProgressBar::new(item.meta.byte_len()).with_style(style.clone()));
        bar.set_message(item.meta.name().to_owned());
        let name = item.meta.name().to_owned();
        sends.push((name, bar, sender.send(item.meta, item.source)));
    }
    let tasks: Vec<_> = sends
        .into_iter()
        .map(|(name, bar, send)| {
            tokio::spawn(async move { (name, send_with_progress(send, &bar).await, bar) })
        })
        .collect();
    let mut failed = 0;
    for task in tasks {
        let (name, result, bar) = task.await?;
        match result {
            Ok(()) => bar.finish(),
            Err(e) => {
                failed += 1;
                bar.abandon_with_message(format!("{name}: {e}"));
            }
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let metrics = sender.metrics();
    println!(
        "sent {} tensors, {} in {elapsed:.2} s: {}; latency p50 {} µs, p99 {} µs; {failed} failed",
        metrics.tensors_completed,
        size(total),
        rate(total, elapsed),
        metrics.latency_p50_us,
        metrics.latency_p99_us,
    );
    sender.close().await;
    if failed > 0 {
        std::process::exit(1);
    }
    Ok(())
}

async fn send_with_progress(
    send: tensorwire::quic::SendHandle,
    bar: &ProgressBar,
) -> anyhow::Result<()> {
    let progress = send.progress();
    let finished = send.finished();
    tokio::pin!(finished);
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            result = &mut finished => {
                result?;
                bar.set_position(progress.total_bytes());
                return Ok(());
            }
            _ = tick.tick() => bar.set_position(progress.sent_bytes()),
        }
    }
}
