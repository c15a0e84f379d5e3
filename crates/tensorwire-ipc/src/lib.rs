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
//!
//! # Example: publish a host tensor, open it as a consumer would
//!
//! ```
//! use tensorwire_ipc::{ShareClient, ShareConfig, ShareService};
//! use tensorwire_proto::{DType, TensorMeta};
//!
//! // The service makes the socket's directory, mode 0700.
//! let dir = std::env::temp_dir().join(format!("tensorwire-doc-{}", std::process::id()));
//! let service = ShareService::start(dir.join("share.sock"), ShareConfig::default())?;
//! let meta = TensorMeta::new([4], DType::U8)?.with_name("w");
//! service.publish_host(&meta, &[1, 2, 3, 4])?;
//!
//! // Usually another process: it maps the same memory under a lease, with no copy.
//! let client = ShareClient::connect(dir.join("share.sock"))?;
//! let tensor = client.open("w")?;
//! assert_eq!(tensor.host_bytes(), Some(&[1u8, 2, 3, 4][..]));
//! # drop((tensor, client, service));
//! # std::fs::remove_dir_all(&dir)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

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
    Descriptor, DeviceFields, ErrorBody, Event, EventKind, Export, GpuInfo, Info, MAX_MESSAGE,
    PROTOCOL_VERSION, RefusalCode, Reply, Request, SecretHandle, TensorFields,
};
pub use service::{
    OnExisting, PublishedTensor, ShareConfig, ShareService, UpdateRefused, local_gpus,
};
