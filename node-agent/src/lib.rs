//! ongrid-agent: the node agent, one per GPU node. It reports the node's GPUs and dev containers
//! to the manager and converges the containers to the desired state the manager answers with.
//!
//! - [`config`]: the TOML file, validated into [`Config`].
//! - [`gpu`]: GPU discovery behind `GpuBackend` (nvidia-smi, simulated).
//! - [`runtime`]: dev containers behind `ContainerRuntime` (Docker; a fake for unit tests).
//! - [`network`]: each session's own Docker network and the host firewall rules isolating it.
//! - [`reconcile`]: desired vs observed, the operations, and the report of what is there.
//! - [`activity`]: CPU and GPU use of the running dev containers, for idle detection.
//! - [`freeze`]: the freeze worker (session → SIF image and Docker image).
//! - [`jobs`]: batch jobs (image from the SIF, one container per job, halt, output).
//! - [`manager_client`]: HTTPS to the manager (register, sync).
//! - [`metrics`]: `/metrics` (container operations, freezes, GPU discoveries) and `/healthz`.
//! - [`streams`]: the SSH gateway's stream endpoint (shells, commands, sftp, port forwarding).
//! - [`sync_times`]: how long each phase of a sync took; a slow sync names its slowest.
//! - [`gpu_check`]: `ongrid-agent gpus`, `mig` and `gpu-container`, the agent's GPU code run once
//!   from a shell for `scripts/gpu-check.sh`; not part of the running agent.
//!
//! [`run`] wires them together, starts the stream endpoint when `[streams]` is configured, and
//! runs the sync loop ([`Agent::run`]) until shutdown. Between syncs the agent keeps a long-poll
//! open on the manager (`watch_desired`), so a change of its desired state is applied at once;
//! after starting, stopping or removing containers, and when one stops by itself, it syncs again
//! at once, so the manager hears of it without waiting for the interval; new output of a batch
//! job is reported within [`OUTPUT_PUSH_GAP`] of the sync before. The periodic sync stays:
//! it is level-triggered, so nothing is lost when the long-poll breaks. Stopping the agent leaves every container
//! as it is: they belong to sessions, and the next agent adopts them. Open streams end.

pub mod activity;
pub mod config;
pub mod freeze;
pub mod gpu;
pub mod gpu_check;
pub mod jobs;
pub mod labels;
pub mod manager_client;
pub mod metrics;
pub mod network;
pub mod reconcile;
pub mod removed_images;
pub mod runtime;
pub mod storage;
pub mod stream_identity;
pub mod streams;
pub mod sync_times;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use ongrid_core::api::{DesiredState, NodeReport, ObservedContainer, RegisterNode};
use ongrid_core::{GpuId, GpuInfo, NodeName};
use reqwest::StatusCode;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, error, info, warn};

pub use config::Config;

use crate::gpu::GpuBackend;
use crate::manager_client::{AgentRoutes, ClientError, Versioned};
use crate::network::HostFirewall;
use crate::reconcile::Reconciler;
use crate::runtime::direct::DirectExec;
use crate::runtime::docker::DockerRuntime;
use crate::runtime::{error_chain, ContainerRuntime, DaemonInfo, GpuAccess};
use crate::streams::StreamServer;
use crate::sync_times::{Phase, SyncTimes};

/// How long open streams may take to end once the agent stops.
const STREAMS_SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// How long running freezes may take to stop once the agent stops.
const FREEZE_SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

/// Bounds of the sync interval the manager may ask for.
const MIN_SYNC_INTERVAL: Duration = Duration::from_secs(1);
const MAX_SYNC_INTERVAL: Duration = Duration::from_secs(300);

/// How long each long-poll asks the manager to wait for a change of the desired state.
const DESIRED_WAIT: Duration = Duration::from_secs(25);

/// New job output is reported at most this long after the sync before it (not on the periodic
/// sync): soon for `devctl job logs -f`, and at most one sync a second for a job that prints
/// all the time (the shortest interval a manager may ask for anyway).
pub const OUTPUT_PUSH_GAP: Duration = MIN_SYNC_INTERVAL;

/// How many syncs in a row may follow the previous one at once (each because it changed
/// containers), so a change that repeats itself cannot keep the agent syncing.
const MAX_FOLLOW_UPS: u32 = 3;

/// Starts the agent described by `config` and runs it until `shutdown` is cancelled.
pub async fn run(config: Config, shutdown: CancellationToken) -> anyhow::Result<()> {
    let metrics_listener = ongrid_service::metrics::bind(config.metrics.as_ref()).await?;
    let gpus = gpu::from_config(&config.gpu)
        .context("setting up the GPU backend ([gpu] in the config)")?;
    let gpus = metrics::MeteredGpus::wrap(gpus);
    // The helper is this very binary (`/proc/self/exe` stays it even when the file is replaced
    // by an upgrade).
    let direct = DirectExec::new(&config.exec, PathBuf::from("/proc/self/exe"));
    let runtime = DockerRuntime::connect(config.node_name.clone())
        .await
        .context("connecting to Docker")?
        .with_direct_exec(direct);
    let runtime: Arc<dyn ContainerRuntime> = Arc::new(runtime);
    report_live_restore(&config.node_name, &*runtime).await;
    let guard = node_guard(&config, &*runtime).await?;
    let manager = AgentRoutes::new(&config.manager_urls, &config.ca_dir, config.token.clone())
        .context("setting up the HTTPS client of the manager")?;
    let streams = TaskTracker::new();
    let readiness = metrics::Readiness::default();
    streams.spawn(ongrid_service::metrics::serve_if_bound(
        metrics_listener,
        Arc::new(metrics::AgentExporter::new(readiness.clone())),
        shutdown.clone(),
    ));
    let stream_url = match &config.streams {
        Some(settings) => {
            Some(serve_streams(&config.node_name, settings, &runtime, &streams, &shutdown).await?)
        }
        None => None,
    };
    let result = Agent {
        node: config.node_name,
        gpus,
        runtime,
        manager,
        stream_url,
        images: config.images,
        jobs: config.jobs,
        guard,
        readiness,
        parallel_operations: config.parallel_operations,
    }
    .run(shutdown.clone())
    .await;
    // The sync loop returns on shutdown; streams end with it (an error frame each).
    shutdown.cancel();
    streams.close();
    if tokio::time::timeout(STREAMS_SHUTDOWN_GRACE, streams.wait())
        .await
        .is_err()
    {
        warn!("Some streams did not end within 5 s of stopping; dropping them.");
    }
    result
}

/// Binds the gateway's stream endpoint (`[streams]`) and serves it on `streams` until
/// `shutdown`; returns the URL the manager is told to give the gateway.
async fn serve_streams(
    node: &NodeName,
    settings: &config::StreamsConfig,
    runtime: &Arc<dyn ContainerRuntime>,
    streams: &TaskTracker,
    shutdown: &CancellationToken,
) -> anyhow::Result<String> {
    let listener = TcpListener::bind(settings.listen).await.with_context(|| {
        format!(
            "binding the stream endpoint to {} ([streams] listen)",
            settings.listen
        )
    })?;
    let bound = listener
        .local_addr()
        .context("reading the stream endpoint's address")?;
    if settings.url.is_none() && bound.ip().is_unspecified() {
        warn!(%bound, "The stream endpoint listens on all addresses; set [streams] url so the gateway gets an address it can reach.");
    }
    let server = Arc::new(StreamServer::new(node.clone(), runtime.clone(), settings));
    streams.spawn(server.serve(listener, streams.clone(), shutdown.clone()));
    Ok(StreamServer::url(settings, bound))
}

/// Logs whether Docker's live-restore is on: without it, a restart or an upgrade of Docker
/// stops every dev container, and their sessions fail.
async fn report_live_restore(node: &NodeName, runtime: &dyn ContainerRuntime) {
    match runtime.daemon().await {
        Ok(DaemonInfo { live_restore: true }) => {
            info!(%node, live_restore = true,
                  "Docker's live-restore is on: dev containers keep running while Docker restarts or is upgraded.");
        }
        Ok(DaemonInfo {
            live_restore: false,
        }) => {
            warn!(%node, live_restore = false,
                  "Docker's live-restore is off: a restart or upgrade of Docker stops every dev container and fails its session; turn it on with {{\"live-restore\": true}} in /etc/docker/daemon.json and `systemctl reload docker`.");
        }
        Err(e) => {
            warn!(%node, error = %error_chain(&e),
                  "Cannot ask Docker whether its live-restore is on.");
        }
    }
}

/// The firewall rules, address pool and limit ceiling of the node's dev containers. The rules
/// are checked (and installed) now, so a node that cannot isolate its containers says so at
/// once; the agent still starts (it reports, and serves the containers that run), but starts no
/// container until the rules are in place (checked again every sync).
async fn node_guard(
    config: &Config,
    runtime: &dyn ContainerRuntime,
) -> anyhow::Result<reconcile::NodeGuard> {
    let firewall = network::iptables::Iptables::with_program(
        &config.node_name,
        &config.network,
        &config.iptables,
    );
    match firewall.ensure().await {
        Ok(_) => info!(node = %config.node_name, interfaces = %firewall.rules().interfaces,
                       "Firewall rules of session networks in place."),
        Err(e) => error!(node = %config.node_name, error = %error_chain(&e),
                         "Cannot apply the firewall rules of session networks; no dev container will start until they are."),
    }
    let resources = runtime
        .node_resources()
        .await
        .context("reading the node's CPUs and memory from Docker")?;
    let ceiling = runtime::LimitCeiling::for_node(resources, config.reserved);
    info!(node = %config.node_name, max_millicpus = ceiling.millicpus,
          max_memory = %ongrid_core::MemorySize(ceiling.memory_bytes),
          "Session limits leave room for the node ([reserved]).");
    Ok(reconcile::NodeGuard {
        firewall: Arc::new(firewall),
        subnet_pool: config.network.subnet_pool,
        ceiling,
        storage: Arc::new(config.storage.clone()),
    })
}

/// The agent's parts, built by [`run`] from the config (tests build them directly).
pub struct Agent {
    pub node: NodeName,
    pub gpus: Arc<dyn GpuBackend>,
    pub runtime: Arc<dyn ContainerRuntime>,
    pub manager: AgentRoutes,
    /// Sent to the manager in the registration: where the gateway reaches the stream endpoint.
    pub stream_url: Option<String>,
    /// The image store for freezes (`[images]`); `None`: freeze orders fail, saying so.
    pub images: Option<freeze::ImagesConfig>,
    /// Where batch jobs find their images and keep their files; `None`: jobs fail, saying so.
    pub jobs: Option<jobs::JobsConfig>,
    /// Network isolation and limits of the dev containers.
    pub guard: reconcile::NodeGuard,
    /// What `/readyz` answers: set by every sync.
    pub readiness: metrics::Readiness,
    /// How many container operations of a pass run at once (`[containers]`).
    pub parallel_operations: std::num::NonZeroUsize,
}

/// What the sync loop remembers between syncs.
struct LoopState {
    /// The inventory the manager was last given by `register`; `None` before the first.
    registered: Option<Vec<GpuInfo>>,
    /// The last inventory discovery gave, reported while discovery fails.
    last_gpus: Vec<GpuInfo>,
    manager_outage: Outage,
    docker_outage: Outage,
    gpu_outage: Outage,
    backoff: Backoff,
    /// CPU samples of the running dev containers between syncs.
    activity: activity::ActivitySampler,
    /// The next sync reports what the last convergence changed: it skips the activity
    /// sample, since people wait for the containers just started and, where the CPU counters
    /// come from Docker's stats (an agent that cannot read the host's cgroups), Docker answers
    /// them only at its next collection (about 1 s).
    report_promptly: bool,
    /// Runs the manager's freeze orders.
    freezer: Arc<freeze::Freezer>,
    /// Runs the manager's batch jobs.
    jobs: jobs::Jobs,
    /// The version of the desired state last converged to (`None`: not known).
    applied: Option<String>,
    /// The MIG layouts made or failed, and the GPUs waiting to drain for one.
    mig: gpu::mig::MigLayouts,
    /// A MIG layout was made (or failed) in the last convergence: report it at once.
    mig_changed: bool,
}

impl Agent {
    /// The sync loop: every interval, discover GPUs, observe containers, report them to the
    /// manager, and converge to the desired state it answers. When the manager or Docker cannot
    /// be reached nothing is touched and the sync is retried with backoff.
    pub async fn run(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let gpu_access = if self.gpus.needs_nvidia_runtime() {
            GpuAccess::NvidiaDeviceRequest
        } else {
            GpuAccess::EnvironmentOnly
        };
        let mut reconciler = Reconciler::new(
            self.runtime.clone(),
            self.node.clone(),
            gpu_access,
            self.guard.clone(),
        )
        .with_parallel_operations(self.parallel_operations);
        let mut state = self.loop_state(gpu_access);
        info!(node = %self.node, gpu_backend = self.gpus.kind(), "Agent started.");
        let (pushed_sender, mut pushed) = watch::channel(None);
        let mut watcher = None;
        let (exit_sender, mut exits) = watch::channel(0u64);
        let mut output = state.jobs.output_written();
        let exit_watcher = tokio::spawn(watch_exits(
            self.runtime.clone(),
            self.node.clone(),
            exit_sender,
            shutdown.clone(),
        ));
        // Syncs in a row that followed the one before at once.
        let mut follow_ups = 0;
        'syncs: while !shutdown.is_cancelled() {
            // Output written from here on is in this sync's report, or calls for the next.
            output.mark_unchanged();
            let sync_started = tokio::time::Instant::now();
            let delay = self.sync_once(&mut reconciler, &mut state, &shutdown).await;
            if watcher.is_none() && state.registered.is_some() {
                watcher = Some(tokio::spawn(watch_desired(
                    self.manager.clone(),
                    self.node.clone(),
                    pushed_sender.clone(),
                    shutdown.clone(),
                )));
            }
            // It changed containers: report them at once.
            let acted = reconciler.acted() > 0 || std::mem::take(&mut state.mig_changed);
            // A pass that spent its budget left operations for the next: report what it did,
            // then go on at once (each such pass starts operations, so this ends).
            let delay = if reconciler.deferred() > 0 {
                state.report_promptly = true;
                Duration::ZERO
            } else if acted && follow_ups < MAX_FOLLOW_UPS {
                follow_ups += 1;
                state.report_promptly = true;
                Duration::ZERO
            } else {
                follow_ups = 0;
                jittered(delay)
            };
            let mut next_sync = tokio::time::Instant::now() + delay;
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => break 'syncs,
                    () = tokio::time::sleep_until(next_sync) => break,
                    // A container stopped: report it now. The watcher ends only with
                    // `shutdown`, so `changed` cannot fail before.
                    Ok(()) = exits.changed() => break,
                    // A job wrote output (or all of it is in): report it soon, unless the
                    // manager or Docker is out (then the backoff decides). `state` owns the
                    // sender: `changed` cannot fail before the loop ends.
                    Ok(()) = output.changed() => {
                        if !state.manager_outage.ongoing() && !state.docker_outage.ongoing() {
                            next_sync = next_sync.min(sync_started + OUTPUT_PUSH_GAP);
                        }
                    }
                    // The sender lives as long as this loop: `changed` cannot fail.
                    Ok(()) = pushed.changed() => {
                        let Some(versioned) = pushed.borrow_and_update().clone() else {
                            continue;
                        };
                        if self.apply_pushed(&mut reconciler, &mut state, versioned).await {
                            // Report what it started or stopped (or its jobs and freezes) at
                            // once; new versions come only from changes in the manager.
                            state.report_promptly = true;
                            break;
                        }
                    }
                }
            }
        }
        if let Some(watcher) = watcher {
            // It ends with `shutdown`.
            let _ = watcher.await;
        }
        let _ = exit_watcher.await;
        self.wind_down(&state).await;
        Ok(())
    }

    /// What the sync loop keeps from one sync to the next, as it starts.
    fn loop_state(&self, gpu_access: GpuAccess) -> LoopState {
        LoopState {
            registered: None,
            last_gpus: Vec::new(),
            manager_outage: Outage::default(),
            docker_outage: Outage::default(),
            gpu_outage: Outage::default(),
            backoff: Backoff::default(),
            activity: activity::ActivitySampler::new(),
            report_promptly: false,
            freezer: Arc::new(freeze::Freezer::new(
                self.runtime.clone(),
                self.node.clone(),
                self.images.clone(),
            )),
            jobs: jobs::Jobs::new(
                self.runtime.clone(),
                self.node.clone(),
                gpu_access,
                self.guard.clone(),
                self.jobs.clone(),
            ),
            applied: None,
            mig: gpu::mig::MigLayouts::default(),
            mig_changed: false,
        }
    }

    /// At shutdown: running freezes failed and cleaned up (the next agent reports them
    /// failed), the firewall released when nothing is left to isolate.
    async fn wind_down(&self, state: &LoopState) {
        state.freezer.cancel_all(freeze::AGENT_RESTARTED);
        if tokio::time::timeout(FREEZE_SHUTDOWN_GRACE, state.freezer.close())
            .await
            .is_err()
        {
            warn!("Some freezes did not stop within 30 s of stopping.");
        }
        self.release_firewall().await;
        info!(node = %self.node, "Agent stopped; dev containers are left as they are.");
    }

    /// At shutdown: the firewall rules go when no dev or job container is left on the node;
    /// otherwise they stay, so that the containers left stay isolated until the next agent.
    async fn release_firewall(&self) {
        let left = match (self.runtime.list().await, self.runtime.list_jobs().await) {
            (Ok(sessions), Ok(jobs)) => sessions.len() + jobs.len(),
            (Err(e), _) | (_, Err(e)) => {
                warn!(node = %self.node, error = %error_chain(&e), "Cannot list this node's containers; its firewall rules stay in place.");
                return;
            }
        };
        if left > 0 {
            info!(node = %self.node, containers = left, "Firewall rules stay in place for the containers left on this node.");
            return;
        }
        match self.guard.firewall.remove().await {
            Ok(()) => {
                info!(node = %self.node, "No container left on this node: its firewall rules are removed.")
            }
            Err(e) => {
                warn!(node = %self.node, error = %error_chain(&e), "Cannot remove this node's firewall rules.")
            }
        }
    }

    /// One sync; returns how long to wait before the next.
    async fn sync_once(
        &self,
        reconciler: &mut Reconciler,
        state: &mut LoopState,
        shutdown: &CancellationToken,
    ) -> Duration {
        let mut times = SyncTimes::start();
        let gpus = self.discover_gpus(state).await;
        times.ended(Phase::Gpus);
        let containers = match reconciler.observe().await {
            Ok(containers) => {
                if state.docker_outage.succeeded() > 0 {
                    info!(node = %self.node, "Docker answers again.");
                    // It may have been restarted with other settings.
                    report_live_restore(&self.node, &*self.runtime).await;
                }
                containers
            }
            Err(e) => {
                self.readiness
                    .set(Err(format!("Docker does not answer: {}", error_chain(&e))));
                if state.docker_outage.failed() {
                    error!(node = %self.node, error = %error_chain(&e),
                           "Cannot list containers; not syncing until Docker answers.");
                }
                return state.backoff.next_delay();
            }
        };
        times.ended(Phase::Containers);

        // An empty list changes nothing at the manager: the sessions keep their last samples.
        let activity = if std::mem::take(&mut state.report_promptly) {
            Vec::new()
        } else {
            state
                .activity
                .sample(
                    &*self.runtime,
                    reconciler.last_observed(),
                    &gpus,
                    chrono::Utc::now(),
                )
                .await
        };
        times.ended(Phase::Activity);
        let exchange = self.exchange(state, gpus, containers, activity);
        let answer = tokio::select! {
            answer = exchange => answer,
            () = shutdown.cancelled() => return Duration::ZERO,
        };
        times.ended(Phase::Manager);
        let Versioned { desired, version } = match answer {
            Ok(answer) if answer.desired.node == self.node => answer,
            Ok(Versioned { desired, .. }) => {
                self.readiness.set(Err(format!(
                    "the manager answered for node {}, not {}",
                    desired.node, self.node
                )));
                if state.manager_outage.failed() {
                    error!(node = %self.node, answered_for = %desired.node,
                           "The manager answered with another node's desired state; check node_name and the token.");
                }
                return state.backoff.next_delay();
            }
            Err(e) => {
                self.readiness.set(Err(format!(
                    "cannot sync with the manager: {}",
                    error_chain(&e)
                )));
                if let Some(status) = e.status() {
                    if matches!(status, StatusCode::NOT_FOUND | StatusCode::CONFLICT) {
                        // The manager may have forgotten the node: register again.
                        state.registered = None;
                    }
                }
                if state.manager_outage.failed() {
                    warn!(node = %self.node, error = %error_chain(&e),
                          "Cannot sync with the manager; containers are left as they are until it answers.");
                }
                return state.backoff.next_delay();
            }
        };
        let failures = state.manager_outage.succeeded();
        if failures > 0 {
            info!(node = %self.node, failures, "Synced with the manager again.");
        }
        state.backoff.reset();
        self.readiness.set(Ok(()));

        self.converge(reconciler, state, &desired).await;
        state.applied = version;
        times.ended(Phase::Converge);
        self.log_times(&times);
        Duration::from_secs(desired.sync_interval_secs).clamp(MIN_SYNC_INTERVAL, MAX_SYNC_INTERVAL)
    }

    /// The node's GPUs as discovered now, MIG changes marked; the last inventory seen, its
    /// utilisation unknown, when discovery fails.
    async fn discover_gpus(&self, state: &mut LoopState) -> Vec<GpuInfo> {
        match self.gpus.discover().await {
            Ok(gpus) => {
                if state.gpu_outage.succeeded() > 0 {
                    info!(node = %self.node, "GPU discovery works again.");
                }
                let mut gpus = gpus;
                state.mig.mark(&mut gpus);
                state.last_gpus = gpus.clone();
                gpus
            }
            Err(e) => {
                if state.gpu_outage.failed() {
                    warn!(node = %self.node, error = %error_chain(&e),
                      "GPU discovery failed; reporting the last inventory seen.");
                }
                // Its utilisation is stale: unknown rather than kept.
                inventory(&state.last_gpus)
            }
        }
    }

    /// A sync slower than [`sync_times::SLOW_SYNC`] is a warning naming its slowest phase.
    fn log_times(&self, times: &SyncTimes) {
        let took = times.total().as_secs_f64();
        match times.slowest() {
            Some((slowest, _)) if times.is_slow() => {
                warn!(node = %self.node, took_s = took, slowest = ?slowest, phases = %times,
                      "A sync was slow; the manager declares the node lost when syncs stop for its node_timeout.");
            }
            _ => debug!(node = %self.node, took_s = took, phases = %times, "Synced."),
        }
    }

    /// Converges to a desired state the long-poll brought, unless it is the one converged to
    /// already; `true` when it converged.
    async fn apply_pushed(
        &self,
        reconciler: &mut Reconciler,
        state: &mut LoopState,
        pushed: Versioned,
    ) -> bool {
        if pushed.desired.node != self.node
            || pushed.version.is_none()
            || pushed.version == state.applied
        {
            return false;
        }
        self.converge(reconciler, state, &pushed.desired).await;
        state.applied = pushed.version;
        true
    }

    /// Converges containers, images, freezes and jobs to `desired`.
    async fn converge(
        &self,
        reconciler: &mut Reconciler,
        state: &mut LoopState,
        desired: &DesiredState,
    ) {
        if let Err(e) = reconciler.converge(&desired.sessions).await {
            if state.docker_outage.failed() {
                error!(node = %self.node, error = %error_chain(&e),
                       "Cannot list containers; nothing converged.");
            }
        }
        reconciler.remove_images(&desired.removed_images).await;
        state.freezer.apply(&desired.freezes, &desired.sessions);
        state.jobs.apply(&desired.jobs).await;
        // MIG changes (also with none wanted: a GPU stops waiting, a failure is forgotten).
        // Held: by a session or job the manager placed, or by a container on the node.
        let mut in_use: Vec<GpuId> = desired
            .sessions
            .iter()
            .flat_map(|s| s.gpus.iter().cloned())
            .chain(desired.jobs.iter().flat_map(|j| j.gpus.iter().cloned()))
            .collect();
        in_use.extend(
            reconciler
                .last_observed()
                .iter()
                .filter_map(|c| c.gpus.clone())
                .flatten(),
        );
        let wanted = gpu::mig::MigWanted {
            layouts: &desired.mig_layouts,
            off: &desired.mig_off,
        };
        if state
            .mig
            .apply(&*self.gpus, wanted, &state.last_gpus, &in_use)
            .await
        {
            state.mig_changed = true;
        }
    }

    /// Registers when the inventory changed since the last registration, then syncs.
    async fn exchange(
        &self,
        state: &mut LoopState,
        gpus: Vec<GpuInfo>,
        containers: Vec<ObservedContainer>,
        activity: Vec<ongrid_core::holds::ContainerActivity>,
    ) -> Result<Versioned, ClientError> {
        // Utilisation changes every sync; only the inventory itself calls for a registration.
        if state.registered.as_ref() != Some(&inventory(&gpus)) {
            let registration = RegisterNode {
                node: self.node.clone(),
                agent_version: env!("CARGO_PKG_VERSION").to_owned(),
                gpu_backend: self.gpus.kind().to_owned(),
                gpus: gpus.clone(),
                stream_url: self.stream_url.clone(),
                start_modes: self.gpus.start_modes(),
            };
            self.manager.register(&registration).await?;
            info!(node = %self.node, gpus = gpus.len(), "Registered with the manager.");
            state.registered = Some(inventory(&gpus));
        }
        let report = NodeReport {
            node: self.node.clone(),
            gpus,
            containers,
            activity,
            freezes: state.freezer.report(),
            jobs: state.jobs.report().await,
        };
        self.manager.sync(&report).await
    }
}

/// Keeps a long-poll open on the manager's `GET /v1/agent/desired` and hands every new version
/// of the node's desired state to the sync loop, until `shutdown`. Failures are retried with
/// backoff (logged once per outage); meanwhile the periodic sync converges as before.
async fn watch_desired(
    manager: AgentRoutes,
    node: NodeName,
    pushed: watch::Sender<Option<Versioned>>,
    shutdown: CancellationToken,
) {
    let mut after: Option<String> = None;
    let mut outage = Outage::default();
    let mut backoff = Backoff::default();
    loop {
        let answer = tokio::select! {
            () = shutdown.cancelled() => return,
            answer = manager.desired(after.as_deref(), DESIRED_WAIT) => answer,
        };
        match answer {
            Ok(answer) => {
                if outage.succeeded() > 0 {
                    info!(%node, "Watching the manager for changes again.");
                }
                match answer {
                    // Nothing changed while it waited.
                    None => {
                        backoff.reset();
                        continue;
                    }
                    Some(answer) if answer.version.is_some() && answer.version != after => {
                        backoff.reset();
                        after.clone_from(&answer.version);
                        pushed.send_replace(Some(answer));
                        continue;
                    }
                    // The same version, or none: asking again at once would only spin.
                    Some(_) => {}
                }
            }
            Err(e) => {
                if outage.failed() {
                    warn!(%node, error = %error_chain(&e),
                          "Cannot watch the manager for changes; relying on the periodic sync until it answers.");
                }
            }
        }
        let delay = backoff.next_delay();
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
    }
}

/// Counts the exits of the node's containers the runtime reports, and the breaks of an event
/// stream that was open, until `shutdown`; the sync loop syncs at each. A broken event stream
/// is opened again with backoff.
async fn watch_exits(
    runtime: Arc<dyn ContainerRuntime>,
    node: NodeName,
    exits: watch::Sender<u64>,
    shutdown: CancellationToken,
) {
    let mut backoff = Backoff::default();
    loop {
        let mut events = runtime.exits();
        let opened = tokio::time::Instant::now();
        loop {
            let event = tokio::select! {
                () = shutdown.cancelled() => return,
                event = events.next() => event,
            };
            match event {
                Some(()) => exits.send_modify(|count| *count = count.wrapping_add(1)),
                // A stream that was open broke: Docker may be stopping. The sync that follows
                // at once sees it, so that the reconciler can tell who stopped containers.
                None if opened.elapsed() > Backoff::FIRST => {
                    exits.send_modify(|count| *count = count.wrapping_add(1));
                    break;
                }
                None => break,
            }
        }
        // A stream that lasted a while broke by itself (a Docker restart): open it again soon.
        if opened.elapsed() > Backoff::MAX {
            backoff.reset();
        }
        let delay = backoff.next_delay();
        debug!(%node, ?delay, "Docker's event stream ended; opening it again.");
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
    }
}

/// The GPUs without their utilisation: what registration is about.
fn inventory(gpus: &[GpuInfo]) -> Vec<GpuInfo> {
    gpus.iter()
        .map(|gpu| GpuInfo {
            utilization_percent: None,
            mig_devices: Vec::new(),
            mig_waiting: None,
            ..gpu.clone()
        })
        .collect()
}

/// Consecutive failures of one dependency, so that an outage is logged once, not every sync.
#[derive(Debug, Default)]
pub struct Outage {
    failures: u32,
}

impl Outage {
    /// Records a failure; `true` when it starts an outage (the one to log).
    pub fn failed(&mut self) -> bool {
        self.failures = self.failures.saturating_add(1);
        self.failures == 1
    }

    /// Whether the last attempt failed.
    pub fn ongoing(&self) -> bool {
        self.failures > 0
    }

    /// Records a success; the number of failures of the outage it ends (0 when there was none).
    pub fn succeeded(&mut self) -> u32 {
        std::mem::take(&mut self.failures)
    }
}

/// `delay` moved by up to a tenth either way, at random: the agents of a site that started (or
/// found their manager back) at the same moment drift apart instead of syncing, or retrying, in
/// one burst every interval.
fn jittered(delay: Duration) -> Duration {
    delay.mul_f64(rand::random_range(0.9..1.1))
}

/// Delays between retries: 1 s, doubling up to 60 s, back to 1 s after a success (each moved
/// by [`jittered`] where it is waited).
#[derive(Debug)]
pub struct Backoff {
    next: Duration,
}

impl Backoff {
    pub const FIRST: Duration = Duration::from_secs(1);
    pub const MAX: Duration = Duration::from_secs(60);

    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(Self::MAX);
        delay
    }

    pub fn reset(&mut self) {
        self.next = Self::FIRST;
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Self { next: Self::FIRST }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_a_cap_and_resets() {
        let mut backoff = Backoff::default();
        let delays: Vec<u64> = (0..8).map(|_| backoff.next_delay().as_secs()).collect();
        assert_eq!(delays, [1, 2, 4, 8, 16, 32, 60, 60]);
        backoff.reset();
        assert_eq!(backoff.next_delay(), Duration::from_secs(1));
    }

    #[test]
    fn a_delay_moves_by_at_most_a_tenth_and_not_always_the_same() {
        let delay = Duration::from_secs(5);
        let delays: std::collections::BTreeSet<Duration> =
            (0..200).map(|_| jittered(delay)).collect();
        assert!(
            delays.len() > 100,
            "{} different delays of 200",
            delays.len()
        );
        assert!(
            delays.first() >= Some(&Duration::from_millis(4500)),
            "{delays:?}"
        );
        assert!(
            delays.last() < Some(&Duration::from_millis(5500)),
            "{delays:?}"
        );
        assert_eq!(jittered(Duration::ZERO), Duration::ZERO);
    }

    #[test]
    fn an_outage_is_reported_once() {
        let mut outage = Outage::default();
        assert_eq!(outage.succeeded(), 0);
        assert!(outage.failed());
        assert!(!outage.failed());
        assert!(!outage.failed());
        assert_eq!(outage.succeeded(), 3);
        assert!(outage.failed(), "a new outage is reported again");
    }
}
