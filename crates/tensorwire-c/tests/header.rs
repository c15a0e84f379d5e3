//! `include/tensorwire.h` is what cbindgen makes of the crate now (run with
//! `TENSORWIRE_WRITE_HEADER=1` to rewrite it after changing the ABI).
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::path::Path;

#[test]
fn the_committed_header_matches_the_abi() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).unwrap();
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(crate_dir)
        .with_config(config)
        .generate()
        .unwrap()
        .write(&mut generated);
    let path = crate_dir.join("include/tensorwire.h");
    if std::env::var_os("TENSORWIRE_WRITE_HEADER").is_some() {
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    let committed = std::fs::read(&path).unwrap();
    assert!(
        committed == generated,
        "include/tensorwire.h is stale: TENSORWIRE_WRITE_HEADER=1 cargo test -p tensorwire-c --test header"
    );
}
