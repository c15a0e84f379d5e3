//! Loading modules and launching kernels that someone else wrote: the GPU half of remote
//! execution (spec §14.5). Meant for an isolated worker process, because a kernel is arbitrary
//! code: see [`launch`].

use std::ffi::{CString, c_void};
use std::sync::Arc;
use std::time::Duration;

use crate::ModuleFormat;
use cudarc::driver::{result, sys};

use super::{GpuDevice, ImportedMemory, require_driver};
use crate::error::GpuError;

/// What went wrong loading or running a kernel, sorted by who is to blame.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KernelError {
    /// The module does not load on this GPU (bad PTX, another architecture) or lacks the
    /// function.
    #[error("{0}")]
    Module(String),
    /// The kernel faulted or could not be launched with its configuration.
    #[error("{message}")]
    Fault {
        /// What the driver said.
        message: String,
        /// Whether the context is now unusable (an illegal address, a trap): the process
        /// must end, as a sticky error poisons every later call.
        sticky: bool,
    },
    /// The device itself failed (no memory, no driver).
    #[error(transparent)]
    Device(#[from] GpuError),
}

/// The architecture a cubin (CUDA ELF) was built for, as `(major, minor)`; `None` if the
/// bytes are not a 64-bit CUDA ELF.
///
/// The SM number sits in `e_flags`: its low byte for ELF ABI versions before 8, its second
/// byte from version 8 (CUDA 12.8 on), as LLVM's `EF_CUDA_SM` and `EF_CUDA_SM_MASK` say.
pub fn cubin_architecture(bytes: &[u8]) -> Option<(u32, u32)> {
    const EM_CUDA: u16 = 190;
    if bytes.len() < 52 || !bytes.starts_with(b"\x7fELF") || bytes[4] != 2 {
        return None;
    }
    let machine = u16::from_le_bytes([bytes[18], bytes[19]]);
    if machine != EM_CUDA {
        return None;
    }
    let abi_version = bytes[8];
    let flags = u32::from_le_bytes([bytes[48], bytes[49], bytes[50], bytes[51]]);
    let sm = if abi_version >= 8 {
        (flags >> 8) & 0xff
    } else {
        flags & 0xff
    };
    (sm != 0).then_some((sm / 10, sm % 10))
}

/// Whether a cubin for `cubin` runs on a GPU of compute capability `device`: the same major
/// version and a minor version no newer (the driver's own rule for SASS).
pub fn cubin_runs_on(cubin: (u32, u32), device: (u32, u32)) -> bool {
    cubin.0 == device.0 && cubin.1 <= device.1
}

/// A module loaded into a device's context; unloaded on drop.
pub struct LoadedModule {
    device: Arc<GpuDevice>,
    module: sys::CUmodule,
}

// SAFETY: a CUmodule is a handle valid in its context from any thread; every use binds the
// context first.
unsafe impl Send for LoadedModule {}

impl std::fmt::Debug for LoadedModule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LoadedModule(cuda:{})", self.device.ordinal())
    }
}

/// A kernel argument as the launch passes it.
#[derive(Debug)]
pub enum KernelArg<'a> {
    /// A pointer to `len` bytes at `offset` in memory mapped here.
    Buffer {
        /// The mapping.
        memory: &'a ImportedMemory,
        /// Where the tensor starts in it.
        offset: usize,
        /// The tensor's length (0: a null pointer is passed).
        len: usize,
    },
    /// A value passed by value, as its little-endian bytes (1 to 8 of them).
    Value(Vec<u8>),
}

impl LoadedModule {
    /// Loads `bytes`, a module in `format`, on `device`: PTX is compiled for the device now,
    /// a cubin or fatbin read by its own headers. A cubin for another architecture is refused
    /// with a message naming both, before the driver sees it.
    pub fn load(
        device: &Arc<GpuDevice>,
        bytes: &[u8],
        format: ModuleFormat,
    ) -> Result<Self, KernelError> {
        require_driver()?;
        device.bind()?;
        let (major, minor) = device.info().compute_capability;
        let here = (major.max(0) as u32, minor.max(0) as u32);
        if let Some(arch) = cubin_architecture(bytes)
            && !cubin_runs_on(arch, here)
        {
            return Err(KernelError::Module(format!(
                "the cubin is for sm_{}{}; this GPU ({}) is sm_{}{}",
                arch.0,
                arch.1,
                device.info().name,
                here.0,
                here.1
            )));
        }
        // PTX must end in NUL; a cubin or fatbin is read by its own headers.
        let mut image = bytes.to_vec();
        if format == ModuleFormat::Ptx {
            if image.contains(&0) {
                return Err(KernelError::Module(
                    "the PTX text contains a NUL byte".into(),
                ));
            }
            image.push(0);
        }
        let mut log = vec![0u8; 8192];
        let mut options = [
            sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
            sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
        ];
        let mut values = [log.as_mut_ptr().cast::<c_void>(), log.len() as *mut c_void];
        let mut module = std::ptr::null_mut();
        // SAFETY: `image` is a complete module image (NUL-terminated for PTX) that outlives
        // the call; the option arrays have two entries each, the log buffer's pointer and
        // its size passed by value as the JIT API wants; the context is bound above.
        let loaded = unsafe {
            sys::cuModuleLoadDataEx(
                &mut module,
                image.as_ptr().cast(),
                options.len() as u32,
                options.as_mut_ptr(),
                values.as_mut_ptr(),
            )
        };
        if loaded != sys::cudaError_enum::CUDA_SUCCESS {
            let log = String::from_utf8_lossy(&log);
            let log = log.trim_end_matches('\0').trim();
            let detail = if log.is_empty() {
                String::new()
            } else {
                format!(": {log}")
            };
            let hint = match (loaded, cubin_architecture(bytes)) {
                (sys::cudaError_enum::CUDA_ERROR_NO_BINARY_FOR_GPU, Some(arch)) => format!(
                    " (the cubin is for sm_{}{}; this GPU is sm_{}{})",
                    arch.0, arch.1, here.0, here.1
                ),
                (sys::cudaError_enum::CUDA_ERROR_NO_BINARY_FOR_GPU, None) => format!(
                    " (nothing in the module is for this GPU, sm_{}{})",
                    here.0, here.1
                ),
                _ => String::new(),
            };
            return Err(KernelError::Module(format!(
                "the module does not load: {}{hint}{detail}",
                describe(loaded)
            )));
        }
        Ok(Self {
            device: device.clone(),
            module,
        })
    }

    /// Checks that the module has `function`.
    pub fn has_function(&self, function: &str) -> Result<(), KernelError> {
        self.function(function).map(drop)
    }

    fn function(&self, function: &str) -> Result<sys::CUfunction, KernelError> {
        let name = CString::new(function)
            .map_err(|_| KernelError::Module(format!("function name {function:?} has a NUL")))?;
        self.device.bind()?;
        // SAFETY: the module is loaded (it is unloaded only in Drop) and its context is bound.
        unsafe { result::module::get_function(self.module, name) }.map_err(|e| {
            KernelError::Module(format!(
                "the module has no function {function:?} ({}); for C++ kernels declare it \
                 extern \"C\" or give the mangled name",
                describe(e.0)
            ))
        })
    }
}

impl Drop for LoadedModule {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: loaded in this context and unloaded only here.
            let _ = unsafe { result::module::unload(self.module) };
        }
    }
}

/// Grid, block and shared memory of a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks in x, y, z.
    pub grid: [u32; 3],
    /// Threads per block in x, y, z.
    pub block: [u32; 3],
    /// Dynamic shared memory per block, in bytes.
    pub shared_mem_bytes: u32,
}

/// Zeroes each of `outputs` (byte ranges of mapped memory), runs `function` of `module` with
/// `args` on a new stream, waits for it, and returns the kernel's time between CUDA events
/// recorded just before and just after it.
///
/// # Safety
/// The kernel is arbitrary code: it may read and write any device memory of this process's
/// context, including host memory mapped into it (pinned buffers). Call it only in a process
/// that holds nothing else a kernel could corrupt, and that ends when the context is lost
/// (`KernelError::Fault { sticky: true }`): the remote-execution worker.
pub unsafe fn launch(
    module: &LoadedModule,
    function: &str,
    config: LaunchConfig,
    args: &[KernelArg<'_>],
    outputs: &[(&ImportedMemory, usize, usize)],
) -> Result<Duration, KernelError> {
    let f = module.function(function)?;
    let device = &module.device;
    device.bind()?;
    // One slot per argument, each holding the value the kernel parameter is copied from.
    let mut slots: Vec<[u8; 8]> = Vec::with_capacity(args.len());
    for arg in args {
        let mut slot = [0u8; 8];
        match arg {
            KernelArg::Buffer {
                memory,
                offset,
                len,
            } => {
                super::check_range(*offset, *len, memory.len())?;
                let ptr = if *len == 0 {
                    0
                } else {
                    memory.device_ptr() + *offset as u64
                };
                slot = ptr.to_le_bytes();
            }
            KernelArg::Value(bytes) if (1..=8).contains(&bytes.len()) => {
                slot[..bytes.len()].copy_from_slice(bytes);
            }
            KernelArg::Value(bytes) => {
                return Err(GpuError::InvalidConfig(format!(
                    "a by-value argument of {} bytes (1 to 8 are passed)",
                    bytes.len()
                ))
                .into());
            }
        }
        slots.push(slot);
    }
    let mut params: Vec<*mut c_void> = slots
        .iter_mut()
        .map(|slot| slot.as_mut_ptr().cast())
        .collect();
    let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
        .map_err(super::cuda("cuStreamCreate"))?;
    let start = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
        .map_err(super::cuda("cuEventCreate"))?;
    let end = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
        .map_err(super::cuda("cuEventCreate"))?;
    let outcome = (|| {
        for (memory, offset, len) in outputs {
            super::check_range(*offset, *len, memory.len())?;
            if *len > 0 {
                // SAFETY: the range was checked to lie inside the mapping; the stream is live.
                unsafe {
                    result::memset_d8_async(memory.device_ptr() + *offset as u64, 0, *len, stream)
                }
                .map_err(super::cuda("cuMemsetD8Async"))?;
            }
        }
        // SAFETY: both events and the stream were created above in the bound context.
        unsafe { result::event::record(start, stream) }.map_err(super::cuda("cuEventRecord"))?;
        // SAFETY: the caller accepts that the kernel is arbitrary code (this fn's contract).
        // Each parameter points at an 8-byte slot that outlives the call (the driver copies
        // parameters at launch); pointer arguments were checked to lie in their mappings.
        unsafe {
            result::launch_kernel(
                f,
                (config.grid[0], config.grid[1], config.grid[2]),
                (config.block[0], config.block[1], config.block[2]),
                config.shared_mem_bytes,
                stream,
                &mut params,
            )
        }
        .map_err(|e| fault(e.0, "cuLaunchKernel"))?;
        // SAFETY: as for `start`.
        unsafe { result::event::record(end, stream) }.map_err(super::cuda("cuEventRecord"))?;
        // SAFETY: `end` is a live event of this context.
        unsafe { result::event::synchronize(end) }.map_err(|e| fault(e.0, "the kernel"))?;
        // SAFETY: both events were recorded and `end` has completed.
        let ms = unsafe { result::event::elapsed(start, end) }
            .map_err(super::cuda("cuEventElapsedTime"))?;
        Ok(Duration::from_nanos((f64::from(ms) * 1e6) as u64))
    })();
    // SAFETY: created above, destroyed once; a sticky error leaves them to the dying context.
    unsafe {
        let _ = result::event::destroy(start);
        let _ = result::event::destroy(end);
        let _ = result::stream::destroy(stream);
    }
    outcome
}

/// The CUDA driver's version as `(major, minor)`, e.g. `(13, 0)`.
pub fn driver_version() -> Result<(i32, i32), GpuError> {
    require_driver()?;
    let mut version = 0;
    // SAFETY: writes one int; the driver is loaded (checked above).
    let status = unsafe { sys::cuDriverGetVersion(&mut version) };
    if status != sys::cudaError_enum::CUDA_SUCCESS {
        return Err(GpuError::Cuda {
            call: "cuDriverGetVersion",
            error: describe(status),
        });
    }
    Ok((version / 1000, (version % 1000) / 10))
}

/// The device's multiprocessor count.
pub fn multiprocessor_count(device: &GpuDevice) -> Result<u32, GpuError> {
    // SAFETY: a read-only attribute query of a valid device handle.
    let count = unsafe {
        result::device::get_attribute(
            device.cu_device(),
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )
    }
    .map_err(super::cuda("cuDeviceGetAttribute"))?;
    Ok(count.max(0) as u32)
}

fn describe(status: sys::CUresult) -> String {
    let error = result::DriverError(status);
    let name = error
        .error_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{status:?}"));
    let text = error
        .error_string()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    format!("{name} ({}): {text}", status as i32)
}

/// A launch or run error; those that poison the context are sticky.
fn fault(status: sys::CUresult, during: &str) -> KernelError {
    use sys::cudaError_enum as E;
    let sticky = matches!(
        status,
        E::CUDA_ERROR_ILLEGAL_ADDRESS
            | E::CUDA_ERROR_LAUNCH_FAILED
            | E::CUDA_ERROR_MISALIGNED_ADDRESS
            | E::CUDA_ERROR_INVALID_ADDRESS_SPACE
            | E::CUDA_ERROR_INVALID_PC
            | E::CUDA_ERROR_ILLEGAL_INSTRUCTION
            | E::CUDA_ERROR_HARDWARE_STACK_ERROR
            | E::CUDA_ERROR_ASSERT
            | E::CUDA_ERROR_LAUNCH_TIMEOUT
            | E::CUDA_ERROR_ECC_UNCORRECTABLE
    );
    KernelError::Fault {
        message: format!("{during}: {}", describe(status)),
        sticky,
    }
}
