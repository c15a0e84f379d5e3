//! The memory a published tensor lives in, and how it is exported (spec/ipc.md §3).

use std::os::fd::BorrowedFd;
use std::sync::Arc;

use crate::error::IpcError;
use crate::memory::SharedMemory;
use crate::message::{Export, SecretHandle};

/// A published tensor's memory: host memory in a memfd, or device memory (a whole allocation
/// that may hold several tensors, each at its own offset).
#[derive(Clone)]
pub(crate) enum Exported {
    /// A memfd holding the tensor from byte 0.
    Host(Arc<SharedMemory>),
    /// A CUDA allocation; the tensor starts at `offset`.
    #[cfg(feature = "cuda")]
    Device {
        /// Kept alive (out of its pool) while published or leased.
        buffer: Arc<tensorwire_gpu::CudaBuffer>,
        /// Where the tensor starts in the allocation.
        offset: u64,
        /// How it is exported, decided by its memory's kind when it was published.
        export: Export,
    },
}

impl Exported {
    /// Device memory, checked to hold `len` bytes at `offset`, with its export made now (a
    /// VMM fd or a legacy handle, cached by the allocation) so that opens never wait for it.
    #[cfg(feature = "cuda")]
    pub(crate) fn device(
        buffer: Arc<tensorwire_gpu::CudaBuffer>,
        offset: u64,
        len: u64,
    ) -> Result<Self, IpcError> {
        if offset
            .checked_add(len)
            .is_none_or(|end| end > buffer.len() as u64)
        {
            return Err(IpcError::BadMessage(format!(
                "a {len}-byte tensor at offset {offset} does not fit a {}-byte buffer",
                buffer.len()
            )));
        }
        let allocation = buffer.allocation();
        let export = match allocation.kind() {
            tensorwire_gpu::DeviceMemoryKind::Vmm => {
                allocation.export_fd()?;
                Export::Vmm
            }
            tensorwire_gpu::DeviceMemoryKind::Legacy => {
                allocation.ipc_handle()?;
                Export::CudaIpc
            }
            kind => {
                return Err(tensorwire_gpu::GpuError::NotExportable(format!(
                    "{kind:?} memory is not shared"
                ))
                .into());
            }
        };
        Ok(Exported::Device {
            buffer,
            offset,
            export,
        })
    }

    pub(crate) fn export(&self) -> Export {
        match self {
            Exported::Host(_) => Export::Host,
            #[cfg(feature = "cuda")]
            Exported::Device { export, .. } => *export,
        }
    }

    /// Where the tensor starts in what is mapped.
    pub(crate) fn offset(&self) -> u64 {
        match self {
            Exported::Host(_) => 0,
            #[cfg(feature = "cuda")]
            Exported::Device { offset, .. } => *offset,
        }
    }

    /// Bytes a consumer maps: the whole memfd or allocation.
    pub(crate) fn alloc_len(&self) -> u64 {
        match self {
            Exported::Host(memory) => memory.len() as u64,
            #[cfg(feature = "cuda")]
            Exported::Device { buffer, .. } => {
                use tensorwire_gpu::Allocation;
                buffer.allocation().len() as u64
            }
        }
    }

    /// The GPU's UUID; `None` for host memory.
    pub(crate) fn device_uuid(&self) -> Option<String> {
        match self {
            Exported::Host(_) => None,
            #[cfg(feature = "cuda")]
            Exported::Device { buffer, .. } => {
                Some(buffer.allocation().device().info().uuid_string())
            }
        }
    }

    /// The GPU it lives on; `None` for host memory.
    pub(crate) fn device_fields(&self) -> Option<crate::message::DeviceFields> {
        match self {
            Exported::Host(_) => None,
            #[cfg(feature = "cuda")]
            Exported::Device { buffer, .. } => {
                let info = buffer.allocation().device().info();
                Some(crate::message::DeviceFields {
                    ordinal: info.ordinal as u32,
                    uuid: info.uuid_string(),
                    name: info.name.clone(),
                })
            }
        }
    }

    /// Reuses of the underlying buffer by its pool.
    pub(crate) fn buffer_reuse(&self) -> u64 {
        match self {
            Exported::Host(_) => 0,
            #[cfg(feature = "cuda")]
            Exported::Device { buffer, .. } => buffer.allocation().generation(),
        }
    }

    /// The legacy IPC handle, for `cuda_ipc` exports.
    pub(crate) fn handle(&self) -> Result<Option<SecretHandle>, IpcError> {
        match self {
            #[cfg(feature = "cuda")]
            Exported::Device {
                buffer,
                export: Export::CudaIpc,
                ..
            } => Ok(Some(SecretHandle::from_bytes(
                &buffer.allocation().ipc_handle()?.0,
            ))),
            _ => Ok(None),
        }
    }

    /// The descriptor sent with an `open` reply: the memfd or the VMM fd; none for legacy IPC.
    pub(crate) fn fd(&self) -> Result<Option<BorrowedFd<'_>>, IpcError> {
        match self {
            Exported::Host(memory) => Ok(Some(memory.fd())),
            #[cfg(feature = "cuda")]
            Exported::Device {
                buffer,
                export: Export::Vmm,
                ..
            } => Ok(Some(buffer.allocation().export_fd()?)),
            #[cfg(feature = "cuda")]
            Exported::Device { .. } => Ok(None),
        }
    }

    /// Overwrites the tensor's bytes with `new`'s (an update in place): consumers that mapped
    /// it see them once this returns.
    pub(crate) fn overwrite(&self, new: &tensorwire_gpu::TensorBuffer) -> Result<(), IpcError> {
        match self {
            Exported::Host(memory) => match new {
                tensorwire_gpu::TensorBuffer::Host(bytes) => memory.write_at(0, bytes),
                #[cfg(feature = "cuda")]
                gpu => memory.write_at(0, &gpu.to_host()?),
                #[cfg(not(feature = "cuda"))]
                tensorwire_gpu::TensorBuffer::Cuda(_) => Err(IpcError::NoCuda("GPU")),
            },
            #[cfg(feature = "cuda")]
            Exported::Device { buffer, offset, .. } => {
                let at = usize::try_from(*offset)
                    .map_err(|_| IpcError::BadMessage("offset past the address space".into()))?;
                Ok(buffer.overwrite(at, new)?)
            }
        }
    }

    /// The tensor's bytes (`len` of them) as they are now, copied to host memory.
    pub(crate) fn read(&self, len: usize) -> Result<Vec<u8>, IpcError> {
        match self {
            Exported::Host(memory) => Ok(memory.bytes()[..len].to_vec()),
            #[cfg(feature = "cuda")]
            Exported::Device { buffer, offset, .. } => {
                let mut out = vec![0u8; len];
                buffer.read_at(*offset as usize, &mut out)?;
                Ok(out)
            }
        }
    }

    /// Host bytes, for host memory.
    pub(crate) fn host_bytes(&self) -> Option<&[u8]> {
        match self {
            Exported::Host(memory) => Some(memory.bytes()),
            #[cfg(feature = "cuda")]
            Exported::Device { .. } => None,
        }
    }
}
