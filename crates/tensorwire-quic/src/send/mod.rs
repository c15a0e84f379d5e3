//! The sending side: one connection, many tensors at once, each on its own stream, never
//! more bytes in flight than the receiver granted; and a pool of connections to one receiver.

mod connect;
mod handle;
mod pool;
mod report;
mod sender;
mod tensor;

pub use handle::SendHandle;
pub use pool::{MIN_PART, SenderPool};
pub use report::{SendProgress, SendReport, SendWaits};
pub use sender::Sender;
pub(crate) use tensor::{SendOptions, Sharing, send_tensor};
