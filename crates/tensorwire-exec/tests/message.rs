//! Remote-execution messages (spec §14): golden vectors, round trips, and every limit
//! refused with its own code.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tensorwire_exec::fuzzing::exec_round_trip;
use tensorwire_exec::message::{
    ArgSpec, ExecLimits, ExecReply, ExecRequest, ExecRole, LaunchShape, ModuleFormat, RequestBody,
    RequestKind, RunRequest, Timings,
};
use tensorwire_proto::{DType, ErrorCode, TensorMeta};

fn exec_dir() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../spec/vectors/exec"
    ))
}

/// The SpMV request of the walkthrough: y = A·x with A in CSR.
fn spmv(rows: u64, nnz: u64) -> RunRequest {
    RunRequest {
        module_sha256: [0xab; 32],
        module_format: ModuleFormat::Ptx,
        module_len: 2345,
        module_attached: true,
        function: "spmv_csr".into(),
        launch: LaunchShape {
            grid: [rows.div_ceil(256) as u32, 1, 1],
            block: [256, 1, 1],
            shared_mem_bytes: 0,
        },
        time_limit_ms: 5000,
        args: vec![
            ArgSpec::Input {
                name: "values".into(),
                dtype: DType::F32,
                shape: vec![nnz],
            },
            ArgSpec::Input {
                name: "col_indices".into(),
                dtype: DType::I32,
                shape: vec![nnz],
            },
            ArgSpec::Input {
                name: "row_ptr".into(),
                dtype: DType::I32,
                shape: vec![rows + 1],
            },
            ArgSpec::Input {
                name: "x".into(),
                dtype: DType::F32,
                shape: vec![rows],
            },
            ArgSpec::Output {
                name: "y".into(),
                dtype: DType::F32,
                shape: vec![rows],
            },
            ArgSpec::Scalar {
                name: "rows".into(),
                dtype: DType::I32,
                value: (rows as i32).to_le_bytes().to_vec(),
            },
        ],
    }
}

fn run(id: u64, run: RunRequest) -> ExecRequest {
    ExecRequest {
        id,
        body: RequestBody::Run(run),
    }
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Vector {
    file: String,
    /// "request" or "reply".
    message: String,
    description: String,
    /// The error code name decoding must give, or null for a valid message.
    error: Option<String>,
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Manifest {
    about: String,
    vectors: Vec<Vector>,
}

struct Built {
    vector: Vector,
    bytes: Vec<u8>,
}

fn valid_request(file: &str, description: &str, request: &ExecRequest) -> Built {
    built(file, "request", description, None, request.encode())
}

fn built(
    file: &str,
    message: &str,
    description: &str,
    error: Option<ErrorCode>,
    bytes: Vec<u8>,
) -> Built {
    Built {
        vector: Vector {
            file: format!("{file}.bin"),
            message: message.into(),
            description: description.into(),
            error: error.map(|c| c.name().unwrap().to_owned()),
        },
        bytes,
    }
}

fn with(mut request: RunRequest, change: impl FnOnce(&mut RunRequest)) -> ExecRequest {
    change(&mut request);
    run(9, request)
}

fn vectors() -> Vec<Built> {
    let small = spmv(1000, 5000);
    let mut truncated = run(9, small.clone()).encode();
    truncated.pop();
    let mut trailing = run(9, small.clone()).encode();
    trailing.push(0);
    let mut bad_version = ExecRequest {
        id: 1,
        body: RequestBody::Info,
    }
    .encode();
    bad_version[0] = 2;
    let mut bad_dtype = run(9, small.clone()).encode();
    // The first argument's dtype byte follows the 88-byte fixed part, the function name and
    // the argument's kind byte.
    bad_dtype[88 + "spmv_csr".len() + 1] = 99;
    let mut bad_flag = run(9, small.clone()).encode();
    bad_flag[2 + 8 + 32 + 1] = 2;
    let ok_reply = ExecReply {
        kind: RequestKind::Run,
        id: 9,
        error: None,
        message: String::new(),
        timings: Timings {
            landing_ns: 1_250_000,
            kernel_ns: 310_000,
            egress_ns: 420_000,
            total_ns: 2_100_000,
        },
        attributes: vec![("module.cache".into(), "hit".into())],
    };
    let info_reply = ExecReply {
        kind: RequestKind::Info,
        id: 1,
        error: None,
        message: String::new(),
        timings: Timings::default(),
        attributes: vec![
            ("server.version".into(), "0.1.0".into()),
            ("exec".into(), "enabled".into()),
            ("device.name".into(), "NVIDIA H100 80GB HBM3".into()),
            ("device.compute_capability".into(), "9.0".into()),
        ],
    };
    let fault_reply = ExecReply::failure(
        RequestKind::Run,
        9,
        ErrorCode::KERNEL_FAULT,
        "spmv_csr: CUDA_ERROR_ILLEGAL_ADDRESS (700): an illegal memory access was encountered",
    );
    let mut reply_trailing = ok_reply.encode();
    reply_trailing.push(7);
    vec![
        valid_request(
            "request_info",
            "info request, id 1",
            &ExecRequest {
                id: 1,
                body: RequestBody::Info,
            },
        ),
        valid_request(
            "request_health",
            "health request, id 2",
            &ExecRequest {
                id: 2,
                body: RequestBody::Health,
            },
        ),
        valid_request(
            "request_spmv",
            "run spmv_csr: 4 inputs, an output y, a scalar rows; PTX attached",
            &run(9, small.clone()),
        ),
        valid_request(
            "request_cached",
            "run by hash alone (module not attached), a 3-D launch with shared memory",
            &with(small.clone(), |r| {
                r.module_attached = false;
                r.launch = LaunchShape {
                    grid: [4, 3, 2],
                    block: [8, 8, 4],
                    shared_mem_bytes: 4096,
                };
            }),
        ),
        built(
            "reply_ok",
            "reply",
            "run succeeded, with timings and module.cache=hit",
            None,
            ok_reply.encode(),
        ),
        built(
            "reply_info",
            "reply",
            "info reply with server and device attributes",
            None,
            info_reply.encode(),
        ),
        built(
            "reply_kernel_fault",
            "reply",
            "run failed: KERNEL_FAULT with a message",
            None,
            fault_reply.encode(),
        ),
        built(
            "invalid_truncated",
            "request",
            "a run request one byte short",
            Some(ErrorCode::EXEC_MALFORMED),
            truncated,
        ),
        built(
            "invalid_trailing",
            "request",
            "a run request with a byte left over",
            Some(ErrorCode::EXEC_MALFORMED),
            trailing,
        ),
        built(
            "invalid_version",
            "request",
            "version 2",
            Some(ErrorCode::EXEC_MALFORMED),
            bad_version,
        ),
        built(
            "invalid_dtype",
            "request",
            "an argument with dtype 99",
            Some(ErrorCode::UNKNOWN_DTYPE),
            bad_dtype,
        ),
        built(
            "invalid_attached_flag",
            "request",
            "module_attached 2",
            Some(ErrorCode::EXEC_MALFORMED),
            bad_flag,
        ),
        built(
            "invalid_module_too_large",
            "request",
            "a 64 MiB + 1 module",
            Some(ErrorCode::MODULE_TOO_LARGE),
            with(small.clone(), |r| r.module_len = (64 << 20) + 1).encode(),
        ),
        built(
            "invalid_too_many_args",
            "request",
            "65 scalar arguments",
            Some(ErrorCode::TOO_MANY_ARGUMENTS),
            with(small.clone(), |r| {
                r.args = (0..65)
                    .map(|i| ArgSpec::Scalar {
                        name: format!("s{i}"),
                        dtype: DType::U8,
                        value: vec![i as u8],
                    })
                    .collect()
            })
            .encode(),
        ),
        built(
            "invalid_grid_zero",
            "request",
            "grid y of 0",
            Some(ErrorCode::LAUNCH_TOO_LARGE),
            with(small.clone(), |r| r.launch.grid[1] = 0).encode(),
        ),
        built(
            "invalid_block_threads",
            "request",
            "block 64 × 32 = 2048 threads",
            Some(ErrorCode::LAUNCH_TOO_LARGE),
            with(small.clone(), |r| r.launch.block = [64, 32, 1]).encode(),
        ),
        built(
            "invalid_time_limit",
            "request",
            "a time limit of 60 s (the limit is 10 s)",
            Some(ErrorCode::RUN_TIME_EXCEEDED),
            with(small.clone(), |r| r.time_limit_ms = 60_000).encode(),
        ),
        built(
            "invalid_duplicate_name",
            "request",
            "two arguments named x",
            Some(ErrorCode::ARGUMENT_MISMATCH),
            with(small.clone(), |r| {
                r.args.push(ArgSpec::Output {
                    name: "x".into(),
                    dtype: DType::F32,
                    shape: vec![1],
                })
            })
            .encode(),
        ),
        built(
            "invalid_reply_trailing",
            "reply",
            "a reply with a byte left over",
            Some(ErrorCode::EXEC_MALFORMED),
            reply_trailing,
        ),
    ]
}

fn decode(message: &str, bytes: &[u8]) -> Result<(), tensorwire_proto::ProtocolError> {
    let limits = ExecLimits::default();
    match message {
        "request" => ExecRequest::decode(bytes, &limits).map(drop),
        _ => ExecReply::decode(bytes, limits.max_request_len).map(drop),
    }
}

/// `TENSORWIRE_WRITE_VECTORS=1` rewrites `spec/vectors/exec/`; otherwise every committed
/// vector must be byte-identical to what the code builds and decode as its manifest says.
#[test]
fn exec_vectors_match_the_code() {
    let built = vectors();
    let manifest = Manifest {
        about: "Remote-execution requests and replies (spec/protocol.md §14). Regenerate with \
                TENSORWIRE_WRITE_VECTORS=1 cargo test -p tensorwire-proto --test exec."
            .into(),
        vectors: built
            .iter()
            .map(|b| Vector {
                file: b.vector.file.clone(),
                message: b.vector.message.clone(),
                description: b.vector.description.clone(),
                error: b.vector.error.clone(),
            })
            .collect(),
    };
    let dir = exec_dir();
    if std::env::var_os("TENSORWIRE_WRITE_VECTORS").is_some() {
        std::fs::create_dir_all(&dir).unwrap();
        for b in &built {
            std::fs::write(dir.join(&b.vector.file), &b.bytes).unwrap();
        }
        let json = serde_json::to_string_pretty(&manifest).unwrap();
        std::fs::write(dir.join("manifest.json"), json + "\n").unwrap();
    }
    let committed: Manifest =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(
        committed, manifest,
        "manifest differs: regenerate the vectors"
    );
    for b in &built {
        let on_disk = std::fs::read(dir.join(&b.vector.file)).unwrap();
        assert_eq!(on_disk, b.bytes, "{} differs from the code", b.vector.file);
        let outcome = decode(&b.vector.message, &on_disk);
        match (&b.vector.error, outcome) {
            (None, Ok(())) => {}
            (None, Err(e)) => panic!("{}: {e}", b.vector.file),
            (Some(code), Err(e)) => {
                assert_eq!(e.code().name(), Some(code.as_str()), "{}", b.vector.file)
            }
            (Some(code), Ok(())) => panic!("{} decoded; expected {code}", b.vector.file),
        }
        exec_round_trip(&on_disk);
    }
}

#[test]
fn requests_and_replies_round_trip() {
    let limits = ExecLimits::default();
    for request in [
        run(7, spmv(1_000_000, 10_000_000)),
        ExecRequest {
            id: u64::MAX,
            body: RequestBody::Health,
        },
    ] {
        let bytes = request.encode();
        assert_eq!(ExecRequest::decode(&bytes, &limits).unwrap(), request);
    }
    let reply = ExecReply::failure(
        RequestKind::Run,
        3,
        ErrorCode::MODULE_NOT_CACHED,
        "é".repeat(600),
    );
    assert!(reply.message.len() <= 1024 && reply.message.is_char_boundary(reply.message.len()));
    assert_eq!(ExecReply::decode(&reply.encode(), 1 << 16).unwrap(), reply);
}

/// Every prefix of a valid request fails cleanly (no panic, EXEC_MALFORMED).
#[test]
fn every_truncation_is_refused_as_malformed() {
    let bytes = run(9, spmv(100, 500)).encode();
    for n in 0..bytes.len() {
        let err = ExecRequest::decode(&bytes[..n], &ExecLimits::default()).unwrap_err();
        assert_eq!(err.code(), ErrorCode::EXEC_MALFORMED, "prefix {n}: {err}");
    }
}

#[test]
fn every_limit_is_refused_with_its_code() {
    let limits = ExecLimits::default();
    let check = |change: &dyn Fn(&mut RunRequest), code: ErrorCode| {
        let mut request = spmv(100, 500);
        change(&mut request);
        assert_eq!(
            request.check(&limits).unwrap_err().code(),
            code,
            "{request:?}"
        );
        // The decoder applies the same check.
        let err = ExecRequest::decode(&run(1, request).encode(), &limits).unwrap_err();
        assert_eq!(err.code(), code);
    };
    check(
        &|r| r.module_len = limits.max_module_len + 1,
        ErrorCode::MODULE_TOO_LARGE,
    );
    check(
        &|r| {
            r.args = (0..=limits.max_args)
                .map(|i| ArgSpec::Scalar {
                    name: format!("s{i}"),
                    dtype: DType::U8,
                    value: vec![0],
                })
                .collect()
        },
        ErrorCode::TOO_MANY_ARGUMENTS,
    );
    for axis in 0..3 {
        check(&|r| r.launch.grid[axis] = 0, ErrorCode::LAUNCH_TOO_LARGE);
        check(&|r| r.launch.block[axis] = 0, ErrorCode::LAUNCH_TOO_LARGE);
        check(
            &|r| r.launch.grid[axis] = limits.max_grid[axis] + 1,
            ErrorCode::LAUNCH_TOO_LARGE,
        );
        check(
            &|r| {
                r.launch.block = {
                    let mut b = [1, 1, 1];
                    b[axis] = limits.max_block[axis] + 1;
                    b
                }
            },
            ErrorCode::LAUNCH_TOO_LARGE,
        );
    }
    check(
        &|r| r.launch.block = [512, 2, 2],
        ErrorCode::LAUNCH_TOO_LARGE,
    );
    check(
        &|r| r.launch.shared_mem_bytes = limits.max_shared_mem_bytes + 1,
        ErrorCode::LAUNCH_TOO_LARGE,
    );
    check(
        &|r| r.time_limit_ms = limits.max_time_limit_ms + 1,
        ErrorCode::RUN_TIME_EXCEEDED,
    );
    check(
        &|r| {
            r.args.push(ArgSpec::Output {
                name: "huge".into(),
                dtype: DType::F64,
                shape: vec![1 << 31],
            })
        },
        ErrorCode::TENSOR_TOO_LARGE,
    );
    check(
        &|r| {
            r.args.push(ArgSpec::Output {
                name: "overflow".into(),
                dtype: DType::F64,
                shape: vec![u64::MAX, 2],
            })
        },
        ErrorCode::TENSOR_TOO_LARGE,
    );
    check(
        &|r| {
            r.args.push(ArgSpec::Output {
                name: "deep".into(),
                dtype: DType::U8,
                shape: vec![1; 33],
            })
        },
        ErrorCode::EXEC_MALFORMED,
    );
    check(
        &|r| r.function = "f".repeat(1025),
        ErrorCode::EXEC_MALFORMED,
    );
    check(
        &|r| {
            r.args.push(ArgSpec::Input {
                name: String::new(),
                dtype: DType::U8,
                shape: vec![1],
            })
        },
        ErrorCode::ARGUMENT_MISMATCH,
    );
    // A request longer than the request limit is refused before it is parsed.
    let mut small = ExecLimits::default();
    small.max_request_len = 16;
    let err = ExecRequest::decode(&run(1, spmv(10, 10)).encode(), &small).unwrap_err();
    assert_eq!(err.code(), ErrorCode::EXEC_MALFORMED);
    // A scalar whose value is not its dtype's size is refused by the checker.
    let mut request = spmv(10, 10);
    request.args.push(ArgSpec::Scalar {
        name: "alpha".into(),
        dtype: DType::F32,
        value: vec![0; 8],
    });
    assert_eq!(
        request.check(&limits).unwrap_err().code(),
        ErrorCode::ARGUMENT_MISMATCH
    );
}

#[test]
fn time_limits_default_and_are_capped() {
    let limits = ExecLimits::default();
    let mut request = spmv(10, 10);
    request.time_limit_ms = 0;
    assert_eq!(
        request.effective_time_limit_ms(&limits),
        limits.default_time_limit_ms
    );
    request.time_limit_ms = 250;
    assert_eq!(request.effective_time_limit_ms(&limits), 250);
}

#[test]
fn inputs_are_checked_against_their_declaration() {
    let request = spmv(10, 40);
    let ok = TensorMeta::new(vec![40], DType::F32)
        .unwrap()
        .with_name("values");
    request.check_input(&ok).unwrap();
    let wrong_shape = TensorMeta::new(vec![41], DType::F32)
        .unwrap()
        .with_name("values");
    let err = request.check_input(&wrong_shape).unwrap_err();
    assert_eq!(err.code(), ErrorCode::ARGUMENT_MISMATCH);
    assert!(
        err.to_string().contains("[41]") && err.to_string().contains("[40]"),
        "{err}"
    );
    let wrong_dtype = TensorMeta::new(vec![40], DType::I32)
        .unwrap()
        .with_name("values");
    assert_eq!(
        request.check_input(&wrong_dtype).unwrap_err().code(),
        ErrorCode::ARGUMENT_MISMATCH
    );
    let undeclared = TensorMeta::new(vec![1], DType::F32).unwrap().with_name("y");
    assert_eq!(
        request.check_input(&undeclared).unwrap_err().code(),
        ErrorCode::ARGUMENT_MISMATCH
    );
    assert_eq!(request.input_count(), 4);
}

#[test]
fn roles_are_read_from_attributes() {
    let plain = TensorMeta::new(vec![4], DType::U8).unwrap();
    assert_eq!(ExecRole::of(&plain).unwrap(), None);
    let tagged = ExecRole::Input.tag(plain.clone().with_name("x"), 42);
    assert_eq!(ExecRole::of(&tagged).unwrap(), Some((ExecRole::Input, 42)));
    let no_id = plain
        .clone()
        .with_attribute(tensorwire_exec::message::ROLE_ATTRIBUTE, "reply");
    assert_eq!(
        ExecRole::of(&no_id).unwrap_err().code(),
        ErrorCode::EXEC_MALFORMED
    );
    let unknown = plain
        .with_attribute(tensorwire_exec::message::ROLE_ATTRIBUTE, "launch")
        .with_attribute(tensorwire_exec::message::ID_ATTRIBUTE, "1");
    assert_eq!(
        ExecRole::of(&unknown).unwrap_err().code(),
        ErrorCode::EXEC_MALFORMED
    );
}

#[test]
fn module_formats_are_sniffed() {
    assert_eq!(ModuleFormat::sniff(b"\x7fELF\x02\x01"), ModuleFormat::Cubin);
    assert_eq!(
        ModuleFormat::sniff(&[0x50, 0xed, 0x55, 0xba, 1, 0]),
        ModuleFormat::Fatbin
    );
    assert_eq!(
        ModuleFormat::sniff(b"//\n.version 8.0\n"),
        ModuleFormat::Ptx
    );
}

/// The fuzz target's committed corpus (fuzz/corpus/exec_message), replayed by plain
/// `cargo test` so CI exercises what fuzzing found.
#[test]
fn the_exec_message_corpus_replays_cleanly() {
    let dir = Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../fuzz/corpus/exec_message"
    ));
    let mut count = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        exec_round_trip(&std::fs::read(entry.unwrap().path()).unwrap());
        count += 1;
    }
    assert!(count >= 19, "only {count} corpus inputs: run fuzz/seed.sh");
}
