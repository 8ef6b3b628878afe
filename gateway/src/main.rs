//! `ongrid-gateway --config FILE [--check-config]`: loads the config, sets up logging to stderr
//! (filter from `ONGRID_LOG`, default `info`), binds the listener, prints `listening on ADDR`
//! on stdout, and runs [`ongrid_gateway::run`] until SIGINT or SIGTERM. The start-up and
//! shutdown plumbing is [`ongrid_service::Binary`].

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use ongrid_gateway::Config;

/// The ongrid SSH gateway: lets users of allowed institutes reach their dev sessions with
/// their registered SSH keys.
#[derive(Debug, Parser)]
#[command(name = "ongrid-gateway", version)]
struct Args {
    /// The gateway's TOML config file.
    #[arg(long, value_name = "FILE")]
    config: PathBuf,
    /// Validate the config file and exit: 0 when valid, 2 (with the error) when not.
    #[arg(long)]
    check_config: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    ongrid_service::Binary::new("ongrid-gateway", &args.config, args.check_config)
        .check(|config: &Config| {
            ongrid_service::ca_roots::load_ca_dir(&config.ca_dir)?;
            Ok(())
        })
        .run(Config::load(&args.config), |config, shutdown| async move {
            let listener = ongrid_service::bind_and_announce(config.listen).await?;
            ongrid_gateway::run(config, listener, shutdown).await
        })
}
