//! The consumer's side: list and open tensors a producer shares; leases end on drop.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::error::IpcError;
use crate::memory::SharedMemory;
use crate::message::{Descriptor, Event, Export, GpuInfo, Info, PROTOCOL_VERSION, Reply, Request};
use crate::socket::{Packets, Received};

/// A connection to a producer's sharing socket.
pub struct ShareClient {
    packets: Arc<Mutex<Packets>>,
    /// The socket's path, for the second connection a watch takes.
    path: PathBuf,
}

fn exchange(
    packets: &Mutex<Packets>,
    request: &Request,
) -> Result<(Reply, Option<OwnedFd>), IpcError> {
    let packets = packets.lock().unwrap_or_else(PoisonError::into_inner);
    let bytes = serde_json::to_vec(request).map_err(|e| IpcError::BadMessage(e.to_string()))?;
    packets.send(&bytes, None)?;
    let Received { bytes, fd } = packets.recv()?.ok_or(IpcError::Closed)?;
    let reply: Reply =
        serde_json::from_slice(&bytes).map_err(|e| IpcError::BadMessage(e.to_string()))?;
    match (&reply.ok, &reply.error) {
        (false, Some(error)) => Err(IpcError::Refused {
            code: error.code.clone(),
            message: error.message.clone(),
        }),
        (false, None) => Err(IpcError::BadMessage("error reply without an error".into())),
        _ => Ok((reply, fd)),
    }
}

impl ShareClient {
    /// Connects to the producer at `path` and checks the protocol version.
    pub fn connect(path: impl AsRef<Path>) -> Result<Self, IpcError> {
        let client = Self {
            packets: Arc::new(Mutex::new(hello(path.as_ref())?)),
            path: path.as_ref().to_owned(),
        };
        Ok(client)
    }

    /// Events (published, updated with the generation, deleted) for every tensor whose name
    /// starts with `prefix`, from now on, on a connection of their own.
    pub fn watch(&self, prefix: &str) -> Result<Watch, IpcError> {
        let packets = Mutex::new(hello(&self.path)?);
        exchange(
            &packets,
            &Request::Watch {
                prefix: prefix.into(),
            },
        )?;
        Ok(Watch {
            packets: packets.into_inner().unwrap_or_else(PoisonError::into_inner),
        })
    }

    /// Every published tensor.
    pub fn list(&self) -> Result<Vec<Info>, IpcError> {
        Ok(exchange(&self.packets, &Request::List)?
            .0
            .tensors
            .unwrap_or_default())
    }

    /// The producer's GPUs (empty when it has none).
    pub fn devices(&self) -> Result<Vec<GpuInfo>, IpcError> {
        Ok(exchange(&self.packets, &Request::Devices)?
            .0
            .devices
            .unwrap_or_default())
    }

    /// One tensor by id or name.
    pub fn info(&self, tensor: &str) -> Result<Info, IpcError> {
        exchange(
            &self.packets,
            &Request::Info {
                tensor: tensor.into(),
            },
        )?
        .0
        .tensor
        .ok_or_else(|| IpcError::BadMessage("info reply without a tensor".into()))
    }

    /// Maps a tensor, holding a lease until the returned value is dropped. GPU memory is
    /// mapped for the GPU that holds it (found by UUID).
    pub fn open(&self, tensor: &str) -> Result<SharedTensor, IpcError> {
        self.open_inner(tensor, Access::Owner, None)
    }

    /// As [`open`](Self::open), waiting up to `wait` for a name that is not published yet
    /// (`not_found` after that).
    pub fn open_wait(&self, tensor: &str, wait: Duration) -> Result<SharedTensor, IpcError> {
        self.open_inner(tensor, Access::Owner, Some(wait))
    }

    /// As [`open`](Self::open), and for VMM exports also readable and writable by every GPU
    /// of this process (peer access across GPUs of one host).
    pub fn open_for_all_gpus(&self, tensor: &str) -> Result<SharedTensor, IpcError> {
        self.open_inner(tensor, Access::AllGpus, None)
    }

    fn open_inner(
        &self,
        tensor: &str,
        access: Access,
        wait: Option<Duration>,
    ) -> Result<SharedTensor, IpcError> {
        let wait_ms = wait.map(|w| u64::try_from(w.as_millis()).unwrap_or(u64::MAX));
        let (reply, fd) = exchange(
            &self.packets,
            &Request::Open {
                tensor: tensor.into(),
                wait_ms,
            },
        )?;
        let (Some(lease), Some(descriptor)) = (reply.lease, reply.descriptor) else {
            return Err(IpcError::BadMessage(
                "open reply without lease and descriptor".into(),
            ));
        };
        // From here on the lease is ours: a failed mapping must still give it back.
        let mut opened = SharedTensor {
            descriptor,
            lease,
            mapping: None,
            packets: self.packets.clone(),
        };
        let descriptor = &opened.descriptor;
        let end = descriptor.offset.checked_add(descriptor.tensor.byte_len);
        if end.is_none_or(|end| end > descriptor.alloc_len) {
            return Err(IpcError::BadMessage(
                "descriptor: the tensor lies past the end of the shared memory".into(),
            ));
        }
        opened.mapping = Some(Mapping::open(descriptor, fd, access)?);
        Ok(opened)
    }

    /// Deletes a tensor; `Ok(true)` if deferred until its leases end.
    pub fn delete(&self, tensor: &str) -> Result<bool, IpcError> {
        Ok(exchange(
            &self.packets,
            &Request::Delete {
                tensor: tensor.into(),
            },
        )?
        .0
        .deferred
        .unwrap_or(false))
    }
}

/// Connects to `path` and greets the producer.
fn hello(path: &Path) -> Result<Packets, IpcError> {
    let packets = Mutex::new(Packets::connect(path)?);
    exchange(
        &packets,
        &Request::Hello {
            version: PROTOCOL_VERSION,
        },
    )?;
    Ok(packets.into_inner().unwrap_or_else(PoisonError::into_inner))
}

/// A stream of [`Event`]s from [`ShareClient::watch`]; iterate it, or wait with a timeout.
pub struct Watch {
    packets: Packets,
}

impl Watch {
    /// The next event, waiting up to `timeout` (`None`: forever); `Ok(None)` on timeout.
    pub fn next_timeout(&mut self, timeout: Option<Duration>) -> Result<Option<Event>, IpcError> {
        rustix::net::sockopt::set_socket_timeout(
            self.packets.as_fd(),
            rustix::net::sockopt::Timeout::Recv,
            timeout,
        )?;
        let received = match self.packets.recv() {
            Ok(Some(received)) => received,
            Ok(None) => return Err(IpcError::Closed),
            Err(IpcError::Io(e)) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) => return Err(e),
        };
        if let Ok(event) = serde_json::from_slice::<Event>(&received.bytes) {
            return Ok(Some(event));
        }
        // Not an event: the producer ended the watch and says why (e.g. `overflow`).
        let reply: Reply = serde_json::from_slice(&received.bytes)
            .map_err(|e| IpcError::BadMessage(e.to_string()))?;
        Err(match reply.error {
            Some(error) => IpcError::Refused {
                code: error.code,
                message: error.message,
            },
            None => IpcError::BadMessage("a watch message that is not an event".into()),
        })
    }
}

impl Iterator for Watch {
    type Item = Result<Event, IpcError>;

    /// The next event, waiting as long as it takes; `None` once the producer is gone.
    fn next(&mut self) -> Option<Self::Item> {
        match self.next_timeout(None) {
            Ok(Some(event)) => Some(Ok(event)),
            Ok(None) | Err(IpcError::Closed) => None,
            Err(e) => Some(Err(e)),
        }
    }
}

#[derive(Clone, Copy)]
enum Access {
    Owner,
    AllGpus,
}

/// What a lease maps: host memory, or GPU memory.
enum Mapping {
    Host(SharedMemory),
    #[cfg(feature = "cuda")]
    Device(tensorwire_gpu::ImportedMemory),
}

impl Mapping {
    fn open(
        descriptor: &Descriptor,
        fd: Option<OwnedFd>,
        access: Access,
    ) -> Result<Self, IpcError> {
        let missing_fd = || IpcError::BadMessage("open reply without its descriptor".into());
        match descriptor.tensor.export {
            Export::Host => {
                let memory = SharedMemory::from_fd(fd.ok_or_else(missing_fd)?)?;
                if (memory.len() as u64) < descriptor.alloc_len {
                    return Err(IpcError::BadMessage(
                        "the shared memory is shorter than the descriptor says".into(),
                    ));
                }
                Ok(Mapping::Host(memory))
            }
            #[cfg(feature = "cuda")]
            export => Self::open_device(descriptor, fd, access, export),
            #[cfg(not(feature = "cuda"))]
            _ => {
                let _ = (fd, access);
                Err(IpcError::NoCuda("GPU"))
            }
        }
    }

    #[cfg(feature = "cuda")]
    fn open_device(
        descriptor: &Descriptor,
        fd: Option<OwnedFd>,
        access: Access,
        export: Export,
    ) -> Result<Self, IpcError> {
        use tensorwire_gpu::{GpuDevice, ImportedMemory, IpcHandle};
        let uuid = descriptor
            .device_uuid
            .as_deref()
            .ok_or_else(|| IpcError::BadMessage("GPU descriptor without device_uuid".into()))?;
        let device = GpuDevice::open_by_uuid(uuid)?;
        let len = usize::try_from(descriptor.alloc_len)
            .map_err(|_| IpcError::BadMessage("alloc_len past the address space".into()))?;
        let memory = match export {
            Export::Vmm => {
                let fd =
                    fd.ok_or_else(|| IpcError::BadMessage("vmm reply without an fd".into()))?;
                let peers = match access {
                    Access::Owner => Vec::new(),
                    Access::AllGpus => GpuDevice::all()?,
                };
                ImportedMemory::import_fd(&fd, len, &device, &peers)?
            }
            _ => {
                drop(fd);
                let handle = descriptor
                    .handle
                    .as_ref()
                    .and_then(|h| h.to_bytes())
                    .ok_or_else(|| {
                        IpcError::BadMessage("cuda_ipc descriptor without a 64-byte handle".into())
                    })?;
                ImportedMemory::open_ipc_handle(&IpcHandle(handle), len, &device)?
            }
        };
        Ok(Mapping::Device(memory))
    }
}

/// A mapped tensor under a lease; dropping it unmaps and releases the lease.
pub struct SharedTensor {
    descriptor: Descriptor,
    lease: u64,
    /// `None` only while opening, or after drop began (unmapped before the lease ends).
    mapping: Option<Mapping>,
    packets: Arc<Mutex<Packets>>,
}

impl SharedTensor {
    /// What the producer said about it.
    pub fn descriptor(&self) -> &Descriptor {
        &self.descriptor
    }

    /// The lease held.
    pub fn lease(&self) -> u64 {
        self.lease
    }

    fn range(&self) -> (usize, usize) {
        let start = self.descriptor.offset as usize;
        (start, start + self.descriptor.tensor.byte_len as usize)
    }

    /// A host tensor's bytes (the producer and other consumers see the same memory); `None`
    /// for a GPU tensor.
    pub fn host_bytes(&self) -> Option<&[u8]> {
        let (start, end) = self.range();
        match &self.mapping {
            Some(Mapping::Host(memory)) => Some(&memory.bytes()[start..end]),
            _ => None,
        }
    }

    /// A host tensor's shared-memory file (sealed against resizing), to hand on to another
    /// process or map with other tools; `None` for a GPU tensor.
    pub fn host_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        match &self.mapping {
            Some(Mapping::Host(memory)) => Some(memory.fd()),
            _ => None,
        }
    }

    /// A host tensor's bytes, writable in place; `None` for a GPU tensor.
    pub fn host_bytes_mut(&mut self) -> Option<&mut [u8]> {
        let (start, end) = self.range();
        match &mut self.mapping {
            Some(Mapping::Host(memory)) => Some(&mut memory.bytes_mut()[start..end]),
            _ => None,
        }
    }

    /// A GPU tensor's device address in this process (the offset already added), and the
    /// device it is on; `None` for a host tensor.
    #[cfg(feature = "cuda")]
    pub fn device_ptr(&self) -> Option<(u64, &Arc<tensorwire_gpu::GpuDevice>)> {
        match &self.mapping {
            Some(Mapping::Device(memory)) => Some((
                memory.device_ptr() + self.descriptor.offset,
                memory.device(),
            )),
            _ => None,
        }
    }

    /// Copies the tensor into `dst` (exactly as long) on any GPU of this process: across
    /// GPUs, open with [`ShareClient::open_for_all_gpus`] for VMM exports.
    #[cfg(feature = "cuda")]
    pub fn copy_to_device(&self, dst: &mut tensorwire_gpu::CudaBuffer) -> Result<(), IpcError> {
        let (start, end) = self.range();
        if dst.len() != end - start {
            return Err(IpcError::BadMessage(format!(
                "a {}-byte tensor into a {}-byte buffer",
                end - start,
                dst.len()
            )));
        }
        match &self.mapping {
            Some(Mapping::Device(memory)) => Ok(memory.copy_to_device(start, dst)?),
            Some(Mapping::Host(memory)) => Ok(dst.copy_from_host(&memory.bytes()[start..end])?),
            None => Err(IpcError::Closed),
        }
    }

    /// Hands the tensor to a DLPack importer (PyTorch, JAX, CuPy) with no copy; the mapping
    /// and the lease last until the importer calls the deleter (or the result is dropped).
    #[allow(unsafe_code, reason = "hands the mapped memory to DLPack's C struct")]
    pub fn into_dlpack(mut self) -> Result<tensorwire_gpu::dlpack::DlpackTensor, IpcError> {
        use tensorwire_gpu::dlpack::{DLDevice, DlpackTensor, KDL_CPU};
        let dtype =
            tensorwire_proto::DType::from_name(&self.descriptor.tensor.dtype).ok_or_else(|| {
                IpcError::BadMessage(format!("unknown dtype {}", self.descriptor.tensor.dtype))
            })?;
        let (start, _) = self.range();
        let (data, device) = match &mut self.mapping {
            Some(Mapping::Host(memory)) => (
                memory.bytes_mut()[start..].as_mut_ptr() as u64,
                DLDevice {
                    device_type: KDL_CPU,
                    device_id: 0,
                },
            ),
            #[cfg(feature = "cuda")]
            Some(Mapping::Device(memory)) => (
                memory.device_ptr() + start as u64,
                DLDevice {
                    device_type: tensorwire_gpu::dlpack::KDL_CUDA,
                    device_id: memory.device().ordinal() as i32,
                },
            ),
            None => return Err(IpcError::Closed),
        };
        let shape = self.descriptor.tensor.shape.clone();
        // SAFETY: `data` is this tensor's first byte in the memory mapped for it (offset
        // included), on `device`, and holds shape × dtype bytes (checked against the mapping
        // when it was opened); `self`, moved in as the owner, keeps the mapping and the lease
        // until the importer calls the deleter.
        unsafe { DlpackTensor::new(data, device, dtype, &shape, Box::new(self)) }
            .map_err(|e| IpcError::BadMessage(e.to_string()))
    }

    /// A copy of the tensor's bytes in host memory (from the GPU for a GPU tensor).
    pub fn read_to_vec(&self) -> Result<Vec<u8>, IpcError> {
        let (start, end) = self.range();
        match &self.mapping {
            Some(Mapping::Host(memory)) => Ok(memory.bytes()[start..end].to_vec()),
            #[cfg(feature = "cuda")]
            Some(Mapping::Device(memory)) => {
                let mut out = vec![0u8; end - start];
                memory.copy_to_host(start, &mut out)?;
                Ok(out)
            }
            None => Err(IpcError::Closed),
        }
    }

    /// Overwrites the tensor's bytes in place with `src` (exactly its length): the producer
    /// and other consumers see the write.
    pub fn write_from(&mut self, src: &[u8]) -> Result<(), IpcError> {
        let (start, end) = self.range();
        if src.len() != end - start {
            return Err(IpcError::BadMessage(format!(
                "{} bytes for a {}-byte tensor",
                src.len(),
                end - start
            )));
        }
        match &mut self.mapping {
            Some(Mapping::Host(memory)) => {
                memory.bytes_mut()[start..end].copy_from_slice(src);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Some(Mapping::Device(memory)) => Ok(memory.copy_from_host(start, src)?),
            None => Err(IpcError::Closed),
        }
    }
}

impl Drop for SharedTensor {
    fn drop(&mut self) {
        // Unmap first: the producer may free the memory as soon as the lease ends.
        drop(self.mapping.take());
        if let Err(e) = exchange(&self.packets, &Request::Release { lease: self.lease }) {
            tracing::warn!(error = %e, lease = self.lease, "releasing a lease failed");
        }
    }
}
