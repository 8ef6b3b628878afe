//! The scheduling loop: turns the pure [`ongrid_scheduler::plan`] into stored placements.
//!
//! Every `schedule_interval`, and at once when woken (a session was created or removed, an agent
//! registered or synced, a GPU's mode changed), one [`Scheduler::tick`]:
//!
//! 1. sends STARTING sessions whose node went offline back to PENDING ("node N stopped
//!    responding"), keeping their place in the queue. Sessions already running on such a node
//!    are lost with it: FAILED with [`nodes::lost_with_node`]'s reason, so their GPUs no
//!    longer count as used; when the agent is back it stops their containers (never starts
//!    them twice);
//! 2. builds the [`ongrid_scheduler::SiteState`] from the store and calls `plan`;
//! 3. applies each `Place` action as PENDING → STARTING ("placed on N (GPU-...)") in its own
//!    transaction, which re-checks the state: a session removed meanwhile is skipped.
//!
//! Before planning, running sessions of other groups on GPUs of a reservation whose hold is due
//! are HELD ([`crate::domain::policy::reservations::reservation_hold`]), so the plan gives the
//! group their GPUs; others' jobs there are halted by the plan itself.
//!
//! Batch jobs go through the same plan ([`crate::site::SiteSnapshot`] gives it the QUEUED jobs
//! and those holding GPUs). `StartJob`, `HaltJob` and `CancelJob` are applied through
//! [`crate::domain::jobs`]. A `PlaceAfterHalt` is remembered in memory as the session's
//! [`HaltWait`] (the session stays PENDING) and given back to later plans, which place it on
//! those GPUs once the jobs are HALTED; its placement reason then says it preempted batch work.
//! After a manager restart the wait is gone and the next plan decides again (jobs already
//! halting are preferred, so nothing more is halted). Jobs holding GPUs on a node that stopped
//! responding are HALTED and re-queued when restartable, else FAILED ("node lost").
//!
//! MIG devices are planned from the same state before anything is applied: `plan_mig` places
//! sessions on free devices, then `plan_mig_jobs` starts MIG jobs on the devices left and halts
//! a job on a device for a session no free device meets (it stays PENDING and takes the device
//! once the job is HALTED).
//!
//! A PENDING session that still has a node is a released one whose stopped container is there:
//! it is pinned to that node while the node is registered and online. When the node is offline
//! or gone the pin is dropped, the session starts anywhere in a new container, and the reason of
//! its placement says so.
//!
//! The time comes from the injected [`Clock`], so tests move time instead of sleeping.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use ongrid_core::job::JobId;
use ongrid_core::GpuId;
use ongrid_core::{NodeName, SessionId, SessionState};
use ongrid_scheduler::{Action, HaltWait, MigJobAction};
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;

use crate::clock::Clock;
use crate::domain::jobs::{self, JobChange};
use crate::domain::nodes;
use crate::domain::sessions::{queue, Change};
use crate::notify::Changes;
use crate::site::{pending_session, SiteSnapshot};
use crate::store::{NodeRecord, SessionFilter, Store, StoreError, StoreResult};

/// Whether this replica leads; cheap to clone. Defined here, below [`crate::replicas`] (which
/// re-exports it and says who leads), because the scheduler is what it switches off.
#[derive(Debug, Clone)]
pub struct Leader {
    leading: watch::Receiver<bool>,
    /// `true` once this manager is known to serve an old copy of its store
    /// ([`crate::served_store`]): then it never leads.
    behind: watch::Receiver<bool>,
}

impl Leader {
    /// The only manager of its database (SQLite): it always leads.
    pub fn sole() -> Self {
        Self {
            leading: watch::channel(true).1,
            behind: watch::channel(false).1,
        }
    }

    /// A replica that does not lead until the returned sender says so.
    pub fn follower() -> (watch::Sender<bool>, Self) {
        let (lead, leading) = watch::channel(false);
        let behind = watch::channel(false).1;
        (lead, Self { leading, behind })
    }

    /// This leader, which stops leading for good once `behind` turns `true`.
    pub fn unless_behind(self, behind: watch::Receiver<bool>) -> Self {
        Self { behind, ..self }
    }

    pub fn is_leading(&self) -> bool {
        *self.leading.borrow() && !*self.behind.borrow()
    }
}

/// What one tick did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TickReport {
    /// Sessions placed (PENDING → STARTING).
    pub placed: usize,
    /// Sessions sent back to the queue because their node stopped responding.
    pub requeued: usize,
    /// Running sessions FAILED because their node stopped responding.
    pub lost: usize,
    /// GPUs drained or undrained by the health check, and sessions and jobs failed with them.
    pub health: usize,
    /// Job transitions applied (started, asked to halt, cancelled, lost with their node).
    pub jobs: usize,
    /// Running sessions of other groups HELD because a reservation started on their GPUs.
    pub held: usize,
}

pub struct Scheduler {
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    node_timeout: Duration,
    wake: Arc<Notify>,
    ticks: watch::Sender<u64>,
    /// Told of every placement and job change, so agents hear of them at once.
    changes: Option<Changes>,
    /// One tick at a time: two concurrent plans could both hand out the same free GPU. Holds
    /// the PENDING sessions waiting for jobs to halt.
    tick_lock: tokio::sync::Mutex<HashMap<SessionId, HaltWait>>,
    /// The site's `[jobs]` settings: whether a re-queued job is pinned to its checkpoint's node.
    job_limits: jobs::JobLimits,
    /// The manager's `auto_undrain`: lift the health check's drain of a GPU healthy again.
    auto_undrain: bool,
    /// `[fairshare]`: charge usage every round and order each class of requests by it.
    fair_share: Option<crate::domain::policy::fairshare::FairShareConfig>,
    /// When this manager started: a node's silence counts from then at the earliest
    /// ([`nodes::work_given_up`]).
    started: DateTime<Utc>,
    /// `[limits]`: requests over a user's or group's maximum wait.
    limits: Option<crate::domain::policy::limits::LimitsConfig>,
    /// What each request held back by a limit was last told (logged when it changes).
    limit_waits: std::sync::Mutex<HashMap<crate::limit_check::Waiting, String>>,
    /// Owned GPUs and reservations: the site's settings for them (`None`: sessions' lifetimes
    /// unknown, planned as the default `[lifecycle]`'s).
    gpu_policy: Option<crate::gpu_policy::PolicySettings>,
    /// Whether this manager leads its database's replicas: a follower's rounds do nothing.
    leader: Leader,
}

impl Scheduler {
    pub fn new(
        store: Arc<dyn Store>,
        clock: Arc<dyn Clock>,
        node_timeout: Duration,
        wake: Arc<Notify>,
    ) -> Self {
        Self {
            started: clock.now(),
            store,
            clock,
            node_timeout,
            wake,
            ticks: watch::channel(0).0,
            changes: None,
            tick_lock: tokio::sync::Mutex::new(HashMap::new()),
            job_limits: jobs::JobLimits::default(),
            auto_undrain: false,
            fair_share: None,
            limits: None,
            limit_waits: std::sync::Mutex::new(HashMap::new()),
            gpu_policy: None,
            leader: Leader::sole(),
        }
    }

    /// Schedules only while `leader` says this replica leads (default: always).
    pub fn with_leader(mut self, leader: Leader) -> Self {
        self.leader = leader;
        self
    }

    /// The site's settings for owned GPUs and reservations (`[policy] sessions_on_owned_gpus`,
    /// sessions' lifetimes).
    pub fn with_gpu_policy(mut self, settings: crate::gpu_policy::PolicySettings) -> Self {
        self.gpu_policy = Some(settings);
        self
    }

    /// Holds back requests over `[limits]`; `None`: no limits.
    pub fn with_limits(
        mut self,
        limits: Option<crate::domain::policy::limits::LimitsConfig>,
    ) -> Self {
        self.limits = limits;
        self
    }

    /// Why a waiting session or job is held back by a limit, if it is.
    pub fn limit_wait(&self, waiting: crate::limit_check::Waiting) -> Option<String> {
        self.limit_waits
            .lock()
            .ok()
            .and_then(|waits| waits.get(&waiting).cloned())
    }

    /// Orders waiting requests by fair share (`[fairshare]`); `None`: first come, first served.
    pub fn with_fair_share(
        mut self,
        fair_share: Option<crate::domain::policy::fairshare::FairShareConfig>,
    ) -> Self {
        self.fair_share = fair_share;
        self
    }

    /// Lifts the health check's drain of a GPU once its node reports it healthy again (the
    /// manager's `auto_undrain`; default: it stays drained until an admin undrains it).
    pub fn with_auto_undrain(mut self, auto_undrain: bool) -> Self {
        self.auto_undrain = auto_undrain;
        self
    }

    /// The site's `[jobs]` settings (default: jobs directories local to each node).
    pub fn with_job_limits(mut self, job_limits: jobs::JobLimits) -> Self {
        self.job_limits = job_limits;
        self
    }

    /// Notifies `changes` of every session or job change it stores.
    pub fn with_changes(mut self, changes: Changes) -> Self {
        self.changes = Some(changes);
        self
    }

    /// Counts completed ticks; lets a caller wait for the loop to have run.
    pub fn ticks(&self) -> watch::Receiver<u64> {
        self.ticks.subscribe()
    }

    /// Ticks every `interval` and whenever woken, until `shutdown`.
    pub async fn run(self: Arc<Self>, interval: Duration, shutdown: CancellationToken) {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                _ = ticker.tick() => {}
                () = self.wake.notified() => {}
            }
            match self.tick(self.clock.now()).await {
                Ok(report) if report != TickReport::default() => {
                    tracing::debug!(
                        placed = report.placed,
                        requeued = report.requeued,
                        jobs = report.jobs,
                        "Scheduled."
                    );
                }
                Ok(_) => {}
                Err(error) => {
                    tracing::error!(%error, "Scheduling failed; retrying at the next tick.");
                }
            }
            self.ticks.send_modify(|n| *n += 1);
        }
    }

    /// One round of scheduling at time `now`. Rounds never overlap: the loop and the API
    /// (which schedules a new session at once) take turns.
    /// On a replica that does not lead ([`crate::replicas`]) it does nothing.
    pub async fn tick(&self, now: DateTime<Utc>) -> StoreResult<TickReport> {
        let mut halt_waits = self.tick_lock.lock().await;
        if !self.leader.is_leading() {
            return Ok(TickReport::default());
        }
        let mut report = TickReport::default();
        let site = SiteSnapshot::load(self.store.as_ref(), now, self.node_timeout).await?;
        report.health += self.check_health(&site, now).await?;
        // Owners and reservations, read once for the round: nothing in it changes them.
        let gpu_policy = crate::gpu_policy::GpuPolicy::load(self.store.as_ref()).await?;
        report.held += self.hold_for_reservations(&site, &gpu_policy, now).await?;
        let given_up = |node: &NodeRecord| {
            nodes::work_given_up(node.last_seen, self.started, self.node_timeout, now)
        };
        for node in site.nodes.iter().filter(|n| given_up(n)) {
            let lost = site
                .jobs
                .iter()
                .filter(|j| j.state().holds_gpus() && j.node.as_ref() == Some(&node.name));
            for job in lost {
                if let Some(change) = jobs::node_lost(job, now) {
                    let next =
                        jobs::next_in_chain(job, &change, JobId::new_random(), &self.job_limits);
                    if self.apply_job(job.id, change, next).await? {
                        tracing::info!(job_id = %job.id, node = %node.name, "Job lost with its node.");
                        report.jobs += 1;
                    }
                }
            }
            let stranded = site.holding.iter().filter(|s| {
                s.state == SessionState::Starting && s.node.as_ref() == Some(&node.name)
            });
            for session in stranded {
                let change = queue::requeue_stranded(&node.name, now);
                if self.apply(session.id, change).await? {
                    tracing::info!(session_id = %session.id, node = %node.name, "Session re-queued: its node stopped responding.");
                    report.requeued += 1;
                }
            }
            let on_node = site
                .holding
                .iter()
                .filter(|s| s.node.as_ref() == Some(&node.name));
            for session in on_node {
                let change = nodes::lost_with_node(
                    session,
                    &node.name,
                    node.last_seen,
                    self.node_timeout,
                    now,
                );
                if let Some(change) = change {
                    if self.apply(session.id, change).await? {
                        tracing::warn!(session_id = %session.id, node = %node.name, "Session lost with its node.");
                        report.lost += 1;
                    }
                }
            }
        }
        // Re-queued jobs whose checkpoint is on a node that is gone or offline.
        for job in &site.jobs {
            let online = job
                .pinned_node
                .as_ref()
                .is_some_and(|pinned| site.nodes.iter().any(|n| n.name == *pinned && !given_up(n)));
            if let Some(change) = jobs::checkpoint_node_lost(job, online, now) {
                if self.apply_job(job.id, change, None).await? {
                    tracing::info!(job_id = %job.id, node = ?job.pinned_node, "Job failed: its checkpoint's node is gone.");
                    report.jobs += 1;
                }
            }
        }

        let pending = self
            .store
            .sessions(SessionFilter::States(vec![SessionState::Pending]))
            .await?;
        let site = SiteSnapshot::load(self.store.as_ref(), now, self.node_timeout).await?;
        let accounts = match &self.fair_share {
            Some(config) => {
                Some(crate::fair_share::meter(self.store.as_ref(), config, &site, now).await?)
            }
            None => None,
        };
        halt_waits.retain(|id, _| pending.iter().any(|s| s.id == *id));
        if pending.is_empty() && site.jobs.is_empty() {
            crate::metrics::events().queued(&Default::default());
            return Ok(report);
        }
        let mut unpinned: HashMap<SessionId, NodeName> = HashMap::new();
        let queue = pending
            .iter()
            .map(|session| {
                let mut queued = pending_session(session);
                queued.awaiting_halt = halt_waits.get(&session.id).cloned();
                if let Some(node) = &session.node {
                    let online = site
                        .nodes
                        .iter()
                        .any(|n| n.name == *node && site.is_online(n));
                    if online {
                        queued.pinned_node = Some(node.clone());
                        queued.previous_gpus = ongrid_core::api::whole_gpus(&session.gpus);
                    } else {
                        unpinned.insert(session.id, node.clone());
                    }
                }
                queued
            })
            .collect();
        let mut state = site.scheduler_state(queue);
        if let (Some(config), Some(accounts)) = (&self.fair_share, &accounts) {
            let standings = crate::domain::policy::fairshare::standings(accounts, config);
            crate::fair_share::prioritise(&mut state, accounts, &standings, &pending, &site.jobs);
        }
        if let Some(limits) = &self.limits {
            let accounts = match accounts {
                Some(accounts) => accounts,
                None => self.store.usage_accounts().await?,
            };
            let lifecycle = self.gpu_policy.map(|s| s.lifecycle).unwrap_or_default();
            let session_lengths = if limits.length_classes.is_some() {
                let mut states = crate::site::holding_states();
                states.push(SessionState::Pending);
                let facts = self
                    .store
                    .lifecycle_facts(crate::store::FactsScope::States(states))
                    .await?;
                crate::limit_check::session_lengths(&facts, &lifecycle)
            } else {
                HashMap::new()
            };
            let round = crate::limit_check::Round {
                config: limits,
                accounts: &accounts,
                site: &site,
                pending: &pending,
                session_lengths: &session_lengths,
                lifecycle: &lifecycle,
            };
            let held_back = crate::limit_check::hold_back(&mut state, &round);
            if let Ok(mut waits) = self.limit_waits.lock() {
                let mut now_waiting = HashMap::new();
                for (waiting, blocked) in held_back {
                    let reason = blocked.to_string();
                    if waits.get(&waiting) != Some(&reason) {
                        tracing::info!(?waiting, %reason, "Request waits for a limit.");
                    }
                    now_waiting.insert(waiting, reason);
                }
                *waits = now_waiting;
            }
        }
        if !gpu_policy.is_idle(now) {
            let settings = self
                .gpu_policy
                .unwrap_or(crate::gpu_policy::PolicySettings {
                    sessions_on_owned_gpus: false,
                    lifecycle: Default::default(),
                });
            let accounts = self.store.usage_accounts().await?;
            let facts = self
                .store
                .lifecycle_facts(crate::store::FactsScope::States(vec![
                    SessionState::Pending,
                ]))
                .await?;
            state.policy =
                gpu_policy.scheduler_policy(&site, &accounts, &pending, &facts, &settings, now);
        }
        let planning = std::time::Instant::now();
        let actions = ongrid_scheduler::plan(&state, now);
        crate::metrics::events().plan_took(planning.elapsed());
        let mut placed = crate::metrics::placed_sessions(&actions);
        // MIG devices, planned from the same state before anything is applied: sessions, then
        // batch jobs and the jobs waiting sessions halt.
        let mig_slots = site.mig_slots();
        let mig_placements = ongrid_scheduler::plan_mig(&state, &mig_slots, now);
        let mig_jobs =
            ongrid_scheduler::plan_mig_jobs(&state, &mig_slots, now, &actions, &mig_placements);
        for action in actions {
            match action {
                Action::Place {
                    session,
                    node,
                    gpus,
                } => {
                    let mut change = queue::place(&node, gpus, unpinned.get(&session), now);
                    if halt_waits.remove(&session).is_some() {
                        change.reason = format!("{}; it preempted batch work", change.reason);
                    }
                    if self.apply(session, change).await? {
                        tracing::info!(session_id = %session, %node, "Session placed.");
                        report.placed += 1;
                    }
                }
                Action::PlaceAfterHalt {
                    session,
                    node,
                    gpus,
                    jobs,
                } => {
                    tracing::info!(session_id = %session, %node, jobs = jobs.len(), "Session waits for batch jobs to halt.");
                    halt_waits.insert(session, HaltWait { node, gpus, jobs });
                }
                Action::HaltJob { job, reason } => {
                    let Some(record) = site.jobs.iter().find(|j| j.id == job) else {
                        continue;
                    };
                    if let Ok(Some(change)) = jobs::must_halt(record, reason, now) {
                        if self.apply_job(job, change, None).await? {
                            tracing::info!(job_id = %job, "Job asked to halt.");
                            report.jobs += 1;
                        }
                    }
                }
                Action::StartJob { job, node, gpus } => {
                    let Some(record) = site.jobs.iter().find(|j| j.id == job) else {
                        continue;
                    };
                    let gpus = gpus.into_iter().map(GpuId::from).collect();
                    if let Ok(change) = jobs::start(record, node.clone(), gpus, now) {
                        if self.apply_job(job, change, None).await? {
                            tracing::info!(job_id = %job, %node, "Job started.");
                            report.jobs += 1;
                        }
                    }
                }
                Action::CancelJob { job, reason } => {
                    let Some(record) = site.jobs.iter().find(|j| j.id == job) else {
                        continue;
                    };
                    if let Ok(change) = jobs::cancel_queued(record, reason, now) {
                        if self.apply_job(job, change, None).await? {
                            tracing::info!(job_id = %job, "Job cancelled: not started by its notAfter.");
                            report.jobs += 1;
                        }
                    }
                }
            }
        }
        // Sessions asking for a MIG device: on free devices of GPUs in `mig` mode.
        for placement in mig_placements {
            let change =
                queue::place_mig(&placement.node, placement.device, &placement.parent, now);
            if self.apply(placement.session, change).await? {
                tracing::info!(session_id = %placement.session, node = %placement.node, "Session placed on a MIG device.");
                report.placed += 1;
                placed.insert(placement.session);
            }
        }
        for action in mig_jobs {
            match action {
                MigJobAction::Start {
                    job,
                    node,
                    device,
                    parent,
                } => {
                    let Some(record) = site.jobs.iter().find(|j| j.id == job) else {
                        continue;
                    };
                    if let Ok(change) =
                        jobs::start(record, node.clone(), vec![GpuId::Mig(device)], now)
                    {
                        if self.apply_job(job, change, None).await? {
                            tracing::info!(job_id = %job, %node, gpu = %parent, "Job started on a MIG device.");
                            report.jobs += 1;
                        }
                    }
                }
                MigJobAction::Halt { job, reason } => {
                    let Some(record) = site.jobs.iter().find(|j| j.id == job) else {
                        continue;
                    };
                    let why = reason.to_string();
                    if let Ok(Some(change)) = jobs::must_halt(record, reason, now) {
                        if self.apply_job(job, change, None).await? {
                            tracing::info!(job_id = %job, reason = %why, "Job on a MIG device asked to halt.");
                            report.jobs += 1;
                        }
                    }
                }
            }
        }
        crate::metrics::events().queued(&crate::metrics::queue_reasons(
            &pending,
            &placed,
            &halt_waits,
            &unpinned,
        ));
        Ok(report)
    }

    /// Holds the running sessions of other groups on GPUs of a reservation once their hold is
    /// due: at the window's start, not sooner than `[lifecycle] warn_before` after the
    /// reservation was added (`domain::policy::reservations::reservation_hold`), so connected
    /// terminals were warned. Their jobs are halted by the plan. Returns how many it held.
    async fn hold_for_reservations(
        &self,
        site: &SiteSnapshot,
        policy: &crate::gpu_policy::GpuPolicy,
        now: DateTime<Utc>,
    ) -> StoreResult<usize> {
        use crate::domain::policy::reservations::{hold_change, ReservationHold};
        if site.holding.is_empty() {
            return Ok(0);
        }
        if policy.reservations.iter().all(|r| r.to <= now) {
            return Ok(0);
        }
        let accounts = self.store.usage_accounts().await?;
        let notice = self
            .gpu_policy
            .map_or_else(Default::default, |settings| settings.lifecycle)
            .warn_before;
        let mut held = 0;
        for session in &site.holding {
            let group = crate::gpu_policy::group_of(&accounts, &session.owner);
            let Some((at, reservation)) = policy.session_hold(site, session, &group, notice, now)
            else {
                continue;
            };
            if at > now {
                continue;
            }
            let hold = ReservationHold {
                reservation: &reservation,
                at,
            };
            if self
                .apply(session.id, hold_change(&session.name, &hold, now))
                .await?
            {
                tracing::info!(session_id = %session.id, session = %session.name, user = %session.user_name,
                    reservation = %reservation.name, group = %reservation.group,
                    "Session held: a reservation of another group started on its GPUs.");
                crate::metrics::events().held(ongrid_core::holds::HoldReason::Admin);
                held += 1;
            }
        }
        Ok(held)
    }

    /// GPUs that online nodes report unhealthy (failed, or unknown): drained at once, their
    /// sessions FAILED and their jobs HALTED (restartable ones, re-queued) or FAILED. With
    /// `auto_undrain`, the health check's drain of a GPU healthy again is lifted. Returns how
    /// many changes it stored.
    async fn check_health(&self, site: &SiteSnapshot, now: DateTime<Utc>) -> StoreResult<usize> {
        let mut changed = 0;
        for node in site.nodes.iter().filter(|n| site.is_online(n)) {
            for gpu in &node.gpus {
                let uuid = &gpu.info.uuid;
                let health = &gpu.info.health;
                if nodes::lift_health_drain(health, gpu.drain.as_ref(), self.auto_undrain) {
                    self.store.set_gpu_drain(uuid, None).await?;
                    tracing::info!(gpu = %uuid, node = %node.name, "GPU healthy again: back in service (auto_undrain).");
                    changed += 1;
                    continue;
                }
                let Some(problem) = health.problem() else {
                    continue;
                };
                if let Some(drain) = nodes::health_drain(health, gpu.drain.as_ref(), now) {
                    self.store.set_gpu_drain(uuid, Some(drain)).await?;
                    tracing::warn!(gpu = %uuid, node = %node.name, %problem, "GPU drained: its node reports it unhealthy.");
                    changed += 1;
                }
                for session in site.sessions_on(uuid) {
                    if let Some(change) = nodes::session_on_bad_gpu(session, uuid, &problem, now) {
                        if self.apply(session.id, change).await? {
                            tracing::warn!(session_id = %session.id, gpu = %uuid, "Session failed with its GPU.");
                            changed += 1;
                        }
                    }
                }
                let on_gpu = site.jobs.iter().filter(|j| site.on_gpu(uuid, &j.gpus));
                for job in on_gpu {
                    if let Some(change) = nodes::job_on_bad_gpu(job, uuid, &problem, now) {
                        let next = jobs::next_in_chain(
                            job,
                            &change,
                            JobId::new_random(),
                            &self.job_limits,
                        );
                        if self.apply_job(job.id, change, next).await? {
                            tracing::warn!(job_id = %job.id, gpu = %uuid, "Job stopped with its GPU.");
                            changed += 1;
                        }
                    }
                }
            }
        }
        Ok(changed)
    }

    /// Stores a job's change (and the next job of its chain); `false` when the job changed
    /// meanwhile.
    async fn apply_job(
        &self,
        id: JobId,
        change: JobChange,
        next: Option<jobs::NewJob>,
    ) -> StoreResult<bool> {
        match self.store.job_transition(id, change, next).await {
            Ok(job) => {
                if let Some(changes) = &self.changes {
                    changes.node_or_site(job.node.as_ref());
                }
                Ok(true)
            }
            Err(StoreError::InvalidJobTransition(e)) => {
                tracing::debug!(job_id = %id, error = %e, "Skipping a job that changed meanwhile.");
                Ok(false)
            }
            Err(StoreError::NoSuchJob(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Stores a change; `false` when the session's state no longer allows it (it was removed
    /// or changed meanwhile), which is not an error for the scheduler.
    async fn apply(&self, id: ongrid_core::SessionId, change: Change) -> StoreResult<bool> {
        match self.store.transition(id, change).await {
            Ok(session) => {
                if let Some(changes) = &self.changes {
                    changes.node_or_site(session.node.as_ref());
                }
                Ok(true)
            }
            Err(StoreError::InvalidTransition(e)) => {
                tracing::debug!(session_id = %id, error = %e, "Skipping a session that changed meanwhile.");
                Ok(false)
            }
            Err(StoreError::NoSuchSession(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use chrono::{TimeDelta, TimeZone};
    use ongrid_core::{
        ComputeCapability, Dn, GpuHealth, GpuId, GpuInfo, GpuRequest, GpuUuid, MemorySize,
        NodeName, SessionId,
    };

    use super::*;
    use crate::clock::ManualClock;
    use crate::domain::sessions::{Placement, SessionRecord};
    use crate::store::{NewSession, NodeRegistration, SqliteStore};

    const TIMEOUT: Duration = Duration::from_secs(30);

    fn t0() -> DateTime<Utc> {
        Utc.timestamp_opt(1_700_000_000, 0).unwrap()
    }

    fn gpu(n: u8) -> GpuInfo {
        GpuInfo {
            uuid: GpuUuid::parse(&format!("GPU-11111111-2222-3333-4444-5555555555{n:02}")).unwrap(),
            model: "NVIDIA A100-SXM4-40GB".to_owned(),
            capability: ComputeCapability::new(8, 0),
            memory: MemorySize::from_mib(40_960),
            pci_bus_id: None,
            driver_version: None,
            mig_enabled: false,
            health: GpuHealth::Healthy,
            utilization_percent: None,
            mig_devices: Vec::new(),
            mig_waiting: None,
        }
    }

    struct Fixture {
        _dir: tempfile::TempDir,
        store: Arc<SqliteStore>,
        scheduler: Scheduler,
        owner: Dn,
    }

    async fn fixture(gpus: &[GpuInfo]) -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(SqliteStore::open(&dir.path().join("m.db")).await.unwrap());
        let owner = Dn::parse("/DC=org/CN=Alice").unwrap();
        store.user(&owner, 20_000).await.unwrap();
        let registration = NodeRegistration {
            name: NodeName::parse("node1").unwrap(),
            gpu_backend: "simulated".to_owned(),
            agent_version: "test".to_owned(),
            stream_url: None,
            start_modes: Default::default(),
        };
        store.register_node(registration, gpus, t0()).await.unwrap();
        let scheduler = Scheduler::new(
            store.clone(),
            Arc::new(ManualClock::new(t0())),
            TIMEOUT,
            Arc::new(Notify::new()),
        );
        Fixture {
            _dir: dir,
            store,
            scheduler,
            owner,
        }
    }

    async fn create(f: &Fixture, at: DateTime<Utc>) -> SessionRecord {
        f.store
            .create_session(NewSession {
                id: SessionId::new_random(),
                name: None,
                owner: f.owner.clone(),
                request: GpuRequest::default(),
                image: "ongrid/dev:latest".to_owned(),
                at,
                reason: "created".to_owned(),
            })
            .await
            .unwrap()
    }

    async fn state(f: &Fixture, s: &SessionRecord) -> SessionRecord {
        f.store.session(s.id).await.unwrap().unwrap()
    }

    #[tokio::test]
    async fn places_in_queue_order_and_waits_for_a_free_gpu() {
        let f = fixture(&[gpu(1)]).await;
        let first = create(&f, t0()).await;
        let second = create(&f, t0() + TimeDelta::seconds(1)).await;
        let report = f.scheduler.tick(t0()).await.unwrap();
        assert_eq!(report.placed, 1);
        let first = state(&f, &first).await;
        assert_eq!(first.state, SessionState::Starting);
        assert_eq!(
            first.reason,
            "placed on node1 (GPU-11111111-2222-3333-4444-555555555501)"
        );
        assert_eq!(first.gpus, vec![GpuId::Gpu(gpu(1).uuid)]);
        assert_eq!(state(&f, &second).await.state, SessionState::Pending);

        // Nothing changes while the GPU is taken.
        assert_eq!(f.scheduler.tick(t0()).await.unwrap(), TickReport::default());

        f.store
            .transition(
                first.id,
                Change {
                    to: SessionState::Ended,
                    at: t0(),
                    reason: "removed".to_owned(),
                    hold: None,
                    placement: Placement::Keep,
                },
            )
            .await
            .unwrap();
        assert_eq!(f.scheduler.tick(t0()).await.unwrap().placed, 1);
        assert_eq!(state(&f, &second).await.state, SessionState::Starting);
    }

    #[tokio::test]
    async fn a_replica_that_does_not_lead_places_nothing_until_it_leads() {
        let mut f = fixture(&[gpu(1)]).await;
        let (lead, leader) = Leader::follower();
        f.scheduler = f.scheduler.with_leader(leader);
        let waiting = create(&f, t0()).await;
        assert_eq!(f.scheduler.tick(t0()).await.unwrap(), TickReport::default());
        assert_eq!(state(&f, &waiting).await.state, SessionState::Pending);
        lead.send_replace(true);
        assert_eq!(f.scheduler.tick(t0()).await.unwrap().placed, 1);
        assert_eq!(state(&f, &waiting).await.state, SessionState::Starting);
    }

    #[tokio::test]
    async fn an_offline_node_gets_no_work_and_gives_back_starting_sessions() {
        let f = fixture(&[gpu(1), gpu(2)]).await;
        let running = create(&f, t0()).await;
        let starting = create(&f, t0()).await;
        assert_eq!(f.scheduler.tick(t0()).await.unwrap().placed, 2);
        f.store
            .transition(
                running.id,
                Change {
                    to: SessionState::Waiting,
                    at: t0(),
                    reason: "container running on node1".to_owned(),
                    hold: None,
                    placement: Placement::Keep,
                },
            )
            .await
            .unwrap();

        // Still within the timeout: nothing moves.
        let later = t0() + TimeDelta::seconds(30);
        assert_eq!(
            f.scheduler.tick(later).await.unwrap(),
            TickReport::default()
        );

        let gone = t0() + TimeDelta::seconds(31);
        let report = f.scheduler.tick(gone).await.unwrap();
        assert_eq!(
            report,
            TickReport {
                placed: 0,
                requeued: 1,
                lost: 1,
                health: 0,
                jobs: 0,
                held: 0,
            }
        );
        let starting = state(&f, &starting).await;
        assert_eq!(starting.state, SessionState::Pending);
        assert_eq!(starting.reason, "node node1 stopped responding");
        assert_eq!(starting.node, None);
        let lost = state(&f, &running).await;
        assert_eq!(lost.state, SessionState::Failed);
        assert!(
            lost.reason.starts_with(
                "node lost: the agent of node1 has not synced since 2023-11-14 22:13:20 UTC \
                 (node_timeout 30 seconds)"
            ),
            "{}",
            lost.reason
        );
        // It keeps its node, so the agent stops its container there when it is back.
        assert_eq!(lost.node.as_ref().map(|n| n.as_str()), Some("node1"));
        // Its GPU no longer counts as used.
        let site = SiteSnapshot::load(f.store.as_ref(), gone, TIMEOUT)
            .await
            .unwrap();
        assert_eq!(site.holding.len(), 0);
        // A second tick changes nothing more.
        assert_eq!(f.scheduler.tick(gone).await.unwrap(), TickReport::default());

        // When the node is back, the session is placed again.
        let node1 = NodeName::parse("node1").unwrap();
        assert!(f
            .store
            .record_sync(&node1, &[gpu(1), gpu(2)], gone)
            .await
            .unwrap());
        assert_eq!(f.scheduler.tick(gone).await.unwrap().placed, 1);
        assert_eq!(state(&f, &starting).await.state, SessionState::Starting);
    }

    #[tokio::test]
    async fn a_released_session_whose_node_is_offline_starts_elsewhere_and_says_so() {
        let f = fixture(&[gpu(1)]).await;
        let session = create(&f, t0()).await;
        assert_eq!(f.scheduler.tick(t0()).await.unwrap().placed, 1);
        for (to, reason) in [
            (SessionState::Waiting, "container running on node1"),
            (SessionState::Held, "owner: held by alice"),
            (SessionState::Pending, "released by alice"),
        ] {
            let change = Change {
                to,
                at: t0(),
                reason: reason.to_owned(),
                hold: None,
                placement: Placement::Keep,
            };
            f.store.transition(session.id, change).await.unwrap();
        }
        // node1 stops responding; node2 has a free GPU.
        let gone = t0() + TimeDelta::seconds(31);
        let registration = NodeRegistration {
            name: NodeName::parse("node2").unwrap(),
            gpu_backend: "simulated".to_owned(),
            agent_version: "test".to_owned(),
            stream_url: None,
            start_modes: Default::default(),
        };
        f.store
            .register_node(registration, &[gpu(2)], gone)
            .await
            .unwrap();
        assert_eq!(f.scheduler.tick(gone).await.unwrap().placed, 1);
        let placed = state(&f, &session).await;
        assert_eq!(placed.state, SessionState::Starting);
        assert_eq!(placed.node.as_ref().map(|n| n.as_str()), Some("node2"));
        assert_eq!(
            placed.reason,
            "placed on node2 (GPU-11111111-2222-3333-4444-555555555502); node1, where its held \
             container is, is offline, so it starts in a new container: the old one is removed \
             when node1 is back (the home volume there is kept)"
        );
    }

    #[tokio::test]
    async fn a_released_session_gets_its_old_gpu_back_when_it_is_free() {
        let f = fixture(&[gpu(1), gpu(2)]).await;
        let first = create(&f, t0()).await;
        let second = create(&f, t0()).await;
        assert_eq!(f.scheduler.tick(t0()).await.unwrap().placed, 2);
        let old_gpus = state(&f, &second).await.gpus;
        let first_gpus = state(&f, &first).await.gpus;
        assert_ne!(old_gpus, first_gpus);
        let step = |to, reason: &str| Change {
            to,
            at: t0(),
            reason: reason.to_owned(),
            hold: None,
            placement: Placement::Keep,
        };
        for (to, reason) in [
            (SessionState::Waiting, "container running on node1"),
            (SessionState::Held, "owner: held by alice"),
            (SessionState::Pending, "released by alice"),
        ] {
            f.store
                .transition(second.id, step(to, reason))
                .await
                .unwrap();
        }
        // The first session ends: both GPUs are free, and the first one would be chosen for a
        // new session; the released one gets its own back, so its container restarts as it is.
        f.store
            .transition(first.id, step(SessionState::Ended, "removed by alice"))
            .await
            .unwrap();
        assert_eq!(f.scheduler.tick(t0()).await.unwrap().placed, 1);
        let placed = state(&f, &second).await;
        assert_eq!(placed.state, SessionState::Starting);
        assert_eq!(placed.gpus, old_gpus);
    }

    #[tokio::test]
    async fn the_loop_runs_when_woken() {
        let f = fixture(&[gpu(1)]).await;
        let wake = f.scheduler.wake.clone();
        let mut ticks = f.scheduler.ticks();
        let shutdown = CancellationToken::new();
        let Fixture {
            store, scheduler, ..
        } = f;
        // An interval far longer than the test: only waking can make the second tick happen.
        let task =
            tokio::spawn(Arc::new(scheduler).run(Duration::from_secs(3600), shutdown.clone()));
        ticks.changed().await.unwrap(); // the interval's immediate first tick
        let owner = Dn::parse("/DC=org/CN=Alice").unwrap();
        let session = store
            .create_session(NewSession {
                id: SessionId::new_random(),
                name: None,
                owner,
                request: GpuRequest::default(),
                image: "ongrid/dev:latest".to_owned(),
                at: t0(),
                reason: "created".to_owned(),
            })
            .await
            .unwrap();
        wake.notify_one();
        tokio::time::timeout(Duration::from_secs(10), ticks.changed())
            .await
            .unwrap()
            .unwrap();
        let placed = store.session(session.id).await.unwrap().unwrap();
        assert_eq!(placed.state, SessionState::Starting);
        shutdown.cancel();
        task.await.unwrap();
    }

    async fn alive(f: &Fixture, at: DateTime<Utc>) {
        let node = NodeName::parse("node1").unwrap();
        assert!(f.store.record_sync(&node, &[gpu(1)], at).await.unwrap());
    }

    #[tokio::test]
    async fn unhealthy_gpus_are_drained_and_their_work_stops_until_an_admin_undrains() {
        use ongrid_core::job::JobState;
        let mut f = fixture(&[gpu(1), gpu(2)]).await;
        let session = create(&f, t0()).await;
        let job = submit_job(&f, None, t0()).await;
        f.scheduler.tick(t0()).await.unwrap();
        assert_eq!(state(&f, &session).await.gpus, [GpuId::Gpu(gpu(1).uuid)]);
        assert_eq!(
            f.store.job(job).await.unwrap().unwrap().state(),
            JobState::Running
        );

        // The node reports GPU 1 failed and GPU 2 unknown (nvidia-smi hangs).
        let node1 = NodeName::parse("node1").unwrap();
        let failed = GpuInfo {
            health: GpuHealth::Failed("Xid 79: GPU has fallen off the bus".into()),
            ..gpu(1)
        };
        let unknown = GpuInfo {
            health: GpuHealth::Unknown("nvidia-smi did not answer".into()),
            ..gpu(2)
        };
        let at = t0() + TimeDelta::seconds(5);
        f.store
            .record_sync(&node1, &[failed, unknown], at)
            .await
            .unwrap();
        let report = f.scheduler.tick(at).await.unwrap();
        // Two drains, the session and the job.
        assert_eq!(report.health, 4);
        let session = state(&f, &session).await;
        assert_eq!(session.state, SessionState::Failed);
        assert!(
            session.reason.starts_with(
                "GPU GPU-11111111-2222-3333-4444-555555555501 is out of service (failed: Xid 79"
            ),
            "{}",
            session.reason
        );
        let halted = f.store.job(job).await.unwrap().unwrap();
        assert_eq!(halted.state(), JobState::Halted, "restartable: re-queued");
        assert!(halted.next_job.is_some());
        let nodes = f.store.nodes().await.unwrap();
        let drains: Vec<_> = nodes[0]
            .gpus
            .iter()
            .map(|g| g.drain.clone().unwrap())
            .collect();
        assert_eq!(drains[0].by, nodes::HEALTH_CHECK);
        assert_eq!(
            drains[0].reason,
            "failed: Xid 79: GPU has fallen off the bus"
        );
        assert_eq!(drains[1].reason, "unknown: nvidia-smi did not answer");
        assert_eq!(f.scheduler.tick(at).await.unwrap().health, 0, "done once");

        // Healthy again: they stay drained, and the re-queued job waits...
        f.store
            .record_sync(&node1, &[gpu(1), gpu(2)], at)
            .await
            .unwrap();
        assert_eq!(f.scheduler.tick(at).await.unwrap(), TickReport::default());
        assert!(f.store.nodes().await.unwrap()[0]
            .gpus
            .iter()
            .all(|g| g.drain.is_some()));
        // ...unless the site lifts the health check's drains itself.
        f.scheduler = Scheduler::new(
            f.store.clone(),
            Arc::new(ManualClock::new(at)),
            TIMEOUT,
            Arc::new(Notify::new()),
        )
        .with_auto_undrain(true);
        let report = f.scheduler.tick(at).await.unwrap();
        assert_eq!(report.health, 2);
        assert!(f.store.nodes().await.unwrap()[0]
            .gpus
            .iter()
            .all(|g| g.drain.is_none()));
        let next = f
            .store
            .job(halted.next_job.unwrap())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(next.state(), JobState::Running);
    }

    async fn submit_job(f: &Fixture, min_duration: Option<&str>, at: DateTime<Utc>) -> JobId {
        let user = f.store.user(&f.owner, 20_000).await.unwrap();
        let spec = ongrid_core::job::JobSpecFile {
            image: Some("model:v1".into()),
            command: vec!["train".into()],
            restartable: true,
            min_duration: min_duration.map(str::to_owned),
            ..Default::default()
        }
        .validate(at)
        .unwrap();
        let image = ongrid_core::job::JobImage {
            digest: format!("sha256:{}", "c".repeat(64)),
            docker_image: "ongrid/alice/model:v1".into(),
        };
        let who = jobs::Submitter {
            owner: f.owner.clone(),
            user_name: user.user_name,
            uid: user.uid,
        };
        let new = jobs::submit(
            JobId::new_random(),
            who,
            spec,
            image,
            &Default::default(),
            None,
            at,
        )
        .unwrap();
        f.store.create_job(new).await.unwrap().id
    }

    #[tokio::test]
    async fn jobs_share_the_gpus_and_a_session_halts_one_past_its_min_duration() {
        use ongrid_core::job::{JobReason, JobState};
        let f = fixture(&[gpu(1)]).await;
        let job = submit_job(&f, Some("10 minutes"), t0()).await;
        assert_eq!(f.scheduler.tick(t0()).await.unwrap().jobs, 1);
        let running = f.store.job(job).await.unwrap().unwrap();
        assert_eq!(running.state(), JobState::Running);
        assert_eq!(running.gpus, vec![GpuId::Gpu(gpu(1).uuid)]);

        // Within its min duration the job keeps the GPU; the session waits.
        let session = create(&f, t0()).await;
        let early = t0() + TimeDelta::minutes(5);
        alive(&f, early).await;
        assert_eq!(
            f.scheduler.tick(early).await.unwrap(),
            TickReport::default()
        );
        assert_eq!(state(&f, &session).await.state, SessionState::Pending);

        // Past it, the session halts the job and waits for it to be HALTED.
        let later = t0() + TimeDelta::minutes(11);
        alive(&f, later).await;
        f.scheduler.tick(later).await.unwrap();
        let halting = f.store.job(job).await.unwrap().unwrap();
        assert_eq!(halting.state(), JobState::MustHalt);
        assert_eq!(
            halting.lifecycle.last().reason,
            JobReason::ForInteractiveSession {
                need: GpuRequest::default()
            }
        );
        assert_eq!(state(&f, &session).await.state, SessionState::Pending);
        assert_eq!(f.scheduler.tick(later).await.unwrap().placed, 0);

        let halted = jobs::JobChange {
            to: JobState::Halted,
            at: later,
            reason: JobReason::HaltedCleanly,
            place: None,
            exit_code: Some(123),
        };
        let next = jobs::next_in_chain(
            &halting,
            &halted,
            JobId::new_random(),
            &jobs::JobLimits::default(),
        )
        .unwrap();
        f.store
            .job_transition(job, halted, Some(next.clone()))
            .await
            .unwrap();
        let report = f.scheduler.tick(later).await.unwrap();
        assert_eq!(report.placed, 1);
        let placed = state(&f, &session).await;
        assert_eq!(placed.state, SessionState::Starting);
        assert!(
            placed.reason.ends_with("it preempted batch work"),
            "{}",
            placed.reason
        );
        // The re-queued job waits: the GPU is the session's now.
        let requeued = f.store.job(next.id).await.unwrap().unwrap();
        assert_eq!(requeued.state(), JobState::Queued);
        assert_eq!(requeued.chain.restart_count, 1);
    }

    #[tokio::test]
    async fn a_job_on_a_node_that_stopped_responding_is_requeued_when_restartable() {
        use ongrid_core::job::JobState;
        let f = fixture(&[gpu(1)]).await;
        let job = submit_job(&f, None, t0()).await;
        f.scheduler.tick(t0()).await.unwrap();
        let gone = t0() + TimeDelta::seconds(31);
        assert_eq!(f.scheduler.tick(gone).await.unwrap().jobs, 1);
        let lost = f.store.job(job).await.unwrap().unwrap();
        assert_eq!(lost.state(), JobState::Halted);
        assert_eq!(
            lost.lifecycle.last().reason.to_string(),
            "node node1 was lost: re-queued (restartable)"
        );
        let next = f.store.job(lost.next_job.unwrap()).await.unwrap().unwrap();
        assert_eq!(next.state(), JobState::Queued);
        // Its checkpoint is on node1, which is gone: the next round fails it, saying so.
        assert_eq!(
            next.pinned_node.as_ref().map(NodeName::as_str),
            Some("node1")
        );
        assert_eq!(f.scheduler.tick(gone).await.unwrap().jobs, 1);
        let failed = f.store.job(next.id).await.unwrap().unwrap();
        assert_eq!(failed.state(), JobState::Failed);
        assert!(
            failed
                .lifecycle
                .last()
                .reason
                .to_string()
                .starts_with("its checkpoint (the chain's working directory) is on node node1"),
            "{}",
            failed.lifecycle.last().reason
        );
    }

    #[tokio::test]
    async fn with_a_shared_work_dir_a_requeued_job_may_start_anywhere() {
        use ongrid_core::job::JobState;
        let mut f = fixture(&[gpu(1)]).await;
        f.scheduler = f.scheduler.with_job_limits(jobs::JobLimits {
            shared_work_dir: true,
            ..jobs::JobLimits::default()
        });
        let job = submit_job(&f, None, t0()).await;
        f.scheduler.tick(t0()).await.unwrap();
        let gone = t0() + TimeDelta::seconds(31);
        f.scheduler.tick(gone).await.unwrap();
        let lost = f.store.job(job).await.unwrap().unwrap();
        let next = f.store.job(lost.next_job.unwrap()).await.unwrap().unwrap();
        assert_eq!(next.pinned_node, None);
        f.scheduler.tick(gone).await.unwrap();
        let waiting = f.store.job(next.id).await.unwrap().unwrap();
        assert_eq!(waiting.state(), JobState::Queued);
    }
}
