//! Whether this process can use CUDA, found without ever panicking.

use std::fmt;

/// What CUDA support this process has.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GpuStatus {
    /// Built without the `cuda` feature.
    NotCompiled,
    /// No usable driver: libcuda is missing or failed to initialize.
    NoCuda(String),
    /// The driver works but reports no devices.
    NoDevices,
    /// This many devices are usable.
    Available {
        /// Number of CUDA devices.
        device_count: usize,
    },
}

impl GpuStatus {
    /// Probes the driver. Never panics: cudarc panics on the first driver call when libcuda
    /// is missing, so its presence is checked first and every failure becomes a variant.
    pub fn detect() -> GpuStatus {
        #[cfg(feature = "cuda")]
        {
            match crate::cuda::detect() {
                Ok(0) => GpuStatus::NoDevices,
                Ok(device_count) => GpuStatus::Available { device_count },
                Err(reason) => GpuStatus::NoCuda(reason),
            }
        }
        #[cfg(not(feature = "cuda"))]
        {
            GpuStatus::NotCompiled
        }
    }

    /// Whether at least one device is usable.
    pub fn is_available(&self) -> bool {
        matches!(self, GpuStatus::Available { .. })
    }

    /// Usable devices (0 unless available).
    pub fn device_count(&self) -> usize {
        match self {
            GpuStatus::Available { device_count } => *device_count,
            _ => 0,
        }
    }
}

/// For GPU tests: the number of GPUs, or `None` after printing `SKIPPED <test>: <reason>` to
/// stderr (past the test harness's capture, so CI logs show every skip). With
/// `TENSORWIRE_REQUIRE_GPU=1` (a GPU host) a missing GPU panics instead: no silent skips there.
#[cfg(any(test, feature = "test-util"))]
#[doc(hidden)]
pub fn gpus_or_skip(test: &str) -> Option<usize> {
    use std::io::Write;
    let status = GpuStatus::detect();
    if status.is_available() {
        return Some(status.device_count());
    }
    if std::env::var("TENSORWIRE_REQUIRE_GPU").as_deref() == Ok("1") {
        panic!("TENSORWIRE_REQUIRE_GPU=1 but {status}");
    }
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {status}");
    None
}

impl fmt::Display for GpuStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuStatus::NotCompiled => {
                f.write_str("no GPU support in this build (cargo feature `cuda` off)")
            }
            GpuStatus::NoCuda(reason) => write!(f, "no CUDA driver ({reason})"),
            GpuStatus::NoDevices => f.write_str("CUDA driver found, but no GPU"),
            GpuStatus::Available { device_count } => write!(f, "{device_count} CUDA device(s)"),
        }
    }
}
