//! `Receiver`: listens for tensors and lands each on the GPU (or in host memory).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use tensorwire::gpu::{DeviceRequest, GpuRequirement, Placement, TensorSink};
use tensorwire::metrics::{MetricsServer, ReceiverMetrics};
use tensorwire::proto::TensorMeta;
use tensorwire::quic::{
    IncomingTensor, Receiver as QuicReceiver, ReceiverConfig, ServerTls, TransportSettings,
};
use tensorwire::sink::{Landing, SinkError, SplitTensors};
use tokio::sync::mpsc;

use crate::received::ReceivedTensor;
use crate::{error, runtime, transport_error};

/// How many failures [`Receiver::failures`] keeps (the latest).
const FAILURES_KEPT: usize = 1024;

/// Listens for tensors and lands each one on the GPU (or in host memory).
#[pyclass(module = "tensorwire._native")]
pub(crate) struct Receiver {
    pub(crate) landed: Mutex<mpsc::UnboundedReceiver<ReceivedTensor>>,
    pub(crate) failures: std::sync::Arc<Mutex<VecDeque<String>>>,
    pub(crate) local_addr: SocketAddr,
    pub(crate) placement: Placement,
    pub(crate) task: Mutex<Option<tokio::task::JoinHandle<()>>>,
    metrics: ReceiverMetrics,
    metrics_server: Mutex<Option<MetricsServer>>,
    /// The development certificate's PEM (no `cert` given), for senders on other hosts.
    development_certificate: Option<String>,
}

#[pymethods]
impl Receiver {
    #[new]
    #[pyo3(signature = (listen="127.0.0.1:0", *, device="auto", require_gpu=false, budget_mib=256,
        host_memory_mib=None, admission_timeout_s=30.0, cert=None, key=None, client_ca=None,
        mtu=None, metrics=None))]
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
        metrics: Option<&str>,
    ) -> PyResult<Self> {
        let listen: SocketAddr = tensorwire::quic::resolve(listen)
            .map_err(|e| PyValueError::new_err(format!("listen address: {e}")))?;
        let metrics_listen: Option<SocketAddr> = metrics
            .map(|addr| {
                tensorwire::quic::resolve(addr)
                    .map_err(|e| PyValueError::new_err(format!("metrics address: {e}")))
            })
            .transpose()?;
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
        config.session.connection_window = config.budget / 2;
        config.session.admission_timeout = wait;
        config.transport = TransportSettings::default().with_mtu(mtu, listen);
        if let Some(mib) = host_memory_mib {
            config.host_memory_budget = mib << 20;
        }
        let placement = Placement::choose(request, GpuRequirement::required_if(require_gpu))
            .map_err(|e| error(py, e.to_string(), None, None))?;
        let max_tensor_len = config.session.limits.max_tensor_len;
        let bound = py.allow_threads(|| runtime().block_on(QuicReceiver::bind(config)));
        let mut receiver = bound.map_err(|e| transport_error(py, &e, None))?;
        let local_addr = receiver
            .local_addr()
            .map_err(|e| transport_error(py, &e, None))?;
        let development_certificate = receiver.development_certificate().map(str::to_owned);
        let receiver_metrics = ReceiverMetrics::for_placement(receiver.observer(), &placement);
        let metrics_server = match metrics_listen {
            Some(addr) => {
                let bound = py.allow_threads(|| {
                    runtime().block_on(MetricsServer::bind(addr, receiver_metrics.clone()))
                });
                Some(bound.map_err(|e| error(py, format!("metrics at {addr}: {e}"), None, None))?)
            }
            None => None,
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let failures = std::sync::Arc::new(Mutex::new(VecDeque::new()));
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
                        Err(e) => {
                            let mut failures =
                                failures.lock().unwrap_or_else(PoisonError::into_inner);
                            // Peers choose how many tensors fail: keep the latest only.
                            if failures.len() == FAILURES_KEPT {
                                failures.pop_front();
                            }
                            failures.push_back(format!("{} from {peer}: {e}", meta.name()));
                        }
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
            metrics: receiver_metrics,
            metrics_server: Mutex::new(metrics_server),
            development_certificate,
        })
    }

    /// The address it listens on (`host:port`).
    #[getter]
    fn address(&self) -> String {
        self.local_addr.to_string()
    }

    /// Where Prometheus scrapes its metrics (`host:port`, path `/metrics`), if served.
    #[getter]
    fn metrics_address(&self) -> Option<String> {
        let server = self
            .metrics_server
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        server
            .as_ref()
            .map(|server| server.local_addr().to_string())
    }

    /// Every metric now, in the OpenMetrics text format (docs/operators.md lists them).
    fn metrics_text(&self) -> String {
        self.metrics.encode()
    }

    /// The PEM of the self-signed certificate it made (no `cert` given), or None.
    #[getter]
    fn development_certificate(&self) -> Option<String> {
        self.development_certificate.clone()
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

    /// The latest tensors that failed (each with its sender, code and cause), oldest first.
    fn failures(&self) -> Vec<String> {
        let failures = self.failures.lock().unwrap_or_else(PoisonError::into_inner);
        failures.iter().cloned().collect()
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
        let server = self
            .metrics_server
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(server) = server {
            py.allow_threads(|| runtime().block_on(server.close()));
        }
    }
}

/// Refuses `incoming` with the sink's code and reason; returns why, for the failure list.
pub(crate) fn refuse(incoming: IncomingTensor, e: SinkError) -> String {
    let why = format!("{}: {}", e.code, e.message);
    incoming.reject(e.code, e.message);
    why
}
