//! The byte ranges of a tensor received so far, each with its CRC-32C (spec §7.3).

use std::collections::BTreeMap;

use crate::checksum::crc32c_combine;
use crate::error::{ErrorCode, ProtocolError};

/// Disjoint received ranges `[start, end)` with the CRC-32C of each.
///
/// Adjacent ranges merge: a range that continues another extends its CRC, one that precedes
/// another is joined with `crc32c_combine`, so a tensor received in any order ends as one
/// range whose CRC is the whole tensor's. The number of
/// separate ranges is capped: out-of-order senders cannot make the receiver track
/// unbounded gaps.
#[derive(Clone, Debug)]
pub struct ReceivedRanges {
    ranges: BTreeMap<u64, Span>,
    max_ranges: usize,
    covered: u64,
}

/// The received range that ends where a new one starts (with its start), and the one that
/// starts where it ends.
type Neighbours = (Option<(u64, Span)>, Option<Span>);

#[derive(Clone, Copy, Debug)]
struct Span {
    end: u64,
    crc: u32,
}

impl ReceivedRanges {
    /// An empty set that allows at most `max_ranges` separate ranges.
    pub fn new(max_ranges: usize) -> Self {
        Self {
            ranges: BTreeMap::new(),
            max_ranges: max_ranges.max(1),
            covered: 0,
        }
    }

    /// Adds `[start, end)` whose bytes have CRC-32C `crc` (computed on their own).
    ///
    /// Fails with DATA_OVERLAP if any byte was already received and TOO_MANY_GAPS if the
    /// set would exceed its cap; on failure the set is unchanged.
    pub fn insert(&mut self, start: u64, end: u64, crc: u32) -> Result<(), ProtocolError> {
        self.insert_with(start, end, |continued| match continued {
            Some(left) => crc32c_combine(left, crc, end - start),
            None => crc,
        })
    }

    /// Adds `[start, end)`, asking `crc_from` for its CRC once the checks passed.
    ///
    /// `crc_from` gets the CRC of the received range that ends exactly at `start`, if any,
    /// and returns the CRC of that range and the new bytes together (`crc32c_append`), or
    /// of the new bytes alone when there is none. In-order data thus costs one pass and no
    /// `crc32c_combine`. Fails, changing nothing, as [`insert`](Self::insert) does.
    pub fn insert_with(
        &mut self,
        start: u64,
        end: u64,
        crc_from: impl FnOnce(Option<u32>) -> u32,
    ) -> Result<(), ProtocolError> {
        let (left, right) = self.neighbours(start, end)?;
        let mut merged_start = start;
        let mut merged = Span {
            end,
            crc: crc_from(left.map(|(_, span)| span.crc)),
        };
        if let Some((s, _)) = left {
            self.ranges.remove(&s);
            merged_start = s;
        }
        if let Some(span) = right {
            self.ranges.remove(&end);
            merged.crc = crc32c_combine(merged.crc, span.crc, span.end - end);
            merged.end = span.end;
        }
        self.ranges.insert(merged_start, merged);
        self.covered += end - start;
        Ok(())
    }

    /// Whether `[start, end)` could be added: fails as [`insert`](Self::insert) would,
    /// changing nothing either way.
    pub fn check(&self, start: u64, end: u64) -> Result<(), ProtocolError> {
        self.neighbours(start, end).map(drop)
    }

    /// The checks of an insert: the received range that ends exactly at `start` and the one
    /// that starts exactly at `end`, if any, once `[start, end)` neither overlaps a received
    /// byte nor takes the set past its cap.
    fn neighbours(&self, start: u64, end: u64) -> Result<Neighbours, ProtocolError> {
        if start >= end {
            return Err(ProtocolError::Misuse("empty or inverted range"));
        }
        let before = self
            .ranges
            .range(..end)
            .next_back()
            .map(|(&s, &span)| (s, span));
        if let Some((s, span)) = before
            && span.end > start
        {
            return Err(ProtocolError::violation(
                ErrorCode::DATA_OVERLAP,
                format!(
                    "DATA [{start}, {end}) overlaps received [{s}, {})",
                    span.end
                ),
            ));
        }
        let left = before.filter(|(_, span)| span.end == start);
        let right = self.ranges.get(&end).copied();
        let count_after =
            self.ranges.len() + 1 - usize::from(left.is_some()) - usize::from(right.is_some());
        if count_after > self.max_ranges {
            return Err(ProtocolError::LimitExceeded {
                code: ErrorCode::TOO_MANY_GAPS,
                what: "separate received ranges",
                value: count_after as u64,
                limit: self.max_ranges as u64,
            });
        }
        Ok((left, right))
    }

    /// Total bytes received.
    pub fn covered(&self) -> u64 {
        self.covered
    }

    /// Number of separate ranges.
    pub fn range_count(&self) -> usize {
        self.ranges.len()
    }

    /// The CRC-32C of `[0, total)` if exactly that range has been received.
    pub fn whole_crc(&self, total: u64) -> Option<u32> {
        if total == 0 {
            return self.ranges.is_empty().then_some(0);
        }
        match self.ranges.first_key_value() {
            Some((0, span)) if span.end == total && self.ranges.len() == 1 => Some(span.crc),
            _ => None,
        }
    }

    /// The first byte range not yet received below `total`, if any.
    pub fn first_gap(&self, total: u64) -> Option<(u64, u64)> {
        let mut at = 0;
        for (&start, span) in &self.ranges {
            if start > at {
                return Some((at, start));
            }
            at = span.end;
        }
        (at < total).then_some((at, total))
    }
}
