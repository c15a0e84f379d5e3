//! Access tokens for remote execution (spec §14.6): a shared secret that a client presents
//! on each of its remote-execution tensors, for a server that admits peers by token rather
//! than by client certificate.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use subtle::ConstantTimeEq;

use crate::error::ExecError;

/// A remote-execution access token: 16 to 256 printable ASCII characters, no spaces. Its
/// `Debug` output is redacted; it travels only inside TLS, in the
/// [`TOKEN_ATTRIBUTE`](crate::message::TOKEN_ATTRIBUTE) of each remote-execution tensor.
#[derive(Clone)]
pub struct ExecToken(Arc<str>);

impl std::fmt::Debug for ExecToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ExecToken(<redacted>)")
    }
}

impl ExecToken {
    /// The shortest token accepted: 16 characters (from a good generator, 96 bits or more).
    pub const MIN_LEN: usize = 16;
    /// The longest token accepted.
    pub const MAX_LEN: usize = 256;

    /// `secret` as a token, if it is 16 to 256 printable ASCII characters with no spaces.
    pub fn new(secret: impl Into<String>) -> Result<Self, ExecError> {
        let secret = secret.into();
        let printable = secret.bytes().all(|b| b.is_ascii_graphic());
        if !(Self::MIN_LEN..=Self::MAX_LEN).contains(&secret.len()) || !printable {
            return Err(ExecError::Config(format!(
                "an access token is {} to {} printable ASCII characters without spaces (this \
                 one has {}{}); make one with `openssl rand -hex 32`",
                Self::MIN_LEN,
                Self::MAX_LEN,
                secret.len(),
                if printable {
                    ""
                } else {
                    ", some not printable"
                }
            )));
        }
        Ok(Self(secret.into()))
    }

    /// The token in the file at `path` (surrounding whitespace ignored). The file must be
    /// readable by its owner only (mode 0600 or 0400), as an SSH key must: a token others
    /// can read is no secret.
    pub fn from_file(path: &Path) -> Result<Self, ExecError> {
        let file_error = |error| ExecError::File {
            path: path.to_owned(),
            error,
        };
        let mode = std::fs::metadata(path)
            .map_err(file_error)?
            .permissions()
            .mode();
        if mode & 0o077 != 0 {
            return Err(ExecError::Config(format!(
                "{}: an access token file must be readable by its owner only (mode {:o}; \
                 chmod 600 it)",
                path.display(),
                mode & 0o777
            )));
        }
        let text = std::fs::read_to_string(path).map_err(file_error)?;
        Self::new(text.trim()).map_err(|e| match e {
            ExecError::Config(why) => ExecError::Config(format!("{}: {why}", path.display())),
            other => other,
        })
    }

    /// Whether `presented` is this token, compared in constant time (the length aside).
    pub(crate) fn admits(&self, presented: Option<&str>) -> bool {
        presented.is_some_and(|p| bool::from(p.as_bytes().ct_eq(self.0.as_bytes())))
    }

    /// The secret, for the attribute a client sends.
    pub(crate) fn secret(&self) -> &str {
        &self.0
    }
}

/// Tokens compare in constant time, as a server compares them.
impl PartialEq for ExecToken {
    fn eq(&self, other: &Self) -> bool {
        self.admits(Some(&other.0))
    }
}

impl Eq for ExecToken {}
