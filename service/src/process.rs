//! Start-up and shutdown of a long-running ongrid binary. [`Binary::run`] does what every
//! `main.rs` did: refuse a bad config (exit 2 with `<binary>: <error>`), answer
//! `--check-config` (`<file>: valid`), log to stderr with the `ONGRID_LOG` filter (default
//! `info`), start the tokio runtime, and run the binary's `serve` with a [`CancellationToken`]
//! cancelled on SIGINT or SIGTERM; an error from `serve` is logged, printed and exits 1.

use std::future::Future;
use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;
use std::process::ExitCode;

use anyhow::Context as _;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::info;
use tracing_subscriber::EnvFilter;

/// The environment variable holding the log filter.
pub const LOG_ENV: &str = "ONGRID_LOG";

/// An extra check of `--check-config`, beyond loading the config.
type Check<'a, C> = Box<dyn FnOnce(&C) -> anyhow::Result<()> + 'a>;

/// One binary's start-up: its name (the prefix of its errors on stderr), its config file and
/// whether only to check it.
pub struct Binary<'a, C> {
    name: &'static str,
    config_path: &'a Path,
    check_only: bool,
    check: Option<Check<'a, C>>,
}

impl<'a, C> Binary<'a, C> {
    /// `name` as in `ongrid-gateway`; `check_only` is the `--check-config` flag.
    pub fn new(name: &'static str, config_path: &'a Path, check_only: bool) -> Self {
        Self {
            name,
            config_path,
            check_only,
            check: None,
        }
    }

    /// What `--check-config` checks besides loading the config (files the config names that
    /// loading does not read).
    pub fn check(mut self, check: impl FnOnce(&C) -> anyhow::Result<()> + 'a) -> Self {
        self.check = Some(Box::new(check));
        self
    }

    /// Runs the binary on the result of loading its config and returns its exit code: 2 for a
    /// bad config, 1 when `serve` fails, 0 otherwise. `serve` runs on a new tokio runtime and
    /// stops when its token is cancelled (SIGINT, SIGTERM); tasks spawned on the runtime are
    /// not waited for, except the signal task.
    pub fn run<E, F, Fut>(self, config: Result<C, E>, serve: F) -> ExitCode
    where
        anyhow::Error: From<E>,
        F: FnOnce(C, CancellationToken) -> Fut,
        Fut: Future<Output = anyhow::Result<()>>,
    {
        let name = self.name;
        let config = match config {
            Ok(config) => config,
            Err(e) => {
                eprintln!("{name}: {:#}", anyhow::Error::from(e));
                return ExitCode::from(2);
            }
        };
        if self.check_only {
            if let Some(check) = self.check {
                if let Err(e) = check(&config) {
                    eprintln!("{name}: {e:#}");
                    return ExitCode::from(2);
                }
            }
            println!("{}: valid", self.config_path.display());
            return ExitCode::SUCCESS;
        }
        init_tracing();
        let runtime = match tokio::runtime::Runtime::new() {
            Ok(runtime) => runtime,
            Err(e) => {
                eprintln!("{name}: cannot start the async runtime: {e}");
                return ExitCode::FAILURE;
            }
        };
        let role = name.strip_prefix("ongrid-").unwrap_or(name);
        match runtime.block_on(until_signal(role, |shutdown| serve(config, shutdown))) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                tracing::error!("{e:#}");
                eprintln!("{name}: {e:#}");
                ExitCode::FAILURE
            }
        }
    }
}

/// Logs to stderr, filtered by `ONGRID_LOG` (default `info`).
pub fn init_tracing() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            EnvFilter::try_from_env(LOG_ENV).unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .init();
}

/// Binds `address` and [`announce`]s it.
pub async fn bind_and_announce(address: SocketAddr) -> anyhow::Result<TcpListener> {
    let listener = TcpListener::bind(address)
        .await
        .with_context(|| format!("binding {address}"))?;
    announce(&listener)?;
    Ok(listener)
}

/// Prints `listening on ADDR` (the bound address, so port 0 shows the real port) on stdout,
/// which tests and scripts read.
pub fn announce(listener: &TcpListener) -> anyhow::Result<SocketAddr> {
    let address = listener.local_addr().context("reading the bound address")?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "listening on {address}").context("writing to stdout")?;
    stdout.flush().context("writing to stdout")?;
    Ok(address)
}

/// Runs `serve` with a token cancelled on SIGINT or SIGTERM, then cancels it and waits for the
/// signal task.
async fn until_signal<F, Fut>(role: &'static str, serve: F) -> anyhow::Result<()>
where
    F: FnOnce(CancellationToken) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    let shutdown = CancellationToken::new();
    let tracker = TaskTracker::new();
    tracker.spawn(cancel_on_signal(role, shutdown.clone()));
    let result = serve(shutdown.clone()).await;
    shutdown.cancel();
    tracker.close();
    tracker.wait().await;
    result
}

/// Cancels `shutdown` on SIGINT or SIGTERM, or returns when it is cancelled otherwise. `role`
/// (`gateway`, `agent`) names the process in the message when SIGTERM cannot be caught.
async fn cancel_on_signal(role: &'static str, shutdown: CancellationToken) {
    let mut terminate = match tokio::signal::unix::signal(
        tokio::signal::unix::SignalKind::terminate(),
    ) {
        Ok(signal) => signal,
        Err(e) => {
            tracing::error!(error = %e, "Cannot listen for SIGTERM; stop the {role} with SIGINT.");
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_config_exits_2_without_serving() {
        let code = Binary::<()>::new("ongrid-test", Path::new("t.toml"), false)
            .run(Err(std::io::Error::other("broken")), |(), _| async {
                panic!("served a bad config")
            });
        assert_eq!(code, ExitCode::from(2));
    }

    #[test]
    fn check_config_runs_the_check_and_does_not_serve() {
        let serve = |(), _| async { panic!("served while checking") };
        let ok = Binary::new("ongrid-test", Path::new("t.toml"), true)
            .check(|()| Ok(()))
            .run(Ok::<_, std::io::Error>(()), serve);
        assert_eq!(ok, ExitCode::SUCCESS);
        let refused = Binary::new("ongrid-test", Path::new("t.toml"), true)
            .check(|()| anyhow::bail!("no CA"))
            .run(Ok::<_, std::io::Error>(()), serve);
        assert_eq!(refused, ExitCode::from(2));
    }

    #[tokio::test]
    async fn serve_gets_a_live_token_that_is_cancelled_after() {
        let mut seen = None;
        let result = until_signal("test", |shutdown| {
            seen = Some(shutdown.clone());
            async move {
                assert!(!shutdown.is_cancelled());
                Ok(())
            }
        })
        .await;
        assert!(result.is_ok());
        assert!(seen.unwrap().is_cancelled());
    }

    #[tokio::test]
    async fn announce_prints_the_bound_port() {
        let listener = bind_and_announce("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        assert_ne!(listener.local_addr().unwrap().port(), 0);
    }
}
