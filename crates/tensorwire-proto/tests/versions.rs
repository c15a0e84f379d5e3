//! Version negotiation (spec §3.1) against the cases of `spec/vectors/versions.txt`: the
//! server's choice rule applied to each pair of offer lists selects the stored identifier,
//! which means the stored version; this version's own offers are those the spec lists.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use tensorwire_proto::{Feature, Version};

fn offers(list: &str) -> Vec<Vec<u8>> {
    list.split(',')
        .map(|id| id.trim().as_bytes().to_vec())
        .collect()
}

#[test]
fn every_stored_case_selects_its_version() {
    let cases = common::text_cases("versions.txt", 4);
    assert!(cases.len() >= 8, "only {} cases", cases.len());
    for case in &cases {
        let [client, server, selected, version] =
            [&case[0], &case[1], &case[2], &case[3]].map(String::as_str);
        let (client, server) = (offers(client), offers(server));
        let chosen = server.iter().find(|id| client.contains(id));
        match selected {
            "-" => assert_eq!(chosen, None, "{case:?}"),
            id => assert_eq!(chosen.map(Vec::as_slice), Some(id.as_bytes()), "{case:?}"),
        }
        let parsed = chosen.and_then(|id| Version::from_alpn(id));
        assert_eq!(
            parsed.map(|v| v.to_string()).as_deref(),
            match version {
                "-" => None,
                v => Some(v),
            },
            "{case:?}"
        );
    }
}

#[test]
fn this_version_offers_the_named_identifiers_then_the_old_one() {
    assert_eq!(Version::CURRENT.to_string(), "1.5");
    assert_eq!(
        Version::CURRENT.alpn_offers(),
        offers("tensorwire/1.5,tensorwire/1.4,tensorwire/1")
    );
}

/// A connection through the pre-1.4 identifier is 1.0: nothing added since may be used.
#[test]
fn an_unnamed_peer_gets_no_feature() {
    let old = Version::from_alpn(tensorwire_proto::ALPN).unwrap();
    for feature in Feature::ALL {
        assert!(!old.has(feature), "{}", feature.name());
        assert!(Version::CURRENT.has(feature), "{}", feature.name());
    }
}
