//! The GPU receive path of tensorwire: tensors stream from the network through pinned
//! staging buffers into GPU memory with async copies, admitted against a device-memory
//! budget; host memory is used only where asked, where there is no GPU, or (with a warning
//! naming the tensor, and never when the placement is strict) where device memory ran out.
//!
//! - [`GpuStatus::detect`] says what CUDA this process has, and never panics.
//! - [`TensorBuffer`] / [`CudaBuffer`]: tensor bytes in host or device memory.
//! - [`MemoryPool`], [`PinnedMemoryPool`], [`GpuMemoryPool`]: size-class pools, so nothing is
//!   allocated or registered on the data path after warm-up.
//! - [`GpuSink`] (from a [`GpuSinkFactory`]) implements `tensorwire_sink::Sink`; credit for
//!   a chunk is granted again only after its copy to the device has completed, and COMPLETE
//!   is sent only after the last copy has.
//! - [`Placement`] picks GPU or host for a receiver and hands out [`TensorSink`]s;
//!   [`Destinations`] lands tensors of registered names in the application's own memory.
//! - A landed [`CudaBuffer`] is a cudarc slice on the server's stream
//!   ([`CudaBuffer::as_slice`]; from an early hand-off, ordered after its landing event with
//!   no host wait), and any
//!   [`TensorBuffer`] exports as DLPack ([`TensorBuffer::into_dlpack`]).
//! - [`PinnedDatagrams`], as a program's global allocator, puts quinn's received datagrams
//!   in pinned memory, from which the GPU sink copies payloads with no pass through staging.
//! - [`GpuTensorReceiver`] lands one tensor from frames that arrive by any means, no QUIC.
//! - Sharing device memory with other processes: [`DeviceAllocation::export_fd`] (VMM),
//!   [`DeviceAllocation::ipc_handle`] (legacy), [`ImportedMemory`] on the consumer's side, and
//!   [`dlpack`] to hand tensors to PyTorch/JAX/CuPy; `tensorwire-ipc` builds on these.
//!
//! This crate holds the CUDA FFI `unsafe`, in its `cuda` module (and `dlpack`'s C struct);
//! elsewhere only `tensorwire-ipc`'s mapping of shared memory and `tensorwire-c`'s C ABI
//! have any: FFI is layered raw (`cudarc::driver::sys`) →
//! checked (`cudarc::driver::result`) → the safe RAII types of the `cuda` module, and every
//! block says why it is sound.
//!
//! # Example: where tensors will land
//!
//! ```
//! use tensorwire_gpu::{DeviceRequest, GpuRequirement, GpuStatus, Placement};
//!
//! let status = GpuStatus::detect(); // never panics, with or without a driver
//! let placement = Placement::choose(DeviceRequest::Auto, GpuRequirement::Preferred)?;
//! println!("{status}; tensors land in {}", placement.describe());
//! if !status.is_available() {
//!     // Strict placement refuses instead of falling back to host memory.
//!     assert!(Placement::choose(DeviceRequest::Auto, GpuRequirement::Required).is_err());
//! }
//! # Ok::<(), tensorwire_gpu::GpuError>(())
//! ```
mod buffer;
#[cfg(feature = "cuda")]
#[allow(unsafe_code, reason = "CUDA driver FFI and the memory it hands out")]
mod cuda;
mod destination;
#[allow(
    unsafe_code,
    reason = "DLPack is a C struct with raw pointers and a C deleter"
)]
pub mod dlpack;
mod error;
#[cfg(feature = "cuda")]
mod memory_pools;
mod module_format;
mod placement;
mod pool;
mod receiver;
#[cfg(feature = "cuda")]
mod sink;
mod status;

pub use buffer::{CudaBuffer, TensorBuffer};
/// Loading and launching other people's kernels, for the remote-execution worker.
#[cfg(feature = "cuda")]
pub use cuda::kernel;
#[cfg(feature = "cuda")]
pub use cuda::{
    DeviceAllocation, DeviceInfo, DeviceMemoryKind, DeviceRange, DeviceSlice, Element, GpuDevice,
    IPC_HANDLE_LEN, ImportedMemory, IpcHandle, PinnedAllocation, PinnedDatagramStats,
    PinnedDatagrams, pinned_datagram_stats,
};
/// The cudarc this crate is built with: use it for [`CudaBuffer::as_slice`]'s streams so the
/// types match.
#[cfg(feature = "cuda")]
pub use cudarc;
pub use destination::{DestinationSink, Destinations, HostMemory, Landed};
pub use error::GpuError;
#[cfg(feature = "cuda")]
pub use memory_pools::{GpuMemoryPool, PinnedMemoryPool};
pub use module_format::ModuleFormat;
pub use placement::{DeviceRequest, GpuRequirement, Placement, TensorSink};
pub use pool::{Allocation, MemoryPool, PoolConfig, PoolStats, Pooled};
pub use receiver::{GpuReceiverEvent, GpuTensorReceiver, LandError};
#[cfg(feature = "cuda")]
pub use sink::{
    CHECKSUM_ON_DEVICE_FROM, ChecksumOn, DEFAULT_STAGING_POOL, GpuSink, GpuSinkFactory, Handoff,
    HostFallback, STAGING_BUFFER,
};
pub use status::GpuStatus;
#[cfg(feature = "test-util")]
pub use status::gpus_or_skip;
