//! METADATA (spec §6.1): describes the tensor; the first frame on every stream.
//!
//! ```text
//! type = 0x01 | length
//! byte_len: u64 | dtype: u8 | checksum: u8 | device_kind: u8 | device_index: u16
//! ndim: u8 | name_len: u16 | attr_count: u16            (the fixed part, 18 bytes)
//! dims: [u64; ndim] | name: [u8; name_len]
//! attrs: attr_count × (key_len: u16 | key | value_len: u16 | value)
//! ```
//! The fixed part comes first so every limit is checked before anything is allocated.

use bytes::{BufMut, Bytes, BytesMut};

use super::header::FrameType;
use super::wire::Reader;
use crate::dtype::{ChecksumAlgorithm, DType, Device};
use crate::error::{ErrorCode, ProtocolError};
use crate::limits::Limits;
use crate::meta::TensorMeta;
use crate::payload::ByteQueueBody;

/// Describes the tensor that the stream carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Metadata {
    /// The tensor's description.
    pub meta: TensorMeta,
}

/// Bytes of the fixed part of the body.
pub(crate) const FIXED_LEN: usize = 18;

/// Checks the fixed part's limits from its raw bytes, before the rest of the body has
/// arrived (spec §8: a 1 TB claim is refused from its first 23 bytes).
pub(crate) fn check_fixed(raw: &[u8; FIXED_LEN], limits: &Limits) -> Result<(), ProtocolError> {
    Fixed::read(&mut Reader::new(raw, FrameType::METADATA))?.check(limits)
}

/// The fixed part, read before anything else so limits are checked without allocating.
struct Fixed {
    byte_len: u64,
    dtype: u8,
    checksum: u8,
    device_kind: u8,
    device_index: u16,
    ndim: u8,
    name_len: u16,
    attr_count: u16,
}

impl Fixed {
    fn read(r: &mut Reader<'_>) -> Result<Self, ProtocolError> {
        Ok(Self {
            byte_len: r.u64()?,
            dtype: r.u8()?,
            checksum: r.u8()?,
            device_kind: r.u8()?,
            device_index: r.u16()?,
            ndim: r.u8()?,
            name_len: r.u16()?,
            attr_count: r.u16()?,
        })
    }

    fn check(&self, limits: &Limits) -> Result<(), ProtocolError> {
        let checks = [
            (
                ErrorCode::TENSOR_TOO_LARGE,
                "tensor byte length",
                self.byte_len,
                limits.max_tensor_len,
            ),
            (
                ErrorCode::TOO_MANY_DIMS,
                "dimension count",
                self.ndim.into(),
                limits.max_dims.into(),
            ),
            (
                ErrorCode::NAME_TOO_LONG,
                "name length",
                self.name_len.into(),
                limits.max_name_len.into(),
            ),
            (
                ErrorCode::TOO_MANY_ATTRIBUTES,
                "attribute count",
                self.attr_count.into(),
                limits.max_attributes.into(),
            ),
        ];
        for (code, what, value, limit) in checks {
            if value > limit {
                return Err(ProtocolError::LimitExceeded {
                    code,
                    what,
                    value,
                    limit,
                });
            }
        }
        Ok(())
    }
}

impl Metadata {
    pub(crate) fn body_len(&self) -> usize {
        let m = &self.meta;
        let attrs: usize = m
            .attributes()
            .iter()
            .map(|(k, v)| 4 + k.len() + v.len())
            .sum();
        FIXED_LEN + 8 * m.shape().len() + m.name().len() + attrs
    }

    /// Decodes a fully buffered body: the fixed part and limits first, then the rest.
    pub(crate) fn decode(
        body: &mut ByteQueueBody<'_>,
        limits: &Limits,
    ) -> Result<Self, ProtocolError> {
        let mut fixed_raw = [0u8; FIXED_LEN];
        if !body.peek(&mut fixed_raw) {
            return Err(too_short());
        }
        Fixed::read(&mut Reader::new(&fixed_raw, FrameType::METADATA))?.check(limits)?;
        let raw: Bytes = body.contiguous();
        Self::decode_checked(&raw, limits)
    }

    fn decode_checked(raw: &[u8], limits: &Limits) -> Result<Self, ProtocolError> {
        let mut r = Reader::new(raw, FrameType::METADATA);
        let fixed = Fixed::read(&mut r)?;
        let dtype = DType::from_code(fixed.dtype).ok_or_else(|| {
            ProtocolError::malformed(
                ErrorCode::UNKNOWN_DTYPE,
                format!("dtype code {}", fixed.dtype),
            )
        })?;
        let device = Device::from_wire(fixed.device_kind, fixed.device_index).ok_or_else(|| {
            ProtocolError::malformed(
                ErrorCode::UNKNOWN_DEVICE,
                format!("device kind {}", fixed.device_kind),
            )
        })?;
        // Counts were checked against limits, so these allocations are bounded.
        let shape = (0..fixed.ndim)
            .map(|_| r.u64())
            .collect::<Result<Vec<_>, _>>()?;
        let name = r.string(fixed.name_len.into())?;
        let mut attributes = Vec::with_capacity(fixed.attr_count.into());
        for _ in 0..fixed.attr_count {
            let key = read_attribute_part(&mut r, limits)?;
            let value = read_attribute_part(&mut r, limits)?;
            attributes.push((key, value));
        }
        r.finish()?;
        let meta = TensorMeta::from_wire(
            name,
            dtype,
            shape,
            fixed.byte_len,
            device,
            ChecksumAlgorithm(fixed.checksum),
            attributes,
        )?;
        Ok(Self { meta })
    }

    pub(crate) fn encode_body(&self, dst: &mut BytesMut) {
        let m = &self.meta;
        let (device_kind, device_index) = m.device().to_wire();
        dst.put_u64_le(m.byte_len());
        dst.put_u8(m.dtype().code());
        dst.put_u8(m.checksum().0);
        dst.put_u8(device_kind);
        dst.put_u16_le(device_index);
        dst.put_u8(m.shape().len() as u8);
        dst.put_u16_le(m.name().len() as u16);
        dst.put_u16_le(m.attributes().len() as u16);
        m.shape().iter().for_each(|&d| dst.put_u64_le(d));
        dst.put_slice(m.name().as_bytes());
        for (key, value) in m.attributes() {
            for part in [key, value] {
                dst.put_u16_le(part.len() as u16);
                dst.put_slice(part.as_bytes());
            }
        }
    }
}

fn read_attribute_part(r: &mut Reader<'_>, limits: &Limits) -> Result<String, ProtocolError> {
    let len = r.u16()?;
    if len > limits.max_attribute_len {
        return Err(ProtocolError::LimitExceeded {
            code: ErrorCode::ATTRIBUTE_TOO_LONG,
            what: "attribute key or value length",
            value: len.into(),
            limit: limits.max_attribute_len.into(),
        });
    }
    r.string(len.into())
}

fn too_short() -> ProtocolError {
    ProtocolError::malformed(
        ErrorCode::FRAME_MALFORMED,
        format!("METADATA body is shorter than its {FIXED_LEN}-byte fixed part"),
    )
}

/// Checks a METADATA header's body length (spec §8).
pub(crate) fn check_len(len: u32, limits: &Limits) -> Result<(), ProtocolError> {
    if len > limits.max_metadata_len {
        return Err(ProtocolError::LimitExceeded {
            code: ErrorCode::METADATA_TOO_LARGE,
            what: "METADATA body length",
            value: len.into(),
            limit: limits.max_metadata_len.into(),
        });
    }
    if (len as usize) < FIXED_LEN {
        return Err(too_short());
    }
    Ok(())
}
