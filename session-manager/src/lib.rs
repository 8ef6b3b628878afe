//! ongrid-manager: the control plane of an ongrid site.
//!
//! It serves the HTTPS API of `ongrid_core::api` to users (TLS client certificates), node
//! agents and the SSH gateway (bearer tokens), keeps everything in a [`store::Store`] (SQLite or
//! PostgreSQL), and runs the scheduling loop that places PENDING sessions on GPUs with
//! `ongrid_scheduler::plan`.
//!
//! Modules, from the bottom up:
//! - [`domain`]: every rule that moves a session, job or image between states; pure, no I/O.
//! - [`store`]: persistence (one SQL implementation for SQLite and PostgreSQL); [`clock`]:
//!   injected time; [`site`]: the site as the scheduler sees it.
//! - [`keys`] (SSH public keys and their policy), [`grid_identity`] (server TLS, client
//!   certificate → identity), [`auth`] (admins, agent and gateway tokens), [`tokens`] (users'
//!   bearer tokens: WLCG and SciTokens JWTs), [`config`] (the TOML file).
//! - The loops: [`scheduling`] (the scheduling round, with fair share, limits and owned GPUs),
//!   [`hold_timer`] (due holds), [`freeze_watch`] (freezes that cannot finish), [`retention`]
//!   (ended jobs and closed connections pruned), [`grid_mirror`] (jobs of [`targets`]: Slurm,
//!   HTCondor).
//! - [`notify`] (commits wake the long-polls of agents and people), [`replicas`] (several
//!   managers on one PostgreSQL database: who leads the loops, how they tell each other of
//!   changes), [`served_store`] (which copy of the store this manager serves).
//! - [`app`]: each use case, written once; [`api`] (the JSON routes) and [`dashboard`] (the
//!   web pages) translate requests and answers for it; [`metrics`] (the events counted where
//!   they happen) and [`exporter`] (`/metrics` and `/readyz` as a scrape reads them);
//!   [`server`] (the accept loop); [`image_files`], [`job_logs`], [`request_body`]: files and
//!   bodies the routes serve.
//!
//! `main.rs` only parses arguments, binds, and calls [`Manager::open`] then [`Manager::serve`]
//! (or [`run`], which does both).

pub mod api;
pub mod app;
pub mod auth;
pub mod clock;
pub mod config;
pub mod dashboard;
pub mod domain;
pub mod exporter;
pub mod freeze_watch;
pub mod grid_identity;
pub mod grid_mirror;
pub mod hold_timer;
pub mod image_files;
pub mod job_logs;
pub mod keys;
pub mod metrics;
pub mod notify;
pub mod replicas;
pub mod request_body;
pub mod retention;
pub mod scheduling;
pub mod served_store;
pub mod server;
pub mod site;
pub mod store;
pub mod targets;
pub mod tokens;

use std::sync::Arc;

use anyhow::Context;
use ongrid_service::agent_stream::AgentConnector;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use config::Config;

use crate::app::AppState;
use crate::auth::{AgentTokens, GatewayToken};
use crate::clock::{Clock, SystemClock};
use crate::domain::images::FreezeLimits;
use crate::freeze_watch::FreezeWatch;
use crate::grid_identity::{ClientAuthenticator, GridAuthenticator, TrustConfig};
use crate::hold_timer::HoldTimer;
use crate::replicas::{Leader, LeaderLoops};
use crate::scheduling::Scheduler;
use crate::server::Server;
use crate::store::OpenedStore;

/// Everything the config points to, loaded and checked, without touching the database.
/// `--check-config` stops here.
pub struct Prepared {
    pub config: Config,
    pub tls: Arc<rustls::ServerConfig>,
    pub authenticator: Arc<dyn ClientAuthenticator>,
    pub tokens: AgentTokens,
    /// `None` when `gateway_token_file` is not set.
    pub gateway_token: Option<GatewayToken>,
    /// The bearer token issuers of `[[token_issuers]]` (none: certificates only).
    pub bearer: tokens::TokenVerifier,
    /// The client of the agents' stream endpoints, for sessions' web apps; `None` without
    /// `gateway_token_file`.
    pub agent_streams: Option<AgentConnector>,
}

/// Loads the TLS material, the CA directory, the agent tokens and the gateway token named by
/// `config`, and checks what the grid targets need of this host ([`targets::host_check`]).
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
    // What the grid targets need of this host: their commands, the accounts' access to the
    // output and image directories.
    match targets::host_check::check(&config.targets) {
        Ok(warnings) => {
            for warning in warnings {
                tracing::warn!("{warning}");
            }
        }
        Err(problems) => anyhow::bail!("[targets] cannot work on this host:\n{problems}"),
    }
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
    let bearer = tokens::TokenVerifier::new(&config.token_issuers).map_err(anyhow::Error::msg)?;
    let agent_streams = agent_streams(&config)?;
    Ok(Prepared {
        config,
        tls: Arc::new(tls),
        authenticator,
        tokens,
        gateway_token,
        bearer,
        agent_streams,
    })
}

/// The client of the agents' stream endpoints that sessions' web apps go through: the token of
/// `gateway_token_file` (which the agents trust for streams) and the CAs of `ca_dir` as TLS
/// roots (the agents' certificates are the site's, as the gateway trusts them).
fn agent_streams(config: &Config) -> anyhow::Result<Option<AgentConnector>> {
    let Some(path) = &config.gateway_token_file else {
        return Ok(None);
    };
    let token = ongrid_service::Token::read_first_line(path)
        .with_context(|| format!("gateway_token_file {}", path.display()))?;
    let tls = ongrid_service::ca_roots::load_ca_dir(&config.ca_dir)
        .and_then(|roots| ongrid_service::ca_roots::client_config(&roots));
    match tls {
        Ok(tls) => Ok(Some(AgentConnector::new(tls, token))),
        Err(error) => {
            tracing::warn!(ca_dir = %config.ca_dir.display(), error = %anyhow::Error::from(error),
                "Sessions' web apps are off: the CAs of ca_dir cannot be TLS roots for the agents.");
            Ok(None)
        }
    }
}

/// A manager with its files loaded and its database open, ready to serve.
pub struct Manager {
    prepared: Prepared,
    store: OpenedStore,
    clock: Arc<dyn Clock>,
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
        })
    }

    /// Uses `clock` instead of the system clock (tests set the time instead of waiting).
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Serves the API on `listener` and runs the scheduler and the timers (while this replica
    /// leads, see [`replicas`]) until `shutdown`, then waits for every connection and task to
    /// finish and closes the database.
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: CancellationToken,
    ) -> anyhow::Result<()> {
        let prepared = self.prepared;
        let config = prepared.config;
        let opened = self.store;
        let store = opened.shared();
        let served = served_store::ServedStore::open(store.clone())
            .await
            .context("reading the store's identity")?;
        let metrics_listener = ongrid_service::metrics::bind(config.metrics.as_ref()).await?;
        let tracker = TaskTracker::new();
        let Wiring {
            wake,
            leader,
            changes,
            replication,
        } = Wiring::new(opened.replicated(), &served, &shutdown);
        tracker.spawn(served.clone().run(shutdown.clone()));

        let wakes = Wakes {
            api: wake.clone(),
            scheduler: replication.scheduler_wake.clone(),
        };
        let loops = leader_loops(&config, &store, &self.clock, wakes, &changes, &leader);
        let (scheduler, grid) = (loops.scheduler.clone(), loops.grid.clone());
        let links = Links {
            wake: &wake,
            changes: &changes,
            leader: &leader,
            served: &served,
            shutdown: &shutdown,
        };
        spawn_loops(&tracker, &opened, loops, replication, &links);
        let exporter = exporter::ManagerExporter::new(store.clone())
            .with_clock(self.clock.clone())
            .with_fair_share(config.fair_share.clone(), self.clock.clone());
        tracker.spawn(ongrid_service::metrics::serve_if_bound(
            metrics_listener,
            Arc::new(exporter),
            shutdown.clone(),
        ));

        let state = AppState {
            store: store.clone(),
            config: Arc::new(config),
            tokens: Arc::new(prepared.tokens),
            gateway_token: prepared.gateway_token.map(Arc::new),
            bearer: Arc::new(prepared.bearer),
            clock: self.clock,
            wake,
            scheduler: scheduler.clone(),
            leader,
            changes,
            grid,
            web_apps: Arc::new(app::web_apps::WebApps::new(prepared.agent_streams)),
            inventory_reads: Default::default(),
            desired_versions: Default::default(),
            satisfiability: Default::default(),
        };
        let server = Server {
            acceptor: TlsAcceptor::from(prepared.tls),
            authenticator: prepared.authenticator,
            // Both transports, each answer stamped with the store's identity.
            router: api::router(state.clone())
                .merge(dashboard::router(state))
                .layer(axum::middleware::from_fn_with_state(
                    served,
                    served_store::stamp,
                )),
        };
        let addr = listener.local_addr().ok();
        tracing::info!(?addr, "Serving.");
        server.serve(listener, tracker.clone(), shutdown).await;
        tracker.close();
        tracker.wait().await;
        scheduler.finish_requested_rounds().await;
        opened.close().await;
        tracing::info!("Stopped.");
        Ok(())
    }
}

/// How a manager's parts reach one another: what the API and the hold timer notify, whether
/// this replica leads, the changes long-polls wait on, and what replicas of a PostgreSQL store
/// need beside (see [`Replication`]).
struct Wiring {
    wake: Arc<Notify>,
    leader: Leader,
    changes: notify::Changes,
    replication: Replication,
}

impl Wiring {
    /// The sole manager of a store leads at once and its scheduling loop waits on `wake`
    /// itself; a replica follows until it takes the lead, and what it changes goes to the
    /// other replicas too (an outbox). Neither leads while the store is behind this binary.
    fn new(
        replicated: bool,
        served: &served_store::ServedStore,
        shutdown: &CancellationToken,
    ) -> Self {
        let wake = Arc::new(Notify::new());
        let changes = notify::Changes::new(shutdown.clone());
        if !replicated {
            return Self {
                wake: wake.clone(),
                leader: Leader::sole().unless_behind(served.behind()),
                changes,
                replication: Replication {
                    lead: None,
                    outbox: None,
                    scheduler_wake: wake,
                },
            };
        }
        let (lead, leader) = Leader::follower();
        let (changes, outbox) = changes.with_outbox();
        Self {
            wake,
            leader: leader.unless_behind(served.behind()),
            changes,
            replication: Replication {
                lead: Some(lead),
                outbox: Some(outbox),
                scheduler_wake: Arc::new(Notify::new()),
            },
        }
    }
}

/// What the loops started beside the API share with it (see [`spawn_loops`]).
struct Links<'a> {
    wake: &'a Arc<Notify>,
    changes: &'a notify::Changes,
    leader: &'a Leader,
    served: &'a Arc<served_store::ServedStore>,
    shutdown: &'a CancellationToken,
}

/// The two wake-ups of the scheduling loop: what the API and the hold timer notify, and what the
/// loop waits on (the same on a sole manager; with replicas the leader's loop is woken through
/// [`replicas`]).
struct Wakes {
    api: Arc<Notify>,
    scheduler: Arc<Notify>,
}

/// The loops only the leading replica runs (the only manager of a SQLite store always leads).
fn leader_loops(
    config: &Config,
    store: &Arc<dyn store::Store>,
    clock: &Arc<dyn Clock>,
    wakes: Wakes,
    changes: &notify::Changes,
    leader: &Leader,
) -> LeaderLoops {
    let scheduler = Scheduler::new(
        store.clone(),
        clock.clone(),
        config.node_timeout,
        wakes.scheduler,
    )
    .with_leader(leader.clone())
    .with_changes(changes.clone())
    .with_job_limits(config.job_limits)
    .with_auto_undrain(config.auto_undrain)
    .with_fair_share(config.fair_share.clone())
    .with_limits(config.limits.clone())
    .with_gpu_policy(scheduling::gpu_policy::PolicySettings {
        sessions_on_owned_gpus: config.sessions_on_owned_gpus,
        lifecycle: config.lifecycle,
    });
    let holds = HoldTimer::new(store.clone(), clock.clone(), config.lifecycle, wakes.api)
        .with_changes(changes.clone());
    let freeze_limits = FreezeLimits {
        node_timeout: config.node_timeout,
        stall_timeout: config.freeze_stall_timeout,
    };
    let freezes =
        FreezeWatch::new(store.clone(), clock.clone(), freeze_limits).with_changes(changes.clone());
    let grid = grid_mirror::GridMirror::new(
        store.clone(),
        clock.clone(),
        Arc::new(targets::Targets::from_config(&config.targets)),
        config.job_limits,
        job_logs::JobLogs::new(config.job_log_dir.clone()),
    )
    .with_changes(changes.clone());
    let retention = retention::Retention::new(
        store.clone(),
        clock.clone(),
        config.retention,
        config.job_limits.output_grace,
        job_logs::JobLogs::new(config.job_log_dir.clone()),
    );
    LeaderLoops {
        scheduler: Arc::new(scheduler),
        schedule_interval: config.schedule_interval,
        holds: Arc::new(holds),
        freezes: Arc::new(freezes),
        grid: Arc::new(grid),
        retention: Arc::new(retention),
    }
}

/// What a replica of a PostgreSQL store needs beside its loops: the sender that makes it lead,
/// the changes it tells the other replicas, and its scheduling loop's own wake-up. `None`s for
/// the sole manager of a SQLite store.
struct Replication {
    lead: Option<tokio::sync::watch::Sender<bool>>,
    outbox: Option<tokio::sync::mpsc::Receiver<notify::Changed>>,
    scheduler_wake: Arc<Notify>,
}

/// Starts the leader's loops: at once on the sole manager of a store; on a replica, once it
/// leads, with the notifications between replicas.
fn spawn_loops(
    tracker: &TaskTracker,
    opened: &OpenedStore,
    loops: LeaderLoops,
    replication: Replication,
    links: &Links<'_>,
) {
    let Links {
        wake,
        changes,
        leader,
        served,
        shutdown,
    } = *links;
    #[cfg(feature = "postgres")]
    let loops = match (opened.postgres(), replication.lead, replication.outbox) {
        (Some(postgres), Some(lead), Some(outbox)) => {
            let replica = uuid::Uuid::new_v4().simple().to_string();
            let wakes = Arc::new(replicas::Wakes {
                api: wake.clone(),
                scheduler: replication.scheduler_wake,
                grid: loops.grid.clone(),
                rounds: loops.scheduler.clone(),
            });
            tracker.spawn(replicas::lead(
                postgres.clone(),
                lead,
                loops,
                served.clone(),
                shutdown.clone(),
            ));
            tracker.spawn(replicas::publish(
                postgres.clone(),
                replica.clone(),
                changes.clone(),
                outbox,
                wakes.clone(),
                leader.clone(),
                shutdown.clone(),
            ));
            tracker.spawn(replicas::listen(
                postgres.clone(),
                replica,
                changes.clone(),
                wakes,
                leader.clone(),
                shutdown.clone(),
            ));
            None
        }
        _ => Some(loops),
    };
    #[cfg(not(feature = "postgres"))]
    let loops = {
        let _ = (opened, replication, wake, changes, leader);
        Some(loops)
    };
    if let Some(loops) = loops {
        let shutdown = shutdown.clone();
        let served = served.clone();
        tracker.spawn(async move { loops.run_sole(served, shutdown).await });
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
