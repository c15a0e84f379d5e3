//! The producer's side: a registry served on a checked Unix socket (spec/ipc.md).

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tensorwire_proto::TensorMeta;
use uuid::Uuid;

use crate::error::IpcError;
use crate::exported::Exported;
use crate::memory::SharedMemory;
use crate::message::{
    ErrorBody, ErrorCode, Export, GpuInfo, Info, PROTOCOL_VERSION, Reply, Request,
};
use crate::registry::{ClientId, Registry};
use crate::socket::{Packets, listen};

/// Who may connect and how much they may hold.
#[derive(Clone, Debug)]
pub struct ShareConfig {
    /// Uids allowed to connect (`SO_PEERCRED`); default: this process's effective uid.
    pub allowed_uids: Vec<u32>,
    /// Most leases one consumer process may hold, over all its connections.
    pub max_leases_per_process: usize,
    /// Most consumer connections served at once (each has a thread); more are refused with
    /// `too_many_connections`.
    pub max_connections: usize,
    /// Most connections one consumer process may have open at once.
    pub max_connections_per_process: usize,
}

impl Default for ShareConfig {
    fn default() -> Self {
        Self {
            allowed_uids: vec![rustix::process::geteuid().as_raw()],
            max_leases_per_process: 1024,
            max_connections: 256,
            max_connections_per_process: 16,
        }
    }
}

struct Shared {
    registry: Mutex<Registry>,
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

/// Answers a refused peer's first request with `code` and `why`, then disconnects. Its first
/// request is read first: closing with unread data would reset the connection and the peer
/// would never see why. A silent peer waits at most 2 s.
fn refuse_connection(packets: &Packets, code: ErrorCode, why: String) {
    let timeout = Some(std::time::Duration::from_secs(2));
    let _ = rustix::net::sockopt::set_socket_timeout(
        packets.as_fd(),
        rustix::net::sockopt::Timeout::Recv,
        timeout,
    );
    let _ = packets.recv();
    let _ = send(packets, &Reply::error(code, why), None);
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
}

impl PublishedTensor {
    /// The registry id.
    pub fn id(&self) -> Uuid {
        self.id
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
            connections: Mutex::new(HashMap::new()),
            config,
            next_client: AtomicU64::new(1),
            stopping: AtomicBool::new(false),
        });
        let (accept_shared, accept_listener) = (shared.clone(), listener.clone());
        std::thread::Builder::new()
            .name("tensorwire-share-accept".into())
            .spawn(move || accept_loop(&accept_shared, &accept_listener))?;
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

    /// Publishes a host tensor: copies `bytes` into shared memory under `meta`'s name.
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
        let memory = Exported::Host(Arc::new(SharedMemory::with_bytes(meta.name(), bytes)?));
        self.publish(meta, memory)
    }

    /// Publishes a GPU tensor with no copy: `meta.byte_len()` bytes at `offset` of `buffer`
    /// (several tensors may share one buffer at different offsets). VMM memory is exported as
    /// an fd, `cuMemAlloc` memory as a legacy IPC handle plus the offset; the export is made
    /// now, once per allocation. The buffer stays out of its pool until the tensor is deleted
    /// and its last lease has ended. Publish only after the tensor's last copy completed (a
    /// buffer from a finished receive has).
    #[cfg(feature = "cuda")]
    pub fn publish_device(
        &self,
        meta: &TensorMeta,
        buffer: Arc<tensorwire_gpu::CudaBuffer>,
        offset: u64,
    ) -> Result<PublishedTensor, IpcError> {
        let memory = Exported::device(buffer, offset, meta.byte_len())?;
        self.publish(meta, memory)
    }

    /// Publishes a received tensor where it landed: GPU buffers with no copy, host buffers
    /// copied once into shared memory.
    pub fn publish_buffer(
        &self,
        meta: &TensorMeta,
        buffer: tensorwire_gpu::TensorBuffer,
    ) -> Result<PublishedTensor, IpcError> {
        match buffer {
            tensorwire_gpu::TensorBuffer::Cpu(bytes) => self.publish_host(meta, &bytes),
            #[cfg(feature = "cuda")]
            tensorwire_gpu::TensorBuffer::Cuda(buffer) => {
                self.publish_device(meta, Arc::new(buffer), 0)
            }
            #[cfg(not(feature = "cuda"))]
            tensorwire_gpu::TensorBuffer::Cuda(_) => Err(IpcError::NoCuda("GPU")),
        }
    }

    fn publish(&self, meta: &TensorMeta, memory: Exported) -> Result<PublishedTensor, IpcError> {
        let len = usize::try_from(meta.byte_len())
            .map_err(|_| IpcError::BadMessage("tensor larger than the address space".into()))?;
        let id = self
            .shared
            .registry()
            .publish(meta.clone(), memory.clone())
            .map_err(refused)?;
        Ok(PublishedTensor { id, memory, len })
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

fn accept_loop(shared: &Arc<Shared>, listener: &OwnedFd) {
    loop {
        let accepted = rustix::net::accept_with(listener, rustix::net::SocketFlags::CLOEXEC);
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        let Ok(fd) = accepted else { continue };
        let packets = Packets::from_fd(fd);
        let process = rustix::net::sockopt::socket_peercred(packets.as_fd())
            .map_or(0, |cred| cred.pid.as_raw_nonzero().get() as u32);
        if let Err(why) = shared.admit_connection(process) {
            tracing::warn!(process, %why, "refusing a consumer connection");
            refuse_connection(&packets, ErrorCode::too_many_connections(), why);
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

fn serve_client(shared: &Shared, packets: Packets, client: ClientId, process: u32) {
    let peer = rustix::net::sockopt::socket_peercred(packets.as_fd());
    let allowed = peer
        .as_ref()
        .is_ok_and(|cred| shared.config.allowed_uids.contains(&cred.uid.as_raw()));
    if !allowed {
        let who = peer
            .map(|c| format!("uid {}", c.uid.as_raw()))
            .unwrap_or_else(|e| e.to_string());
        tracing::warn!(%who, "refusing a consumer");
        refuse_connection(
            &packets,
            ErrorCode::forbidden(),
            format!("{who} may not connect"),
        );
        return;
    }
    let mut greeted = false;
    loop {
        let received = match packets.recv() {
            Ok(Some(received)) => received,
            Ok(None) => break,
            Err(IpcError::BadMessage(why)) => {
                if send(&packets, &Reply::error(ErrorCode::bad_request(), why), None).is_err() {
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
                    &Reply::error(ErrorCode::bad_request(), e.to_string()),
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
                    ErrorCode::unsupported_version(),
                    format!("version {version}; this producer speaks {PROTOCOL_VERSION}"),
                ),
                None,
            ),
            (_, false) => send(
                &packets,
                &Reply::error(ErrorCode::bad_request(), "send hello first"),
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
        Request::Open { tensor } => match registry.open(tensor, client, process) {
            Ok((lease, descriptor, memory)) => {
                drop(registry);
                let fd = match memory.fd() {
                    Ok(fd) => fd,
                    Err(e) => {
                        let _ = shared.registry().release(lease, client);
                        return send(
                            packets,
                            &Reply::error(ErrorCode::internal(), e.to_string()),
                            None,
                        );
                    }
                };
                let reply = Reply {
                    lease: Some(lease),
                    descriptor: Some(descriptor),
                    ..Reply::ok()
                };
                return send(packets, &reply, fd);
            }
            Err(refusal) => Reply::refusal(refusal),
        },
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
                    &Reply::error(ErrorCode::internal(), e.to_string()),
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
