//! Remote GPU execution over tensorwire (spec §14): a client sends a kernel (PTX, cubin or
//! fatbin) with its input tensors over one QUIC connection; a server lands the inputs on its
//! GPU, runs the kernel in an isolated worker process, and sends the outputs back on the same
//! connection with the kernel's time measured by CUDA events.
//!
//! - Client: [`ExecClient`] with [`Module`] and [`Run`] (see `tensorwire-exec`, the program).
//! - Server: [`ExecServer::offer`] takes a [`Receiver`](tensorwire_quic::Receiver)'s
//!   remote-execution tensors and gives the others back; [`refuse_exec`] is what a receiver
//!   that does not run kernels uses instead. `receiver --allow-exec` is both.
//! - Messages: [`message`], the request and reply formats carried in U8 tensors (spec §14),
//!   with the limits a server checks; pure, no IO.
//! - Worker: [`serve_stdin`], the `tensorwire-exec-worker` program. A kernel that faults or
//!   overruns ends only its worker; the server replaces it.
//!
//! Security (spec §14.6): a server runs kernels only for peers that authenticated with a
//! client certificate, or, without client authentication, only for loopback peers;
//! [`ExecAccess::for_listener`] refuses any other setup.
//!
//! # Example: who may run kernels
//!
//! ```
//! use tensorwire_exec::ExecAccess;
//! use tensorwire_quic::ServerTls;
//!
//! // Without client certificates, only a loopback listener may run peers' kernels.
//! assert!(ExecAccess::for_listener("127.0.0.1:7000".parse()?, &ServerTls::Development).is_ok());
//! assert!(ExecAccess::for_listener("0.0.0.0:7000".parse()?, &ServerTls::Development).is_err());
//! # Ok::<(), std::net::AddrParseError>(())
//! ```

mod channel;
mod client;
mod error;
#[cfg(feature = "test-util")]
#[doc(hidden)]
pub mod fuzzing;
pub mod message;
mod pool;
mod server;
mod token;
mod worker;

pub use client::{ExecClient, Module, Run, RunOutput};
pub use error::ExecError;
pub use message::{ExecLimits, ExecReply, LaunchShape, RequestKind, Timings};
pub use pool::{WorkerCommand, WorkerStats};
pub use server::{ExecAccess, ExecConfig, ExecServer, ExecStats, refuse_exec};
pub use tensorwire_gpu::ModuleFormat;
pub use token::ExecToken;
pub use worker::serve_stdin;

/// SHA-256 of `bytes`.
pub(crate) fn sha256(bytes: &[u8]) -> [u8; 32] {
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    let mut out = [0u8; 32];
    out.copy_from_slice(digest.as_ref());
    out
}

/// Lower-case hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
