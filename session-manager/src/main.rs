//! `ongrid-manager --config FILE [--check-config]`: loads the config, binds, prints
//! `listening on ADDR`, and serves until SIGINT or SIGTERM. Everything else is in the library.
//! Unlike the gateway and the agent it does not use [`ongrid_service::Binary`]: its messages
//! differ (`error: ...`, `<file>: configuration is valid`, `Shutting down.`) and it logs before
//! the config is loaded; folding it in would change them.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use ongrid_manager::{Config, Manager};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// The ongrid control plane: HTTPS API, SQLite store and scheduler.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// The manager's TOML config file.
    #[arg(long, value_name = "FILE")]
    config: PathBuf,
    /// Validate the config and the files it names (certificates, CA directory, agent tokens),
    /// then exit: 0 when valid, 2 otherwise.
    #[arg(long)]
    check_config: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    ongrid_service::init_tracing();
    let config = match Config::load(&args.config) {
        Ok(config) => config,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::from(2);
        }
    };
    if args.check_config {
        return match ongrid_manager::prepare(config) {
            Ok(_) => {
                println!("{}: configuration is valid", args.config.display());
                ExitCode::SUCCESS
            }
            Err(error) => {
                eprintln!("error: {error:#}");
                ExitCode::from(2)
            }
        };
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: starting the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(config: Config) -> anyhow::Result<()> {
    let listen = config.listen;
    let manager = Manager::open(config).await?;
    let listener = TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding {listen} (key `listen`)"))?;
    ongrid_service::announce(&listener)?;
    let shutdown = CancellationToken::new();
    tokio::spawn(cancel_on_signal(shutdown.clone()));
    manager.serve(listener, shutdown).await
}

/// Cancels `shutdown` on SIGINT or SIGTERM.
async fn cancel_on_signal(shutdown: CancellationToken) {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(error) => {
                tracing::warn!(%error, "Cannot listen for SIGTERM; only Ctrl-C stops the manager.");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = terminate => {}
    }
    tracing::info!("Shutting down.");
    shutdown.cancel();
}
