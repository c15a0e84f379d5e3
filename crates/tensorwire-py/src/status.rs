//! What this process's GPUs are: `gpu_status`, `devices`, `pinned_datagram_stats`.

use std::collections::HashMap;

use pyo3::prelude::*;
use tensorwire::gpu::GpuStatus;

use crate::error;

/// `(available, device count, description)` of this process's GPUs.
#[pyfunction]
pub(crate) fn gpu_status() -> (bool, usize, String) {
    let status = GpuStatus::detect();
    (
        status.is_available(),
        status.device_count(),
        status.to_string(),
    )
}

/// `(capacity, lent, served, overflowed, reached)` of the pinned region received datagrams
/// land in.
#[pyfunction]
pub(crate) fn pinned_datagram_stats() -> (usize, usize, u64, u64, usize) {
    let stats = tensorwire::gpu::pinned_datagram_stats();
    (
        stats.capacity,
        stats.lent,
        stats.served,
        stats.overflowed,
        stats.reached,
    )
}

/// Each GPU: `{ordinal, name, uuid, compute_capability, total_memory}`.
#[pyfunction]
pub(crate) fn devices(py: Python<'_>) -> PyResult<Vec<HashMap<&'static str, PyObject>>> {
    if !GpuStatus::detect().is_available() {
        return Ok(Vec::new());
    }
    let all =
        tensorwire::gpu::GpuDevice::all().map_err(|e| error(py, e.to_string(), None, None))?;
    all.iter()
        .map(|device| {
            let info = device.info();
            let mut d: HashMap<&'static str, PyObject> = HashMap::new();
            d.insert(
                "ordinal",
                info.ordinal.into_pyobject(py)?.into_any().unbind(),
            );
            d.insert(
                "name",
                info.name.clone().into_pyobject(py)?.into_any().unbind(),
            );
            d.insert(
                "uuid",
                info.uuid_string().into_pyobject(py)?.into_any().unbind(),
            );
            let (major, minor) = info.compute_capability;
            d.insert(
                "compute_capability",
                format!("{major}.{minor}")
                    .into_pyobject(py)?
                    .into_any()
                    .unbind(),
            );
            d.insert(
                "total_memory",
                info.total_memory.into_pyobject(py)?.into_any().unbind(),
            );
            Ok(d)
        })
        .collect()
}
