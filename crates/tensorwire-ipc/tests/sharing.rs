//! Host-tensor sharing across processes, end to end: publish, list, open in a child process,
//! write in place, observe; deletes deferred by leases; a consumer killed mid-lease;
//! malformed requests; peers that may not connect.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::io::{BufRead, BufReader, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{socket_path, wait_for};
use tensorwire_ipc::{IpcError, ShareClient, ShareConfig, ShareService};
use tensorwire_proto::{DType, TensorMeta};

fn publish(
    service: &ShareService,
    name: &str,
    len: usize,
) -> (tensorwire_ipc::PublishedTensor, Vec<u8>) {
    let bytes: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(13) | 1).collect();
    let meta = TensorMeta::new([len as u64], DType::U8)
        .unwrap()
        .with_name(name);
    (service.publish_host(&meta, &bytes).unwrap(), bytes)
}

fn refused_code(result: Result<impl Sized, IpcError>) -> String {
    match result {
        Err(IpcError::Refused { code, .. }) => code.0,
        Err(other) => panic!("expected a refusal, got {other}"),
        Ok(_) => panic!("expected a refusal, got success"),
    }
}

/// Runs this test binary's `child_consumer` in a new process with `mode`.
fn child(path: &Path, mode: &str) -> Command {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args([
            "--exact",
            "child_consumer",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("TENSORWIRE_IPC_CHILD", format!("{mode}:{}", path.display()))
        .stdout(Stdio::piped());
    command
}

/// Not a test of its own: the consumer process the cross-process tests start.
#[test]
fn child_consumer() {
    let Ok(spec) = std::env::var("TENSORWIRE_IPC_CHILD") else {
        return;
    };
    let (mode, path) = spec.split_once(':').unwrap();
    let client = match ShareClient::connect(path) {
        Ok(client) => client,
        Err(e) => {
            println!("CONNECT-FAILED {e}");
            return;
        }
    };
    let mut tensor = client.open("weights").unwrap();
    match mode {
        "write" => {
            let expected: Vec<u8> = (0..tensor.host_bytes().unwrap().len())
                .map(|i| (i as u8).wrapping_mul(13) | 1)
                .collect();
            assert_eq!(
                tensor.host_bytes().unwrap(),
                &expected[..],
                "the child maps the producer's bytes"
            );
            tensor
                .host_bytes_mut()
                .unwrap()
                .iter_mut()
                .for_each(|b| *b = b.wrapping_mul(3));
            println!("WROTE");
        }
        "hold" => {
            println!("HOLDING");
            std::thread::sleep(Duration::from_secs(60));
        }
        other => panic!("unknown child mode {other}"),
    }
}

#[test]
fn a_child_process_maps_the_tensor_and_its_writes_are_seen() {
    let path = socket_path("child-write");
    let service = ShareService::start(&path, ShareConfig::default()).unwrap();
    let (published, bytes) = publish(&service, "weights", 3 * 4096 + 5);
    let output = child(&path, "write").output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && stdout.contains("WROTE"),
        "{stdout}"
    );
    let tripled: Vec<u8> = bytes.iter().map(|b| b.wrapping_mul(3)).collect();
    assert_eq!(
        published.host_bytes().unwrap(),
        &tripled[..],
        "the producer sees the consumer's in-place write"
    );
    wait_for("the exited child's lease to end", || {
        service.list()[0].leases == 0
    });
}

#[test]
fn a_consumer_killed_mid_lease_loses_it_and_a_deferred_delete_completes() {
    let path = socket_path("child-killed");
    let service = ShareService::start(&path, ShareConfig::default()).unwrap();
    let _ = publish(&service, "weights", 100_000);
    let mut holder = child(&path, "hold").spawn().unwrap();
    let mut lines = BufReader::new(holder.stdout.take().unwrap()).lines();
    assert!(lines.any(|l| l.unwrap().contains("HOLDING")));
    assert_eq!(service.list()[0].leases, 1);
    assert!(
        service.delete("weights").unwrap(),
        "deleting a leased tensor is deferred"
    );
    let listed = service.list();
    assert!(listed[0].deleting, "still listed while leased: {listed:?}");
    holder.kill().unwrap();
    holder.wait().unwrap();
    wait_for(
        "the killed consumer's lease to end and the tensor to go",
        || service.list().is_empty(),
    );
}

#[test]
fn leases_defer_deletes_and_are_limited_per_consumer() {
    let path = socket_path("leases");
    let mut config = ShareConfig::default();
    config.max_leases_per_process = 2;
    let service = ShareService::start(&path, config).unwrap();
    let _ = publish(&service, "a", 64);
    let _ = publish(&service, "b", 64);
    let client = ShareClient::connect(&path).unwrap();
    let names: Vec<String> = client
        .list()
        .unwrap()
        .into_iter()
        .map(|i| i.tensor.name)
        .collect();
    assert_eq!(names, ["a", "b"]);
    let first = client.open("a").unwrap();
    let by_id = client
        .open(&first.descriptor().tensor.id.to_string())
        .unwrap();
    assert_eq!(by_id.host_bytes(), first.host_bytes());
    assert_eq!(refused_code(client.open("b")), "lease_limit");
    // The limit is the process's, not the connection's: a second connection gets no more.
    let second = ShareClient::connect(&path).unwrap();
    assert_eq!(refused_code(second.open("b")), "lease_limit");
    drop(second);
    assert_eq!(client.info("a").unwrap().leases, 2);
    assert!(client.delete("a").unwrap(), "deferred while leased");
    assert_eq!(
        refused_code(client.open("a")),
        "not_found",
        "a deleting tensor cannot be opened"
    );
    drop(first);
    assert_eq!(client.list().unwrap().len(), 2, "one lease still holds it");
    drop(by_id);
    let names: Vec<String> = client
        .list()
        .unwrap()
        .into_iter()
        .map(|i| i.tensor.name)
        .collect();
    assert_eq!(names, ["b"], "gone with its last lease");
    assert!(
        !client.delete("b").unwrap(),
        "an unleased tensor goes at once"
    );
    assert_eq!(refused_code(client.info("b")), "not_found");
    assert!(
        service
            .publish_host(
                &TensorMeta::new([3], DType::U8).unwrap().with_name("x"),
                &[1, 2]
            )
            .is_err()
    );
}

/// A raw SEQPACKET connection, for requests no well-behaved client sends.
struct Raw(std::os::fd::OwnedFd);

impl Raw {
    fn connect(path: &Path) -> Self {
        use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
        let fd = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        rustix::net::connect(&fd, &SocketAddrUnix::new(path).unwrap()).unwrap();
        Self(fd)
    }

    fn ask(&self, bytes: &[u8]) -> serde_json::Value {
        use rustix::net::{RecvAncillaryBuffer, RecvFlags, SendAncillaryBuffer, SendFlags};
        let mut space: [MaybeUninit<u8>; 0] = [];
        rustix::net::sendmsg(
            &self.0,
            &[IoSlice::new(bytes)],
            &mut SendAncillaryBuffer::new(&mut space),
            SendFlags::NOSIGNAL,
        )
        .unwrap();
        let mut buf = vec![0u8; 70_000];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let msg = rustix::net::recvmsg(
            &self.0,
            &mut [IoSliceMut::new(&mut buf)],
            &mut RecvAncillaryBuffer::new(&mut space),
            RecvFlags::empty(),
        )
        .unwrap();
        serde_json::from_slice(&buf[..msg.bytes]).unwrap()
    }
}

#[test]
fn malformed_requests_get_errors_and_the_service_goes_on() {
    let path = socket_path("malformed");
    let service = ShareService::start(&path, ShareConfig::default()).unwrap();
    let _ = publish(&service, "t", 16);
    let raw = Raw::connect(&path);
    let code = |reply: serde_json::Value| reply["error"]["code"].as_str().unwrap_or("").to_owned();
    assert_eq!(
        code(raw.ask(br#"{"op":"list"}"#)),
        "bad_request",
        "hello comes first"
    );
    assert_eq!(
        code(raw.ask(br#"{"op":"hello","version":99}"#)),
        "unsupported_version"
    );
    assert_eq!(raw.ask(br#"{"op":"hello","version":2}"#)["ok"], true);
    assert_eq!(code(raw.ask(b"\xff\xfe not json")), "bad_request");
    assert_eq!(code(raw.ask(br#"{"op":"format_disk"}"#)), "bad_request");
    assert_eq!(
        code(raw.ask(br#"{"op":"open"}"#)),
        "bad_request",
        "missing field"
    );
    assert_eq!(
        code(raw.ask(&vec![b' '; 65 * 1024])),
        "bad_request",
        "oversized"
    );
    assert_eq!(
        code(raw.ask(br#"{"op":"release","lease":12345}"#)),
        "not_found"
    );
    assert_eq!(
        raw.ask(br#"{"op":"list"}"#)["tensors"][0]["name"],
        "t",
        "the connection still works"
    );
    assert_eq!(
        ShareClient::connect(&path).unwrap().list().unwrap().len(),
        1,
        "and the service serves others"
    );
}

#[test]
fn peers_of_another_uid_are_refused() {
    let path = socket_path("peercred");
    let mut config = ShareConfig::default();
    config.allowed_uids = vec![rustix::process::geteuid().as_raw() + 4242];
    let _service = ShareService::start(&path, config).unwrap();
    assert_eq!(
        refused_code(ShareClient::connect(&path)),
        "forbidden",
        "SO_PEERCRED checked"
    );
}

#[test]
fn the_socket_directory_must_be_private() {
    use std::os::unix::fs::PermissionsExt;
    let path = socket_path("loose-dir");
    let dir = path.parent().unwrap();
    std::fs::create_dir_all(dir).unwrap();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let err = ShareService::start(&path, ShareConfig::default())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("mode 0700"), "{err}");
    let fresh = socket_path("fresh-dir");
    let _service = ShareService::start(&fresh, ShareConfig::default()).unwrap();
    let mode = std::fs::metadata(fresh.parent().unwrap())
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o700);
}

#[test]
fn a_process_of_another_uid_cannot_reach_the_socket() {
    use std::os::unix::process::CommandExt;
    if rustix::process::geteuid().as_raw() != 0 {
        eprintln!(
            "SKIPPED a_process_of_another_uid_cannot_reach_the_socket: needs root to start a process as another uid"
        );
        return;
    }
    let path = socket_path("other-uid");
    let service = ShareService::start(&path, ShareConfig::default()).unwrap();
    let _ = publish(&service, "weights", 10);
    // The test binary may live in a private directory (a 0700 home, a `mktemp -d` clone)
    // that uid 65534 cannot enter: run a copy from a directory every uid can execute.
    let runnable =
        std::env::temp_dir().join(format!("tensorwire-ipc-child-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&runnable);
    std::fs::create_dir(&runnable).unwrap();
    std::fs::set_permissions(&runnable, std::fs::Permissions::from_mode(0o755)).unwrap();
    let exe = runnable.join("sharing-child");
    std::fs::copy(std::env::current_exe().unwrap(), &exe).unwrap();
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut command = child(&path, "write");
    let output = Command::new(&exe)
        .args(command.get_args())
        .envs(command.get_envs().filter_map(|(k, v)| Some((k, v?))))
        .stdout(Stdio::piped())
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    let _ = &mut command;
    std::fs::remove_dir_all(&runnable).unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    // Refused by the directory's mode (EACCES on connect), not by anything later.
    assert!(
        stdout.contains("CONNECT-FAILED") && stdout.contains("Permission denied"),
        "the 0700 directory stops it: {stdout} {}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(service.list()[0].leases, 0);
}

/// Consumer connections are bounded in all and per process, each refused with a reason.
#[test]
fn consumer_connections_are_bounded() {
    let path = socket_path("connections");
    let mut config = ShareConfig::default();
    config.max_connections = 5;
    config.max_connections_per_process = 3;
    let service = ShareService::start(&path, config).unwrap();
    let _ = publish(&service, "weights", 10);
    let held: Vec<_> = (0..3)
        .map(|_| ShareClient::connect(&path).unwrap())
        .collect();
    let err = ShareClient::connect(&path)
        .err()
        .expect("a fourth connection is refused");
    assert!(err.to_string().contains("too_many_connections"), "{err}");
    assert!(err.to_string().contains("3 connections open"), "{err}");
    // Closing one makes room again.
    drop(held);
    wait_for("the connections to close", || {
        ShareClient::connect(&path).is_ok()
    });
}

/// Refused connections that never speak (idle processes at the cap) do not hold up the
/// service: a consumer that comes after many of them is answered at once, with the reason,
/// not after each silent one was waited for in turn.
#[test]
fn silent_refused_connections_do_not_delay_the_next_consumer() {
    let path = socket_path("silent-refused");
    let mut config = ShareConfig::default();
    config.max_connections = 2;
    let service = ShareService::start(&path, config).unwrap();
    let _ = publish(&service, "weights", 10);
    let held: Vec<_> = (0..2).map(|_| Raw::connect(&path)).collect();
    wait_for("both connections to be served", || {
        ShareClient::connect(&path).is_err()
    });
    // Forty silent peers, each refused; with each waited for in turn on the accept loop
    // (as before), the next consumer waited tens of seconds.
    let silent: Vec<_> = (0..40).map(|_| Raw::connect(&path)).collect();
    let started = std::time::Instant::now();
    let err = ShareClient::connect(&path).err().expect("still at the cap");
    let waited = started.elapsed();
    assert!(err.to_string().contains("too_many_connections"), "{err}");
    assert!(
        waited < Duration::from_secs(8),
        "answered after {waited:?}, behind the silent peers"
    );
    drop((held, silent));
    wait_for("room again", || ShareClient::connect(&path).is_ok());
}

/// `--share PATH` never deletes what is at PATH unless it is a dead socket.
#[test]
fn a_share_path_that_is_a_file_or_a_live_socket_is_refused() {
    let path = socket_path("occupied");
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(path.parent().unwrap())
        .unwrap();
    std::fs::write(&path, b"not a socket").unwrap();
    let err = ShareService::start(&path, ShareConfig::default())
        .err()
        .unwrap();
    assert!(err.to_string().contains("not a socket"), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), b"not a socket");
    std::fs::remove_file(&path).unwrap();

    let live = ShareService::start(&path, ShareConfig::default()).unwrap();
    let _ = publish(&live, "weights", 10);
    let err = ShareService::start(&path, ShareConfig::default())
        .err()
        .unwrap();
    assert!(err.to_string().contains("live producer"), "{err}");
    assert_eq!(
        ShareClient::connect(&path).unwrap().list().unwrap().len(),
        1
    );
}

/// A stale socket (its producer gone) is replaced.
#[test]
fn a_stale_socket_is_replaced() {
    let path = socket_path("stale");
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(path.parent().unwrap())
        .unwrap();
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    drop(listener); // The file stays; nobody listens.
    let service = ShareService::start(&path, ShareConfig::default()).unwrap();
    let _ = publish(&service, "weights", 10);
    assert_eq!(
        ShareClient::connect(&path).unwrap().list().unwrap().len(),
        1
    );
}

/// A shared host tensor's memory is sealed: a consumer cannot truncate it under the others.
#[test]
fn a_consumer_cannot_shrink_shared_host_memory() {
    let path = socket_path("sealed");
    let service = ShareService::start(&path, ShareConfig::default()).unwrap();
    let (_published, bytes) = publish(&service, "weights", 4096);
    let client = ShareClient::connect(&path).unwrap();
    let tensor = client.open("weights").unwrap();
    let fd = tensor.host_fd().expect("a host tensor has its memfd");
    let err = rustix::fs::ftruncate(fd, 0).unwrap_err();
    assert_eq!(err, rustix::io::Errno::PERM, "shrinking must be sealed off");
    assert_eq!(tensor.host_bytes().unwrap(), &bytes[..]);
}

#[test]
fn a_dlpack_export_holds_the_lease_until_its_deleter_runs() {
    let path = socket_path("dlpack");
    let service = ShareService::start(&path, ShareConfig::default()).unwrap();
    let meta = TensorMeta::new([3, 5], DType::F32).unwrap().with_name("w");
    service.publish_host(&meta, &[7u8; 60]).unwrap();
    let client = ShareClient::connect(&path).unwrap();
    let exported = client.open("w").unwrap().into_dlpack().unwrap();
    assert_eq!(exported.shape(), [3, 5]);
    let tensor = exported.tensor();
    assert_eq!((tensor.dtype.code, tensor.dtype.bits), (2, 32));
    assert_eq!(tensor.device.device_type, tensorwire_gpu::dlpack::KDL_CPU);
    assert!(!tensor.data.is_null());
    assert_eq!(
        client.info("w").unwrap().leases,
        1,
        "the export holds the lease"
    );
    drop(exported);
    assert_eq!(
        client.info("w").unwrap().leases,
        0,
        "the deleter released it"
    );
}

#[test]
fn the_producer_reports_its_gpus_by_uuid() {
    let path = socket_path("devices");
    let _service = ShareService::start(&path, ShareConfig::default()).unwrap();
    let devices = ShareClient::connect(&path).unwrap().devices().unwrap();
    assert_eq!(
        devices.len(),
        tensorwire_gpu::GpuStatus::detect().device_count(),
        "{devices:?}"
    );
    for device in devices {
        assert!(device.uuid.starts_with("GPU-"), "{device:?}");
        assert!(device.free_memory <= device.total_memory);
    }
}

#[test]
fn a_socket_path_too_long_for_the_kernel_is_refused_with_the_limit_named() {
    let long = std::env::temp_dir()
        .join("d".repeat(100))
        .join("share.sock");
    let Err(err) = ShareService::start(&long, ShareConfig::default()) else {
        panic!("a {}-byte socket path was accepted", long.as_os_str().len());
    };
    assert!(err.to_string().contains("at most 107 bytes"), "{err}");
    let Err(err) = ShareClient::connect(&long) else {
        panic!("connected through a path the kernel cannot take");
    };
    assert!(err.to_string().contains("at most 107 bytes"), "{err}");
    assert!(!long.parent().unwrap().exists(), "nothing was created");
}
