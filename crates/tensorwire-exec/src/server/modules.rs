//! Modules kept between runs, by SHA-256, the least recently used dropped first once their
//! bytes pass the cache's limit (spec §14.3: a client sends a module only when asked).

use std::sync::Arc;

use bytes::Bytes;
use tensorwire_gpu::ModuleFormat;

pub(super) struct CachedModule {
    pub(super) format: ModuleFormat,
    pub(super) bytes: Bytes,
}

pub(super) struct ModuleCache {
    pub(super) entries: Vec<([u8; 32], Arc<CachedModule>)>,
    pub(super) bytes: u64,
    pub(super) limit: u64,
}

impl ModuleCache {
    pub(super) fn get(&mut self, hash: &[u8; 32]) -> Option<Arc<CachedModule>> {
        let i = self.entries.iter().position(|(h, _)| h == hash)?;
        let entry = self.entries.remove(i);
        let module = entry.1.clone();
        self.entries.push(entry);
        Some(module)
    }

    pub(super) fn insert(&mut self, hash: [u8; 32], module: Arc<CachedModule>) {
        if self.get(&hash).is_some() {
            return;
        }
        self.bytes += module.bytes.len() as u64;
        self.entries.push((hash, module));
        while self.bytes > self.limit && self.entries.len() > 1 {
            let (_, old) = self.entries.remove(0);
            self.bytes -= old.bytes.len() as u64;
        }
    }
}
