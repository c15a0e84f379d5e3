//! Device memory another process can map (spec/ipc.md §3): VMM allocations whose physical
//! memory is exported as a POSIX fd, legacy CUDA IPC handles of `cuMemAlloc` memory, and the
//! importing side of both.
//!
//! Facts this follows (measured, see DESIGN): exporting a VMM fd costs ~0.7 ms, so it is done
//! once per allocation and cached; a legacy handle names the whole allocation (consumers must
//! add the tensor's offset), cannot be opened by the exporting process, and opening it twice in
//! one process returns the same pointer, so opens are reference-counted per handle.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use cudarc::driver::sys;

use super::{GpuDevice, allocation_error, cuda, transfer};
use crate::buffer::CudaBuffer;
use crate::error::GpuError;

/// How device memory is allocated, which decides how it can be shared.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceMemoryKind {
    /// `cuMemAlloc`: shareable as a legacy CUDA IPC handle (PyTorch/CuPy can open it).
    #[default]
    Legacy,
    /// `cuMemCreate` with POSIX-fd handles, mapped with `cuMemMap`: shareable as an fd, across
    /// PID namespaces and with peer access to other GPUs. Sizes round up to the granularity.
    Vmm,
    /// The application's own memory, registered as a tensor's destination: never allocated,
    /// freed or exported by tensorwire.
    CallerOwned,
}

/// A legacy CUDA IPC handle: 64 bytes naming a whole `cuMemAlloc` allocation.
///
/// It is a bearer secret (any local process on that GPU holding it can map the memory), so
/// its `Debug` output is redacted; send it only over a checked channel.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcHandle(pub [u8; IPC_HANDLE_LEN]);

/// Bytes in a legacy CUDA IPC handle.
pub const IPC_HANDLE_LEN: usize = 64;

impl std::fmt::Debug for IpcHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("IpcHandle(<redacted>)")
    }
}

fn location(device: sys::CUdevice) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: device,
    }
}

/// Pinned device memory on `device`, exportable as a POSIX fd.
fn vmm_properties(device: sys::CUdevice) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes:
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        location: location(device),
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// The VMM allocation granularity of `device` (2 MiB on Hopper).
pub(crate) fn vmm_granularity(device: &GpuDevice) -> Result<usize, GpuError> {
    let properties = vmm_properties(device.cu_device());
    let mut granularity = 0usize;
    // SAFETY: both pointers are to live locals of the right types.
    unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut granularity,
            &properties,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    }
    .result()
    .map_err(cuda("cuMemGetAllocationGranularity"))?;
    Ok(granularity.max(1))
}

/// Physical memory (a generic allocation handle) mapped read-write at a reserved address range.
/// Dropping it unmaps the range, frees the addresses and releases the handle, in that order;
/// the physical memory itself lives on while another process still maps it.
pub(crate) struct VmmMapping {
    handle: sys::CUmemGenericAllocationHandle,
    ptr: sys::CUdeviceptr,
    len: usize,
    mapped: bool,
}

impl VmmMapping {
    /// New physical memory of at least `len` bytes on `device`, mapped for it.
    pub(crate) fn allocate(device: &GpuDevice, len: usize) -> Result<Self, GpuError> {
        device.bind()?;
        let granularity = vmm_granularity(device)?;
        let rounded = len
            .max(1)
            .checked_next_multiple_of(granularity)
            .ok_or_else(|| GpuError::Bounds(format!("{len} bytes cannot be rounded up")))?;
        let properties = vmm_properties(device.cu_device());
        let mut handle = 0;
        // SAFETY: `handle` and `properties` are live locals; the handle is released in Drop.
        unsafe { sys::cuMemCreate(&mut handle, rounded, &properties, 0) }
            .result()
            .map_err(allocation_error("device (VMM)", rounded, "cuMemCreate"))?;
        Self::map(handle, rounded, granularity, &[device])
    }

    /// Maps `handle` (taken over: released on failure too) at a new address range of `len`
    /// bytes, readable and writable by each of `access` (the first is the owner, whose context
    /// is bound).
    fn map(
        handle: sys::CUmemGenericAllocationHandle,
        len: usize,
        alignment: usize,
        access: &[&GpuDevice],
    ) -> Result<Self, GpuError> {
        let mut mapping = Self {
            handle,
            ptr: 0,
            len,
            mapped: false,
        };
        // SAFETY: writes one address into a live local; the range is freed in Drop.
        unsafe { sys::cuMemAddressReserve(&mut mapping.ptr, len, alignment, 0, 0) }
            .result()
            .map_err(cuda("cuMemAddressReserve"))?;
        // SAFETY: the range was just reserved with exactly `len` bytes, and `handle` holds at
        // least `len` bytes (it was created or imported with that size).
        unsafe { sys::cuMemMap(mapping.ptr, len, 0, handle, 0) }
            .result()
            .map_err(cuda("cuMemMap"))?;
        mapping.mapped = true;
        let descriptors: Vec<sys::CUmemAccessDesc> = access
            .iter()
            .map(|device| sys::CUmemAccessDesc {
                location: location(device.cu_device()),
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            })
            .collect();
        // SAFETY: the range is mapped; the descriptor slice is live for the call.
        unsafe { sys::cuMemSetAccess(mapping.ptr, len, descriptors.as_ptr(), descriptors.len()) }
            .result()
            .map_err(cuda("cuMemSetAccess"))?;
        Ok(mapping)
    }

    /// Imports physical memory another process exported as `fd` (`len` bytes: the whole
    /// allocation) and maps it for each of `access`; `access[0]` owns the memory.
    pub(crate) fn import(
        fd: &OwnedFd,
        len: usize,
        access: &[&GpuDevice],
    ) -> Result<Self, GpuError> {
        let owner = access
            .first()
            .ok_or_else(|| GpuError::Bounds("importing memory for no device".into()))?;
        owner.bind()?;
        let granularity = vmm_granularity(owner)?;
        if len == 0 || !len.is_multiple_of(granularity) {
            return Err(GpuError::Bounds(format!(
                "{len} bytes is not a whole number of {granularity}-byte VMM granules"
            )));
        }
        let mut handle = 0;
        // SAFETY: for POSIX fds the driver takes the descriptor's number cast to a pointer and
        // does not take ownership; the fd stays open for the call.
        unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                fd.as_raw_fd() as usize as *mut std::ffi::c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        }
        .result()
        .map_err(cuda("cuMemImportFromShareableHandle"))?;
        Self::map(handle, len, granularity, access)
    }

    /// Exports the physical memory as a new POSIX fd (~0.7 ms: callers cache it).
    pub(crate) fn export_fd(&self) -> Result<OwnedFd, GpuError> {
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: for POSIX fds the driver writes an int through the pointer; `fd` is a live
        // local of that type.
        unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut std::ffi::c_int).cast(),
                self.handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        }
        .result()
        .map_err(cuda("cuMemExportToShareableHandle"))?;
        if fd < 0 {
            return Err(GpuError::Cuda {
                call: "cuMemExportToShareableHandle",
                error: format!("returned fd {fd}"),
            });
        }
        // SAFETY: the driver just created this descriptor for us; nothing else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    pub(crate) fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for VmmMapping {
    fn drop(&mut self) {
        // Each step undoes one successful step of `map`/`allocate`, once, on this value's own
        // range and handle; owners finish their copies before dropping it.
        if self.mapped {
            // SAFETY: the range is mapped (see above).
            let unmapped = unsafe { sys::cuMemUnmap(self.ptr, self.len) }.result();
            if let Err(e) = unmapped {
                tracing::error!(error = %e, "cuMemUnmap failed");
            }
        }
        if self.ptr != 0 {
            // SAFETY: the range was reserved with this length and is no longer mapped.
            let freed = unsafe { sys::cuMemAddressFree(self.ptr, self.len) }.result();
            if let Err(e) = freed {
                tracing::error!(error = %e, "cuMemAddressFree failed");
            }
        }
        // SAFETY: the handle is this value's and nothing maps it here any more.
        if let Err(e) = unsafe { sys::cuMemRelease(self.handle) }.result() {
            tracing::error!(error = %e, "cuMemRelease failed");
        }
    }
}

/// The legacy IPC handle of the `cuMemAlloc` allocation starting at `base`.
pub(crate) fn ipc_handle(
    device: &GpuDevice,
    base: sys::CUdeviceptr,
) -> Result<IpcHandle, GpuError> {
    device.bind()?;
    let mut handle = sys::CUipcMemHandle {
        reserved: [0; IPC_HANDLE_LEN],
    };
    // SAFETY: `base` is a live cuMemAlloc allocation of the current context (caller); the
    // handle is a live local.
    unsafe { sys::cuIpcGetMemHandle(&mut handle, base) }
        .result()
        .map_err(cuda("cuIpcGetMemHandle"))?;
    Ok(IpcHandle(handle.reserved.map(|b| b as u8)))
}

/// Handles this process has opened, with how many [`ImportedMemory`] values use each: the
/// driver maps a handle once per process, so it is closed only when the last user is gone.
fn opened_handles() -> &'static Mutex<HashMap<IpcHandle, (sys::CUdeviceptr, usize)>> {
    static OPENED: OnceLock<Mutex<HashMap<IpcHandle, (sys::CUdeviceptr, usize)>>> = OnceLock::new();
    OPENED.get_or_init(Default::default)
}

enum Source {
    /// Held for its `Drop`, which unmaps.
    Vmm {
        _mapping: VmmMapping,
    },
    CudaIpc(IpcHandle),
}

/// Device memory another process shared with this one, mapped here; unmapped on drop.
pub struct ImportedMemory {
    device: Arc<GpuDevice>,
    ptr: sys::CUdeviceptr,
    len: usize,
    /// A VMM mapping unmaps itself when this drops (after `Drop` bound the context).
    source: Source,
}

impl std::fmt::Debug for ImportedMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.source {
            Source::Vmm { .. } => "vmm",
            Source::CudaIpc(_) => "cuda_ipc",
        };
        write!(
            f,
            "ImportedMemory({} bytes, {kind}, cuda:{})",
            self.len,
            self.device.ordinal()
        )
    }
}

impl ImportedMemory {
    /// Imports a VMM allocation of `len` bytes exported as `fd`, owned by `device`, and makes
    /// it readable and writable by `device` and each of `peers` (other GPUs of this host).
    pub fn import_fd(
        fd: &OwnedFd,
        len: usize,
        device: &Arc<GpuDevice>,
        peers: &[Arc<GpuDevice>],
    ) -> Result<Self, GpuError> {
        let mut access: Vec<&GpuDevice> = vec![device];
        access.extend(
            peers
                .iter()
                .filter(|p| !Arc::ptr_eq(p, device))
                .map(Arc::as_ref),
        );
        let mapping = VmmMapping::import(fd, len, &access)?;
        Ok(Self {
            device: device.clone(),
            ptr: mapping.ptr(),
            len: mapping.len(),
            source: Source::Vmm { _mapping: mapping },
        })
    }

    /// Opens a legacy IPC handle of a `len`-byte allocation on `device`. Fails in the process
    /// that exported it (a driver rule).
    pub fn open_ipc_handle(
        handle: &IpcHandle,
        len: usize,
        device: &Arc<GpuDevice>,
    ) -> Result<Self, GpuError> {
        device.bind()?;
        let mut opened = opened_handles()
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let ptr = match opened.get_mut(handle) {
            Some((ptr, users)) => {
                *users += 1;
                *ptr
            }
            None => {
                let mut ptr = 0;
                let raw = sys::CUipcMemHandle {
                    reserved: handle.0.map(|b| b as std::ffi::c_char),
                };
                // SAFETY: writes one pointer into a live local; the mapping is closed once,
                // when the last user of this handle drops.
                unsafe {
                    sys::cuIpcOpenMemHandle_v2(
                        &mut ptr,
                        raw,
                        sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                    )
                }
                .result()
                .map_err(cuda("cuIpcOpenMemHandle"))?;
                opened.insert(*handle, (ptr, 1));
                ptr
            }
        };
        Ok(Self {
            device: device.clone(),
            ptr,
            len,
            source: Source::CudaIpc(*handle),
        })
    }

    /// The device address of the first byte of the shared allocation.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is mapped.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device the memory lives on.
    pub fn device(&self) -> &Arc<GpuDevice> {
        &self.device
    }

    /// Copies bytes from `offset` into `dst` (synchronously).
    pub fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<(), GpuError> {
        transfer::read(&self.device, self.ptr, self.len, offset, dst)
    }

    /// Copies `src` to byte `offset` (synchronously): the exporting process sees the write.
    pub fn copy_from_host(&self, offset: usize, src: &[u8]) -> Result<(), GpuError> {
        transfer::write(&self.device, self.ptr, self.len, offset, src)
    }

    /// Copies `dst.len()` bytes from byte `offset` into `dst`, on any GPU of this process that
    /// may access this memory (VMM memory imported for all GPUs; legacy handles open with lazy
    /// peer access).
    pub fn copy_to_device(&self, offset: usize, dst: &mut CudaBuffer) -> Result<(), GpuError> {
        let len = dst.len();
        transfer::check_range(offset, len, self.len)?;
        if len == 0 {
            return Ok(());
        }
        let target = dst.allocation_mut()?;
        self.device.synchronize_copies()?;
        target.device().synchronize_copies()?;
        // SAFETY: the source range was checked to lie inside this mapping and the destination
        // is a live allocation of at least `len` bytes, both kept until the copy completed
        // (waited for below); with unified addressing cuMemcpy copies between any two device
        // addresses.
        let copied = unsafe { sys::cuMemcpy(target.device_ptr(), self.ptr + offset as u64, len) }
            .result()
            .map_err(cuda("cuMemcpy"));
        // A device-to-device cuMemcpy returns before it finishes: wait for it.
        let finished = transfer::finish_device_copies(&self.device, target.device());
        copied.and(finished)
    }
}

impl Drop for ImportedMemory {
    fn drop(&mut self) {
        let _ = self.device.bind();
        let Source::CudaIpc(handle) = &self.source else {
            return;
        };
        let mut opened = opened_handles()
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let Some((_, users)) = opened.get_mut(handle) else {
            return;
        };
        *users -= 1;
        if *users == 0 {
            opened.remove(handle);
            // SAFETY: opened by cuIpcOpenMemHandle above; this was its last user.
            if let Err(e) = unsafe { sys::cuIpcCloseMemHandle(self.ptr) }.result() {
                tracing::error!(error = %e, "cuIpcCloseMemHandle failed");
            }
        }
    }
}
