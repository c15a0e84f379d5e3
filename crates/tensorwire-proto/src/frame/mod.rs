//! Frames: the header, the type registry and dispatch to one module per frame type (spec §6).
//!
//! Every frame is `type: u8 | length: u32 LE | body: [u8; length]`; the body's layout
//! depends on the type. All integers are little-endian and fixed width.

mod accept;
mod cancel;
mod complete;
mod credit;
mod data;
mod early;
mod early_credit;
mod end;
pub(crate) mod header;
mod metadata;
mod reject;
pub mod wire;

pub use accept::Accept;
pub use cancel::Cancel;
pub use complete::Complete;
pub use credit::Credit;
pub use data::Data;
pub use early::Early;
pub use early_credit::EarlyCredit;
pub use end::End;
pub use header::{FrameType, HEADER_LEN};
pub use metadata::Metadata;
pub use reject::Reject;

use bytes::{BufMut, Bytes, BytesMut};

use crate::error::{ErrorCode, ProtocolError};
use crate::limits::Limits;
use crate::meta::TensorMeta;
use crate::payload::Payload;

/// One decoded frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// METADATA (spec §6.1).
    Metadata(Metadata),
    /// DATA (spec §6.2).
    Data(Data),
    /// END (spec §6.3).
    End(End),
    /// CANCEL (spec §6.4).
    Cancel(Cancel),
    /// ACCEPT (spec §6.5).
    Accept(Accept),
    /// REJECT (spec §6.6).
    Reject(Reject),
    /// CREDIT (spec §6.7).
    Credit(Credit),
    /// COMPLETE (spec §6.8).
    Complete(Complete),
    /// EARLY (spec §6.9).
    Early(Early),
    /// EARLY_CREDIT (spec §6.10).
    EarlyCredit(EarlyCredit),
}

/// Each frame type's struct converts into its `Frame` variant.
macro_rules! into_frame {
    ($($variant:ident),*) => {$(
        impl From<$variant> for Frame {
            fn from(f: $variant) -> Frame {
                Frame::$variant(f)
            }
        }
    )*};
}

into_frame!(
    Metadata,
    Data,
    End,
    Cancel,
    Accept,
    Reject,
    Credit,
    Complete,
    Early,
    EarlyCredit
);

impl From<TensorMeta> for Frame {
    fn from(meta: TensorMeta) -> Frame {
        Frame::Metadata(Metadata { meta })
    }
}

impl Frame {
    /// This frame's type code.
    pub fn frame_type(&self) -> FrameType {
        match self {
            Frame::Metadata(_) => FrameType::METADATA,
            Frame::Data(_) => FrameType::DATA,
            Frame::End(_) => FrameType::END,
            Frame::Cancel(_) => FrameType::CANCEL,
            Frame::Accept(_) => FrameType::ACCEPT,
            Frame::Reject(_) => FrameType::REJECT,
            Frame::Credit(_) => FrameType::CREDIT,
            Frame::Complete(_) => FrameType::COMPLETE,
            Frame::Early(_) => FrameType::EARLY,
            Frame::EarlyCredit(_) => FrameType::EARLY_CREDIT,
        }
    }

    /// Length of the body (everything after the header), DATA payload included.
    pub fn body_len(&self) -> usize {
        match self {
            Frame::Metadata(f) => f.body_len(),
            Frame::Data(f) => f.body_len(),
            Frame::End(_) => End::BODY_LEN,
            Frame::Cancel(f) => f.body_len(),
            Frame::Accept(_) => Accept::BODY_LEN,
            Frame::Reject(f) => f.body_len(),
            Frame::Credit(_) => Credit::BODY_LEN,
            Frame::Complete(f) => f.body_len(),
            Frame::Early(_) => Early::BODY_LEN,
            Frame::EarlyCredit(_) => EarlyCredit::BODY_LEN,
        }
    }

    /// Length of the whole encoded frame.
    pub fn encoded_len(&self) -> usize {
        HEADER_LEN + self.body_len()
    }

    /// Writes the frame except a DATA payload, which the caller sends as its own `Bytes`.
    pub fn encode_header(&self, dst: &mut BytesMut) {
        let body_len = self.body_len();
        debug_assert!(u32::try_from(body_len).is_ok(), "frame body exceeds u32");
        dst.put_u8(self.frame_type().0);
        dst.put_u32_le(body_len as u32);
        match self {
            Frame::Metadata(f) => f.encode_body(dst),
            Frame::Data(f) => f.encode_body_header(dst),
            Frame::End(f) => f.encode_body(dst),
            Frame::Cancel(f) => f.encode_body(dst),
            Frame::Accept(f) => f.encode_body(dst),
            Frame::Reject(f) => f.encode_body(dst),
            Frame::Credit(f) => f.encode_body(dst),
            Frame::EarlyCredit(f) => f.encode_body(dst),
            Frame::Complete(f) => f.encode_body(dst),
            Frame::Early(_) => {}
        }
    }

    /// The DATA payload that follows `encode_header`'s bytes on the wire, if any.
    pub fn payload(&self) -> Option<&Payload> {
        match self {
            Frame::Data(f) => Some(&f.payload),
            _ => None,
        }
    }

    /// Writes the whole frame, copying any DATA payload (for tests, vectors and small frames).
    pub fn encode(&self, dst: &mut BytesMut) {
        self.encode_header(dst);
        if let Some(payload) = self.payload() {
            payload
                .parts()
                .iter()
                .for_each(|p| dst.extend_from_slice(p));
        }
    }

    /// The whole frame as one buffer.
    pub fn to_bytes(&self) -> Bytes {
        let mut dst = BytesMut::with_capacity(self.encoded_len());
        self.encode(&mut dst);
        dst.freeze()
    }
}

/// Checks a header's body length against the type's layout and the limits, before the
/// body is awaited (spec §8).
pub(crate) use metadata::{FIXED_LEN as METADATA_FIXED_LEN, check_fixed as check_metadata_fixed};

pub(crate) fn check_header(ty: FrameType, len: u32, limits: &Limits) -> Result<(), ProtocolError> {
    match ty {
        FrameType::METADATA => metadata::check_len(len, limits),
        FrameType::DATA => data::check_len(len, limits),
        FrameType::END => wire::exact_len(ty, len, End::BODY_LEN),
        FrameType::ACCEPT => wire::exact_len(ty, len, Accept::BODY_LEN),
        FrameType::CREDIT => wire::exact_len(ty, len, Credit::BODY_LEN),
        FrameType::COMPLETE => complete::check_len(len),
        FrameType::EARLY => wire::exact_len(ty, len, Early::BODY_LEN),
        FrameType::EARLY_CREDIT => wire::exact_len(ty, len, EarlyCredit::BODY_LEN),
        FrameType::CANCEL | FrameType::REJECT => wire::check_reason_len(ty, len, limits),
        _ => Err(ProtocolError::malformed(
            ErrorCode::UNKNOWN_FRAME_TYPE,
            format!("{ty}"),
        )),
    }
}

/// Longest fixed-length body (EARLY_CREDIT's).
const SHORT_BODY_MAX: usize = EarlyCredit::BODY_LEN;

/// A fixed-length body, whose length `check_header` matched exactly, copied into `dst`.
fn short_body<'d>(
    body: &mut crate::payload::ByteQueueBody<'_>,
    dst: &'d mut [u8; SHORT_BODY_MAX],
) -> Result<&'d [u8], ProtocolError> {
    body.copy_rest(dst).ok_or_else(|| {
        ProtocolError::malformed(
            ErrorCode::FRAME_MALFORMED,
            "a fixed-length body longer than any frame type's",
        )
    })
}

/// Decodes a body whose length `check_header` accepted and which is fully buffered.
pub(crate) fn decode_body(
    ty: FrameType,
    body: &mut crate::payload::ByteQueueBody<'_>,
    limits: &Limits,
) -> Result<Frame, ProtocolError> {
    // The fixed bodies (END, ACCEPT, CREDIT, EARLY_CREDIT) are read through this, not
    // collected: a small tensor's frames decode without allocating.
    let mut short = [0u8; SHORT_BODY_MAX];
    Ok(match ty {
        FrameType::METADATA => Frame::Metadata(Metadata::decode(body, limits)?),
        FrameType::DATA => Frame::Data(Data::decode(body)),
        FrameType::END => Frame::End(End::decode(short_body(body, &mut short)?)?),
        FrameType::CANCEL => Frame::Cancel(Cancel::decode(&body.contiguous())?),
        FrameType::ACCEPT => Frame::Accept(Accept::decode(short_body(body, &mut short)?)?),
        FrameType::REJECT => Frame::Reject(Reject::decode(&body.contiguous())?),
        FrameType::CREDIT => Frame::Credit(Credit::decode(short_body(body, &mut short)?)?),
        FrameType::COMPLETE => Frame::Complete(Complete::decode(&body.contiguous())?),
        FrameType::EARLY => Frame::Early(Early),
        FrameType::EARLY_CREDIT => {
            Frame::EarlyCredit(EarlyCredit::decode(short_body(body, &mut short)?)?)
        }
        _ => {
            return Err(ProtocolError::malformed(
                ErrorCode::UNKNOWN_FRAME_TYPE,
                format!("{ty}"),
            ));
        }
    })
}
