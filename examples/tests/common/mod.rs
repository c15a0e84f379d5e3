//! Helpers shared by the programs' tests: a receiver started as a process.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used)] // Test helpers; each test binary uses some.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};

/// A receiver's output lines after the first.
pub type Lines = std::io::Lines<BufReader<ChildStdout>>;

/// Starts the receiver program with `args` after `--listen 127.0.0.1:0`; returns it, the rest
/// of its output lines, and the address it listens on.
pub fn spawn_receiver(args: &[&std::ffi::OsStr]) -> (Child, Lines, String) {
    spawn_receiver_on("127.0.0.1:0", args)
}

/// As [`spawn_receiver`], listening on `listen`.
pub fn spawn_receiver_on(listen: &str, args: &[&std::ffi::OsStr]) -> (Child, Lines, String) {
    let mut receiver = Command::new(env!("CARGO_BIN_EXE_receiver"))
        .args(["--listen", listen])
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(receiver.stdout.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    let addr = first
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("{first}"))
        .to_owned();
    (receiver, lines, addr)
}

/// Asks `child` to stop (SIGTERM), as Ctrl-C or a service manager would.
pub fn terminate(child: &Child) {
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
}

/// Stops a receiver started by [`spawn_receiver`] (SIGTERM), reads the rest of its output
/// so that it never writes to a closed pipe, and waits for it to exit.
pub fn stop(mut receiver: Child, lines: Lines) {
    terminate(&receiver);
    lines.for_each(drop);
    receiver.wait().unwrap();
}

/// Runs `sender --quiet` with `args` (the connect address among them) on `file`; fails the
/// test if it fails; returns its summary line(s).
pub fn send_file(args: &[&str], file: &Path) -> String {
    let sent = Command::new(env!("CARGO_BIN_EXE_sender"))
        .args(["--quiet"])
        .args(args)
        .arg(file)
        .output()
        .unwrap();
    assert!(
        sent.status.success(),
        "sender: {}",
        String::from_utf8_lossy(&sent.stderr)
    );
    String::from_utf8_lossy(&sent.stdout).into_owned()
}
