//! Split tensors (spec §15, version 1.3): one tensor sent as several parts of consecutive
//! rows, each an ordinary tensor on its own stream (on any of the sender's connections), put
//! back together in one destination and delivered once.
//!
//! A part is a slice of the whole along its outermost dimension, described by four attributes
//! of its METADATA; its own shape, byte length and checksum are the slice's, so every part is
//! checked by the rules of §6–§7 as any tensor is. [`SplitPart::of`] reads and checks the
//! attributes, [`plan_split`] makes a sender's parts, and [`SplitAssembly`] checks that the
//! parts of one whole agree and cover it exactly.

use std::fmt;

use crate::error::{ErrorCode, ProtocolError};
use crate::meta::TensorMeta;
use crate::ranges::ReceivedRanges;

/// Attribute: the whole's id, 32 lowercase hexadecimal digits, the same on every part.
pub const SPLIT_ID: &str = "tensorwire.split.id";
/// Attribute: the whole's row (index in its outermost dimension) where the part starts.
pub const SPLIT_ROW: &str = "tensorwire.split.row";
/// Attribute: the whole's outermost dimension.
pub const SPLIT_ROWS: &str = "tensorwire.split.rows";
/// Attribute: how many parts the whole is sent as.
pub const SPLIT_PARTS: &str = "tensorwire.split.parts";

/// The most parts one whole may be sent as (spec §15).
pub const MAX_PARTS: u64 = 256;

const ATTRIBUTES: [&str; 4] = [SPLIT_ID, SPLIT_ROW, SPLIT_ROWS, SPLIT_PARTS];

/// The id a sender gives one split tensor: random, so that another peer cannot guess it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SplitId(pub u128);

impl fmt::Display for SplitId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl fmt::Debug for SplitId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// One part of a split tensor, as its METADATA describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SplitPart {
    id: SplitId,
    first_row: u64,
    parts: u64,
    offset: u64,
    len: u64,
    whole: TensorMeta,
}

fn mismatch(detail: impl Into<String>) -> ProtocolError {
    ProtocolError::violation(ErrorCode::SPLIT_MISMATCH, detail)
}

/// A decimal `u64` with digits only (no sign, no spaces), as spec §15 writes numbers.
fn decimal(meta: &TensorMeta, key: &str) -> Result<u64, ProtocolError> {
    let value = meta.attribute(key).unwrap_or_default();
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return Err(mismatch(format!(
            "{key} is {value:?}, not a decimal number"
        )));
    }
    value
        .parse()
        .map_err(|_| mismatch(format!("{key} is {value:?}, past 64 bits")))
}

impl SplitPart {
    /// Reads the split attributes of `meta`: `None` for a tensor sent whole, the part
    /// otherwise. `max_whole_len` is the receiver's largest tensor, which applies to the
    /// whole (TENSOR_TOO_LARGE); attributes that are incomplete, malformed or inconsistent
    /// with the part's shape are SPLIT_MISMATCH.
    pub fn of(meta: &TensorMeta, max_whole_len: u64) -> Result<Option<Self>, ProtocolError> {
        let present = ATTRIBUTES
            .iter()
            .filter(|key| meta.attribute(key).is_some())
            .count();
        if present == 0 {
            return Ok(None);
        }
        if present < ATTRIBUTES.len() {
            return Err(mismatch(format!(
                "a part carries {present} of the 4 split attributes"
            )));
        }
        let id = meta.attribute(SPLIT_ID).unwrap_or_default();
        if id.len() != 32 || !id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(mismatch(format!(
                "{SPLIT_ID} is {id:?}, not 32 lowercase hex digits"
            )));
        }
        let id = SplitId(u128::from_str_radix(id, 16).map_err(|_| mismatch("split id"))?);
        let (first_row, rows, parts) = (
            decimal(meta, SPLIT_ROW)?,
            decimal(meta, SPLIT_ROWS)?,
            decimal(meta, SPLIT_PARTS)?,
        );
        let Some(&part_rows) = meta.shape().first() else {
            return Err(mismatch("a scalar cannot be a part"));
        };
        if part_rows == 0
            || first_row
                .checked_add(part_rows)
                .is_none_or(|end| end > rows)
        {
            return Err(mismatch(format!(
                "rows {first_row}..+{part_rows} are not inside the whole's {rows}"
            )));
        }
        if !(2..=MAX_PARTS).contains(&parts) || parts > rows {
            return Err(mismatch(format!(
                "{parts} parts of {rows} rows (2 to {MAX_PARTS}, at most one per row)"
            )));
        }
        let whole = meta
            .with_rows(rows)
            .ok_or_else(|| mismatch(format!("a whole of {rows} rows overflows 64 bits")))?
            .without_attributes(&ATTRIBUTES);
        if whole.byte_len() > max_whole_len {
            return Err(ProtocolError::LimitExceeded {
                code: ErrorCode::TENSOR_TOO_LARGE,
                what: "a split tensor's whole byte_len",
                value: whole.byte_len(),
                limit: max_whole_len,
            });
        }
        // Rows of a whole that fits in 64 bits: neither product overflows.
        let row_bytes = whole.byte_len() / rows;
        if row_bytes == 0 {
            return Err(mismatch("a tensor of no bytes is not split"));
        }
        Ok(Some(Self {
            id,
            first_row,
            parts,
            offset: first_row * row_bytes,
            len: meta.byte_len(),
            whole,
        }))
    }

    /// The whole's id.
    pub fn id(&self) -> SplitId {
        self.id
    }

    /// The whole, as it is delivered: the part's name, dtype, device hint and attributes
    /// (the split ones removed), with all its rows.
    pub fn whole(&self) -> &TensorMeta {
        &self.whole
    }

    /// Where the part's first byte goes in the whole.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The part's length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the part has no bytes (never, for a part that [`of`](Self::of) accepted).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The whole's row where the part starts.
    pub fn first_row(&self) -> u64 {
        self.first_row
    }

    /// How many parts the whole is sent as.
    pub fn parts(&self) -> u64 {
        self.parts
    }
}

/// One part a sender sends: its METADATA and where its bytes start in the whole.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedPart {
    /// The part's METADATA.
    pub meta: TensorMeta,
    /// Its first byte's offset in the whole.
    pub offset: u64,
}

/// Splits `whole` into `parts` parts of consecutive rows (the first ones a row longer when
/// the rows do not divide evenly), each carrying the split attributes with `id`.
///
/// Fails (Misuse) for a scalar, for fewer than 2 or more than [`MAX_PARTS`] parts, for more
/// parts than rows, and for a tensor that already carries split attributes.
pub fn plan_split(
    whole: &TensorMeta,
    parts: u64,
    id: SplitId,
) -> Result<Vec<PlannedPart>, ProtocolError> {
    let Some(&rows) = whole.shape().first() else {
        return Err(ProtocolError::Misuse("a scalar cannot be split"));
    };
    if !(2..=MAX_PARTS).contains(&parts) || parts > rows {
        return Err(ProtocolError::Misuse(
            "a tensor splits into 2 to 256 parts, at most one per row",
        ));
    }
    if ATTRIBUTES.iter().any(|key| whole.attribute(key).is_some()) {
        return Err(ProtocolError::Misuse("the tensor is a part already"));
    }
    if whole.byte_len() == 0 {
        return Err(ProtocolError::Misuse("a tensor of no bytes is not split"));
    }
    let row_bytes = whole.byte_len() / rows;
    let (each, longer) = (rows / parts, rows % parts);
    let mut planned = Vec::with_capacity(parts as usize);
    let mut row = 0;
    for index in 0..parts {
        let part_rows = each + u64::from(index < longer);
        let meta = whole
            .with_rows(part_rows)
            .ok_or(ProtocolError::Misuse(
                "a part is never longer than its whole",
            ))?
            .with_attribute(SPLIT_ID, id.to_string())
            .with_attribute(SPLIT_ROW, row.to_string())
            .with_attribute(SPLIT_ROWS, rows.to_string())
            .with_attribute(SPLIT_PARTS, parts.to_string());
        planned.push(PlannedPart {
            meta,
            offset: row * row_bytes,
        });
        row += part_rows;
    }
    Ok(planned)
}

/// The parts of one whole that have arrived and landed: checks that they agree with each
/// other and cover the whole exactly once (spec §15).
#[derive(Clone, Debug)]
pub struct SplitAssembly {
    whole: TensorMeta,
    id: SplitId,
    parts: u64,
    /// The rows of the parts joined so far (CRCs unused).
    rows: ReceivedRanges,
    joined: u64,
    landed: u64,
}

impl SplitAssembly {
    /// An assembly for the whole that `first` belongs to; `first` still has to
    /// [`join`](Self::join).
    pub fn new(first: &SplitPart) -> Self {
        Self {
            whole: first.whole.clone(),
            id: first.id,
            parts: first.parts,
            rows: ReceivedRanges::new(first.parts as usize),
            joined: 0,
            landed: 0,
        }
    }

    /// The whole being assembled.
    pub fn whole(&self) -> &TensorMeta {
        &self.whole
    }

    /// Adds an arriving part. SPLIT_MISMATCH if it describes another whole (name, dtype,
    /// shape, device hint or part count differ), overlaps a part joined before, is one part
    /// too many, or is the last announced part while rows are still missing.
    pub fn join(&mut self, part: &SplitPart) -> Result<(), ProtocolError> {
        let (mine, theirs) = (&self.whole, &part.whole);
        if part.id != self.id {
            return Err(mismatch(format!(
                "part of {} joined to {}",
                part.id, self.id
            )));
        }
        if theirs.name() != mine.name()
            || theirs.dtype() != mine.dtype()
            || theirs.shape() != mine.shape()
            || theirs.device() != mine.device()
            || part.parts != self.parts
        {
            return Err(mismatch(format!(
                "a part describes {:?} {} {:?} in {} parts; the first described {:?} {} {:?} in {}",
                theirs.name(),
                theirs.dtype(),
                theirs.shape(),
                part.parts,
                mine.name(),
                mine.dtype(),
                mine.shape(),
                self.parts
            )));
        }
        if self.joined == self.parts {
            return Err(mismatch(format!(
                "more than the {} parts announced",
                self.parts
            )));
        }
        let rows = part.first_row..part.first_row + part.len / self.row_bytes();
        self.rows.insert(rows.start, rows.end, 0).map_err(|_| {
            mismatch(format!(
                "rows {}..{} overlap a part that arrived before",
                rows.start, rows.end
            ))
        })?;
        self.joined += 1;
        let total = self.whole.shape()[0];
        if self.joined == self.parts
            && let Some((start, end)) = self.rows.first_gap(total)
        {
            return Err(mismatch(format!(
                "all {} parts arrived, yet rows {start}..{end} are missing",
                self.parts
            )));
        }
        Ok(())
    }

    /// Whether every announced part has joined.
    pub fn all_joined(&self) -> bool {
        self.joined == self.parts
    }

    /// Counts one joined part whose bytes all landed; true once the whole has landed.
    pub fn landed(&mut self) -> Result<bool, ProtocolError> {
        if self.landed == self.joined {
            return Err(ProtocolError::Misuse("a part landed that never joined"));
        }
        self.landed += 1;
        Ok(self.all_joined() && self.landed == self.parts)
    }

    fn row_bytes(&self) -> u64 {
        // `of` checked the whole to have at least 2 rows of at least one byte each.
        (self.whole.byte_len() / self.whole.shape()[0].max(1)).max(1)
    }
}
