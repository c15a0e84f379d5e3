//! A `SOCK_SEQPACKET` Unix socket carrying one message (and at most one fd) per packet, in a
//! directory only its owner may enter (spec/ipc.md §1).

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::Path;

use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};

use crate::error::IpcError;
use crate::message::MAX_MESSAGE;

/// One end of a connection.
#[derive(Debug)]
pub(crate) struct Packets {
    fd: OwnedFd,
}

/// A received packet.
pub(crate) struct Received {
    pub(crate) bytes: Vec<u8>,
    pub(crate) fd: Option<OwnedFd>,
}

impl Packets {
    /// Connects to the socket at `path`.
    pub(crate) fn connect(path: &Path) -> Result<Self, IpcError> {
        check_path_len(path)?;
        let fd = seqpacket()?;
        rustix::net::connect(&fd, &SocketAddrUnix::new(path)?)
            .map_err(|e| IpcError::Connect(format!("{}: {e}", path.display())))?;
        Ok(Self { fd })
    }

    pub(crate) fn from_fd(fd: OwnedFd) -> Self {
        Self { fd }
    }

    pub(crate) fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Sends one message, with `fd` attached if given.
    pub(crate) fn send(&self, bytes: &[u8], fd: Option<BorrowedFd<'_>>) -> Result<(), IpcError> {
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut ancillary = SendAncillaryBuffer::new(&mut space);
        let fds;
        if let Some(fd) = fd {
            fds = [fd];
            ancillary.push(SendAncillaryMessage::ScmRights(&fds));
        }
        rustix::net::sendmsg(
            &self.fd,
            &[IoSlice::new(bytes)],
            &mut ancillary,
            SendFlags::NOSIGNAL,
        )?;
        Ok(())
    }

    /// Whether the peer closed the connection, without waiting. A message it sent meanwhile
    /// is read and dropped (a watching connection takes no requests).
    pub(crate) fn peer_closed(&self) -> bool {
        let mut byte = [0u8; 1];
        match rustix::net::recv(&self.fd, &mut byte, RecvFlags::PEEK | RecvFlags::DONTWAIT) {
            Ok((0, _)) => true,
            Ok(_) => !matches!(self.recv(), Ok(Some(_))),
            Err(rustix::io::Errno::AGAIN) => false,
            Err(_) => true,
        }
    }

    /// Receives one message; `None` when the peer closed the connection.
    ///
    /// A packet longer than [`MAX_MESSAGE`] or with more descriptors than one is refused
    /// (`MSG_TRUNC` / `MSG_CTRUNC`): any descriptors that did arrive are closed.
    pub(crate) fn recv(&self) -> Result<Option<Received>, IpcError> {
        let mut buf = vec![0u8; MAX_MESSAGE + 1];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut ancillary = RecvAncillaryBuffer::new(&mut space);
        let msg = rustix::net::recvmsg(
            &self.fd,
            &mut [IoSliceMut::new(&mut buf)],
            &mut ancillary,
            RecvFlags::CMSG_CLOEXEC,
        )?;
        let mut fds: Vec<OwnedFd> = Vec::new();
        for message in ancillary.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = message {
                fds.extend(received);
            }
        }
        if msg.bytes == 0 && fds.is_empty() {
            return Ok(None);
        }
        if msg.flags.contains(ReturnFlags::TRUNC) || msg.bytes > MAX_MESSAGE {
            return Err(IpcError::BadMessage(format!(
                "message longer than {MAX_MESSAGE} bytes"
            )));
        }
        if msg.flags.contains(ReturnFlags::CTRUNC) || fds.len() > 1 {
            return Err(IpcError::BadMessage(
                "more than one descriptor in a message".into(),
            ));
        }
        buf.truncate(msg.bytes);
        Ok(Some(Received {
            bytes: buf,
            fd: fds.pop(),
        }))
    }
}

/// Longest socket path the kernel takes (`sun_path` is 108 bytes with its NUL).
const MAX_SOCKET_PATH: usize = 107;

/// Refuses a path too long for a Unix socket address, saying so (the kernel's own error is a
/// bare "File name too long").
fn check_path_len(path: &Path) -> Result<(), IpcError> {
    let len = path.as_os_str().len();
    if len > MAX_SOCKET_PATH {
        return Err(IpcError::Config(format!(
            "{}: a Unix socket path is at most {MAX_SOCKET_PATH} bytes; this one is {len}",
            path.display()
        )));
    }
    Ok(())
}

/// A new close-on-exec Unix `SOCK_SEQPACKET` socket.
fn seqpacket() -> Result<OwnedFd, IpcError> {
    Ok(rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?)
}

/// Removes what is at `path` only if it is a socket nobody listens on (left by a producer that
/// died); refuses anything else: a file, a directory, or a live producer's socket.
fn remove_stale_socket(path: &Path) -> Result<(), IpcError> {
    use std::os::unix::fs::FileTypeExt;
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    if !meta.file_type().is_socket() {
        return Err(IpcError::Config(format!(
            "{} exists and is not a socket; refusing to replace it",
            path.display()
        )));
    }
    let probe = seqpacket()?;
    match rustix::net::connect(&probe, &SocketAddrUnix::new(path)?) {
        Ok(()) => Err(IpcError::Config(format!(
            "{} is the socket of a live producer; stop it or choose another path",
            path.display()
        ))),
        Err(rustix::io::Errno::CONNREFUSED) => {
            tracing::info!(path = %path.display(), "replacing a stale sharing socket");
            std::fs::remove_file(path)?;
            Ok(())
        }
        Err(e) => Err(IpcError::Config(format!(
            "{}: cannot tell whether a producer listens there ({e}); refusing to replace it",
            path.display()
        ))),
    }
}

/// A listening socket at `path`, in a directory created (or checked to be) mode 0700 and
/// owned by this process's user.
pub(crate) fn listen(path: &Path) -> Result<OwnedFd, IpcError> {
    check_path_len(path)?;
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .ok_or_else(|| {
            IpcError::Config(format!(
                "{}: the socket needs its own directory",
                path.display()
            ))
        })?;
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
    }
    let meta = std::fs::metadata(dir)?;
    let uid = rustix::process::geteuid().as_raw();
    if meta.uid() != uid || meta.mode() & 0o777 != 0o700 {
        return Err(IpcError::Config(format!(
            "{} must be a directory owned by uid {uid} with mode 0700 (it is uid {}, mode {:o})",
            dir.display(),
            meta.uid(),
            meta.mode() & 0o777
        )));
    }
    remove_stale_socket(path)?;
    let fd = seqpacket()?;
    rustix::net::bind(&fd, &SocketAddrUnix::new(path)?)?;
    rustix::net::listen(&fd, 64)?;
    Ok(fd)
}
