//! The pure-Python consumer (`python/tensorwire_ipc`) against a real producer: it lists,
//! maps a host tensor, writes it in place, and the producer sees the write; its DLPack
//! capsule describes the shared bytes and holds the lease until the importer's deleter runs.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::io::Write;
use std::path::PathBuf;
use std::process::Command;

use common::{socket_path, wait_for};
use tensorwire_ipc::{ShareConfig, ShareService};
use tensorwire_proto::{DType, TensorMeta};

fn consume_py() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../python/consume.py")
}

#[test]
fn the_python_consumer_lists_maps_and_writes_in_place() {
    if Command::new("python3").arg("--version").output().is_err() {
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED the_python_consumer_lists_maps_and_writes_in_place: no python3"
        );
        return;
    }
    let path = socket_path("python");
    let service = ShareService::start(&path, ShareConfig::default()).unwrap();
    let bytes: Vec<u8> = (0..5000u32)
        .map(|i| (i as u8).wrapping_mul(7) | 1)
        .collect();
    let meta = TensorMeta::new([50, 100], DType::U8)
        .unwrap()
        .with_name("weights");
    let published = service.publish_host(&meta, &bytes).unwrap();

    let listed = Command::new("python3")
        .arg(consume_py())
        .arg(&path)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&listed.stdout);
    assert!(
        listed.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&listed.stderr)
    );
    assert!(
        stdout.contains("weights U8 [50, 100] 5000 host leases 0"),
        "{stdout}"
    );

    let wrote = Command::new("python3")
        .arg(consume_py())
        .arg(&path)
        .args(["weights", "--triple"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&wrote.stdout);
    assert!(
        wrote.status.success() && stdout.contains("TRIPLED 5000"),
        "{stdout}{}",
        String::from_utf8_lossy(&wrote.stderr)
    );
    let tripled: Vec<u8> = bytes.iter().map(|b| b.wrapping_mul(3)).collect();
    assert_eq!(
        published.host_bytes().unwrap(),
        &tripled[..],
        "the producer sees the Python consumer's write"
    );

    wait_for("the Python consumer's lease to end", || {
        service.list()[0].leases == 0
    });

    let dlpack = Command::new("python3")
        .arg(consume_py().with_file_name("check_dlpack.py"))
        .arg(&path)
        .arg("weights")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&dlpack.stdout);
    assert!(
        dlpack.status.success() && stdout.contains("DLPACK-OK [50, 100] (1, 8)"),
        "{stdout}{}",
        String::from_utf8_lossy(&dlpack.stderr)
    );
}

#[test]
fn the_python_consumer_watches_waits_and_reads_generations_and_attributes() {
    use std::io::{BufRead, BufReader};
    if Command::new("python3").arg("--version").output().is_err() {
        eprintln!("SKIPPED the_python_consumer_watches_waits_and_reads_generations: no python3");
        return;
    }
    let path = socket_path("python-updates");
    let service = ShareService::start(&path, ShareConfig::default()).unwrap();
    let mut child = Command::new("python3")
        .arg(consume_py().with_file_name("check_updates.py"))
        .arg(&path)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut output = String::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        output += &line;
        if line == "READY" {
            break;
        }
    }
    let live = TensorMeta::new([4], DType::U8).unwrap().with_name("live.w");
    service.publish_host(&live, &[1; 4]).unwrap();
    service.publish_host(&live, &[2; 4]).unwrap();
    let late = TensorMeta::new([4], DType::F32)
        .unwrap()
        .with_name("late")
        .with_attribute("sample_rate", "16000");
    service.publish_host(&late, &[0; 16]).unwrap();
    for line in lines {
        output += &line.unwrap();
    }
    assert!(child.wait().unwrap().success(), "{output}");
    assert!(output.contains("UPDATES-OK"), "{output}");
}
