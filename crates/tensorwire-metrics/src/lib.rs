//! Prometheus metrics of a tensorwire receiver: its counters in the OpenMetrics text format
//! ([`ReceiverMetrics`]), served over HTTP at `/metrics` for scrapers ([`MetricsServer`]).
//!
//! Each scrape reads the receiver's counters at that moment: nothing is recorded twice, and
//! an idle receiver costs nothing. The metrics are listed, with their meaning, in
//! `docs/operators.md`.
//!
//! ```
//! use tensorwire_metrics::{MetricsServer, ReceiverMetrics};
//! use tensorwire_quic::{Receiver, ReceiverConfig, ServerTls};
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let receiver =
//!     Receiver::bind(ReceiverConfig::new("127.0.0.1:0".parse()?, ServerTls::Development)).await?;
//! let metrics = ReceiverMetrics::new(receiver.observer());
//! assert!(metrics.encode().contains("tensorwire_received_tensors_total"));
//! let server = MetricsServer::bind("127.0.0.1:0".parse()?, metrics).await?;
//! println!("scrape http://{}/metrics", server.local_addr());
//! server.close().await;
//! # Ok(())
//! # }
//! ```

mod exposition;
mod placement;
mod server;

pub use exposition::{Family, FamilyKind, ReceiverMetrics, Sample};
pub use server::{MAX_SCRAPERS, MetricsServer};
