//! What the raw transports send (`--source`): a buffer, a cache-hot buffer, or a mapped file.

use bytes::Bytes;

/// What the raw transports send (`--source`).
#[derive(Clone, Debug)]
pub(crate) enum RawSource {
    /// One `CHUNK` buffer, again and again: stays in the CPU's cache.
    Hot,
    /// A file's bytes, mapped read-only.
    File(std::path::PathBuf),
}

impl std::str::FromStr for RawSource {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "hot" => RawSource::Hot,
            path => RawSource::File(path.into()),
        })
    }
}

impl RawSource {
    /// The bytes to send; `None` is a buffer of `tensor_bytes`, as tensorwire's run sends.
    pub(crate) fn load(source: Option<&RawSource>, tensor_bytes: u64) -> anyhow::Result<Loaded> {
        match source {
            None => Ok(Loaded::Memory(payload(tensor_bytes as usize))),
            Some(RawSource::Hot) => Ok(Loaded::Memory(payload(CHUNK))),
            Some(RawSource::File(path)) => {
                let file = std::fs::File::open(path)
                    .map_err(|e| anyhow::anyhow!("--source {}: {e}", path.display()))?;
                anyhow::ensure!(
                    file.metadata()?.len() > 0,
                    "--source {}: empty",
                    path.display()
                );
                #[allow(unsafe_code)]
                // SAFETY: a read-only private mapping of the benchmark's own input file, which
                // nothing writes while the benchmark runs.
                let map = unsafe { memmap2::Mmap::map(&file)? };
                let _ = map.advise(memmap2::Advice::Sequential);
                Ok(Loaded::Mapped(Bytes::from_owner(map)))
            }
        }
    }
}

/// The bytes the raw transports send, and where they lie.
#[derive(Clone)]
pub(crate) enum Loaded {
    /// In this process's memory.
    Memory(Bytes),
    /// A file's read-only mapping, faulted in as it is sent.
    Mapped(Bytes),
}

impl Loaded {
    /// The pieces the `k`th of `n` connections sends, `bytes` in all: from its own `k/n` of
    /// these bytes, so that no two connections read the same memory at once, going round
    /// as often as needed.
    pub(crate) fn pieces(&self, (k, n): (usize, usize), bytes: u64) -> Pieces {
        let (Loaded::Memory(data) | Loaded::Mapped(data)) = self;
        let mut pieces = Pieces {
            data: data.clone(),
            at: (data.len() / n.max(1) * k) & !4095,
            left: bytes,
            upcoming: None,
            faulting: None,
            fault_ahead: matches!(self, Loaded::Mapped(_)),
        };
        pieces.upcoming = pieces.cut();
        pieces
    }
}

/// Pieces of at most `CHUNK` for one connection (`Loaded::pieces`). A mapping's pages are
/// faulted in one piece ahead on the blocking pool, as `sender` does, so that no fault
/// stalls the sending task.
pub(crate) struct Pieces {
    pub(crate) data: Bytes,
    pub(crate) at: usize,
    pub(crate) left: u64,
    pub(crate) upcoming: Option<Bytes>,
    pub(crate) faulting: Option<tokio::task::JoinHandle<u8>>,
    pub(crate) fault_ahead: bool,
}

impl Pieces {
    /// The next piece to send, its pages in memory; `None` after the last.
    pub(crate) async fn next(&mut self) -> anyhow::Result<Option<Bytes>> {
        let Some(piece) = self.upcoming.take() else {
            return Ok(None);
        };
        if let Some(faulting) = self.faulting.take() {
            faulting.await?;
        }
        self.upcoming = self.cut();
        if let (true, Some(upcoming)) = (self.fault_ahead, &self.upcoming) {
            let upcoming = upcoming.clone();
            // Reading a byte of each page faults it in.
            self.faulting = Some(tokio::task::spawn_blocking(move || {
                std::hint::black_box(upcoming.iter().step_by(4096).fold(0, |a, b| a ^ b))
            }));
        }
        Ok(Some(piece))
    }

    pub(crate) fn cut(&mut self) -> Option<Bytes> {
        if self.left == 0 {
            return None;
        }
        let n = self
            .left
            .min(CHUNK as u64)
            .min((self.data.len() - self.at) as u64) as usize;
        let piece = self.data.slice(self.at..self.at + n);
        self.at = (self.at + n) % self.data.len();
        self.left -= n as u64;
        Some(piece)
    }
}

/// Write granularity for the raw transports, like tensorwire's DATA payloads.
pub(crate) const CHUNK: usize = 4 << 20;

pub(crate) fn payload(len: usize) -> Bytes {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) | 1)
        .collect::<Vec<u8>>()
        .into()
}
