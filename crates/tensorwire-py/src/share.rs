//! `SharedBuffer`, `empty` and `ShareService`: publishing tensors to local processes.

use std::path::PathBuf;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;
use tensorwire::gpu::dlpack::KDL_CUDA;
use tensorwire::gpu::{CudaBuffer, DeviceAllocation, DeviceRequest, GpuDevice, TensorBuffer};
use tensorwire::proto::{Device, TensorMeta};
use tensorwire::quic::Source;

use crate::dlpack::{capsule, refuse_copy};
use crate::sending::{Bytesource, Item, outgoing};
use crate::{dtype_of, error};

/// GPU memory this process allocated to share: exportable (VMM), zeroed, viewed by
/// frameworks through DLPack without being given away.
#[pyclass(module = "tensorwire._native")]
pub(crate) struct SharedBuffer {
    pub(crate) meta: TensorMeta,
    pub(crate) buffer: CudaBuffer,
}

#[pymethods]
impl SharedBuffer {
    /// The dtype's name.
    #[getter]
    fn dtype(&self) -> &'static str {
        self.meta.dtype().name()
    }

    /// The shape.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.meta.shape())
    }

    /// `cuda:N`.
    #[getter]
    fn device(&self) -> String {
        format!("cuda:{}", self.buffer.ordinal())
    }

    /// The device address of its first byte.
    #[getter]
    fn data_ptr(&self) -> u64 {
        self.buffer.device_ptr()
    }

    /// Its size in bytes.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.meta.byte_len()
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        (KDL_CUDA, self.buffer.ordinal() as i32)
    }

    /// A view for a framework (the memory lives while any view, this object or a
    /// publication holds it). Any number of views may be made.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<PyObject>,
        max_version: Option<PyObject>,
        dl_device: Option<PyObject>,
        copy: Option<bool>,
    ) -> PyResult<PyObject> {
        let _ = (stream, max_version, dl_device);
        refuse_copy(copy, "shared memory is viewed, not copied")?;
        capsule(py, TensorBuffer::Cuda(self.buffer.share()), &self.meta)
    }
}

/// A zeroed tensor of `shape` and `dtype` in exportable memory on `device` (`cuda:N`), to
/// fill through a framework view and publish with no copy.
#[pyfunction]
pub(crate) fn empty(
    py: Python<'_>,
    shape: Vec<u64>,
    dtype: &str,
    device: &str,
) -> PyResult<SharedBuffer> {
    let meta = TensorMeta::new(shape, dtype_of(dtype)?)
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    let ordinal = match device.parse::<DeviceRequest>() {
        Ok(DeviceRequest::Cuda(n)) => n,
        _ => {
            return Err(PyValueError::new_err(format!(
                "empty() allocates GPU memory: device must be cuda or cuda:N, not {device:?} \
                 (host tensors are published from NumPy with publish())"
            )));
        }
    };
    let len = usize::try_from(meta.byte_len())
        .map_err(|_| PyValueError::new_err("too large for this machine"))?;
    let made = py.allow_threads(|| -> Result<CudaBuffer, tensorwire::gpu::GpuError> {
        let device = GpuDevice::open(ordinal)?;
        let memory = DeviceAllocation::new_vmm(&device, len.max(1))?;
        let mut buffer = CudaBuffer::from_owned(memory, len);
        buffer.fill(0)?;
        Ok(buffer)
    });
    let buffer = made.map_err(|e| error(py, e.to_string(), None, None))?;
    Ok(SharedBuffer { meta, buffer })
}

/// Publishes tensors to local processes on a Unix socket (spec/ipc.md): GPU memory from
/// `empty` or a framework's allocator with no copy, host arrays copied once into shared
/// memory.
#[pyclass(module = "tensorwire._native")]
pub(crate) struct ShareService {
    pub(crate) inner: tensorwire::ipc::ShareService,
}

#[pymethods]
impl ShareService {
    #[new]
    #[pyo3(signature = (path, *, on_existing="replace"))]
    fn new(py: Python<'_>, path: PathBuf, on_existing: &str) -> PyResult<Self> {
        let on_existing = on_existing
            .parse::<tensorwire::ipc::OnExisting>()
            .map_err(|e| PyValueError::new_err(format!("on_existing {on_existing:?}: {e}")))?;
        let mut config = tensorwire::ipc::ShareConfig::default();
        config.on_existing = on_existing;
        let inner = tensorwire::ipc::ShareService::start(&path, config)
            .map_err(|e| error(py, format!("{}: {e}", path.display()), None, None))?;
        Ok(Self { inner })
    }

    /// The socket's path.
    #[getter]
    fn path(&self) -> PathBuf {
        self.inner.path().to_owned()
    }

    /// Publishes `buffer` (from `empty`) as `name`, with no copy; returns its generation.
    fn publish_device(&self, py: Python<'_>, name: &str, buffer: &SharedBuffer) -> PyResult<u64> {
        let meta = buffer.meta.clone().with_name(name);
        self.inner
            .publish_device(&meta, std::sync::Arc::new(buffer.buffer.share()), 0)
            .map(|published| published.generation())
            .map_err(|e| error(py, format!("{name}: {e}"), None, Some(name)))
    }

    /// Publishes the tensor `item` describes, as `send` takes it, and returns its
    /// generation: GPU memory with no copy (the allocation it lies in is exported, and its
    /// owner kept while published or leased), host bytes copied once into shared memory.
    fn publish(&self, py: Python<'_>, item: Item<'_>) -> PyResult<u64> {
        let (meta, source) = outgoing(item, Device::Any)?;
        let name = meta.name();
        let published = match source {
            Bytesource::Device(range) => {
                py.allow_threads(|| self.inner.publish_range(&meta, &range))
            }
            Bytesource::Ready(Source::Bytes(bytes)) => self.inner.publish_host(&meta, &bytes),
            Bytesource::Ready(_) => {
                return Err(PyValueError::new_err(format!(
                    "{name}: only host or GPU memory is published"
                )));
            }
        };
        published
            .map(|published| published.generation())
            .map_err(|e| error(py, format!("{name}: {e}"), None, Some(name)))
    }

    /// Names shared now.
    fn names(&self) -> Vec<String> {
        self.inner
            .list()
            .into_iter()
            .map(|info| info.tensor.name)
            .collect()
    }

    /// Unshares `name`; `True` if consumers still hold it (its memory goes when they let go).
    /// An unknown name raises.
    fn delete(&self, py: Python<'_>, name: &str) -> PyResult<bool> {
        self.inner
            .delete(name)
            .map_err(|e| error(py, format!("{name}: {e}"), None, Some(name)))
    }
}
