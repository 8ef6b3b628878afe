//! Jobs on grid targets (Slurm, HTCondor): the rules that decide what the manager does with a
//! job it handed to a batch engine, as pure functions of the job as stored, what the engine
//! said and `now`. The I/O (running `sbatch`, `squeue`, `condor_q`, ...) is in
//! `crate::targets`; the loop that polls the engines is `crate::grid_mirror`.
//!
//! - Who the job runs as: [`AccountMap::account_for`] maps the owner's DN or accounting group to
//!   a local account, as a CE maps grid users; no mapping is a 403 naming what to ask for.
//! - What to tell the engine: [`order`] (submit a re-queued job of a chain, send the halt
//!   signal, kill a job that ignored it, cancel a job cancelled here).
//! - What the engine's answer means: [`mirror`] turns an [`Observation`] (the engine's state
//!   already mapped to a [`Phase`] by the target) into the job's transitions, and the next job of
//!   the chain when the engine re-queued it (checkpoint exit 85). [`lost`] decides about a job
//!   the engine no longer knows.
//!
//! A job of a grid target goes through the same states as a local one (`QUEUED → RUNNING →
//! FINISHED | FAILED | CANCELLED`, `RUNNING → MUSTHALT → HALTING → HALTED`), with the same
//! typed reasons where they fit and `TargetStarted`/`TargetEnded`/`TargetRefused`/`TargetLost`
//! where the engine has its own words.

use std::time::Duration;

use chrono::{DateTime, Utc};
use ongrid_core::job::{JobId, JobReason, JobState, JobTarget, HALT_GRACE};
use ongrid_core::Dn;

pub use super::engine_job::{requeued_job_id, EngineJobId, GridJob, LocalAccount};
use super::jobs::{next_in_chain, JobChange, JobLimits, JobRecord, NewJob};
use super::policy::GroupName;
use super::Refusal;

/// How long a job may stay without an engine id after the manager began to hand it to its
/// engine (a manager stopped half-way) before the engine is asked for it by name once more and,
/// when it does not know it, the job is FAILED.
pub const SUBMIT_TIMEOUT: Duration = Duration::from_secs(120);

/// Who is mapped to a local account: a DN, or everyone of an accounting group (`[policy]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AccountMatch {
    Dn(Dn),
    Group(GroupName),
}

/// `accounts` of `[targets]`: DN or group → local account. DN rules win over group rules, then
/// the first rule written.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AccountMap {
    pub rules: Vec<(AccountMatch, LocalAccount)>,
    /// Who to ask for a mapping, in the refusal (`[policy] contact` when set).
    pub contact: Option<String>,
}

impl AccountMap {
    /// The local account `dn` (in accounting group `group`) runs under on `target`; a 403
    /// saying what to ask for when there is none.
    pub fn account_for(
        &self,
        target: JobTarget,
        dn: &Dn,
        group: &GroupName,
    ) -> Result<LocalAccount, Refusal> {
        let by_dn = self
            .rules
            .iter()
            .find_map(|(matcher, account)| match matcher {
                AccountMatch::Dn(d) if d == dn => Some(account),
                _ => None,
            });
        let by_group = || {
            self.rules
                .iter()
                .find_map(|(matcher, account)| match matcher {
                    AccountMatch::Group(g) if g == group => Some(account),
                    _ => None,
                })
        };
        match by_dn.or_else(by_group) {
            Some(account) => Ok(account.clone()),
            None => Err(Refusal::Forbidden(format!(
                "you have no local account on target {target}: jobs there run under an account \
                 the site maps your DN ({dn}) or group ({group}) to; ask {} to add one \
                 (`accounts` of [targets] in the manager's config), or submit with --to local",
                self.contact.as_deref().unwrap_or("the site's admins")
            ))),
        }
    }
}

/// What an engine says of one of ongrid's jobs, mapped by its target into ongrid's terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observation {
    pub engine_id: EngineJobId,
    /// The ongrid job it was submitted for, when the engine tells (from the job's name).
    pub job: Option<JobId>,
    pub phase: Phase,
    /// How many times the engine re-queued the job (Slurm's `restart_cnt`, HTCondor's
    /// checkpoint exits).
    pub restarts: u32,
    /// Where it runs or ran, as the engine names it; empty if unknown.
    pub hosts: String,
    /// The engine's own words (`PENDING (Resources)`, `COMPLETED 0:0`), kept for `job show`.
    pub raw: String,
    /// The engine keeps the job in its queue, held, until someone removes it (HTCondor's Held):
    /// once the job has ended in ongrid the loop removes it (`cancel`), so held jobs do not
    /// pile up in the engine.
    pub held: bool,
}

/// An engine's state, in ongrid's terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    /// Waiting in the engine's queue (also held, suspended or re-queued and waiting again);
    /// `why` is the engine's reason in words a user understands.
    Pending {
        why: Option<String>,
    },
    Running,
    /// Its main process exited with this code.
    Exited {
        code: i32,
    },
    /// The engine stopped it at its time limit (the job's max duration).
    TimeLimit,
    /// Halted by the engine at ongrid's request (SIGUSR1, then stopped) without an exit code of
    /// its own, as HTCondor's `condor_hold` does: the engine's words.
    Halted {
        message: String,
    },
    /// Cancelled on the engine's side (by `cancel`, or by an administrator): the engine's words.
    Cancelled {
        message: String,
    },
    /// Ended without an exit code of its own: node failure, out of memory, killed by a signal,
    /// ... in words a user understands.
    Failed {
        message: String,
    },
}

impl Phase {
    pub fn is_final(&self) -> bool {
        !matches!(self, Self::Pending { .. } | Self::Running)
    }

    /// Why the engine keeps the job waiting, in words; `None` unless pending.
    pub fn waiting(&self) -> Option<&str> {
        match self {
            Self::Pending { why } => why.as_deref(),
            _ => None,
        }
    }
}

/// Where a submitted job goes: its spec's target, else the site's default; a grid target must
/// be one the site offers, and the owner must have a local account there.
pub fn choose_target(
    asked: Option<JobTarget>,
    offered: &[JobTarget],
    default: JobTarget,
    accounts: &AccountMap,
    who: (&Dn, &GroupName),
    now: DateTime<Utc>,
) -> Result<Option<GridJob>, Refusal> {
    let target = asked.unwrap_or(default);
    if !offered.contains(&target) {
        let names: Vec<String> = offered.iter().map(ToString::to_string).collect();
        return Err(Refusal::Invalid(format!(
            "target {target} is not offered by this site: use one of {} (`devctl job targets` \
             lists them)",
            names.join(", ")
        )));
    }
    if target == JobTarget::Local {
        return Ok(None);
    }
    let account = accounts.account_for(target, who.0, who.1)?;
    Ok(Some(GridJob::submitting(target, account, now)))
}

/// What the loop asks the engine to do for a job, from [`order`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineOrder {
    /// Hand it to the engine (a re-queued job of a chain, which no engine job carries on).
    Submit,
    /// Send the halt signal (MUSTHALT → HALTING once sent).
    Halt,
    /// Kill it: cancelled here, or HALTING past the halt grace.
    Cancel,
}

/// What the engine must be told about `job` now, if anything.
pub fn order(job: &JobRecord, now: DateTime<Utc>) -> Option<EngineOrder> {
    let grid = job.grid.as_ref()?;
    if grid.engine_final {
        return None;
    }
    match (job.state(), &grid.engine_id) {
        (JobState::Queued, None) if grid.submit_started_at.is_none() => Some(EngineOrder::Submit),
        (_, None) => None,
        (JobState::MustHalt, Some(_)) => Some(EngineOrder::Halt),
        (JobState::Halting, Some(_)) => {
            let since = job.lifecycle.last().at;
            let grace = chrono::TimeDelta::from_std(HALT_GRACE).unwrap_or_default();
            (now - since >= grace).then_some(EngineOrder::Cancel)
        }
        (
            JobState::Cancelled | JobState::Failed | JobState::Halted | JobState::Finished,
            Some(_),
        ) => Some(EngineOrder::Cancel),
        _ => None,
    }
}

/// What an engine's observation does to a job: the transitions to store in order (the last
/// one with `next`), and whether the engine is done with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mirror {
    pub changes: Vec<JobChange>,
    /// The next job of the chain: when the engine re-queued it (it runs under the same engine
    /// id), or when it ended HALTED and continues its chain by the same rule as a local job
    /// ([`next_in_chain`]: restartable, or exit 85), handed to the engine again by the loop.
    pub next: Option<NewJob>,
    /// The engine has ended its job (or, re-queued, this job's run of it). A job the engine
    /// keeps held ([`Observation::held`]) is not final until it is removed.
    pub engine_final: bool,
    /// Why the engine keeps the job waiting, in words (`None` unless it does).
    pub waiting: Option<String>,
}

/// What `observation` means for `job` (of a grid target). `next_id` names the next job of the
/// chain when ongrid hands it to the engine again (a restartable job HALTED); a job the engine
/// itself re-queued is continued by [`requeued_job_id`] of `job`, the id its run sees.
pub fn mirror(
    job: &JobRecord,
    observation: &Observation,
    limits: &JobLimits,
    next_id: JobId,
    now: DateTime<Utc>,
) -> Mirror {
    let Some(grid) = &job.grid else {
        return Mirror {
            changes: Vec::new(),
            next: None,
            engine_final: false,
            waiting: None,
        };
    };
    let seen = Seen {
        job,
        grid,
        observation,
        now,
    };
    let state = job.state();
    // The engine re-queued it (a checkpoint exit, 85): this job is HALTED and the chain goes on
    // as a new job under the same engine id.
    if observation.restarts > grid.engine_restarts && !state.is_final() {
        return seen.requeued(limits);
    }
    let mut changes = Vec::new();
    if state == JobState::Queued && !matches!(observation.phase, Phase::Pending { .. }) {
        changes.push(seen.started());
    }
    let mut next = None;
    if let Some(end) = seen.end(if state == JobState::Queued {
        JobState::Running
    } else {
        state
    }) {
        // A restartable job HALTED at ongrid's request (or an exit 85 the engine did not
        // re-queue) goes on as the local target's jobs do: a new QUEUED job, handed to the
        // engine anew. A job the engine stopped at its time limit (its SIGUSR1 `halt_lead`
        // before, then the limit) has used the chain's max duration.
        let asked = matches!(state, JobState::MustHalt | JobState::Halting)
            && observation.phase != Phase::TimeLimit;
        if asked || end.reason == JobReason::CheckpointExit {
            next = next_in_chain(&as_started(job, &changes), &end, next_id, limits);
        }
        changes.push(end);
    }
    // A job that never ran here ends only through the states above; one that ended here
    // (cancelled by its owner) just learns the engine is done.
    Mirror {
        changes,
        next,
        engine_final: observation.phase.is_final() && !observation.held,
        waiting: observation.phase.waiting().map(str::to_owned),
    }
}

/// A job of a grid target and what its engine said of it, at `now`: the pieces of [`mirror`].
struct Seen<'a> {
    job: &'a JobRecord,
    grid: &'a GridJob,
    observation: &'a Observation,
    now: DateTime<Utc>,
}

impl Seen<'_> {
    /// QUEUED → RUNNING: the engine started it.
    fn started(&self) -> JobChange {
        self.change(
            JobState::Running,
            JobReason::TargetStarted {
                target: self.grid.target,
                engine_id: self.observation.engine_id.to_string(),
                hosts: self.observation.hosts.clone(),
            },
            None,
        )
    }

    fn change(&self, to: JobState, reason: JobReason, exit_code: Option<i32>) -> JobChange {
        JobChange {
            to,
            at: self.now,
            reason,
            place: None,
            exit_code,
        }
    }

    /// The engine re-queued the job: it ends HALTED (started first if it was still QUEUED), and
    /// the next job of its chain runs under the same engine id.
    fn requeued(&self, limits: &JobLimits) -> Mirror {
        let (job, grid, now) = (self.job, self.grid, self.now);
        let mut changes = Vec::new();
        if job.state() == JobState::Queued {
            changes.push(self.started());
        }
        let change = self.change(
            JobState::Halted,
            JobReason::CheckpointExit,
            Some(ongrid_core::job::CHECKPOINT_EXIT_CODE),
        );
        let waiting = self.observation.phase.waiting().map(str::to_owned);
        let next = next_in_chain(
            &as_started(job, &changes),
            &change,
            requeued_job_id(job.id),
            limits,
        )
        .map(|mut next| {
            next.grid = Some(GridJob {
                engine_id: Some(self.observation.engine_id.clone()),
                submit_started_at: Some(now),
                engine_restarts: grid.engine_restarts + 1,
                engine_state: Some(self.observation.raw.clone()),
                engine_waiting: waiting.clone(),
                polled_at: Some(now),
                engine_final: false,
                ..grid.clone()
            });
            next
        });
        changes.push(change);
        // The engine's job goes on, followed by the next job: this one's run is over.
        Mirror {
            changes,
            next,
            engine_final: true,
            waiting,
        }
    }

    /// How the engine's phase ends the job, `current` being its state here (RUNNING once
    /// started): `None` while it runs or waits, or when the end is already known here.
    fn end(&self, current: JobState) -> Option<JobChange> {
        let target = self.grid.target;
        let by_engine = |to, message: &str| {
            let reason = JobReason::TargetEnded {
                target,
                message: message.to_owned(),
            };
            self.change(to, reason, None)
        };
        match &self.observation.phase {
            Phase::Pending { .. } | Phase::Running => None,
            Phase::Exited { code } => current
                .after_exit(*code)
                .map(|(to, reason)| self.change(to, reason, Some(*code))),
            Phase::TimeLimit if current.holds_gpus() => Some(match self.job.max_duration {
                Some(max) => self.change(
                    JobState::Halted,
                    JobReason::MaxDurationReached { max },
                    None,
                ),
                None => by_engine(JobState::Halted, "reached its time limit"),
            }),
            Phase::Halted { message } if current.holds_gpus() => {
                Some(by_engine(JobState::Halted, message))
            }
            Phase::Cancelled { .. } if current == JobState::Halting => {
                Some(self.change(JobState::Halted, JobReason::IgnoredHaltSignal, None))
            }
            Phase::Cancelled { message } if current.holds_gpus() => {
                Some(by_engine(JobState::Cancelled, message))
            }
            Phase::Failed { message } if current.holds_gpus() => {
                Some(by_engine(JobState::Failed, message))
            }
            _ => None,
        }
    }
}

/// `job` as it is once `changes` (which may start it) are applied, for the chain's time used,
/// counted from its start.
fn as_started(job: &JobRecord, changes: &[JobChange]) -> JobRecord {
    let mut record = job.clone();
    if record.lifecycle.started_at().is_none() {
        if let Some(start) = changes.iter().find(|c| c.to == JobState::Running) {
            let _ = record
                .lifecycle
                .transition(JobState::Running, start.at, start.reason.clone());
        }
    }
    record
}

/// A job whose engine no longer knows it (nor its id, for one being submitted when the manager
/// stopped): the change, if it is time to give up on it.
pub fn lost(job: &JobRecord, now: DateTime<Utc>) -> Option<JobChange> {
    let grid = job.grid.as_ref()?;
    if grid.engine_final || job.state().is_final() {
        return None;
    }
    let reason = match &grid.engine_id {
        Some(id) => JobReason::TargetLost {
            target: grid.target,
            engine_id: id.to_string(),
        },
        None => {
            let started = grid.submit_started_at?;
            let timeout = chrono::TimeDelta::from_std(SUBMIT_TIMEOUT).unwrap_or_default();
            if now - started < timeout {
                return None;
            }
            JobReason::CouldNotRun {
                message: format!(
                    "the manager stopped while handing it to {}, which does not know it: submit \
                     it again",
                    grid.target
                ),
            }
        }
    };
    Some(JobChange {
        to: JobState::Failed,
        at: now,
        reason,
        place: None,
        exit_code: None,
    })
}

/// The engine refused the submission: the job FAILED with its words.
pub fn refused(target: JobTarget, message: &str, now: DateTime<Utc>) -> JobChange {
    JobChange {
        to: JobState::Failed,
        at: now,
        reason: JobReason::TargetRefused {
            target,
            message: message.to_owned(),
        },
        place: None,
        exit_code: None,
    }
}

/// The halt signal was delivered by the engine: MUSTHALT → HALTING.
pub fn halt_sent(job: &JobRecord, now: DateTime<Utc>) -> Option<JobChange> {
    (job.state() == JobState::MustHalt).then_some(JobChange {
        to: JobState::Halting,
        at: now,
        reason: JobReason::HaltSignalSent,
        place: None,
        exit_code: None,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use ongrid_core::job::{JobImage, JobLifecycle, JobSpecFile, RestartChain};
    use ongrid_core::{HumanDuration, UserName};

    use super::*;
    use crate::domain::fixtures::t;

    /// A job handed to HTCondor as `8.0`, RUNNING there since t(10) unless `state` is QUEUED,
    /// HALTING after a halt sent at t(20). Also the grid job of `crate::app::jobs`'s tests.
    pub(crate) fn job(state: JobState) -> JobRecord {
        let spec = JobSpecFile {
            image: Some("mymodel:v1".into()),
            command: vec!["python".into(), "train.py".into()],
            ..JobSpecFile::default()
        }
        .validate(t(0))
        .unwrap();
        let id = JobId(uuid::Uuid::from_u128(1));
        let mut lifecycle = JobLifecycle::new(t(0), JobReason::Submitted);
        let started = JobReason::TargetStarted {
            target: JobTarget::Htcondor,
            engine_id: "8.0".into(),
            hosts: "slot1@gpu-01".into(),
        };
        let path: &[(JobState, JobReason)] = match state {
            JobState::Queued => &[],
            JobState::Running => &[(JobState::Running, started)],
            JobState::Halting => &[
                (JobState::Running, started),
                (JobState::MustHalt, JobReason::HaltedByUser),
                (JobState::Halting, JobReason::HaltSignalSent),
            ],
            other => panic!("no fixture for {other}"),
        };
        for (n, (to, reason)) in path.iter().enumerate() {
            lifecycle
                .transition(*to, t(10 * (n as i64 + 1)), reason.clone())
                .unwrap();
        }
        JobRecord {
            id,
            owner: Dn::parse("/CN=Alice").unwrap(),
            user_name: UserName::parse("alice").unwrap(),
            uid: 2000,
            spec,
            lifecycle,
            max_duration: Some(HumanDuration::from_secs(8 * 3600)),
            image: JobImage {
                digest: format!("sha256:{}", "a".repeat(64)),
                docker_image: "ongrid/alice/mymodel:v1".into(),
            },
            node: None,
            gpus: vec![],
            chain: RestartChain {
                initial_job: id,
                restart_count: 0,
            },
            previous_job: None,
            next_job: None,
            exit_code: None,
            log_size: 0,
            log_complete: false,
            pinned_node: None,
            grid: Some(GridJob {
                engine_id: Some(EngineJobId::parse("8.0").unwrap()),
                submit_started_at: Some(t(0)),
                ..GridJob::submitting(
                    JobTarget::Htcondor,
                    LocalAccount::parse("alice").unwrap(),
                    t(0),
                )
            }),
        }
    }

    fn seen(phase: Phase) -> Observation {
        Observation {
            engine_id: EngineJobId::parse("8.0").unwrap(),
            job: Some(JobId(uuid::Uuid::from_u128(1))),
            phase,
            restarts: 0,
            hosts: "slot1@gpu-01".into(),
            raw: "engine words".into(),
            held: false,
        }
    }

    /// `job` with `changes` applied, as the store applies them.
    fn applied(mut job: JobRecord, changes: &[JobChange]) -> JobRecord {
        for change in changes {
            job.lifecycle
                .transition(change.to, change.at, change.reason.clone())
                .unwrap();
        }
        job
    }

    /// What the loop makes of `seen` at t(`at`) for `job`, under the default limits.
    fn mirror_at(job: &JobRecord, seen: &Observation, next_id: JobId, at: i64) -> Mirror {
        mirror(job, seen, &JobLimits::default(), next_id, t(at))
    }

    fn mirrored(state: JobState, phase: Phase) -> Mirror {
        mirror_at(
            &job(state),
            &seen(phase),
            JobId(uuid::Uuid::from_u128(2)),
            100,
        )
    }

    /// The last change of `mirrored(state, phase)`.
    fn last_end(state: JobState, phase: Phase) -> (JobState, String) {
        ends(&mirrored(state, phase)).pop().unwrap()
    }

    fn ends(mirror: &Mirror) -> Vec<(JobState, String)> {
        mirror
            .changes
            .iter()
            .map(|c| (c.to, c.reason.to_string()))
            .collect()
    }

    #[test]
    fn an_engines_halt_without_exit_code_is_halted_in_its_words() {
        let halted = Phase::Halted {
            message: "halted: HTCondor sent SIGUSR1 and stopped it".into(),
        };
        for state in [JobState::Running, JobState::Halting] {
            let m = mirrored(state, halted.clone());
            let (to, reason) = ends(&m).pop().expect("a change");
            assert_eq!(to, JobState::Halted, "from {state}");
            assert!(reason.contains("HTCondor sent SIGUSR1"), "{reason}");
            assert!(m.engine_final);
            assert_eq!(m.next, None);
        }
        // Not yet seen running: it starts, then is halted.
        let m = mirrored(JobState::Queued, halted);
        let states: Vec<JobState> = ends(&m).into_iter().map(|(to, _)| to).collect();
        assert_eq!(states, [JobState::Running, JobState::Halted]);
    }

    #[test]
    fn a_cancel_is_cancelled_unless_a_halt_was_under_way() {
        let cancelled = || Phase::Cancelled {
            message: "removed by an administrator".into(),
        };
        let (to, reason) = last_end(JobState::Running, cancelled());
        assert_eq!(to, JobState::Cancelled);
        assert!(reason.contains("removed by an administrator"), "{reason}");
        let (to, reason) = last_end(JobState::Halting, cancelled());
        assert_eq!(to, JobState::Halted);
        assert_eq!(reason, JobReason::IgnoredHaltSignal.to_string());
    }

    #[test]
    fn exits_time_limits_and_engine_requeues() {
        let (to, _) = last_end(JobState::Running, Phase::Exited { code: 0 });
        assert_eq!(to, JobState::Finished);
        let (to, _) = last_end(JobState::Running, Phase::Exited { code: 3 });
        assert_eq!(to, JobState::Failed);
        let (to, reason) = last_end(JobState::Running, Phase::TimeLimit);
        assert_eq!(to, JobState::Halted);
        assert!(reason.contains("max duration of 8 hours"), "{reason}");
        // Nothing final: nothing changes.
        let m = mirrored(JobState::Running, Phase::Running);
        assert!(m.changes.is_empty() && !m.engine_final);
        // Re-queued by the engine (a checkpoint exit): HALTED, and the chain's next job keeps
        // the engine id with one more restart.
        let mut requeued = seen(Phase::Pending { why: None });
        requeued.restarts = 1;
        let next_id = JobId(uuid::Uuid::from_u128(2));
        let m = mirror_at(&job(JobState::Running), &requeued, next_id, 100);
        assert_eq!(ends(&m).pop().unwrap().0, JobState::Halted);
        let next = m.next.expect("the chain goes on");
        let grid = next.grid.expect("on the same target");
        assert_eq!(grid.engine_id, Some(EngineJobId::parse("8.0").unwrap()));
        assert_eq!(grid.engine_restarts, 1);
    }

    #[test]
    fn a_restartable_job_halted_in_its_engine_goes_on_as_a_new_job_handed_over_anew() {
        let next_id = JobId(uuid::Uuid::from_u128(2));
        let halted_by_condor = Phase::Halted {
            message: "halted: HTCondor sent SIGUSR1 and stopped it".into(),
        };
        for (state, phase) in [
            (JobState::Halting, Phase::Exited { code: 123 }),
            (JobState::Halting, halted_by_condor),
        ] {
            let mut restartable = job(state);
            restartable.spec.restartable = true;
            let m = mirror_at(&restartable, &seen(phase.clone()), next_id, 100);
            assert_eq!(ends(&m).pop().unwrap().0, JobState::Halted, "{phase:?}");
            let next = m.next.expect("the chain goes on");
            assert_eq!(next.id, next_id);
            assert_eq!(next.previous_job, Some(restartable.id));
            assert_eq!(next.chain.restart_count, 1);
            assert_eq!(
                next.reason,
                JobReason::Requeued {
                    previous: restartable.id,
                    restart_count: 1
                }
            );
            // No engine job carries it on: the loop hands it to the engine again.
            let grid = next.grid.expect("on the same target");
            assert_eq!(
                (grid.target, grid.engine_id, grid.submit_started_at),
                (JobTarget::Htcondor, None, None)
            );
            assert_eq!(grid.engine_state, None);
            // The chain's time used is counted from its start at t(10).
            assert_eq!(
                next.max_duration,
                Some(HumanDuration::from_secs(8 * 3600 - 90))
            );
        }
        // Not restartable: a halt ends the chain, as on the local target.
        let m = mirrored(JobState::Halting, Phase::Exited { code: 123 });
        assert_eq!(ends(&m).pop().unwrap().0, JobState::Halted);
        assert_eq!(m.next, None);
        // Halted by the engine at its time limit (SIGUSR1 `halt_lead` before it, or the limit
        // itself): the chain's max duration is used up.
        for (state, phase) in [
            (JobState::Running, Phase::Exited { code: 123 }),
            (JobState::Running, Phase::TimeLimit),
            (JobState::Halting, Phase::TimeLimit),
        ] {
            let mut restartable = job(state);
            restartable.spec.restartable = true;
            let m = mirror_at(&restartable, &seen(phase.clone()), next_id, 100);
            assert_eq!(ends(&m).pop().unwrap().0, JobState::Halted, "{phase:?}");
            assert_eq!(m.next, None, "{phase:?}");
        }
        // An exit 85 the engine did not re-queue goes on, restartable or not.
        let m = mirrored(JobState::Running, Phase::Exited { code: 85 });
        assert_eq!(m.next.map(|n| n.id), Some(next_id));
        // A next job not yet handed over is submitted by the loop.
        let mut queued = job(JobState::Queued);
        queued.grid.as_mut().unwrap().engine_id = None;
        queued.grid.as_mut().unwrap().submit_started_at = None;
        assert_eq!(order(&queued, t(100)), Some(EngineOrder::Submit));
    }

    #[test]
    fn a_job_the_engine_requeued_goes_on_under_the_id_its_run_derives() {
        let mut requeued = seen(Phase::Pending {
            why: Some("waiting in Slurm: its start time has not come".into()),
        });
        requeued.restarts = 1;
        let running = job(JobState::Running);
        let m = mirror_at(&running, &requeued, JobId::new_random(), 100);
        let next = m.next.expect("the chain goes on");
        assert_eq!(next.id, requeued_job_id(running.id));
        assert_ne!(next.id, running.id);
        let grid = next.grid.unwrap();
        assert_eq!(
            grid.engine_waiting.as_deref(),
            Some("waiting in Slurm: its start time has not come")
        );
    }

    #[test]
    fn a_held_job_is_removed_from_its_engine_once_it_ended_here() {
        let mut held = seen(Phase::Halted {
            message: "halted: HTCondor sent SIGUSR1 and stopped it".into(),
        });
        held.held = true;
        let halting = job(JobState::Halting);
        let m = mirror_at(&halting, &held, JobId::new_random(), 100);
        assert!(!m.engine_final, "held in the schedd: not done there");
        let mut halted = applied(halting, &m.changes);
        assert_eq!(halted.state(), JobState::Halted);
        assert_eq!(order(&halted, t(101)), Some(EngineOrder::Cancel));
        // Seen held again: nothing changes, the removal is asked again.
        let again = mirror_at(&halted, &held, JobId::new_random(), 102);
        assert!(again.changes.is_empty() && !again.engine_final);
        // Removed: the engine is done with it.
        let removed = seen(Phase::Cancelled {
            message: "removed from HTCondor's queue".into(),
        });
        let m = mirror_at(&halted, &removed, JobId::new_random(), 103);
        assert!(m.changes.is_empty() && m.engine_final);
        halted.grid.as_mut().unwrap().engine_final = true;
        assert_eq!(order(&halted, t(104)), None);
    }

    #[test]
    fn a_waiting_job_says_why_in_the_engines_words() {
        let why = "no HTCondor machine offers what it asks right now";
        let m = mirrored(
            JobState::Queued,
            Phase::Pending {
                why: Some(why.into()),
            },
        );
        assert!(m.changes.is_empty() && !m.engine_final);
        assert_eq!(m.waiting.as_deref(), Some(why));
        let mut queued = job(JobState::Queued);
        let grid = queued.grid.as_mut().unwrap();
        assert_eq!(
            grid.waiting_reason(),
            "handed to htcondor as its job 8.0: not asked about yet"
        );
        grid.polled_at = Some(t(5));
        assert_eq!(grid.waiting_reason(), "in htcondor's queue as its job 8.0");
        grid.engine_waiting = Some(why.into());
        assert_eq!(grid.waiting_reason(), why);
        // Not this site's queue: no local words.
        assert_eq!(
            super::super::jobs::waiting_reason(&queued, &[], t(6)).as_deref(),
            Some(why)
        );
        assert_eq!(mirrored(JobState::Running, Phase::Running).waiting, None);
    }
}
