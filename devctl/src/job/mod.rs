//! `devctl job submit|ls|show|logs|cancel|halt|rm|targets`: batch jobs that run frozen images on
//! the site's GPUs beside interactive sessions, or on the grid targets the site offers (Slurm,
//! HTCondor: `job submit --to`, `job targets`).
//!
//! - [`submit`]: `job submit`, from flags or a job file; both are core's `JobSpecFile`.
//! - [`catalog`]: `job ls|show|cancel|halt|rm`, and how a job is described.
//! - [`logs`]: `job logs [-f]`, the job's kept output, followed on the manager's long-poll until
//!   complete.

pub mod catalog;
pub mod logs;
pub mod submit;
pub mod targets;

use clap::Subcommand;

use crate::client::Client;
use crate::terminal::Terminal;

#[derive(Debug, Subcommand)]
pub enum JobCommand {
    /// Submit a job: a frozen image and a command, from flags or a job file
    ///
    /// devctl job submit --image mymodel:v1 --gpus 1 --max-duration 8h -- python train.py, or
    /// devctl job submit job.toml (the same fields; see deploy/examples/job.toml).
    Submit(Box<submit::JobSubmitArgs>),
    /// List your jobs, oldest first
    #[command(alias = "list")]
    Ls(catalog::JobLsArgs),
    /// Show a job: state, node, GPUs, transitions with reasons, restart chain, exit code
    Show(catalog::JobIdArgs),
    /// Print a job's output (stdout and stderr, kept up to 16 MiB per job)
    Logs(logs::JobLogsArgs),
    /// Cancel a job (a running one is killed)
    Cancel(catalog::JobIdArgs),
    /// Halt a running job: SIGUSR1, then 15 s to exit with code 123 (a restartable job is
    /// re-queued)
    Halt(catalog::JobIdArgs),
    /// Remove ended jobs of yours (admins: anyone's) with their output; a job that has not
    /// ended is refused: cancel it first. The site removes ended jobs itself after a while
    #[command(alias = "remove")]
    Rm(catalog::JobRmArgs),
    /// List where jobs may run (local, slurm, htcondor), the site's default, and the local
    /// account your jobs run under there
    Targets(targets::JobTargetsArgs),
}

pub async fn run(
    command: JobCommand,
    client: &Client,
    term: &mut Terminal<'_>,
) -> anyhow::Result<()> {
    match command {
        JobCommand::Submit(args) => submit::run(*args, client, term).await,
        JobCommand::Ls(args) => catalog::list(args, client, term).await,
        JobCommand::Show(args) => catalog::show(args, client, term).await,
        JobCommand::Logs(args) => logs::run(args, client, term).await,
        JobCommand::Cancel(args) => catalog::change(args, "cancel", client, term).await,
        JobCommand::Halt(args) => catalog::change(args, "halt", client, term).await,
        JobCommand::Rm(args) => catalog::remove(args, client, term).await,
        JobCommand::Targets(args) => targets::run(args, client, term).await,
    }
}
