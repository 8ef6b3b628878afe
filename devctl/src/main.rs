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
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
