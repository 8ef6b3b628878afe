//! The scheduling loop: turns the pure [`ongrid_scheduler::plan`] into stored placements.
//!
//! Every `schedule_interval`, and at once when woken (a session was created or removed, an agent
//! registered or synced, a GPU's mode changed), one [`Scheduler::tick`] runs the round's phases
//! in order, one module each: [`health`] (GPUs reported unhealthy), [`reservations`] (holds due
//! on reserved GPUs), [`lost`] (nodes that stopped responding, checkpoints lost with them),
//! [`input`] (the queue and the policies the plan is given) and [`apply`] (the plan stored: its
//! placements and job changes in one write).
//!
//! The site's rules on waiting requests are in [`crate::domain::policy`]; the loop's use of them
//! is here: [`fair_share`] (charging usage every round, ordering the queue), [`limits`] (holding
//! back requests over a maximum) and [`gpu_policy`] (owned GPUs and reservations as the planner's
//! policy).
//!
//! Batch jobs go through the same plan ([`crate::site::SiteSnapshot`] gives it the QUEUED jobs
//! and those holding GPUs). A `PlaceAfterHalt` is remembered in memory as the session's
//! [`HaltWait`] (the session stays PENDING) and given back to later plans, which place it on
//! those GPUs once the jobs are HALTED; its placement reason then says it preempted batch work.
//! After a manager restart the wait is gone and the next plan decides again (jobs already
//! halting are preferred, so nothing more is halted).
//!
//! A PENDING session that still has a node is a released one whose stopped container is there:
//! it is pinned to that node while the node is registered and online. When the node is offline
//! or gone the pin is dropped, the session starts anywhere in a new container, and the reason of
//! its placement says so.
//!
//! The time comes from the injected [`Clock`], so tests move time instead of sleeping.

mod apply;
pub mod fair_share;
pub mod gpu_policy;
mod health;
mod input;
pub mod limits;
mod lost;
mod reservations;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use ongrid_core::job::JobId;
use ongrid_core::{SessionId, SessionState};
use ongrid_scheduler::HaltWait;
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;

use self::gpu_policy::GpuPolicy;
use crate::clock::Clock;
use crate::domain::jobs::{self, JobChange};
use crate::domain::policy::fairshare::Account;
use crate::domain::sessions::holds::LifecycleFacts;
use crate::domain::sessions::{Change, SessionRecord};
use crate::notify::Changes;
use crate::site::SiteSnapshot;
use crate::store::{FactsScope, Store, StoreError, StoreResult};

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

    /// Waits for the lead to be taken or lost after the last call (the first call may also end
    /// at a change made before it); never ends when nothing can change it any more.
    pub async fn changed(&mut self) {
        tokio::select! {
            Ok(()) = self.leading.changed() => {}
            Ok(()) = self.behind.changed() => {}
            else => std::future::pending().await,
        }
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
    /// Rounds started (counted under `tick_lock`), so that requests waiting for a round after
    /// their commit share one ([`Self::tick_covering`]).
    rounds: AtomicU64,
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
    limit_waits: std::sync::Mutex<HashMap<limits::Waiting, String>>,
    /// Owned GPUs and reservations: the site's settings for them (`None`: sessions' lifetimes
    /// unknown, planned as the default `[lifecycle]`'s).
    gpu_policy: Option<gpu_policy::PolicySettings>,
    /// Whether this manager leads its database's replicas: a follower's rounds do nothing.
    leader: Leader,
    /// The rounds requests asked for ([`Self::cover`]): the manager waits for them before it
    /// closes the store ([`Self::finish_requested_rounds`]).
    requested: tokio_util::task::TaskTracker,
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
            rounds: AtomicU64::new(0),
            job_limits: jobs::JobLimits::default(),
            auto_undrain: false,
            fair_share: None,
            limits: None,
            limit_waits: std::sync::Mutex::new(HashMap::new()),
            gpu_policy: None,
            leader: Leader::sole(),
            requested: tokio_util::task::TaskTracker::new(),
        }
    }

    /// Schedules only while `leader` says this replica leads (default: always).
    pub fn with_leader(mut self, leader: Leader) -> Self {
        self.leader = leader;
        self
    }

    /// The site's settings for owned GPUs and reservations (`[policy] sessions_on_owned_gpus`,
    /// sessions' lifetimes).
    pub fn with_gpu_policy(mut self, settings: gpu_policy::PolicySettings) -> Self {
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
    pub fn limit_wait(&self, waiting: limits::Waiting) -> Option<String> {
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

    /// Ticks every `interval`, whenever woken, and when a clock that does not move by itself
    /// jumps ([`Clock::jumps`]), until `shutdown`.
    pub async fn run(self: Arc<Self>, interval: Duration, shutdown: CancellationToken) {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut jumps = self.clock.jumps();
        loop {
            let jumped = async {
                let moved = match jumps.as_mut() {
                    Some(jumps) => jumps.changed().await.is_ok(),
                    None => false,
                };
                if !moved {
                    std::future::pending::<()>().await;
                }
            };
            tokio::select! {
                () = shutdown.cancelled() => break,
                _ = ticker.tick() => {}
                () = self.wake.notified() => {}
                () = jumped => {}
            }
            match self.tick_now().await {
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

    /// One round of scheduling at time `now`, in phases; rounds never overlap (the loop and the
    /// API, which schedules a new session at once, take turns). On a replica that does not lead
    /// ([`crate::replicas`]) it does nothing.
    ///
    /// 1. [`Self::check_health`]: GPUs reported unhealthy drained, their work stopped;
    /// 2. [`Self::hold_for_reservations`]: others' sessions on a reservation's GPUs held;
    /// 3. [`Self::give_up_lost_nodes`]: work of nodes that stopped responding re-queued or lost;
    /// 4. [`Self::fail_jobs_of_lost_checkpoints`]: re-queued jobs whose checkpoint is gone;
    /// 5. [`Self::plan_input`]: the queue (pins, halt waits), ordered by fair share, without what
    ///    a limit holds back, with the owned GPUs' and reservations' policy;
    /// 6. [`Self::apply_plan`]: the plan (whole and shared GPUs, then MIG devices) stored.
    ///
    /// The site is read once; again before the plan only when a phase changed it.
    pub async fn tick(&self, now: DateTime<Utc>) -> StoreResult<TickReport> {
        let mut halt_waits = self.tick_lock.lock().await;
        self.round(&mut halt_waits, now).await
    }

    /// A round at the time it starts, once the round under way (a request's) has ended: the
    /// time its changes are stored with is never one from before it began.
    async fn tick_now(&self) -> StoreResult<TickReport> {
        let mut halt_waits = self.tick_lock.lock().await;
        self.round(&mut halt_waits, self.clock.now()).await
    }

    /// A round that starts after this call: what a request that just committed a change needs
    /// for its answer to reflect it. Run here, unless the round of another caller waiting at
    /// the same time started after this call (then that one covered it, and `None`): a burst
    /// of requests shares rounds instead of queueing one round each.
    pub async fn tick_covering(&self) -> StoreResult<Option<TickReport>> {
        let needed = self.rounds.load(AtomicOrdering::SeqCst) + 1;
        let mut halt_waits = self.tick_lock.lock().await;
        if self.rounds.load(AtomicOrdering::SeqCst) >= needed {
            return Ok(None);
        }
        self.round(&mut halt_waits, self.clock.now())
            .await
            .map(Some)
    }

    /// [`Self::tick_covering`] in a task of its own, then `asked` covered in the scheduler's
    /// [`Changes`] ([`Changes::round_covered`]): a request that asked for the round (for
    /// `session`) may answer before it ends (`placement_wait`) without the round being given up.
    /// A round run after the lead was lost covers nothing, as in `replicas.rs`: the request stays
    /// among those that ask the next leader again.
    pub fn cover(self: &Arc<Self>, asked: u64, session: SessionId) {
        let scheduler = self.clone();
        self.requested.spawn(async move {
            if let Err(error) = scheduler.tick_covering().await {
                tracing::error!(%error, %session, "Scheduling at once failed; the loop retries.");
            }
            if let (true, Some(changes)) = (scheduler.leader.is_leading(), &scheduler.changes) {
                changes.round_covered(asked);
            }
        });
    }

    /// Waits for the rounds requests asked for ([`Self::cover`]) to end, so that none runs on a
    /// closed store; called once the server stopped taking requests.
    pub async fn finish_requested_rounds(&self) {
        self.requested.close();
        self.requested.wait().await;
    }

    /// A round, timed (`ongrid_scheduler_round_duration_seconds`): the loop's and those a request
    /// runs at once alike, from its first read to its last write, not the wait for the one before.
    async fn round(
        &self,
        halt_waits: &mut HashMap<SessionId, HaltWait>,
        now: DateTime<Utc>,
    ) -> StoreResult<TickReport> {
        self.rounds.fetch_add(1, AtomicOrdering::SeqCst);
        if !self.leader.is_leading() {
            return Ok(TickReport::default());
        }
        let started = std::time::Instant::now();
        let round = self.phases(halt_waits, now).await;
        crate::metrics::events().round_took(started.elapsed());
        round
    }

    async fn phases(
        &self,
        halt_waits: &mut HashMap<SessionId, HaltWait>,
        now: DateTime<Utc>,
    ) -> StoreResult<TickReport> {
        let mut report = TickReport::default();
        let mut reads = Reads::new(self.store.as_ref());
        let started = std::time::Instant::now();
        let (site, pending) =
            SiteSnapshot::load_for_planning(self.store.as_ref(), now, self.node_timeout).await?;
        let site_read = started.elapsed();
        // Owners and reservations, read once for the round: nothing in it changes them.
        let gpu_policy = GpuPolicy::load(self.store.as_ref(), now).await?;
        report.health = self.check_health(&site, now).await?;
        report.held = self
            .hold_for_reservations(&site, &gpu_policy, &mut reads, now)
            .await?;
        self.give_up_lost_nodes(&site, now, &mut report).await?;
        report.jobs += self.fail_jobs_of_lost_checkpoints(&site, now).await?;
        let (site, pending) = if report == TickReport::default() {
            (site, pending)
        } else {
            SiteSnapshot::load_for_planning(self.store.as_ref(), now, self.node_timeout).await?
        };
        halt_waits.retain(|id, _| pending.iter().any(|s| s.id == *id));
        if let Some(config) = &self.fair_share {
            let accounts = reads.accounts().await?.to_vec();
            reads.charged(
                fair_share::meter(self.store.as_ref(), config, &site, accounts, now).await?,
            );
        }
        if pending.is_empty() && site.jobs.is_empty() {
            crate::metrics::events().queued(&Default::default());
            return Ok(report);
        }
        let round = Round {
            site: &site,
            jobs: site.jobs.iter().map(|job| (job.id, &**job)).collect(),
            pending: &pending,
            gpu_policy: &gpu_policy,
            now,
        };
        let before_input = started.elapsed();
        let (state, unpinned) = self.plan_input(&round, halt_waits, &mut reads).await?;
        let before_apply = started.elapsed();
        let (placed, planned) = self
            .apply_plan(&round, &state, halt_waits, &unpinned, &mut report)
            .await?;
        let ms = |duration: std::time::Duration| duration.as_secs_f64() * 1e3;
        tracing::debug!(
            site_ms = ms(site_read),
            phases_ms = ms(before_input - site_read),
            input_ms = ms(before_apply - before_input),
            plan_ms = ms(planned),
            write_ms = ms(started.elapsed() - before_apply - planned),
            nodes = site.nodes.len(),
            holding = site.holding.len(),
            pending = pending.len(),
            "Round's phases timed."
        );
        crate::metrics::events().queued(&crate::metrics::queue_reasons(
            &pending, &placed, halt_waits, &unpinned,
        ));
        Ok(report)
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

/// What a round's later phases share: the site and the queue as read for the plan.
struct Round<'a> {
    site: &'a SiteSnapshot,
    /// The site's jobs by id: a round that starts thousands of jobs looked each up among all.
    jobs: HashMap<JobId, &'a jobs::JobRecord>,
    pending: &'a [SessionRecord],
    gpu_policy: &'a GpuPolicy,
    now: DateTime<Utc>,
}

/// What a round reads of the store beside the site, each at most once and only when a phase
/// needs it: the fair-share accounts (groups and usage) and the lifecycle facts of the sessions
/// that hold GPUs or wait.
struct Reads<'a> {
    store: &'a dyn Store,
    accounts: Option<Vec<Account>>,
    facts: Option<Vec<LifecycleFacts>>,
}

impl<'a> Reads<'a> {
    fn new(store: &'a dyn Store) -> Self {
        Self {
            store,
            accounts: None,
            facts: None,
        }
    }

    async fn accounts(&mut self) -> StoreResult<&[Account]> {
        if self.accounts.is_none() {
            self.accounts = Some(self.store.usage_accounts().await?);
        }
        Ok(self.accounts.as_deref().unwrap_or_default())
    }

    /// The accounts as fair share charged and stored them this round.
    fn charged(&mut self, accounts: Vec<Account>) {
        self.accounts = Some(accounts);
    }

    async fn facts(&mut self) -> StoreResult<&[LifecycleFacts]> {
        if self.facts.is_none() {
            let mut states = crate::site::holding_states();
            states.push(SessionState::Pending);
            let facts = self
                .store
                .lifecycle_facts(FactsScope::States(states))
                .await?;
            self.facts = Some(facts);
        }
        Ok(self.facts.as_deref().unwrap_or_default())
    }

    async fn accounts_and_facts(&mut self) -> StoreResult<(&[Account], &[LifecycleFacts])> {
        self.accounts().await?;
        self.facts().await?;
        Ok((
            self.accounts.as_deref().unwrap_or_default(),
            self.facts.as_deref().unwrap_or_default(),
        ))
    }
}

#[cfg(test)]
mod tests;
