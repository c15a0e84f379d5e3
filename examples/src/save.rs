//! Writes received tensors as `.safetensors` files: tensors that came from one file are
//! gathered and written back as that file; others each get a file of their own.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use anyhow::Context;
use bytes::Bytes;
use tensorwire::proto::TensorMeta;

use crate::files::{FILE_ATTR, FILE_METADATA_ATTR, FILE_TENSORS_ATTR};

/// A directory that received tensors are saved into.
pub struct SaveDir {
    dir: PathBuf,
    pending: HashMap<String, (usize, Vec<(TensorMeta, Bytes)>)>,
}

impl SaveDir {
    /// Saves into `dir`, creating it.
    pub fn new(dir: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
        Ok(Self {
            dir: dir.to_owned(),
            pending: HashMap::new(),
        })
    }

    /// Adds a tensor; returns the path of each file this completed.
    pub fn add(&mut self, meta: TensorMeta, bytes: Bytes) -> anyhow::Result<Option<PathBuf>> {
        let expected = meta
            .attribute(FILE_TENSORS_ATTR)
            .and_then(|n| n.parse::<usize>().ok());
        let (file, expected) = match (meta.attribute(FILE_ATTR), expected) {
            (Some(file), Some(n)) if n > 0 && n <= 1_000_000 => (safe_file_name(file), n),
            _ => {
                let name = format!("{}.safetensors", safe_file_name(meta.name()));
                return self.write(&name, vec![(meta, bytes)]).map(Some);
            }
        };
        let entry = self
            .pending
            .entry(file.clone())
            .or_insert((expected, Vec::new()));
        entry.1.push((meta, bytes));
        if entry.1.len() < entry.0 {
            return Ok(None);
        }
        let (_, tensors) = self.pending.remove(&file).unwrap_or_default();
        self.write(&file, tensors).map(Some)
    }

    /// Files still waiting for tensors: (file, received, expected).
    pub fn incomplete(&self) -> Vec<(String, usize, usize)> {
        self.pending
            .iter()
            .map(|(f, (n, t))| (f.clone(), t.len(), *n))
            .collect()
    }

    fn write(&self, file: &str, tensors: Vec<(TensorMeta, Bytes)>) -> anyhow::Result<PathBuf> {
        let metadata: Option<HashMap<String, String>> = tensors
            .first()
            .and_then(|(m, _)| m.attribute(FILE_METADATA_ATTR))
            .and_then(|json| serde_json::from_str(json).ok())
            .or_else(|| {
                let (meta, _) = tensors.first()?;
                let attrs: HashMap<String, String> = meta
                    .attributes()
                    .iter()
                    .filter(|(k, _)| {
                        !k.starts_with("tensorwire.") && !k.starts_with("safetensors.")
                    })
                    .cloned()
                    .collect();
                (!attrs.is_empty()).then_some(attrs)
            });
        let mut views = BTreeMap::new();
        for (meta, bytes) in &tensors {
            let dtype: safetensors::Dtype =
                serde_json::from_value(serde_json::Value::from(meta.dtype().name()))
                    .with_context(|| format!("dtype {}", meta.dtype()))?;
            let shape = meta.shape().iter().map(|&d| d as usize).collect();
            views.insert(
                meta.name().to_owned(),
                safetensors::tensor::TensorView::new(dtype, shape, bytes)?,
            );
        }
        let path = self.dir.join(file);
        safetensors::serialize_to_file(views, metadata, &path)
            .with_context(|| path.display().to_string())?;
        Ok(path)
    }
}

/// A file name from a peer's string: separators and odd characters become `_`, no leading
/// dots, at most 200 characters, so it can name nothing outside the directory.
fn safe_file_name(name: &str) -> String {
    let cleaned: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    let cleaned = cleaned.trim_start_matches('.');
    if cleaned.is_empty() {
        "tensor".to_owned()
    } else {
        cleaned.chars().take(200).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::safe_file_name;

    #[test]
    fn peer_names_cannot_escape_the_directory() {
        assert_eq!(safe_file_name("../../etc/passwd"), "_.._etc_passwd");
        assert_eq!(safe_file_name("..."), "tensor");
        assert_eq!(safe_file_name("speech/utterance 7"), "speech_utterance_7");
        assert_eq!(safe_file_name("model.safetensors"), "model.safetensors");
        assert_eq!(safe_file_name(""), "tensor");
        assert_eq!(safe_file_name(&"x".repeat(500)).len(), 200);
    }
}
