//! Where a receiver puts incoming tensors: a GPU when there is one, host memory otherwise,
//! and a sink that lands each tensor there.

use bytes::Bytes;
use tensorwire_proto::{Payload, TensorMeta};
use tensorwire_sink::{CreditPermit, HostSink, Sink, SinkError};

use crate::buffer::TensorBuffer;
use crate::error::GpuError;
use crate::status::GpuStatus;

/// Which device a receiver should land tensors on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
    Gpu(crate::sink::PooledGpuReceiver),
    /// Host memory; `reason` says why not a GPU.
    Host {
        /// Why tensors land in host memory.
        reason: String,
    },
}

impl Placement {
    /// Resolves `request`: a GPU when asked for (or, with `Auto`, when one exists), else host
    /// memory with a warning. With `require_gpu`, no GPU is an error instead.
    pub fn choose(request: DeviceRequest, require_gpu: bool) -> Result<Placement, GpuError> {
        Self::choose_shareable(request, require_gpu, false)
    }

    /// As [`choose`](Self::choose); with `shareable`, GPU tensors land in VMM memory that
    /// `tensorwire-ipc` can share with other processes with no copy.
    pub fn choose_shareable(
        request: DeviceRequest,
        require_gpu: bool,
        shareable: bool,
    ) -> Result<Placement, GpuError> {
        let status = GpuStatus::detect();
        let ordinal = match request {
            DeviceRequest::Host if require_gpu => {
                return Err(GpuError::Bounds("--require-gpu with host placement".into()));
            }
            DeviceRequest::Host => {
                return Ok(Placement::Host {
                    reason: "host memory was requested".into(),
                });
            }
            DeviceRequest::Auto => 0,
            DeviceRequest::Cuda(n) => n,
        };
        match Self::open_gpu(ordinal, shareable) {
            Ok(placement) => Ok(placement),
            Err(e) if require_gpu => Err(e),
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
    fn open_gpu(ordinal: usize, shareable: bool) -> Result<Placement, GpuError> {
        let kind = if shareable {
            crate::cuda::DeviceMemoryKind::Vmm
        } else {
            crate::cuda::DeviceMemoryKind::Legacy
        };
        crate::sink::PooledGpuReceiver::with_defaults_of_kind(ordinal, kind).map(Placement::Gpu)
    }

    #[cfg(not(feature = "cuda"))]
    fn open_gpu(_ordinal: usize, _shareable: bool) -> Result<Placement, GpuError> {
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

    /// A sink for `meta` in this place; a GPU that cannot hold it falls back to host memory.
    pub fn sink(&self, meta: &TensorMeta) -> Result<TensorSink, SinkError> {
        match self {
            #[cfg(feature = "cuda")]
            Placement::Gpu(gpu) => match gpu.sink(meta) {
                Ok(sink) => Ok(TensorSink::Gpu(sink)),
                Err(e) => {
                    tracing::warn!(error = %e, tensor = meta.name(), "no GPU memory for this tensor; using host memory");
                    HostSink::new(meta.byte_len()).map(TensorSink::Host)
                }
            },
            Placement::Host { .. } => HostSink::new(meta.byte_len()).map(TensorSink::Host),
        }
    }
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

    async fn write(
        &mut self,
        offset: u64,
        payload: Payload,
        permit: CreditPermit,
    ) -> Result<(), SinkError> {
        match self {
            #[cfg(feature = "cuda")]
            TensorSink::Gpu(sink) => sink.write(offset, payload, permit).await,
            TensorSink::Host(sink) => sink.write(offset, payload, permit).await,
        }
    }

    async fn finish(self) -> Result<TensorBuffer, SinkError> {
        match self {
            #[cfg(feature = "cuda")]
            TensorSink::Gpu(sink) => sink.finish().await.map(TensorBuffer::Cuda),
            TensorSink::Host(sink) => sink
                .finish()
                .await
                .map(|bytes: Bytes| TensorBuffer::Cpu(bytes)),
        }
    }
}
