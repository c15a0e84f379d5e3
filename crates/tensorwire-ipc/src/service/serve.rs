//! Serving consumers: the accept loop (uid and connection caps checked before anything is
//! read), one thread per consumer, and its requests: list, open (leases), watch, release,
//! write and delete (spec/ipc.md §2–§6).

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{RecvTimeoutError, sync_channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::{ShareConfig, local_gpus};
use crate::error::IpcError;
use crate::message::{PROTOCOL_VERSION, RefusalCode, Reply, Request};
use crate::registry::{ClientId, Registry, Watcher};
use crate::socket::Packets;

/// Most events a watcher may have queued; past it the watcher is told and disconnected.
const WATCH_QUEUE: usize = 1024;

/// Longest `open` wait a consumer may ask for.
const MAX_OPEN_WAIT: Duration = Duration::from_secs(3600);

/// A refused connection, its code and why.
pub(super) type Refusal = (Packets, RefusalCode, String);

/// What the service and its consumers' threads share.
pub(super) struct Shared {
    pub(super) registry: Mutex<Registry>,
    /// Signalled whenever a tensor is published or updated: `open` waits on it.
    pub(super) published: Condvar,
    pub(super) config: ShareConfig,
    pub(super) next_client: AtomicU64,
    pub(super) stopping: AtomicBool,
    /// Open consumer connections, in all and by process id.
    pub(super) connections: Mutex<HashMap<u32, usize>>,
}

impl Shared {
    pub(super) fn registry(&self) -> MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn connections(&self) -> MutexGuard<'_, HashMap<u32, usize>> {
        self.connections
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts a new connection of `process`, or says which limit it would break.
    fn admit_connection(&self, process: u32) -> Result<(), String> {
        let mut open = self.connections();
        let total: usize = open.values().sum();
        if total >= self.config.max_connections {
            return Err(format!(
                "{total} consumer connections are open; the limit is {}",
                self.config.max_connections
            ));
        }
        let mine = open.entry(process).or_default();
        if *mine >= self.config.max_connections_per_process {
            return Err(format!(
                "process {process} has {mine} connections open; the limit is {}",
                self.config.max_connections_per_process
            ));
        }
        *mine += 1;
        Ok(())
    }

    fn connection_closed(&self, process: u32) {
        let mut open = self.connections();
        if let Some(n) = open.get_mut(&process) {
            *n -= 1;
            if *n == 0 {
                open.remove(&process);
            }
        }
    }
}

pub(super) fn accept_loop(
    shared: &Arc<Shared>,
    listener: &OwnedFd,
    refuse: &std::sync::mpsc::SyncSender<Refusal>,
) {
    loop {
        let accepted = rustix::net::accept_with(listener, rustix::net::SocketFlags::CLOEXEC);
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        let Ok(fd) = accepted else { continue };
        let packets = Packets::from_fd(fd);
        // Who is calling, read once: the uid decides whether it may connect at all, the
        // process which connection cap it counts against.
        let peer = rustix::net::sockopt::socket_peercred(packets.as_fd());
        let allowed = peer
            .as_ref()
            .is_ok_and(|cred| shared.config.allowed_uids.contains(&cred.uid.as_raw()));
        if !allowed {
            let who = peer
                .map(|c| format!("uid {}", c.uid.as_raw()))
                .unwrap_or_else(|e| e.to_string());
            tracing::warn!(%who, "refusing a consumer");
            // Full: this one is closed with no reason rather than delay the next.
            let _ = refuse.try_send((
                packets,
                RefusalCode::forbidden(),
                format!("{who} may not connect"),
            ));
            continue;
        }
        let process = peer.map_or(0, |cred| cred.pid.as_raw_nonzero().get() as u32);
        if let Err(why) = shared.admit_connection(process) {
            tracing::warn!(process, %why, "refusing a consumer connection");
            let _ = refuse.try_send((packets, RefusalCode::too_many_connections(), why));
            continue;
        }
        let client = shared.next_client.fetch_add(1, Ordering::Relaxed);
        let shared = shared.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("tensorwire-share-client-{client}"))
            .spawn({
                let shared = shared.clone();
                move || {
                    serve_client(&shared, packets, client, process);
                    shared.connection_closed(process);
                }
            });
        if let Err(e) = spawned {
            shared.connection_closed(process);
            tracing::error!(error = %e, "cannot serve a consumer");
        }
    }
}

pub(super) fn send(
    packets: &Packets,
    reply: &Reply,
    fd: Option<std::os::fd::BorrowedFd<'_>>,
) -> Result<(), IpcError> {
    let bytes = serde_json::to_vec(reply).map_err(|e| IpcError::BadMessage(e.to_string()))?;
    packets.send(&bytes, fd)
}

/// Serves one consumer whose uid was checked when it connected.
fn serve_client(shared: &Shared, packets: Packets, client: ClientId, process: u32) {
    let mut greeted = false;
    loop {
        let received = match packets.recv() {
            Ok(Some(received)) => received,
            Ok(None) => break,
            Err(IpcError::BadMessage(why)) => {
                if send(
                    &packets,
                    &Reply::error(RefusalCode::bad_request(), why),
                    None,
                )
                .is_err()
                {
                    break;
                }
                continue;
            }
            Err(_) => break,
        };
        drop(received.fd); // Consumers send no descriptors; close any that came.
        let request: Request = match serde_json::from_slice(&received.bytes) {
            Ok(request) => request,
            Err(e) => {
                if send(
                    &packets,
                    &Reply::error(RefusalCode::bad_request(), e.to_string()),
                    None,
                )
                .is_err()
                {
                    break;
                }
                continue;
            }
        };
        let sent = match (&request, greeted) {
            (Request::Hello { version }, _) if *version == PROTOCOL_VERSION => {
                greeted = true;
                send(
                    &packets,
                    &Reply {
                        version: Some(PROTOCOL_VERSION),
                        ..Reply::ok()
                    },
                    None,
                )
            }
            (Request::Hello { version }, _) => send(
                &packets,
                &Reply::error(
                    RefusalCode::unsupported_version(),
                    format!("version {version}; this producer speaks {PROTOCOL_VERSION}"),
                ),
                None,
            ),
            (_, false) => send(
                &packets,
                &Reply::error(RefusalCode::bad_request(), "send hello first"),
                None,
            ),
            (request, true) => handle(shared, &packets, request, (client, process)),
        };
        if sent.is_err() {
            break;
        }
    }
    shared.registry().client_gone(client);
}

/// Answers `open`: takes a lease and sends the descriptor with its fd. A name not published
/// yet is waited for up to `wait` (capped at an hour).
fn open(
    shared: &Shared,
    packets: &Packets,
    tensor: &str,
    wait: Option<Duration>,
    (client, process): (ClientId, u32),
) -> Result<(), IpcError> {
    let deadline = Instant::now() + wait.unwrap_or_default().min(MAX_OPEN_WAIT);
    let mut registry = shared.registry();
    let opened = loop {
        match registry.open(tensor, client, process) {
            Err(mut refusal) if refusal.code == RefusalCode::not_found() => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() || shared.stopping.load(Ordering::SeqCst) {
                    if let Some(wait) = wait {
                        refusal.message += &format!(" after waiting {} ms", wait.as_millis());
                    }
                    break Err(refusal);
                }
                // Every publication wakes all waiters; each looks again.
                registry = shared
                    .published
                    .wait_timeout(registry, left)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
            other => break other,
        }
    };
    drop(registry);
    let (lease, descriptor, memory) = match opened {
        Ok(opened) => opened,
        Err(refusal) => return send(packets, &Reply::refusal(refusal), None),
    };
    let fd = match memory.fd() {
        Ok(fd) => fd,
        Err(e) => {
            let _ = shared.registry().release(lease, client);
            return send(
                packets,
                &Reply::error(RefusalCode::internal(), e.to_string()),
                None,
            );
        }
    };
    let reply = Reply {
        lease: Some(lease),
        descriptor: Some(descriptor),
        ..Reply::ok()
    };
    send(packets, &reply, fd)
}

/// Serves a `watch`: the connection carries only events from now on, until the consumer
/// closes it, falls too far behind, or the service stops.
fn watch(shared: &Shared, packets: &Packets, prefix: String) -> Result<(), IpcError> {
    let (events, queue) = sync_channel(WATCH_QUEUE);
    let overflowed = Arc::new(AtomicBool::new(false));
    shared.registry().watch(Watcher {
        prefix,
        events,
        overflowed: overflowed.clone(),
    });
    send(packets, &Reply::ok(), None)?;
    loop {
        match queue.recv_timeout(Duration::from_millis(250)) {
            Ok(event) => {
                let bytes =
                    serde_json::to_vec(&event).map_err(|e| IpcError::BadMessage(e.to_string()))?;
                packets.send(&bytes, None)?;
            }
            Err(RecvTimeoutError::Timeout) => {
                if shared.stopping.load(Ordering::SeqCst) || packets.peer_closed() {
                    return Ok(());
                }
            }
            Err(RecvTimeoutError::Disconnected) => {
                if overflowed.load(Ordering::SeqCst) {
                    let why = format!("more than {WATCH_QUEUE} events were waiting to be read");
                    let _ = send(packets, &Reply::error(RefusalCode::overflow(), why), None);
                }
                return Ok(());
            }
        }
    }
}

fn handle(
    shared: &Shared,
    packets: &Packets,
    request: &Request,
    (client, process): (ClientId, u32),
) -> Result<(), IpcError> {
    let mut registry = shared.registry();
    let reply = match request {
        Request::Hello { .. } => Reply::ok(),
        Request::List => Reply {
            tensors: Some(registry.list()),
            ..Reply::ok()
        },
        Request::Info { tensor } => match registry.lookup(tensor) {
            Ok(info) => Reply {
                tensor: Some(info),
                ..Reply::ok()
            },
            Err(refusal) => Reply::refusal(refusal),
        },
        Request::Open { tensor, wait_ms } => {
            drop(registry);
            let wait = wait_ms.map(Duration::from_millis);
            return open(shared, packets, tensor, wait, (client, process));
        }
        Request::Watch { prefix } => {
            drop(registry);
            return watch(shared, packets, prefix.clone()).and(Err(IpcError::Closed));
        }
        Request::Release { lease } => match registry.release(*lease, client) {
            Ok(()) => Reply::ok(),
            Err(refusal) => Reply::refusal(refusal),
        },
        Request::Devices => {
            drop(registry);
            return match local_gpus() {
                Ok(devices) => send(
                    packets,
                    &Reply {
                        devices: Some(devices),
                        ..Reply::ok()
                    },
                    None,
                ),
                Err(e) => send(
                    packets,
                    &Reply::error(RefusalCode::internal(), e.to_string()),
                    None,
                ),
            };
        }
        Request::Delete { tensor } => match registry.delete(tensor) {
            Ok(deferred) => Reply {
                deferred: Some(deferred),
                ..Reply::ok()
            },
            Err(refusal) => Reply::refusal(refusal),
        },
    };
    drop(registry);
    send(packets, &reply, None)
}
