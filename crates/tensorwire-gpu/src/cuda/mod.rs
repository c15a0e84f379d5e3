//! The CUDA driver layer, in three steps: raw `sys` calls and the checked
//! `cudarc::driver::result` wrappers are used only in this module, and come out as the safe
//! RAII types [`GpuDevice`], [`DeviceAllocation`] and [`PinnedAllocation`].
//!
//! Rules kept here: libcuda's presence is checked before any driver call (cudarc panics on a
//! missing library); the device's context is bound on every thread before a raw call; device
//! memory comes from `cuMemAlloc` (never the stream-ordered pool, which cannot be exported for
//! sharing); pinned memory is page-locked without write-combining.

mod checksum;
mod datagrams;
mod device;
pub mod kernel;
mod memory;
mod share;
mod streaming;
mod transfer;
mod view;

pub use datagrams::{PinnedDatagramStats, PinnedDatagrams, pinned_datagram_stats};
pub(crate) use datagrams::{holds as in_pinned_datagram, pin_region as pin_datagram_region};
pub use device::{DeviceInfo, GpuDevice};
pub use memory::{DeviceAllocation, DeviceRange, PinnedAllocation};
pub use share::{DeviceMemoryKind, IPC_HANDLE_LEN, ImportedMemory, IpcHandle};
pub(crate) use streaming::stream_into;
pub(crate) use transfer::check_range;
pub(crate) use view::UsedBy;
pub use view::{DeviceSlice, Element};

use std::sync::OnceLock;

use cudarc::driver::{result, sys};

use crate::error::GpuError;

/// Usable devices (0 when the driver reports none), or why the driver is not usable;
/// probed once per process.
pub(crate) fn detect() -> Result<usize, String> {
    static PROBED: OnceLock<Result<usize, String>> = OnceLock::new();
    PROBED.get_or_init(probe).clone()
}

fn probe() -> Result<usize, String> {
    // SAFETY: only tries to dlopen libcuda under its usual names; calls no driver function.
    if !unsafe { sys::is_culib_present() } {
        return Err("libcuda.so not found".into());
    }
    if let Err(e) = result::init() {
        if e.0 == sys::cudaError_enum::CUDA_ERROR_NO_DEVICE {
            return Ok(0);
        }
        return Err(format!("cuInit: {e}"));
    }
    match result::device::get_count() {
        Ok(n) => Ok(n.max(0) as usize),
        Err(e) => Err(format!("cuDeviceGetCount: {e}")),
    }
}

/// Fails unless the driver is usable; every entry point into this module calls it first.
pub(crate) fn require_driver() -> Result<usize, GpuError> {
    match detect() {
        Ok(0) => Err(GpuError::NoDevice {
            requested: 0,
            available: 0,
        }),
        Ok(device_count) => Ok(device_count),
        Err(reason) => Err(GpuError::NoDriver(reason)),
    }
}

/// Out of memory as its own error, so callers can fall back; anything else names the call.
pub(crate) fn allocation_error(
    what: &'static str,
    bytes: usize,
    call: &'static str,
) -> impl FnOnce(result::DriverError) -> GpuError {
    move |e| {
        if e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
            GpuError::OutOfMemory { what, bytes }
        } else {
            cuda(call)(e)
        }
    }
}

/// Turns a driver error into a typed one naming the call.
pub(crate) fn cuda(call: &'static str) -> impl FnOnce(result::DriverError) -> GpuError {
    move |e| {
        let name = e
            .error_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let text = e
            .error_string()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        GpuError::Cuda {
            call,
            error: format!("{name}: {text}"),
        }
    }
}
