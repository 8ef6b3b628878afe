//! The Slurm target: `sbatch` a script per job (`script.rs`), states from `squeue --json` and,
//! for jobs `squeue` no longer lists, `sacct` (`-c`, the job-completion log, where no slurmdbd
//! runs), `scancel` to cancel, `scancel --batch --signal=USR1` to halt (`parse.rs` reads what
//! they print).
//!
//! Halting signals the batch shell only (`--batch`), which passes SIGUSR1 on to the job once,
//! exactly as Slurm's own `--signal=B:USR1@<lead>` before the time limit does. `--full` would
//! also signal the job's processes directly, so the job would get SIGUSR1 twice (measured on
//! Slurm 22.05 with `proctrack/linuxproc`).
//!
//! The job's commands (`sbatch`, `scancel`) run as the job's local account through the
//! configured `run_as` prefix; `squeue` and `sacct` run as the manager.

pub mod parse;
pub mod script;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use futures::future::BoxFuture;
use ongrid_core::job::JobTarget;

use super::command::{self, Finished, Invocation};
use super::{
    engine_job_name, job_of_engine_name, Output, SlurmConfig, Target, TargetError, TargetJob,
    Tracked,
};
use crate::domain::grid_jobs::{EngineJobId, LocalAccount, Observation};
use parse::{Ended, SACCT_FORMAT};

/// A Slurm cluster reached through its commands.
#[derive(Debug, Clone)]
pub struct Slurm {
    config: SlurmConfig,
}

impl Slurm {
    pub fn new(config: SlurmConfig) -> Self {
        Self { config }
    }

    /// The file a run of a job writes its output to: `<output_dir>/slurm-<id>-<run>.out`.
    pub fn output_path(&self, engine_id: &EngineJobId, run: u32) -> PathBuf {
        self.config
            .output_dir
            .join(format!("slurm-{engine_id}-{run}.out"))
    }

    async fn run(
        &self,
        account: Option<&LocalAccount>,
        program: &Path,
        args: Vec<String>,
        stdin: Option<Vec<u8>>,
    ) -> Result<Finished, TargetError> {
        let argv = match account {
            Some(account) => self.config.run_as.argv(account, program, &args),
            None => std::iter::once(program.display().to_string())
                .chain(args)
                .collect(),
        };
        let env = self
            .config
            .slurm_conf
            .iter()
            .map(|conf| ("SLURM_CONF".to_owned(), conf.display().to_string()))
            .collect();
        command::run(&Invocation { argv, stdin, env })
            .await
            .map_err(TargetError::Unavailable)
    }

    /// Jobs `squeue` still lists.
    async fn squeue(&self) -> Result<Vec<parse::SqueueJob>, TargetError> {
        let done = self
            .run(None, &self.config.squeue, vec!["--json".to_owned()], None)
            .await?;
        if !done.success() {
            return Err(TargetError::Unavailable(format!(
                "squeue --json failed: {}",
                done.last_words()
            )));
        }
        let out = parse::parse_squeue(&done.stdout).map_err(TargetError::Unavailable)?;
        if let Some(error) = out.errors.first() {
            return Err(TargetError::Unavailable(format!(
                "squeue --json reported an error: {error}"
            )));
        }
        Ok(out.jobs)
    }

    /// Ended jobs of `ids` from the completion log or the accounting database.
    async fn sacct(&self, ids: &[&EngineJobId]) -> Result<Vec<parse::SacctJob>, TargetError> {
        let mut args = vec![
            "--parsable2".to_owned(),
            "--noheader".to_owned(),
            format!("--format={SACCT_FORMAT}"),
        ];
        if self.config.completion_log {
            args.push("-c".to_owned());
        } else {
            let list: Vec<&str> = ids.iter().map(|id| id.as_str()).collect();
            args.push("--allusers".to_owned());
            args.push(format!("--jobs={}", list.join(",")));
        }
        let done = self.run(None, &self.config.sacct, args, None).await?;
        if !done.success() {
            return Err(TargetError::Unavailable(format!(
                "sacct failed: {}",
                done.last_words()
            )));
        }
        Ok(parse::parse_sacct(&done.stdout))
    }

    /// `scancel` with `options` on the job `id`, as `job`'s account; a job that has ended
    /// already is fine.
    async fn scancel(
        &self,
        job: &Tracked,
        id: &EngineJobId,
        options: &[&str],
    ) -> Result<(), TargetError> {
        let args: Vec<String> = options
            .iter()
            .map(|o| (*o).to_owned())
            .chain([id.to_string()])
            .collect();
        let shown = args.join(" ");
        let done = self
            .run(Some(&job.account), &self.config.scancel, args, None)
            .await?;
        if done.success() || gone(&done) {
            Ok(())
        } else {
            Err(TargetError::Unavailable(format!(
                "scancel {shown} failed: {}",
                done.last_words()
            )))
        }
    }
}

/// An [`Observation`] of one `squeue --json` job.
fn observe_squeue(job: &parse::SqueueJob) -> Option<Observation> {
    let ended = job
        .exit_code
        .as_ref()
        .map_or(Ended::Code(0), parse::ExitCode::ended);
    let state = job.job_state.base();
    Some(Observation {
        engine_id: EngineJobId::parse(&job.job_id.to_string()).ok()?,
        job: job_of_engine_name(&job.name),
        phase: parse::phase(state, &job.state_reason, ended),
        restarts: job.restart_cnt,
        hosts: job.nodes.clone(),
        raw: if job.state_reason.is_empty() || job.state_reason == "None" {
            state.to_owned()
        } else {
            format!("{state} ({})", job.state_reason)
        },
        held: false,
    })
}

/// An [`Observation`] of one `sacct` job (which does not say how often it was re-queued:
/// `restarts` is the one the job was tracked with).
fn observe_sacct(job: &parse::SacctJob, restarts: u32) -> Option<Observation> {
    Some(Observation {
        engine_id: EngineJobId::parse(&job.job_id).ok()?,
        job: job_of_engine_name(&job.name),
        phase: parse::phase(&job.state, "", job.ended),
        restarts,
        hosts: job.nodes.clone(),
        raw: match job.ended {
            Ended::Code(code) => format!("{} (exit code {code})", job.state),
            Ended::Signal(signal) => format!("{} (signal {signal})", job.state),
        },
        held: false,
    })
}

impl Target for Slurm {
    fn kind(&self) -> JobTarget {
        JobTarget::Slurm
    }

    fn describe(&self) -> String {
        let mut text = format!("Slurm cluster through {}", self.config.sbatch.display());
        if let Some(partition) = &self.config.partition {
            text.push_str(&format!(", partition {partition}"));
        }
        if !self.config.gpu_types.is_empty() {
            let types: Vec<String> = self
                .config
                .gpu_types
                .iter()
                .map(|t| format!("{} ({}, {})", t.name, t.capability, t.memory))
                .collect();
            text.push_str(&format!("; GPUs {}", types.join(", ")));
        }
        text
    }

    fn submit<'a>(&'a self, job: &'a TargetJob) -> BoxFuture<'a, Result<EngineJobId, TargetError>> {
        Box::pin(async move {
            let text = script::script(job, &self.config)
                .map_err(|e| TargetError::Refused(e.to_string()))?;
            let done = self
                .run(
                    Some(&job.account),
                    &self.config.sbatch,
                    vec!["--parsable".to_owned()],
                    Some(text.into_bytes()),
                )
                .await?;
            if !done.success() {
                return Err(match parse::sbatch_refused(&done.stderr) {
                    Some(words) => TargetError::Refused(words),
                    None => {
                        TargetError::Unavailable(format!("sbatch failed: {}", done.last_words()))
                    }
                });
            }
            let id = parse::parse_sbatch(&done.stdout).map_err(TargetError::Unavailable)?;
            tracing::info!(job_id = %job.id, slurm_job = %id, account = %job.account, name = %engine_job_name(job.id), "Job handed to Slurm.");
            Ok(id)
        })
    }

    fn status<'a>(
        &'a self,
        jobs: &'a [Tracked],
    ) -> BoxFuture<'a, Result<Vec<Observation>, TargetError>> {
        Box::pin(async move {
            let listed = self.squeue().await?;
            let mut seen: Vec<Observation> = Vec::new();
            for tracked in jobs {
                let found = listed.iter().find(|j| match &tracked.engine_id {
                    Some(id) => j.job_id.to_string() == id.as_str(),
                    None => job_of_engine_name(&j.name) == Some(tracked.job),
                });
                if let Some(observation) = found.and_then(observe_squeue) {
                    seen.push(observation);
                }
            }
            let missing: Vec<&Tracked> = jobs
                .iter()
                .filter(|t| match &t.engine_id {
                    Some(id) => !seen.iter().any(|o| &o.engine_id == id),
                    None => !seen.iter().any(|o| o.job == Some(t.job)),
                })
                .collect();
            if missing.is_empty() {
                return Ok(seen);
            }
            let ids: Vec<&EngineJobId> = missing
                .iter()
                .filter_map(|t| t.engine_id.as_ref())
                .collect();
            let ended: HashMap<String, parse::SacctJob> = self
                .sacct(&ids)
                .await?
                .into_iter()
                .map(|j| (j.job_id.clone(), j))
                .collect();
            for tracked in missing {
                let record = match &tracked.engine_id {
                    Some(id) => ended.get(id.as_str()),
                    None => ended
                        .values()
                        .find(|j| job_of_engine_name(&j.name) == Some(tracked.job)),
                };
                if let Some(observation) =
                    record.and_then(|j| observe_sacct(j, tracked.engine_restarts))
                {
                    seen.push(observation);
                }
            }
            Ok(seen)
        })
    }

    fn cancel<'a>(&'a self, job: &'a Tracked) -> BoxFuture<'a, Result<(), TargetError>> {
        Box::pin(async move {
            let Some(id) = &job.engine_id else {
                return Ok(());
            };
            self.scancel(job, id, &[]).await
        })
    }

    fn halt<'a>(&'a self, job: &'a Tracked) -> BoxFuture<'a, Result<(), TargetError>> {
        Box::pin(async move {
            let Some(id) = &job.engine_id else {
                return Err(TargetError::Unavailable(
                    "the job has no Slurm id yet".to_owned(),
                ));
            };
            self.scancel(job, id, &["--batch", "--signal=USR1"]).await
        })
    }

    fn logs<'a>(
        &'a self,
        job: &'a Tracked,
        offset: u64,
        max: usize,
    ) -> BoxFuture<'a, Result<Output, TargetError>> {
        Box::pin(async move {
            let Some(id) = &job.engine_id else {
                return Ok(Output {
                    data: Vec::new(),
                    size: 0,
                });
            };
            Output::read(&self.output_path(id, job.engine_restarts), offset, max).await
        })
    }
}

/// scancel's words for a job that has ended already.
fn gone(done: &Finished) -> bool {
    let words = format!("{} {}", done.stderr, done.stdout).to_ascii_lowercase();
    words.contains("already completing or completed") || words.contains("invalid job id")
}
