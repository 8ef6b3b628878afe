//! `ongrid-manager --config FILE [--check-config]`: loads the config, opens the database, binds,
//! prints `listening on ADDR` on stdout, and serves until SIGINT or SIGTERM. Everything else is
//! in the library; the start-up and shutdown plumbing (error format, exit codes, logging to
//! stderr with `ONGRID_LOG`, signals) is [`ongrid_service::Binary`], as for the gateway and the
//! agent.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use ongrid_manager::{Config, Manager};

/// The ongrid control plane: HTTPS API, store (SQLite or PostgreSQL) and scheduler.
#[derive(Debug, Parser)]
#[command(name = "ongrid-manager", version)]
struct Args {
    /// The manager's TOML config file.
    #[arg(long, value_name = "FILE")]
    config: PathBuf,
    /// Validate the config and the files it names (certificates, CA directory, agent tokens),
    /// then exit: 0 when valid, 2 (with the error) otherwise.
    #[arg(long)]
    check_config: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    ongrid_service::Binary::new("ongrid-manager", &args.config, args.check_config)
        // Everything the config names, without touching the database.
        .check(|config: &Config| {
            ongrid_manager::prepare(config.clone())?;
            Ok(())
        })
        .run(Config::load(&args.config), |config, shutdown| async move {
            let listen = config.listen;
            let mut manager = Manager::open(config).await?;
            // A standby (another manager is active on the PostgreSQL database) binds nothing.
            tokio::select! {
                active = manager.wait_until_active() => active?,
                () = shutdown.cancelled() => return Ok(()),
            }
            let listener = ongrid_service::bind_and_announce(listen).await?;
            manager.serve(listener, shutdown).await
        })
}
