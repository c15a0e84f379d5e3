//! Receiver addresses as people write them: `IP:PORT`, or `HOST:PORT` through the system's
//! resolver.

use std::net::{SocketAddr, ToSocketAddrs};

use crate::error::TransportError;

/// The address `addr` names: an `IP:PORT` (`[v6]:PORT`) as is, or a `HOST:PORT` looked up
/// through the system's resolver, its first IPv4 address preferred (a receiver listening on
/// `127.0.0.1` is not reached through `::1`). Blocks while the resolver answers.
pub fn resolve(addr: &str) -> Result<SocketAddr, TransportError> {
    if let Ok(ip) = addr.parse::<SocketAddr>() {
        return Ok(ip);
    }
    let explain = |why: String| {
        TransportError::Config(format!(
            "address {addr:?}: {why} (expected HOST:PORT or IP:PORT, e.g. localhost:7000 or \
             10.0.0.2:7000)"
        ))
    };
    let found: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| explain(e.to_string()))?
        .collect();
    found
        .iter()
        .find(|a| a.is_ipv4())
        .or_else(|| found.first())
        .copied()
        .ok_or_else(|| explain("the name resolves to no address".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_and_names_resolve() {
        assert_eq!(
            resolve("127.0.0.1:7000").unwrap(),
            "127.0.0.1:7000".parse().unwrap()
        );
        assert_eq!(
            resolve("[::1]:7000").unwrap(),
            "[::1]:7000".parse().unwrap()
        );
        let local = resolve("localhost:7000").unwrap();
        assert_eq!(local.port(), 7000);
        assert!(local.ip().is_loopback(), "{local}");
    }

    #[test]
    fn a_bad_address_is_explained() {
        for bad in ["localhost", "7000", "no such host.invalid:7000", ""] {
            let err = resolve(bad).unwrap_err().to_string();
            assert!(err.contains("expected HOST:PORT"), "{bad}: {err}");
        }
    }
}
