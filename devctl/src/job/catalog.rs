//! `devctl job ls|show|cancel|halt|rm` (`GET /v1/jobs[?all=true]`, `GET /v1/jobs/{id}`,
//! `POST /v1/jobs/{id}/cancel|halt`, `DELETE /v1/jobs/{id}`), and how a job is described.

use clap::Args;
use ongrid_core::job::{JobId, JobState, JobView};

use crate::client::Client;
use crate::format::format_time;
use crate::table::Table;
use crate::terminal::Terminal;

#[derive(Debug, Clone, Args)]
pub struct JobLsArgs {
    /// Everybody's jobs (admins only)
    #[arg(long)]
    pub all: bool,
    /// Print JSON instead of text
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Args)]
pub struct JobIdArgs {
    /// The job's id, as devctl job ls shows it
    #[arg(value_name = "ID")]
    pub id: JobId,
    /// Print JSON instead of text
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Args)]
pub struct JobRmArgs {
    /// The ids of ended jobs, as devctl job ls shows them
    #[arg(value_name = "ID", required = true)]
    pub ids: Vec<JobId>,
    /// Print JSON (the removed jobs as they were) instead of text
    #[arg(long)]
    pub json: bool,
}

/// `devctl job ls`
pub async fn list(args: JobLsArgs, client: &Client, term: &mut Terminal<'_>) -> anyhow::Result<()> {
    let jobs: Vec<JobView> = client.get("v1/jobs").all(args.all).send().await?;
    let width = term.width;
    term.show(args.json, &jobs, |jobs| render_jobs(jobs, args.all, width))
}

/// `devctl job show`
pub async fn show(args: JobIdArgs, client: &Client, term: &mut Terminal<'_>) -> anyhow::Result<()> {
    let job: JobView = client.get(&format!("v1/jobs/{}", args.id)).send().await?;
    term.show(args.json, &job, render_job)
}

/// `devctl job cancel` and `devctl job halt` (`verb` is the route's last segment).
pub async fn change(
    args: JobIdArgs,
    verb: &str,
    client: &Client,
    term: &mut Terminal<'_>,
) -> anyhow::Result<()> {
    let job: JobView = client
        .post(&format!("v1/jobs/{}/{verb}", args.id))
        .send()
        .await?;
    term.show(args.json, &job, |job| {
        format!("job {} is {}: {}\n", job.id, job.state, job.reason)
    })
}

/// `devctl job rm ID...`: each job in turn; one that is refused (not ended, not yours) is said
/// on stderr and the others are still removed.
pub async fn remove(
    args: JobRmArgs,
    client: &Client,
    term: &mut Terminal<'_>,
) -> anyhow::Result<()> {
    let mut removed = Vec::new();
    let mut refused = Vec::new();
    for id in &args.ids {
        match client
            .delete(&format!("v1/jobs/{id}"))
            .send::<JobView>()
            .await
        {
            Ok(job) => {
                if !args.json {
                    term.print(&format!(
                        "job {} removed ({}), with its output\n",
                        job.id, job.state
                    ))?;
                }
                removed.push(job);
            }
            Err(error) => refused.push((id, error)),
        }
    }
    if args.json {
        term.json(&removed)?;
    }
    if args.ids.len() == 1 {
        if let Some((_, error)) = refused.pop() {
            return Err(error.into());
        }
    }
    if refused.is_empty() {
        return Ok(());
    }
    for (id, error) in &refused {
        term.note(&format!("job {id}: {error:#}"));
    }
    anyhow::bail!(
        "{} of {} jobs not removed (above)",
        refused.len(),
        args.ids.len()
    )
}

/// The table of `devctl job ls`; with `all`, each job's owner too.
pub fn render_jobs(jobs: &[JobView], all: bool, width: Option<u16>) -> String {
    if jobs.is_empty() {
        return "no jobs: submit one with devctl job submit --image NAME:VERSION -- COMMAND\n"
            .to_owned();
    }
    let mut headers = vec!["ID", "STATE", "IMAGE", "NODE", "QUEUED", "REASON"];
    if all {
        headers.push("OWNER");
    }
    let mut table = Table::new(&headers);
    table.keep_whole(&[0, 1, 4]);
    for job in jobs {
        let mut state = job.state.to_string();
        if let Some(position) = job.queue_position {
            state.push_str(&format!(" #{position}"));
        }
        let mut row = vec![
            job.id.to_string(),
            state,
            job.spec.image.to_string(),
            where_it_runs(job),
            format_time(job.queued_at),
            reason_column(job),
        ];
        if all {
            row.push(job.owner.to_string());
        }
        table.row(row);
    }
    table.render(width, "")
}

/// The REASON column: why a QUEUED job waits (its engine's reason in words for a job of a grid
/// target, as squeue's NODELIST(REASON)), else its last transition's reason.
fn reason_column(job: &JobView) -> String {
    match (&job.waiting, job.state) {
        // The local queue's words start with what it waits for ("for a fitting GPU to be
        // free"); a limit's and an engine's say it themselves ("waiting in Slurm: ...").
        (Some(waiting), JobState::Queued) if waiting.starts_with("for ") => {
            format!("waiting {waiting}")
        }
        (Some(waiting), JobState::Queued) => waiting.clone(),
        _ => job.reason.clone(),
    }
}

/// The NODE column: the node of a local job, `slurm:42` for a job of a grid target; a job on
/// a MIG device adds the profile it asked for, `node1 (mig:1g.10gb)`.
fn where_it_runs(job: &JobView) -> String {
    let place = match (&job.grid, &job.node) {
        (Some(grid), _) => format!(
            "{}:{}",
            grid.target,
            grid.engine_id.as_deref().unwrap_or("-")
        ),
        (None, Some(node)) => node.to_string(),
        (None, None) => "-".to_owned(),
    };
    match job.spec.gpus.sharing.mig() {
        Some(profile) => format!("{place} (mig:{profile})"),
        None => place,
    }
}

/// The text of `devctl job show`.
pub fn render_job(job: &JobView) -> String {
    let mut table = Table::bare();
    let mut field = |name: &str, value: String| table.field(name, value);
    field("job", job.id.to_string());
    field("state", job.state.to_string());
    field("reason", job.reason.clone());
    field("owner", format!("{} ({})", job.owner, job.user_name));
    field(
        "image",
        match &job.image_digest {
            Some(digest) => format!("{} ({digest})", job.spec.image),
            None => job.spec.image.to_string(),
        },
    );
    field("command", job.spec.command.argv().join(" "));
    if let Some(position) = job.queue_position {
        field("queue", format!("#{position}"));
    }
    if let Some(waiting) = &job.waiting {
        field("waiting", waiting.clone());
    }
    if let Some(profile) = job.spec.gpus.sharing.mig() {
        field("request", format!("1 MIG device, {profile} or larger"));
    }
    if let Some(node) = &job.node {
        let gpus: Vec<&str> = job.gpus.iter().map(|g| g.as_str()).collect();
        field("node", format!("{node} ({})", gpus.join(", ")));
    }
    if let Some(grid) = &job.grid {
        field(
            "target",
            format!(
                "{} job {} as {}",
                grid.target,
                grid.engine_id.as_deref().unwrap_or("(not yet known)"),
                grid.account
            ),
        );
        if let Some(state) = &grid.engine_state {
            let at = grid.polled_at.map(format_time).unwrap_or_default();
            field(&format!("{} says", grid.target), format!("{state} ({at})"));
        }
    }
    field(
        "max duration",
        job.max_duration
            .map_or_else(|| "none".to_owned(), |d| d.to_string()),
    );
    if let Some(min) = job.spec.min_duration {
        field("min duration", min.to_string());
    }
    field(
        "restartable",
        if job.spec.restartable { "yes" } else { "no" }.to_owned(),
    );
    let mut chain = format!(
        "restart {} of {}",
        job.chain.restart_count, job.chain.initial_job
    );
    if let Some(previous) = job.previous_job {
        chain.push_str(&format!("; previous {previous}"));
    }
    if let Some(next) = job.next_job {
        chain.push_str(&format!("; next {next}"));
    }
    field("chain", chain);
    if let Some(code) = job.exit_code {
        field("exit code", code.to_string());
    }
    field("queued", format_time(job.queued_at));
    if let Some(at) = job.started_at {
        field("started", format_time(at));
    }
    if let Some(at) = job.finished_at {
        field("finished", format_time(at));
    }
    let mut text = table.to_string();
    text.push_str("transitions:\n");
    for t in &job.transitions {
        text.push_str(&format!(
            "  {}  {}  {}\n",
            format_time(t.at),
            t.to,
            t.reason
        ));
    }
    text
}
