//! Batch jobs on this node: the agent's half of the job contract in `ongrid_core::job`
//! (`DesiredState::jobs` in, `NodeReport::jobs` out). Level-triggered like the reconciler of
//! sessions: each sync [`Jobs::apply`] compares the desired jobs with the job containers
//! Docker has (`ContainerRuntime::list_jobs`, by label) and acts; [`Jobs::report`] says where
//! each desired job stands, with the output that follows the manager's offset.
//!
//! - Image: when Docker lacks the job's image it is built from the SIF ([`image`]), once per
//!   digest; meanwhile the job is `Preparing`, and a missing or broken SIF fails it.
//! - Container `ongrid-job-<id>`: hardened like a dev container (`runtime::JobContainerSpec`),
//!   on its own network made like a session's (so the node's firewall rules isolate it), the
//!   GPU variables added to the manager's environment, the chain's working directory
//!   `<jobs dir>/<chain id>` (owned by the user) at `WORK_DIR_IN_CONTAINER`, the home volume
//!   only when asked. Created and started once: a job container that exists, in any state, is
//!   never created again, and one that ran is never started again.
//! - Halt: `HALT_SIGNAL` once, then `SIGKILL` when the job still runs [`JobsConfig::halt_grace`]
//!   (`HALT_GRACE` unless configured) after the manager's `since`. Kill: `SIGKILL` at once.
//! - Output: [`logs`] copies it into `<job id>.log`, capped, so it outlives the container,
//!   from the moment the container starts; every piece written bumps [`Jobs::output_written`],
//!   on which the sync loop reports it within a second instead of on its periodic sync.
//! - Exit: a job's exit is reported in the same report as the last of its output (the chunk
//!   that says it is complete), so the manager never shows a job ended before its output is in.
//!   A report waits up to [`EXIT_OUTPUT_WAIT`] for the output of a job that just exited; while
//!   some is still to come (Docker has not sent it all, or more than one chunk is left) the job
//!   is reported as still running (or halting). Only when its output cannot be read
//!   [`EXIT_OUTPUT_LIMIT`] after the exit is the exit reported without it (logged).
//! - When the manager stops listing a job, its container and network are removed, and its log
//!   and record files too. The manager stops listing a job once it has its complete output, or
//!   once its `[jobs] output_grace` passed after the end: output the manager never got is then
//!   dropped with a warning that says how much.
//!
//! What the agent must remember across its own restarts sits in a small record per job
//! (`<job id>.json`: created, when it was signalled, whether it was killed, whether its output
//! is complete), written before the action it records. The chain directories may live on
//! storage shared by nodes (the default is beside the image store); the per-job files are
//! node-local, under `<jobs dir>/.agent/<node>/`.

pub mod image;
pub mod logs;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use chrono::{DateTime, Utc};
use ongrid_core::api::visible_devices;
use ongrid_core::job::{DesiredJob, JobId, JobRun, ObservedJob, ObservedJobStatus, HALT_SIGNAL};
use ongrid_core::{NodeName, SessionId};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

use crate::network::NetworkSpec;
use crate::reconcile::NodeGuard;
use crate::runtime::{
    error_chain, ContainerRuntime, GpuAccess, JobContainerSpec, JobContainerState,
    JobContainerStatus, LABEL_GPUS, LABEL_JOB, LABEL_MANAGED, LABEL_NODE, LABEL_OWNER, LABEL_USER,
};

use self::image::{BuildPlace, BuildState, Builds};
use self::logs::OutputSignal;

/// How long a report waits for the rest of the output of a job whose container exited (Docker
/// sends the last of it a moment after the exit), so the exit and the output go in one report.
pub const EXIT_OUTPUT_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// How long after its exit a job whose output cannot all be read is still reported as running;
/// past it the exit is reported without the rest (the manager's `output_grace` then applies).
pub const EXIT_OUTPUT_LIMIT: std::time::Duration = std::time::Duration::from_secs(60);

/// Where jobs find their images and keep their files (`[images]` of the agent's config).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobsConfig {
    /// The image store: `<store>/sha256/<hex>.sif`.
    pub image_store: PathBuf,
    /// `<dir>/<chain id>`: the chains' working directories; `<dir>/.agent/<node>/`: this
    /// node's logs and records.
    pub dir: PathBuf,
    /// How long a job has between `HALT_SIGNAL` and `SIGKILL` (`[images] job_halt_grace`;
    /// default `HALT_GRACE`).
    pub halt_grace: std::time::Duration,
}

/// The time now; tests inject their own.
pub type Clock = Arc<dyn Fn() -> DateTime<Utc> + Send + Sync>;

/// What the agent keeps on disk about one job (see the module docs).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct JobRecord {
    /// Its container was created: it is never created again.
    created: bool,
    /// When `HALT_SIGNAL` was sent.
    signalled_at: Option<DateTime<Utc>>,
    /// The agent killed it (or is killing it).
    killed: bool,
    /// Its whole output is in the log file.
    log_complete: bool,
}

/// See the module documentation.
pub struct Jobs {
    runtime: Arc<dyn ContainerRuntime>,
    node: NodeName,
    gpu_access: GpuAccess,
    guard: NodeGuard,
    config: Option<JobsConfig>,
    clock: Clock,
    /// The jobs of the manager's last answer.
    desired: Vec<DesiredJob>,
    records: HashMap<JobId, JobRecord>,
    /// The last failure to create or start a job's container (retried every sync).
    problems: HashMap<JobId, String>,
    builds: Builds,
    followers: HashMap<JobId, logs::Follower>,
    /// Bumped by the followers at every piece of output and at their end.
    output: OutputSignal,
    /// Jobs whose exit was reported without all their output (logged once).
    output_overdue: HashSet<JobId>,
    /// How far each job's output went in the last report (the manager's offset and the
    /// chunk sent), to say what is dropped when the manager stops listing it too early.
    reported: HashMap<JobId, u64>,
    tasks: TaskTracker,
}

impl Jobs {
    pub fn new(
        runtime: Arc<dyn ContainerRuntime>,
        node: NodeName,
        gpu_access: GpuAccess,
        guard: NodeGuard,
        config: Option<JobsConfig>,
    ) -> Self {
        Self {
            runtime,
            node,
            gpu_access,
            guard,
            config,
            clock: Arc::new(Utc::now),
            desired: Vec::new(),
            records: HashMap::new(),
            problems: HashMap::new(),
            builds: Builds::default(),
            followers: HashMap::new(),
            output: Arc::new(watch::channel(0).0),
            output_overdue: HashSet::new(),
            reported: HashMap::new(),
            tasks: TaskTracker::new(),
        }
    }

    /// Changes whenever a job's output grew or all of it is in: the sync loop reports then.
    pub fn output_written(&self) -> watch::Receiver<u64> {
        self.output.subscribe()
    }

    /// Replaces the clock (tests).
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// The image builds running now (tests and shutdown wait on them).
    pub fn tasks(&self) -> &TaskTracker {
        &self.tasks
    }

    /// Waits until every output follower has ended (tests: the fake's end at once).
    #[cfg(test)]
    async fn settle_followers(&self) {
        while self.followers.values().any(|f| !f.ended()) {
            tokio::task::yield_now().await;
        }
    }

    /// This node's directory of logs and records.
    fn local_dir(&self) -> Option<PathBuf> {
        let config = self.config.as_ref()?;
        Some(config.dir.join(".agent").join(self.node.as_str()))
    }

    fn log_path(&self, job_id: JobId) -> Option<PathBuf> {
        Some(self.local_dir()?.join(format!("{job_id}.log")))
    }

    fn record_path(&self, job_id: JobId) -> Option<PathBuf> {
        Some(self.local_dir()?.join(format!("{job_id}.json")))
    }

    /// The job's record, read from disk the first time.
    fn record(&mut self, job_id: JobId) -> JobRecord {
        if let Some(record) = self.records.get(&job_id) {
            return record.clone();
        }
        let record: JobRecord = self
            .record_path(job_id)
            .and_then(|path| std::fs::read(path).ok())
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
            .unwrap_or_default();
        self.records.insert(job_id, record.clone());
        record
    }

    /// Writes the job's record (then keeps it in memory).
    fn save(&mut self, job_id: JobId, record: JobRecord) -> Result<(), String> {
        let path = self
            .record_path(job_id)
            .ok_or_else(|| NO_IMAGE_STORE.to_owned())?;
        let write = || -> std::io::Result<()> {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            let partial = path.with_extension("json.partial");
            std::fs::write(&partial, serde_json::to_vec(&record)?)?;
            std::fs::rename(&partial, &path)
        };
        write().map_err(|e| format!("writing {}: {e}", path.display()))?;
        self.records.insert(job_id, record);
        Ok(())
    }

    /// One pass towards `desired`. Nothing is touched when Docker cannot list the containers.
    pub async fn apply(&mut self, desired: &[DesiredJob]) {
        self.desired = desired.to_vec();
        let wanted: HashSet<JobId> = desired.iter().map(|j| j.job_id).collect();
        let dropped: Vec<(JobId, u64)> = self
            .reported
            .iter()
            .filter(|(id, _)| !wanted.contains(id))
            .map(|(id, end)| (*id, *end))
            .collect();
        for (id, delivered) in dropped {
            self.reported.remove(&id);
            self.warn_undelivered(id, delivered);
        }
        let containers = match self.runtime.list_jobs().await {
            Ok(containers) => containers,
            Err(e) => {
                warn!(error = %error_chain(&e), "Cannot list job containers; jobs left as they are.");
                return;
            }
        };
        let by_job: HashMap<JobId, &JobContainerStatus> =
            containers.iter().map(|c| (c.job_id, c)).collect();
        for job in desired {
            match by_job.get(&job.job_id) {
                Some(container) => self.drive(job, container).await,
                None => self.prepare(job).await,
            }
        }
        let mut present: HashSet<JobId> = by_job.keys().copied().collect();
        for container in &containers {
            if !wanted.contains(&container.job_id) && self.remove(container).await {
                present.remove(&container.job_id);
            }
        }
        self.forget_files(&wanted, &present);
        let digests: Vec<&str> = desired.iter().map(|j| j.image.digest.as_str()).collect();
        self.builds.retain(&digests);
        self.problems.retain(|id, _| wanted.contains(id));
    }

    /// A job whose container exists: start it if it never ran, halt or kill it, follow its
    /// output.
    async fn drive(&mut self, job: &DesiredJob, container: &JobContainerStatus) {
        let id = job.job_id;
        let mut record = self.record(id);
        if !record.log_complete && container.state != JobContainerState::Created {
            self.follow(id, &container.id);
        }
        let now = (self.clock)();
        match (job.run, container.state) {
            (JobRun::Run, JobContainerState::Created) => {
                // Created and never started (the agent stopped in between): start it now.
                if !record.created {
                    record.created = true;
                    if let Err(problem) = self.save(id, record.clone()) {
                        self.problems.insert(id, problem);
                        return;
                    }
                }
                self.start(id, &container.id).await;
            }
            (JobRun::Halt { since }, JobContainerState::Running { .. }) => {
                if record.signalled_at.is_none() {
                    record.signalled_at = Some(now);
                    if self.save(id, record.clone()).is_ok() {
                        info!(job = %id, "Halting a job: sending it {HALT_SIGNAL}.");
                        self.signal(id, &container.id, HALT_SIGNAL).await;
                    }
                }
                let halt_grace = self
                    .config
                    .as_ref()
                    .map_or(ongrid_core::job::HALT_GRACE, |c| c.halt_grace);
                let grace = chrono::Duration::from_std(halt_grace).unwrap_or_default();
                if now >= since + grace {
                    if !record.killed {
                        info!(job = %id, "The job still runs {} s after it was asked to halt: killing it.", halt_grace.as_secs_f64());
                    }
                    self.kill(id, &container.id, record).await;
                }
            }
            (JobRun::Kill, JobContainerState::Running { .. }) => {
                if !record.killed {
                    info!(job = %id, "Killing a job, as the manager asks.");
                }
                self.kill(id, &container.id, record).await;
            }
            (_, JobContainerState::Exited { .. }) => self.note_output_complete(id),
            _ => {}
        }
    }

    /// Records that the exited job's output is all in the log file once its follower is done.
    fn note_output_complete(&mut self, id: JobId) {
        let mut record = self.record(id);
        let done = self.followers.get(&id).is_some_and(logs::Follower::done);
        if done && !record.log_complete {
            record.log_complete = true;
            let _ = self.save(id, record);
            self.followers.remove(&id);
        }
    }

    /// Logs how much of a job's output the manager never got, when it stops listing the job
    /// before the agent sent it all (its `output_grace` passed); the files go with the job.
    fn warn_undelivered(&self, id: JobId, delivered: u64) {
        let Some(path) = self.log_path(id) else {
            return;
        };
        let Ok(kept) = std::fs::metadata(&path).map(|m| m.len()) else {
            return;
        };
        if kept > delivered {
            warn!(job = %id, delivered, undelivered = kept - delivered,
                  "The manager stopped listing a job before it had all its output (its [jobs] output_grace passed); the rest is dropped with the job.");
        }
    }

    /// Sends `SIGKILL` (every pass while the job runs), recording first that it was killed.
    async fn kill(&mut self, id: JobId, container_id: &str, mut record: JobRecord) {
        if !record.killed {
            record.killed = true;
            if self.save(id, record).is_err() {
                return;
            }
        }
        self.signal(id, container_id, "SIGKILL").await;
    }

    async fn signal(&mut self, id: JobId, container_id: &str, signal: &str) {
        if let Err(e) = self.runtime.signal(container_id, signal).await {
            warn!(job = %id, %signal, error = %error_chain(&e), "Cannot signal a job.");
        }
    }

    async fn start(&mut self, id: JobId, container_id: &str) {
        match self.runtime.start(container_id).await {
            Ok(()) => {
                info!(job = %id, "Job started.");
                self.problems.remove(&id);
                // Its output is copied from the start, so none waits for the next pass.
                self.follow(id, container_id);
            }
            Err(e) => {
                let problem = error_chain(&e);
                warn!(job = %id, error = %problem, "Cannot start a job's container.");
                self.problems.insert(id, problem);
            }
        }
    }

    /// Keeps a follower copying the output of the job's container (started) into the log file.
    fn follow(&mut self, id: JobId, container_id: &str) {
        if self.followers.get(&id).is_some_and(|f| !f.failed()) {
            return;
        }
        let Some(path) = self.log_path(id) else {
            return;
        };
        if let Some(dir) = path.parent() {
            if let Err(e) = std::fs::create_dir_all(dir) {
                warn!(job = %id, dir = %dir.display(), error = %e, "Cannot keep a job's output.");
                return;
            }
        }
        let follower =
            logs::Follower::spawn(&*self.runtime, container_id, path, self.output.clone());
        self.followers.insert(id, follower);
    }

    /// A job without a container: build its image if needed, then create and start it.
    async fn prepare(&mut self, job: &DesiredJob) {
        let id = job.job_id;
        if job.run != JobRun::Run || self.record(id).created {
            return; // Halted or killed before it started, or its container was removed.
        }
        let Some(config) = self.config.clone() else {
            return;
        };
        match self.runtime.image_exists(&job.image.docker_image).await {
            Ok(true) => {}
            Ok(false) => {
                let place = BuildPlace {
                    store: config.image_store.clone(),
                    work: self.local_dir().unwrap_or_else(|| config.dir.clone()),
                };
                self.builds
                    .ensure(self.runtime.clone(), place, &job.image, &self.tasks);
                return;
            }
            Err(e) => {
                self.problems.insert(id, error_chain(&e));
                return;
            }
        }
        if let Err(problem) = self.create_and_start(job, &config).await {
            warn!(job = %id, error = %problem, "Cannot start a job; retrying on the next sync.");
            self.problems.insert(id, problem);
        }
    }

    async fn create_and_start(
        &mut self,
        job: &DesiredJob,
        config: &JobsConfig,
    ) -> Result<(), String> {
        let id = job.job_id;
        // As for dev containers: no job starts while the node cannot isolate it.
        self.guard.firewall.ensure().await.map_err(|e| {
            format!(
                "the node's firewall rules cannot be applied: {}",
                error_chain(&e)
            )
        })?;
        let work_dir = config.dir.join(job.chain_id.to_string());
        chain_dir(&work_dir, job.user.uid)?;
        let network = job_network(&self.node, id, &self.guard);
        self.runtime
            .ensure_network(&network)
            .await
            .map_err(|e| error_chain(&e))?;
        let spec = self.spec(job, work_dir, network.name);
        let container_id = self
            .runtime
            .create_job(&spec)
            .await
            .map_err(|e| error_chain(&e))?;
        let mut record = self.record(id);
        record.created = true;
        self.save(id, record)?;
        info!(job = %id, container = %spec.name, "Job container created.");
        self.start(id, &container_id).await;
        Ok(())
    }

    /// The container of `job`.
    fn spec(&self, job: &DesiredJob, work_dir: PathBuf, network: String) -> JobContainerSpec {
        let (home, binds) = self.guard.storage.for_user(&job.user);
        let devices = visible_devices(&job.gpus);
        let mut env: Vec<(String, String)> = job
            .env
            .iter()
            .filter(|(key, _)| {
                !matches!(
                    key.as_str(),
                    "CUDA_VISIBLE_DEVICES" | "NVIDIA_VISIBLE_DEVICES"
                )
            })
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        env.push(("CUDA_VISIBLE_DEVICES".to_owned(), devices.clone()));
        env.push(("NVIDIA_VISIBLE_DEVICES".to_owned(), devices.clone()));
        JobContainerSpec {
            job_id: job.job_id,
            name: job.job_id.container_name(),
            image: job.image.docker_image.clone(),
            user: job.user.clone(),
            labels: [
                (LABEL_MANAGED, "true".to_owned()),
                (LABEL_NODE, self.node.to_string()),
                (LABEL_JOB, job.job_id.to_string()),
                (LABEL_USER, job.user.name.to_string()),
                (LABEL_OWNER, job.owner.to_string()),
                (LABEL_GPUS, devices),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect(),
            env,
            gpus: job.gpus.clone(),
            gpu_access: self.gpu_access,
            limits: self.guard.ceiling.cap(job.limits),
            command: job.command.argv().to_vec(),
            network,
            work_dir,
            mount_home: job.mount_home,
            home,
            binds,
        }
    }

    /// Removes the container of a job the manager no longer lists, and its network. Returns
    /// whether the container is gone.
    async fn remove(&mut self, container: &JobContainerStatus) -> bool {
        let id = container.job_id;
        self.followers.remove(&id);
        if let Err(e) = self.runtime.remove(&container.id).await {
            warn!(job = %id, error = %error_chain(&e), "Cannot remove a job's container; retrying on the next sync.");
            return false;
        }
        let network = job_network(&self.node, id, &self.guard);
        if let Err(e) = self.runtime.remove_network(&network.name).await {
            warn!(job = %id, error = %error_chain(&e), "Cannot remove a job's network.");
        }
        info!(job = %id, "Job container removed.");
        true
    }

    /// Removes the log and record files of jobs that are neither desired nor have a container.
    fn forget_files(&mut self, wanted: &HashSet<JobId>, present: &HashSet<JobId>) {
        self.records
            .retain(|id, _| wanted.contains(id) || present.contains(id));
        self.followers
            .retain(|id, _| wanted.contains(id) || present.contains(id));
        let Some(dir) = self.local_dir() else { return };
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let Some(id) = name
                .strip_suffix(".log")
                .or_else(|| name.strip_suffix(".json"))
                .and_then(|id| id.parse::<JobId>().ok())
            else {
                continue;
            };
            if !wanted.contains(&id) && !present.contains(&id) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }

    /// Where each desired job stands, with its output after the manager's offset. A job that
    /// exited is reported so only with the last of its output (see the module docs).
    pub async fn report(&mut self) -> Vec<ObservedJob> {
        let containers = match self.runtime.list_jobs().await {
            Ok(containers) => containers,
            Err(_) => return Vec::new(), // The sync loop stops on a Docker outage anyway.
        };
        let desired = self.desired.clone();
        self.finish_output(&desired, &containers).await;
        let mut report = Vec::with_capacity(desired.len());
        for job in &desired {
            let container = containers.iter().find(|c| c.job_id == job.job_id);
            let record = self.record(job.job_id);
            let status = self.status(job, container, &record);
            let ended = match &status {
                ObservedJobStatus::Exited { .. } => record.log_complete,
                ObservedJobStatus::Failed { .. } => true,
                _ => false,
            };
            let log = match (&status, self.log_path(job.job_id)) {
                (ObservedJobStatus::Preparing { .. }, _) | (_, None) => None,
                (_, Some(path)) => logs::chunk(&path, job.log_offset, ended),
            };
            if log
                .as_ref()
                .is_some_and(|l| l.data.len() >= ongrid_core::job::JOB_LOG_CHUNK_MAX)
            {
                // More than one chunk: the rest goes in the next report, soon.
                logs::bump(&self.output);
            }
            let sent = log.as_ref().map_or(0, |l| l.data.len() as u64);
            self.reported.insert(job.job_id, job.log_offset + sent);
            let status = self.exit_with_output(job.job_id, status, &record, log.as_ref());
            report.push(ObservedJob {
                job_id: job.job_id,
                status,
                log,
            });
        }
        report
    }

    /// Waits (at most [`EXIT_OUTPUT_WAIT`] in all) for the output of the desired jobs whose
    /// container exited and whose output is not all in, following it where nobody does (the
    /// agent restarted), and records those now complete.
    async fn finish_output(&mut self, desired: &[DesiredJob], containers: &[JobContainerStatus]) {
        let mut waiting = Vec::new();
        for job in desired {
            let Some(container) = containers.iter().find(|c| c.job_id == job.job_id) else {
                continue;
            };
            if matches!(container.state, JobContainerState::Exited { .. })
                && !self.record(job.job_id).log_complete
            {
                waiting.push((job.job_id, container.id.clone()));
            }
        }
        let deadline = tokio::time::Instant::now() + EXIT_OUTPUT_WAIT;
        // Twice: a follower started while the job ran may have failed (Docker's stream broke);
        // one started now reads the exited container's whole output.
        for _ in 0..2 {
            for (id, container_id) in &waiting {
                self.follow(*id, container_id);
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let waits = waiting
                .iter()
                .filter_map(|(id, _)| self.followers.get(id))
                .map(|follower| follower.wait_done(left));
            let done = futures::future::join_all(waits).await;
            if done.iter().all(|done| *done) || left.is_zero() {
                break;
            }
        }
        for (id, _) in waiting {
            self.note_output_complete(id);
        }
    }

    /// `status`, unless it is an exit whose report does not carry the end of the output: then
    /// the job is reported as still running (or halting), until [`EXIT_OUTPUT_LIMIT`] after
    /// the exit.
    fn exit_with_output(
        &mut self,
        id: JobId,
        status: ObservedJobStatus,
        record: &JobRecord,
        log: Option<&ongrid_core::job::LogChunk>,
    ) -> ObservedJobStatus {
        let ObservedJobStatus::Exited {
            started_at,
            finished_at,
            ..
        } = status
        else {
            return status;
        };
        if log.is_some_and(|l| l.complete) {
            self.output_overdue.remove(&id);
            return status;
        }
        let limit = chrono::Duration::from_std(EXIT_OUTPUT_LIMIT).unwrap_or_default();
        if (self.clock)() < finished_at + limit {
            return match record.signalled_at {
                Some(signalled_at) => ObservedJobStatus::Halting {
                    started_at,
                    signalled_at,
                },
                None => ObservedJobStatus::Running { started_at },
            };
        }
        if self.output_overdue.insert(id) {
            warn!(job = %id, "The job's output cannot all be read {} s after it exited; reporting its exit without the rest.", EXIT_OUTPUT_LIMIT.as_secs());
        }
        status
    }

    fn status(
        &self,
        job: &DesiredJob,
        container: Option<&JobContainerStatus>,
        record: &JobRecord,
    ) -> ObservedJobStatus {
        let id = job.job_id;
        let Some(container) = container else {
            return self.status_without_container(job, record);
        };
        match container.state {
            JobContainerState::Created => match job.run {
                JobRun::Run => ObservedJobStatus::Preparing {
                    detail: match self.problems.get(&id) {
                        Some(problem) => format!("starting the container: {problem}"),
                        None => "starting the container".to_owned(),
                    },
                },
                JobRun::Halt { .. } | JobRun::Kill => ObservedJobStatus::Failed {
                    error: "stopped before it started".to_owned(),
                },
            },
            JobContainerState::Running { started_at } => match record.signalled_at {
                Some(signalled_at) => ObservedJobStatus::Halting {
                    started_at,
                    signalled_at,
                },
                None => ObservedJobStatus::Running { started_at },
            },
            JobContainerState::Exited {
                started_at,
                finished_at,
                exit_code,
                oom_killed,
            } => ObservedJobStatus::Exited {
                started_at,
                finished_at,
                exit_code: i32::try_from(exit_code).unwrap_or(i32::MAX),
                oom_killed,
                killed: record.killed,
                signalled_at: record.signalled_at,
            },
        }
    }

    fn status_without_container(&self, job: &DesiredJob, record: &JobRecord) -> ObservedJobStatus {
        if record.created {
            return ObservedJobStatus::Failed {
                error: format!(
                    "the job's container {} was removed outside ongrid; how it ended is unknown",
                    job.job_id.container_name()
                ),
            };
        }
        if job.run != JobRun::Run {
            return ObservedJobStatus::Failed {
                error: "stopped before it started".to_owned(),
            };
        }
        if self.config.is_none() {
            return ObservedJobStatus::Failed {
                error: NO_IMAGE_STORE.to_owned(),
            };
        }
        match self.builds.get(&job.image.digest) {
            Some(BuildState::Failed { error }) => ObservedJobStatus::Failed { error },
            Some(BuildState::Building { detail }) => ObservedJobStatus::Preparing { detail },
            None => ObservedJobStatus::Preparing {
                detail: match self.problems.get(&job.job_id) {
                    Some(problem) => format!("creating the container: {problem}"),
                    None => "creating the container".to_owned(),
                },
            },
        }
    }
}

const NO_IMAGE_STORE: &str =
    "this node has no [images] store in its agent config, so it cannot run jobs: ask the admin";

/// The job's own network: made like a session's (a bridge named with this node's prefix, so
/// the node's firewall rules apply to it), labelled with the job.
fn job_network(node: &NodeName, job_id: JobId, guard: &NodeGuard) -> NetworkSpec {
    let mut spec = NetworkSpec::for_session(node, SessionId(job_id.0), guard.subnet_pool);
    spec.labels.insert(LABEL_JOB.to_owned(), job_id.to_string());
    spec
}

/// Creates the chain's working directory (if new) and gives it to the user (mode 0700).
fn chain_dir(dir: &Path, uid: u32) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    let problem = |e: std::io::Error| {
        format!(
            "preparing the job's working directory {}: {e}: check the agent's [images] jobs_dir",
            dir.display()
        )
    };
    std::fs::create_dir_all(dir).map_err(problem)?;
    std::os::unix::fs::chown(dir, Some(uid), Some(uid)).map_err(problem)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(problem)
}

#[cfg(test)]
mod tests;
