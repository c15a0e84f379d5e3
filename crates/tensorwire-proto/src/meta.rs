//! Tensor metadata: what METADATA carries (spec §6.1).

use std::sync::Arc;

use crate::dtype::{ChecksumAlgorithm, DType, Device};
use crate::error::{ErrorCode, ProtocolError};

/// A tensor's description: name, dtype, shape, byte length, device hint and attributes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorMeta {
    name: String,
    dtype: DType,
    shape: Vec<u64>,
    byte_len: u64,
    device: Device,
    checksum: ChecksumAlgorithm,
    /// Shared between clones: a receiver hands a tensor's METADATA to several owners, and
    /// its attributes may be most of a 64 KiB frame that the METADATA budget counts once.
    /// `None` when there are none (never an empty list), so a tensor without attributes
    /// allocates nothing for them.
    attributes: Option<Arc<Vec<(String, String)>>>,
}

impl TensorMeta {
    /// A nameless tensor of this shape and dtype; fails if its byte length overflows `u64`.
    pub fn new(shape: impl Into<Vec<u64>>, dtype: DType) -> Result<Self, ProtocolError> {
        let shape = shape.into();
        let byte_len = byte_len_of(&shape, dtype).ok_or_else(|| ProtocolError::Local {
            code: ErrorCode::LENGTH_MISMATCH,
            reason: format!("shape {shape:?} of {dtype} overflows a 64-bit byte length"),
        })?;
        Ok(Self {
            name: String::new(),
            dtype,
            shape,
            byte_len,
            device: Device::Any,
            checksum: ChecksumAlgorithm::CRC32C,
            attributes: None,
        })
    }

    /// Builds metadata from decoded wire fields, checking shape × dtype == `byte_len` (spec §6.1).
    pub(crate) fn from_wire(
        name: String,
        dtype: DType,
        shape: Vec<u64>,
        byte_len: u64,
        device: Device,
        checksum: ChecksumAlgorithm,
        attributes: Vec<(String, String)>,
    ) -> Result<Self, ProtocolError> {
        match byte_len_of(&shape, dtype) {
            Some(computed) if computed == byte_len => Ok(Self {
                name,
                dtype,
                shape,
                byte_len,
                device,
                checksum,
                attributes: (!attributes.is_empty()).then(|| Arc::new(attributes)),
            }),
            Some(computed) => Err(ProtocolError::violation(
                ErrorCode::LENGTH_MISMATCH,
                format!("shape {shape:?} of {dtype} is {computed} bytes, METADATA says {byte_len}"),
            )),
            None => Err(ProtocolError::violation(
                ErrorCode::LENGTH_MISMATCH,
                format!("shape {shape:?} of {dtype} overflows a 64-bit byte length"),
            )),
        }
    }

    /// Sets the tensor's name.
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Sets the device the sender would like the tensor on.
    pub fn with_device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }

    /// Sets the checksum algorithm.
    pub fn with_checksum(mut self, checksum: ChecksumAlgorithm) -> Self {
        self.checksum = checksum;
        self
    }

    /// Adds a string attribute such as `sample_rate`.
    pub fn with_attribute(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        let attributes = self.attributes.get_or_insert_with(Arc::default);
        Arc::make_mut(attributes).push((key.into(), value.into()));
        self
    }

    /// The same tensor with its outermost dimension `rows` (a slice of it, or the whole a
    /// slice belongs to, spec §15); `None` for a scalar or a byte length past 64 bits.
    pub fn with_rows(&self, rows: u64) -> Option<Self> {
        let mut shape = self.shape.clone();
        *shape.first_mut()? = rows;
        let byte_len = byte_len_of(&shape, self.dtype)?;
        Some(Self {
            shape,
            byte_len,
            ..self.clone()
        })
    }

    /// Without the attributes whose key is one of `keys`.
    pub fn without_attributes(mut self, keys: &[&str]) -> Self {
        if let Some(attributes) = &mut self.attributes {
            Arc::make_mut(attributes).retain(|(key, _)| !keys.contains(&key.as_str()));
            if attributes.is_empty() {
                self.attributes = None;
            }
        }
        self
    }

    /// The tensor's name (may be empty).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The shape, outermost dimension first.
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// Total bytes: product of the shape times the dtype's size.
    pub fn byte_len(&self) -> u64 {
        self.byte_len
    }

    /// Number of elements.
    pub fn element_count(&self) -> u64 {
        self.byte_len / self.dtype.size()
    }

    /// The device hint.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The checksum algorithm END will use.
    pub fn checksum(&self) -> ChecksumAlgorithm {
        self.checksum
    }

    /// The attributes, in the order they were added.
    pub fn attributes(&self) -> &[(String, String)] {
        self.attributes.as_deref().map_or(&[], Vec::as_slice)
    }

    /// The value of the first attribute named `key`.
    pub fn attribute(&self, key: &str) -> Option<&str> {
        self.attributes()
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// Product of `shape` and the dtype's size, or `None` on overflow.
fn byte_len_of(shape: &[u64], dtype: DType) -> Option<u64> {
    shape
        .iter()
        .try_fold(dtype.size(), |acc, &dim| acc.checked_mul(dim))
}
