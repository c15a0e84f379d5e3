//! RAII device and pinned host allocations.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{result, sys};

use super::share::{self, DeviceMemoryKind, IpcHandle, VmmMapping};
use super::transfer::{check_range, finish_device_copies, read, write};
use super::{GpuDevice, allocation_error, cuda};
use crate::error::GpuError;
use crate::pool::Allocation;

/// `len` bytes of device memory, from `cuMemAlloc` or (for VMM sharing) `cuMemCreate`;
/// freed on drop.
pub struct DeviceAllocation {
    ptr: sys::CUdeviceptr,
    len: usize,
    device: Arc<GpuDevice>,
    /// Boxed: export state is large and only sharing uses it.
    backing: Box<Backing>,
    /// Times a pool handed this allocation out again (spec/ipc.md: descriptors carry it).
    generation: u64,
}

enum Backing {
    /// `cuMemAlloc`; its legacy IPC handle once asked for.
    Legacy { ipc_handle: OnceLock<IpcHandle> },
    /// `cuMemCreate`; its exported fd once asked for (exporting costs ~0.7 ms).
    Vmm {
        /// Unmapped when the allocation drops, after its pending copies (see `Drop`).
        mapping: VmmMapping,
        fd: OnceLock<OwnedFd>,
    },
    /// The application's memory (a registered destination): `owner` keeps it allocated;
    /// never freed or exported here.
    CallerOwned {
        _owner: Box<dyn std::any::Any + Send + Sync>,
    },
    /// A whole `cuMemAlloc` allocation of another allocator (a framework's), shared through
    /// its legacy IPC handle: `owner` keeps the tensor in it allocated; never freed here.
    Borrowed {
        ipc_handle: OnceLock<IpcHandle>,
        _owner: Box<dyn std::any::Any + Send + Sync>,
    },
}

impl std::fmt::Debug for DeviceAllocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceAllocation({} bytes, {:?}, on cuda:{})",
            self.len,
            self.kind(),
            self.device.ordinal()
        )
    }
}

impl DeviceAllocation {
    /// Allocates `len` bytes on `device` with `cuMemAlloc` (no memory for `len == 0`).
    pub fn new(device: &Arc<GpuDevice>, len: usize) -> Result<Self, GpuError> {
        let ptr = if len == 0 {
            0
        } else {
            device.bind()?;
            // SAFETY: the device's context is current; the pointer is freed exactly once, in Drop.
            unsafe { result::malloc_sync(len) }.map_err(allocation_error(
                "device",
                len,
                "cuMemAlloc",
            ))?
        };
        Ok(Self {
            ptr,
            len,
            device: device.clone(),
            backing: Box::new(Backing::Legacy {
                ipc_handle: OnceLock::new(),
            }),
            generation: 0,
        })
    }

    /// Allocates at least `len` bytes on `device` as VMM memory exportable as a POSIX fd;
    /// [`len`](Allocation::len) is rounded up to the allocation granularity.
    pub fn new_vmm(device: &Arc<GpuDevice>, len: usize) -> Result<Self, GpuError> {
        let mapping = VmmMapping::allocate(device, len)?;
        Ok(Self {
            ptr: mapping.ptr(),
            len: mapping.len(),
            device: device.clone(),
            backing: Box::new(Backing::Vmm {
                mapping,
                fd: OnceLock::new(),
            }),
            generation: 0,
        })
    }

    /// `len` bytes at `ptr` that the application owns, kept allocated by `owner` for as long
    /// as this value lives; dropping it frees nothing.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be device memory of `device`'s primary context that stays
    /// allocated while `owner` lives, and that tensorwire may write.
    pub(crate) unsafe fn caller_owned(
        device: &Arc<GpuDevice>,
        ptr: sys::CUdeviceptr,
        len: usize,
        owner: Box<dyn std::any::Any + Send + Sync>,
    ) -> Self {
        Self {
            ptr,
            len,
            device: device.clone(),
            backing: Box::new(Backing::CallerOwned { _owner: owner }),
            generation: 0,
        }
    }

    /// Allocates `len` bytes of `kind` on `device`.
    pub fn with_kind(
        device: &Arc<GpuDevice>,
        len: usize,
        kind: DeviceMemoryKind,
    ) -> Result<Self, GpuError> {
        match kind {
            DeviceMemoryKind::Legacy => Self::new(device, len),
            DeviceMemoryKind::Vmm => Self::new_vmm(device, len),
            DeviceMemoryKind::CallerOwned => Err(GpuError::InvalidConfig(
                "caller-owned memory is registered, not allocated".into(),
            )),
        }
    }

    /// How the memory was allocated, which says how it can be shared (another allocator's
    /// `cuMemAlloc` memory is `Legacy`: shared the same way, though never freed here).
    pub fn kind(&self) -> DeviceMemoryKind {
        match *self.backing {
            Backing::Legacy { .. } | Backing::Borrowed { .. } => DeviceMemoryKind::Legacy,
            Backing::Vmm { .. } => DeviceMemoryKind::Vmm,
            Backing::CallerOwned { .. } => DeviceMemoryKind::CallerOwned,
        }
    }

    /// Times a pool has handed this allocation out before: a consumer compares it to tell a
    /// recycled buffer from the one it saw.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The fd another process imports this VMM memory with; exported on first use, then
    /// cached. Fails for `cuMemAlloc` memory.
    pub fn export_fd(&self) -> Result<BorrowedFd<'_>, GpuError> {
        let Backing::Vmm { mapping, fd } = &*self.backing else {
            return Err(GpuError::NotExportable(format!(
                "only VMM memory exports an fd (this is {:?} memory)",
                self.kind()
            )));
        };
        if fd.get().is_none() {
            let exported = mapping.export_fd()?;
            let _ = fd.set(exported);
        }
        fd.get()
            .map(AsFd::as_fd)
            .ok_or_else(|| GpuError::NotExportable("the exported fd vanished".into()))
    }

    /// The legacy CUDA IPC handle of this allocation (a bearer secret: never log it); asked
    /// of the driver once, then cached. Fails for VMM memory and for empty allocations.
    pub fn ipc_handle(&self) -> Result<IpcHandle, GpuError> {
        let ipc_handle = match &*self.backing {
            Backing::Legacy { ipc_handle } | Backing::Borrowed { ipc_handle, .. } => ipc_handle,
            Backing::Vmm { .. } => {
                return Err(GpuError::NotExportable(
                    "VMM memory has no legacy IPC handle; export its fd".into(),
                ));
            }
            Backing::CallerOwned { .. } => {
                return Err(GpuError::NotExportable(
                    "the application's own memory is not exported".into(),
                ));
            }
        };
        if self.ptr == 0 {
            return Err(GpuError::NotExportable("an empty allocation".into()));
        }
        if let Some(handle) = ipc_handle.get() {
            return Ok(*handle);
        }
        let handle = share::ipc_handle(&self.device, self.ptr)?;
        Ok(*ipc_handle.get_or_init(|| handle))
    }

    /// The device address.
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// The device it lives on.
    pub fn device(&self) -> &Arc<GpuDevice> {
        &self.device
    }

    /// Sets every byte to `value`.
    pub fn fill(&mut self, value: u8) -> Result<(), GpuError> {
        if self.len == 0 {
            return Ok(());
        }
        self.device.synchronize_copies()?;
        // SAFETY: `ptr..ptr + len` is this allocation, on the context bound just above.
        unsafe { result::memset_d8_sync(self.ptr, value, self.len) }.map_err(cuda("cuMemsetD8"))
    }

    /// Copies `src` to byte `offset` (synchronously).
    pub fn copy_from_host(&mut self, offset: usize, src: &[u8]) -> Result<(), GpuError> {
        write(&self.device, self.ptr, self.len, offset, src)
    }

    /// Copies bytes from `offset` into `dst` (synchronously, after pending copies).
    pub fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<(), GpuError> {
        read(&self.device, self.ptr, self.len, offset, dst)
    }

    /// Copies the first `len` bytes of `self` to the start of `dst`, across devices if they
    /// differ (synchronously, after pending copies on both).
    pub fn copy_prefix_to(&self, len: usize, dst: &mut DeviceAllocation) -> Result<(), GpuError> {
        dst.overwrite_from_device(0, self, len)
    }

    /// Copies `src`'s first `len` bytes to byte `offset` of this memory, which others may be
    /// reading (a shared tensor updated in place: they see the new bytes once this returns).
    /// Synchronous, after pending copies on both devices.
    pub fn overwrite_from_device(
        &self,
        offset: usize,
        src: &DeviceAllocation,
        len: usize,
    ) -> Result<(), GpuError> {
        check_range(0, len, src.len)?;
        check_range(offset, len, self.len)?;
        if len == 0 {
            return Ok(());
        }
        src.device.synchronize_copies()?;
        self.device.synchronize_copies()?;
        src.device.bind()?;
        let target = self.ptr + offset as u64;
        let copied = if Arc::ptr_eq(&self.device, &src.device) {
            // SAFETY: both ranges were checked to lie inside live allocations of the current
            // context, which stay allocated until the copy completed (waited for below).
            unsafe { result::memcpy_dtod_sync(target, src.ptr, len) }.map_err(cuda("cuMemcpyDtoD"))
        } else {
            let (src_ctx, dst_ctx) = (src.device.cuda_context(), self.device.cuda_context());
            // SAFETY: both ranges were checked to lie inside live allocations of their own
            // contexts, which stay allocated until the copy completed (waited for below).
            unsafe { sys::cuMemcpyPeer(target, dst_ctx.cu_ctx(), src.ptr, src_ctx.cu_ctx(), len) }
                .result()
                .map_err(cuda("cuMemcpyPeer"))
        };
        // Device-to-device copies return before they finish (the driver does not wait for
        // them, "sync" names notwithstanding): wait, or a caller could free the source or
        // read the destination while the copy still runs.
        let finished = finish_device_copies(&src.device, &self.device);
        copied.and(finished)
    }

    /// Copies `src` to byte `offset` of this memory, which others may be reading (see
    /// [`overwrite_from_device`](Self::overwrite_from_device)); synchronous.
    pub fn overwrite_from_host(&self, offset: usize, src: &[u8]) -> Result<(), GpuError> {
        write(&self.device, self.ptr, self.len, offset, src)
    }
}

impl Allocation for DeviceAllocation {
    fn len(&self) -> usize {
        self.len
    }

    fn reused(&mut self) {
        self.generation += 1;
    }
}

impl Drop for DeviceAllocation {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        // No copy into this memory can be pending: each async copy owns a share of its
        // destination until its event completes (`GpuDevice::copy_to_device_async`), and the
        // other copies are synchronous. A VMM mapping frees itself when `backing` drops.
        if self.device.bind().is_err() {
            tracing::error!("cannot bind the CUDA context to free device memory");
            return;
        }
        if let Backing::Legacy { .. } = *self.backing {
            // SAFETY: allocated by cuMemAlloc in `new`, freed only here; the context is bound
            // above.
            if let Err(e) = unsafe { result::free_sync(self.ptr) } {
                tracing::error!(error = %e, "cuMemFree failed");
            }
        }
    }
}

/// `len` bytes of page-locked host memory (portable, not write-combined), freed on drop.
pub struct PinnedAllocation {
    ptr: *mut u8,
    len: usize,
    device: Arc<GpuDevice>,
}

// SAFETY: a plain host memory region owned by this value; access goes through `&`/`&mut`.
unsafe impl Send for PinnedAllocation {}
// SAFETY: shared access only reads through `&[u8]`.
unsafe impl Sync for PinnedAllocation {}

impl PinnedAllocation {
    /// Allocates `len` pinned bytes (usable by every context: CU_MEMHOSTALLOC_PORTABLE).
    pub fn new(device: &Arc<GpuDevice>, len: usize) -> Result<Self, GpuError> {
        device.bind()?;
        // Flags: PORTABLE only. Write-combined memory would make CPU reads ~70x slower.
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: the context is current; the pointer is freed exactly once, in Drop.
        let ptr = unsafe { result::malloc_host(len.max(1), flags) }.map_err(allocation_error(
            "pinned host",
            len,
            "cuMemHostAlloc",
        ))?;
        Ok(Self {
            ptr: ptr.cast(),
            len,
            device: device.clone(),
        })
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` bytes this value owns; no copy reads or writes them
        // while a `&self` exists, because in-flight copies own their buffer.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as `as_slice`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Allocation for PinnedAllocation {
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for PinnedAllocation {
    fn drop(&mut self) {
        let _ = self.device.bind();
        // SAFETY: allocated by cuMemHostAlloc in `new`, freed only here; no copy uses it
        // any more (copies own their source buffer until their event completes).
        if let Err(e) = unsafe { result::free_host(self.ptr.cast()) } {
            tracing::error!(error = %e, "cuMemFreeHost failed");
        }
    }
}

/// Device memory the application owns, for tensors to land in (a registered destination,
/// `Destinations::register_device`): an address range kept allocated by an owner.
#[derive(Clone)]
pub struct DeviceRange {
    device: Arc<GpuDevice>,
    ptr: sys::CUdeviceptr,
    len: usize,
    /// Keeps the memory allocated (the application's cudarc slice, or what it passed).
    owner: Arc<dyn std::any::Any + Send + Sync>,
    /// The stream the application uses the memory on: copies into it first wait for it.
    stream: Option<Arc<cudarc::driver::CudaStream>>,
}

impl std::fmt::Debug for DeviceRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceRange({} bytes at {:#x} on cuda:{})",
            self.len,
            self.ptr,
            self.device.ordinal()
        )
    }
}

impl DeviceRange {
    /// `len` bytes at `ptr` on cuda:`ordinal`, kept allocated by `owner`.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be device memory of that device's primary context that stays
    /// allocated while `owner` lives, and that tensorwire may overwrite at any time while a
    /// tensor lands in it.
    pub unsafe fn new(
        ordinal: usize,
        ptr: u64,
        len: usize,
        owner: impl std::any::Any + Send + Sync,
    ) -> Result<Self, GpuError> {
        Ok(Self {
            device: GpuDevice::open(ordinal)?,
            ptr,
            len,
            owner: Arc::new(owner),
            stream: None,
        })
    }

    /// The memory of the application's cudarc slice (on a device's primary context), which
    /// it keeps; copies into it first wait for the work queued on the slice's stream.
    pub fn from_cuda_slice<T: super::Element>(
        slice: Arc<cudarc::driver::CudaSlice<T>>,
    ) -> Result<Self, GpuError> {
        use cudarc::driver::DevicePtr;
        let device = GpuDevice::open(slice.context().ordinal())?;
        device.require_primary(slice.context(), "the slice")?;
        let stream = slice.stream().clone();
        let ptr = slice.device_ptr(&stream).0;
        let len = slice.len() * std::mem::size_of::<T>();
        Ok(Self {
            device,
            ptr,
            len,
            owner: slice,
            stream: Some(stream),
        })
    }

    /// Bytes in the range.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address of its first byte.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The device it is on.
    pub fn device(&self) -> &Arc<GpuDevice> {
        &self.device
    }

    /// Copies bytes `offset..offset + dst.len()` of the range to `dst` (synchronously, after
    /// the work queued on its slice's stream, if it came from one): a tensor on the GPU
    /// read for sending, a chunk at a time.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<(), GpuError> {
        if let Some(stream) = &self.stream {
            stream.synchronize().map_err(cuda("cuStreamSynchronize"))?;
        }
        self.device.bind()?;
        read(&self.device, self.ptr, self.len, offset, dst)
    }

    /// The whole `cuMemAlloc` allocation the range lies in (a framework's allocator carves
    /// tensors out of larger allocations), as memory local processes map through its legacy
    /// CUDA IPC handle, with the range's offset in it; it keeps the range's owner, after the
    /// work queued on the range's stream. Fails, naming why, for memory with no legacy
    /// handle: VMM memory (`cuMemCreate`, as PyTorch's expandable segments) or managed memory.
    pub fn enclosing_allocation(&self) -> Result<(DeviceAllocation, u64), GpuError> {
        if let Some(stream) = &self.stream {
            stream.synchronize().map_err(cuda("cuStreamSynchronize"))?;
        }
        self.device.bind()?;
        let mut capable: i32 = 0;
        // SAFETY: a live local of the attribute's size (an int); the pointer is only read by
        // the driver, which checks that it names memory.
        unsafe {
            sys::cuPointerGetAttribute(
                (&raw mut capable).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                self.ptr,
            )
        }
        .result()
        .map_err(cuda("cuPointerGetAttribute"))?;
        if capable == 0 {
            return Err(GpuError::NotExportable(format!(
                "the memory at {:#x} has no legacy CUDA IPC handle (VMM memory, such as \
                 PyTorch's expandable segments, or managed memory); allocate what you share \
                 with tensorwire, or with cudaMalloc",
                self.ptr
            )));
        }
        let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: live locals for the results; the driver checks that `ptr` is device memory
        // of the bound context.
        unsafe { sys::cuMemGetAddressRange_v2(&raw mut base, &raw mut size, self.ptr) }
            .result()
            .map_err(cuda("cuMemGetAddressRange"))?;
        let offset = self.ptr - base;
        if offset + self.len as u64 > size as u64 {
            return Err(GpuError::InvalidConfig(format!(
                "{} bytes at {:#x} run past their allocation ({size} bytes at {base:#x})",
                self.len, self.ptr
            )));
        }
        let owner: Box<dyn std::any::Any + Send + Sync> = Box::new(self.owner.clone());
        let allocation = DeviceAllocation {
            ptr: base,
            len: size,
            device: self.device.clone(),
            backing: Box::new(Backing::Borrowed {
                ipc_handle: OnceLock::new(),
                _owner: owner,
            }),
            generation: 0,
        };
        Ok((allocation, offset))
    }

    /// The range as an allocation (a tensor lands in it, or is copied from it), after the
    /// application's queued work on it; the allocation keeps the owner and frees nothing.
    pub fn allocation(&self) -> Result<DeviceAllocation, GpuError> {
        if let Some(stream) = &self.stream {
            let used = stream.record_event(None).map_err(cuda("cuEventRecord"))?;
            self.device.copies_wait_for(&used)?;
        }
        let keep: Box<dyn std::any::Any + Send + Sync> = Box::new(self.owner.clone());
        // SAFETY: a `DeviceRange` is live device memory of this device's primary context
        // while `owner` lives (`new`'s contract, or a cudarc slice it holds); the allocation
        // keeps `owner`.
        Ok(unsafe { DeviceAllocation::caller_owned(&self.device, self.ptr, self.len, keep) })
    }
}
