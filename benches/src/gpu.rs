//! The GPU section (`--gpu`): pinned host → device peak, ingest from memory into GPU sinks
//! beside the same copies without the GPU, and network → GPU beside network → host.

use std::time::{Duration, Instant};

use tensorwire::proto::{DType, Payload, TensorMeta};
use tensorwire::quic::{CreditPermit, Sink};

use crate::args::Args;
use crate::report::{GpuReport, IngestRun, NetworkRun, SinkIngest};
use crate::setup::Setup;
use crate::source::payload;
use crate::stats::{keep_best, median, rounds_text, spread, spread_text};
use crate::tensorwire_run::{SinkKind, TensorwireRun, tensorwire_run};

/// What ingest's anchors copy: pieces of ingest's chunk size from one source this large.
pub(crate) const ANCHOR_PIECE: usize = 1 << 20;
pub(crate) const ANCHOR_SOURCE: usize = 64 << 20;

/// Plain memory copies as ingest from memory makes them, without the GPU: `threads` threads
/// copy [`ANCHOR_PIECE`]s of one [`ANCHOR_SOURCE`] into a ring of their own, together
/// `staging_pool` bytes, for about a second. What the copies alone can do, beside what they
/// do while the GPU reads the staging buffers.
pub(crate) fn host_copy_rate(threads: usize, staging_pool: usize) -> f64 {
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
pub(crate) fn staged_h2d_rate(threads: usize, staging_pool: usize) -> anyhow::Result<f64> {
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
pub(crate) fn pinned_h2d_peak() -> anyhow::Result<f64> {
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
pub(crate) const INGEST_BYTES: usize = 8 << 30;

/// `tensors` GPU sinks at once, fed 1 MiB chunks from host memory, [`INGEST_BYTES`] in all
/// (at least four rounds), no network: the ceiling of the sink (memcpy into pinned staging,
/// async H2D, completion). As a receiver's connections do, a new tensor starts as soon as any
/// one ends, not once a whole round has. Each copy takes one staging buffer, and a sink
/// copies a buffer before it is full when the pool runs out: the mean copy size shows it.
pub(crate) async fn ingest_from_memory(
    pools: &tensorwire::gpu::GpuSinkFactory,
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
pub(crate) fn hit_rate_since(
    before: tensorwire::gpu::PoolStats,
    after: tensorwire::gpu::PoolStats,
) -> f64 {
    let (hits, misses) = (after.hits - before.hits, after.misses - before.misses);
    if hits + misses == 0 {
        1.0
    } else {
        hits as f64 / (hits + misses) as f64
    }
}

pub(crate) async fn gpu_section(
    setup: Setup,
    args: &Args,
    bytes: u64,
    tensor_bytes: u64,
    runs: usize,
) -> anyhow::Result<GpuReport> {
    use tensorwire::gpu::{
        DEFAULT_STAGING_POOL, GpuSinkFactory, HostFallback, Placement, PoolConfig,
    };
    let mut staging = PoolConfig::default();
    staging.max_pool_bytes = args
        .staging_pool_mib
        .map_or(DEFAULT_STAGING_POOL, |mib| mib << 20);
    staging.preallocate = true;
    let memory = match args.device_pool_mib {
        0 => PoolConfig::default(),
        mib => {
            let mut config = PoolConfig::default();
            config.max_pool_bytes = mib << 20;
            config.max_buffer = (mib << 20).max(64 << 20);
            config
        }
    };
    let staging_pool = staging.max_pool_bytes;
    let device_pool_mib = memory.max_pool_bytes >> 20;
    // A GPU measurement never lands a tensor in host memory instead.
    let pools =
        GpuSinkFactory::new(0, staging, memory)?.with_host_fallback(HostFallback::Forbidden);
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
        let run_with = |sink: SinkKind| TensorwireRun::from_args(setup, args, sink, tensor_bytes);
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

/// Prints the GPU section.
pub(crate) fn print(g: &GpuReport, runs: usize) {
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
