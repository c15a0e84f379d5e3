//! Host memory that another process can map: a memfd and a shared mapping of it.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use memmap2::{MmapMut, MmapOptions};

use crate::error::IpcError;

/// A memfd holding a tensor's bytes, mapped shared: writes through any mapping of it are seen
/// by every process that maps it.
pub(crate) struct SharedMemory {
    file: File,
    map: MmapMut,
}

impl SharedMemory {
    /// A new memfd named `name`, holding a copy of `bytes`.
    pub(crate) fn with_bytes(name: &str, bytes: &[u8]) -> Result<Self, IpcError> {
        let fd = rustix::fs::memfd_create(
            format!("tensorwire:{name}"),
            rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING,
        )?;
        let file = File::from(fd);
        file.set_len(bytes.len().max(1) as u64)?;
        // Sealed before any consumer sees it: no process can shrink it (which would make
        // every other mapping fault with SIGBUS) or grow it, and the seals cannot be lifted.
        rustix::fs::fcntl_add_seals(
            &file,
            rustix::fs::SealFlags::SHRINK
                | rustix::fs::SealFlags::GROW
                | rustix::fs::SealFlags::SEAL,
        )?;
        let mut memory = Self::map(file)?;
        memory.map[..bytes.len()].copy_from_slice(bytes);
        Ok(memory)
    }

    /// Maps a memfd received from the producer, if it is sealed against shrinking.
    pub(crate) fn from_fd(fd: OwnedFd) -> Result<Self, IpcError> {
        let seals = rustix::fs::fcntl_get_seals(&fd)?;
        if !seals.contains(rustix::fs::SealFlags::SHRINK) {
            return Err(IpcError::Config(
                "the producer's shared memory is not sealed against shrinking; mapping it \
                 could fault"
                    .into(),
            ));
        }
        Self::map(File::from(fd))
    }

    fn map(file: File) -> Result<Self, IpcError> {
        // SAFETY: the mapping is shared memory that other processes may write at any time;
        // it is only ever exposed as bytes (`&[u8]`/`&mut [u8]`), for which any value is
        // valid. The producer seals every memfd against shrinking before it is shared
        // (`with_bytes`), so no process can truncate the mapping under us; a consumer checks
        // the seals of a memfd it receives (`from_fd`) before mapping it.
        let map = unsafe { MmapOptions::new().map_mut(&file)? };
        Ok(Self { file, map })
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.map
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.map
    }

    /// Writes `bytes` at `offset` through the file, not the mapping: every mapping (this
    /// process's and consumers') sees them, and no `&mut` to shared memory is needed.
    pub(crate) fn write_at(&self, offset: u64, bytes: &[u8]) -> Result<(), IpcError> {
        use std::os::unix::fs::FileExt;
        self.file.write_all_at(bytes, offset)?;
        Ok(())
    }
}
