//! The parts of a split tensor (spec §15) landing in one destination: the first part to arrive
//! admits the whole's sink, every part writes its own range of it, and the part that lands
//! last finishes the whole and hands it over, once.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use tensorwire_proto::split::{SplitAssembly, SplitId, SplitPart};
use tensorwire_proto::{ErrorCode, Payload, ProtocolError, Receipt, TensorMeta};
use tokio::sync::OnceCell;

use crate::{Carrier, CreditPermit, Sink, SinkError};

/// A sink whose destination several parts can fill at once, each through a writer of its
/// own; parts of a sink that has none write through it one at a time.
pub trait Divisible: Sink {
    /// A writer into the same destination, at the whole's offsets.
    type Part: Sink;

    /// Another writer beside this one, or `None` if writes must go through this sink.
    fn part(&mut self) -> Option<Self::Part>;
}

/// Wholes being assembled at once, at most; parts of another are refused (RESOURCE_EXHAUSTED).
pub const MAX_ASSEMBLING: usize = 1024;

/// Wholes one peer (IP address) may have assembled at once: a sender splits at most one
/// tensor per connection it opens, so this leaves room for many senders on one host while
/// one peer cannot fill [`MAX_ASSEMBLING`] and refuse every other.
pub const MAX_ASSEMBLING_PER_PEER: usize = 64;

type Key = (IpAddr, SplitId);
type Entry<S> = Arc<OnceCell<Result<Arc<Whole<S>>, SinkError>>>;
type Open<S> = Mutex<HashMap<Key, Entry<S>>>;

/// A receiver's split tensors being assembled, by peer address and id. Clones share them.
pub struct SplitTensors<S: Divisible> {
    open: Arc<Open<S>>,
    within: Duration,
}

impl<S: Divisible> Clone for SplitTensors<S> {
    fn clone(&self) -> Self {
        Self {
            open: self.open.clone(),
            within: self.within,
        }
    }
}

/// A whole assembled from its parts: its description and its sink's output.
#[derive(Debug)]
pub struct Assembled<T> {
    /// The whole tensor, as the parts described it (spec §15).
    pub meta: TensorMeta,
    /// What the whole's sink produced.
    pub output: T,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl<S: Divisible> SplitTensors<S> {
    /// Assemblies whose parts must all arrive within `within` of the first; otherwise the
    /// whole is refused and its destination freed.
    pub fn new(within: Duration) -> Self {
        Self {
            open: Arc::default(),
            within,
        }
    }

    /// Wholes being assembled now (or refused, and remembered until their time is up).
    pub fn assembling(&self) -> usize {
        lock(&self.open).len()
    }

    /// The sink for `part`, from a peer at `peer` over `carrier` (its connection: once every
    /// connection that carried a whole's parts has closed, the whole fails at once). The
    /// first part of a whole to arrive
    /// admits the whole's sink with `admit` (once, however many parts wait for it); the
    /// others share its outcome. Fails with the admission's error, or SPLIT_MISMATCH (and
    /// fails the whole) if the part does not fit the parts before it.
    pub async fn join<F, Fut>(
        &self,
        peer: IpAddr,
        carrier: &Carrier,
        part: &SplitPart,
        admit: F,
    ) -> Result<PartSink<S>, SinkError>
    where
        F: FnOnce(TensorMeta) -> Fut,
        Fut: Future<Output = Result<S, SinkError>>,
    {
        let key = (peer, part.id());
        let entry = {
            let mut open = lock(&self.open);
            match open.get(&key) {
                Some(entry) => entry.clone(),
                None => {
                    if open.len() >= MAX_ASSEMBLING {
                        return Err(SinkError::exhausted(format!(
                            "{MAX_ASSEMBLING} split tensors are being assembled already"
                        )));
                    }
                    // One peer may not take every slot (spec §10).
                    let of_peer = open.keys().filter(|(ip, _)| *ip == peer).count();
                    if of_peer >= MAX_ASSEMBLING_PER_PEER {
                        return Err(SinkError::exhausted(format!(
                            "{peer} has {of_peer} split tensors being assembled already (at \
                             most {MAX_ASSEMBLING_PER_PEER} per peer)"
                        )));
                    }
                    let entry = Entry::<S>::default();
                    open.insert(key, entry.clone());
                    self.expire(key, &entry);
                    entry
                }
            }
        };
        let whole = entry
            .get_or_init(|| async {
                let meta = part.whole().clone();
                admit(meta.clone()).await.map(|sink| {
                    Arc::new(Whole {
                        meta,
                        sink: tokio::sync::Mutex::new(Some(sink)),
                        state: Mutex::new(State {
                            assembly: SplitAssembly::new(part),
                            failed: None,
                            carriers: Vec::new(),
                        }),
                        open: Arc::downgrade(&self.open),
                        key,
                        gone: Carrier::new(),
                    })
                })
            })
            .await
            .clone()?;
        whole.join(part).await?;
        Whole::carried_by(&whole, carrier);
        let direct = match whole.sink.lock().await.as_mut() {
            Some(sink) => sink.part(),
            None => return Err(whole.failure()),
        };
        Ok(PartSink {
            whole,
            base: part.offset(),
            direct,
            landed: false,
        })
    }

    /// Fails the whole of `entry` if its parts have not all arrived in time, and forgets it
    /// then (a refused whole is remembered until then, so its late parts are refused at once).
    fn expire(&self, key: Key, entry: &Entry<S>) {
        let (open, entry, within) = (
            Arc::downgrade(&self.open),
            Arc::downgrade(entry),
            self.within,
        );
        tokio::spawn(async move {
            tokio::time::sleep(within).await;
            let Some(entry) = entry.upgrade() else {
                return;
            };
            if let Some(Ok(whole)) = entry.get()
                && !whole.all_joined()
            {
                let why = format!(
                    "the parts of {:?} did not all arrive within {:.1} s",
                    whole.meta.name(),
                    within.as_secs_f64()
                );
                whole.fail(SinkError::exhausted(why)).await;
            }
            if let Some(open) = open.upgrade() {
                let mut open = lock(&open);
                if open.get(&key).is_some_and(|e| Arc::ptr_eq(e, &entry)) {
                    open.remove(&key);
                }
            }
        });
    }
}

/// One whole: its sink (until it finishes or fails) and its assembly.
struct Whole<S: Divisible> {
    meta: TensorMeta,
    sink: tokio::sync::Mutex<Option<S>>,
    state: Mutex<State>,
    open: Weak<Open<S>>,
    key: Key,
    /// Closed when the whole is dropped, so its carriers' watchers end.
    gone: Carrier,
}

impl<S: Divisible> Drop for Whole<S> {
    fn drop(&mut self) {
        self.gone.close();
    }
}

struct State {
    assembly: SplitAssembly,
    failed: Option<SinkError>,
    /// The connections its parts came over; once all have closed, no more can come.
    carriers: Vec<Carrier>,
}

fn split_error(e: ProtocolError) -> SinkError {
    SinkError {
        code: e.code(),
        message: e.to_string(),
    }
}

impl<S: Divisible> Whole<S> {
    fn failure(&self) -> SinkError {
        lock(&self.state).failed.clone().unwrap_or_else(|| {
            SinkError::failed(format!("{:?} was already finished", self.meta.name()))
        })
    }

    fn check(&self) -> Result<(), SinkError> {
        match &lock(&self.state).failed {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    fn all_joined(&self) -> bool {
        lock(&self.state).assembly.all_joined()
    }

    async fn join(&self, part: &SplitPart) -> Result<(), SinkError> {
        let joined = {
            let mut state = lock(&self.state);
            if let Some(e) = &state.failed {
                return Err(e.clone());
            }
            state.assembly.join(part).map_err(split_error)
        };
        if let Err(e) = &joined {
            // A part that does not fit spoils the whole: its other parts are cancelled.
            self.fail(e.clone()).await;
        }
        joined
    }

    /// Counts `carrier` among the whole's; the first time, watches it: once every carrier
    /// has closed, parts still missing can no longer come, and the whole fails at once
    /// rather than hold its destination until the parts' deadline.
    fn carried_by(whole: &Arc<Self>, carrier: &Carrier) {
        {
            let mut state = lock(&whole.state);
            if state.carriers.iter().any(|c| c.same_as(carrier)) {
                return;
            }
            state.carriers.push(carrier.clone());
        }
        let (gone, whole, carrier) = (whole.gone.clone(), Arc::downgrade(whole), carrier.clone());
        // Ends with the whole, so that a connection carrying many wholes keeps no watchers.
        tokio::spawn(async move {
            tokio::select! {
                () = carrier.closed() => {}
                () = gone.closed() => return,
            }
            if let Some(whole) = whole.upgrade() {
                whole.carrier_closed().await;
            }
        });
    }

    /// Fails the whole if every carrier has closed and it is still waiting for parts.
    async fn carrier_closed(&self) {
        let why = {
            let state = lock(&self.state);
            if !state.carriers.iter().all(Carrier::is_closed) || state.failed.is_some() {
                return;
            }
            format!(
                "every connection that carried parts of {:?} closed before its last part came",
                self.meta.name()
            )
        };
        // Finished wholes have handed their sink over: nothing to fail.
        if self.sink.lock().await.is_some() {
            self.fail(SinkError::failed(why)).await;
        }
    }

    /// Marks the whole failed (the first cause is kept) and frees its destination.
    async fn fail(&self, error: SinkError) {
        self.mark_failed(error);
        drop(self.sink.lock().await.take());
        self.forget();
    }

    fn mark_failed(&self, error: SinkError) {
        lock(&self.state).failed.get_or_insert(error);
    }

    /// Removes the whole from its receiver's map once it is done.
    fn forget(&self) {
        let Some(open) = self.open.upgrade() else {
            return;
        };
        let mut open = lock(&open);
        let mine = open.get(&self.key).is_some_and(|entry| {
            matches!(entry.get(), Some(Ok(whole)) if std::ptr::eq(Arc::as_ptr(whole), self))
        });
        if mine && lock(&self.state).failed.is_none() {
            open.remove(&self.key);
        }
    }
}

/// The sink of one part: writes its bytes at the part's place in the whole. Finishing the
/// part that lands last finishes the whole and yields it.
pub struct PartSink<S: Divisible> {
    whole: Arc<Whole<S>>,
    base: u64,
    direct: Option<S::Part>,
    landed: bool,
}

impl<S: Divisible> PartSink<S> {
    /// The whole this part belongs to.
    pub fn whole(&self) -> &TensorMeta {
        &self.whole.meta
    }
}

impl<S: Divisible> Sink for PartSink<S> {
    type Output = Option<Assembled<S::Output>>;

    /// Writes through the part's own writer, or through the whole's sink in turn.
    async fn store(
        &mut self,
        offset: u64,
        payload: Payload,
        permit: CreditPermit,
        crc: Option<&mut u32>,
    ) -> Result<(), SinkError> {
        self.whole.check()?;
        let at = self.base + offset;
        if let Some(direct) = self.direct.as_mut() {
            return direct.store(at, payload, permit, crc).await;
        }
        let mut sink = self.whole.sink.lock().await;
        self.whole.check()?;
        match sink.as_mut() {
            Some(sink) => sink.store(at, payload, permit, crc).await,
            None => Err(self.whole.failure()),
        }
    }

    async fn flush(&mut self) -> Result<(), SinkError> {
        if let Some(direct) = self.direct.as_mut() {
            return direct.flush().await;
        }
        match self.whole.sink.lock().await.as_mut() {
            Some(sink) => sink.flush().await,
            None => Err(self.whole.failure()),
        }
    }

    async fn finish(mut self) -> Result<Self::Output, SinkError> {
        if let Some(direct) = self.direct.take() {
            direct.finish().await?;
        }
        let whole = self.whole.clone();
        let complete = {
            let mut state = lock(&whole.state);
            if let Some(e) = &state.failed {
                return Err(e.clone());
            }
            state.assembly.landed().map_err(split_error)?
        };
        self.landed = true;
        if !complete {
            return Ok(None);
        }
        let Some(sink) = whole.sink.lock().await.take() else {
            return Err(whole.failure());
        };
        let finished = sink.finish().await;
        match finished {
            Ok(output) => {
                whole.forget();
                Ok(Some(Assembled {
                    meta: whole.meta.clone(),
                    output,
                }))
            }
            Err(e) => {
                whole.fail(e.clone()).await;
                Err(e)
            }
        }
    }
}

impl<S: Divisible> Drop for PartSink<S> {
    fn drop(&mut self) {
        if self.landed {
            return;
        }
        // Cancelled or failed before its last byte: the whole cannot land.
        let rows = self.whole.meta.shape().first().copied().unwrap_or(0);
        self.whole.mark_failed(SinkError {
            code: ErrorCode::CANCELLED,
            message: format!(
                "another part of {:?} ({rows} rows) ended before it landed",
                self.whole.meta.name()
            ),
        });
        // The destination goes now unless a part is writing, which then sees the failure.
        if let Ok(mut sink) = self.whole.sink.try_lock() {
            drop(sink.take());
        }
    }
}

/// What an [`Assembling`] sink hands over: a whole tensor, or word that a part landed.
#[derive(Debug)]
pub enum Landing<T> {
    /// A tensor sent whole, or the whole of a split tensor whose last part this was.
    Whole(Assembled<T>),
    /// A part of a split tensor whose other parts are still landing.
    Part,
}

/// The sink of a tensor that may be a part of a split one (spec §15): a sink of its own for
/// a tensor sent whole, its part of the whole's otherwise. Made by [`SplitTensors::admit`].
pub enum Assembling<S: Divisible> {
    /// A tensor sent whole, into its own sink.
    Whole(TensorMeta, S),
    /// A part, into its whole's sink.
    Part(PartSink<S>),
}

impl<S: Divisible> SplitTensors<S> {
    /// The sink for a tensor described by `meta` from a peer at `peer` over `carrier`: for
    /// a tensor sent
    /// whole, `admit(meta)`; for a part of a split tensor (spec §15), its share of the whole,
    /// which the first of its parts admits with `admit(whole)` ([`join`](Self::join)).
    /// `max_whole_len` is the receiver's largest tensor, which applies to the whole. Fails
    /// with the admission's error, SPLIT_MISMATCH or TENSOR_TOO_LARGE; the caller refuses
    /// the tensor with it.
    pub async fn admit<F, Fut>(
        &self,
        peer: IpAddr,
        carrier: &Carrier,
        meta: &TensorMeta,
        max_whole_len: u64,
        admit: F,
    ) -> Result<Assembling<S>, SinkError>
    where
        F: FnOnce(TensorMeta) -> Fut,
        Fut: Future<Output = Result<S, SinkError>>,
    {
        match SplitPart::of(meta, max_whole_len).map_err(split_error)? {
            None => Ok(Assembling::Whole(meta.clone(), admit(meta.clone()).await?)),
            Some(part) => self
                .join(peer, carrier, &part, admit)
                .await
                .map(Assembling::Part),
        }
    }
}

impl<S: Divisible> Sink for Assembling<S> {
    type Output = Landing<S::Output>;

    async fn store(
        &mut self,
        offset: u64,
        payload: Payload,
        permit: CreditPermit,
        crc: Option<&mut u32>,
    ) -> Result<(), SinkError> {
        match self {
            Assembling::Whole(_, sink) => sink.store(offset, payload, permit, crc).await,
            Assembling::Part(part) => part.store(offset, payload, permit, crc).await,
        }
    }

    async fn flush(&mut self) -> Result<(), SinkError> {
        match self {
            Assembling::Whole(_, sink) => sink.flush().await,
            Assembling::Part(part) => part.flush().await,
        }
    }

    /// A whole tensor's sink may checksum its landed bytes; a part is checksummed as it
    /// arrives (its END covers the part, not the destination).
    fn take_checksum(&mut self) -> bool {
        match self {
            Assembling::Whole(_, sink) => sink.take_checksum(),
            Assembling::Part(_) => false,
        }
    }

    async fn landed_checksum(&mut self) -> Result<u32, SinkError> {
        match self {
            Assembling::Whole(_, sink) => sink.landed_checksum().await,
            Assembling::Part(_) => Err(SinkError::failed(
                "a split tensor's part is checksummed as it arrives",
            )),
        }
    }

    /// The whole's, from the part that completed it; a part whose whole is still landing
    /// has nothing to say.
    fn receipt(output: &Self::Output) -> Receipt {
        match output {
            Landing::Whole(whole) => S::receipt(&whole.output),
            Landing::Part => Receipt::new(),
        }
    }

    async fn finish(self) -> Result<Self::Output, SinkError> {
        Ok(match self {
            Assembling::Whole(meta, sink) => Landing::Whole(Assembled {
                meta,
                output: sink.finish().await?,
            }),
            Assembling::Part(part) => match part.finish().await? {
                Some(whole) => Landing::Whole(whole),
                None => Landing::Part,
            },
        })
    }
}
