//! The server ↔ worker channel: a `SOCK_SEQPACKET` socket pair carrying one JSON message per
//! packet, with file descriptors (VMM exports, a module's memfd) attached.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketFlags, SocketType,
};
use serde::{Deserialize, Serialize};

/// Most descriptors one message carries: every argument's buffer and the module.
pub(crate) const MAX_FDS: usize = 72;
/// Longest message (a job names at most 64 arguments).
const MAX_MESSAGE: usize = 256 * 1024;

/// One end of the pair.
#[derive(Debug)]
pub(crate) struct Channel {
    fd: OwnedFd,
}

/// A job for a worker (server → worker). Buffers arrive as descriptors, in order: the
/// module's memfd first when `module_attached`, then one per entry of `buffers`.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Job {
    /// The module's SHA-256, hex: the worker's cache key.
    pub(crate) module: String,
    /// Whether the module's bytes come with this job (the worker lacks them).
    pub(crate) module_attached: bool,
    /// How the module's bytes are loaded: the wire code of a
    /// [`ModuleFormat`](tensorwire_gpu::ModuleFormat) (spec §14.2).
    pub(crate) format: u8,
    /// The kernel.
    pub(crate) function: String,
    pub(crate) grid: [u32; 3],
    pub(crate) block: [u32; 3],
    pub(crate) shared_mem_bytes: u32,
    /// Exported allocations: `(allocation length, tensor offset, tensor length)`.
    pub(crate) buffers: Vec<(usize, usize, usize)>,
    /// Kernel parameters in order.
    pub(crate) args: Vec<JobArg>,
    /// Indexes into `buffers` to zero before the launch (outputs).
    pub(crate) zero: Vec<usize>,
}

/// A kernel parameter of a job.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum JobArg {
    /// A pointer into `buffers[i]`.
    Buffer(usize),
    /// A zero-byte tensor: a null pointer.
    Null,
    /// A value passed by value.
    Value(Vec<u8>),
}

/// A worker's answers (worker → server).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Report {
    /// The worker opened its device and waits for jobs.
    Ready,
    /// Module loaded and buffers mapped: the kernel is being launched now, and the time
    /// limit runs from here.
    Launching,
    /// The kernel ended; its time between CUDA events.
    Done { kernel_ns: u64 },
    /// The job failed with a wire code; `fatal` when the worker exits after this report.
    Failed {
        code: u32,
        message: String,
        fatal: bool,
    },
}

impl Channel {
    /// A connected pair of close-on-exec sockets.
    pub(crate) fn pair() -> std::io::Result<(Channel, Channel)> {
        let (a, b) = rustix::net::socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )?;
        Ok((Channel { fd: a }, Channel { fd: b }))
    }

    /// Wraps a socket this process inherited.
    pub(crate) fn from_fd(fd: OwnedFd) -> Channel {
        Channel { fd }
    }

    /// The socket, to hand to a child process.
    pub(crate) fn into_fd(self) -> OwnedFd {
        self.fd
    }

    /// Sends `message` with `fds` attached.
    pub(crate) fn send<T: Serialize>(
        &self,
        message: &T,
        fds: &[BorrowedFd<'_>],
    ) -> std::io::Result<()> {
        let bytes = serde_json::to_vec(message).map_err(std::io::Error::other)?;
        if fds.len() > MAX_FDS || bytes.len() > MAX_MESSAGE {
            return Err(std::io::Error::other("a worker message over its limits"));
        }
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut ancillary = SendAncillaryBuffer::new(&mut space);
        if !fds.is_empty() {
            ancillary.push(SendAncillaryMessage::ScmRights(fds));
        }
        rustix::net::sendmsg(
            &self.fd,
            &[IoSlice::new(&bytes)],
            &mut ancillary,
            SendFlags::NOSIGNAL,
        )?;
        Ok(())
    }

    /// Receives one message and its descriptors; `None` once the peer is gone.
    pub(crate) fn recv<T: for<'de> Deserialize<'de>>(
        &self,
    ) -> std::io::Result<Option<(T, Vec<OwnedFd>)>> {
        let mut buf = vec![0u8; MAX_MESSAGE + 1];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut ancillary = RecvAncillaryBuffer::new(&mut space);
        let msg = rustix::net::recvmsg(
            &self.fd,
            &mut [IoSliceMut::new(&mut buf)],
            &mut ancillary,
            RecvFlags::CMSG_CLOEXEC,
        )?;
        let mut fds = Vec::new();
        for message in ancillary.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = message {
                fds.extend(received);
            }
        }
        if msg.bytes == 0 && fds.is_empty() {
            return Ok(None);
        }
        if msg.flags.contains(ReturnFlags::TRUNC) || msg.flags.contains(ReturnFlags::CTRUNC) {
            return Err(std::io::Error::other("a worker message was cut short"));
        }
        let message = serde_json::from_slice(&buf[..msg.bytes]).map_err(std::io::Error::other)?;
        Ok(Some((message, fds)))
    }

    /// The socket, for polling.
    pub(crate) fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}
