//! Writes received tensors as `.safetensors` files: tensors that came from one file are
//! gathered and written back as that file; others each get a file of their own.
//!
//! Every tensor is spooled to disk while it lands ([`SpoolingSink`]) and synced before its
//! sink finishes, so the COMPLETE its sender gets means the bytes are on disk (spec §6.8): a
//! full or read-only disk fails that tensor (CANCEL with RESOURCE_EXHAUSTED or SINK_FAILED),
//! not the receiver, and never after the sender was told it succeeded. Whole files are then
//! assembled from the spool, atomically.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::Context;
use tensorwire::proto::{Payload, TensorMeta};
use tensorwire::quic::{CreditPermit, Sink, SinkError};
use tensorwire::sink::Divisible;

use crate::files::{FILE_ATTR, FILE_METADATA_ATTR, FILE_TENSORS_ATTR, SENDER_ATTR};

/// The spool's folder inside the save directory.
const SPOOL: &str = ".incoming";

/// A directory that received tensors are saved into.
///
/// Tensors are grouped by where they came from (the connection) and by file, so two senders
/// sending files of the same name never mix; a file is written once all its tensors arrived,
/// atomically (a temporary file, synced, then renamed), off the caller's thread by
/// [`SaveJob::write`].
pub struct SaveDir {
    dir: PathBuf,
    spool: SpoolDir,
    /// By (connection, file): how many tensors the file holds, and those that arrived.
    pending: HashMap<(String, String), Pending>,
}

/// A file's expected tensor count and the tensors received so far.
type Pending = (usize, Vec<(TensorMeta, Spooled)>);

/// Tensors ready to be written as one `.safetensors` file.
pub struct SaveJob {
    dir: PathBuf,
    file: String,
    tensors: Vec<(TensorMeta, Spooled)>,
}

/// Where tensors are spooled while they land; cheap to clone into admission tasks.
#[derive(Clone, Debug)]
pub struct SpoolDir {
    dir: PathBuf,
}

/// A landed tensor's bytes in a synced spool file, removed when dropped (once saved).
#[derive(Debug)]
pub struct Spooled {
    path: PathBuf,
    len: u64,
}

impl Spooled {
    /// Keeps the file (renamed `kept-…`, which no receiver removes) when its file could not
    /// be written, so its bytes are not lost; returns where it is.
    fn keep(mut self) -> PathBuf {
        let name = self
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned());
        let kept = self
            .path
            .with_file_name(format!("kept-{}", name.unwrap_or_default()));
        if std::fs::rename(&self.path, &kept).is_ok() {
            self.path = kept.clone();
        }
        // An empty path: dropping removes nothing.
        std::mem::take(&mut self.path)
    }
}

impl Drop for Spooled {
    fn drop(&mut self) {
        if !self.path.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Lands a tensor in `inner` and, when saving, in a spool file as well; finishing syncs the
/// file before the inner sink's output is handed back, so COMPLETE follows the bytes
/// reaching the disk. Dropped unfinished (the tensor failed), it removes the file.
pub struct SpoolingSink<S> {
    inner: S,
    /// The spool file the bytes also go to, and its path for errors.
    file: Option<(Arc<std::fs::File>, PathBuf)>,
    /// What `finish` hands over; a part of a split tensor writes the whole's file and hands
    /// over nothing.
    spooled: Option<Spooled>,
}

impl<S: Sink> SpoolingSink<S> {
    /// Wraps `inner`; with a `spool`, the tensor's `len` bytes also go to disk before
    /// COMPLETE.
    pub fn new(inner: S, spool: Option<&SpoolDir>, len: u64) -> Result<Self, SinkError> {
        let (file, spooled) = match spool.map(|dir| dir.create(len)).transpose()? {
            Some((file, spooled)) => (Some((file, spooled.path.clone())), Some(spooled)),
            None => (None, None),
        };
        Ok(Self {
            inner,
            file,
            spooled,
        })
    }
}

/// Parts of a split tensor (spec §15) write the same spool file at their own offsets,
/// beside each other where the inner sink allows it.
impl<S: Divisible> Divisible for SpoolingSink<S> {
    type Part = SpoolingSink<S::Part>;

    fn part(&mut self) -> Option<Self::Part> {
        Some(SpoolingSink {
            inner: self.inner.part()?,
            file: self.file.clone(),
            spooled: None,
        })
    }
}

impl SpoolDir {
    /// Creates the spool in `dir` and removes files left by receivers that are gone.
    fn open(dir: &Path) -> anyhow::Result<Self> {
        let spool = dir.join(SPOOL);
        std::fs::create_dir_all(&spool).with_context(|| spool.display().to_string())?;
        for entry in std::fs::read_dir(&spool)?.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            // `PID-N.part` is a receiver's; `kept-…` bytes wait for their owner.
            let Some(pid) = name
                .split('-')
                .next()
                .and_then(|pid| pid.parse::<u32>().ok())
            else {
                continue;
            };
            if !Path::new(&format!("/proc/{pid}")).exists() {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        Ok(Self { dir: spool })
    }

    /// A new spool file for a tensor of `len` bytes.
    fn create(&self, len: u64) -> Result<(Arc<std::fs::File>, Spooled), SinkError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = self.dir.join(format!("{}-{n}.part", std::process::id()));
        let file = std::fs::OpenOptions::new()
            .write(true)
            .read(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| disk_error(&path, &e))?;
        Ok((Arc::new(file), Spooled { path, len }))
    }
}

/// A disk failure as the sender is told it: out of space is RESOURCE_EXHAUSTED, anything
/// else SINK_FAILED; the message names the file.
fn disk_error(path: &Path, e: &std::io::Error) -> SinkError {
    let message = format!("saving to {}: {e}", path.display());
    match e.kind() {
        std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded => {
            SinkError::exhausted(message)
        }
        _ => SinkError::failed(message),
    }
}

impl<S: Sink> SpoolingSink<S> {
    /// Writes `payload` at `offset` into the spool file, if there is one.
    fn spool(
        &self,
        offset: u64,
        payload: &Payload,
    ) -> impl Future<Output = Result<(), SinkError>> + Send + 'static {
        // Owned, so that the future does not hold `&self` (`S` need not be `Sync`).
        let spool = self
            .file
            .as_ref()
            .map(|(file, path)| (file.clone(), payload.clone(), path.clone()));
        async move { Self::write_spool(spool, offset).await }
    }

    async fn write_spool(
        spool: Option<(Arc<std::fs::File>, Payload, PathBuf)>,
        offset: u64,
    ) -> Result<(), SinkError> {
        if let Some((file, parts, path)) = spool {
            // Disk writes block: off the async path.
            tokio::task::spawn_blocking(move || {
                let mut at = offset;
                for part in parts.parts() {
                    file.write_all_at(part, at)?;
                    at += part.len() as u64;
                }
                Ok(())
            })
            .await
            .map_err(|e| SinkError::failed(format!("the spool writer failed: {e}")))?
            .map_err(|e| disk_error(&path, &e))?;
        }
        Ok(())
    }
}

impl<S: Sink> Sink for SpoolingSink<S> {
    type Output = (S::Output, Option<Spooled>);

    async fn store(
        &mut self,
        offset: u64,
        payload: Payload,
        permit: CreditPermit,
        crc: Option<&mut u32>,
    ) -> Result<(), SinkError> {
        self.spool(offset, &payload).await?;
        self.inner.store(offset, payload, permit, crc).await
    }

    async fn flush(&mut self) -> Result<(), SinkError> {
        self.inner.flush().await
    }

    fn take_checksum(&mut self) -> bool {
        self.inner.take_checksum()
    }

    async fn landed_checksum(&mut self) -> Result<u32, SinkError> {
        self.inner.landed_checksum().await
    }

    async fn finish(self) -> Result<Self::Output, SinkError> {
        let output = self.inner.finish().await?;
        let Some((file, path)) = self.file else {
            return Ok((output, None));
        };
        tokio::task::spawn_blocking(move || file.sync_all())
            .await
            .map_err(|e| SinkError::failed(format!("the spool writer failed: {e}")))?
            .map_err(|e| disk_error(&path, &e))?;
        Ok((output, self.spooled))
    }
}

impl SaveDir {
    /// Saves into `dir`, creating it and its spool.
    pub fn new(dir: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
        Ok(Self {
            dir: dir.to_owned(),
            spool: SpoolDir::open(dir)?,
            pending: HashMap::new(),
        })
    }

    /// Where tensors are spooled while they land.
    pub fn spool(&self) -> SpoolDir {
        self.spool.clone()
    }

    /// Adds a landed tensor that came over the connection `origin` (`ip:port`); returns the
    /// file it completed, to be written with [`SaveJob::write`]. A file's tensors are grouped
    /// by the sender run that sent them (from one host), over however many connections.
    pub fn add(&mut self, origin: &str, meta: TensorMeta, bytes: Spooled) -> Option<SaveJob> {
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
        let sender = match meta.attribute(SENDER_ATTR) {
            Some(run) => {
                let host = origin.rsplit_once(':').map_or(origin, |(host, _)| host);
                format!("{host} run {run}")
            }
            None => origin.to_owned(),
        };
        let key = (sender, file.clone());
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

    fn job(&self, file: String, tensors: Vec<(TensorMeta, Spooled)>) -> SaveJob {
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

/// One spooled tensor as safetensors writes it: its bytes are read from the spool only when
/// written, one tensor at a time.
struct SpooledView<'a> {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    spooled: &'a Spooled,
    /// The first read failure; the file is then not written.
    failed: &'a RefCell<Option<std::io::Error>>,
}

impl safetensors::View for SpooledView<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        match std::fs::read(&self.spooled.path) {
            Ok(bytes) if bytes.len() as u64 == self.spooled.len => Cow::Owned(bytes),
            read => {
                let e = read.err().unwrap_or_else(|| {
                    std::io::Error::other(format!(
                        "spool file {} is not {} bytes long",
                        self.spooled.path.display(),
                        self.spooled.len
                    ))
                });
                self.failed.borrow_mut().get_or_insert(e);
                Cow::Owned(vec![0; self.data_len()])
            }
        }
    }

    fn data_len(&self) -> usize {
        usize::try_from(self.spooled.len).unwrap_or(usize::MAX)
    }
}

impl SaveJob {
    /// The file's name in the directory.
    pub fn file(&self) -> &str {
        &self.file
    }

    /// Writes the file atomically: into a temporary file in the same directory, synced,
    /// then renamed over the final name, and the directory synced; the spool files go once
    /// it is. Blocking: run it off the async path (`spawn_blocking`).
    pub fn write(self) -> anyhow::Result<PathBuf> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
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
        let failed = RefCell::new(None);
        let mut views = Vec::new();
        for (meta, spooled) in &self.tensors {
            let dtype: safetensors::Dtype =
                serde_json::from_value(serde_json::Value::from(meta.dtype().name()))
                    .with_context(|| format!("dtype {}", meta.dtype()))?;
            let shape = meta.shape().iter().map(|&d| d as usize).collect();
            let view = SpooledView {
                dtype,
                shape,
                spooled,
                failed: &failed,
            };
            views.push((meta.name().to_owned(), view));
        }
        let path = self.dir.join(&self.file);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let temp = self
            .dir
            .join(format!(".{}.{}-{n}.tmp", self.file, std::process::id()));
        let written = safetensors::serialize_to_file(views, metadata, &temp)
            .map_err(anyhow::Error::from)
            .and_then(|()| match failed.take() {
                Some(e) => Err(anyhow::Error::from(e).context("reading the spool")),
                None => Ok(()),
            })
            .and_then(|()| Ok(std::fs::File::open(&temp)?.sync_all()?))
            .and_then(|()| Ok(std::fs::rename(&temp, &path)?));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&temp);
            let kept: Vec<String> = self
                .tensors
                .into_iter()
                .map(|(meta, spooled)| format!("{} in {}", meta.name(), spooled.keep().display()))
                .collect();
            return Err(e.context(format!(
                "writing {} (the received bytes are kept: {})",
                path.display(),
                kept.join(", ")
            )));
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

    /// A tensor of four `fill` bytes, spooled in `save`'s spool as if it had landed.
    fn tensor(
        save: &SaveDir,
        name: &str,
        file: &str,
        of: usize,
        fill: u8,
    ) -> (TensorMeta, Spooled) {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let meta = TensorMeta::new([4], DType::U8)
            .unwrap()
            .with_name(name)
            .with_attribute(FILE_ATTR, file)
            .with_attribute(FILE_TENSORS_ATTR, of.to_string());
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = save
            .spool
            .dir
            .join(format!("{}-test{n}.part", std::process::id()));
        std::fs::write(&path, [fill; 4]).unwrap();
        (meta, Spooled { path, len: 4 })
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
        let (a0, a0b) = tensor(&save, "x", "m.safetensors", 2, 1);
        let (b0, b0b) = tensor(&save, "x", "m.safetensors", 2, 2);
        let (a1, a1b) = tensor(&save, "y", "m.safetensors", 2, 1);
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
        let mut leftovers: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        leftovers.sort();
        assert_eq!(
            leftovers,
            [SPOOL, "m.safetensors"],
            "no temporary file left behind"
        );
        let spooled = std::fs::read_dir(dir.join(SPOOL)).unwrap().count();
        assert_eq!(spooled, 1, "only peer b's waiting tensor is still spooled");
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// Tensors of a file that never completes are not lost: they are written as a partial
    /// file when the receiver stops.
    #[test]
    fn tensors_of_an_incomplete_file_are_saved_as_a_partial_file() {
        let dir = temp("partial");
        let mut save = SaveDir::new(&dir).unwrap();
        let (m, b) = tensor(&save, "x", "model.safetensors", 3, 5);
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

    /// A write that fails (here: a directory stands where the file goes) is an error naming
    /// the file, and the received bytes are kept in the spool, named in the error.
    #[test]
    fn a_failed_write_names_the_file_and_keeps_the_bytes() {
        let dir = temp("blocked");
        let mut save = SaveDir::new(&dir).unwrap();
        std::fs::create_dir_all(dir.join("solo.safetensors").join("x")).unwrap();
        let (m, b) = tensor(&save, "solo", "", 0, 7);
        let err = format!("{:#}", save.add("peer", m, b).unwrap().write().unwrap_err());
        assert!(err.contains("solo.safetensors"), "{err}");
        let kept = err
            .split(" in ")
            .nth(1)
            .and_then(|rest| rest.split(')').next())
            .unwrap();
        assert_eq!(std::fs::read(kept).unwrap(), [7; 4], "{err}");
        // A new receiver on the directory leaves kept bytes alone.
        drop(SaveDir::new(&dir).unwrap());
        assert!(Path::new(kept).exists(), "{kept} gone");
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// Spool files of receivers that are gone are removed; a live one's are not.
    #[test]
    fn stale_spool_files_are_removed_on_start() {
        let dir = temp("stale");
        let save = SaveDir::new(&dir).unwrap();
        let stale = save.spool.dir.join("4194304999-0.part");
        std::fs::write(&stale, b"old").unwrap();
        let (_, live) = tensor(&save, "live", "", 0, 1);
        drop(SaveDir::new(&dir).unwrap());
        assert!(!stale.exists());
        assert!(live.path.exists());
        drop(live);
        std::fs::remove_dir_all(dir).unwrap();
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
