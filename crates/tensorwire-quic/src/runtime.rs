//! Where an endpoint's work runs. An endpoint on a runtime of its own keeps each of its
//! connections' tasks (UDP receive, packet processing, timers, and the tensor streams the
//! library spawns) on the same few threads: a packet decrypted by quinn's connection driver
//! is checksummed and copied from the same core's cache, and no task waits on another core
//! for quinn's per-connection lock, so connections move faster for less CPU than spread
//! over one runtime's workers (benches/results/LOG.md). While
//! the host has cores to spare, a receiver stores large payloads on its caller's runtime
//! instead ([`StoreOffload`](crate::StoreOffload)).

use std::future::Future;
use std::num::NonZeroUsize;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use quinn::{AsyncTimer, AsyncUdpSocket, Runtime, TokioRuntime};
use tokio::runtime::Handle;
use tokio::sync::oneshot;

use crate::error::TransportError;

/// Where each endpoint's work runs ([`TransportSettings::endpoint_threads`]).
///
/// [`TransportSettings::endpoint_threads`]: crate::TransportSettings::endpoint_threads
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum EndpointThreads {
    /// On the tokio runtime that creates the endpoint, spread over its workers.
    Caller,
    /// On a runtime of its own with this many threads, kept while the endpoint or any of
    /// its connections lives (one thread: a current-thread runtime).
    Own(NonZeroUsize),
}

impl Default for EndpointThreads {
    /// One thread of its own per endpoint.
    fn default() -> Self {
        Self::Own(NonZeroUsize::MIN)
    }
}

impl std::str::FromStr for EndpointThreads {
    type Err = String;

    /// `caller`, or a number of threads of the endpoint's own.
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "caller" {
            return Ok(Self::Caller);
        }
        s.parse::<NonZeroUsize>().map(Self::Own).map_err(|_| {
            format!("endpoint threads {s:?}: expected caller or a number of threads (1 or more)")
        })
    }
}

/// The quinn runtime of one endpoint and the handle its tasks are spawned with.
#[derive(Clone, Debug)]
pub(crate) struct EndpointRuntime {
    /// What quinn runs the endpoint on.
    pub(crate) quinn: Arc<dyn Runtime>,
    /// Where the library spawns the endpoint's own tasks (accept loops, tensor streams).
    pub(crate) handle: Handle,
}

impl EndpointRuntime {
    /// The runtime `threads` asks for; `name` names its threads.
    pub(crate) fn start(threads: EndpointThreads, name: &str) -> Result<Self, TransportError> {
        match threads {
            EndpointThreads::Caller => Ok(Self {
                quinn: Arc::new(TokioRuntime),
                handle: Handle::try_current().map_err(|_| {
                    TransportError::Config(
                        "an endpoint on the caller's runtime (EndpointThreads::Caller) must be \
                         created inside a tokio runtime"
                            .into(),
                    )
                })?,
            }),
            EndpointThreads::Own(count) => {
                let own = OwnRuntime::start(count, name)?;
                let handle = own.handle.clone();
                Ok(Self {
                    quinn: Arc::new(own),
                    handle,
                })
            }
        }
    }
}

/// A tokio runtime run by a thread of its own, shut down when quinn drops the last
/// reference (the endpoint and all its connections are gone).
#[derive(Debug)]
struct OwnRuntime {
    handle: Handle,
    /// Dropping it lets the runtime's thread return and shut the runtime down.
    _stop: oneshot::Sender<()>,
}

impl OwnRuntime {
    fn start(threads: NonZeroUsize, name: &str) -> Result<Self, TransportError> {
        let runtime = if threads.get() == 1 {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?
        } else {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(threads.get())
                .thread_name(name)
                .enable_all()
                .build()?
        };
        let handle = runtime.handle().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        // A current-thread runtime runs its tasks only inside `block_on`: this thread is its
        // one worker. Either kind is dropped here, outside any async context, as tokio asks.
        std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                let _ = runtime.block_on(stopped);
                drop(runtime);
            })?;
        Ok(Self {
            handle,
            _stop: stop,
        })
    }
}

impl Runtime for OwnRuntime {
    fn new_timer(&self, i: Instant) -> Pin<Box<dyn AsyncTimer>> {
        // A tokio timer belongs to the runtime current when it is made.
        let _on = self.handle.enter();
        TokioRuntime.new_timer(i)
    }

    fn spawn(&self, future: Pin<Box<dyn Future<Output = ()> + Send>>) {
        self.handle.spawn(future);
    }

    fn wrap_udp_socket(
        &self,
        socket: std::net::UdpSocket,
    ) -> std::io::Result<Arc<dyn AsyncUdpSocket>> {
        // Registered with this runtime's I/O driver, which then polls it.
        let _on = self.handle.enter();
        TokioRuntime.wrap_udp_socket(socket)
    }

    fn now(&self) -> Instant {
        TokioRuntime.now()
    }
}
