//! Phase 6 of a round: the plan, and its actions stored: the round's placements and its job
//! changes (starts, halts, cancels, on whole GPUs and MIG devices) in one write
//! ([`crate::store::Store::round_changes`], which other callers' changes waiting then may share);
//! each change is re-checked against the state as stored (a session removed or a job cancelled
//! meanwhile is skipped).
//!
//! Whole and shared GPUs come from [`ongrid_scheduler::plan`]; MIG devices are planned from the
//! same state before anything is applied: sessions on free devices (`plan_mig`), then MIG jobs
//! on the devices left, and a job on a device halted for a session no free device meets
//! (`plan_mig_jobs`; the session stays PENDING and takes the device once the job is HALTED).
//! A `PlaceAfterHalt` is remembered as the session's [`HaltWait`] and given to later plans.

use std::collections::{HashMap, HashSet};

use ongrid_core::job::JobId;
use ongrid_core::{GpuId, GpuUuid, NodeName, SessionId};
use ongrid_scheduler::{Action, HaltWait, MigJobAction, SiteState};

use super::input::Unpinned;
use super::{Round, Scheduler, TickReport};
use crate::domain::jobs::{self, JobChange, JobRecord};
use crate::domain::sessions::{queue, Change};
use crate::store::{StoreError, StoreResult};

/// A placement the plan decided, stored with the round's others ([`Scheduler::store_round`]).
struct Placing {
    session: SessionId,
    node: NodeName,
    change: Change,
    on_mig: bool,
}

/// A job's change the plan decided, stored with the round's others ([`Scheduler::store_round`]).
struct JobMove {
    job: JobId,
    change: JobChange,
    /// The job's node once changed (where it starts, else where it is): told of the change.
    node: Option<NodeName>,
    /// What the log says once it is stored.
    said: Said,
}

/// What the log says of a stored [`JobMove`], for each action that makes one.
enum Said {
    Started { node: NodeName },
    StartedOnMig { node: NodeName, parent: GpuUuid },
    AskedToHalt,
    AskedToHaltOnMig { reason: String },
    Cancelled,
}

impl JobMove {
    /// The change `decide` makes of job `id` as the round read it, said as `said` once stored;
    /// `None` when the job is not in the round or the rules refuse the change.
    fn decided(
        round: &Round<'_>,
        id: JobId,
        decide: impl FnOnce(&JobRecord) -> Option<JobChange>,
        said: Said,
    ) -> Option<Self> {
        let record = *round.jobs.get(&id)?;
        let change = decide(record)?;
        let node = match &change.place {
            Some((node, _)) => Some(node.clone()),
            None => record.node.clone(),
        };
        Some(Self {
            job: id,
            change,
            node,
            said,
        })
    }

    fn log(&self) {
        let job_id = self.job;
        match &self.said {
            Said::Started { node } => tracing::info!(%job_id, %node, "Job started."),
            Said::StartedOnMig { node, parent } => {
                tracing::info!(%job_id, %node, gpu = %parent, "Job started on a MIG device.");
            }
            Said::AskedToHalt => tracing::info!(%job_id, "Job asked to halt."),
            Said::AskedToHaltOnMig { reason } => {
                tracing::info!(%job_id, %reason, "Job on a MIG device asked to halt.");
            }
            Said::Cancelled => {
                tracing::info!(%job_id, "Job cancelled: not started by its notAfter.");
            }
        }
    }
}

impl Scheduler {
    /// Plans from `state` and stores the plan; returns the sessions placed, and how long the
    /// planning took (the plans and the changes made of them; the rest, the write, its log lines
    /// and the nodes' wake-ups, is the plan's write).
    pub(super) async fn apply_plan(
        &self,
        round: &Round<'_>,
        state: &SiteState,
        halt_waits: &mut HashMap<SessionId, HaltWait>,
        unpinned: &Unpinned,
        report: &mut TickReport,
    ) -> StoreResult<(HashSet<SessionId>, std::time::Duration)> {
        let now = round.now;
        let planning = std::time::Instant::now();
        let actions = ongrid_scheduler::plan(state, now);
        crate::metrics::events().plan_took(planning.elapsed());
        let mut placed = crate::metrics::placed_sessions(&actions);
        let mig_slots = round.site.mig_slots();
        let mig_placements = ongrid_scheduler::plan_mig(state, &mig_slots, now);
        let mig_jobs =
            ongrid_scheduler::plan_mig_jobs(state, &mig_slots, now, &actions, &mig_placements);
        let mut places = Vec::new();
        let mut moves = Vec::new();
        for action in actions {
            add_action(round, action, halt_waits, unpinned, &mut places, &mut moves);
        }
        // Sessions asking for a MIG device: on free devices of GPUs in `mig` mode.
        for placement in &mig_placements {
            let change = queue::place_mig(
                &placement.node,
                placement.device.clone(),
                &placement.parent,
                now,
            );
            places.push(Placing {
                session: placement.session,
                node: placement.node.clone(),
                change,
                on_mig: true,
            });
        }
        moves.extend(
            mig_jobs
                .into_iter()
                .filter_map(|action| mig_job_move(round, action)),
        );
        let planned = planning.elapsed();
        let (places, moves) = self.store_round(places, moves).await?;
        for moved in moves {
            moved.log();
            report.jobs += 1;
        }
        for placing in places {
            if placing.on_mig {
                tracing::info!(session_id = %placing.session, node = %placing.node, "Session placed on a MIG device.");
                placed.insert(placing.session);
            } else {
                tracing::info!(session_id = %placing.session, node = %placing.node, "Session placed.");
            }
            report.placed += 1;
        }
        Ok((placed, planned))
    }

    /// Stores the round's placements and job changes in one write, and wakes the node of each
    /// one stored (the whole site for a job on none); returns those stored (a session or job
    /// removed or changed meanwhile is skipped).
    async fn store_round(
        &self,
        places: Vec<Placing>,
        moves: Vec<JobMove>,
    ) -> StoreResult<(Vec<Placing>, Vec<JobMove>)> {
        let sessions = places
            .iter()
            .map(|p| (p.session, p.change.clone()))
            .collect();
        let jobs = moves
            .iter()
            .map(|m| (m.job, m.change.clone(), None))
            .collect();
        let outcomes = self.store.round_changes(sessions, jobs).await?;
        let placed = stored(places, outcomes.sessions, |placing, error| {
            tracing::debug!(session_id = %placing.session, %error, "Skipping a session that changed meanwhile.");
        });
        let moved = stored(moves, outcomes.jobs, |moved, error| {
            tracing::debug!(job_id = %moved.job, %error, "Skipping a job that changed meanwhile.");
        });
        if let Some(changes) = &self.changes {
            for placing in &placed {
                changes.node(&placing.node);
            }
            for moved in &moved {
                changes.node_or_site(moved.node.as_ref());
            }
        }
        Ok((placed, moved))
    }
}

/// The items whose change was stored, in order; `skipped` is told of each other one.
fn stored<T>(
    items: Vec<T>,
    outcomes: Vec<StoreResult<()>>,
    skipped: impl Fn(&T, &StoreError),
) -> Vec<T> {
    items
        .into_iter()
        .zip(outcomes)
        .filter_map(|(item, outcome)| match outcome {
            Ok(()) => Some(item),
            Err(error) => {
                skipped(&item, &error);
                None
            }
        })
        .collect()
}

/// Adds an action of the plan to what the round stores: a placement to `places`, a job's
/// change to `moves`; a `PlaceAfterHalt` is remembered in `halt_waits`.
fn add_action(
    round: &Round<'_>,
    action: Action,
    halt_waits: &mut HashMap<SessionId, HaltWait>,
    unpinned: &Unpinned,
    places: &mut Vec<Placing>,
    moves: &mut Vec<JobMove>,
) {
    let now = round.now;
    let moved = match action {
        Action::Place {
            session,
            node,
            gpus,
        } => {
            let mut change = queue::place(&node, gpus, unpinned.get(&session), now);
            if halt_waits.remove(&session).is_some() {
                change.reason = format!("{}; it preempted batch work", change.reason);
            }
            places.push(Placing {
                session,
                node,
                change,
                on_mig: false,
            });
            None
        }
        Action::PlaceAfterHalt {
            session,
            node,
            gpus,
            jobs,
        } => {
            tracing::info!(session_id = %session, %node, jobs = jobs.len(), "Session waits for batch jobs to halt.");
            halt_waits.insert(session, HaltWait { node, gpus, jobs });
            None
        }
        Action::HaltJob { job, reason } => {
            let change = |record: &JobRecord| jobs::must_halt(record, reason, now).ok()?;
            JobMove::decided(round, job, change, Said::AskedToHalt)
        }
        Action::StartJob { job, node, gpus } => {
            let gpus: Vec<GpuId> = gpus.into_iter().map(GpuId::from).collect();
            let said = Said::Started { node: node.clone() };
            let change = |record: &JobRecord| jobs::start(record, node, gpus, now).ok();
            JobMove::decided(round, job, change, said)
        }
        Action::CancelJob { job, reason } => {
            let change = |record: &JobRecord| jobs::cancel_queued(record, reason, now).ok();
            JobMove::decided(round, job, change, Said::Cancelled)
        }
    };
    moves.extend(moved);
}

/// A MIG job action of the plan as a job's change; `None` as [`JobMove::decided`] says.
fn mig_job_move(round: &Round<'_>, action: MigJobAction) -> Option<JobMove> {
    let now = round.now;
    match action {
        MigJobAction::Start {
            job,
            node,
            device,
            parent,
        } => {
            let said = Said::StartedOnMig {
                node: node.clone(),
                parent,
            };
            let gpus = vec![GpuId::Mig(device)];
            let change = |record: &JobRecord| jobs::start(record, node, gpus, now).ok();
            JobMove::decided(round, job, change, said)
        }
        MigJobAction::Halt { job, reason } => {
            let said = Said::AskedToHaltOnMig {
                reason: reason.to_string(),
            };
            let change = |record: &JobRecord| jobs::must_halt(record, reason, now).ok()?;
            JobMove::decided(round, job, change, said)
        }
    }
}
