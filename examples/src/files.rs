//! Tensors to send, read from files: `.safetensors` (every tensor), `.npy`, `.wav`, raw.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use tensorwire::proto::{DType, TensorMeta};
use tensorwire::quic::Source;

/// Attribute naming the file a tensor came from, so a receiver can rebuild it.
pub const FILE_ATTR: &str = "tensorwire.file";
/// Attribute with the number of tensors that file holds.
pub const FILE_TENSORS_ATTR: &str = "tensorwire.file_tensors";
/// Attribute naming one run of the sender program: its tensors may arrive over several
/// connections, and a receiver that saves files groups them by it.
pub const SENDER_ATTR: &str = "tensorwire.sender";
/// Attribute with the file's `__metadata__` as JSON (safetensors only).
pub const FILE_METADATA_ATTR: &str = "safetensors.metadata";

/// One tensor ready to send.
pub struct Outgoing {
    /// Its metadata.
    pub meta: TensorMeta,
    /// Where its bytes are.
    pub source: Source,
}

/// Reads the tensors in `path`, by extension; `raw` gives dtype and shape for other files.
pub fn load(path: &Path, raw: Option<(DType, Vec<u64>)>) -> anyhow::Result<Vec<Outgoing>> {
    let extension = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    match (extension, raw) {
        (_, Some((dtype, shape))) => load_raw(path, dtype, shape),
        ("safetensors", None) => load_safetensors(path),
        ("npy", None) => load_npy(path),
        ("wav", None) => load_wav(path),
        (_, None) => bail!(
            "{}: not .safetensors, .npy or .wav; pass --dtype and --shape to send raw bytes",
            path.display()
        ),
    }
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn stem(path: &Path) -> String {
    path.file_stem()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn file_source(path: &Path, offset: u64) -> Source {
    Source::File {
        path: PathBuf::from(path),
        offset,
    }
}

fn load_raw(path: &Path, dtype: DType, shape: Vec<u64>) -> anyhow::Result<Vec<Outgoing>> {
    let meta = TensorMeta::new(shape, dtype)
        .with_context(|| path.display().to_string())?
        .with_name(stem(path));
    let info = std::fs::metadata(path).with_context(|| path.display().to_string())?;
    if !info.is_file() {
        bail!("{}: not a regular file", path.display());
    }
    let len = info.len();
    if len != meta.byte_len() {
        bail!(
            "{}: {len} bytes, but {:?} of {dtype} is {} bytes",
            path.display(),
            meta.shape(),
            meta.byte_len()
        );
    }
    Ok(vec![Outgoing {
        meta,
        source: file_source(path, 0),
    }])
}

/// Every tensor of a `.safetensors` file, names kept, read in place from the file.
///
/// Validated as the safetensors format requires, before anything is sent: each tensor's
/// `data_offsets` is two ordered integers matching its shape and dtype, and together the
/// tensors cover the data section exactly, in order, without overlap or gaps.
fn load_safetensors(path: &Path) -> anyhow::Result<Vec<Outgoing>> {
    use std::io::Read;
    let shown = path.display();
    let mut file = std::fs::File::open(path).with_context(|| shown.to_string())?;
    let file_len = file.metadata().with_context(|| shown.to_string())?.len();
    let mut len = [0u8; 8];
    file.read_exact(&mut len).with_context(|| {
        format!("{shown}: reading the 8-byte header length ({file_len} byte file)")
    })?;
    let header_len = u64::from_le_bytes(len);
    if header_len > 100 << 20 || header_len > file_len - 8 {
        bail!("{shown}: header length {header_len} is not plausible for a {file_len} byte file");
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header)
        .with_context(|| format!("{shown}: reading the {header_len} byte header"))?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&header).with_context(|| format!("{shown}: header JSON"))?;
    let data_start = 8 + header_len;
    let data_len = file_len - data_start;
    let metadata = header.get("__metadata__").map(|m| m.to_string());
    let count = header.keys().filter(|k| *k != "__metadata__").count();
    let mut out = Vec::new();
    let mut extents = Vec::new();
    for (name, info) in &header {
        if name == "__metadata__" {
            continue;
        }
        let at = || format!("{shown}: tensor {name:?}");
        let dtype_name = info["dtype"].as_str().unwrap_or("");
        let dtype = DType::from_name(dtype_name)
            .with_context(|| format!("{}: dtype {dtype_name:?} is not supported", at()))?;
        let shape: Vec<u64> = info["shape"]
            .as_array()
            .with_context(|| format!("{}: no shape array", at()))?
            .iter()
            .map(|d| {
                d.as_u64()
                    .with_context(|| format!("{}: dimension {d} is not an integer", at()))
            })
            .collect::<anyhow::Result<_>>()?;
        let (begin, end) = match info["data_offsets"].as_array().map(Vec::as_slice) {
            Some([begin, end]) => match (begin.as_u64(), end.as_u64()) {
                (Some(begin), Some(end)) => (begin, end),
                _ => bail!(
                    "{}: data_offsets {} are not two integers",
                    at(),
                    info["data_offsets"]
                ),
            },
            _ => bail!(
                "{}: data_offsets must be [begin, end], not {}",
                at(),
                info["data_offsets"]
            ),
        };
        let mut meta = TensorMeta::new(shape, dtype)
            .with_context(at)?
            .with_name(name.clone())
            .with_attribute(FILE_ATTR, file_name(path))
            .with_attribute(FILE_TENSORS_ATTR, count.to_string());
        if let Some(metadata) = &metadata {
            meta = meta.with_attribute(FILE_METADATA_ATTR, metadata.clone());
        }
        if begin > end || end > data_len || end - begin != meta.byte_len() {
            bail!(
                "{}: data_offsets [{begin}, {end}) do not hold its {} bytes within the {data_len} \
                 byte data section",
                at(),
                meta.byte_len()
            );
        }
        extents.push((begin, end, name.clone()));
        out.push(Outgoing {
            meta,
            source: file_source(path, data_start + begin),
        });
    }
    extents.sort();
    let mut covered = 0;
    for (begin, end, name) in &extents {
        if *begin != covered {
            let problem = if *begin < covered {
                "overlaps the tensor before it"
            } else {
                "leaves a gap before it"
            };
            bail!(
                "{shown}: tensor {name:?} at [{begin}, {end}) {problem} (expected to start at {covered})"
            );
        }
        covered = *end;
    }
    if covered != data_len {
        bail!("{shown}: the tensors cover {covered} of the {data_len} bytes after the header");
    }
    Ok(out)
}

/// A `.npy` array (little-endian, C order), read in place from the file.
fn load_npy(path: &Path) -> anyhow::Result<Vec<Outgoing>> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).with_context(|| path.display().to_string())?;
    let mut magic = [0u8; 8];
    file.read_exact(&mut magic)?;
    if &magic[..6] != b"\x93NUMPY" {
        bail!("{}: not a .npy file", path.display());
    }
    let header_len = if magic[6] == 1 {
        let mut n = [0u8; 2];
        file.read_exact(&mut n)?;
        u16::from_le_bytes(n) as usize
    } else {
        let mut n = [0u8; 4];
        file.read_exact(&mut n)?;
        u32::from_le_bytes(n) as usize
    };
    let data_start = 8 + if magic[6] == 1 { 2 } else { 4 } + header_len;
    let mut header = vec![0u8; header_len.min(1 << 20)];
    file.read_exact(&mut header)?;
    let header = String::from_utf8_lossy(&header);
    let field = |key: &str| -> anyhow::Result<String> {
        let at = header
            .find(&format!("'{key}':"))
            .with_context(|| format!("{}: no '{key}'", path.display()))?;
        Ok(header[at + key.len() + 3..].trim_start().to_owned())
    };
    let descr = field("descr")?;
    let descr = descr
        .trim_start_matches('\'')
        .split('\'')
        .next()
        .unwrap_or("");
    let dtype = NPY_DESCRS
        .iter()
        .find(|(_, d)| *d == descr)
        .map(|(dtype, _)| *dtype)
        .with_context(|| {
            format!(
                "{}: numpy dtype {descr} is not supported (little-endian numbers and bool only)",
                path.display()
            )
        })?;
    if field("fortran_order")?.starts_with("True") {
        bail!(
            "{}: Fortran-order arrays are not supported; save with np.ascontiguousarray",
            path.display()
        );
    }
    let shape_text = field("shape")?;
    let inside = shape_text
        .trim_start_matches('(')
        .split(')')
        .next()
        .unwrap_or("");
    let shape: Vec<u64> = inside
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.trim_end_matches('L').parse::<u64>().context("shape"))
        .collect::<anyhow::Result<_>>()?;
    let meta = TensorMeta::new(shape, dtype)?.with_name(stem(path));
    if data_start as u64 + meta.byte_len() > file.metadata()?.len() {
        bail!("{}: file shorter than its array", path.display());
    }
    Ok(vec![Outgoing {
        meta,
        source: file_source(path, data_start as u64),
    }])
}

/// A `.wav` file as F32 samples, shape [frames] (mono) or [frames, channels], with a
/// `sample_rate` attribute.
fn load_wav(path: &Path) -> anyhow::Result<Vec<Outgoing>> {
    let mut reader = hound::WavReader::open(path).with_context(|| path.display().to_string())?;
    let spec = reader.spec();
    let samples: Vec<f32> = match spec.sample_format {
        hound::SampleFormat::Float => reader.samples::<f32>().collect::<Result<_, _>>()?,
        hound::SampleFormat::Int => {
            let scale = 1.0 / (1u64 << (spec.bits_per_sample - 1)) as f32;
            reader
                .samples::<i32>()
                .map(|s| s.map(|s| s as f32 * scale))
                .collect::<Result<_, _>>()?
        }
    };
    let channels = u64::from(spec.channels);
    let frames = samples.len() as u64 / channels.max(1);
    let shape = if channels == 1 {
        vec![frames]
    } else {
        vec![frames, channels]
    };
    let meta = TensorMeta::new(shape, DType::F32)?
        .with_name(stem(path))
        .with_attribute("sample_rate", spec.sample_rate.to_string())
        .with_attribute("channels", channels.to_string());
    let bytes: Vec<u8> = samples.iter().flat_map(|s| s.to_le_bytes()).collect();
    Ok(vec![Outgoing {
        meta,
        source: Source::Bytes(bytes.into()),
    }])
}

/// Parses `--shape 2,3,4` (empty for a scalar).
pub fn parse_shape(text: &str) -> anyhow::Result<Vec<u64>> {
    text.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<u64>()
                .with_context(|| format!("shape dimension {s:?}"))
        })
        .collect()
}

/// A `.npy` array's metadata (named after the file) and bytes, read into memory.
pub fn read_npy(path: &Path) -> anyhow::Result<(TensorMeta, bytes::Bytes)> {
    use std::io::{Read, Seek, SeekFrom};
    let loaded = load_npy(path)?;
    let Some(Outgoing {
        meta,
        source: Source::File { offset, .. },
    }) = loaded.into_iter().next()
    else {
        bail!("{}: not one array", path.display());
    };
    let mut file = std::fs::File::open(path).with_context(|| path.display().to_string())?;
    file.seek(SeekFrom::Start(offset))?;
    let mut bytes = vec![0u8; usize::try_from(meta.byte_len())?];
    file.read_exact(&mut bytes)
        .with_context(|| format!("{}: reading the array", path.display()))?;
    Ok((meta, bytes.into()))
}

/// NumPy's `descr` of each dtype NumPy has (little-endian), for reading and writing `.npy`.
const NPY_DESCRS: [(DType, &str); 12] = [
    (DType::Bool, "|b1"),
    (DType::U8, "|u1"),
    (DType::I8, "|i1"),
    (DType::U16, "<u2"),
    (DType::I16, "<i2"),
    (DType::U32, "<u4"),
    (DType::I32, "<i4"),
    (DType::U64, "<u8"),
    (DType::I64, "<i8"),
    (DType::F16, "<f2"),
    (DType::F32, "<f4"),
    (DType::F64, "<f8"),
];

/// The numpy `descr` of `dtype`, if numpy has one.
pub fn npy_descr(dtype: DType) -> Option<&'static str> {
    NPY_DESCRS
        .iter()
        .find(|(d, _)| *d == dtype)
        .map(|(_, descr)| *descr)
}

/// Writes `bytes` as a version 1.0 `.npy` array of `dtype` and `shape` (C order). Types
/// numpy lacks (BF16, FP8) are written as raw bytes of their width (`|V2`, `|V1`).
pub fn write_npy(path: &Path, dtype: DType, shape: &[u64], bytes: &[u8]) -> anyhow::Result<()> {
    let descr = match npy_descr(dtype) {
        Some(descr) => descr.to_owned(),
        None => format!("|V{}", dtype.size()),
    };
    let dims = match shape {
        [one] => format!("({one},)"),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {dims}, }}");
    // Magic (6) + version (2) + length (2) + header + newline, padded to 64 bytes.
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + bytes.len());
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&u16::try_from(header.len())?.to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(bytes);
    std::fs::write(path, out).with_context(|| path.display().to_string())
}
