//! The receiver program's memory under hostile peers: its peak stays within the bound the
//! README states (the credit budget, host memory, the METADATA budget, half a MiB per
//! connection, and what quinn may buffer per flooding connection), legitimate senders are
//! served during each attack, and memory comes back once the attackers are gone. Read from
//! `/proc` (Linux).
#![cfg(target_os = "linux")]
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{spawn_receiver, terminate};

const MIB: u64 = 1 << 20;
const BUDGET_MIB: u64 = 16;
const HOST_MIB: u64 = 32;
const METADATA_MIB: u64 = 8;
const MAX_CONNECTIONS: u64 = 64;
/// Peers flooding METADATA at once, one connection each.
const FLOODS: u64 = 4;

/// A field of `/proc/PID/status` in bytes (VmRSS now, VmHWM the peak).
fn status_bytes(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with(&format!("{field}:")))
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"));
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

/// The receiver's RSS once the attackers' streams have timed out and their memory has come
/// back: the lowest of samples over six seconds (frees go on for a while after the attacks,
/// later on a loaded machine).
fn settled_rss(pid: u32) -> u64 {
    (0..24)
        .map(|_| {
            std::thread::sleep(Duration::from_millis(250));
            status_bytes(pid, "VmRSS")
        })
        .min()
        .unwrap_or(u64::MAX)
}

fn hostile(addr: &str, from: &str, args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_hostile-peer"))
        .args(["--connect", addr, "--from", from])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// One `hostile-peer` with `args` for 3 s from each of 127.0.0.`peers` (a peer each).
fn from_peers(addr: &str, peers: std::ops::Range<u64>, args: &[&str]) -> Vec<Child> {
    peers
        .map(|i| {
            let args = [args, &["--seconds", "3"]].concat();
            hostile(addr, &format!("127.0.0.{i}"), &args)
        })
        .collect()
}

/// A legitimate `sender` of `file` (raw bytes) from 127.0.0.1; whether it succeeded, and what
/// it printed.
fn legitimate(addr: &str, file: &Path) -> (bool, String) {
    let len = std::fs::metadata(file).unwrap().len();
    let out = Command::new(env!("CARGO_BIN_EXE_sender"))
        .args(["--connect", addr, "--quiet", "--dtype", "U8", "--shape"])
        .arg(len.to_string())
        .arg(file)
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), said)
}

fn temp_file(name: &str, len: usize, seed: u8) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tensorwire-bound-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    let bytes: Vec<u8> = (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect();
    std::fs::write(&path, bytes).unwrap();
    path
}

/// Runs `attackers` for their seconds with a legitimate send halfway through; the send must
/// succeed. Returns once every attacker has exited.
fn during(receiver: u32, attack: &str, addr: &str, file: &Path, mut attackers: Vec<Child>) {
    std::thread::sleep(Duration::from_secs(1));
    let (ok, said) = legitimate(addr, file);
    for attacker in &mut attackers {
        attacker.wait().unwrap();
    }
    assert!(ok, "a legitimate send failed during {attack}: {said}");
    eprintln!(
        "after {attack}: peak {} MiB, now {} MiB",
        status_bytes(receiver, "VmHWM") >> 20,
        status_bytes(receiver, "VmRSS") >> 20
    );
}

/// One round of every attack, each with legitimate sends beside it.
fn attack_round(receiver: u32, addr: &str, file: &Path) {
    // 80 silent connections from 5 peers: 64 served (16 per peer), the rest refused.
    let silent = from_peers(addr, 3..8, &["--mode", "silent", "--connections", "16"]);
    during(receiver, "80 silent connections", addr, file, silent);
    // Legal METADATA with 64 attributes of 1000 bytes each, as fast as allowed.
    let metadata = [
        "--mode",
        "metadata-flood",
        "--claim",
        "1",
        "--attributes",
        "64",
    ];
    let floods = from_peers(addr, 3..3 + FLOODS, &metadata);
    during(
        receiver,
        "METADATA floods of 64 KB each",
        addr,
        file,
        floods,
    );
    // Streams claiming 1 GiB each, never sending DATA, from 2 peers.
    let claims = ["--mode", "metadata-flood", "--claim", "1073741824"];
    let claims = from_peers(addr, 3..5, &claims);
    during(receiver, "1 GiB claims without DATA", addr, file, claims);
    // Eight legitimate senders at once, 4 MiB each, beside a CANCEL flood.
    let flood = from_peers(addr, 3..4, &["--mode", "cancel-flood"]);
    let senders: Vec<_> = (0..8)
        .map(|_| {
            let (addr, file) = (addr.to_owned(), file.to_owned());
            std::thread::spawn(move || legitimate(&addr, &file))
        })
        .collect();
    for sender in senders {
        let (ok, said) = sender.join().unwrap();
        assert!(ok, "one of eight legitimate senders failed: {said}");
    }
    during(receiver, "a CANCEL flood", addr, file, flood);
}

#[test]
fn peak_memory_under_attack_stays_within_the_documented_bound_and_comes_back() {
    let budget = BUDGET_MIB.to_string();
    let host = HOST_MIB.to_string();
    let metadata = METADATA_MIB.to_string();
    let max = MAX_CONNECTIONS.to_string();
    let flags = [
        "--device",
        "host",
        "--budget-mib",
        &budget,
        "--host-memory-mib",
        &host,
        "--metadata-budget-mib",
        &metadata,
        "--max-connections",
        &max,
        "--max-connections-per-peer",
        "16",
    ];
    let args: Vec<&std::ffi::OsStr> = flags.iter().map(|a| a.as_ref()).collect();
    let (mut receiver, lines, addr) = spawn_receiver(&args);
    let pid = receiver.id();
    std::thread::sleep(Duration::from_millis(500));
    let baseline = status_bytes(pid, "VmRSS");
    // README: credit + host memory + METADATA + connections × 0.5 MiB + QUIC buffers, the
    // last, for each connection sending faster than the receiver reads (the floods), what
    // quinn may hold of a QUIC receive window (the connection's credit window, half the
    // budget, + 1 MiB): 2.5 times it, plus 32 KiB for each of 1024 streams.
    let quic_window = (BUDGET_MIB / 2 + 1) * MIB;
    let quic_buffers = quic_window * 5 / 2 + 1024 * (32 << 10);
    let bound =
        (BUDGET_MIB + HOST_MIB + METADATA_MIB + MAX_CONNECTIONS / 2) * MIB + FLOODS * quic_buffers;
    let file = temp_file("legit.bin", 4 << 20, 1);

    attack_round(pid, &addr, &file);
    let first_peak = status_bytes(pid, "VmHWM");
    let first_settled = settled_rss(pid);
    // A second round: memory kept after the first is reused, not added to.
    attack_round(pid, &addr, &file);
    let peak = status_bytes(pid, "VmHWM");
    // Attackers' connections close and their streams time out; kept buffers stay (an
    // eighth of host memory), the rest comes back.
    let settled = settled_rss(pid);
    terminate(&receiver);
    // Its summary is read to the end, so it never writes to a closed pipe.
    lines.for_each(drop);
    receiver.wait().unwrap();
    std::fs::remove_dir_all(file.parent().unwrap()).unwrap();
    let mib = |b: u64| b as f64 / MIB as f64;
    eprintln!(
        "baseline {:.0} MiB, peak {:.0} MiB (bound {:.0} above baseline), settled {:.0} MiB",
        mib(baseline),
        mib(peak),
        mib(bound),
        mib(settled)
    );
    assert!(
        peak <= baseline + bound,
        "peak RSS {:.0} MiB above the bound: baseline {:.0} + {:.0} MiB",
        mib(peak),
        mib(baseline),
        mib(bound)
    );
    eprintln!(
        "first round: peak {:.0} MiB, settled {:.0} MiB",
        mib(first_peak),
        mib(first_settled)
    );
    // What the allocator keeps varies between rounds (seen: up to 24 MiB on a 2-core
    // machine); a leak of a round's connections and streams would be more.
    assert!(
        settled <= first_settled + 32 * MIB,
        "RSS grew from {:.0} MiB after one round of attacks to {:.0} after two",
        mib(first_settled),
        mib(settled)
    );
    assert!(
        settled <= baseline + bound / 2,
        "RSS {:.0} MiB after the attacks: most of the {:.0} MiB peak should have come back",
        mib(settled),
        mib(peak)
    );
}
