//! Errors of the sharing layer.

use crate::message::RefusalCode;

/// Why a sharing operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IpcError {
    /// The socket or its directory is unusable.
    #[error("configuration: {0}")]
    Config(String),
    /// Could not reach the producer.
    #[error("connect: {0}")]
    Connect(String),
    /// A malformed or oversized message.
    #[error("bad message: {0}")]
    BadMessage(String),
    /// The producer answered with an error.
    #[error("producer refused: {code:?}: {message}")]
    Refused {
        /// The error code (spec/ipc.md §2).
        code: RefusalCode,
        /// The producer's explanation.
        message: String,
    },
    /// The connection closed.
    #[error("the producer closed the connection")]
    Closed,
    /// A system call failed.
    #[error("IO: {0}")]
    Io(#[from] std::io::Error),
    /// The tensor is in GPU memory and this build has no CUDA (the `cuda` feature is off).
    #[error("{0} tensors need the `cuda` feature")]
    NoCuda(&'static str),
    /// A CUDA call failed (exporting, importing or copying device memory).
    #[cfg(feature = "cuda")]
    #[error("GPU: {0}")]
    Gpu(#[from] tensorwire_gpu::GpuError),
}

impl From<rustix::io::Errno> for IpcError {
    fn from(e: rustix::io::Errno) -> Self {
        IpcError::Io(e.into())
    }
}
