//! The mirroring loop of grid targets: every `[targets] poll_interval` (and at once when woken
//! by a submission, a cancel or a halt) it asks each engine about the jobs it was handed, stores
//! what that means as the jobs' transitions (the rules are `crate::domain::grid_jobs`), tells
//! the engines what the manager decided (halt, cancel, the next job of a chain), and copies
//! the jobs' output into the manager's job logs, so `devctl job ls/show/logs` read one list
//! whatever the target.
//!
//! A submission stores the job (with its `grid_jobs` row) first, then runs the engine's
//! submit, then stores the engine's id, and only then answers: a manager stopped half-way finds
//! the job again by its engine name (`ongrid-<id>`) at its next poll, or fails it after
//! [`crate::domain::grid_jobs::SUBMIT_TIMEOUT`] when the engine never got it.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use ongrid_core::job::{JobId, LogChunk, JOB_LOG_CHUNK_MAX};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::clock::Clock;
use crate::domain::engine_job::EnginePoll;
use crate::domain::grid_jobs::{self, EngineOrder, Observation};
use crate::domain::jobs::{JobChange, JobLimits, JobRecord, NewJob};
use crate::job_logs::JobLogs;
use crate::notify::Changes;
use crate::store::{Store, StoreError};
use crate::targets::{Target, TargetError, TargetJob, Targets, Tracked};

/// Why a submission did not reach its engine.
#[derive(Debug, thiserror::Error)]
pub enum HandOverError {
    /// The engine refused it; the job is FAILED with the engine's words.
    #[error("{target} refused the job: {message}")]
    Refused {
        target: ongrid_core::job::JobTarget,
        message: String,
        job: Box<JobRecord>,
    },
    /// The engine could not be asked; the job is FAILED saying so.
    #[error("{0}")]
    Unavailable(String, Box<JobRecord>),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The loop, and the hand-over of new jobs the API calls.
pub struct GridMirror {
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    targets: Arc<Targets>,
    limits: JobLimits,
    logs: JobLogs,
    wake: Notify,
    changes: Option<Changes>,
}

impl GridMirror {
    pub fn new(
        store: Arc<dyn Store>,
        clock: Arc<dyn Clock>,
        targets: Arc<Targets>,
        limits: JobLimits,
        logs: JobLogs,
    ) -> Self {
        Self {
            store,
            clock,
            targets,
            limits,
            logs,
            wake: Notify::new(),
            changes: None,
        }
    }

    /// Notifies `changes` after every job it changes or whose output grows.
    pub fn with_changes(mut self, changes: Changes) -> Self {
        self.changes = Some(changes);
        self
    }

    pub fn targets(&self) -> &Targets {
        &self.targets
    }

    /// Runs a round now (a halt or cancel to pass on).
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    fn notify(&self) {
        if let Some(changes) = &self.changes {
            changes.site();
        }
    }

    /// A round every poll interval, or when woken, until `shutdown`. Does nothing when no
    /// engine is configured.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        if self.targets.engines().is_empty() {
            return;
        }
        let interval = self.targets.config().poll_interval;
        loop {
            if let Err(error) = self.round().await {
                tracing::error!(%error, "Mirroring the grid targets' jobs failed; retrying.");
            }
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = tokio::time::sleep(interval) => {}
                () = self.wake.notified() => {}
            }
        }
    }

    /// Hands a newly stored job to its engine and stores the engine's id before returning.
    pub async fn hand_over(&self, job: JobRecord) -> Result<JobRecord, HandOverError> {
        let grid = job.grid.clone().ok_or_else(|| {
            HandOverError::Unavailable("not a grid job".to_owned(), Box::new(job.clone()))
        })?;
        let Some(engine) = self.targets.engine(grid.target).cloned() else {
            let message = format!("target {} is not configured any more", grid.target);
            let job = self.fail(&job, &message).await?;
            return Err(HandOverError::Unavailable(message, Box::new(job)));
        };
        let Some(sif) = self.targets.sif_path(grid.target, &job.image.digest) else {
            let message = format!("image digest {} has no SIF path", job.image.digest);
            let job = self.fail(&job, &message).await?;
            return Err(HandOverError::Unavailable(message, Box::new(job)));
        };
        let target_job = TargetJob {
            id: job.id,
            spec: job.spec.clone(),
            max_duration: job.max_duration,
            sif,
            account: grid.account.clone(),
            chain: job.chain,
        };
        match engine.submit(&target_job).await {
            Ok(engine_id) => {
                self.store.set_engine_id(job.id, &engine_id).await?;
                self.notify();
                let job = self
                    .store
                    .job(job.id)
                    .await?
                    .ok_or(StoreError::NoSuchJob(job.id))?;
                self.wake();
                Ok(job)
            }
            Err(TargetError::Refused(message)) => {
                let change = grid_jobs::refused(grid.target, &message, self.clock.now());
                let job = self.store.job_transition(job.id, change, None).await?;
                self.store
                    .record_engine_poll(job.id, EnginePoll::done("refused", self.clock.now()))
                    .await?;
                self.notify();
                tracing::info!(job_id = %job.id, target = %grid.target, reason = ?message, "Job refused by its target.");
                Err(HandOverError::Refused {
                    target: grid.target,
                    message,
                    job: Box::new(job),
                })
            }
            Err(TargetError::Unavailable(message)) => {
                tracing::error!(job_id = %job.id, target = %grid.target, error = %message, "Could not hand a job to its target.");
                let words = format!(
                    "{} could not be reached: submit it again later, or ask the site",
                    grid.target
                );
                let job = self.fail(&job, &words).await?;
                Err(HandOverError::Unavailable(words, Box::new(job)))
            }
        }
    }

    async fn fail(&self, job: &JobRecord, message: &str) -> Result<JobRecord, StoreError> {
        let change = JobChange {
            to: ongrid_core::job::JobState::Failed,
            at: self.clock.now(),
            reason: ongrid_core::job::JobReason::CouldNotRun {
                message: message.to_owned(),
            },
            place: None,
            exit_code: None,
        };
        let job = self.store.job_transition(job.id, change, None).await?;
        self.store
            .record_engine_poll(job.id, EnginePoll::done("not submitted", self.clock.now()))
            .await?;
        self.notify();
        Ok(job)
    }

    /// One round over every engine.
    pub async fn round(&self) -> Result<(), StoreError> {
        let jobs = self.store.grid_jobs_to_mirror().await?;
        for engine in self.targets.engines() {
            let mine: Vec<&JobRecord> = jobs
                .iter()
                .filter(|j| j.grid.as_ref().is_some_and(|g| g.target == engine.kind()))
                .collect();
            if mine.is_empty() {
                continue;
            }
            self.orders(engine.as_ref(), &mine).await?;
            self.poll(engine.as_ref(), &mine).await?;
            self.copy_output(engine.as_ref()).await?;
        }
        Ok(())
    }

    /// Tells the engine what the manager decided: submit, halt, kill, cancel.
    async fn orders(&self, engine: &dyn Target, jobs: &[&JobRecord]) -> Result<(), StoreError> {
        let now = self.clock.now();
        for job in jobs {
            let Some(order) = grid_jobs::order(job, now) else {
                continue;
            };
            let Some(tracked) = Tracked::of(job) else {
                continue;
            };
            match order {
                EngineOrder::Submit => {
                    self.store.mark_submit_started(job.id, Some(now)).await?;
                    match self.hand_over((*job).clone()).await {
                        Ok(_) | Err(HandOverError::Refused { .. }) => {}
                        Err(HandOverError::Unavailable(message, _)) => {
                            tracing::warn!(job_id = %job.id, error = %message, "Re-queued job not handed over.");
                        }
                        Err(HandOverError::Store(e)) => return Err(e),
                    }
                }
                EngineOrder::Halt => match engine.halt(&tracked).await {
                    Ok(()) => {
                        if let Some(change) = grid_jobs::halt_sent(job, now) {
                            self.store.job_transition(job.id, change, None).await?;
                            self.notify();
                            tracing::info!(job_id = %job.id, "Halt signal sent through the job's target.");
                        }
                    }
                    Err(error) => {
                        tracing::warn!(job_id = %job.id, %error, "Could not halt a grid job; retrying.")
                    }
                },
                EngineOrder::Cancel => {
                    if let Err(error) = engine.cancel(&tracked).await {
                        tracing::warn!(job_id = %job.id, %error, "Could not cancel a grid job; retrying.");
                    }
                }
            }
        }
        Ok(())
    }

    /// Asks the engine about the jobs it has not ended, and stores what that means.
    async fn poll(&self, engine: &dyn Target, jobs: &[&JobRecord]) -> Result<(), StoreError> {
        // Fresh records: the orders may have changed some.
        let mut open = Vec::new();
        for job in jobs {
            if let Some(job) = self.store.job(job.id).await? {
                if job.grid.as_ref().is_some_and(|g| !g.engine_final) {
                    open.push(job);
                }
            }
        }
        let tracked: Vec<Tracked> = open
            .iter()
            .filter(|j| {
                let g = j.grid.as_ref();
                g.is_some_and(|g| g.engine_id.is_some() || g.submit_started_at.is_some())
            })
            .filter_map(Tracked::of)
            .collect();
        if tracked.is_empty() {
            return Ok(());
        }
        let observations = match engine.status(&tracked).await {
            Ok(observations) => observations,
            Err(error) => {
                tracing::warn!(target = %engine.kind(), %error, "Could not ask the target about its jobs; retrying.");
                return Ok(());
            }
        };
        let now = self.clock.now();
        for job in open
            .iter()
            .filter(|j| tracked.iter().any(|t| t.job == j.id))
        {
            let Some(grid) = &job.grid else { continue };
            let seen = observations.iter().find(|o| match &grid.engine_id {
                Some(id) => &o.engine_id == id,
                None => o.job == Some(job.id),
            });
            match seen {
                Some(observation) => self.follow(job, observation, now).await?,
                None => {
                    if let Some(change) = grid_jobs::lost(job, now) {
                        tracing::warn!(job_id = %job.id, target = %engine.kind(), "The target no longer knows a job.");
                        self.store.job_transition(job.id, change, None).await?;
                        self.store
                            .record_engine_poll(
                                job.id,
                                EnginePoll::done("unknown to the target", now),
                            )
                            .await?;
                        self.notify();
                    }
                }
            }
        }
        Ok(())
    }

    async fn follow(
        &self,
        job: &JobRecord,
        observation: &Observation,
        now: DateTime<Utc>,
    ) -> Result<(), StoreError> {
        let grid = job.grid.as_ref();
        if grid.is_some_and(|g| g.engine_id.is_none()) {
            // Submitted by a manager that stopped before storing the id: found by name.
            self.store
                .set_engine_id(job.id, &observation.engine_id)
                .await?;
        }
        let decision = grid_jobs::mirror(job, observation, &self.limits, JobId::new_random(), now);
        let count = decision.changes.len();
        let mut next: Option<NewJob> = decision.next;
        for (i, change) in decision.changes.into_iter().enumerate() {
            let with = if i + 1 == count { next.take() } else { None };
            tracing::info!(job_id = %job.id, to = %change.to, reason = %change.reason, "Grid job changed state.");
            self.store.job_transition(job.id, change, with).await?;
        }
        let poll = EnginePoll {
            state: &observation.raw,
            waiting: decision.waiting.as_deref(),
            engine_final: decision.engine_final,
            at: now,
        };
        self.store.record_engine_poll(job.id, poll).await?;
        if count > 0 || decision.waiting != job.grid.as_ref().and_then(|g| g.engine_waiting.clone())
        {
            self.notify();
        }
        Ok(())
    }

    /// Copies new output of the jobs whose output is not all in.
    async fn copy_output(&self, engine: &dyn Target) -> Result<(), StoreError> {
        let jobs = self.store.grid_jobs_to_mirror().await?;
        for job in jobs
            .iter()
            .filter(|j| j.grid.as_ref().is_some_and(|g| g.target == engine.kind()))
        {
            let Some(tracked) = Tracked::of(job) else {
                continue;
            };
            if tracked.engine_id.is_none() {
                if job.grid.as_ref().is_some_and(|g| g.engine_final) {
                    self.store
                        .record_job_log(job.id, job.log_size, true)
                        .await?;
                }
                continue;
            }
            let output = match engine.logs(&tracked, job.log_size, JOB_LOG_CHUNK_MAX).await {
                Ok(output) => output,
                Err(error) => {
                    tracing::warn!(job_id = %job.id, %error, "Could not read a grid job's output; retrying.");
                    continue;
                }
            };
            let done = job.grid.as_ref().is_some_and(|g| g.engine_final) && job.state().is_final();
            let end = job.log_size + output.data.len() as u64 >= output.size;
            if output.data.is_empty() {
                if done {
                    self.store
                        .record_job_log(job.id, job.log_size, true)
                        .await?;
                    self.notify();
                }
                continue;
            }
            let chunk = LogChunk {
                offset: job.log_size,
                data: output.data,
                complete: false,
            };
            match self.logs.append(job.id, job.log_size, &chunk).await {
                Ok(Some(size)) => {
                    self.store.record_job_log(job.id, size, done && end).await?;
                    self.notify();
                }
                Ok(None) => {}
                Err(error) => {
                    tracing::error!(job_id = %job.id, %error, "Could not keep a grid job's output.");
                }
            }
        }
        Ok(())
    }
}
