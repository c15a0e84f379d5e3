//! Runs a CUDA kernel on a remote GPU: sends the module (PTX, cubin or fatbin) and the inputs
//! to `receiver --allow-exec`, and saves the outputs it sends back (spec §14).
//!
//! ```sh
//! tensorwire-exec --connect 127.0.0.1:7000 info
//! tensorwire-exec --connect 127.0.0.1:7000 run spmv.ptx --function spmv_csr \
//!     --grid 3907 --block 256 --in values=values.npy --in col_indices=col_indices.npy \
//!     --in row_ptr=row_ptr.npy --in x=x.npy --out y=f32:1000000 --scalar rows=i32:1000000 \
//!     --save out/
//! ```
//!
//! Arguments reach the kernel in the order given, whatever their kind.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, Subcommand};
use tensorwire::exec::{ExecClient, ExecError, ExecReply, ExecToken, Module, Run, RunOutput};
use tensorwire::proto::{Blame, DType};
use tensorwire::quic::{BindingChoice, SenderConfig};
use tensorwire_examples::cli::{ClientTlsArgs, TransportArgs, init_logging, size};
use tensorwire_examples::files::{parse_shape, read_npy, write_npy};

/// Run CUDA kernels on a remote GPU over tensorwire.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// The receiver (started with --allow-exec).
    #[arg(long, default_value = "127.0.0.1:7000", value_parser = tensorwire_examples::cli::address)]
    connect: SocketAddr,
    /// How to reach the receiver: quic (over UDP), tcp (QUIC over TCP), or auto (UDP, and
    /// TCP too if UDP completes no handshake within a second).
    #[arg(long = "transport", default_value = "auto")]
    binding: BindingChoice,
    #[command(flatten)]
    tls: ClientTlsArgs,
    #[command(flatten)]
    transport: TransportArgs,
    /// The access token of a receiver started with --exec-token-file, read from this file
    /// (readable by its owner only). Sent only to a receiver whose certificate is verified.
    #[arg(long)]
    token_file: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// The server's GPU: name, UUID, compute capability, memory, multiprocessors, driver.
    Info,
    /// Whether the server can run kernels now: workers, cached modules.
    Health,
    /// Run a kernel.
    Run(Box<RunArgs>),
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    /// The module: PTX (.ptx), a cubin or a fatbin, told apart by content.
    module: PathBuf,
    /// The kernel's name (extern "C", or the mangled C++ name).
    #[arg(long)]
    function: String,
    /// Blocks: X, X,Y or X,Y,Z.
    #[arg(long, default_value = "1")]
    grid: String,
    /// Threads per block: X, X,Y or X,Y,Z.
    #[arg(long, default_value = "1")]
    block: String,
    /// Dynamic shared memory per block, in bytes.
    #[arg(long, default_value_t = 0)]
    shared_mem: u32,
    /// Longest the kernel may run, in ms (0: the server's default).
    #[arg(long, default_value_t = 0)]
    time_limit_ms: u64,
    /// An input: NAME=FILE.npy, passed as a device pointer.
    #[arg(long = "in", value_name = "NAME=FILE.npy")]
    inputs: Vec<String>,
    /// An output: NAME=DTYPE:SHAPE (e.g. y=f32:1000000 or c=f16:64,64), allocated zeroed
    /// by the server and passed as a device pointer.
    #[arg(long = "out", value_name = "NAME=DTYPE:SHAPE")]
    outputs: Vec<String>,
    /// A scalar: NAME=DTYPE:VALUE (e.g. n=i32:1000), passed by value.
    #[arg(long = "scalar", value_name = "NAME=DTYPE:VALUE")]
    scalars: Vec<String>,
    /// Save each output as DIR/NAME.npy.
    #[arg(long)]
    save: Option<PathBuf>,
    /// Run it this many times on one connection (the module is sent at most once).
    #[arg(long, default_value_t = 1)]
    repeat: u32,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    init_logging("error");
    let matches = Args::command().get_matches();
    let outcome = match Args::from_arg_matches(&matches) {
        Ok(args) => run(args, &matches).await,
        Err(e) => e.exit(),
    };
    match outcome {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tensorwire-exec: {}", explain(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

/// The error with its wire code and who is to blame, as the server sees it.
fn explain(error: &anyhow::Error) -> String {
    let Some(exec) = error.downcast_ref::<ExecError>() else {
        return format!("{error:#}");
    };
    let blame = match exec.blame() {
        Some(Blame::MalformedBytes | Blame::PeerBrokeRule) => {
            " (the request or the kernel is at fault)"
        }
        Some(Blame::LocalResource) => " (the server ran out of something or failed)",
        Some(Blame::Application) => " (the server's policy)",
        _ => "",
    };
    format!("{error:#}{blame}")
}

async fn run(args: Args, matches: &ArgMatches) -> anyhow::Result<()> {
    let mut config = SenderConfig::new(args.tls.tls());
    config.server_name = args.tls.server_name.clone();
    config.transport = args.transport.settings(args.connect);
    config.binding = args.binding;
    let token = args
        .token_file
        .as_deref()
        .map(ExecToken::from_file)
        .transpose()?;
    let mut client = ExecClient::connect(args.connect, config)
        .await
        .with_context(|| format!("connecting to {}", args.connect))?;
    if let Some(token) = token {
        client = client.with_token(token);
    }
    match &args.command {
        Command::Info => print_reply(&client.info().await?),
        Command::Health => print_reply(&client.health().await?),
        Command::Run(run_args) => {
            let run_matches = matches
                .subcommand_matches("run")
                .context("no run arguments")?;
            let run = build(run_args, run_matches)?;
            for i in 1..=run_args.repeat {
                let output = client.run(&run).await?;
                report(i, &output);
                if i == run_args.repeat
                    && let Some(dir) = &run_args.save
                {
                    save(dir, &output)?;
                }
            }
        }
    }
    client.close().await;
    Ok(())
}

fn print_reply(reply: &ExecReply) {
    for (key, value) in &reply.attributes {
        println!("{key}: {value}");
    }
}

/// The run, its arguments in command-line order across --in, --out and --scalar.
fn build(args: &RunArgs, matches: &ArgMatches) -> anyhow::Result<Run> {
    let module = Module::from_file(&args.module)?;
    let mut run = Run::new(Arc::new(module), args.function.clone())
        .grid(dims(&args.grid, "--grid")?)
        .block(dims(&args.block, "--block")?)
        .shared_mem_bytes(args.shared_mem);
    if args.time_limit_ms > 0 {
        run = run.time_limit(Duration::from_millis(args.time_limit_ms));
    }
    let mut ordered: Vec<(usize, Kind<'_>)> = Vec::new();
    for (id, values, kind) in [
        ("inputs", &args.inputs, 0),
        ("outputs", &args.outputs, 1),
        ("scalars", &args.scalars, 2),
    ] {
        let indices: Vec<usize> = matches
            .indices_of(id)
            .map(Iterator::collect)
            .unwrap_or_default();
        for (index, value) in indices.into_iter().zip(values) {
            ordered.push((
                index,
                match kind {
                    0 => Kind::Input(value),
                    1 => Kind::Output(value),
                    _ => Kind::Scalar(value),
                },
            ));
        }
    }
    ordered.sort_by_key(|(index, _)| *index);
    for (_, kind) in ordered {
        run = match kind {
            Kind::Input(spec) => {
                let (name, file) = split(spec, "--in")?;
                let (meta, bytes) = read_npy(Path::new(file))?;
                run.input(meta.with_name(name), bytes)?
            }
            Kind::Output(spec) => {
                let (name, rest) = split(spec, "--out")?;
                let (dtype, shape) = rest
                    .split_once(':')
                    .with_context(|| format!("--out {spec}: expected NAME=DTYPE:SHAPE"))?;
                run.output(name, dtype_of(dtype)?, parse_shape(shape)?)
            }
            Kind::Scalar(spec) => {
                let (name, rest) = split(spec, "--scalar")?;
                let (dtype, value) = rest
                    .split_once(':')
                    .with_context(|| format!("--scalar {spec}: expected NAME=DTYPE:VALUE"))?;
                let dtype = dtype_of(dtype)?;
                run.scalar(name, dtype, scalar_bytes(dtype, value)?)
            }
        };
    }
    Ok(run)
}

enum Kind<'a> {
    Input(&'a str),
    Output(&'a str),
    Scalar(&'a str),
}

fn split<'a>(spec: &'a str, flag: &str) -> anyhow::Result<(&'a str, &'a str)> {
    spec.split_once('=')
        .filter(|(name, _)| !name.is_empty())
        .with_context(|| format!("{flag} {spec}: expected NAME=..."))
}

fn dims(text: &str, flag: &str) -> anyhow::Result<[u32; 3]> {
    let parts: Vec<u32> = text
        .split(',')
        .map(|p| p.trim().parse::<u32>())
        .collect::<Result<_, _>>()
        .with_context(|| format!("{flag} {text}: expected X[,Y[,Z]]"))?;
    match parts.as_slice() {
        [x] => Ok([*x, 1, 1]),
        [x, y] => Ok([*x, *y, 1]),
        [x, y, z] => Ok([*x, *y, *z]),
        _ => bail!("{flag} {text}: expected X[,Y[,Z]]"),
    }
}

fn dtype_of(text: &str) -> anyhow::Result<DType> {
    DType::from_name_any_case(text)
        .with_context(|| format!("dtype {text:?}: expected one of f32, f64, i32, u8, bf16, ..."))
}

fn scalar_bytes(dtype: DType, value: &str) -> anyhow::Result<Vec<u8>> {
    let bad = || format!("scalar {value:?} is not a {dtype}");
    Ok(match dtype {
        DType::Bool => vec![u8::from(value.parse::<bool>().with_context(bad)?)],
        DType::U8 => value
            .parse::<u8>()
            .with_context(bad)?
            .to_le_bytes()
            .to_vec(),
        DType::I8 => value
            .parse::<i8>()
            .with_context(bad)?
            .to_le_bytes()
            .to_vec(),
        DType::U16 => value
            .parse::<u16>()
            .with_context(bad)?
            .to_le_bytes()
            .to_vec(),
        DType::I16 => value
            .parse::<i16>()
            .with_context(bad)?
            .to_le_bytes()
            .to_vec(),
        DType::U32 => value
            .parse::<u32>()
            .with_context(bad)?
            .to_le_bytes()
            .to_vec(),
        DType::I32 => value
            .parse::<i32>()
            .with_context(bad)?
            .to_le_bytes()
            .to_vec(),
        DType::U64 => value
            .parse::<u64>()
            .with_context(bad)?
            .to_le_bytes()
            .to_vec(),
        DType::I64 => value
            .parse::<i64>()
            .with_context(bad)?
            .to_le_bytes()
            .to_vec(),
        DType::F32 => value
            .parse::<f32>()
            .with_context(bad)?
            .to_le_bytes()
            .to_vec(),
        DType::F64 => value
            .parse::<f64>()
            .with_context(bad)?
            .to_le_bytes()
            .to_vec(),
        other => bail!("scalars of {other} are not parsed here; use f32, f64 or an integer type"),
    })
}

fn report(i: u32, output: &RunOutput) {
    let ms = |ns: u64| ns as f64 / 1e6;
    let t = &output.timings;
    println!(
        "run {i}: kernel {:.3} ms | landing {:.3} ms, egress {:.3} ms, total {:.3} ms (server) | \
         round trip {:.3} ms | {} moved | module {}",
        ms(t.kernel_ns),
        ms(t.landing_ns),
        ms(t.egress_ns),
        ms(t.total_ns),
        output.round_trip.as_secs_f64() * 1e3,
        size(output.bytes_moved),
        if output.module_sent {
            "sent"
        } else {
            "cached by the server"
        }
    );
}

fn save(dir: &Path, output: &RunOutput) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
    for (meta, bytes) in &output.outputs {
        let path = dir.join(format!("{}.npy", meta.name()));
        write_npy(&path, meta.dtype(), meta.shape(), bytes)?;
        println!("saved {}", path.display());
    }
    Ok(())
}
