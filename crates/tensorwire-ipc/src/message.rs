//! The messages of the sharing protocol (spec/ipc.md §2): one JSON object per packet.

use serde::{Deserialize, Serialize};

/// The protocol version this crate speaks (spec/ipc.md: 2 added generations, full
/// metadata, `watch` and `open` with a wait).
pub const PROTOCOL_VERSION: u32 = 2;

/// Largest message in bytes (spec/ipc.md §1).
pub const MAX_MESSAGE: usize = 64 * 1024;

/// A consumer's request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// First request on a connection.
    Hello {
        /// The consumer's protocol version.
        version: u32,
    },
    /// All published tensors.
    List,
    /// One tensor, by UUID or name.
    Info {
        /// UUID or name.
        tensor: String,
    },
    /// Map a tensor: takes a lease; the reply carries an fd.
    Open {
        /// UUID or name.
        tensor: String,
        /// Wait up to this many milliseconds for a name that is not published yet.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        wait_ms: Option<u64>,
    },
    /// Turns the connection into a stream of [`Event`]s for names starting with `prefix`.
    Watch {
        /// Name prefix; empty for every tensor.
        #[serde(default)]
        prefix: String,
    },
    /// Ends a lease.
    Release {
        /// The lease from `open`.
        lease: u64,
    },
    /// Removes a tensor (deferred while leased).
    Delete {
        /// UUID or name.
        tensor: String,
    },
    /// The producer's GPUs.
    Devices,
}

/// One of the producer's GPUs (spec/ipc.md §2).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    /// The ordinal in the producer (others may differ: match by `uuid`).
    pub ordinal: u32,
    /// e.g. "NVIDIA H200".
    pub name: String,
    /// `GPU-…`, as `nvidia-smi -L` prints it.
    pub uuid: String,
    /// Bytes of device memory.
    pub total_memory: u64,
    /// Bytes free when asked.
    pub free_memory: u64,
    /// Compute capability, major and minor.
    pub compute_capability: [i32; 2],
}

/// How a tensor's memory is exported (spec/ipc.md §3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Export {
    /// A memfd of host memory.
    Host,
    /// A CUDA VMM allocation exported as a POSIX fd.
    Vmm,
    /// A legacy CUDA IPC handle plus offset.
    CudaIpc,
}

impl Export {
    /// The wire name: `host`, `vmm` or `cuda_ipc`.
    pub fn name(self) -> &'static str {
        match self {
            Export::Host => "host",
            Export::Vmm => "vmm",
            Export::CudaIpc => "cuda_ipc",
        }
    }
}

/// The GPU a tensor lives on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceFields {
    /// The ordinal in the producer (others may differ: match by `uuid`).
    pub ordinal: u32,
    /// `GPU-…`, as `nvidia-smi -L` prints it.
    pub uuid: String,
    /// e.g. "NVIDIA H200".
    pub name: String,
}

/// What every listing and descriptor says about a tensor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorFields {
    /// Registry id.
    pub id: uuid::Uuid,
    /// Name (unique in the registry).
    pub name: String,
    /// dtype name, as in protocol.md §5.1.
    pub dtype: String,
    /// Shape.
    pub shape: Vec<u64>,
    /// Bytes of the tensor.
    pub byte_len: u64,
    /// Elements: the product of the shape.
    pub numel: u64,
    /// Bytes per element.
    pub element_size: u64,
    /// Export mode.
    pub export: Export,
    /// The sender's attributes (e.g. a WAV's `sample_rate`), as they arrived.
    #[serde(default)]
    pub attributes: std::collections::BTreeMap<String, String>,
    /// The GPU it lives on; `None` in host memory.
    #[serde(default)]
    pub device: Option<DeviceFields>,
    /// 1 when first published under its name, one more with each update (spec/ipc.md §4).
    pub generation: u64,
    /// When this generation's bytes had landed, in microseconds since the Unix epoch.
    pub landed_unix_us: u64,
}

/// What a listing shows of a tensor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Info {
    /// Id, name, dtype, shape, length, export.
    #[serde(flatten)]
    pub tensor: TensorFields,
    /// Leases held now.
    pub leases: u64,
    /// Deleted, waiting for its last lease.
    pub deleting: bool,
}

/// What a consumer needs to map a tensor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Descriptor {
    /// Id, name, dtype, shape, length, export.
    #[serde(flatten)]
    pub tensor: TensorFields,
    /// Where the tensor starts in the exported memory.
    pub offset: u64,
    /// Bytes of the exported memory (what to map).
    pub alloc_len: u64,
    /// The GPU's UUID in hex; `None` for host memory.
    pub device_uuid: Option<String>,
    /// Reuses of the underlying buffer by the producer's pool.
    pub buffer_reuse: u64,
    /// For `cuda_ipc`: the allocation's 64-byte legacy IPC handle (add `offset`!).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handle: Option<SecretHandle>,
}

/// What happened to a watched tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// A name was published for the first time (or again after a delete).
    Published,
    /// A new generation took the name (replaced, or written in place).
    Updated,
    /// The name was deleted.
    Deleted,
}

/// One message of a `watch` stream (spec/ipc.md §2).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// What happened.
    pub event: EventKind,
    /// The tensor as it is after the event (its last state, for `deleted`).
    pub tensor: Info,
}

/// A legacy CUDA IPC handle in hex: a bearer secret, so `Debug` does not show it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SecretHandle(String);

impl SecretHandle {
    /// The hex form of `bytes`.
    pub fn from_bytes(bytes: &[u8]) -> Self {
        Self(bytes.iter().map(|b| format!("{b:02x}")).collect())
    }

    /// The handle's bytes; `None` unless it is 64 bytes of hex.
    pub fn to_bytes(&self) -> Option<[u8; 64]> {
        let text = self.0.as_bytes();
        if text.len() != 128 {
            return None;
        }
        let mut out = [0u8; 64];
        for (byte, pair) in out.iter_mut().zip(text.chunks_exact(2)) {
            let pair = std::str::from_utf8(pair).ok()?;
            *byte = u8::from_str_radix(pair, 16).ok()?;
        }
        Some(out)
    }
}

impl std::fmt::Debug for SecretHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// Why a producer refused a request: an error reply's code (spec/ipc.md §2), a short string
/// such as `not_found`. Open: unknown codes are kept. (Tensor streams carry numeric codes,
/// [`tensorwire_proto::ErrorCode`].)
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RefusalCode(pub String);

impl RefusalCode {
    /// The request could not be parsed or is not allowed here.
    pub fn bad_request() -> Self {
        Self("bad_request".into())
    }
    /// The versions do not match.
    pub fn unsupported_version() -> Self {
        Self("unsupported_version".into())
    }
    /// No such tensor or lease.
    pub fn not_found() -> Self {
        Self("not_found".into())
    }
    /// A watcher fell too far behind its events and was disconnected.
    pub fn overflow() -> Self {
        Self("overflow".into())
    }
    /// The consumer holds too many leases.
    pub fn lease_limit() -> Self {
        Self("lease_limit".into())
    }
    /// The producer serves as many consumer connections as it allows (in all, or for this
    /// process).
    pub fn too_many_connections() -> Self {
        Self("too_many_connections".into())
    }
    /// The peer's credentials are not allowed.
    pub fn forbidden() -> Self {
        Self("forbidden".into())
    }
    /// A fault of the producer.
    pub fn internal() -> Self {
        Self("internal".into())
    }
}

/// The error part of a reply.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The code.
    pub code: RefusalCode,
    /// What went wrong, for people.
    pub message: String,
}

/// A reply: `ok` plus the fields of the request's answer, or an error.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reply {
    /// Whether the request succeeded.
    pub ok: bool,
    /// With `ok: false`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorBody>,
    /// `hello`'s answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<u32>,
    /// `list`'s answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensors: Option<Vec<Info>>,
    /// `info`'s answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensor: Option<Info>,
    /// `open`'s lease.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<u64>,
    /// `open`'s descriptor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub descriptor: Option<Descriptor>,
    /// `delete`'s answer: the tensor waits for its last lease.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deferred: Option<bool>,
    /// `devices`' answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub devices: Option<Vec<GpuInfo>>,
}

impl Reply {
    /// A success with no fields yet.
    pub fn ok() -> Self {
        Self {
            ok: true,
            ..Self::default()
        }
    }

    /// A failure.
    pub fn error(code: RefusalCode, message: impl Into<String>) -> Self {
        Self::refusal(ErrorBody {
            code,
            message: message.into(),
        })
    }

    /// A failure with this error body.
    pub fn refusal(error: ErrorBody) -> Self {
        Self {
            error: Some(error),
            ..Self::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handle_round_trips_through_hex_and_never_shows_in_debug() {
        let bytes: [u8; 64] = std::array::from_fn(|i| (i * 7 + 1) as u8);
        let handle = SecretHandle::from_bytes(&bytes);
        assert_eq!(handle.to_bytes(), Some(bytes));
        let shown = format!("{handle:?}");
        assert!(!shown.contains("010815"), "{shown}");
        assert_eq!(SecretHandle("zz".repeat(64)).to_bytes(), None);
        assert_eq!(SecretHandle("01".into()).to_bytes(), None);
    }

    #[test]
    fn a_descriptor_without_a_handle_still_parses() {
        let json = r#"{"id":"67e55044-10b1-426f-9247-bb680e5fe0c8","name":"w","dtype":"U8",
            "shape":[4],"byte_len":4,"numel":4,"element_size":1,"export":"host","offset":0,
            "alloc_len":4,"device_uuid":null,"buffer_reuse":0,"generation":1,
            "landed_unix_us":0}"#;
        let descriptor: Descriptor = serde_json::from_str(json).unwrap();
        assert_eq!(descriptor.handle, None);
    }
}
