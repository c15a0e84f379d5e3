//! The byte ranges of a tensor received so far, each with its CRC-32C (spec §7.3).

use std::collections::BTreeMap;

use crate::error::{ErrorCode, ProtocolError};

/// Disjoint received ranges `[start, end)` with the CRC-32C of each.
///
/// Adjacent ranges merge, combining their checksums with `crc32c_combine`, so a tensor
/// received in any order ends as one range whose CRC is the whole tensor's. The number of
/// separate ranges is capped: out-of-order senders cannot make the receiver track
/// unbounded gaps.
#[derive(Clone, Debug)]
pub struct ReceivedRanges {
    ranges: BTreeMap<u64, Span>,
    max_ranges: usize,
    covered: u64,
}

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

    /// Adds `[start, end)` whose bytes have CRC-32C `crc`.
    ///
    /// Fails with DATA_OVERLAP if any byte was already received and TOO_MANY_GAPS if the
    /// set would exceed its cap; on failure the set is unchanged.
    pub fn insert(&mut self, start: u64, end: u64, crc: u32) -> Result<(), ProtocolError> {
        if start >= end {
            return Err(ProtocolError::Misuse("empty or inverted range"));
        }
        let before = self
            .ranges
            .range(..end)
            .next_back()
            .map(|(&s, &span)| (s, span));
        if let Some((s, span)) = before {
            if span.end > start {
                return Err(ProtocolError::violation(
                    ErrorCode::DATA_OVERLAP,
                    format!(
                        "DATA [{start}, {end}) overlaps received [{s}, {})",
                        span.end
                    ),
                ));
            }
        }
        let left = before.filter(|(_, span)| span.end == start);
        let right = self.ranges.get(&end).copied();
        let count_after = self.ranges.len() + 1 - left.iter().count() - right.iter().count();
        if count_after > self.max_ranges {
            return Err(ProtocolError::LimitExceeded {
                code: ErrorCode::TOO_MANY_GAPS,
                what: "separate received ranges",
                value: count_after as u64,
                limit: self.max_ranges as u64,
            });
        }
        let (mut merged_start, mut merged) = (start, Span { end, crc });
        if let Some((s, span)) = left {
            self.ranges.remove(&s);
            merged_start = s;
            merged.crc = crc32c::crc32c_combine(span.crc, crc, len(start, end));
        }
        if let Some(span) = right {
            self.ranges.remove(&end);
            merged.crc = crc32c::crc32c_combine(merged.crc, span.crc, len(end, span.end));
            merged.end = span.end;
        }
        self.ranges.insert(merged_start, merged);
        self.covered += end - start;
        Ok(())
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

/// A range's length as `crc32c_combine` takes it; a range longer than `usize` could not be
/// held in memory on this target, so saturating never changes a reachable result.
fn len(start: u64, end: u64) -> usize {
    usize::try_from(end - start).unwrap_or(usize::MAX)
}
