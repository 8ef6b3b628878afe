//! The freeze worker: runs the manager's freeze orders (`DesiredState::freezes`) and reports
//! their progress (`NodeReport::freezes`).
//!
//! One freeze, in order:
//! 1. Its work directory `<store>/.partial/<node>-<image id>/` is made. Everything the freeze
//!    writes goes there, so a failed or interrupted freeze is cleaned up by removing it.
//! 2. The session's container is committed (Docker pauses it for the commit only) into an
//!    untagged image whose entrypoint, command and working directory are the base image's (the
//!    dev container's keep-alive command and home directory are not wanted) and whose inherited
//!    `ongrid.*` labels are blanked, so that containers of the image are never mistaken for
//!    ongrid's own. Its id is written to the work directory. The commit is the consistent
//!    snapshot the export reads (exporting the running session would read files while they
//!    change); it is not the frozen image.
//! 3. A container of that image is created (never started, not labelled `ongrid.managed`), its
//!    `docker export` stream is bridged with `SyncIoBridge` into
//!    [`ongrid_images::freeze_with_copy`] in a blocking task, and the container is removed
//!    whatever happened. The filtered copy (what the SIF holds, minus `/.singularity.d`) goes
//!    through a bounded channel into `docker import` at the same time, as
//!    [`import_reference`], with the commit's configuration and labels and the SIF's environment.
//!    So the Docker image holds what the SIF holds: nothing of the strip list (`/tmp`, `/var/tmp`
//!    and the grid proxies there, host keys, histories).
//! 4. The SIF is moved from the work directory to `<store>/sha256/<hex>.sif` (an existing file of
//!    the same digest is kept: same content), the imported image is tagged
//!    `ongrid/<login>/<name>:<version>` (`--force` moves the tag, the old image keeps its id) and
//!    loses its working name, the commit is removed, and the result is written to `result.json`
//!    in the work directory, which is removed once the manager has recorded it (the order is
//!    gone).
//!
//! Failure removes the images of the freeze (the commit and the import both carry
//! [`LABEL_FROZEN_IMAGE`]) and the work directory, and reports one line a user can act on. The
//! session's container is only ever read: the commit is the one call that touches it.
//!
//! The worker is level-triggered like the reconciler: [`Freezer::apply`] takes the whole list of
//! orders each sync. An order it does not know whose work directory exists was started by an
//! agent that stopped before finishing: it is cleaned up and failed (or, with a `result.json`,
//! reported done). An order whose session is no longer in the desired state is cancelled.
//! At most `max_concurrent` freezes run at once, one per session.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use chrono::Utc;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use ongrid_core::api::DesiredSession;
use ongrid_core::image::{FreezeOrder, FreezeProgress, ImageReference};
use ongrid_core::{NodeName, SessionId};
use ongrid_images::{FreezeError, FreezeRequest, ImageConfig, Provenance};
use serde::{Deserialize, Serialize};
use tokio_util::io::{StreamReader, SyncIoBridge};
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

use crate::runtime::{
    error_chain, CommitSpec, ContainerRuntime, ImageDetails, ImportConfig, RuntimeError, LABEL_NODE,
};

/// Label of the throwaway container a freeze exports from: the image id it freezes.
pub const LABEL_FREEZE_EXPORT: &str = "ongrid.freeze.export";
/// Label of a frozen Docker image: the id of the image record (`ImageView::id`).
pub const LABEL_FROZEN_IMAGE: &str = "ongrid.frozen.image";

/// When an interrupted freeze's labelled images (commit, import) are looked for after an agent
/// restart: at once, then after 2 s and 5 s more, for one Docker was still finishing.
const INTERRUPTED_IMAGE_CHECKS: [std::time::Duration; 3] = [
    std::time::Duration::ZERO,
    std::time::Duration::from_secs(2),
    std::time::Duration::from_secs(5),
];

/// Variables of the dev container that belong to the session, not to the image: the GPUs it was
/// given and its user. Batch runners set their own.
pub const SESSION_ENV: [&str; 5] = [
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "HOME",
    "USER",
    "LOGNAME",
];

/// The reasons users see.
pub const NO_STORE: &str = "this node has no image store configured: ask the admin";
pub const AGENT_RESTARTED: &str =
    "the node agent restarted during the freeze: run devctl freeze again";
pub const SESSION_REMOVED: &str = "the session was removed during the freeze";
pub const ORDER_WITHDRAWN: &str = "the image was removed during the freeze";

/// The `[images]` table of the agent's config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImagesConfig {
    /// The image store: `<store>/sha256/<hex>.sif`, work under `<store>/.partial/`.
    pub store: PathBuf,
    /// Freezes running at once on this node.
    pub max_concurrent: usize,
}

/// What a finished freeze leaves in its work directory until the manager has recorded it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Outcome {
    digest: String,
    size: u64,
    sif_path: String,
    docker_image: String,
}

/// One order as the worker tracks it.
struct Job {
    order: FreezeOrder,
    progress: Arc<Mutex<FreezeProgress>>,
    cancel: Arc<AtomicBool>,
    /// Why it was cancelled, for the report.
    cancel_reason: Arc<Mutex<Option<String>>>,
    started: bool,
    finished: Arc<AtomicBool>,
}

impl Job {
    fn new(order: FreezeOrder, progress: FreezeProgress) -> Self {
        let finished = !matches!(progress, FreezeProgress::Running { .. });
        Self {
            order,
            progress: Arc::new(Mutex::new(progress)),
            cancel: Arc::new(AtomicBool::new(false)),
            cancel_reason: Arc::new(Mutex::new(None)),
            started: false,
            finished: Arc::new(AtomicBool::new(finished)),
        }
    }

    fn cancel(&self, reason: &str) {
        lock(&self.cancel_reason).get_or_insert_with(|| reason.to_owned());
        self.cancel.store(true, Ordering::SeqCst);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The node's freeze worker. Cheap to share; its tasks are tracked, so shutdown can wait for them.
pub struct Freezer {
    runtime: Arc<dyn ContainerRuntime>,
    node: NodeName,
    config: Option<ImagesConfig>,
    jobs: Mutex<HashMap<uuid::Uuid, Job>>,
    /// Whether the store's leftovers of a previous agent were looked at.
    swept: AtomicBool,
    tasks: TaskTracker,
}

impl Freezer {
    /// `config` is `None` when the node has no image store: every order then fails, saying so.
    pub fn new(
        runtime: Arc<dyn ContainerRuntime>,
        node: NodeName,
        config: Option<ImagesConfig>,
    ) -> Self {
        Self {
            runtime,
            node,
            config,
            jobs: Mutex::default(),
            swept: AtomicBool::new(false),
            tasks: TaskTracker::new(),
        }
    }

    /// Where the freezes of this node work: `<store>/.partial/<node>-<image id>`.
    pub fn work_dir(&self, image_id: uuid::Uuid) -> Option<PathBuf> {
        self.config.as_ref().map(|c| {
            c.store
                .join(ongrid_images::PARTIAL_DIR)
                .join(format!("{}-{image_id}", self.node))
        })
    }

    /// Where each order stands, for the next sync's report.
    pub fn report(&self) -> Vec<FreezeProgress> {
        let jobs = lock(&self.jobs);
        let mut report: Vec<FreezeProgress> = jobs
            .values()
            .map(|job| lock(&job.progress).clone())
            .collect();
        report.sort_by_key(FreezeProgress::image_id);
        report
    }

    /// Converges to the manager's `orders`, given the sessions it wants on the node: starts new
    /// orders (up to the limit), cancels those withdrawn or whose session is gone, forgets
    /// finished ones the manager no longer lists.
    pub fn apply(self: &Arc<Self>, orders: &[FreezeOrder], sessions: &[DesiredSession]) {
        let wanted: HashSet<uuid::Uuid> = orders.iter().map(|o| o.image_id).collect();
        let live_sessions: HashSet<SessionId> = sessions.iter().map(|s| s.session_id).collect();
        self.sweep_once(&wanted);
        let mut jobs = lock(&self.jobs);

        // Withdrawn orders: forget what ended (and its work directory) or never started; cancel
        // what runs and keep it until it has stopped, so that it still counts against the
        // limit and its session is not frozen twice at once.
        jobs.retain(|id, job| {
            if wanted.contains(id) {
                return true;
            }
            if job.finished.load(Ordering::SeqCst) {
                if let Some(dir) = self.work_dir(*id) {
                    remove_dir(&dir);
                }
                return false;
            }
            job.cancel(ORDER_WITHDRAWN);
            job.started
        });
        // Sessions gone: cancel their freezes.
        for job in jobs.values() {
            if !live_sessions.contains(&job.order.session_id)
                && !job.finished.load(Ordering::SeqCst)
            {
                job.cancel(SESSION_REMOVED);
            }
        }
        for order in orders {
            if jobs.contains_key(&order.image_id) {
                continue;
            }
            let job = self.admit(order, &live_sessions);
            jobs.insert(order.image_id, job);
        }
        self.start_queued(&mut jobs);
    }

    /// A new order: failed at once, reported from a previous agent's work, or queued.
    fn admit(&self, order: &FreezeOrder, live_sessions: &HashSet<SessionId>) -> Job {
        let failed = |reason: &str| {
            Job::new(
                order.clone(),
                FreezeProgress::Failed {
                    image_id: order.image_id,
                    reason: reason.to_owned(),
                },
            )
        };
        let Some(dir) = self.work_dir(order.image_id) else {
            return failed(NO_STORE);
        };
        if dir.exists() {
            // A previous agent took this order.
            if let Some(outcome) = read_outcome(&dir) {
                info!(image_id = %order.image_id, "Reporting a freeze finished before the agent restarted.");
                return Job::new(
                    order.clone(),
                    FreezeProgress::Done {
                        image_id: order.image_id,
                        digest: outcome.digest,
                        size: outcome.size,
                        sif_path: outcome.sif_path,
                        docker_image: outcome.docker_image,
                    },
                );
            }
            warn!(image_id = %order.image_id, dir = %dir.display(), "A freeze was interrupted by an agent restart; cleaning up.");
            let runtime = self.runtime.clone();
            let image_id = read_image_id(&dir);
            let export_name = export_container_name(order.image_id);
            remove_dir(&dir);
            let frozen_image = order.image_id;
            self.tasks.spawn(async move {
                let _ = runtime.remove(&export_name).await;
                if let Some(image_id) = image_id {
                    if let Err(e) = runtime.remove_image_id(&image_id).await {
                        warn!(error = %error_chain(&e), "Could not remove the image of an interrupted freeze.");
                    }
                }
                // Docker finishes a commit (or an import) that was under way when the agent
                // died, maybe only after this restart: the freeze's label finds it whether or
                // not its id was written down. Looked for now and twice more (bounded, so shutdown never waits
                // long).
                for wait in INTERRUPTED_IMAGE_CHECKS {
                    tokio::time::sleep(wait).await;
                    remove_images_of(runtime.as_ref(), frozen_image).await;
                }
            });
            return failed(AGENT_RESTARTED);
        }
        if !live_sessions.contains(&order.session_id) {
            return failed(SESSION_REMOVED);
        }
        Job::new(
            order.clone(),
            FreezeProgress::Running {
                image_id: order.image_id,
                bytes_done: 0,
                bytes_total: 0,
            },
        )
    }

    /// Starts queued jobs while fewer than `max_concurrent` run, one per session.
    fn start_queued(self: &Arc<Self>, jobs: &mut HashMap<uuid::Uuid, Job>) {
        let Some(config) = &self.config else { return };
        let running: Vec<SessionId> = jobs
            .values()
            .filter(|j| j.started && !j.finished.load(Ordering::SeqCst))
            .map(|j| j.order.session_id)
            .collect();
        let mut busy: HashSet<SessionId> = running.iter().copied().collect();
        let mut slots = config.max_concurrent.saturating_sub(running.len());
        let mut queued: Vec<&mut Job> = jobs
            .values_mut()
            .filter(|j| !j.started && !j.finished.load(Ordering::SeqCst))
            .collect();
        queued.sort_by_key(|j| (j.order.requested_at, j.order.image_id));
        for job in queued {
            if slots == 0 {
                break;
            }
            if !busy.insert(job.order.session_id) {
                continue;
            }
            slots -= 1;
            job.started = true;
            let run = FreezeRun {
                freezer: self.clone(),
                order: job.order.clone(),
                progress: job.progress.clone(),
                cancel: job.cancel.clone(),
                cancel_reason: job.cancel_reason.clone(),
                finished: job.finished.clone(),
            };
            self.tasks.spawn(run.run());
        }
    }

    /// Once, at the first orders: removes work directories of this node that belong to no
    /// order (a previous agent's, whose orders the manager has dropped meanwhile).
    fn sweep_once(&self, wanted: &HashSet<uuid::Uuid>) {
        if self.swept.swap(true, Ordering::SeqCst) {
            return;
        }
        let Some(config) = &self.config else { return };
        let partial = config.store.join(ongrid_images::PARTIAL_DIR);
        let Ok(entries) = std::fs::read_dir(&partial) else {
            return;
        };
        let prefix = format!("{}-", self.node);
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(id) = name
                .strip_prefix(&prefix)
                .and_then(|rest| rest.parse::<uuid::Uuid>().ok())
            else {
                continue;
            };
            if !wanted.contains(&id) {
                info!(dir = %entry.path().display(), "Removing the work of a freeze no longer ordered.");
                remove_dir(&entry.path());
            }
        }
    }

    /// Waits for the running freezes' tasks (tests, shutdown).
    pub async fn wait_idle(&self) {
        loop {
            let busy = lock(&self.jobs)
                .values()
                .any(|j| j.started && !j.finished.load(Ordering::SeqCst));
            if !busy {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }

    /// Cancels every running freeze, as on shutdown: each is failed with `reason` and cleaned
    /// up by its task.
    pub fn cancel_all(&self, reason: &str) {
        for job in lock(&self.jobs).values() {
            job.cancel(reason);
        }
    }

    /// Stops tracking new tasks and waits for those running.
    pub async fn close(&self) {
        self.tasks.close();
        self.tasks.wait().await;
    }
}

/// `ongrid-freeze-<image id>`: the throwaway container a freeze exports from.
pub fn export_container_name(image_id: uuid::Uuid) -> String {
    format!("ongrid-freeze-{}", image_id.simple())
}

/// The environment of the frozen image: the committed container's, without the session's own
/// variables ([`SESSION_ENV`]).
pub fn image_env(env: &[String]) -> Vec<String> {
    env.iter()
        .filter(|var| {
            let name = var.split_once('=').map_or(var.as_str(), |(name, _)| name);
            !SESSION_ENV.contains(&name)
        })
        .cloned()
        .collect()
}

/// The frozen image's entrypoint, command and working directory: the base image's (when Docker
/// still has it), since the dev container runs a keep-alive command in the user's home. An
/// image with neither entrypoint nor command gets `/bin/bash`, as Docker needs one to run it.
pub fn commit_spec(
    base: Option<&crate::runtime::ImageDetails>,
    container_labels: &BTreeMap<String, String>,
    comment: String,
) -> CommitSpec {
    let (entrypoint, mut cmd, working_dir) = match base {
        Some(base) => (
            base.entrypoint.clone(),
            base.cmd.clone(),
            base.working_dir.clone().unwrap_or_else(|| "/".to_owned()),
        ),
        None => (Vec::new(), Vec::new(), "/".to_owned()),
    };
    if entrypoint.is_empty() && cmd.is_empty() {
        cmd = vec!["/bin/bash".to_owned()];
    }
    // Docker copies the container's labels into the image; blank ongrid's, so that containers
    // of the frozen image never look like a node's dev containers.
    let labels = container_labels
        .keys()
        .filter(|key| key.starts_with("ongrid."))
        .map(|key| (key.clone(), String::new()))
        .collect();
    CommitSpec {
        entrypoint,
        cmd,
        working_dir,
        labels,
        comment,
    }
}

/// One running freeze.
struct FreezeRun {
    freezer: Arc<Freezer>,
    order: FreezeOrder,
    progress: Arc<Mutex<FreezeProgress>>,
    cancel: Arc<AtomicBool>,
    cancel_reason: Arc<Mutex<Option<String>>>,
    finished: Arc<AtomicBool>,
}

/// Why a freeze failed, before it is put in words for the user.
#[derive(Debug, thiserror::Error)]
enum FreezeFailure {
    #[error("the session's container is not on node {node} any more: start a new session")]
    NoContainer { node: NodeName },
    #[error("Docker failed while {step}: {}: try again, or ask the admin", error_chain(.source))]
    Docker {
        step: &'static str,
        #[source]
        source: RuntimeError,
    },
    #[error("{0}")]
    Image(String),
    #[error("image store {}: {source}: check that it exists and the agent may write it", path.display())]
    Store {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("image store {} is full: free space or ask the admin", store.display())]
    StoreFull { store: PathBuf },
    #[error("freeze cancelled")]
    Cancelled,
    #[error("image reference {0:?} is not valid: freeze again with a NAME:VERSION tag")]
    BadReference(String),
}

impl FreezeRun {
    async fn run(self) {
        let image_id = self.order.image_id;
        let (dir, store) = match (
            self.freezer.work_dir(image_id),
            self.freezer.config.as_ref().map(|c| c.store.clone()),
        ) {
            (Some(dir), Some(store)) => (dir, store),
            _ => {
                self.finish(Err(FreezeFailure::Image(NO_STORE.to_owned())));
                return;
            }
        };
        info!(%image_id, session = %self.order.session_name, reference = %self.order.reference, "Freeze started.");
        let mut committed = None;
        let started = std::time::Instant::now();
        let result = self.freeze(&store, &dir, &mut committed).await;
        let size = result.as_ref().ok().map(|outcome| outcome.size);
        crate::metrics::events().freeze_ended(started.elapsed(), size);
        if result.is_err() {
            let runtime = self.freezer.runtime.as_ref();
            if let Some(image) = &committed {
                if let Err(e) = runtime.remove_image_id(image).await {
                    warn!(%image_id, error = %error_chain(&e), "Could not remove the image of a failed freeze.");
                }
            }
            // The import (and the commit, had its id not been kept) carry the freeze's label.
            remove_images_of(runtime, image_id).await;
            remove_dir(&dir);
            // Stopped with the agent: an empty work directory tells the next agent to report
            // the freeze failed rather than start it again.
            if lock(&self.cancel_reason).as_deref() == Some(AGENT_RESTARTED) {
                let _ = std::fs::create_dir_all(&dir);
            }
        }
        self.finish(result);
    }

    /// Records the end; a cancelled freeze reports why it was cancelled.
    fn finish(&self, result: Result<Outcome, FreezeFailure>) {
        let image_id = self.order.image_id;
        let cancelled = self.cancel.load(Ordering::SeqCst);
        let progress = match result {
            Ok(outcome) if !cancelled => {
                info!(%image_id, digest = %outcome.digest, size = outcome.size, docker_image = %outcome.docker_image, "Freeze done.");
                FreezeProgress::Done {
                    image_id,
                    digest: outcome.digest,
                    size: outcome.size,
                    sif_path: outcome.sif_path,
                    docker_image: outcome.docker_image,
                }
            }
            other => {
                let reason = match (lock(&self.cancel_reason).clone(), other) {
                    (Some(reason), _) => reason,
                    (None, Err(e)) => e.to_string(),
                    (None, Ok(_)) => "freeze cancelled".to_owned(),
                };
                info!(%image_id, %reason, "Freeze failed.");
                FreezeProgress::Failed { image_id, reason }
            }
        };
        *lock(&self.progress) = progress;
        self.finished.store(true, Ordering::SeqCst);
    }

    fn check_cancel(&self) -> Result<(), FreezeFailure> {
        if self.cancel.load(Ordering::SeqCst) {
            Err(FreezeFailure::Cancelled)
        } else {
            Ok(())
        }
    }

    async fn freeze(
        &self,
        store: &Path,
        dir: &Path,
        committed: &mut Option<String>,
    ) -> Result<Outcome, FreezeFailure> {
        let runtime = self.freezer.runtime.clone();
        let order = &self.order;
        let reference = ImageReference::parse(&order.reference)
            .map_err(|_| FreezeFailure::BadReference(order.reference.clone()))?;
        std::fs::create_dir_all(dir).map_err(|e| store_failure(store, dir, e))?;

        let container = runtime
            .session_container(order.session_id)
            .await
            .map_err(docker("looking for the session's container"))?
            .ok_or_else(|| FreezeFailure::NoContainer {
                node: self.freezer.node.clone(),
            })?;
        self.check_cancel()?;
        let image_id = self.commit(&container.id, store, dir, committed).await?;
        self.check_cancel()?;
        let details = runtime
            .image_details(&image_id)
            .await
            .map_err(docker("reading the committed image"))?
            .ok_or_else(|| FreezeFailure::Docker {
                step: "reading the committed image",
                source: RuntimeError::Setup {
                    action: format!("inspecting image {image_id}"),
                    problem: "it vanished".to_owned(),
                },
            })?;
        *lock(&self.progress) = FreezeProgress::Running {
            image_id: order.image_id,
            bytes_done: 0,
            bytes_total: details.size,
        };
        let frozen = self.export(&image_id, &details, dir, store).await?;
        self.check_cancel()?;

        // Publish: <dir>/sha256/<hex>.sif → <store>/sha256/<hex>.sif.
        let hex = frozen.digest.trim_start_matches("sha256:").to_owned();
        let target = ongrid_images::sif_path(store, &hex);
        publish(&frozen.sif_path, &target).map_err(|e| store_failure(store, &target, e))?;
        let repository = format!("ongrid/{}/{}", container.login, reference.name());
        self.publish_docker_image(&repository, reference.version())
            .await?;
        // The commit was only the snapshot to export from.
        if let Err(e) = runtime.remove_image_id(&image_id).await {
            warn!(image_id = %order.image_id, error = %error_chain(&e), "Could not remove the commit of a freeze.");
        }
        let outcome = Outcome {
            digest: frozen.digest,
            size: frozen.size,
            sif_path: target.display().to_string(),
            docker_image: format!("{repository}:{}", reference.version()),
        };
        let json = serde_json::to_vec(&outcome).map_err(|e| FreezeFailure::Image(e.to_string()))?;
        std::fs::write(dir.join("result.json"), json).map_err(|e| store_failure(store, dir, e))?;
        Ok(outcome)
    }

    /// Commits the session's container (Docker pauses it for the commit only) into an untagged
    /// image labelled with this freeze, and writes its id to the work directory. The commit is
    /// the snapshot the export reads: exporting the session's own container would read files
    /// while they change, and pausing the session for a whole export could take minutes.
    async fn commit(
        &self,
        container_id: &str,
        store: &Path,
        dir: &Path,
        committed: &mut Option<String>,
    ) -> Result<String, FreezeFailure> {
        let runtime = &self.freezer.runtime;
        let order = &self.order;
        let base = runtime
            .image_details(&order.base_image)
            .await
            .map_err(docker("reading the base image"))?;
        let inherited = base.as_ref().map(|b| b.labels.clone()).unwrap_or_default();
        let mut spec = commit_spec(
            base.as_ref(),
            &managed_labels(&inherited),
            format!(
                "ongrid freeze of session {} as {}",
                order.session_name, order.reference
            ),
        );
        spec.labels
            .insert(LABEL_FROZEN_IMAGE.to_owned(), order.image_id.to_string());
        let image_id = runtime
            .freeze_commit(container_id, &spec)
            .await
            .map_err(docker("committing the session's container"))?;
        *committed = Some(image_id.clone());
        std::fs::write(dir.join("image-id"), &image_id)
            .map_err(|e| store_failure(store, dir, e))?;
        Ok(image_id)
    }

    /// Exports the commit `image_id` from a throwaway container of it, removed whatever
    /// happened: [`FreezeRun::export_freeze_and_import`].
    async fn export(
        &self,
        image_id: &str,
        committed: &ImageDetails,
        dir: &Path,
        store: &Path,
    ) -> Result<ongrid_images::Frozen, FreezeFailure> {
        let runtime = &self.freezer.runtime;
        let export_name = export_container_name(self.order.image_id);
        let labels = BTreeMap::from([
            (LABEL_NODE.to_owned(), self.freezer.node.to_string()),
            (LABEL_FREEZE_EXPORT.to_owned(), image_id.to_owned()),
        ]);
        let export_id = runtime
            .create_export_container(image_id, &export_name, &labels)
            .await
            .map_err(docker("creating the container to export"))?;
        let frozen = self
            .export_freeze_and_import(&export_id, committed, dir, store)
            .await;
        if let Err(e) = runtime.remove(&export_id).await {
            warn!(container = %export_name, error = %error_chain(&e), "Could not remove the export container.");
        }
        frozen
    }

    /// Streams the export container's filesystem through [`ongrid_images::freeze_with_copy`]
    /// (in a blocking task) into the SIF, and its filtered copy into `docker import` as
    /// [`import_reference`], both at once. The copy goes through a bounded channel, so the
    /// freeze waits while Docker is behind and never holds more than a few MiB of it.
    async fn export_freeze_and_import(
        &self,
        export_id: &str,
        committed: &ImageDetails,
        dir: &Path,
        store: &Path,
    ) -> Result<ongrid_images::Frozen, FreezeFailure> {
        let order = &self.order;
        let config = ImageConfig {
            env: image_env(&committed.env),
            working_dir: committed.working_dir.clone(),
            entrypoint: committed.entrypoint.clone(),
            cmd: committed.cmd.clone(),
            user: committed.user.clone(),
        };
        // The commit's configuration and labels (the base image's, ongrid's blanked, this
        // freeze's), with the environment the SIF records.
        let import = ImportConfig {
            labels: committed.labels.clone(),
            ..ImportConfig::from(config.clone())
        };
        let provenance = Provenance {
            owner: order.owner.to_string(),
            session: order.session_name.to_string(),
            base_image: order.base_image.clone(),
            reference: order.reference.clone(),
            created_at: Utc::now(),
        };
        let (copy, tar) = copy_channel();
        let import_reference = import_reference(order.image_id);
        let imported = self
            .freezer
            .runtime
            .import_image(&import_reference, &import, tar);
        let frozen = self.freeze_blocking(export_id, copy, config, provenance, committed.size, dir);
        let (frozen, imported) = tokio::join!(frozen, imported);
        let frozen = frozen.map_err(|e| {
            FreezeFailure::Image(format!(
                "the freeze task failed: {e}: report this to the admin"
            ))
        })?;
        match (frozen, imported) {
            (Ok(frozen), Ok(())) => Ok(frozen),
            // The import stopped first: its error says why the copy could not be written.
            (Ok(_) | Err(FreezeError::Copy { .. }), Err(source)) => Err(FreezeFailure::Docker {
                step: "importing the frozen filesystem as a Docker image",
                source,
            }),
            (Err(FreezeError::StoreFull { .. }), _) => Err(FreezeFailure::StoreFull {
                store: store.to_owned(),
            }),
            (Err(FreezeError::Cancelled), _) => Err(FreezeFailure::Cancelled),
            (Err(e), _) => Err(FreezeFailure::Image(error_chain(&e))),
        }
    }

    /// Runs [`ongrid_images::freeze_with_copy`] on the export of `export_id` in a blocking task,
    /// reporting progress; on failure the copy ends with an error, so that Docker never takes a
    /// cut-short stream for a whole filesystem.
    fn freeze_blocking(
        &self,
        export_id: &str,
        copy: CopySender,
        config: ImageConfig,
        provenance: Provenance,
        estimated_size: u64,
        dir: &Path,
    ) -> tokio::task::JoinHandle<Result<ongrid_images::Frozen, FreezeError>> {
        let stream = self
            .freezer
            .runtime
            .export_container(export_id)
            .map_ok(io::Cursor::new)
            .map_err(|e| io::Error::other(error_chain(&e)));
        let mut reader = SyncIoBridge::new(StreamReader::new(stream));
        let dir = dir.to_owned();
        let progress = self.progress.clone();
        let cancel = self.cancel.clone();
        let compression = self.order.compression;
        let image_id = self.order.image_id;
        tokio::task::spawn_blocking(move || {
            let mut report = |bytes_done: u64| {
                let mut progress = lock(&progress);
                if let FreezeProgress::Running {
                    bytes_done: done, ..
                } = &mut *progress
                {
                    *done = bytes_done;
                } else {
                    *progress = FreezeProgress::Running {
                        image_id,
                        bytes_done,
                        bytes_total: estimated_size,
                    };
                }
            };
            let mut copy = io::BufWriter::with_capacity(COPY_CHUNK, copy);
            let frozen = ongrid_images::freeze_with_copy(
                FreezeRequest {
                    export: &mut reader,
                    config,
                    provenance,
                    compression,
                    store: &dir,
                    estimated_size,
                    progress: &mut report,
                    cancel: &cancel,
                },
                Some(&mut copy),
            );
            if let (Err(e), Ok(copy)) = (&frozen, copy.into_inner()) {
                copy.abort(&error_chain(e));
            }
            frozen
        })
    }

    /// Tags the imported image as `repository:tag` (moving the tag from an older image) and
    /// drops its working name.
    async fn publish_docker_image(&self, repository: &str, tag: &str) -> Result<(), FreezeFailure> {
        let runtime = &self.freezer.runtime;
        let imported = import_reference(self.order.image_id);
        runtime
            .tag_image(&imported, repository, tag)
            .await
            .map_err(docker("tagging the Docker image"))?;
        runtime
            .untag_image(&imported)
            .await
            .map_err(docker("removing the import's working name"))
    }
}

/// How a Docker error of one freeze step reads.
fn docker(step: &'static str) -> impl Fn(RuntimeError) -> FreezeFailure {
    move |source| FreezeFailure::Docker { step, source }
}

/// Bytes of one chunk of the filtered copy on its way to `docker import`.
const COPY_CHUNK: usize = 1024 * 1024;
/// Chunks of the copy waiting for Docker at most: with [`COPY_CHUNK`], a few MiB whatever the
/// image's size.
const COPY_CHUNKS_IN_FLIGHT: usize = 4;

/// `ongrid-freeze/<image id>:import`: the working name of a freeze's imported Docker image,
/// until it gets its real tag.
pub fn import_reference(image_id: uuid::Uuid) -> String {
    format!("ongrid-freeze/{}:import", image_id.simple())
}

/// A bounded pipe from the blocking freeze to the async `docker import`: the writing end, which
/// blocks while [`COPY_CHUNKS_IN_FLIGHT`] chunks wait, and the stream Docker reads.
fn copy_channel() -> (CopySender, BoxStream<'static, io::Result<Vec<u8>>>) {
    let (sender, receiver) = tokio::sync::mpsc::channel(COPY_CHUNKS_IN_FLIGHT);
    let stream = futures::stream::unfold(receiver, |mut receiver| async move {
        receiver.recv().await.map(|chunk| (chunk, receiver))
    });
    (CopySender(sender), stream.boxed())
}

/// The writing end of [`copy_channel`]; used from a blocking task only.
struct CopySender(tokio::sync::mpsc::Sender<io::Result<Vec<u8>>>);

impl CopySender {
    /// Ends the stream with an error instead of its end.
    fn abort(self, why: &str) {
        let _ = self.0.blocking_send(Err(io::Error::other(why.to_owned())));
    }
}

impl io::Write for CopySender {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        self.0.blocking_send(Ok(buf.to_vec())).map_err(|_| {
            io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the Docker image import stopped reading",
            )
        })?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Removes every image labelled with the freeze `image_id` (its commit and its import), with
/// their tags; failures are logged.
async fn remove_images_of(runtime: &dyn ContainerRuntime, image_id: uuid::Uuid) {
    let labelled = match runtime
        .images_labelled(LABEL_FROZEN_IMAGE, &image_id.to_string())
        .await
    {
        Ok(labelled) => labelled,
        Err(e) => {
            warn!(%image_id, error = %error_chain(&e), "Could not list the images of a freeze.");
            return;
        }
    };
    for docker_image in labelled {
        if let Err(e) = runtime.remove_image_id(&docker_image).await {
            warn!(%image_id, error = %error_chain(&e), "Could not remove an image of a freeze.");
        }
    }
}

/// The `ongrid.*` labels the committed image gets from the session's container: those of its
/// base image and those the agent puts on every dev container.
fn managed_labels(labels: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    let mut labels: BTreeMap<String, String> = labels
        .iter()
        .filter(|(k, _)| k.starts_with("ongrid."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    // Whatever the inspection found, these are always on a dev container.
    for key in [
        crate::runtime::LABEL_MANAGED,
        crate::runtime::LABEL_NODE,
        crate::runtime::LABEL_SESSION,
        crate::runtime::LABEL_SESSION_NAME,
        crate::runtime::LABEL_USER,
        crate::runtime::LABEL_OWNER,
        crate::runtime::LABEL_GPUS,
    ] {
        labels.entry(key.to_owned()).or_default();
    }
    labels
}

fn store_failure(store: &Path, path: &Path, error: io::Error) -> FreezeFailure {
    if matches!(error.raw_os_error(), Some(code) if code == nix::errno::Errno::ENOSPC as i32 || code == nix::errno::Errno::EDQUOT as i32)
    {
        FreezeFailure::StoreFull {
            store: store.to_owned(),
        }
    } else {
        FreezeFailure::Store {
            path: path.to_owned(),
            source: error,
        }
    }
}

/// Moves the finished SIF to its content address without replacing an existing file (same
/// digest, same content).
fn publish(from: &Path, to: &Path) -> io::Result<()> {
    if let Some(parent) = to.parent() {
        std::fs::create_dir_all(parent)?;
    }
    match std::fs::hard_link(from, to) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    std::fs::remove_file(from)?;
    if let Some(parent) = to.parent() {
        std::fs::File::open(parent)?.sync_all()?;
    }
    Ok(())
}

fn read_outcome(dir: &Path) -> Option<Outcome> {
    let text = std::fs::read(dir.join("result.json")).ok()?;
    serde_json::from_slice(&text).ok()
}

fn read_image_id(dir: &Path) -> Option<String> {
    std::fs::read_to_string(dir.join("image-id"))
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
}

fn remove_dir(dir: &Path) {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => {
            warn!(dir = %dir.display(), error = %e, "Could not remove a freeze's work directory.")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::ImageDetails;

    #[test]
    fn session_variables_are_left_out_of_the_image() {
        let env = [
            "PATH=/usr/bin:/bin",
            "CUDA_VISIBLE_DEVICES=GPU-1",
            "NVIDIA_VISIBLE_DEVICES=GPU-1",
            "HOME=/home/alice",
            "USER=alice",
            "LOGNAME=alice",
            "LANG=C.UTF-8",
            "HOMEPAGE=x",
        ]
        .map(String::from);
        assert_eq!(
            image_env(&env),
            ["PATH=/usr/bin:/bin", "LANG=C.UTF-8", "HOMEPAGE=x"].map(String::from)
        );
    }

    #[test]
    fn commit_takes_the_base_image_command_and_blanks_ongrid_labels() {
        let labels = BTreeMap::from([
            ("ongrid.managed".to_owned(), "true".to_owned()),
            ("ongrid.node".to_owned(), "node1".to_owned()),
            ("site.project".to_owned(), "atlas".to_owned()),
        ]);
        let base = ImageDetails {
            entrypoint: vec!["/entry".into()],
            cmd: vec!["python".into()],
            working_dir: Some("/work".into()),
            ..Default::default()
        };
        let spec = commit_spec(Some(&base), &labels, "c".into());
        assert_eq!(spec.entrypoint, ["/entry"]);
        assert_eq!(spec.cmd, ["python"]);
        assert_eq!(spec.working_dir, "/work");
        assert_eq!(
            spec.labels,
            BTreeMap::from([
                ("ongrid.managed".to_owned(), String::new()),
                ("ongrid.node".to_owned(), String::new()),
            ])
        );
        // A base image without a command (docker import) or gone: bash in /.
        let bare = commit_spec(Some(&ImageDetails::default()), &labels, "c".into());
        assert_eq!(
            (bare.cmd, bare.working_dir),
            (vec!["/bin/bash".to_owned()], "/".to_owned())
        );
        let gone = commit_spec(None, &BTreeMap::new(), "c".into());
        assert_eq!(gone.cmd, ["/bin/bash"]);
        assert!(gone.labels.is_empty());
    }

    #[test]
    fn managed_labels_always_cover_the_dev_container_labels() {
        let labels = managed_labels(&BTreeMap::from([("site.x".to_owned(), "y".to_owned())]));
        assert!(labels.contains_key("ongrid.managed"));
        assert!(labels.contains_key("ongrid.session"));
        assert!(!labels.contains_key("site.x"));
    }

    #[tokio::test]
    async fn a_withdrawn_freeze_holds_its_session_until_it_has_stopped() {
        let runtime = Arc::new(crate::runtime::fake::FakeRuntime::new());
        let store = tempfile::tempdir().unwrap();
        let config = ImagesConfig {
            store: store.path().to_owned(),
            max_concurrent: 2,
        };
        let node = NodeName::parse("node1").unwrap();
        let freezer = Arc::new(Freezer::new(runtime, node, Some(config)));
        let session = crate::runtime::fake::desired_session(&[]);
        let order = |reference: &str| FreezeOrder {
            image_id: uuid::Uuid::new_v4(),
            session_id: session.session_id,
            session_name: session.name.clone(),
            owner: session.owner.clone(),
            reference: reference.to_owned(),
            base_image: session.image.clone(),
            compression: Default::default(),
            requested_at: Utc::now(),
        };
        let (first, second) = (order("m:1"), order("m:2"));
        let sessions = std::slice::from_ref(&session);
        let started = |id| lock(&freezer.jobs).get(&id).is_some_and(|j| j.started);
        // The first is withdrawn (image removed) while its task has not even run, and the
        // user freezes the session again at once.
        freezer.apply(std::slice::from_ref(&first), sessions);
        freezer.apply(&[], sessions);
        freezer.apply(std::slice::from_ref(&second), sessions);
        assert!(started(first.image_id), "still stopping");
        assert!(
            !started(second.image_id),
            "one freeze per session at a time"
        );
        freezer.wait_idle().await;
        freezer.apply(std::slice::from_ref(&second), sessions);
        assert!(started(second.image_id));
        assert!(!lock(&freezer.jobs).contains_key(&first.image_id));
        // A withdrawn order that never started is forgotten at once.
        let queued = order("m:3");
        freezer.apply(&[second.clone(), queued.clone()], sessions);
        assert!(!started(queued.image_id));
        freezer.apply(std::slice::from_ref(&second), sessions);
        assert!(!lock(&freezer.jobs).contains_key(&queued.image_id));
        freezer.close().await;
    }

    #[test]
    fn publish_keeps_an_existing_file_of_the_same_digest() {
        let dir = tempfile::tempdir().unwrap();
        let from = dir.path().join("a.sif");
        let to = dir.path().join("sha256").join("x.sif");
        std::fs::write(&from, "new").unwrap();
        publish(&from, &to).unwrap();
        assert_eq!(std::fs::read_to_string(&to).unwrap(), "new");
        assert!(!from.exists());
        std::fs::write(&from, "again").unwrap();
        publish(&from, &to).unwrap();
        assert_eq!(std::fs::read_to_string(&to).unwrap(), "new");
        assert!(!from.exists());
    }
}
