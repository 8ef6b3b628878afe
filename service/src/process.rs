//! Start-up and shutdown of a long-running ongrid binary (the manager, the gateway, the agent).
//! [`Binary::run`] does what every `main.rs` did: refuse a bad config (exit 2 with
//! `<binary>: <error>`, the causes chained with `: `), log to stderr with the `ONGRID_LOG`
//! filter (default `info`), answer `--check-config` (`<file>: valid` on stdout, or exit 2 with
//! the check's error), start the tokio runtime, and run the binary's `serve` with a [`CancellationToken`]
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
        // Before the check, so what it warns about (a CA directory with no CRL, ...) is seen.
        init_tracing();
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

/// Logs to stderr, filtered by `ONGRID_LOG` (default `info`); a no-op when the process has set
/// up logging already. Colours only on a terminal: a log file or the journal gets plain text,
/// in which a control character can only come from a bug (peer-controlled fields are escaped).
pub fn init_tracing() {
    use std::io::IsTerminal;
    // An error only says that a subscriber is set already.
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            EnvFilter::try_from_env(LOG_ENV).unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .try_init();
}

/// Binds `address` and [`announce`]s it.
pub async fn bind_and_announce(address: SocketAddr) -> anyhow::Result<TcpListener> {
    bind_and_announce_to(address, &mut std::io::stdout().lock()).await
}

/// Prints `listening on ADDR` (the bound address, so port 0 shows the real port) on stdout,
/// which tests and scripts read.
pub fn announce(listener: &TcpListener) -> anyhow::Result<SocketAddr> {
    announce_to(listener, &mut std::io::stdout().lock())
}

async fn bind_and_announce_to(
    address: SocketAddr,
    out: &mut impl Write,
) -> anyhow::Result<TcpListener> {
    let listener = TcpListener::bind(address)
        .await
        .with_context(|| format!("binding {address}"))?;
    announce_to(&listener, out)?;
    Ok(listener)
}

fn announce_to(listener: &TcpListener, out: &mut impl Write) -> anyhow::Result<SocketAddr> {
    let address = listener.local_addr().context("reading the bound address")?;
    writeln!(out, "listening on {address}").context("writing to stdout")?;
    out.flush().context("writing to stdout")?;
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
        let mut out = Vec::new();
        let listener = bind_and_announce_to("127.0.0.1:0".parse().unwrap(), &mut out)
            .await
            .unwrap();
        let port = listener.local_addr().unwrap().port();
        assert_ne!(port, 0);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            format!("listening on 127.0.0.1:{port}\n")
        );
    }
}
