//! The server side (spec §14): takes a receiver's remote-execution tensors, lands inputs on
//! the GPU in exportable memory, runs the kernel in a worker process, and sends the outputs
//! and the reply back on the same connection.

mod config;
mod mailbox;
mod modules;
mod request;
mod run;

pub use config::{ExecAccess, ExecConfig};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::message::ExecRole;
use tensorwire_gpu::{DeviceMemoryKind, GpuRequirement, GpuSinkFactory, HostFallback, Placement};
use tensorwire_proto::ErrorCode;
use tensorwire_quic::IncomingTensor;

use crate::error::ExecError;
use crate::pool::{WorkerPool, WorkerStats};
use mailbox::Mailboxes;
use modules::ModuleCache;

/// Counters of a server.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExecStats {
    /// Requests received (all kinds).
    pub requests: u64,
    /// Runs that succeeded.
    pub runs_succeeded: u64,
    /// Runs that failed, for any reason.
    pub runs_failed: u64,
    /// Runs whose module was in the cache and was not sent.
    pub module_hits: u64,
    /// Runs that sent their module.
    pub module_misses: u64,
    /// Module bytes received.
    pub module_bytes_received: u64,
    /// The worker processes.
    pub workers: WorkerStats,
}

/// Runs kernels for a receiver's peers. Cloning shares the server.
#[derive(Clone)]
pub struct ExecServer {
    inner: Arc<Inner>,
}

struct Inner {
    config: ExecConfig,
    /// The GPU and its pools, or why there is none.
    gpu: Result<GpuSinkFactory, String>,
    workers: Option<Arc<WorkerPool>>,
    modules: Mutex<ModuleCache>,
    mailboxes: Arc<Mailboxes>,
    counters: Counters,
    started: Instant,
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    runs_succeeded: AtomicU64,
    runs_failed: AtomicU64,
    module_hits: AtomicU64,
    module_misses: AtomicU64,
    module_bytes: AtomicU64,
}

impl ExecServer {
    /// A server with `config`: opens the GPU (with exportable memory) and starts the
    /// workers. Without a GPU it still answers info and health, and refuses runs with
    /// UNSUPPORTED_DEVICE.
    pub fn new(config: ExecConfig) -> Result<Self, ExecError> {
        let gpu = match Placement::choose_shareable(config.device, GpuRequirement::Required) {
            Ok(Placement::Gpu(gpu)) => Ok(gpu),
            Ok(Placement::Host { reason }) => Err(reason),
            Err(e) => Err(e.to_string()),
        };
        Self::build(config, gpu)
    }

    /// A server that lands inputs and allocates outputs through `placement`, the
    /// receiver's own: one set of pools and one device-memory budget for everything the
    /// receiver holds (spec §7.5). `config.device` is not used. The placement must export
    /// its memory (VMM, `Placement::choose_shareable`); inputs never fall back to host
    /// memory, whatever its fallback policy.
    pub fn with_placement(config: ExecConfig, placement: &Placement) -> Result<Self, ExecError> {
        let gpu = match placement {
            Placement::Gpu(gpu) if gpu.memory_kind() == DeviceMemoryKind::Vmm => {
                Ok(gpu.clone().with_host_fallback(HostFallback::Forbidden))
            }
            Placement::Gpu(_) => {
                return Err(ExecError::Config(
                    "remote execution needs exportable (VMM) device memory: choose the \
                     placement with Placement::choose_shareable"
                        .into(),
                ));
            }
            Placement::Host { reason } => Err(reason.clone()),
        };
        Self::build(config, gpu)
    }

    fn build(config: ExecConfig, gpu: Result<GpuSinkFactory, String>) -> Result<Self, ExecError> {
        if config.workers == 0 {
            return Err(ExecError::Config("at least one worker is needed".into()));
        }
        let workers = gpu.as_ref().ok().map(|gpu| {
            WorkerPool::start(
                config.worker.clone(),
                gpu.device().ordinal(),
                config.workers,
            )
        });
        if let Err(reason) = &gpu {
            tracing::warn!(%reason, "remote execution: no GPU, so runs are refused");
        }
        Ok(Self {
            inner: Arc::new(Inner {
                mailboxes: Mailboxes::new(config.admission_wait),
                modules: Mutex::new(ModuleCache {
                    entries: Vec::new(),
                    bytes: 0,
                    limit: config.module_cache_bytes,
                }),
                config,
                gpu,
                workers,
                counters: Counters::default(),
                started: Instant::now(),
            }),
        })
    }

    /// Why runs are refused, if they are: no GPU.
    pub fn unavailable(&self) -> Option<&str> {
        self.inner.gpu.as_ref().err().map(String::as_str)
    }

    /// The server's counters.
    pub fn stats(&self) -> ExecStats {
        let c = &self.inner.counters;
        ExecStats {
            requests: c.requests.load(Ordering::Relaxed),
            runs_succeeded: c.runs_succeeded.load(Ordering::Relaxed),
            runs_failed: c.runs_failed.load(Ordering::Relaxed),
            module_hits: c.module_hits.load(Ordering::Relaxed),
            module_misses: c.module_misses.load(Ordering::Relaxed),
            module_bytes_received: c.module_bytes.load(Ordering::Relaxed),
            workers: self
                .inner
                .workers
                .as_ref()
                .map(|w| w.stats())
                .unwrap_or_default(),
        }
    }

    /// Takes `incoming` if it is remote-execution traffic (spec §14.1) and handles it in the
    /// background; gives any other tensor back. Call it from a Tokio runtime.
    pub fn offer(&self, incoming: IncomingTensor) -> Option<IncomingTensor> {
        let (role, id) = match ExecRole::of(incoming.meta()) {
            Ok(None) => return Some(incoming),
            Ok(Some(tagged)) => tagged,
            Err(e) => {
                incoming.reject(e.code(), e.to_string());
                return None;
            }
        };
        let peer = incoming.peer();
        if let Some(why) = self.inner.config.access.refusal(peer, incoming.meta()) {
            incoming.reject(ErrorCode::EXEC_NOT_ALLOWED, why);
            return None;
        }
        match role {
            ExecRole::Request => {
                let inner = self.inner.clone();
                tokio::spawn(async move { inner.request(incoming, id).await });
            }
            ExecRole::Input | ExecRole::Module => self.inner.mailboxes.route((peer, id), incoming),
            ExecRole::Output | ExecRole::Reply => incoming.reject(
                ErrorCode::REJECTED,
                format!("a server takes no {role} tensors (spec §14.1)"),
            ),
        }
        None
    }
}

/// For receivers that do not run kernels: refuses remote-execution tensors with
/// EXEC_NOT_ALLOWED (spec §14.1) and gives every other tensor back.
pub fn refuse_exec(incoming: IncomingTensor) -> Option<IncomingTensor> {
    match ExecRole::of(incoming.meta()) {
        Ok(None) => Some(incoming),
        Ok(Some(_)) => {
            incoming.reject(
                ErrorCode::EXEC_NOT_ALLOWED,
                "this receiver does not run kernels (receiver --allow-exec enables it)",
            );
            None
        }
        Err(e) => {
            incoming.reject(e.code(), e.to_string());
            None
        }
    }
}
