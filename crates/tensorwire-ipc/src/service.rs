//! The producer's side: a registry served on a checked Unix socket (spec/ipc.md).

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{RecvTimeoutError, sync_channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use tensorwire_proto::TensorMeta;
use uuid::Uuid;

use crate::error::IpcError;
use crate::exported::Exported;
use crate::memory::SharedMemory;
use crate::message::{
    ErrorBody, Export, GpuInfo, Info, PROTOCOL_VERSION, RefusalCode, Reply, Request,
};
use crate::registry::{ClientId, Registry, Watcher};

/// What publishing a tensor under a name that is already shared does (spec/ipc.md §4).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnExisting {
    /// The new tensor takes the name as its next generation; leases on the old one keep
    /// its memory until released.
    #[default]
    Replace,
    /// The new bytes are copied into the existing memory (same address: a consumer that
    /// mapped it once sees them) and the generation goes up; dtype and shape must match.
    InPlace,
    /// The new tensor is refused (a receiver refuses it at METADATA time).
    Reject,
}

impl std::str::FromStr for OnExisting {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "replace" => Ok(OnExisting::Replace),
            "in-place" => Ok(OnExisting::InPlace),
            "reject" => Ok(OnExisting::Reject),
            other => Err(format!("{other:?}: expected replace, in-place or reject")),
        }
    }
}

/// Why an update of a shared name is refused, with the wire code a receiver sends its peer.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct UpdateRefused {
    /// REJECTED (the policy refuses updates) or DESTINATION_MISMATCH (in place, but the
    /// dtype or shape differ).
    pub code: tensorwire_proto::ErrorCode,
    /// Which tensor, and why.
    pub message: String,
}

/// Microseconds since the Unix epoch, now.
fn now_unix_us() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// Most events a watcher may have queued; past it the watcher is told and disconnected.
const WATCH_QUEUE: usize = 1024;

/// Longest `open` wait a consumer may ask for.
const MAX_OPEN_WAIT: Duration = Duration::from_secs(3600);
use crate::socket::{Packets, listen};

/// Who may connect and how much they may hold.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ShareConfig {
    /// Uids allowed to connect (`SO_PEERCRED`); default: this process's effective uid.
    pub allowed_uids: Vec<u32>,
    /// Most leases one consumer process may hold, over all its connections.
    pub max_leases_per_process: usize,
    /// Most consumer connections served at once (each has a thread); more are refused with
    /// `too_many_connections`.
    pub max_connections: usize,
    /// Most connections one consumer process may have open at once: low enough that many
    /// processes at their cap leave room for one more (256 / 8 = 32 processes).
    pub max_connections_per_process: usize,
    /// What publishing a name that is already shared does.
    pub on_existing: OnExisting,
}

impl Default for ShareConfig {
    fn default() -> Self {
        Self {
            allowed_uids: vec![rustix::process::geteuid().as_raw()],
            max_leases_per_process: 1024,
            max_connections: 256,
            max_connections_per_process: 8,
            on_existing: OnExisting::Replace,
        }
    }
}

struct Shared {
    registry: Mutex<Registry>,
    /// Signalled whenever a tensor is published or updated: `open` waits on it.
    published: Condvar,
    config: ShareConfig,
    next_client: AtomicU64,
    stopping: AtomicBool,
    /// Open consumer connections, in all and by process id.
    connections: Mutex<HashMap<u32, usize>>,
}

impl Shared {
    fn registry(&self) -> MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn connections(&self) -> MutexGuard<'_, HashMap<u32, usize>> {
        self.connections
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts a new connection of `process`, or says which limit it would break.
    fn admit_connection(&self, process: u32) -> Result<(), String> {
        let mut open = self.connections();
        let total: usize = open.values().sum();
        if total >= self.config.max_connections {
            return Err(format!(
                "{total} consumer connections are open; the limit is {}",
                self.config.max_connections
            ));
        }
        let mine = open.entry(process).or_default();
        if *mine >= self.config.max_connections_per_process {
            return Err(format!(
                "process {process} has {mine} connections open; the limit is {}",
                self.config.max_connections_per_process
            ));
        }
        *mine += 1;
        Ok(())
    }

    fn connection_closed(&self, process: u32) {
        let mut open = self.connections();
        if let Some(n) = open.get_mut(&process) {
            *n -= 1;
            if *n == 0 {
                open.remove(&process);
            }
        }
    }
}

/// Refused connections waiting to be told why; past this many, one is closed with no reason
/// rather than waited for.
const REFUSALS_QUEUED: usize = 64;

/// How long a refused peer's first request is waited for: a consumer sends it as soon as it
/// connects, so only a silent peer waits this long.
const REFUSAL_WAIT: Duration = Duration::from_millis(250);

/// A refused connection, its code and why.
type Refusal = (Packets, RefusalCode, String);

/// Tells refused peers why, off the accept loop and all at once. Each peer's first request
/// is read before the answer (closing with unread data would reset the connection, and the
/// peer would never see why); one that stays silent is closed after [`REFUSAL_WAIT`], so
/// silent peers never delay another's answer.
fn refusal_loop(refusals: std::sync::mpsc::Receiver<Refusal>) {
    use rustix::event::{PollFd, PollFlags, poll};
    let mut waiting: Vec<(Refusal, Instant)> = Vec::new();
    loop {
        // Block for the next refusal only when none is waiting.
        if waiting.is_empty() {
            match refusals.recv() {
                Ok(refusal) => waiting.push((refusal, Instant::now() + REFUSAL_WAIT)),
                Err(_) => return, // The service stopped.
            }
        }
        while waiting.len() < REFUSALS_QUEUED {
            match refusals.try_recv() {
                Ok(refusal) => waiting.push((refusal, Instant::now() + REFUSAL_WAIT)),
                Err(_) => break,
            }
        }
        let now = Instant::now();
        let wait = waiting
            .iter()
            .map(|(_, deadline)| deadline.saturating_duration_since(now))
            .min()
            .unwrap_or_default()
            // Short, so refusals that came meanwhile join the wait.
            .min(Duration::from_millis(20));
        let timeout = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: i64::from(wait.subsec_nanos()),
        };
        let ready: Vec<bool> = {
            let mut fds: Vec<PollFd<'_>> = waiting
                .iter()
                .map(|((packets, _, _), _)| {
                    PollFd::from_borrowed_fd(packets.as_fd(), PollFlags::IN)
                })
                .collect();
            let _ = poll(&mut fds, Some(&timeout));
            fds.iter().map(|fd| !fd.revents().is_empty()).collect()
        };
        let now = Instant::now();
        let mut ready = ready.into_iter();
        waiting.retain(|((packets, code, why), deadline)| {
            let answered = ready.next().unwrap_or(false);
            if answered {
                let _ = packets.recv();
                let _ = send(packets, &Reply::error(code.clone(), why.clone()), None);
            }
            !answered && *deadline > now
        });
    }
}

/// A running sharing service: publish tensors; consumers connect to [`path`](Self::path).
pub struct ShareService {
    shared: Arc<Shared>,
    listener: Arc<OwnedFd>,
    path: PathBuf,
}

/// A tensor this process published; reads see consumers' in-place writes.
pub struct PublishedTensor {
    id: Uuid,
    memory: Exported,
    len: usize,
    generation: u64,
}

impl PublishedTensor {
    /// The registry id.
    pub fn id(&self) -> Uuid {
        self.id
    }

    /// Its name's generation: 1 when first published, one more with each update.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// How it is exported.
    pub fn export(&self) -> Export {
        self.memory.export()
    }

    /// A host tensor's bytes as they are now (consumers may write them); `None` on a GPU.
    pub fn host_bytes(&self) -> Option<&[u8]> {
        self.memory.host_bytes().map(|bytes| &bytes[..self.len])
    }

    /// The tensor's bytes as they are now, copied to host memory (from the GPU if there).
    pub fn read_to_vec(&self) -> Result<Vec<u8>, IpcError> {
        self.memory.read(self.len)
    }
}

impl ShareService {
    /// Listens at `path`, creating its directory with mode 0700 (spec/ipc.md §1).
    pub fn start(path: impl AsRef<Path>, config: ShareConfig) -> Result<Self, IpcError> {
        let path = path.as_ref().to_owned();
        let listener = Arc::new(listen(&path)?);
        let shared = Arc::new(Shared {
            registry: Mutex::new(Registry::new(config.max_leases_per_process)),
            published: Condvar::new(),
            connections: Mutex::new(HashMap::new()),
            config,
            next_client: AtomicU64::new(1),
            stopping: AtomicBool::new(false),
        });
        let (accept_shared, accept_listener) = (shared.clone(), listener.clone());
        let (refuse, refusals) = std::sync::mpsc::sync_channel(REFUSALS_QUEUED);
        std::thread::Builder::new()
            .name("tensorwire-share-refuse".into())
            .spawn(move || refusal_loop(refusals))?;
        std::thread::Builder::new()
            .name("tensorwire-share-accept".into())
            .spawn(move || accept_loop(&accept_shared, &accept_listener, &refuse))?;
        tracing::info!(path = %path.display(), "sharing tensors");
        Ok(Self {
            shared,
            listener,
            path,
        })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether a tensor with `meta` could be published under the policy: a receiver asks at
    /// METADATA time, so a refused update costs the sender no bytes.
    pub fn check_update(&self, meta: &TensorMeta) -> Result<(), UpdateRefused> {
        match self.shared.registry().current(meta.name()) {
            Some((current, _)) => self.update_refusal(meta, &current),
            None => Ok(()),
        }
    }

    /// Whether the policy lets `meta` take the name `current` holds.
    fn update_refusal(&self, meta: &TensorMeta, current: &TensorMeta) -> Result<(), UpdateRefused> {
        match self.shared.config.on_existing {
            OnExisting::Replace => Ok(()),
            OnExisting::Reject => Err(UpdateRefused {
                code: tensorwire_proto::ErrorCode::REJECTED,
                message: format!(
                    "{} is already shared (generation kept; this producer refuses updates)",
                    meta.name()
                ),
            }),
            OnExisting::InPlace
                if current.dtype() != meta.dtype() || current.shape() != meta.shape() =>
            {
                Err(UpdateRefused {
                    code: tensorwire_proto::ErrorCode::DESTINATION_MISMATCH,
                    message: format!(
                        "{}: {} {:?} cannot update the shared {} {:?} in place",
                        meta.name(),
                        meta.dtype(),
                        meta.shape(),
                        current.dtype(),
                        current.shape()
                    ),
                })
            }
            OnExisting::InPlace => Ok(()),
        }
    }

    /// Publishes a host tensor: copies `bytes` into shared memory under `meta`'s name (or,
    /// updating in place, into the memory already shared under it).
    pub fn publish_host(
        &self,
        meta: &TensorMeta,
        bytes: &[u8],
    ) -> Result<PublishedTensor, IpcError> {
        if bytes.len() as u64 != meta.byte_len() {
            return Err(IpcError::BadMessage(format!(
                "{} bytes for a {}-byte tensor",
                bytes.len(),
                meta.byte_len()
            )));
        }
        self.publish(
            meta,
            || {
                Ok(Exported::Host(Arc::new(SharedMemory::with_bytes(
                    meta.name(),
                    bytes,
                )?)))
            },
            || tensorwire_gpu::TensorBuffer::cpu(bytes.to_vec()),
        )
    }

    /// Publishes a GPU tensor with no copy: `meta.byte_len()` bytes at `offset` of `buffer`
    /// (several tensors may share one buffer at different offsets). VMM memory is exported as
    /// an fd, `cuMemAlloc` memory as a legacy IPC handle plus the offset; the export is made
    /// now, once per allocation. The buffer stays out of its pool until the tensor is deleted
    /// and its last lease has ended. Publish only after the tensor's last copy completed (a
    /// buffer from a finished receive has). Updating in place copies from it.
    #[cfg(feature = "cuda")]
    pub fn publish_device(
        &self,
        meta: &TensorMeta,
        buffer: Arc<tensorwire_gpu::CudaBuffer>,
        offset: u64,
    ) -> Result<PublishedTensor, IpcError> {
        if offset != 0 && self.shared.config.on_existing == OnExisting::InPlace {
            return Err(IpcError::BadMessage(
                "in-place updates copy whole buffers: publish at offset 0".into(),
            ));
        }
        let bytes = tensorwire_gpu::TensorBuffer::Cuda(buffer.share());
        self.publish(
            meta,
            || Exported::device(buffer, offset, meta.byte_len()),
            || bytes,
        )
    }

    /// Publishes a received tensor where it landed: GPU buffers with no copy, host buffers
    /// copied once into shared memory.
    pub fn publish_buffer(
        &self,
        meta: &TensorMeta,
        buffer: tensorwire_gpu::TensorBuffer,
    ) -> Result<PublishedTensor, IpcError> {
        match buffer {
            tensorwire_gpu::TensorBuffer::Host(bytes) => self.publish_host(meta, &bytes),
            #[cfg(feature = "cuda")]
            tensorwire_gpu::TensorBuffer::Cuda(buffer) => {
                self.publish_device(meta, Arc::new(buffer), 0)
            }
            #[cfg(not(feature = "cuda"))]
            tensorwire_gpu::TensorBuffer::Cuda(_) => Err(IpcError::NoCuda("GPU")),
        }
    }

    /// Publishes under `meta`'s name by the update policy: the tensor's memory is exported
    /// by `export`, or, updating in place, `bytes` are copied into the memory shared already.
    fn publish(
        &self,
        meta: &TensorMeta,
        export: impl FnOnce() -> Result<Exported, IpcError>,
        bytes: impl FnOnce() -> tensorwire_gpu::TensorBuffer,
    ) -> Result<PublishedTensor, IpcError> {
        let landed = now_unix_us();
        let len = usize::try_from(meta.byte_len())
            .map_err(|_| IpcError::BadMessage("tensor larger than the address space".into()))?;
        let current = self.shared.registry().current(meta.name());
        if let Some((current, _)) = &current {
            self.update_refusal(meta, current)
                .map_err(|refused| IpcError::Refused {
                    code: RefusalCode::bad_request(),
                    message: refused.message,
                })?;
        }
        let (id, generation, memory) = match current {
            Some((_, existing)) if self.shared.config.on_existing == OnExisting::InPlace => {
                // Outside the registry's lock: a large copy must not stall other requests.
                existing.overwrite(&bytes())?;
                let (id, generation) = self
                    .shared
                    .registry()
                    .updated_in_place(meta.name(), landed)
                    .map_err(refused)?;
                (id, generation, existing)
            }
            _ => {
                let memory = export()?;
                let (id, generation) =
                    self.shared
                        .registry()
                        .publish(meta.clone(), memory.clone(), landed);
                (id, generation, memory)
            }
        };
        self.shared.published.notify_all();
        Ok(PublishedTensor {
            id,
            memory,
            len,
            generation,
        })
    }

    /// Every published tensor.
    pub fn list(&self) -> Vec<Info> {
        self.shared.registry().list()
    }

    /// This host's GPUs, as consumers see them through `devices`.
    pub fn devices(&self) -> Result<Vec<GpuInfo>, IpcError> {
        local_gpus()
    }

    /// Deletes a tensor by id or name; `Ok(true)` if deferred until its leases end.
    pub fn delete(&self, tensor: &str) -> Result<bool, IpcError> {
        self.shared.registry().delete(tensor).map_err(refused)
    }
}

impl Drop for ShareService {
    fn drop(&mut self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        let _ = rustix::net::shutdown(&*self.listener, rustix::net::Shutdown::Both);
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The GPUs this process can use (none without a driver or the `cuda` feature).
pub fn local_gpus() -> Result<Vec<GpuInfo>, IpcError> {
    #[cfg(feature = "cuda")]
    {
        let count = tensorwire_gpu::GpuStatus::detect().device_count();
        (0..count)
            .map(|ordinal| {
                let device = tensorwire_gpu::GpuDevice::open(ordinal)?;
                let info = device.info();
                let (free, total) = device.memory()?;
                Ok(GpuInfo {
                    ordinal: ordinal as u32,
                    name: info.name.clone(),
                    uuid: info.uuid_string(),
                    total_memory: total as u64,
                    free_memory: free as u64,
                    compute_capability: [info.compute_capability.0, info.compute_capability.1],
                })
            })
            .collect()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Ok(Vec::new())
    }
}

fn refused(body: ErrorBody) -> IpcError {
    IpcError::Refused {
        code: body.code,
        message: body.message,
    }
}

fn accept_loop(
    shared: &Arc<Shared>,
    listener: &OwnedFd,
    refuse: &std::sync::mpsc::SyncSender<Refusal>,
) {
    loop {
        let accepted = rustix::net::accept_with(listener, rustix::net::SocketFlags::CLOEXEC);
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        let Ok(fd) = accepted else { continue };
        let packets = Packets::from_fd(fd);
        // Who is calling, read once: the uid decides whether it may connect at all, the
        // process which connection cap it counts against.
        let peer = rustix::net::sockopt::socket_peercred(packets.as_fd());
        let allowed = peer
            .as_ref()
            .is_ok_and(|cred| shared.config.allowed_uids.contains(&cred.uid.as_raw()));
        if !allowed {
            let who = peer
                .map(|c| format!("uid {}", c.uid.as_raw()))
                .unwrap_or_else(|e| e.to_string());
            tracing::warn!(%who, "refusing a consumer");
            // Full: this one is closed with no reason rather than delay the next.
            let _ = refuse.try_send((
                packets,
                RefusalCode::forbidden(),
                format!("{who} may not connect"),
            ));
            continue;
        }
        let process = peer.map_or(0, |cred| cred.pid.as_raw_nonzero().get() as u32);
        if let Err(why) = shared.admit_connection(process) {
            tracing::warn!(process, %why, "refusing a consumer connection");
            let _ = refuse.try_send((packets, RefusalCode::too_many_connections(), why));
            continue;
        }
        let client = shared.next_client.fetch_add(1, Ordering::Relaxed);
        let shared = shared.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("tensorwire-share-client-{client}"))
            .spawn({
                let shared = shared.clone();
                move || {
                    serve_client(&shared, packets, client, process);
                    shared.connection_closed(process);
                }
            });
        if let Err(e) = spawned {
            shared.connection_closed(process);
            tracing::error!(error = %e, "cannot serve a consumer");
        }
    }
}

fn send(
    packets: &Packets,
    reply: &Reply,
    fd: Option<std::os::fd::BorrowedFd<'_>>,
) -> Result<(), IpcError> {
    let bytes = serde_json::to_vec(reply).map_err(|e| IpcError::BadMessage(e.to_string()))?;
    packets.send(&bytes, fd)
}

/// Serves one consumer whose uid was checked when it connected.
fn serve_client(shared: &Shared, packets: Packets, client: ClientId, process: u32) {
    let mut greeted = false;
    loop {
        let received = match packets.recv() {
            Ok(Some(received)) => received,
            Ok(None) => break,
            Err(IpcError::BadMessage(why)) => {
                if send(
                    &packets,
                    &Reply::error(RefusalCode::bad_request(), why),
                    None,
                )
                .is_err()
                {
                    break;
                }
                continue;
            }
            Err(_) => break,
        };
        drop(received.fd); // Consumers send no descriptors; close any that came.
        let request: Request = match serde_json::from_slice(&received.bytes) {
            Ok(request) => request,
            Err(e) => {
                if send(
                    &packets,
                    &Reply::error(RefusalCode::bad_request(), e.to_string()),
                    None,
                )
                .is_err()
                {
                    break;
                }
                continue;
            }
        };
        let sent = match (&request, greeted) {
            (Request::Hello { version }, _) if *version == PROTOCOL_VERSION => {
                greeted = true;
                send(
                    &packets,
                    &Reply {
                        version: Some(PROTOCOL_VERSION),
                        ..Reply::ok()
                    },
                    None,
                )
            }
            (Request::Hello { version }, _) => send(
                &packets,
                &Reply::error(
                    RefusalCode::unsupported_version(),
                    format!("version {version}; this producer speaks {PROTOCOL_VERSION}"),
                ),
                None,
            ),
            (_, false) => send(
                &packets,
                &Reply::error(RefusalCode::bad_request(), "send hello first"),
                None,
            ),
            (request, true) => handle(shared, &packets, request, (client, process)),
        };
        if sent.is_err() {
            break;
        }
    }
    shared.registry().client_gone(client);
}

/// Answers `open`: takes a lease and sends the descriptor with its fd. A name not published
/// yet is waited for up to `wait` (capped at an hour).
fn open(
    shared: &Shared,
    packets: &Packets,
    tensor: &str,
    wait: Option<Duration>,
    (client, process): (ClientId, u32),
) -> Result<(), IpcError> {
    let deadline = Instant::now() + wait.unwrap_or_default().min(MAX_OPEN_WAIT);
    let mut registry = shared.registry();
    let opened = loop {
        match registry.open(tensor, client, process) {
            Err(mut refusal) if refusal.code == RefusalCode::not_found() => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() || shared.stopping.load(Ordering::SeqCst) {
                    if let Some(wait) = wait {
                        refusal.message += &format!(" after waiting {} ms", wait.as_millis());
                    }
                    break Err(refusal);
                }
                // Every publication wakes all waiters; each looks again.
                registry = shared
                    .published
                    .wait_timeout(registry, left)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
            other => break other,
        }
    };
    drop(registry);
    let (lease, descriptor, memory) = match opened {
        Ok(opened) => opened,
        Err(refusal) => return send(packets, &Reply::refusal(refusal), None),
    };
    let fd = match memory.fd() {
        Ok(fd) => fd,
        Err(e) => {
            let _ = shared.registry().release(lease, client);
            return send(
                packets,
                &Reply::error(RefusalCode::internal(), e.to_string()),
                None,
            );
        }
    };
    let reply = Reply {
        lease: Some(lease),
        descriptor: Some(descriptor),
        ..Reply::ok()
    };
    send(packets, &reply, fd)
}

/// Serves a `watch`: the connection carries only events from now on, until the consumer
/// closes it, falls too far behind, or the service stops.
fn watch(shared: &Shared, packets: &Packets, prefix: String) -> Result<(), IpcError> {
    let (events, queue) = sync_channel(WATCH_QUEUE);
    let overflowed = Arc::new(AtomicBool::new(false));
    shared.registry().watch(Watcher {
        prefix,
        events,
        overflowed: overflowed.clone(),
    });
    send(packets, &Reply::ok(), None)?;
    loop {
        match queue.recv_timeout(Duration::from_millis(250)) {
            Ok(event) => {
                let bytes =
                    serde_json::to_vec(&event).map_err(|e| IpcError::BadMessage(e.to_string()))?;
                packets.send(&bytes, None)?;
            }
            Err(RecvTimeoutError::Timeout) => {
                if shared.stopping.load(Ordering::SeqCst) || packets.peer_closed() {
                    return Ok(());
                }
            }
            Err(RecvTimeoutError::Disconnected) => {
                if overflowed.load(Ordering::SeqCst) {
                    let why = format!("more than {WATCH_QUEUE} events were waiting to be read");
                    let _ = send(packets, &Reply::error(RefusalCode::overflow(), why), None);
                }
                return Ok(());
            }
        }
    }
}

fn handle(
    shared: &Shared,
    packets: &Packets,
    request: &Request,
    (client, process): (ClientId, u32),
) -> Result<(), IpcError> {
    let mut registry = shared.registry();
    let reply = match request {
        Request::Hello { .. } => Reply::ok(),
        Request::List => Reply {
            tensors: Some(registry.list()),
            ..Reply::ok()
        },
        Request::Info { tensor } => match registry.lookup(tensor) {
            Ok(info) => Reply {
                tensor: Some(info),
                ..Reply::ok()
            },
            Err(refusal) => Reply::refusal(refusal),
        },
        Request::Open { tensor, wait_ms } => {
            drop(registry);
            let wait = wait_ms.map(Duration::from_millis);
            return open(shared, packets, tensor, wait, (client, process));
        }
        Request::Watch { prefix } => {
            drop(registry);
            return watch(shared, packets, prefix.clone()).and(Err(IpcError::Closed));
        }
        Request::Release { lease } => match registry.release(*lease, client) {
            Ok(()) => Reply::ok(),
            Err(refusal) => Reply::refusal(refusal),
        },
        Request::Devices => {
            drop(registry);
            return match local_gpus() {
                Ok(devices) => send(
                    packets,
                    &Reply {
                        devices: Some(devices),
                        ..Reply::ok()
                    },
                    None,
                ),
                Err(e) => send(
                    packets,
                    &Reply::error(RefusalCode::internal(), e.to_string()),
                    None,
                ),
            };
        }
        Request::Delete { tensor } => match registry.delete(tensor) {
            Ok(deferred) => Reply {
                deferred: Some(deferred),
                ..Reply::ok()
            },
            Err(refusal) => Reply::refusal(refusal),
        },
    };
    drop(registry);
    send(packets, &reply, None)
}
