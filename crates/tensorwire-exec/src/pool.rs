//! Worker processes, seen from the server: started ahead of need, one job at a time each,
//! stopped when a kernel overruns, replaced when one dies (spec §14.5).

use std::collections::HashSet;
use std::ffi::OsString;
use std::io::{Seek, SeekFrom, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use tensorwire_proto::ErrorCode;
use tokio::sync::Semaphore;

use crate::channel::{Channel, Job, Report};

/// How long a worker may take to open its device, or to load a module (PTX is compiled
/// then) and map a job's tensors, before it is stopped.
const SETUP_TIMEOUT: Duration = Duration::from_secs(60);

/// The program the server starts as a worker, and its arguments (`--device N` is added).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerCommand {
    /// The executable.
    pub program: PathBuf,
    /// Arguments before `--device N`.
    pub args: Vec<OsString>,
}

impl WorkerCommand {
    /// `program` with no arguments of its own.
    pub fn new(program: impl Into<PathBuf>) -> Self {
        Self {
            program: program.into(),
            args: Vec::new(),
        }
    }

    /// `tensorwire-exec-worker` in the running program's directory (where `cargo build` and
    /// an install put it beside `receiver`).
    pub fn beside_current_exe() -> std::io::Result<Self> {
        let exe = std::env::current_exe()?;
        let dir = exe
            .parent()
            .ok_or_else(|| std::io::Error::other("the running program has no directory"))?;
        Ok(Self::new(dir.join("tensorwire-exec-worker")))
    }
}

/// How a job ended.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// The kernel ran; its time between CUDA events.
    Done { kernel_ns: u64 },
    /// It did not, with the code and reason for the client.
    Failed { code: ErrorCode, message: String },
}

/// A job and what it needs that the worker may not have.
pub(crate) struct Submission {
    pub(crate) job: Job,
    /// The module's bytes, sent only to a worker that has not loaded them.
    pub(crate) module_bytes: Bytes,
    /// One descriptor per `job.buffers` entry.
    pub(crate) buffer_fds: Vec<OwnedFd>,
    /// How long the kernel may run.
    pub(crate) time_limit: Duration,
}

struct Worker {
    child: Child,
    channel: Channel,
    /// Modules (hex SHA-256) this worker has loaded.
    modules: HashSet<String>,
}

/// Counters of the pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkerStats {
    /// Worker processes the pool runs at most.
    pub workers: usize,
    /// Started and waiting for work now.
    pub idle: usize,
    /// Workers stopped or lost (a fault, an overrun) and replaced.
    pub replaced: u64,
}

pub(crate) struct WorkerPool {
    command: WorkerCommand,
    ordinal: usize,
    size: usize,
    idle: Mutex<Vec<Worker>>,
    slots: Semaphore,
    replaced: AtomicU64,
}

impl WorkerPool {
    /// A pool of `size` workers for device `ordinal`, started in the background.
    pub(crate) fn start(command: WorkerCommand, ordinal: usize, size: usize) -> Arc<Self> {
        let pool = Arc::new(Self {
            command,
            ordinal,
            size,
            idle: Mutex::new(Vec::new()),
            slots: Semaphore::new(size),
            replaced: AtomicU64::new(0),
        });
        for _ in 0..size {
            pool.clone().start_one_in_background();
        }
        pool
    }

    pub(crate) fn stats(&self) -> WorkerStats {
        WorkerStats {
            workers: self.size,
            idle: self.idle().len(),
            replaced: self.replaced.load(Ordering::Relaxed),
        }
    }

    fn idle(&self) -> std::sync::MutexGuard<'_, Vec<Worker>> {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn start_one_in_background(self: Arc<Self>) {
        std::thread::spawn(move || match self.spawn() {
            Ok(worker) => self.idle().push(worker),
            Err(e) => tracing::error!("remote execution: {e}"),
        });
    }

    /// Starts a worker and waits until it has opened its device.
    fn spawn(&self) -> Result<Worker, String> {
        let (ours, theirs) =
            Channel::pair().map_err(|e| format!("cannot make a worker socket: {e}"))?;
        let mut child = Command::new(&self.command.program)
            .args(&self.command.args)
            .arg("--device")
            .arg(self.ordinal.to_string())
            .stdin(Stdio::from(theirs.into_fd()))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| {
                format!(
                    "cannot start the worker {}: {e}",
                    self.command.program.display()
                )
            })?;
        match recv_within(&ours, SETUP_TIMEOUT) {
            Ok(Some(Report::Ready)) => Ok(Worker {
                child,
                channel: ours,
                modules: HashSet::new(),
            }),
            Ok(Some(Report::Failed { message, .. })) => {
                let _ = child.wait();
                Err(message)
            }
            other => {
                let _ = child.kill();
                let status = child.wait();
                Err(format!(
                    "the worker {} did not start ({other:?}, {status:?})",
                    self.command.program.display()
                ))
            }
        }
    }

    /// Runs `submission` on a worker, waiting for one to be free.
    pub(crate) async fn run(self: &Arc<Self>, submission: Submission) -> Outcome {
        let Ok(_slot) = self.slots.acquire().await else {
            return failed(ErrorCode::SHUTDOWN, "the server is shutting down");
        };
        let pool = self.clone();
        let ran = tokio::task::spawn_blocking(move || pool.run_blocking(submission)).await;
        ran.unwrap_or_else(|e| failed(ErrorCode::INTERNAL, format!("the job's thread failed: {e}")))
    }

    fn run_blocking(self: Arc<Self>, submission: Submission) -> Outcome {
        let taken = self.idle().pop();
        let mut worker = match taken {
            Some(worker) => worker,
            None => match self.spawn() {
                Ok(worker) => worker,
                Err(e) => return failed(ErrorCode::INTERNAL, e),
            },
        };
        let Submission {
            mut job,
            module_bytes,
            buffer_fds,
            time_limit,
        } = submission;
        job.module_attached = !worker.modules.contains(&job.module);
        let module_fd = if job.module_attached {
            match memfd_with(&module_bytes) {
                Ok(fd) => Some(fd),
                Err(e) => {
                    self.idle().push(worker);
                    return failed(ErrorCode::INTERNAL, format!("module memfd: {e}"));
                }
            }
        } else {
            None
        };
        let fds: Vec<_> = module_fd
            .iter()
            .chain(&buffer_fds)
            .map(AsFd::as_fd)
            .collect();
        let function = job.function.clone();
        if let Err(e) = worker.channel.send(&job, &fds) {
            return self.lose(worker, ErrorCode::INTERNAL, format!("sending the job: {e}"));
        }
        let module = job.module.clone();
        // Setup (module load, mappings) has its own limit; the kernel's starts at Launching.
        match recv_within(&worker.channel, SETUP_TIMEOUT) {
            Ok(Some(Report::Launching)) => {
                worker.modules.insert(module);
            }
            Ok(Some(Report::Failed {
                code,
                message,
                fatal,
            })) => return self.after_failure(worker, ErrorCode(code), message, fatal),
            Ok(None) => return self.died(worker, &function),
            Ok(Some(other)) => {
                return self.lose(
                    worker,
                    ErrorCode::INTERNAL,
                    format!("the worker sent {other:?} before launching"),
                );
            }
            Err(Waited::Timeout) => {
                return self.stop(
                    worker,
                    ErrorCode::INTERNAL,
                    format!(
                        "the worker took over {} s to load the module and map the tensors",
                        SETUP_TIMEOUT.as_secs()
                    ),
                );
            }
            Err(Waited::Io(e)) => return self.lose(worker, ErrorCode::INTERNAL, e),
        }
        match recv_within(&worker.channel, time_limit) {
            Ok(Some(Report::Done { kernel_ns })) => {
                self.idle().push(worker);
                Outcome::Done { kernel_ns }
            }
            Ok(Some(Report::Failed {
                code,
                message,
                fatal,
            })) => self.after_failure(worker, ErrorCode(code), message, fatal),
            Ok(None) => self.died(worker, &function),
            Ok(Some(other)) => self.lose(
                worker,
                ErrorCode::INTERNAL,
                format!("the worker sent {other:?} instead of a result"),
            ),
            Err(Waited::Timeout) => self.stop(
                worker,
                ErrorCode::RUN_TIME_EXCEEDED,
                format!(
                    "{function} ran past its time limit of {} ms; its worker was stopped",
                    time_limit.as_millis()
                ),
            ),
            Err(Waited::Io(e)) => self.lose(worker, ErrorCode::INTERNAL, e),
        }
    }

    fn after_failure(
        self: &Arc<Self>,
        worker: Worker,
        code: ErrorCode,
        message: String,
        fatal: bool,
    ) -> Outcome {
        if fatal {
            return self.lose(worker, code, message);
        }
        self.idle().push(worker);
        failed(code, message)
    }

    /// The worker went away without a word: a crash.
    fn died(self: &Arc<Self>, mut worker: Worker, function: &str) -> Outcome {
        let status = worker.child.wait();
        let how = match status {
            Ok(status) => status.to_string(),
            Err(e) => e.to_string(),
        };
        self.replace();
        failed(
            ErrorCode::KERNEL_FAULT,
            format!("{function}: the worker died ({how})"),
        )
    }

    /// Kills the worker (it overran, or hangs) and replaces it.
    fn stop(self: &Arc<Self>, mut worker: Worker, code: ErrorCode, message: String) -> Outcome {
        let _ = worker.child.kill();
        let _ = worker.child.wait();
        self.replace();
        failed(code, message)
    }

    /// The worker is unusable (it said so, or the channel broke): it goes, a new one comes.
    fn lose(self: &Arc<Self>, worker: Worker, code: ErrorCode, message: String) -> Outcome {
        self.stop(worker, code, message)
    }

    fn replace(self: &Arc<Self>) {
        self.replaced.fetch_add(1, Ordering::Relaxed);
        self.clone().start_one_in_background();
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        for mut worker in self.idle().drain(..) {
            // Closing the socket ends the worker's loop; kill in case it is stuck.
            drop(worker.channel);
            let _ = worker.child.kill();
            let _ = worker.child.wait();
        }
    }
}

fn failed(code: ErrorCode, message: impl Into<String>) -> Outcome {
    Outcome::Failed {
        code,
        message: message.into(),
    }
}

#[derive(Debug)]
enum Waited {
    Timeout,
    Io(String),
}

/// Waits up to `timeout` for the worker's next report; `Ok(None)` if it closed the socket.
fn recv_within(channel: &Channel, timeout: Duration) -> Result<Option<Report>, Waited> {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(Waited::Timeout);
        }
        let wait = Timespec {
            tv_sec: left.as_secs() as i64,
            tv_nsec: i64::from(left.subsec_nanos()),
        };
        let fd = channel.as_fd();
        let mut fds = [PollFd::new(&fd, PollFlags::IN)];
        match poll(&mut fds, Some(&wait)) {
            Ok(0) => continue,
            Ok(_) => break,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(Waited::Io(format!("waiting for the worker: {e}"))),
        }
    }
    channel
        .recv::<Report>()
        .map(|r| r.map(|(report, _)| report))
        .map_err(|e| Waited::Io(format!("reading the worker: {e}")))
}

/// A memfd holding `bytes`, positioned at its start.
fn memfd_with(bytes: &[u8]) -> std::io::Result<OwnedFd> {
    let fd = rustix::fs::memfd_create("tensorwire-module", rustix::fs::MemfdFlags::CLOEXEC)?;
    let mut file = std::fs::File::from(fd);
    file.write_all(bytes)?;
    file.seek(SeekFrom::Start(0))?;
    Ok(file.into())
}
