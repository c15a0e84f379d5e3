//! Writes received tensors as `.safetensors` files: tensors that came from one file are
//! gathered and written back as that file; others each get a file of their own.
//!
//! Every tensor is spooled to disk while it lands ([`SpoolingSink`]) and synced before its
//! sink finishes, so the COMPLETE its sender gets means the bytes are on disk (spec §6.8): a
//! full or read-only disk fails that tensor (CANCEL with RESOURCE_EXHAUSTED or SINK_FAILED),
//! not the receiver, and never after the sender was told it succeeded. Beside each landed
//! tensor's bytes goes a record of what it is (its METADATA and the connection it came
//! over), synced before COMPLETE too, so a receiver that restarts on the directory recovers
//! every tensor its predecessor confirmed ([`SaveDir::open`]). Whole files are then
//! assembled from the spool, atomically, and never over a file already there unless asked
//! ([`OnCollision`]).

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::Context;
use bytes::{Buf, BytesMut};
use tensorwire::proto::{
    Frame, FrameDecoder, Limits, Payload, Receipt, TensorMeta, frame::Metadata,
};
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
    on_collision: OnCollision,
    /// By (connection, file): how many tensors the file holds, and those that arrived.
    pending: HashMap<(String, String), Pending>,
}

/// What saving a file whose name is already in the directory does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum OnCollision {
    /// Both are kept: the new file takes the first free name `STEM.N.safetensors` (N from 1).
    #[default]
    KeepBoth,
    /// The new file replaces the old one.
    Overwrite,
    /// The new file is not written; its received bytes stay in the spool (`.incoming/kept-…`)
    /// and the error names them.
    Refuse,
}

/// What a receiver found in the spool of receivers that are gone ([`SaveDir::open`]).
#[derive(Default)]
pub struct Recovery {
    /// Files assembled from tensors a gone receiver had confirmed: whole files, and the
    /// tensors of files that never completed as `STEM.partial-KofN.safetensors`.
    pub jobs: Vec<SaveJob>,
    /// Spool files of tensors that were never confirmed (no COMPLETE went out), removed.
    pub unconfirmed_removed: usize,
}

/// A file's expected tensor count and the tensors received so far.
type Pending = (usize, Vec<(TensorMeta, Spooled)>);

/// Tensors ready to be written as one `.safetensors` file.
pub struct SaveJob {
    dir: PathBuf,
    file: String,
    on_collision: OnCollision,
    tensors: Vec<(TensorMeta, Spooled)>,
}

/// Where tensors are spooled while they land; cheap to clone into admission tasks.
#[derive(Clone, Debug)]
pub struct SpoolDir {
    dir: PathBuf,
}

/// A landed tensor's bytes in a synced spool file, and the record of what it is; both are
/// removed when dropped (once saved).
#[derive(Debug)]
pub struct Spooled {
    path: PathBuf,
    len: u64,
}

impl Spooled {
    /// Where the record of what the bytes are lies: beside them, `….meta`.
    fn record_path(&self) -> PathBuf {
        self.path.with_extension("meta")
    }
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
            // The record goes along, so that the kept bytes can still be told apart.
            let _ = std::fs::rename(self.record_path(), kept.with_extension("meta"));
            self.path = kept.clone();
        }
        // An empty path: dropping removes nothing.
        std::mem::take(&mut self.path)
    }
}

impl Drop for Spooled {
    fn drop(&mut self) {
        if !self.path.as_os_str().is_empty() {
            // The record first: bytes without a record were never confirmed, and a receiver
            // that finds them after a crash removes them.
            let _ = std::fs::remove_file(self.record_path());
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
    /// The record written beside the bytes when they are synced (not for a part).
    record: Option<Vec<u8>>,
    /// What `finish` hands over; a part of a split tensor writes the whole's file and hands
    /// over nothing.
    spooled: Option<Spooled>,
}

impl<S: Sink> SpoolingSink<S> {
    /// Wraps `inner`; with a `spool`, the tensor's bytes, and a record of `meta` and of the
    /// connection `origin` (`ip:port`) it came over, also go to disk before COMPLETE.
    pub fn new(
        inner: S,
        spool: Option<&SpoolDir>,
        meta: &TensorMeta,
        origin: &str,
    ) -> Result<Self, SinkError> {
        let (file, spooled) = match spool.map(|dir| dir.create(meta.byte_len())).transpose()? {
            Some((file, spooled)) => (Some((file, spooled.path.clone())), Some(spooled)),
            None => (None, None),
        };
        let record = file.as_ref().map(|_| encode_record(origin, meta));
        Ok(Self {
            inner,
            file,
            record,
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
            record: None,
            spooled: None,
        })
    }
}

impl SpoolDir {
    /// Creates the spool in `dir`.
    fn open(dir: &Path) -> anyhow::Result<Self> {
        let spool = dir.join(SPOOL);
        std::fs::create_dir_all(&spool).with_context(|| spool.display().to_string())?;
        Ok(Self { dir: spool })
    }

    /// The spool files of receivers that are gone (`PID-N.part`, whose process no longer
    /// runs), each with its record if it has one. `kept-…` files wait for their owner and
    /// are not listed.
    fn orphans(&self) -> anyhow::Result<Vec<(Spooled, Option<Vec<u8>>)>> {
        let mut orphans = Vec::new();
        let entries =
            std::fs::read_dir(&self.dir).with_context(|| self.dir.display().to_string())?;
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(pid) = name
                .split('-')
                .next()
                .and_then(|pid| pid.parse::<u32>().ok())
            else {
                continue;
            };
            if Path::new(&format!("/proc/{pid}")).exists() {
                continue;
            }
            match path.extension().and_then(|e| e.to_str()) {
                Some("part") => {
                    let len = entry.metadata().map_or(0, |m| m.len());
                    let spooled = Spooled { path, len };
                    let record = std::fs::read(spooled.record_path()).ok();
                    orphans.push((spooled, record));
                }
                // A half-written record, or one whose bytes are gone: nothing to recover.
                Some("tmp") => {
                    let _ = std::fs::remove_file(&path);
                }
                Some("meta") if !path.with_extension("part").exists() => {
                    let _ = std::fs::remove_file(&path);
                }
                _ => {}
            }
        }
        Ok(orphans)
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

    /// The inner sink's: the spool is not where the tensor is saved in the end.
    fn receipt(output: &Self::Output) -> Receipt {
        S::receipt(&output.0)
    }

    async fn finish(self) -> Result<Self::Output, SinkError> {
        let output = self.inner.finish().await?;
        let Some((file, path)) = self.file else {
            return Ok((output, None));
        };
        let record = self
            .record
            .zip(self.spooled.as_ref().map(Spooled::record_path));
        tokio::task::spawn_blocking(move || {
            file.sync_all().map_err(|e| disk_error(&path, &e))?;
            match record {
                Some((record, at)) => write_synced(&at, &record).map_err(|e| disk_error(&at, &e)),
                None => Ok(()),
            }
        })
        .await
        .map_err(|e| SinkError::failed(format!("the spool writer failed: {e}")))??;
        Ok((output, self.spooled))
    }
}

impl SaveDir {
    /// Saves into `dir`, creating it and its spool, with `on_collision` for names already
    /// there. Tensors a receiver that is gone had confirmed are recovered: they come back
    /// as files to write ([`Recovery::jobs`]), grouped as they would have been; its bytes
    /// that were never confirmed are removed.
    pub fn open(dir: &Path, on_collision: OnCollision) -> anyhow::Result<(Self, Recovery)> {
        std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
        let mut save = Self {
            dir: dir.to_owned(),
            spool: SpoolDir::open(dir)?,
            on_collision,
            pending: HashMap::new(),
        };
        let mut recovery = Recovery::default();
        for (spooled, record) in save.spool.orphans()? {
            match record.as_deref().and_then(decode_record) {
                Some((origin, meta)) if meta.byte_len() == spooled.len => {
                    recovery.jobs.extend(save.add(&origin, meta, spooled));
                }
                // No record (or one that does not describe these bytes): the tensor never
                // reached COMPLETE, so its sender knows it failed.
                _ => {
                    drop(spooled);
                    recovery.unconfirmed_removed += 1;
                }
            }
        }
        recovery.jobs.extend(save.drain_partial());
        Ok((save, recovery))
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
            on_collision: self.on_collision,
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

    /// How many tensors it holds.
    pub fn tensor_count(&self) -> usize {
        self.tensors.len()
    }

    /// Writes the file atomically: into a temporary file in the same directory, synced,
    /// then put in place by the collision policy, and the directory synced; the spool files
    /// go once it is. Returns where the file went (with keep-both, maybe a numbered name). Blocking: run it off the async path (`spawn_blocking`).
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
            .and_then(|()| place(&temp, &path, self.on_collision));
        let path = match written {
            Ok(placed) => placed,
            Err(e) => {
                let _ = std::fs::remove_file(&temp);
                let kept: Vec<String> = self
                    .tensors
                    .into_iter()
                    .map(|(meta, spooled)| {
                        format!("{} in {}", meta.name(), spooled.keep().display())
                    })
                    .collect();
                return Err(e.context(format!(
                    "writing {} (the received bytes are kept: {})",
                    path.display(),
                    kept.join(", ")
                )));
            }
        };
        // The new name is durable once the directory is.
        if let Ok(dir) = std::fs::File::open(&self.dir) {
            let _ = dir.sync_all();
        }
        Ok(path)
    }
}

/// The first bytes of a spool record.
const RECORD_MAGIC: &[u8] = b"tensorwire spool record 1\n";

/// A spool record: the magic, the origin's length (u16, little-endian) and bytes, then the
/// tensor's METADATA frame (spec §6.1) as it would go on the wire.
fn encode_record(origin: &str, meta: &TensorMeta) -> Vec<u8> {
    let origin = &origin.as_bytes()[..origin.len().min(u16::MAX as usize)];
    let mut record = BytesMut::from(RECORD_MAGIC);
    record.extend_from_slice(&(origin.len() as u16).to_le_bytes());
    record.extend_from_slice(origin);
    Frame::Metadata(Metadata { meta: meta.clone() }).encode(&mut record);
    record.to_vec()
}

/// The origin and metadata a record holds; `None` for anything else.
fn decode_record(record: &[u8]) -> Option<(String, TensorMeta)> {
    let mut rest = record.strip_prefix(RECORD_MAGIC)?;
    if rest.len() < 2 {
        return None;
    }
    let origin_len = usize::from(rest.get_u16_le());
    let origin = String::from_utf8(rest.get(..origin_len)?.to_vec()).ok()?;
    rest.advance(origin_len);
    // The receiver's own bytes, already judged by its limits: any size they describe.
    let mut limits = Limits::default();
    limits.max_metadata_len = u32::try_from(rest.len()).ok()?;
    limits.max_dims = u8::MAX;
    limits.max_name_len = u16::MAX;
    limits.max_attributes = u16::MAX;
    limits.max_attribute_len = u16::MAX;
    limits.max_tensor_len = u64::MAX;
    let mut decoder = FrameDecoder::new(limits);
    decoder.push(bytes::Bytes::copy_from_slice(rest));
    match decoder.next_frame() {
        Ok(Some(Frame::Metadata(Metadata { meta }))) => Some((origin, meta)),
        _ => None,
    }
}

/// Writes `bytes` to `path` durably: a temporary file, synced, renamed, and the directory
/// synced, so a crash leaves either no file or the whole of it.
fn write_synced(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let temp = path.with_extension("tmp");
    let mut file = std::fs::File::create(&temp)?;
    std::io::Write::write_all(&mut file, bytes)?;
    file.sync_all()?;
    std::fs::rename(&temp, path)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// Puts the written `temp` file at `path` by `policy`; returns where it went. Keeping both
/// and refusing never replace a file: a hard link fails where the name exists.
fn place(temp: &Path, path: &Path, policy: OnCollision) -> anyhow::Result<PathBuf> {
    if policy == OnCollision::Overwrite {
        std::fs::rename(temp, path)?;
        return Ok(path.to_owned());
    }
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let (stem, extension) = match name.strip_suffix(".safetensors") {
        Some(stem) => (stem.to_owned(), ".safetensors"),
        None => (name.clone(), ""),
    };
    // Bounded: a directory with this many files of one name is a problem of its own.
    for n in 0..10_000u32 {
        let candidate = match n {
            0 => path.to_owned(),
            n => path.with_file_name(format!("{stem}.{n}{extension}")),
        };
        match std::fs::hard_link(temp, &candidate) {
            Ok(()) => {
                std::fs::remove_file(temp)?;
                return Ok(candidate);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                if policy == OnCollision::Refuse {
                    anyhow::bail!(
                        "{} exists already (--on-collision refuse)",
                        candidate.display()
                    );
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
    anyhow::bail!(
        "{} and 9999 numbered files of its name exist already",
        path.display()
    )
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
        let mut save = SaveDir::open(&dir, OnCollision::KeepBoth).unwrap().0;
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
        let mut save = SaveDir::open(&dir, OnCollision::KeepBoth).unwrap().0;
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

    /// A write that fails (here: a directory stands where the file goes, and the policy
    /// would replace it) is an error naming
    /// the file, and the received bytes are kept in the spool, named in the error.
    #[test]
    fn a_failed_write_names_the_file_and_keeps_the_bytes() {
        let dir = temp("blocked");
        let mut save = SaveDir::open(&dir, OnCollision::Overwrite).unwrap().0;
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
        drop(SaveDir::open(&dir, OnCollision::KeepBoth).unwrap().0);
        assert!(Path::new(kept).exists(), "{kept} gone");
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// Spools `fill` bytes for `meta` as a receiver of process `pid` would have, with the
    /// record a confirmed tensor has when `confirmed`.
    fn orphan(dir: &Path, pid: u32, n: u32, meta: &TensorMeta, fill: u8, confirmed: bool) {
        let part = dir.join(SPOOL).join(format!("{pid}-{n}.part"));
        std::fs::create_dir_all(part.parent().unwrap()).unwrap();
        std::fs::write(&part, vec![fill; meta.byte_len() as usize]).unwrap();
        if confirmed {
            let record = encode_record("10.0.0.9:4433", meta);
            write_synced(&part.with_extension("meta"), &record).unwrap();
        }
    }

    fn file_meta(name: &str, file: &str, of: usize) -> TensorMeta {
        TensorMeta::new([4], DType::U8)
            .unwrap()
            .with_name(name)
            .with_attribute(FILE_ATTR, file)
            .with_attribute(FILE_TENSORS_ATTR, of.to_string())
            .with_attribute(SENDER_ATTR, "7")
    }

    fn written(jobs: Vec<SaveJob>) -> Vec<String> {
        let mut names: Vec<String> = jobs
            .into_iter()
            .map(|job| {
                let path = job.write().unwrap();
                path.file_name().unwrap().to_string_lossy().into_owned()
            })
            .collect();
        names.sort();
        names
    }

    /// A process id that no process has (above the kernel's largest).
    const GONE: u32 = 4_194_304_999;

    /// A receiver that died left confirmed tensors of a file that completed, of one that
    /// did not, and of no file, and a tensor it never confirmed: the next receiver on the
    /// directory writes the first as the file, the second as a partial file and the third
    /// on its own, removes the unconfirmed bytes, and leaves a live receiver's spool alone.
    #[test]
    fn a_restart_recovers_every_confirmed_tensor() {
        let dir = temp("recover");
        let (save, _) = SaveDir::open(&dir, OnCollision::KeepBoth).unwrap();
        let (_, live) = tensor(&save, "live", "", 0, 1);
        orphan(
            &dir,
            GONE,
            0,
            &file_meta("a", "whole.safetensors", 2),
            1,
            true,
        );
        orphan(
            &dir,
            GONE,
            1,
            &file_meta("b", "whole.safetensors", 2),
            2,
            true,
        );
        orphan(
            &dir,
            GONE,
            2,
            &file_meta("c", "half.safetensors", 3),
            3,
            true,
        );
        let solo = TensorMeta::new([4], DType::U8).unwrap().with_name("solo");
        orphan(&dir, GONE, 3, &solo, 4, true);
        orphan(&dir, GONE, 4, &solo, 5, false);

        let (_, recovery) = SaveDir::open(&dir, OnCollision::KeepBoth).unwrap();
        assert_eq!(recovery.unconfirmed_removed, 1);
        assert_eq!(
            written(recovery.jobs),
            [
                "half.partial-1of3.safetensors",
                "solo.safetensors",
                "whole.safetensors"
            ]
        );
        let bytes = std::fs::read(dir.join("whole.safetensors")).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(file.tensor("a").unwrap().data(), &[1u8; 4]);
        assert_eq!(file.tensor("b").unwrap().data(), &[2u8; 4]);
        let bytes = std::fs::read(dir.join("solo.safetensors")).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(
            file.tensor("solo").unwrap().data(),
            &[4u8; 4],
            "the confirmed one"
        );
        let mut spool: Vec<_> = std::fs::read_dir(dir.join(SPOOL))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        spool.sort();
        assert_eq!(
            spool,
            std::slice::from_ref(&live.path),
            "only the live receiver's bytes remain"
        );
        drop(live);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A record that does not describe its bytes (a torn write) is not trusted: the bytes
    /// are treated as unconfirmed.
    #[test]
    fn a_record_that_does_not_match_its_bytes_recovers_nothing() {
        let dir = temp("torn");
        let meta = TensorMeta::new([8], DType::U8).unwrap().with_name("x");
        orphan(&dir, GONE, 0, &meta, 1, true);
        std::fs::write(dir.join(SPOOL).join(format!("{GONE}-0.part")), [1u8; 3]).unwrap();
        std::fs::write(dir.join(SPOOL).join(format!("{GONE}-1.part")), [1u8; 3]).unwrap();
        std::fs::write(dir.join(SPOOL).join(format!("{GONE}-1.meta")), b"garbage").unwrap();
        let (_, recovery) = SaveDir::open(&dir, OnCollision::KeepBoth).unwrap();
        assert!(recovery.jobs.is_empty());
        assert_eq!(recovery.unconfirmed_removed, 2);
        assert_eq!(std::fs::read_dir(dir.join(SPOOL)).unwrap().count(), 0);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn records_round_trip() {
        let meta = file_meta("layer.0", "m.safetensors", 3).with_attribute("k", "v".repeat(3000));
        let record = encode_record("[::1]:7000", &meta);
        assert_eq!(
            decode_record(&record),
            Some(("[::1]:7000".to_owned(), meta))
        );
        assert_eq!(decode_record(&record[..record.len() - 1]), None);
        assert_eq!(decode_record(b"tensorwire spool record 1\n"), None);
    }

    /// Two files of one name: kept both (the second numbered), replaced, or refused with the
    /// bytes kept, by the policy.
    #[test]
    fn a_name_already_saved_is_kept_replaced_or_refused_by_policy() {
        for (policy, expect) in [
            (
                OnCollision::KeepBoth,
                vec!["acts.1.safetensors", "acts.safetensors"],
            ),
            (OnCollision::Overwrite, vec!["acts.safetensors"]),
            (OnCollision::Refuse, vec!["acts.safetensors"]),
        ] {
            let dir = temp(&format!("collide-{policy:?}"));
            let (mut save, _) = SaveDir::open(&dir, policy).unwrap();
            let (m, b) = tensor(&save, "acts", "", 0, 1);
            save.add("peer-a", m, b).unwrap().write().unwrap();
            let (m, b) = tensor(&save, "acts", "", 0, 2);
            let second = save.add("peer-b", m, b).unwrap().write();
            let mut names: Vec<_> = std::fs::read_dir(&dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|n| n != SPOOL)
                .collect();
            names.sort();
            assert_eq!(names, expect, "{policy:?}");
            let first = std::fs::read(dir.join("acts.safetensors")).unwrap();
            let first = safetensors::SafeTensors::deserialize(&first).unwrap();
            let fill = first.tensor("acts").unwrap().data()[0];
            match policy {
                OnCollision::KeepBoth => {
                    assert_eq!(fill, 1);
                    assert!(second.unwrap().ends_with("acts.1.safetensors"));
                }
                OnCollision::Overwrite => assert_eq!(fill, 2),
                OnCollision::Refuse => {
                    assert_eq!(fill, 1);
                    let err = format!("{:#}", second.unwrap_err());
                    assert!(err.contains("exists already"), "{err}");
                    let kept = std::fs::read_dir(dir.join(SPOOL))
                        .unwrap()
                        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                        .filter(|n| n.starts_with("kept-") && n.ends_with(".part"))
                        .count();
                    assert_eq!(kept, 1, "the refused file's bytes are kept");
                }
            }
            std::fs::remove_dir_all(dir).unwrap();
        }
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
