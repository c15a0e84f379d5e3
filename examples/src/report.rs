//! What a push did, receiver by receiver: the summary lines for people, and `sender
//! --json`'s objects (docs/operators.md lists their fields).

use std::net::SocketAddr;
use std::time::Duration;

use tensorwire::proto::{ErrorCode, Receipt};
use tensorwire::quic::{Binding, SendReport, SendWaits, SenderPool, TransportError};

use crate::cli::{micros, rate, size};

/// Shared tensors a summary names one by one; the rest are counted.
const MAX_RECEIPT_LINES: usize = 10;

/// How one receiver's part of the push went.
pub enum HostOutcome {
    /// Connected; its tensors sent, delivered or failed (boxed: far larger than a failure).
    Pushed(Box<HostPush>),
    /// Never connected.
    Unreachable(SocketAddr, anyhow::Error),
}

/// One receiver's tensors as they end.
pub struct HostPush {
    addr: SocketAddr,
    /// The connections to the receiver, to close once reported.
    pub sender: SenderPool,
    tensors: usize,
    total: u64,
    delivered_bytes: u64,
    /// The tensors it did not get.
    pub failed: Vec<String>,
    waited: SendWaits,
    /// What the receiver made of each delivered tensor (spec §6.8), by tensor name.
    receipts: Vec<(String, Receipt)>,
    results: Vec<serde_json::Value>,
    /// Seconds from the push's start until this receiver's last tensor ended.
    pub elapsed: f64,
}

impl HostPush {
    /// A receiver connected to, of `tensors` tensors and `total` bytes.
    pub fn new(addr: SocketAddr, sender: SenderPool, tensors: usize, total: u64) -> Self {
        Self {
            addr,
            sender,
            tensors,
            total,
            delivered_bytes: 0,
            failed: Vec::new(),
            waited: SendWaits::default(),
            receipts: Vec::new(),
            results: Vec::new(),
            elapsed: 0.0,
        }
    }

    /// Counts one tensor's end.
    pub fn add(
        &mut self,
        name: String,
        len: u64,
        ended: Duration,
        result: &anyhow::Result<SendReport>,
        peer: &Peer,
    ) {
        self.results
            .push(tensor_json(&name, len, ended, result, peer));
        match result {
            Ok(report) => {
                self.waited += report.waited;
                self.delivered_bytes += len;
                if !report.receipt.is_empty() {
                    self.receipts.push((name, report.receipt.clone()));
                }
            }
            Err(_) => self.failed.push(name),
        }
    }

    /// The summary for people: what was delivered, how fast, over what, and who waited.
    pub fn print_summary(&self, name_the_receiver: bool) {
        let sender = &self.sender;
        let metrics = sender.metrics();
        let to = match name_the_receiver {
            true => format!("to {}: ", self.addr),
            false => String::new(),
        };
        println!(
            "{to}sent {} of {} tensors ({} streams), {} of {} in {:.2} s over {} \
             connections ({}): {}; packets of {} bytes; latency p50 {}, p99 {}; {} failed",
            self.tensors - self.failed.len(),
            self.tensors,
            metrics.tensors_completed,
            size(self.delivered_bytes),
            size(self.total),
            self.elapsed,
            sender.connections(),
            sender.binding(),
            rate(self.delivered_bytes, self.elapsed),
            sender.path_mtu(),
            micros(metrics.latency_p50_us),
            micros(metrics.latency_p99_us),
            self.failed.len(),
        );
        // Which side held the tensors up: the receiver (credit, its decisions), the files,
        // or the network (QUIC's send buffer full).
        println!("{to}waited, summed over the tensors sent: {}", self.waited);
        self.print_receipts(&to);
    }

    /// What the receiver made of the tensors (spec §6.8): where they landed, and the ids
    /// local processes open them by. A receiver older than 1.5 says nothing.
    fn print_receipts(&self, to: &str) {
        let mut devices = std::collections::BTreeMap::<&str, usize>::new();
        for device in self.receipts.iter().filter_map(|(_, r)| r.device()) {
            *devices.entry(device).or_default() += 1;
        }
        if !devices.is_empty() {
            let list: Vec<String> = devices.iter().map(|(d, n)| format!("{d} ({n})")).collect();
            println!("{to}landed on {}", list.join(", "));
        }
        let shared: Vec<_> = self
            .receipts
            .iter()
            .filter_map(|(name, r)| Some((name, r.shared_id()?, r)))
            .collect();
        for (name, id, receipt) in shared.iter().take(MAX_RECEIPT_LINES) {
            let generation = receipt
                .shared_generation()
                .map_or(String::new(), |g| format!(", generation {g}"));
            println!("{to}shared {name} as {id}{generation}");
        }
        if shared.len() > MAX_RECEIPT_LINES {
            println!(
                "{to}… and {} more shared (every id is in --json's results)",
                shared.len() - MAX_RECEIPT_LINES
            );
        }
    }

    /// The result object of `--json` (docs/operators.md).
    pub fn json(&self, interrupted: bool) -> serde_json::Value {
        let sender = &self.sender;
        serde_json::json!({
            "receiver": self.addr.to_string(),
            "connected": true,
            "transport": match sender.binding() {
                Binding::Udp => "udp",
                Binding::Tcp => "tcp",
            },
            "protocol_version": sender.peer_version().to_string(),
            "connections": sender.connections(),
            "packet_bytes": sender.path_mtu(),
            "seconds": self.elapsed,
            "tensors": self.tensors,
            "delivered_tensors": self.tensors - self.failed.len(),
            "delivered_bytes": self.delivered_bytes,
            "total_bytes": self.total,
            "failed_tensors": self.failed.len(),
            "interrupted": interrupted,
            "waited_s": waits_json(&self.waited),
            "results": self.results,
        })
    }
}

/// `--json` for a receiver never connected to: nothing delivered, and why.
pub fn unreachable_json(
    addr: SocketAddr,
    e: &anyhow::Error,
    total: u64,
    tensors: usize,
) -> serde_json::Value {
    let transport = e.downcast_ref::<TransportError>();
    let code = transport.and_then(TransportError::code);
    serde_json::json!({
        "receiver": addr.to_string(),
        "connected": false,
        "tensors": tensors,
        "delivered_tensors": 0,
        "delivered_bytes": 0,
        "total_bytes": total,
        "failed_tensors": tensors,
        "code": code.map(code_name),
        "code_value": code.map(|c| c.0),
        "cause": format!("{e:#}"),
    })
}

/// One tensor's result for `--json`: delivered with its waits, or failed with the code,
/// who is to blame, and why.
fn tensor_json(
    name: &str,
    bytes: u64,
    ended: Duration,
    result: &anyhow::Result<SendReport>,
    peer: &Peer,
) -> serde_json::Value {
    let mut tensor = serde_json::json!({
        "name": name,
        "bytes": bytes,
        "seconds": ended.as_secs_f64(),
    });
    let fields = match result {
        Ok(report) => serde_json::json!({
            "outcome": "delivered",
            "waited_s": waits_json(&report.waited),
            "receipt": receipt_json(&report.receipt),
        }),
        Err(e) => {
            let transport = e.downcast_ref::<TransportError>();
            let code = transport.and_then(TransportError::code);
            serde_json::json!({
                "outcome": "failed",
                "code": code.map(code_name),
                "code_value": code.map(|c| c.0),
                "blame": transport.and_then(TransportError::blame).map(|b| format!("{b:?}")),
                "cause": explain(e, peer),
            })
        }
    };
    if let (Some(tensor), serde_json::Value::Object(fields)) = (tensor.as_object_mut(), fields) {
        tensor.extend(fields);
    }
    tensor
}

/// A receipt's entries as an object (the first of a repeated key wins, as in attributes).
fn receipt_json(receipt: &Receipt) -> serde_json::Value {
    let mut object = serde_json::Map::new();
    for (key, value) in receipt.entries() {
        object
            .entry(key.clone())
            .or_insert_with(|| serde_json::Value::String(value.clone()));
    }
    serde_json::Value::Object(object)
}

/// Seconds waited, by whom.
pub fn waits_json(waited: &SendWaits) -> serde_json::Value {
    serde_json::json!({
        "receiver": waited.receiver.as_secs_f64(),
        "source": waited.source.as_secs_f64(),
        "transport": waited.transport.as_secs_f64(),
        "turn": waited.turn.as_secs_f64(),
    })
}

/// The receiver, as failures name it.
pub struct Peer {
    /// Its address.
    pub addr: SocketAddr,
    /// How long a silent connection to it lasts (`--idle-timeout-s`).
    pub idle_timeout_s: u64,
}

/// A failure for people: the wire code (named, or hex) and who is to blame, then the message;
/// a connection that timed out names the receiver and how long it was silent.
pub fn explain(e: &anyhow::Error, peer: &Peer) -> String {
    let Some(t) = e.downcast_ref::<TransportError>() else {
        return format!("{e:#}");
    };
    if let TransportError::Connection(quinn::ConnectionError::TimedOut) = t {
        return format!(
            "no answer from {} for {} s: the receiver stopped, or the path is down \
             (--idle-timeout-s sets how long to wait)",
            peer.addr, peer.idle_timeout_s
        );
    }
    let message = t.to_string();
    let coded = match t.code() {
        Some(code) if !message.contains(&code.to_string()) => format!("{code}: {message}"),
        _ => message,
    };
    match t.blame() {
        Some(blame) => format!("{coded} [blame: {blame:?}]"),
        None => coded,
    }
}

/// A wire code as `--json` names it: its registered name, or its number in hex.
pub fn code_name(code: ErrorCode) -> String {
    code.name()
        .map_or_else(|| format!("0x{:04x}", code.0), str::to_owned)
}
