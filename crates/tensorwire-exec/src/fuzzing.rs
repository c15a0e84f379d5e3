//! Entry points for the fuzz targets (`fuzz/`), also run over the spec's vectors by the
//! tests. Not a stable API: built only with the `test-util` feature.

use crate::message::{ExecLimits, ExecReply, ExecRequest};

/// Decodes `data` as a remote-execution request and as a reply (spec §14) under the default
/// limits; whatever decodes must re-encode to exactly the bytes it came from.
pub fn exec_round_trip(data: &[u8]) {
    let limits = ExecLimits::default();
    if let Ok(request) = ExecRequest::decode(data, &limits) {
        assert_eq!(
            request.encode(),
            data,
            "a decoded request re-encodes differently"
        );
    }
    if let Ok(reply) = ExecReply::decode(data, limits.max_request_len) {
        assert_eq!(
            reply.encode(),
            data,
            "a decoded reply re-encodes differently"
        );
    }
}
