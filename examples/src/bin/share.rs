//! Operator commands for a receiver's sharing socket: list, info, watch, wait, delete; and
//! the local GPUs.
//!
//! `tensorwire-share --socket /run/tensorwire/share.sock list`
//! `tensorwire-share --socket /run/tensorwire/share.sock watch layers.`

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
    /// Print JSON lines instead of text: one object per tensor, event or GPU, as the
    /// sharing protocol's messages carry them (spec/ipc.md §2).
    #[arg(long, global = true)]
    json: bool,
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
    /// Print events (published, updated with the generation, deleted) for names starting
    /// with PREFIX, with how long after the tensor landed each was seen.
    Watch {
        /// Name prefix (empty: every tensor).
        #[arg(default_value = "")]
        prefix: String,
        /// Stop after this many events (0: never).
        #[arg(long, default_value_t = 0)]
        count: usize,
    },
    /// Wait until a tensor is shared (open it), then print it.
    Wait {
        /// Name.
        tensor: String,
        /// Seconds to wait.
        #[arg(long, default_value_t = 60.0)]
        timeout_s: f64,
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
        Command::List if args.json => {
            for t in client()?.list()? {
                println!("{}", serde_json::to_string(&t)?);
            }
        }
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
        Command::Info { tensor } => println!("{}", to_json(&client()?.info(tensor)?, args.json)?),
        Command::Watch { prefix, count } => {
            let watch = client()?.watch(prefix)?;
            for (seen, event) in watch.enumerate() {
                let event = event?;
                let t = &event.tensor.tensor;
                let now_us = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_micros() as u64);
                let seen_ms = now_us.saturating_sub(t.landed_unix_us) as f64 / 1e3;
                if args.json {
                    let mut line = serde_json::to_value(&event)?;
                    if let Some(fields) = line.as_object_mut() {
                        fields.insert("seen_ms".into(), seen_ms.into());
                    }
                    println!("{line}");
                } else {
                    println!(
                        "{:<9} {} generation {} {} {:?} {}: seen {:.3} ms after it landed",
                        format!("{:?}", event.event).to_lowercase(),
                        t.name,
                        t.generation,
                        t.dtype,
                        t.shape,
                        size(t.byte_len),
                        seen_ms
                    );
                }
                if *count > 0 && seen + 1 == *count {
                    break;
                }
            }
        }
        Command::Wait { tensor, timeout_s } => {
            let wait = std::time::Duration::from_secs_f64(timeout_s.max(0.0));
            let opened = client()?.open_wait(tensor, wait)?;
            println!("{}", to_json(opened.descriptor(), args.json)?);
        }
        Command::Delete { tensor } => {
            let deferred = client()?.delete(tensor)?;
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({"deleted": tensor, "deferred": deferred})
                );
                return Ok(());
            }
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
            if args.json {
                for d in &devices {
                    println!("{}", serde_json::to_string(d)?);
                }
                return Ok(());
            }
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

/// One line for `--json`, else indented for people.
fn to_json(value: &impl serde::Serialize, one_line: bool) -> serde_json::Result<String> {
    match one_line {
        true => serde_json::to_string(value),
        false => serde_json::to_string_pretty(value),
    }
}
