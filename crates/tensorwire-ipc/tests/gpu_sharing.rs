//! GPU tensors shared across processes: nine tensors in one pool allocation read back exactly
//! in a child process (legacy handles must carry the offset); a consumer's in-place multiply
//! seen by the producer, for VMM and legacy exports; VMM import, across two GPUs when the host
//! has two; a legacy handle opened by its own exporter fails cleanly and gives its lease back.
//! Without a GPU each test prints why it skips; with `TENSORWIRE_REQUIRE_GPU=1` it fails.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use common::{socket_path, wait_for};
use tensorwire_gpu::{
    CudaBuffer, DeviceAllocation, DeviceMemoryKind, GpuDevice, GpuMemoryPool, PoolConfig,
    gpus_or_skip,
};
use tensorwire_ipc::{Export, IpcError, ShareClient, ShareConfig, ShareService};
use tensorwire_proto::testing::pattern;
use tensorwire_proto::{DType, TensorMeta};

const NINE: usize = 9;

/// Where tensor `i` of the nine sits in their shared allocation, and its length: odd offsets
/// and lengths, so nothing lines up by accident.
fn nine_layout(i: usize) -> (usize, usize) {
    (i * 70_001 + 13, 40_000 + i * 1_003)
}

fn meta(name: &str, len: usize) -> TensorMeta {
    TensorMeta::new([len as u64], DType::U8)
        .unwrap()
        .with_name(name)
}

/// Runs this binary's `gpu_child` as a separate process; returns its stdout.
fn run_child(path: &Path, mode: &str) -> String {
    let output = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "gpu_child", "--nocapture", "--test-threads", "1"])
        .env(
            "TENSORWIRE_IPC_GPU_CHILD",
            format!("{mode}|{}", path.display()),
        )
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "child {mode} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// Not a test of its own: the consumer process the tests below start.
#[test]
fn gpu_child() {
    let Ok(spec) = std::env::var("TENSORWIRE_IPC_GPU_CHILD") else {
        return;
    };
    let (mode, path) = spec.split_once('|').unwrap();
    let client = ShareClient::connect(path).unwrap();
    match mode {
        "nine" => {
            let tensors: Vec<_> = (0..NINE)
                .map(|i| client.open(&format!("t{i}")).unwrap())
                .collect();
            let first = tensors[0].descriptor();
            for (i, tensor) in tensors.iter().enumerate() {
                let (offset, len) = nine_layout(i);
                let descriptor = tensor.descriptor();
                assert_eq!(descriptor.tensor.export, Export::CudaIpc);
                assert_eq!(descriptor.offset, offset as u64);
                assert_eq!(
                    descriptor.handle, first.handle,
                    "one allocation, one handle"
                );
                let (ptr, _) = tensor.device_ptr().unwrap();
                let (first_ptr, _) = tensors[0].device_ptr().unwrap();
                assert_eq!(ptr - first_ptr, (offset - nine_layout(0).0) as u64);
                assert_eq!(
                    tensor.read_to_vec().unwrap(),
                    pattern(len, i as u64),
                    "tensor t{i} read back exactly"
                );
            }
            let (ptr, device) = tensors[3].device_ptr().unwrap();
            let exported = client.open("t3").unwrap().into_dlpack().unwrap();
            let dl = exported.tensor();
            assert_eq!(
                dl.data as u64, ptr,
                "DLPack points at the tensor, offset included"
            );
            assert_eq!(dl.device.device_type, tensorwire_gpu::dlpack::KDL_CUDA);
            assert_eq!(dl.device.device_id as usize, device.ordinal());
            println!("NINE-EXACT");
        }
        "triple" => {
            let mut tensor = client.open("weights").unwrap();
            let tripled: Vec<u8> = tensor
                .read_to_vec()
                .unwrap()
                .iter()
                .map(|b| b.wrapping_mul(3))
                .collect();
            tensor.write_from(&tripled).unwrap();
            println!("TRIPLED {}", tensor.descriptor().tensor.export.name());
        }
        "peers" => {
            let tensor = client.open_for_all_gpus("vmm").unwrap();
            let len = tensor.descriptor().tensor.byte_len as usize;
            let expected = pattern(len, 77);
            assert_eq!(tensor.read_to_vec().unwrap(), expected);
            let devices = GpuDevice::all().unwrap();
            for device in &devices {
                let mut copy = CudaBuffer::allocate(len, device.ordinal()).unwrap();
                tensor.copy_to_device(&mut copy).unwrap();
                assert_eq!(
                    copy.copy_to_host().unwrap(),
                    expected,
                    "read on cuda:{}",
                    device.ordinal()
                );
            }
            println!("VMM-READ-ON {} GPUS", devices.len());
        }
        "update" => {
            // Maps generation 1, then waits (watching) for the update and reads it again
            // through the same mapping.
            let mut watch = client.watch("weights").unwrap();
            let tensor = client.open("weights").unwrap();
            let (ptr, _) = tensor.device_ptr().unwrap();
            let len = tensor.descriptor().tensor.byte_len as usize;
            assert_eq!(tensor.descriptor().tensor.generation, 1);
            assert!(tensor.read_to_vec().unwrap() == pattern(len, 1));
            println!("READY");
            let event = watch
                .next_timeout(Some(std::time::Duration::from_secs(60)))
                .unwrap()
                .expect("the update within 60 s");
            let seen = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_micros() as u64;
            let landed = event.tensor.tensor.landed_unix_us;
            assert_eq!(event.tensor.tensor.generation, 2);
            println!("UPDATE-SEEN-AFTER-US {}", seen.saturating_sub(landed));
            // Through the mapping made before the update, at the same device pointer.
            let read = tensor.read_to_vec().unwrap();
            assert_eq!(tensor.device_ptr().unwrap().0, ptr);
            let now = client.open("weights").unwrap();
            let same_entry = now.descriptor().tensor.id == tensor.descriptor().tensor.id;
            assert!(
                now.read_to_vec().unwrap() == pattern(len, 2),
                "a new open reads the update"
            );
            if same_entry && read == pattern(len, 2) {
                println!("IN-PLACE: the mapping made before (at {ptr:#x}) reads the new bytes");
            } else if !same_entry && read == pattern(len, 1) {
                println!("REPLACED: old generation intact, new one elsewhere");
            } else {
                panic!("neither an in-place update nor a replacement (same entry: {same_entry})");
            }
        }
        other => panic!("unknown child mode {other}"),
    }
}

#[test]
fn nine_tensors_in_one_pool_allocation_read_back_exactly_in_another_process() {
    let Some(_) =
        gpus_or_skip("nine_tensors_in_one_pool_allocation_read_back_exactly_in_another_process")
    else {
        return;
    };
    let path = socket_path("nine");
    let service = ShareService::start(&path, ShareConfig::default()).unwrap();
    let device = GpuDevice::open(0).unwrap();
    let mut config = PoolConfig::default();
    config.max_pool_bytes = 1 << 20;
    config.min_buffer = 1 << 20;
    config.max_buffer = 1 << 20;
    config.preallocate = false;
    let pool = GpuMemoryPool::for_device(&device, config).unwrap();
    let mut buffer = CudaBuffer::from_pool(pool.acquire(1 << 20).unwrap(), 1 << 20);
    buffer.fill(0).unwrap();
    for i in 0..NINE {
        let (offset, len) = nine_layout(i);
        buffer.write_at(offset, &pattern(len, i as u64)).unwrap();
    }
    let buffer = Arc::new(buffer);
    for i in 0..NINE {
        let (offset, len) = nine_layout(i);
        let published = service
            .publish_device(&meta(&format!("t{i}"), len), buffer.clone(), offset as u64)
            .unwrap();
        assert_eq!(published.export(), Export::CudaIpc);
    }
    drop(buffer);

    let stdout = run_child(&path, "nine");
    assert!(stdout.contains("NINE-EXACT"), "{stdout}");

    wait_for("the child's leases to end", || {
        service.list().iter().all(|t| t.leases == 0)
    });
    assert_eq!(pool.stats().in_use_buffers, 1, "held while published");
    for i in 0..NINE {
        assert!(!service.delete(&format!("t{i}")).unwrap());
    }
    assert_eq!(
        pool.stats().in_use_buffers,
        0,
        "back in the pool once the last tensor in it is deleted"
    );
}

#[test]
fn a_consumers_in_place_multiply_is_seen_by_the_producer() {
    let Some(_) = gpus_or_skip("a_consumers_in_place_multiply_is_seen_by_the_producer") else {
        return;
    };
    let device = GpuDevice::open(0).unwrap();
    for kind in [DeviceMemoryKind::Vmm, DeviceMemoryKind::Legacy] {
        let path = socket_path(&format!("triple-{kind:?}"));
        let service = ShareService::start(&path, ShareConfig::default()).unwrap();
        let len = 3 << 20; // more than one VMM granule
        let bytes = pattern(len, 5);
        let mut buffer = CudaBuffer::from_owned(
            DeviceAllocation::with_kind(&device, len, kind).unwrap(),
            len,
        );
        buffer.write_at(0, &bytes).unwrap();
        let published = service
            .publish_device(&meta("weights", len), Arc::new(buffer), 0)
            .unwrap();
        let stdout = run_child(&path, "triple");
        assert!(stdout.contains("TRIPLED"), "{stdout}");
        let tripled: Vec<u8> = bytes.iter().map(|b| b.wrapping_mul(3)).collect();
        assert!(
            published.read_to_vec().unwrap() == tripled,
            "{kind:?}: the producer sees the consumer's write"
        );
    }
}

/// Publishes `weights` (pattern 1) under `on_existing`, lets a child process map it, then
/// publishes pattern 2 under the same name; returns the child's report.
fn update_seen_by_a_mapping(on_existing: tensorwire_ipc::OnExisting, len: usize) -> String {
    use std::io::{BufRead, BufReader};
    let path = socket_path(&format!("update-{on_existing:?}"));
    let mut config = ShareConfig::default();
    config.on_existing = on_existing;
    let service = ShareService::start(&path, config).unwrap();
    let device = GpuDevice::open(0).unwrap();
    let buffer = |seed: u64| {
        let allocation = DeviceAllocation::new_vmm(&device, len).unwrap();
        let mut buffer = CudaBuffer::from_owned(allocation, len);
        buffer.write_at(0, &pattern(len, seed)).unwrap();
        Arc::new(buffer)
    };
    let meta = meta("weights", len);
    let first = service.publish_device(&meta, buffer(1), 0).unwrap();
    assert_eq!(first.generation(), 1);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "gpu_child", "--nocapture", "--test-threads", "1"])
        .env(
            "TENSORWIRE_IPC_GPU_CHILD",
            format!("update|{}", path.display()),
        )
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut report = String::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        report += &line;
        report.push('\n');
        // The test harness may print the test's name on the same line first.
        if line.ends_with("READY") {
            break;
        }
    }
    let second = service.publish_device(&meta, buffer(2), 0).unwrap();
    assert_eq!(second.generation(), 2);
    for line in lines {
        report += &line.unwrap();
        report.push('\n');
    }
    assert!(child.wait().unwrap().success(), "{report}");
    // The child's leases ended with it: only the live generation remains.
    let listed = service.list();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].tensor.generation, 2);
    report
}

#[test]
fn an_in_place_update_of_a_1_gib_gpu_tensor_is_seen_through_a_mapping_made_before() {
    let test = "an_in_place_update_of_a_1_gib_gpu_tensor_is_seen_through_a_mapping_made_before";
    if gpus_or_skip(test).is_none() {
        return;
    }
    let report = update_seen_by_a_mapping(tensorwire_ipc::OnExisting::InPlace, 1 << 30);
    assert!(
        report.contains("IN-PLACE: the mapping made before"),
        "{report}"
    );
    eprintln!("{report}");
}

#[test]
fn a_replaced_gpu_tensor_stays_readable_to_a_consumer_of_the_old_generation() {
    let test = "a_replaced_gpu_tensor_stays_readable_to_a_consumer_of_the_old_generation";
    if gpus_or_skip(test).is_none() {
        return;
    }
    let report = update_seen_by_a_mapping(tensorwire_ipc::OnExisting::Replace, 64 << 20);
    assert!(
        report.contains("REPLACED: old generation intact, new one elsewhere"),
        "{report}"
    );
    eprintln!("{report}");
}

#[test]
fn vmm_memory_is_imported_by_another_process_on_every_gpu() {
    let Some(count) = gpus_or_skip("vmm_memory_is_imported_by_another_process_on_every_gpu") else {
        return;
    };
    let path = socket_path("vmm");
    let service = ShareService::start(&path, ShareConfig::default()).unwrap();
    let device = GpuDevice::open(0).unwrap();
    let (offset, len) = (4096 + 13, 1_000_003);
    let allocation = DeviceAllocation::new_vmm(&device, offset + len).unwrap();
    let mut buffer = CudaBuffer::from_owned(allocation, offset + len);
    buffer.write_at(offset, &pattern(len, 77)).unwrap();
    let published = service
        .publish_device(&meta("vmm", len), Arc::new(buffer), offset as u64)
        .unwrap();
    assert_eq!(published.export(), Export::Vmm);
    let stdout = run_child(&path, "peers");
    assert!(
        stdout.contains(&format!("VMM-READ-ON {count} GPUS")),
        "{stdout}"
    );
    if count < 2 {
        eprintln!("note: one GPU, so VMM peer access across GPUs was not exercised");
    }
}

#[test]
fn a_legacy_handle_cannot_be_opened_by_its_exporter_and_the_lease_comes_back() {
    let Some(_) =
        gpus_or_skip("a_legacy_handle_cannot_be_opened_by_its_exporter_and_the_lease_comes_back")
    else {
        return;
    };
    let path = socket_path("self-open");
    let service = ShareService::start(&path, ShareConfig::default()).unwrap();
    let buffer = CudaBuffer::allocate(4096, 0).unwrap();
    let _published = service
        .publish_device(&meta("mine", 4096), Arc::new(buffer), 0)
        .unwrap();
    let client = ShareClient::connect(&path).unwrap();
    match client.open("mine") {
        Err(IpcError::Gpu(e)) => assert!(e.to_string().contains("cuIpcOpenMemHandle"), "{e}"),
        Err(other) => panic!("expected a CUDA error, got {other}"),
        Ok(_) => panic!("a legacy handle opened in its own process"),
    }
    assert_eq!(
        client.info("mine").unwrap().leases,
        0,
        "the lease came back"
    );
    let descriptor_debug = format!("{:?}", service.list());
    assert!(!descriptor_debug.contains("handle"), "{descriptor_debug}");
}

#[test]
fn a_tensor_outside_its_buffer_is_refused() {
    let Some(_) = gpus_or_skip("a_tensor_outside_its_buffer_is_refused") else {
        return;
    };
    let path = socket_path("outside");
    let service = ShareService::start(&path, ShareConfig::default()).unwrap();
    let buffer = Arc::new(CudaBuffer::allocate(4096, 0).unwrap());
    assert!(matches!(
        service.publish_device(&meta("past-end", 4000), buffer.clone(), 100),
        Err(IpcError::BadMessage(_))
    ));
    assert!(
        service
            .publish_device(&meta("fits", 3996), buffer, 100)
            .is_ok()
    );
}
