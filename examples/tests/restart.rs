//! A receiver killed (SIGKILL) while a file's tensors land, then started again on the same
//! `--save` directory: every tensor its sender was told was delivered (COMPLETE) is in a
//! saved file, bit for bit, and nothing it never confirmed is kept (spec §6.8).
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use common::{Lines, spawn_receiver, terminate};

const TENSORS: usize = 48;
const TENSOR_LEN: usize = 1 << 20;

/// Writes a model of `TENSORS` U8 tensors, each of its own bytes; returns them by name.
fn write_model(path: &Path) -> HashMap<String, Vec<u8>> {
    let tensors: HashMap<String, Vec<u8>> = (0..TENSORS)
        .map(|i| {
            let bytes = (0..TENSOR_LEN).map(|j| (i * 31 + j * 7) as u8).collect();
            (format!("layer.{i:02}"), bytes)
        })
        .collect();
    let views: Vec<_> = tensors
        .iter()
        .map(|(name, bytes)| {
            let view = safetensors::tensor::TensorView::new(
                safetensors::Dtype::U8,
                vec![TENSOR_LEN],
                bytes,
            )
            .unwrap();
            (name.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
    tensors
}

/// Starts the receiver saving into `out`; returns it, its output lines and its address.
fn start_receiver(out: &Path) -> (Child, Lines, String) {
    spawn_receiver(&[
        "--device".as_ref(),
        "host".as_ref(),
        "--save".as_ref(),
        out.as_ref(),
    ])
}

/// Every tensor in the `.safetensors` files of `dir`, by name.
fn saved_tensors(dir: &Path) -> HashMap<String, Vec<u8>> {
    let mut saved = HashMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let bytes = std::fs::read(&path).unwrap();
            let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            for (name, view) in file.tensors() {
                let previous = saved.insert(name.clone(), view.data().to_vec());
                assert!(previous.is_none(), "{name} saved twice");
            }
        }
    }
    saved
}

#[test]
fn a_killed_receiver_loses_no_confirmed_tensor_when_started_again() {
    let dir = std::env::temp_dir().join(format!("tensorwire-restart-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("model.safetensors");
    let tensors = write_model(&model);
    let mut recovered_rounds = 0;
    for (round, kill_after) in [1usize, 5, 17, 33].into_iter().enumerate() {
        let out = dir.join(format!("out-{round}"));
        let (mut receiver, mut lines, addr) = start_receiver(&out);
        let sender = Command::new(env!("CARGO_BIN_EXE_sender"))
            .args(["--connect", &addr, "--quiet", "--connections", "1"])
            .args(["--idle-timeout-s", "2"])
            .arg(&model)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut received = 0;
        for line in lines.by_ref() {
            if line.unwrap().starts_with("received ") {
                received += 1;
                if received == kill_after {
                    break;
                }
            }
        }
        receiver.kill().unwrap();
        receiver.wait().unwrap();
        let sent = sender.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&sent.stderr);
        let failed: HashSet<&str> = stderr
            .lines()
            .filter_map(|l| l.strip_prefix("failed: "))
            .filter_map(|l| l.split(": ").next())
            .collect();
        let delivered: Vec<&String> = tensors
            .keys()
            .filter(|name| !failed.contains(name.as_str()))
            .collect();

        // Started again on the same directory, then stopped at once: it recovers and
        // saves before it exits.
        let (mut again, lines, _) = start_receiver(&out);
        terminate(&again);
        let output: Vec<String> = lines.map(Result::unwrap).collect();
        again.wait().unwrap();
        if output.iter().any(|l| l.starts_with("recovering ")) {
            recovered_rounds += 1;
        }

        let saved = saved_tensors(&out);
        for name in &delivered {
            let bytes = saved.get(name.as_str()).unwrap_or_else(|| {
                panic!(
                    "round {round}: {name} was confirmed to the sender but not saved; \
                     sender: {stderr}; restarted receiver: {output:?}"
                )
            });
            assert!(bytes == &tensors[name.as_str()], "{name} differs");
        }
        let spool = std::fs::read_dir(out.join(".incoming")).unwrap().count();
        assert_eq!(spool, 0, "round {round}: spool files left: {output:?}");
    }
    assert!(
        recovered_rounds > 0,
        "no round killed the receiver with confirmed tensors unsaved: the test proved nothing"
    );
    std::fs::remove_dir_all(dir).unwrap();
}
