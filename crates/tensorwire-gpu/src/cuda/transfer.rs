//! Checked copies between host memory and a device mapping, and the range check they share:
//! used alike by memory this process allocated and memory it imported.

use cudarc::driver::{result, sys};

use super::{GpuDevice, cuda};
use crate::error::GpuError;

/// Waits until device-to-device copies issued on these devices' contexts have completed.
pub(super) fn finish_device_copies(a: &GpuDevice, b: &GpuDevice) -> Result<(), GpuError> {
    for device in [a, b] {
        device.bind()?;
        result::ctx::synchronize().map_err(cuda("cuCtxSynchronize"))?;
    }
    Ok(())
}

/// Copies `size` bytes at `base + offset` of `device` into `dst`, after pending copies.
pub(super) fn read(
    device: &GpuDevice,
    base: sys::CUdeviceptr,
    size: usize,
    offset: usize,
    dst: &mut [u8],
) -> Result<(), GpuError> {
    check_range(offset, dst.len(), size)?;
    if dst.is_empty() {
        return Ok(());
    }
    device.synchronize_copies()?;
    // SAFETY: the range was checked to lie inside `size` mapped bytes at `base` (callers pass
    // their own live mapping); the context is current.
    unsafe { result::memcpy_dtoh_sync(dst, base + offset as u64) }.map_err(cuda("cuMemcpyDtoH"))
}

/// Copies `src` to `base + offset` of `device`, after pending copies.
pub(super) fn write(
    device: &GpuDevice,
    base: sys::CUdeviceptr,
    size: usize,
    offset: usize,
    src: &[u8],
) -> Result<(), GpuError> {
    check_range(offset, src.len(), size)?;
    if src.is_empty() {
        return Ok(());
    }
    device.synchronize_copies()?;
    // SAFETY: as in `read`.
    unsafe { result::memcpy_htod_sync(base + offset as u64, src) }.map_err(cuda("cuMemcpyHtoD"))
}

/// Fails unless `len` bytes at `offset` lie inside a `size`-byte buffer.
pub(crate) fn check_range(offset: usize, len: usize, size: usize) -> Result<(), GpuError> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(GpuError::Bounds(format!(
            "bytes [{offset}, {offset}+{len}) outside a {size}-byte buffer"
        ))),
    }
}
