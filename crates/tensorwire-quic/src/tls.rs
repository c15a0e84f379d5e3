//! TLS 1.3 configurations: one crypto provider (ring), AES-128-GCM first, the version's ALPN
//! offers (spec §3.1), 0-RTT off, development and PEM certificates, optional mutual TLS.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use tensorwire_proto::Version;

use crate::error::TransportError;

/// How a receiver proves who it is, and whom it lets in.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum ServerTls {
    /// Development trust: a fresh self-signed certificate for `localhost`, whose PEM is
    /// written to [`dev_cert_path`](crate::dev_cert_path) so that senders on the same host find it.
    Development,
    /// Production: PEM certificate chain and private key files.
    Pem {
        /// Certificate chain, leaf first.
        cert: PathBuf,
        /// Private key (PKCS#8, PKCS#1 or SEC1).
        key: PathBuf,
        /// If set, clients must present a certificate issued by one of these CAs (mTLS).
        client_ca: Option<PathBuf>,
    },
}

/// How a sender checks the receiver, and proves who it is.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum ClientTls {
    /// Development trust: trust the certificate a development receiver on this host left at
    /// [`dev_cert_path`](crate::dev_cert_path) for the address being connected to (or for every address, with
    /// that port).
    Development,
    /// Production: trust receivers whose certificate chains to one of these CAs.
    Pem {
        /// CA certificates (PEM).
        ca: PathBuf,
        /// Client certificate and key (PEM), for receivers that require mTLS.
        identity: Option<(PathBuf, PathBuf)>,
    },
}

/// The one crypto provider: ring, TLS 1.3 suites only, AES-128-GCM preferred (fastest with
/// AES-NI, and the suite QUIC's initial packets use anyway).
pub fn crypto_provider() -> Arc<CryptoProvider> {
    use rustls::crypto::ring::{cipher_suite, default_provider};
    Arc::new(CryptoProvider {
        cipher_suites: vec![
            cipher_suite::TLS13_AES_128_GCM_SHA256,
            cipher_suite::TLS13_AES_256_GCM_SHA384,
            cipher_suite::TLS13_CHACHA20_POLY1305_SHA256,
        ],
        ..default_provider()
    })
}

fn tls_error(what: &str) -> impl FnOnce(rustls::Error) -> TransportError + '_ {
    move |e| TransportError::Tls(format!("{what}: {e}"))
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TransportError> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| {
            TransportError::Tls(format!("reading certificates from {}: {e}", path.display()))
        })?;
    if certs.is_empty() {
        return Err(TransportError::Tls(format!(
            "no PEM certificate in {}",
            path.display()
        )));
    }
    Ok(certs)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TransportError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| {
        TransportError::Tls(format!("reading private key from {}: {e}", path.display()))
    })
}

fn roots(
    certs: Vec<CertificateDer<'static>>,
) -> Result<Arc<rustls::RootCertStore>, TransportError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in certs {
        roots
            .add(cert)
            .map_err(tls_error("adding a trusted certificate"))?;
    }
    Ok(Arc::new(roots))
}

/// A self-signed development certificate for `localhost`, 127.0.0.1 and ::1.
pub struct DevCertificate {
    /// The certificate.
    pub cert: CertificateDer<'static>,
    /// Its PEM text.
    pub pem: String,
    key: PrivateKeyDer<'static>,
    key_pem: String,
}

impl DevCertificate {
    /// Generates a fresh key and certificate.
    pub fn generate() -> Result<Self, TransportError> {
        let names = vec![
            "localhost".to_owned(),
            "127.0.0.1".to_owned(),
            "::1".to_owned(),
        ];
        let certified = rcgen::generate_simple_self_signed(names).map_err(|e| {
            TransportError::Tls(format!("generating a development certificate: {e}"))
        })?;
        let key = PrivateKeyDer::try_from(certified.signing_key.serialize_der())
            .map_err(|e| TransportError::Tls(format!("development key: {e}")))?;
        Ok(Self {
            pem: certified.cert.pem(),
            cert: certified.cert.der().clone(),
            key,
            key_pem: certified.signing_key.serialize_pem(),
        })
    }

    /// The private key as PEM (PKCS#8), for writing a development key file.
    pub fn key_pem(&self) -> &str {
        &self.key_pem
    }

    /// The private key as PKCS#8 DER.
    pub fn key_der(&self) -> Vec<u8> {
        self.key.secret_der().to_vec()
    }

    /// SHA-256 of the certificate, as colon-separated hex, for pinning by eye.
    pub fn fingerprint(&self) -> String {
        fingerprint(&self.cert)
    }
}

/// SHA-256 of a DER certificate as colon-separated hex.
pub fn fingerprint(cert: &CertificateDer<'_>) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, cert);
    digest
        .as_ref()
        .iter()
        .map(|b| format!("{b:02X}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// The QUIC server crypto for `tls`; returns the development certificate if it made one.
pub fn server_crypto(
    tls: &ServerTls,
) -> Result<(Arc<QuicServerConfig>, Option<DevCertificate>), TransportError> {
    let builder = rustls::ServerConfig::builder_with_provider(crypto_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_error("TLS 1.3 with the ring provider"))?;
    let (mut config, dev) = match tls {
        ServerTls::Development => {
            let dev = DevCertificate::generate()?;
            let config = builder
                .with_no_client_auth()
                .with_single_cert(vec![dev.cert.clone()], dev.key.clone_key())
                .map_err(tls_error("development certificate"))?;
            (config, Some(dev))
        }
        ServerTls::Pem {
            cert,
            key,
            client_ca,
        } => {
            let builder = match client_ca {
                None => builder.with_no_client_auth(),
                Some(ca) => {
                    // The handshake completes only after the client's chain is verified, and
                    // no stream is served before the handshake completes.
                    let verifier = WebPkiClientVerifier::builder_with_provider(
                        roots(read_certs(ca)?)?,
                        crypto_provider(),
                    )
                    .build()
                    .map_err(|e| TransportError::Tls(format!("client CA {}: {e}", ca.display())))?;
                    builder.with_client_cert_verifier(verifier)
                }
            };
            let config = builder
                .with_single_cert(read_certs(cert)?, read_key(key)?)
                .map_err(tls_error("server certificate and key"))?;
            (config, None)
        }
    };
    config.alpn_protocols = Version::CURRENT.alpn_offers();
    config.max_early_data_size = 0; // 0-RTT off: replayed frames would be acted on twice.
    let quic = QuicServerConfig::try_from(config)
        .map_err(|e| TransportError::Tls(format!("QUIC server crypto: {e}")))?;
    Ok((Arc::new(quic), dev))
}

/// The QUIC client crypto for `tls`, connecting to `addr` (for development trust).
pub fn client_crypto(
    tls: &ClientTls,
    addr: SocketAddr,
) -> Result<Arc<QuicClientConfig>, TransportError> {
    let builder = rustls::ClientConfig::builder_with_provider(crypto_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_error("TLS 1.3 with the ring provider"))?;
    let mut config = match tls {
        ClientTls::Development => {
            let (pem, path) = crate::dev_trust::read_dev_cert(addr)?;
            let certs = CertificateDer::pem_slice_iter(&pem)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| TransportError::Tls(format!("{}: {e}", path.display())))?;
            if certs.is_empty() {
                return Err(TransportError::Tls(format!(
                    "no PEM certificate in {}",
                    path.display()
                )));
            }
            tracing::warn!(
                path = %path.display(),
                fingerprint = %fingerprint(&certs[0]),
                "development trust: trusting the self-signed certificate a local receiver left; \
                 use a CA file in production"
            );
            builder
                .with_root_certificates(roots(certs)?)
                .with_no_client_auth()
        }
        ClientTls::Pem { ca, identity } => {
            let builder = builder.with_root_certificates(roots(read_certs(ca)?)?);
            match identity {
                None => builder.with_no_client_auth(),
                Some((cert, key)) => builder
                    .with_client_auth_cert(read_certs(cert)?, read_key(key)?)
                    .map_err(tls_error("client certificate and key"))?,
            }
        }
    };
    config.alpn_protocols = Version::CURRENT.alpn_offers();
    config.enable_early_data = false;
    let quic = QuicClientConfig::try_from(config)
        .map_err(|e| TransportError::Tls(format!("QUIC client crypto: {e}")))?;
    Ok(Arc::new(quic))
}

/// The protocol version `connection` negotiated through ALPN (spec §3.1); `None` if its
/// peer selected no tensorwire identifier.
pub fn negotiated_version(connection: &quinn::Connection) -> Option<Version> {
    connection
        .handshake_data()
        .and_then(|data| data.downcast::<quinn::crypto::rustls::HandshakeData>().ok())
        .and_then(|data| data.protocol)
        .and_then(|id| Version::from_alpn(&id))
}
