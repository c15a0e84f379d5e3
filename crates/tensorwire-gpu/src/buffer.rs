//! Where a tensor's bytes live: host memory or a CUDA device.

use bytes::Bytes;
use tensorwire_proto::Device;

use crate::error::GpuError;

/// A tensor's bytes, in host memory or on a GPU.
#[derive(Debug)]
pub enum TensorBuffer {
    /// Host memory.
    Host(Bytes),
    /// Device memory.
    Cuda(CudaBuffer),
}

impl TensorBuffer {
    /// Host bytes.
    pub fn cpu(bytes: impl Into<Bytes>) -> Self {
        TensorBuffer::Host(bytes.into())
    }

    /// `len` zeroed host bytes.
    pub fn cpu_zeros(len: usize) -> Self {
        TensorBuffer::Host(vec![0u8; len].into())
    }

    /// `len` bytes on CUDA device `device`; fails if that cannot be had.
    pub fn allocate_gpu(len: usize, device: usize) -> Result<Self, GpuError> {
        CudaBuffer::allocate(len, device).map(TensorBuffer::Cuda)
    }

    /// `len` bytes on CUDA device `device`, or zeroed host bytes with a logged warning when
    /// the build has no CUDA, the driver or device is missing, or allocation fails.
    pub fn try_allocate_gpu(len: usize, device: usize) -> Self {
        match Self::allocate_gpu(len, device) {
            Ok(buffer) => buffer,
            Err(e) => {
                tracing::warn!(error = %e, bytes = len, "no GPU memory; using host memory instead");
                Self::cpu_zeros(len)
            }
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            TensorBuffer::Host(bytes) => bytes.len(),
            TensorBuffer::Cuda(buffer) => buffer.len(),
        }
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the bytes are in host memory.
    pub fn is_host(&self) -> bool {
        matches!(self, TensorBuffer::Host(_))
    }

    /// Whether the bytes are on a GPU.
    pub fn is_gpu(&self) -> bool {
        matches!(self, TensorBuffer::Cuda(_))
    }

    /// Where the bytes live, as the spec names devices (§5.2): `host` or `cuda:N`.
    pub fn device(&self) -> Device {
        match self {
            TensorBuffer::Host(_) => Device::Host,
            TensorBuffer::Cuda(buffer) => {
                Device::Cuda(u16::try_from(buffer.ordinal()).unwrap_or(u16::MAX))
            }
        }
    }

    /// Where the bytes live, for people: "host memory" or "cuda:0 (NVIDIA H200)".
    pub fn location(&self) -> String {
        match self {
            TensorBuffer::Host(_) => "host memory".to_owned(),
            TensorBuffer::Cuda(buffer) => buffer.location(),
        }
    }

    /// A host copy of the bytes (free for host buffers).
    pub fn to_host(&self) -> Result<Bytes, GpuError> {
        match self {
            TensorBuffer::Host(bytes) => Ok(bytes.clone()),
            TensorBuffer::Cuda(buffer) => buffer.copy_to_host().map(Bytes::from),
        }
    }

    /// A copy of the bytes on CUDA device `device`.
    pub fn to_gpu(&self, device: usize) -> Result<TensorBuffer, GpuError> {
        let mut copy = CudaBuffer::allocate(self.len(), device)?;
        match self {
            TensorBuffer::Host(bytes) => copy.copy_from_host(bytes)?,
            TensorBuffer::Cuda(buffer) => buffer.copy_to(&mut copy)?,
        }
        Ok(TensorBuffer::Cuda(copy))
    }

    /// A host-memory copy of this buffer.
    pub fn to_cpu(&self) -> Result<TensorBuffer, GpuError> {
        self.to_host().map(TensorBuffer::Host)
    }

    /// Overwrites the bytes with `src`, which must be exactly as long.
    pub fn copy_from_slice(&mut self, src: &[u8]) -> Result<(), GpuError> {
        if src.len() != self.len() {
            return Err(GpuError::Bounds(format!(
                "{} bytes into a {}-byte buffer",
                src.len(),
                self.len()
            )));
        }
        match self {
            TensorBuffer::Host(bytes) => *bytes = Bytes::copy_from_slice(src),
            TensorBuffer::Cuda(buffer) => buffer.copy_from_host(src)?,
        }
        Ok(())
    }
}

#[cfg(feature = "cuda")]
pub use with_cuda::CudaBuffer;
#[cfg(not(feature = "cuda"))]
pub use without_cuda::CudaBuffer;

#[cfg(feature = "cuda")]
mod with_cuda {
    use std::sync::{Arc, Mutex, PoisonError};

    use cudarc::driver::{CudaEvent, CudaStream};
    use tensorwire_proto::DType;

    use crate::cuda::{DeviceAllocation, DeviceSlice, Element, GpuDevice, UsedBy, check_range};
    use crate::error::GpuError;
    use crate::pool::Pooled;

    /// Bytes in CUDA device memory: from a pool, allocated for this buffer alone, or the
    /// application's own (a registered destination).
    ///
    /// Handles from [`share`](Self::share) (copies in flight, an early hand-off, typed views)
    /// hold the same memory; it goes back to its pool or is freed once the last of them is
    /// gone and every stream that used it finished (never twice, never early).
    #[derive(Debug)]
    pub struct CudaBuffer {
        held: Arc<Held>,
        len: usize,
        /// For an early hand-off ([`GpuSink::handoff`](crate::GpuSink::handoff)): recorded on
        /// the copy stream after the last copy, completes when the bytes have landed. `None`
        /// when they had landed before this handle was made.
        landed: Option<Arc<CudaEvent>>,
    }

    #[derive(Debug)]
    struct Held {
        memory: Memory,
        /// The device-memory budget's share this buffer holds, returned when it is dropped.
        reservation: Option<tensorwire_sink::MemoryReservation>,
        /// Last uses on other streams (typed views): waited for before the memory goes.
        uses: Mutex<Vec<CudaEvent>>,
    }

    #[derive(Debug)]
    enum Memory {
        Owned(DeviceAllocation),
        Pooled(PooledDevice),
    }

    struct PooledDevice(Pooled<DeviceAllocation>);

    impl std::fmt::Debug for PooledDevice {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "pooled {:?}", *self.0)
        }
    }

    impl Held {
        fn allocation(&self) -> &DeviceAllocation {
            match &self.memory {
                Memory::Owned(a) => a,
                Memory::Pooled(p) => &p.0,
            }
        }
    }

    impl UsedBy for Held {
        fn used_until(&self, event: CudaEvent) {
            let mut uses = self.uses.lock().unwrap_or_else(PoisonError::into_inner);
            // Finished uses need no waiting: keep the list short for long-lived buffers.
            uses.retain(|used| !used.is_complete());
            uses.push(event);
        }
    }

    impl Drop for Held {
        fn drop(&mut self) {
            // Each event is a view's last use; usually long complete, so this rarely waits.
            let uses = self.uses.get_mut().unwrap_or_else(PoisonError::into_inner);
            for used in uses.drain(..) {
                if let Err(e) = used.synchronize() {
                    tracing::error!(error = %e, "waiting for a stream's use of a buffer failed");
                }
            }
        }
    }

    impl CudaBuffer {
        /// `len` bytes on CUDA device `device`.
        pub fn allocate(len: usize, device: usize) -> Result<Self, GpuError> {
            let device = GpuDevice::open(device)?;
            Ok(Self::with_memory(
                Memory::Owned(DeviceAllocation::new(&device, len)?),
                len,
            ))
        }

        fn with_memory(memory: Memory, len: usize) -> Self {
            Self {
                held: Arc::new(Held {
                    memory,
                    reservation: None,
                    uses: Mutex::default(),
                }),
                len,
                landed: None,
            }
        }

        /// The first `len` bytes of a pool buffer; the buffer goes back to its pool when
        /// the last handle to it is dropped.
        pub fn from_pool(memory: Pooled<DeviceAllocation>, len: usize) -> Self {
            Self::with_memory(Memory::Pooled(PooledDevice(memory)), len)
        }

        /// The first `len` bytes of an allocation of its own.
        pub fn from_owned(memory: DeviceAllocation, len: usize) -> Self {
            Self::with_memory(Memory::Owned(memory), len)
        }

        /// Holds `reservation` of a device-memory budget for as long as the memory lives.
        pub fn with_reservation(
            mut self,
            reservation: tensorwire_sink::MemoryReservation,
        ) -> Result<Self, GpuError> {
            let held = Arc::get_mut(&mut self.held)
                .ok_or_else(|| GpuError::InUse("reserving memory for a shared buffer".into()))?;
            held.reservation = Some(reservation);
            Ok(self)
        }

        /// Another handle to the same memory and landing event: the memory lives until
        /// every handle is gone.
        pub fn share(&self) -> CudaBuffer {
            CudaBuffer {
                held: self.held.clone(),
                len: self.len,
                landed: self.landed.clone(),
            }
        }

        /// Marks the bytes as landing when `event` completes (the copy stream's last copy).
        pub(crate) fn set_landing(&mut self, event: CudaEvent) {
            self.landed = Some(Arc::new(event));
        }

        /// The allocation holding the bytes (from offset 0; it may be longer): what sharing
        /// exports.
        pub fn allocation(&self) -> &DeviceAllocation {
            self.held.allocation()
        }

        /// The allocation, for synchronous writes: only while no other handle shares it.
        pub(crate) fn allocation_mut(&mut self) -> Result<&mut DeviceAllocation, GpuError> {
            let held = Arc::get_mut(&mut self.held).ok_or_else(|| {
                GpuError::InUse("another handle (a view or a hand-off) shares it".into())
            })?;
            Ok(match &mut held.memory {
                Memory::Owned(a) => a,
                Memory::Pooled(p) => &mut p.0,
            })
        }

        /// Length in bytes (a pooled allocation may be larger).
        pub fn len(&self) -> usize {
            self.len
        }

        /// Whether it holds no bytes.
        pub fn is_empty(&self) -> bool {
            self.len == 0
        }

        /// The ordinal of the device it lives on.
        pub fn ordinal(&self) -> usize {
            self.allocation().device().ordinal()
        }

        /// The device it lives on.
        pub fn device(&self) -> &Arc<GpuDevice> {
            self.allocation().device()
        }

        /// The device address of the first byte.
        pub fn device_ptr(&self) -> u64 {
            self.allocation().device_ptr()
        }

        /// "cuda:N (name)".
        pub fn location(&self) -> String {
            let info = self.allocation().device().info();
            format!("cuda:{} ({})", info.ordinal, info.name)
        }

        /// The event after the last copy into this buffer, for a handle given out before the
        /// copies completed (an early hand-off): a stream that waits for it reads the landed
        /// bytes (see [`wait_on`](Self::wait_on)). `None` once the bytes had landed.
        pub fn landing_event(&self) -> Option<&CudaEvent> {
            self.landed.as_deref()
        }

        /// Whether the bytes have landed: no copy into them is still running.
        pub fn has_landed(&self) -> bool {
            self.landed.as_ref().is_none_or(|event| event.is_complete())
        }

        /// Makes `stream` wait (on the device, not the host) until the bytes have landed:
        /// work queued on it afterwards reads them. Needed only for work queued before
        /// the tensor's COMPLETE; once a receiver hands a finished tensor over, the bytes
        /// are there and this returns at once.
        pub fn wait_on(&self, stream: &CudaStream) -> Result<(), GpuError> {
            match &self.landed {
                Some(event) => stream
                    .wait(event)
                    .map_err(crate::cuda::cuda("cuStreamWaitEvent")),
                None => Ok(()),
            }
        }

        /// The tensor as a cudarc slice of `T` on `stream` (the server's, on this device's
        /// primary context), after `stream` waits for the landing: `dtype` is the tensor's
        /// and must be `T`'s. The memory stays allocated while the view and any work
        /// queued through it live.
        pub fn as_slice<T: Element>(
            &self,
            dtype: DType,
            stream: &Arc<CudaStream>,
        ) -> Result<DeviceSlice<T>, GpuError> {
            self.as_slice_of(dtype, 0..self.len, stream)
        }

        /// As [`as_slice`](Self::as_slice), for the tensor of `dtype` at `bytes` of this
        /// buffer (several tensors packed in one buffer, each at its offset); the range must
        /// lie inside the buffer and start at a multiple of `T`'s size.
        pub fn as_slice_of<T: Element>(
            &self,
            dtype: DType,
            bytes: std::ops::Range<usize>,
            stream: &Arc<CudaStream>,
        ) -> Result<DeviceSlice<T>, GpuError> {
            check_range(bytes.start, bytes.len(), self.len)?;
            if !bytes.start.is_multiple_of(std::mem::size_of::<T>().max(1)) {
                return Err(GpuError::Bounds(format!(
                    "a {} view at byte {} is misaligned",
                    std::any::type_name::<T>(),
                    bytes.start
                )));
            }
            self.device()
                .require_primary(stream.context(), "the stream")?;
            let memory: Arc<dyn UsedBy> = self.held.clone();
            DeviceSlice::new(
                self.device_ptr() + bytes.start as u64,
                bytes.len(),
                dtype,
                stream,
                self.landing_event(),
                memory,
            )
        }

        /// Overwrites the bytes with `src` (at most `len` bytes, from the start).
        pub fn copy_from_host(&mut self, src: &[u8]) -> Result<(), GpuError> {
            check_range(0, src.len(), self.len)?;
            self.allocation_mut()?.copy_from_host(0, src)
        }

        /// A host copy of the bytes.
        pub fn copy_to_host(&self) -> Result<Vec<u8>, GpuError> {
            let mut out = vec![0u8; self.len];
            self.allocation().copy_to_host(0, &mut out)?;
            Ok(out)
        }

        /// Copies `dst.len()` bytes from byte `offset` of this buffer into `dst`.
        pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<(), GpuError> {
            // Against the buffer's length: a pooled allocation may be longer.
            check_range(offset, dst.len(), self.len)?;
            self.allocation().copy_to_host(offset, dst)
        }

        /// Copies `src` to byte `offset` of this buffer.
        pub fn write_at(&mut self, offset: usize, src: &[u8]) -> Result<(), GpuError> {
            check_range(offset, src.len(), self.len)?;
            self.allocation_mut()?.copy_from_host(offset, src)
        }

        /// Sets every byte to `value` (tests poison destinations with it).
        pub fn fill(&mut self, value: u8) -> Result<(), GpuError> {
            self.allocation_mut()?.fill(value)
        }

        /// Writes `src`'s bytes at byte `offset` of this memory, which other handles may
        /// hold and other processes may have mapped (a shared tensor updated in place: they
        /// see the new bytes once this returns). Synchronous, after pending copies.
        pub fn overwrite(&self, offset: usize, src: &crate::TensorBuffer) -> Result<(), GpuError> {
            check_range(offset, src.len(), self.len)?;
            match src {
                crate::TensorBuffer::Host(bytes) => {
                    self.allocation().overwrite_from_host(offset, bytes)
                }
                crate::TensorBuffer::Cuda(from) => {
                    self.allocation()
                        .overwrite_from_device(offset, from.allocation(), from.len())
                }
            }
        }

        /// Copies all bytes into `dst` (same length), device to device, across GPUs too.
        pub fn copy_to(&self, dst: &mut CudaBuffer) -> Result<(), GpuError> {
            if dst.len != self.len {
                return Err(GpuError::Bounds(format!(
                    "{} bytes into a {}-byte buffer",
                    self.len, dst.len
                )));
            }
            // Exactly `len` bytes: a pooled allocation may be larger than the tensor.
            let len = self.len;
            self.allocation().copy_prefix_to(len, dst.allocation_mut()?)
        }
    }
}

#[cfg(not(feature = "cuda"))]
mod without_cuda {
    use crate::error::GpuError;

    /// Bytes in CUDA device memory; this build has no CUDA, so none can exist.
    #[derive(Debug)]
    pub struct CudaBuffer {
        never: std::convert::Infallible,
    }

    impl CudaBuffer {
        /// Fails: this build has no CUDA support.
        pub fn allocate(_len: usize, _device: usize) -> Result<Self, GpuError> {
            Err(GpuError::NotCompiled)
        }

        /// Length in bytes.
        pub fn len(&self) -> usize {
            match self.never {}
        }

        /// Whether it holds no bytes.
        pub fn is_empty(&self) -> bool {
            match self.never {}
        }

        /// The ordinal of the device it lives on.
        pub fn ordinal(&self) -> usize {
            match self.never {}
        }

        /// The device address of the first byte.
        pub fn device_ptr(&self) -> u64 {
            match self.never {}
        }

        /// "cuda:N (name)".
        pub fn location(&self) -> String {
            match self.never {}
        }

        /// Overwrites the bytes with `src`.
        pub fn copy_from_host(&mut self, _src: &[u8]) -> Result<(), GpuError> {
            match self.never {}
        }

        /// A host copy of the bytes.
        pub fn copy_to_host(&self) -> Result<Vec<u8>, GpuError> {
            match self.never {}
        }

        /// Copies all bytes into `dst`.
        pub fn copy_to(&self, _dst: &mut CudaBuffer) -> Result<(), GpuError> {
            match self.never {}
        }
    }
}
