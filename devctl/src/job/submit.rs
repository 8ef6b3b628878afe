//! `devctl job submit` (`POST /v1/jobs`): flags or a job file, both read into core's
//! `JobSpecFile` and validated by it, so the errors name the field the same way.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use ongrid_core::job::{CpuNumber, JobSpecFile, JobView, SubmitJob};

use super::catalog::render_job;
use crate::client::Client;
use crate::terminal::Terminal;

#[derive(Debug, Clone, Args)]
pub struct JobSubmitArgs {
    /// A job file (TOML, the same fields as the flags); no other flag but --json then
    #[arg(value_name = "JOB_FILE", conflicts_with_all = ["image", "command"])]
    pub file: Option<PathBuf>,
    /// The frozen image: NAME:VERSION (yours), LOGIN/NAME:VERSION (shared by its owner) or
    /// sha256:DIGEST (devctl image ls [--shared])
    #[arg(long)]
    pub image: Option<String>,
    /// How many GPUs [default: 1]
    #[arg(long)]
    pub gpus: Option<u32>,
    /// Minimum compute capability, like 8.0
    #[arg(long, value_name = "X.Y")]
    pub min_capability: Option<String>,
    /// Minimum GPU memory, like 40G
    #[arg(long, value_name = "SIZE")]
    pub min_gpu_memory: Option<String>,
    /// exclusive (default), shared or any
    #[arg(long)]
    pub share: Option<String>,
    /// One MIG device of this profile or larger instead of GPUs, like 1g.10gb (devctl gpus
    /// lists the site's devices); the same as --share mig:PROFILE
    #[arg(long, value_name = "PROFILE", conflicts_with_all = ["share", "gpus"])]
    pub mig: Option<ongrid_core::MigProfile>,
    /// CPUs, like 4 or 0.5 [default: the site's]
    #[arg(long, value_name = "N")]
    pub cpus: Option<String>,
    /// Memory, like 16G [default: the site's]
    #[arg(long, value_name = "SIZE")]
    pub memory: Option<String>,
    /// Halted when still running this long, like 8h [default: the site's]
    #[arg(long, value_name = "DURATION")]
    pub max_duration: Option<String>,
    /// Never halted for an interactive session within this long, like 1h
    #[arg(long, value_name = "DURATION")]
    pub min_duration: Option<String>,
    /// Re-queue the job when it is halted, with the max duration it has left
    #[arg(long)]
    pub restartable: bool,
    /// Never start before this time (RFC 3339, or +2h)
    #[arg(long, value_name = "TIME")]
    pub not_before: Option<String>,
    /// Cancel when not started by this time (RFC 3339, or +1d)
    #[arg(long, value_name = "TIME")]
    pub not_after: Option<String>,
    /// NAME:MAX: at most MAX of your jobs in bucket NAME run at once
    #[arg(long, value_name = "NAME:MAX")]
    pub bucket: Option<String>,
    /// An environment variable, NAME=VALUE (repeatable)
    #[arg(long = "env", value_name = "NAME=VALUE")]
    pub env: Vec<String>,
    /// Mount your home volume read-write
    #[arg(long)]
    pub home: bool,
    /// Where it runs: local (this site's GPUs), slurm or htcondor [default: the site's, see
    /// devctl job targets]; with a job file, overrides its target
    #[arg(long = "to", value_name = "TARGET")]
    pub to: Option<String>,
    /// Run on the GPUs of this reservation of your group, within its window (devctl admin
    /// reservation ls)
    #[arg(long, value_name = "NAME")]
    pub reservation: Option<String>,
    /// Print JSON instead of text
    #[arg(long)]
    pub json: bool,
    /// The program and its arguments, after --
    #[arg(last = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

impl JobSubmitArgs {
    /// The flags as a job file's fields.
    fn spec_file(self) -> anyhow::Result<JobSpecFile> {
        let mut env = BTreeMap::new();
        for pair in &self.env {
            let (name, value) = pair
                .split_once('=')
                .with_context(|| format!("--env {pair:?} must be NAME=VALUE"))?;
            if env.insert(name.to_owned(), value.to_owned()).is_some() {
                anyhow::bail!("--env {name} is given twice");
            }
        }
        let cpus = self
            .cpus
            .map(|text| -> anyhow::Result<CpuNumber> {
                let number = text.trim();
                Ok(match number.parse::<u64>() {
                    Ok(whole) => CpuNumber::Whole(whole),
                    Err(_) => CpuNumber::Fraction(number.parse().with_context(|| {
                        format!("--cpus {text:?} must be a number of CPUs like 4 or 0.5")
                    })?),
                })
            })
            .transpose()?;
        Ok(JobSpecFile {
            image: self.image,
            command: self.command,
            gpus: self.gpus,
            min_capability: self.min_capability,
            min_gpu_memory: self.min_gpu_memory,
            share: self
                .mig
                .map(|profile| format!("mig:{profile}"))
                .or(self.share),
            cpus,
            memory: self.memory,
            max_duration: self.max_duration,
            min_duration: self.min_duration,
            restartable: self.restartable,
            not_before: self.not_before.as_deref().map(Into::into),
            not_after: self.not_after.as_deref().map(Into::into),
            bucket: self.bucket,
            env,
            home: self.home,
            target: self.to,
        })
    }
}

/// `devctl job submit`
pub async fn run(
    args: JobSubmitArgs,
    client: &Client,
    term: &mut Terminal<'_>,
) -> anyhow::Result<()> {
    let json = args.json;
    let reservation = args.reservation.clone();
    let file = match &args.file {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading job file {}", path.display()))?;
            let mut file = JobSpecFile::from_toml(&text)
                .with_context(|| format!("job file {}", path.display()))?;
            if let Some(to) = args.to {
                file.target = Some(to);
            }
            file
        }
        None => args.spec_file()?,
    };
    let spec = file.validate(chrono::Utc::now())?;
    let job: JobView = client
        .post("v1/jobs")
        .json(&SubmitJob { spec, reservation })
        .idempotent()
        .if_lost("the job may have been submitted: devctl job ls")
        .send()
        .await?;
    term.show(json, &job, |job| {
        format!(
            "job {} submitted ({}); follow it with devctl job show {} and devctl job logs -f {}\n{}",
            job.id,
            job.state,
            job.id,
            job.id,
            render_job(job)
        )
    })
}
