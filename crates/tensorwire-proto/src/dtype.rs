//! Element types, device hints and checksum algorithms as they appear on the wire (spec §5).

use std::fmt;

macro_rules! dtypes {
    ($($(#[doc = $doc:literal])* $variant:ident = $code:literal, $size:literal, $name:literal;)*) => {
        /// An element type. Elements are little-endian and tensors C-contiguous (spec §5.1).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum DType {
            $($(#[doc = $doc])* $variant,)*
        }

        impl DType {
            /// Every dtype of this protocol version.
            pub const ALL: &'static [DType] = &[$(DType::$variant,)*];

            /// The dtype's wire code.
            pub fn code(self) -> u8 {
                match self { $(DType::$variant => $code,)* }
            }

            /// The dtype with this wire code, if this version defines it.
            pub fn from_code(code: u8) -> Option<DType> {
                match code { $($code => Some(DType::$variant),)* _ => None }
            }

            /// Bytes per element.
            pub fn size(self) -> u64 {
                match self { $(DType::$variant => $size,)* }
            }

            /// The name `safetensors` uses for this dtype.
            pub fn name(self) -> &'static str {
                match self { $(DType::$variant => $name,)* }
            }

            /// The dtype `safetensors` calls `name`.
            pub fn from_name(name: &str) -> Option<DType> {
                match name { $($name => Some(DType::$variant),)* _ => None }
            }

            /// As [`from_name`](Self::from_name), in any case (`bf16`, `Bf16`, `BF16`), as
            /// people type them.
            pub fn from_name_any_case(name: &str) -> Option<DType> {
                Self::ALL.iter().copied().find(|dtype| dtype.name().eq_ignore_ascii_case(name))
            }
        }
    };
}

dtypes! {
    /// Boolean, one byte, 0 or 1.
    Bool = 1, 1, "BOOL";
    /// Unsigned 8-bit integer.
    U8 = 2, 1, "U8";
    /// Signed 8-bit integer.
    I8 = 3, 1, "I8";
    /// Unsigned 16-bit integer.
    U16 = 4, 2, "U16";
    /// Signed 16-bit integer.
    I16 = 5, 2, "I16";
    /// Unsigned 32-bit integer.
    U32 = 6, 4, "U32";
    /// Signed 32-bit integer.
    I32 = 7, 4, "I32";
    /// Unsigned 64-bit integer.
    U64 = 8, 8, "U64";
    /// Signed 64-bit integer.
    I64 = 9, 8, "I64";
    /// IEEE 754 half precision.
    F16 = 10, 2, "F16";
    /// bfloat16.
    BF16 = 11, 2, "BF16";
    /// IEEE 754 single precision.
    F32 = 12, 4, "F32";
    /// IEEE 754 double precision.
    F64 = 13, 8, "F64";
    /// 8-bit float, 4 exponent and 3 mantissa bits (OCP FP8 E4M3).
    F8E4M3 = 14, 1, "F8_E4M3";
    /// 8-bit float, 5 exponent and 2 mantissa bits (OCP FP8 E5M2).
    F8E5M2 = 15, 1, "F8_E5M2";
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where the sender would like the tensor to land; the receiver may ignore it (spec §5.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// No preference.
    #[default]
    Any,
    /// Host memory.
    Host,
    /// The CUDA device with this ordinal on the receiver.
    Cuda(u16),
}

impl Device {
    /// The device's wire kind and index.
    pub fn to_wire(self) -> (u8, u16) {
        match self {
            Device::Any => (0, 0),
            Device::Host => (1, 0),
            Device::Cuda(index) => (2, index),
        }
    }

    /// The device for a wire kind and index; `None` for an unknown kind, or a non-zero index
    /// on a kind that has none (spec §5.2: one encoding per device).
    pub fn from_wire(kind: u8, index: u16) -> Option<Device> {
        match (kind, index) {
            (0, 0) => Some(Device::Any),
            (1, 0) => Some(Device::Host),
            (2, index) => Some(Device::Cuda(index)),
            _ => None,
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Any => f.write_str("any"),
            Device::Host => f.write_str("host"),
            Device::Cuda(index) => write!(f, "cuda:{index}"),
        }
    }
}

/// A whole-tensor checksum algorithm (spec §5.3). Open: unknown codes survive decoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ChecksumAlgorithm(pub u8);

impl ChecksumAlgorithm {
    /// CRC-32C (Castagnoli), reflected, as in iSCSI; carried in the low 32 bits of END.
    pub const CRC32C: ChecksumAlgorithm = ChecksumAlgorithm(1);
}

impl Default for ChecksumAlgorithm {
    fn default() -> Self {
        Self::CRC32C
    }
}
