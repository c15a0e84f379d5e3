//! Where large DATA payloads are stored. A tensor's stream task shares its thread with its
//! connection's packet processing (decryption, acknowledgements), so that small tensors
//! need no hand-off between cores. Storing a large payload (the sink's copy and the
//! checksum) there too caps one connection at what one core does for both; while the host
//! has cores to spare, the tensor's stores run on a task of their own on another thread
//! instead, beside the decryption of the next packets. On a loaded host they stay on the
//! stream's thread, where the bytes are still in that core's cache: moving them then costs
//! more CPU per byte than it frees. Cores are the host's, so the load is counted
//! across all of a process's receivers.
//!
//! A tensor's stores off its thread form a queue ([`OffThreadStores`]): the stream task
//! hands each DATA over and reads the next at once, so the session counts the bytes as
//! arrived (and grants the credit that frees) while earlier ones are still being stored.
//! Waiting for each store instead leaves the stream task waiting on hand-offs between
//! threads most of the time.
//! When connections get busy while a tensor stores off its thread, more tensors may be
//! storing off their threads than the host now has cores for: the excess come back to
//! their streams' threads at their next payload, once those handed over are stored.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tensorwire_proto::frame::Data;
use tensorwire_sink::{CreditPermit, Sink, SinkError};
use tokio::runtime::{Handle, RuntimeFlavor};
use tokio::sync::mpsc;
use tokio::task::JoinError;
use tokio_util::task::AbortOnDropHandle;

use crate::config::StoreOffload;
use crate::error::TransportError;
use crate::runtime::EndpointThreads;

/// DATA handed to a tensor's stores off its thread and not yet taken up: with the payload
/// being stored, at most this many plus one are held in the queue at once (each under its
/// credit), and their checksums owed to the session (`MAX_CHECKSUMS_OWED` bounds it there).
const QUEUED_STORES: usize = 4;

/// Payloads at least this long (the senders' default DATA size) may move a tensor's stores
/// off the stream's thread: handing over smaller ones costs more than it frees
/// (benches/results/LOG.md).
pub(crate) const OFFLOAD_MIN_PAYLOAD: usize = 1 << 20;

/// What the process's receivers are doing now, weighed against the host's cores.
#[derive(Debug, Default)]
pub(super) struct HostLoad {
    /// Tensors storing off their streams' threads.
    running: AtomicUsize,
    /// Connections with a large tensor being received.
    busy_connections: AtomicUsize,
}

/// Every receiver of the process counts here.
static HOST_LOAD: HostLoad = HostLoad {
    running: AtomicUsize::new(0),
    busy_connections: AtomicUsize::new(0),
};

/// Where one receiver's tensors store their payloads.
pub(super) struct Offloader {
    /// Where stores off their streams' threads run; `None` when they never leave them.
    runtime: Option<Handle>,
    policy: StoreOffload,
    cores: usize,
    load: &'static HostLoad,
}

impl Offloader {
    /// Stores for a receiver bound on the current runtime, whose endpoints run where
    /// `endpoints` says.
    pub(super) fn new(policy: StoreOffload, endpoints: EndpointThreads) -> Self {
        Self::counting_in(&HOST_LOAD, policy, endpoints)
    }

    fn counting_in(
        load: &'static HostLoad,
        policy: StoreOffload,
        endpoints: EndpointThreads,
    ) -> Self {
        let runtime = match policy {
            StoreOffload::Never => None,
            // The caller's workers already run the endpoints: no core is left to take stores.
            StoreOffload::Auto if endpoints == EndpointThreads::Caller => None,
            StoreOffload::Auto | StoreOffload::UpTo(_) => Handle::try_current()
                .ok()
                .filter(|h| h.runtime_flavor() != RuntimeFlavor::CurrentThread),
        };
        let workers = runtime.as_ref().map_or(0, |h| h.metrics().num_workers());
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        Self {
            runtime,
            policy,
            cores: cores.min(workers),
            load,
        }
    }

    /// How many tensors may store off their streams' threads at once now.
    fn limit(&self) -> usize {
        match self.policy {
            StoreOffload::Never => 0,
            StoreOffload::UpTo(n) => n.get(),
            StoreOffload::Auto => self
                .cores
                .saturating_sub(2 * self.load.busy_connections.load(Ordering::Relaxed)),
        }
    }

    /// Moves the stores of a tensor of `connection` off its stream's thread, if a payload of
    /// `len` bytes may move them now: the runtime to run them on and the tensor's place
    /// among those storing there; `None` keeps them on the stream's thread. From its first
    /// payload large enough to move, the tensor counts its connection as busy
    /// (`receiving`), so small tensors touch no shared counter.
    fn place(
        self: &Arc<Self>,
        len: usize,
        connection: &Arc<ConnectionLoad>,
        receiving: &mut Option<Receiving>,
    ) -> Option<(Handle, OffloadSlot)> {
        let runtime = self
            .runtime
            .as_ref()
            .filter(|_| len >= OFFLOAD_MIN_PAYLOAD)?;
        receiving.get_or_insert_with(|| self.receiving(connection));
        let limit = self.limit();
        self.load
            .running
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .ok()?;
        Some((
            runtime.clone(),
            OffloadSlot {
                offloader: self.clone(),
                held: true,
            },
        ))
    }

    /// Counts `connection` as carrying a large tensor until the returned guard drops.
    fn receiving(self: &Arc<Self>, connection: &Arc<ConnectionLoad>) -> Receiving {
        if connection.receiving.fetch_add(1, Ordering::AcqRel) == 0 {
            self.load.busy_connections.fetch_add(1, Ordering::AcqRel);
        }
        Receiving {
            offloader: self.clone(),
            connection: connection.clone(),
        }
    }
}

/// One tensor storing off its stream's thread.
pub(super) struct OffloadSlot {
    offloader: Arc<Offloader>,
    /// Whether this tensor still counts among those storing off their threads.
    held: bool,
}

impl OffloadSlot {
    /// Gives up this tensor's place if more tensors store off their threads than the load
    /// now allows (connections got busy since it moved); returns whether it did. Only the
    /// excess gives up: each one that does lowers the count the next one sees.
    fn give_up_if_over_limit(&mut self) -> bool {
        if !self.held {
            return false;
        }
        let limit = self.offloader.limit();
        let gave_up = self
            .offloader
            .load
            .running
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n > limit).then(|| n - 1)
            })
            .is_ok();
        self.held = !gave_up;
        gave_up
    }
}

impl Drop for OffloadSlot {
    fn drop(&mut self) {
        if self.held {
            self.offloader.load.running.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Called with each payload's CRC-32C (none where the sink checksums the landed tensor) and
/// length once it is stored, in order: records the CRC with the tensor's session and counts
/// the bytes.
pub(super) type OnStored = Box<dyn FnMut(Option<u32>, u64) -> Result<(), TransportError> + Send>;

/// Where a tensor's bytes are checksummed (spec §7.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Checksums {
    /// Each payload as it is stored, in the same pass as the sink's copy.
    PerPayload,
    /// The whole tensor once landed, by its sink ([`Sink::landed_checksum`]).
    OfLandedBytes,
}

impl Checksums {
    /// Stores `data` into `sink`; its CRC-32C where each payload is checksummed.
    pub(super) async fn store<S: Sink>(
        self,
        sink: &mut S,
        data: Data,
        permit: CreditPermit,
    ) -> Result<Option<u32>, SinkError> {
        match self {
            Self::PerPayload => sink
                .write_checksummed(data.offset, data.payload, permit)
                .await
                .map(Some),
            Self::OfLandedBytes => sink
                .write(data.offset, data.payload, permit)
                .await
                .map(|()| None),
        }
    }
}

/// Where a tensor's payloads are stored: into its sink on the stream's own task, until a
/// large payload moves them off the thread ([`Offloader::place`]); then, in order, there.
pub(super) enum Stores<S> {
    /// On the stream's own task.
    Here(S),
    /// On a task of their own, off the stream's thread.
    OffThread(OffThreadStores<S>),
}

impl<S: Sink> Stores<S> {
    /// Where the tensor's next payload, of `len` bytes, is stored. Stores off the thread come
    /// back to the stream's own task, once those handed over are stored, when the host has
    /// no core to spare for them now ([`StoreOffload::Auto`]: connections got busy since
    /// they moved). Stores here move off the thread when `offloader` places them, each
    /// stored payload then reported to `on_stored`.
    pub(super) async fn for_payload(
        mut self,
        len: usize,
        offloader: &Arc<Offloader>,
        connection: &Arc<ConnectionLoad>,
        receiving: &mut Option<Receiving>,
        checksums: Checksums,
        on_stored: impl FnOnce() -> OnStored,
    ) -> Result<Self, TransportError> {
        if let Self::OffThread(stores) = &mut self
            && stores.slot.give_up_if_over_limit()
        {
            self = Self::Here(self.into_sink().await?);
        }
        Ok(match self {
            Self::Here(sink) => match offloader.place(len, connection, receiving) {
                Some(place) => {
                    Self::OffThread(OffThreadStores::start(place, sink, checksums, on_stored()))
                }
                None => Self::Here(sink),
            },
            off_thread => off_thread,
        })
    }

    /// Resolves once stores off the thread end on their own, which they do only when one
    /// failed; never for stores here.
    pub(super) async fn failed(&mut self) -> TransportError {
        match self {
            Self::OffThread(stores) => stores.failed().await,
            Self::Here(_) => std::future::pending().await,
        }
    }

    /// Waits for every payload handed over to be stored; the sink back.
    /// Has the sink release the bytes it holds back ([`Sink::flush`]), after any stores
    /// handed over before.
    pub(super) async fn flush(&mut self) -> Result<(), TransportError> {
        match self {
            Self::Here(sink) => Ok(sink.flush().await?),
            Self::OffThread(stores) => stores.flush().await,
        }
    }

    pub(super) async fn into_sink(self) -> Result<S, TransportError> {
        match self {
            Self::Here(sink) => Ok(sink),
            Self::OffThread(stores) => stores.finish().await,
        }
    }
}

/// A tensor's stores on a task of their own off its stream's thread: each DATA handed over
/// is stored in the order it came, and [`finish`](Self::finish) hands the sink back. Dropped
/// before that (the tensor failed), it stops them: what is queued is dropped, its credit
/// returning.
/// What a tensor's stream hands its stores off its thread, in order.
enum Queued {
    /// DATA to store, under its credit.
    Data(Data, CreditPermit),
    /// The tensor ran out of credit: the sink releases what it holds ([`Sink::flush`]).
    Flush,
}

pub(super) struct OffThreadStores<S> {
    queue: mpsc::Sender<Queued>,
    task: AbortOnDropHandle<Result<S, TransportError>>,
    /// The tensor's place among those storing off their threads, until the stores end.
    slot: OffloadSlot,
}

impl<S: Sink> OffThreadStores<S> {
    /// Starts storing into `sink` on `runtime`, holding `slot` until the stores end.
    fn start(
        (runtime, slot): (Handle, OffloadSlot),
        mut sink: S,
        checksums: Checksums,
        mut on_stored: OnStored,
    ) -> Self {
        let (queue, mut queued) = mpsc::channel::<Queued>(QUEUED_STORES);
        let task = runtime.spawn(async move {
            while let Some(next) = queued.recv().await {
                match next {
                    Queued::Data(data, permit) => {
                        let len = data.payload.len() as u64;
                        let crc = checksums.store(&mut sink, data, permit).await?;
                        on_stored(crc, len)?;
                    }
                    Queued::Flush => sink.flush().await?,
                }
            }
            Ok(sink)
        });
        Self {
            queue,
            task: AbortOnDropHandle::new(task),
            slot,
        }
    }

    /// Hands `data` over, waiting while the queue is full; fails with the error that ended
    /// the stores, if they ended.
    pub(super) async fn store(
        &mut self,
        data: Data,
        permit: CreditPermit,
    ) -> Result<(), TransportError> {
        self.hand_over(Queued::Data(data, permit)).await
    }

    /// Has the sink release what it holds once the payloads handed over are stored.
    pub(super) async fn flush(&mut self) -> Result<(), TransportError> {
        self.hand_over(Queued::Flush).await
    }

    async fn hand_over(&mut self, next: Queued) -> Result<(), TransportError> {
        if self.queue.send(next).await.is_ok() {
            return Ok(());
        }
        // The queue's receiver is gone: the stores ended, and their task says why.
        Err(self.failed().await)
    }

    /// Resolves once the stores end on their own, which they do only when one failed.
    async fn failed(&mut self) -> TransportError {
        match (&mut self.task).await {
            Ok(Err(e)) => e,
            Ok(Ok(_)) => SinkError::failed("the stores ended before the tensor did").into(),
            Err(e) => store_task_ended(e),
        }
    }

    /// Waits for every payload handed over to be stored; the sink back.
    async fn finish(self) -> Result<S, TransportError> {
        let Self { queue, task, slot } = self;
        // The queue closes: the task stores what is in it, then ends.
        drop(queue);
        let sink = task.await.map_err(store_task_ended)?;
        drop(slot);
        sink
    }
}

/// The error of a store task that panicked or was cancelled.
fn store_task_ended(e: JoinError) -> TransportError {
    SinkError::failed(format!("the sink's store task ended: {e}")).into()
}

/// Large tensors of one connection being received now.
#[derive(Default)]
pub(super) struct ConnectionLoad {
    receiving: AtomicUsize,
}

/// A large tensor being received, counted in its connection's load.
pub(super) struct Receiving {
    offloader: Arc<Offloader>,
    connection: Arc<ConnectionLoad>,
}

impl Drop for Receiving {
    fn drop(&mut self) {
        if self.connection.receiving.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.offloader
                .load
                .busy_connections
                .fetch_sub(1, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroUsize;

    use super::*;

    fn upto(n: usize) -> StoreOffload {
        StoreOffload::UpTo(NonZeroUsize::new(n).unwrap())
    }

    /// An offloader counting in a load of its own, not the process's.
    fn offloader(policy: StoreOffload, endpoints: EndpointThreads) -> Arc<Offloader> {
        let load = Box::leak(Box::default());
        Arc::new(Offloader::counting_in(load, policy, endpoints))
    }

    #[test]
    fn the_policy_parses_from_its_flag() {
        assert_eq!("auto".parse(), Ok(StoreOffload::Auto));
        assert_eq!("never".parse(), Ok(StoreOffload::Never));
        assert_eq!("3".parse(), Ok(upto(3)));
        assert!("0".parse::<StoreOffload>().is_err());
        assert!("sometimes".parse::<StoreOffload>().is_err());
    }

    /// Asks `offloader` where a payload of `len` bytes of a tensor of `connection` goes.
    fn place(
        offloader: &Arc<Offloader>,
        len: usize,
        connection: &Arc<ConnectionLoad>,
        receiving: &mut Option<Receiving>,
    ) -> Option<OffloadSlot> {
        offloader
            .place(len, connection, receiving)
            .map(|(_, slot)| slot)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn small_payloads_and_a_full_limit_stay_on_the_stream() {
        let offloader = offloader(upto(1), EndpointThreads::default());
        let connection = Arc::new(ConnectionLoad::default());
        let mut receiving = None;
        assert!(
            place(
                &offloader,
                OFFLOAD_MIN_PAYLOAD - 1,
                &connection,
                &mut receiving
            )
            .is_none()
        );
        assert!(receiving.is_none(), "a small payload counts nothing");
        let slot = place(&offloader, OFFLOAD_MIN_PAYLOAD, &connection, &mut receiving);
        assert!(slot.is_some());
        assert!(receiving.is_some(), "a large payload counts its connection");
        assert!(place(&offloader, OFFLOAD_MIN_PAYLOAD, &connection, &mut receiving).is_none());
        drop(slot);
        assert!(place(&offloader, OFFLOAD_MIN_PAYLOAD, &connection, &mut receiving).is_some());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn auto_leaves_two_cores_to_each_busy_connection() {
        let offloader = offloader(StoreOffload::Auto, EndpointThreads::default());
        let cores = offloader.cores;
        assert!(cores >= 1, "a multi-thread runtime has workers");
        let connections: Vec<_> = (0..cores.div_ceil(2))
            .map(|_| Arc::new(ConnectionLoad::default()))
            .collect();
        let (mut first, mut second_tensor_same_connection) = (None, None);
        let _ = place(&offloader, usize::MAX, &connections[0], &mut first);
        let _ = place(
            &offloader,
            usize::MAX,
            &connections[0],
            &mut second_tensor_same_connection,
        );
        assert_eq!(offloader.limit(), cores.saturating_sub(2));
        let mut rest: Vec<_> = connections[1..].iter().map(|_| None).collect();
        for (c, receiving) in connections[1..].iter().zip(&mut rest) {
            let _ = place(&offloader, usize::MAX, c, receiving);
        }
        assert_eq!(
            offloader.limit(),
            0,
            "every core is taken by busy connections"
        );
        let mut another = None;
        assert!(place(&offloader, usize::MAX, &connections[0], &mut another).is_none());
        drop((first, second_tensor_same_connection, rest, another));
        assert_eq!(offloader.limit(), cores);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn only_the_excess_gives_up_its_place_once_connections_get_busy() {
        let mut offloader = Offloader::counting_in(
            Box::leak(Box::default()),
            StoreOffload::Auto,
            EndpointThreads::default(),
        );
        // Seven cores, whatever this host has: one spare once three connections are busy.
        offloader.cores = 7;
        let offloader = Arc::new(offloader);
        let running = || offloader.load.running.load(Ordering::Acquire);
        let connections: Vec<_> = (0..3)
            .map(|_| Arc::new(ConnectionLoad::default()))
            .collect();
        let (mut first, mut second) = (None, None);
        let mut a = place(&offloader, usize::MAX, &connections[0], &mut first).expect("5 spare");
        let mut b = place(&offloader, usize::MAX, &connections[0], &mut second).expect("5 spare");
        assert_eq!(running(), 2);
        let busy_1 = offloader.receiving(&connections[1]);
        assert_eq!(offloader.limit(), 3);
        assert!(
            !a.give_up_if_over_limit(),
            "within the limit, both keep their places"
        );
        assert!(!b.give_up_if_over_limit());
        let busy_2 = offloader.receiving(&connections[2]);
        assert_eq!(offloader.limit(), 1);
        assert!(
            a.give_up_if_over_limit(),
            "two storing where one may: one gives up"
        );
        assert!(!b.give_up_if_over_limit(), "the other keeps its place");
        assert!(!a.give_up_if_over_limit(), "a place is given up once");
        assert_eq!(running(), 1);
        drop(a);
        assert_eq!(running(), 1, "a place given up is not counted off again");
        drop(b);
        assert_eq!(running(), 0);
        drop((busy_1, busy_2, first, second));
        assert_eq!(offloader.limit(), 7);
    }

    #[test]
    fn never_and_a_current_thread_runtime_keep_stores_on_the_stream() {
        let connection = Arc::new(ConnectionLoad::default());
        let never = offloader(StoreOffload::Never, EndpointThreads::default());
        assert!(place(&never, usize::MAX, &connection, &mut None).is_none());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let current = runtime.block_on(async { offloader(upto(4), EndpointThreads::default()) });
        assert!(place(&current, usize::MAX, &connection, &mut None).is_none());
        let caller = tokio::runtime::Builder::new_multi_thread().build().unwrap();
        let on_caller =
            caller.block_on(async { offloader(StoreOffload::Auto, EndpointThreads::Caller) });
        assert!(place(&on_caller, usize::MAX, &connection, &mut None).is_none());
    }
}
