//! The size-class pools of each kind of CUDA memory a receiver draws from: pinned host
//! memory for staging, device memory for landed tensors.

use std::sync::Arc;

use crate::cuda::{DeviceAllocation, DeviceMemoryKind, GpuDevice, PinnedAllocation};
use crate::error::GpuError;
use crate::pool::{MemoryPool, PoolConfig};

/// Pinned host memory buffers by size class.
pub type PinnedMemoryPool = MemoryPool<PinnedAllocation>;

/// Device memory buffers by size class, from `cuMemAlloc` (exportable for sharing later).
pub type GpuMemoryPool = MemoryPool<DeviceAllocation>;

impl MemoryPool<PinnedAllocation> {
    /// A pool of pinned memory registered with `device`'s context.
    pub fn for_device(device: &Arc<GpuDevice>, config: PoolConfig) -> Result<Self, GpuError> {
        let device = device.clone();
        MemoryPool::new("pinned", config, move |size| {
            PinnedAllocation::new(&device, size)
        })
    }
}

impl MemoryPool<DeviceAllocation> {
    /// A pool of `cuMemAlloc` memory on `device`.
    pub fn for_device(device: &Arc<GpuDevice>, config: PoolConfig) -> Result<Self, GpuError> {
        Self::for_device_with_kind(device, config, DeviceMemoryKind::Legacy)
    }

    /// A pool of memory of `kind` on `device`. VMM buffers are rounded up to the allocation
    /// granularity (2 MiB on Hopper), so give such a pool a `min_buffer` of at least that.
    pub fn for_device_with_kind(
        device: &Arc<GpuDevice>,
        config: PoolConfig,
        kind: DeviceMemoryKind,
    ) -> Result<Self, GpuError> {
        let device = device.clone();
        MemoryPool::new("device", config, move |size| {
            DeviceAllocation::with_kind(&device, size, kind)
        })
    }
}
