//! CRC-32C of device memory, on the device: a GPU receiver checks a tensor's END checksum
//! over its landed bytes (spec §7.3), so no CPU core reads them a second time. The kernel
//! (`kernels/crc32c.cu`, shipped as PTX the driver compiles for the GPU at hand) checksums
//! equal pieces, one per thread; the host combines the pieces' CRCs.

use std::ffi::{CString, c_void};

use cudarc::driver::{result, sys};

use super::cuda;
use crate::error::GpuError;

/// The kernel as PTX for `sm_75` and later (PTX ISA 7.0, so drivers from CUDA 11 on load it).
const PTX: &str = include_str!("../../kernels/crc32c.ptx");

/// The kernel's name in [`PTX`].
const FUNCTION: &str = "tensorwire_crc32c_chunks";

/// Threads per block: each checksums one piece.
const THREADS_PER_BLOCK: u32 = 256;

/// The checksum kernel, loaded in one device's primary context (which lives as long as the
/// process: devices are opened once and never closed).
pub(crate) struct ChecksumKernel {
    function: sys::CUfunction,
}

// SAFETY: a CUfunction is a handle valid in its context from any thread; every launch binds
// the context first.
unsafe impl Send for ChecksumKernel {}
// SAFETY: as above; launching one function from several threads at once is allowed.
unsafe impl Sync for ChecksumKernel {}

impl ChecksumKernel {
    /// Loads the kernel into the context current on this thread.
    pub(crate) fn load() -> Result<Self, GpuError> {
        let image = CString::new(PTX).map_err(|_| GpuError::Cuda {
            call: "cuModuleLoadData",
            error: "the checksum kernel's PTX has a NUL byte".into(),
        })?;
        // SAFETY: `image` is NUL-terminated PTX that outlives the call; the caller bound the
        // context. The module is never unloaded: it lives as long as its device.
        let module = unsafe { result::module::load_data(image.as_ptr().cast()) }
            .map_err(cuda("cuModuleLoadData (checksum kernel)"))?;
        let name = CString::new(FUNCTION).map_err(|_| GpuError::Cuda {
            call: "cuModuleGetFunction",
            error: "the kernel's name has a NUL byte".into(),
        })?;
        // SAFETY: the module was loaded just above in the current context.
        let function = unsafe { result::module::get_function(module, name) }
            .map_err(cuda("cuModuleGetFunction (checksum kernel)"))?;
        Ok(Self { function })
    }

    /// Enqueues on `stream` the CRC-32C of each `piece` bytes of the `len` bytes at device
    /// address `data` (the last piece shorter), written to `out` as one `u32` per piece.
    ///
    /// # Safety
    /// `data..data + len` must be device memory of the current context, and `out` pinned
    /// host memory of at least `4 · len.div_ceil(piece)` bytes, both kept allocated and
    /// `out` unread until the work completes; `stream` must be live in the current context.
    pub(crate) unsafe fn enqueue(
        &self,
        data: u64,
        len: usize,
        piece: usize,
        out: *const u8,
        stream: sys::CUstream,
    ) -> Result<(), GpuError> {
        let pieces = len.div_ceil(piece.max(1));
        let blocks = u32::try_from(pieces.div_ceil(THREADS_PER_BLOCK as usize))
            .map_err(|_| GpuError::Bounds(format!("{pieces} checksum pieces in one launch")))?;
        let mut out_on_device: sys::CUdeviceptr = 0;
        // SAFETY: `out` is pinned memory (the caller's contract); the call only translates
        // its address, which the device writes through.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut out_on_device, out.cast_mut().cast(), 0) }
            .result()
            .map_err(cuda("cuMemHostGetDevicePointer"))?;
        // The kernel's parameters, in order: data, len, piece, out, pieces (all 64-bit).
        let mut slots: [u64; 5] = [data, len as u64, piece as u64, out_on_device, pieces as u64];
        let mut params: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|slot| std::ptr::from_mut(slot).cast())
            .collect();
        // SAFETY: the kernel reads `len` bytes at `data` and writes `pieces` u32s at `out`,
        // both valid until the work completes (the caller's contract); each parameter points
        // at a live 8-byte slot matching the kernel's signature, copied at launch.
        unsafe {
            result::launch_kernel(
                self.function,
                (blocks, 1, 1),
                (THREADS_PER_BLOCK, 1, 1),
                0,
                stream,
                &mut params,
            )
        }
        .map_err(cuda("cuLaunchKernel (checksum kernel)"))
    }
}
