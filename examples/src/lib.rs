//! Shared pieces of the `sender`, `receiver` and `demo` programs: reading tensors from
//! `.safetensors`, `.npy`, `.wav` and raw files, saving received tensors as `.safetensors`,
//! the TLS and transport options every program takes, progress on a terminal, a push's
//! report, and the receiver's metric families.

/// Every program's allocator: mimalloc, with received datagrams in pinned memory once a
/// receiver opens a GPU.
///
/// A receiver stores large payloads on other threads, so quinn's receive buffers are freed
/// away from the connection's thread that allocated them, which glibc's allocator makes
/// dearer per byte on that thread than mimalloc (benches/results/LOG.md). mimalloc is built
/// without transparent huge pages (the workspace's `Cargo.toml` says why).
/// `PinnedDatagrams` lets a GPU receiver copy payloads to the device straight from the
/// buffers quinn decrypted them into, with no copy into staging. Its region (256 MiB) holds
/// the receiver's default budget of received datagrams; past it, payloads go through staging.
#[global_allocator]
static ALLOCATOR: tensorwire::gpu::PinnedDatagrams<mimalloc::MiMalloc> =
    tensorwire::gpu::PinnedDatagrams::new(mimalloc::MiMalloc);

pub mod cli;
pub mod files;
pub mod metric_families;
pub mod progress;
pub mod report;
pub mod save;
pub mod sharing;
