//! The remote-execution worker: started by a server (`receiver --allow-exec`) with a socket
//! as standard input, it runs one kernel at a time in its own CUDA context.
//!
//!     tensorwire-exec-worker --device N

use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let ordinal = match (
        args.next().as_deref(),
        args.next().map(|n| n.parse::<usize>()),
    ) {
        (Some("--device"), Some(Ok(n))) => n,
        _ => {
            eprintln!(
                "usage: tensorwire-exec-worker --device N (started by a server with its socket \
                 on standard input; not meant to be run by hand)"
            );
            return ExitCode::from(2);
        }
    };
    tensorwire::exec::serve_stdin(ordinal)
}
