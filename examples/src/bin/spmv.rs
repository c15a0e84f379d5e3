//! The remote-execution walkthrough's data: a random square CSR matrix A and a vector x as
//! `.npy` files, and a check of y = A·x against a CPU reference.
//!
//!     spmv gen --rows 1000000 --nnz 10000000 --out data/
//!     spmv check data/ out/y.npy
//!
//! `examples/spmv/spmv.cu` is the kernel; docs/remote-exec.md walks through running it remotely.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use tensorwire::proto::DType;
use tensorwire_examples::files::{read_npy, write_npy};

/// Make CSR SpMV inputs, or check a result.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Writes values.npy (F32), col_indices.npy (I32), row_ptr.npy (I32) and x.npy (F32).
    Gen {
        /// Rows (and columns) of A.
        #[arg(long, default_value_t = 1_000_000)]
        rows: u32,
        /// Non-zeros of A, spread over the rows.
        #[arg(long, default_value_t = 10_000_000)]
        nnz: u32,
        /// Seed of the generator.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Directory to write to.
        #[arg(long)]
        out: PathBuf,
    },
    /// Compares y (an F32 .npy) with A·x computed here from the files in DIR.
    Check {
        /// Where `gen` wrote A and x.
        dir: PathBuf,
        /// The result to check.
        y: PathBuf,
    },
}

fn main() -> anyhow::Result<()> {
    match Args::parse().command {
        Command::Gen {
            rows,
            nnz,
            seed,
            out,
        } => generate(rows, nnz, seed, &out),
        Command::Check { dir, y } => check(&dir, &y),
    }
}

/// xorshift64*: reproducible and fast; no statistical claims needed here.
struct Random(u64);

impl Random {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

fn generate(rows: u32, nnz: u32, seed: u64, out: &Path) -> anyhow::Result<()> {
    if rows == 0 || i32::try_from(nnz).is_err() || i32::try_from(rows).is_err() {
        bail!("--rows must be 1 to 2^31-1 and --nnz at most 2^31-1");
    }
    std::fs::create_dir_all(out).with_context(|| out.display().to_string())?;
    let mut random = Random(seed.max(1));
    // Each row gets nnz/rows entries, and the remainder goes to random rows.
    let base = nnz / rows;
    let mut per_row = vec![base; rows as usize];
    for _ in 0..(nnz - base * rows) {
        per_row[(random.next() % u64::from(rows)) as usize] += 1;
    }
    let mut row_ptr = Vec::with_capacity(rows as usize + 1);
    let mut cols = Vec::with_capacity(nnz as usize);
    let mut values = Vec::with_capacity(nnz as usize);
    row_ptr.push(0i32);
    for count in per_row {
        for _ in 0..count {
            cols.push((random.next() % u64::from(rows)) as i32);
            values.push(random.unit());
        }
        row_ptr.push(cols.len() as i32);
    }
    let x: Vec<f32> = (0..rows).map(|_| random.unit()).collect();
    write_npy(
        &out.join("values.npy"),
        DType::F32,
        &[u64::from(nnz)],
        &f32s(&values),
    )?;
    write_npy(
        &out.join("col_indices.npy"),
        DType::I32,
        &[u64::from(nnz)],
        &i32s(&cols),
    )?;
    write_npy(
        &out.join("row_ptr.npy"),
        DType::I32,
        &[u64::from(rows) + 1],
        &i32s(&row_ptr),
    )?;
    write_npy(
        &out.join("x.npy"),
        DType::F32,
        &[u64::from(rows)],
        &f32s(&x),
    )?;
    println!(
        "wrote A ({rows}×{rows}, {nnz} non-zeros, CSR) and x to {}",
        out.display()
    );
    Ok(())
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|f| f.to_le_bytes()).collect()
}

fn i32s(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|i| i.to_le_bytes()).collect()
}

fn load<T>(path: &Path, dtype: DType, from: fn([u8; 4]) -> T) -> anyhow::Result<Vec<T>> {
    let (meta, bytes) = read_npy(path)?;
    if meta.dtype() != dtype {
        bail!(
            "{}: {} where {dtype} was expected",
            path.display(),
            meta.dtype()
        );
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| from([c[0], c[1], c[2], c[3]]))
        .collect())
}

fn check(dir: &Path, y: &Path) -> anyhow::Result<()> {
    let values = load(&dir.join("values.npy"), DType::F32, f32::from_le_bytes)?;
    let cols = load(&dir.join("col_indices.npy"), DType::I32, i32::from_le_bytes)?;
    let row_ptr = load(&dir.join("row_ptr.npy"), DType::I32, i32::from_le_bytes)?;
    let x = load(&dir.join("x.npy"), DType::F32, f32::from_le_bytes)?;
    let y = load(y, DType::F32, f32::from_le_bytes)?;
    let rows = row_ptr.len().saturating_sub(1);
    if y.len() != rows {
        bail!("y has {} entries; A has {rows} rows", y.len());
    }
    let mut worst = 0.0f64;
    for row in 0..rows {
        let (start, end) = (row_ptr[row] as usize, row_ptr[row + 1] as usize);
        let (mut sum, mut magnitude) = (0.0f64, 0.0f64);
        for j in start..end {
            let term = f64::from(values[j]) * f64::from(x[cols[j] as usize]);
            sum += term;
            magnitude += term.abs();
        }
        let error = (f64::from(y[row]) - sum).abs();
        // F32 accumulation in the kernel: error grows with the terms' magnitude.
        if error > 1e-5 * magnitude + 1e-6 {
            bail!("y[{row}] = {}, the CPU reference says {sum}", y[row]);
        }
        worst = worst.max(error);
    }
    println!("y matches the CPU reference on all {rows} rows (largest difference {worst:.2e})");
    Ok(())
}
