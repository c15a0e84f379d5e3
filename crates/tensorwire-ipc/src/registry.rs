//! Published tensors and their leases (spec/ipc.md §4). Pure bookkeeping: no IO.

use std::collections::HashMap;
use tensorwire_proto::TensorMeta;
use uuid::Uuid;

use crate::exported::Exported;
use crate::message::{Descriptor, ErrorBody, ErrorCode, Info, TensorFields};

/// A consumer connection's id.
pub(crate) type ClientId = u64;

struct Entry {
    meta: TensorMeta,
    memory: Exported,
    leases: u64,
    deleting: bool,
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
}

/// Why a request was refused, as its error reply carries it.
pub(crate) type Refusal = ErrorBody;

fn refuse(code: ErrorCode, message: impl Into<String>) -> Refusal {
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
        }
    }

    /// Adds a tensor under its (unique) name.
    pub(crate) fn publish(&mut self, meta: TensorMeta, memory: Exported) -> Result<Uuid, Refusal> {
        if self.names.contains_key(meta.name()) {
            return Err(refuse(
                ErrorCode::bad_request(),
                format!("a tensor named {:?} is already published", meta.name()),
            ));
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
            },
        );
        Ok(id)
    }

    fn resolve(&self, tensor: &str) -> Option<Uuid> {
        Uuid::parse_str(tensor)
            .ok()
            .filter(|id| self.tensors.contains_key(id))
            .or_else(|| self.names.get(tensor).copied())
    }

    fn fields(id: Uuid, entry: &Entry) -> TensorFields {
        TensorFields {
            id,
            name: entry.meta.name().to_owned(),
            dtype: entry.meta.dtype().name().to_owned(),
            shape: entry.meta.shape().to_vec(),
            byte_len: entry.meta.byte_len(),
            export: entry.memory.export(),
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
            .ok_or_else(|| refuse(ErrorCode::not_found(), format!("no tensor {tensor:?}")))?;
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
            .ok_or_else(|| refuse(ErrorCode::not_found(), format!("no tensor {tensor:?}")))?;
        let held = self
            .leases
            .values()
            .filter(|l| l.process == process)
            .count();
        if held >= self.max_leases_per_process {
            return Err(refuse(
                ErrorCode::lease_limit(),
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
            .ok_or_else(|| refuse(ErrorCode::internal(), "entry vanished"))?;
        // Exported at publish time and cached: this only fails if the driver broke since.
        let handle = entry
            .memory
            .handle()
            .map_err(|e| refuse(ErrorCode::internal(), e.to_string()))?;
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
            generation: entry.memory.generation(),
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
                    ErrorCode::not_found(),
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
            self.remove(id);
        }
    }

    fn remove(&mut self, id: Uuid) {
        if let Some(entry) = self.tensors.remove(&id) {
            self.names.remove(entry.meta.name());
        }
    }

    /// Removes a tensor now, or when its last lease ends; `Ok(true)` if deferred.
    pub(crate) fn delete(&mut self, tensor: &str) -> Result<bool, Refusal> {
        let id = self
            .resolve(tensor)
            .ok_or_else(|| refuse(ErrorCode::not_found(), format!("no tensor {tensor:?}")))?;
        let entry = self
            .tensors
            .get_mut(&id)
            .ok_or_else(|| refuse(ErrorCode::internal(), "entry vanished"))?;
        if entry.leases == 0 {
            self.remove(id);
            Ok(false)
        } else {
            entry.deleting = true;
            Ok(true)
        }
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
