//! Remote execution messages (spec §14): requests to run a kernel (or to describe the server)
//! and their replies, carried as the bytes of ordinary U8 tensors, with the limits a server
//! checks before it waits for or allocates anything a request announces.
//!
//! Which tensor is which travels in two attributes ([`ROLE_ATTRIBUTE`], [`ID_ATTRIBUTE`]);
//! [`ExecRole::of`] reads them. Everything here is pure: no IO, no clock, no GPU.

use std::fmt;

pub use tensorwire_gpu::ModuleFormat;
use tensorwire_proto::frame::wire::{Reader, truncate_reason};
use tensorwire_proto::{DType, ErrorCode, MAX_REASON_LEN, ProtocolError, TensorMeta};

/// The version byte that starts every request and reply (spec §14.2).
pub const EXEC_VERSION: u8 = 1;
/// The attribute naming a tensor's part in remote execution (spec §14.1).
pub const ROLE_ATTRIBUTE: &str = "tensorwire.exec.role";
/// The attribute carrying the request id a tensor belongs to, in decimal (spec §14.1).
pub const ID_ATTRIBUTE: &str = "tensorwire.exec.id";

/// The attribute carrying a client's access token, for servers that admit by token (spec
/// §14.6).
pub const TOKEN_ATTRIBUTE: &str = "tensorwire.exec.token";
/// Bytes of a run request before its function name and arguments (spec §14.2).
pub const RUN_FIXED_LEN: usize = 88;
/// Bytes of a reply before its message and attributes (spec §14.3).
pub const REPLY_FIXED_LEN: usize = 50;

/// What part a tensor plays in remote execution (spec §14.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExecRole {
    /// Client → server: an encoded [`ExecRequest`].
    Request,
    /// Client → server: the module's bytes, when the request says they are attached.
    Module,
    /// Client → server: an input argument, named as the request names it.
    Input,
    /// Server → client: an output argument, named as the request names it.
    Output,
    /// Server → client: an encoded [`ExecReply`].
    Reply,
}

impl ExecRole {
    /// The attribute value of this role.
    pub fn as_str(self) -> &'static str {
        match self {
            ExecRole::Request => "request",
            ExecRole::Module => "module",
            ExecRole::Input => "input",
            ExecRole::Output => "output",
            ExecRole::Reply => "reply",
        }
    }

    /// The role and request id `meta` carries: `Ok(None)` for an ordinary tensor; an unknown
    /// role or a missing or non-decimal id is EXEC_MALFORMED.
    pub fn of(meta: &TensorMeta) -> Result<Option<(ExecRole, u64)>, ProtocolError> {
        let Some(role) = meta.attribute(ROLE_ATTRIBUTE) else {
            return Ok(None);
        };
        let role = match role {
            "request" => ExecRole::Request,
            "module" => ExecRole::Module,
            "input" => ExecRole::Input,
            "output" => ExecRole::Output,
            "reply" => ExecRole::Reply,
            other => {
                return Err(ProtocolError::malformed(
                    ErrorCode::EXEC_MALFORMED,
                    format!("{ROLE_ATTRIBUTE} {other:?} is not a role of spec §14.1"),
                ));
            }
        };
        let id = meta
            .attribute(ID_ATTRIBUTE)
            .and_then(|id| id.parse::<u64>().ok())
            .ok_or_else(|| {
                ProtocolError::malformed(
                    ErrorCode::EXEC_MALFORMED,
                    format!(
                        "{} has {ROLE_ATTRIBUTE} but no decimal {ID_ATTRIBUTE}",
                        meta.name()
                    ),
                )
            })?;
        Ok(Some((role, id)))
    }

    /// `meta` tagged with this role and request `id`.
    pub fn tag(self, meta: TensorMeta, id: u64) -> TensorMeta {
        meta.with_attribute(ROLE_ATTRIBUTE, self.as_str())
            .with_attribute(ID_ATTRIBUTE, id.to_string())
    }
}

impl fmt::Display for ExecRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a request asks for (spec §14.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RequestKind {
    /// Run a kernel.
    Run,
    /// Describe the server and its GPU.
    Info,
    /// Say whether the server can run kernels now.
    Health,
}

impl RequestKind {
    /// The wire code.
    pub fn code(self) -> u8 {
        match self {
            RequestKind::Run => 1,
            RequestKind::Info => 2,
            RequestKind::Health => 3,
        }
    }

    fn from_code(code: u8) -> Result<Self, ProtocolError> {
        match code {
            1 => Ok(RequestKind::Run),
            2 => Ok(RequestKind::Info),
            3 => Ok(RequestKind::Health),
            other => Err(malformed(format!("request kind {other} is not 1, 2 or 3"))),
        }
    }
}

impl fmt::Display for RequestKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RequestKind::Run => "run",
            RequestKind::Info => "info",
            RequestKind::Health => "health",
        })
    }
}

/// A module format's wire code (spec §14.2).
pub(crate) fn module_format_code(format: ModuleFormat) -> u8 {
    match format {
        ModuleFormat::Ptx => 1,
        ModuleFormat::Cubin => 2,
        ModuleFormat::Fatbin => 3,
    }
}

/// The module format of a wire code; EXEC_MALFORMED for any other (spec §14.2).
pub(crate) fn module_format_of(code: u8) -> Result<ModuleFormat, ProtocolError> {
    match code {
        1 => Ok(ModuleFormat::Ptx),
        2 => Ok(ModuleFormat::Cubin),
        3 => Ok(ModuleFormat::Fatbin),
        other => Err(malformed(format!("module format {other} is not 1, 2 or 3"))),
    }
}

/// Grid, block and dynamic shared memory of a kernel launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LaunchShape {
    /// Blocks in x, y, z.
    pub grid: [u32; 3],
    /// Threads per block in x, y, z.
    pub block: [u32; 3],
    /// Dynamic shared memory per block, in bytes.
    pub shared_mem_bytes: u32,
}

/// One kernel argument, in the kernel's parameter order (spec §14.2).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ArgSpec {
    /// A tensor the client sends; the kernel gets a pointer to it in device memory.
    Input {
        /// The input tensor's name.
        name: String,
        /// Its element type.
        dtype: DType,
        /// Its shape.
        shape: Vec<u64>,
    },
    /// A tensor the server allocates (zeroed) and sends back; the kernel gets a pointer.
    Output {
        /// The output tensor's name.
        name: String,
        /// Its element type.
        dtype: DType,
        /// Its shape.
        shape: Vec<u64>,
    },
    /// A value passed to the kernel by value.
    Scalar {
        /// The scalar's name, for messages.
        name: String,
        /// Its type; `value` holds exactly its size in bytes, little-endian.
        dtype: DType,
        /// Its bytes.
        value: Vec<u8>,
    },
}

impl ArgSpec {
    /// The argument's name.
    pub fn name(&self) -> &str {
        match self {
            ArgSpec::Input { name, .. }
            | ArgSpec::Output { name, .. }
            | ArgSpec::Scalar { name, .. } => name,
        }
    }

    /// Bytes of the tensor, for inputs and outputs (`None` for scalars or on overflow).
    pub fn byte_len(&self) -> Option<u64> {
        match self {
            ArgSpec::Input { dtype, shape, .. } | ArgSpec::Output { dtype, shape, .. } => shape
                .iter()
                .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d)),
            ArgSpec::Scalar { .. } => None,
        }
    }

    fn kind_code(&self) -> u8 {
        match self {
            ArgSpec::Input { .. } => 1,
            ArgSpec::Output { .. } => 2,
            ArgSpec::Scalar { .. } => 3,
        }
    }
}

/// A request to run one kernel (spec §14.2).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunRequest {
    /// SHA-256 of the module's bytes: the server's cache key.
    pub module_sha256: [u8; 32],
    /// How to load the module.
    pub module_format: ModuleFormat,
    /// The module's length in bytes.
    pub module_len: u64,
    /// Whether a module tensor with the same id carries the bytes.
    pub module_attached: bool,
    /// The kernel's (unmangled or `extern "C"`) name in the module.
    pub function: String,
    /// Grid, block and shared memory.
    pub launch: LaunchShape,
    /// Longest the kernel may run, in ms; 0 asks for the server's default.
    pub time_limit_ms: u32,
    /// The kernel's parameters, in order.
    pub args: Vec<ArgSpec>,
}

/// What a request carries besides its id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RequestBody {
    /// Run a kernel.
    Run(RunRequest),
    /// Describe the server.
    Info,
    /// Report health.
    Health,
}

/// An execution request, the bytes of a tensor with role `request` (spec §14.2).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecRequest {
    /// Chosen by the client, unique among its unanswered requests on the connection.
    pub id: u64,
    /// What is asked.
    pub body: RequestBody,
}

/// The receiving side's limits on requests (spec §14.4). Each has its own wire code.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ExecLimits {
    /// Largest encoded request, in bytes (EXEC_MALFORMED past it).
    pub max_request_len: u64,
    /// Largest module (MODULE_TOO_LARGE).
    pub max_module_len: u64,
    /// Most arguments (TOO_MANY_ARGUMENTS).
    pub max_args: u16,
    /// Longest function or argument name (EXEC_MALFORMED).
    pub max_name_len: u16,
    /// Most dimensions of an argument tensor (EXEC_MALFORMED).
    pub max_dims: u8,
    /// Largest grid per dimension (LAUNCH_TOO_LARGE).
    pub max_grid: [u32; 3],
    /// Largest block per dimension (LAUNCH_TOO_LARGE).
    pub max_block: [u32; 3],
    /// Most threads per block (LAUNCH_TOO_LARGE).
    pub max_threads_per_block: u32,
    /// Most dynamic shared memory per block (LAUNCH_TOO_LARGE).
    pub max_shared_mem_bytes: u32,
    /// Longest a kernel may run, in ms (RUN_TIME_EXCEEDED for a request asking more).
    pub max_time_limit_ms: u32,
    /// Run time of a request that asks for none (0).
    pub default_time_limit_ms: u32,
    /// Most bytes of inputs and outputs of one request together (TENSOR_TOO_LARGE).
    pub max_tensor_bytes: u64,
}

impl Default for ExecLimits {
    /// The reference server's defaults (spec §14.4).
    fn default() -> Self {
        Self {
            max_request_len: 64 * 1024,
            max_module_len: 64 << 20,
            max_args: 64,
            max_name_len: 1024,
            max_dims: 32,
            // CUDA's own launch limits on every current GPU.
            max_grid: [i32::MAX as u32, 65_535, 65_535],
            max_block: [1024, 1024, 64],
            max_threads_per_block: 1024,
            max_shared_mem_bytes: 227 * 1024,
            max_time_limit_ms: 10_000,
            default_time_limit_ms: 10_000,
            max_tensor_bytes: 16 << 30,
        }
    }
}

impl ExecRequest {
    /// The request's kind.
    pub fn kind(&self) -> RequestKind {
        match self.body {
            RequestBody::Run(_) => RequestKind::Run,
            RequestBody::Info => RequestKind::Info,
            RequestBody::Health => RequestKind::Health,
        }
    }

    /// The canonical bytes of this request.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(128);
        out.push(EXEC_VERSION);
        out.push(self.kind().code());
        out.extend_from_slice(&self.id.to_le_bytes());
        let RequestBody::Run(run) = &self.body else {
            return out;
        };
        out.extend_from_slice(&run.module_sha256);
        out.push(module_format_code(run.module_format));
        out.push(u8::from(run.module_attached));
        out.extend_from_slice(&run.module_len.to_le_bytes());
        for v in run.launch.grid.iter().chain(&run.launch.block) {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&run.launch.shared_mem_bytes.to_le_bytes());
        out.extend_from_slice(&run.time_limit_ms.to_le_bytes());
        put_len16(&mut out, run.function.len());
        put_len16(&mut out, run.args.len());
        out.extend_from_slice(run.function.as_bytes());
        for arg in &run.args {
            out.push(arg.kind_code());
            match arg {
                ArgSpec::Input { name, dtype, shape } | ArgSpec::Output { name, dtype, shape } => {
                    out.push(dtype.code());
                    put_len16(&mut out, name.len());
                    out.push(u8::try_from(shape.len()).unwrap_or(u8::MAX));
                    out.extend_from_slice(name.as_bytes());
                    for d in shape {
                        out.extend_from_slice(&d.to_le_bytes());
                    }
                }
                ArgSpec::Scalar { name, dtype, value } => {
                    out.push(dtype.code());
                    put_len16(&mut out, name.len());
                    out.push(0);
                    out.extend_from_slice(name.as_bytes());
                    out.extend_from_slice(value);
                }
            }
        }
        out
    }

    /// Decodes a request, checking every length against `limits` before reading what it
    /// announces, and a run request's launch against them too ([`RunRequest::check`]).
    pub fn decode(bytes: &[u8], limits: &ExecLimits) -> Result<Self, ProtocolError> {
        if bytes.len() as u64 > limits.max_request_len {
            return Err(ProtocolError::LimitExceeded {
                code: ErrorCode::EXEC_MALFORMED,
                what: "request length",
                value: bytes.len() as u64,
                limit: limits.max_request_len,
            });
        }
        let mut r = Reader::message(bytes, ErrorCode::EXEC_MALFORMED, "remote-execution message");
        let version = r.u8()?;
        if version != EXEC_VERSION {
            return Err(malformed(format!(
                "request version {version}; this server speaks {EXEC_VERSION}"
            )));
        }
        let kind = RequestKind::from_code(r.u8()?)?;
        let id = r.u64()?;
        let body = match kind {
            RequestKind::Info => RequestBody::Info,
            RequestKind::Health => RequestBody::Health,
            RequestKind::Run => RequestBody::Run(decode_run(&mut r, limits)?),
        };
        r.finish()?;
        let request = ExecRequest { id, body };
        if let RequestBody::Run(run) = &request.body {
            run.check(limits)?;
        }
        Ok(request)
    }
}

fn decode_run(r: &mut Reader<'_>, limits: &ExecLimits) -> Result<RunRequest, ProtocolError> {
    let module_sha256 = r.array::<32>()?;
    let module_format = module_format_of(r.u8()?)?;
    let module_attached = match r.u8()? {
        0 => false,
        1 => true,
        other => return Err(malformed(format!("module_attached is {other}, not 0 or 1"))),
    };
    let module_len = r.u64()?;
    let mut grid = [0u32; 3];
    let mut block = [0u32; 3];
    for v in grid.iter_mut().chain(block.iter_mut()) {
        *v = r.u32()?;
    }
    let shared_mem_bytes = r.u32()?;
    let time_limit_ms = r.u32()?;
    let function_len = r.u16()?;
    let arg_count = r.u16()?;
    // Every count of the fixed part is judged before anything it announces is read.
    if module_len > limits.max_module_len {
        return Err(ProtocolError::LimitExceeded {
            code: ErrorCode::MODULE_TOO_LARGE,
            what: "module length",
            value: module_len,
            limit: limits.max_module_len,
        });
    }
    if arg_count > limits.max_args {
        return Err(ProtocolError::LimitExceeded {
            code: ErrorCode::TOO_MANY_ARGUMENTS,
            what: "argument count",
            value: u64::from(arg_count),
            limit: u64::from(limits.max_args),
        });
    }
    check_name_len("function name", function_len, limits)?;
    let function = r.string(usize::from(function_len))?;
    let mut args = Vec::with_capacity(usize::from(arg_count));
    for _ in 0..arg_count {
        let kind = r.u8()?;
        let dtype_code = r.u8()?;
        let dtype = DType::from_code(dtype_code).ok_or_else(|| {
            ProtocolError::malformed(
                ErrorCode::UNKNOWN_DTYPE,
                format!("argument dtype {dtype_code} is not in spec §5.1"),
            )
        })?;
        let name_len = r.u16()?;
        let ndim = r.u8()?;
        check_name_len("argument name", name_len, limits)?;
        let name = r.string(usize::from(name_len))?;
        let arg = match kind {
            1 | 2 => {
                if ndim > limits.max_dims {
                    return Err(ProtocolError::LimitExceeded {
                        code: ErrorCode::EXEC_MALFORMED,
                        what: "argument dimensions",
                        value: u64::from(ndim),
                        limit: u64::from(limits.max_dims),
                    });
                }
                let shape = (0..ndim).map(|_| r.u64()).collect::<Result<Vec<_>, _>>()?;
                if kind == 1 {
                    ArgSpec::Input { name, dtype, shape }
                } else {
                    ArgSpec::Output { name, dtype, shape }
                }
            }
            3 => {
                if ndim != 0 {
                    return Err(malformed(format!("scalar {name} has ndim {ndim}, not 0")));
                }
                let value = r.bytes(dtype.size() as usize)?.to_vec();
                ArgSpec::Scalar { name, dtype, value }
            }
            other => return Err(malformed(format!("argument kind {other} is not 1, 2 or 3"))),
        };
        args.push(arg);
    }
    Ok(RunRequest {
        module_sha256,
        module_format,
        module_len,
        module_attached,
        function,
        launch: LaunchShape {
            grid,
            block,
            shared_mem_bytes,
        },
        time_limit_ms,
        args,
    })
}

impl RunRequest {
    /// Checks the launch, the time limit and the arguments against `limits` (spec §14.4):
    /// LAUNCH_TOO_LARGE, RUN_TIME_EXCEEDED, TOO_MANY_ARGUMENTS, TENSOR_TOO_LARGE,
    /// ARGUMENT_MISMATCH (empty or duplicate names, zero launch dimensions) and
    /// MODULE_TOO_LARGE, each naming the value and the limit.
    pub fn check(&self, limits: &ExecLimits) -> Result<(), ProtocolError> {
        if self.module_len > limits.max_module_len {
            return Err(ProtocolError::LimitExceeded {
                code: ErrorCode::MODULE_TOO_LARGE,
                what: "module length",
                value: self.module_len,
                limit: limits.max_module_len,
            });
        }
        if self.args.len() > usize::from(limits.max_args) {
            return Err(ProtocolError::LimitExceeded {
                code: ErrorCode::TOO_MANY_ARGUMENTS,
                what: "argument count",
                value: self.args.len() as u64,
                limit: u64::from(limits.max_args),
            });
        }
        check_name_len("function name", clamp16(self.function.len()), limits)?;
        for arg in &self.args {
            check_name_len("argument name", clamp16(arg.name().len()), limits)?;
        }
        let launch = &self.launch;
        const AXES: [(&str, &str, &str); 3] = [
            ("x", "grid x", "block x"),
            ("y", "grid y", "block y"),
            ("z", "grid z", "block z"),
        ];
        for (i, (axis, grid, block)) in AXES.into_iter().enumerate() {
            let (g, b) = (launch.grid[i], launch.block[i]);
            if g == 0 || b == 0 {
                return Err(ProtocolError::violation(
                    ErrorCode::LAUNCH_TOO_LARGE,
                    format!("grid {g} × block {b} in {axis}: every dimension must be at least 1"),
                ));
            }
            if g > limits.max_grid[i] {
                return Err(too_large(grid, u64::from(g), u64::from(limits.max_grid[i])));
            }
            if b > limits.max_block[i] {
                return Err(too_large(
                    block,
                    u64::from(b),
                    u64::from(limits.max_block[i]),
                ));
            }
        }
        let threads: u64 = launch.block.iter().map(|&b| u64::from(b)).product();
        if threads > u64::from(limits.max_threads_per_block) {
            return Err(too_large(
                "threads per block",
                threads,
                u64::from(limits.max_threads_per_block),
            ));
        }
        if launch.shared_mem_bytes > limits.max_shared_mem_bytes {
            return Err(too_large(
                "dynamic shared memory",
                u64::from(launch.shared_mem_bytes),
                u64::from(limits.max_shared_mem_bytes),
            ));
        }
        if self.time_limit_ms > limits.max_time_limit_ms {
            return Err(ProtocolError::LimitExceeded {
                code: ErrorCode::RUN_TIME_EXCEEDED,
                what: "time limit (ms)",
                value: u64::from(self.time_limit_ms),
                limit: u64::from(limits.max_time_limit_ms),
            });
        }
        let mut total: u64 = 0;
        for (i, arg) in self.args.iter().enumerate() {
            if arg.name().is_empty() {
                return Err(ProtocolError::violation(
                    ErrorCode::ARGUMENT_MISMATCH,
                    format!("argument {i} has an empty name"),
                ));
            }
            if self.args[..i].iter().any(|a| a.name() == arg.name()) {
                return Err(ProtocolError::violation(
                    ErrorCode::ARGUMENT_MISMATCH,
                    format!("argument name {:?} appears twice", arg.name()),
                ));
            }
            if let ArgSpec::Scalar { name, dtype, value } = arg
                && value.len() as u64 != dtype.size()
            {
                return Err(ProtocolError::violation(
                    ErrorCode::ARGUMENT_MISMATCH,
                    format!("scalar {name} is {dtype} but has {} bytes", value.len()),
                ));
            }
            let ndim = match arg {
                ArgSpec::Input { shape, .. } | ArgSpec::Output { shape, .. } => shape.len(),
                ArgSpec::Scalar { .. } => continue,
            };
            if ndim > usize::from(limits.max_dims) {
                return Err(ProtocolError::LimitExceeded {
                    code: ErrorCode::EXEC_MALFORMED,
                    what: "argument dimensions",
                    value: ndim as u64,
                    limit: u64::from(limits.max_dims),
                });
            }
            total = arg
                .byte_len()
                .and_then(|len| total.checked_add(len))
                .unwrap_or(u64::MAX);
        }
        if total > limits.max_tensor_bytes {
            return Err(ProtocolError::LimitExceeded {
                code: ErrorCode::TENSOR_TOO_LARGE,
                what: "bytes of inputs and outputs",
                value: total,
                limit: limits.max_tensor_bytes,
            });
        }
        Ok(())
    }

    /// The time limit to apply, in ms: the request's, or `limits`' default when it asks none.
    pub fn effective_time_limit_ms(&self, limits: &ExecLimits) -> u32 {
        match self.time_limit_ms {
            0 => limits.default_time_limit_ms,
            asked => asked.min(limits.max_time_limit_ms),
        }
    }

    /// The declared input named `name`, with its dtype and shape.
    pub fn input(&self, name: &str) -> Option<(DType, &[u64])> {
        self.args.iter().find_map(|arg| match arg {
            ArgSpec::Input {
                name: n,
                dtype,
                shape,
            } if n == name => Some((*dtype, shape.as_slice())),
            _ => None,
        })
    }

    /// Checks an arriving input tensor against its declaration: same dtype and shape, and
    /// declared at all (ARGUMENT_MISMATCH otherwise, naming both).
    pub fn check_input(&self, meta: &TensorMeta) -> Result<(), ProtocolError> {
        match self.input(meta.name()) {
            None => Err(ProtocolError::violation(
                ErrorCode::ARGUMENT_MISMATCH,
                format!("the request declares no input named {:?}", meta.name()),
            )),
            Some((dtype, shape)) if dtype != meta.dtype() || shape != meta.shape() => {
                Err(ProtocolError::violation(
                    ErrorCode::ARGUMENT_MISMATCH,
                    format!(
                        "input {} is {} {:?}; the request declares {dtype} {shape:?}",
                        meta.name(),
                        meta.dtype(),
                        meta.shape()
                    ),
                ))
            }
            Some(_) => Ok(()),
        }
    }

    /// The number of inputs the request declares.
    pub fn input_count(&self) -> usize {
        self.args
            .iter()
            .filter(|a| matches!(a, ArgSpec::Input { .. }))
            .count()
    }
}

fn too_large(what: &'static str, value: u64, limit: u64) -> ProtocolError {
    ProtocolError::LimitExceeded {
        code: ErrorCode::LAUNCH_TOO_LARGE,
        what,
        value,
        limit,
    }
}

/// How long each part of a run took, in nanoseconds; 0 where not measured (spec §14.3).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Timings {
    /// The request's arrival → every input and the module resident on the GPU.
    pub landing_ns: u64,
    /// The kernel alone, between CUDA events recorded around its launch.
    pub kernel_ns: u64,
    /// The kernel's end → every output acknowledged (COMPLETE) by the client.
    pub egress_ns: u64,
    /// The request's arrival → the reply being sent.
    pub total_ns: u64,
}

/// The answer to a request, the bytes of a tensor with role `reply` (spec §14.3).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecReply {
    /// What was asked.
    pub kind: RequestKind,
    /// The request's id.
    pub id: u64,
    /// `None` on success, else the error's wire code (spec §9).
    pub error: Option<ErrorCode>,
    /// Why it failed, or a note; for people.
    pub message: String,
    /// Measured times (run requests).
    pub timings: Timings,
    /// Keyed facts: the server description for info and health, cache use for runs.
    pub attributes: Vec<(String, String)>,
}

impl ExecReply {
    /// A failed reply to `request` with `code` and `message`.
    pub fn failure(
        kind: RequestKind,
        id: u64,
        code: ErrorCode,
        message: impl Into<String>,
    ) -> Self {
        Self {
            kind,
            id,
            error: Some(code),
            message: truncate_reason(message.into(), MAX_REASON_LEN),
            timings: Timings::default(),
            attributes: Vec::new(),
        }
    }

    /// The attribute `key`, if present (the first, where repeated).
    pub fn attribute(&self, key: &str) -> Option<&str> {
        self.attributes
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// The canonical bytes of this reply.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(REPLY_FIXED_LEN + self.message.len());
        out.push(EXEC_VERSION);
        out.push(self.kind.code());
        out.extend_from_slice(&self.id.to_le_bytes());
        out.extend_from_slice(&self.error.map_or(0, |c| c.0).to_le_bytes());
        let t = &self.timings;
        for v in [t.landing_ns, t.kernel_ns, t.egress_ns, t.total_ns] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        put_len16(&mut out, self.message.len());
        put_len16(&mut out, self.attributes.len());
        out.extend_from_slice(self.message.as_bytes());
        for (k, v) in &self.attributes {
            put_len16(&mut out, k.len());
            out.extend_from_slice(k.as_bytes());
            put_len16(&mut out, v.len());
            out.extend_from_slice(v.as_bytes());
        }
        out
    }

    /// Decodes a reply of at most `max_len` bytes.
    pub fn decode(bytes: &[u8], max_len: u64) -> Result<Self, ProtocolError> {
        if bytes.len() as u64 > max_len {
            return Err(ProtocolError::LimitExceeded {
                code: ErrorCode::EXEC_MALFORMED,
                what: "reply length",
                value: bytes.len() as u64,
                limit: max_len,
            });
        }
        let mut r = Reader::message(bytes, ErrorCode::EXEC_MALFORMED, "remote-execution message");
        let version = r.u8()?;
        if version != EXEC_VERSION {
            return Err(malformed(format!(
                "reply version {version}, expected {EXEC_VERSION}"
            )));
        }
        let kind = RequestKind::from_code(r.u8()?)?;
        let id = r.u64()?;
        let error = match r.u32()? {
            0 => None,
            code => Some(ErrorCode(code)),
        };
        let timings = Timings {
            landing_ns: r.u64()?,
            kernel_ns: r.u64()?,
            egress_ns: r.u64()?,
            total_ns: r.u64()?,
        };
        let message_len = r.u16()?;
        let attr_count = r.u16()?;
        let message = r.string(usize::from(message_len))?;
        let mut attributes = Vec::with_capacity(usize::from(attr_count).min(256));
        for _ in 0..attr_count {
            let key_len = r.u16()?;
            let key = r.string(usize::from(key_len))?;
            let value_len = r.u16()?;
            let value = r.string(usize::from(value_len))?;
            attributes.push((key, value));
        }
        r.finish()?;
        Ok(Self {
            kind,
            id,
            error,
            message,
            timings,
            attributes,
        })
    }
}

fn clamp16(len: usize) -> u16 {
    u16::try_from(len).unwrap_or(u16::MAX)
}

fn check_name_len(what: &'static str, len: u16, limits: &ExecLimits) -> Result<(), ProtocolError> {
    if len > limits.max_name_len {
        return Err(ProtocolError::LimitExceeded {
            code: ErrorCode::EXEC_MALFORMED,
            what,
            value: u64::from(len),
            limit: u64::from(limits.max_name_len),
        });
    }
    Ok(())
}

/// Writes a u16 length; encoders only build messages whose strings fit (longer is cut to
/// u16::MAX and the decoder will refuse it).
fn put_len16(out: &mut Vec<u8>, len: usize) {
    out.extend_from_slice(&u16::try_from(len).unwrap_or(u16::MAX).to_le_bytes());
}

fn malformed(detail: String) -> ProtocolError {
    ProtocolError::malformed(ErrorCode::EXEC_MALFORMED, detail)
}
