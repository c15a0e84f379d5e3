//! The native module of the `tensorwire` Python package (`tensorwire._native`): sending from
//! host buffers, GPU memory and files; a receiver whose tensors leave through DLPack with no
//! copy; GPU status. The Python half (`python/tensorwire/`) turns NumPy, PyTorch and CuPy
//! objects into what these functions take, and is the documented API.

#![allow(
    unsafe_code,
    reason = "host buffers Python lends, device pointers it passes, and DLPack capsules"
)]

use std::collections::HashMap;
use std::ffi::{CStr, c_void};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};
use tensorwire::gpu::dlpack::{DLManagedTensor, KDL_CPU, KDL_CUDA};
use tensorwire::gpu::{
    CudaBuffer, DeviceAllocation, DeviceRange, DeviceRequest, GpuDevice, GpuRequirement, GpuStatus,
    Placement, TensorBuffer, TensorSink,
};
use tensorwire::proto::{DType, Device, ErrorCode, ProtocolError, TensorMeta};
use tensorwire::quic::{
    ClientTls, IncomingTensor, Receiver as QuicReceiver, ReceiverConfig, SendHandle, Sender,
    SenderConfig, SenderPool, ServerTls, Source, TransportError, TransportSettings,
};
use tensorwire::sink::{Landing, SinkError, SplitTensors};
use tokio::sync::mpsc;

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

/// Host memory of a Python object (a NumPy array or a view of one), held while sent.
struct HostBuffer {
    ptr: *const u8,
    len: usize,
    /// Keeps the memory allocated.
    _owner: PyObject,
}

// SAFETY: the memory belongs to `_owner`, a Python object that may be held from any thread
// (PyO3 defers its release to a thread holding the GIL); the bytes are only read.
unsafe impl Send for HostBuffer {}
// SAFETY: as above; shared reads only.
unsafe impl Sync for HostBuffer {}

impl AsRef<[u8]> for HostBuffer {
    fn as_ref(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `ptr..ptr + len` is the C-contiguous data of `_owner` as NumPy reported it
        // (`__array_interface__`), kept allocated and unmoved while `_owner` is held.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// Chunks of a device tensor copied to host memory as the sender asks for them, at most two
/// ahead: the tensor is never copied to the host whole.
struct DeviceChunks(mpsc::Receiver<std::io::Result<Bytes>>);

impl futures_core::Stream for DeviceChunks {
    type Item = std::io::Result<Bytes>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0.poll_recv(cx)
    }
}

/// Bytes `[start, start + len)` of `range`, read from the GPU a chunk at a time on the
/// blocking pool.
fn device_source(range: Arc<DeviceRange>, start: usize, len: usize) -> Source {
    let (tx, rx) = mpsc::channel(2);
    let end = start + len;
    runtime().spawn_blocking(move || {
        let mut offset = start;
        while offset < end {
            let len = DEVICE_CHUNK.min(end - offset);
            let mut chunk = vec![0u8; len];
            let read = range
                .read_at(offset, &mut chunk)
                .map(|()| Bytes::from(chunk))
                .map_err(std::io::Error::other);
            let failed = read.is_err();
            if tx.blocking_send(read).is_err() || failed {
                return;
            }
            offset += len;
        }
    });
    Source::Stream(Box::pin(DeviceChunks(rx)))
}

/// What one item of `send` says: `(name, dtype, shape, kind, payload, attributes)`, where
/// kind is `host` (payload: `(address, bytes, owner)` of C-contiguous host memory),
/// `device` (payload: `(pointer, bytes, ordinal, owner)`) or `file` (payload: `(path,
/// offset)`).
type Item<'py> = (
    String,
    String,
    Vec<u64>,
    String,
    Bound<'py, PyAny>,
    Vec<(String, String)>,
);

/// Where an outgoing tensor's bytes are: a source as it is, or GPU memory, read a chunk at a
/// time by each part that asks for a range of it.
enum Bytesource {
    Ready(Source),
    Device(Arc<DeviceRange>),
}

impl Bytesource {
    /// The whole tensor's bytes.
    fn whole(self) -> Source {
        match self {
            Bytesource::Ready(source) => source,
            Bytesource::Device(range) => {
                let len = range.len();
                device_source(range, 0, len)
            }
        }
    }

    /// Bytes `[offset, offset + len)`, for one part of a split tensor (spec §15).
    fn part(&self, offset: u64, len: u64) -> Result<Source, TransportError> {
        let misuse = |why| ProtocolError::Misuse(why).into();
        match self {
            Bytesource::Ready(source) => source
                .slice(offset, len)
                .ok_or_else(|| misuse("a stream or a range past the bytes cannot be split")),
            Bytesource::Device(range) => {
                let (start, len) = (usize::try_from(offset), usize::try_from(len));
                match (start, len) {
                    (Ok(start), Ok(len))
                        if start.checked_add(len).is_some_and(|end| end <= range.len()) =>
                    {
                        Ok(device_source(range.clone(), start, len))
                    }
                    _ => Err(misuse("a part past the tensor's bytes")),
                }
            }
        }
    }
}

fn outgoing(item: Item<'_>, hint: Device) -> PyResult<(TensorMeta, Bytesource)> {
    let (name, dtype, shape, kind, payload, attributes) = item;
    let mut meta = TensorMeta::new(shape, dtype_of(&dtype)?)
        .map_err(|e| PyValueError::new_err(format!("{name}: {e}")))?
        .with_name(name.clone())
        .with_device(hint);
    for (key, value) in attributes {
        meta = meta.with_attribute(key, value);
    }
    let len = meta.byte_len();
    let source = match kind.as_str() {
        "host" => {
            let (address, nbytes, owner): (u64, u64, PyObject) = payload.extract()?;
            if nbytes != len {
                return Err(PyValueError::new_err(format!(
                    "{name}: {nbytes} bytes, but {} {:?} is {len} bytes",
                    meta.dtype(),
                    meta.shape()
                )));
            }
            let len = usize::try_from(nbytes)
                .map_err(|_| PyValueError::new_err(format!("{name}: too large")))?;
            Bytesource::Ready(Source::Bytes(Bytes::from_owner(HostBuffer {
                ptr: address as usize as *const u8,
                len,
                _owner: owner,
            })))
        }
        "device" => {
            let (ptr, nbytes, ordinal, owner): (u64, u64, usize, PyObject) = payload.extract()?;
            if nbytes != len {
                return Err(PyValueError::new_err(format!(
                    "{name}: {nbytes} bytes on the GPU, but {} {:?} is {len} bytes",
                    meta.dtype(),
                    meta.shape()
                )));
            }
            let nbytes = usize::try_from(nbytes)
                .map_err(|_| PyValueError::new_err(format!("{name}: too large")))?;
            // SAFETY: `ptr..ptr + nbytes` is the tensor's memory on cuda:`ordinal`, as its
            // framework reports it (data_ptr or __cuda_array_interface__, made contiguous and
            // its stream synchronized by the Python side); `owner`, the tensor object, keeps
            // it allocated until the range is dropped after the send. It is only read: the
            // range is never a landing destination.
            let range = unsafe { DeviceRange::new(ordinal, ptr, nbytes, owner) }
                .map_err(|e| PyRuntimeError::new_err(format!("{name}: {e}")))?;
            Bytesource::Device(Arc::new(range))
        }
        "file" => {
            let (path, offset): (PathBuf, u64) = payload.extract()?;
            Bytesource::Ready(Source::File { path, offset })
        }
        other => {
            return Err(PyValueError::new_err(format!(
                "{name}: unknown kind {other:?}"
            )));
        }
    };
    Ok((meta, source))
}

fn client_tls(
    ca: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
) -> PyResult<ClientTls> {
    match (ca, cert, key) {
        (None, None, None) => Ok(ClientTls::Development),
        (Some(ca), cert, key) => {
            let identity = match (cert, key) {
                (Some(cert), Some(key)) => Some((cert, key)),
                (None, None) => None,
                _ => {
                    return Err(PyValueError::new_err(
                        "client_cert and client_key go together",
                    ));
                }
            };
            Ok(ClientTls::Pem { ca, identity })
        }
        (None, _, _) => Err(PyValueError::new_err(
            "a client certificate needs ca= (the receiver's CA)",
        )),
    }
}

/// Sends `items` to `addr` over `connections` connections (None: one per core, at most 8,
/// and no more than the tensors, or their 16 MiB parts, can use); with `split`, a tensor
/// larger than its connection's share goes as parts over several (spec §15). Returns
/// `(name, bytes, seconds, (receiver, source, transport, turn))` per tensor, the last four
/// the seconds it waited for each ([`SendWaits`](tensorwire::quic::SendWaits)), or raises
/// `TensorwireError` naming the first tensor that failed.
#[pyfunction]
#[pyo3(signature = (addr, items, *, connections=None, split=true, ca=None, client_cert=None,
    client_key=None, server_name="localhost".to_owned(), mtu=None, device=None))]
#[allow(clippy::too_many_arguments)]
fn send(
    py: Python<'_>,
    addr: &str,
    items: Vec<Item<'_>>,
    connections: Option<usize>,
    split: bool,
    ca: Option<PathBuf>,
    client_cert: Option<PathBuf>,
    client_key: Option<PathBuf>,
    server_name: String,
    mtu: Option<u16>,
    device: Option<String>,
) -> PyResult<Vec<SentTensor>> {
    let addr: SocketAddr =
        tensorwire::quic::resolve(addr).map_err(|e| error(py, e.to_string(), None, None))?;
    let hint = match device.as_deref() {
        None | Some("any") => Device::Any,
        Some("host" | "cpu") => Device::Host,
        Some(other) => match other.parse::<DeviceRequest>() {
            Ok(DeviceRequest::Cuda(n)) => Device::Cuda(
                u16::try_from(n).map_err(|_| PyValueError::new_err("device index too large"))?,
            ),
            _ => {
                return Err(PyValueError::new_err(format!(
                    "device {other:?}: any, host or cuda:N"
                )));
            }
        },
    };
    let outgoing = items
        .into_iter()
        .map(|item| outgoing(item, hint))
        .collect::<PyResult<Vec<_>>>()?;
    let mut config = SenderConfig::new(client_tls(ca, client_cert, client_key)?);
    config.server_name = server_name;
    config.transport = TransportSettings::default().with_mtu(mtu, addr);
    let total: u64 = outgoing.iter().map(|(meta, _)| meta.byte_len()).sum();
    let splittable = if split { total } else { 0 };
    let connections = connections
        .unwrap_or_else(|| SenderPool::automatic_connections(outgoing.len(), splittable));
    let outcome = py.allow_threads(|| {
        runtime().block_on(async move {
            let sending: Vec<(String, SendHandle)>;
            let closer: Box<
                dyn FnOnce() -> Pin<Box<dyn std::future::Future<Output = ()> + Send>> + Send,
            >;
            if connections > 1 {
                let pool = SenderPool::connect(addr, config, connections)
                    .await
                    .map_err(|e| (e, None))?;
                let mut started = Vec::with_capacity(outgoing.len());
                for (meta, bytes) in outgoing {
                    let name = meta.name().to_owned();
                    let parts = match split {
                        true => pool.parts_for(&meta, total),
                        false => 1,
                    };
                    let handle = match parts {
                        1 => pool.send(meta, bytes.whole()),
                        parts => pool
                            .send_split_with(meta, parts, |offset, len| bytes.part(offset, len))
                            .map_err(|e| (e, Some(name.clone())))?,
                    };
                    started.push((name, handle));
                }
                sending = started;
                closer = Box::new(move || Box::pin(pool.close()));
            } else {
                let sender = Sender::connect(addr, config).await.map_err(|e| (e, None))?;
                sending = outgoing
                    .into_iter()
                    .map(|(meta, bytes)| (meta.name().to_owned(), sender.send(meta, bytes.whole())))
                    .collect();
                closer = Box::new(move || Box::pin(sender.close()));
            }
            let mut results = Vec::with_capacity(sending.len());
            let mut failed = None;
            for (name, handle) in sending {
                match handle.finished().await {
                    Ok(report) => results.push(sent_tensor(name, &report)),
                    Err(e) if failed.is_none() => failed = Some((e, Some(name))),
                    Err(_) => {}
                }
            }
            closer().await;
            match failed {
                Some(failure) => Err(failure),
                None => Ok(results),
            }
        })
    });
    outcome.map_err(|(e, tensor)| transport_error(py, &e, tensor.as_deref()))
}

/// What `send` returns for one tensor: its name, bytes, seconds, and the seconds it waited
/// for the receiver, its source, QUIC and its turn.
type SentTensor = (String, u64, f64, (f64, f64, f64, f64));

fn sent_tensor(name: String, report: &tensorwire::quic::SendReport) -> SentTensor {
    let waited = &report.waited;
    (
        name,
        report.bytes,
        report.elapsed.as_secs_f64(),
        (
            waited.receiver.as_secs_f64(),
            waited.source.as_secs_f64(),
            waited.transport.as_secs_f64(),
            waited.turn.as_secs_f64(),
        ),
    )
}

/// A tensor that landed: on the receiver's GPU or in host memory, handed to NumPy, PyTorch or
/// CuPy through DLPack with no copy (once), or copied out with `tobytes`.
#[pyclass(module = "tensorwire._native")]
struct ReceivedTensor {
    meta: TensorMeta,
    location: (i32, i32),
    data_ptr: u64,
    peer: String,
    buffer: Mutex<Option<TensorBuffer>>,
}

const DLTENSOR: &CStr = c"dltensor";

/// Frees a DLPack capsule nobody consumed (a consumer renames it `used_dltensor`).
unsafe extern "C" fn drop_capsule(capsule: *mut pyo3::ffi::PyObject) {
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
fn capsule(py: Python<'_>, buffer: TensorBuffer, meta: &TensorMeta) -> PyResult<PyObject> {
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

impl ReceivedTensor {
    fn new(meta: TensorMeta, buffer: TensorBuffer, peer: SocketAddr) -> Self {
        let (location, data_ptr) = match &buffer {
            TensorBuffer::Cuda(cuda) => ((KDL_CUDA, cuda.device_id() as i32), cuda.device_ptr()),
            TensorBuffer::Cpu(bytes) => ((KDL_CPU, 0), bytes.as_ptr() as u64),
        };
        Self {
            meta,
            location,
            data_ptr,
            peer: peer.to_string(),
            buffer: Mutex::new(Some(buffer)),
        }
    }

    fn take(&self) -> PyResult<TensorBuffer> {
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
    fn name(&self) -> &str {
        self.meta.name()
    }

    /// The dtype's name (spec §5.1), e.g. `F32`, `BF16`.
    #[getter]
    fn dtype(&self) -> &'static str {
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
    fn device(&self) -> String {
        match self.location {
            (KDL_CUDA, n) => format!("cuda:{n}"),
            _ => "cpu".to_owned(),
        }
    }

    /// Its size in bytes.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.meta.byte_len()
    }

    /// The address of its first byte (a device pointer on the GPU).
    #[getter]
    fn data_ptr(&self) -> u64 {
        self.data_ptr
    }

    /// The sender's address.
    #[getter]
    fn peer(&self) -> &str {
        &self.peer
    }

    /// `(device type, index)` as DLPack numbers it.
    fn __dlpack_device__(&self) -> (i32, i32) {
        self.location
    }

    /// Hands the memory over as a DLPack capsule, with no copy; the importer frees it (and
    /// the buffer returns to its pool) when done. The bytes have landed, so any stream may
    /// read them. Works once.
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
        if copy == Some(true) {
            return Err(PyValueError::new_err(
                "tensorwire exports without copying (copy=True)",
            ));
        }
        capsule(py, self.take()?, &self.meta)
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
    fn release(&self) {
        drop(
            self.buffer
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take(),
        );
    }

    fn __repr__(&self) -> String {
        format!(
            "ReceivedTensor({:?}, {} {:?}, {})",
            self.meta.name(),
            self.meta.dtype(),
            self.meta.shape(),
            self.device()
        )
    }
}

/// Listens for tensors and lands each one on the GPU (or in host memory).
#[pyclass(module = "tensorwire._native")]
struct Receiver {
    landed: Mutex<mpsc::UnboundedReceiver<ReceivedTensor>>,
    failures: std::sync::Arc<Mutex<Vec<String>>>,
    local_addr: SocketAddr,
    placement: Placement,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

#[pymethods]
impl Receiver {
    #[new]
    #[pyo3(signature = (listen="127.0.0.1:0", *, device="auto", require_gpu=false, budget_mib=256,
        host_memory_mib=None, admission_timeout_s=30.0, cert=None, key=None, client_ca=None,
        mtu=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        listen: &str,
        device: &str,
        require_gpu: bool,
        budget_mib: u64,
        host_memory_mib: Option<u64>,
        admission_timeout_s: f64,
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
        client_ca: Option<PathBuf>,
        mtu: Option<u16>,
    ) -> PyResult<Self> {
        let listen: SocketAddr = tensorwire::quic::resolve(listen)
            .map_err(|e| PyValueError::new_err(format!("listen address: {e}")))?;
        let request: DeviceRequest = device.parse().map_err(PyValueError::new_err)?;
        let tls = match (cert, key) {
            (Some(cert), Some(key)) => ServerTls::Pem {
                cert,
                key,
                client_ca,
            },
            (None, None) if client_ca.is_none() => ServerTls::Development,
            _ => {
                return Err(PyValueError::new_err(
                    "cert and key go together (client_ca needs them)",
                ));
            }
        };
        if !admission_timeout_s.is_finite() || admission_timeout_s <= 0.0 {
            return Err(PyValueError::new_err(
                "admission_timeout_s must be positive",
            ));
        }
        let wait = Duration::from_secs_f64(admission_timeout_s);
        let mut config = ReceiverConfig::new(listen, tls);
        config.budget = budget_mib << 20;
        config.high_watermark = config.budget / 100 * 87;
        config.low_watermark = config.budget / 2;
        config.connection_window = config.budget / 2;
        config.admission_timeout = wait;
        config.transport = TransportSettings::default().with_mtu(mtu, listen);
        if let Some(mib) = host_memory_mib {
            config.host_memory_budget = mib << 20;
        }
        let placement = Placement::choose(request, GpuRequirement::required_if(require_gpu))
            .map_err(|e| error(py, e.to_string(), None, None))?;
        let max_tensor_len = config.limits.max_tensor_len;
        let bound = py.allow_threads(|| runtime().block_on(QuicReceiver::bind(config)));
        let mut receiver = bound.map_err(|e| transport_error(py, &e, None))?;
        let local_addr = receiver
            .local_addr()
            .map_err(|e| transport_error(py, &e, None))?;
        let (tx, rx) = mpsc::unbounded_channel();
        let failures = std::sync::Arc::new(Mutex::new(Vec::new()));
        let (task_placement, task_failures) = (placement.clone(), failures.clone());
        // A split tensor's parts (spec §15) must all arrive within twice the admission wait.
        let splits: SplitTensors<TensorSink> = SplitTensors::new(2 * wait);
        let task = runtime().spawn(async move {
            while let Some(incoming) = receiver.next().await {
                let (placement, tx, failures, splits) = (
                    task_placement.clone(),
                    tx.clone(),
                    task_failures.clone(),
                    splits.clone(),
                );
                tokio::spawn(async move {
                    let meta = incoming.meta().clone();
                    let peer = incoming.peer();
                    let (shares, host) = (
                        incoming.memory_shares().clone(),
                        incoming.host_memory().clone(),
                    );
                    let admit = |meta: TensorMeta| async move {
                        placement.admit(&meta, &shares, &host, wait).await
                    };
                    // A part of a split tensor (spec §15) lands in its whole's sink; only the
                    // part that lands last yields the whole.
                    let carrier = incoming.carrier().clone();
                    let landed = match splits
                        .admit(peer.ip(), &carrier, &meta, max_tensor_len, admit)
                        .await
                    {
                        Ok(sink) => incoming
                            .accept(sink)
                            .finished()
                            .await
                            .map(|(_, landing)| match landing {
                                Landing::Whole(whole) => Some((whole.meta, whole.output)),
                                Landing::Part => None,
                            })
                            .map_err(|e| e.to_string()),
                        Err(e) => Err(refuse(incoming, e)),
                    };
                    match landed {
                        Ok(Some((meta, buffer))) => {
                            let _ = tx.send(ReceivedTensor::new(meta, buffer, peer));
                        }
                        Ok(None) => {}
                        Err(e) => failures
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .push(format!("{} from {peer}: {e}", meta.name())),
                    }
                });
            }
            receiver.close().await;
        });
        Ok(Self {
            landed: Mutex::new(rx),
            failures,
            local_addr,
            placement,
            task: Mutex::new(Some(task)),
        })
    }

    /// The address it listens on (`host:port`).
    #[getter]
    fn address(&self) -> String {
        self.local_addr.to_string()
    }

    /// Where tensors land, for people.
    #[getter]
    fn placement(&self) -> String {
        self.placement.describe()
    }

    /// The next tensor that landed, waiting up to `timeout` seconds (forever if None);
    /// raises `TimeoutError`, or `StopIteration`-like `EOFError` once closed.
    #[pyo3(signature = (timeout=None))]
    fn recv(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<ReceivedTensor> {
        let deadline = timeout.map(|t| Instant::now() + Duration::from_secs_f64(t.max(0.0)));
        loop {
            // Short waits with the GIL released, so Ctrl-C and other threads get through.
            let slice = Duration::from_millis(100);
            let step = match deadline {
                Some(deadline) => slice.min(deadline.saturating_duration_since(Instant::now())),
                None => slice,
            };
            let got = py.allow_threads(|| {
                let mut landed = self.landed.lock().unwrap_or_else(PoisonError::into_inner);
                runtime().block_on(async { tokio::time::timeout(step, landed.recv()).await })
            });
            match got {
                Ok(Some(tensor)) => return Ok(tensor),
                Ok(None) => {
                    return Err(pyo3::exceptions::PyEOFError::new_err(
                        "the receiver is closed",
                    ));
                }
                Err(_) => {}
            }
            py.check_signals()?;
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(pyo3::exceptions::PyTimeoutError::new_err(format!(
                    "no tensor landed within {:.1} s",
                    timeout.unwrap_or_default()
                )));
            }
        }
    }

    /// Tensors that failed (each with its sender, code and cause), oldest first.
    fn failures(&self) -> Vec<String> {
        self.failures
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Device and staging pool statistics (GPU placement), or an empty dict.
    fn pool_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        if let Placement::Gpu(gpu) = &self.placement {
            for (name, stats) in [
                ("device", gpu.memory_stats()),
                ("staging", gpu.staging_stats()),
            ] {
                let d = PyDict::new(py);
                d.set_item("in_use_buffers", stats.in_use_buffers)?;
                d.set_item("available_buffers", stats.available_buffers)?;
                d.set_item("in_use_bytes", stats.in_use_bytes)?;
                d.set_item("pool_bytes", stats.pool_bytes)?;
                d.set_item("hits", stats.hits)?;
                d.set_item("misses", stats.misses)?;
                d.set_item("returns", stats.returns)?;
                if name == "device" {
                    // Tensors allocated on their own: the pool was full or too small for them.
                    d.set_item("outside_pool", gpu.allocations_outside_pool())?;
                }
                out.set_item(name, d)?;
            }
        }
        Ok(out)
    }

    /// Stops listening; tensors already landed can still be taken.
    fn close(&self, py: Python<'_>) {
        if let Some(task) = self
            .task
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            task.abort();
            py.allow_threads(|| {
                let _ = runtime().block_on(task);
            });
        }
    }
}

/// GPU memory this process allocated to share: exportable (VMM), zeroed, viewed by
/// frameworks through DLPack without being given away.
#[pyclass(module = "tensorwire._native")]
struct SharedBuffer {
    meta: TensorMeta,
    buffer: CudaBuffer,
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
        format!("cuda:{}", self.buffer.device_id())
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
        (KDL_CUDA, self.buffer.device_id() as i32)
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
        if copy == Some(true) {
            return Err(PyValueError::new_err(
                "shared memory is viewed, not copied (copy=True)",
            ));
        }
        capsule(py, TensorBuffer::Cuda(self.buffer.share()), &self.meta)
    }
}

/// A zeroed tensor of `shape` and `dtype` in exportable memory on `device` (`cuda:N`), to
/// fill through a framework view and publish with no copy.
#[pyfunction]
fn empty(py: Python<'_>, shape: Vec<u64>, dtype: &str, device: &str) -> PyResult<SharedBuffer> {
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
/// `empty` with no copy, host arrays copied once into shared memory.
#[pyclass(module = "tensorwire._native")]
struct ShareService {
    inner: tensorwire::ipc::ShareService,
}

#[pymethods]
impl ShareService {
    #[new]
    #[pyo3(signature = (path, *, on_existing="replace"))]
    fn new(py: Python<'_>, path: PathBuf, on_existing: &str) -> PyResult<Self> {
        let on_existing = on_existing
            .parse::<tensorwire::ipc::OnExisting>()
            .map_err(|e| PyValueError::new_err(format!("on_existing {on_existing:?}: {e}")))?;
        let config = tensorwire::ipc::ShareConfig {
            on_existing,
            ..tensorwire::ipc::ShareConfig::default()
        };
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

    /// Publishes host bytes `(address, nbytes, owner)` of `dtype` and `shape` as `name`,
    /// copied into shared memory; returns its generation.
    fn publish_host(
        &self,
        py: Python<'_>,
        name: &str,
        dtype: &str,
        shape: Vec<u64>,
        payload: Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        let (address, nbytes, owner): (u64, u64, PyObject) = payload.extract()?;
        let meta = TensorMeta::new(shape, dtype_of(dtype)?)
            .map_err(|e| PyValueError::new_err(e.to_string()))?
            .with_name(name);
        if nbytes != meta.byte_len() {
            return Err(PyValueError::new_err(format!(
                "{name}: {nbytes} bytes for a {}-byte tensor",
                meta.byte_len()
            )));
        }
        let host = HostBuffer {
            ptr: address as usize as *const u8,
            len: nbytes as usize,
            _owner: owner,
        };
        self.inner
            .publish_host(&meta, host.as_ref())
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

/// `(available, device count, description)` of this process's GPUs.
#[pyfunction]
fn gpu_status() -> (bool, usize, String) {
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
fn pinned_datagram_stats() -> (usize, usize, u64, u64, usize) {
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
fn devices(py: Python<'_>) -> PyResult<Vec<HashMap<&'static str, PyObject>>> {
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

/// The native module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(send, m)?)?;
    m.add_function(wrap_pyfunction!(gpu_status, m)?)?;
    m.add_function(wrap_pyfunction!(devices, m)?)?;
    m.add_function(wrap_pyfunction!(pinned_datagram_stats, m)?)?;
    m.add_class::<Receiver>()?;
    m.add_class::<ReceivedTensor>()?;
    m.add_class::<SharedBuffer>()?;
    m.add_class::<ShareService>()?;
    m.add_function(wrap_pyfunction!(empty, m)?)?;
    m.add("VERSION", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}

/// Refuses `incoming` with the sink's code and reason; returns why, for the failure list.
fn refuse(incoming: IncomingTensor, e: SinkError) -> String {
    let why = format!("{}: {}", e.code, e.message);
    incoming.reject(e.code, e.message);
    why
}
