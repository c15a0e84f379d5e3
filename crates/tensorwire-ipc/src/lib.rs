//! Re-share received tensors with other local processes, without copying them again.
//!
//! A producer runs a [`ShareService`] on a Unix `SOCK_SEQPACKET` socket in a 0700 directory,
//! checks each consumer's uid with `SO_PEERCRED`, and publishes tensors; consumers connect with
//! a [`ShareClient`], list them and [`open`](ShareClient::open) them under leases, mapping the
//! same memory. The protocol is in `spec/ipc.md`.
//!
//! Three export modes, tagged in every descriptor: host memory (a memfd passed with
//! `SCM_RIGHTS`, so everything works without a GPU), and with the `cuda` feature GPU memory
//! as a VMM fd (`cuMemCreate` memory, e.g. a receiver's pool built with
//! [`DeviceMemoryKind::Vmm`](tensorwire_gpu::DeviceMemoryKind)) or a legacy CUDA IPC handle
//! plus offset (`cuMemAlloc` memory), which PyTorch and CuPy can open.

mod client;
mod error;
mod exported;
#[allow(
    unsafe_code,
    reason = "mapping shared memory (mmap) and exporting it as DLPack"
)]
mod memory;
mod message;
mod registry;
mod service;
mod socket;

pub use client::{ShareClient, SharedTensor, Watch};
pub use error::IpcError;
pub use message::{
    Descriptor, DeviceFields, ErrorBody, ErrorCode, Event, EventKind, Export, GpuInfo, Info,
    MAX_MESSAGE, PROTOCOL_VERSION, Reply, Request, SecretHandle, TensorFields,
};
pub use service::{
    OnExisting, PublishedTensor, ShareConfig, ShareService, UpdateRefused, local_gpus,
};
