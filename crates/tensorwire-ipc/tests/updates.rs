//! Live sharing: a name shared again under each update policy, generations, leases that keep
//! an old generation alive, watchers that see published/updated/deleted in order, `open`
//! that waits for a name, and the metadata every listing carries (host memory: no GPU).
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::time::Duration;

use common::{SocketPath, socket_path};
use tensorwire_ipc::{EventKind, IpcError, OnExisting, ShareClient, ShareConfig, ShareService};
use tensorwire_proto::{DType, ErrorCode, TensorMeta};

/// A service and its socket path, whose directory goes when the path is dropped.
fn service(name: &str, on_existing: OnExisting) -> (ShareService, SocketPath) {
    let mut config = ShareConfig::default();
    config.on_existing = on_existing;
    let path = socket_path(name);
    (ShareService::start(&path, config).unwrap(), path)
}

fn weights(fill: u8) -> (TensorMeta, Vec<u8>) {
    let meta = TensorMeta::new([4, 4], DType::F32)
        .unwrap()
        .with_name("weights");
    (meta, vec![fill; 64])
}

#[test]
fn replace_gives_the_name_a_new_generation_and_a_lease_keeps_the_old_one_alive() {
    let (service, _socket) = service("replace", OnExisting::Replace);
    let (meta, old) = weights(1);
    assert_eq!(service.publish_host(&meta, &old).unwrap().generation(), 1);
    let client = ShareClient::connect(service.path()).unwrap();
    let reader = client.open("weights").unwrap();
    assert_eq!(reader.descriptor().tensor.generation, 1);
    let (_, new) = weights(2);
    let published = service.publish_host(&meta, &new).unwrap();
    assert_eq!(published.generation(), 2);
    // The consumer still reads the generation it opened; a new open gets the new one.
    assert_eq!(reader.host_bytes().unwrap(), &old[..]);
    let fresh = client.open("weights").unwrap();
    assert_eq!(fresh.descriptor().tensor.generation, 2);
    assert_eq!(fresh.host_bytes().unwrap(), &new[..]);
    let listed = service.list();
    assert_eq!(
        listed.len(),
        2,
        "the old generation lives while leased: {listed:?}"
    );
    let old_entry = listed.iter().find(|i| i.tensor.generation == 1).unwrap();
    assert!(old_entry.deleting && old_entry.leases == 1);
    drop(reader);
    let listed = client.list().unwrap();
    assert_eq!(listed.len(), 1, "released, the old generation is freed");
    assert_eq!(listed[0].tensor.generation, 2);
}

#[test]
fn in_place_writes_the_memory_a_consumer_already_mapped() {
    let (service, _socket) = service("in-place", OnExisting::InPlace);
    let (meta, old) = weights(1);
    let first = service.publish_host(&meta, &old).unwrap();
    let client = ShareClient::connect(service.path()).unwrap();
    let mapped = client.open("weights").unwrap();
    let address = mapped.host_bytes().unwrap().as_ptr();
    let (_, new) = weights(7);
    let second = service.publish_host(&meta, &new).unwrap();
    assert_eq!((second.id(), second.generation()), (first.id(), 2));
    // Same mapping, same address, new bytes: no re-open needed.
    assert_eq!(mapped.host_bytes().unwrap().as_ptr(), address);
    assert_eq!(mapped.host_bytes().unwrap(), &new[..]);
    assert_eq!(client.info("weights").unwrap().tensor.generation, 2);
    // Another shape or dtype cannot be written in place: refused before any byte moves.
    let other = TensorMeta::new([8, 2], DType::F32)
        .unwrap()
        .with_name("weights");
    let refused = service.check_update(&other).unwrap_err();
    assert_eq!(refused.code, ErrorCode::DESTINATION_MISMATCH);
    assert!(refused.message.contains("[8, 2]") && refused.message.contains("[4, 4]"));
    assert!(service.publish_host(&other, &[0; 64]).is_err());
    assert_eq!(
        mapped.host_bytes().unwrap(),
        &new[..],
        "untouched by the refusal"
    );
}

#[test]
fn reject_refuses_a_name_already_shared_and_keeps_the_first() {
    let (service, _socket) = service("reject", OnExisting::Reject);
    let (meta, old) = weights(1);
    service.publish_host(&meta, &old).unwrap();
    let refused = service.check_update(&meta).unwrap_err();
    assert_eq!(refused.code, ErrorCode::REJECTED);
    assert!(refused.message.contains("weights"), "{refused}");
    assert!(matches!(
        service.publish_host(&meta, &[9; 64]),
        Err(IpcError::Refused { .. })
    ));
    let client = ShareClient::connect(service.path()).unwrap();
    let kept = client.open("weights").unwrap();
    assert_eq!(kept.host_bytes().unwrap(), &old[..]);
    assert_eq!(kept.descriptor().tensor.generation, 1);
    // A deleted name may be shared afresh.
    drop(kept);
    service.delete("weights").unwrap();
    assert_eq!(service.publish_host(&meta, &old).unwrap().generation(), 1);
}

#[test]
fn a_watcher_started_first_sees_published_updated_and_deleted_in_order() {
    let (service, _socket) = service("watch", OnExisting::Replace);
    let client = ShareClient::connect(service.path()).unwrap();
    let mut watch = client.watch("layers.").unwrap();
    let (meta, bytes) = weights(1);
    let layer = meta.clone().with_name("layers.0.weight");
    service.publish_host(&meta, &bytes).unwrap(); // Not under the prefix.
    service.publish_host(&layer, &bytes).unwrap();
    service.publish_host(&layer, &[2; 64]).unwrap();
    service.delete("layers.0.weight").unwrap();
    let mut seen = Vec::new();
    while let Some(event) = watch.next_timeout(Some(Duration::from_secs(5))).unwrap() {
        seen.push((
            event.event,
            event.tensor.tensor.name.clone(),
            event.tensor.tensor.generation,
        ));
        if seen.len() == 3 {
            break;
        }
    }
    assert_eq!(
        seen,
        vec![
            (EventKind::Published, "layers.0.weight".to_owned(), 1),
            (EventKind::Updated, "layers.0.weight".to_owned(), 2),
            (EventKind::Deleted, "layers.0.weight".to_owned(), 2),
        ]
    );
    assert!(
        watch
            .next_timeout(Some(Duration::from_millis(200)))
            .unwrap()
            .is_none(),
        "nothing else, and nothing outside the prefix"
    );
}

#[test]
fn open_waits_for_a_name_until_it_is_published_or_the_wait_ends() {
    let (service, _socket) = service("open-wait", OnExisting::Replace);
    let client = ShareClient::connect(service.path()).unwrap();
    let err = client
        .open_wait("late", Duration::from_millis(100))
        .err()
        .unwrap();
    match err {
        IpcError::Refused { code, message } => {
            assert_eq!(code.0, "not_found");
            assert!(message.contains("after waiting 100 ms"), "{message}");
        }
        other => panic!("expected not_found, got {other}"),
    }
    let (meta, bytes) = weights(5);
    let late = meta.with_name("late");
    std::thread::scope(|scope| {
        scope.spawn(|| {
            std::thread::sleep(Duration::from_millis(200));
            service.publish_host(&late, &bytes).unwrap();
        });
        let opened = client.open_wait("late", Duration::from_secs(10)).unwrap();
        assert_eq!(opened.host_bytes().unwrap(), &bytes[..]);
    });
}

#[test]
fn listings_carry_the_senders_attributes_and_the_full_metadata() {
    let (service, _socket) = service("metadata", OnExisting::Replace);
    let meta = TensorMeta::new([16_000], DType::F32)
        .unwrap()
        .with_name("speech")
        .with_attribute("sample_rate", "16000")
        .with_attribute("channels", "1");
    service.publish_host(&meta, &[0; 64_000]).unwrap();
    let client = ShareClient::connect(service.path()).unwrap();
    let info = client.info("speech").unwrap().tensor;
    assert_eq!(info.attributes["sample_rate"], "16000");
    assert_eq!(info.attributes["channels"], "1");
    assert_eq!((info.numel, info.element_size), (16_000, 4));
    assert_eq!((&info.device, info.generation), (&None, 1));
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64;
    assert!(info.landed_unix_us <= now_us && now_us - info.landed_unix_us < 60_000_000);
    let opened = client.open("speech").unwrap();
    assert_eq!(
        opened.descriptor().tensor,
        info,
        "open's descriptor says the same"
    );
}
