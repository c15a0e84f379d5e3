//! The kinds of CUDA module a kernel can be loaded from.

use std::fmt;

/// What a CUDA module's bytes are, which decides how they are loaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ModuleFormat {
    /// PTX text, compiled for the server's GPU when loaded.
    Ptx,
    /// A cubin (ELF) for one GPU architecture.
    Cubin,
    /// A fatbin holding cubins and/or PTX for several architectures.
    Fatbin,
}

impl ModuleFormat {
    /// Guesses the format from a module's first bytes: ELF is a cubin, the fatbin magic a
    /// fatbin, anything else PTX.
    pub fn sniff(bytes: &[u8]) -> ModuleFormat {
        if bytes.starts_with(b"\x7fELF") {
            ModuleFormat::Cubin
        } else if bytes.starts_with(&[0x50, 0xed, 0x55, 0xba]) {
            ModuleFormat::Fatbin
        } else {
            ModuleFormat::Ptx
        }
    }
}

impl fmt::Display for ModuleFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ModuleFormat::Ptx => "PTX",
            ModuleFormat::Cubin => "cubin",
            ModuleFormat::Fatbin => "fatbin",
        })
    }
}
