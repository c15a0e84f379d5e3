//! Where a receiver puts incoming tensors: a GPU when there is one, host memory otherwise,
//! and a sink that lands each tensor there.

use std::time::Duration;

use bytes::Bytes;
use tensorwire_proto::{Device, Payload, Receipt, TensorMeta};
use tensorwire_sink::{
    CreditPermit, Divisible, HostSink, MemoryBudget, MemoryShares, Sink, SinkError,
};

use crate::buffer::TensorBuffer;
use crate::error::GpuError;
use crate::status::GpuStatus;

/// Which device a receiver should land tensors on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeviceRequest {
    /// GPU 0 if there is one, else host memory.
    Auto,
    /// This CUDA device.
    Cuda(usize),
    /// Host memory.
    Host,
}

impl std::str::FromStr for DeviceRequest {
    type Err = String;

    /// `auto`, `host`/`cpu`, `cuda` (= `cuda:0`) or `cuda:N`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(DeviceRequest::Auto),
            "host" | "cpu" => Ok(DeviceRequest::Host),
            "cuda" => Ok(DeviceRequest::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceRequest::Cuda)
                .ok_or_else(|| format!("device {other:?}: expected auto, host, cuda or cuda:N")),
        }
    }
}

/// A receiver's landing place for tensors.
#[derive(Clone)]
pub enum Placement {
    /// A GPU, with its pools.
    #[cfg(feature = "cuda")]
    Gpu(crate::sink::GpuSinkFactory),
    /// Host memory; `reason` says why not a GPU.
    Host {
        /// Why tensors land in host memory.
        reason: String,
    },
}

/// Whether tensors must land on a GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum GpuRequirement {
    /// A GPU when one can be opened, else host memory, with a warning that says why (and
    /// [`Placement::describe`] says it too).
    Preferred,
    /// A GPU or an error, never host memory: no GPU fails the choice, and a GPU sink that
    /// cannot get device memory refuses the tensor rather than land it in host memory.
    Required,
}

impl GpuRequirement {
    /// `Required` where a program's `--require-gpu` (or `require_gpu=True`) is set, else
    /// `Preferred`.
    pub fn required_if(required: bool) -> Self {
        if required {
            GpuRequirement::Required
        } else {
            GpuRequirement::Preferred
        }
    }
}

/// Which device memory a GPU placement lands tensors in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DeviceMemory {
    /// The CUDA allocator's, shared by legacy CUDA IPC at most.
    Private,
    /// VMM allocations that `tensorwire-ipc` shares as file descriptors.
    Shareable,
}

impl Placement {
    /// Resolves `request`: a GPU when asked for (or, with `Auto`, when one exists), else host
    /// memory with a warning, or an error where the GPU is [`Required`](GpuRequirement).
    pub fn choose(request: DeviceRequest, gpu: GpuRequirement) -> Result<Placement, GpuError> {
        Self::choose_in(request, gpu, DeviceMemory::Private)
    }

    /// As [`choose`](Self::choose), GPU tensors landing in VMM memory that `tensorwire-ipc`
    /// can share with other processes with no copy.
    pub fn choose_shareable(
        request: DeviceRequest,
        gpu: GpuRequirement,
    ) -> Result<Placement, GpuError> {
        Self::choose_in(request, gpu, DeviceMemory::Shareable)
    }

    fn choose_in(
        request: DeviceRequest,
        gpu: GpuRequirement,
        memory: DeviceMemory,
    ) -> Result<Placement, GpuError> {
        let status = GpuStatus::detect();
        let ordinal = match request {
            DeviceRequest::Host if gpu == GpuRequirement::Required => {
                return Err(GpuError::InvalidConfig(
                    "a GPU is required, but host placement was asked for".into(),
                ));
            }
            DeviceRequest::Host => {
                return Ok(Placement::Host {
                    reason: "host memory was requested".into(),
                });
            }
            DeviceRequest::Auto => 0,
            DeviceRequest::Cuda(n) => n,
        };
        match Self::open_gpu(ordinal, memory, gpu) {
            Ok(placement) => Ok(placement),
            Err(e) if gpu == GpuRequirement::Required => Err(e),
            Err(e) => {
                let reason = match (&request, status.is_available()) {
                    (DeviceRequest::Auto, false) => format!("{status}"),
                    _ => e.to_string(),
                };
                tracing::warn!(%reason, "tensors will land in host memory");
                Ok(Placement::Host { reason })
            }
        }
    }

    #[cfg(feature = "cuda")]
    fn open_gpu(
        ordinal: usize,
        memory: DeviceMemory,
        gpu: GpuRequirement,
    ) -> Result<Placement, GpuError> {
        let kind = match memory {
            DeviceMemory::Shareable => crate::cuda::DeviceMemoryKind::Vmm,
            DeviceMemory::Private => crate::cuda::DeviceMemoryKind::Legacy,
        };
        let fallback = match gpu {
            GpuRequirement::Required => crate::sink::HostFallback::Forbidden,
            GpuRequirement::Preferred => crate::sink::HostFallback::Allowed,
        };
        crate::sink::GpuSinkFactory::with_defaults_of_kind(ordinal, kind)
            .map(|gpu| Placement::Gpu(gpu.with_host_fallback(fallback)))
    }

    #[cfg(not(feature = "cuda"))]
    fn open_gpu(
        _ordinal: usize,
        _memory: DeviceMemory,
        _gpu: GpuRequirement,
    ) -> Result<Placement, GpuError> {
        Err(GpuError::NotCompiled)
    }

    /// Where tensors land, for people.
    pub fn describe(&self) -> String {
        match self {
            #[cfg(feature = "cuda")]
            Placement::Gpu(gpu) => {
                let info = gpu.device().info();
                format!("GPU cuda:{} ({})", info.ordinal, info.name)
            }
            Placement::Host { reason } => format!("host memory ({reason})"),
        }
    }

    /// A sink for `meta` now, without waiting for memory: see [`admit`](Self::admit) for the
    /// rules. Host memory here is outside any budget.
    pub fn sink(&self, meta: &TensorMeta) -> Result<TensorSink, SinkError> {
        match self.target(meta)? {
            #[cfg(feature = "cuda")]
            Target::Gpu(gpu, fallback) => match gpu.sink(meta) {
                Ok(sink) => Ok(TensorSink::Gpu(sink)),
                Err(e) => Self::fall_back(meta, fallback, e.into(), HostSink::new(meta.byte_len())),
            },
            Target::Host => HostSink::new(meta.byte_len()).map(TensorSink::Host),
        }
    }

    /// A sink for `meta`, its destination admitted against the device's memory budget (or
    /// `host`'s, for host memory) before anything is allocated (spec §7.5), through the
    /// sender's connection's `shares` of each, waiting up to `wait` for memory to come back.
    ///
    /// The METADATA device hint is honoured (spec §5.2): `host` lands in host memory; `cuda:N`
    /// lands on this receiver's GPU N or is refused with UNSUPPORTED_DEVICE, and never falls
    /// back to host memory. Without a hint, a GPU placement falls back to host memory (with a
    /// warning naming the tensor) only if its [`HostFallback`] allows; otherwise a tensor
    /// that finds no device memory is refused with RESOURCE_EXHAUSTED.
    ///
    /// [`HostFallback`]: crate::HostFallback
    pub async fn admit(
        &self,
        meta: &TensorMeta,
        shares: &MemoryShares,
        host: &MemoryBudget,
        wait: Duration,
    ) -> Result<TensorSink, SinkError> {
        let host = &shares.of(host);
        let host_sink = || async {
            let reservation = tokio::time::timeout(wait, host.reserve(meta.byte_len()))
                .await
                .map_err(|_| waited_in_vain(host, meta, wait))??;
            HostSink::reserved(reservation)
        };
        match self.target(meta)? {
            #[cfg(feature = "cuda")]
            Target::Gpu(gpu, fallback) => {
                let device = shares.of(gpu.memory_budget());
                let reserved = tokio::time::timeout(wait, device.reserve(meta.byte_len())).await;
                let sink = match reserved {
                    Ok(Ok(reservation)) => gpu
                        .sink_reserved(meta, reservation)
                        .map_err(SinkError::from),
                    Ok(Err(e)) => Err(e),
                    Err(_) => Err(waited_in_vain(&device, meta, wait)),
                };
                match sink {
                    Ok(sink) => Ok(TensorSink::Gpu(sink)),
                    Err(e) => Self::fall_back(meta, fallback, e, host_sink().await),
                }
            }
            Target::Host => host_sink().await.map(TensorSink::Host),
        }
    }

    /// Where `meta` goes, per its device hint and this placement.
    fn target(&self, meta: &TensorMeta) -> Result<Target, SinkError> {
        match (self, meta.device()) {
            (_, Device::Host) => Ok(Target::Host),
            #[cfg(feature = "cuda")]
            (Placement::Gpu(gpu), Device::Cuda(n)) if usize::from(n) == gpu.device().ordinal() => {
                Ok(Target::Gpu(
                    gpu.clone(),
                    crate::sink::HostFallback::Forbidden,
                ))
            }
            (_, Device::Cuda(n)) => Err(SinkError::unsupported_device(format!(
                "{} asks for cuda:{n}; this receiver lands tensors in {}",
                meta.name(),
                self.describe()
            ))),
            #[cfg(feature = "cuda")]
            (Placement::Gpu(gpu), _) => Ok(Target::Gpu(gpu.clone(), gpu.host_fallback())),
            (Placement::Host { .. }, _) => Ok(Target::Host),
        }
    }

    #[cfg(feature = "cuda")]
    fn fall_back(
        meta: &TensorMeta,
        fallback: crate::sink::HostFallback,
        error: SinkError,
        host: Result<HostSink, SinkError>,
    ) -> Result<TensorSink, SinkError> {
        if fallback == crate::sink::HostFallback::Forbidden {
            return Err(error);
        }
        tracing::warn!(
            tensor = meta.name(),
            error = %error,
            "no GPU memory for this tensor: it lands in host memory"
        );
        host.map(TensorSink::Host)
    }
}

/// Where one tensor goes.
enum Target {
    #[cfg(feature = "cuda")]
    Gpu(crate::sink::GpuSinkFactory, crate::sink::HostFallback),
    Host,
}

fn waited_in_vain(budget: &MemoryBudget, meta: &TensorMeta, wait: Duration) -> SinkError {
    let state = budget.snapshot();
    SinkError::exhausted(format!(
        "{}: waited {:.1} s for {} bytes of {} memory; {} of its {} byte budget stayed in use",
        meta.name(),
        wait.as_secs_f64(),
        meta.byte_len(),
        budget.what(),
        state.reserved,
        state.limit
    ))
}

/// A sink into GPU or host memory; its output says which.
pub enum TensorSink {
    /// Into device memory.
    #[cfg(feature = "cuda")]
    Gpu(crate::sink::GpuSink),
    /// Into host memory.
    Host(HostSink),
}

impl Sink for TensorSink {
    type Output = TensorBuffer;

    async fn store(
        &mut self,
        offset: u64,
        payload: Payload,
        permit: CreditPermit,
        crc: Option<&mut u32>,
    ) -> Result<(), SinkError> {
        match self {
            #[cfg(feature = "cuda")]
            TensorSink::Gpu(sink) => sink.store(offset, payload, permit, crc).await,
            TensorSink::Host(sink) => sink.store(offset, payload, permit, crc).await,
        }
    }

    async fn flush(&mut self) -> Result<(), SinkError> {
        match self {
            #[cfg(feature = "cuda")]
            TensorSink::Gpu(sink) => sink.flush().await,
            TensorSink::Host(sink) => sink.flush().await,
        }
    }

    fn take_checksum(&mut self) -> bool {
        match self {
            #[cfg(feature = "cuda")]
            TensorSink::Gpu(sink) => sink.take_checksum(),
            TensorSink::Host(sink) => sink.take_checksum(),
        }
    }

    async fn landed_checksum(&mut self) -> Result<u32, SinkError> {
        match self {
            #[cfg(feature = "cuda")]
            TensorSink::Gpu(sink) => sink.landed_checksum().await,
            TensorSink::Host(sink) => sink.landed_checksum().await,
        }
    }

    /// Where it landed: `host` or `cuda:N`.
    fn receipt(buffer: &TensorBuffer) -> Receipt {
        Receipt::new().with(Receipt::DEVICE, buffer.device().to_string())
    }

    async fn finish(self) -> Result<TensorBuffer, SinkError> {
        match self {
            #[cfg(feature = "cuda")]
            TensorSink::Gpu(sink) => sink.finish().await.map(TensorBuffer::Cuda),
            TensorSink::Host(sink) => sink
                .finish()
                .await
                .map(|bytes: Bytes| TensorBuffer::Host(bytes)),
        }
    }
}

/// Parts of a split tensor (spec §15) landing on the GPU write beside each other; into host
/// memory, one at a time.
impl Divisible for TensorSink {
    type Part = TensorSink;

    fn part(&mut self) -> Option<TensorSink> {
        match self {
            #[cfg(feature = "cuda")]
            TensorSink::Gpu(sink) => sink.part().map(TensorSink::Gpu),
            TensorSink::Host(_) => None,
        }
    }
}
