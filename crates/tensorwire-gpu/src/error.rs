//! Typed GPU errors; none panics, and each maps to a wire code when it ends a tensor.

use tensorwire_proto::ErrorCode;
use tensorwire_sink::SinkError;

/// Why a GPU operation failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    /// This build has no CUDA support (the `cuda` feature is off).
    #[error("this build has no CUDA support (cargo feature `cuda` is off)")]
    NotCompiled,
    /// No usable CUDA driver (libcuda) on this machine.
    #[error("no CUDA driver: {0}")]
    NoDriver(String),
    /// The requested device does not exist.
    #[error("no CUDA device {requested} (this machine has {available})")]
    NoDevice {
        /// The ordinal asked for.
        requested: usize,
        /// How many devices there are.
        available: usize,
    },
    /// The device (or host, for pinned memory) is out of memory.
    #[error("out of {what} memory: {bytes} bytes")]
    OutOfMemory {
        /// "device" or "pinned host".
        what: &'static str,
        /// How much was asked for.
        bytes: usize,
    },
    /// A pool reached its byte limit.
    #[error("{pool} pool exhausted: {requested} bytes asked, {in_use} of {max} bytes in use")]
    PoolExhausted {
        /// Which pool.
        pool: &'static str,
        /// Bytes asked for.
        requested: usize,
        /// Bytes held by callers.
        in_use: usize,
        /// The pool's limit.
        max: usize,
    },
    /// The device-memory budget has no room for the tensor.
    #[error("cuda:{device} memory budget: {message}")]
    BudgetExhausted {
        /// The device's ordinal.
        device: usize,
        /// How much was asked and how much is in use.
        message: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA {call} failed: {error}")]
    Cuda {
        /// The driver call.
        call: &'static str,
        /// The driver's error name and text.
        error: String,
    },
    /// Lengths or offsets do not fit.
    #[error("{0}")]
    Bounds(String),
    /// A pool's buffers are all smaller than the request (callers allocate directly).
    #[error("{pool} pool: {requested} bytes exceeds its largest buffer ({largest})")]
    LargerThanPoolBuffers {
        /// Which pool.
        pool: &'static str,
        /// Bytes asked for.
        requested: usize,
        /// Its largest buffer.
        largest: usize,
    },
    /// Settings that cannot work together.
    #[error("configuration: {0}")]
    InvalidConfig(String),
    /// This memory cannot be shared the way asked.
    #[error("cannot export: {0}")]
    NotExportable(String),
    /// Others hold this buffer (a view, an early hand-off or a copy in flight), so it cannot
    /// be written through this handle.
    #[error("buffer in use: {0}")]
    InUse(String),
    /// The tensor ended (failed or was cancelled) before its destination was handed over.
    #[error("no hand-off: {0}")]
    NoHandoff(String),
    /// A typed view asked for a Rust type that is not the tensor's dtype.
    #[error("a {dtype} tensor cannot be viewed as {rust_type}")]
    WrongType {
        /// The tensor's dtype.
        dtype: tensorwire_proto::DType,
        /// The Rust element type asked for.
        rust_type: &'static str,
    },
    /// No GPU of this host has the UUID a descriptor names.
    #[error("no GPU with UUID {0} on this host (is it hidden by CUDA_VISIBLE_DEVICES?)")]
    UnknownDevice(String),
}

impl GpuError {
    /// The wire code a tensor ended by this error carries.
    pub fn code(&self) -> ErrorCode {
        match self {
            GpuError::OutOfMemory { .. }
            | GpuError::PoolExhausted { .. }
            | GpuError::LargerThanPoolBuffers { .. }
            | GpuError::BudgetExhausted { .. } => ErrorCode::RESOURCE_EXHAUSTED,
            GpuError::InvalidConfig(_) => ErrorCode::INTERNAL,
            GpuError::NotCompiled | GpuError::NoDriver(_) | GpuError::NoDevice { .. } => {
                ErrorCode::UNSUPPORTED_DEVICE
            }
            GpuError::Cuda { .. }
            | GpuError::Bounds(_)
            | GpuError::NotExportable(_)
            | GpuError::InUse(_)
            | GpuError::NoHandoff(_)
            | GpuError::UnknownDevice(_) => ErrorCode::SINK_FAILED,
            GpuError::WrongType { .. } => ErrorCode::UNSUPPORTED_DTYPE,
        }
    }
}

impl From<GpuError> for SinkError {
    fn from(e: GpuError) -> Self {
        SinkError {
            code: e.code(),
            message: e.to_string(),
        }
    }
}
