//! DLPack capsules: how tensorwire's buffers reach NumPy, PyTorch and CuPy with no copy.

use std::ffi::{CStr, c_void};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use tensorwire::gpu::TensorBuffer;
use tensorwire::gpu::dlpack::DLManagedTensor;
use tensorwire::proto::TensorMeta;

pub(crate) const DLTENSOR: &CStr = c"dltensor";

/// Frees a DLPack capsule nobody consumed (a consumer renames it `used_dltensor`).
pub(crate) unsafe extern "C" fn drop_capsule(capsule: *mut pyo3::ffi::PyObject) {
    // SAFETY: called by Python with a live capsule; the name check tells an unconsumed one.
    unsafe {
        if pyo3::ffi::PyCapsule_IsValid(capsule, DLTENSOR.as_ptr()) == 1 {
            let managed = pyo3::ffi::PyCapsule_GetPointer(capsule, DLTENSOR.as_ptr())
                .cast::<DLManagedTensor>();
            if let Some(deleter) = managed.as_ref().and_then(|m| m.deleter) {
                deleter(managed);
            }
        }
    }
}

/// `buffer` as a DLPack capsule named `dltensor`, freed by its consumer or with the capsule.
pub(crate) fn capsule(
    py: Python<'_>,
    buffer: TensorBuffer,
    meta: &TensorMeta,
) -> PyResult<PyObject> {
    let exported = buffer
        .into_dlpack(meta.dtype(), meta.shape())
        .map_err(|e| PyValueError::new_err(format!("{}: {e}", meta.name())))?;
    let raw = exported.into_raw();
    // SAFETY: `raw` is a live DLManagedTensor we own; the capsule takes it and
    // `drop_capsule` frees it unless a consumer took it (and its deleter) first.
    let capsule = unsafe {
        pyo3::ffi::PyCapsule_New(raw.cast::<c_void>(), DLTENSOR.as_ptr(), Some(drop_capsule))
    };
    if capsule.is_null() {
        // SAFETY: the capsule was not made, so `raw` is still ours to free, once.
        unsafe {
            if let Some(deleter) = (*raw).deleter {
                deleter(raw);
            }
        }
        return Err(PyErr::fetch(py));
    }
    // SAFETY: `PyCapsule_New` returned a new reference.
    Ok(unsafe { PyObject::from_owned_ptr(py, capsule) })
}

/// `__dlpack__(copy=True)` asks for a copy, which these exports never make: refused with
/// `why`.
pub(crate) fn refuse_copy(copy: Option<bool>, why: &str) -> PyResult<()> {
    if copy == Some(true) {
        return Err(PyValueError::new_err(format!("{why} (copy=True)")));
    }
    Ok(())
}
