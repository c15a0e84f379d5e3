//! The endpoint scraped over HTTP while tensors land, are refused, and connections meet
//! their caps: the metrics change as they happen.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::net::SocketAddr;

use tensorwire_metrics::{MetricsServer, ReceiverMetrics};
use tensorwire_proto::{DType, ErrorCode, TensorMeta};
use tensorwire_quic::{ClientTls, Receiver, ReceiverConfig, Sender, SenderConfig, ServerTls};
use tensorwire_sink::MemoryBudget;

/// GET `path` with a real HTTP client: status, content type, body.
async fn get(server: SocketAddr, path: &str) -> (u16, String, String) {
    request("GET", server, path).await
}

async fn request(method: &'static str, server: SocketAddr, path: &str) -> (u16, String, String) {
    let url = format!("http://{server}{path}");
    tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        let mut response = match method {
            "GET" => agent.get(&url).call(),
            _ => agent.post(&url).send_empty(),
        }
        .expect("the endpoint answers");
        let kind = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let allow = response
            .headers()
            .get("allow")
            .and_then(|v| v.to_str().ok())
            .map(|allow| format!("allow: {allow}\n"))
            .unwrap_or_default();
        let body = response.body_mut().read_to_string().expect("a text body");
        (response.status().as_u16(), kind, allow + &body)
    })
    .await
    .expect("the client thread")
}

/// A receiver on loopback, and its metrics served on another port.
async fn serving() -> (Receiver, MetricsServer) {
    let receiver = Receiver::bind(ReceiverConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        ServerTls::Development,
    ))
    .await
    .unwrap();
    let metrics = ReceiverMetrics::new(receiver.observer());
    let server = MetricsServer::bind("127.0.0.1:0".parse().unwrap(), metrics)
        .await
        .unwrap();
    (receiver, server)
}

/// Scrapes until `done` holds for the exposition (10 s at most); returns it.
async fn scrape_until(server: SocketAddr, done: impl Fn(&str) -> bool) -> String {
    for _ in 0..200 {
        let (_, _, text) = get(server, "/metrics").await;
        if done(&text) {
            return text;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("the metrics never showed what was done")
}

/// The value of the sample whose name and labels are exactly `series`.
fn value(exposition: &str, series: &str) -> f64 {
    exposition
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no sample {series} in\n{exposition}"))
        .parse()
        .expect("a number")
}

/// Every line is a comment (HELP, TYPE, EOF) or `series value`, every family has its HELP
/// and TYPE, and the exposition ends with `# EOF`.
fn assert_well_formed(exposition: &str) {
    assert!(exposition.ends_with("# EOF\n"), "{exposition}");
    let mut typed = Vec::new();
    for line in exposition.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            typed.push(rest.split(' ').next().unwrap_or_default().to_owned());
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        let (series, number) = line.rsplit_once(' ').expect("series and value");
        number.parse::<f64>().unwrap_or_else(|_| panic!("{line}"));
        let name = series.split('{').next().unwrap_or_default();
        assert!(
            typed.iter().any(|family| name.starts_with(family.as_str())),
            "{name} has no TYPE before it"
        );
    }
}

#[tokio::test]
async fn metrics_follow_tensors_landing_refused_and_connections_capped() {
    let mut config = ReceiverConfig::new("127.0.0.1:0".parse().unwrap(), ServerTls::Development);
    config.max_connections_per_peer = 1;
    let mut receiver = Receiver::bind(config).await.unwrap();
    let gpu_like = MemoryBudget::new("cuda:7", 1 << 30);
    let metrics = ReceiverMetrics::with_memory(receiver.observer(), vec![gpu_like.clone()]);
    let server = MetricsServer::bind("127.0.0.1:0".parse().unwrap(), metrics)
        .await
        .unwrap();
    let addr = server.local_addr();

    let (status, kind, before) = get(addr, "/metrics").await;
    assert_eq!(status, 200);
    assert!(kind.starts_with("application/openmetrics-text"), "{kind}");
    assert_well_formed(&before);
    assert_eq!(
        value(
            &before,
            r#"tensorwire_received_tensors_total{outcome="completed"}"#
        ),
        0.0
    );
    assert_eq!(
        value(&before, r#"tensorwire_connections{binding="udp"}"#),
        0.0
    );
    assert_eq!(
        value(&before, r#"tensorwire_memory_limit_bytes{memory="cuda:7"}"#),
        (1u64 << 30) as f64
    );
    assert!(value(&before, r#"tensorwire_memory_limit_bytes{memory="host"}"#) > 0.0);

    let sender = Sender::connect(
        receiver.local_addr().unwrap(),
        SenderConfig::new(ClientTls::Development),
    )
    .await
    .unwrap();
    let meta = |name: &str| TensorMeta::new([1024], DType::F32).unwrap().with_name(name);
    let landing = sender.send(meta("kept"), vec![7u8; 4096]);
    let incoming = receiver.next().await.unwrap();
    let handle = incoming.accept_host().await.unwrap();
    let (_, landed) = handle.finished().await.unwrap();
    landing.finished().await.unwrap();
    let refused = sender.send(meta("refused"), vec![7u8; 4096]);
    receiver
        .next()
        .await
        .unwrap()
        .reject(ErrorCode::REJECTED, "not wanted here");
    assert!(refused.finished().await.is_err());
    // One connection per peer: a second from this host is refused before its handshake.
    let second = Sender::connect(
        receiver.local_addr().unwrap(),
        SenderConfig::new(ClientTls::Development),
    )
    .await;
    assert!(second.is_err(), "the peer's cap admits one connection");

    // A stream's outcome is counted as its task ends, which may be just after the sender
    // heard COMPLETE or REJECT: scrape until both are in (bounded).
    let after = scrape_until(addr, |text| {
        value(
            text,
            r#"tensorwire_received_tensors_total{outcome="completed"}"#,
        ) == 1.0
            && value(
                text,
                r#"tensorwire_received_tensors_total{outcome="failed"}"#,
            ) == 1.0
    })
    .await;
    assert_well_formed(&after);
    assert_eq!(
        value(
            &after,
            r#"tensorwire_received_tensors_total{outcome="completed"}"#
        ),
        1.0
    );
    assert_eq!(
        value(
            &after,
            r#"tensorwire_received_tensors_total{outcome="failed"}"#
        ),
        1.0
    );
    assert_eq!(
        value(
            &after,
            r#"tensorwire_received_tensor_failures_total{code="REJECTED"}"#
        ),
        1.0
    );
    assert_eq!(
        value(
            &after,
            r#"tensorwire_received_tensor_failures_total{code="other"}"#
        ),
        0.0
    );
    assert_eq!(
        value(&after, "tensorwire_received_payload_bytes_total"),
        4096.0
    );
    assert_eq!(
        value(&after, "tensorwire_receive_latency_seconds_count"),
        1.0
    );
    assert_eq!(
        value(
            &after,
            r#"tensorwire_receive_latency_seconds_bucket{le="+Inf"}"#
        ),
        1.0
    );
    assert_eq!(
        value(
            &after,
            r#"tensorwire_refused_connections_total{cap="peer"}"#
        ),
        1.0
    );
    assert_eq!(
        value(&after, r#"tensorwire_connections{binding="udp"}"#),
        1.0
    );
    // The landed tensor is still held: its host memory is reserved.
    assert!(
        value(
            &after,
            r#"tensorwire_memory_bytes{memory="host",state="reserved"}"#
        ) >= 4096.0
    );

    drop(landed);
    let (_, _, released) = get(addr, "/metrics").await;
    assert_eq!(
        value(
            &released,
            r#"tensorwire_memory_bytes{memory="host",state="reserved"}"#
        ),
        0.0
    );
    sender.close().await;
    receiver.close().await;
    server.close().await;
}

#[tokio::test]
async fn the_endpoint_answers_only_what_it_serves() {
    let (receiver, server) = serving().await;
    let addr = server.local_addr();
    let (status, _, body) = get(addr, "/").await;
    assert_eq!(status, 200);
    assert!(body.contains("/metrics"), "{body}");
    let (status, _, body) = get(addr, "/secrets").await;
    assert_eq!(status, 404);
    assert!(body.contains("metrics are at /metrics"), "{body}");
    let (status, _, body) = request("POST", addr, "/metrics").await;
    assert_eq!(status, 405);
    assert!(body.starts_with("allow: GET, HEAD"), "{body}");
    server.close().await;
    // Closed: nothing listens any more.
    assert!(std::net::TcpStream::connect(addr).is_err());
    receiver.close().await;
}

#[tokio::test]
async fn an_applications_family_is_read_at_each_scrape() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    use tensorwire_metrics::{Family, FamilyKind};

    let receiver = Receiver::bind(ReceiverConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        ServerTls::Development,
    ))
    .await
    .unwrap();
    let hits = Arc::new(AtomicU64::new(0));
    let read = hits.clone();
    let metrics = ReceiverMetrics::new(receiver.observer()).with_family(Family::new(
        "pool_requests",
        "Requests to a pool, by outcome.",
        FamilyKind::Counter,
        move || {
            vec![
                (
                    vec![("outcome", "hit".into())],
                    read.load(Ordering::Relaxed),
                ),
                (vec![("outcome", "miss".into())], 1),
            ]
        },
    ));
    let hit = r#"tensorwire_pool_requests_total{outcome="hit"}"#;
    assert_eq!(value(&metrics.encode(), hit), 0.0);
    hits.store(41, Ordering::Relaxed);
    let text = metrics.clone().encode();
    assert_well_formed(&text);
    assert_eq!(value(&text, hit), 41.0);
    assert_eq!(
        value(&text, r#"tensorwire_pool_requests_total{outcome="miss"}"#),
        1.0
    );
    receiver.close().await;
}

/// Scrapers that connect and send nothing hold every place for at most the header timeout:
/// a real scrape then gets through.
#[tokio::test]
async fn silent_connections_cannot_keep_scrapers_out() {
    use tensorwire_metrics::MAX_SCRAPERS;

    let (receiver, server) = serving().await;
    let addr = server.local_addr();
    let mut silent = Vec::new();
    for _ in 0..MAX_SCRAPERS + 4 {
        silent.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    // Every place is held now; the scrape waits for the silent ones to be dropped, within
    // the header timeout (10 s), and is bounded here well past it.
    let scrape = tokio::time::timeout(std::time::Duration::from_secs(30), get(addr, "/metrics"));
    let (status, _, body) = scrape.await.expect("a scrape gets through");
    assert_eq!(status, 200);
    assert!(body.ends_with("# EOF\n"));
    drop(silent);
    server.close().await;
    receiver.close().await;
}
