//! [`GpuSinkFactory`]: one device's staging and device pools, budget and checksum kernel,
//! which makes a [`GpuSink`](super::GpuSink) for each tensor.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tensorwire_proto::TensorMeta;
use tensorwire_sink::{MemoryBudget, MemoryReservation};

use super::copy::GpuSink;
use super::{ChecksumOn, DEFAULT_STAGING_POOL, STAGING_BUFFER};
use crate::buffer::CudaBuffer;
use crate::cuda::{DeviceAllocation, DeviceMemoryKind, GpuDevice, pin_datagram_region};
use crate::error::GpuError;
use crate::memory_pools::{GpuMemoryPool, PinnedMemoryPool};
use crate::pool::{PoolConfig, PoolStats};

/// A receiver's GPU side: one device, a pinned staging pool and a device memory pool, from
/// which each incoming tensor gets a [`GpuSink`].
#[derive(Clone)]
pub struct GpuSinkFactory {
    pub(crate) device: Arc<GpuDevice>,
    pub(crate) staging: PinnedMemoryPool,
    pub(crate) memory: GpuMemoryPool,
    pub(crate) kind: DeviceMemoryKind,
    /// Destination buffers of landed tensors, admitted before ACCEPT (spec §7.5).
    pub(crate) budget: MemoryBudget,
    pub(crate) fallback: HostFallback,
    /// Destinations allocated on their own because the device pool could not serve them.
    pub(crate) outside_pool: Arc<AtomicU64>,
    pub(crate) checksum_on: ChecksumOn,
}

/// Whether a tensor that finds no device memory may land in host memory instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HostFallback {
    /// Yes, with a warning naming the tensor (the default for `auto` placement).
    Allowed,
    /// No: the tensor waits for device memory, then is refused (`--require-gpu`).
    Forbidden,
}

/// The default device-memory budget: this share of the memory free when the device opens.
pub(crate) const DEFAULT_BUDGET_OF_FREE: (usize, usize) = (3, 4);

impl GpuSinkFactory {
    /// Opens CUDA device `ordinal` with the given pool sizes; staging buffers are all
    /// [`STAGING_BUFFER`] bytes, the only size the sink asks for.
    pub fn new(ordinal: usize, staging: PoolConfig, memory: PoolConfig) -> Result<Self, GpuError> {
        Self::with_memory_kind(ordinal, staging, memory, DeviceMemoryKind::Legacy)
    }

    /// As [`new`](Self::new), with tensors landing in memory of `kind`: VMM memory can be
    /// shared with other processes as an fd with no copy (`tensorwire-ipc`).
    pub fn with_memory_kind(
        ordinal: usize,
        staging: PoolConfig,
        memory: PoolConfig,
        kind: DeviceMemoryKind,
    ) -> Result<Self, GpuError> {
        let device = GpuDevice::open(ordinal)?;
        let mut staging = staging;
        staging.min_buffer = STAGING_BUFFER;
        staging.max_buffer = STAGING_BUFFER;
        let staging = PinnedMemoryPool::for_device(&device, staging)?;
        let memory = GpuMemoryPool::for_device_with_kind(&device, memory, kind)?;
        // The checksum kernel loads now rather than at the first large tensor: the driver
        // compiles its PTX for this GPU (once per machine where its compute cache is kept),
        // which would stall that tensor's connection. A kernel that does not load is
        // reported when a tensor would have used it (`Sink::take_checksum`).
        let _ = device.checksum_kernel();
        // Where the program's allocator is `PinnedDatagrams`, received payloads reach the
        // device straight from quinn's buffers; without the region they go through staging.
        if let Err(e) = pin_datagram_region(&device) {
            tracing::warn!(error = %e, "received datagrams are not pinned: payloads go through staging");
        }
        // Measured after the staging pool's preallocation: what is left for tensors.
        let (free, _total) = device.memory()?;
        let (num, den) = DEFAULT_BUDGET_OF_FREE;
        let budget = MemoryBudget::new(format!("cuda:{ordinal}"), (free / den * num) as u64);
        Ok(Self {
            staging,
            memory,
            kind,
            device,
            budget,
            fallback: HostFallback::Allowed,
            outside_pool: Arc::default(),
            checksum_on: ChecksumOn::default(),
        })
    }

    /// Sets where tensors' checksums are computed (the default: on the device).
    pub fn with_checksum_on(mut self, checksum_on: ChecksumOn) -> Self {
        self.checksum_on = checksum_on;
        self
    }

    /// Where tensors' checksums are computed.
    pub fn checksum_on(&self) -> ChecksumOn {
        self.checksum_on
    }

    /// Sets the device-memory budget: landed tensors on this device never hold more.
    pub fn with_memory_budget(mut self, bytes: u64) -> Self {
        self.budget = MemoryBudget::new(format!("cuda:{}", self.device.ordinal()), bytes);
        self
    }

    /// Sets whether tensors that find no device memory may land in host memory.
    pub fn with_host_fallback(mut self, fallback: HostFallback) -> Self {
        self.fallback = fallback;
        self
    }

    /// The device-memory budget (clones share it).
    pub fn memory_budget(&self) -> &MemoryBudget {
        &self.budget
    }

    /// Whether host memory may stand in for device memory.
    pub fn host_fallback(&self) -> HostFallback {
        self.fallback
    }

    /// The kind of device memory tensors land in (VMM memory can be exported).
    pub fn memory_kind(&self) -> DeviceMemoryKind {
        self.kind
    }

    /// Defaults: 128 MiB of pinned staging allocated up front, the default device pool.
    pub fn with_defaults(ordinal: usize) -> Result<Self, GpuError> {
        Self::with_defaults_of_kind(ordinal, DeviceMemoryKind::Legacy)
    }

    /// The defaults, with tensors landing in memory of `kind` (VMM buffers start at 2 MiB).
    pub fn with_defaults_of_kind(ordinal: usize, kind: DeviceMemoryKind) -> Result<Self, GpuError> {
        let staging = PoolConfig {
            max_pool_bytes: DEFAULT_STAGING_POOL,
            preallocate: true,
            ..PoolConfig::default()
        };
        let mut memory = PoolConfig::default();
        if kind == DeviceMemoryKind::Vmm {
            memory.min_buffer = memory.min_buffer.max(2 << 20);
        }
        Self::with_memory_kind(ordinal, staging, memory, kind)
    }

    /// The device tensors land on.
    pub fn device(&self) -> &Arc<GpuDevice> {
        &self.device
    }

    /// The staging pool's counters.
    pub fn staging_stats(&self) -> PoolStats {
        self.staging.stats()
    }

    /// The device pool's counters.
    pub fn memory_stats(&self) -> PoolStats {
        self.memory.stats()
    }

    /// Tensors whose destination was allocated on its own because the device pool was full
    /// or its buffers too small. Each costs a `cuMemAlloc` and, once dropped, a `cuMemFree`,
    /// which may wait for the device's copies in flight (traced: 0.5 ms each, with the copy
    /// stream left idle meanwhile). Size the pool to the tensors in flight to avoid them.
    pub fn allocations_outside_pool(&self) -> u64 {
        self.outside_pool.load(Ordering::Relaxed)
    }

    /// A sink for `meta`. Its destination comes from the device pool when it fits a pool
    /// buffer and the pool has room; otherwise from an allocation of its own (the pool bounds
    /// what is cached, not what the device may hold). Fails only when the device is out of
    /// memory.
    pub fn sink(&self, meta: &TensorMeta) -> Result<GpuSink, GpuError> {
        let reservation =
            self.budget
                .try_reserve(meta.byte_len())
                .map_err(|e| GpuError::BudgetExhausted {
                    device: self.device.ordinal(),
                    message: e.message,
                })?;
        self.sink_reserved(meta, reservation)
    }

    /// A sink into `dest` (the application's registered memory, say) through this
    /// receiver's staging pool; `dest` must be on this receiver's device.
    pub fn sink_into(&self, dest: CudaBuffer) -> Result<GpuSink, GpuError> {
        if dest.ordinal() != self.device.ordinal() {
            return Err(GpuError::InvalidConfig(format!(
                "a cuda:{} destination for a cuda:{} receiver",
                dest.ordinal(),
                self.device.ordinal()
            )));
        }
        Ok(
            GpuSink::new(self.device.clone(), dest, self.staging.clone())
                .with_checksum_on(self.checksum_on),
        )
    }

    /// A sink for `meta` into memory already admitted against [`Self::memory_budget`].
    pub fn sink_reserved(
        &self,
        meta: &TensorMeta,
        reservation: MemoryReservation,
    ) -> Result<GpuSink, GpuError> {
        let len = usize::try_from(meta.byte_len())
            .map_err(|_| GpuError::Bounds("tensor larger than the address space".into()))?;
        let pooled = match self.memory.acquire(len) {
            Ok(buffer) => Some(buffer),
            Err(GpuError::PoolExhausted { .. } | GpuError::LargerThanPoolBuffers { .. }) => None,
            Err(e) => return Err(e),
        };
        let dest = match pooled {
            Some(buffer) => CudaBuffer::from_pool(buffer, len),
            None => {
                tracing::debug!(
                    bytes = len,
                    "device pool full or buffer too large: allocating directly"
                );
                let own = DeviceAllocation::with_kind(&self.device, len, self.kind)?;
                self.outside_pool.fetch_add(1, Ordering::Relaxed);
                CudaBuffer::from_owned(own, len)
            }
        };
        Ok(GpuSink::new(
            self.device.clone(),
            dest.with_reservation(reservation)?,
            self.staging.clone(),
        )
        .with_checksum_on(self.checksum_on))
    }
}
