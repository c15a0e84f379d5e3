//! tensorwire: stream tensors over QUIC straight into GPU memory and re-share them locally.
//!
//! This facade re-exports the layers; each lives in its own crate:
//! [`proto`] (sans-IO protocol).
#![forbid(unsafe_code)]

pub use tensorwire_proto as proto;
pub use tensorwire_proto::{DType, Device, ErrorCode, ProtocolError, TensorMeta};
