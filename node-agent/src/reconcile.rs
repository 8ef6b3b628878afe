//! Converging the node's dev containers to the manager's desired state, and reporting what is
//! there.
//!
//! [`plan`] is the pure decision: from the desired sessions and the containers the runtime
//! sees, the operations to run. [`Reconciler`] runs them on a [`ContainerRuntime`], up to
//! `[containers] parallel_operations` at once (a failure is logged and reported for its session,
//! never fatal to the pass nor in the way of the others), and builds the [`ObservedContainer`]
//! list of the next report.
//!
//! Order within a pass: every stop and removal ends before any creation or start begins (the
//! plan may hand a GPU freed in this pass to another session); the operations of one session
//! (or of one stray container) run one after the other, in the plan's order; networks are
//! removed after the containers. Operations run on `&Reconciler`; what they change in its memory
//! ([`Outcome`]) is applied once their batch is over. A pass starts operations for
//! [`PASS_BUDGET`] only, so that a burst is reported (and its node heard from) as it goes; the
//! rest waits for the next pass, which the agent runs at once, and no creation or start begins
//! in a pass whose stops and removals did not all run. Being level-triggered, it needs no memory to be
//! correct after a restart: containers found by label are adopted, never recreated. Its only
//! memory is which sessions the manager asked to stop, so that their exited containers are
//! started again on release instead of being reported as dead, and which dev containers
//! stopped with the Docker daemon, so that their owners read why ([`describe_docker_stop`]):
//! one first seen dead while Docker accepts no new connection (a stopping dockerd closes its
//! socket first, then stops its containers unless live-restore is on), or one seen running
//! before Docker stopped answering and exited once it answers again.
//!
//! Release onto other GPUs: a held container knows the GPUs it was created with (label
//! `ongrid.gpus`). When its session comes back on the same GPUs it is simply started again
//! (processes restart; files and installed packages stay). On other GPUs it is committed to
//! the node-local image [`held_image`], removed, and created again from that image under the
//! same name, with the same labels and home volume and the new GPUs. A creation always starts
//! from the session's held image when one exists, so a failure half-way loses nothing: the next
//! pass creates the container from it. The held image is removed with the container.

use std::collections::{HashMap, HashSet};
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;

use ongrid_core::api::{
    ContainerLimits, ContainerState, DesiredSession, ObservedContainer, RunState,
};
use ongrid_core::{NodeName, SessionId};
use tracing::{debug, error, info, warn};

use crate::network::{FirewallState, HostFirewall, Ipv4Net, NetworkSpec};
use crate::removed_images::RemovedImages;
use crate::runtime::{
    error_chain, held_image, ContainerRuntime, ContainerSpec, ContainerStatus, DaemonInfo,
    GpuAccess, LimitCeiling, NetworkStatus, RuntimeError,
};
use crate::storage::SiteStorage;

/// How long a dev container gets to stop before it is killed.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a pass goes on starting operations. Those left are for the next pass, after a
/// report: a class of 60 arriving at once takes longer than the manager's `node_timeout` (10 s
/// in tests) to start, and the sessions started meanwhile are waited for.
pub const PASS_BUDGET: Duration = Duration::from_secs(4);

/// How many operations of a pass run at once unless `[containers] parallel_operations` says.
pub const DEFAULT_PARALLEL_OPERATIONS: NonZeroUsize = NonZeroUsize::MIN.saturating_add(7);

/// One step towards the desired state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Operation {
    /// Create the session's container and start it.
    Create(Box<DesiredSession>),
    /// Start the exited container of a session the manager had stopped and now wants running.
    Start {
        session_id: SessionId,
        container_id: String,
    },
    /// Like `Start`, but the session now has other GPUs: commit the container to its held
    /// image, remove it, and create and start it again from that image.
    Recreate {
        session: Box<DesiredSession>,
        container_id: String,
    },
    /// Stop a running container, giving it [`STOP_TIMEOUT`].
    Stop {
        session_id: Option<SessionId>,
        container_id: String,
    },
    /// Remove a container (its home volume stays), then the session's held image when the
    /// container was made from it (`held_image`).
    Remove {
        session_id: Option<SessionId>,
        container_id: String,
        held_image: Option<String>,
    },
    /// Remove the network of a session that is no longer desired (after its container).
    RemoveNetwork {
        session_id: Option<SessionId>,
        network_id: String,
    },
}

impl Operation {
    /// The session whose report carries the operation's failure; `None` for a stray.
    pub fn session_id(&self) -> Option<SessionId> {
        match self {
            Self::Create(s) | Self::Recreate { session: s, .. } => Some(s.session_id),
            Self::Start { session_id, .. } => Some(*session_id),
            Self::Stop { session_id, .. }
            | Self::Remove { session_id, .. }
            | Self::RemoveNetwork { session_id, .. } => *session_id,
        }
    }

    /// Whether it frees what a container holds (its GPUs): stops and removals, which end
    /// before any creation or start of the same pass begins.
    pub fn frees(&self) -> bool {
        matches!(self, Self::Stop { .. } | Self::Remove { .. })
    }

    /// What it acts on, for keeping one session's operations in order: its session, else the
    /// stray container or network.
    fn subject(&self) -> Subject<'_> {
        match self {
            Self::Create(s) | Self::Recreate { session: s, .. } => Subject::Session(s.session_id),
            Self::Start { session_id, .. }
            | Self::Stop {
                session_id: Some(session_id),
                ..
            }
            | Self::Remove {
                session_id: Some(session_id),
                ..
            }
            | Self::RemoveNetwork {
                session_id: Some(session_id),
                ..
            } => Subject::Session(*session_id),
            Self::Stop {
                session_id: None,
                container_id,
            }
            | Self::Remove {
                session_id: None,
                container_id,
                ..
            } => Subject::Other(container_id),
            Self::RemoveNetwork {
                session_id: None,
                network_id,
            } => Subject::Other(network_id),
        }
    }

    /// The operation's name in metrics.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Create(_) => "create",
            Self::Start { .. } => "start",
            Self::Recreate { .. } => "recreate",
            Self::Stop { .. } => "stop",
            Self::Remove { .. } => "remove",
            Self::RemoveNetwork { .. } => "remove_network",
        }
    }
}

/// What an [`Operation`] acts on (see [`Operation::subject`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Subject<'a> {
    Session(SessionId),
    Other(&'a str),
}

/// What a finished operation changes in the [`Reconciler`]'s memory, applied after its batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// Nothing to remember.
    Done,
    /// The session's held container runs again: a later exit is a death, not a hold.
    Resumed(SessionId),
}

/// `operations` as chains, one per [`Subject`], each in the given order; the chains in the order
/// of their first operation.
fn chains(operations: Vec<Operation>) -> Vec<Vec<Operation>> {
    let (of_operation, count) = {
        let mut index: HashMap<Subject<'_>, usize> = HashMap::new();
        let of_operation: Vec<usize> = operations
            .iter()
            .map(|operation| {
                let next = index.len();
                *index.entry(operation.subject()).or_insert(next)
            })
            .collect();
        (of_operation, index.len())
    };
    let mut chains: Vec<Vec<Operation>> = vec![Vec::new(); count];
    for (operation, chain) in operations.into_iter().zip(of_operation) {
        chains[chain].push(operation);
    }
    chains
}

/// The networks to remove: those of sessions no longer desired, and any without a session.
/// A desired session keeps its network while its container is stopped. Run after [`plan`]'s
/// operations, which remove the containers using them.
pub fn stale_networks(desired: &[DesiredSession], networks: &[NetworkStatus]) -> Vec<Operation> {
    let wanted: HashSet<SessionId> = desired.iter().map(|s| s.session_id).collect();
    networks
        .iter()
        .filter(|network| !network.session_id.is_some_and(|id| wanted.contains(&id)))
        .map(|network| Operation::RemoveNetwork {
            session_id: network.session_id,
            network_id: network.id.clone(),
        })
        .collect()
}

/// What the node imposes on every container it runs (dev and batch job containers): the
/// firewall rules their networks need (`crate::network`), where the networks' addresses come
/// from, the ceiling of their CPU and memory limits, and the site storage they mount
/// (`crate::storage`).
#[derive(Clone)]
pub struct NodeGuard {
    pub firewall: Arc<dyn HostFirewall>,
    pub subnet_pool: Ipv4Net,
    pub ceiling: LimitCeiling,
    pub storage: Arc<SiteStorage>,
}

/// The operations that bring `observed` to `desired`, stops and removals first (they free
/// resources), then creations and starts.
///
/// - desired running, absent: create and start.
/// - desired running, created but never started (the agent stopped half-way): remove, create.
/// - desired running, exited: start it only if it is in `resumable` (the manager stopped it and
///   now wants it back) or the manager says the session resumes after a hold — or recreate it
///   when its GPUs differ from the desired ones; otherwise it died by itself and is left as it
///   is, to be reported.
/// - desired stopped, running: stop.
/// - not desired (or not a session's dev container at all): stop if running, then remove.
pub fn plan(
    desired: &[DesiredSession],
    observed: &[ContainerStatus],
    resumable: &HashSet<SessionId>,
) -> Vec<Operation> {
    let wanted: HashSet<SessionId> = desired.iter().map(|s| s.session_id).collect();
    let mut by_session: HashMap<SessionId, &ContainerStatus> = HashMap::new();
    let mut first = Vec::new();
    let mut then = Vec::new();

    for container in observed {
        match container.dev_container_of() {
            Some(id) if wanted.contains(&id) => {
                by_session.insert(id, container);
            }
            session_id => {
                if container.state == ContainerState::Running {
                    first.push(Operation::Stop {
                        session_id,
                        container_id: container.id.clone(),
                    });
                }
                let held_image = session_id
                    .map(held_image)
                    .filter(|held| *held == container.image);
                first.push(Operation::Remove {
                    session_id,
                    container_id: container.id.clone(),
                    held_image,
                });
            }
        }
    }

    for session in desired {
        let id = session.session_id;
        let container = by_session.get(&id);
        match (session.run, container.map(|c| &c.state)) {
            (RunState::Running, None | Some(ContainerState::Missing)) => {
                then.push(Operation::Create(Box::new(session.clone())));
            }
            (RunState::Running, Some(ContainerState::Created)) => {
                if let Some(c) = container {
                    // Its held image, if any, stays: the new container is made from it.
                    first.push(Operation::Remove {
                        session_id: Some(id),
                        container_id: c.id.clone(),
                        held_image: None,
                    });
                }
                then.push(Operation::Create(Box::new(session.clone())));
            }
            (RunState::Running, Some(ContainerState::Exited { .. })) => {
                if let (Some(c), true) = (container, session.resume || resumable.contains(&id)) {
                    if c.gpus.as_ref() == Some(&session.gpus) {
                        then.push(Operation::Start {
                            session_id: id,
                            container_id: c.id.clone(),
                        });
                    } else {
                        then.push(Operation::Recreate {
                            session: Box::new(session.clone()),
                            container_id: c.id.clone(),
                        });
                    }
                }
            }
            (RunState::Stopped, Some(ContainerState::Running)) => {
                if let Some(c) = container {
                    first.push(Operation::Stop {
                        session_id: Some(id),
                        container_id: c.id.clone(),
                    });
                }
            }
            (RunState::Running, Some(ContainerState::Running)) | (RunState::Stopped, _) => {}
        }
    }
    first.extend(then);
    first
}

/// Why a container that should run has stopped, in words for the session's owner.
pub fn describe_exit(
    exit_code: i64,
    oom_killed: bool,
    error: Option<&str>,
    limits: &ContainerLimits,
) -> String {
    if oom_killed {
        format!(
            "the dev container was killed for using more than its memory limit of {} \
             (exit code {exit_code}): start a session with more memory or use less",
            limits.memory
        )
    } else if let Some(error) = error.filter(|e| !e.is_empty()) {
        format!("the dev container failed: {error} (exit code {exit_code})")
    } else if let Some(signal) = exit_code.checked_sub(128).filter(|n| (1..=64).contains(n)) {
        format!(
            "the dev container was killed by {} (exit code {exit_code}) without ongrid asking",
            signal_name(signal)
        )
    } else {
        format!("the dev container stopped by itself with exit code {exit_code}")
    }
}

/// Why a dev container that stopped with the node's Docker daemon stopped, for its owner.
pub fn describe_docker_stop(exit_code: i64) -> String {
    format!(
        "the dev container stopped (exit code {exit_code}) when the node's Docker daemon stopped \
         or restarted, which stops every container unless Docker's live-restore is on: start a \
         new session, and ask the site's admins to turn live-restore on"
    )
}

/// `SIGKILL` for 9, and so on for the signals that usually end a container; `signal N` else.
fn signal_name(signal: i64) -> String {
    let name = match signal {
        1 => "SIGHUP",
        2 => "SIGINT",
        6 => "SIGABRT",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        15 => "SIGTERM",
        _ => return format!("signal {signal}"),
    };
    name.to_owned()
}

/// Runs [`plan`]s on a runtime and reports what it sees. See the module documentation.
pub struct Reconciler {
    runtime: Arc<dyn ContainerRuntime>,
    node: NodeName,
    gpu_access: GpuAccess,
    guard: NodeGuard,
    /// Why the firewall rules are not in place, as of this pass's check; containers are not
    /// started while it is `Some`.
    firewall_problem: Option<String>,
    /// Whether the rules have been seen in place once (later reinstalls are warned about).
    firewall_checked: bool,
    /// The desired sessions of the last pass.
    desired: Vec<DesiredSession>,
    /// Sessions the manager asked to stop: their exited containers may be started again.
    resumable: HashSet<SessionId>,
    /// Problems of the last pass, by session, reported with the next observation.
    problems: HashMap<SessionId, String>,
    /// Sessions whose container has been seen dead (logged once).
    seen_dead: HashSet<SessionId>,
    /// Sessions whose dead container stopped with the Docker daemon (see
    /// [`Reconciler::observe`]).
    stopped_with_docker: HashSet<SessionId>,
    /// The last listing failed: Docker was away.
    docker_was_away: bool,
    /// The containers as the last [`Reconciler::observe`] saw them.
    observed: Vec<ContainerStatus>,
    /// How many operations the last [`Reconciler::converge`] carried out.
    acted: usize,
    /// How many chains of operations the last [`Reconciler::converge`] left for the next pass.
    deferred: usize,
    /// Untags the Docker images of frozen images the manager says were removed.
    removed_images: RemovedImages,
    /// How many operations of a pass run at once (`[containers] parallel_operations`).
    parallel_operations: NonZeroUsize,
    /// How long a pass starts operations ([`PASS_BUDGET`]).
    pass_budget: Duration,
}

impl Reconciler {
    pub fn new(
        runtime: Arc<dyn ContainerRuntime>,
        node: NodeName,
        gpu_access: GpuAccess,
        guard: NodeGuard,
    ) -> Self {
        Self {
            node,
            gpu_access,
            guard,
            firewall_problem: Some("the firewall rules have not been checked yet".to_owned()),
            firewall_checked: false,
            desired: Vec::new(),
            resumable: HashSet::new(),
            problems: HashMap::new(),
            seen_dead: HashSet::new(),
            stopped_with_docker: HashSet::new(),
            docker_was_away: false,
            observed: Vec::new(),
            acted: 0,
            removed_images: RemovedImages::new(runtime.clone()),
            runtime,
            parallel_operations: DEFAULT_PARALLEL_OPERATIONS,
            pass_budget: PASS_BUDGET,
            deferred: 0,
        }
    }

    /// Starts operations for `pass_budget` in a pass instead of [`PASS_BUDGET`].
    #[must_use]
    pub fn with_pass_budget(mut self, pass_budget: Duration) -> Self {
        self.pass_budget = pass_budget;
        self
    }

    /// Runs up to `parallel_operations` operations of a pass at once (1: one at a time).
    #[must_use]
    pub fn with_parallel_operations(mut self, parallel_operations: NonZeroUsize) -> Self {
        self.parallel_operations = parallel_operations;
        self
    }

    /// Removes from the node the Docker images of the frozen images in `removed`
    /// (`DesiredState::removed_images`); failures are logged and retried on the next call.
    pub async fn remove_images(&mut self, removed: &[String]) {
        self.removed_images.remove(removed).await;
    }

    /// How many operations (creations, starts, stops, removals) the last
    /// [`Reconciler::converge`] carried out; failed ones do not count.
    pub fn acted(&self) -> usize {
        self.acted
    }

    /// How many sessions' (or strays') operations the last [`Reconciler::converge`] left for
    /// the next pass, its budget spent; the next pass should come at once.
    pub fn deferred(&self) -> usize {
        self.deferred
    }

    /// The containers as the last [`Reconciler::observe`] saw them (for activity sampling).
    pub fn last_observed(&self) -> &[ContainerStatus] {
        &self.observed
    }

    /// One pass: looks at the containers, plans, and runs the operations, starting new ones for
    /// its budget ([`Reconciler::deferred`] counts those left). Fails only when the runtime
    /// cannot list the containers (then nothing is touched).
    pub async fn converge(&mut self, desired: &[DesiredSession]) -> Result<(), RuntimeError> {
        self.acted = 0;
        self.deferred = 0;
        let deadline = tokio::time::Instant::now() + self.pass_budget;
        let observed = self.runtime.list().await.inspect_err(|_| {
            self.docker_was_away = true;
        })?;
        let wanted: HashSet<SessionId> = desired.iter().map(|s| s.session_id).collect();
        self.resumable.retain(|id| wanted.contains(id));
        self.resumable.extend(
            desired
                .iter()
                .filter(|s| s.run == RunState::Stopped)
                .map(|s| s.session_id),
        );
        self.desired = desired.to_vec();
        let previous = std::mem::take(&mut self.problems);
        self.check_firewall().await;
        let networks = self.runtime.list_networks().await?;

        // Stops and removals first, all of them: a GPU they free may be the one a creation of
        // this pass is given. Network removals go with the second batch, after the containers.
        let (freeing, starting): (Vec<Operation>, Vec<Operation>) =
            plan(desired, &observed, &self.resumable)
                .into_iter()
                .chain(stale_networks(desired, &networks))
                .partition(Operation::frees);
        let mut started_any = false;
        for batch in [freeing, starting] {
            if self.deferred > 0 {
                // Not every stop and removal ran: what they free is not free yet.
                self.deferred += chains(batch).len();
                continue;
            }
            let chains = chains(batch);
            let count = chains.len();
            let (results, deferred) = self.run_batch(chains, deadline, !started_any).await;
            started_any |= deferred < count;
            self.deferred = deferred;
            for (session_id, result) in results {
                match result {
                    Ok(outcome) => {
                        self.acted += 1;
                        if let Outcome::Resumed(id) = outcome {
                            self.resumable.remove(&id);
                        }
                    }
                    Err(e) => {
                        let problem = error_chain(&e);
                        let Some(id) = session_id else {
                            warn!(error = %problem, "Could not clean up a stray ongrid container or network.");
                            continue;
                        };
                        if previous.get(&id) == Some(&problem) {
                            debug!(session = %id, error = %problem, "Operation failed again.");
                        } else {
                            warn!(session = %id, error = %problem, "Operation on a dev container failed.");
                        }
                        self.problems.insert(id, problem);
                    }
                }
            }
        }
        Ok(())
    }

    /// Runs the chains of operations ([`chains`]), up to `parallel_operations` at once, those
    /// of one chain one after the other (each whatever the previous one's result), starting none
    /// after `deadline`
    /// (but one with `start_one`, so that every pass gets on); each result with the session it
    /// belongs to, in the order they end, and how many sessions' operations were not started.
    async fn run_batch(
        &self,
        chains: Vec<Vec<Operation>>,
        deadline: tokio::time::Instant,
        start_one: bool,
    ) -> (
        Vec<(Option<SessionId>, Result<Outcome, RuntimeError>)>,
        usize,
    ) {
        let total = chains.len();
        let mut started = 0;
        let results = futures::stream::iter(chains)
            .take_while(|_| {
                let start = (start_one && started == 0) || tokio::time::Instant::now() < deadline;
                started += usize::from(start);
                std::future::ready(start)
            })
            .map(|chain| async move {
                let mut results = Vec::with_capacity(chain.len());
                for operation in chain {
                    let session_id = operation.session_id();
                    results.push((session_id, self.execute(operation).await));
                }
                results
            })
            .buffer_unordered(self.parallel_operations.get())
            .flat_map(futures::stream::iter)
            .collect()
            .await;
        (results, total - started)
    }

    /// Checks the firewall rules (reinstalling what is missing) and remembers the outcome.
    async fn check_firewall(&mut self) {
        match self.guard.firewall.ensure().await {
            Ok(state) => {
                if self.firewall_checked && state == FirewallState::Installed {
                    warn!(node = %self.node, "The firewall rules of session networks were missing or changed; installed them again.");
                } else if self.firewall_problem.is_some() {
                    info!(node = %self.node, "Firewall rules of session networks in place.");
                }
                self.firewall_problem = None;
                self.firewall_checked = true;
            }
            Err(e) => {
                let problem = error_chain(&e);
                if self.firewall_problem.as_deref() != Some(problem.as_str()) {
                    error!(node = %self.node, error = %problem,
                           "Cannot apply the firewall rules of session networks; no dev container is started until they are.");
                }
                self.firewall_problem = Some(problem);
            }
        }
    }

    /// Before a container starts: the firewall rules are in place and its network exists.
    async fn isolate(&self, session_id: SessionId) -> Result<(), RuntimeError> {
        if let Some(problem) = &self.firewall_problem {
            return Err(RuntimeError::Setup {
                action: "isolating the session's network".to_owned(),
                problem: problem.clone(),
            });
        }
        let network = NetworkSpec::for_session(&self.node, session_id, self.guard.subnet_pool);
        self.runtime.ensure_network(&network).await
    }

    async fn execute(&self, operation: Operation) -> Result<Outcome, RuntimeError> {
        let name = operation.name();
        let started = std::time::Instant::now();
        let result = self.execute_untimed(operation).await;
        crate::metrics::events().container_operation(name, started.elapsed(), result.is_ok());
        result
    }

    async fn execute_untimed(&self, operation: Operation) -> Result<Outcome, RuntimeError> {
        let mut outcome = Outcome::Done;
        match operation {
            Operation::Create(session) => {
                let spec = self.create_and_start(&session).await?;
                info!(session = %session.session_id, name = %session.name, user = %session.user.name,
                      container = %spec.name, image = %spec.image, "Dev container started.");
            }
            Operation::Recreate {
                session,
                container_id,
            } => {
                let id = session.session_id;
                let held = held_image(id);
                self.isolate(id).await?;
                // Until the commit succeeded the old container is the only copy: keep it.
                self.runtime.commit_to_image(&container_id, &held).await?;
                self.runtime.remove(&container_id).await?;
                let spec = self.create_and_start(&session).await?;
                outcome = Outcome::Resumed(id);
                info!(session = %id, name = %session.name, container = %spec.name,
                      gpus = %ongrid_core::api::visible_devices(&session.gpus), image = %held,
                      "Dev container created again on other GPUs, with its files.");
            }
            Operation::Start {
                session_id,
                container_id,
            } => {
                self.isolate(session_id).await?;
                self.runtime.start(&container_id).await?;
                outcome = Outcome::Resumed(session_id);
                info!(session = %session_id, container = %container_id, "Dev container started again.");
            }
            Operation::Stop {
                session_id,
                container_id,
            } => {
                self.runtime.stop(&container_id, STOP_TIMEOUT).await?;
                info!(session = ?session_id, container = %container_id, "Dev container stopped.");
            }
            Operation::Remove {
                session_id,
                container_id,
                held_image,
            } => {
                self.runtime.remove(&container_id).await?;
                info!(session = ?session_id, container = %container_id, "Container removed.");
                if let Some(held) = held_image {
                    self.runtime.untag_image(&held).await?;
                    info!(session = ?session_id, image = %held, "Held image removed.");
                }
            }
            Operation::RemoveNetwork {
                session_id,
                network_id,
            } => {
                self.runtime.remove_network(&network_id).await?;
                info!(session = ?session_id, network = %network_id, "Session network removed.");
            }
        }
        Ok(outcome)
    }

    /// Creates the session's container — from its held image when there is one (a release onto
    /// other GPUs that failed half-way), else from the session's image — and starts it.
    async fn create_and_start(
        &self,
        session: &DesiredSession,
    ) -> Result<ContainerSpec, RuntimeError> {
        self.isolate(session.session_id).await?;
        let mut spec = ContainerSpec::for_session(&self.node, session, self.gpu_access);
        spec.limits = self.guard.ceiling.cap(spec.limits);
        self.guard.storage.apply(&mut spec);
        let held = held_image(session.session_id);
        if self.runtime.image_exists(&held).await? {
            spec.image = held;
        }
        let id = self.runtime.create(&spec).await?;
        self.runtime.start(&id).await?;
        Ok(spec)
    }

    /// The desired session of an exited dev container that should run and that ongrid did not
    /// stop: a container that died by itself, or with the Docker daemon.
    fn dead_unasked(&self, container: &ContainerStatus) -> Option<&DesiredSession> {
        let id = container.dev_container_of()?;
        if !matches!(container.state, ContainerState::Exited { .. }) {
            return None;
        }
        self.desired.iter().find(|s| {
            s.session_id == id
                && s.run == RunState::Running
                && !s.resume
                && !self.resumable.contains(&id)
        })
    }

    /// Docker did not answer for a while and answers again: the dev containers seen running
    /// before and exited now stopped while it was away, with it, unless its live-restore is on
    /// (then Docker stops none when it stops).
    async fn note_stopped_while_away(&mut self, before: &[ContainerStatus]) {
        if let Ok(DaemonInfo { live_restore: true }) = self.runtime.daemon().await {
            return;
        }
        let stopped: Vec<SessionId> = self
            .observed
            .iter()
            .filter(|c| self.dead_unasked(c).is_some())
            .filter(|c| {
                before
                    .iter()
                    .any(|b| b.id == c.id && b.state == ContainerState::Running)
            })
            .filter_map(ContainerStatus::dev_container_of)
            .collect();
        self.stopped_with_docker.extend(stopped);
    }

    /// Dev containers seen dead for the first time while Docker accepts no new connection
    /// stopped with it: a stopping dockerd closes its socket first, then stops every container
    /// (without live-restore), while the connections it had still answer.
    async fn note_stopped_by_stopping_docker(&mut self) {
        let newly_dead: Vec<SessionId> = self
            .observed
            .iter()
            .filter(|c| self.dead_unasked(c).is_some())
            .filter_map(ContainerStatus::dev_container_of)
            .filter(|id| !self.seen_dead.contains(id) && !self.stopped_with_docker.contains(id))
            .collect();
        if !newly_dead.is_empty() && self.runtime.daemon().await.is_err() {
            self.stopped_with_docker.extend(newly_dead);
        }
    }

    /// Every dev container of the node as the manager should see it, with the problems of the
    /// last pass; a session that should run but has no container and a problem is `Missing`.
    pub async fn observe(&mut self) -> Result<Vec<ObservedContainer>, RuntimeError> {
        let observed = match self.runtime.list().await {
            Ok(observed) => observed,
            Err(e) => {
                self.docker_was_away = true;
                return Err(e);
            }
        };
        let before = std::mem::replace(&mut self.observed, observed.clone());
        if std::mem::take(&mut self.docker_was_away) {
            self.note_stopped_while_away(&before).await;
        }
        self.note_stopped_by_stopping_docker().await;
        let mut report = Vec::new();
        let mut dead = HashSet::new();
        for container in &observed {
            let Some(id) = container.dev_container_of() else {
                continue;
            };
            let mut error = self.problems.get(&id).cloned();
            if let (
                ContainerState::Exited {
                    exit_code,
                    oom_killed,
                    error: docker_error,
                },
                Some(session),
            ) = (&container.state, self.dead_unasked(container))
            {
                let why = if self.stopped_with_docker.contains(&id) {
                    describe_docker_stop(*exit_code)
                } else {
                    describe_exit(
                        *exit_code,
                        *oom_killed,
                        docker_error.as_deref(),
                        &session.limits,
                    )
                };
                if !self.seen_dead.contains(&id) {
                    warn!(session = %id, container = %container.id, reason = %why,
                          "Dev container stopped without ongrid asking; it is not restarted.");
                }
                dead.insert(id);
                error.get_or_insert(why);
            }
            report.push(ObservedContainer {
                session_id: id,
                container_id: container.id.clone(),
                state: container.state.clone(),
                error,
            });
        }
        self.stopped_with_docker.retain(|id| dead.contains(id));
        self.seen_dead = dead;
        for session in &self.desired {
            let id = session.session_id;
            if session.run != RunState::Running || report.iter().any(|c| c.session_id == id) {
                continue;
            }
            if let Some(problem) = self.problems.get(&id) {
                report.push(ObservedContainer {
                    session_id: id,
                    container_id: String::new(),
                    state: ContainerState::Missing,
                    error: Some(problem.clone()),
                });
            }
        }
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::network::fake::FakeFirewall;
    use crate::runtime::fake::{desired_session, FakeRuntime};
    use ongrid_core::GpuId;
    use std::sync::atomic::Ordering;

    const GPU: &str = "GPU-11111111-2222-3333-4444-555555555501";
    const OTHER_GPU: &str = "GPU-11111111-2222-3333-4444-555555555502";

    fn status(session: &DesiredSession, id: &str, state: ContainerState) -> ContainerStatus {
        ContainerStatus {
            id: id.into(),
            name: session.session_id.container_name(),
            session_id: Some(session.session_id),
            state,
            image: session.image.clone(),
            gpus: Some(session.gpus.clone()),
            pid: None,
        }
    }

    fn exited(code: i64) -> ContainerState {
        ContainerState::Exited {
            exit_code: code,
            oom_killed: false,
            error: None,
        }
    }

    fn stopped(mut session: DesiredSession) -> DesiredSession {
        session.run = RunState::Stopped;
        session
    }

    #[test]
    fn plan_creates_what_is_missing_and_keeps_what_runs() {
        let a = desired_session(&[GPU]);
        let b = desired_session(&[]);
        let observed = [status(&b, "cb", ContainerState::Running)];
        let ops = plan(&[a.clone(), b], &observed, &HashSet::new());
        assert_eq!(ops, vec![Operation::Create(Box::new(a))]);
    }

    #[test]
    fn plan_never_restarts_a_container_that_died() {
        let a = desired_session(&[GPU]);
        let observed = [status(&a, "ca", exited(137))];
        assert_eq!(plan(&[a], &observed, &HashSet::new()), vec![]);
    }

    #[test]
    fn plan_starts_a_held_container_again_when_resumable() {
        let a = desired_session(&[GPU]);
        let observed = [status(&a, "ca", exited(143))];
        let resumable = HashSet::from([a.session_id]);
        assert_eq!(
            plan(std::slice::from_ref(&a), &observed, &resumable),
            vec![Operation::Start {
                session_id: a.session_id,
                container_id: "ca".into()
            }]
        );
    }

    #[test]
    fn plan_starts_a_resuming_session_the_agent_did_not_stop_itself() {
        // The agent restarted while the session was held, so `resumable` is empty; the manager
        // says the session resumes.
        let a = DesiredSession {
            resume: true,
            ..desired_session(&[GPU])
        };
        let observed = [status(&a, "ca", exited(143))];
        assert_eq!(
            plan(std::slice::from_ref(&a), &observed, &HashSet::new()),
            vec![Operation::Start {
                session_id: a.session_id,
                container_id: "ca".into()
            }]
        );
        let dead = DesiredSession {
            resume: false,
            ..a.clone()
        };
        assert_eq!(plan(&[dead], &observed, &HashSet::new()), vec![]);
    }

    #[test]
    fn plan_recreates_a_held_container_whose_gpus_changed() {
        let before = desired_session(&[GPU]);
        let after = DesiredSession {
            gpus: vec![GpuId::parse(OTHER_GPU).unwrap()],
            ..before.clone()
        };
        let resumable = HashSet::from([before.session_id]);
        let observed = [status(&before, "ca", exited(143))];
        assert_eq!(
            plan(std::slice::from_ref(&after), &observed, &resumable),
            vec![Operation::Recreate {
                session: Box::new(after.clone()),
                container_id: "ca".into()
            }]
        );
        // A container from before the `ongrid.gpus` label: its GPUs are unknown, so it is
        // recreated too (its files are kept either way).
        let unlabelled = ContainerStatus {
            gpus: None,
            ..status(&before, "ca", exited(143))
        };
        assert_eq!(
            plan(std::slice::from_ref(&before), &[unlabelled], &resumable),
            vec![Operation::Recreate {
                session: Box::new(before.clone()),
                container_id: "ca".into()
            }]
        );
        // A death is still a death, whatever the GPUs.
        assert_eq!(plan(&[after], &observed, &HashSet::new()), vec![]);
    }

    #[test]
    fn plan_removes_the_held_image_with_its_container() {
        let gone = desired_session(&[GPU]);
        let observed = [ContainerStatus {
            image: held_image(gone.session_id),
            ..status(&gone, "cg", exited(143))
        }];
        assert_eq!(
            plan(&[], &observed, &HashSet::new()),
            vec![Operation::Remove {
                session_id: Some(gone.session_id),
                container_id: "cg".into(),
                held_image: Some(held_image(gone.session_id)),
            }]
        );
    }

    #[test]
    fn plan_recreates_a_container_that_never_started() {
        let a = desired_session(&[GPU]);
        let observed = [status(&a, "ca", ContainerState::Created)];
        assert_eq!(
            plan(std::slice::from_ref(&a), &observed, &HashSet::new()),
            vec![
                Operation::Remove {
                    session_id: Some(a.session_id),
                    container_id: "ca".into(),
                    held_image: None,
                },
                Operation::Create(Box::new(a)),
            ]
        );
    }

    #[test]
    fn plan_stops_what_should_be_stopped_and_keeps_it() {
        let a = stopped(desired_session(&[GPU]));
        let b = stopped(desired_session(&[]));
        let c = stopped(desired_session(&[]));
        let observed = [
            status(&a, "ca", ContainerState::Running),
            status(&b, "cb", exited(143)),
        ];
        assert_eq!(
            plan(&[a.clone(), b, c], &observed, &HashSet::new()),
            vec![Operation::Stop {
                session_id: Some(a.session_id),
                container_id: "ca".into()
            }]
        );
    }

    #[test]
    fn plan_removes_undesired_and_stray_containers_first() {
        let gone = desired_session(&[]);
        let kept = desired_session(&[GPU]);
        let helper = ContainerStatus {
            id: "helper".into(),
            name: "ongrid-chown-1".into(),
            session_id: None,
            state: exited(0),
            image: "ongrid/dev:latest".into(),
            gpus: None,
            pid: None,
        };
        let impostor = ContainerStatus {
            name: "not-the-right-name".into(),
            ..status(&kept, "impostor", ContainerState::Running)
        };
        let observed = [
            status(&gone, "cg", ContainerState::Running),
            helper,
            impostor,
        ];
        let ops = plan(std::slice::from_ref(&kept), &observed, &HashSet::new());
        assert_eq!(
            ops,
            vec![
                Operation::Stop {
                    session_id: Some(gone.session_id),
                    container_id: "cg".into()
                },
                Operation::Remove {
                    session_id: Some(gone.session_id),
                    container_id: "cg".into(),
                    held_image: None,
                },
                Operation::Remove {
                    session_id: None,
                    container_id: "helper".into(),
                    held_image: None,
                },
                // Labelled for `kept` but not its container: a stray, whose failures are
                // not `kept`'s problems.
                Operation::Stop {
                    session_id: None,
                    container_id: "impostor".into()
                },
                Operation::Remove {
                    session_id: None,
                    container_id: "impostor".into(),
                    held_image: None,
                },
                Operation::Create(Box::new(kept)),
            ]
        );
    }

    #[test]
    fn exits_are_described_for_people() {
        let limits = desired_session(&[]).limits;
        assert_eq!(
            describe_exit(137, true, None, &limits),
            "the dev container was killed for using more than its memory limit of 2.0 GiB \
             (exit code 137): start a session with more memory or use less"
        );
        assert_eq!(
            describe_exit(127, false, Some("exec: \"sleep\": not found"), &limits),
            "the dev container failed: exec: \"sleep\": not found (exit code 127)"
        );
        assert_eq!(
            describe_exit(1, false, Some(""), &limits),
            "the dev container stopped by itself with exit code 1"
        );
        assert_eq!(
            describe_exit(137, false, None, &limits),
            "the dev container was killed by SIGKILL (exit code 137) without ongrid asking"
        );
        assert_eq!(
            describe_exit(162, false, None, &limits),
            "the dev container was killed by signal 34 (exit code 162) without ongrid asking"
        );
        assert_eq!(
            describe_exit(200, false, None, &limits),
            "the dev container stopped by itself with exit code 200"
        );
    }

    fn reconciler(runtime: &Arc<FakeRuntime>) -> Reconciler {
        reconciler_with(runtime, Arc::new(FakeFirewall::default()))
    }

    fn reconciler_with(runtime: &Arc<FakeRuntime>, firewall: Arc<FakeFirewall>) -> Reconciler {
        Reconciler::new(
            runtime.clone(),
            NodeName::parse("node1").unwrap(),
            GpuAccess::EnvironmentOnly,
            NodeGuard {
                firewall,
                subnet_pool: "10.213.0.0/16".parse().unwrap(),
                storage: Default::default(),
                ceiling: LimitCeiling::NONE,
            },
        )
    }

    #[tokio::test]
    async fn each_session_gets_its_network_before_its_container_and_loses_it_after() {
        let runtime = Arc::new(FakeRuntime::new());
        let mut reconciler = reconciler(&runtime);
        let a = desired_session(&[GPU]);
        reconciler.converge(std::slice::from_ref(&a)).await.unwrap();
        let network = crate::network::network_name(a.session_id);
        assert_eq!(
            runtime.take_network_calls(),
            [format!("ensure_network {network}")]
        );
        assert_eq!(runtime.spec_of("c1").unwrap().network, network);
        let networks = runtime.networks();
        assert_eq!(networks.len(), 1);
        assert_eq!(networks[0].session_id, Some(a.session_id));

        // Held: the container and its network stay.
        reconciler.converge(&[stopped(a.clone())]).await.unwrap();
        assert_eq!(runtime.networks().len(), 1);
        runtime.take_network_calls();

        // Ended: the container goes, then its network; a network left by an earlier agent
        // run for a session that is gone is removed too.
        let stray = runtime.insert_network("ongrid-net-old", Some(SessionId::new_random()));
        reconciler.converge(&[]).await.unwrap();
        assert!(runtime.containers().is_empty());
        assert!(runtime.networks().is_empty(), "{:?}", runtime.networks());
        let calls = runtime.take_network_calls();
        assert!(
            calls.contains(&format!("remove_network {stray}")),
            "{calls:?}"
        );
    }

    #[tokio::test]
    async fn no_container_starts_while_the_firewall_rules_cannot_be_applied() {
        let runtime = Arc::new(FakeRuntime::new());
        let firewall = Arc::new(FakeFirewall::default());
        firewall.broken.store(true, Ordering::SeqCst);
        let mut reconciler = reconciler_with(&runtime, firewall.clone());
        let a = desired_session(&[GPU]);
        reconciler.converge(std::slice::from_ref(&a)).await.unwrap();
        assert_eq!(
            runtime.take_calls(),
            Vec::<String>::new(),
            "nothing created"
        );
        let report = reconciler.observe().await.unwrap();
        assert_eq!(report.len(), 1, "{report:?}");
        assert_eq!(report[0].state, ContainerState::Missing);
        let error = report[0].error.clone().unwrap();
        assert!(error.contains("isolating the session's network"), "{error}");
        assert!(error.contains("DOCKER-USER"), "{error}");

        // Checked again every pass: once the rules apply, the container starts.
        firewall.broken.store(false, Ordering::SeqCst);
        reconciler.converge(std::slice::from_ref(&a)).await.unwrap();
        assert_eq!(
            runtime.take_calls(),
            [
                format!("create {}", a.session_id.container_name()),
                "start c1".into()
            ]
        );
        assert_eq!(firewall.checks.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn limits_are_lowered_to_the_ceiling() {
        let runtime = Arc::new(FakeRuntime::new());
        let mut reconciler = Reconciler::new(
            runtime.clone(),
            NodeName::parse("node1").unwrap(),
            GpuAccess::EnvironmentOnly,
            NodeGuard {
                firewall: Arc::new(FakeFirewall::default()),
                subnet_pool: "10.213.0.0/16".parse().unwrap(),
                storage: Default::default(),
                ceiling: LimitCeiling {
                    millicpus: 1000,
                    memory_bytes: 1 << 30,
                },
            },
        );
        let a = desired_session(&[GPU]);
        reconciler.converge(std::slice::from_ref(&a)).await.unwrap();
        let limits = runtime.spec_of("c1").unwrap().limits;
        assert_eq!(limits.millicpus, 1000);
        assert_eq!(limits.memory.bytes(), 1 << 30);
        assert_eq!(limits.pids, a.limits.pids);
    }

    #[tokio::test]
    async fn converge_creates_starts_and_reports_running() {
        let runtime = Arc::new(FakeRuntime::new());
        let mut reconciler = reconciler(&runtime);
        let a = desired_session(&[GPU]);
        reconciler.converge(std::slice::from_ref(&a)).await.unwrap();

        let name = a.session_id.container_name();
        assert_eq!(
            runtime.take_calls(),
            [format!("create {name}"), "start c1".into()]
        );
        let spec = runtime.spec_of("c1").unwrap();
        assert_eq!(
            spec,
            ContainerSpec::for_session(&reconciler.node, &a, GpuAccess::EnvironmentOnly)
        );
        assert_eq!(
            reconciler.observe().await.unwrap(),
            vec![ObservedContainer {
                session_id: a.session_id,
                container_id: "c1".into(),
                state: ContainerState::Running,
                error: None,
            }]
        );

        // Level-triggered: the same desired state again changes nothing.
        reconciler.converge(&[a]).await.unwrap();
        assert_eq!(runtime.take_calls(), Vec::<String>::new());
    }

    #[tokio::test]
    async fn a_new_agent_adopts_running_containers() {
        let runtime = Arc::new(FakeRuntime::new());
        let a = desired_session(&[GPU]);
        let id = runtime.insert(
            &a.session_id.container_name(),
            Some(a.session_id),
            ContainerState::Running,
        );
        let mut fresh = reconciler(&runtime);
        fresh.converge(std::slice::from_ref(&a)).await.unwrap();
        assert_eq!(runtime.take_calls(), Vec::<String>::new());
        let report = fresh.observe().await.unwrap();
        assert_eq!(report.len(), 1);
        assert_eq!(
            (report[0].container_id.as_str(), &report[0].state),
            (id.as_str(), &ContainerState::Running)
        );
    }

    #[tokio::test]
    async fn a_dead_container_is_reported_with_why_and_not_restarted() {
        let runtime = Arc::new(FakeRuntime::new());
        let mut reconciler = reconciler(&runtime);
        let a = desired_session(&[GPU]);
        reconciler.converge(std::slice::from_ref(&a)).await.unwrap();
        runtime.die(a.session_id, 137, true);
        runtime.take_calls();

        reconciler.converge(std::slice::from_ref(&a)).await.unwrap();
        assert_eq!(
            runtime.take_calls(),
            Vec::<String>::new(),
            "must not restart silently"
        );
        let report = reconciler.observe().await.unwrap();
        assert_eq!(
            report[0].state,
            ContainerState::Exited {
                exit_code: 137,
                oom_killed: true,
                error: None
            }
        );
        let error = report[0].error.as_deref().unwrap();
        assert!(error.contains("memory limit of 2.0 GiB"), "{error}");
    }

    /// The reason reported for session `a`'s container, which died with SIGTERM's code.
    async fn reason_after_sigterm(reconciler: &mut Reconciler) -> String {
        let report = reconciler.observe().await.unwrap();
        assert_eq!(report.len(), 1, "{report:?}");
        report[0].error.clone().expect("a reason")
    }

    #[tokio::test]
    async fn a_container_that_died_while_docker_stopped_says_so() {
        let runtime = Arc::new(FakeRuntime::new());
        let mut reconciler = reconciler(&runtime);
        let a = desired_session(&[GPU]);
        reconciler.converge(std::slice::from_ref(&a)).await.unwrap();
        reconciler.observe().await.unwrap();

        // dockerd closed its socket and stopped the container; the pooled connection answers.
        runtime.set_daemon_stopping(true);
        runtime.die(a.session_id, 143, false);
        let stopping = reason_after_sigterm(&mut reconciler).await;
        assert_eq!(stopping, describe_docker_stop(143));
        assert!(stopping.contains("live-restore"), "{stopping}");

        // Back, it is still the reason, even though Docker accepts connections again.
        runtime.set_daemon_stopping(false);
        assert_eq!(reason_after_sigterm(&mut reconciler).await, stopping);
    }

    #[tokio::test]
    async fn a_container_seen_running_before_docker_went_away_and_exited_after_stopped_with_it() {
        let runtime = Arc::new(FakeRuntime::new());
        let mut reconciler = reconciler(&runtime);
        let a = desired_session(&[GPU]);
        reconciler.converge(std::slice::from_ref(&a)).await.unwrap();
        reconciler.observe().await.unwrap();

        runtime.fail_list();
        assert!(reconciler.observe().await.is_err());
        runtime.die(a.session_id, 143, false);
        runtime.heal();
        assert_eq!(
            reason_after_sigterm(&mut reconciler).await,
            describe_docker_stop(143)
        );
    }

    #[tokio::test]
    async fn a_container_that_died_while_docker_answered_died_by_itself() {
        let runtime = Arc::new(FakeRuntime::new());
        let mut reconciler = reconciler(&runtime);
        let a = desired_session(&[GPU]);
        reconciler.converge(std::slice::from_ref(&a)).await.unwrap();
        reconciler.observe().await.unwrap();

        runtime.die(a.session_id, 143, false);
        assert_eq!(
            reason_after_sigterm(&mut reconciler).await,
            "the dev container was killed by SIGTERM (exit code 143) without ongrid asking"
        );
        // An outage after the death changes nothing: it was seen dead before.
        runtime.fail_list();
        assert!(reconciler.observe().await.is_err());
        runtime.heal();
        assert_eq!(
            reason_after_sigterm(&mut reconciler).await,
            "the dev container was killed by SIGTERM (exit code 143) without ongrid asking"
        );
    }

    #[tokio::test]
    async fn with_live_restore_a_container_that_died_while_docker_was_away_died_by_itself() {
        let runtime = Arc::new(FakeRuntime::new());
        runtime.set_live_restore(true);
        let mut reconciler = reconciler(&runtime);
        let a = desired_session(&[GPU]);
        reconciler.converge(std::slice::from_ref(&a)).await.unwrap();
        reconciler.observe().await.unwrap();

        runtime.fail_list();
        assert!(reconciler.converge(std::slice::from_ref(&a)).await.is_err());
        runtime.die(a.session_id, 143, false);
        runtime.heal();
        assert_eq!(
            reason_after_sigterm(&mut reconciler).await,
            "the dev container was killed by SIGTERM (exit code 143) without ongrid asking"
        );
    }

    #[tokio::test]
    async fn hold_then_release_stops_and_starts_the_same_container() {
        let runtime = Arc::new(FakeRuntime::new());
        let mut reconciler = reconciler(&runtime);
        let a = desired_session(&[GPU]);
        reconciler.converge(std::slice::from_ref(&a)).await.unwrap();
        runtime.take_calls();

        reconciler.converge(&[stopped(a.clone())]).await.unwrap();
        assert_eq!(runtime.take_calls(), ["stop c1"]);
        let report = reconciler.observe().await.unwrap();
        assert_eq!(report[0].error, None, "a requested stop is no failure");

        reconciler.converge(std::slice::from_ref(&a)).await.unwrap();
        assert_eq!(runtime.take_calls(), ["start c1"]);
        assert_eq!(
            reconciler.observe().await.unwrap()[0].state,
            ContainerState::Running
        );

        // Having been started again, a later death is a death.
        runtime.die(a.session_id, 1, false);
        reconciler.converge(std::slice::from_ref(&a)).await.unwrap();
        assert_eq!(runtime.take_calls(), Vec::<String>::new());
        let report = reconciler.observe().await.unwrap();
        assert_eq!(
            report[0].error.as_deref(),
            Some("the dev container stopped by itself with exit code 1")
        );
    }

    #[tokio::test]
    async fn release_onto_other_gpus_recreates_the_container_from_its_held_image() {
        let runtime = Arc::new(FakeRuntime::new());
        let mut reconciler = reconciler(&runtime);
        let a = desired_session(&[GPU]);
        reconciler.converge(std::slice::from_ref(&a)).await.unwrap();
        reconciler.converge(&[stopped(a.clone())]).await.unwrap();
        runtime.take_calls();

        let moved = DesiredSession {
            gpus: vec![GpuId::parse(OTHER_GPU).unwrap()],
            ..a.clone()
        };
        reconciler
            .converge(std::slice::from_ref(&moved))
            .await
            .unwrap();
        let held = held_image(a.session_id);
        let name = a.session_id.container_name();
        assert_eq!(
            runtime.take_calls(),
            [
                format!("commit c1 {held}"),
                "remove c1".into(),
                format!("create {name}"),
                "start c2".into(),
            ]
        );
        let spec = runtime.spec_of("c2").unwrap();
        assert_eq!(spec.name, name);
        assert_eq!(spec.image, held);
        assert_eq!(spec.gpus, moved.gpus);
        assert_eq!(
            spec.labels
                .get(crate::runtime::LABEL_GPUS)
                .map(String::as_str),
            Some(OTHER_GPU)
        );
        let report = reconciler.observe().await.unwrap();
        assert_eq!(
            (report[0].state.clone(), report[0].error.clone()),
            (ContainerState::Running, None)
        );

        // Level-triggered: nothing more to do; and a later death is a death.
        reconciler
            .converge(std::slice::from_ref(&moved))
            .await
            .unwrap();
        assert_eq!(runtime.take_calls(), Vec::<String>::new());

        // The session ends: the container goes, and its held image with it.
        reconciler.converge(&[]).await.unwrap();
        assert_eq!(
            runtime.take_calls(),
            [
                "stop c2".to_owned(),
                "remove c2".into(),
                format!("untag {held}")
            ]
        );
        assert!(!runtime.images().contains(&held));
    }

    #[tokio::test]
    async fn a_recreate_that_fails_half_way_keeps_the_files_for_the_next_pass() {
        let runtime = Arc::new(FakeRuntime::new());
        let mut reconciler = reconciler(&runtime);
        let a = desired_session(&[GPU]);
        reconciler.converge(std::slice::from_ref(&a)).await.unwrap();
        reconciler.converge(&[stopped(a.clone())]).await.unwrap();
        let moved = DesiredSession {
            gpus: vec![GpuId::parse(OTHER_GPU).unwrap()],
            ..a.clone()
        };

        // The commit fails: the old container stays, untouched.
        runtime.fail("commit");
        runtime.take_calls();
        reconciler
            .converge(std::slice::from_ref(&moved))
            .await
            .unwrap();
        let held = held_image(a.session_id);
        assert_eq!(runtime.take_calls(), [format!("commit c1 {held}")]);
        let report = reconciler.observe().await.unwrap();
        assert_eq!(report[0].container_id, "c1");
        let error = report[0].error.as_deref().unwrap();
        assert!(error.contains("the fake was told to fail"), "{error}");

        // The creation fails after the old container is gone: the held image has the files.
        runtime.heal();
        runtime.fail("create");
        reconciler
            .converge(std::slice::from_ref(&moved))
            .await
            .unwrap();
        assert!(runtime.containers().is_empty());
        assert!(runtime.images().contains(&held));
        let report = reconciler.observe().await.unwrap();
        assert_eq!(report[0].state, ContainerState::Missing);

        // The next pass creates it from the held image.
        runtime.heal();
        runtime.take_calls();
        reconciler
            .converge(std::slice::from_ref(&moved))
            .await
            .unwrap();
        let name = a.session_id.container_name();
        assert_eq!(
            runtime.take_calls(),
            [format!("create {name}"), "start c2".into()]
        );
        assert_eq!(runtime.spec_of("c2").unwrap().image, held);
    }

    #[tokio::test]
    async fn undesired_containers_are_removed() {
        let runtime = Arc::new(FakeRuntime::new());
        let mut reconciler = reconciler(&runtime);
        let a = desired_session(&[GPU]);
        reconciler.converge(&[a]).await.unwrap();
        runtime.take_calls();
        reconciler.converge(&[]).await.unwrap();
        assert_eq!(runtime.take_calls(), ["stop c1", "remove c1"]);
        assert!(runtime.containers().is_empty());
        assert!(reconciler.observe().await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_missing_image_is_reported_as_missing_with_the_fix() {
        let runtime = Arc::new(FakeRuntime::new());
        runtime.remove_image("ongrid/dev:latest");
        let mut reconciler = reconciler(&runtime);
        let a = desired_session(&[GPU]);
        reconciler.converge(std::slice::from_ref(&a)).await.unwrap();
        assert_eq!(
            reconciler.observe().await.unwrap(),
            vec![ObservedContainer {
                session_id: a.session_id,
                container_id: String::new(),
                state: ContainerState::Missing,
                error: Some(
                    "image ongrid/dev:latest is not present on node node1: \
                     build or load it there (images/dev/build.sh)"
                        .into()
                ),
            }]
        );
    }

    #[tokio::test]
    async fn failures_are_per_operation_and_retried() {
        let runtime = Arc::new(FakeRuntime::new());
        let mut reconciler = reconciler(&runtime);
        let a = desired_session(&[GPU]);
        let b = desired_session(&[]);
        runtime.fail("start");
        reconciler.converge(&[a.clone(), b.clone()]).await.unwrap();
        // Both were attempted: one failure does not stop the pass.
        assert_eq!(runtime.take_calls().len(), 4);
        let report = reconciler.observe().await.unwrap();
        assert_eq!(report.len(), 2);
        for observed in &report {
            assert_eq!(observed.state, ContainerState::Created);
            let error = observed.error.as_deref().unwrap();
            assert!(error.contains("the fake was told to fail"), "{error}");
        }

        runtime.heal();
        reconciler.converge(&[a.clone(), b]).await.unwrap();
        let report = reconciler.observe().await.unwrap();
        assert!(
            report
                .iter()
                .all(|c| c.state == ContainerState::Running && c.error.is_none()),
            "{report:?}"
        );
    }

    fn parallel(n: usize) -> NonZeroUsize {
        NonZeroUsize::new(n).unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn creations_run_at_once_up_to_parallel_operations() {
        for (parallel_operations, at_once, seconds) in [(1, 1, 6), (4, 4, 2), (8, 6, 1)] {
            let runtime = Arc::new(FakeRuntime::new());
            runtime.slow("create", Duration::from_secs(1));
            let mut reconciler = reconciler(&runtime)
                .with_parallel_operations(parallel(parallel_operations))
                .with_pass_budget(Duration::from_secs(60));
            let desired: Vec<DesiredSession> = (0..6).map(|_| desired_session(&[])).collect();
            let started = tokio::time::Instant::now();
            reconciler.converge(&desired).await.unwrap();
            assert_eq!(
                runtime.most_at_once("create"),
                at_once,
                "parallel_operations = {parallel_operations}"
            );
            assert_eq!(started.elapsed().as_secs(), seconds);
            assert_eq!(reconciler.acted(), 6);
            let report = reconciler.observe().await.unwrap();
            assert_eq!(report.len(), 6);
            assert!(
                report.iter().all(|c| c.state == ContainerState::Running),
                "{report:?}"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn every_stop_and_removal_ends_before_any_creation_begins() {
        let runtime = Arc::new(FakeRuntime::new());
        let mut reconciler = reconciler(&runtime).with_pass_budget(Duration::from_secs(60));
        let (gone, held) = (desired_session(&[GPU]), desired_session(&[OTHER_GPU]));
        reconciler
            .converge(&[gone.clone(), held.clone()])
            .await
            .unwrap();
        let containers = |session: &DesiredSession| {
            runtime
                .containers()
                .into_iter()
                .find(|c| c.session_id == Some(session.session_id))
                .unwrap()
                .id
        };
        let (gone_id, held_id) = (containers(&gone), containers(&held));
        runtime.take_timeline();

        // The GPUs of both go to new sessions in the same pass.
        runtime.slow("stop", Duration::from_secs(10));
        runtime.slow("remove", Duration::from_secs(1));
        runtime.slow("create", Duration::from_secs(1));
        let (new_a, new_b) = (desired_session(&[GPU]), desired_session(&[OTHER_GPU]));
        reconciler
            .converge(&[stopped(held.clone()), new_a.clone(), new_b.clone()])
            .await
            .unwrap();
        let timeline = runtime.take_timeline();
        let at = |event: &str| {
            timeline
                .iter()
                .position(|e| e == event)
                .unwrap_or_else(|| panic!("no {event} in {timeline:?}"))
        };
        let first_create = timeline
            .iter()
            .position(|e| e.starts_with("begin create"))
            .unwrap();
        for freed in [
            format!("end stop {gone_id}"),
            format!("end remove {gone_id}"),
            format!("end stop {held_id}"),
        ] {
            assert!(at(&freed) < first_create, "{timeline:?}");
        }
        // One session's operations in order; the two stops at once, and the two creations.
        assert!(at(&format!("end stop {gone_id}")) < at(&format!("begin remove {gone_id}")));
        assert_eq!(runtime.most_at_once("stop"), 2);
        assert_eq!(runtime.most_at_once("create"), 2);
        // Two stops, a removal, two creations, and the network of the session gone.
        assert_eq!(reconciler.acted(), 6);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failing_creation_holds_no_other() {
        let runtime = Arc::new(FakeRuntime::new());
        runtime.slow("create", Duration::from_secs(1));
        let mut reconciler = reconciler(&runtime);
        let desired: Vec<DesiredSession> = (0..4).map(|_| desired_session(&[])).collect();
        let failing = desired[1].session_id;
        runtime.fail_on("create", &failing.container_name());
        reconciler.converge(&desired).await.unwrap();
        assert_eq!(runtime.most_at_once("create"), 4, "all began together");
        assert_eq!(reconciler.acted(), 3);
        let report = reconciler.observe().await.unwrap();
        assert_eq!(report.len(), 4, "{report:?}");
        for observed in &report {
            if observed.session_id == failing {
                assert_eq!(observed.state, ContainerState::Missing);
                let error = observed.error.as_deref().unwrap();
                assert!(error.contains("the fake was told to fail"), "{error}");
            } else {
                assert_eq!(
                    (&observed.state, &observed.error),
                    (&ContainerState::Running, &None)
                );
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_pass_starts_operations_for_its_budget_and_leaves_the_rest() {
        let runtime = Arc::new(FakeRuntime::new());
        runtime.slow("create", Duration::from_secs(1));
        let mut reconciler = reconciler(&runtime)
            .with_parallel_operations(parallel(2))
            .with_pass_budget(Duration::from_secs(3));
        let desired: Vec<DesiredSession> = (0..10).map(|_| desired_session(&[])).collect();
        // Two at a time, started at 0, 1 and 2 s; none at 3 s.
        reconciler.converge(&desired).await.unwrap();
        assert_eq!((reconciler.acted(), reconciler.deferred()), (6, 4));
        let running = |report: Vec<ObservedContainer>| {
            report
                .iter()
                .filter(|c| c.state == ContainerState::Running)
                .count()
        };
        assert_eq!(running(reconciler.observe().await.unwrap()), 6);
        reconciler.converge(&desired).await.unwrap();
        assert_eq!((reconciler.acted(), reconciler.deferred()), (4, 0));
        assert_eq!(running(reconciler.observe().await.unwrap()), 10);
    }

    #[tokio::test(start_paused = true)]
    async fn no_creation_begins_in_a_pass_whose_stops_did_not_all_run() {
        let runtime = Arc::new(FakeRuntime::new());
        let mut reconciler = reconciler(&runtime)
            .with_parallel_operations(parallel(1))
            .with_pass_budget(Duration::from_secs(3));
        let (a, b) = (desired_session(&[GPU]), desired_session(&[OTHER_GPU]));
        reconciler.converge(&[a.clone(), b.clone()]).await.unwrap();
        runtime.take_calls();
        runtime.slow("stop", Duration::from_secs(10));
        // Their GPUs go to c, in shared mode say.
        let c = desired_session(&[GPU]);
        let desired = [stopped(a), stopped(b), c.clone()];
        reconciler.converge(&desired).await.unwrap();
        assert_eq!(runtime.take_calls(), ["stop c1"]);
        assert_eq!((reconciler.acted(), reconciler.deferred()), (1, 2));
        reconciler.converge(&desired).await.unwrap();
        assert_eq!(runtime.take_calls(), ["stop c2"]);
        assert_eq!((reconciler.acted(), reconciler.deferred()), (1, 1));
        reconciler.converge(&desired).await.unwrap();
        assert_eq!(
            runtime.take_calls(),
            [
                format!("create {}", c.session_id.container_name()),
                "start c3".into()
            ]
        );
        assert_eq!((reconciler.acted(), reconciler.deferred()), (1, 0));
    }

    #[tokio::test]
    async fn nothing_is_touched_when_the_runtime_cannot_list() {
        let runtime = Arc::new(FakeRuntime::new());
        let mut reconciler = reconciler(&runtime);
        runtime.fail_list();
        assert!(reconciler
            .converge(&[desired_session(&[GPU])])
            .await
            .is_err());
        assert!(reconciler.observe().await.is_err());
        assert_eq!(runtime.take_calls(), Vec::<String>::new());
    }
}
