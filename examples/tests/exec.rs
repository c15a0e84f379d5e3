//! Remote execution as users run it: `receiver --allow-exec`, `tensorwire-exec` and the SpMV
//! walkthrough; on a GPU, faulting and endless kernels that end only their worker, and cubins
//! for the wrong architecture (spec §14).
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tensorwire::exec::{ExecClient, Module, ModuleFormat, Run};
use tensorwire::gpu::gpus_or_skip;
use tensorwire::gpu::kernel::cubin_architecture;
use tensorwire::proto::{DType, ErrorCode, TensorMeta};
use tensorwire::quic::{ClientTls, SenderConfig};
use tensorwire_examples::files::{read_npy, write_npy};

/// The source tree (for the kernels and the SpMV PTX): `TENSORWIRE_SOURCE_DIR` where the
/// tests run away from it (the GPU bundle), else this checkout.
fn root() -> PathBuf {
    std::env::var_os("TENSORWIRE_SOURCE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/..")))
}

/// A program of this package: from `TENSORWIRE_BIN_DIR` where the tests run away from the
/// build (the GPU bundle), else the one cargo built.
fn program(name: &str, built: &str) -> PathBuf {
    match std::env::var_os("TENSORWIRE_BIN_DIR") {
        Some(dir) => PathBuf::from(dir).join(name),
        None => PathBuf::from(built),
    }
}

fn receiver_bin() -> PathBuf {
    program("receiver", env!("CARGO_BIN_EXE_receiver"))
}

fn exec_bin() -> PathBuf {
    program("tensorwire-exec", env!("CARGO_BIN_EXE_tensorwire-exec"))
}

fn worker_bin() -> PathBuf {
    program(
        "tensorwire-exec-worker",
        env!("CARGO_BIN_EXE_tensorwire-exec-worker"),
    )
}

fn kernels(file: &str) -> PathBuf {
    root().join("examples/tests/kernels").join(file)
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tensorwire-exec-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A running `receiver --allow-exec`, killed on drop.
struct Server {
    child: Child,
    addr: String,
}

impl Server {
    fn start(args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut command = Command::new(receiver_bin());
        command
            .args(["--listen", "127.0.0.1:0", "--allow-exec", "--exec-worker"])
            .arg(worker_bin())
            .args(args)
            .stdout(Stdio::piped());
        for (key, value) in env {
            command.env(key, value);
        }
        let mut child = command.spawn().unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let first = lines.next().unwrap().unwrap();
        let addr = first
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("{first}"))
            .to_owned();
        // Keep reading its output so it never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines.by_ref() {});
        Server { child, addr }
    }

    /// Runs `tensorwire-exec` against the server; unless `args` choose, over the binding
    /// `TENSORWIRE_TEST_BINDING` names (`quic`, `tcp` or `auto`; the program's default, auto,
    /// when unset).
    fn exec(&self, args: &[&str]) -> Output {
        let mut command = Command::new(exec_bin());
        command.args(["--connect", &self.addr]);
        if let Ok(binding) = std::env::var("TENSORWIRE_TEST_BINDING")
            && !args.contains(&"--transport")
        {
            command.args(["--transport", &binding]);
        }
        command.args(args).output().unwrap()
    }

    async fn client(&self) -> ExecClient {
        let mut config = SenderConfig::new(ClientTls::Development);
        if let Ok(binding) = std::env::var("TENSORWIRE_TEST_BINDING") {
            config.binding = binding.parse().unwrap();
        }
        ExecClient::connect(self.addr.parse().unwrap(), config)
            .await
            .unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn text(output: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn spmv(args: &[&str]) -> Output {
    Command::new(program("spmv", env!("CARGO_BIN_EXE_spmv")))
        .args(args)
        .output()
        .unwrap()
}

/// The walkthrough's `tensorwire-exec run` for the data in `data`.
fn spmv_run_args(data: &Path, rows: u32, save: &Path, repeat: u32) -> Vec<String> {
    let file = |name: &str| data.join(name).display().to_string();
    vec![
        "run".into(),
        root().join("examples/spmv/spmv.ptx").display().to_string(),
        "--function".into(),
        "spmv_csr".into(),
        "--grid".into(),
        rows.div_ceil(256).to_string(),
        "--block".into(),
        "256".into(),
        "--in".into(),
        format!("values={}", file("values.npy")),
        "--in".into(),
        format!("col_indices={}", file("col_indices.npy")),
        "--in".into(),
        format!("row_ptr={}", file("row_ptr.npy")),
        "--in".into(),
        format!("x={}", file("x.npy")),
        "--out".into(),
        format!("y=f32:{rows}"),
        "--scalar".into(),
        format!("rows=i32:{rows}"),
        "--save".into(),
        save.display().to_string(),
        "--repeat".into(),
        repeat.to_string(),
    ]
}

#[test]
fn allow_exec_on_a_public_address_without_mutual_tls_refuses_to_start() {
    let output = Command::new(receiver_bin())
        .args(["--listen", "0.0.0.0:0", "--allow-exec"])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&output);
    assert!(!output.status.success(), "{stdout}");
    assert!(stderr.contains("mutual TLS"), "{stderr}");
    assert!(!stdout.contains("listening on"), "{stdout}");
}

/// Spec §14.6: with an access token a receiver may serve kernels on any address, only to
/// clients that present the token; a token file others can read is refused at start.
#[test]
fn a_receiver_with_an_access_token_serves_only_its_holders_on_any_address() {
    use std::os::unix::fs::PermissionsExt;
    let dir = temp_dir("token");
    let token = dir.join("token");
    std::fs::write(&token, "4f1c9a0d7e2b6c58a1f3d9e0b7c2a465\n").unwrap();
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o644)).unwrap();
    let loose = Command::new(receiver_bin())
        .args(["--listen", "0.0.0.0:0", "--allow-exec", "--exec-token-file"])
        .arg(&token)
        .output()
        .unwrap();
    let (stdout, stderr) = text(&loose);
    assert!(!loose.status.success(), "{stdout}");
    assert!(stderr.contains("chmod 600"), "{stderr}");
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    let mut receiver = Command::new(receiver_bin())
        .args(["--listen", "0.0.0.0:0", "--allow-exec", "--exec-worker"])
        .arg(worker_bin())
        .arg("--exec-token-file")
        .arg(&token)
        .env("CUDA_VISIBLE_DEVICES", "")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(receiver.stdout.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    let port = first.rsplit(':').next().unwrap().to_owned();
    std::thread::spawn(move || for _ in lines.by_ref() {});
    let addr = format!("127.0.0.1:{port}");
    let without = Command::new(exec_bin())
        .args(["--connect", &addr, "info"])
        .output()
        .unwrap();
    let with = Command::new(exec_bin())
        .args(["--connect", &addr, "--token-file"])
        .arg(&token)
        .arg("info")
        .output()
        .unwrap();
    let _ = receiver.kill();
    let _ = receiver.wait();
    let (stdout, stderr) = text(&without);
    assert!(!without.status.success(), "{stdout}");
    assert!(
        stderr.contains("EXEC_NOT_ALLOWED") && stderr.contains("access token"),
        "{stderr}"
    );
    let (stdout, stderr) = text(&with);
    assert!(with.status.success(), "{stderr}");
    assert!(stdout.contains("exec: disabled: no GPU"), "{stdout}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_receiver_without_allow_exec_refuses_kernels() {
    let mut receiver = Command::new(receiver_bin())
        .args(["--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(receiver.stdout.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    let addr = first.strip_prefix("listening on ").unwrap().to_owned();
    let output = Command::new(exec_bin())
        .args(["--connect", &addr, "info"])
        .output()
        .unwrap();
    let _ = receiver.kill();
    let _ = receiver.wait();
    let (stdout, stderr) = text(&output);
    assert!(!output.status.success(), "{stdout}");
    assert!(stderr.contains("EXEC_NOT_ALLOWED"), "{stderr}");
    assert!(stderr.contains("--allow-exec"), "{stderr}");
}

/// `CUDA_VISIBLE_DEVICES=` hides every GPU, so this runs the same on any host.
#[test]
fn without_a_gpu_the_server_answers_info_and_refuses_runs_with_a_reason() {
    let server = Server::start(&[], &[("CUDA_VISIBLE_DEVICES", "")]);
    let info = server.exec(&["info"]);
    let (stdout, stderr) = text(&info);
    assert!(info.status.success(), "{stderr}");
    assert!(stdout.contains("exec: disabled: no GPU"), "{stdout}");
    // The same answer over TCP (spec §16).
    let over_tcp = server.exec(&["--transport", "tcp", "info"]);
    assert!(
        text(&over_tcp).0.contains("exec: disabled: no GPU"),
        "{:?}",
        text(&over_tcp)
    );
    let health = server.exec(&["health"]);
    assert!(
        text(&health).0.contains("workers: 0"),
        "{:?}",
        text(&health)
    );

    let dir = temp_dir("nogpu");
    assert!(
        spmv(&[
            "gen",
            "--rows",
            "64",
            "--nnz",
            "256",
            "--out",
            dir.to_str().unwrap()
        ])
        .status
        .success()
    );
    let args = spmv_run_args(&dir, 64, &dir.join("out"), 1);
    let run = server.exec(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let (stdout, stderr) = text(&run);
    assert!(!run.status.success(), "{stdout}");
    assert!(stderr.contains("UNSUPPORTED_DEVICE"), "{stderr}");
    assert!(stderr.contains("no GPU"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_run_arguments_are_refused_with_the_flag_named() {
    let server = Server::start(&[], &[("CUDA_VISIBLE_DEVICES", "")]);
    let ptx = root().join("examples/spmv/spmv.ptx");
    let ptx = ptx.to_str().unwrap();
    for (args, expected) in [
        (
            vec!["run", ptx, "--function", "f", "--grid", "1,2,3,4"],
            "--grid",
        ),
        (vec!["run", ptx, "--function", "f", "--out", "y"], "--out y"),
        (
            vec!["run", ptx, "--function", "f", "--scalar", "n=i32:x"],
            "not a I32",
        ),
        (
            vec!["run", ptx, "--function", "f", "--block", "4096"],
            "LAUNCH_TOO_LARGE",
        ),
        (
            vec!["run", ptx, "--function", "f", "--in", "x=/nonexistent.npy"],
            "nonexistent",
        ),
    ] {
        let output = server.exec(&args);
        let (_, stderr) = text(&output);
        assert!(!output.status.success(), "{args:?}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
}

/// The checker computes A·x itself: a right y passes, one wrong entry fails naming its row.
#[test]
fn spmv_check_catches_a_wrong_result() {
    let dir = temp_dir("check");
    assert!(
        spmv(&[
            "gen",
            "--rows",
            "100",
            "--nnz",
            "700",
            "--out",
            dir.to_str().unwrap()
        ])
        .status
        .success()
    );
    let load_f32 = |name: &str| -> Vec<f32> {
        let (_, bytes) = read_npy(&dir.join(name)).unwrap();
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let load_i32 = |name: &str| -> Vec<i32> {
        let (_, bytes) = read_npy(&dir.join(name)).unwrap();
        bytes
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let (values, cols, row_ptr, x) = (
        load_f32("values.npy"),
        load_i32("col_indices.npy"),
        load_i32("row_ptr.npy"),
        load_f32("x.npy"),
    );
    assert_eq!(
        (values.len(), row_ptr.len(), *row_ptr.last().unwrap()),
        (700, 101, 700)
    );
    let mut y: Vec<f32> = (0..100)
        .map(|r| {
            (row_ptr[r]..row_ptr[r + 1])
                .map(|j| values[j as usize] * x[cols[j as usize] as usize])
                .sum()
        })
        .collect();
    let y_path = dir.join("y.npy");
    let bytes: Vec<u8> = y.iter().flat_map(|v| v.to_le_bytes()).collect();
    write_npy(&y_path, DType::F32, &[100], &bytes).unwrap();
    let ok = spmv(&["check", dir.to_str().unwrap(), y_path.to_str().unwrap()]);
    assert!(ok.status.success(), "{:?}", text(&ok));
    y[42] += 0.5;
    let bytes: Vec<u8> = y.iter().flat_map(|v| v.to_le_bytes()).collect();
    write_npy(&y_path, DType::F32, &[100], &bytes).unwrap();
    let bad = spmv(&["check", dir.to_str().unwrap(), y_path.to_str().unwrap()]);
    assert!(!bad.status.success());
    assert!(text(&bad).1.contains("y[42]"), "{:?}", text(&bad));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_committed_cubins_say_their_architecture() {
    let sm80 = std::fs::read(kernels("kernels_sm80.cubin")).unwrap();
    let sm90 = std::fs::read(kernels("kernels_sm90.cubin")).unwrap();
    assert_eq!(cubin_architecture(&sm80), Some((8, 0)));
    assert_eq!(cubin_architecture(&sm90), Some((9, 0)));
    assert_eq!(ModuleFormat::sniff(&sm80), ModuleFormat::Cubin);
    let ptx = std::fs::read(kernels("kernels.ptx")).unwrap();
    assert_eq!(cubin_architecture(&ptx), None);
}

// --- On a GPU -------------------------------------------------------------------------

/// The walkthrough at the size the issue names: 1,000,000 rows, 10,000,000 non-zeros. The
/// second run sends no module; y matches the CPU reference.
#[test]
fn spmv_on_the_gpu_matches_the_cpu_reference_and_the_second_run_sends_no_module() {
    if gpus_or_skip("spmv_on_the_gpu").is_none() {
        return;
    }
    let dir = temp_dir("spmv");
    let rows = 1_000_000u32;
    let generated = spmv(&[
        "gen",
        "--rows",
        "1000000",
        "--nnz",
        "10000000",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(generated.status.success(), "{:?}", text(&generated));
    let server = Server::start(&["--device", "cuda:0"], &[]);
    let out = dir.join("out");
    let args = spmv_run_args(&dir, rows, &out, 2);
    let run = server.exec(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let (stdout, stderr) = text(&run);
    assert!(run.status.success(), "{stdout}{stderr}");
    eprintln!("{stdout}");
    let lines: Vec<&str> = stdout.lines().filter(|l| l.starts_with("run ")).collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    assert!(lines[0].ends_with("module sent"), "{stdout}");
    assert!(
        lines[1].ends_with("module cached by the server"),
        "{stdout}"
    );
    let check = spmv(&[
        "check",
        dir.to_str().unwrap(),
        out.join("y.npy").to_str().unwrap(),
    ]);
    assert!(check.status.success(), "{:?}", text(&check));
    eprintln!("{}", text(&check).0);
    let health = text(&server.exec(&["health"])).0;
    assert!(health.contains("module.cached: 1"), "{health}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn f32_bytes(values: impl IntoIterator<Item = f32>) -> Bytes {
    values
        .into_iter()
        .flat_map(f32::to_le_bytes)
        .collect::<Vec<u8>>()
        .into()
}

/// `add` over n floats: out = in + 1.5.
fn add_run(module: &Arc<Module>, n: u32) -> (Run, Vec<f32>) {
    let input: Vec<f32> = (0..n).map(|i| i as f32 * 0.25).collect();
    let meta = TensorMeta::new(vec![u64::from(n)], DType::F32)
        .unwrap()
        .with_name("in");
    let run = Run::new(module.clone(), "add")
        .grid([n.div_ceil(256), 1, 1])
        .block([256, 1, 1])
        .input(meta, f32_bytes(input.iter().copied()))
        .unwrap()
        .output("out", DType::F32, vec![u64::from(n)])
        .scalar("delta", DType::F32, 1.5f32.to_le_bytes())
        .scalar("n", DType::I32, (n as i32).to_le_bytes());
    (run, input.iter().map(|v| v + 1.5).collect())
}

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// A kernel that writes out of bounds and one that never ends each get an error reply, and
/// only their workers go: a request from another client at the same time completes, and
/// so does one after them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn faulting_and_endless_kernels_end_only_their_worker() {
    if gpus_or_skip("faulting_and_endless_kernels").is_none() {
        return;
    }
    let server = Server::start(
        &[
            "--device",
            "cuda:0",
            "--exec-workers",
            "3",
            "--exec-time-limit-ms",
            "5000",
        ],
        &[],
    );
    let ptx = std::fs::read(kernels("kernels.ptx")).unwrap();
    let module = Arc::new(Module::new(ModuleFormat::Ptx, ptx));
    let (faulty, endless, good) = (
        server.client().await,
        server.client().await,
        server.client().await,
    );
    let far = Run::new(module.clone(), "write_far").output("out", DType::F32, vec![16]);
    let spin = Run::new(module.clone(), "spin")
        .output("flag", DType::I32, vec![1])
        .time_limit(Duration::from_millis(1500));
    let (add, expected) = add_run(&module, 1 << 20);
    let (fault, overrun, fine) = tokio::join!(faulty.run(&far), endless.run(&spin), good.run(&add));
    let fault = fault.unwrap_err();
    assert_eq!(fault.code(), Some(ErrorCode::KERNEL_FAULT), "{fault}");
    let overrun = overrun.unwrap_err();
    assert_eq!(
        overrun.code(),
        Some(ErrorCode::RUN_TIME_EXCEEDED),
        "{overrun}"
    );
    assert!(overrun.to_string().contains("1500 ms"), "{overrun}");
    let fine = fine.unwrap();
    assert_eq!(floats(&fine.output("out").unwrap().1), expected);
    assert!(fine.timings.kernel_ns > 0 && fine.timings.kernel_ns < fine.timings.total_ns);
    eprintln!(
        "fault: {fault}\noverrun: {overrun}\nadd: {:?}",
        fine.timings
    );

    // The workers were replaced: the next requests run as before.
    let again = faulty.run(&add).await.unwrap();
    assert_eq!(floats(&again.output("out").unwrap().1), expected);
    assert!(!again.module_sent, "the module stays cached");
    let health = good.health().await.unwrap();
    assert_eq!(
        health.attribute("workers.replaced"),
        Some("2"),
        "{health:?}"
    );
}

/// A cubin runs on its own architecture and is refused on another, naming both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cubin_for_another_architecture_is_refused_with_both_named() {
    if gpus_or_skip("cubin_architecture").is_none() {
        return;
    }
    let server = Server::start(&["--device", "cuda:0"], &[]);
    let client = server.client().await;
    let info = client.info().await.unwrap();
    let cc = info
        .attribute("device.compute_capability")
        .unwrap()
        .to_owned();
    let (major, minor): (u32, u32) = {
        let (a, b) = cc.split_once('.').unwrap();
        (a.parse().unwrap(), b.parse().unwrap())
    };
    let runs_here = |arch: (u32, u32)| arch.0 == major && arch.1 <= minor;
    for file in ["kernels_sm80.cubin", "kernels_sm90.cubin"] {
        let bytes = std::fs::read(kernels(file)).unwrap();
        let arch = cubin_architecture(&bytes).unwrap();
        let module = Arc::new(Module::new(ModuleFormat::Cubin, bytes));
        let (add, expected) = add_run(&module, 4096);
        let outcome = client.run(&add).await;
        if runs_here(arch) {
            let output = outcome.unwrap();
            assert_eq!(floats(&output.output("out").unwrap().1), expected, "{file}");
        } else {
            let err = outcome.unwrap_err();
            assert_eq!(err.code(), Some(ErrorCode::MODULE_INVALID), "{file}: {err}");
            let message = err.to_string();
            let (cubin, device) = (
                format!("sm_{}{}", arch.0, arch.1),
                format!("sm_{major}{minor}"),
            );
            assert!(
                message.contains(&cubin) && message.contains(&device),
                "{message}"
            );
            eprintln!("{file}: {message}");
        }
    }
    // A function the module lacks.
    let ptx = std::fs::read(kernels("kernels.ptx")).unwrap();
    let module = Arc::new(Module::new(ModuleFormat::Ptx, ptx));
    let missing = Run::new(module, "no_such_kernel").output("out", DType::F32, vec![1]);
    let err = client.run(&missing).await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::MODULE_INVALID), "{err}");
    assert!(err.to_string().contains("no_such_kernel"), "{err}");
}

/// Processes whose parent is `pid`, and not yet dead (zombies count as gone).
fn live_children(pid: u32) -> Vec<u32> {
    let mut children = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(child) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // "pid (comm) state ppid ...": the fields after the last ')'.
        let Some(rest) = stat.rsplit_once(')').map(|(_, rest)| rest) else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        if fields.len() > 1 && fields[0] != "Z" && fields[1] == pid.to_string() {
            children.push(child);
        }
    }
    children
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|stat| {
            !stat
                .rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

/// A server that dies while a kernel spins takes its workers with it: nothing is left
/// holding the GPU.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_end_with_their_server() {
    if gpus_or_skip("workers_end_with_their_server").is_none() {
        return;
    }
    let mut server = Server::start(
        &[
            "--device",
            "cuda:0",
            "--exec-workers",
            "1",
            "--exec-time-limit-ms",
            "60000",
        ],
        &[],
    );
    let ptx = std::fs::read(kernels("kernels.ptx")).unwrap();
    let module = Arc::new(Module::new(ModuleFormat::Ptx, ptx));
    let client = server.client().await;
    let spin = Run::new(module, "spin")
        .output("flag", DType::I32, vec![1])
        .time_limit(Duration::from_secs(60));
    let running = tokio::spawn(async move { client.run(&spin).await });
    // Wait for the worker to exist and the kernel to have had time to start.
    let mut workers = Vec::new();
    for _ in 0..100 {
        workers = live_children(server.child.id());
        if !workers.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!workers.is_empty(), "the receiver started no worker");
    tokio::time::sleep(Duration::from_secs(2)).await;
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    let mut left = workers.clone();
    for _ in 0..200 {
        left.retain(|&pid| alive(pid));
        if left.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(left.is_empty(), "workers {left:?} outlived their server");
    assert!(
        running.await.unwrap().is_err(),
        "the run cannot succeed without its server"
    );
}
