//! `/metrics` over HTTP/1.1, for Prometheus and anything else that scrapes.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{ALLOW, CONTENT_TYPE, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::ReceiverMetrics;

/// Scrapers served at once; more wait in the kernel's accept queue.
pub const MAX_SCRAPERS: usize = 16;

/// How long a scraper may take to send its request's headers.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest one scraper's connection is kept, requests included: an idle keep-alive
/// connection cannot hold one of the [`MAX_SCRAPERS`] places for ever.
const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);

/// The OpenMetrics text format, which Prometheus asks for and reads.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Serves a receiver's metrics at `http://ADDR/metrics` until closed.
///
/// Plain HTTP with no authentication, as Prometheus exporters are: bind it to loopback or
/// to a network only the scrapers reach.
#[derive(Debug)]
pub struct MetricsServer {
    local: SocketAddr,
    stop: CancellationToken,
    /// Taken by [`close`](MetricsServer::close), to wait for it.
    task: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Listens on `addr` (port 0: any free port, see [`local_addr`](Self::local_addr)).
    pub async fn bind(addr: SocketAddr, metrics: ReceiverMetrics) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        let local = listener.local_addr()?;
        let stop = CancellationToken::new();
        let task = Some(tokio::spawn(serve(listener, metrics, stop.clone())));
        Ok(Self { local, stop, task })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Stops listening and ends the connections of scrapers.
    pub async fn close(mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn serve(listener: TcpListener, metrics: ReceiverMetrics, stop: CancellationToken) {
    let places = Arc::new(Semaphore::new(MAX_SCRAPERS));
    loop {
        let place = tokio::select! {
            () = stop.cancelled() => return,
            place = places.clone().acquire_owned() => match place {
                Ok(place) => place,
                Err(_) => return,
            },
        };
        let (stream, peer) = tokio::select! {
            () = stop.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors, most likely: wait rather than spin.
                    warn!(error = %e, "metrics endpoint: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let (metrics, stop) = (metrics.clone(), stop.clone());
        tokio::spawn(async move {
            let _place = place;
            let service = service_fn(move |request| {
                let response = respond(&request, &metrics);
                async move { Ok::<_, Infallible>(response) }
            });
            let connection = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                () = stop.cancelled() => {}
                ended = tokio::time::timeout(CONNECTION_LIFETIME, connection) => {
                    if let Ok(Err(e)) = ended {
                        debug!(%peer, error = %e, "metrics endpoint: a scraper's connection failed");
                    }
                }
            }
        });
    }
}

/// `GET /metrics` (or `HEAD`): the exposition; `/`: where it is; anything else: why not.
fn respond(request: &Request<Incoming>, metrics: &ReceiverMetrics) -> Response<Full<Bytes>> {
    let text = |status: StatusCode, body: String| {
        let mut response = Response::new(Full::new(Bytes::from(body)));
        *response.status_mut() = status;
        response
    };
    if request.method() != Method::GET && request.method() != Method::HEAD {
        let mut response = text(
            StatusCode::METHOD_NOT_ALLOWED,
            "only GET and HEAD are served\n".into(),
        );
        response
            .headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return response;
    }
    match request.uri().path() {
        "/metrics" => {
            let mut response = text(StatusCode::OK, metrics.encode());
            response
                .headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static(OPENMETRICS));
            response
        }
        "/" => text(
            StatusCode::OK,
            "tensorwire receiver: metrics at /metrics\n".into(),
        ),
        other => text(
            StatusCode::NOT_FOUND,
            format!("{other}: not here; metrics are at /metrics\n"),
        ),
    }
}
