//! `ReceivedTensor`: a landed tensor, handed to frameworks through DLPack with no copy.

use std::net::SocketAddr;
use std::sync::{Mutex, PoisonError};

use pyo3::exceptions::{PyAttributeError, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};
use tensorwire::gpu::TensorBuffer;
use tensorwire::gpu::dlpack::{KDL_CPU, KDL_CUDA};
use tensorwire::proto::{DType, TensorMeta};

use crate::dlpack::{capsule, refuse_copy};

/// A tensor that landed: on the receiver's GPU or in host memory, handed to NumPy, PyTorch or
/// CuPy through DLPack with no copy (once), or copied out with `tobytes`.
#[pyclass(module = "tensorwire._native")]
pub(crate) struct ReceivedTensor {
    pub(crate) meta: TensorMeta,
    pub(crate) location: (i32, i32),
    pub(crate) data_ptr: u64,
    pub(crate) peer: String,
    pub(crate) buffer: Mutex<Option<TensorBuffer>>,
}

impl ReceivedTensor {
    pub(crate) fn new(meta: TensorMeta, buffer: TensorBuffer, peer: SocketAddr) -> Self {
        let (location, data_ptr) = match &buffer {
            TensorBuffer::Cuda(cuda) => ((KDL_CUDA, cuda.ordinal() as i32), cuda.device_ptr()),
            TensorBuffer::Host(bytes) => ((KDL_CPU, 0), bytes.as_ptr() as u64),
        };
        Self {
            meta,
            location,
            data_ptr,
            peer: peer.to_string(),
            buffer: Mutex::new(Some(buffer)),
        }
    }

    pub(crate) fn take(&self) -> PyResult<TensorBuffer> {
        self.buffer
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .ok_or_else(|| {
                PyRuntimeError::new_err(format!(
                    "{} was already handed over (DLPack) or released",
                    self.meta.name()
                ))
            })
    }
}

#[pymethods]
impl ReceivedTensor {
    /// The tensor's name.
    #[getter]
    pub(crate) fn name(&self) -> &str {
        self.meta.name()
    }

    /// The dtype's name (spec §5.1), e.g. `F32`, `BF16`.
    #[getter]
    pub(crate) fn dtype(&self) -> &'static str {
        self.meta.dtype().name()
    }

    /// The shape.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.meta.shape())
    }

    /// The sender's attributes (the first of repeated keys).
    #[getter]
    fn attributes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let dict = PyDict::new(py);
        for (key, value) in self.meta.attributes().iter().rev() {
            dict.set_item(key, value)?;
        }
        Ok(dict)
    }

    /// Where it landed: `cuda:N` or `cpu`.
    #[getter]
    pub(crate) fn device(&self) -> String {
        match self.location {
            (KDL_CUDA, n) => format!("cuda:{n}"),
            _ => "cpu".to_owned(),
        }
    }

    /// Its size in bytes.
    #[getter]
    pub(crate) fn nbytes(&self) -> u64 {
        self.meta.byte_len()
    }

    /// The address of its first byte (a device pointer on the GPU).
    #[getter]
    pub(crate) fn data_ptr(&self) -> u64 {
        self.data_ptr
    }

    /// The sender's address.
    #[getter]
    pub(crate) fn peer(&self) -> &str {
        &self.peer
    }

    /// `(device type, index)` as DLPack numbers it.
    pub(crate) fn __dlpack_device__(&self) -> (i32, i32) {
        self.location
    }

    /// Hands the memory over as a DLPack capsule, with no copy; the importer frees it (and
    /// the buffer returns to its pool) when done. The bytes have landed, so any stream may
    /// read them. Works once.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    pub(crate) fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<PyObject>,
        max_version: Option<PyObject>,
        dl_device: Option<PyObject>,
        copy: Option<bool>,
    ) -> PyResult<PyObject> {
        let _ = (stream, max_version, dl_device);
        refuse_copy(copy, "tensorwire exports without copying")?;
        capsule(py, self.take()?, &self.meta)
    }

    /// The CUDA Array Interface (version 3) of a tensor on the GPU, for CuPy, Numba and
    /// PyTorch: the same memory, no copy, readable from any stream (the bytes have landed),
    /// valid while this object lives and holds it. BF16 and FP8, which have no array-interface
    /// type, appear as bytes of shape `(nbytes,)`. Host tensors, and tensors handed over
    /// (DLPack) or released, have none: AttributeError.
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        if self.location.0 != KDL_CUDA {
            return Err(PyAttributeError::new_err(
                "a tensor in host memory has no __cuda_array_interface__ (use numpy())",
            ));
        }
        let held = self
            .buffer
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some();
        if !held {
            return Err(PyAttributeError::new_err(format!(
                "{} was already handed over (DLPack) or released",
                self.meta.name()
            )));
        }
        let interface = PyDict::new(py);
        match array_interface_type(self.meta.dtype()) {
            Some(typestr) => {
                interface.set_item("shape", PyTuple::new(py, self.meta.shape())?)?;
                interface.set_item("typestr", typestr)?;
            }
            None => {
                interface.set_item("shape", (self.meta.byte_len(),))?;
                interface.set_item("typestr", "|u1")?;
            }
        }
        // Not read-only: writes are the holder's to make, as through DLPack.
        interface.set_item("data", (self.data_ptr, false))?;
        interface.set_item("version", 3)?;
        interface.set_item("strides", py.None())?;
        interface.set_item("stream", py.None())?;
        Ok(interface)
    }

    /// A copy of the bytes in host memory (for dtypes NumPy lacks, or to keep a copy).
    fn tobytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let guard = self.buffer.lock().unwrap_or_else(PoisonError::into_inner);
        let buffer = guard.as_ref().ok_or_else(|| {
            PyRuntimeError::new_err(format!("{} was already handed over", self.meta.name()))
        })?;
        let bytes = py
            .allow_threads(|| buffer.to_host())
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// Gives the memory back to its pool now, instead of when this object is collected.
    pub(crate) fn release(&self) {
        drop(
            self.buffer
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take(),
        );
    }

    pub(crate) fn __repr__(&self) -> String {
        format!(
            "ReceivedTensor({:?}, {} {:?}, {})",
            self.meta.name(),
            self.meta.dtype(),
            self.meta.shape(),
            self.device()
        )
    }
}

/// The array-interface type string of `dtype` (little-endian), if it has one: NumPy's types
/// lack BF16 and FP8.
fn array_interface_type(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::Bool => "|b1",
        DType::U8 => "|u1",
        DType::I8 => "|i1",
        DType::U16 => "<u2",
        DType::I16 => "<i2",
        DType::U32 => "<u4",
        DType::I32 => "<i4",
        DType::U64 => "<u8",
        DType::I64 => "<i8",
        DType::F16 => "<f2",
        DType::F32 => "<f4",
        DType::F64 => "<f8",
        // BF16, FP8, and any type a later version adds.
        _ => return None,
    })
}
