//! Re-share received tensors with other local processes, without copying them again.
//!
//! A producer runs a [`ShareService`] on a Unix `SOCK_SEQPACKET` socket in a 0700 directory,
//! checks each consumer's uid with `SO_PEERCRED`, and publishes tensors; consumers connect with
//! a [`ShareClient`], list them and [`open`](ShareClient::open) them under leases, mapping the
//! same memory. The protocol is in `spec/ipc.md`.
//!
//! This version shares host memory (a memfd passed with `SCM_RIGHTS`); the GPU export modes
//! of the spec (VMM fds, legacy CUDA IPC handles) are not implemented yet.

mod client;
mod error;
mod memory;
mod message;
mod registry;
mod service;
mod socket;

pub use client::{ShareClient, SharedTensor};
pub use error::IpcError;
pub use message::{
    Descriptor, ErrorBody, ErrorCode, Export, Info, MAX_MESSAGE, PROTOCOL_VERSION, Reply, Request,
};
pub use service::{PublishedTensor, ShareConfig, ShareService};
