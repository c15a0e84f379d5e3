//! Operator commands for a receiver's sharing socket: list, info, delete; and the local GPUs.
//!
//! `tensorwire-share --socket /run/tensorwire/share.sock list`

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use tensorwire::gpu::GpuStatus;
use tensorwire::ipc::{ShareClient, local_gpus};
use tensorwire_examples::cli::size;

/// Inspect and manage the tensors a receiver shares.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// The receiver's sharing socket (`receiver --share`).
    #[arg(long)]
    socket: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Every shared tensor.
    List,
    /// One tensor, by name or id.
    Info {
        /// Name or id.
        tensor: String,
    },
    /// Remove a tensor (deferred while consumers hold leases).
    Delete {
        /// Name or id.
        tensor: String,
    },
    /// The GPUs of this host: name, memory, compute capability, UUID.
    Devices,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let client = || -> anyhow::Result<ShareClient> {
        let socket = args
            .socket
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("--socket is required for this command"))?;
        Ok(ShareClient::connect(socket)?)
    };
    match &args.command {
        Command::List => {
            for t in client()?.list()? {
                let state = if t.deleting { " (deleting)" } else { "" };
                println!(
                    "{}  {:<32} {:>8} {:<16} {:>10}  {:<8}  leases {}{state}",
                    t.tensor.id,
                    t.tensor.name,
                    t.tensor.dtype,
                    format!("{:?}", t.tensor.shape),
                    size(t.tensor.byte_len),
                    t.tensor.export.name(),
                    t.leases
                );
            }
        }
        Command::Info { tensor } => println!(
            "{}",
            serde_json::to_string_pretty(&client()?.info(tensor)?)?
        ),
        Command::Delete { tensor } => {
            let deferred = client()?.delete(tensor)?;
            println!(
                "{}",
                if deferred {
                    "deleted once its leases end"
                } else {
                    "deleted"
                }
            );
        }
        Command::Devices => {
            // The producer's view when a socket is given (its ordinals), else this host's.
            let devices = match &args.socket {
                Some(_) => client()?.devices()?,
                None => local_gpus()?,
            };
            if devices.is_empty() {
                println!("no GPUs ({})", GpuStatus::detect());
            }
            for d in devices {
                println!(
                    "cuda:{}  {}  {} free of {}  compute {}.{}  {}",
                    d.ordinal,
                    d.name,
                    size(d.free_memory),
                    size(d.total_memory),
                    d.compute_capability[0],
                    d.compute_capability[1],
                    d.uuid
                );
            }
        }
    }
    Ok(())
}
