//! Writes received tensors as `.safetensors` files: tensors that came from one file are
//! gathered and written back as that file; others each get a file of their own.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use anyhow::Context;
use bytes::Bytes;
use tensorwire::proto::TensorMeta;

use crate::files::{FILE_ATTR, FILE_METADATA_ATTR, FILE_TENSORS_ATTR};

/// A directory that received tensors are saved into.
///
/// Tensors are grouped by where they came from (the connection) and by file, so two senders
/// sending files of the same name never mix; a file is written once all its tensors arrived,
/// atomically (a temporary file, synced, then renamed), off the caller's thread by
/// [`SaveJob::write`].
pub struct SaveDir {
    dir: PathBuf,
    /// By (connection, file): how many tensors the file holds, and those that arrived.
    pending: HashMap<(String, String), Pending>,
}

/// A file's expected tensor count and the tensors received so far.
type Pending = (usize, Vec<(TensorMeta, Bytes)>);

/// Tensors ready to be written as one `.safetensors` file.
pub struct SaveJob {
    dir: PathBuf,
    file: String,
    tensors: Vec<(TensorMeta, Bytes)>,
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

    /// Adds a tensor that came over the connection `origin`; returns the file it completed,
    /// to be written with [`SaveJob::write`].
    pub fn add(&mut self, origin: &str, meta: TensorMeta, bytes: Bytes) -> Option<SaveJob> {
        let expected = meta
            .attribute(FILE_TENSORS_ATTR)
            .and_then(|n| n.parse::<usize>().ok());
        let (file, expected) = match (meta.attribute(FILE_ATTR), expected) {
            (Some(file), Some(n)) if n > 0 && n <= 1_000_000 => (safe_file_name(file), n),
            _ => {
                let file = format!("{}.safetensors", safe_file_name(meta.name()));
                return Some(self.job(file, vec![(meta, bytes)]));
            }
        };
        let key = (origin.to_owned(), file.clone());
        let entry = self
            .pending
            .entry(key.clone())
            .or_insert((expected, Vec::new()));
        entry.1.push((meta, bytes));
        if entry.1.len() < entry.0 {
            return None;
        }
        let (_, tensors) = self.pending.remove(&key).unwrap_or_default();
        Some(self.job(file, tensors))
    }

    fn job(&self, file: String, tensors: Vec<(TensorMeta, Bytes)>) -> SaveJob {
        SaveJob {
            dir: self.dir.clone(),
            file,
            tensors,
        }
    }

    /// Files still waiting for tensors: (file, received, expected).
    pub fn incomplete(&self) -> Vec<(String, usize, usize)> {
        self.pending
            .iter()
            .map(|((_, f), (n, t))| (f.clone(), t.len(), *n))
            .collect()
    }

    /// The tensors of files that will not complete (the receiver is stopping), each set as a
    /// file named `STEM.partial-GOTofEXPECTED.safetensors`, so no completed tensor is lost.
    pub fn drain_partial(&mut self) -> Vec<SaveJob> {
        let pending = std::mem::take(&mut self.pending);
        pending
            .into_iter()
            .map(|((_, file), (expected, tensors))| {
                let stem = file.strip_suffix(".safetensors").unwrap_or(&file);
                let name = format!("{stem}.partial-{}of{expected}.safetensors", tensors.len());
                self.job(name, tensors)
            })
            .collect()
    }
}

impl SaveJob {
    /// The file's name in the directory.
    pub fn file(&self) -> &str {
        &self.file
    }

    /// Writes the file atomically: into a temporary file in the same directory, synced,
    /// then renamed over the final name, and the directory synced. Blocking: run it off the
    /// async path (`spawn_blocking`).
    pub fn write(self) -> anyhow::Result<PathBuf> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let metadata: Option<HashMap<String, String>> = self
            .tensors
            .first()
            .and_then(|(m, _)| m.attribute(FILE_METADATA_ATTR))
            .and_then(|json| serde_json::from_str(json).ok())
            .or_else(|| {
                let (meta, _) = self.tensors.first()?;
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
        for (meta, bytes) in &self.tensors {
            let dtype: safetensors::Dtype =
                serde_json::from_value(serde_json::Value::from(meta.dtype().name()))
                    .with_context(|| format!("dtype {}", meta.dtype()))?;
            let shape = meta.shape().iter().map(|&d| d as usize).collect();
            views.insert(
                meta.name().to_owned(),
                safetensors::tensor::TensorView::new(dtype, shape, bytes)?,
            );
        }
        let path = self.dir.join(&self.file);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let temp = self
            .dir
            .join(format!(".{}.{}-{n}.tmp", self.file, std::process::id()));
        let written = safetensors::serialize_to_file(views, metadata, &temp)
            .map_err(anyhow::Error::from)
            .and_then(|()| Ok(std::fs::File::open(&temp)?.sync_all()?))
            .and_then(|()| Ok(std::fs::rename(&temp, &path)?));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&temp);
            return Err(e.context(format!("writing {}", path.display())));
        }
        // The rename is durable once the directory is.
        if let Ok(dir) = std::fs::File::open(&self.dir) {
            let _ = dir.sync_all();
        }
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
    use super::*;
    use tensorwire::proto::DType;

    fn tensor(name: &str, file: &str, of: usize, fill: u8) -> (TensorMeta, Bytes) {
        let meta = TensorMeta::new([4], DType::U8)
            .unwrap()
            .with_name(name)
            .with_attribute(FILE_ATTR, file)
            .with_attribute(FILE_TENSORS_ATTR, of.to_string());
        (meta, Bytes::from(vec![fill; 4]))
    }

    fn temp(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("tensorwire-save-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    /// Two connections sending files of the same name never mix: each completes its own.
    #[test]
    fn files_of_the_same_name_from_two_connections_do_not_mix() {
        let dir = temp("mix");
        let mut save = SaveDir::new(&dir).unwrap();
        let (a0, a0b) = tensor("x", "m.safetensors", 2, 1);
        let (b0, b0b) = tensor("x", "m.safetensors", 2, 2);
        let (a1, a1b) = tensor("y", "m.safetensors", 2, 1);
        assert!(save.add("peer-a", a0, a0b).is_none());
        assert!(save.add("peer-b", b0, b0b).is_none());
        let job = save
            .add("peer-a", a1, a1b)
            .expect("peer a's file is complete");
        let path = job.write().unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for name in ["x", "y"] {
            assert_eq!(
                file.tensor(name).unwrap().data(),
                &[1u8; 4],
                "{name} from peer a only"
            );
        }
        assert_eq!(save.incomplete().len(), 1, "peer b's file still waits");
        let leftovers: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            leftovers,
            ["m.safetensors"],
            "no temporary file left behind"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// Tensors of a file that never completes are not lost: they are written as a partial
    /// file when the receiver stops.
    #[test]
    fn tensors_of_an_incomplete_file_are_saved_as_a_partial_file() {
        let dir = temp("partial");
        let mut save = SaveDir::new(&dir).unwrap();
        let (m, b) = tensor("x", "model.safetensors", 3, 5);
        assert!(save.add("peer", m, b).is_none());
        let jobs = save.drain_partial();
        assert_eq!(jobs.len(), 1);
        let path = jobs.into_iter().next().unwrap().write().unwrap();
        assert!(
            path.ends_with("model.partial-1of3.safetensors"),
            "{}",
            path.display()
        );
        let bytes = std::fs::read(&path).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(file.tensor("x").unwrap().data(), &[5u8; 4]);
        assert!(save.incomplete().is_empty());
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A write that fails (here: the directory is gone) is an error naming the file, and
    /// leaves nothing behind.
    #[test]
    fn a_failed_write_names_the_file() {
        let dir = temp("gone");
        let mut save = SaveDir::new(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let (m, b) = tensor("solo", "", 0, 1);
        let err = save.add("peer", m, b).unwrap().write().unwrap_err();
        assert!(format!("{err:#}").contains("solo.safetensors"), "{err:#}");
    }

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
