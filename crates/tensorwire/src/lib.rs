//! tensorwire: stream tensors over QUIC straight into GPU memory and re-share them locally.
//!
//! This facade re-exports the layers; each lives in its own crate, and data flows one way:
//! [`proto`] (sans-IO protocol) → [`sink`] (where bytes land: the `Sink` trait, credit
//! permits, memory budgets, host memory) → [`quic`] (QUIC driver) and [`gpu`] (GPU sink,
//! pools) → [`ipc`] (re-sharing with local processes, no QUIC stack), [`exec`] (remote
//! kernel execution on received tensors, in isolated worker processes) and [`metrics`]
//! (a receiver's counters for Prometheus, over HTTP).
//!
//! Guides: `docs/` in the repository (operators, Rust, Python, sharing, remote execution,
//! performance); the wire protocol: `spec/protocol.md`.
//!
//! # Example: a receiver landing tensors where the host has room
//!
//! ```
//! use tensorwire::prelude::*;
//! use tensorwire::quic::{ClientTls, ServerTls};
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut receiver =
//!     Receiver::bind(ReceiverConfig::new("127.0.0.1:0".parse()?, ServerTls::Development)).await?;
//! // GPU 0 if there is one, else host memory (said plainly: `describe` names the reason).
//! let placement = Placement::choose(DeviceRequest::Auto, GpuRequirement::Preferred)?;
//!
//! let sender =
//!     Sender::connect(receiver.local_addr()?, SenderConfig::new(ClientTls::Development)).await?;
//! let sending = sender.send(TensorMeta::new([1024], DType::F32)?.with_name("w"), vec![1u8; 4096]);
//!
//! let incoming = receiver.next().await.ok_or("the receiver closed")?;
//! let sink = placement.sink(incoming.meta())?;
//! let (meta, buffer) = incoming.accept(sink).finished().await?;
//! println!("{} landed in {}", meta.name(), buffer.location());
//! sending.finished().await?;
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]

pub use tensorwire_exec as exec;
pub use tensorwire_gpu as gpu;
pub use tensorwire_ipc as ipc;
pub use tensorwire_metrics as metrics;
pub use tensorwire_proto as proto;
pub use tensorwire_quic as quic;
pub use tensorwire_sink as sink;

/// The types most programs need.
pub mod prelude {
    pub use tensorwire_gpu::{
        Destinations, DeviceRequest, GpuRequirement, GpuStatus, Placement, TensorBuffer,
    };
    pub use tensorwire_proto::{DType, Device, ErrorCode, ProtocolError, TensorMeta};
    pub use tensorwire_quic::{
        HostSink, IncomingTensor, Receiver, ReceiverConfig, Sender, SenderConfig, SenderPool, Sink,
        Source, TransportError, TransportSettings,
    };
}
