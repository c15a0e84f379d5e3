//! One request, from its tensor to its reply: decoded and checked, answered at once (info,
//! health) or handed to a run (spec §14.2, §14.5).

use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::Instant;

use crate::message::{ExecReply, ExecRequest, ExecRole, RequestBody, RequestKind, Timings};
use bytes::Bytes;
use tensorwire_proto::{DType, ErrorCode, TensorMeta};
use tensorwire_quic::{Connection, IncomingTensor};

use super::Inner;

impl Inner {
    pub(super) async fn request(self: Arc<Self>, incoming: IncomingTensor, id: u64) {
        let started = Instant::now();
        self.counters.requests.fetch_add(1, Ordering::Relaxed);
        let limits = &self.config.limits;
        let meta = incoming.meta().clone();
        if meta.dtype() != DType::U8
            || meta.shape().len() != 1
            || meta.byte_len() > limits.max_request_len
        {
            incoming.reject(
                ErrorCode::EXEC_MALFORMED,
                format!(
                    "a request is a U8 vector of at most {} bytes; this is {} {:?}",
                    limits.max_request_len,
                    meta.dtype(),
                    meta.shape()
                ),
            );
            return;
        }
        let reply_to = incoming.connection(&self.config.reply);
        let bytes = match incoming.accept_host().await {
            Ok(handle) => match handle.finished().await {
                Ok((_, bytes)) => bytes,
                Err(e) => {
                    tracing::debug!(%e, "remote execution: a request did not arrive");
                    return;
                }
            },
            Err(_) => return,
        };
        let kind = match bytes.get(1) {
            Some(2) => RequestKind::Info,
            Some(3) => RequestKind::Health,
            _ => RequestKind::Run,
        };
        let request = match ExecRequest::decode(&bytes, limits) {
            Ok(request) if request.id == id => request,
            Ok(request) => {
                let message = format!(
                    "the request says id {}, its tensor's {} says {id}",
                    request.id,
                    crate::message::ID_ATTRIBUTE
                );
                let failure = ExecReply::failure(kind, id, ErrorCode::EXEC_MALFORMED, message);
                self.send_reply(&reply_to, failure).await;
                return;
            }
            Err(e) => {
                if kind == RequestKind::Run {
                    self.counters.runs_failed.fetch_add(1, Ordering::Relaxed);
                    let key = (reply_to.peer(), id);
                    let rx = self.mailboxes.claim(key);
                    self.mailboxes
                        .close(key, rx, Some((e.code(), e.to_string())));
                }
                let failure = ExecReply::failure(kind, id, e.code(), e.to_string());
                self.send_reply(&reply_to, failure).await;
                return;
            }
        };
        let reply = match request.body {
            RequestBody::Info => self.info(id),
            RequestBody::Health => self.health(id),
            RequestBody::Run(run) => {
                let key = (reply_to.peer(), id);
                let Some(rx) = self.mailboxes.claim(key) else {
                    let failure = ExecReply::failure(
                        kind,
                        id,
                        ErrorCode::ARGUMENT_MISMATCH,
                        format!("request id {id} is already in use on this connection"),
                    );
                    self.send_reply(&reply_to, failure).await;
                    return;
                };
                let outcome = self.run(&run, id, rx, &reply_to, started).await;
                match outcome {
                    Ok((reply, rx)) => {
                        self.counters.runs_succeeded.fetch_add(1, Ordering::Relaxed);
                        self.mailboxes.close(key, Some(rx), None);
                        reply
                    }
                    Err((failure, rx)) => {
                        self.counters.runs_failed.fetch_add(1, Ordering::Relaxed);
                        let (code, message) = failure.clone();
                        self.mailboxes.close(key, rx, Some(failure));
                        let mut reply = ExecReply::failure(kind, id, code, message);
                        reply.timings.total_ns = started.elapsed().as_nanos() as u64;
                        reply
                    }
                }
            }
        };
        self.send_reply(&reply_to, reply).await;
    }

    async fn send_reply(&self, to: &Connection, reply: ExecReply) {
        let bytes = reply.encode();
        let meta = match TensorMeta::new(vec![bytes.len() as u64], DType::U8) {
            Ok(meta) => ExecRole::Reply.tag(meta.with_name("tensorwire.exec.reply"), reply.id),
            Err(e) => {
                tracing::error!(%e, "remote execution: cannot describe a reply");
                return;
            }
        };
        if let Err(e) = to.send(meta, Bytes::from(bytes)).finished().await {
            tracing::warn!(%e, id = reply.id, "remote execution: the reply did not arrive");
        }
    }

    fn base_attributes(&self) -> Vec<(String, String)> {
        let exec = match &self.gpu {
            Ok(_) => "enabled".to_owned(),
            Err(reason) => format!("disabled: no GPU ({reason})"),
        };
        vec![
            ("server.version".into(), env!("CARGO_PKG_VERSION").into()),
            ("exec".into(), exec),
        ]
    }

    fn info(&self, id: u64) -> ExecReply {
        let mut attributes = self.base_attributes();
        if let Ok(gpu) = &self.gpu {
            let device = gpu.device();
            let info = device.info();
            let (major, minor) = info.compute_capability;
            attributes.push(("device.name".into(), info.name.clone()));
            attributes.push(("device.uuid".into(), info.uuid_string()));
            attributes.push((
                "device.compute_capability".into(),
                format!("{major}.{minor}"),
            ));
            attributes.push(("device.memory_total".into(), info.total_memory.to_string()));
            if let Ok((free, _)) = device.memory() {
                attributes.push(("device.memory_free".into(), free.to_string()));
            }
            if let Ok(count) = tensorwire_gpu::kernel::multiprocessor_count(device) {
                attributes.push(("device.multiprocessors".into(), count.to_string()));
            }
            if let Ok((major, minor)) = tensorwire_gpu::kernel::driver_version() {
                attributes.push(("driver.version".into(), format!("{major}.{minor}")));
            }
        }
        ok_reply(RequestKind::Info, id, attributes)
    }

    fn health(&self, id: u64) -> ExecReply {
        let mut attributes = self.base_attributes();
        let workers = self.workers.as_ref().map(|w| w.stats()).unwrap_or_default();
        let cached = self
            .modules
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entries
            .len();
        attributes.extend([
            ("workers".into(), workers.workers.to_string()),
            ("workers.idle".into(), workers.idle.to_string()),
            ("workers.replaced".into(), workers.replaced.to_string()),
            ("module.cached".into(), cached.to_string()),
            (
                "uptime_s".into(),
                self.started.elapsed().as_secs().to_string(),
            ),
        ]);
        ok_reply(RequestKind::Health, id, attributes)
    }
}

pub(super) fn ok_reply(kind: RequestKind, id: u64, attributes: Vec<(String, String)>) -> ExecReply {
    ExecReply {
        kind,
        id,
        error: None,
        message: String::new(),
        timings: Timings::default(),
        attributes,
    }
}
