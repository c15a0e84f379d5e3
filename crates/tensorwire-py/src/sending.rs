//! `send`: host buffers, GPU memory and files to a receiver, over one or more connections.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use bytes::Bytes;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use tensorwire::gpu::{DeviceRange, DeviceRequest};
use tensorwire::proto::{Device, ProtocolError, TensorMeta};
use tensorwire::quic::{
    BindingChoice, ClientTls, SendProgress, SenderConfig, SenderPool, Source, TransportError,
    TransportSettings,
};
use tokio::sync::mpsc;

use crate::{DEVICE_CHUNK, dtype_of, error, runtime, transport_error};

/// Host memory of a Python object (a NumPy array or a view of one), held while sent.
pub(crate) struct HostBuffer {
    pub(crate) ptr: *const u8,
    pub(crate) len: usize,
    /// Keeps the memory allocated.
    pub(crate) _owner: PyObject,
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
pub(crate) struct DeviceChunks(mpsc::Receiver<std::io::Result<Bytes>>);

impl futures_core::Stream for DeviceChunks {
    type Item = std::io::Result<Bytes>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0.poll_recv(cx)
    }
}

/// Bytes `[start, start + len)` of `range`, read from the GPU a chunk at a time on the
/// blocking pool.
pub(crate) fn device_source(range: Arc<DeviceRange>, start: usize, len: usize) -> Source {
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
pub(crate) type Item<'py> = (
    String,
    String,
    Vec<u64>,
    String,
    Bound<'py, PyAny>,
    Vec<(String, String)>,
);

/// Where an outgoing tensor's bytes are: a source as it is, or GPU memory, read a chunk at a
/// time by each part that asks for a range of it.
pub(crate) enum Bytesource {
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

pub(crate) fn outgoing(item: Item<'_>, hint: Device) -> PyResult<(TensorMeta, Bytesource)> {
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
            // it allocated until the range is dropped (after the send, or once a publication
            // of it and its last lease end). tensorwire only reads it: the range is never a
            // landing destination (a publication's consumers may write it, as shared tensors
            // are written).
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

pub(crate) fn client_tls(
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
/// larger than its connection's share goes as parts over several (spec §15); `transport`
/// (`quic`, `tcp` or `auto`) is what carries the connections (spec §16). Returns
/// `(name, bytes, seconds, (receiver, source, transport, turn))` per tensor, the last four
/// the seconds it waited for each ([`SendWaits`](tensorwire::quic::SendWaits)), beside a
/// `TensorwireError` for each tensor that failed; raises one where no connection was made.
#[pyfunction]
#[pyo3(signature = (addr, items, *, connections=None, split=true, ca=None, client_cert=None,
    client_key=None, server_name="localhost".to_owned(), mtu=None, device=None,
    transport="auto".to_owned(), progress=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn send(
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
    transport: String,
    progress: Option<PyObject>,
) -> PyResult<(Vec<SentTensor>, Vec<PyObject>)> {
    let (addr, config) = sender_config(
        py,
        addr,
        (ca, client_cert, client_key),
        server_name,
        mtu,
        &transport,
    )?;
    let hint = device_hint(device.as_deref())?;
    let outgoing = items
        .into_iter()
        .map(|item| outgoing(item, hint))
        .collect::<PyResult<Vec<_>>>()?;
    let total: u64 = outgoing.iter().map(|(meta, _)| meta.byte_len()).sum();
    let splittable = if split { total } else { 0 };
    let connections = connections
        .unwrap_or_else(|| SenderPool::automatic_connections(outgoing.len(), splittable));
    // Each tensor's counters, filled in as the sends start, read by `progress`.
    let started = Arc::new(Mutex::new(Vec::<(String, SendProgress)>::new()));
    let counters = started.clone();
    let work = runtime().spawn(async move {
        let pool = SenderPool::connect(addr, config, connections)
            .await
            .map_err(|e| (e, None))?;
        let outcome = send_all(&pool, outgoing, split, &counters).await;
        pool.close().await;
        outcome
    });
    finish(py, work, progress.as_ref(), &started)
}

/// How a send's tensors ended: those acknowledged, and each that failed with why.
type Ended = (Vec<SentTensor>, Vec<(TransportError, String)>);

/// Starts every tensor of `outgoing` on `pool` (a large one in parts over several
/// connections where `split`), records their counters in `counters`, and waits for all.
pub(crate) async fn send_all(
    pool: &SenderPool,
    outgoing: Vec<(TensorMeta, Bytesource)>,
    split: bool,
    counters: &Mutex<Vec<(String, SendProgress)>>,
) -> Result<Ended, (TransportError, Option<String>)> {
    let total: u64 = outgoing.iter().map(|(meta, _)| meta.byte_len()).sum();
    let mut sending = Vec::with_capacity(outgoing.len());
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
        sending.push((name, handle));
    }
    *counters.lock().unwrap_or_else(PoisonError::into_inner) = sending
        .iter()
        .map(|(name, handle)| (name.clone(), handle.progress()))
        .collect();
    let mut results = Vec::with_capacity(sending.len());
    let mut failures = Vec::new();
    for (name, handle) in sending {
        match handle.finished().await {
            Ok(report) => results.push(sent_tensor(name, &report)),
            Err(e) => failures.push((e, name)),
        }
    }
    Ok((results, failures))
}

/// Waits for `work` (reporting to `progress` meanwhile): what was sent, beside a
/// `TensorwireError` for each tensor that failed; raises where nothing could be sent.
pub(crate) fn finish(
    py: Python<'_>,
    work: tokio::task::JoinHandle<Result<Ended, (TransportError, Option<String>)>>,
    progress: Option<&PyObject>,
    started: &Mutex<Vec<(String, SendProgress)>>,
) -> PyResult<(Vec<SentTensor>, Vec<PyObject>)> {
    let report = |py: Python<'_>| match progress {
        Some(callback) => report_progress(py, callback, started),
        None => Ok(()),
    };
    let (results, failures) = match wait_interruptibly(py, work, report)? {
        Ok(outcome) => outcome,
        Err((e, tensor)) => return Err(transport_error(py, &e, tensor.as_deref())),
    };
    let failures = failures
        .into_iter()
        .map(|(e, name)| {
            transport_error(py, &e, Some(&name))
                .into_value(py)
                .into_any()
        })
        .collect();
    Ok((results, failures))
}

/// Where to connect, and how: `addr` resolved, the TLS files `(ca, client_cert,
/// client_key)`, the name the receiver's certificate must carry, the UDP payload size, and
/// `transport` (`quic`, `tcp` or `auto`).
pub(crate) fn sender_config(
    py: Python<'_>,
    addr: &str,
    (ca, client_cert, client_key): (Option<PathBuf>, Option<PathBuf>, Option<PathBuf>),
    server_name: String,
    mtu: Option<u16>,
    transport: &str,
) -> PyResult<(SocketAddr, SenderConfig)> {
    let binding: BindingChoice = transport.parse().map_err(PyValueError::new_err)?;
    let addr: SocketAddr =
        tensorwire::quic::resolve(addr).map_err(|e| error(py, e.to_string(), None, None))?;
    let mut config = SenderConfig::new(client_tls(ca, client_cert, client_key)?);
    config.server_name = server_name;
    config.transport = TransportSettings::default().with_mtu(mtu, addr);
    config.binding = binding;
    Ok((addr, config))
}

/// The device hint (spec §5.2) a send's `device` names.
pub(crate) fn device_hint(device: Option<&str>) -> PyResult<Device> {
    Ok(match device {
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
    })
}

/// Calls `callback(sent_bytes, total_bytes, [(name, sent, total), …])` with the counters of
/// the tensors started so far.
fn report_progress(
    py: Python<'_>,
    callback: &PyObject,
    started: &Mutex<Vec<(String, SendProgress)>>,
) -> PyResult<()> {
    let tensors: Vec<(String, u64, u64)> = started
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .iter()
        .map(|(name, progress)| (name.clone(), progress.sent_bytes(), progress.total_bytes()))
        .collect();
    let sent = tensors.iter().map(|(_, sent, _)| sent).sum::<u64>();
    let total = tensors.iter().map(|(_, _, total)| total).sum::<u64>();
    callback.call1(py, (sent, total, tensors))?;
    Ok(())
}

/// Waits for `work` with the GIL released, a tenth of a second at a time, calling `tick`
/// between (and once at the end), so that Ctrl-C (or another signal Python handles)
/// interrupts it: then, or when `tick` fails, `work` is aborted, which closes its
/// connections and so cancels its tensors at the receiver.
pub(crate) fn wait_interruptibly<T: Send + 'static>(
    py: Python<'_>,
    mut work: tokio::task::JoinHandle<T>,
    mut tick: impl FnMut(Python<'_>) -> PyResult<()>,
) -> PyResult<T> {
    loop {
        let slice = std::time::Duration::from_millis(100);
        let done = py.allow_threads(|| {
            runtime().block_on(async { tokio::time::timeout(slice, &mut work).await })
        });
        match done {
            Ok(Ok(outcome)) => {
                tick(py)?;
                return Ok(outcome);
            }
            Ok(Err(joined)) => {
                return Err(error(py, format!("the send stopped: {joined}"), None, None));
            }
            Err(_) => {}
        }
        if let Err(stopped) = py.check_signals().and_then(|()| tick(py)) {
            work.abort();
            return Err(stopped);
        }
    }
}

/// What `send` returns for one tensor: its name, bytes, seconds, the seconds it waited for
/// the receiver, its source, QUIC and its turn, and the receiver's receipt (spec §6.8).
pub(crate) type SentTensor = (
    String,
    u64,
    f64,
    (f64, f64, f64, f64),
    Vec<(String, String)>,
);

pub(crate) fn sent_tensor(name: String, report: &tensorwire::quic::SendReport) -> SentTensor {
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
        report.receipt.entries().to_vec(),
    )
}
