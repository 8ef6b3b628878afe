//! Grid targets: the batch engines (Slurm, HTCondor) the manager hands jobs to, one
//! [`Target`] implementation per engine, behind one trait so the API and the mirroring loop
//! (`crate::grid_mirror`) never name an engine.
//!
//! [`Targets`] is what the site offers (`[targets]` in the manager's config, validated into
//! [`TargetsConfig`]): the local target always, and each configured engine. The rules (which
//! target a job goes to, the account it runs under, what an engine's state means for the job)
//! are in [`crate::domain::grid_jobs`]; this module only runs the engines' commands and
//! parses what they print.

pub mod command;
pub mod host_check;
pub mod htcondor;
pub mod slurm;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use ongrid_core::job::{JobId, JobSpec, JobTarget, TargetInfo};
use ongrid_core::HumanDuration;

use crate::domain::grid_jobs::{AccountMap, EngineJobId, LocalAccount, Observation};

/// Why an engine's command failed.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    /// The engine refused the job (a request it can never run, an unknown partition, ...):
    /// its own words, shown to the user as the job's reason.
    #[error("{0}")]
    Refused(String),
    /// The engine could not be asked (command missing, daemon down, output not understood):
    /// an operator's problem; the job is left as it is and asked about again at the next poll.
    #[error("{0}")]
    Unavailable(String),
}

/// A job as a target submits it: everything the engine needs, resolved by the manager.
#[derive(Debug, Clone)]
pub struct TargetJob {
    pub id: JobId,
    pub spec: JobSpec,
    /// The max duration it runs under (the engine's time limit); `None`: the engine's default.
    pub max_duration: Option<HumanDuration>,
    /// The frozen image's SIF, as the engine's nodes see it (`<image_dir>/sha256/<hex>.sif`).
    pub sif: PathBuf,
    /// The local account it runs under.
    pub account: LocalAccount,
    /// Its place in its restart chain: the environment's `ONGRID_*` variables.
    pub chain: ongrid_core::job::RestartChain,
}

/// A job a target is asked about: its ongrid id (the engine's job name is derived from it, so
/// a job whose submission answer was lost can be found by name), its engine id once known, and
/// the account it runs under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tracked {
    pub job: JobId,
    pub engine_id: Option<EngineJobId>,
    pub account: LocalAccount,
    /// Which run of the engine's job this ongrid job is (the engine's re-queues before it).
    pub engine_restarts: u32,
}

impl Tracked {
    /// The tracking of a stored grid job; `None` for a local one.
    pub fn of(job: &crate::domain::jobs::JobRecord) -> Option<Self> {
        let grid = job.grid.as_ref()?;
        Some(Self {
            job: job.id,
            engine_id: grid.engine_id.clone(),
            account: grid.account.clone(),
            engine_restarts: grid.engine_restarts,
        })
    }
}

/// Bytes of a job's output from an offset, as the engine wrote them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    pub data: Vec<u8>,
    /// The output's size when read (so a caller knows whether more is there already).
    pub size: u64,
}

impl Output {
    /// At most `max` bytes of the output file at `path` from `offset`.
    pub async fn read(path: &Path, offset: u64, max: usize) -> Result<Self, TargetError> {
        let (data, size) = crate::job_logs::read_at(path, offset, max)
            .await
            .map_err(|e| TargetError::Unavailable(format!("reading {}: {e}", path.display())))?;
        Ok(Self { data, size })
    }
}

/// One batch engine. Implementations (`slurm.rs`, `htcondor/`) must:
///
/// - **submit**: turn the job into the engine's own description (an sbatch script, a submit
///   description) that runs `apptainer exec --nv <sif> <command>` under `job.account` with the
///   spec's GPUs, CPUs, memory, max duration (the engine's time limit), the halt signal
///   (SIGUSR1 some lead time before the limit, as the local target does), the checkpoint exit
///   85 re-queued by the engine, and the environment plus `ONGRID_JOB_ID`,
///   `ONGRID_RESTART_COUNT` (the chain's count plus the engine's own re-queues),
///   `ONGRID_RESTART_INITIAL_JOB_ID`. Name the engine's job `ongrid-<job id>` (see
///   [`engine_job_name`]) so [`Target::status`] can find a job whose id was never stored. Return
///   the engine's job id as soon as the engine accepted it; a request the engine can never run
///   is [`TargetError::Refused`] with the engine's words.
/// - **status**: one call for many jobs (the loop polls every interval); return an
///   [`Observation`] for every job the engine still knows, in ongrid's terms: map every engine
///   state to a [`crate::domain::grid_jobs::Phase`] and every pending or hold reason to a
///   sentence a user understands; count the engine's re-queues in `restarts`. Leave out jobs
///   the engine does not know (the loop then decides they are lost). Ended jobs must still be
///   reported (from the engine's history: `sacct`, `condor_history`) for as long as the engine
///   keeps them.
/// - **cancel**: remove the job from the engine (`scancel`, `condor_rm`); already gone is fine.
/// - **halt**: deliver SIGUSR1 to the running job (its checkpoint then exit 123), the same
///   signal the local target sends.
/// - **logs**: the job's output (stdout and stderr together) from `offset`, at most `max`
///   bytes, from where the engine writes it (a file on storage the manager sees).
///
/// Commands run with the paths of the target's config, never through a shell; the account's
/// commands through the configured `run_as` prefix.
pub trait Target: Send + Sync {
    fn kind(&self) -> JobTarget;

    /// One line for `devctl job targets`.
    fn describe(&self) -> String;

    fn submit<'a>(&'a self, job: &'a TargetJob) -> BoxFuture<'a, Result<EngineJobId, TargetError>>;

    fn status<'a>(
        &'a self,
        jobs: &'a [Tracked],
    ) -> BoxFuture<'a, Result<Vec<Observation>, TargetError>>;

    fn cancel<'a>(&'a self, job: &'a Tracked) -> BoxFuture<'a, Result<(), TargetError>>;

    fn halt<'a>(&'a self, job: &'a Tracked) -> BoxFuture<'a, Result<(), TargetError>>;

    fn logs<'a>(
        &'a self,
        job: &'a Tracked,
        offset: u64,
        max: usize,
    ) -> BoxFuture<'a, Result<Output, TargetError>>;
}

/// The engine's name of an ongrid job: `ongrid-<job id>`.
pub fn engine_job_name(job: JobId) -> String {
    format!("ongrid-{job}")
}

/// The ongrid job an engine's job name stands for, if it is one of ongrid's.
pub fn job_of_engine_name(name: &str) -> Option<JobId> {
    name.strip_prefix("ongrid-")?.parse().ok()
}

/// How a target runs a command for an account: the configured prefix with `{account}`
/// replaced, then the engine's command. An empty prefix runs it as the manager's own user.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RunAs(pub Vec<String>);

impl RunAs {
    /// `["runuser", "-u", "{account}", "--"]`: what a manager running as root uses.
    pub fn runuser() -> Self {
        Self(
            ["runuser", "-u", "{account}", "--"]
                .map(str::to_owned)
                .to_vec(),
        )
    }

    /// The argv that runs `program args` as `account`.
    pub fn argv(&self, account: &LocalAccount, program: &Path, args: &[String]) -> Vec<String> {
        let mut argv: Vec<String> = self
            .0
            .iter()
            .map(|part| part.replace("{account}", account.as_str()))
            .collect();
        argv.push(program.display().to_string());
        argv.extend(args.iter().cloned());
        argv
    }
}

/// `[targets.slurm]`, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlurmConfig {
    pub sbatch: PathBuf,
    pub squeue: PathBuf,
    pub sacct: PathBuf,
    pub scancel: PathBuf,
    /// `SLURM_CONF` for every command; `None`: Slurm's default (`/etc/slurm/slurm.conf`).
    pub slurm_conf: Option<PathBuf>,
    /// Where the engine's nodes see the image store (`<dir>/sha256/<hex>.sif`).
    pub image_dir: PathBuf,
    /// Where job output files go (`<dir>/slurm-<engine id>-<run>.out`): storage both the
    /// engine's nodes and the manager see, writable by the mapped accounts.
    pub output_dir: PathBuf,
    pub partition: Option<String>,
    /// The `apptainer` the job script runs (a name found on `job_path`, or a path).
    pub apptainer: String,
    /// The job's `PATH` (its environment is not the manager's: `--export=NONE`).
    pub job_path: String,
    /// How long before the time limit the job gets SIGUSR1 (`--signal=B:USR1@<lead>`).
    pub halt_lead: Duration,
    /// Ended jobs are read from the job-completion log (`sacct -c`, `JobCompType=jobcomp/filetxt`)
    /// where no slurmdbd runs; otherwise from the accounting database (`sacct -j`).
    pub completion_log: bool,
    pub run_as: RunAs,
    /// Extra `#SBATCH` options the site wants in every script (`--qos=grid`, ...).
    pub extra_options: Vec<String>,
    /// The cluster's GPU types (gres.conf `Type=`), for typed `--gres` requests.
    pub gpu_types: Vec<slurm::script::GpuType>,
}

/// `[targets.htcondor]`, validated by `htcondor/config.rs`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HtcondorConfig {
    pub condor_submit: PathBuf,
    pub condor_q: PathBuf,
    pub condor_history: PathBuf,
    pub condor_rm: PathBuf,
    pub condor_hold: PathBuf,
    /// Where the engine's nodes see the image store (`<dir>/sha256/<hex>.sif`).
    pub image_dir: PathBuf,
    /// Where job output and submit files go, seen by the manager (and the schedd).
    pub output_dir: PathBuf,
    /// `request_disk` of every job: the scratch space it asks for.
    pub request_disk: ongrid_core::MemorySize,
    pub run_as: RunAs,
    /// Extra submit-description lines the site wants (`+AccountingGroup = "grid"`, ...).
    pub extra_lines: Vec<String>,
}

/// `[targets]`, validated: what the site offers besides the local target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetsConfig {
    /// Where jobs that name no target go.
    pub default: JobTarget,
    /// Whether the local target takes jobs (default yes).
    pub local: bool,
    /// How often each engine is polled for its jobs' states.
    pub poll_interval: Duration,
    pub accounts: AccountMap,
    pub slurm: Option<SlurmConfig>,
    pub htcondor: Option<HtcondorConfig>,
}

impl Default for TargetsConfig {
    fn default() -> Self {
        Self {
            default: JobTarget::Local,
            local: true,
            poll_interval: DEFAULT_POLL_INTERVAL,
            accounts: AccountMap::default(),
            slurm: None,
            htcondor: None,
        }
    }
}

/// How often engines are polled unless `[targets] poll_interval` says otherwise.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(10);

/// The targets the site offers, built once from [`TargetsConfig`].
#[derive(Clone)]
pub struct Targets {
    config: TargetsConfig,
    engines: Vec<Arc<dyn Target>>,
}

impl std::fmt::Debug for Targets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Targets")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Targets {
    /// The engines `config` names.
    pub fn from_config(config: &TargetsConfig) -> Self {
        let mut engines: Vec<Arc<dyn Target>> = Vec::new();
        if let Some(slurm) = &config.slurm {
            engines.push(Arc::new(slurm::Slurm::new(slurm.clone())));
        }
        if let Some(htcondor) = &config.htcondor {
            engines.push(Arc::new(htcondor::Htcondor::new(htcondor.clone())));
        }
        Self {
            config: config.clone(),
            engines,
        }
    }

    pub fn config(&self) -> &TargetsConfig {
        &self.config
    }

    /// Every target offered: local first (when it takes jobs), then the engines.
    pub fn offered(&self) -> Vec<JobTarget> {
        let mut offered = Vec::new();
        if self.config.local {
            offered.push(JobTarget::Local);
        }
        offered.extend(self.engines.iter().map(|e| e.kind()));
        offered
    }

    pub fn engine(&self, target: JobTarget) -> Option<&Arc<dyn Target>> {
        self.engines.iter().find(|e| e.kind() == target)
    }

    pub fn engines(&self) -> &[Arc<dyn Target>] {
        &self.engines
    }

    /// Where `target`'s nodes see the SIF of an image with this digest (`sha256:<hex>`).
    pub fn sif_path(&self, target: JobTarget, digest: &str) -> Option<PathBuf> {
        let dir = match target {
            JobTarget::Local => return None,
            JobTarget::Slurm => &self.config.slurm.as_ref()?.image_dir,
            JobTarget::Htcondor => &self.config.htcondor.as_ref()?.image_dir,
        };
        let hex = digest.strip_prefix("sha256:")?;
        Some(dir.join("sha256").join(format!("{hex}.sif")))
    }

    /// What `devctl job targets` shows a caller (DN `dn` in accounting group `group`).
    pub fn describe_for(
        &self,
        dn: &ongrid_core::Dn,
        group: &crate::domain::policy::GroupName,
    ) -> Vec<TargetInfo> {
        let mut infos = Vec::new();
        if self.config.local {
            infos.push(TargetInfo {
                target: JobTarget::Local,
                default: self.config.default == JobTarget::Local,
                description: "this site's own GPUs, beside interactive sessions".to_owned(),
                account: None,
                refusal: None,
            });
        }
        for engine in &self.engines {
            let kind = engine.kind();
            let account = self.config.accounts.account_for(kind, dn, group);
            infos.push(TargetInfo {
                target: kind,
                default: self.config.default == kind,
                description: engine.describe(),
                account: account.as_ref().ok().map(ToString::to_string),
                refusal: account.err().map(|e| e.to_string()),
            });
        }
        infos
    }
}
