//! Shared pieces of the `sender`, `receiver` and `demo` programs: reading tensors from
//! `.safetensors`, `.npy`, `.wav` and raw files, saving received tensors as `.safetensors`,
//! and the TLS and transport options every program takes.

pub mod cli;
pub mod files;
pub mod save;
