//! `devctl job logs ID [-f]` (`GET /v1/jobs/{id}/logs?offset=N`): the job's kept output, stdout
//! and stderr in the order they came, at most 16 MiB per job (the manager drops the rest and
//! says so in one line). `-f` polls the route from the last offset until the output is
//! complete (the job has ended and everything is in).

use std::time::Duration;

use clap::Args;
use ongrid_core::job::{JobId, LogChunk, JOB_LOG_CAP};

use crate::client::Client;
use crate::terminal::Terminal;

/// How often `-f` asks for more.
const POLL: Duration = Duration::from_secs(1);

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
    loop {
        let chunk: LogChunk = client
            .get(&format!("v1/jobs/{}/logs", args.id))
            .query(&[("offset", offset)])
            .send()
            .await?;
        offset += chunk.data.len() as u64;
        if args.json {
            term.json(&chunk)?;
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
        if chunk.complete || !args.follow {
            return Ok(());
        }
        if chunk.data.is_empty() {
            tokio::time::sleep(POLL).await;
        }
    }
}
