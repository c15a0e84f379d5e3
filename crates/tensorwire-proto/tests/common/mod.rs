//! Helpers shared by the integration tests: the golden vectors and an in-memory pair.
#![allow(dead_code, unreachable_pub)] // Each test binary uses a different subset.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

pub mod pair;
pub mod vectors;

/// The cases of a text vector under `spec/vectors` (`versions.txt`, `tcp_framing.txt`): each
/// line that is not a comment, split into its `;`-separated fields, trimmed. Each case must
/// have `fields` fields.
pub fn text_cases(file: &str, fields: usize) -> Vec<Vec<String>> {
    let text = std::fs::read_to_string(vectors::vectors_dir().join(file)).unwrap();
    text.lines()
        .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
        .map(|line| {
            let case: Vec<String> = line.split(';').map(|f| f.trim().to_owned()).collect();
            assert_eq!(case.len(), fields, "{file}: not {fields} fields: {line}");
            case
        })
        .collect()
}
