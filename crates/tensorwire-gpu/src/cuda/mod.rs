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
mod view;

pub use datagrams::{PinnedDatagramStats, PinnedDatagrams, pinned_datagram_stats};
pub(crate) use datagrams::{holds as in_pinned_datagram, pin_region as pin_datagram_region};
pub use device::{DeviceInfo, GpuDevice};
pub(crate) use memory::check_range;
pub use memory::{DeviceAllocation, DeviceRange, PinnedAllocation};
pub use share::{DeviceMemoryKind, IPC_HANDLE_LEN, ImportedMemory, IpcHandle};
pub(crate) use streaming::stream_into;
pub(crate) use view::UsedBy;
pub use view::{DeviceSlice, Element};

use std::sync::OnceLock;

use cudarc::driver::{result, sys};

use crate::error::GpuError;
use crate::status::GpuStatus;

/// Probes the driver once per process.
pub(crate) fn detect() -> GpuStatus {
    static STATUS: OnceLock<GpuStatus> = OnceLock::new();
    STATUS.get_or_init(probe).clone()
}

fn probe() -> GpuStatus {
    // SAFETY: only tries to dlopen libcuda under its usual names; calls no driver function.
    if !unsafe { sys::is_culib_present() } {
        return GpuStatus::NoCuda("libcuda.so not found".into());
    }
    if let Err(e) = result::init() {
        if e.0 == sys::cudaError_enum::CUDA_ERROR_NO_DEVICE {
            return GpuStatus::NoDevices;
        }
        return GpuStatus::NoCuda(format!("cuInit: {e}"));
    }
    match result::device::get_count() {
        Ok(0) => GpuStatus::NoDevices,
        Ok(n) => GpuStatus::Available {
            device_count: n.max(0) as usize,
        },
        Err(e) => GpuStatus::NoCuda(format!("cuDeviceGetCount: {e}")),
    }
}

/// Fails unless the driver is usable; every entry point into this module calls it first.
pub(crate) fn require_driver() -> Result<usize, GpuError> {
    match detect() {
        GpuStatus::Available { device_count } => Ok(device_count),
        GpuStatus::NoDevices => Err(GpuError::NoDevice {
            requested: 0,
            available: 0,
        }),
        GpuStatus::NoCuda(reason) => Err(GpuError::NoDriver(reason)),
        GpuStatus::NotCompiled => Err(GpuError::NotCompiled),
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
