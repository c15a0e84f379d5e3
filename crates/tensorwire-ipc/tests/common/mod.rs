//! Helpers shared by the sharing tests: a fresh socket path per test, and polling for what
//! another process or thread does.
#![allow(dead_code, unreachable_pub)] // Each test binary uses some.

use std::ffi::OsStr;
use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A socket path in a directory of its own, removed when the path is dropped.
pub struct SocketPath {
    dir: PathBuf,
    path: PathBuf,
}

impl Deref for SocketPath {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.path
    }
}

impl AsRef<Path> for SocketPath {
    fn as_ref(&self) -> &Path {
        &self.path
    }
}

impl AsRef<OsStr> for SocketPath {
    fn as_ref(&self) -> &OsStr {
        self.path.as_os_str()
    }
}

impl Drop for SocketPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A socket path in a fresh directory of its own for `test` in this process.
pub fn socket_path(test: &str) -> SocketPath {
    let dir = std::env::temp_dir().join(format!("tensorwire-ipc-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let path = dir.join("share.sock");
    SocketPath { dir, path }
}

/// Polls `condition` for up to 10 s; fails the test naming `what` if it never holds.
pub fn wait_for(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}
