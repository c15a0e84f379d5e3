//! One harness, one run, side by side on loopback, with the same QUIC configuration:
//! (a) raw quinn bulk transfer on streams, (b) tensorwire sending the same bytes as tensors,
//! (c) TCP + TLS 1.3 (tokio-rustls, same provider and AES-128-GCM), for 1 and N connections;
//! plus small-tensor latency p50/p99 and, with `--gpu`, the GPU path.
//!
//! `cargo run --release -p tensorwire-bench -- --quick` finishes in under a minute. Each
//! scenario has a module of its own; `main` only reads the flags and passes them on.

use bytes::Bytes;
use clap::Parser;

use crate::args::Args;
use crate::report::Report;
use crate::setup::Setup;
use crate::source::{Loaded, RawSource};

mod alloc;
mod args;
mod gpu;
mod latency;
mod raw_quinn;
mod relay;
mod report;
mod setup;
mod source;
mod stats;
mod tcp_tls;
mod tensorwire_run;
mod threads;
mod throughput;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    args.check()?;
    let setup = Setup::from_args(&args);
    let first_connections = args.connections.first().copied().unwrap_or(1);
    if let Some(cert) = &args.raw_server {
        return raw_quinn::raw_quinn_server_process(
            cert,
            args.listen,
            first_connections,
            setup,
            args.steering,
        )
        .await;
    }
    if let Some(cert) = &args.tls_server {
        return tcp_tls::tls_server_process(cert, args.listen, first_connections).await;
    }
    let bytes = args.mib_per_connection() << 20;
    let tensor_bytes = (args.tensor_mib << 20).min(bytes);
    // A run without throughput rows loads no throughput source: its setup stays out of the
    // measurement (and of a profile of it).
    let client_process = args.raw_client.is_some() || args.tls_client.is_some();
    let source = if args.no_throughput() && !client_process {
        Loaded::Memory(Bytes::new())
    } else {
        RawSource::load(args.source.as_ref(), tensor_bytes)?
    };
    if let (Some(addr), Some(cert)) = (args.raw_client, &args.cert) {
        return raw_quinn::raw_quinn_client_process(
            addr,
            cert,
            first_connections,
            bytes,
            setup,
            source,
        )
        .await;
    }
    if let (Some(addr), Some(cert)) = (args.tls_client, &args.cert) {
        return tcp_tls::tls_client_process(addr, cert, first_connections, bytes, &source).await;
    }

    let rounds = throughput::measure(setup, &args, bytes, tensor_bytes, &source).await?;
    let latency = latency::measure(setup, &args).await?;
    if !args.no_throughput() {
        throughput::print(&args, &rounds, tensor_bytes);
    }
    latency::print(&latency, args.latency_samples());
    let gpu = if args.gpu_section() {
        let report = gpu::gpu_section(setup, &args, bytes, tensor_bytes, args.rounds()).await?;
        gpu::print(&report, args.rounds());
        Some(report)
    } else {
        None
    };
    let report = Report::new(&args, rounds, latency, gpu);
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
