//! The server side (spec §14): takes a receiver's remote-execution tensors, lands inputs on
//! the GPU in exportable memory, runs the kernel in a worker process, and sends the outputs
//! and the reply back on the same connection.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tensorwire_gpu::{
    Allocation, CudaBuffer, DeviceAllocation, DeviceMemoryKind, DeviceRequest, GpuRequirement,
    HostFallback, Placement, PooledGpuReceiver, TensorBuffer,
};
use tensorwire_proto::exec::{
    ArgSpec, ExecLimits, ExecReply, ExecRequest, ExecRole, ModuleFormat, RequestBody, RequestKind,
    RunRequest, Timings,
};
use tensorwire_proto::{DType, Device, ErrorCode, TensorMeta};
use tensorwire_quic::{ConnectionSender, IncomingTensor, SenderConfig, ServerTls};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::channel::{Job, JobArg};
use crate::error::ExecError;
use crate::pool::{Outcome, Submission, WorkerCommand, WorkerPool, WorkerStats};
use crate::{hex, sha256};

/// Who may run kernels (spec §14.6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ExecAccess {
    /// Every peer: the server verifies client certificates (mutual TLS), so every peer has
    /// authenticated before any frame is read.
    AuthenticatedPeers,
    /// Peers on a loopback address only: the server does not authenticate clients.
    LoopbackPeers,
}

impl ExecAccess {
    /// The access a server listening on `listen` with `tls` may grant: authenticated peers
    /// with mutual TLS; loopback peers on a loopback address without it; otherwise an error
    /// saying so, and nothing should start.
    pub fn for_listener(listen: SocketAddr, tls: &ServerTls) -> Result<ExecAccess, ExecError> {
        match tls {
            ServerTls::Pem {
                client_ca: Some(_), ..
            } => Ok(ExecAccess::AuthenticatedPeers),
            _ if listen.ip().is_loopback() => Ok(ExecAccess::LoopbackPeers),
            _ => Err(ExecError::Config(format!(
                "remote execution on {listen} needs mutual TLS (a client CA, so that only \
                 clients with certificates it issued may run kernels); without it, listen on \
                 a loopback address"
            ))),
        }
    }

    fn allows(self, peer: SocketAddr) -> bool {
        match self {
            ExecAccess::AuthenticatedPeers => true,
            ExecAccess::LoopbackPeers => peer.ip().is_loopback(),
        }
    }
}

/// How the server runs kernels.
#[derive(Clone, Debug)]
pub struct ExecConfig {
    /// Who may run kernels.
    pub access: ExecAccess,
    /// The request limits (spec §14.4).
    pub limits: ExecLimits,
    /// The GPU kernels run on (`Auto`: GPU 0).
    pub device: DeviceRequest,
    /// Worker processes, each running one kernel at a time.
    pub workers: usize,
    /// How to start a worker.
    pub worker: WorkerCommand,
    /// How long a request's inputs may take to arrive (their METADATA) after the request,
    /// and how long an input may wait for its request.
    pub admission_wait: Duration,
    /// Most bytes of modules kept, oldest dropped first.
    pub module_cache_bytes: u64,
    /// Settings for sending outputs and replies back.
    pub reply: SenderConfig,
}

impl ExecConfig {
    /// Defaults: the default limits, GPU 0, two workers started from
    /// [`WorkerCommand::beside_current_exe`], 30 s admission, 256 MiB of modules.
    pub fn new(access: ExecAccess, worker: WorkerCommand) -> Self {
        Self {
            access,
            limits: ExecLimits::default(),
            device: DeviceRequest::Auto,
            workers: 2,
            worker,
            admission_wait: Duration::from_secs(30),
            module_cache_bytes: 256 << 20,
            reply: SenderConfig::new(tensorwire_quic::ClientTls::Development),
        }
    }
}

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
    gpu: Result<PooledGpuReceiver, String>,
    workers: Option<Arc<WorkerPool>>,
    modules: Mutex<ModuleCache>,
    requests: Mutex<HashMap<(SocketAddr, u64), Entry>>,
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

/// A request's mailbox: its inputs and module, which may arrive before it.
struct Entry {
    tx: mpsc::UnboundedSender<IncomingTensor>,
    rx: Option<mpsc::UnboundedReceiver<IncomingTensor>>,
    /// Set once the request is over: later tensors of it are refused with this.
    closed: Option<(ErrorCode, String)>,
}

struct CachedModule {
    format: ModuleFormat,
    bytes: Bytes,
}

struct ModuleCache {
    entries: Vec<([u8; 32], Arc<CachedModule>)>,
    bytes: u64,
    limit: u64,
}

impl ModuleCache {
    fn get(&mut self, hash: &[u8; 32]) -> Option<Arc<CachedModule>> {
        let i = self.entries.iter().position(|(h, _)| h == hash)?;
        let entry = self.entries.remove(i);
        let module = entry.1.clone();
        self.entries.push(entry);
        Some(module)
    }

    fn insert(&mut self, hash: [u8; 32], module: Arc<CachedModule>) {
        if self.get(&hash).is_some() {
            return;
        }
        self.bytes += module.bytes.len() as u64;
        self.entries.push((hash, module));
        while self.bytes > self.limit && self.entries.len() > 1 {
            let (_, old) = self.entries.remove(0);
            self.bytes -= old.bytes.len() as u64;
        }
    }
}

/// A failure to send back: its code and reason.
type Failure = (ErrorCode, String);

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

    fn build(
        config: ExecConfig,
        gpu: Result<PooledGpuReceiver, String>,
    ) -> Result<Self, ExecError> {
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
                modules: Mutex::new(ModuleCache {
                    entries: Vec::new(),
                    bytes: 0,
                    limit: config.module_cache_bytes,
                }),
                config,
                gpu,
                workers,
                requests: Mutex::new(HashMap::new()),
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
        if !self.inner.config.access.allows(peer) {
            incoming.reject(
                ErrorCode::EXEC_NOT_ALLOWED,
                format!(
                    "{peer} may not run kernels: this server has no client authentication, so \
                     only loopback peers may"
                ),
            );
            return None;
        }
        match role {
            ExecRole::Request => {
                let inner = self.inner.clone();
                tokio::spawn(async move { inner.request(incoming, id).await });
            }
            ExecRole::Input | ExecRole::Module => self.inner.route((peer, id), incoming),
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

impl Inner {
    fn requests(&self) -> std::sync::MutexGuard<'_, HashMap<(SocketAddr, u64), Entry>> {
        self.requests.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The mailbox of `key`, made (with a timer that refuses its tensors if no request
    /// comes) if it is new.
    fn entry<'a>(
        self: &Arc<Self>,
        map: &'a mut HashMap<(SocketAddr, u64), Entry>,
        key: (SocketAddr, u64),
    ) -> &'a mut Entry {
        map.entry(key).or_insert_with(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            let inner = self.clone();
            let wait = self.config.admission_wait;
            tokio::spawn(async move {
                tokio::time::sleep(wait).await;
                inner.expire(key, wait);
            });
            Entry {
                tx,
                rx: Some(rx),
                closed: None,
            }
        })
    }

    /// Removes `key`'s mailbox if its request never came (or ended), refusing what waits.
    fn expire(&self, key: (SocketAddr, u64), wait: Duration) {
        let mut map = self.requests();
        let Some(entry) = map.get(&key) else { return };
        if entry.rx.is_some() {
            if let Some(mut entry) = map.remove(&key)
                && let Some(mut rx) = entry.rx.take()
            {
                drop(map);
                while let Ok(tensor) = rx.try_recv() {
                    tensor.reject(
                        ErrorCode::PROGRESS_TIMEOUT,
                        format!(
                            "no request with id {} arrived within {} s",
                            key.1,
                            wait.as_secs()
                        ),
                    );
                }
            }
        } else if entry.closed.is_some() {
            map.remove(&key);
        }
    }

    fn route(self: &Arc<Self>, key: (SocketAddr, u64), incoming: IncomingTensor) {
        let mut map = self.requests();
        let entry = self.entry(&mut map, key);
        if let Some((code, message)) = &entry.closed {
            let (code, message) = (*code, message.clone());
            drop(map);
            incoming.reject(code, message);
            return;
        }
        if let Err(mpsc::error::SendError(incoming)) = entry.tx.send(incoming) {
            drop(map);
            incoming.reject(ErrorCode::INTERNAL, "the request's mailbox is gone");
        }
    }

    /// Ends `key`'s request: refuses what waits and what comes later with `failure` (or,
    /// after a success, ARGUMENT_MISMATCH), until the mailbox expires.
    fn close(
        self: &Arc<Self>,
        key: (SocketAddr, u64),
        rx: Option<mpsc::UnboundedReceiver<IncomingTensor>>,
        failure: Option<Failure>,
    ) {
        let (code, message) = failure.unwrap_or_else(|| {
            (
                ErrorCode::ARGUMENT_MISMATCH,
                "it already ran; this tensor was not declared or came twice".into(),
            )
        });
        {
            let mut map = self.requests();
            let entry = self.entry(&mut map, key);
            entry.closed = Some((code, message.clone()));
            entry.rx = None;
        }
        if let Some(mut rx) = rx {
            while let Ok(tensor) = rx.try_recv() {
                tensor.reject(code, message.clone());
            }
        }
        let inner = self.clone();
        let wait = self.config.admission_wait;
        tokio::spawn(async move {
            tokio::time::sleep(wait).await;
            inner.expire(key, wait);
        });
    }

    async fn request(self: Arc<Self>, incoming: IncomingTensor, id: u64) {
        let started = Instant::now();
        self.counters.requests.fetch_add(1, Ordering::Relaxed);
        let limits = &self.config.limits;
        let meta = incoming.meta().clone();
        if meta.dtype() != DType::U8
            || meta.shape().len() != 1
            || meta.byte_len() > limits.max_request_len
        {
            incoming.reject(
                ErrorCode::EXEC_MALFORMED,
                format!(
                    "a request is a U8 vector of at most {} bytes; this is {} {:?}",
                    limits.max_request_len,
                    meta.dtype(),
                    meta.shape()
                ),
            );
            return;
        }
        let reply_to = incoming.reply_sender(&self.config.reply);
        let bytes = match incoming.accept_host().await {
            Ok(handle) => match handle.finished().await {
                Ok((_, bytes)) => bytes,
                Err(e) => {
                    tracing::debug!(%e, "remote execution: a request did not arrive");
                    return;
                }
            },
            Err(_) => return,
        };
        let kind = match bytes.get(1) {
            Some(2) => RequestKind::Info,
            Some(3) => RequestKind::Health,
            _ => RequestKind::Run,
        };
        let request = match ExecRequest::decode(&bytes, limits) {
            Ok(request) if request.id == id => request,
            Ok(request) => {
                let message = format!(
                    "the request says id {}, its tensor's {} says {id}",
                    request.id,
                    tensorwire_proto::exec::ID_ATTRIBUTE
                );
                let failure = ExecReply::failure(kind, id, ErrorCode::EXEC_MALFORMED, message);
                self.send_reply(&reply_to, failure).await;
                return;
            }
            Err(e) => {
                if kind == RequestKind::Run {
                    self.counters.runs_failed.fetch_add(1, Ordering::Relaxed);
                    let key = (reply_to.peer(), id);
                    let rx = self.claim(key);
                    self.close(key, rx, Some((e.code(), e.to_string())));
                }
                let failure = ExecReply::failure(kind, id, e.code(), e.to_string());
                self.send_reply(&reply_to, failure).await;
                return;
            }
        };
        let reply = match request.body {
            RequestBody::Info => self.info(id),
            RequestBody::Health => self.health(id),
            RequestBody::Run(run) => {
                let key = (reply_to.peer(), id);
                let Some(rx) = self.claim(key) else {
                    let failure = ExecReply::failure(
                        kind,
                        id,
                        ErrorCode::ARGUMENT_MISMATCH,
                        format!("request id {id} is already in use on this connection"),
                    );
                    self.send_reply(&reply_to, failure).await;
                    return;
                };
                let outcome = self.run(&run, id, rx, &reply_to, started).await;
                match outcome {
                    Ok((reply, rx)) => {
                        self.counters.runs_succeeded.fetch_add(1, Ordering::Relaxed);
                        self.close(key, Some(rx), None);
                        reply
                    }
                    Err((failure, rx)) => {
                        self.counters.runs_failed.fetch_add(1, Ordering::Relaxed);
                        let (code, message) = failure.clone();
                        self.close(key, rx, Some(failure));
                        let mut reply = ExecReply::failure(kind, id, code, message);
                        reply.timings.total_ns = started.elapsed().as_nanos() as u64;
                        reply
                    }
                }
            }
        };
        self.send_reply(&reply_to, reply).await;
    }

    /// Takes the mailbox of `key` for its request; `None` if another request has it.
    fn claim(
        self: &Arc<Self>,
        key: (SocketAddr, u64),
    ) -> Option<mpsc::UnboundedReceiver<IncomingTensor>> {
        let mut map = self.requests();
        let entry = self.entry(&mut map, key);
        if entry.closed.is_some() {
            return None;
        }
        entry.rx.take()
    }

    async fn send_reply(&self, to: &ConnectionSender, reply: ExecReply) {
        let bytes = reply.encode();
        let meta = match TensorMeta::new(vec![bytes.len() as u64], DType::U8) {
            Ok(meta) => ExecRole::Reply.tag(meta.with_name("tensorwire.exec.reply"), reply.id),
            Err(e) => {
                tracing::error!(%e, "remote execution: cannot describe a reply");
                return;
            }
        };
        if let Err(e) = to.send(meta, Bytes::from(bytes)).finished().await {
            tracing::warn!(%e, id = reply.id, "remote execution: the reply did not arrive");
        }
    }

    fn base_attributes(&self) -> Vec<(String, String)> {
        let exec = match &self.gpu {
            Ok(_) => "enabled".to_owned(),
            Err(reason) => format!("disabled: no GPU ({reason})"),
        };
        vec![
            ("server.version".into(), env!("CARGO_PKG_VERSION").into()),
            ("exec".into(), exec),
        ]
    }

    fn info(&self, id: u64) -> ExecReply {
        let mut attributes = self.base_attributes();
        if let Ok(gpu) = &self.gpu {
            let device = gpu.device();
            let info = device.info();
            let (major, minor) = info.compute_capability;
            attributes.push(("device.name".into(), info.name.clone()));
            attributes.push(("device.uuid".into(), info.uuid_string()));
            attributes.push((
                "device.compute_capability".into(),
                format!("{major}.{minor}"),
            ));
            attributes.push(("device.memory_total".into(), info.total_memory.to_string()));
            if let Ok((free, _)) = device.memory() {
                attributes.push(("device.memory_free".into(), free.to_string()));
            }
            if let Ok(count) = tensorwire_gpu::kernel::multiprocessor_count(device) {
                attributes.push(("device.multiprocessors".into(), count.to_string()));
            }
            if let Ok((major, minor)) = tensorwire_gpu::kernel::driver_version() {
                attributes.push(("driver.version".into(), format!("{major}.{minor}")));
            }
        }
        ok_reply(RequestKind::Info, id, attributes)
    }

    fn health(&self, id: u64) -> ExecReply {
        let mut attributes = self.base_attributes();
        let workers = self.workers.as_ref().map(|w| w.stats()).unwrap_or_default();
        let cached = self
            .modules
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entries
            .len();
        attributes.extend([
            ("workers".into(), workers.workers.to_string()),
            ("workers.idle".into(), workers.idle.to_string()),
            ("workers.replaced".into(), workers.replaced.to_string()),
            ("module.cached".into(), cached.to_string()),
            (
                "uptime_s".into(),
                self.started.elapsed().as_secs().to_string(),
            ),
        ]);
        ok_reply(RequestKind::Health, id, attributes)
    }

    /// Lands the inputs, runs the kernel, sends the outputs back; the reply to send, or the
    /// failure, with the mailbox for refusing what still comes.
    async fn run(
        self: &Arc<Self>,
        run: &RunRequest,
        id: u64,
        mut rx: mpsc::UnboundedReceiver<IncomingTensor>,
        reply_to: &ConnectionSender,
        started: Instant,
    ) -> Result<
        (ExecReply, mpsc::UnboundedReceiver<IncomingTensor>),
        (Failure, Option<mpsc::UnboundedReceiver<IncomingTensor>>),
    > {
        let gpu = match &self.gpu {
            Ok(gpu) => gpu.clone(),
            Err(reason) => {
                let failure = (
                    ErrorCode::UNSUPPORTED_DEVICE,
                    format!("this server has no GPU to run kernels on ({reason})"),
                );
                return Err((failure, Some(rx)));
            }
        };
        let cached = self
            .modules
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&run.module_sha256);
        if !run.module_attached && cached.is_none() {
            let failure = (
                ErrorCode::MODULE_NOT_CACHED,
                format!(
                    "no module with SHA-256 {}: send the request again with the module",
                    hex(&run.module_sha256)
                ),
            );
            return Err((failure, Some(rx)));
        }
        let landed = match self.land(run, &gpu, &mut rx).await {
            Ok(landed) => landed,
            Err(failure) => return Err((failure, Some(rx))),
        };
        let landing_ns = started.elapsed().as_nanos() as u64;
        let module = match (landed.module, cached) {
            (Some(bytes), _) => {
                self.counters.module_misses.fetch_add(1, Ordering::Relaxed);
                self.counters
                    .module_bytes
                    .fetch_add(bytes.len() as u64, Ordering::Relaxed);
                let module = Arc::new(CachedModule {
                    format: run.module_format,
                    bytes,
                });
                self.modules
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(run.module_sha256, module.clone());
                module
            }
            (None, Some(module)) => {
                self.counters.module_hits.fetch_add(1, Ordering::Relaxed);
                module
            }
            (None, None) => {
                let failure = (ErrorCode::INTERNAL, "the module vanished".to_owned());
                return Err((failure, Some(rx)));
            }
        };
        let outputs = match self.allocate_outputs(run, &gpu).await {
            Ok(outputs) => outputs,
            Err(failure) => return Err((failure, Some(rx))),
        };
        let submission =
            match submission(run, &module, &landed.inputs, &outputs, &self.config.limits) {
                Ok(submission) => submission,
                Err(failure) => return Err((failure, Some(rx))),
            };
        let Some(workers) = &self.workers else {
            let failure = (ErrorCode::UNSUPPORTED_DEVICE, "no workers".to_owned());
            return Err((failure, Some(rx)));
        };
        let kernel_ns = match workers.run(submission).await {
            Outcome::Done { kernel_ns } => kernel_ns,
            Outcome::Failed { code, message } => return Err(((code, message), Some(rx))),
        };
        drop(landed.inputs);
        let egress = Instant::now();
        if let Err(failure) = send_outputs(run, id, outputs, reply_to).await {
            return Err((failure, Some(rx)));
        }
        let egress_ns = egress.elapsed().as_nanos() as u64;
        let cache = if run.module_attached { "miss" } else { "hit" };
        let mut reply = ok_reply(
            RequestKind::Run,
            id,
            vec![("module.cache".into(), cache.into())],
        );
        reply.timings = Timings {
            landing_ns,
            kernel_ns,
            egress_ns,
            total_ns: started.elapsed().as_nanos() as u64,
        };
        Ok((reply, rx))
    }

    /// Admits the request's inputs (and module, if attached) as they arrive and waits until
    /// every byte is resident.
    async fn land(
        self: &Arc<Self>,
        run: &RunRequest,
        gpu: &PooledGpuReceiver,
        rx: &mut mpsc::UnboundedReceiver<IncomingTensor>,
    ) -> Result<Landed, Failure> {
        let mut expected_inputs = run.input_count();
        let mut module_expected = run.module_attached;
        let mut seen: Vec<String> = Vec::new();
        let mut landing: JoinSet<Result<Arrived, Failure>> = JoinSet::new();
        let deadline = tokio::time::Instant::now() + self.config.admission_wait;
        let wait = self.config.admission_wait;
        let placement = Placement::Gpu(gpu.clone());
        while expected_inputs > 0 || module_expected {
            let incoming = match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(incoming)) => incoming,
                Ok(None) => return Err((ErrorCode::INTERNAL, "the mailbox closed".into())),
                Err(_) => {
                    return Err((
                        ErrorCode::PROGRESS_TIMEOUT,
                        format!(
                            "{expected_inputs} input(s){} did not arrive within {} s of the \
                             request",
                            if module_expected {
                                " and the module"
                            } else {
                                ""
                            },
                            wait.as_secs()
                        ),
                    ));
                }
            };
            let meta = incoming.meta().clone();
            let role = ExecRole::of(&meta).ok().flatten().map(|(role, _)| role);
            if role == Some(ExecRole::Module) {
                if !module_expected {
                    let why = "the request does not attach a module, or it came twice";
                    incoming.reject(ErrorCode::ARGUMENT_MISMATCH, why);
                    return Err((ErrorCode::ARGUMENT_MISMATCH, why.into()));
                }
                if meta.dtype() != DType::U8 || meta.byte_len() != run.module_len {
                    let why = format!(
                        "the module tensor is {} {:?}; the request says U8 [{}]",
                        meta.dtype(),
                        meta.shape(),
                        run.module_len
                    );
                    incoming.reject(ErrorCode::MODULE_INVALID, why.clone());
                    return Err((ErrorCode::MODULE_INVALID, why));
                }
                module_expected = false;
                let hash = run.module_sha256;
                landing.spawn(async move {
                    let handle = incoming
                        .accept_host()
                        .await
                        .map_err(|e| (e.code, format!("the module: {}", e.message)))?;
                    let (_, bytes) = handle.finished().await.map_err(|e| {
                        (
                            e.code().unwrap_or(ErrorCode::INTERNAL),
                            format!("the module did not arrive: {e}"),
                        )
                    })?;
                    if sha256(&bytes) != hash {
                        return Err((
                            ErrorCode::MODULE_INVALID,
                            format!(
                                "the module's SHA-256 is {}; the request says {}",
                                hex(&sha256(&bytes)),
                                hex(&hash)
                            ),
                        ));
                    }
                    Ok(Arrived::Module(bytes))
                });
                continue;
            }
            if let Err(e) = run.check_input(&meta) {
                incoming.reject(e.code(), e.to_string());
                return Err((e.code(), e.to_string()));
            }
            if seen.iter().any(|n| n == meta.name()) {
                let why = format!("input {} arrived twice", meta.name());
                incoming.reject(ErrorCode::ARGUMENT_MISMATCH, why.clone());
                return Err((ErrorCode::ARGUMENT_MISMATCH, why));
            }
            if matches!(meta.device(), Device::Host) {
                let why = format!(
                    "input {} asks for host memory; kernel inputs land on the GPU",
                    meta.name()
                );
                incoming.reject(ErrorCode::UNSUPPORTED_DEVICE, why.clone());
                return Err((ErrorCode::UNSUPPORTED_DEVICE, why));
            }
            seen.push(meta.name().to_owned());
            expected_inputs -= 1;
            let placement = placement.clone();
            landing.spawn(async move {
                let sink = placement
                    .admit(
                        &meta,
                        incoming.memory_shares(),
                        incoming.host_memory(),
                        wait,
                    )
                    .await;
                let sink = match sink {
                    Ok(sink) => sink,
                    Err(e) => {
                        incoming.reject(e.code, e.message.clone());
                        return Err((e.code, format!("input {}: {}", meta.name(), e.message)));
                    }
                };
                let (_, buffer) = incoming.accept(sink).finished().await.map_err(|e| {
                    (
                        e.code().unwrap_or(ErrorCode::INTERNAL),
                        format!("input {} did not arrive: {e}", meta.name()),
                    )
                })?;
                match buffer {
                    TensorBuffer::Cuda(buffer) => {
                        Ok(Arrived::Input(meta.name().to_owned(), buffer))
                    }
                    TensorBuffer::Cpu(bytes) if bytes.is_empty() => {
                        Ok(Arrived::Empty(meta.name().to_owned()))
                    }
                    TensorBuffer::Cpu(_) => Err((
                        ErrorCode::INTERNAL,
                        format!("input {} landed in host memory", meta.name()),
                    )),
                }
            });
        }
        let mut landed = Landed {
            inputs: HashMap::new(),
            module: None,
        };
        while let Some(arrived) = landing.join_next().await {
            let arrived =
                arrived.map_err(|e| (ErrorCode::INTERNAL, format!("landing failed: {e}")))??;
            match arrived {
                Arrived::Input(name, buffer) => {
                    landed.inputs.insert(name, Some(buffer));
                }
                Arrived::Empty(name) => {
                    landed.inputs.insert(name, None);
                }
                Arrived::Module(bytes) => landed.module = Some(bytes),
            }
        }
        Ok(landed)
    }

    /// Zero-filled output buffers in exportable memory, admitted against the device budget.
    async fn allocate_outputs(
        &self,
        run: &RunRequest,
        gpu: &PooledGpuReceiver,
    ) -> Result<Vec<Option<CudaBuffer>>, Failure> {
        let mut outputs = Vec::new();
        for arg in &run.args {
            let ArgSpec::Output { name, .. } = arg else {
                continue;
            };
            let len = arg.byte_len().unwrap_or(u64::MAX);
            if len == 0 {
                outputs.push(None);
                continue;
            }
            let reservation =
                tokio::time::timeout(self.config.admission_wait, gpu.memory_budget().reserve(len))
                    .await
                    .map_err(|_| {
                        (
                            ErrorCode::RESOURCE_EXHAUSTED,
                            format!("no device memory for output {name} ({len} bytes) in time"),
                        )
                    })?
                    .map_err(|e| (e.code, format!("output {name}: {}", e.message)))?;
            let len = usize::try_from(len)
                .map_err(|_| (ErrorCode::TENSOR_TOO_LARGE, format!("output {name}")))?;
            let memory = DeviceAllocation::new_vmm(gpu.device(), len)
                .map_err(|e| (ErrorCode::RESOURCE_EXHAUSTED, format!("output {name}: {e}")))?;
            let buffer = CudaBuffer::from_owned(memory, len)
                .with_reservation(reservation)
                .map_err(|e| (ErrorCode::INTERNAL, format!("output {name}: {e}")))?;
            outputs.push(Some(buffer));
        }
        Ok(outputs)
    }
}

enum Arrived {
    Input(String, CudaBuffer),
    Empty(String),
    Module(Bytes),
}

struct Landed {
    /// Each input by name; `None` for a zero-byte one.
    inputs: HashMap<String, Option<CudaBuffer>>,
    module: Option<Bytes>,
}

/// The worker's job for `run`: each input and output exported, scalars by value.
fn submission(
    run: &RunRequest,
    module: &CachedModule,
    inputs: &HashMap<String, Option<CudaBuffer>>,
    outputs: &[Option<CudaBuffer>],
    limits: &ExecLimits,
) -> Result<Submission, Failure> {
    let mut buffers = Vec::new();
    let mut buffer_fds: Vec<OwnedFd> = Vec::new();
    let mut args = Vec::with_capacity(run.args.len());
    let mut zero = Vec::new();
    let mut outputs = outputs.iter();
    let mut export = |buffer: &CudaBuffer| -> Result<usize, Failure> {
        let allocation = buffer.allocation();
        let fd = allocation
            .export_fd()
            .and_then(|fd| {
                fd.as_fd()
                    .try_clone_to_owned()
                    .map_err(|e| tensorwire_gpu::GpuError::NotExportable(e.to_string()))
            })
            .map_err(|e| (ErrorCode::INTERNAL, format!("exporting a tensor: {e}")))?;
        let offset = (buffer.device_ptr() - allocation.device_ptr()) as usize;
        buffers.push((allocation.len(), offset, buffer.len()));
        buffer_fds.push(fd);
        Ok(buffers.len() - 1)
    };
    for arg in &run.args {
        match arg {
            ArgSpec::Input { name, .. } => match inputs.get(name) {
                Some(Some(buffer)) => args.push(JobArg::Buffer(export(buffer)?)),
                Some(None) => args.push(JobArg::Null),
                None => {
                    return Err((
                        ErrorCode::INTERNAL,
                        format!("input {name} is missing after landing"),
                    ));
                }
            },
            ArgSpec::Output { .. } => match outputs.next() {
                Some(Some(buffer)) => {
                    let i = export(buffer)?;
                    zero.push(i);
                    args.push(JobArg::Buffer(i));
                }
                _ => args.push(JobArg::Null),
            },
            ArgSpec::Scalar { value, .. } => args.push(JobArg::Value(value.clone())),
        }
    }
    let launch = &run.launch;
    Ok(Submission {
        job: Job {
            module: hex(&run.module_sha256),
            module_attached: false,
            format: module.format.code(),
            function: run.function.clone(),
            grid: launch.grid,
            block: launch.block,
            shared_mem_bytes: launch.shared_mem_bytes,
            buffers,
            args,
            zero,
        },
        module_bytes: module.bytes.clone(),
        buffer_fds,
        time_limit: Duration::from_millis(u64::from(run.effective_time_limit_ms(limits))),
    })
}

/// Copies each output to the host and sends it back, tagged; waits for every COMPLETE.
async fn send_outputs(
    run: &RunRequest,
    id: u64,
    outputs: Vec<Option<CudaBuffer>>,
    to: &ConnectionSender,
) -> Result<(), Failure> {
    let mut sends = Vec::new();
    let mut outputs = outputs.into_iter();
    for arg in &run.args {
        let ArgSpec::Output { name, dtype, shape } = arg else {
            continue;
        };
        let bytes = match outputs.next().flatten() {
            Some(buffer) => tokio::task::spawn_blocking(move || buffer.copy_to_host())
                .await
                .map_err(|e| (ErrorCode::INTERNAL, e.to_string()))?
                .map_err(|e| (ErrorCode::SINK_FAILED, format!("output {name}: {e}")))?,
            None => Vec::new(),
        };
        let meta = TensorMeta::new(shape.clone(), *dtype)
            .map_err(|e| (e.code(), e.to_string()))?
            .with_name(name.clone());
        let meta = ExecRole::Output.tag(meta, id);
        sends.push((name.clone(), to.send(meta, Bytes::from(bytes))));
    }
    for (name, send) in sends {
        send.finished().await.map_err(|e| {
            (
                e.code().unwrap_or(ErrorCode::INTERNAL),
                format!("output {name} was not delivered: {e}"),
            )
        })?;
    }
    Ok(())
}

fn ok_reply(kind: RequestKind, id: u64, attributes: Vec<(String, String)>) -> ExecReply {
    ExecReply {
        kind,
        id,
        error: None,
        message: String::new(),
        timings: Timings::default(),
        attributes,
    }
}
