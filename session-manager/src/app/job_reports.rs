//! The jobs' part of an agent's sync, called by [`super::agent_sync`]: the node's reports of its
//! jobs applied ([`follow_reports`]: the node's jobs read once, their changes stored together)
//! and its jobs added to its desired state ([`node_jobs`]). Every change is decided by
//! [`crate::domain::jobs`]; this module reads, writes and logs.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use ongrid_core::api::DesiredState;
use ongrid_core::job::{JobId, ObservedJob};
use ongrid_core::NodeName;

use super::{ApiError, AppState};
use crate::domain::jobs::{self, JobRecord};
use crate::job_logs::JobLogs;
use crate::store::{JobFilter, OutputKept, StoreError};

/// Applies an agent's reports of its jobs: output appended to the jobs' files, then the changes
/// [`jobs::follow_report`] decides, with the next job of a chain when it goes on. Reports of
/// jobs that are not placed on `node` are ignored. Whether it stored anything (output or a
/// change); the caller says so ([`super::Effect`]).
///
/// The node's jobs are read once ([`JobFilter::Node`]: those holding GPUs there, and those that
/// ended there with output still to come); a report of a job that ended with its output all in
/// would change nothing. The changes are stored in at most two writes: the HALTING steps that
/// exit reports skipped ([`jobs::halting_before_exit`]) first, then every change the reports
/// call for, each decided on the job as its HALTING step left it; a job whose step was refused
/// (changed meanwhile) waits for the next sync.
///
/// The output is stored before the changes: an agent reports a job's exit in the same report as
/// the last of its output, so once a job shows as ended its whole output is kept. Output that
/// comes after the job's `[jobs] output_grace` (its reader was told it was complete) is still
/// kept, and logged; what an agent never sends by then is dropped by the agent, which logs it.
///
/// The node's jobs as read come back with the answer when nothing of them was written (the
/// common sync of a node whose jobs run on), for its desired state.
pub async fn follow_reports(
    state: &AppState,
    node: &NodeName,
    reports: &[ObservedJob],
) -> Result<Followed, ApiError> {
    if reports.is_empty() {
        return Ok(Followed {
            stored: false,
            unchanged: None,
        });
    }
    let now = state.clock.now();
    let mut on_node = NodeJobs::new(state.store.jobs(JobFilter::Node(node.clone())).await?);
    let mut stored = store_output(state, node, reports, &mut on_node, now).await?;
    let mut written = stored;

    // Each change is applied to the job as read, so that what follows is decided on the job as
    // the change leaves it.
    let mut halting = Vec::new();
    for report in reports {
        let Some(job) = on_node.get_mut(&report.job_id) else {
            continue;
        };
        if let Some(change) = jobs::halting_before_exit(job, &report.status) {
            if job.apply(&change).is_ok() {
                halting.push((job.id, change, None));
            }
        }
    }
    if !halting.is_empty() {
        written = true;
        let ids: Vec<JobId> = halting.iter().map(|(id, ..)| *id).collect();
        for (id, outcome) in ids
            .into_iter()
            .zip(state.store.job_transition_all(halting).await?)
        {
            match outcome {
                Ok(()) => stored = true,
                // Changed (cancelled by its owner) or removed meanwhile: the next sync sees it.
                Err(StoreError::InvalidJobTransition(_) | StoreError::NoSuchJob(_)) => {
                    on_node.forget(&id);
                }
                Err(other) => return Err(other.into()),
            }
        }
    }

    let mut changes = Vec::new();
    let mut said = Vec::new();
    for report in reports {
        let Some(job) = on_node.get_mut(&report.job_id) else {
            continue;
        };
        let Some(change) = jobs::follow_report(job, &report.status, now) else {
            continue;
        };
        let next = jobs::next_in_chain(job, &change, JobId::new_random(), &state.config.job_limits);
        if job.apply(&change).is_err() {
            continue;
        }
        said.push((
            job.id,
            change.to,
            change.reason.clone(),
            next.as_ref().map(|n| n.id),
        ));
        changes.push((job.id, change, next));
    }
    if changes.is_empty() {
        let unchanged = (!written).then_some(on_node.jobs);
        return Ok(Followed { stored, unchanged });
    }
    let outcomes = state.store.job_transition_all(changes).await?;
    for ((job_id, to, reason, next_job), outcome) in said.into_iter().zip(outcomes) {
        match outcome {
            Ok(()) => {
                tracing::info!(%job_id, %node, state = %to, %reason, ?next_job, "Job changed on its node's report.");
                stored = true;
            }
            // Changed (cancelled by its owner) or removed meanwhile: the next sync sees it.
            Err(StoreError::InvalidJobTransition(_) | StoreError::NoSuchJob(_)) => {}
            Err(other) => return Err(other.into()),
        }
    }
    Ok(Followed {
        stored,
        unchanged: None,
    })
}

/// What [`follow_reports`] did.
pub struct Followed {
    /// Whether it stored anything (output or a change).
    pub stored: bool,
    /// The node's jobs as read, when it wrote nothing of them.
    pub unchanged: Option<Vec<JobRecord>>,
}

/// The node's jobs as read ([`JobFilter::Node`], in its order), found by id.
struct NodeJobs {
    jobs: Vec<JobRecord>,
    index: HashMap<JobId, usize>,
}

impl NodeJobs {
    fn new(jobs: Vec<JobRecord>) -> Self {
        let index = jobs
            .iter()
            .enumerate()
            .map(|(i, job)| (job.id, i))
            .collect();
        Self { jobs, index }
    }

    fn get_mut(&mut self, id: &JobId) -> Option<&mut JobRecord> {
        let i = *self.index.get(id)?;
        self.jobs.get_mut(i)
    }

    /// Leaves the job out of the rest of the reports' handling.
    fn forget(&mut self, id: &JobId) {
        self.index.remove(id);
    }
}

/// Appends the output of each report of a job in `on_node` to the job's file, and records how
/// much of it the manager has (in `on_node` too, for a later report of the same job). Whether
/// it recorded any.
async fn store_output(
    state: &AppState,
    node: &NodeName,
    reports: &[ObservedJob],
    on_node: &mut NodeJobs,
    now: DateTime<Utc>,
) -> Result<bool, ApiError> {
    let logs = JobLogs::new(state.config.job_log_dir.clone());
    let grace = state.config.job_limits.output_grace;
    let mut records = Vec::new();
    let mut failed = None;
    for report in reports {
        let (Some(job), Some(chunk)) = (on_node.get_mut(&report.job_id), &report.log) else {
            continue;
        };
        let appended = match logs.append(job.id, job.log_size, chunk).await {
            Ok(appended) => appended,
            Err(e) => {
                failed = Some(ApiError::internal(format!(
                    "keeping the output of job {}: {e}",
                    job.id
                )));
                break;
            }
        };
        let Some(size) = appended else {
            continue;
        };
        if size > job.log_size && !job.log_complete && jobs::output_complete(job, grace, now) {
            tracing::info!(job_id = %job.id, %node, bytes = size - job.log_size, grace_secs = grace.as_secs(),
                           "Output of a job came after its [jobs] output_grace; kept.");
        }
        // A repeated chunk never takes back what an earlier one said.
        let complete = chunk.complete || job.log_complete;
        if (size, complete) != (job.log_size, job.log_complete) {
            records.push(OutputKept {
                id: job.id,
                size,
                complete,
            });
            (job.log_size, job.log_complete) = (size, complete);
        }
    }
    // One write for the sync's jobs, shared with other syncs waiting meanwhile; after a file
    // that could not be written, of those appended before it, so that the agent's next report
    // does not send their output again.
    let stored = !records.is_empty();
    state.store.record_job_logs(records).await?;
    match failed {
        Some(error) => Err(error),
        None => Ok(stored),
    }
}

/// Adds the node's jobs to its desired state: as `read` when the caller has just read them.
pub async fn node_jobs(
    state: &AppState,
    node: &NodeName,
    desired: &mut DesiredState,
    read: Option<Vec<JobRecord>>,
) -> Result<(), ApiError> {
    let records = match read {
        Some(read) => read,
        None => state.store.jobs(JobFilter::Node(node.clone())).await?,
    };
    desired.jobs = jobs::desired_jobs(
        node,
        &records,
        state.config.session_limits,
        state.config.job_limits.output_grace,
        state.clock.now(),
    );
    Ok(())
}
