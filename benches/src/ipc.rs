//! Sharing latency: publish, export and open, first and cached, beside the raw driver calls
//! they wrap (`cuIpcOpenMemHandle`, VMM fd import + map), for host, VMM and legacy exports.
//!
//! `ipc-bench [--json FILE] [--iterations N]`. The consumer side runs in a child process
//! (this program again), as a real consumer would: a legacy handle cannot be opened by the
//! process that exported it. Without a GPU only the host rows are measured.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use serde::{Deserialize, Serialize};
use tensorwire::gpu::{
    Allocation, CudaBuffer, DeviceAllocation, DeviceMemoryKind, GpuDevice, GpuStatus,
    ImportedMemory,
};
use tensorwire::ipc::{ShareClient, ShareConfig, ShareService};
use tensorwire::proto::{DType, TensorMeta};

const CHILD_ENV: &str = "TENSORWIRE_IPC_BENCH_CHILD";

/// Measure sharing latency.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Repetitions of each cached measurement.
    #[arg(long, default_value_t = 50)]
    iterations: usize,
    /// Also write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One measured operation.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Row {
    /// What was timed.
    operation: String,
    /// host, vmm or cuda_ipc.
    export: String,
    /// Tensor bytes.
    bytes: u64,
    /// Median in microseconds.
    median_us: f64,
    /// 90th percentile in microseconds.
    p90_us: f64,
    /// Samples.
    samples: usize,
}

fn row(operation: &str, export: &str, bytes: u64, mut samples: Vec<Duration>) -> Row {
    samples.sort();
    let at = |q: f64| {
        samples
            .get(((samples.len() as f64 - 1.0) * q).round() as usize)
            .map_or(0.0, |d| d.as_secs_f64() * 1e6)
    };
    Row {
        operation: operation.into(),
        export: export.into(),
        bytes,
        median_us: at(0.5),
        p90_us: at(0.9),
        samples: samples.len(),
    }
}

fn timed<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let start = Instant::now();
    let out = f();
    (out, start.elapsed())
}

const SIZES: [usize; 3] = [1 << 20, 64 << 20, 1 << 30];

fn name(export: &str, bytes: usize) -> String {
    format!("{export}-{}MiB", bytes >> 20)
}

/// The consumer: for each tensor, the first open, then cached opens, then the raw driver
/// call; one JSON row per line on stdout.
fn child(path: &str, iterations: usize, gpu: bool) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    if gpu {
        // Creating a CUDA context takes ~100+ ms once per process: keep it out of the opens.
        let (device, took) = timed(|| GpuDevice::open(0));
        device?;
        rows.push(row("CUDA context (once per process)", "-", 0, vec![took]));
    }
    let (client, connect) = timed(|| ShareClient::connect(path));
    let client = client?;
    rows.push(row("connect + hello", "-", 0, vec![connect]));
    let exports: &[&str] = if gpu {
        &["host", "vmm", "cuda_ipc"]
    } else {
        &["host"]
    };
    for export in exports {
        for bytes in SIZES {
            if *export == "host" && bytes > 64 << 20 {
                continue;
            }
            let tensor = name(export, bytes);
            let (first, took) = timed(|| client.open(&tensor));
            let descriptor = first?.descriptor().clone();
            rows.push(row("open (first)", export, bytes as u64, vec![took]));
            let mut again = Vec::new();
            for _ in 0..iterations {
                let (opened, took) = timed(|| client.open(&tensor));
                drop(opened?);
                again.push(took);
            }
            rows.push(row("open (again)", export, bytes as u64, again));
            if *export == "cuda_ipc" {
                let device =
                    GpuDevice::open_by_uuid(descriptor.device_uuid.as_deref().unwrap_or(""))?;
                let handle = tensorwire::gpu::IpcHandle(
                    descriptor
                        .handle
                        .as_ref()
                        .and_then(|h| h.to_bytes())
                        .ok_or_else(|| anyhow::anyhow!("no handle"))?,
                );
                let mut raw = Vec::new();
                for _ in 0..iterations {
                    let (opened, took) = timed(|| {
                        ImportedMemory::open_ipc_handle(
                            &handle,
                            descriptor.alloc_len as usize,
                            &device,
                        )
                    });
                    drop(opened?);
                    raw.push(took);
                }
                rows.push(row("raw cuIpcOpenMemHandle", export, bytes as u64, raw));
            }
        }
    }
    for r in rows {
        println!("{}", serde_json::to_string(&r)?);
    }
    Ok(())
}

fn publish_all(
    service: &ShareService,
    gpu: Option<&Arc<GpuDevice>>,
    rows: &mut Vec<Row>,
) -> anyhow::Result<()> {
    for bytes in SIZES.iter().copied().filter(|b| *b <= 64 << 20) {
        let meta = TensorMeta::new([bytes as u64], DType::U8)?.with_name(name("host", bytes));
        let data = vec![7u8; bytes];
        let (published, took) = timed(|| service.publish_host(&meta, &data));
        published?;
        rows.push(row(
            "publish (memfd + copy)",
            "host",
            bytes as u64,
            vec![took],
        ));
    }
    let Some(device) = gpu else { return Ok(()) };
    for (kind, export) in [
        (DeviceMemoryKind::Vmm, "vmm"),
        (DeviceMemoryKind::Legacy, "cuda_ipc"),
    ] {
        for bytes in SIZES {
            let allocation = DeviceAllocation::with_kind(device, bytes, kind)?;
            let operation = match kind {
                DeviceMemoryKind::Vmm => {
                    let (_, first) = timed(|| allocation.export_fd().map(|_| ()));
                    let (_, cached) = timed(|| allocation.export_fd().map(|_| ()));
                    rows.push(row("export fd (first)", export, bytes as u64, vec![first]));
                    rows.push(row(
                        "export fd (cached)",
                        export,
                        bytes as u64,
                        vec![cached],
                    ));
                    "publish (export cached)"
                }
                // Not allocated here: only Vmm and Legacy are measured.
                DeviceMemoryKind::CallerOwned => continue,
                DeviceMemoryKind::Legacy => {
                    let (_, first) = timed(|| allocation.ipc_handle().map(|_| ()));
                    rows.push(row(
                        "cuIpcGetMemHandle (first)",
                        export,
                        bytes as u64,
                        vec![first],
                    ));
                    "publish (handle cached)"
                }
            };
            let buffer = Arc::new(CudaBuffer::from_owned(allocation, bytes));
            let meta = TensorMeta::new([bytes as u64], DType::U8)?.with_name(name(export, bytes));
            let (published, took) = timed(|| service.publish_device(&meta, buffer.clone(), 0));
            published?;
            rows.push(row(operation, export, bytes as u64, vec![took]));
            if kind == DeviceMemoryKind::Vmm {
                // Raw fd import + map, in this process (allowed for VMM), from a duplicate fd.
                let mut raw = Vec::new();
                for _ in 0..20 {
                    let fd = buffer.allocation().export_fd()?.try_clone_to_owned()?;
                    let (imported, took) = timed(|| {
                        ImportedMemory::import_fd(
                            &fd,
                            Allocation::len(buffer.allocation()),
                            device,
                            &[],
                        )
                    });
                    drop(imported?);
                    raw.push(took);
                }
                rows.push(row("raw fd import + map", export, bytes as u64, raw));
            }
        }
    }
    Ok(())
}

fn print(rows: &[Row]) {
    println!(
        "{:<28} {:<9} {:>9} {:>11} {:>11} {:>7}",
        "operation", "export", "size", "median µs", "p90 µs", "samples"
    );
    for r in rows {
        println!(
            "{:<28} {:<9} {:>9} {:>11.1} {:>11.1} {:>7}",
            r.operation,
            r.export,
            if r.bytes == 0 {
                "-".to_string()
            } else {
                format!("{} MiB", r.bytes >> 20)
            },
            r.median_us,
            r.p90_us,
            r.samples
        );
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let gpu_status = GpuStatus::detect();
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        return child(&spec, args.iterations, gpu_status.is_available());
    }
    let gpu = if gpu_status.is_available() {
        Some(GpuDevice::open(0)?)
    } else {
        eprintln!("no GPU ({gpu_status}): measuring host sharing only");
        None
    };
    let dir = std::env::temp_dir().join(format!("tensorwire-ipc-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let path = dir.join("share.sock");
    let service = ShareService::start(&path, ShareConfig::default())?;
    let mut rows = Vec::new();
    publish_all(&service, gpu.as_ref(), &mut rows)?;
    rows.extend(run_child(&path, args.iterations)?);
    if let Some(device) = &gpu {
        println!("device: {}", device.info().name);
    }
    print(&rows);
    if let Some(json) = &args.json {
        std::fs::write(json, serde_json::to_string_pretty(&rows)?)?;
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

fn run_child(path: &Path, iterations: usize) -> anyhow::Result<Vec<Row>> {
    let output = Command::new(std::env::current_exe()?)
        .args(["--iterations", &iterations.to_string()])
        .env(CHILD_ENV, path)
        .output()?;
    anyhow::ensure!(
        output.status.success(),
        "consumer failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|line| Ok(serde_json::from_str(line)?))
        .collect()
}
