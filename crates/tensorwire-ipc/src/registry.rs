//! Published tensors and their leases (spec/ipc.md §4). Pure bookkeeping: no IO.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};

use tensorwire_proto::TensorMeta;
use uuid::Uuid;

use crate::exported::Exported;
use crate::message::{Descriptor, ErrorBody, Event, EventKind, Info, RefusalCode, TensorFields};

/// A consumer connection's id.
pub(crate) type ClientId = u64;

struct Entry {
    meta: TensorMeta,
    memory: Exported,
    leases: u64,
    /// Gone from the live set (deleted, or replaced by a newer generation); freed when its
    /// last lease ends.
    deleting: bool,
    generation: u64,
    landed_unix_us: u64,
}

/// A `watch` connection: events for names under `prefix` go to its thread.
pub(crate) struct Watcher {
    pub(crate) prefix: String,
    pub(crate) events: SyncSender<Event>,
    /// Set when its queue was full: the thread tells the consumer and disconnects.
    pub(crate) overflowed: Arc<AtomicBool>,
}

struct Lease {
    tensor: Uuid,
    client: ClientId,
    /// The consumer process (pid from `SO_PEERCRED`): limits count across its connections.
    process: u32,
}

/// Every published tensor, by id and name, and every lease.
pub(crate) struct Registry {
    tensors: HashMap<Uuid, Entry>,
    names: HashMap<String, Uuid>,
    leases: HashMap<u64, Lease>,
    next_lease: u64,
    max_leases_per_process: usize,
    watchers: Vec<Watcher>,
}

/// Why a request was refused, as its error reply carries it.
pub(crate) type Refusal = ErrorBody;

fn refuse(code: RefusalCode, message: impl Into<String>) -> Refusal {
    ErrorBody {
        code,
        message: message.into(),
    }
}

impl Registry {
    pub(crate) fn new(max_leases_per_process: usize) -> Self {
        Self {
            tensors: HashMap::new(),
            names: HashMap::new(),
            leases: HashMap::new(),
            next_lease: 1,
            max_leases_per_process,
            watchers: Vec::new(),
        }
    }

    /// Adds a tensor under its name. A tensor already published under it is replaced: it
    /// leaves the live set (its leases keep its memory) and the new one is its next
    /// generation. Returns the new id and generation.
    pub(crate) fn publish(
        &mut self,
        meta: TensorMeta,
        memory: Exported,
        landed_unix_us: u64,
    ) -> (Uuid, u64) {
        let previous = self.names.get(meta.name()).copied();
        let generation = previous
            .and_then(|old| self.tensors.get(&old))
            .map_or(1, |old| old.generation + 1);
        if let Some(old) = previous {
            self.retire(old);
        }
        let id = Uuid::new_v4();
        self.names.insert(meta.name().to_owned(), id);
        self.tensors.insert(
            id,
            Entry {
                meta,
                memory,
                leases: 0,
                deleting: false,
                generation,
                landed_unix_us,
            },
        );
        let kind = if previous.is_some() {
            EventKind::Updated
        } else {
            EventKind::Published
        };
        self.emit(kind, id);
        (id, generation)
    }

    /// The live tensor named `name`: its metadata and memory.
    pub(crate) fn current(&self, name: &str) -> Option<(TensorMeta, Exported)> {
        let entry = self.names.get(name).and_then(|id| self.tensors.get(id))?;
        Some((entry.meta.clone(), entry.memory.clone()))
    }

    /// `name`'s bytes were overwritten in place: its generation goes up. Returns the id and
    /// the new generation.
    pub(crate) fn updated_in_place(
        &mut self,
        name: &str,
        landed_unix_us: u64,
    ) -> Result<(Uuid, u64), Refusal> {
        let id = self
            .names
            .get(name)
            .copied()
            .ok_or_else(|| refuse(RefusalCode::not_found(), format!("no tensor {name:?}")))?;
        let entry = self
            .tensors
            .get_mut(&id)
            .ok_or_else(|| refuse(RefusalCode::internal(), "entry vanished"))?;
        entry.generation += 1;
        entry.landed_unix_us = landed_unix_us;
        let generation = entry.generation;
        self.emit(EventKind::Updated, id);
        Ok((id, generation))
    }

    /// Starts sending events for names under the watcher's prefix.
    pub(crate) fn watch(&mut self, watcher: Watcher) {
        self.watchers.push(watcher);
    }

    /// Sends `kind` for `id` to every watcher of its name; drops watchers whose consumer
    /// left or whose queue is full (flagged, so its thread can say why).
    fn emit(&mut self, kind: EventKind, id: Uuid) {
        let Some(entry) = self.tensors.get(&id) else {
            return;
        };
        let event = Event {
            event: kind,
            tensor: Self::info(id, entry),
        };
        self.watchers.retain(|watcher| {
            if !event.tensor.tensor.name.starts_with(&watcher.prefix) {
                return true;
            }
            match watcher.events.try_send(event.clone()) {
                Ok(()) => true,
                Err(TrySendError::Full(_)) => {
                    watcher.overflowed.store(true, Ordering::SeqCst);
                    false
                }
                Err(TrySendError::Disconnected(_)) => false,
            }
        });
    }

    /// Takes `id` out of the live set: removed now if unleased, else when its last lease ends.
    fn retire(&mut self, id: Uuid) {
        let Some(entry) = self.tensors.get_mut(&id) else {
            return;
        };
        entry.deleting = true;
        if self.names.get(entry.meta.name()) == Some(&id) {
            self.names.remove(entry.meta.name());
        }
        if entry.leases == 0 {
            self.tensors.remove(&id);
        }
    }

    fn resolve(&self, tensor: &str) -> Option<Uuid> {
        Uuid::parse_str(tensor)
            .ok()
            .filter(|id| self.tensors.contains_key(id))
            .or_else(|| self.names.get(tensor).copied())
    }

    fn fields(id: Uuid, entry: &Entry) -> TensorFields {
        let meta = &entry.meta;
        TensorFields {
            id,
            name: meta.name().to_owned(),
            dtype: meta.dtype().name().to_owned(),
            shape: meta.shape().to_vec(),
            byte_len: meta.byte_len(),
            numel: meta.shape().iter().product(),
            element_size: meta.dtype().size(),
            export: entry.memory.export(),
            attributes: meta.attributes().iter().cloned().collect(),
            device: entry.memory.device_fields(),
            generation: entry.generation,
            landed_unix_us: entry.landed_unix_us,
        }
    }

    fn info(id: Uuid, entry: &Entry) -> Info {
        Info {
            tensor: Self::fields(id, entry),
            leases: entry.leases,
            deleting: entry.deleting,
        }
    }

    pub(crate) fn list(&self) -> Vec<Info> {
        let mut all: Vec<Info> = self
            .tensors
            .iter()
            .map(|(id, e)| Self::info(*id, e))
            .collect();
        all.sort_by(|a, b| a.tensor.name.cmp(&b.tensor.name));
        all
    }

    pub(crate) fn lookup(&self, tensor: &str) -> Result<Info, Refusal> {
        let id = self
            .resolve(tensor)
            .ok_or_else(|| refuse(RefusalCode::not_found(), format!("no tensor {tensor:?}")))?;
        Ok(Self::info(id, &self.tensors[&id]))
    }

    /// Takes a lease on a live tensor for `client`.
    pub(crate) fn open(
        &mut self,
        tensor: &str,
        client: ClientId,
        process: u32,
    ) -> Result<(u64, Descriptor, Exported), Refusal> {
        let id = self
            .resolve(tensor)
            .filter(|id| !self.tensors[id].deleting)
            .ok_or_else(|| refuse(RefusalCode::not_found(), format!("no tensor {tensor:?}")))?;
        let held = self
            .leases
            .values()
            .filter(|l| l.process == process)
            .count();
        if held >= self.max_leases_per_process {
            return Err(refuse(
                RefusalCode::lease_limit(),
                format!(
                    "process {process} holds {held} leases over all its connections; the \
                     limit is {}",
                    self.max_leases_per_process
                ),
            ));
        }
        let entry = self
            .tensors
            .get_mut(&id)
            .ok_or_else(|| refuse(RefusalCode::internal(), "entry vanished"))?;
        // Exported at publish time and cached: this only fails if the driver broke since.
        let handle = entry
            .memory
            .handle()
            .map_err(|e| refuse(RefusalCode::internal(), e.to_string()))?;
        entry.leases += 1;
        let lease = self.next_lease;
        self.next_lease += 1;
        self.leases.insert(
            lease,
            Lease {
                tensor: id,
                client,
                process,
            },
        );
        let descriptor = Descriptor {
            tensor: Self::fields(id, entry),
            offset: entry.memory.offset(),
            alloc_len: entry.memory.alloc_len(),
            device_uuid: entry.memory.device_uuid(),
            buffer_reuse: entry.memory.buffer_reuse(),
            handle,
        };
        Ok((lease, descriptor, entry.memory.clone()))
    }

    /// Ends `client`'s lease.
    pub(crate) fn release(&mut self, lease: u64, client: ClientId) -> Result<(), Refusal> {
        match self.leases.get(&lease) {
            Some(l) if l.client == client => {}
            _ => {
                return Err(refuse(
                    RefusalCode::not_found(),
                    format!("no lease {lease} held by this consumer"),
                ));
            }
        }
        if let Some(l) = self.leases.remove(&lease) {
            self.drop_lease(l.tensor);
        }
        Ok(())
    }

    fn drop_lease(&mut self, id: Uuid) {
        let Some(entry) = self.tensors.get_mut(&id) else {
            return;
        };
        entry.leases -= 1;
        if entry.deleting && entry.leases == 0 {
            self.tensors.remove(&id);
        }
    }

    /// Removes a tensor now, or when its last lease ends; `Ok(true)` if deferred.
    pub(crate) fn delete(&mut self, tensor: &str) -> Result<bool, Refusal> {
        let id = self
            .resolve(tensor)
            .ok_or_else(|| refuse(RefusalCode::not_found(), format!("no tensor {tensor:?}")))?;
        let entry = self
            .tensors
            .get(&id)
            .ok_or_else(|| refuse(RefusalCode::internal(), "entry vanished"))?;
        let (live, deferred) = (!entry.deleting, entry.leases > 0);
        if live {
            self.emit(EventKind::Deleted, id);
        }
        self.retire(id);
        Ok(deferred)
    }

    /// A consumer's connection closed: all its leases end.
    pub(crate) fn client_gone(&mut self, client: ClientId) {
        let gone: Vec<u64> = self
            .leases
            .iter()
            .filter(|(_, l)| l.client == client)
            .map(|(k, _)| *k)
            .collect();
        for lease in gone {
            if let Some(l) = self.leases.remove(&lease) {
                self.drop_lease(l.tensor);
            }
        }
    }
}
