//! The client side (spec §14): sends a kernel's module, inputs and request over one
//! connection, and collects the outputs and the reply that come back on it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::message::{
    ArgSpec, ExecLimits, ExecReply, ExecRequest, ExecRole, LaunchShape, ModuleFormat, RequestBody,
    RunRequest, TOKEN_ATTRIBUTE, Timings,
};
use crate::token::ExecToken;
use bytes::Bytes;
use tensorwire_proto::{DType, ErrorCode, Feature, TensorMeta};
use tensorwire_quic::{
    IncomingTensor, Receiver, ReceiverConfig, SendHandle, Sender, SenderConfig, ServerTls,
};
use tokio::sync::mpsc;

use crate::error::ExecError;
use crate::sha256;

/// A kernel module: PTX, a cubin or a fatbin, with its SHA-256 (the server's cache key).
#[derive(Clone, Debug)]
pub struct Module {
    format: ModuleFormat,
    bytes: Bytes,
    sha256: [u8; 32],
}

impl Module {
    /// A module of `format` holding `bytes`.
    pub fn new(format: ModuleFormat, bytes: impl Into<Bytes>) -> Self {
        let bytes = bytes.into();
        Self {
            format,
            sha256: sha256(&bytes),
            bytes,
        }
    }

    /// Reads a module file; the format is told from its first bytes (ELF: cubin).
    pub fn from_file(path: &Path) -> Result<Self, ExecError> {
        let bytes = std::fs::read(path).map_err(|error| ExecError::File {
            path: path.to_owned(),
            error,
        })?;
        Ok(Self::new(ModuleFormat::sniff(&bytes), bytes))
    }

    /// How it is loaded.
    pub fn format(&self) -> ModuleFormat {
        self.format
    }

    /// Its SHA-256.
    pub fn sha256(&self) -> [u8; 32] {
        self.sha256
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}

/// A kernel launch to request: module, function, launch shape and arguments.
#[derive(Clone, Debug)]
pub struct Run {
    module: Arc<Module>,
    function: String,
    launch: LaunchShape,
    time_limit: Option<Duration>,
    /// The kernel's parameters in order, as the request declares them.
    args: Vec<ArgSpec>,
    /// The bytes of each input, in declaration order.
    inputs: Vec<(TensorMeta, Bytes)>,
}

impl Run {
    /// Runs `function` of `module`, on one block of one thread until told otherwise.
    pub fn new(module: Arc<Module>, function: impl Into<String>) -> Self {
        Self {
            module,
            function: function.into(),
            launch: LaunchShape {
                grid: [1, 1, 1],
                block: [1, 1, 1],
                shared_mem_bytes: 0,
            },
            time_limit: None,
            args: Vec::new(),
            inputs: Vec::new(),
        }
    }

    /// Blocks in x, y, z.
    pub fn grid(mut self, grid: [u32; 3]) -> Self {
        self.launch.grid = grid;
        self
    }

    /// Threads per block in x, y, z.
    pub fn block(mut self, block: [u32; 3]) -> Self {
        self.launch.block = block;
        self
    }

    /// Dynamic shared memory per block.
    pub fn shared_mem_bytes(mut self, bytes: u32) -> Self {
        self.launch.shared_mem_bytes = bytes;
        self
    }

    /// The longest the kernel may run (the server's default if not set).
    pub fn time_limit(mut self, limit: Duration) -> Self {
        self.time_limit = Some(limit);
        self
    }

    /// An input tensor, passed as a device pointer. Fails if `data` is not `meta`'s length.
    pub fn input(mut self, meta: TensorMeta, data: impl Into<Bytes>) -> Result<Self, ExecError> {
        let data = data.into();
        if data.len() as u64 != meta.byte_len() {
            return Err(ExecError::Config(format!(
                "input {} is {} bytes, but {} {:?} needs {}",
                meta.name(),
                data.len(),
                meta.dtype(),
                meta.shape(),
                meta.byte_len()
            )));
        }
        self.args.push(ArgSpec::Input {
            name: meta.name().to_owned(),
            dtype: meta.dtype(),
            shape: meta.shape().to_vec(),
        });
        self.inputs.push((meta, data));
        Ok(self)
    }

    /// An output tensor the server allocates (zeroed), passed as a device pointer.
    pub fn output(mut self, name: impl Into<String>, dtype: DType, shape: Vec<u64>) -> Self {
        self.args.push(ArgSpec::Output {
            name: name.into(),
            dtype,
            shape,
        });
        self
    }

    /// A scalar passed by value: `value` holds `dtype`'s size in little-endian bytes.
    pub fn scalar(
        mut self,
        name: impl Into<String>,
        dtype: DType,
        value: impl Into<Vec<u8>>,
    ) -> Self {
        self.args.push(ArgSpec::Scalar {
            name: name.into(),
            dtype,
            value: value.into(),
        });
        self
    }

    fn request(
        &self,
        id: u64,
        attach: bool,
        limits: &ExecLimits,
    ) -> Result<ExecRequest, ExecError> {
        let time_limit_ms = self.time_limit.map_or(0, |d| {
            u32::try_from(d.as_millis().max(1)).unwrap_or(u32::MAX)
        });
        let run = RunRequest {
            module_sha256: self.module.sha256,
            module_format: self.module.format,
            module_len: self.module.bytes.len() as u64,
            module_attached: attach,
            function: self.function.clone(),
            launch: self.launch,
            time_limit_ms,
            args: self.args.clone(),
        };
        // The client checks what the server will, so a bad request fails here with the
        // same code, before anything is sent.
        run.check(limits)?;
        Ok(ExecRequest {
            id,
            body: RequestBody::Run(run),
        })
    }
}

/// What a run gave back.
#[derive(Debug)]
pub struct RunOutput {
    /// The outputs, in the order the run declared them.
    pub outputs: Vec<(TensorMeta, Bytes)>,
    /// The server's timings (spec §14.3).
    pub timings: Timings,
    /// Whether the module's bytes were sent (the server did not have it).
    pub module_sent: bool,
    /// Bytes of module, inputs and outputs moved.
    pub bytes_moved: u64,
    /// Request sent → reply received, on this side's clock.
    pub round_trip: Duration,
    /// The server's reply, with its attributes.
    pub reply: ExecReply,
}

impl RunOutput {
    /// The output named `name`.
    pub fn output(&self, name: &str) -> Option<&(TensorMeta, Bytes)> {
        self.outputs.iter().find(|(meta, _)| meta.name() == name)
    }
}

/// A connection to a server that runs kernels.
pub struct ExecClient {
    sender: Sender,
    shared: Arc<Shared>,
    /// Ends by itself when the connection closes.
    _dispatcher: tokio::task::JoinHandle<()>,
    limits: ExecLimits,
    /// How long to wait for a reply beyond the run's time limit.
    reply_timeout: Duration,
    /// Presented on every tensor it sends, for servers that admit by token (spec §14.6).
    token: Option<ExecToken>,
}

struct Shared {
    next_id: AtomicU64,
    /// Requests awaiting their outputs and reply, by id.
    pending: Mutex<HashMap<u64, mpsc::UnboundedSender<IncomingTensor>>>,
}

impl ExecClient {
    /// Connects to `addr`.
    pub async fn connect(addr: SocketAddr, config: SenderConfig) -> Result<Self, ExecError> {
        let sender = Sender::connect(addr, config).await?;
        Self::over(sender)
    }

    /// Uses an open connection: its replies are received on it (spec §3).
    pub fn over(sender: Sender) -> Result<Self, ExecError> {
        let version = sender.peer_version();
        if !version.has(Feature::RemoteExecution) {
            return Err(ExecError::Unsupported {
                peer: sender.peer(),
                version,
            });
        }
        // Only budgets, limits and timeouts of this config apply on a connection's own
        // receiving side; the address and TLS are placeholders.
        let config = ReceiverConfig::new(
            SocketAddr::from(([127, 0, 0, 1], 0)),
            ServerTls::Development,
        );
        let receiver = sender.connection().incoming(config)?;
        let shared = Arc::new(Shared {
            next_id: AtomicU64::new(1),
            pending: Mutex::new(HashMap::new()),
        });
        let dispatcher = tokio::spawn(dispatch(receiver, shared.clone()));
        Ok(Self {
            sender,
            shared,
            _dispatcher: dispatcher,
            limits: ExecLimits::default(),
            reply_timeout: Duration::from_secs(120),
            token: None,
        })
    }

    /// Presents `token` on every remote-execution tensor, for a server that admits clients
    /// by token (spec §14.6). Send it only to a server whose certificate is verified.
    pub fn with_token(mut self, token: ExecToken) -> Self {
        self.token = Some(token);
        self
    }

    /// Waits this long for a reply beyond the run's time limit (default 120 s: inputs
    /// must land first).
    pub fn with_reply_timeout(mut self, timeout: Duration) -> Self {
        self.reply_timeout = timeout;
        self
    }

    /// Describes the server and its GPU (spec §14.3's info keys).
    pub async fn info(&self) -> Result<ExecReply, ExecError> {
        self.query(RequestBody::Info).await
    }

    /// Whether the server can run kernels now, with its workers and cache.
    pub async fn health(&self) -> Result<ExecReply, ExecError> {
        self.query(RequestBody::Health).await
    }

    async fn query(&self, body: RequestBody) -> Result<ExecReply, ExecError> {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let request = ExecRequest { id, body };
        let mut mailbox = self.register(id);
        let sent = self.send_request(&request);
        let outcome = self
            .collect(id, &mut mailbox, &[], Vec::new(), sent, self.reply_timeout)
            .await;
        self.unregister(id);
        let (reply, _) = outcome?;
        Ok(reply)
    }

    /// Runs `run`: sends the request by module hash first, and again with the module if the
    /// server does not have it (spec §14.2); returns the outputs and timings, or the
    /// server's error.
    pub async fn run(&self, run: &Run) -> Result<RunOutput, ExecError> {
        match self.run_once(run, false).await {
            Err(ExecError::Refused { code, .. }) if code == ErrorCode::MODULE_NOT_CACHED => {
                self.run_once(run, true).await
            }
            other => other,
        }
    }

    async fn run_once(&self, run: &Run, attach: bool) -> Result<RunOutput, ExecError> {
        let started = Instant::now();
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let request = run.request(id, attach, &self.limits)?;
        let mut mailbox = self.register(id);
        let mut sends = vec![self.send_request(&request)];
        let mut bytes_moved = 0u64;
        if attach {
            let meta = TensorMeta::new(vec![run.module.bytes.len() as u64], DType::U8)?
                .with_name("tensorwire.exec.module");
            bytes_moved += run.module.bytes.len() as u64;
            sends.push(self.sender.send(
                self.tag(ExecRole::Module, meta, id),
                run.module.bytes.clone(),
            ));
        }
        for (meta, data) in &run.inputs {
            bytes_moved += data.len() as u64;
            let meta = self.tag(ExecRole::Input, meta.clone(), id);
            sends.push(self.sender.send(meta, data.clone()));
        }
        let mut outputs = Vec::new();
        for arg in &run.args {
            if let ArgSpec::Output { name, dtype, shape } = arg {
                outputs.push(TensorMeta::new(shape.clone(), *dtype)?.with_name(name.clone()));
            }
        }
        let wait = self.reply_timeout + run.time_limit.unwrap_or(Duration::from_secs(10));
        let request_send = sends.remove(0);
        let outcome = self
            .collect(id, &mut mailbox, &outputs, sends, request_send, wait)
            .await;
        self.unregister(id);
        let (reply, received) = outcome?;
        bytes_moved += received.iter().map(|(m, _)| m.byte_len()).sum::<u64>();
        Ok(RunOutput {
            outputs: received,
            timings: reply.timings,
            module_sent: attach,
            bytes_moved,
            round_trip: started.elapsed(),
            reply,
        })
    }

    /// `meta` tagged with `role` and request `id`, and with the access token if any.
    fn tag(&self, role: ExecRole, meta: TensorMeta, id: u64) -> TensorMeta {
        let meta = role.tag(meta, id);
        match &self.token {
            Some(token) => meta.with_attribute(TOKEN_ATTRIBUTE, token.secret()),
            None => meta,
        }
    }

    fn send_request(&self, request: &ExecRequest) -> SendHandle {
        let bytes = request.encode();
        let meta = TensorMeta::new(vec![bytes.len() as u64], DType::U8)
            .map(|meta| meta.with_name("tensorwire.exec.request"));
        match meta {
            Ok(meta) => self.sender.send(
                self.tag(ExecRole::Request, meta, request.id),
                Bytes::from(bytes),
            ),
            // A one-dimensional U8 shape always describes its bytes.
            Err(_) => unreachable!("a U8 vector's metadata is always valid"),
        }
    }

    fn register(&self, id: u64) -> mpsc::UnboundedReceiver<IncomingTensor> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.shared
            .pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id, tx);
        rx
    }

    fn unregister(&self, id: u64) {
        self.shared
            .pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&id);
    }

    /// Accepts the declared outputs and the reply of request `id`; a refused request or
    /// input ends it with the server's code.
    async fn collect(
        &self,
        id: u64,
        mailbox: &mut mpsc::UnboundedReceiver<IncomingTensor>,
        declared: &[TensorMeta],
        inputs: Vec<SendHandle>,
        request: SendHandle,
        wait: Duration,
    ) -> Result<(ExecReply, Vec<(TensorMeta, Bytes)>), ExecError> {
        let deadline = tokio::time::Instant::now() + wait;
        let mut request = tokio::spawn(request.finished());
        let mut request_done = false;
        let mut inputs: tokio::task::JoinSet<_> =
            inputs.into_iter().map(|send| send.finished()).collect();
        let mut received: Vec<Option<(TensorMeta, Bytes)>> = vec![None; declared.len()];
        let mut landing = tokio::task::JoinSet::new();
        loop {
            tokio::select! {
                Some(sent) = inputs.join_next(), if !inputs.is_empty() => {
                    if let Ok(Err(e)) = sent {
                        return Err(refused_or(e));
                    }
                }
                done = &mut request, if !request_done => {
                    request_done = true;
                    if let Ok(Err(e)) = done {
                        return Err(refused_or(e));
                    }
                }
                Some(landed) = landing.join_next(), if !landing.is_empty() => {
                    match landed {
                        Ok(Ok(Landed::Output(i, meta, bytes))) => received[i] = Some((meta, bytes)),
                        Ok(Ok(Landed::Reply(reply))) => {
                            while let Some(next) = landing.join_next().await {
                                if let Ok(Ok(Landed::Output(i, meta, bytes))) = next {
                                    received[i] = Some((meta, bytes));
                                }
                            }
                            return finish(reply, declared, received);
                        }
                        Ok(Err(e)) => return Err(e),
                        Err(e) => return Err(ExecError::Config(format!("a receive task failed: {e}"))),
                    }
                }
                incoming = mailbox.recv() => {
                    let Some(incoming) = incoming else {
                        return Err(ExecError::Config("the connection's receiver closed".into()));
                    };
                    let meta = incoming.meta().clone();
                    match ExecRole::of(&meta) {
                        Ok(Some((ExecRole::Reply, _))) => {
                            let limit = self.limits.max_request_len;
                            if meta.dtype() != DType::U8 || meta.byte_len() > limit {
                                incoming.reject(ErrorCode::EXEC_MALFORMED, "a reply is a short U8 vector");
                                return Err(ExecError::Refused {
                                    code: ErrorCode::EXEC_MALFORMED,
                                    message: "the server's reply is not a short U8 vector".into(),
                                });
                            }
                            landing.spawn(async move {
                                let (_, bytes) = incoming.accept_host().await.map_err(|e| ExecError::Refused { code: e.code, message: e.message })?
                                    .finished().await?;
                                Ok(Landed::Reply(ExecReply::decode(&bytes, limit)?))
                            });
                        }
                        Ok(Some((ExecRole::Output, _))) => {
                            let slot = declared.iter().position(|d| {
                                d.name() == meta.name() && d.dtype() == meta.dtype() && d.shape() == meta.shape()
                            });
                            match slot {
                                Some(i) if received[i].is_none() => {
                                    landing.spawn(async move {
                                        let (meta, bytes) = incoming.accept_host().await.map_err(|e| ExecError::Refused { code: e.code, message: e.message })?
                                            .finished().await?;
                                        Ok(Landed::Output(i, meta, bytes))
                                    });
                                }
                                _ => incoming.reject(
                                    ErrorCode::ARGUMENT_MISMATCH,
                                    format!("request {id} declares no output {} {} {:?}", meta.name(), meta.dtype(), meta.shape()),
                                ),
                            }
                        }
                        _ => incoming.reject(ErrorCode::REJECTED, "not an output or reply of this request"),
                    }
                }
                () = tokio::time::sleep_until(deadline) => return Err(ExecError::NoReply(wait)),
            }
        }
    }
}

enum Landed {
    Output(usize, TensorMeta, Bytes),
    Reply(ExecReply),
}

/// The reply's verdict, with every declared output present on success.
fn finish(
    reply: ExecReply,
    declared: &[TensorMeta],
    received: Vec<Option<(TensorMeta, Bytes)>>,
) -> Result<(ExecReply, Vec<(TensorMeta, Bytes)>), ExecError> {
    if let Some(code) = reply.error {
        return Err(ExecError::Refused {
            code,
            message: reply.message,
        });
    }
    let mut outputs = Vec::with_capacity(declared.len());
    for (meta, got) in declared.iter().zip(received) {
        match got {
            Some(output) => outputs.push(output),
            None => {
                return Err(ExecError::Refused {
                    code: ErrorCode::INTERNAL,
                    message: format!("the reply came, output {} did not", meta.name()),
                });
            }
        }
    }
    Ok((reply, outputs))
}

/// A send the server refused carries its code and reason as [`ExecError::Refused`].
fn refused_or(error: tensorwire_quic::TransportError) -> ExecError {
    match &error {
        tensorwire_quic::TransportError::Protocol(tensorwire_proto::ProtocolError::Remote {
            code,
            reason,
        }) => ExecError::Refused {
            code: *code,
            message: reason.clone(),
        },
        _ => ExecError::Transport(error),
    }
}

/// Routes the server's tensors to the request they answer; refuses the rest.
async fn dispatch(mut receiver: Receiver, shared: Arc<Shared>) {
    while let Some(incoming) = receiver.next().await {
        let id = match ExecRole::of(incoming.meta()) {
            Ok(Some((ExecRole::Output | ExecRole::Reply, id))) => id,
            _ => {
                incoming.reject(
                    ErrorCode::REJECTED,
                    "this client takes only outputs and replies",
                );
                continue;
            }
        };
        let target = shared
            .pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&id)
            .cloned();
        match target {
            Some(tx) => {
                if let Err(mpsc::error::SendError(incoming)) = tx.send(incoming) {
                    incoming.reject(ErrorCode::REJECTED, format!("request {id} is over"));
                }
            }
            None => incoming.reject(ErrorCode::REJECTED, format!("no request {id} is waiting")),
        }
    }
}

impl ExecClient {
    /// Closes the connection cleanly; the dispatcher ends with it.
    pub async fn close(self) {
        self.sender.close().await;
    }
}
