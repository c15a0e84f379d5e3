//! EARLY (spec §6.9): the sender sends this tensor's bytes without waiting for ACCEPT, from
//! its early allowance (spec §7.6).
//!
//! `type = 0x05 | length = 0`

/// The tensor is sent early: its `byte_len` is taken from the connection's early allowance,
/// and DATA and END follow without waiting for ACCEPT. Only right after METADATA.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Early;

impl Early {
    pub(crate) const BODY_LEN: usize = 0;
}
