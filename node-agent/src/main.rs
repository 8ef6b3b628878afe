//! `ongrid-agent --config FILE [--check-config]`: loads the config, sets up logging to stderr
//! (filter from `ONGRID_LOG`, default `info`), and runs [`ongrid_agent::run`] until SIGINT or
//! SIGTERM. Dev containers keep running when the agent stops. `ongrid-agent exec-helper ...` is
//! the agent's own helper of processes it starts with runc (`runtime::direct`). The start-up and shutdown
//! plumbing is [`ongrid_service::Binary`].
//!
//! `ongrid-agent gpus`, `ongrid-agent mig` and `ongrid-agent gpu-container` run the agent's GPU
//! code once and exit ([`ongrid_agent::gpu_check`], for `scripts/gpu-check.sh`).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use ongrid_agent::gpu_check;
use ongrid_agent::Config;

/// The ongrid node agent: reports this node's GPUs and dev containers to the manager and runs
/// the dev containers the manager wants here.
#[derive(Debug, Parser)]
#[command(
    name = "ongrid-agent",
    version,
    subcommand_negates_reqs = true,
    args_conflicts_with_subcommands = true
)]
struct Args {
    /// The agent's TOML config file.
    #[arg(long, value_name = "FILE", required = true)]
    config: Option<PathBuf>,
    /// Validate the config file and exit: 0 when valid, 2 (with the error) when not.
    #[arg(long)]
    check_config: bool,
    #[command(subcommand)]
    command: Option<gpu_check::Command>,
}

fn main() -> ExitCode {
    let mut args = std::env::args();
    if args.nth(1).as_deref() == Some(ongrid_agent::runtime::direct::HELPER_ARG) {
        // The parent of one process started with runc (the agent runs it, never a person).
        return ongrid_agent::runtime::direct::helper_main(args);
    }
    let args = Args::parse();
    if let Some(command) = args.command {
        return command.run();
    }
    let Some(config) = args.config else {
        // clap requires --config without a subcommand.
        return ExitCode::from(2);
    };
    ongrid_service::Binary::new("ongrid-agent", &config, args.check_config)
        // The GPU backend checks what it can without discovering: the file, the binary.
        .check(|config: &Config| {
            ongrid_agent::gpu::from_config(&config.gpu)?;
            Ok(())
        })
        .run(Config::load(&config), ongrid_agent::run)
}
