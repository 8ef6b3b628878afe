//! The rules that move a batch job between GPULab's states, as pure functions of what is known
//! (the job as stored, a scheduler action, an agent's report, an owner's request) and `now`.
//!
//! - [`submit`]: a new QUEUED job with its effective max duration ([`effective_max_duration`]).
//! - The scheduler's actions: [`start`] (QUEUED → RUNNING), [`must_halt`] (→ MUSTHALT),
//!   [`cancel_queued`] (QUEUED → CANCELLED, e.g. past notAfter).
//! - An agent's report: [`follow_report`] (→ HALTING, HALTED, FINISHED, FAILED through
//!   [`JobState::after_exit`]; a killed halt is HALTED, having ignored SIGUSR1).
//! - The owner: [`cancel_by_owner`], [`halt_by_owner`]; removing an ended job's record:
//!   [`removal`] (and the retention's [`prune_before`]).
//! - A node that stopped syncing: [`node_lost`].
//! - A job that ends HALTED and continues its chain (restartable, or exit 85) is followed by a
//!   new QUEUED job of the same [`RestartChain`]: [`next_in_chain`]. Unless the site's jobs
//!   directory is shared storage (`[jobs] shared_work_dir`), that job is pinned to the node that
//!   holds the chain's working directory, and FAILED when that node is gone or offline
//!   ([`checkpoint_node_lost`]).
//! - What a node runs, halts or kills: [`desired_jobs`].
//!
//! A decision is a [`JobChange`] (and, for a chain that goes on, a [`NewJob`]); the store applies
//! it through the job's [`JobLifecycle`], which refuses a move the state machine does not allow.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use ongrid_core::api::{ContainerLimits, ContainerUser};
use ongrid_core::job::{
    continues_chain, remaining_max_duration, DesiredJob, InvalidJobTransition, JobId, JobImage,
    JobLifecycle, JobReason, JobRun, JobSpec, JobState, JobTarget, ObservedJobStatus, RestartChain,
};
use ongrid_core::{Dn, GpuId, GpuRequest, HumanDuration, NodeName, UserName};

use ongrid_core::image::{ImageLookup, ImageState};

use super::engine_job::GridJob;
use super::image_access;
use super::images::ImageRecord;
use super::Refusal;

/// How long, by default (`[jobs] output_grace`), the desired state keeps listing a job that
/// ended while its output is not all in: an agent that syncs within this time sends the rest
/// (and is told to kill what is left). Output that comes later is lost.
pub const DEFAULT_OUTPUT_GRACE: Duration = Duration::from_secs(10 * 60);

/// A job as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobRecord {
    pub id: JobId,
    pub owner: Dn,
    pub user_name: UserName,
    pub uid: u32,
    pub spec: JobSpec,
    /// Its state and every transition.
    pub lifecycle: JobLifecycle,
    /// The max duration it runs under (see [`effective_max_duration`]; for a re-queued job, what
    /// its chain has left). `None`: no limit (jobs stored before every job had one).
    pub max_duration: Option<HumanDuration>,
    pub image: JobImage,
    /// Where it runs or ran; kept after it ends.
    pub node: Option<NodeName>,
    pub gpus: Vec<GpuId>,
    pub chain: RestartChain,
    pub previous_job: Option<JobId>,
    pub next_job: Option<JobId>,
    pub exit_code: Option<i32>,
    /// How many bytes of its output the manager has.
    pub log_size: u64,
    /// The agent said nothing follows those bytes.
    pub log_complete: bool,
    /// The only node it may start on: where its chain's working directory (its checkpoint) is.
    pub pinned_node: Option<NodeName>,
    /// Its life in a grid target's engine; `None` for the local target.
    pub grid: Option<GridJob>,
}

impl JobRecord {
    pub fn state(&self) -> JobState {
        self.lifecycle.state()
    }

    /// When it entered the queue: its first transition.
    pub fn queued_at(&self) -> DateTime<Utc> {
        self.lifecycle.history()[0].at
    }

    /// When it reached a final state, if it did.
    pub fn finished_at(&self) -> Option<DateTime<Utc>> {
        self.state().is_final().then(|| self.lifecycle.last().at)
    }

    /// When it was asked to halt (its MUSTHALT), if it was.
    pub fn halt_requested_at(&self) -> Option<DateTime<Utc>> {
        self.lifecycle
            .history()
            .iter()
            .rev()
            .find(|t| t.to == JobState::MustHalt)
            .map(|t| t.at)
    }

    /// The job as storing `change` leaves it (its lifecycle, exit code and placement), for a
    /// caller that decides more on it before anything is read back; the link to a next job of
    /// its chain is the store's to set. A move its lifecycle refuses changes nothing.
    pub fn apply(&mut self, change: &JobChange) -> Result<(), InvalidJobTransition> {
        self.lifecycle
            .transition(change.to, change.at, change.reason.clone())?;
        self.exit_code = change.exit_code.or(self.exit_code);
        if let Some((node, gpus)) = &change.place {
            self.node = Some(node.clone());
            self.gpus = gpus.clone();
        }
        Ok(())
    }
}

/// The cap of every job's max duration when the site's config sets none (`[jobs]
/// max_duration`): two weeks, the longest a session may ask to live by default. No job runs
/// unbounded.
pub const DEFAULT_MAX_DURATION: HumanDuration = HumanDuration::from_secs(14 * 86_400);

/// The site's settings for jobs (`[jobs]` in the manager's config).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobLimits {
    /// For a job that names no max duration.
    pub default_max_duration: Option<HumanDuration>,
    /// No job runs longer than this; a job asking for more is refused.
    pub max_duration: HumanDuration,
    /// How long a job that ended stays listed to its node while its output is not all in.
    pub output_grace: Duration,
    /// The agents' jobs directory is the same shared storage on every node, so a re-queued job
    /// may run anywhere; otherwise it is pinned to the node that holds its chain's directory.
    pub shared_work_dir: bool,
}

impl Default for JobLimits {
    fn default() -> Self {
        Self {
            default_max_duration: None,
            max_duration: DEFAULT_MAX_DURATION,
            output_grace: DEFAULT_OUTPUT_GRACE,
            shared_work_dir: false,
        }
    }
}

/// The max duration a submitted job runs under: the spec's, else the site's default, else the
/// site's maximum; never more than the maximum (a spec asking for more is refused by
/// [`check_durations`]).
pub fn effective_max_duration(spec: &JobSpec, limits: &JobLimits) -> HumanDuration {
    spec.max_duration
        .or(limits.default_max_duration)
        .unwrap_or(limits.max_duration)
        .min(limits.max_duration)
}

/// Refuses a spec whose max (or min) duration is longer than the site's maximum, saying the
/// maximum and how to ask for less.
pub fn check_durations(spec: &JobSpec, limits: &JobLimits) -> Result<(), Refusal> {
    let cap = limits.max_duration;
    let asks = [
        (
            "max duration",
            spec.max_duration,
            "--max-duration",
            "max_duration",
        ),
        (
            "min duration",
            spec.min_duration,
            "--min-duration",
            "min_duration",
        ),
    ];
    for (what, asked, flag, key) in asks {
        if let Some(asked) = asked.filter(|&asked| asked > cap) {
            return Err(Refusal::Invalid(format!(
                "{what} {asked} ({} seconds) is more than this site allows ({cap}): ask for \
                 {cap} or less ({flag} of devctl job submit, {key} in a job file)",
                asked.as_duration().as_secs()
            )));
        }
    }
    Ok(())
}

/// A job to create, QUEUED.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewJob {
    pub id: JobId,
    pub owner: Dn,
    pub user_name: UserName,
    pub uid: u32,
    pub spec: JobSpec,
    pub max_duration: Option<HumanDuration>,
    pub image: JobImage,
    pub chain: RestartChain,
    pub previous_job: Option<JobId>,
    /// Its creation: `Submitted`, or `Requeued`.
    pub at: DateTime<Utc>,
    pub reason: JobReason,
    /// See [`JobRecord::pinned_node`].
    pub pinned_node: Option<NodeName>,
    /// See [`JobRecord::grid`].
    pub grid: Option<GridJob>,
}

/// The job as storing `new` makes it: QUEUED, nowhere yet, no output.
impl From<NewJob> for JobRecord {
    fn from(new: NewJob) -> Self {
        Self {
            id: new.id,
            owner: new.owner,
            user_name: new.user_name,
            uid: new.uid,
            spec: new.spec,
            lifecycle: JobLifecycle::new(new.at, new.reason),
            max_duration: new.max_duration,
            image: new.image,
            node: None,
            gpus: Vec::new(),
            chain: new.chain,
            previous_job: new.previous_job,
            next_job: None,
            exit_code: None,
            log_size: 0,
            log_complete: false,
            pinned_node: new.pinned_node,
            grid: new.grid,
        }
    }
}

/// Who submits, and the image their spec resolved to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Submitter {
    pub owner: Dn,
    pub user_name: UserName,
    pub uid: u32,
}

/// A newly submitted job: QUEUED, `Submitted`, first of its chain. `grid` is where a job of a
/// grid target goes (from [`super::grid_jobs::choose_target`]); `None` runs it here. The spec
/// stored names its target.
pub fn submit(
    id: JobId,
    who: Submitter,
    mut spec: JobSpec,
    image: JobImage,
    limits: &JobLimits,
    grid: Option<GridJob>,
    now: DateTime<Utc>,
) -> Result<NewJob, Refusal> {
    spec.target = Some(grid.as_ref().map_or(JobTarget::Local, |g| g.target));
    if let (Some(grid), Some(profile)) = (&grid, spec.gpus.sharing.mig()) {
        return Err(Refusal::Invalid(format!(
            "target {target} cannot give a MIG device: ongrid hands out MIG {profile} devices \
             only on this site's own GPUs, and {target} asks its engine for whole GPUs; submit \
             with --to local, or without --mig for whole GPUs on {target}",
            target = grid.target
        )));
    }
    check_durations(&spec, limits)?;
    if let Some(not_after) = spec.not_after.filter(|&t| t <= now) {
        return Err(Refusal::Invalid(format!(
            "not-after {} has passed: the job would be cancelled at once; give a later time",
            not_after.to_rfc3339()
        )));
    }
    Ok(NewJob {
        id,
        owner: who.owner,
        user_name: who.user_name,
        uid: who.uid,
        max_duration: Some(effective_max_duration(&spec, limits)),
        spec,
        image,
        chain: RestartChain::first(id),
        previous_job: None,
        at: now,
        reason: JobReason::Submitted,
        pinned_node: None,
        grid,
    })
}

/// The frozen image a job of `caller` runs, from the images the lookup found (the caller's
/// by tag, a login's by `login/name:version`, anyone's by digest): a READY image the caller
/// may run ([`super::image_access::may_run`]: their own, or one its owner shares). A tag
/// `--force` moved on is found by digest. Nothing found and only someone else's private images
/// found are the same refusal (403, [`image_access::no_image_you_may_run`]), as for sessions, so
/// that a submission cannot tell whether another user has an image; a runnable image that is
/// not READY is a conflict (409).
pub fn resolve_image(
    lookup: &ImageLookup,
    candidates: &[ImageRecord],
    caller: &Dn,
) -> Result<JobImage, Refusal> {
    let runnable: Vec<&ImageRecord> = candidates
        .iter()
        .filter(|i| image_access::may_run(i, caller))
        .collect();
    // The caller's own first, then the newest.
    let ready = runnable
        .iter()
        .rev()
        .filter(|i| &i.owner == caller)
        .chain(runnable.iter().rev().filter(|i| &i.owner != caller))
        .find_map(|i| match (&i.state, &i.digest, &i.docker_image) {
            (ImageState::Ready, Some(digest), Some(docker_image)) => Some(JobImage {
                digest: digest.clone(),
                docker_image: docker_image.clone(),
            }),
            _ => None,
        });
    if let Some(image) = ready {
        return Ok(image);
    }
    match image_access::not_runnable(lookup, candidates, caller) {
        Some(why) if !runnable.is_empty() => Err(Refusal::Conflict(why)),
        _ => Err(Refusal::Forbidden(image_access::no_image_you_may_run(
            lookup,
        ))),
    }
}

/// Whether a job's output is all in: the agent said so, or the job ended longer than
/// `output_grace` ago (what did not come by then never will).
pub fn output_complete(job: &JobRecord, output_grace: Duration, now: DateTime<Utc>) -> bool {
    let drain = chrono::TimeDelta::from_std(output_grace).unwrap_or(chrono::TimeDelta::MAX);
    match job.finished_at() {
        Some(at) => job.log_complete || now - at >= drain,
        None => false,
    }
}

/// One change of a job's state: what a rule decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobChange {
    pub to: JobState,
    pub at: DateTime<Utc>,
    pub reason: JobReason,
    /// Placed on this node with these GPUs (only when it starts).
    pub place: Option<(NodeName, Vec<GpuId>)>,
    /// The main process's exit code, when it exited.
    pub exit_code: Option<i32>,
}

impl JobChange {
    fn new(to: JobState, at: DateTime<Utc>, reason: JobReason) -> Self {
        Self {
            to,
            at,
            reason,
            place: None,
            exit_code: None,
        }
    }
}

/// Checks that `job` may move to `to` now, as the state machine says.
fn allowed(job: &JobRecord, to: JobState) -> Result<(), Refusal> {
    if job.state().can_become(to) {
        Ok(())
    } else {
        Err(Refusal::Conflict(format!(
            "job {} is {} and cannot become {to}",
            job.id,
            job.state()
        )))
    }
}

/// The scheduler's `StartJob`: QUEUED → RUNNING on `node` with `gpus`.
pub fn start(
    job: &JobRecord,
    node: NodeName,
    gpus: Vec<GpuId>,
    now: DateTime<Utc>,
) -> Result<JobChange, Refusal> {
    allowed(job, JobState::Running)?;
    if job.state() != JobState::Queued {
        return Err(Refusal::Conflict(format!(
            "job {} is {}, not QUEUED",
            job.id,
            job.state()
        )));
    }
    let reason = JobReason::Started {
        node: node.clone(),
        gpus: gpus.clone(),
    };
    Ok(JobChange {
        place: Some((node, gpus)),
        ..JobChange::new(JobState::Running, now, reason)
    })
}

/// The scheduler's `HaltJob` (max duration, an interactive session): RUNNING → MUSTHALT. A job
/// asked to halt already is left as it is.
pub fn must_halt(
    job: &JobRecord,
    reason: JobReason,
    now: DateTime<Utc>,
) -> Result<Option<JobChange>, Refusal> {
    match job.state() {
        JobState::MustHalt | JobState::Halting => Ok(None),
        JobState::Running => Ok(Some(JobChange::new(JobState::MustHalt, now, reason))),
        other => Err(Refusal::Conflict(format!(
            "job {} is {other} and cannot be halted",
            job.id
        ))),
    }
}

/// The scheduler's `CancelJob` (not started by its notAfter): QUEUED → CANCELLED.
pub fn cancel_queued(
    job: &JobRecord,
    reason: JobReason,
    now: DateTime<Utc>,
) -> Result<JobChange, Refusal> {
    if job.state() != JobState::Queued {
        return Err(Refusal::Conflict(format!(
            "job {} is {}, not QUEUED",
            job.id,
            job.state()
        )));
    }
    Ok(JobChange::new(JobState::Cancelled, now, reason))
}

/// The owner cancels: a job not halting yet is CANCELLED (a running one is killed).
pub fn cancel_by_owner(job: &JobRecord, now: DateTime<Utc>) -> Result<JobChange, Refusal> {
    match job.state() {
        JobState::Queued | JobState::Running | JobState::MustHalt => Ok(JobChange::new(
            JobState::Cancelled,
            now,
            JobReason::CancelledByUser,
        )),
        JobState::Halting => Err(Refusal::Conflict(format!(
            "job {} is HALTING: it will be HALTED within {} seconds",
            job.id,
            ongrid_core::job::HALT_GRACE.as_secs()
        ))),
        done => Err(Refusal::Conflict(format!(
            "job {} is {done} already: nothing to cancel",
            job.id
        ))),
    }
}

/// The owner halts a running job: RUNNING → MUSTHALT (SIGUSR1, then 15 s to exit 123).
pub fn halt_by_owner(job: &JobRecord, now: DateTime<Utc>) -> Result<JobChange, Refusal> {
    match job.state() {
        JobState::Running => Ok(JobChange::new(
            JobState::MustHalt,
            now,
            JobReason::HaltedByUser,
        )),
        JobState::Queued => Err(Refusal::Conflict(format!(
            "job {} is QUEUED and has nothing to halt: cancel it with `devctl job cancel {}`",
            job.id, job.id
        ))),
        JobState::MustHalt | JobState::Halting => Err(Refusal::Conflict(format!(
            "job {} is {} already",
            job.id,
            job.state()
        ))),
        done => Err(Refusal::Conflict(format!(
            "job {} is {done}: it no longer runs",
            job.id
        ))),
    }
}

/// Whether the record of `job` may be removed at `now` (`devctl job rm`; the retention's prune
/// applies the same conditions in its SQL, past [`prune_before`]): it has ended, the grid
/// target's engine is done with it (a record is never forgotten while its engine job may still
/// run: the grid mirror could no longer cancel or follow it), and its output is all in (until
/// then its node is still told about it, see [`desired_jobs`]; a job that never ran has none).
pub fn removal(job: &JobRecord, output_grace: Duration, now: DateTime<Utc>) -> Result<(), Refusal> {
    let id = job.id;
    match job.state() {
        JobState::Halting => {
            return Err(Refusal::Conflict(format!(
                "job {id} is HALTING and has not ended: it will be HALTED within {} seconds, \
                 remove it then",
                ongrid_core::job::HALT_GRACE.as_secs()
            )))
        }
        state if !state.is_final() => {
            return Err(Refusal::Conflict(format!(
                "job {id} is {state} and has not ended: cancel it first with \
                 `devctl job cancel {id}`, then remove it"
            )))
        }
        _ => {}
    }
    if let Some(grid) = job.grid.as_ref().filter(|g| !g.engine_final) {
        let engine_job = grid
            .engine_id
            .as_ref()
            .map_or_else(String::new, |e| format!(" {e}"));
        return Err(Refusal::Conflict(format!(
            "job {id} is {} here, but {} has not yet confirmed that its job{engine_job} ended: \
             try again after the manager's next poll of {}",
            job.state(),
            grid.target,
            grid.target
        )));
    }
    // A local job that never ran on a node has no output to wait for.
    let output_expected = job.node.is_some() || job.grid.is_some();
    if output_expected && !output_complete(job, output_grace, now) {
        let until = job
            .finished_at()
            .and_then(|at| {
                chrono::TimeDelta::from_std(output_grace)
                    .ok()
                    .map(|g| at + g)
            })
            .unwrap_or(now);
        let from = job
            .node
            .as_ref()
            .map_or_else(String::new, |node| format!(" from {node}"));
        return Err(Refusal::Conflict(format!(
            "the output of job {id} is still coming in{from}: remove it after {}",
            super::utc(until)
        )));
    }
    Ok(())
}

/// The jobs that ended before this time may be pruned, with `retention` (`[retention] jobs`):
/// never sooner than `output_grace` after they ended, so their output is all in
/// ([`output_complete`]).
pub fn prune_before(
    retention: Duration,
    output_grace: Duration,
    now: DateTime<Utc>,
) -> DateTime<Utc> {
    let kept =
        chrono::TimeDelta::from_std(retention.max(output_grace)).unwrap_or(chrono::TimeDelta::MAX);
    now.checked_sub_signed(kept)
        .unwrap_or(DateTime::<Utc>::MIN_UTC)
}

/// The HALTING step a report skipped: a MUSTHALT job that exited within one sync of its halt
/// signal is reported `Exited` with the signal's time, never `Halting`. Every transition is
/// stored, so the job passes through HALTING at that time before [`follow_report`] ends it.
pub fn halting_before_exit(job: &JobRecord, status: &ObservedJobStatus) -> Option<JobChange> {
    match status {
        ObservedJobStatus::Exited {
            signalled_at: Some(signalled_at),
            ..
        } if job.state() == JobState::MustHalt => Some(JobChange::new(
            JobState::Halting,
            *signalled_at,
            JobReason::HaltSignalSent,
        )),
        _ => None,
    }
}

/// What an agent's report of a job means for it, if anything. Reports of a job that no longer
/// holds GPUs (cancelled meanwhile, ...) change nothing.
pub fn follow_report(
    job: &JobRecord,
    status: &ObservedJobStatus,
    now: DateTime<Utc>,
) -> Option<JobChange> {
    let state = job.state();
    if !state.holds_gpus() {
        return None;
    }
    match status {
        ObservedJobStatus::Preparing { .. } | ObservedJobStatus::Running { .. } => None,
        ObservedJobStatus::Halting { signalled_at, .. } => (state == JobState::MustHalt)
            .then(|| JobChange::new(JobState::Halting, *signalled_at, JobReason::HaltSignalSent)),
        ObservedJobStatus::Exited {
            finished_at,
            exit_code,
            killed,
            ..
        } => {
            let halting = matches!(state, JobState::MustHalt | JobState::Halting);
            let (to, reason) = if *killed && halting && *exit_code != 0 {
                (JobState::Halted, JobReason::IgnoredHaltSignal)
            } else {
                state.after_exit(*exit_code)?
            };
            Some(JobChange {
                exit_code: Some(*exit_code),
                ..JobChange::new(to, *finished_at, reason)
            })
        }
        ObservedJobStatus::Failed { error } => Some(JobChange::new(
            JobState::Failed,
            now,
            JobReason::CouldNotRun {
                message: error.lines().next().unwrap_or_default().to_owned(),
            },
        )),
    }
}

/// The node of a job holding GPUs stopped syncing: a restartable job is HALTED (and its chain
/// goes on, see [`next_in_chain`]), any other FAILED.
pub fn node_lost(job: &JobRecord, now: DateTime<Utc>) -> Option<JobChange> {
    if !job.state().holds_gpus() {
        return None;
    }
    let node = job.node.clone()?;
    let requeued = job.spec.restartable;
    let to = if requeued {
        JobState::Halted
    } else {
        JobState::Failed
    };
    Some(JobChange::new(
        to,
        now,
        JobReason::NodeLost { node, requeued },
    ))
}

/// A QUEUED job pinned to a node that is gone or offline (`pinned_node_online` is false) can
/// never start where its checkpoint is: FAILED, with that reason.
pub fn checkpoint_node_lost(
    job: &JobRecord,
    pinned_node_online: bool,
    now: DateTime<Utc>,
) -> Option<JobChange> {
    let node = job.pinned_node.clone()?;
    if job.state() != JobState::Queued || pinned_node_online {
        return None;
    }
    Some(JobChange::new(
        JobState::Failed,
        now,
        JobReason::CheckpointNodeLost { node },
    ))
}

/// The job that continues `job`'s chain after `change`, if the chain goes on: a restartable job
/// that was HALTED, or a checkpoint exit (85), while the chain has max duration left. It is a
/// new QUEUED job with the same spec, the next restart count and the max duration left, pinned
/// to the node `job` ran on (where the chain's working directory is) unless `site` says that
/// directory is shared storage.
pub fn next_in_chain(
    job: &JobRecord,
    change: &JobChange,
    new_id: JobId,
    site: &JobLimits,
) -> Option<NewJob> {
    if !continues_chain(change.to, &change.reason, job.spec.restartable) {
        return None;
    }
    let max_duration = match job.max_duration {
        None => None,
        Some(max) => {
            let ran = job
                .lifecycle
                .started_at()
                .map(|started| (change.at - started).to_std().unwrap_or_default())
                .unwrap_or_default();
            Some(remaining_max_duration(max, ran)?)
        }
    };
    let chain = job.chain.next();
    Some(NewJob {
        id: new_id,
        owner: job.owner.clone(),
        user_name: job.user_name.clone(),
        uid: job.uid,
        spec: job.spec.clone(),
        max_duration,
        image: job.image.clone(),
        chain,
        previous_job: Some(job.id),
        at: change.at,
        reason: JobReason::Requeued {
            previous: job.id,
            restart_count: chain.restart_count,
        },
        pinned_node: if site.shared_work_dir || job.grid.is_some() {
            None
        } else {
            job.node.clone().or_else(|| job.pinned_node.clone())
        },
        // A grid job's chain goes on in the same engine: handed to it again by the mirroring
        // loop (or, re-queued by the engine itself, under the same engine id, set by the caller).
        grid: job.grid.as_ref().map(|g| GridJob {
            engine_id: None,
            submit_started_at: None,
            engine_restarts: 0,
            engine_state: None,
            engine_waiting: None,
            polled_at: None,
            engine_final: false,
            ..g.clone()
        }),
    })
}

/// What `node`'s agent is told about jobs: run the RUNNING ones, halt the MUSTHALT and HALTING
/// ones (since their MUSTHALT), and kill those that ended on it within `output_grace` whose
/// output is not all in (a cancelled job's container is killed; an exited one sends the rest of
/// its output). `limits` are the site's, for what a spec leaves out.
pub fn desired_jobs(
    node: &NodeName,
    jobs: &[JobRecord],
    limits: ContainerLimits,
    output_grace: Duration,
    now: DateTime<Utc>,
) -> Vec<DesiredJob> {
    let drain = chrono::TimeDelta::from_std(output_grace).unwrap_or(chrono::TimeDelta::MAX);
    jobs.iter()
        .filter(|job| job.node.as_ref() == Some(node))
        .filter_map(|job| {
            let run = match job.state() {
                JobState::Running => JobRun::Run,
                JobState::MustHalt | JobState::Halting => JobRun::Halt {
                    since: job.halt_requested_at().unwrap_or(now),
                },
                JobState::Queued => return None,
                _ => {
                    let recent = job.finished_at().is_some_and(|at| now - at < drain);
                    if job.log_complete || !recent {
                        return None;
                    }
                    JobRun::Kill
                }
            };
            Some(desired_job(job, run, limits))
        })
        .collect()
}

fn desired_job(job: &JobRecord, run: JobRun, site: ContainerLimits) -> DesiredJob {
    let mut env: BTreeMap<String, String> = job
        .spec
        .env
        .iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    for (name, value) in job.chain.env(job.id) {
        env.insert(name.to_owned(), value);
    }
    DesiredJob {
        job_id: job.id,
        chain_id: job.chain.initial_job,
        owner: job.owner.clone(),
        user: ContainerUser {
            name: job.user_name.clone(),
            uid: job.uid,
        },
        image: job.image.clone(),
        command: job.spec.command.clone(),
        env,
        gpus: job.gpus.clone(),
        limits: ContainerLimits {
            millicpus: job.spec.cpus.map_or(site.millicpus, |c| c.millis()),
            memory: job.spec.memory.unwrap_or(site.memory),
            pids: site.pids,
        },
        mount_home: job.spec.home,
        run,
        log_offset: job.log_size,
    }
}

/// Why the QUEUED `job` has not started, for people (`job show`), given the site's `active` jobs
/// (QUEUED or holding GPUs) at `now`: the first of its notBefore, its bucket being full, the
/// node that holds its checkpoint, or else no fitting GPUs being free. A job of a grid target
/// waits in its engine, not in this site's queue: the engine's reason in words
/// ([`GridJob::waiting_reason`]). `None` unless QUEUED.
pub fn waiting_reason(
    job: &JobRecord,
    active: &[std::sync::Arc<JobRecord>],
    now: DateTime<Utc>,
) -> Option<String> {
    if job.state() != JobState::Queued {
        return None;
    }
    if let Some(grid) = &job.grid {
        return Some(grid.waiting_reason());
    }
    if let Some(not_before) = job.spec.not_before.filter(|&t| t > now) {
        return Some(format!("not before {}", super::utc(not_before)));
    }
    if let Some(bucket) = &job.spec.bucket {
        let running = active
            .iter()
            .filter(|other| {
                other.state().holds_gpus()
                    && other.owner == job.owner
                    && other
                        .spec
                        .bucket
                        .as_ref()
                        .is_some_and(|b| b.name == bucket.name)
            })
            .count();
        if running >= bucket.max as usize {
            return Some(format!(
                "bucket {} is full: {running} of your jobs in it hold GPUs, at most {} may",
                bucket.name, bucket.max
            ));
        }
    }
    if let Some(node) = &job.pinned_node {
        return Some(format!(
            "for {} on node {node}, which holds its checkpoint",
            describe_gpus(&job.spec.gpus)
        ));
    }
    Some(format!("for {}", describe_gpus(&job.spec.gpus)))
}

fn describe_gpus(request: &GpuRequest) -> String {
    if let Some(profile) = request.sharing.mig() {
        return format!("a free MIG device of profile {profile} or larger");
    }
    match request.count {
        1 => "a fitting GPU to be free".to_owned(),
        n => format!("{n} fitting GPUs to be free"),
    }
}

/// The reason of a halt for an interactive session needing `need` (its need, never its user).
pub fn halt_for_session(need: &GpuRequest) -> JobReason {
    JobReason::ForInteractiveSession { need: *need }
}

#[cfg(test)]
mod tests {
    use ongrid_core::job::{JobSpecFile, CHECKPOINT_EXIT_CODE, HALT_EXIT_CODE};
    use ongrid_core::MemorySize;

    use super::*;
    use crate::domain::fixtures::{node, t};

    fn gpu() -> GpuId {
        GpuId::parse("GPU-00000000-0000-0000-0000-000000000001").unwrap()
    }

    fn spec(file: JobSpecFile) -> JobSpec {
        JobSpecFile {
            image: Some("model:v1".into()),
            command: vec!["python".into(), "train.py".into()],
            ..file
        }
        .validate(t(0))
        .unwrap()
    }

    fn hours(h: u64) -> HumanDuration {
        HumanDuration::from_secs(h * 3600)
    }

    fn image() -> JobImage {
        JobImage {
            digest: format!("sha256:{}", "a".repeat(64)),
            docker_image: "ongrid/alice/model:v1".into(),
        }
    }

    /// Alice's job 1 of `file` submitted at t(0) under `limits`, to `grid` when given.
    fn submission(
        file: JobSpecFile,
        limits: &JobLimits,
        grid: Option<GridJob>,
    ) -> Result<NewJob, Refusal> {
        let alice = Submitter {
            owner: Dn::parse("/CN=Alice").unwrap(),
            user_name: UserName::parse("alice").unwrap(),
            uid: 2000,
        };
        let id = JobId(uuid::Uuid::from_u128(1));
        submit(id, alice, spec(file), image(), limits, grid, t(0))
    }

    fn submitted(file: JobSpecFile, limits: &JobLimits) -> JobRecord {
        record(submission(file, limits, None).unwrap())
    }

    fn record(new: NewJob) -> JobRecord {
        JobRecord::from(new)
    }

    fn running(file: JobSpecFile) -> JobRecord {
        let mut job = submitted(file, &JobLimits::default());
        let change = start(&job, node(), vec![gpu()], t(10)).unwrap();
        job.apply(&change).unwrap();
        job
    }

    fn exited(code: i32, killed: bool, at: i64) -> ObservedJobStatus {
        ObservedJobStatus::Exited {
            started_at: t(10),
            finished_at: t(at),
            exit_code: code,
            oom_killed: false,
            killed,
            signalled_at: None,
        }
    }

    #[test]
    fn max_duration_is_the_specs_else_the_default_capped_by_the_maximum() {
        let limits = JobLimits {
            default_max_duration: Some(hours(8)),
            max_duration: hours(24),
            ..JobLimits::default()
        };
        let own = |h: Option<&str>| JobSpecFile {
            max_duration: h.map(str::to_owned),
            ..JobSpecFile::default()
        };
        assert_eq!(submitted(own(None), &limits).max_duration, Some(hours(8)));
        assert_eq!(
            submitted(own(Some("2h")), &limits).max_duration,
            Some(hours(2))
        );
        assert_eq!(
            submitted(own(Some("24h")), &limits).max_duration,
            Some(hours(24))
        );
        // A site that sets nothing still caps every job.
        let unset = JobLimits::default();
        assert_eq!(unset.max_duration, DEFAULT_MAX_DURATION);
        assert_eq!(
            submitted(own(None), &unset).max_duration,
            Some(DEFAULT_MAX_DURATION)
        );
        let only_cap = JobLimits {
            default_max_duration: None,
            max_duration: hours(4),
            ..JobLimits::default()
        };
        assert_eq!(submitted(own(None), &only_cap).max_duration, Some(hours(4)));
    }

    #[test]
    fn a_job_asking_for_more_than_the_cap_is_refused_with_the_cap() {
        let limits = JobLimits {
            max_duration: hours(24),
            ..JobLimits::default()
        };
        let asking = |max: Option<&str>, min: Option<&str>| JobSpecFile {
            max_duration: max.map(str::to_owned),
            min_duration: min.map(str::to_owned),
            ..JobSpecFile::default()
        };
        let refused = |file, limits: &JobLimits| submission(file, limits, None).unwrap_err();
        assert_eq!(
            refused(asking(Some("3 days"), None), &limits),
            Refusal::Invalid(
                "max duration 3 days (259200 seconds) is more than this site allows (1 day): \
                 ask for 1 day or less (--max-duration of devctl job submit, max_duration in a \
                 job file)"
                    .to_owned()
            )
        );
        assert!(matches!(
            refused(asking(None, Some("2 days")), &limits),
            Refusal::Invalid(m) if m.starts_with("min duration 2 days (172800 seconds) is more than this site allows (1 day)")
        ));
        // The longest duration there is, against the default cap.
        let mut longest = spec(JobSpecFile::default());
        longest.max_duration = Some(HumanDuration::from_secs(u64::MAX));
        let err = check_durations(&longest, &JobLimits::default()).unwrap_err();
        assert!(
            matches!(&err, Refusal::Invalid(m) if m.contains("(18446744073709551615 seconds) is more than this site allows (2 weeks): ask for 2 weeks or less")),
            "{err:?}"
        );
    }

    #[test]
    fn a_submitted_job_is_queued_and_first_of_its_chain() {
        let job = submitted(JobSpecFile::default(), &JobLimits::default());
        assert_eq!(job.state(), JobState::Queued);
        assert_eq!(job.chain.initial_job, job.id);
        assert_eq!(job.chain.restart_count, 0);
        assert_eq!(job.lifecycle.last().reason, JobReason::Submitted);
        // The stored spec names where it runs, whatever the request said.
        assert_eq!(job.spec.target, Some(JobTarget::Local));
    }

    #[test]
    fn scheduler_actions_move_the_job() {
        let mut job = running(JobSpecFile::default());
        assert_eq!(job.state(), JobState::Running);
        assert_eq!(job.node, Some(node()));
        assert!(start(&job, node(), vec![gpu()], t(11)).is_err());
        let need = GpuRequest::default();
        let change = must_halt(&job, halt_for_session(&need), t(20))
            .unwrap()
            .unwrap();
        job.apply(&change).unwrap();
        assert_eq!(job.state(), JobState::MustHalt);
        assert_eq!(job.halt_requested_at(), Some(t(20)));
        // Asked twice: nothing more.
        assert_eq!(
            must_halt(&job, halt_for_session(&need), t(21)).unwrap(),
            None
        );

        let queued = submitted(JobSpecFile::default(), &JobLimits::default());
        let reason = JobReason::NotStartedByNotAfter { not_after: t(5) };
        let change = cancel_queued(&queued, reason.clone(), t(5)).unwrap();
        assert_eq!((change.to, change.reason), (JobState::Cancelled, reason));
        assert!(cancel_queued(&job, JobReason::CancelledByUser, t(5)).is_err());
    }

    #[test]
    fn reports_drive_a_clean_halt() {
        let mut job = running(JobSpecFile::default());
        assert_eq!(
            follow_report(
                &job,
                &ObservedJobStatus::Running { started_at: t(10) },
                t(200)
            ),
            None
        );
        job.apply(&halt_by_owner(&job, t(100)).unwrap()).unwrap();
        let signalled = ObservedJobStatus::Halting {
            started_at: t(10),
            signalled_at: t(101),
        };
        let change = follow_report(&job, &signalled, t(200)).unwrap();
        assert_eq!((change.to, change.at), (JobState::Halting, t(101)));
        job.apply(&change).unwrap();
        assert_eq!(follow_report(&job, &signalled, t(200)), None);
        let change = follow_report(&job, &exited(HALT_EXIT_CODE, false, 105), t(200)).unwrap();
        assert_eq!(change.to, JobState::Halted);
        assert_eq!(change.reason, JobReason::HaltedCleanly);
        assert_eq!(change.exit_code, Some(HALT_EXIT_CODE));
        job.apply(&change).unwrap();
        // The container's report after the end changes nothing.
        assert_eq!(
            follow_report(&job, &exited(HALT_EXIT_CODE, false, 106), t(200)),
            None
        );
    }

    #[test]
    fn an_exit_within_one_sync_of_the_signal_still_passes_through_halting() {
        let mut job = running(JobSpecFile::default());
        job.apply(&halt_by_owner(&job, t(100)).unwrap()).unwrap();
        let quick = ObservedJobStatus::Exited {
            started_at: t(10),
            finished_at: t(102),
            exit_code: HALT_EXIT_CODE,
            oom_killed: false,
            killed: false,
            signalled_at: Some(t(101)),
        };
        let halting = halting_before_exit(&job, &quick).unwrap();
        assert_eq!(
            (halting.to, halting.at, halting.reason.clone()),
            (JobState::Halting, t(101), JobReason::HaltSignalSent)
        );
        job.apply(&halting).unwrap();
        // Once HALTING (or without a signal time) there is no step to add.
        assert_eq!(halting_before_exit(&job, &quick), None);
        let change = follow_report(&job, &quick, t(200)).unwrap();
        assert_eq!((change.to, change.at), (JobState::Halted, t(102)));
        let mut plain = running(JobSpecFile::default());
        plain
            .apply(&halt_by_owner(&plain, t(100)).unwrap())
            .unwrap();
        assert_eq!(
            halting_before_exit(&plain, &exited(HALT_EXIT_CODE, false, 102)),
            None
        );
    }

    #[test]
    fn a_killed_halt_ignored_the_signal_and_other_exits_finish_or_fail() {
        let mut job = running(JobSpecFile::default());
        job.apply(&halt_by_owner(&job, t(100)).unwrap()).unwrap();
        let change = follow_report(&job, &exited(137, true, 116), t(200)).unwrap();
        assert_eq!(
            (change.to, change.reason),
            (JobState::Halted, JobReason::IgnoredHaltSignal)
        );

        let job = running(JobSpecFile::default());
        let change = follow_report(&job, &exited(0, false, 50), t(200)).unwrap();
        assert_eq!((change.to, change.exit_code), (JobState::Finished, Some(0)));
        let change = follow_report(&job, &exited(2, false, 50), t(200)).unwrap();
        assert_eq!(
            (change.to, change.reason),
            (JobState::Failed, JobReason::Exited { code: 2 })
        );
        let failed = ObservedJobStatus::Failed {
            error: "the SIF of sha256:aa is missing\nmore".into(),
        };
        let change = follow_report(&job, &failed, t(200)).unwrap();
        assert_eq!(change.to, JobState::Failed);
        assert_eq!(
            change.reason.to_string(),
            "could not run: the SIF of sha256:aa is missing"
        );
    }

    #[test]
    fn restartable_halts_and_checkpoints_continue_the_chain_with_the_time_left() {
        let restartable = JobSpecFile {
            restartable: true,
            max_duration: Some("8h".into()),
            env: [("EPOCHS".to_owned(), "10".to_owned())].into(),
            ..JobSpecFile::default()
        };
        let mut job = running(restartable);
        assert_eq!(job.max_duration, Some(hours(8)));
        job.apply(
            &must_halt(&job, halt_for_session(&GpuRequest::default()), t(3600))
                .unwrap()
                .unwrap(),
        )
        .unwrap();
        let change = follow_report(&job, &exited(HALT_EXIT_CODE, false, 3610), t(200)).unwrap();
        let new_id = JobId(uuid::Uuid::from_u128(2));
        let next = next_in_chain(&job, &change, new_id, &JobLimits::default()).unwrap();
        assert_eq!(next.chain.initial_job, job.id);
        // Its checkpoint is on the node the job ran on.
        assert_eq!(next.pinned_node, Some(node()));
        assert_eq!(next.chain.restart_count, 1);
        assert_eq!(next.previous_job, Some(job.id));
        // Started at 10, ended at 3610: one hour used.
        assert_eq!(next.max_duration, Some(hours(7)));
        assert_eq!(
            next.reason,
            JobReason::Requeued {
                previous: job.id,
                restart_count: 1
            }
        );
        let mut next = record(next);
        next.node = Some(node());
        next.lifecycle
            .transition(JobState::Running, t(4000), JobReason::Submitted)
            .unwrap();
        let desired = desired_jobs(&node(), &[next], limits(), DEFAULT_OUTPUT_GRACE, t(4001));
        let env = &desired[0].env;
        assert_eq!(env["ONGRID_RESTART_COUNT"], "1");
        assert_eq!(env["ONGRID_JOB_ID"], new_id.to_string());
        assert_eq!(env["ONGRID_RESTART_INITIAL_JOB_ID"], job.id.to_string());
        assert_eq!(env["EPOCHS"], "10");
        assert_eq!(desired[0].chain_id, job.id);

        // Not restartable: a halt ends the chain, a checkpoint exit does not.
        let plain = running(JobSpecFile::default());
        let halted = JobChange::new(JobState::Halted, t(50), JobReason::HaltedCleanly);
        assert_eq!(
            next_in_chain(&plain, &halted, new_id, &JobLimits::default()),
            None
        );
        let checkpoint =
            follow_report(&plain, &exited(CHECKPOINT_EXIT_CODE, false, 50), t(200)).unwrap();
        assert_eq!(checkpoint.reason, JobReason::CheckpointExit);
        assert!(next_in_chain(&plain, &checkpoint, new_id, &JobLimits::default()).is_some());
        // Max duration used up: the chain ends.
        let mut short = running(JobSpecFile {
            restartable: true,
            max_duration: Some("1h".into()),
            ..JobSpecFile::default()
        });
        let reason = JobReason::MaxDurationReached { max: hours(1) };
        short
            .apply(&must_halt(&short, reason, t(3610)).unwrap().unwrap())
            .unwrap();
        let end = follow_report(&short, &exited(HALT_EXIT_CODE, false, 3615), t(200)).unwrap();
        assert_eq!(
            next_in_chain(&short, &end, new_id, &JobLimits::default()),
            None
        );
    }

    #[test]
    fn a_queued_job_says_why_it_waits() {
        let in_bucket = JobSpecFile {
            bucket: Some("sweep:1".into()),
            ..JobSpecFile::default()
        };
        let mut running = running(in_bucket.clone());
        let queued = submitted(in_bucket, &JobLimits::default());
        assert_eq!(
            waiting_reason(
                &queued,
                &[running.clone().into(), queued.clone().into()],
                t(20)
            )
            .as_deref(),
            Some("bucket sweep is full: 1 of your jobs in it hold GPUs, at most 1 may")
        );
        assert_eq!(waiting_reason(&running, &[], t(20)), None);
        running.owner = Dn::parse("/CN=Someone Else").unwrap();
        assert_eq!(
            waiting_reason(&queued, &[running.into(), queued.clone().into()], t(20)).as_deref(),
            Some("for a fitting GPU to be free")
        );
        let mut later = submitted(
            JobSpecFile {
                not_before: Some(ongrid_core::job::TimeText::Text(t(3600).to_rfc3339())),
                ..JobSpecFile::default()
            },
            &JobLimits::default(),
        );
        assert_eq!(
            waiting_reason(&later, &[], t(20)),
            Some(format!("not before {}", super::super::utc(t(3600))))
        );
        later.spec.not_before = None;
        later.pinned_node = Some(node());
        assert_eq!(
            waiting_reason(&later, &[], t(20)).as_deref(),
            Some("for a fitting GPU to be free on node node1, which holds its checkpoint")
        );
    }

    #[test]
    fn a_job_runs_on_one_mig_device_here_and_grid_targets_refuse_it() {
        let mig = JobSpecFile {
            share: Some("mig:1g.10gb".into()),
            ..JobSpecFile::default()
        };
        let queued = submitted(mig.clone(), &JobLimits::default());
        assert_eq!(
            waiting_reason(&queued, &[], t(20)).as_deref(),
            Some("for a free MIG device of profile 1g.10gb or larger")
        );
        let device = GpuId::parse("MIG-c7384736-a75d-5afc-978f-d2f1294409fd").unwrap();
        let mut job = queued.clone();
        job.apply(&start(&job, node(), vec![device.clone()], t(10)).unwrap())
            .unwrap();
        let desired = desired_jobs(&node(), &[job], limits(), DEFAULT_OUTPUT_GRACE, t(11));
        assert_eq!(desired[0].gpus, vec![device]);

        let slurm = GridJob::submitting(
            JobTarget::Slurm,
            super::super::engine_job::LocalAccount::parse("alice").unwrap(),
            t(0),
        );
        let refused = submission(mig, &JobLimits::default(), Some(slurm)).unwrap_err();
        assert_eq!(
            refused.to_string(),
            "target slurm cannot give a MIG device: ongrid hands out MIG 1g.10gb devices only on \
             this site's own GPUs, and slurm asks its engine for whole GPUs; submit with --to \
             local, or without --mig for whole GPUs on slurm"
        );
    }

    #[test]
    fn a_requeued_job_is_pinned_to_its_checkpoint_unless_the_work_dir_is_shared() {
        let job = running(JobSpecFile {
            restartable: true,
            ..JobSpecFile::default()
        });
        let halted = JobChange::new(JobState::Halted, t(50), JobReason::HaltedCleanly);
        let local = JobLimits::default();
        let next = record(next_in_chain(&job, &halted, JobId::new_random(), &local).unwrap());
        assert_eq!(next.pinned_node, Some(node()));
        // While its node is online it waits for it; once the node is gone, it FAILs saying
        // where its checkpoint is.
        assert_eq!(checkpoint_node_lost(&next, true, t(60)), None);
        let lost = checkpoint_node_lost(&next, false, t(60)).unwrap();
        assert_eq!(lost.to, JobState::Failed);
        assert_eq!(lost.reason, JobReason::CheckpointNodeLost { node: node() });
        assert!(
            lost.reason
                .to_string()
                .starts_with("its checkpoint (the chain's working directory) is on node node1"),
            "{}",
            lost.reason
        );
        // A job that was never pinned, or is no longer QUEUED, is left alone.
        let fresh = submitted(JobSpecFile::default(), &local);
        assert_eq!(checkpoint_node_lost(&fresh, false, t(60)), None);
        let mut started = next.clone();
        started
            .apply(&start(&next, node(), vec![gpu()], t(61)).unwrap())
            .unwrap();
        assert_eq!(checkpoint_node_lost(&started, false, t(62)), None);

        let shared = JobLimits {
            shared_work_dir: true,
            ..JobLimits::default()
        };
        let anywhere = next_in_chain(&job, &halted, JobId::new_random(), &shared).unwrap();
        assert_eq!(anywhere.pinned_node, None);
    }

    #[test]
    fn owners_cancel_and_halt() {
        let queued = submitted(JobSpecFile::default(), &JobLimits::default());
        assert_eq!(
            cancel_by_owner(&queued, t(1)).unwrap().to,
            JobState::Cancelled
        );
        assert!(
            matches!(halt_by_owner(&queued, t(1)), Err(Refusal::Conflict(m)) if m.contains("devctl job cancel"))
        );
        let mut job = running(JobSpecFile::default());
        assert_eq!(
            cancel_by_owner(&job, t(20)).unwrap().reason,
            JobReason::CancelledByUser
        );
        job.apply(&halt_by_owner(&job, t(20)).unwrap()).unwrap();
        assert!(halt_by_owner(&job, t(21)).is_err());
        job.apply(&JobChange::new(
            JobState::Halting,
            t(21),
            JobReason::HaltSignalSent,
        ))
        .unwrap();
        assert!(
            matches!(cancel_by_owner(&job, t(22)), Err(Refusal::Conflict(m)) if m.contains("HALTING"))
        );
        let mut done = running(JobSpecFile::default());
        done.apply(&follow_report(&done, &exited(0, false, 30), t(200)).unwrap())
            .unwrap();
        assert!(
            matches!(cancel_by_owner(&done, t(40)), Err(Refusal::Conflict(m)) if m.contains("FINISHED already"))
        );
    }

    #[test]
    fn a_lost_node_requeues_restartable_jobs_and_fails_others() {
        let job = running(JobSpecFile::default());
        let change = node_lost(&job, t(100)).unwrap();
        assert_eq!(change.to, JobState::Failed);
        assert_eq!(
            change.reason,
            JobReason::NodeLost {
                node: node(),
                requeued: false
            }
        );
        assert_eq!(
            next_in_chain(&job, &change, JobId::new_random(), &JobLimits::default()),
            None
        );
        let job = running(JobSpecFile {
            restartable: true,
            ..JobSpecFile::default()
        });
        let change = node_lost(&job, t(100)).unwrap();
        assert_eq!(change.to, JobState::Halted);
        let next =
            next_in_chain(&job, &change, JobId::new_random(), &JobLimits::default()).unwrap();
        // The site's cap, less the 90 seconds it ran.
        assert_eq!(
            next.max_duration,
            Some(HumanDuration::from_secs(14 * 86_400 - 90))
        );
        let queued = submitted(JobSpecFile::default(), &JobLimits::default());
        assert_eq!(node_lost(&queued, t(100)), None);
    }

    fn limits() -> ContainerLimits {
        ContainerLimits {
            millicpus: 4000,
            memory: MemorySize::parse("16G").unwrap(),
            pids: 4096,
        }
    }

    fn image_record(owner: &str, state: ImageState) -> ImageRecord {
        let ready = state == ImageState::Ready;
        ImageRecord {
            owner: Dn::parse(owner).unwrap(),
            reference: ongrid_core::image::ImageReference::parse("model:v1").unwrap(),
            state,
            digest: ready.then(|| image().digest),
            docker_image: ready.then(|| image().docker_image),
            ..crate::domain::images::fixtures::image()
        }
    }

    #[test]
    fn a_job_runs_only_its_owners_ready_image() {
        let alice = Dn::parse("/CN=Alice").unwrap();
        let lookup = ImageLookup::parse("model:v1").unwrap();
        let nothing = resolve_image(&lookup, &[], &alice);
        assert_eq!(
            nothing,
            Err(Refusal::Forbidden(image_access::no_image_you_may_run(
                &lookup
            )))
        );
        let ready = image_record("/CN=Alice", ImageState::Ready);
        assert_eq!(
            resolve_image(&lookup, std::slice::from_ref(&ready), &alice),
            Ok(image())
        );
        let building = image_record("/CN=Alice", ImageState::Building);
        assert!(matches!(
            resolve_image(&lookup, &[building], &alice),
            Err(Refusal::Conflict(m)) if m.contains("BUILDING, not READY")
        ));
        let bobs = image_record("/CN=Bob", ImageState::Ready);
        // Bob's private image: the same answer as no image at all.
        assert_eq!(
            resolve_image(&lookup, std::slice::from_ref(&bobs), &alice),
            nothing
        );
        // Someone else sharing the digest does not hide the caller's own.
        assert_eq!(
            resolve_image(&lookup, &[bobs.clone(), ready], &alice),
            Ok(image())
        );
        // Bob's image runs once Bob shares it, and not while it is not READY.
        let mut shared = bobs;
        shared.shared_at = Some(t(1));
        assert_eq!(
            resolve_image(&lookup, std::slice::from_ref(&shared), &alice),
            Ok(image())
        );
        shared.state = ImageState::Failed;
        assert!(matches!(
            resolve_image(&lookup, &[shared], &alice),
            Err(Refusal::Conflict(m)) if m.contains("image model:v1 is FAILED, not READY")
        ));
    }

    #[test]
    fn output_is_complete_when_the_agent_says_so_or_long_after_the_end() {
        let mut job = running(JobSpecFile::default());
        job.log_complete = true;
        let grace = DEFAULT_OUTPUT_GRACE;
        assert!(!output_complete(&job, grace, t(100)), "still running");
        let end = follow_report(&job, &exited(0, false, 100), t(100)).unwrap();
        job.apply(&end).unwrap();
        assert!(output_complete(&job, grace, t(100)));
        job.log_complete = false;
        assert!(!output_complete(&job, grace, t(101)));
        let late = t(100) + chrono::TimeDelta::from_std(grace).unwrap();
        assert!(output_complete(&job, grace, late));
        // A site's shorter grace ends the wait sooner.
        let short = Duration::from_secs(30);
        assert!(!output_complete(&job, short, t(129)));
        assert!(output_complete(&job, short, t(130)));
    }

    #[test]
    fn desired_jobs_run_halt_and_kill() {
        let run = running(JobSpecFile {
            cpus: Some(ongrid_core::job::CpuNumber::Fraction(1.5)),
            home: true,
            ..JobSpecFile::default()
        });
        let mut halt = running(JobSpecFile::default());
        halt.id = JobId(uuid::Uuid::from_u128(7));
        halt.apply(&halt_by_owner(&halt, t(30)).unwrap()).unwrap();
        let mut cancelled = running(JobSpecFile::default());
        cancelled.id = JobId(uuid::Uuid::from_u128(8));
        cancelled.log_size = 42;
        cancelled
            .apply(&cancel_by_owner(&cancelled, t(40)).unwrap())
            .unwrap();
        let mut drained = cancelled.clone();
        drained.log_complete = true;
        let queued = submitted(JobSpecFile::default(), &JobLimits::default());
        let mut elsewhere = run.clone();
        elsewhere.node = Some(NodeName::parse("node2").unwrap());

        let jobs = [run, halt, cancelled.clone(), drained, queued, elsewhere];
        let desired = desired_jobs(&node(), &jobs, limits(), DEFAULT_OUTPUT_GRACE, t(50));
        let runs: Vec<JobRun> = desired.iter().map(|d| d.run).collect();
        assert_eq!(
            runs,
            [JobRun::Run, JobRun::Halt { since: t(30) }, JobRun::Kill]
        );
        assert_eq!(desired[0].limits.millicpus, 1500);
        assert_eq!(desired[0].limits.memory, limits().memory);
        assert!(desired[0].mount_home);
        assert_eq!(desired[0].gpus, [gpu()]);
        assert_eq!(desired[0].user.uid, 2000);
        assert_eq!(desired[2].log_offset, 42);
        // A while after it ended, a job whose output never came is no longer listed.
        let late = t(40) + chrono::TimeDelta::from_std(DEFAULT_OUTPUT_GRACE).unwrap();
        assert!(desired_jobs(
            &node(),
            &[cancelled.clone()],
            limits(),
            DEFAULT_OUTPUT_GRACE,
            late
        )
        .is_empty());
        // With a grace of a minute, listed for a minute only.
        let minute = Duration::from_secs(60);
        assert_eq!(
            desired_jobs(&node(), &[cancelled.clone()], limits(), minute, t(99)).len(),
            1
        );
        assert!(desired_jobs(&node(), &[cancelled], limits(), minute, t(100)).is_empty());
    }

    /// `devctl job rm`: only an ended job, only once its engine is done with it and its output
    /// is all in; each refusal says what to do.
    #[test]
    fn only_an_ended_job_whose_engine_and_output_are_done_may_be_removed() {
        let grace = Duration::from_secs(600);
        let mut queued = submitted(JobSpecFile::default(), &JobLimits::default());
        let refusal = removal(&queued, grace, t(5)).unwrap_err().to_string();
        assert!(
            refusal
                .contains("is QUEUED and has not ended: cancel it first with `devctl job cancel"),
            "{refusal}"
        );
        // Cancelled before it ran: no output to wait for.
        queued
            .apply(&cancel_by_owner(&queued, t(6)).unwrap())
            .unwrap();
        assert_eq!(removal(&queued, grace, t(6)), Ok(()));
        let mut job = running(JobSpecFile::default());
        assert!(removal(&job, grace, t(20)).is_err());
        job.apply(&halt_by_owner(&job, t(20)).unwrap()).unwrap();
        job.apply(&JobChange::new(
            JobState::Halting,
            t(21),
            JobReason::HaltSignalSent,
        ))
        .unwrap();
        let refusal = removal(&job, grace, t(22)).unwrap_err().to_string();
        assert!(refusal.contains("HALTING and has not ended"), "{refusal}");
        job.apply(&follow_report(&job, &exited(HALT_EXIT_CODE, false, 30), t(30)).unwrap())
            .unwrap();
        assert!(job.state().is_final());
        // Its node may still send output until the grace ends, or until it says it sent all.
        let refusal = removal(&job, grace, t(31)).unwrap_err().to_string();
        assert_eq!(
            refusal,
            format!(
                "the output of job {} is still coming in from node1: remove it after {}",
                job.id,
                crate::domain::utc(t(630))
            )
        );
        assert_eq!(removal(&job, grace, t(630)), Ok(()));
        job.log_complete = true;
        assert_eq!(removal(&job, grace, t(31)), Ok(()));

        // A grid job cancelled here: not before its engine confirmed the end.
        let mut grid = crate::domain::grid_jobs::tests::job(JobState::Running);
        let at = grid.lifecycle.last().at + chrono::TimeDelta::seconds(1);
        grid.apply(&cancel_by_owner(&grid, at).unwrap()).unwrap();
        grid.log_complete = true;
        let refusal = removal(&grid, grace, at).unwrap_err().to_string();
        assert!(
            refusal.contains(
                "is CANCELLED here, but htcondor has not yet confirmed that its job 8.0 ended"
            ),
            "{refusal}"
        );
        grid.grid.as_mut().unwrap().engine_final = true;
        assert_eq!(removal(&grid, grace, at), Ok(()));
    }

    #[test]
    fn jobs_are_pruned_past_their_retention_and_never_within_the_output_grace() {
        let day = Duration::from_secs(86_400);
        let grace = Duration::from_secs(600);
        assert_eq!(
            prune_before(30 * day, grace, t(40 * 86_400)),
            t(10 * 86_400)
        );
        assert_eq!(
            prune_before(Duration::from_secs(60), grace, t(1000)),
            t(400)
        );
        assert_eq!(
            prune_before(Duration::MAX, grace, t(0)),
            DateTime::<Utc>::MIN_UTC
        );
    }
}
