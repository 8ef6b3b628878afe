//! `devctl job logs ID [-f]` (`GET /v1/jobs/{id}/logs?offset=N`): the job's kept output, stdout
//! and stderr in the order they came, at most 16 MiB per job (the manager drops the rest and
//! says so in one line). One answer carries at most 1 MiB, so devctl asks again from where the
//! last answer ended until an answer brings nothing more (all that is stored now) or says the
//! output is complete. `-f` follows the output until it is complete (the job has ended and
//! everything is in) with the manager doing the waiting: `?offset=N&wait=true&timeout=` answers
//! as soon as the agent's report brings output past `N` or the output is complete, so devctl
//! never sleeps between requests.
//!
//! Without `-f`, a job that has ended but whose output is not all in yet (its node has not sent
//! the rest) is waited for the same way, so a finished job's output is never printed cut short
//! silently: the manager answers complete once the node sent the end, or at the latest when the
//! site's `[jobs] output_grace` passed, and then devctl says, on stderr, that the rest never came.

use std::time::Duration;

use clap::Args;
use ongrid_core::job::{JobId, JobView, LogChunk, JOB_LOG_CAP};

use crate::client::Client;
use crate::terminal::Terminal;

/// The longest one wait of `-f` asks the manager for: well within devctl's request timeout.
pub const WAIT_STEP: Duration = Duration::from_secs(20);

#[derive(Debug, Clone, Args)]
pub struct JobLogsArgs {
    /// The job's id
    #[arg(value_name = "ID")]
    pub id: JobId,
    /// Keep printing new output until the job has ended
    #[arg(short, long)]
    pub follow: bool,
    /// Print the pieces as JSON (base64 data) instead of the output
    #[arg(long)]
    pub json: bool,
}

/// `devctl job logs`
pub async fn run(
    args: JobLogsArgs,
    client: &Client,
    term: &mut Terminal<'_>,
) -> anyhow::Result<()> {
    let mut offset = 0u64;
    // The first request answers at once, also without `-f`.
    let mut wait = false;
    // Without `-f`: the job had ended when its stored output was read, but not all of it was in.
    let mut waiting_for_end = false;
    loop {
        let route = format!("v1/jobs/{}/logs", args.id);
        let request = client.get(&route).query(&[("offset", offset)]);
        let request = if wait {
            request.query(&[
                ("wait", "true".to_owned()),
                ("timeout", WAIT_STEP.as_secs().to_string()),
            ])
        } else {
            request
        };
        let chunk: LogChunk = request.send().await?;
        let from = offset;
        offset += chunk.data.len() as u64;
        // An answer without output that is not complete: the wait's timeout passed, or (without
        // `-f`) everything stored was read.
        let nothing = chunk.data.is_empty() && !chunk.complete;
        if args.json {
            if !(nothing && (wait || from > 0)) {
                term.json(&chunk)?;
            }
        } else {
            term.out.write_all(&chunk.data)?;
            term.out.flush()?;
        }
        if offset >= JOB_LOG_CAP && chunk.complete {
            term.note(&format!(
                "the output reached the cap of {} MiB per job: what followed was dropped",
                JOB_LOG_CAP / (1024 * 1024)
            ));
        }
        if chunk.complete {
            if waiting_for_end {
                let view = show(client, args.id).await?;
                if !view.output_complete {
                    term.note(&format!(
                        "the rest of job {}'s output never came from its node {} within the \
                         site's output grace: what is printed may miss its end; ask the admin \
                         to look at the node's agent log",
                        args.id,
                        view.node.map_or_else(|| "?".to_owned(), |n| n.to_string()),
                    ));
                }
            }
            return Ok(());
        }
        if !args.follow && !wait {
            // Without `-f`: everything stored now, in as many answers as it takes.
            if !chunk.data.is_empty() {
                continue;
            }
            if !show(client, args.id).await?.state.is_final() {
                return Ok(());
            }
            // It ended and its output is not all in: wait for the rest (the manager bounds the
            // wait by the site's output grace).
            term.note(&format!(
                "job {} has ended; waiting for the rest of its output from its node",
                args.id
            ));
            waiting_for_end = true;
        }
        // From now on the manager answers when there is more (at once when there is already).
        wait = true;
    }
}

/// `GET /v1/jobs/{id}`.
async fn show(client: &Client, id: JobId) -> anyhow::Result<JobView> {
    Ok(client.get(&format!("v1/jobs/{id}")).send().await?)
}
