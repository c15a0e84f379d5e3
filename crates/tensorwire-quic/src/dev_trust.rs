//! Development trust on one host: where a development receiver leaves its self-signed
//! certificate, and the checks that keep another local user from planting or redirecting it.
//!
//! The directory is per user (`$TMPDIR/tensorwire-dev-UID`), mode 0700 and owned by that
//! user; files are created exclusively, never through a symlink, and read only when owned by
//! the reading user (or root) and writable by nobody else. Development trust therefore works
//! between processes of one user; across users, pass a CA file.
//!
//! A certificate is filed under the address and port its receiver listens on: receivers on
//! different addresses (or network namespaces) may share a port number.

use std::fs::{DirBuilder, File, OpenOptions};
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::error::TransportError;

/// Group or others may write: such a file or directory could have been planted.
const WRITABLE_BY_OTHERS: u32 = 0o022;

/// Where a development receiver listening on `addr` leaves its certificate, for this user.
pub fn dev_cert_path(addr: SocketAddr) -> PathBuf {
    dev_dir().join(format!("receiver-{}-{}.pem", addr.ip(), addr.port()))
}

/// Where a sender connecting to `addr` looks, in order: the receiver listening on exactly
/// that address, else one listening on every address (`0.0.0.0` for IPv4, then `::`, which
/// takes IPv4 too where the socket is dual-stack) with that port.
fn dev_cert_candidates(addr: SocketAddr) -> Vec<PathBuf> {
    let every: &[IpAddr] = match addr {
        SocketAddr::V4(_) => &[
            IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        ],
        SocketAddr::V6(_) => &[IpAddr::V6(Ipv6Addr::UNSPECIFIED)],
    };
    std::iter::once(dev_cert_path(addr))
        .chain(
            every
                .iter()
                .map(|ip| dev_cert_path(SocketAddr::new(*ip, addr.port()))),
        )
        .collect()
}

fn dev_dir() -> PathBuf {
    std::env::temp_dir().join(format!(
        "tensorwire-dev-{}",
        rustix::process::getuid().as_raw()
    ))
}

fn refuse(path: &Path, why: &str) -> TransportError {
    TransportError::Tls(format!(
        "development trust: refusing {}: {why}",
        path.display()
    ))
}

/// Checks that `path` (not followed if a link) is owned by this user or root and writable by
/// no one else.
fn check_owned(path: &Path, meta: &std::fs::Metadata) -> Result<(), TransportError> {
    let uid = rustix::process::getuid().as_raw();
    if meta.uid() != uid && meta.uid() != 0 {
        return Err(refuse(
            path,
            &format!("owned by uid {}, not by you ({uid}) or root", meta.uid()),
        ));
    }
    if meta.mode() & WRITABLE_BY_OTHERS != 0 {
        return Err(refuse(
            path,
            &format!("mode {:o} lets others write it", meta.mode() & 0o7777),
        ));
    }
    Ok(())
}

/// Creates (mode 0700) or checks the user's development directory.
fn ensure_dir() -> Result<PathBuf, TransportError> {
    let dir = dev_dir();
    match DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => {
            return Err(TransportError::Tls(format!(
                "creating {}: {e}",
                dir.display()
            )));
        }
    }
    let meta = std::fs::symlink_metadata(&dir)?;
    if !meta.is_dir() {
        return Err(refuse(&dir, "not a directory (a link?)"));
    }
    check_owned(&dir, &meta)?;
    Ok(dir)
}

/// Writes the certificate of a development receiver listening on `addr`, replacing a stale
/// one, never through a link; returns where.
pub(crate) fn write_dev_cert(addr: SocketAddr, pem: &str) -> Result<PathBuf, TransportError> {
    ensure_dir()?;
    let path = dev_cert_path(addr);
    // This receiver owns the address now: a file for it is a stale one of a receiver that died.
    match std::fs::remove_file(&path) {
        Ok(()) => tracing::info!(path = %path.display(), "removed a stale development certificate"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(TransportError::Tls(format!(
                "removing {}: {e}",
                path.display()
            )));
        }
    }
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(&path)
        .map_err(|e| TransportError::Tls(format!("creating {}: {e}", path.display())))?;
    file.write_all(pem.as_bytes())?;
    Ok(path)
}

/// Reads the development certificate of the receiver at `addr` (see
/// [`dev_cert_candidates`]), after checking who could have written it; returns it and where
/// it was.
pub(crate) fn read_dev_cert(addr: SocketAddr) -> Result<(Vec<u8>, PathBuf), TransportError> {
    let dir = dev_dir();
    let candidates = dev_cert_candidates(addr);
    let missing = || {
        TransportError::Tls(format!(
            "no development certificate at {} (nor for every address, port {}): start a \
             receiver with development TLS on this host and address first (as the same \
             user), or pass a CA file",
            candidates[0].display(),
            addr.port()
        ))
    };
    let dir_meta = std::fs::symlink_metadata(&dir).map_err(|_| missing())?;
    if !dir_meta.is_dir() {
        return Err(refuse(&dir, "not a directory (a link?)"));
    }
    check_owned(&dir, &dir_meta)?;
    for path in &candidates {
        let opened = OpenOptions::new()
            .read(true)
            .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
            .open(path);
        let mut file = match opened {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(refuse(path, &format!("{e} (a link?)"))),
        };
        check_owned(path, &File::metadata(&file)?)?;
        let mut pem = Vec::new();
        file.read_to_end(&mut pem)?;
        return Ok((pem, path.clone()));
    }
    Err(missing())
}
