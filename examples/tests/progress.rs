//! `sender` as a user sees it on a terminal: one bar for the push and at most a few for the
//! largest tensors in flight, however many tensors the file holds; and no escape codes at
//! all where its output is not a terminal.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::{send_file, spawn_receiver, stop};
use rustix::pty::{OpenptFlags, grantpt, openpt, ptsname, unlockpt};
use rustix::termios::{Winsize, tcsetwinsize};
use tensorwire_examples::progress::MAX_TENSOR_BARS;

/// A `.safetensors` file of `count` U8 tensors of `len` bytes each.
fn many_tensors(dir: &Path, count: usize, len: usize) -> PathBuf {
    let entries: Vec<String> = (0..count)
        .map(|i| {
            format!(
                r#""t{i:04}":{{"dtype":"U8","shape":[{len}],"data_offsets":[{},{}]}}"#,
                i * len,
                (i + 1) * len
            )
        })
        .collect();
    let header = format!("{{{}}}", entries.join(","));
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend((0..count * len).map(|i| (i % 251) as u8));
    let path = dir.join("many.safetensors");
    std::fs::write(&path, bytes).unwrap();
    path
}

/// A pseudo-terminal of 40 rows and 120 columns: its controlling side, and the terminal a
/// program writes to.
fn terminal() -> (File, File) {
    let master = openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY).unwrap();
    grantpt(&master).unwrap();
    unlockpt(&master).unwrap();
    let name = ptsname(&master, Vec::new()).unwrap();
    let terminal = OpenOptions::new()
        .read(true)
        .write(true)
        .open(name.to_str().unwrap())
        .unwrap();
    let size = Winsize {
        ws_row: 40,
        ws_col: 120,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    tcsetwinsize(&terminal, size).unwrap();
    (File::from(master), terminal)
}

/// Reads what is drawn on the terminal of `master` until its last writer exits, on a thread.
fn read_to_end(mut master: File) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut drawn = Vec::new();
        let mut chunk = [0u8; 65536];
        // A read fails (EIO) once the last writer closed the terminal.
        while let Ok(n @ 1..) = master.read(&mut chunk) {
            drawn.extend_from_slice(&chunk[..n]);
        }
        String::from_utf8_lossy(&drawn).into_owned()
    })
}

/// The most lines a redraw moved the cursor up over (CSI n A): the bars drawn at once, less
/// one.
fn most_lines_redrawn(output: &str) -> usize {
    output
        .split("\x1b[")
        .skip(1)
        .filter_map(|rest| {
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            let after = rest[digits.len()..].chars().next()?;
            (after == 'A').then(|| digits.parse().unwrap_or(1))
        })
        .max()
        .unwrap_or(0)
}

#[test]
fn a_file_of_300_tensors_draws_one_total_bar_and_a_few_tensor_bars() {
    let dir = std::env::temp_dir().join(format!("tensorwire-progress-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = many_tensors(&dir, 300, 256 << 10);
    let (receiver, said, addr) = spawn_receiver(&["--device".as_ref(), "host".as_ref()]);
    let (master, terminal) = terminal();
    let mut sender = Command::new(env!("CARGO_BIN_EXE_sender"))
        .args(["--connect", &addr, "--connections", "2"])
        .arg(&file)
        .stdout(Stdio::piped())
        .stderr(Stdio::from(terminal))
        .spawn()
        .unwrap();
    // The terminal's only writer is now the sender: reading ends when it exits.
    let reader = read_to_end(master);
    let status = sender.wait().unwrap();
    let drawn = reader.join().unwrap();
    let mut summary = String::new();
    sender
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut summary)
        .unwrap();
    assert!(status.success(), "{summary}\n{drawn}");
    assert!(summary.contains("sent 300 of 300 tensors"), "{summary}");
    assert!(
        drawn.contains("300/300 tensors"),
        "the total bar ends complete: {drawn:?}"
    );
    let moved = most_lines_redrawn(&drawn);
    assert!(
        moved <= MAX_TENSOR_BARS,
        "a redraw spans {} lines: more than one total bar and {MAX_TENSOR_BARS} tensor bars",
        moved + 1
    );
    assert!(drawn.len() < 1 << 20, "{} bytes of bars", drawn.len());

    // Not a terminal: the same push writes no escape code and no bar.
    let piped = Command::new(env!("CARGO_BIN_EXE_sender"))
        .args(["--connect", &addr, "--connections", "2"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(piped.status.success());
    let stderr = String::from_utf8_lossy(&piped.stderr);
    assert!(
        !stderr.contains('\x1b') && !stderr.contains("tensors"),
        "{stderr:?}"
    );

    stop(receiver, said);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn the_receiver_draws_one_line_on_a_terminal_and_its_output_stays_whole() {
    let dir = std::env::temp_dir().join(format!("tensorwire-rx-progress-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = many_tensors(&dir, 300, 64 << 10);
    let (master, terminal) = terminal();
    let mut receiver = Command::new(env!("CARGO_BIN_EXE_receiver"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--device",
            "host",
            "--count",
            "300",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::from(terminal))
        .spawn()
        .unwrap();
    let reader = read_to_end(master);
    let mut stdout = String::new();
    let mut out = receiver.stdout.take().unwrap();
    let mut first = Vec::new();
    let mut byte = [0u8; 1];
    while out.read(&mut byte).unwrap() == 1 && byte[0] != b'\n' {
        first.push(byte[0]);
    }
    let first = String::from_utf8(first).unwrap();
    let addr = first.strip_prefix("listening on ").unwrap().to_owned();
    send_file(&["--connect", &addr, "--connections", "1"], &file);
    out.read_to_string(&mut stdout).unwrap();
    assert!(receiver.wait().unwrap().success());
    let drawn = reader.join().unwrap();
    assert!(drawn.contains("tensors landed"), "{drawn:?}");
    assert_eq!(most_lines_redrawn(&drawn), 0, "one line: {drawn:?}");
    // stdout is not the terminal: its lines are whole, one per tensor, then the summary.
    let received = stdout
        .lines()
        .filter(|l| l.starts_with("received "))
        .count();
    assert_eq!(received, 300, "{stdout}");
    assert!(!stdout.contains('\x1b'), "{stdout}");
    std::fs::remove_dir_all(dir).unwrap();
}
