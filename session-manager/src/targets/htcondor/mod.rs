//! The HTCondor target: jobs handed to an HTCondor pool through its command-line tools, at the
//! paths of `[targets.htcondor]`.
//!
//! - [`config`]: `[targets.htcondor]`, validated into [`HtcondorConfig`].
//! - [`submit`]: the submit description of a job (container universe on the frozen image's
//!   SIF, GPUs, checkpoint exit 85, halt signal, max duration), a pure function.
//! - [`status`]: `condor_q -json` / `condor_history -json` output, parsed and mapped to
//!   ongrid's phases with reasons a user understands.
//! - [`Htcondor`] runs the tools: `condor_submit -terse` (the description on its stdin; the
//!   answer `17.0 - 17.0` is the engine id `17.0`), `condor_q -allusers -json` then
//!   `condor_history -json` for the jobs the queue no longer has, `condor_rm`, and
//!   `condor_hold` with [`status::HALT_HOLD_REASON`] for a halt (HTCondor cannot signal a
//!   running job: holding it sends the job's `kill_sig`, SIGUSR1, and kills it after
//!   `job_max_vacate_time`). Commands that act on a job run as its account through `run_as`;
//!   queries run as the manager (`-allusers`). No shell is involved.
//!
//! A job is found by its `OngridJobId` attribute, so a job whose `condor_submit` answer was
//! lost (a manager stopped half-way) is found again; its output is `job.out` in its directory
//! `<output_dir>/ongrid-<id>/`, written by HTCondor when the job ends.

pub mod config;
pub mod status;
pub mod submit;

use std::path::{Path, PathBuf};

use futures::future::BoxFuture;
use futures::FutureExt;
use ongrid_core::job::{JobId, JobTarget};

use crate::domain::grid_jobs::{EngineJobId, LocalAccount, Observation};
use crate::targets::{command, HtcondorConfig, Output, Target, TargetError, TargetJob, Tracked};

use self::submit::{SubmitSite, JOB_ID_ATTRIBUTE, OUTPUT_FILE};

/// How many jobs one `condor_q` or `condor_history` constraint names at most.
const JOBS_PER_QUERY: usize = 200;

/// The HTCondor target.
#[derive(Debug, Clone)]
pub struct Htcondor {
    config: HtcondorConfig,
    site: SubmitSite,
}

impl Htcondor {
    pub fn new(config: HtcondorConfig) -> Self {
        let site = SubmitSite {
            output_dir: config.output_dir.clone(),
            request_disk: config.request_disk,
            extra_lines: config.extra_lines.clone(),
        };
        Self { config, site }
    }

    /// The submit description of `job`, as [`Target::submit`] hands it to `condor_submit`.
    pub fn describe_job(&self, job: &TargetJob) -> Result<String, TargetError> {
        submit::render(job, &self.site).map_err(|e| TargetError::Refused(e.to_string()))
    }

    /// The directory of `job` on the submit side.
    pub fn job_dir(&self, job: JobId) -> PathBuf {
        self.site.job_dir(job)
    }

    async fn submit_job(&self, job: &TargetJob) -> Result<EngineJobId, TargetError> {
        let description = self.describe_job(job)?;
        let dir = self.job_dir(job.id);
        self.make_dir(&job.account, &dir).await?;
        let argv = self.config.run_as.argv(
            &job.account,
            &self.config.condor_submit,
            &["-terse".to_owned(), "-".to_owned()],
        );
        let out = run(argv, Some(description.as_bytes())).await?;
        if !out.success {
            let words = out.error_words();
            return Err(if out.not_run() {
                TargetError::Unavailable(format!(
                    "could not run {}: {words} (check the path in [targets.htcondor] and run_as)",
                    self.config.condor_submit.display()
                ))
            } else if unavailable(&words) {
                TargetError::Unavailable(format!("condor_submit: {words}"))
            } else {
                TargetError::Refused(words)
            });
        }
        parse_terse(&out.stdout).map_err(TargetError::Unavailable)
    }

    /// Creates the job's directory (its `initialdir`) as its account.
    async fn make_dir(&self, account: &LocalAccount, dir: &Path) -> Result<(), TargetError> {
        if self.config.run_as.0.is_empty() {
            return tokio::fs::create_dir_all(dir)
                .await
                .map_err(|e| TargetError::Unavailable(format!("creating {}: {e}", dir.display())));
        }
        let argv = self.config.run_as.argv(
            account,
            Path::new("mkdir"),
            &["-p".to_owned(), dir.display().to_string()],
        );
        let out = run(argv, None).await?;
        if out.success {
            Ok(())
        } else {
            Err(TargetError::Unavailable(format!(
                "creating {} as {account}: {}",
                dir.display(),
                out.error_words()
            )))
        }
    }

    async fn query(&self, jobs: &[Tracked]) -> Result<Vec<Observation>, TargetError> {
        let attributes = status::ATTRIBUTES.join(",");
        let mut observations = Vec::new();
        for chunk in jobs.chunks(JOBS_PER_QUERY) {
            let asked: Vec<JobId> = chunk.iter().map(|t| t.job).collect();
            let queue = self
                .ask(
                    &self.config.condor_q,
                    &[
                        "-allusers",
                        "-json",
                        "-attributes",
                        &attributes,
                        "-constraint",
                        &constraint(asked.iter().copied()),
                    ],
                )
                .await?;
            let mut seen = Vec::new();
            for ad in queue {
                if let Some(job) = ad
                    .job
                    .filter(|job| asked.contains(job) && !seen.contains(job))
                {
                    seen.push(job);
                    observations.push(ad.observation());
                }
            }
            let missing: Vec<JobId> = asked
                .iter()
                .copied()
                .filter(|job| !seen.contains(job))
                .collect();
            if missing.is_empty() {
                continue;
            }
            // The newest first: a job's last record is the one that counts.
            let history = self
                .ask(
                    &self.config.condor_history,
                    &[
                        "-json",
                        "-attributes",
                        &attributes,
                        "-limit",
                        &missing.len().to_string(),
                        "-constraint",
                        &constraint(missing.iter().copied()),
                    ],
                )
                .await?;
            for ad in history {
                if let Some(job) = ad
                    .job
                    .filter(|job| missing.contains(job) && !seen.contains(job))
                {
                    seen.push(job);
                    observations.push(ad.observation());
                }
            }
        }
        Ok(observations)
    }

    /// Runs a query as the manager and parses its job ads.
    async fn ask(&self, program: &Path, args: &[&str]) -> Result<Vec<status::JobAd>, TargetError> {
        let mut argv = vec![program.display().to_string()];
        argv.extend(args.iter().map(|a| (*a).to_owned()));
        let out = run(argv, None).await?;
        let name = program.display();
        if !out.success {
            return Err(TargetError::Unavailable(format!(
                "{name}: {}",
                out.error_words()
            )));
        }
        status::parse_ads(&out.stdout)
            .map_err(|e| TargetError::Unavailable(format!("{name} printed {e}")))
    }

    /// `condor_rm` or `condor_hold` on one job, as its account. A job HTCondor no longer has is
    /// fine.
    async fn act(
        &self,
        program: &Path,
        options: &[&str],
        job: &Tracked,
    ) -> Result<(), TargetError> {
        let mut args: Vec<String> = options.iter().map(|o| (*o).to_owned()).collect();
        match &job.engine_id {
            Some(id) => args.push(id.to_string()),
            None => {
                args.push("-constraint".to_owned());
                args.push(constraint([job.job]));
            }
        }
        let argv = self.config.run_as.argv(&job.account, program, &args);
        let out = run(argv, None).await?;
        let words = out.error_words();
        if out.success || gone(&words) {
            Ok(())
        } else {
            Err(TargetError::Unavailable(format!(
                "{}: {words}",
                program.display()
            )))
        }
    }
}

impl Target for Htcondor {
    fn kind(&self) -> JobTarget {
        JobTarget::Htcondor
    }

    fn describe(&self) -> String {
        format!(
            "HTCondor pool via {} (container universe, images from {})",
            self.config.condor_submit.display(),
            self.config.image_dir.display()
        )
    }

    fn submit<'a>(&'a self, job: &'a TargetJob) -> BoxFuture<'a, Result<EngineJobId, TargetError>> {
        self.submit_job(job).boxed()
    }

    fn status<'a>(
        &'a self,
        jobs: &'a [Tracked],
    ) -> BoxFuture<'a, Result<Vec<Observation>, TargetError>> {
        self.query(jobs).boxed()
    }

    fn cancel<'a>(&'a self, job: &'a Tracked) -> BoxFuture<'a, Result<(), TargetError>> {
        self.act(&self.config.condor_rm, &[], job).boxed()
    }

    fn halt<'a>(&'a self, job: &'a Tracked) -> BoxFuture<'a, Result<(), TargetError>> {
        self.act(
            &self.config.condor_hold,
            &["-reason", status::HALT_HOLD_REASON],
            job,
        )
        .boxed()
    }

    fn logs<'a>(
        &'a self,
        job: &'a Tracked,
        offset: u64,
        max: usize,
    ) -> BoxFuture<'a, Result<Output, TargetError>> {
        let path = self.job_dir(job.job).join(OUTPUT_FILE);
        async move { Output::read(&path, offset, max).await }.boxed()
    }
}

/// The ClassAd constraint that matches these ongrid jobs by their `OngridJobId`.
pub fn constraint(jobs: impl IntoIterator<Item = JobId>) -> String {
    let terms: Vec<String> = jobs
        .into_iter()
        .map(|job| format!("{JOB_ID_ATTRIBUTE} == \"{job}\""))
        .collect();
    if terms.is_empty() {
        "false".to_owned()
    } else {
        terms.join(" || ")
    }
}

/// The engine id in `condor_submit -terse`'s answer: `17.0 - 17.0` (first and last job of the
/// cluster; ongrid queues one) is `17.0`.
pub fn parse_terse(stdout: &str) -> Result<EngineJobId, String> {
    let first = stdout
        .lines()
        .map(str::trim)
        .find(|line| !line.is_empty())
        .and_then(|line| line.split(" - ").next())
        .map(str::trim)
        .unwrap_or_default();
    let valid = first.split_once('.').is_some_and(|(cluster, proc)| {
        !cluster.is_empty()
            && !proc.is_empty()
            && cluster.bytes().all(|b| b.is_ascii_digit())
            && proc.bytes().all(|b| b.is_ascii_digit())
    });
    if !valid {
        return Err(format!(
            "condor_submit -terse printed {stdout:?}, not CLUSTER.PROC - CLUSTER.PROC"
        ));
    }
    EngineJobId::parse(first)
}

/// Whether condor_submit's words say HTCondor could not be asked (rather than that it
/// refused the job).
fn unavailable(words: &str) -> bool {
    let words = words.to_ascii_lowercase();
    [
        "queue manager",
        "failed to connect",
        "can't find address",
        "no such directory",
        "permission denied",
        "timed out",
    ]
    .iter()
    .any(|w| words.contains(w))
}

/// Whether condor_rm's or condor_hold's words say the job is gone already.
fn gone(words: &str) -> bool {
    let words = words.to_ascii_lowercase();
    words.contains("not found")
        || words.contains("couldn't find")
        || words.contains("already")
        || words.contains("no jobs")
}

/// What a command printed and whether it exited with 0.
struct Ran {
    success: bool,
    /// The exit code; `None` when killed by a signal.
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Ran {
    /// Whether the program could not be run at all: 126 and 127 are what `run_as` prefixes
    /// (`runuser`, `sudo`, `env`) and shells exit with for a program that is not there or not
    /// executable.
    fn not_run(&self) -> bool {
        matches!(self.code, Some(126 | 127))
    }

    /// The command's complaint in one line: its stderr (else its stdout), `ERROR:` lines first.
    fn error_words(&self) -> String {
        let text = if self.stderr.trim().is_empty() {
            &self.stdout
        } else {
            &self.stderr
        };
        let errors: Vec<&str> = text
            .lines()
            .map(str::trim)
            .filter(|l| l.starts_with("ERROR"))
            .collect();
        let lines: Vec<&str> = if errors.is_empty() {
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect()
        } else {
            errors
        };
        let joined = lines.join("; ");
        if joined.is_empty() {
            "failed without saying why".to_owned()
        } else {
            joined
        }
    }
}

/// Runs `argv` (no shell) with `stdin` written to it, through the targets' shared runner
/// ([`command::run`], within its timeout).
async fn run(argv: Vec<String>, stdin: Option<&[u8]>) -> Result<Ran, TargetError> {
    let invocation = command::Invocation {
        argv,
        stdin: stdin.map(<[u8]>::to_vec),
        env: Vec::new(),
    };
    let finished = command::run(&invocation).await.map_err(|e| {
        TargetError::Unavailable(format!("{e} (check the path in [targets.htcondor])"))
    })?;
    Ok(Ran {
        success: finished.success(),
        code: finished.code,
        stdout: finished.stdout,
        stderr: finished.stderr,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terse_answer_is_the_first_job() {
        assert_eq!(parse_terse("17.0 - 17.0\n").unwrap().as_str(), "17.0");
        assert_eq!(
            parse_terse("\n  4321.0 - 4321.0  \n").unwrap().as_str(),
            "4321.0"
        );
        for bad in ["", "Submitting job(s).\n", "17 - 17", "a.0 - a.0"] {
            assert!(parse_terse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn constraint_names_every_job() {
        let a: JobId = "7f0c1c9e-2f7a-4b8e-9a51-0d6c2a7c3e11".parse().unwrap();
        let b: JobId = "0b3e5e2a-6f1d-4c4a-8d3b-5f2e9c1a7b22".parse().unwrap();
        assert_eq!(
            constraint([a, b]),
            "OngridJobId == \"7f0c1c9e-2f7a-4b8e-9a51-0d6c2a7c3e11\" || \
             OngridJobId == \"0b3e5e2a-6f1d-4c4a-8d3b-5f2e9c1a7b22\""
        );
        assert_eq!(constraint([]), "false");
    }
}
