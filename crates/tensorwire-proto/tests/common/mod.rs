//! Helpers shared by the integration tests: the golden vectors and an in-memory pair.
#![allow(dead_code, unreachable_pub)] // Each test binary uses a different subset.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

pub mod pair;
pub mod vectors;
