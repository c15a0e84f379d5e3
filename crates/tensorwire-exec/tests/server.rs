//! The remote-execution server over loopback QUIC, without running a kernel: every invalid
//! request answered with its code, info and health, access control, and the paths that need
//! no GPU (spec §14).
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use tensorwire_exec::message::ExecRole;
use tensorwire_exec::{
    ExecAccess, ExecClient, ExecConfig, ExecError, ExecReply, ExecServer, ExecToken, Module,
    ModuleFormat, Run, WorkerCommand, refuse_exec,
};
use tensorwire_gpu::GpuStatus;
use tensorwire_proto::{DType, ErrorCode, TensorMeta};
use tensorwire_quic::{ClientTls, Receiver, ReceiverConfig, Sender, SenderConfig, ServerTls};

/// The source tree: `TENSORWIRE_SOURCE_DIR` where the tests run away from it (the GPU
/// bundle), else this checkout.
fn root() -> PathBuf {
    std::env::var_os("TENSORWIRE_SOURCE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../..")))
}

/// A receiver whose every tensor goes to `route`; returns its address.
async fn serve(
    tls: ServerTls,
    admission: Duration,
    route: impl Fn(tensorwire_quic::IncomingTensor) + Send + 'static,
) -> SocketAddr {
    let mut config = ReceiverConfig::new("127.0.0.1:0".parse().unwrap(), tls);
    config.session.admission_timeout = admission;
    let mut receiver = Receiver::bind(config).await.unwrap();
    let addr = receiver.local_addr().unwrap();
    tokio::spawn(async move {
        while let Some(incoming) = receiver.next().await {
            route(incoming);
        }
    });
    addr
}

fn exec_config(access: ExecAccess, admission: Duration) -> ExecConfig {
    // No kernel runs here: a worker that cannot start is only logged.
    let mut config = ExecConfig::new(access, WorkerCommand::new("/nonexistent/tensorwire-worker"));
    config.workers = 1;
    config.admission_wait = admission;
    config
}

async fn exec_server(admission: Duration) -> (SocketAddr, ExecServer) {
    let server = ExecServer::new(exec_config(ExecAccess::LoopbackPeers, admission)).unwrap();
    let routed = server.clone();
    let addr = serve(ServerTls::Development, admission, move |incoming| {
        if let Some(other) = routed.offer(incoming) {
            other.reject(ErrorCode::REJECTED, "this test takes remote execution only");
        }
    })
    .await;
    (addr, server)
}

fn u8_meta(len: usize, name: &str) -> TensorMeta {
    TensorMeta::new(vec![len as u64], DType::U8)
        .unwrap()
        .with_name(name)
}

/// Sends `bytes` as a request tensor with id `id` and waits for the reply tensor.
async fn raw_request(sender: &Sender, back: &mut Receiver, id: u64, bytes: Vec<u8>) -> ExecReply {
    let meta = ExecRole::Request.tag(u8_meta(bytes.len(), "request"), id);
    sender
        .send(meta, Bytes::from(bytes))
        .finished()
        .await
        .unwrap();
    let incoming = tokio::time::timeout(Duration::from_secs(20), back.next())
        .await
        .expect("no reply within 20 s")
        .unwrap();
    assert_eq!(
        ExecRole::of(incoming.meta()).unwrap(),
        Some((ExecRole::Reply, id))
    );
    let (_, bytes) = incoming
        .accept_host()
        .await
        .unwrap()
        .finished()
        .await
        .unwrap();
    ExecReply::decode(&bytes, 1 << 16).unwrap()
}

async fn raw_client(addr: SocketAddr) -> (Sender, Receiver) {
    let sender = Sender::connect(addr, SenderConfig::new(ClientTls::Development))
        .await
        .unwrap();
    let back = sender
        .connection()
        .incoming(ReceiverConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            ServerTls::Development,
        ))
        .unwrap();
    (sender, back)
}

#[derive(serde::Deserialize)]
struct Manifest {
    vectors: Vec<Vector>,
}

#[derive(serde::Deserialize)]
struct Vector {
    file: String,
    message: String,
    error: Option<String>,
}

/// Each invalid request of `spec/vectors/exec` sent to a live server comes back as a reply
/// with the code its manifest names: the limits of spec §14.4 hold on the wire.
#[tokio::test]
async fn every_invalid_request_vector_is_answered_with_its_code() {
    let (addr, server) = exec_server(Duration::from_secs(5)).await;
    let (sender, mut back) = raw_client(addr).await;
    let dir = root().join("spec/vectors/exec");
    let manifest: Manifest =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    let mut checked = 0;
    for (n, vector) in manifest.vectors.iter().enumerate() {
        let (Some(code), "request") = (&vector.error, vector.message.as_str()) else {
            continue;
        };
        let bytes = std::fs::read(dir.join(&vector.file)).unwrap();
        // A fresh id per vector: ids of requests that failed stay reserved for a while.
        let id = 1000 + n as u64;
        let mut bytes = bytes;
        if bytes.len() >= 10 {
            bytes[2..10].copy_from_slice(&id.to_le_bytes());
        }
        let reply = raw_request(&sender, &mut back, id, bytes).await;
        assert_eq!(
            reply.error.and_then(|c| c.name()),
            Some(code.as_str()),
            "{}: {}",
            vector.file,
            reply.message
        );
        assert!(
            !reply.message.is_empty(),
            "{}: no reason given",
            vector.file
        );
        checked += 1;
    }
    assert!(checked >= 10, "only {checked} invalid request vectors");
    assert_eq!(server.stats().requests, checked);
}

#[tokio::test]
async fn a_request_whose_id_differs_from_its_tensor_is_malformed() {
    let (addr, _server) = exec_server(Duration::from_secs(5)).await;
    let (sender, mut back) = raw_client(addr).await;
    let request = tensorwire_exec::message::ExecRequest {
        id: 5,
        body: tensorwire_exec::message::RequestBody::Health,
    };
    let reply = raw_request(&sender, &mut back, 6, request.encode()).await;
    assert_eq!(
        reply.error,
        Some(ErrorCode::EXEC_MALFORMED),
        "{}",
        reply.message
    );
}

#[tokio::test]
async fn a_request_tensor_over_the_limit_is_refused_before_it_is_read() {
    let (addr, server) = exec_server(Duration::from_secs(5)).await;
    let (sender, _back) = raw_client(addr).await;
    let len = 64 * 1024 + 1;
    let meta = ExecRole::Request.tag(u8_meta(len, "request"), 1);
    let err = sender
        .send(meta, Bytes::from(vec![0u8; len]))
        .finished()
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::EXEC_MALFORMED), "{err}");
    assert_eq!(server.stats().requests, 1);
}

#[tokio::test]
async fn info_and_health_answer_whether_or_not_there_is_a_gpu() {
    let (addr, _server) = exec_server(Duration::from_secs(5)).await;
    let client = ExecClient::connect(addr, SenderConfig::new(ClientTls::Development))
        .await
        .unwrap();
    let info = client.info().await.unwrap();
    assert_eq!(
        info.attribute("server.version"),
        Some(env!("CARGO_PKG_VERSION"))
    );
    let exec = info.attribute("exec").unwrap();
    if GpuStatus::detect().is_available() {
        assert_eq!(exec, "enabled");
        assert!(info.attribute("device.compute_capability").is_some());
        assert!(info.attribute("device.multiprocessors").is_some());
    } else {
        assert!(exec.starts_with("disabled: no GPU"), "{exec}");
        assert!(info.attribute("device.name").is_none());
    }
    let health = client.health().await.unwrap();
    assert_eq!(
        health.attribute("workers"),
        Some(if GpuStatus::detect().is_available() {
            "1"
        } else {
            "0"
        })
    );
    assert_eq!(health.attribute("module.cached"), Some("0"));
    client.close().await;
}

fn spmv_run() -> Run {
    let ptx = std::fs::read(root().join("examples/spmv/spmv.ptx")).unwrap();
    let module = Arc::new(Module::new(ModuleFormat::Ptx, ptx));
    let rows = 4u64;
    let f32s = |n: u64| TensorMeta::new(vec![n], DType::F32).unwrap();
    let i32s = |n: u64| TensorMeta::new(vec![n], DType::I32).unwrap();
    Run::new(module, "spmv_csr")
        .grid([1, 1, 1])
        .block([32, 1, 1])
        .input(f32s(4).with_name("values"), vec![0u8; 16])
        .unwrap()
        .input(i32s(4).with_name("col_indices"), vec![0u8; 16])
        .unwrap()
        .input(i32s(rows + 1).with_name("row_ptr"), vec![0u8; 20])
        .unwrap()
        .input(f32s(rows).with_name("x"), vec![0u8; 16])
        .unwrap()
        .output("y", DType::F32, vec![rows])
        .scalar("rows", DType::I32, 4i32.to_le_bytes())
}

#[tokio::test]
async fn a_server_without_a_gpu_refuses_runs_with_unsupported_device() {
    if GpuStatus::detect().is_available() {
        eprintln!("SKIPPED: this host has a GPU; the GPU tests run kernels here");
        return;
    }
    let (addr, server) = exec_server(Duration::from_secs(5)).await;
    let client = ExecClient::connect(addr, SenderConfig::new(ClientTls::Development))
        .await
        .unwrap();
    let err = client.run(&spmv_run()).await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::UNSUPPORTED_DEVICE), "{err}");
    assert!(err.to_string().contains("no GPU"), "{err}");
    let stats = server.stats();
    assert_eq!((stats.runs_succeeded, stats.runs_failed), (0, 1));
}

#[tokio::test]
async fn a_run_over_a_limit_fails_at_the_client_before_anything_is_sent() {
    let (addr, server) = exec_server(Duration::from_secs(5)).await;
    let client = ExecClient::connect(addr, SenderConfig::new(ClientTls::Development))
        .await
        .unwrap();
    for (run, code) in [
        (spmv_run().grid([0, 1, 1]), ErrorCode::LAUNCH_TOO_LARGE),
        (spmv_run().block([2048, 1, 1]), ErrorCode::LAUNCH_TOO_LARGE),
        (
            spmv_run().time_limit(Duration::from_secs(3600)),
            ErrorCode::RUN_TIME_EXCEEDED,
        ),
        (
            spmv_run().output("x", DType::F32, vec![1]),
            ErrorCode::ARGUMENT_MISMATCH,
        ),
    ] {
        let err = client.run(&run).await.unwrap_err();
        assert!(matches!(err, ExecError::Protocol(_)), "{err}");
        assert_eq!(err.code(), Some(code), "{err}");
    }
    assert_eq!(server.stats().requests, 0);
}

#[tokio::test]
async fn an_input_whose_request_never_comes_is_refused_when_admission_ends() {
    let (addr, _server) = exec_server(Duration::from_millis(500)).await;
    let (sender, _back) = raw_client(addr).await;
    let meta = ExecRole::Input.tag(u8_meta(8, "x"), 77);
    let err = sender
        .send(meta, Bytes::from(vec![1u8; 8]))
        .finished()
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::PROGRESS_TIMEOUT), "{err}");
    assert!(err.to_string().contains("no request with id 77"), "{err}");
}

#[tokio::test]
async fn clients_cannot_send_outputs_or_replies_to_a_server() {
    let (addr, _server) = exec_server(Duration::from_secs(5)).await;
    let (sender, _back) = raw_client(addr).await;
    for role in [ExecRole::Output, ExecRole::Reply] {
        let err = sender
            .send(role.tag(u8_meta(4, "y"), 3), Bytes::from(vec![0u8; 4]))
            .finished()
            .await
            .unwrap_err();
        assert_eq!(err.code(), Some(ErrorCode::REJECTED), "{role}: {err}");
    }
    // A role with no id is malformed.
    let meta = u8_meta(4, "x").with_attribute(tensorwire_exec::message::ROLE_ATTRIBUTE, "input");
    let err = sender
        .send(meta, Bytes::from(vec![0u8; 4]))
        .finished()
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::EXEC_MALFORMED), "{err}");
}

#[tokio::test]
async fn a_receiver_that_does_not_execute_refuses_exec_tensors_and_keeps_the_rest() {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let addr = serve(
        ServerTls::Development,
        Duration::from_secs(5),
        move |incoming| {
            if let Some(other) = refuse_exec(incoming) {
                let _ = tx.send(other);
            }
        },
    )
    .await;
    let client = ExecClient::connect(addr, SenderConfig::new(ClientTls::Development))
        .await
        .unwrap();
    let err = client.info().await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::EXEC_NOT_ALLOWED), "{err}");
    // An ordinary tensor still reaches the application.
    let sender = Sender::connect(addr, SenderConfig::new(ClientTls::Development))
        .await
        .unwrap();
    let send = sender.send(u8_meta(3, "plain"), Bytes::from_static(b"abc"));
    let plain = rx.recv().await.unwrap();
    assert_eq!(plain.meta().name(), "plain");
    let (_, bytes) = plain.accept_host().await.unwrap().finished().await.unwrap();
    assert_eq!(&bytes[..], b"abc");
    send.finished().await.unwrap();
}

struct Pki {
    dir: PathBuf,
}

impl Pki {
    /// A CA with a server certificate for localhost and a client certificate, as PEM files.
    fn new(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("tensorwire-exec-pki-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ca_key = KeyPair::generate().unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = ca_params.self_signed(&ca_key).unwrap();
        std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
        let issuer = Issuer::new(ca_params, ca_key);
        for leaf in ["server", "client"] {
            let key = KeyPair::generate().unwrap();
            let cert = CertificateParams::new(vec!["localhost".to_owned()])
                .unwrap()
                .signed_by(&key, &issuer)
                .unwrap();
            std::fs::write(dir.join(format!("{leaf}.pem")), cert.pem()).unwrap();
            std::fs::write(dir.join(format!("{leaf}.key")), key.serialize_pem()).unwrap();
        }
        Self { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn server_tls(&self, client_ca: bool) -> ServerTls {
        ServerTls::Pem {
            cert: self.path("server.pem"),
            key: self.path("server.key"),
            client_ca: client_ca.then(|| self.path("ca.pem")),
        }
    }

    fn client(&self, identity: bool) -> SenderConfig {
        SenderConfig::new(ClientTls::Pem {
            ca: self.path("ca.pem"),
            identity: identity.then(|| (self.path("client.pem"), self.path("client.key"))),
        })
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn execution_needs_mutual_tls_or_a_loopback_address() {
    let pki = Pki::new("access");
    let public: SocketAddr = "0.0.0.0:7000".parse().unwrap();
    let loopback: SocketAddr = "127.0.0.1:7000".parse().unwrap();
    let err = ExecAccess::for_listener(public, &ServerTls::Development).unwrap_err();
    assert!(err.to_string().contains("mutual TLS"), "{err}");
    assert!(ExecAccess::for_listener(public, &pki.server_tls(false)).is_err());
    assert_eq!(
        ExecAccess::for_listener(public, &pki.server_tls(true)).unwrap(),
        ExecAccess::AuthenticatedPeers
    );
    assert_eq!(
        ExecAccess::for_listener(loopback, &ServerTls::Development).unwrap(),
        ExecAccess::LoopbackPeers
    );
}

/// With mutual TLS, a client with a certificate from the CA runs requests; one without a
/// certificate never gets a request through.
#[tokio::test]
async fn a_peer_without_a_client_certificate_is_refused() {
    let pki = Pki::new("mtls");
    let server = ExecServer::new(exec_config(
        ExecAccess::AuthenticatedPeers,
        Duration::from_secs(5),
    ))
    .unwrap();
    let routed = server.clone();
    let addr = serve(
        pki.server_tls(true),
        Duration::from_secs(5),
        move |incoming| {
            if let Some(other) = routed.offer(incoming) {
                other.reject(ErrorCode::REJECTED, "exec only");
            }
        },
    )
    .await;
    let with = ExecClient::connect(addr, pki.client(true)).await.unwrap();
    assert!(with.info().await.unwrap().attribute("exec").is_some());
    with.close().await;
    let refused = async {
        let without = ExecClient::connect(addr, pki.client(false)).await?;
        without.info().await
    };
    let err = tokio::time::timeout(Duration::from_secs(20), refused)
        .await
        .expect("the unauthenticated client was neither refused nor answered")
        .unwrap_err();
    assert!(matches!(err, ExecError::Transport(_)), "{err}");
    assert_eq!(
        server.stats().requests,
        1,
        "only the authenticated request arrived"
    );
}

/// Spec §14.6: a server that admits by token answers a client presenting it, and refuses,
/// with EXEC_NOT_ALLOWED, one without it or with another, before reading their tensors.
#[tokio::test]
async fn a_server_that_admits_by_token_refuses_clients_without_it() {
    let secret = "4f1c9a0d7e2b6c58a1f3d9e0b7c2a465";
    let token = ExecToken::new(secret).unwrap();
    assert_eq!(
        format!("{token:?}"),
        "ExecToken(<redacted>)",
        "never printed"
    );
    assert_eq!(
        ExecToken::new(secret).unwrap(),
        token,
        "equal tokens compare equal"
    );
    let server = ExecServer::new(exec_config(
        ExecAccess::TokenHolders(token.clone()),
        Duration::from_secs(5),
    ))
    .unwrap();
    let routed = server.clone();
    let addr = serve(
        ServerTls::Development,
        Duration::from_secs(5),
        move |incoming| {
            if let Some(other) = routed.offer(incoming) {
                other.reject(ErrorCode::REJECTED, "exec only");
            }
        },
    )
    .await;
    let config = || SenderConfig::new(ClientTls::Development);
    let holder = ExecClient::connect(addr, config())
        .await
        .unwrap()
        .with_token(token);
    assert!(holder.info().await.unwrap().attribute("exec").is_some());
    holder.close().await;
    let other = ExecToken::new("0000000000000000000000000000000a").unwrap();
    assert_ne!(
        ExecAccess::TokenHolders(other.clone()),
        ExecAccess::TokenHolders(ExecToken::new(secret).unwrap())
    );
    for presented in [None, Some(other)] {
        let mut client = ExecClient::connect(addr, config()).await.unwrap();
        if let Some(token) = presented.clone() {
            client = client.with_token(token);
        }
        let err = client.info().await.unwrap_err();
        assert_eq!(
            err.code(),
            Some(ErrorCode::EXEC_NOT_ALLOWED),
            "{presented:?}: {err}"
        );
        assert!(err.to_string().contains("access token"), "{err}");
        client.close().await;
    }
    assert_eq!(
        server.stats().requests,
        1,
        "only the holder's request was read"
    );
}

#[test]
fn tokens_are_long_printable_secrets_in_files_only_their_owner_reads() {
    use std::os::unix::fs::PermissionsExt;
    assert!(ExecToken::new("short").is_err());
    assert!(ExecToken::new("has a space in the middle!").is_err());
    assert!(ExecToken::new("x".repeat(257)).is_err());
    assert!(ExecToken::new("x".repeat(16)).is_ok());
    let dir = std::env::temp_dir().join(format!("tensorwire-token-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("token");
    std::fs::write(&file, "4f1c9a0d7e2b6c58a1f3d9e0b7c2a465\n").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let err = ExecToken::from_file(&file).unwrap_err();
    assert!(err.to_string().contains("chmod 600"), "{err}");
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    ExecToken::from_file(&file).unwrap();
    let missing = ExecToken::from_file(&dir.join("absent")).unwrap_err();
    assert!(missing.to_string().contains("absent"), "{missing}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// A server on a receiver's host placement answers but refuses runs, naming why.
#[test]
fn a_server_on_a_host_placement_refuses_runs_with_the_placements_reason() {
    let placement = tensorwire_gpu::Placement::Host {
        reason: "host memory was requested".into(),
    };
    let server = ExecServer::with_placement(
        exec_config(ExecAccess::LoopbackPeers, Duration::from_secs(5)),
        &placement,
    )
    .unwrap();
    assert_eq!(server.unavailable(), Some("host memory was requested"));
    assert_eq!(server.stats().workers.workers, 0);
}
