//! The jobs' part of an agent's sync, called by [`super::agent_sync`]: the node's reports of its
//! jobs applied ([`follow_reports`]) and its jobs added to its desired state ([`node_jobs`]).
//! Every change is decided by [`crate::domain::jobs`]; this module reads, writes and logs.

use ongrid_core::api::DesiredState;
use ongrid_core::job::{JobId, ObservedJob};
use ongrid_core::NodeName;

use super::{ApiError, AppState};
use crate::domain::jobs;
use crate::job_logs::JobLogs;
use crate::store::{JobFilter, StoreError};

/// Applies an agent's reports of its jobs: output appended to the jobs' files, then the change
/// [`jobs::follow_report`] decides, with the next job of the chain when it goes on. Reports of
/// jobs that are not placed on `node` are ignored. Whether it stored anything (output or a
/// change); the caller says so ([`super::Effect`]).
///
/// The output is stored before the change: an agent reports a job's exit in the same report as
/// the last of its output, so once a job shows as ended its whole output is kept. Output that
/// comes after the job's `[jobs] output_grace` (its reader was told it was complete) is still
/// kept, and logged; what an agent never sends by then is dropped by the agent, which logs it.
pub async fn follow_reports(
    state: &AppState,
    node: &NodeName,
    reports: &[ObservedJob],
) -> Result<bool, ApiError> {
    let logs = JobLogs::new(state.config.job_log_dir.clone());
    let now = state.clock.now();
    let mut stored = false;
    for report in reports {
        let Some(job) = state.store.job(report.job_id).await? else {
            continue;
        };
        if job.node.as_ref() != Some(node) {
            continue;
        }
        if let Some(chunk) = &report.log {
            let appended = logs
                .append(job.id, job.log_size, chunk)
                .await
                .map_err(|e| {
                    ApiError::internal(format!("keeping the output of job {}: {e}", job.id))
                })?;
            if let Some(size) = appended {
                let grace = state.config.job_limits.output_grace;
                if size > job.log_size
                    && !job.log_complete
                    && jobs::output_complete(&job, grace, now)
                {
                    tracing::info!(job_id = %job.id, %node, bytes = size - job.log_size, grace_secs = grace.as_secs(),
                                   "Output of a job came after its [jobs] output_grace; kept.");
                }
                // A repeated chunk never takes back what an earlier one said.
                let complete = chunk.complete || job.log_complete;
                if (size, complete) != (job.log_size, job.log_complete) {
                    state.store.record_job_log(job.id, size, complete).await?;
                    stored = true;
                }
            }
        }
        let job = match jobs::halting_before_exit(&job, &report.status) {
            Some(halting) => match state.store.job_transition(job.id, halting, None).await {
                Ok(job) => {
                    stored = true;
                    job
                }
                // Changed meanwhile (cancelled by its owner): the next sync sees it.
                Err(StoreError::InvalidJobTransition(_)) => continue,
                Err(other) => return Err(other.into()),
            },
            None => job,
        };
        let Some(change) = jobs::follow_report(&job, &report.status, now) else {
            continue;
        };
        let next =
            jobs::next_in_chain(&job, &change, JobId::new_random(), &state.config.job_limits);
        let (to, reason) = (change.to, change.reason.clone());
        match state.store.job_transition(job.id, change, next).await {
            Ok(job) => {
                tracing::info!(job_id = %job.id, %node, state = %to, %reason, next_job = ?job.next_job, "Job changed on its node's report.");
                stored = true;
            }
            // Changed meanwhile (cancelled by its owner): the next sync sees it.
            Err(StoreError::InvalidJobTransition(_)) => {}
            Err(other) => return Err(other.into()),
        }
    }
    Ok(stored)
}

/// Adds the node's jobs to its desired state.
pub async fn node_jobs(
    state: &AppState,
    node: &NodeName,
    desired: &mut DesiredState,
) -> Result<(), ApiError> {
    let records = state.store.jobs(JobFilter::Node(node.clone())).await?;
    desired.jobs = jobs::desired_jobs(
        node,
        &records,
        state.config.session_limits,
        state.config.job_limits.output_grace,
        state.clock.now(),
    );
    Ok(())
}
