//! The C example, compiled with the system's C compiler against this crate's shared library,
//! maps a host tensor a producer shares, reads it, and writes it in place: the producer sees
//! the write. Skipped with a printed reason where there is no C compiler.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::path::{Path, PathBuf};
use std::process::Command;

use tensorwire_ipc::{ShareConfig, ShareService};
use tensorwire_proto::{DType, TensorMeta};

/// The directory holding `libtensorwire_c.so` of this build.
fn library_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    [deps, deps.parent().unwrap()]
        .into_iter()
        .find(|dir| dir.join("libtensorwire_c.so").exists())
        .unwrap_or_else(|| panic!("libtensorwire_c.so not built next to {}", exe.display()))
        .to_owned()
}

fn compile(out: &Path) -> Option<PathBuf> {
    let compiler = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let libs = library_dir();
    let binary = out.join("consumer");
    let built = Command::new(&compiler)
        .arg(crate_dir.join("examples/consumer.c"))
        .arg("-I")
        .arg(crate_dir.join("include"))
        .arg("-L")
        .arg(&libs)
        .arg("-ltensorwire_c")
        .arg(format!("-Wl,-rpath,{}", libs.display()))
        .arg("-o")
        .arg(&binary)
        .output();
    match built {
        Ok(built) if built.status.success() => Some(binary),
        Ok(built) => panic!("cc failed: {}", String::from_utf8_lossy(&built.stderr)),
        Err(e) => {
            eprintln!("SKIPPED the C example: no C compiler ({compiler}: {e})");
            None
        }
    }
}

#[test]
fn the_c_example_maps_reads_and_writes_a_shared_host_tensor() {
    let dir = std::env::temp_dir().join(format!("tensorwire-c-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let Some(consumer) = compile(&dir) else {
        return;
    };
    let service =
        ShareService::start(dir.join("share").join("share.sock"), ShareConfig::default()).unwrap();
    let bytes: Vec<u8> = (0..24u8).collect();
    let meta = TensorMeta::new([2, 3], DType::F32)
        .unwrap()
        .with_name("weights");
    let published = service.publish_host(&meta, &bytes).unwrap();
    let run = Command::new(&consumer)
        .arg(service.path())
        .args(["weights", "--increment"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let sum: u64 = bytes.iter().map(|&b| u64::from(b)).sum();
    assert!(
        stdout.contains("weights F32 [2, 3] generation 1 host"),
        "{stdout}"
    );
    assert!(stdout.contains(&format!("sum {sum}")), "{stdout}");
    let now: Vec<u8> = bytes.iter().map(|b| b + 1).collect();
    assert_eq!(
        published.host_bytes().unwrap(),
        &now[..],
        "the producer sees the C consumer's write"
    );
    // A name that never comes: the example waits, then says why.
    let missing = Command::new(&consumer)
        .arg(service.path())
        .arg("nothing-yet")
        .env("TW_WAIT_MS", "0")
        .output()
        .unwrap();
    assert!(!missing.status.success());
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(
        stderr.contains("open: ") && stderr.contains("not_found"),
        "{stderr}"
    );
    drop(service);
    std::fs::remove_dir_all(dir).unwrap();
}
