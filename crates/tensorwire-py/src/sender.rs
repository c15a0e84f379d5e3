//! `Sender`: connections to one receiver kept open across sends.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use pyo3::prelude::*;
use tensorwire::quic::{SendProgress, SenderPool};

use crate::sending::{
    Item, SentTensor, device_hint, finish, outgoing, send_all, sender_config, wait_interruptibly,
};
use crate::{error, runtime, transport_error};

/// Connections to one receiver, opened once and used by every `send` until `close`.
#[pyclass(module = "tensorwire._native")]
pub(crate) struct Sender {
    /// Taken by `close`.
    pool: Mutex<Option<Arc<SenderPool>>>,
    address: String,
}

#[pymethods]
impl Sender {
    /// Opens `connections` connections (default: one per core, at most 8) to `addr`.
    #[new]
    #[pyo3(signature = (addr, *, connections=None, ca=None, client_cert=None, client_key=None,
        server_name="localhost".to_owned(), mtu=None, transport="auto".to_owned()))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        addr: &str,
        connections: Option<usize>,
        ca: Option<PathBuf>,
        client_cert: Option<PathBuf>,
        client_key: Option<PathBuf>,
        server_name: String,
        mtu: Option<u16>,
        transport: String,
    ) -> PyResult<Self> {
        let (peer, config) = sender_config(
            py,
            addr,
            (ca, client_cert, client_key),
            server_name,
            mtu,
            &transport,
        )?;
        let connections =
            connections.unwrap_or_else(|| SenderPool::automatic_connections(usize::MAX, 0));
        let connecting = runtime().spawn(SenderPool::connect(peer, config, connections));
        let pool = wait_interruptibly(py, connecting, |_| Ok(()))?
            .map_err(|e| transport_error(py, &e, None))?;
        Ok(Self {
            pool: Mutex::new(Some(Arc::new(pool))),
            address: peer.to_string(),
        })
    }

    /// The receiver's address.
    #[getter]
    fn address(&self) -> String {
        self.address.clone()
    }

    /// How many connections it holds.
    #[getter]
    fn connections(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.pool(py)?.connections())
    }

    /// Sends `items` over the open connections, as `send` does.
    #[pyo3(signature = (items, *, split=true, device=None, progress=None))]
    fn send(
        &self,
        py: Python<'_>,
        items: Vec<Item<'_>>,
        split: bool,
        device: Option<String>,
        progress: Option<PyObject>,
    ) -> PyResult<(Vec<SentTensor>, Vec<PyObject>)> {
        let pool = self.pool(py)?;
        let hint = device_hint(device.as_deref())?;
        let outgoing = items
            .into_iter()
            .map(|item| outgoing(item, hint))
            .collect::<PyResult<Vec<_>>>()?;
        let started = Arc::new(Mutex::new(Vec::<(String, SendProgress)>::new()));
        let counters = started.clone();
        let work =
            runtime().spawn(async move { send_all(&pool, outgoing, split, &counters).await });
        finish(py, work, progress.as_ref(), &started)
    }

    /// Closes the connections (once every send on them has ended); later sends raise.
    fn close(&self, py: Python<'_>) {
        let taken = self
            .pool
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(pool) = taken {
            py.allow_threads(|| {
                runtime().block_on(async move {
                    // A send under way holds the pool too: the last to let go closes it.
                    if let Some(pool) = Arc::into_inner(pool) {
                        pool.close().await;
                    }
                });
            });
        }
    }
}

impl Sender {
    fn pool(&self, py: Python<'_>) -> PyResult<Arc<SenderPool>> {
        let pool = self.pool.lock().unwrap_or_else(PoisonError::into_inner);
        pool.clone()
            .ok_or_else(|| error(py, "the sender is closed".to_owned(), None, None))
    }
}
