//! What every scenario of one `bench` call shares: the transport the flags chose, the path a
//! throughput run's client takes, and what `--thread-usage` prints.

use std::net::SocketAddr;
use std::time::Duration;

use tensorwire::quic::{EndpointThreads, SendWaits, StoreOffload, TransportSettings};

use crate::args::Args;
use crate::relay;
use crate::threads::ThreadUsage;

/// The flags every scenario reads, made once in `main` and passed down.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Setup {
    /// UDP payload size of every QUIC run (`--mtu`).
    pub(crate) mtu: u16,
    /// Where each QUIC endpoint's work runs (`--endpoint-threads`).
    pub(crate) endpoint_threads: EndpointThreads,
    /// Where tensorwire's receivers store large payloads (`--store-offload`).
    pub(crate) store_offload: StoreOffload,
    /// How long a relay in each QUIC throughput run's path holds datagrams (`--delay-ms`).
    pub(crate) one_way_delay: Option<Duration>,
    /// Whether runs print their busy threads and waits (`--thread-usage`).
    pub(crate) thread_usage: bool,
}

impl Setup {
    /// The setup `args` ask for.
    pub(crate) fn from_args(args: &Args) -> Self {
        Self {
            mtu: args.mtu,
            endpoint_threads: args.endpoint_threads,
            store_offload: args.store_offload,
            one_way_delay: (args.delay_ms > 0).then(|| Duration::from_millis(args.delay_ms)),
            thread_usage: args.thread_usage,
        }
    }

    /// The QUIC settings of every run: raw quinn and tensorwire alike.
    pub(crate) fn transport(&self) -> TransportSettings {
        let mut settings = TransportSettings::default();
        settings.endpoint_threads = self.endpoint_threads;
        settings.fixed_mtu(self.mtu)
    }

    /// How a throughput run's client reaches `server`: through a delaying relay with
    /// `--delay-ms` (which runs while the caller keeps it), straight otherwise.
    pub(crate) async fn path_to(
        &self,
        server: SocketAddr,
    ) -> anyhow::Result<(SocketAddr, Option<relay::Relay>)> {
        match self.one_way_delay {
            Some(one_way) => {
                let relay = relay::delayed_path(server, one_way).await?;
                Ok((relay.addr(), Some(relay)))
            }
            None => Ok((server, None)),
        }
    }

    /// With `--thread-usage`, prints what each thread busy more than a tenth of the `seconds`
    /// since `before` spent on a CPU, as a fraction of them.
    pub(crate) fn print_busy_threads(&self, run: &str, before: &ThreadUsage, seconds: f64) {
        if self.thread_usage {
            eprintln!(
                "  {run}: busy threads {}",
                ThreadUsage::now().busy_since(before, seconds)
            );
        }
    }

    /// With `--thread-usage`, prints what tensorwire's sends waited for over a run of
    /// `seconds`, summed over its tensors (several at once per connection, so a sum can pass
    /// the run).
    pub(crate) fn print_send_waits(&self, waited: &SendWaits, seconds: f64) {
        if self.thread_usage {
            eprintln!(
                "  tensorwire: sends waited (summed over tensors, run {seconds:.3} s): {waited}"
            );
        }
    }
}
