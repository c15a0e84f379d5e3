//! Protocol versions, as negotiated through ALPN, and the features each lets a sender use
//! (spec §3.1).

use std::fmt;

/// A protocol version: `major.minor`. The major version names incompatible wire formats;
/// minor versions add what an older peer can ignore or refuse, never what it would misread.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version {
    /// Incompatible revisions (the ALPN's `tensorwire/MAJOR`).
    pub major: u8,
    /// Compatible additions within a major version.
    pub minor: u8,
}

/// Something a sender may use only when the connection's version has it (spec §3.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Feature {
    /// Remote execution requests (§14, version 1.1).
    RemoteExecution,
    /// One tensor sent as parts on several streams (§15, version 1.3).
    SplitTensors,
    /// What the receiver made of a tensor, in COMPLETE (§6.8, version 1.5).
    Receipts,
}

impl Feature {
    /// Every feature, oldest first.
    pub const ALL: [Feature; 3] = [
        Feature::RemoteExecution,
        Feature::SplitTensors,
        Feature::Receipts,
    ];

    /// The version that introduced it.
    pub fn introduced(self) -> Version {
        match self {
            Feature::RemoteExecution => Version::V1_1,
            Feature::SplitTensors => Version::V1_3,
            Feature::Receipts => Version::V1_5,
        }
    }

    /// Its name as the spec writes it.
    pub fn name(self) -> &'static str {
        match self {
            Feature::RemoteExecution => "remote execution (§14)",
            Feature::SplitTensors => "split tensors (§15)",
            Feature::Receipts => "receipts in COMPLETE (§6.8)",
        }
    }
}

/// The ALPN identifiers' common prefix.
const ALPN_PREFIX: &[u8] = b"tensorwire/";

/// The longest ALPN identifier this crate parses; longer ones are not ours.
const MAX_ALPN_LEN: usize = 32;

impl Version {
    /// Version 1.0: tensors (§4–§10).
    pub const V1_0: Version = Version { major: 1, minor: 0 };
    /// Version 1.1: remote execution (§14).
    pub const V1_1: Version = Version { major: 1, minor: 1 };
    /// Version 1.2: the control stream and early data (§4.1, §7.6).
    pub const V1_2: Version = Version { major: 1, minor: 2 };
    /// Version 1.3: split tensors (§15).
    pub const V1_3: Version = Version { major: 1, minor: 3 };
    /// Version 1.4: versions negotiated through ALPN (§3.1).
    pub const V1_4: Version = Version { major: 1, minor: 4 };
    /// Version 1.5: receipts in COMPLETE (§6.8).
    pub const V1_5: Version = Version { major: 1, minor: 5 };
    /// The version this crate implements.
    pub const CURRENT: Version = Version::V1_5;
    /// The first minor version whose ALPN identifier names it; older ones share `tensorwire/1`.
    const FIRST_NAMED: Version = Version::V1_4;

    /// The version an ALPN identifier selects, or `None` for one that is not tensorwire's
    /// (spec §3.1): `tensorwire/1` is 1.0 (a peer of 1.0 to 1.3, which cannot say which),
    /// `tensorwire/1.N` is 1.N for N ≥ 4. Never panics, whatever the bytes.
    pub fn from_alpn(id: &[u8]) -> Option<Version> {
        if id.len() > MAX_ALPN_LEN {
            return None;
        }
        let rest = id.strip_prefix(ALPN_PREFIX)?;
        let text = std::str::from_utf8(rest).ok()?;
        let (major, minor) = match text.split_once('.') {
            None => (decimal(text)?, None),
            Some((major, minor)) => (decimal(major)?, Some(decimal(minor)?)),
        };
        let version = match minor {
            None => Version { major, minor: 0 },
            Some(minor) => Version { major, minor },
        };
        // `tensorwire/1.0` to `tensorwire/1.3` are never offered: those versions predate
        // named identifiers, and a peer that writes one is not following the spec.
        let named_too_early = minor.is_some() && version < Version::FIRST_NAMED;
        (version.major == Version::CURRENT.major && !named_too_early).then_some(version)
    }

    /// Its ALPN identifier: `tensorwire/1.N`, or `tensorwire/1` for 1.0 to 1.3.
    pub fn alpn(self) -> Vec<u8> {
        let mut id = ALPN_PREFIX.to_vec();
        if self < Version::FIRST_NAMED {
            id.extend_from_slice(self.major.to_string().as_bytes());
        } else {
            id.extend_from_slice(self.to_string().as_bytes());
        }
        id
    }

    /// The ALPN identifiers an endpoint of this version offers, newest first (spec §3.1):
    /// each named minor version from its own down to 1.4, then `tensorwire/1`. A server
    /// selects the first of its own list that the client offers too, so two peers agree
    /// on the older of their two versions.
    pub fn alpn_offers(self) -> Vec<Vec<u8>> {
        let named = (Version::FIRST_NAMED.minor..=self.minor)
            .rev()
            .filter(|_| self.major == Version::FIRST_NAMED.major)
            .map(|minor| Version { minor, ..self }.alpn());
        named.chain([Version::V1_0.alpn()]).collect()
    }

    /// Whether a peer of this version has `feature`, so a sender may use it.
    pub fn has(self, feature: Feature) -> bool {
        self >= feature.introduced()
    }
}

impl fmt::Display for Version {
    /// `1.4`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// A decimal number of 1 to 3 ASCII digits with no leading zero (but `0` itself), up to 255.
fn decimal(text: &str) -> Option<u8> {
    let canonical = !text.is_empty()
        && text.len() <= 3
        && text.bytes().all(|b| b.is_ascii_digit())
        && (text == "0" || !text.starts_with('0'));
    if canonical { text.parse().ok() } else { None }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_parse_as_the_spec_says() {
        assert_eq!(Version::from_alpn(b"tensorwire/1"), Some(Version::V1_0));
        assert_eq!(Version::from_alpn(b"tensorwire/1.4"), Some(Version::V1_4));
        assert_eq!(
            Version::from_alpn(b"tensorwire/1.17"),
            Some(Version {
                major: 1,
                minor: 17
            })
        );
        for foreign in [
            &b"tensorwire/1.3"[..],
            b"tensorwire/1.0",
            b"tensorwire/2",
            b"tensorwire/01.4",
            b"tensorwire/1.04",
            b"tensorwire/1.",
            b"tensorwire/1.4.1",
            b"tensorwire/1.256",
            b"tensorwire/+1",
            b"h3",
            b"",
        ] {
            assert_eq!(
                Version::from_alpn(foreign),
                None,
                "{}",
                String::from_utf8_lossy(foreign)
            );
        }
    }

    #[test]
    fn identifiers_round_trip() {
        for minor in 4..=40 {
            let v = Version { major: 1, minor };
            assert_eq!(Version::from_alpn(&v.alpn()), Some(v));
        }
        assert_eq!(Version::V1_3.alpn(), b"tensorwire/1");
    }

    #[test]
    fn offers_run_newest_first_and_end_with_the_unnamed_identifier() {
        let offers = Version::CURRENT.alpn_offers();
        assert_eq!(
            offers,
            [
                b"tensorwire/1.5".to_vec(),
                b"tensorwire/1.4".to_vec(),
                b"tensorwire/1".to_vec()
            ]
        );
        let later = Version { major: 1, minor: 6 }.alpn_offers();
        assert_eq!(
            later,
            [
                b"tensorwire/1.6".to_vec(),
                b"tensorwire/1.5".to_vec(),
                b"tensorwire/1.4".to_vec(),
                b"tensorwire/1".to_vec()
            ]
        );
    }

    #[test]
    fn features_need_the_version_that_introduced_them() {
        assert!(!Version::V1_0.has(Feature::SplitTensors));
        assert!(!Version::V1_0.has(Feature::RemoteExecution));
        assert!(Version::V1_3.has(Feature::SplitTensors));
        assert!(Version::CURRENT.has(Feature::SplitTensors));
        assert!(Version::CURRENT.has(Feature::RemoteExecution));
    }
}
