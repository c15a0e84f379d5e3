//! The native module of the `tensorwire` Python package (`tensorwire._native`): sending from
//! host buffers, GPU memory and files; a receiver whose tensors leave through DLPack with no
//! copy; kernels run on a receiver's GPU; GPU status. The Python half (`python/tensorwire/`) turns NumPy, PyTorch and CuPy
//! objects into what these functions take, and is the documented API.

#[allow(
    unsafe_code,
    reason = "DLPack capsules: raw pointers and a C destructor"
)]
mod dlpack;
mod exec;
mod received;
mod receiver;
mod sender;
#[allow(
    unsafe_code,
    reason = "host buffers Python lends and device pointers it passes"
)]
mod sending;
mod share;
mod status;

use std::sync::OnceLock;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use tensorwire::proto::{DType, ErrorCode};
use tensorwire::quic::TransportError;

use crate::received::ReceivedTensor;
use crate::receiver::Receiver;
use crate::share::{ShareService, SharedBuffer, empty};
use crate::status::{devices, gpu_status, pinned_datagram_stats};

/// The module's allocator for Rust's allocations (Python's own keep the interpreter's), as
/// the programs': mimalloc, with received datagrams in pinned memory once a `Receiver` opens
/// a GPU. Its receiver stores large payloads on other threads, so quinn's receive buffers
/// are freed away from the connection's thread that allocated them, which glibc's allocator
/// makes dearer per byte on that thread (benches/results/LOG.md). The pinned region
/// (256 MiB, locked for the life of the process) lets a GPU receiver copy payloads to the
/// device straight from the buffers quinn decrypted them into; a forked child lends none.
#[global_allocator]
static ALLOCATOR: tensorwire::gpu::PinnedDatagrams<mimalloc::MiMalloc> =
    tensorwire::gpu::PinnedDatagrams::new(mimalloc::MiMalloc);

/// Bytes read from GPU memory per chunk when sending a device tensor.
const DEVICE_CHUNK: usize = 8 << 20;

/// One runtime for the process: every call blocks on it with the GIL released.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("tensorwire")
            .build()
            .unwrap_or_else(|e| panic!("tensorwire cannot start its IO threads: {e}"))
    })
}

/// `tensorwire.errors.TensorwireError(message, code, code_name, blame, tensor)`.
fn error(py: Python<'_>, message: String, code: Option<ErrorCode>, tensor: Option<&str>) -> PyErr {
    let made = (|| -> PyResult<PyErr> {
        let class = py.import("tensorwire.errors")?.getattr("TensorwireError")?;
        let blame = code.map(|c| format!("{:?}", c.blame()));
        let value = class.call1((
            message.clone(),
            code.map(|c| c.0),
            code.and_then(|c| c.name()),
            blame,
            tensor,
        ))?;
        Ok(PyErr::from_value(value))
    })();
    made.unwrap_or_else(|e| e)
}

fn transport_error(py: Python<'_>, e: &TransportError, tensor: Option<&str>) -> PyErr {
    let message = match tensor {
        Some(name) => format!("{name}: {e}"),
        None => e.to_string(),
    };
    error(py, message, e.code(), tensor)
}

fn dtype_of(name: &str) -> PyResult<DType> {
    DType::from_name_any_case(name)
        .ok_or_else(|| PyValueError::new_err(format!("dtype {name:?} is not one of spec §5.1")))
}

/// The native module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(sending::send, m)?)?;
    m.add_function(wrap_pyfunction!(gpu_status, m)?)?;
    m.add_function(wrap_pyfunction!(devices, m)?)?;
    m.add_function(wrap_pyfunction!(pinned_datagram_stats, m)?)?;
    m.add_class::<sender::Sender>()?;
    m.add_class::<exec::ExecClient>()?;
    m.add_class::<Receiver>()?;
    m.add_class::<ReceivedTensor>()?;
    m.add_class::<SharedBuffer>()?;
    m.add_class::<ShareService>()?;
    m.add_function(wrap_pyfunction!(empty, m)?)?;
    m.add("VERSION", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
