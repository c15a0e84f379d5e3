//! `ExecClient`: kernels run on a receiver's GPU from Python (spec §14), over one connection
//! kept open across runs.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tensorwire::exec::{ExecError, ExecReply, ExecToken, Module, ModuleFormat, Run};
use tensorwire::proto::TensorMeta;

use crate::sending::{sender_config, wait_interruptibly};
use crate::{dtype_of, error, runtime};

/// One argument of a kernel, in parameter order: `(kind, name, dtype, shape, bytes)`, where
/// `kind` is `input` (the tensor's bytes), `output` (allocated zeroed by the server; no
/// bytes) or `scalar` (its value's little-endian bytes; no shape).
type Arg = (String, String, String, Vec<u64>, Option<Vec<u8>>);

/// An output: `(name, dtype, shape, bytes)`.
type Output<'py> = (String, &'static str, Vec<u64>, Bound<'py, PyBytes>);

/// What a run gave back: the outputs; the server's timings in seconds (landing, kernel,
/// egress, total); whether the module was sent; bytes moved; the round trip in seconds; and
/// the reply's attributes.
type Ran<'py> = (
    Vec<Output<'py>>,
    (f64, f64, f64, f64),
    bool,
    u64,
    f64,
    Vec<(String, String)>,
);

/// A connection to a receiver that runs kernels (`receiver --allow-exec`).
#[pyclass(module = "tensorwire._native")]
pub(crate) struct ExecClient {
    /// Taken by `close`.
    client: Mutex<Option<Arc<tensorwire::exec::ExecClient>>>,
    address: String,
}

#[pymethods]
impl ExecClient {
    /// Connects to `addr`; TLS and `transport` as `send` takes them; `token` or `token_file`
    /// (readable by its owner only) is presented to a server that admits by token.
    #[new]
    #[pyo3(signature = (addr, *, ca=None, client_cert=None, client_key=None,
        server_name="localhost".to_owned(), transport="auto".to_owned(), token=None,
        token_file=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        addr: &str,
        ca: Option<PathBuf>,
        client_cert: Option<PathBuf>,
        client_key: Option<PathBuf>,
        server_name: String,
        transport: String,
        token: Option<String>,
        token_file: Option<PathBuf>,
    ) -> PyResult<Self> {
        let token = match (token, token_file) {
            (Some(_), Some(_)) => {
                return Err(PyValueError::new_err(
                    "token and token_file: one or the other",
                ));
            }
            (Some(token), None) => Some(ExecToken::new(token).map_err(|e| exec_error(py, &e))?),
            (None, Some(path)) => {
                Some(ExecToken::from_file(&path).map_err(|e| exec_error(py, &e))?)
            }
            (None, None) => None,
        };
        let (peer, config) = sender_config(
            py,
            addr,
            (ca, client_cert, client_key),
            server_name,
            None,
            &transport,
        )?;
        let connecting = runtime().spawn(tensorwire::exec::ExecClient::connect(peer, config));
        let mut client =
            wait_interruptibly(py, connecting, |_| Ok(()))?.map_err(|e| exec_error(py, &e))?;
        if let Some(token) = token {
            client = client.with_token(token);
        }
        Ok(Self {
            client: Mutex::new(Some(Arc::new(client))),
            address: peer.to_string(),
        })
    }

    /// The server's address.
    #[getter]
    fn address(&self) -> String {
        self.address.clone()
    }

    /// The server and its GPU, as `(key, value)` pairs (spec §14.3's info keys).
    fn info(&self, py: Python<'_>) -> PyResult<Vec<(String, String)>> {
        let client = self.client(py)?;
        let asking = runtime().spawn(async move { client.info().await });
        reply_attributes(py, wait_interruptibly(py, asking, |_| Ok(()))?)
    }

    /// Whether the server can run kernels now, with its workers and cache.
    fn health(&self, py: Python<'_>) -> PyResult<Vec<(String, String)>> {
        let client = self.client(py)?;
        let asking = runtime().spawn(async move { client.health().await });
        reply_attributes(py, wait_interruptibly(py, asking, |_| Ok(()))?)
    }

    /// Runs `function` of `module` (PTX, cubin or fatbin bytes; `format` sniffed when None)
    /// over `args`, with `grid` and `block` dimensions; sends the module only if the server
    /// does not have it (spec §14.2). Ctrl-C abandons the run.
    #[pyo3(signature = (module, function, args, *, grid, block, format=None,
        shared_mem_bytes=0, time_limit_ms=None))]
    #[allow(clippy::too_many_arguments)]
    fn run<'py>(
        &self,
        py: Python<'py>,
        module: Vec<u8>,
        function: String,
        args: Vec<Arg>,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        format: Option<&str>,
        shared_mem_bytes: u32,
        time_limit_ms: Option<u64>,
    ) -> PyResult<Ran<'py>> {
        let client = self.client(py)?;
        let format = match format {
            None => ModuleFormat::sniff(&module),
            Some("ptx") => ModuleFormat::Ptx,
            Some("cubin") => ModuleFormat::Cubin,
            Some("fatbin") => ModuleFormat::Fatbin,
            Some(other) => {
                return Err(PyValueError::new_err(format!(
                    "module format {other:?}: ptx, cubin or fatbin"
                )));
            }
        };
        let mut run = Run::new(Arc::new(Module::new(format, module)), function)
            .grid([grid.0, grid.1, grid.2])
            .block([block.0, block.1, block.2])
            .shared_mem_bytes(shared_mem_bytes);
        if let Some(ms) = time_limit_ms {
            run = run.time_limit(Duration::from_millis(ms));
        }
        for (kind, name, dtype, shape, bytes) in args {
            let dtype = dtype_of(&dtype)?;
            run = match (kind.as_str(), bytes) {
                ("input", Some(bytes)) => {
                    let meta = TensorMeta::new(shape, dtype)
                        .map_err(|e| PyValueError::new_err(format!("input {name}: {e}")))?
                        .with_name(name);
                    run.input(meta, bytes).map_err(|e| exec_error(py, &e))?
                }
                ("output", None) => run.output(name, dtype, shape),
                ("scalar", Some(bytes)) => run.scalar(name, dtype, bytes),
                (kind, _) => {
                    return Err(PyValueError::new_err(format!(
                        "argument {name}: {kind:?} with or without bytes: inputs and scalars \
                         carry bytes, outputs none"
                    )));
                }
            };
        }
        let running = runtime().spawn(async move { client.run(&run).await });
        let ran = wait_interruptibly(py, running, |_| Ok(()))?.map_err(|e| exec_error(py, &e))?;
        let outputs = ran
            .outputs
            .iter()
            .map(|(meta, bytes)| {
                (
                    meta.name().to_owned(),
                    meta.dtype().name(),
                    meta.shape().to_vec(),
                    PyBytes::new(py, bytes),
                )
            })
            .collect();
        let seconds = |ns: u64| Duration::from_nanos(ns).as_secs_f64();
        let t = &ran.timings;
        Ok((
            outputs,
            (
                seconds(t.landing_ns),
                seconds(t.kernel_ns),
                seconds(t.egress_ns),
                seconds(t.total_ns),
            ),
            ran.module_sent,
            ran.bytes_moved,
            ran.round_trip.as_secs_f64(),
            ran.reply.attributes.clone(),
        ))
    }

    /// Closes the connection; later calls raise.
    fn close(&self, py: Python<'_>) {
        let taken = self
            .client
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(client) = taken.and_then(Arc::into_inner) {
            py.allow_threads(|| runtime().block_on(client.close()));
        }
    }
}

impl ExecClient {
    fn client(&self, py: Python<'_>) -> PyResult<Arc<tensorwire::exec::ExecClient>> {
        let client = self.client.lock().unwrap_or_else(PoisonError::into_inner);
        client
            .clone()
            .ok_or_else(|| error(py, "the client is closed".to_owned(), None, None))
    }
}

/// A reply's attributes, or its failure as a `TensorwireError`.
fn reply_attributes(
    py: Python<'_>,
    reply: Result<ExecReply, ExecError>,
) -> PyResult<Vec<(String, String)>> {
    reply
        .map(|reply| reply.attributes)
        .map_err(|e| exec_error(py, &e))
}

/// `TensorwireError` with the failure's wire code, where it has one.
fn exec_error(py: Python<'_>, e: &ExecError) -> PyErr {
    error(py, e.to_string(), e.code(), None)
}
