//! Phase 6 of a round: the plan, and its actions stored: the round's placements together in one
//! write, each job action in its own; each change is re-checked against the state as stored (a
//! session removed or a job cancelled meanwhile is skipped).
//!
//! Whole and shared GPUs come from [`ongrid_scheduler::plan`]; MIG devices are planned from the
//! same state before anything is applied: sessions on free devices (`plan_mig`), then MIG jobs
//! on the devices left, and a job on a device halted for a session no free device meets
//! (`plan_mig_jobs`; the session stays PENDING and takes the device once the job is HALTED).
//! A `PlaceAfterHalt` is remembered as the session's [`HaltWait`] and given to later plans.

use std::collections::{HashMap, HashSet};

use ongrid_core::job::JobId;
use ongrid_core::{GpuId, NodeName, SessionId};
use ongrid_scheduler::{Action, HaltWait, MigJobAction, SiteState};

use super::input::Unpinned;
use super::{Round, Scheduler, TickReport};
use crate::domain::jobs::{self, JobChange, JobRecord};
use crate::domain::sessions::{queue, Change};
use crate::store::StoreResult;

/// A placement the plan decided, stored with the round's others ([`Scheduler::place_all`]).
struct Placing {
    session: SessionId,
    node: NodeName,
    change: Change,
    on_mig: bool,
}

impl Scheduler {
    /// Plans from `state` and stores the plan; returns the sessions placed.
    pub(super) async fn apply_plan(
        &self,
        round: &Round<'_>,
        state: &SiteState,
        halt_waits: &mut HashMap<SessionId, HaltWait>,
        unpinned: &Unpinned,
        report: &mut TickReport,
    ) -> StoreResult<HashSet<SessionId>> {
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
        for action in actions {
            self.apply_action(round, action, halt_waits, unpinned, &mut places, report)
                .await?;
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
        for placing in self.place_all(places).await? {
            if placing.on_mig {
                tracing::info!(session_id = %placing.session, node = %placing.node, "Session placed on a MIG device.");
                placed.insert(placing.session);
            } else {
                tracing::info!(session_id = %placing.session, node = %placing.node, "Session placed.");
            }
            report.placed += 1;
        }
        for action in mig_jobs {
            report.jobs += usize::from(self.apply_mig_job(round, action).await?);
        }
        Ok(placed)
    }

    /// Applies a job action at once; a placement is added to `places`, which are stored
    /// together.
    async fn apply_action(
        &self,
        round: &Round<'_>,
        action: Action,
        halt_waits: &mut HashMap<SessionId, HaltWait>,
        unpinned: &Unpinned,
        places: &mut Vec<Placing>,
        report: &mut TickReport,
    ) -> StoreResult<()> {
        let now = round.now;
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
                places.push(Placing {
                    session,
                    node,
                    change,
                    on_mig: false,
                });
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
                let change = |record: &JobRecord| jobs::must_halt(record, reason, now).ok()?;
                if self.change_job(round, job, change).await? {
                    tracing::info!(job_id = %job, "Job asked to halt.");
                    report.jobs += 1;
                }
            }
            Action::StartJob { job, node, gpus } => {
                let gpus: Vec<GpuId> = gpus.into_iter().map(GpuId::from).collect();
                let change = |record: &JobRecord| jobs::start(record, node.clone(), gpus, now).ok();
                if self.change_job(round, job, change).await? {
                    tracing::info!(job_id = %job, %node, "Job started.");
                    report.jobs += 1;
                }
            }
            Action::CancelJob { job, reason } => {
                let change = |record: &JobRecord| jobs::cancel_queued(record, reason, now).ok();
                if self.change_job(round, job, change).await? {
                    tracing::info!(job_id = %job, "Job cancelled: not started by its notAfter.");
                    report.jobs += 1;
                }
            }
        }
        Ok(())
    }

    /// Stores the round's placements in one write, and wakes each placed session's node;
    /// returns those stored (a session removed or changed meanwhile is skipped).
    async fn place_all(&self, places: Vec<Placing>) -> StoreResult<Vec<Placing>> {
        if places.is_empty() {
            return Ok(places);
        }
        let changes = places
            .iter()
            .map(|p| (p.session, p.change.clone()))
            .collect();
        let outcomes = self.store.transition_all(changes).await?;
        let mut stored = Vec::with_capacity(places.len());
        for (placing, outcome) in places.into_iter().zip(outcomes) {
            match outcome {
                Ok(()) => {
                    if let Some(changes) = &self.changes {
                        changes.node(&placing.node);
                    }
                    stored.push(placing);
                }
                Err(error) => {
                    tracing::debug!(session_id = %placing.session, %error, "Skipping a session that changed meanwhile.");
                }
            }
        }
        Ok(stored)
    }

    async fn apply_mig_job(&self, round: &Round<'_>, action: MigJobAction) -> StoreResult<bool> {
        let now = round.now;
        match action {
            MigJobAction::Start {
                job,
                node,
                device,
                parent,
            } => {
                let gpus = vec![GpuId::Mig(device)];
                let change = |record: &JobRecord| jobs::start(record, node.clone(), gpus, now).ok();
                let started = self.change_job(round, job, change).await?;
                if started {
                    tracing::info!(job_id = %job, %node, gpu = %parent, "Job started on a MIG device.");
                }
                Ok(started)
            }
            MigJobAction::Halt { job, reason } => {
                let why = reason.to_string();
                let change = |record: &JobRecord| jobs::must_halt(record, reason, now).ok()?;
                let asked = self.change_job(round, job, change).await?;
                if asked {
                    tracing::info!(job_id = %job, reason = %why, "Job on a MIG device asked to halt.");
                }
                Ok(asked)
            }
        }
    }

    /// Stores the change `decide` makes of job `id` as the round read it; `false` when the job
    /// is not in the round, the rules refuse the change, or the job changed meanwhile.
    async fn change_job(
        &self,
        round: &Round<'_>,
        id: JobId,
        decide: impl FnOnce(&JobRecord) -> Option<JobChange>,
    ) -> StoreResult<bool> {
        let Some(change) = round
            .site
            .jobs
            .iter()
            .find(|j| j.id == id)
            .and_then(|j| decide(j))
        else {
            return Ok(false);
        };
        self.apply_job(id, change, None).await
    }
}
