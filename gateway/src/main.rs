//! `ongrid-gateway --config FILE [--check-config]`: loads the config, sets up logging to stderr
//! (filter from `ONGRID_LOG`, default `info`), binds the listener, prints `listening on ADDR`
//! on stdout, and runs [`ongrid_gateway::run`] until SIGINT or SIGTERM.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser;
use ongrid_gateway::Config;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::info;
use tracing_subscriber::EnvFilter;

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
    let config = match Config::load(&args.config) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("ongrid-gateway: {:#}", anyhow::Error::from(e));
            return ExitCode::from(2);
        }
    };
    if args.check_config {
        if let Err(e) = ongrid_gateway::tls::load_ca_dir(&config.ca_dir) {
            eprintln!("ongrid-gateway: {:#}", anyhow::Error::from(e));
            return ExitCode::from(2);
        }
        println!("{}: valid", args.config.display());
        return ExitCode::SUCCESS;
    }
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            EnvFilter::try_from_env("ONGRID_LOG").unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .init();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("ongrid-gateway: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("ongrid-gateway: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(config: Config) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("binding {}", config.listen))?;
    let address = listener.local_addr().context("reading the bound address")?;
    let mut stdout = std::io::stdout();
    writeln!(stdout, "listening on {address}").context("writing to stdout")?;
    stdout.flush().context("writing to stdout")?;

    let shutdown = CancellationToken::new();
    let tracker = TaskTracker::new();
    tracker.spawn(cancel_on_signal(shutdown.clone()));
    let result = ongrid_gateway::run(config, listener, shutdown.clone()).await;
    shutdown.cancel();
    tracker.close();
    tracker.wait().await;
    result
}

/// Cancels `shutdown` on SIGINT or SIGTERM, or returns when it is cancelled otherwise.
async fn cancel_on_signal(shutdown: CancellationToken) {
    let mut terminate = match tokio::signal::unix::signal(
        tokio::signal::unix::SignalKind::terminate(),
    ) {
        Ok(signal) => signal,
        Err(e) => {
            tracing::error!(error = %e, "Cannot listen for SIGTERM; stop the gateway with SIGINT.");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => info!("SIGINT received, stopping."),
                () = shutdown.cancelled() => return,
            }
            shutdown.cancel();
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => info!("SIGINT received, stopping."),
        _ = terminate.recv() => info!("SIGTERM received, stopping."),
        () = shutdown.cancelled() => return,
    }
    shutdown.cancel();
}
