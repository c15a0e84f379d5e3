//! The worker process (spec §14.5): one CUDA context of its own, the modules it has loaded,
//! and, per job, mappings of that job's tensors only. A kernel that faults takes this process
//! down with it, never the server; the server kills it outright when a kernel overruns.

use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::process::ExitCode;
use std::sync::Arc;

use tensorwire_gpu::kernel::{KernelArg, KernelError, LaunchConfig, LoadedModule, launch};
use tensorwire_gpu::{GpuDevice, ImportedMemory};
use tensorwire_proto::ErrorCode;

use crate::channel::{Channel, Job, JobArg, Report};
use crate::message::module_format_of;

/// Modules a worker keeps loaded; the oldest goes first past this.
const MAX_MODULES: usize = 64;

/// Serves jobs on the socket inherited as standard input until the server closes it, for
/// device `ordinal`. The `tensorwire-exec-worker` program is this function; a program that
/// embeds the server and wants to be its own worker can call it instead.
pub fn serve_stdin(ordinal: usize) -> ExitCode {
    exit_with_parent();
    let fd = match std::io::stdin().as_fd().try_clone_to_owned() {
        Ok(fd) => fd,
        Err(e) => {
            eprintln!("tensorwire-exec-worker: no socket on standard input: {e}");
            return ExitCode::from(2);
        }
    };
    let channel = Channel::from_fd(fd);
    let device = match GpuDevice::open(ordinal) {
        Ok(device) => device,
        Err(e) => {
            let _ = channel.send(
                &Report::Failed {
                    code: ErrorCode::UNSUPPORTED_DEVICE.0,
                    message: format!("the worker cannot open cuda:{ordinal}: {e}"),
                    fatal: true,
                },
                &[],
            );
            return ExitCode::from(2);
        }
    };
    if channel.send(&Report::Ready, &[]).is_err() {
        return ExitCode::from(2);
    }
    let mut modules: Vec<(String, LoadedModule)> = Vec::new();
    loop {
        let (job, fds) = match channel.recv::<Job>() {
            Ok(Some(received)) => received,
            Ok(None) => return ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("tensorwire-exec-worker: {e}");
                return ExitCode::from(2);
            }
        };
        let report = match run(&device, &mut modules, &job, fds, &channel) {
            Ok(kernel_ns) => Report::Done { kernel_ns },
            Err(failure) => failure,
        };
        let fatal = matches!(report, Report::Failed { fatal: true, .. });
        let sent = channel.send(&report, &[]);
        if fatal || sent.is_err() {
            // The context is lost: leave without unmapping anything through it.
            std::process::exit(3);
        }
    }
}

#[allow(
    unsafe_code,
    reason = "the crate's one unsafe call: launching the peer's kernel is what this process exists for"
)]
fn run(
    device: &Arc<GpuDevice>,
    modules: &mut Vec<(String, LoadedModule)>,
    job: &Job,
    fds: Vec<OwnedFd>,
    channel: &Channel,
) -> Result<u64, Report> {
    let mut fds = fds.into_iter();
    if job.module_attached {
        let fd = fds
            .next()
            .ok_or_else(|| internal("the module's descriptor is missing"))?;
        let mut bytes = Vec::new();
        std::fs::File::from(fd)
            .read_to_end(&mut bytes)
            .map_err(|e| internal(format!("reading the module: {e}")))?;
        let format = module_format_of(job.format)
            .map_err(|e| internal(format!("the job's module format: {e}")))?;
        let loaded = LoadedModule::load(device, &bytes, format).map_err(failed)?;
        modules.retain(|(hash, _)| hash != &job.module);
        if modules.len() >= MAX_MODULES {
            modules.remove(0);
        }
        modules.push((job.module.clone(), loaded));
    }
    let module = modules
        .iter()
        .find(|(hash, _)| hash == &job.module)
        .map(|(_, m)| m)
        .ok_or_else(|| Report::Failed {
            code: ErrorCode::MODULE_NOT_CACHED.0,
            message: "the worker has not loaded this module".into(),
            fatal: false,
        })?;
    module.has_function(&job.function).map_err(failed)?;
    let mut mapped = Vec::with_capacity(job.buffers.len());
    for &(alloc_len, _, _) in &job.buffers {
        let fd = fds
            .next()
            .ok_or_else(|| internal("a buffer's descriptor is missing"))?;
        let memory = ImportedMemory::import_fd(&fd, alloc_len, device, &[])
            .map_err(|e| internal(format!("mapping a tensor: {e}")))?;
        mapped.push(memory);
    }
    let buffer = |i: usize| -> Result<(&ImportedMemory, usize, usize), Report> {
        let (_, offset, len) = *job
            .buffers
            .get(i)
            .ok_or_else(|| internal(format!("buffer {i} does not exist")))?;
        Ok((&mapped[i], offset, len))
    };
    let mut args = Vec::with_capacity(job.args.len());
    for arg in &job.args {
        args.push(match arg {
            JobArg::Buffer(i) => {
                let (memory, offset, len) = buffer(*i)?;
                KernelArg::Buffer {
                    memory,
                    offset,
                    len,
                }
            }
            JobArg::Null => KernelArg::Value(0u64.to_le_bytes().to_vec()),
            JobArg::Value(bytes) => KernelArg::Value(bytes.clone()),
        });
    }
    let zero = job
        .zero
        .iter()
        .map(|&i| buffer(i))
        .collect::<Result<Vec<_>, _>>()?;
    channel
        .send(&Report::Launching, &[])
        .map_err(|e| internal(format!("telling the server: {e}")))?;
    let config = LaunchConfig {
        grid: job.grid,
        block: job.block,
        shared_mem_bytes: job.shared_mem_bytes,
    };
    // SAFETY: this is the worker process (launch's contract): it maps only this job's
    // tensors and no host memory into its context, and it exits on a sticky fault.
    let elapsed = unsafe { launch(module, &job.function, config, &args, &zero) };
    elapsed.map(|d| d.as_nanos() as u64).map_err(failed)
}

/// A worker must not outlive its server: a kernel that never ends would hold the GPU. A
/// thread watches the parent (the parent-death signal would fire when the spawning thread
/// ends, not the server) and ends the process, running kernel and all, once it is gone.
fn exit_with_parent() {
    let parent = rustix::process::getppid();
    let _ = std::thread::Builder::new()
        .name("parent-watch".into())
        .spawn(move || {
            loop {
                std::thread::sleep(std::time::Duration::from_millis(500));
                if rustix::process::getppid() != parent {
                    std::process::exit(4);
                }
            }
        });
}

fn failed(error: KernelError) -> Report {
    match error {
        KernelError::Module(message) => Report::Failed {
            code: ErrorCode::MODULE_INVALID.0,
            message,
            fatal: false,
        },
        KernelError::Fault { message, sticky } => Report::Failed {
            code: ErrorCode::KERNEL_FAULT.0,
            message,
            fatal: sticky,
        },
        KernelError::Device(e) => Report::Failed {
            code: ErrorCode::INTERNAL.0,
            message: e.to_string(),
            fatal: true,
        },
        // A kind this worker does not know: the context may be unusable, so it is replaced.
        other => Report::Failed {
            code: ErrorCode::INTERNAL.0,
            message: other.to_string(),
            fatal: true,
        },
    }
}

fn internal(message: impl Into<String>) -> Report {
    Report::Failed {
        code: ErrorCode::INTERNAL.0,
        message: message.into(),
        fatal: false,
    }
}
