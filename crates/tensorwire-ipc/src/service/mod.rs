//! The producer's side: a registry served on a checked Unix socket (spec/ipc.md).
//!
//! - this module: [`ShareService`], what it publishes and its policy;
//! - `serve`: the accept loop and each consumer's requests;
//! - `refusal`: telling refused consumers why.

mod refusal;
mod serve;

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::SystemTime;

use tensorwire_proto::TensorMeta;
use uuid::Uuid;

use crate::error::IpcError;
use crate::exported::Exported;
use crate::memory::SharedMemory;
use crate::message::{ErrorBody, Export, GpuInfo, Info, RefusalCode};
use crate::registry::Registry;

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

use crate::socket::listen;
use refusal::{REFUSALS_QUEUED, refusal_loop};
use serve::{Shared, accept_loop};

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

    /// Publishes a tensor in device memory another allocator made (a framework's, such as
    /// PyTorch's caching allocator), with no copy: the `cuMemAlloc` allocation it lies in is
    /// exported as a legacy IPC handle, the tensor at its offset, so consumers can map the
    /// rest of that allocation too. The range's owner keeps the memory allocated until the
    /// tensor is deleted and its last lease has ended. Updating in place copies from the
    /// range. VMM memory of another allocator (PyTorch's expandable segments) is refused.
    #[cfg(feature = "cuda")]
    pub fn publish_range(
        &self,
        meta: &TensorMeta,
        range: &tensorwire_gpu::DeviceRange,
    ) -> Result<PublishedTensor, IpcError> {
        if range.len() as u64 != meta.byte_len() {
            return Err(IpcError::BadMessage(format!(
                "{} bytes of device memory for a {}-byte tensor",
                range.len(),
                meta.byte_len()
            )));
        }
        let (allocation, offset) = range.enclosing_allocation()?;
        let len = tensorwire_gpu::Allocation::len(&allocation);
        let whole = Arc::new(tensorwire_gpu::CudaBuffer::from_owned(allocation, len));
        let exact = tensorwire_gpu::CudaBuffer::from_owned(range.allocation()?, range.len());
        self.publish(
            meta,
            || Exported::device(whole, offset, meta.byte_len()),
            || tensorwire_gpu::TensorBuffer::Cuda(exact),
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
