//! Spreading a receiver's connections evenly over its reuse-port sockets, by connection ID
//! (spec §3).
//!
//! In a SO_REUSEPORT group the kernel picks each datagram's socket by a hash of its address
//! 4-tuple, so connections land on sockets at random: 8 connections over 8 sockets use about
//! 5 of them, and a client whose address changes (migration) lands on a socket that does not
//! know its connection; sockets that carry two connections while others idle cap the group
//! below what one connection per socket moves (benches/results/LOG.md).
//!
//! A steered group picks the socket from the packet's destination connection ID instead,
//! with a classic BPF program attached to the group: every connection ID an endpoint issues
//! starts with the endpoint's index in the group. A client's first Initial carries an ID of
//! its own choosing and lands on any socket. If that endpoint serves more connections than
//! the least loaded one, it answers with a Retry whose new connection ID names the least
//! loaded endpoint, and the client's next Initial goes there: one more round trip, for the
//! connections that land on a busier socket.

use std::cell::Cell;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use quinn::{ConnectionId, ConnectionIdGenerator};
use quinn_proto::InvalidCid;
use ring::rand::{SecureRandom, SystemRandom};

use crate::runtime::EndpointRuntime;

/// How a receiver with several endpoints (UDP sockets on one address) decides which of them
/// serves a connection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Steering {
    /// By connection ID (Linux): each connection goes to the least loaded endpoint (a Retry
    /// moves it there, one extra round trip when needed), and a client that changes address
    /// keeps its connection. Where the kernel refuses the steering program, the receiver
    /// logs it and falls back to [`Steering::Address`].
    #[default]
    ConnectionId,
    /// By the kernel's hash of the address 4-tuple: no extra round trip, but connections land
    /// unevenly and a client that changes address loses its connection.
    Address,
}

impl std::str::FromStr for Steering {
    type Err = String;

    /// `connection-id` or `address`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "connection-id" => Ok(Self::ConnectionId),
            "address" => Ok(Self::Address),
            other => Err(format!(
                "steering {other:?}: expected connection-id or address"
            )),
        }
    }
}

/// The most endpoints a steered group can have: the index is one byte of the connection ID.
pub(crate) const MAX_STEERED_ENDPOINTS: usize = 256;

/// Connection IDs of a steered endpoint: its index, then 8 random bytes (64 bits, as many as
/// quinn's default IDs have).
const STEERED_CID_LEN: usize = 9;

/// How long a Retry's reservation on its target endpoint counts toward that endpoint's load,
/// if the client does not come back.
const RESERVATION_LIFETIME: Duration = Duration::from_secs(10);

/// Reservations kept at most, so a flood of first Initials cannot grow the list.
const MAX_RESERVATIONS: usize = 4096;

thread_local! {
    /// Set for the duration of one `Incoming::retry` call: the endpoint the Retry's
    /// connection ID must name. quinn generates that ID synchronously on the calling thread,
    /// and an endpoint's other IDs are generated on other threads or at other times, so
    /// they keep the endpoint's own index.
    static RETRY_TARGET: Cell<Option<u8>> = const { Cell::new(None) };
}

/// Connection IDs that start with their endpoint's index in the group.
struct SteeredIds {
    index: u8,
    random: SystemRandom,
}

impl ConnectionIdGenerator for SteeredIds {
    fn generate_cid(&mut self) -> ConnectionId {
        let mut id = [0u8; STEERED_CID_LEN];
        id[0] = RETRY_TARGET.with(Cell::take).unwrap_or(self.index);
        if self.random.fill(&mut id[1..]).is_err() {
            // The OS's random source failing at run time is not known to happen on Linux;
            // the ID still routes, only its entropy would be lost.
            tracing::error!("no random bytes for a connection ID");
        }
        ConnectionId::new(&id)
    }

    /// Drops short-header packets that name another endpoint, instead of answering them
    /// with a stateless reset.
    fn validate(&self, cid: &ConnectionId) -> Result<(), InvalidCid> {
        if cid.len() == STEERED_CID_LEN && cid[0] == self.index {
            Ok(())
        } else {
            Err(InvalidCid)
        }
    }

    fn cid_len(&self) -> usize {
        STEERED_CID_LEN
    }

    fn cid_lifetime(&self) -> Option<Duration> {
        None
    }
}

/// The connection-ID generator factory for endpoint `index` of a steered group.
pub(crate) fn steered_ids(index: u8) -> impl Fn() -> Box<dyn ConnectionIdGenerator> + Send + Sync {
    move || {
        Box::new(SteeredIds {
            index,
            random: SystemRandom::new(),
        })
    }
}

/// Attaches the steering program to the reuse-port group of `socket` (bound, one of
/// `sockets`): a datagram goes to the socket whose index its destination connection ID's
/// first byte names, modulo the group's size.
#[cfg(target_os = "linux")]
pub(crate) fn attach_steering(socket: &socket2::Socket, sockets: usize) -> std::io::Result<()> {
    use nix::libc::{
        BPF_A, BPF_ABS, BPF_ALU, BPF_B, BPF_JA, BPF_JMP, BPF_JSET, BPF_K, BPF_LD, BPF_MOD, BPF_RET,
        sock_filter, sock_fprog,
    };
    let op = |code: u32, jt: u8, jf: u8, k: u32| sock_filter {
        code: code as u16,
        jt,
        jf,
        k,
    };
    let sockets = u32::try_from(sockets).map_err(std::io::Error::other)?;
    // The program sees the UDP payload: a QUIC packet (RFC 9000 §17).
    let mut program = [
        // A = the first byte.
        op(BPF_LD | BPF_B | BPF_ABS, 0, 0, 0),
        // The header form bit: set for long headers.
        op(BPF_JMP | BPF_JSET | BPF_K, 0, 2, 0x80),
        // Long header: flags (1), version (4), DCID length (1), then the DCID.
        op(BPF_LD | BPF_B | BPF_ABS, 0, 0, 6),
        op(BPF_JMP | BPF_JA, 0, 0, 1),
        // Short header: flags (1), then the DCID.
        op(BPF_LD | BPF_B | BPF_ABS, 0, 0, 1),
        op(BPF_ALU | BPF_MOD | BPF_K, 0, 0, sockets),
        op(BPF_RET | BPF_A, 0, 0, 0),
    ];
    // A packet too short to read makes the program return 0: the first socket.
    let program = sock_fprog {
        len: program.len() as u16,
        filter: program.as_mut_ptr(),
    };
    nix::sys::socket::setsockopt(
        socket,
        nix::sys::socket::sockopt::AttachReusePortCbpf,
        &program,
    )
    .map_err(std::io::Error::from)
}

/// Steering by connection ID needs Linux's reuse-port BPF.
#[cfg(not(target_os = "linux"))]
pub(crate) fn attach_steering(_socket: &socket2::Socket, _sockets: usize) -> std::io::Result<()> {
    Err(std::io::ErrorKind::Unsupported.into())
}

/// One of a receiver's server endpoints, and its part in spreading connections over them.
#[derive(Clone, Debug)]
pub struct ServerEndpoint {
    endpoint: quinn::Endpoint,
    index: usize,
    balance: Option<Arc<Balance>>,
    runtime: EndpointRuntime,
}

impl ServerEndpoint {
    pub(crate) fn new(
        endpoint: quinn::Endpoint,
        index: usize,
        balance: Option<Arc<Balance>>,
        runtime: EndpointRuntime,
    ) -> Self {
        Self {
            endpoint,
            index,
            balance,
            runtime,
        }
    }

    /// The quinn endpoint.
    pub fn endpoint(&self) -> &quinn::Endpoint {
        &self.endpoint
    }

    /// The runtime the endpoint's work runs on ([`EndpointThreads`]): tasks that serve its
    /// connections belong there, beside their packet processing.
    ///
    /// [`EndpointThreads`]: crate::EndpointThreads
    pub fn runtime(&self) -> &tokio::runtime::Handle {
        &self.runtime.handle
    }

    /// The runtime with what quinn needs of it, for more endpoints on the same threads.
    pub(crate) fn endpoint_runtime(&self) -> &EndpointRuntime {
        &self.runtime
    }

    /// Its place in the group (the first byte of its connection IDs, when steered).
    pub fn index(&self) -> usize {
        self.index
    }

    /// Whether the group steers connections by connection ID.
    pub fn is_steered(&self) -> bool {
        self.balance.is_some()
    }

    /// The next connection attempt this endpoint serves, with its place in the group's
    /// balance (given back when the [`ConnectionSlot`] drops); `None` once the endpoint is
    /// closed. Attempts that belong on a less loaded endpoint are sent there with a Retry.
    pub async fn accept(&self) -> Option<(quinn::Incoming, ConnectionSlot)> {
        loop {
            let incoming = self.endpoint.accept().await?;
            let Some(balance) = &self.balance else {
                return Some((incoming, ConnectionSlot(None)));
            };
            if let Some(placed) = balance.place(self.index, incoming) {
                return Some(placed);
            }
        }
    }
}

/// A connection's place on its endpoint, counted in the group's balance until dropped.
#[derive(Debug)]
pub struct ConnectionSlot(Option<(Arc<Balance>, usize)>);

impl ConnectionSlot {
    /// A place on an endpoint outside any steered group (one of a TCP connection).
    pub(crate) fn unbalanced() -> Self {
        Self(None)
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        if let Some((balance, endpoint)) = self.0.take() {
            let mut loads = balance.loads();
            loads.serving[endpoint] = loads.serving[endpoint].saturating_sub(1);
        }
    }
}

/// Connections each endpoint of a steered group serves, or was sent by a Retry.
#[derive(Debug)]
pub(crate) struct Balance {
    loads: Mutex<Loads>,
}

#[derive(Debug)]
struct Loads {
    /// Connections each endpoint serves.
    serving: Vec<usize>,
    /// Retries not yet answered, per target endpoint.
    reserved: Vec<usize>,
    /// The same, oldest first, to expire them.
    reservations: VecDeque<(Instant, usize)>,
    /// Where the search for the least loaded endpoint starts, so ties take turns.
    turn: usize,
}

impl Balance {
    pub(crate) fn new(endpoints: usize) -> Self {
        Self {
            loads: Mutex::new(Loads {
                serving: vec![0; endpoints],
                reserved: vec![0; endpoints],
                reservations: VecDeque::new(),
                turn: 0,
            }),
        }
    }

    fn loads(&self) -> MutexGuard<'_, Loads> {
        // The counts stay consistent under every lock holder, so a poisoned lock is usable.
        self.loads.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Serves `incoming` on endpoint `here`, or sends it toward the least loaded endpoint
    /// with a Retry (`None`).
    fn place(
        self: &Arc<Self>,
        here: usize,
        incoming: quinn::Incoming,
    ) -> Option<(quinn::Incoming, ConnectionSlot)> {
        let now = Instant::now();
        if !incoming.may_retry() {
            // It holds a Retry token: it was sent here (or its client chose to retry).
            self.loads().arrive(here, now);
            return Some((incoming, self.slot(here)));
        }
        let target = self.loads().choose(here, now);
        if target == here {
            return Some((incoming, self.slot(here)));
        }
        RETRY_TARGET.with(|t| t.set(u8::try_from(target).ok()));
        let retried = incoming.retry();
        RETRY_TARGET.with(|t| t.set(None));
        match retried {
            Ok(()) => None,
            // Not reached: `may_retry` was checked. Serve it here rather than lose it.
            Err(refused) => {
                self.loads().arrive(here, now);
                Some((refused.into_incoming(), self.slot(here)))
            }
        }
    }

    fn slot(self: &Arc<Self>, endpoint: usize) -> ConnectionSlot {
        ConnectionSlot(Some((self.clone(), endpoint)))
    }
}

impl Loads {
    /// The endpoint a new connection landing on `here` should go to: `here` if none is less
    /// loaded, otherwise the least loaded, ties taking turns. Counts it there.
    fn choose(&mut self, here: usize, now: Instant) -> usize {
        self.expire(now);
        let load = |i: usize| self.serving[i] + self.reserved[i];
        let least = (0..self.serving.len()).map(load).min().unwrap_or(0);
        if load(here) == least {
            self.serving[here] += 1;
            return here;
        }
        let count = self.serving.len();
        let target = (0..count)
            .map(|k| (self.turn + k) % count)
            .find(|&i| load(i) == least)
            .unwrap_or(here);
        self.turn = (target + 1) % count;
        if self.reservations.len() == MAX_RESERVATIONS {
            self.drop_oldest();
        }
        self.reserved[target] += 1;
        self.reservations.push_back((now, target));
        target
    }

    /// A connection sent by a Retry arrived at `here`: its reservation becomes a served
    /// connection.
    fn arrive(&mut self, here: usize, now: Instant) {
        self.expire(now);
        if let Some(at) = self.reservations.iter().position(|&(_, t)| t == here) {
            self.reservations.remove(at);
            self.reserved[here] -= 1;
        }
        self.serving[here] += 1;
    }

    fn expire(&mut self, now: Instant) {
        while self
            .reservations
            .front()
            .is_some_and(|&(at, _)| now.duration_since(at) > RESERVATION_LIFETIME)
        {
            self.drop_oldest();
        }
    }

    fn drop_oldest(&mut self) {
        if let Some((_, target)) = self.reservations.pop_front() {
            self.reserved[target] -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ties_take_turns_and_a_landing_endpoint_that_is_least_loaded_keeps_its_connection() {
        let mut loads = Balance::new(4).loads.into_inner().unwrap();
        let now = Instant::now();
        // All empty: the endpoint it landed on is least loaded.
        assert_eq!(loads.choose(2, now), 2);
        // Endpoint 2 is busier than the others: sent to 0, then 1, then 3.
        assert_eq!(loads.choose(2, now), 0);
        assert_eq!(loads.choose(2, now), 1);
        assert_eq!(loads.choose(2, now), 3);
        assert_eq!(loads.reserved, [1, 1, 0, 1]);
        for endpoint in [0, 1, 3] {
            loads.arrive(endpoint, now);
        }
        assert_eq!(loads.serving, [1, 1, 1, 1]);
        assert_eq!(loads.reserved, [0, 0, 0, 0]);
        assert!(loads.reservations.is_empty());
    }

    #[test]
    fn reservations_expire_and_stay_bounded() {
        let mut loads = Balance::new(2).loads.into_inner().unwrap();
        let start = Instant::now();
        assert_eq!(loads.choose(0, start), 0);
        for _ in 0..MAX_RESERVATIONS + 10 {
            // Endpoint 0 serves one; 1's reservations never arrive.
            loads.choose(0, start);
        }
        assert!(loads.reservations.len() <= MAX_RESERVATIONS);
        assert_eq!(
            loads.reserved.iter().sum::<usize>(),
            loads.reservations.len()
        );
        let later = start + RESERVATION_LIFETIME + Duration::from_secs(1);
        loads.expire(later);
        assert_eq!(loads.reserved, [0, 0]);
    }
}
