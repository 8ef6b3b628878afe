//! The `devctl` binary: parses the arguments and hands over to [`devctl::run`].

use std::process::ExitCode;

use clap::Parser;
use devctl::cli::Cli;
use devctl::config::{Defaults, Env};
use devctl::terminal::Terminal;

fn main() -> ExitCode {
    // Usage errors exit here with code 2, `--help` and `--version` with 0.
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: cannot start the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    let mut stdout = std::io::stdout();
    let mut stderr = std::io::stderr();
    let mut term = Terminal::process(&mut stdout, &mut stderr);
    let result = runtime.block_on(devctl::run(
        cli,
        &Env::from_process(),
        &Defaults::grid(),
        &mut term,
    ));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // The reader of stdout went away (`devctl completions bash | head`): stop quietly, as
        // tools killed by SIGPIPE do, with the shell's code for it.
        Err(err) if is_broken_pipe(&err) => ExitCode::from(141),
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn is_broken_pipe(err: &anyhow::Error) -> bool {
    err.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}
