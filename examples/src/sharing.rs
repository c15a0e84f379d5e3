//! The receiver's `--share`: a landed tensor is published to local processes before its
//! COMPLETE, so that the sender's receipt names its shared id (spec §6.8) and a consumer
//! told that id by the sender finds it.

use std::sync::Arc;

use tensorwire::gpu::TensorBuffer;
use tensorwire::ipc::{PublishedTensor, ShareService};
use tensorwire::proto::{Device, Payload, Receipt, TensorMeta};
use tensorwire::sink::{CreditPermit, Divisible, Sink, SinkError};

use crate::save::Spooled;

/// Lands a tensor through `inner`; once every byte is durable, publishes it with the
/// `service` (if any) before COMPLETE. A publish that fails does not fail the tensor, which
/// landed: the output says why, and the receipt names no id.
pub struct SharingSink<S> {
    inner: S,
    service: Option<Arc<ShareService>>,
    meta: TensorMeta,
}

impl<S> SharingSink<S> {
    /// Wraps `inner`, which lands the tensor `meta` describes.
    pub fn new(inner: S, service: Option<Arc<ShareService>>, meta: &TensorMeta) -> Self {
        Self {
            inner,
            service,
            meta: meta.clone(),
        }
    }
}

/// A tensor that landed whole, and what became of it.
pub struct Landed {
    /// Where the bytes landed, for people: "host memory" or "cuda:0 (NVIDIA H100)".
    pub location: String,
    /// Where the bytes landed, as the spec names it.
    pub device: Device,
    /// Its publication to local processes, with `--share`: the tensor, or why not.
    pub published: Option<Result<PublishedTensor, String>>,
    /// Its spooled bytes, with `--save`.
    pub spooled: Option<Spooled>,
}

/// Parts of a split tensor (spec §15) write beside each other into the whole's destination;
/// the whole is published once, by the sink that finishes it.
impl<S> Divisible for SharingSink<S>
where
    S: Divisible<Output = (TensorBuffer, Option<Spooled>)>,
{
    type Part = S::Part;

    fn part(&mut self) -> Option<Self::Part> {
        self.inner.part()
    }
}

impl<S> Sink for SharingSink<S>
where
    S: Sink<Output = (TensorBuffer, Option<Spooled>)>,
{
    type Output = Landed;

    async fn store(
        &mut self,
        offset: u64,
        payload: Payload,
        permit: CreditPermit,
        crc: Option<&mut u32>,
    ) -> Result<(), SinkError> {
        self.inner.store(offset, payload, permit, crc).await
    }

    async fn flush(&mut self) -> Result<(), SinkError> {
        self.inner.flush().await
    }

    fn take_checksum(&mut self) -> bool {
        self.inner.take_checksum()
    }

    async fn landed_checksum(&mut self) -> Result<u32, SinkError> {
        self.inner.landed_checksum().await
    }

    async fn finish(self) -> Result<Landed, SinkError> {
        let (buffer, spooled) = self.inner.finish().await?;
        let (location, device) = (buffer.location(), buffer.device());
        let published = match self.service {
            None => None,
            Some(service) => {
                let meta = self.meta;
                // Exporting GPU memory or copying into shared memory blocks: off the runtime.
                let task =
                    tokio::task::spawn_blocking(move || service.publish_buffer(&meta, buffer));
                Some(match task.await {
                    Ok(result) => result.map_err(|e| e.to_string()),
                    Err(e) => Err(format!("the publishing task failed: {e}")),
                })
            }
        };
        Ok(Landed {
            location,
            device,
            published,
            spooled,
        })
    }

    /// Where it landed and, once published, the id and generation consumers open it by.
    fn receipt(landed: &Landed) -> Receipt {
        let receipt = Receipt::new().with(Receipt::DEVICE, landed.device.to_string());
        match &landed.published {
            Some(Ok(published)) => receipt
                .with(Receipt::SHARED_ID, published.id().to_string())
                .with(
                    Receipt::SHARED_GENERATION,
                    published.generation().to_string(),
                ),
            _ => receipt,
        }
    }
}
