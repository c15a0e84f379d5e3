//! The consumer's side: list and open tensors a producer shares; leases end on drop.

use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use crate::error::IpcError;
use crate::memory::SharedMemory;
use crate::message::{Descriptor, Info, PROTOCOL_VERSION, Reply, Request};
use crate::socket::{Packets, Received};

/// A connection to a producer's sharing socket.
pub struct ShareClient {
    packets: Arc<Mutex<Packets>>,
}

fn exchange(
    packets: &Mutex<Packets>,
    request: &Request,
) -> Result<(Reply, Option<std::os::fd::OwnedFd>), IpcError> {
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
            packets: Arc::new(Mutex::new(Packets::connect(path.as_ref())?)),
        };
        exchange(
            &client.packets,
            &Request::Hello {
                version: PROTOCOL_VERSION,
            },
        )?;
        Ok(client)
    }

    /// Every published tensor.
    pub fn list(&self) -> Result<Vec<Info>, IpcError> {
        Ok(exchange(&self.packets, &Request::List)?
            .0
            .tensors
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

    /// Maps a tensor, holding a lease until the returned value is dropped.
    pub fn open(&self, tensor: &str) -> Result<SharedTensor, IpcError> {
        let (reply, fd) = exchange(
            &self.packets,
            &Request::Open {
                tensor: tensor.into(),
            },
        )?;
        let (Some(lease), Some(descriptor), Some(fd)) = (reply.lease, reply.descriptor, fd) else {
            return Err(IpcError::BadMessage(
                "open reply without lease, descriptor and fd".into(),
            ));
        };
        let memory = SharedMemory::from_fd(fd)?;
        let end = descriptor.offset.checked_add(descriptor.tensor.byte_len);
        if end.is_none_or(|end| end > memory.len() as u64) {
            return Err(IpcError::BadMessage(
                "descriptor past the end of the shared memory".into(),
            ));
        }
        Ok(SharedTensor {
            descriptor,
            lease,
            memory,
            packets: self.packets.clone(),
        })
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

/// A mapped tensor under a lease; dropping it unmaps and releases the lease.
pub struct SharedTensor {
    descriptor: Descriptor,
    lease: u64,
    memory: SharedMemory,
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

    /// The tensor's bytes (the producer and other consumers see the same memory).
    pub fn bytes(&self) -> &[u8] {
        let start = self.descriptor.offset as usize;
        &self.memory.bytes()[start..start + self.descriptor.tensor.byte_len as usize]
    }

    /// The tensor's bytes, writable in place.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let start = self.descriptor.offset as usize;
        let len = self.descriptor.tensor.byte_len as usize;
        &mut self.memory.bytes_mut()[start..start + len]
    }
}

impl Drop for SharedTensor {
    fn drop(&mut self) {
        if let Err(e) = exchange(&self.packets, &Request::Release { lease: self.lease }) {
            tracing::warn!(error = %e, lease = self.lease, "releasing a lease failed");
        }
    }
}
