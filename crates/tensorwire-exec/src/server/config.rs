//! How a server runs kernels and who may ask it to (spec §14.6).

use std::net::SocketAddr;
use std::time::Duration;

use crate::message::{ExecLimits, TOKEN_ATTRIBUTE};
use crate::token::ExecToken;
use tensorwire_gpu::DeviceRequest;
use tensorwire_proto::TensorMeta;
use tensorwire_quic::{SenderConfig, ServerTls};

use crate::error::ExecError;
use crate::pool::WorkerCommand;

/// Who may run kernels (spec §14.6).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ExecAccess {
    /// Every peer: the server verifies client certificates (mutual TLS), so every peer has
    /// authenticated before any frame is read.
    AuthenticatedPeers,
    /// Peers on a loopback address only: the server does not authenticate clients.
    LoopbackPeers,
    /// Peers whose remote-execution tensors carry this access token, from any address (and
    /// with or without certificates).
    TokenHolders(ExecToken),
}

impl ExecAccess {
    /// The access a server listening on `listen` with `tls` may grant: authenticated peers
    /// with mutual TLS; loopback peers on a loopback address without it; otherwise an error
    /// saying so, and nothing should start.
    pub fn for_listener(listen: SocketAddr, tls: &ServerTls) -> Result<ExecAccess, ExecError> {
        match tls {
            ServerTls::Pem {
                client_ca: Some(_), ..
            } => Ok(ExecAccess::AuthenticatedPeers),
            _ if listen.ip().is_loopback() => Ok(ExecAccess::LoopbackPeers),
            _ => Err(ExecError::Config(format!(
                "remote execution on {listen} needs mutual TLS (a client CA, so that only \
                 clients with certificates it issued may run kernels) or an access token; \
                 without either, listen on a loopback address"
            ))),
        }
    }

    /// Why `peer`'s remote-execution tensor described by `meta` may not run kernels, or
    /// `None` if it may.
    pub(super) fn refusal(&self, peer: SocketAddr, meta: &TensorMeta) -> Option<String> {
        match self {
            ExecAccess::AuthenticatedPeers => None,
            ExecAccess::LoopbackPeers if peer.ip().is_loopback() => None,
            ExecAccess::LoopbackPeers => Some(format!(
                "{peer} may not run kernels: this server has no client authentication, so \
                 only loopback peers may"
            )),
            ExecAccess::TokenHolders(token) if token.admits(meta.attribute(TOKEN_ATTRIBUTE)) => {
                None
            }
            ExecAccess::TokenHolders(_) => Some(format!(
                "{peer} may not run kernels: its tensor carries no access token, or a wrong \
                 one (spec §14.6)"
            )),
        }
    }
}

/// How the server runs kernels.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ExecConfig {
    /// Who may run kernels.
    pub access: ExecAccess,
    /// The request limits (spec §14.4).
    pub limits: ExecLimits,
    /// The GPU kernels run on (`Auto`: GPU 0).
    pub device: DeviceRequest,
    /// Worker processes, each running one kernel at a time.
    pub workers: usize,
    /// How to start a worker.
    pub worker: WorkerCommand,
    /// How long a request's inputs may take to arrive (their METADATA) after the request,
    /// and how long an input may wait for its request.
    pub admission_wait: Duration,
    /// Most bytes of modules kept, oldest dropped first.
    pub module_cache_bytes: u64,
    /// Settings for sending outputs and replies back.
    pub reply: SenderConfig,
}

impl ExecConfig {
    /// Defaults: the default limits, GPU 0, two workers started from
    /// [`WorkerCommand::beside_current_exe`], 30 s admission, 256 MiB of modules.
    pub fn new(access: ExecAccess, worker: WorkerCommand) -> Self {
        Self {
            access,
            limits: ExecLimits::default(),
            device: DeviceRequest::Auto,
            workers: 2,
            worker,
            admission_wait: Duration::from_secs(30),
            module_cache_bytes: 256 << 20,
            reply: SenderConfig::new(tensorwire_quic::ClientTls::Development),
        }
    }
}
