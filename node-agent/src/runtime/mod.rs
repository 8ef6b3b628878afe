//! Dev containers behind one trait, [`ContainerRuntime`]: Docker through bollard in
//! [`docker`] (the only file of the project that imports bollard) and an in-memory fake for
//! unit tests.
//!
//! What a dev container must be is decided here, independently of Docker: [`ContainerSpec`]
//! turns a session of the manager's desired state into labels, environment, user, home volume,
//! GPU access and limits. The runtime only carries the spec out.
//!
//! The SSH gateway's streams ([`crate::streams`]) use the same trait to find a session's
//! container ([`SessionContainer`]) and to run processes in it ([`ExecSpec`], [`ExecProcess`]):
//! through runc beside dockerd ([`direct`]), else `docker exec`. [`cgroup_cpu`] reads a running
//! container's CPU counter from its cgroup on the host, for activity sampling. [`inject`] puts
//! ongrid's own tools into containers (under `/run/ongrid`) with the archive methods: the
//! node's sftp-server for images without one.

pub mod accounts;
pub mod cgroup_cpu;
pub mod direct;
pub mod docker;
#[cfg(test)]
pub mod fake;
pub mod inject;
pub mod site_dirs;

use std::collections::BTreeMap;
use std::pin::Pin;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::StreamExt;
use ongrid_core::api::{
    visible_devices, ContainerLimits, ContainerState, ContainerUser, DesiredSession,
};
use ongrid_core::{GpuId, NodeName, SessionId};

pub use crate::labels::{
    LABEL_GPUS, LABEL_HELPER, LABEL_JOB, LABEL_MANAGED, LABEL_NODE, LABEL_OWNER, LABEL_SESSION,
    LABEL_SESSION_NAME, LABEL_USER,
};

/// The node-local image a held dev container is committed to when its session comes back on
/// other GPUs: the new container is created from it, so the user's files survive. It is
/// removed with the container.
pub fn held_image(session_id: SessionId) -> String {
    format!("ongrid-held/{session_id}:latest")
}

/// The only command a dev container runs: it keeps the container alive while users come and go
/// through `docker exec`. The image's own CMD is not wanted.
pub const KEEPALIVE_COMMAND: [&str; 2] = ["sleep", "infinity"];

/// How a dev container reaches its GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuAccess {
    /// Only `CUDA_VISIBLE_DEVICES`/`NVIDIA_VISIBLE_DEVICES` (simulated GPUs: no driver to ask).
    EnvironmentOnly,
    /// Also Docker's device request for the `nvidia` driver, with the assigned UUIDs.
    NvidiaDeviceRequest,
}

/// Everything that defines one session's dev container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerSpec {
    pub session_id: SessionId,
    /// `ongrid-<session id>`.
    pub name: String,
    pub image: String,
    /// The session's name, so the shell prompt says where the user is.
    pub hostname: String,
    pub user: ContainerUser,
    /// `/home/<login>`, where the home is mounted.
    pub home_dir: String,
    /// What is mounted at `home_dir`: by default the volume `ongrid-home-<login>`, persistent
    /// and shared by all of the user's sessions on the node; with `[storage] home`, a directory
    /// on site storage (`crate::storage`).
    pub home: Home,
    /// The site's storage (`[storage]`), bind-mounted under `home`.
    pub binds: Vec<BindMount>,
    pub labels: BTreeMap<String, String>,
    pub env: Vec<(String, String)>,
    pub gpus: Vec<GpuId>,
    pub gpu_access: GpuAccess,
    pub limits: ContainerLimits,
    pub command: Vec<String>,
    /// The session's own Docker network (`crate::network::NetworkSpec`), its only network.
    pub network: String,
}

impl ContainerSpec {
    /// The dev container of `session` on `node`.
    pub fn for_session(node: &NodeName, session: &DesiredSession, gpu_access: GpuAccess) -> Self {
        let login = session.user.name.as_str();
        let home_dir = format!("/home/{login}");
        // The manager's extra labels first, so they can never replace ongrid's own.
        let mut labels = session.labels.clone();
        labels.extend([
            (LABEL_MANAGED.to_owned(), "true".to_owned()),
            (LABEL_SESSION.to_owned(), session.session_id.to_string()),
            (LABEL_SESSION_NAME.to_owned(), session.name.to_string()),
            (LABEL_USER.to_owned(), login.to_owned()),
            (LABEL_OWNER.to_owned(), session.owner.to_string()),
            (LABEL_NODE.to_owned(), node.to_string()),
            (LABEL_GPUS.to_owned(), visible_devices(&session.gpus)),
        ]);
        let devices = visible_devices(&session.gpus);
        let env = vec![
            ("HOME".to_owned(), home_dir.clone()),
            ("USER".to_owned(), login.to_owned()),
            ("LOGNAME".to_owned(), login.to_owned()),
            ("SHELL".to_owned(), "/bin/bash".to_owned()),
            ("LANG".to_owned(), "C.UTF-8".to_owned()),
            ("CUDA_VISIBLE_DEVICES".to_owned(), devices.clone()),
            ("NVIDIA_VISIBLE_DEVICES".to_owned(), devices),
        ];
        Self {
            session_id: session.session_id,
            name: session.session_id.container_name(),
            image: session.image.clone(),
            hostname: session.name.to_string(),
            user: session.user.clone(),
            home: Home::Volume(home_volume_name(&session.user)),
            binds: Vec::new(),
            home_dir,
            labels,
            env,
            gpus: session.gpus.clone(),
            gpu_access,
            limits: session.limits,
            command: KEEPALIVE_COMMAND.iter().map(|s| (*s).to_owned()).collect(),
            network: crate::network::network_name(session.session_id),
        }
    }

    /// Labels of the home volume.
    pub fn home_volume_labels(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            (LABEL_MANAGED.to_owned(), "true".to_owned()),
            (LABEL_USER.to_owned(), self.user.name.to_string()),
        ])
    }
}

/// Where a container's home comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Home {
    /// A node-local Docker volume of this name, made (and given to the user) when missing.
    Volume(String),
    /// A directory on the node (site storage), made when missing below `root`, which must
    /// exist, owned by the user with `mode` ([`site_dirs::ensure_home_directory`]).
    Directory {
        path: std::path::PathBuf,
        root: std::path::PathBuf,
        mode: u32,
    },
}

/// A directory of the node bind-mounted into a container (`[storage]` of the agent's config).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BindMount {
    /// It must exist on the node.
    pub source: std::path::PathBuf,
    pub target: String,
    pub read_only: bool,
    pub propagation: Propagation,
}

/// Whether mounts made on the node under a bind's source later show up in the container (an
/// autofs-mounted `/cvmfs` needs `Slave`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Propagation {
    /// Docker's default, `rprivate`.
    Private,
    /// `rslave`: mounts of the node propagate into the container.
    Slave,
    /// `rshared`: and back.
    Shared,
}

/// `ongrid-home-<login>`.
pub fn home_volume_name(user: &ContainerUser) -> String {
    format!("ongrid-home-{}", user.name)
}

/// One ongrid container of this node as the runtime sees it now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerStatus {
    pub id: String,
    /// Without the leading `/` Docker puts there.
    pub name: String,
    /// From the `ongrid.session` label; `None` for helpers and anything unparsable.
    pub session_id: Option<SessionId>,
    /// Never [`ContainerState::Missing`]: the container exists.
    pub state: ContainerState,
    /// The image it was created from, as named then (`Config.Image`).
    pub image: String,
    /// From the `ongrid.gpus` label; `None` when absent or unparsable.
    pub gpus: Option<Vec<GpuId>>,
    /// The host PID of its first process while it runs, as the list read it (its CPU counter's
    /// cgroup is that process's).
    pub pid: Option<u32>,
}

impl ContainerStatus {
    /// The session this container is the dev container of: its label names a session and its
    /// name is that session's container name. Anything else labelled ongrid is a stray.
    pub fn dev_container_of(&self) -> Option<SessionId> {
        self.session_id
            .filter(|id| id.container_name() == self.name)
    }
}

/// A session's dev container as the stream endpoint sees it: enough to check that a stream may
/// go there and to run processes as its user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionContainer {
    pub id: String,
    pub session_id: SessionId,
    /// From the `ongrid.session.name` label.
    pub session_name: String,
    /// From the `ongrid.owner` label: the owner's DN as written.
    pub owner: String,
    /// From the `ongrid.user` label: the user's login inside.
    pub login: String,
    /// The container's user (`Config.User`), `uid:gid`: every process runs as it.
    pub user: String,
    pub running: bool,
    /// The host PID of the container's first process while it runs (for its namespaces).
    pub pid: Option<u32>,
}

/// A process to start in a container (`docker exec`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecSpec {
    pub command: Vec<String>,
    /// `uid:gid` or a name known inside the container.
    pub user: String,
    pub working_dir: String,
    /// Added to (and overriding) the container's own environment.
    pub env: Vec<(String, String)>,
    /// A pseudo-terminal of this size (stderr then goes to it too), or `None` for pipes with
    /// stdout and stderr kept apart.
    pub tty: Option<TtySize>,
}

/// A terminal size in characters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TtySize {
    pub cols: u16,
    pub rows: u16,
}

/// A chunk of a process's output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecOutput {
    /// Standard output, or everything when the process has a terminal.
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
}

/// A started process: its output until it closes it, and its standard input (shutting the
/// writer down closes the process's stdin).
pub struct ExecProcess {
    pub id: String,
    pub output: BoxStream<'static, Result<ExecOutput, RuntimeError>>,
    pub input: Pin<Box<dyn tokio::io::AsyncWrite + Send>>,
}

impl std::fmt::Debug for ExecProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecProcess")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

/// What the runtime knows about a started process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExecStatus {
    pub running: bool,
    /// Once it has ended. A process killed by signal N reports 128 + N, like a shell.
    pub exit_code: Option<i64>,
    /// Its host PID while it runs.
    pub pid: Option<u32>,
}

/// How [`ContainerRuntime::freeze_commit`] sets the configuration of the committed image
/// (Docker keeps the container's own for whatever is left empty, and merges labels).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CommitSpec {
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    pub working_dir: String,
    pub labels: BTreeMap<String, String>,
    pub comment: String,
}

/// An image as freezing needs it: its configuration and size.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ImageDetails {
    pub id: String,
    /// Bytes of all its layers.
    pub size: u64,
    pub env: Vec<String>,
    pub working_dir: Option<String>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    pub user: Option<String>,
    pub labels: BTreeMap<String, String>,
}

/// One of this node's session networks as the runtime sees it now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetworkStatus {
    pub id: String,
    pub name: String,
    /// From the `ongrid.session` label; `None` when absent or unparsable.
    pub session_id: Option<SessionId>,
}

/// What the node has in total, as the container engine sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeResources {
    /// Thousandths of a CPU.
    pub millicpus: u64,
    pub memory_bytes: u64,
}

/// What the node keeps for itself: the agent, Docker, sshd and the kernel need CPU and memory
/// even when dev containers are busy (`[reserved]` of the agent's config).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reserved {
    pub millicpus: u64,
    pub memory_bytes: u64,
}

impl Reserved {
    /// Half a CPU and 1 GiB.
    pub const DEFAULT: Self = Self {
        millicpus: 500,
        memory_bytes: 1 << 30,
    };
}

/// The most CPU and memory one dev container may be given on this node.
///
/// The rule: a session's limit is the manager's `session_limits`, lowered to what the node has
/// minus `[reserved]`, but never below half of the node (a node smaller than its reserve still
/// runs sessions). On a 2-CPU node with the default reserve a session gets at most 1.5 CPUs; on
/// a 64-CPU node, 63.5.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitCeiling {
    pub millicpus: u64,
    pub memory_bytes: u64,
}

impl LimitCeiling {
    pub fn for_node(node: NodeResources, reserved: Reserved) -> Self {
        let ceiling = |total: u64, reserve: u64| total.saturating_sub(reserve).max(total / 2);
        Self {
            millicpus: ceiling(node.millicpus, reserved.millicpus),
            memory_bytes: ceiling(node.memory_bytes, reserved.memory_bytes),
        }
    }

    /// No ceiling (tests that do not care).
    pub const NONE: Self = Self {
        millicpus: u64::MAX,
        memory_bytes: u64::MAX,
    };

    /// `limits` lowered to the ceiling; `0` (no limit) becomes the ceiling too.
    pub fn cap(&self, limits: ContainerLimits) -> ContainerLimits {
        let lower = |value: u64, ceiling: u64| match value {
            0 => ceiling,
            v => v.min(ceiling),
        };
        ContainerLimits {
            millicpus: u32::try_from(lower(u64::from(limits.millicpus), self.millicpus))
                .unwrap_or(u32::MAX),
            memory: ongrid_core::MemorySize(lower(limits.memory.bytes(), self.memory_bytes)),
            pids: limits.pids,
        }
    }
}

/// What the agent needs to know of the container engine itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DaemonInfo {
    /// Docker's `live-restore`: containers keep running while the daemon is stopped,
    /// restarted or upgraded. Without it the daemon stops every container when it stops.
    pub live_restore: bool,
}

/// Why a runtime operation failed.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(
        "image {image} is not present on node {node}: build or load it there (images/dev/build.sh)"
    )]
    ImageMissing { image: String, node: NodeName },
    #[error("cannot reach the Docker daemon: is dockerd running, and may the agent's user use its socket?")]
    Unreachable(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("{action}")]
    Docker {
        /// What the agent was doing, e.g. `creating container ongrid-...`.
        action: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("{action}: {problem}")]
    Setup {
        action: String,
        /// What was wrong, for a person.
        problem: String,
    },
}

/// The message of an error and all its causes, `a: b: c`, as reported to the manager.
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// The container engine of the node: creates, starts, stops, removes and lists dev containers.
///
/// Every method works on this node's containers only (label `ongrid.node`). Methods that act
/// on a container take its id; acting on one that is already gone or already in the wanted
/// state is not an error.
pub trait ContainerRuntime: Send + Sync + 'static {
    /// Every container of this node labelled `ongrid.managed=true`, whatever its state.
    fn list(&self) -> BoxFuture<'_, Result<Vec<ContainerStatus>, RuntimeError>>;

    /// Yields each time one of this node's ongrid containers stops (Docker's `die`), so the
    /// agent reports it at once; ends when the runtime's event stream breaks. The default never
    /// yields: without events the periodic sync still sees every exit.
    fn exits(&self) -> BoxStream<'_, ()> {
        futures::stream::pending().boxed()
    }

    /// Creates (without starting) the container of `spec`, ready for its first start: the home
    /// volume exists and is owned by the user, and the user exists inside. Returns its id.
    /// [`RuntimeError::ImageMissing`] when the image is not on the node.
    fn create<'a>(&'a self, spec: &'a ContainerSpec)
        -> BoxFuture<'a, Result<String, RuntimeError>>;

    fn start<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), RuntimeError>>;

    /// Asks the container to stop, killing it after `timeout`.
    fn stop<'a>(
        &'a self,
        id: &'a str,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<(), RuntimeError>>;

    /// Removes the container (killing it if it runs) and its anonymous volumes. Named volumes,
    /// the home volume among them, are kept.
    fn remove<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), RuntimeError>>;

    /// The dev container of `session_id` when this node has it (named after the session,
    /// labelled with it and with this node); `None` otherwise.
    fn session_container(
        &self,
        session_id: SessionId,
    ) -> BoxFuture<'_, Result<Option<SessionContainer>, RuntimeError>>;

    /// Starts a process in a running container, attached to its stdin, stdout and stderr.
    fn start_exec<'a>(
        &'a self,
        container_id: &'a str,
        spec: &'a ExecSpec,
    ) -> BoxFuture<'a, Result<ExecProcess, RuntimeError>>;

    /// Resizes the terminal of a process started with one.
    fn resize_exec<'a>(
        &'a self,
        exec_id: &'a str,
        size: TtySize,
    ) -> BoxFuture<'a, Result<(), RuntimeError>>;

    fn inspect_exec<'a>(
        &'a self,
        exec_id: &'a str,
    ) -> BoxFuture<'a, Result<ExecStatus, RuntimeError>>;

    /// Extracts the tar `archive` into the directory `dir` of a container, with the owners and
    /// modes the archive gives; missing parent directories are created (root, 0755).
    fn upload_archive<'a>(
        &'a self,
        container_id: &'a str,
        dir: &'a str,
        archive: Vec<u8>,
    ) -> BoxFuture<'a, Result<(), RuntimeError>>;

    /// A file or directory of a container as a tar archive; `None` when it does not exist.
    fn download_archive<'a>(
        &'a self,
        container_id: &'a str,
        path: &'a str,
    ) -> BoxFuture<'a, Result<Option<Vec<u8>>, RuntimeError>>;

    // ---- Session lifecycle: activity sampling, and release onto other GPUs ----

    /// CPU time used so far by all processes of a running container, as [`Self::list`] saw it
    /// (its cgroup's counter, which restarts with the container); `None` when it does not run.
    fn cpu_time<'a>(
        &'a self,
        container: &'a ContainerStatus,
    ) -> BoxFuture<'a, Result<Option<Duration>, RuntimeError>>;

    /// Commits the container's filesystem (not its volumes) to the image `reference`, moving
    /// the tag if it exists. Returns the image id.
    fn commit_to_image<'a>(
        &'a self,
        id: &'a str,
        reference: &'a str,
    ) -> BoxFuture<'a, Result<String, RuntimeError>>;

    /// Whether the image `reference` is on the node.
    fn image_exists<'a>(&'a self, reference: &'a str) -> BoxFuture<'a, Result<bool, RuntimeError>>;

    /// Removes the image `reference` once no container uses it (Docker refuses before: an
    /// error); a missing image is not an error.
    fn untag_image<'a>(&'a self, reference: &'a str) -> BoxFuture<'a, Result<(), RuntimeError>>;

    /// Removes the tag `reference` even while containers use its image (Docker then keeps the
    /// image, untagged, until they are gone; nothing can start from the tag any more). Returns
    /// whether the tag was there.
    fn remove_tag<'a>(&'a self, reference: &'a str) -> BoxFuture<'a, Result<bool, RuntimeError>>;

    // ---- Freeze: commit a session, export the snapshot, tag the matching Docker image ----

    /// Commits the container into a new untagged image (Docker pauses it for the commit) whose
    /// configuration `spec` adjusts. Returns the image id.
    fn freeze_commit<'a>(
        &'a self,
        container_id: &'a str,
        spec: &'a CommitSpec,
    ) -> BoxFuture<'a, Result<String, RuntimeError>>;

    /// An image's configuration and size; `None` when the image is not on the node.
    fn image_details<'a>(
        &'a self,
        reference: &'a str,
    ) -> BoxFuture<'a, Result<Option<ImageDetails>, RuntimeError>>;

    /// Creates, never starts, a container of `image` named `name` with `labels` and no network,
    /// only to export its filesystem. It is not labelled `ongrid.managed`, so the reconciler
    /// leaves it alone; the caller removes it (with [`ContainerRuntime::remove`]).
    fn create_export_container<'a>(
        &'a self,
        image: &'a str,
        name: &'a str,
        labels: &'a BTreeMap<String, String>,
    ) -> BoxFuture<'a, Result<String, RuntimeError>>;

    /// The container's whole filesystem as a tar stream (`docker export`).
    fn export_container(
        &self,
        container_id: &str,
    ) -> BoxStream<'static, Result<Vec<u8>, RuntimeError>>;

    /// Tags `image` as `repository:tag`, moving the tag when it exists.
    fn tag_image<'a>(
        &'a self,
        image: &'a str,
        repository: &'a str,
        tag: &'a str,
    ) -> BoxFuture<'a, Result<(), RuntimeError>>;

    /// Removes an image by id with every tag on it; a missing image is not an error.
    fn remove_image_id<'a>(&'a self, image_id: &'a str) -> BoxFuture<'a, Result<(), RuntimeError>>;

    /// The ids of the images labelled `label=value` (the commits of one freeze, found again
    /// after an agent restart that came before the freeze wrote their id down).
    fn images_labelled<'a>(
        &'a self,
        label: &'a str,
        value: &'a str,
    ) -> BoxFuture<'a, Result<Vec<String>, RuntimeError>>;

    // ---- Session networks (see `crate::network`) ----

    /// Every network of this node labelled `ongrid.managed=true`.
    fn list_networks(&self) -> BoxFuture<'_, Result<Vec<NetworkStatus>, RuntimeError>>;

    /// Creates the network of `spec` unless one of that name exists, with a /29 of its pool
    /// that no network of the daemon overlaps.
    fn ensure_network<'a>(
        &'a self,
        spec: &'a crate::network::NetworkSpec,
    ) -> BoxFuture<'a, Result<(), RuntimeError>>;

    /// Removes a network; a missing one is not an error, one still in use is.
    fn remove_network<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), RuntimeError>>;

    /// The node's CPUs and memory.
    fn node_resources(&self) -> BoxFuture<'_, Result<NodeResources, RuntimeError>>;

    /// The engine's own settings, asked over a new connection: an error means the engine
    /// accepts no connection now (it is stopping, or gone), even while connections opened
    /// before still answer, as Docker's do while it stops its containers.
    fn daemon(&self) -> BoxFuture<'_, Result<DaemonInfo, RuntimeError>>;

    // ---- Batch jobs (see `crate::jobs`) ----

    /// Every batch job container of this node (labelled `ongrid.job`), whatever its state.
    /// [`ContainerRuntime::list`] and [`ContainerRuntime::list_networks`] leave job containers
    /// and job networks out, so the reconciler of sessions never touches them.
    fn list_jobs(&self) -> BoxFuture<'_, Result<Vec<JobContainerStatus>, RuntimeError>>;

    /// Creates (without starting) the container of a batch job: the image must be on the node
    /// ([`RuntimeError::ImageMissing`] otherwise), the home volume exists when it is mounted,
    /// and the user exists inside. Returns its id.
    fn create_job<'a>(
        &'a self,
        spec: &'a JobContainerSpec,
    ) -> BoxFuture<'a, Result<String, RuntimeError>>;

    /// Sends `signal` (`SIGUSR1`, `SIGKILL`, ...) to the main process of a running container;
    /// a container that does not run (any more) is not an error.
    fn signal<'a>(
        &'a self,
        id: &'a str,
        signal: &'a str,
    ) -> BoxFuture<'a, Result<(), RuntimeError>>;

    /// The container's stdout and stderr from its start, in the order they came, following
    /// the output until the container stops (then the stream ends).
    fn follow_logs(&self, id: &str) -> BoxStream<'static, Result<Vec<u8>, RuntimeError>>;

    /// Makes the image `reference` from the filesystem in the tar stream `tar`, with the
    /// configuration `config` (`docker import --change ...`).
    fn import_image<'a>(
        &'a self,
        reference: &'a str,
        config: &'a ImportConfig,
        tar: BoxStream<'static, Result<Vec<u8>, std::io::Error>>,
    ) -> BoxFuture<'a, Result<(), RuntimeError>>;
}

/// Everything that defines one batch job's container (`crate::jobs`). It is hardened like a
/// dev container (the docker runtime builds both from the same request), but runs the job's
/// command under the image's entrypoint, works in the chain's working directory, and mounts
/// the home volume only when asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobContainerSpec {
    pub job_id: ongrid_core::job::JobId,
    /// `ongrid-job-<job id>`.
    pub name: String,
    pub image: String,
    pub user: ContainerUser,
    pub labels: BTreeMap<String, String>,
    pub env: Vec<(String, String)>,
    pub gpus: Vec<GpuId>,
    pub gpu_access: GpuAccess,
    pub limits: ContainerLimits,
    /// The job's command (it replaces the image's CMD; the image's entrypoint stays).
    pub command: Vec<String>,
    /// The job's own Docker network (`crate::network::NetworkSpec`), its only network.
    pub network: String,
    /// The chain's working directory on the node, mounted at
    /// [`ongrid_core::job::WORK_DIR_IN_CONTAINER`].
    pub work_dir: std::path::PathBuf,
    /// Mount the user's home at `/home/<login>`, read-write.
    pub mount_home: bool,
    /// The user's home, as a dev container of the user would have it.
    pub home: Home,
    /// The site's storage (`[storage]`), mounted into every job.
    pub binds: Vec<BindMount>,
}

impl JobContainerSpec {
    /// The same container as a dev container's spec, for the parts both share (user, home
    /// volume, GPUs, limits, network). Its `session_id` is the job's id: it names nothing.
    pub fn as_container_spec(&self) -> ContainerSpec {
        let login = self.user.name.as_str();
        ContainerSpec {
            session_id: SessionId(self.job_id.0),
            name: self.name.clone(),
            image: self.image.clone(),
            hostname: format!("job-{}", &self.job_id.0.simple().to_string()[..8]),
            user: self.user.clone(),
            home_dir: format!("/home/{login}"),
            home: self.home.clone(),
            binds: self.binds.clone(),
            labels: self.labels.clone(),
            env: self.env.clone(),
            gpus: self.gpus.clone(),
            gpu_access: self.gpu_access,
            limits: self.limits,
            command: self.command.clone(),
            network: self.network.clone(),
        }
    }
}

/// A batch job's container as the runtime sees it now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobContainerStatus {
    pub id: String,
    pub name: String,
    /// From the `ongrid.job` label.
    pub job_id: ongrid_core::job::JobId,
    pub state: JobContainerState,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobContainerState {
    /// Created, never started.
    Created,
    Running {
        started_at: chrono::DateTime<chrono::Utc>,
    },
    Exited {
        started_at: chrono::DateTime<chrono::Utc>,
        finished_at: chrono::DateTime<chrono::Utc>,
        exit_code: i64,
        oom_killed: bool,
    },
}

/// The configuration an imported image gets (`docker import --change`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ImportConfig {
    /// `KEY=value`.
    pub env: Vec<String>,
    pub working_dir: Option<String>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    /// Docker's `Config.User` (`name`, `uid` or `uid:gid`).
    pub user: Option<String>,
    /// `Config.Labels` (a frozen image carries [`crate::freeze::LABEL_FROZEN_IMAGE`]).
    pub labels: BTreeMap<String, String>,
}

impl From<ongrid_images::ImageConfig> for ImportConfig {
    /// The configuration recorded in a frozen image's provenance, without labels.
    fn from(config: ongrid_images::ImageConfig) -> Self {
        Self {
            env: config.env,
            working_dir: config.working_dir,
            entrypoint: config.entrypoint,
            cmd: config.cmd,
            user: config.user,
            labels: BTreeMap::new(),
        }
    }
}

impl ImportConfig {
    /// The Dockerfile instructions of `docker import --change` that set this configuration.
    pub fn changes(&self) -> Vec<String> {
        let json = |list: &[String]| serde_json::to_string(list).unwrap_or_else(|_| "[]".into());
        let quoted =
            |text: &str| format!("\"{}\"", text.replace('\\', "\\\\").replace('"', "\\\""));
        let mut changes = Vec::new();
        for pair in &self.env {
            if let Some((key, value)) = pair.split_once('=') {
                if !key.is_empty() {
                    changes.push(format!("ENV {key}={}", quoted(value)));
                }
            }
        }
        for (key, value) in &self.labels {
            changes.push(format!("LABEL {}={}", quoted(key), quoted(value)));
        }
        if let Some(user) = self.user.as_deref().filter(|u| !u.is_empty()) {
            changes.push(format!("USER {user}"));
        }
        if let Some(dir) = self.working_dir.as_deref().filter(|d| !d.is_empty()) {
            changes.push(format!("WORKDIR {dir}"));
        }
        if !self.entrypoint.is_empty() {
            changes.push(format!("ENTRYPOINT {}", json(&self.entrypoint)));
        }
        if !self.cmd.is_empty() {
            changes.push(format!("CMD {}", json(&self.cmd)));
        }
        changes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::fake::desired_session;

    #[test]
    fn import_changes_quote_env_and_labels_and_set_the_user() {
        let config = ImportConfig {
            env: vec![
                "PATH=/usr/bin".into(),
                "Q=say \"hi\" \\o/".into(),
                "=x".into(),
            ],
            working_dir: Some("/work".into()),
            entrypoint: Vec::new(),
            cmd: vec!["/bin/bash".into()],
            user: Some("1000:1000".into()),
            labels: BTreeMap::from([
                ("ongrid.frozen.image".to_owned(), "42".to_owned()),
                ("ongrid.managed".to_owned(), String::new()),
            ]),
        };
        assert_eq!(
            config.changes(),
            [
                r#"ENV PATH="/usr/bin""#,
                r#"ENV Q="say \"hi\" \\o/""#,
                r#"LABEL "ongrid.frozen.image"="42""#,
                r#"LABEL "ongrid.managed"="""#,
                "USER 1000:1000",
                "WORKDIR /work",
                r#"CMD ["/bin/bash"]"#,
            ]
        );
    }

    #[test]
    fn limits_leave_room_for_the_node() {
        let gib = 1u64 << 30;
        let small = LimitCeiling::for_node(
            NodeResources {
                millicpus: 2000,
                memory_bytes: 8 * gib,
            },
            Reserved::DEFAULT,
        );
        assert_eq!((small.millicpus, small.memory_bytes), (1500, 7 * gib));
        let asked = ContainerLimits {
            millicpus: 2000,
            memory: ongrid_core::MemorySize(16 * gib),
            pids: 512,
        };
        let capped = small.cap(asked);
        assert_eq!(
            capped.millicpus, 1500,
            "2 CPUs on a 2-CPU node is the whole node"
        );
        assert_eq!(capped.memory.bytes(), 7 * gib);
        assert_eq!(capped.pids, 512);
        let modest = ContainerLimits {
            millicpus: 500,
            memory: ongrid_core::MemorySize(gib),
            pids: 64,
        };
        assert_eq!(small.cap(modest), modest, "limits below the ceiling stay");
        let unlimited = ContainerLimits {
            millicpus: 0,
            memory: ongrid_core::MemorySize(0),
            pids: 64,
        };
        assert_eq!(
            small.cap(unlimited).millicpus,
            1500,
            "no limit is not the whole node"
        );
        let tiny = LimitCeiling::for_node(
            NodeResources {
                millicpus: 500,
                memory_bytes: gib / 2,
            },
            Reserved::DEFAULT,
        );
        assert_eq!((tiny.millicpus, tiny.memory_bytes), (250, gib / 4));
    }

    #[test]
    fn spec_carries_identity_labels_and_environment() {
        let node = NodeName::parse("node1").unwrap();
        let session = desired_session(&[
            "GPU-11111111-2222-3333-4444-555555555501",
            "MIG-c7384736-a75d-5afc-978f-d2f1294409fd",
        ]);
        let spec = ContainerSpec::for_session(&node, &session, GpuAccess::EnvironmentOnly);

        assert_eq!(spec.name, session.session_id.container_name());
        assert_eq!(spec.hostname, "train1");
        assert_eq!(spec.home_dir, "/home/alice-smith");
        assert_eq!(spec.home, Home::Volume("ongrid-home-alice-smith".into()));
        assert_eq!(spec.binds, []);
        assert_eq!(spec.command, ["sleep", "infinity"]);

        let label = |k: &str| spec.labels.get(k).map(String::as_str);
        assert_eq!(label(LABEL_MANAGED), Some("true"));
        assert_eq!(
            label(LABEL_SESSION),
            Some(session.session_id.to_string().as_str())
        );
        assert_eq!(label(LABEL_SESSION_NAME), Some("train1"));
        assert_eq!(
            label(LABEL_OWNER),
            Some("/DC=org/DC=example/CN=Alice Smith")
        );
        assert_eq!(label(LABEL_NODE), Some("node1"));
        // The manager's extra labels are kept but cannot override ongrid's own.
        assert_eq!(label("site.project"), Some("atlas"));
        assert_eq!(label(LABEL_USER), Some("alice-smith"));
        assert_eq!(
            label(LABEL_GPUS),
            Some(
                "GPU-11111111-2222-3333-4444-555555555501,\
                 MIG-c7384736-a75d-5afc-978f-d2f1294409fd"
            )
        );

        let env: BTreeMap<_, _> = spec.env.iter().cloned().collect();
        let devices = "GPU-11111111-2222-3333-4444-555555555501,\
                       MIG-c7384736-a75d-5afc-978f-d2f1294409fd";
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], devices);
        assert_eq!(env["NVIDIA_VISIBLE_DEVICES"], devices);
        assert_eq!(env["HOME"], "/home/alice-smith");
        assert_eq!(env["USER"], "alice-smith");
        assert_eq!(env["LOGNAME"], "alice-smith");
        assert_eq!(env["SHELL"], "/bin/bash");
        assert_eq!(env["LANG"], "C.UTF-8");

        assert_eq!(
            spec.home_volume_labels(),
            BTreeMap::from([
                (LABEL_MANAGED.to_owned(), "true".to_owned()),
                (LABEL_USER.to_owned(), "alice-smith".to_owned()),
            ])
        );
    }

    #[test]
    fn only_properly_named_containers_belong_to_a_session() {
        let id = SessionId::new_random();
        let status = |name: String, session_id| ContainerStatus {
            id: "abc".into(),
            name,
            session_id,
            state: ContainerState::Running,
            image: "ongrid/dev:latest".into(),
            gpus: None,
            pid: None,
        };
        assert_eq!(
            status(id.container_name(), Some(id)).dev_container_of(),
            Some(id)
        );
        assert_eq!(status("other".into(), Some(id)).dev_container_of(), None);
        assert_eq!(status(id.container_name(), None).dev_container_of(), None);
    }

    #[test]
    fn error_chain_joins_causes() {
        let err = RuntimeError::Docker {
            action: "starting container x".into(),
            source: "no such device".into(),
        };
        assert_eq!(error_chain(&err), "starting container x: no such device");
    }
}
