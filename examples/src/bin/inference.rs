//! An inference-style server in one process: it receives a weight matrix and an input batch
//! over loopback QUIC, multiplies them on the GPU with cuBLAS through cudarc (the landed
//! tensors are cudarc slices, no copy), checks the product against a CPU reference, then
//! receives new weights into the same device memory (a registered destination) and
//! multiplies again. It prints where each tensor landed and the time from a tensor's last
//! byte to its result, and measures the time from a large tensor's last byte to a kernel's
//! first use of it, with the early hand-off (the kernel queued behind the landing event)
//! and without it (queued once the tensor's receive finished).
//!
//!     inference-server [--device cuda:0] [--dim 2048] [--batch 64] [--handoff-mib 1024]
//!                      [--require-gpu]
//!
//! Needs a GPU and cuBLAS (libcublas, loaded at run time); without them it says so and
//! exits 0 (1 with `--require-gpu`).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::Parser;
use tensorwire::gpu::cudarc::cublas::sys::cublasOperation_t;
use tensorwire::gpu::cudarc::cublas::{CudaBlas, Gemm, GemmConfig, Gemv, GemvConfig};
use tensorwire::gpu::cudarc::driver::{
    CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, sys::CUevent_flags,
};
use tensorwire::gpu::{
    CudaBuffer, Destinations, DeviceRequest, GpuRequirement, GpuStatus, Landed, Placement,
    TensorBuffer, TensorSink,
};
use tensorwire::proto::{DType, Payload, TensorMeta};
use tensorwire::quic::{IncomingTensor, Receiver, ReceiverConfig, Sender, SenderConfig};
use tensorwire::sink::{CreditPermit, Sink, SinkError};
use tensorwire_examples::cli::{init_logging, size};

/// Receive weights and inputs, multiply on the GPU, update the weights in place.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// The GPU: cuda or cuda:N.
    #[arg(long, default_value = "cuda:0")]
    device: DeviceRequest,
    /// The weight matrix is DIM × DIM F32.
    #[arg(long, default_value_t = 2048)]
    dim: usize,
    /// Rows of the input batch.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Size of the tensor whose last byte → first kernel use is measured (0: skip).
    #[arg(long, default_value_t = 1024)]
    handoff_mib: usize,
    /// Fail, instead of exiting 0, when there is no GPU or no cuBLAS.
    #[arg(long)]
    require_gpu: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    init_logging("error");
    let args = Args::parse();
    let status = GpuStatus::detect();
    let missing = if !status.is_available() {
        Some(format!("no GPU ({status})"))
    } else if !cublas_present() {
        Some("no cuBLAS (libcublas.so not found)".to_owned())
    } else {
        None
    };
    if let Some(missing) = missing {
        if args.require_gpu {
            bail!("{missing}, and --require-gpu was given");
        }
        println!("{missing}: this example multiplies on the GPU, so there is nothing to run");
        return Ok(());
    }
    let DeviceRequest::Cuda(ordinal) = args.device else {
        bail!("--device must be cuda or cuda:N, not {:?}", args.device);
    };
    let placement = Placement::choose(args.device, GpuRequirement::Required)?;
    let Placement::Gpu(gpu) = &placement else {
        bail!("a GPU placement was required");
    };
    let gpu = gpu.clone();
    // The server's own context and stream: CudaContext::new retains the same primary
    // context tensorwire lands tensors in, so landed memory is usable here directly.
    let stream = CudaContext::new(ordinal)?.new_stream()?;
    let blas = CudaBlas::new(stream.clone())?;
    let destinations = Destinations::new();

    let mut receiver = Receiver::bind(ReceiverConfig::new(
        "127.0.0.1:0".parse()?,
        tensorwire::quic::ServerTls::Development,
    ))
    .await?;
    let addr = receiver.local_addr()?;
    let sender = Sender::connect(
        addr,
        SenderConfig::new(tensorwire::quic::ClientTls::Development),
    )
    .await?;
    println!(
        "server on {addr}: tensors land in {}, multiplied with cuBLAS",
        placement.describe()
    );

    let (dim, batch) = (args.dim, args.batch);
    {
        // cuBLAS picks and loads its kernels on a shape's first GEMM: do that before timing.
        let (x, w) = (
            stream.alloc_zeros(batch * dim)?,
            stream.alloc_zeros(dim * dim)?,
        );
        let mut y = stream.alloc_zeros::<f32>(batch * dim)?;
        multiply(&blas, &x, &w, &mut y, batch, dim)?;
        stream.synchronize()?;
    }
    let weights = floats(dim * dim, 1);
    let input = floats(batch * dim, 2);
    send(&sender, f32_meta("weights", &[dim, dim])?, &weights);
    send(&sender, f32_meta("input", &[batch, dim])?, &input);
    let landed_weights = receive(&mut receiver, &placement, &destinations, &stream).await?;
    let landed_input = receive(&mut receiver, &placement, &destinations, &stream).await?;
    let (w, x) = (&landed_weights.buffer, &landed_input.buffer);
    let w_view = w.as_slice::<f32>(DType::F32, &stream)?;
    let x_view = x.as_slice::<f32>(DType::F32, &stream)?;
    let mut y = stream.alloc_zeros::<f32>(batch * dim)?;
    multiply(&blas, &x_view, &w_view, &mut y, batch, dim)?;
    stream.synchronize()?;
    let result = Instant::now();
    check(&stream.clone_dtoh(&y)?, &input, &weights, batch, dim)?;
    println!(
        "  y = input · weights: {batch}×{dim} · {dim}×{dim}, matches the CPU reference; \
         {:.2} ms from the input's last byte to the result",
        landed_input.since_last_byte(result).as_secs_f64() * 1e3
    );

    // The server keeps its weights in memory of its own and registers it: the next tensor
    // named "weights" lands there, at the same address, with no allocation.
    let mut own = stream.alloc_zeros::<f32>(dim * dim)?;
    stream.memcpy_dtod(&*w_view, &mut own)?;
    drop((w_view, landed_weights));
    let own = Arc::new(own);
    let address = own.device_ptr(&stream).0;
    destinations.register_cuda_slice("weights", &[dim as u64, dim as u64], own.clone())?;
    let pool_before = gpu.memory_stats();
    let new_weights = floats(dim * dim, 3);
    send(&sender, f32_meta("weights", &[dim, dim])?, &new_weights);
    let updated = receive(&mut receiver, &placement, &destinations, &stream).await?;
    let landed_at = updated.buffer.device_ptr();
    let pool_after = gpu.memory_stats();
    multiply(&blas, &x_view, &own, &mut y, batch, dim)?;
    stream.synchronize()?;
    let result = Instant::now();
    check(&stream.clone_dtoh(&y)?, &input, &new_weights, batch, dim)?;
    if landed_at != address || pool_after.misses != pool_before.misses {
        bail!(
            "the update did not land in place: at {landed_at:#x} (registered {address:#x}), \
             device pool misses {} -> {}",
            pool_before.misses,
            pool_after.misses
        );
    }
    println!(
        "  new weights landed in place at {address:#x} (no device allocation); \
         y = input · new weights matches the CPU reference; {:.2} ms from the last byte to \
         the result",
        updated.since_last_byte(result).as_secs_f64() * 1e3
    );
    drop((x_view, updated, landed_input));

    if args.handoff_mib > 0 {
        measure_handoff(&args, &sender, &mut receiver, &placement, &stream, &blas).await?;
    }
    sender.close().await;
    receiver.close().await;
    Ok(())
}

/// Last byte → first use by a kernel (a GEMV reading the whole matrix), on the GPU's clock.
async fn measure_handoff(
    args: &Args,
    sender: &Sender,
    receiver: &mut Receiver,
    placement: &Placement,
    stream: &Arc<CudaStream>,
    blas: &CudaBlas,
) -> anyhow::Result<()> {
    let cols = 4096usize;
    let rows = (args.handoff_mib << 20) / 4 / cols;
    let matrix = floats(rows * cols, 4);
    let vector = stream.clone_htod(&floats(cols, 5))?;
    let mut out = stream.alloc_zeros::<f32>(rows)?;
    println!(
        "last byte of a {} tensor → first use by a kernel (GEMV over it), GPU clock:",
        size((rows * cols * 4) as u64)
    );
    for early in [false, true, false, true] {
        send(sender, f32_meta("big", &[rows, cols])?, &matrix);
        let incoming = receiver.next().await.context("receiver closed")?;
        let mut sink = Stamped::new(placement.sink(incoming.meta())?, stream, incoming.meta())?;
        let stamp = sink.stamp.clone();
        let handoff = match (early, &mut sink.inner) {
            (true, TensorSink::Gpu(gpu_sink)) => Some(gpu_sink.handoff()),
            (true, TensorSink::Host(_)) => bail!("the tensor is not landing on the GPU"),
            (false, _) => None,
        };
        let handle = incoming.accept(sink);
        let used = match handoff {
            Some(handoff) => {
                // Queued as soon as the last copy is: the stream waits for the landing.
                let buffer = handoff.landed().await?;
                let used = first_use(blas, stream, &buffer, &vector, &mut out, rows, cols)?;
                handle.finished().await?;
                used
            }
            None => {
                let (_, landed) = handle.finished().await?;
                let buffer = on_gpu(landed.output)?;
                first_use(blas, stream, &buffer, &vector, &mut out, rows, cols)?
            }
        };
        stream.synchronize()?;
        let ms = stamp.event()?.elapsed_ms(&used)?;
        let how = if early {
            "early hand-off (landing event)"
        } else {
            "after the receive finished"
        };
        println!("  {how:<34} {ms:>7.3} ms");
    }
    Ok(())
}

/// Queues a GEMV over `buffer` on `stream` (ordered after its landing) and returns an event
/// recorded just before it: when the kernel could start.
fn first_use(
    blas: &CudaBlas,
    stream: &Arc<CudaStream>,
    buffer: &CudaBuffer,
    vector: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    rows: usize,
    cols: usize,
) -> anyhow::Result<CudaEvent> {
    let matrix = buffer.as_slice::<f32>(DType::F32, stream)?;
    let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    // Row-major rows×cols is column-major cols×rows: y = Aᵀ·x in cuBLAS's terms.
    let config = GemvConfig {
        trans: cublasOperation_t::CUBLAS_OP_T,
        m: i32::try_from(cols)?,
        n: i32::try_from(rows)?,
        alpha: 1.0f32,
        lda: i32::try_from(cols)?,
        incx: 1,
        beta: 0.0f32,
        incy: 1,
    };
    gemv(blas, config, &matrix, vector, out)?;
    Ok(start)
}

#[allow(unsafe_code)]
fn gemv(
    blas: &CudaBlas,
    config: GemvConfig<f32>,
    matrix: &CudaSlice<f32>,
    vector: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
) -> anyhow::Result<()> {
    let (m, n) = (config.m as usize, config.n as usize);
    if matrix.len() < m * n || vector.len() < m || out.len() < n {
        bail!("GEMV operands smaller than its configuration");
    }
    // SAFETY: cuBLAS reads m·n matrix elements and m vector elements and writes n outputs,
    // all checked above to lie inside the slices.
    unsafe { blas.gemv(config, matrix, vector, out) }?;
    Ok(())
}

/// Whether libcublas can be loaded (cudarc panics on a missing library otherwise).
#[allow(unsafe_code)]
fn cublas_present() -> bool {
    // SAFETY: only tries to dlopen libcublas under its usual names; calls nothing in it.
    unsafe { tensorwire::gpu::cudarc::cublas::sys::is_culib_present() }
}

/// y (batch×dim) = x (batch×dim) · w (dim×dim), all row-major, queued on `blas`'s stream.
#[allow(unsafe_code)]
fn multiply(
    blas: &CudaBlas,
    x: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    y: &mut CudaSlice<f32>,
    batch: usize,
    dim: usize,
) -> anyhow::Result<()> {
    if x.len() < batch * dim || w.len() < dim * dim || y.len() < batch * dim {
        bail!("GEMM operands smaller than their shapes");
    }
    // cuBLAS is column-major: row-major y = x·w is column-major yᵀ = wᵀ·xᵀ.
    let config = GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_N,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: i32::try_from(dim)?,
        n: i32::try_from(batch)?,
        k: i32::try_from(dim)?,
        alpha: 1.0f32,
        lda: i32::try_from(dim)?,
        ldb: i32::try_from(dim)?,
        beta: 0.0f32,
        ldc: i32::try_from(dim)?,
    };
    // SAFETY: the slices hold dim·dim, batch·dim and batch·dim f32s (checked above), which
    // is what the configuration makes cuBLAS read and write.
    unsafe { blas.gemm(config, w, x, y) }?;
    Ok(())
}

/// Compares the GPU's product with a CPU reference (every row, every column).
fn check(got: &[f32], x: &[f32], w: &[f32], batch: usize, dim: usize) -> anyhow::Result<()> {
    for row in 0..batch {
        for col in 0..dim {
            let expected: f64 = (0..dim)
                .map(|i| f64::from(x[row * dim + i]) * f64::from(w[i * dim + col]))
                .sum();
            let value = f64::from(got[row * dim + col]);
            if (value - expected).abs() > 1e-3 * (1.0 + expected.abs()) {
                bail!("y[{row}][{col}] = {value}, the CPU reference says {expected}");
            }
        }
    }
    Ok(())
}

fn floats(n: usize, seed: u64) -> Vec<f32> {
    tensorwire_proto::testing::pattern(n, seed)
        .into_iter()
        .map(|b| f32::from(b) / 128.0 - 1.0)
        .collect()
}

fn f32_meta(name: &str, shape: &[usize]) -> anyhow::Result<TensorMeta> {
    let shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
    Ok(TensorMeta::new(shape, DType::F32)?.with_name(name))
}

/// Sends `values` as the tensor `meta` in the background; failures show at the receiver.
fn send(sender: &Sender, meta: TensorMeta, values: &[f32]) {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let handle = sender.send(meta, Bytes::from(bytes));
    tokio::spawn(async move {
        if let Err(e) = handle.finished().await {
            eprintln!("send failed: {e}");
        }
    });
}

/// Admits the next tensor: into its registered destination, or where the placement says.
async fn receive(
    receiver: &mut Receiver,
    placement: &Placement,
    destinations: &Destinations,
    stream: &Arc<CudaStream>,
) -> anyhow::Result<Received> {
    let incoming: IncomingTensor = receiver.next().await.context("receiver closed")?;
    let meta = incoming.meta().clone();
    let wait = Duration::from_secs(10);
    let received = match destinations.claim(&meta, placement, wait).await {
        Ok(Some(sink)) => {
            let stamped = Stamped::new(sink, stream, &meta)?;
            let (_, landed) = incoming.accept(stamped).finished().await?;
            let Landed::Device(buffer) = landed.output else {
                bail!(
                    "{}: a device destination landed in host memory",
                    meta.name()
                );
            };
            Received {
                buffer,
                stamp: landed.stamp,
            }
        }
        Ok(None) => {
            let sink = Stamped::new(placement.sink(&meta)?, stream, &meta)?;
            let (_, landed) = incoming.accept(sink).finished().await?;
            Received {
                buffer: on_gpu(landed.output)?,
                stamp: landed.stamp,
            }
        }
        Err(e) => {
            incoming.reject(e.code, e.message.clone());
            bail!("{}: refused: {e}", meta.name());
        }
    };
    println!(
        "  {:<8} {} {:?} {:>10} -> {}",
        meta.name(),
        meta.dtype(),
        meta.shape(),
        size(meta.byte_len()),
        received.buffer.location()
    );
    Ok(received)
}

/// A received tensor and when its last byte arrived.
struct Received {
    buffer: CudaBuffer,
    stamp: Stamp,
}

/// The GPU buffer a GPU placement lands in (the example needs one).
fn on_gpu(buffer: TensorBuffer) -> anyhow::Result<CudaBuffer> {
    match buffer {
        TensorBuffer::Cuda(buffer) => Ok(buffer),
        TensorBuffer::Host(_) => bail!("landed in host memory"),
    }
}

impl Received {
    /// From the last byte's arrival to `then`.
    fn since_last_byte(&self, then: Instant) -> Duration {
        then.saturating_duration_since(self.stamp.at().unwrap_or(then))
    }
}

/// When a tensor's last byte reached the receiver: a host time, and an event on the GPU's
/// clock recorded then on an idle stream.
#[derive(Clone)]
struct Stamp(Arc<Mutex<Option<(Instant, CudaEvent)>>>);

impl Stamp {
    fn at(&self) -> Option<Instant> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map(|(at, _)| *at)
    }

    fn event(&self) -> anyhow::Result<CudaEvent> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .map(|(_, event)| event)
            .context("the last byte never arrived")
    }
}

/// A sink that stamps the arrival of the tensor's last byte, then passes every write on.
struct Stamped<S> {
    inner: S,
    stamp: Stamp,
    clock: Arc<CudaStream>,
    left: u64,
}

/// What a stamped sink's tensor landed as, and its stamp.
struct StampedOutput<T> {
    output: T,
    stamp: Stamp,
}

impl<S: Sink> Stamped<S> {
    fn new(inner: S, stream: &Arc<CudaStream>, meta: &TensorMeta) -> anyhow::Result<Self> {
        // Its own stream, idle, so an event recorded on it completes at once: a timestamp.
        let clock = stream.context().new_stream()?;
        Ok(Self {
            inner,
            stamp: Stamp(Arc::default()),
            clock,
            left: meta.byte_len(),
        })
    }
}

impl<S: Sink> Stamped<S> {
    /// Counts `len` more bytes written; stamps the time when the last byte is.
    fn count(&mut self, len: usize) -> Result<(), SinkError> {
        self.left = self.left.saturating_sub(len as u64);
        if self.left == 0 {
            let event = self
                .clock
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| SinkError::failed(format!("cuEventRecord: {e}")))?;
            *self.stamp.0.lock().unwrap_or_else(PoisonError::into_inner) =
                Some((Instant::now(), event));
        }
        Ok(())
    }
}

impl<S: Sink> Sink for Stamped<S> {
    type Output = StampedOutput<S::Output>;

    async fn store(
        &mut self,
        offset: u64,
        payload: Payload,
        permit: CreditPermit,
        crc: Option<&mut u32>,
    ) -> Result<(), SinkError> {
        self.count(payload.len())?;
        self.inner.store(offset, payload, permit, crc).await
    }

    async fn flush(&mut self) -> Result<(), SinkError> {
        self.inner.flush().await
    }

    fn take_checksum(&mut self) -> bool {
        self.inner.take_checksum()
    }

    async fn landed_checksum(&mut self) -> Result<u32, SinkError> {
        self.inner.landed_checksum().await
    }

    async fn finish(self) -> Result<Self::Output, SinkError> {
        let output = self.inner.finish().await?;
        Ok(StampedOutput {
            output,
            stamp: self.stamp,
        })
    }
}
