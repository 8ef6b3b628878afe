//! ongrid-manager: the control plane of an ongrid site.
//!
//! It serves the HTTPS API of `ongrid_core::api` to users (TLS client certificates), node
//! agents and the SSH gateway (bearer tokens), keeps everything in a [`store::Store`] (SQLite or
//! PostgreSQL), and runs the scheduling loop that places PENDING sessions on GPUs with
//! `ongrid_scheduler::plan`.
//!
//! Modules, from the bottom up: [`domain`] (every rule that moves a session or an image between
//! states, pure), [`store`] (persistence), [`clock`] (injected time), [`site`] (the site as the
//! scheduler sees it), [`keys`] (SSH public keys and their policy), [`tls`] (server TLS, client
//! certificate → identity), [`auth`] (admins, agent and gateway tokens), [`config`] (the TOML
//! file); the loops [`scheduler`] (placements), [`hold_timer`] (due holds) and [`freeze_watch`]
//! (freezes that cannot finish); [`metrics`] (`/metrics`, `/readyz`); [`notify`] (commits wake
//! the long-polls of agents and people);
//! [`api`] (the routes), [`dashboard`] (the web pages) and [`server`] (the accept loop).
//!
//! `main.rs` only parses arguments, binds, and calls [`Manager::open`] then [`Manager::serve`]
//! (or [`run`], which does both).

pub mod api;
pub mod auth;
pub mod clock;
pub mod config;
pub mod dashboard;
pub mod domain;
pub mod fair_share;
pub mod freeze_watch;
pub mod gpu_policy;
pub mod grid_identity;
pub mod grid_mirror;
pub mod hold_timer;
pub mod image_files;
pub mod job_logs;
pub mod keys;
pub mod limit_check;
pub mod metrics;
pub mod notify;
pub mod scheduler;
pub mod server;
pub mod site;
pub mod store;
pub mod targets;

use std::sync::Arc;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use config::Config;

use crate::api::AppState;
use crate::auth::{AgentTokens, GatewayToken};
use crate::clock::{Clock, SystemClock};
use crate::domain::images::FreezeLimits;
use crate::freeze_watch::FreezeWatch;
use crate::grid_identity::{ClientAuthenticator, GridAuthenticator, TrustConfig};
use crate::hold_timer::HoldTimer;
use crate::scheduler::Scheduler;
use crate::server::Server;
use crate::store::{Active, OpenedStore};

/// Everything the config points to, loaded and checked, without touching the database.
/// `--check-config` stops here.
pub struct Prepared {
    pub config: Config,
    pub tls: Arc<rustls::ServerConfig>,
    pub authenticator: Arc<dyn ClientAuthenticator>,
    pub tokens: AgentTokens,
    /// `None` when `gateway_token_file` is not set.
    pub gateway_token: Option<GatewayToken>,
}

/// Loads the TLS material, the CA directory, the agent tokens and the gateway token named by
/// `config`.
pub fn prepare(config: Config) -> anyhow::Result<Prepared> {
    let provider = grid_identity::provider();
    let authenticator: Arc<dyn ClientAuthenticator> =
        Arc::new(GridAuthenticator::load(TrustConfig {
            ca_dir: config.ca_dir.clone(),
            vomsdir: config.vomsdir.clone(),
            crl_policy: config.crl_policy,
        })?);
    let tls = grid_identity::server_config(
        &config.tls_cert,
        &config.tls_key,
        authenticator.clone(),
        provider,
    )?;
    let tokens = AgentTokens::load(&config.agent_tokens_file)?;
    if tokens.is_empty() {
        tracing::warn!(file = %config.agent_tokens_file.display(), "No agent tokens: no node can register.");
    }
    let gateway_token = match &config.gateway_token_file {
        Some(path) => {
            let token = GatewayToken::load(path)?;
            if let Some(node) = token.shared_with(&tokens) {
                anyhow::bail!(
                    "gateway_token_file {} holds node {node}'s agent token: give the gateway a \
                     token of its own (`openssl rand -hex 32`)",
                    path.display()
                );
            }
            Some(token)
        }
        None => {
            tracing::info!("No gateway_token_file: SSH gateway routes are off.");
            None
        }
    };
    Ok(Prepared {
        config,
        tls: Arc::new(tls),
        authenticator,
        tokens,
        gateway_token,
    })
}

/// A manager with its files loaded and its database open, ready to serve.
pub struct Manager {
    prepared: Prepared,
    store: OpenedStore,
    clock: Arc<dyn Clock>,
    /// Set once no other manager is active on the database ([`Manager::wait_until_active`]).
    active: Option<Active>,
}

impl Manager {
    /// Loads everything the config names and opens (and migrates) the database.
    pub async fn open(config: Config) -> anyhow::Result<Self> {
        let prepared = prepare(config)?;
        let store = prepared
            .config
            .store
            .open()
            .await
            .with_context(|| format!("opening {} (key `database`)", prepared.config.store))?;
        tracing::info!(database = %prepared.config.store, "Database open, schema up to date.");
        Ok(Self {
            prepared,
            store,
            clock: Arc::new(SystemClock),
            active: None,
        })
    }

    /// Waits until no other manager is active on the database (PostgreSQL: a second manager is
    /// a standby until the active one stops or dies; SQLite: at once). [`Manager::serve`] does
    /// it too; the binary calls it before binding, so a standby does not take connections.
    pub async fn wait_until_active(&mut self) -> anyhow::Result<()> {
        if self.active.is_some() {
            return Ok(());
        }
        let database = &self.prepared.config.store;
        let active = self
            .store
            .activate(|| {
                tracing::warn!(
                    %database,
                    "Standby: another manager is active on this database; this one serves as \
                     soon as it stops."
                );
            })
            .await
            .with_context(|| format!("waiting to be the active manager of {database}"))?;
        tracing::info!(%database, "Active: no other manager serves this database.");
        self.active = Some(active);
        Ok(())
    }

    /// Uses `clock` instead of the system clock (tests set the time instead of waiting).
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Serves the API on `listener` and runs the scheduler until `shutdown`, then waits for
    /// every connection and task to finish and closes the database.
    pub async fn serve(
        mut self,
        listener: TcpListener,
        shutdown: CancellationToken,
    ) -> anyhow::Result<()> {
        tokio::select! {
            active = self.wait_until_active() => active?,
            () = shutdown.cancelled() => return Ok(()),
        }
        let mut active = self.active.take().context("not active")?;
        let Prepared {
            config,
            tls,
            authenticator,
            tokens,
            gateway_token,
        } = self.prepared;
        let opened = self.store;
        let store = opened.shared();
        let metrics_listener = ongrid_service::metrics::bind(config.metrics.as_ref()).await?;
        let wake = Arc::new(Notify::new());
        let tracker = TaskTracker::new();
        // Another manager may take over once this one cannot show it still holds the lock:
        // stop. The lock itself is released only after everything stopped.
        let lost = {
            let shutdown = shutdown.clone();
            tracker.spawn(async move {
                let lost = tokio::select! {
                    why = active.lost() => Some(why),
                    () = shutdown.cancelled() => None,
                };
                if let Some(why) = &lost {
                    tracing::error!(%why, "Lost the database's manager lock: stopping.");
                    shutdown.cancel();
                }
                (active, lost)
            })
        };

        let changes = notify::Changes::new(shutdown.clone());
        let scheduler = Arc::new(
            Scheduler::new(
                store.clone(),
                self.clock.clone(),
                config.node_timeout,
                wake.clone(),
            )
            .with_changes(changes.clone())
            .with_job_limits(config.job_limits)
            .with_auto_undrain(config.auto_undrain)
            .with_fair_share(config.fair_share.clone())
            .with_limits(config.limits.clone())
            .with_gpu_policy(gpu_policy::PolicySettings {
                sessions_on_owned_gpus: config.sessions_on_owned_gpus,
                lifecycle: config.lifecycle,
            }),
        );
        tracker.spawn(
            scheduler
                .clone()
                .run(config.schedule_interval, shutdown.clone()),
        );
        let holds = Arc::new(
            HoldTimer::new(
                store.clone(),
                self.clock.clone(),
                config.lifecycle,
                wake.clone(),
            )
            .with_changes(changes.clone()),
        );
        tracker.spawn(holds.run(shutdown.clone()));
        let freezes = Arc::new(
            FreezeWatch::new(
                store.clone(),
                self.clock.clone(),
                FreezeLimits {
                    node_timeout: config.node_timeout,
                    stall_timeout: config.freeze_stall_timeout,
                },
            )
            .with_changes(changes.clone()),
        );
        tracker.spawn(freezes.run(shutdown.clone()));
        let grid = Arc::new(
            grid_mirror::GridMirror::new(
                store.clone(),
                self.clock.clone(),
                Arc::new(targets::Targets::from_config(&config.targets)),
                config.job_limits,
                job_logs::JobLogs::new(config.job_log_dir.clone()),
            )
            .with_changes(changes.clone()),
        );
        tracker.spawn(grid.clone().run(shutdown.clone()));
        let exporter = metrics::ManagerExporter::new(store.clone())
            .with_fair_share(config.fair_share.clone(), self.clock.clone());
        tracker.spawn(ongrid_service::metrics::serve_if_bound(
            metrics_listener,
            Arc::new(exporter),
            shutdown.clone(),
        ));

        let state = AppState {
            store: store.clone(),
            config: Arc::new(config),
            tokens: Arc::new(tokens),
            gateway_token: gateway_token.map(Arc::new),
            clock: self.clock,
            wake,
            scheduler,
            changes,
            grid,
        };
        let server = Server {
            acceptor: TlsAcceptor::from(tls),
            authenticator,
            router: api::router(state.clone()).merge(dashboard::router(state)),
        };
        let addr = listener.local_addr().ok();
        tracing::info!(?addr, "Serving.");
        server.serve(listener, tracker.clone(), shutdown).await;
        tracker.close();
        tracker.wait().await;
        // Held until the end: the lock is released once everything stopped.
        let (_active, lost) = lost.await.context("the manager lock's task")?;
        opened.close().await;
        tracing::info!("Stopped.");
        match lost {
            Some(why) => anyhow::bail!("lost the database's manager lock: {why}"),
            None => Ok(()),
        }
    }
}

/// Opens and serves: [`Manager::open`] then [`Manager::serve`].
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    Manager::open(config).await?.serve(listener, shutdown).await
}
