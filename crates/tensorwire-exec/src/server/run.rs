//! One RUN: land the inputs (and module) on the GPU, allocate the outputs, have a worker run
//! the kernel on them, and send the outputs back (spec §14.3, §14.5).

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use crate::message::{ArgSpec, ExecLimits, ExecReply, ExecRole, RequestKind, RunRequest, Timings};
use bytes::Bytes;
use tensorwire_gpu::{
    Allocation, CudaBuffer, DeviceAllocation, GpuSinkFactory, Placement, TensorBuffer,
};
use tensorwire_proto::{DType, Device, ErrorCode, TensorMeta};
use tensorwire_quic::{Connection, IncomingTensor};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use super::Inner;
use super::mailbox::Failure;
use super::modules::CachedModule;
use super::request::ok_reply;
use crate::channel::{Job, JobArg};
use crate::message::module_format_code;
use crate::pool::{Outcome, Submission};
use crate::{hex, sha256};

impl Inner {
    /// Lands the inputs, runs the kernel, sends the outputs back; the reply to send, or the
    /// failure, with the mailbox for refusing what still comes.
    pub(super) async fn run(
        self: &Arc<Self>,
        run: &RunRequest,
        id: u64,
        mut rx: mpsc::UnboundedReceiver<IncomingTensor>,
        reply_to: &Connection,
        started: Instant,
    ) -> Result<
        (ExecReply, mpsc::UnboundedReceiver<IncomingTensor>),
        (Failure, Option<mpsc::UnboundedReceiver<IncomingTensor>>),
    > {
        let gpu = match &self.gpu {
            Ok(gpu) => gpu.clone(),
            Err(reason) => {
                let failure = (
                    ErrorCode::UNSUPPORTED_DEVICE,
                    format!("this server has no GPU to run kernels on ({reason})"),
                );
                return Err((failure, Some(rx)));
            }
        };
        let cached = self
            .modules
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&run.module_sha256);
        if !run.module_attached && cached.is_none() {
            let failure = (
                ErrorCode::MODULE_NOT_CACHED,
                format!(
                    "no module with SHA-256 {}: send the request again with the module",
                    hex(&run.module_sha256)
                ),
            );
            return Err((failure, Some(rx)));
        }
        let landed = match self.land(run, &gpu, &mut rx).await {
            Ok(landed) => landed,
            Err(failure) => return Err((failure, Some(rx))),
        };
        let landing_ns = started.elapsed().as_nanos() as u64;
        let module = match (landed.module, cached) {
            (Some(bytes), _) => {
                self.counters.module_misses.fetch_add(1, Ordering::Relaxed);
                self.counters
                    .module_bytes
                    .fetch_add(bytes.len() as u64, Ordering::Relaxed);
                let module = Arc::new(CachedModule {
                    format: run.module_format,
                    bytes,
                });
                self.modules
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(run.module_sha256, module.clone());
                module
            }
            (None, Some(module)) => {
                self.counters.module_hits.fetch_add(1, Ordering::Relaxed);
                module
            }
            (None, None) => {
                let failure = (ErrorCode::INTERNAL, "the module vanished".to_owned());
                return Err((failure, Some(rx)));
            }
        };
        let outputs = match self.allocate_outputs(run, &gpu).await {
            Ok(outputs) => outputs,
            Err(failure) => return Err((failure, Some(rx))),
        };
        let submission =
            match submission(run, &module, &landed.inputs, &outputs, &self.config.limits) {
                Ok(submission) => submission,
                Err(failure) => return Err((failure, Some(rx))),
            };
        let Some(workers) = &self.workers else {
            let failure = (ErrorCode::UNSUPPORTED_DEVICE, "no workers".to_owned());
            return Err((failure, Some(rx)));
        };
        let kernel_ns = match workers.run(submission).await {
            Outcome::Done { kernel_ns } => kernel_ns,
            Outcome::Failed { code, message } => return Err(((code, message), Some(rx))),
        };
        drop(landed.inputs);
        let egress = Instant::now();
        if let Err(failure) = send_outputs(run, id, outputs, reply_to).await {
            return Err((failure, Some(rx)));
        }
        let egress_ns = egress.elapsed().as_nanos() as u64;
        let cache = if run.module_attached { "miss" } else { "hit" };
        let mut reply = ok_reply(
            RequestKind::Run,
            id,
            vec![("module.cache".into(), cache.into())],
        );
        reply.timings = Timings {
            landing_ns,
            kernel_ns,
            egress_ns,
            total_ns: started.elapsed().as_nanos() as u64,
        };
        Ok((reply, rx))
    }

    /// Admits the request's inputs (and module, if attached) as they arrive and waits until
    /// every byte is resident.
    async fn land(
        self: &Arc<Self>,
        run: &RunRequest,
        gpu: &GpuSinkFactory,
        rx: &mut mpsc::UnboundedReceiver<IncomingTensor>,
    ) -> Result<Landed, Failure> {
        let mut expected_inputs = run.input_count();
        let mut module_expected = run.module_attached;
        let mut seen: Vec<String> = Vec::new();
        let mut landing: JoinSet<Result<Arrived, Failure>> = JoinSet::new();
        let deadline = tokio::time::Instant::now() + self.config.admission_wait;
        let wait = self.config.admission_wait;
        let placement = Placement::Gpu(gpu.clone());
        while expected_inputs > 0 || module_expected {
            let incoming = match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(incoming)) => incoming,
                Ok(None) => return Err((ErrorCode::INTERNAL, "the mailbox closed".into())),
                Err(_) => {
                    return Err((
                        ErrorCode::PROGRESS_TIMEOUT,
                        format!(
                            "{expected_inputs} input(s){} did not arrive within {} s of the \
                             request",
                            if module_expected {
                                " and the module"
                            } else {
                                ""
                            },
                            wait.as_secs()
                        ),
                    ));
                }
            };
            let meta = incoming.meta().clone();
            let role = ExecRole::of(&meta).ok().flatten().map(|(role, _)| role);
            if role == Some(ExecRole::Module) {
                if !module_expected {
                    let why = "the request does not attach a module, or it came twice";
                    incoming.reject(ErrorCode::ARGUMENT_MISMATCH, why);
                    return Err((ErrorCode::ARGUMENT_MISMATCH, why.into()));
                }
                if meta.dtype() != DType::U8 || meta.byte_len() != run.module_len {
                    let why = format!(
                        "the module tensor is {} {:?}; the request says U8 [{}]",
                        meta.dtype(),
                        meta.shape(),
                        run.module_len
                    );
                    incoming.reject(ErrorCode::MODULE_INVALID, why.clone());
                    return Err((ErrorCode::MODULE_INVALID, why));
                }
                module_expected = false;
                let hash = run.module_sha256;
                landing.spawn(async move {
                    let handle = incoming
                        .accept_host()
                        .await
                        .map_err(|e| (e.code, format!("the module: {}", e.message)))?;
                    let (_, bytes) = handle.finished().await.map_err(|e| {
                        (
                            e.code().unwrap_or(ErrorCode::INTERNAL),
                            format!("the module did not arrive: {e}"),
                        )
                    })?;
                    if sha256(&bytes) != hash {
                        return Err((
                            ErrorCode::MODULE_INVALID,
                            format!(
                                "the module's SHA-256 is {}; the request says {}",
                                hex(&sha256(&bytes)),
                                hex(&hash)
                            ),
                        ));
                    }
                    Ok(Arrived::Module(bytes))
                });
                continue;
            }
            if let Err(e) = run.check_input(&meta) {
                incoming.reject(e.code(), e.to_string());
                return Err((e.code(), e.to_string()));
            }
            if seen.iter().any(|n| n == meta.name()) {
                let why = format!("input {} arrived twice", meta.name());
                incoming.reject(ErrorCode::ARGUMENT_MISMATCH, why.clone());
                return Err((ErrorCode::ARGUMENT_MISMATCH, why));
            }
            if matches!(meta.device(), Device::Host) {
                let why = format!(
                    "input {} asks for host memory; kernel inputs land on the GPU",
                    meta.name()
                );
                incoming.reject(ErrorCode::UNSUPPORTED_DEVICE, why.clone());
                return Err((ErrorCode::UNSUPPORTED_DEVICE, why));
            }
            seen.push(meta.name().to_owned());
            expected_inputs -= 1;
            let placement = placement.clone();
            landing.spawn(async move {
                let sink = placement
                    .admit(
                        &meta,
                        incoming.memory_shares(),
                        incoming.host_memory(),
                        wait,
                    )
                    .await;
                let sink = match sink {
                    Ok(sink) => sink,
                    Err(e) => {
                        incoming.reject(e.code, e.message.clone());
                        return Err((e.code, format!("input {}: {}", meta.name(), e.message)));
                    }
                };
                let (_, buffer) = incoming.accept(sink).finished().await.map_err(|e| {
                    (
                        e.code().unwrap_or(ErrorCode::INTERNAL),
                        format!("input {} did not arrive: {e}", meta.name()),
                    )
                })?;
                match buffer {
                    TensorBuffer::Cuda(buffer) => {
                        Ok(Arrived::Input(meta.name().to_owned(), buffer))
                    }
                    TensorBuffer::Host(bytes) if bytes.is_empty() => {
                        Ok(Arrived::Empty(meta.name().to_owned()))
                    }
                    TensorBuffer::Host(_) => Err((
                        ErrorCode::INTERNAL,
                        format!("input {} landed in host memory", meta.name()),
                    )),
                }
            });
        }
        let mut landed = Landed {
            inputs: HashMap::new(),
            module: None,
        };
        while let Some(arrived) = landing.join_next().await {
            let arrived =
                arrived.map_err(|e| (ErrorCode::INTERNAL, format!("landing failed: {e}")))??;
            match arrived {
                Arrived::Input(name, buffer) => {
                    landed.inputs.insert(name, Some(buffer));
                }
                Arrived::Empty(name) => {
                    landed.inputs.insert(name, None);
                }
                Arrived::Module(bytes) => landed.module = Some(bytes),
            }
        }
        Ok(landed)
    }

    /// Zero-filled output buffers in exportable memory, admitted against the device budget.
    async fn allocate_outputs(
        &self,
        run: &RunRequest,
        gpu: &GpuSinkFactory,
    ) -> Result<Vec<Option<CudaBuffer>>, Failure> {
        let mut outputs = Vec::new();
        for arg in &run.args {
            let ArgSpec::Output { name, .. } = arg else {
                continue;
            };
            let len = arg.byte_len().unwrap_or(u64::MAX);
            if len == 0 {
                outputs.push(None);
                continue;
            }
            let reservation =
                tokio::time::timeout(self.config.admission_wait, gpu.memory_budget().reserve(len))
                    .await
                    .map_err(|_| {
                        (
                            ErrorCode::RESOURCE_EXHAUSTED,
                            format!("no device memory for output {name} ({len} bytes) in time"),
                        )
                    })?
                    .map_err(|e| (e.code, format!("output {name}: {}", e.message)))?;
            let len = usize::try_from(len)
                .map_err(|_| (ErrorCode::TENSOR_TOO_LARGE, format!("output {name}")))?;
            let memory = DeviceAllocation::new_vmm(gpu.device(), len)
                .map_err(|e| (ErrorCode::RESOURCE_EXHAUSTED, format!("output {name}: {e}")))?;
            let buffer = CudaBuffer::from_owned(memory, len)
                .with_reservation(reservation)
                .map_err(|e| (ErrorCode::INTERNAL, format!("output {name}: {e}")))?;
            outputs.push(Some(buffer));
        }
        Ok(outputs)
    }
}

enum Arrived {
    Input(String, CudaBuffer),
    Empty(String),
    Module(Bytes),
}

struct Landed {
    /// Each input by name; `None` for a zero-byte one.
    inputs: HashMap<String, Option<CudaBuffer>>,
    module: Option<Bytes>,
}

/// The worker's job for `run`: each input and output exported, scalars by value.
fn submission(
    run: &RunRequest,
    module: &CachedModule,
    inputs: &HashMap<String, Option<CudaBuffer>>,
    outputs: &[Option<CudaBuffer>],
    limits: &ExecLimits,
) -> Result<Submission, Failure> {
    let mut buffers = Vec::new();
    let mut buffer_fds: Vec<OwnedFd> = Vec::new();
    let mut args = Vec::with_capacity(run.args.len());
    let mut zero = Vec::new();
    let mut outputs = outputs.iter();
    let mut export = |buffer: &CudaBuffer| -> Result<usize, Failure> {
        let allocation = buffer.allocation();
        let fd = allocation
            .export_fd()
            .and_then(|fd| {
                fd.as_fd()
                    .try_clone_to_owned()
                    .map_err(|e| tensorwire_gpu::GpuError::NotExportable(e.to_string()))
            })
            .map_err(|e| (ErrorCode::INTERNAL, format!("exporting a tensor: {e}")))?;
        let offset = (buffer.device_ptr() - allocation.device_ptr()) as usize;
        buffers.push((allocation.len(), offset, buffer.len()));
        buffer_fds.push(fd);
        Ok(buffers.len() - 1)
    };
    for arg in &run.args {
        match arg {
            ArgSpec::Input { name, .. } => match inputs.get(name) {
                Some(Some(buffer)) => args.push(JobArg::Buffer(export(buffer)?)),
                Some(None) => args.push(JobArg::Null),
                None => {
                    return Err((
                        ErrorCode::INTERNAL,
                        format!("input {name} is missing after landing"),
                    ));
                }
            },
            ArgSpec::Output { .. } => match outputs.next() {
                Some(Some(buffer)) => {
                    let i = export(buffer)?;
                    zero.push(i);
                    args.push(JobArg::Buffer(i));
                }
                _ => args.push(JobArg::Null),
            },
            ArgSpec::Scalar { value, .. } => args.push(JobArg::Value(value.clone())),
        }
    }
    let launch = &run.launch;
    Ok(Submission {
        job: Job {
            module: hex(&run.module_sha256),
            module_attached: false,
            format: module_format_code(module.format),
            function: run.function.clone(),
            grid: launch.grid,
            block: launch.block,
            shared_mem_bytes: launch.shared_mem_bytes,
            buffers,
            args,
            zero,
        },
        module_bytes: module.bytes.clone(),
        buffer_fds,
        time_limit: Duration::from_millis(u64::from(run.effective_time_limit_ms(limits))),
    })
}

/// Copies each output to the host and sends it back, tagged; waits for every COMPLETE.
async fn send_outputs(
    run: &RunRequest,
    id: u64,
    outputs: Vec<Option<CudaBuffer>>,
    to: &Connection,
) -> Result<(), Failure> {
    let mut sends = Vec::new();
    let mut outputs = outputs.into_iter();
    for arg in &run.args {
        let ArgSpec::Output { name, dtype, shape } = arg else {
            continue;
        };
        let bytes = match outputs.next().flatten() {
            Some(buffer) => tokio::task::spawn_blocking(move || buffer.copy_to_host())
                .await
                .map_err(|e| (ErrorCode::INTERNAL, e.to_string()))?
                .map_err(|e| (ErrorCode::SINK_FAILED, format!("output {name}: {e}")))?,
            None => Vec::new(),
        };
        let meta = TensorMeta::new(shape.clone(), *dtype)
            .map_err(|e| (e.code(), e.to_string()))?
            .with_name(name.clone());
        let meta = ExecRole::Output.tag(meta, id);
        sends.push((name.clone(), to.send(meta, Bytes::from(bytes))));
    }
    for (name, send) in sends {
        send.finished().await.map_err(|e| {
            (
                e.code().unwrap_or(ErrorCode::INTERNAL),
                format!("output {name} was not delivered: {e}"),
            )
        })?;
    }
    Ok(())
}
