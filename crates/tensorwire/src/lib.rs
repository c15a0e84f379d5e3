//! tensorwire: stream tensors over QUIC straight into GPU memory and re-share them locally.
//!
//! This facade re-exports the layers; each lives in its own crate, and data flows one way:
//! [`proto`] (sans-IO protocol) → [`sink`] (where bytes land: the `Sink` trait, credit
//! permits, memory budgets, host memory) → [`quic`] (QUIC driver) and [`gpu`] (GPU sink,
//! pools) → [`ipc`] (re-sharing with local processes, no QUIC stack) and [`exec`] (remote
//! kernel execution on received tensors, in isolated worker processes).
#![forbid(unsafe_code)]

pub use tensorwire_exec as exec;
pub use tensorwire_gpu as gpu;
pub use tensorwire_ipc as ipc;
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
