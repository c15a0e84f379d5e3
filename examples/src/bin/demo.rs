//! Streams a generated set of tensors (mixed sizes and dtypes) over loopback QUIC from a
//! sender to a receiver in this process, then prints where each landed and how fast.

use std::time::Instant;

use bytes::Bytes;
use clap::Parser;
use tensorwire::gpu::{DeviceRequest, GpuRequirement, Placement, TensorBuffer};
use tensorwire::proto::{DType, TensorMeta};
use tensorwire::quic::{Receiver, ReceiverConfig, Sender, SenderConfig, TransportSettings};
use tensorwire_examples::cli::{init_logging, micros, rate, size};

/// Stream generated tensors over loopback QUIC.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// UDP payload size; loopback carries up to the largest UDP payload.
    #[arg(long, default_value_t = tensorwire::quic::MAX_MTU)]
    mtu: u16,
    /// Send the set this many times.
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Where tensors land: auto (GPU 0 if present, else host memory), host, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    device: DeviceRequest,
    /// Fail instead of falling back to host memory when there is no usable GPU.
    #[arg(long)]
    require_gpu: bool,
}

/// A model-ish set: embeddings, layer weights, KV blocks, audio, tokens, masks, fp8.
fn tensor_set() -> anyhow::Result<Vec<TensorMeta>> {
    let mut set = vec![TensorMeta::new([32_000, 1024], DType::BF16)?.with_name("embed.weight")];
    for layer in 0..4 {
        set.push(
            TensorMeta::new([1024, 3072], DType::F16)?
                .with_name(format!("layers.{layer}.attn.qkv")),
        );
        set.push(
            TensorMeta::new([1024, 4096], DType::F32)?.with_name(format!("layers.{layer}.mlp.up")),
        );
    }
    for block in 0..64 {
        set.push(
            TensorMeta::new([16, 8, 128], DType::BF16)?.with_name(format!("kv.block.{block}")),
        );
    }
    set.push(
        TensorMeta::new([16_000 * 5], DType::F32)?
            .with_name("audio.utterance")
            .with_attribute("sample_rate", "16000"),
    );
    set.push(TensorMeta::new([4096], DType::I64)?.with_name("tokens"));
    set.push(TensorMeta::new([4096], DType::Bool)?.with_name("attention.mask"));
    set.push(TensorMeta::new([1024, 1024], DType::F8E4M3)?.with_name("fp8.weight"));
    Ok(set)
}

/// Deterministic bytes (every dtype's bit patterns are fine for transport).
fn fill(len: u64, seed: u64) -> Bytes {
    tensorwire_proto::testing::pattern(len as usize, seed).into()
}

fn check(verified: bool) -> &'static str {
    if verified {
        "bytes verified"
    } else {
        "MISMATCH"
    }
}

fn report(name: &str, dtype: &str, shape: &str, bytes: u64, buffer: &TensorBuffer, verified: bool) {
    println!(
        "  {name:<22} {dtype:>7} {shape:<14} {:>10} -> {}, {}",
        size(bytes),
        buffer.location(),
        check(verified)
    );
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    init_logging("error");
    let args = Args::parse();
    let transport = TransportSettings::default().fixed_mtu(args.mtu);
    let mut config = ReceiverConfig::new(
        "127.0.0.1:0".parse()?,
        tensorwire::quic::ServerTls::Development,
    );
    config.transport = transport.clone();
    let placement = Placement::choose(args.device, GpuRequirement::required_if(args.require_gpu))?;
    let mut receiver = Receiver::bind(config).await?;
    let addr = receiver.local_addr()?;
    println!(
        "receiver on {addr} (development TLS); tensors land in {}",
        placement.describe()
    );

    let set = tensor_set()?;
    let count = set.len() * args.repeat;
    let server = tokio::spawn(async move {
        let mut handles = Vec::with_capacity(count);
        for _ in 0..count {
            let incoming = receiver
                .next()
                .await
                .ok_or_else(|| anyhow::anyhow!("receiver closed"))?;
            let sink = placement.sink(incoming.meta())?;
            handles.push(tokio::spawn(incoming.accept(sink).finished()));
        }
        let mut landed = Vec::with_capacity(count);
        for handle in handles {
            landed.push(handle.await??);
        }
        anyhow::Ok((landed, receiver))
    });

    let sender = Sender::connect(addr, {
        let mut config = SenderConfig::new(tensorwire::quic::ClientTls::Development);
        config.transport = transport;
        config
    })
    .await?;
    let payloads: Vec<(TensorMeta, Bytes)> = set
        .iter()
        .enumerate()
        .map(|(i, meta)| (meta.clone(), fill(meta.byte_len(), i as u64)))
        .collect();
    let total: u64 = payloads.iter().map(|(m, _)| m.byte_len()).sum::<u64>() * args.repeat as u64;
    println!("sending {count} tensors, {} ...", size(total));
    let started = Instant::now();
    let mut sends = Vec::with_capacity(count);
    for _ in 0..args.repeat {
        for (meta, bytes) in &payloads {
            sends.push(sender.send(meta.clone(), bytes.clone()));
        }
    }
    for send in sends {
        send.finished().await?;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let (landed, receiver) = server.await??;
    let budget = receiver.budget();

    // Every tensor is read back (from the GPU, where it landed there) and compared.
    let mut kv_blocks = (0, 0, true, String::new());
    for (meta, buffer) in landed.iter().take(set.len()) {
        let expected = payloads
            .iter()
            .find(|(m, _)| m.name() == meta.name())
            .map(|(_, b)| b);
        let verified = expected == Some(&buffer.to_host()?);
        if meta.name().starts_with("kv.block.") {
            kv_blocks = (
                kv_blocks.0 + 1,
                kv_blocks.1 + meta.byte_len(),
                kv_blocks.2 && verified,
                buffer.location(),
            );
            continue;
        }
        report(
            meta.name(),
            &meta.dtype().to_string(),
            &format!("{:?}", meta.shape()),
            meta.byte_len(),
            buffer,
            verified,
        );
    }
    let (count_kv, bytes_kv, verified_kv, location_kv) = kv_blocks;
    let name = format!("kv.block.* ({count_kv})");
    println!(
        "  {name:<22} {:>7} {:<14} {:>10} -> {location_kv}, {}",
        "BF16",
        "[16, 8, 128]",
        size(bytes_kv),
        check(verified_kv)
    );
    if args.repeat > 1 {
        println!("  (and {} more repeats of the set)", args.repeat - 1);
    }
    let metrics = sender.metrics();
    println!(
        "{count} tensors, {} in {elapsed:.2} s: {}; tensor latency p50 {}, p99 {}; peak credit held {} of {}",
        size(total),
        rate(total, elapsed),
        micros(metrics.latency_p50_us),
        micros(metrics.latency_p99_us),
        size(budget.peak_outstanding),
        size(budget.budget)
    );
    sender.close().await;
    receiver.close().await;
    Ok(())
}
