//! [`ContainerRuntime`] on the node's Docker daemon, through bollard. This is the only file of
//! the project that imports bollard.
//!
//! A dev container is hardened the same way every time ([`create_body`]): it runs as the
//! session's unprivileged user, with no capabilities, `no-new-privileges`, CPU, memory and pids
//! limits, tini as PID 1, the user's home and the site's storage (`[storage]`) as its only
//! mounts (never the Docker socket), and no restart policy (the agent decides). Before its first
//! start the user is written into its `/etc/passwd` and `/etc/group`, and a new home volume is
//! given to the user by a short-lived helper container (a new home on site storage is made by
//! the agent itself, `super::site_dirs::ensure_home_directory`).
//!
//! Processes for the SSH gateway's streams run with `docker exec` ([`DockerRuntime::exec_in`]);
//! files go into and out of running containers through Docker's archive API.

use std::collections::HashMap;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use bollard::container::LogOutput;
use bollard::errors::Error as BollardError;
use bollard::exec::{ResizeExecOptions, StartExecOptions, StartExecResults};
use bollard::models::{
    ContainerCreateBody, ContainerStateStatusEnum, DeviceRequest, ExecConfig, HostConfig, Mount,
    MountBindOptions, MountBindOptionsPropagationEnum, MountTypeEnum, MountVolumeOptions,
    RestartPolicy, RestartPolicyNameEnum, VolumeCreateOptions,
};
use bollard::models::{ContainerSummary, Ipam, IpamConfig, NetworkCreateRequest};
use bollard::query_parameters::{CommitContainerOptionsBuilder, StatsOptionsBuilder};
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, DownloadFromContainerOptionsBuilder,
    InspectContainerOptionsBuilder, ListContainersOptionsBuilder, RemoveContainerOptionsBuilder,
    StartContainerOptionsBuilder, StopContainerOptionsBuilder, UploadToContainerOptionsBuilder,
    WaitContainerOptionsBuilder,
};
use bollard::query_parameters::{InspectNetworkOptions, ListNetworksOptionsBuilder};
use bollard::Docker;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use ongrid_core::api::ContainerState;
use ongrid_core::job::JobId;
use ongrid_core::{NodeName, SessionId};
use tracing::{debug, info};

use super::accounts::{self, EtcFile};
use super::cgroup_cpu::CgroupFs;
use super::direct::{DirectError, DirectExec};
use super::LABEL_GPUS;
use super::{BindMount, DaemonInfo, Home, NetworkStatus, NodeResources, Propagation};
use super::{
    ContainerRuntime, ContainerSpec, ContainerStatus, ExecOutput, ExecProcess, ExecSpec,
    ExecStatus, GpuAccess, RuntimeError, SessionContainer, TtySize, LABEL_HELPER, LABEL_MANAGED,
    LABEL_NODE, LABEL_OWNER, LABEL_SESSION, LABEL_SESSION_NAME, LABEL_USER,
};
use super::{ImportConfig, JobContainerSpec, JobContainerState, JobContainerStatus, LABEL_JOB};
use crate::network::{Ipv4Net, NetworkSpec};

/// How long the agent waits for a helper container to finish.
const HELPER_TIMEOUT: Duration = Duration::from_secs(60);

/// The node's Docker daemon, scoped to the containers of one node.
#[derive(Debug, Clone)]
pub struct DockerRuntime {
    docker: Docker,
    node: NodeName,
    /// `/etc/passwd` and `/etc/group` of each image seen, by image ID (content-addressed, so
    /// never stale): a new container's are its image's, and reading them out of a container
    /// costs two archive requests on the way to a shell.
    etc_files: Arc<std::sync::Mutex<HashMap<String, (EtcFile, EtcFile)>>>,
    /// Streams' processes through runc beside dockerd; `None`: `docker exec` for all.
    direct: Option<Arc<DirectExec>>,
    /// Subnets picked by session networks being created now, which Docker does not list yet:
    /// the reconciler creates several at once, and two must not pick the same /29.
    claimed_subnets: Arc<std::sync::Mutex<Vec<Ipv4Net>>>,
    /// Held while a home volume is made: two sessions of one user starting together must not
    /// both make it (nor one remove it, on a failed chown, under the other).
    making_home_volume: Arc<tokio::sync::Mutex<()>>,
    /// Where a running container's CPU counter is read without asking Docker's stats.
    cgroup_fs: CgroupFs,
}

/// A subnet [`DockerRuntime::claimed_subnets`] holds until its network is created (or not).
struct SubnetClaim {
    claimed: Arc<std::sync::Mutex<Vec<Ipv4Net>>>,
    subnet: Ipv4Net,
}

impl Drop for SubnetClaim {
    fn drop(&mut self) {
        self.claimed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|claimed| *claimed != self.subnet);
    }
}

/// How many images' `/etc/passwd` and `/etc/group` the runtime keeps.
const ETC_FILES_CACHED: usize = 32;

impl DockerRuntime {
    /// Connects to the local daemon (`DOCKER_HOST`, else `/var/run/docker.sock`), agrees on an
    /// API version it supports and checks that it answers.
    pub async fn connect(node: NodeName) -> Result<Self, RuntimeError> {
        let unreachable = |e: BollardError| RuntimeError::Unreachable(Box::new(e));
        let docker = Docker::connect_with_local_defaults().map_err(unreachable)?;
        let docker = docker.negotiate_version().await.map_err(unreachable)?;
        docker.ping().await.map_err(unreachable)?;
        Ok(Self {
            docker,
            node,
            etc_files: Arc::default(),
            direct: None,
            claimed_subnets: Arc::default(),
            making_home_volume: Arc::default(),
            cgroup_fs: CgroupFs::host(),
        })
    }

    /// Starts processes through runc beside dockerd ([`DirectExec`]) wherever runc knows the
    /// container; `None` keeps `docker exec` for all.
    #[must_use]
    pub fn with_direct_exec(mut self, direct: Option<DirectExec>) -> Self {
        self.direct = direct.map(Arc::new);
        self
    }

    /// Reads containers' CPU counters from the cgroup and process filesystems at `cgroup_fs`
    /// instead of the host's.
    #[must_use]
    pub fn with_cgroup_fs(mut self, cgroup_fs: CgroupFs) -> Self {
        self.cgroup_fs = cgroup_fs;
        self
    }

    /// Every container of this node's (any state) that also carries `extra_labels`.
    async fn list_node_containers(
        &self,
        extra_labels: &[&str],
        what: &str,
    ) -> Result<Vec<ContainerSummary>, RuntimeError> {
        let mut labels = vec![
            format!("{LABEL_MANAGED}=true"),
            format!("{LABEL_NODE}={}", self.node),
        ];
        labels.extend(extra_labels.iter().map(|label| (*label).to_owned()));
        let filters = HashMap::from([("label", labels)]);
        let options = ListContainersOptionsBuilder::new()
            .all(true)
            .filters(&filters)
            .build();
        self.docker
            .list_containers(Some(options))
            .await
            .map_err(docker_error(format!("listing {what}")))
    }

    async fn list_statuses(&self) -> Result<Vec<ContainerStatus>, RuntimeError> {
        let summaries = self.list_node_containers(&[], "ongrid containers").await?;
        let mut statuses = Vec::with_capacity(summaries.len());
        for summary in summaries {
            let Some(id) = summary.id else { continue };
            if is_job(summary.labels.as_ref()) {
                continue; // `list_jobs`
            }
            // The list has the state but not the exit code, OOM flag and error: inspect.
            let inspect = match self
                .docker
                .inspect_container(&id, Some(InspectContainerOptionsBuilder::new().build()))
                .await
            {
                Ok(inspect) => inspect,
                Err(e) if is_status(&e, 404) => continue, // removed meanwhile
                Err(e) => return Err(docker_error(format!("inspecting container {id}"))(e)),
            };
            let name = inspect
                .name
                .as_deref()
                .unwrap_or_default()
                .trim_start_matches('/')
                .to_owned();
            let session_id = summary
                .labels
                .as_ref()
                .and_then(|labels| labels.get(LABEL_SESSION))
                .and_then(|value| value.parse::<SessionId>().ok());
            let state = inspect.state.unwrap_or_default();
            let pid = state
                .pid
                .and_then(|pid| u32::try_from(pid).ok())
                .filter(|pid| *pid > 0);
            let state = match state.status {
                Some(ContainerStateStatusEnum::CREATED) => ContainerState::Created,
                Some(
                    ContainerStateStatusEnum::RUNNING
                    | ContainerStateStatusEnum::PAUSED
                    | ContainerStateStatusEnum::RESTARTING,
                ) => ContainerState::Running,
                other => ContainerState::Exited {
                    exit_code: state.exit_code.unwrap_or(0),
                    oom_killed: state.oom_killed.unwrap_or(false),
                    error: state
                        .error
                        .filter(|e| !e.is_empty())
                        .or_else(|| match other {
                            Some(ContainerStateStatusEnum::DEAD) => {
                                Some("Docker marked the container dead".to_owned())
                            }
                            Some(ContainerStateStatusEnum::REMOVING) => {
                                Some("the container is being removed".to_owned())
                            }
                            _ => None,
                        }),
                },
            };
            let config = inspect.config.unwrap_or_default();
            let gpus = summary
                .labels
                .as_ref()
                .and_then(|labels| labels.get(LABEL_GPUS))
                .and_then(|value| parse_gpu_label(value));
            statuses.push(ContainerStatus {
                id,
                name,
                session_id,
                state,
                image: config.image.unwrap_or_default(),
                gpus,
                pid,
            });
        }
        Ok(statuses)
    }

    async fn create_dev_container(&self, spec: &ContainerSpec) -> Result<String, RuntimeError> {
        let image_id = match self.docker.inspect_image(&spec.image).await {
            Ok(image) => image.id,
            Err(e) if is_status(&e, 404) => {
                return Err(RuntimeError::ImageMissing {
                    image: spec.image.clone(),
                    node: self.node.clone(),
                })
            }
            Err(e) => return Err(docker_error(format!("inspecting image {}", spec.image))(e)),
        };
        self.ensure_home(spec).await?;

        let options = CreateContainerOptionsBuilder::new()
            .name(&spec.name)
            .build();
        let created = self
            .docker
            .create_container(Some(options), create_body(spec))
            .await
            .map_err(docker_error(format!("creating container {}", spec.name)))?;
        for warning in &created.warnings {
            info!(container = %spec.name, %warning, "Docker warned while creating the container.");
        }
        if let Err(e) = self
            .install_user(&created.id, image_id.as_deref(), spec)
            .await
        {
            // A container without its user must not start; the next pass creates it again.
            let _ = self.remove_container(&created.id).await;
            return Err(e);
        }
        Ok(created.id)
    }

    /// Makes the container's home when absent (a volume, or a directory on site storage) and
    /// checks that the site storage it mounts is there.
    async fn ensure_home(&self, spec: &ContainerSpec) -> Result<(), RuntimeError> {
        if let Some(problem) = super::site_dirs::missing_source(&spec.binds, &spec.user) {
            return Err(RuntimeError::Setup {
                action: format!("mounting site storage into container {}", spec.name),
                problem,
            });
        }
        match &spec.home {
            Home::Volume(volume) => self.ensure_home_volume(spec, volume).await,
            Home::Directory { path, root, mode } => {
                let action = format!("making the home {} of {}", path.display(), spec.user.name);
                let (home, root, mode, uid) = (path.clone(), root.clone(), *mode, spec.user.uid);
                let made = tokio::task::spawn_blocking(move || {
                    super::site_dirs::ensure_home_directory(&home, &root, uid, mode)
                })
                .await
                .map_err(|e| RuntimeError::Setup {
                    action: action.clone(),
                    problem: e.to_string(),
                })?
                .map_err(|e| RuntimeError::Setup {
                    action,
                    problem: super::error_chain(&e),
                })?;
                if made {
                    info!(user = %spec.user.name, uid = spec.user.uid, ?path, "Made the home on site storage.");
                }
                Ok(())
            }
        }
    }

    /// Creates the home volume when absent, and then hands it to the user.
    async fn ensure_home_volume(
        &self,
        spec: &ContainerSpec,
        volume: &str,
    ) -> Result<(), RuntimeError> {
        let inspect = || async {
            match self.docker.inspect_volume(volume).await {
                Ok(_) => Ok(true),
                Err(e) if is_status(&e, 404) => Ok(false),
                Err(e) => Err(docker_error(format!("inspecting volume {volume}"))(e)),
            }
        };
        if inspect().await? {
            return Ok(());
        }
        // Another session of the user may be making it: wait for it, then look again.
        let _making = self.making_home_volume.lock().await;
        if inspect().await? {
            return Ok(());
        }
        let options = VolumeCreateOptions {
            name: Some(volume.to_owned()),
            labels: Some(spec.home_volume_labels().into_iter().collect()),
            ..Default::default()
        };
        self.docker
            .create_volume(options)
            .await
            .map_err(docker_error(format!("creating volume {volume}")))?;
        info!(%volume, user = %spec.user.name, "Created home volume.");
        if let Err(e) = self.chown_home_volume(spec, volume).await {
            // It is new and empty: remove it, so the next attempt starts from scratch.
            let _ = self
                .docker
                .remove_volume(
                    volume,
                    None::<bollard::query_parameters::RemoveVolumeOptions>,
                )
                .await;
            return Err(e);
        }
        Ok(())
    }

    /// Runs `chown uid:uid /home/<login>` as root in a throwaway container of the same image,
    /// with no network and only `CAP_CHOWN`.
    async fn chown_home_volume(
        &self,
        spec: &ContainerSpec,
        volume: &str,
    ) -> Result<(), RuntimeError> {
        let name = format!("ongrid-chown-{}", uuid::Uuid::new_v4().simple());
        let options = CreateContainerOptionsBuilder::new().name(&name).build();
        let action = format!("giving volume {volume} to uid {}", spec.user.uid);
        let id = self
            .docker
            .create_container(Some(options), chown_helper_body(spec, &self.node))
            .await
            .map_err(docker_error(action.clone()))?
            .id;
        let result = self.run_to_completion(&id, &action).await;
        let _ = self.remove_container(&id).await;
        result
    }

    async fn run_to_completion(&self, id: &str, action: &str) -> Result<(), RuntimeError> {
        self.docker
            .start_container(id, Some(StartContainerOptionsBuilder::new().build()))
            .await
            .map_err(docker_error(action.to_owned()))?;
        let options = WaitContainerOptionsBuilder::new()
            .condition("not-running")
            .build();
        let wait = self
            .docker
            .wait_container(id, Some(options))
            .try_collect::<Vec<_>>();
        match tokio::time::timeout(HELPER_TIMEOUT, wait).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(BollardError::DockerContainerWaitError { error, code })) => {
                Err(RuntimeError::Setup {
                    action: action.to_owned(),
                    problem: format!("the helper container exited with code {code} {error}")
                        .trim_end()
                        .to_owned(),
                })
            }
            Ok(Err(e)) => Err(docker_error(action.to_owned())(e)),
            Err(_) => Err(RuntimeError::Setup {
                action: action.to_owned(),
                problem: format!(
                    "the helper container did not finish within {} s",
                    HELPER_TIMEOUT.as_secs()
                ),
            }),
        }
    }

    /// Writes the user and its group into the created container's `/etc/passwd` and
    /// `/etc/group`, so the shell has a name, a home and a login shell. The files come from
    /// the cache of its image (`image_id`) when they were read before.
    async fn install_user(
        &self,
        id: &str,
        image_id: Option<&str>,
        spec: &ContainerSpec,
    ) -> Result<(), RuntimeError> {
        let cached = image_id.and_then(|image| {
            let cache = self
                .etc_files
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            cache.get(image).cloned()
        });
        let (mut passwd, mut group) = match cached {
            Some(files) => files,
            None => {
                let passwd = self.download_etc_file(id, "passwd").await?;
                let group = self.download_etc_file(id, "group").await?;
                if let Some(image) = image_id {
                    let mut cache = self
                        .etc_files
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner);
                    if cache.len() >= ETC_FILES_CACHED {
                        cache.clear();
                    }
                    cache.insert(image.to_owned(), (passwd.clone(), group.clone()));
                }
                (passwd, group)
            }
        };
        passwd.text = accounts::with_user_in_passwd(&passwd.text, &spec.user);
        group.text = accounts::with_user_in_group(&group.text, &spec.user);
        let action = format!("adding user {} to container {}", spec.user.name, spec.name);
        let archive = accounts::tar_of(&[passwd, group]).map_err(|e| RuntimeError::Docker {
            action: action.clone(),
            source: Box::new(e),
        })?;
        let options = UploadToContainerOptionsBuilder::new().path("/etc").build();
        self.docker
            .upload_to_container(id, Some(options), bollard::body_full(archive.into()))
            .await
            .map_err(docker_error(action))
    }

    async fn download_etc_file(&self, id: &str, name: &str) -> Result<EtcFile, RuntimeError> {
        let path = format!("/etc/{name}");
        let action = format!("reading {path} of container {id}");
        let options = DownloadFromContainerOptionsBuilder::new()
            .path(&path)
            .build();
        let chunks: Vec<_> = self
            .docker
            .download_from_container(id, Some(options))
            .try_collect()
            .await
            .map_err(docker_error(action.clone()))?;
        let archive = chunks.concat();
        let mut file =
            accounts::file_from_tar(&archive, &path).map_err(|e| RuntimeError::Docker {
                action,
                source: Box::new(e),
            })?;
        file.name = name.to_owned();
        Ok(file)
    }

    async fn start_container(&self, id: &str) -> Result<(), RuntimeError> {
        self.docker
            .start_container(id, Some(StartContainerOptionsBuilder::new().build()))
            .await
            .map_err(docker_error(format!("starting container {id}")))
    }

    async fn stop_container(&self, id: &str, timeout: Duration) -> Result<(), RuntimeError> {
        let seconds = i32::try_from(timeout.as_secs()).unwrap_or(i32::MAX);
        let options = StopContainerOptionsBuilder::new().t(seconds).build();
        match self.docker.stop_container(id, Some(options)).await {
            Ok(()) => Ok(()),
            Err(e) if is_status(&e, 404) => Ok(()),
            Err(e) => Err(docker_error(format!("stopping container {id}"))(e)),
        }
    }

    async fn remove_container(&self, id: &str) -> Result<(), RuntimeError> {
        let options = RemoveContainerOptionsBuilder::new()
            .force(true)
            .v(true)
            .build();
        match self.docker.remove_container(id, Some(options)).await {
            Ok(()) => Ok(()),
            Err(e) if is_status(&e, 404) => Ok(()),
            Err(e) => Err(docker_error(format!("removing container {id}"))(e)),
        }
    }
}

impl DockerRuntime {
    async fn find_session_container(
        &self,
        session_id: SessionId,
    ) -> Result<Option<SessionContainer>, RuntimeError> {
        let name = session_id.container_name();
        let inspect = match self
            .docker
            .inspect_container(&name, Some(InspectContainerOptionsBuilder::new().build()))
            .await
        {
            Ok(inspect) => inspect,
            Err(e) if is_status(&e, 404) => return Ok(None),
            Err(e) => return Err(docker_error(format!("inspecting container {name}"))(e)),
        };
        let config = inspect.config.unwrap_or_default();
        let labels = config.labels.unwrap_or_default();
        let label = |key: &str| labels.get(key).cloned().unwrap_or_default();
        let ours = label(LABEL_MANAGED) == "true"
            && label(LABEL_NODE) == self.node.as_str()
            && label(LABEL_SESSION) == session_id.to_string();
        let Some(id) = inspect.id.filter(|_| ours) else {
            return Ok(None);
        };
        let state = inspect.state.unwrap_or_default();
        let running = state.status == Some(ContainerStateStatusEnum::RUNNING);
        Ok(Some(SessionContainer {
            id,
            session_id,
            session_name: label(LABEL_SESSION_NAME),
            owner: label(LABEL_OWNER),
            login: label(LABEL_USER),
            user: config.user.unwrap_or_default(),
            running,
            pid: state
                .pid
                .filter(|_| running)
                .and_then(|pid| u32::try_from(pid).ok())
                .filter(|pid| *pid > 0),
        }))
    }

    /// `docker exec`: creates the process and attaches to it.
    ///
    /// The attach stream is always multiplexed (`Tty: false` when starting, whatever the
    /// process has): Docker then frames a terminal's output like any other, whereas raw
    /// terminal output beginning with a byte 0–2 would be mistaken for a frame header by
    /// bollard's decoder and stall the stream.
    pub async fn exec_in(
        &self,
        container_id: &str,
        spec: &ExecSpec,
    ) -> Result<ExecProcess, RuntimeError> {
        let action = format!(
            "starting {} in container {container_id}",
            spec.command
                .first()
                .map(String::as_str)
                .unwrap_or("a process")
        );
        let mut command = spec.command.clone();
        let mut console_size = None;
        if let Some(size) = spec.tty {
            if self.sets_console_size() {
                console_size = Some(vec![usize::from(size.rows), usize::from(size.cols)]);
            } else {
                command = with_initial_size(size, command);
            }
        }
        let config = ExecConfig {
            attach_stdin: Some(true),
            attach_stdout: Some(true),
            attach_stderr: Some(true),
            tty: Some(spec.tty.is_some()),
            console_size,
            env: Some(spec.env.iter().map(|(k, v)| format!("{k}={v}")).collect()),
            cmd: Some(command),
            user: Some(spec.user.clone()),
            working_dir: Some(spec.working_dir.clone()),
            ..Default::default()
        };
        let created = self
            .docker
            .create_exec(container_id, config)
            .await
            .map_err(docker_error(action.clone()))?;
        let options = StartExecOptions {
            detach: false,
            tty: false,
            output_capacity: Some(64 * 1024),
        };
        let started = self
            .docker
            .start_exec(&created.id, Some(options))
            .await
            .map_err(docker_error(action.clone()))?;
        let StartExecResults::Attached { output, input } = started else {
            return Err(RuntimeError::Setup {
                action,
                problem: "Docker started the process detached".to_owned(),
            });
        };
        let exec_id = created.id.clone();
        let output = output
            .filter_map(move |item| {
                let item = match item {
                    Ok(LogOutput::StdOut { message } | LogOutput::Console { message }) => {
                        Some(Ok(ExecOutput::Stdout(message.to_vec())))
                    }
                    Ok(LogOutput::StdErr { message }) => {
                        Some(Ok(ExecOutput::Stderr(message.to_vec())))
                    }
                    Ok(LogOutput::StdIn { .. }) => None,
                    Err(e) => Some(Err(docker_error(format!(
                        "reading the output of exec {exec_id}"
                    ))(e))),
                };
                std::future::ready(item)
            })
            .boxed();
        Ok(ExecProcess {
            id: created.id,
            output,
            input,
        })
    }

    /// Whether the daemon takes an exec's initial terminal size (`ConsoleSize`, API 1.42).
    fn sets_console_size(&self) -> bool {
        let version = self.docker.client_version();
        (version.major_version, version.minor_version) >= (1, 42)
    }

    async fn resize(&self, exec_id: &str, size: TtySize) -> Result<(), RuntimeError> {
        let options = ResizeExecOptions {
            height: size.rows,
            width: size.cols,
        };
        self.docker
            .resize_exec(exec_id, options)
            .await
            .map_err(docker_error(format!(
                "resizing the terminal of exec {exec_id}"
            )))
    }

    async fn exec_status(&self, exec_id: &str) -> Result<ExecStatus, RuntimeError> {
        let inspect = self
            .docker
            .inspect_exec(exec_id)
            .await
            .map_err(docker_error(format!("inspecting exec {exec_id}")))?;
        let running = inspect.running.unwrap_or(false);
        Ok(ExecStatus {
            running,
            exit_code: inspect.exit_code.filter(|_| !running),
            pid: inspect
                .pid
                .filter(|_| running)
                .and_then(|pid| u32::try_from(pid).ok())
                .filter(|pid| *pid > 0),
        })
    }
}

impl DockerRuntime {
    /// `PUT /containers/{id}/archive`: extracts `archive` at `dir`.
    async fn upload(
        &self,
        container_id: &str,
        dir: &str,
        archive: Vec<u8>,
    ) -> Result<(), RuntimeError> {
        let options = UploadToContainerOptionsBuilder::new().path(dir).build();
        self.docker
            .upload_to_container(
                container_id,
                Some(options),
                bollard::body_full(archive.into()),
            )
            .await
            .map_err(docker_error(format!(
                "copying files into {dir} of container {container_id}"
            )))
    }

    /// `GET /containers/{id}/archive`: `path` as a tar archive, `None` on 404.
    async fn download(
        &self,
        container_id: &str,
        path: &str,
    ) -> Result<Option<Vec<u8>>, RuntimeError> {
        let options = DownloadFromContainerOptionsBuilder::new()
            .path(path)
            .build();
        let chunks: Result<Vec<_>, _> = self
            .docker
            .download_from_container(container_id, Some(options))
            .try_collect()
            .await;
        match chunks {
            Ok(chunks) => Ok(Some(chunks.concat())),
            Err(e) if is_status(&e, 404) => Ok(None),
            Err(e) => Err(docker_error(format!(
                "reading {path} of container {container_id}"
            ))(e)),
        }
    }
}

/// `command` behind a shell that first sets the terminal's size. Before API 1.42 Docker starts
/// an exec's terminal at 0×0 and can resize it only once the process runs, so a quick command
/// (`stty size`, `tput cols`) would see no size. `exec` keeps the process's PID.
fn with_initial_size(size: TtySize, command: Vec<String>) -> Vec<String> {
    let mut wrapped = vec![
        "/bin/sh".to_owned(),
        "-c".to_owned(),
        r#"stty rows "$1" cols "$2" 2>/dev/null; shift 2; exec "$@""#.to_owned(),
        "sh".to_owned(),
        size.rows.to_string(),
        size.cols.to_string(),
    ];
    wrapped.extend(command);
    wrapped
}

impl ContainerRuntime for DockerRuntime {
    fn list(&self) -> BoxFuture<'_, Result<Vec<ContainerStatus>, RuntimeError>> {
        Box::pin(self.list_statuses())
    }

    fn create<'a>(
        &'a self,
        spec: &'a ContainerSpec,
    ) -> BoxFuture<'a, Result<String, RuntimeError>> {
        Box::pin(self.create_dev_container(spec))
    }

    fn start<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), RuntimeError>> {
        Box::pin(self.start_container(id))
    }

    fn stop<'a>(
        &'a self,
        id: &'a str,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<(), RuntimeError>> {
        Box::pin(self.stop_container(id, timeout))
    }

    fn remove<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), RuntimeError>> {
        Box::pin(self.remove_container(id))
    }

    fn session_container(
        &self,
        session_id: SessionId,
    ) -> BoxFuture<'_, Result<Option<SessionContainer>, RuntimeError>> {
        Box::pin(self.find_session_container(session_id))
    }

    fn start_exec<'a>(
        &'a self,
        container_id: &'a str,
        spec: &'a ExecSpec,
    ) -> BoxFuture<'a, Result<ExecProcess, RuntimeError>> {
        Box::pin(async move {
            if let Some(direct) = &self.direct {
                match direct.start(container_id, spec).await {
                    Ok(process) => return Ok(process),
                    Err(DirectError::Failed(e)) => return Err(e),
                    Err(DirectError::Unavailable(why)) => direct.note_fallback(container_id, &why),
                }
            }
            self.exec_in(container_id, spec).await
        })
    }

    fn resize_exec<'a>(
        &'a self,
        exec_id: &'a str,
        size: TtySize,
    ) -> BoxFuture<'a, Result<(), RuntimeError>> {
        Box::pin(async move {
            match &self.direct {
                Some(direct) if DirectExec::owns(exec_id) => direct.resize(exec_id, size),
                _ => self.resize(exec_id, size).await,
            }
        })
    }

    fn inspect_exec<'a>(
        &'a self,
        exec_id: &'a str,
    ) -> BoxFuture<'a, Result<ExecStatus, RuntimeError>> {
        Box::pin(async move {
            match &self.direct {
                Some(direct) if DirectExec::owns(exec_id) => direct.status(exec_id),
                _ => self.exec_status(exec_id).await,
            }
        })
    }

    fn upload_archive<'a>(
        &'a self,
        container_id: &'a str,
        dir: &'a str,
        archive: Vec<u8>,
    ) -> BoxFuture<'a, Result<(), RuntimeError>> {
        Box::pin(self.upload(container_id, dir, archive))
    }

    fn download_archive<'a>(
        &'a self,
        container_id: &'a str,
        path: &'a str,
    ) -> BoxFuture<'a, Result<Option<Vec<u8>>, RuntimeError>> {
        Box::pin(self.download(container_id, path))
    }

    fn exits(&self) -> BoxStream<'_, ()> {
        let filters = HashMap::from([
            ("type".to_owned(), vec!["container".to_owned()]),
            ("event".to_owned(), vec!["die".to_owned()]),
            (
                "label".to_owned(),
                vec![
                    format!("{LABEL_MANAGED}=true"),
                    format!("{LABEL_NODE}={}", self.node),
                ],
            ),
        ]);
        let options = bollard::query_parameters::EventsOptions {
            filters: Some(filters),
            ..Default::default()
        };
        self.docker
            .events(Some(options))
            .take_while(|event| std::future::ready(event.is_ok()))
            .map(|_| ())
            .boxed()
    }

    fn cpu_time<'a>(
        &'a self,
        container: &'a ContainerStatus,
    ) -> BoxFuture<'a, Result<Option<Duration>, RuntimeError>> {
        Box::pin(self.container_cpu_time(container))
    }

    fn commit_to_image<'a>(
        &'a self,
        id: &'a str,
        reference: &'a str,
    ) -> BoxFuture<'a, Result<String, RuntimeError>> {
        Box::pin(self.commit_container(id, reference))
    }

    fn image_exists<'a>(&'a self, reference: &'a str) -> BoxFuture<'a, Result<bool, RuntimeError>> {
        Box::pin(self.has_image(reference))
    }

    fn untag_image<'a>(&'a self, reference: &'a str) -> BoxFuture<'a, Result<(), RuntimeError>> {
        Box::pin(self.remove_image_reference(reference))
    }

    fn remove_tag<'a>(&'a self, reference: &'a str) -> BoxFuture<'a, Result<bool, RuntimeError>> {
        Box::pin(self.force_remove_tag(reference))
    }

    fn freeze_commit<'a>(
        &'a self,
        container_id: &'a str,
        spec: &'a super::CommitSpec,
    ) -> BoxFuture<'a, Result<String, RuntimeError>> {
        Box::pin(self.commit_for_freeze(container_id, spec))
    }

    fn image_details<'a>(
        &'a self,
        reference: &'a str,
    ) -> BoxFuture<'a, Result<Option<super::ImageDetails>, RuntimeError>> {
        Box::pin(self.inspect_image_details(reference))
    }

    fn create_export_container<'a>(
        &'a self,
        image: &'a str,
        name: &'a str,
        labels: &'a std::collections::BTreeMap<String, String>,
    ) -> BoxFuture<'a, Result<String, RuntimeError>> {
        Box::pin(self.create_export(image, name, labels))
    }

    fn export_container(
        &self,
        container_id: &str,
    ) -> futures::stream::BoxStream<'static, Result<Vec<u8>, RuntimeError>> {
        let action = format!("exporting the filesystem of container {container_id}");
        self.docker
            .export_container(container_id)
            .map(move |chunk| {
                chunk
                    .map(|bytes| bytes.to_vec())
                    .map_err(|e| docker_error(action.clone())(e))
            })
            .boxed()
    }

    fn tag_image<'a>(
        &'a self,
        image: &'a str,
        repository: &'a str,
        tag: &'a str,
    ) -> BoxFuture<'a, Result<(), RuntimeError>> {
        Box::pin(self.tag(image, repository, tag))
    }

    fn remove_image_id<'a>(&'a self, image_id: &'a str) -> BoxFuture<'a, Result<(), RuntimeError>> {
        Box::pin(self.remove_image_by_id(image_id))
    }

    fn images_labelled<'a>(
        &'a self,
        label: &'a str,
        value: &'a str,
    ) -> BoxFuture<'a, Result<Vec<String>, RuntimeError>> {
        Box::pin(async move {
            let filter = format!("{label}={value}");
            let filters = HashMap::from([("label", vec![filter.as_str()])]);
            let options = bollard::query_parameters::ListImagesOptionsBuilder::new()
                .all(true)
                .filters(&filters)
                .build();
            let images = self
                .docker
                .list_images(Some(options))
                .await
                .map_err(docker_error(format!(
                    "listing the images labelled {filter}"
                )))?;
            Ok(images.into_iter().map(|image| image.id).collect())
        })
    }

    fn list_networks(&self) -> BoxFuture<'_, Result<Vec<NetworkStatus>, RuntimeError>> {
        Box::pin(self.list_session_networks())
    }

    fn ensure_network<'a>(
        &'a self,
        spec: &'a NetworkSpec,
    ) -> BoxFuture<'a, Result<(), RuntimeError>> {
        Box::pin(self.ensure_session_network(spec))
    }

    fn remove_network<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), RuntimeError>> {
        Box::pin(self.remove_session_network(id))
    }

    fn node_resources(&self) -> BoxFuture<'_, Result<NodeResources, RuntimeError>> {
        Box::pin(async move {
            let info = self.docker.info().await.map_err(docker_error(
                "reading the node's CPUs and memory".to_owned(),
            ))?;
            let positive = |v: Option<i64>| v.and_then(|v| u64::try_from(v).ok()).unwrap_or(0);
            Ok(NodeResources {
                millicpus: positive(info.ncpu).saturating_mul(1000),
                memory_bytes: positive(info.mem_total),
            })
        })
    }

    fn daemon(&self) -> BoxFuture<'_, Result<DaemonInfo, RuntimeError>> {
        Box::pin(async move {
            // A client of its own, so that no pooled connection answers: a stopping dockerd
            // has closed its socket but still serves the connections it had.
            let unreachable = |e: BollardError| RuntimeError::Unreachable(Box::new(e));
            let fresh = Docker::connect_with_local_defaults().map_err(unreachable)?;
            let fresh = fresh.negotiate_version().await.map_err(unreachable)?;
            let info = fresh.info().await.map_err(unreachable)?;
            Ok(DaemonInfo {
                live_restore: info.live_restore_enabled.unwrap_or(false),
            })
        })
    }

    fn list_jobs(&self) -> BoxFuture<'_, Result<Vec<JobContainerStatus>, RuntimeError>> {
        Box::pin(self.list_job_containers())
    }

    fn create_job<'a>(
        &'a self,
        spec: &'a JobContainerSpec,
    ) -> BoxFuture<'a, Result<String, RuntimeError>> {
        Box::pin(self.create_job_container(spec))
    }

    fn signal<'a>(
        &'a self,
        id: &'a str,
        signal: &'a str,
    ) -> BoxFuture<'a, Result<(), RuntimeError>> {
        Box::pin(self.kill_with(id, signal))
    }

    fn follow_logs(&self, id: &str) -> BoxStream<'static, Result<Vec<u8>, RuntimeError>> {
        let options = bollard::query_parameters::LogsOptionsBuilder::new()
            .follow(true)
            .stdout(true)
            .stderr(true)
            .build();
        let action = format!("reading the output of container {id}");
        self.docker
            .logs(id, Some(options))
            .map(move |item| match item {
                Ok(output) => Ok(output.into_bytes().to_vec()),
                Err(e) => Err(docker_error(action.clone())(e)),
            })
            .boxed()
    }

    fn import_image<'a>(
        &'a self,
        reference: &'a str,
        config: &'a ImportConfig,
        tar: BoxStream<'static, Result<Vec<u8>, std::io::Error>>,
    ) -> BoxFuture<'a, Result<(), RuntimeError>> {
        Box::pin(self.import(reference, config, tar))
    }
}

/// Batch jobs: their containers, signals, output, and images imported from SIF files.
impl DockerRuntime {
    async fn list_job_containers(&self) -> Result<Vec<JobContainerStatus>, RuntimeError> {
        let summaries = self
            .list_node_containers(&[LABEL_JOB], "job containers")
            .await?;
        let mut statuses = Vec::with_capacity(summaries.len());
        for summary in summaries {
            let Some(id) = summary.id else { continue };
            let Some(job_id) = summary
                .labels
                .as_ref()
                .and_then(|labels| labels.get(LABEL_JOB))
                .and_then(|value| value.parse::<uuid::Uuid>().ok())
                .map(JobId)
            else {
                continue;
            };
            let inspect = match self
                .docker
                .inspect_container(&id, Some(InspectContainerOptionsBuilder::new().build()))
                .await
            {
                Ok(inspect) => inspect,
                Err(e) if is_status(&e, 404) => continue,
                Err(e) => return Err(docker_error(format!("inspecting container {id}"))(e)),
            };
            let name = inspect
                .name
                .as_deref()
                .unwrap_or_default()
                .trim_start_matches('/')
                .to_owned();
            let state = inspect.state.unwrap_or_default();
            let time = |value: Option<&String>| {
                value
                    .and_then(|v| chrono::DateTime::parse_from_rfc3339(v).ok())
                    .map(|t| t.with_timezone(&chrono::Utc))
                    .filter(|t| t.timestamp() > 0)
            };
            let started_at = time(state.started_at.as_ref());
            let state = match (state.status, started_at) {
                (Some(ContainerStateStatusEnum::CREATED), _) | (_, None) => {
                    JobContainerState::Created
                }
                (
                    Some(
                        ContainerStateStatusEnum::RUNNING
                        | ContainerStateStatusEnum::PAUSED
                        | ContainerStateStatusEnum::RESTARTING,
                    ),
                    Some(started_at),
                ) => JobContainerState::Running { started_at },
                (_, Some(started_at)) => JobContainerState::Exited {
                    started_at,
                    // Docker takes the two from different places (the daemon once the start
                    // returned, containerd's exit event): a container that exits at once can
                    // read as finished microseconds before it started. A run never lasts less
                    // than nothing (its usage is charged by its length).
                    finished_at: time(state.finished_at.as_ref())
                        .unwrap_or(started_at)
                        .max(started_at),
                    exit_code: state.exit_code.unwrap_or(0),
                    oom_killed: state.oom_killed.unwrap_or(false),
                },
            };
            statuses.push(JobContainerStatus {
                id,
                name,
                job_id,
                state,
            });
        }
        Ok(statuses)
    }

    async fn create_job_container(&self, job: &JobContainerSpec) -> Result<String, RuntimeError> {
        let spec = job.as_container_spec();
        let image_id = match self.docker.inspect_image(&spec.image).await {
            Ok(image) => image.id,
            Err(e) if is_status(&e, 404) => {
                return Err(RuntimeError::ImageMissing {
                    image: spec.image.clone(),
                    node: self.node.clone(),
                })
            }
            Err(e) => return Err(docker_error(format!("inspecting image {}", spec.image))(e)),
        };
        if job.mount_home {
            self.ensure_home(&spec).await?;
        } else if let Some(problem) = super::site_dirs::missing_source(&spec.binds, &spec.user) {
            return Err(RuntimeError::Setup {
                action: format!("mounting site storage into container {}", spec.name),
                problem,
            });
        }
        let options = CreateContainerOptionsBuilder::new()
            .name(&spec.name)
            .build();
        let created = self
            .docker
            .create_container(Some(options), job_create_body(job))
            .await
            .map_err(docker_error(format!("creating container {}", spec.name)))?;
        for warning in &created.warnings {
            info!(container = %spec.name, %warning, "Docker warned while creating the container.");
        }
        if let Err(e) = self
            .install_user(&created.id, image_id.as_deref(), &spec)
            .await
        {
            // Never started, so removing it cannot lose a run: the next pass creates it again.
            let _ = self.remove_container(&created.id).await;
            return Err(e);
        }
        Ok(created.id)
    }

    async fn kill_with(&self, id: &str, signal: &str) -> Result<(), RuntimeError> {
        let options = bollard::query_parameters::KillContainerOptionsBuilder::new()
            .signal(signal)
            .build();
        match self.docker.kill_container(id, Some(options)).await {
            Ok(()) => Ok(()),
            // Gone, or not running (any more).
            Err(e) if is_status(&e, 404) || is_status(&e, 409) => Ok(()),
            Err(e) => Err(docker_error(format!("sending {signal} to container {id}"))(
                e,
            )),
        }
    }

    async fn import(
        &self,
        reference: &str,
        config: &ImportConfig,
        tar: BoxStream<'static, Result<Vec<u8>, std::io::Error>>,
    ) -> Result<(), RuntimeError> {
        let (repository, tag) = split_reference(reference);
        let options = bollard::query_parameters::CreateImageOptionsBuilder::new()
            .from_src("-")
            .repo(repository)
            .tag(tag)
            .changes(config.changes())
            .build();
        let body = bollard::body_try_stream(tar.map_ok(Into::into));
        let action = format!("importing image {reference}");
        let mut progress = self.docker.create_image(Some(options), Some(body), None);
        while let Some(item) = progress.next().await {
            item.map_err(docker_error(action.clone()))?;
        }
        info!(image = %reference, "Imported image.");
        Ok(())
    }
}

/// Whether Docker labels mark a batch job's container or network.
fn is_job(labels: Option<&HashMap<String, String>>) -> bool {
    labels.is_some_and(|labels| labels.contains_key(LABEL_JOB))
}

/// `repository` and `tag` of `repository[:tag]` (`latest` when there is none).
fn split_reference(reference: &str) -> (&str, &str) {
    match reference.rsplit_once(':') {
        Some((repository, tag)) if !tag.contains('/') => (repository, tag),
        _ => (reference, "latest"),
    }
}

/// Docker's create request for a batch job's container: the dev container's hardening
/// ([`create_body`]: user, no capabilities, no-new-privileges, limits, its own network, no
/// restart policy, tini as PID 1 so signals reach the job), with the job's command under the
/// image's entrypoint, the chain's working directory, and the home volume only when asked.
pub fn job_create_body(job: &JobContainerSpec) -> ContainerCreateBody {
    let spec = job.as_container_spec();
    let mut body = create_body(&spec);
    body.entrypoint = None;
    body.working_dir = Some(ongrid_core::job::WORK_DIR_IN_CONTAINER.to_owned());
    let mut mounts = vec![Mount {
        typ: Some(MountTypeEnum::BIND),
        source: Some(job.work_dir.display().to_string()),
        target: Some(ongrid_core::job::WORK_DIR_IN_CONTAINER.to_owned()),
        read_only: Some(false),
        ..Default::default()
    }];
    if job.mount_home {
        mounts.push(home_mount(&spec));
    }
    mounts.extend(spec.binds.iter().map(bind_mount));
    if let Some(host) = body.host_config.as_mut() {
        host.mounts = Some(mounts);
    }
    body
}

/// Session networks: one bridge per session, see `crate::network`.
impl DockerRuntime {
    async fn list_session_networks(&self) -> Result<Vec<NetworkStatus>, RuntimeError> {
        let filters = HashMap::from([(
            "label",
            vec![
                format!("{LABEL_MANAGED}=true"),
                format!("{LABEL_NODE}={}", self.node),
            ],
        )]);
        let options = ListNetworksOptionsBuilder::new().filters(&filters).build();
        let networks = self
            .docker
            .list_networks(Some(options))
            .await
            .map_err(docker_error("listing ongrid networks".to_owned()))?;
        Ok(networks
            .into_iter()
            .filter(|network| !is_job(network.labels.as_ref()))
            .filter_map(|network| {
                let session_id = network
                    .labels
                    .as_ref()
                    .and_then(|labels| labels.get(LABEL_SESSION))
                    .and_then(|value| value.parse::<SessionId>().ok());
                Some(NetworkStatus {
                    id: network.id?,
                    name: network.name.unwrap_or_default(),
                    session_id,
                })
            })
            .collect())
    }

    async fn ensure_session_network(&self, spec: &NetworkSpec) -> Result<(), RuntimeError> {
        match self
            .docker
            .inspect_network(&spec.name, None::<InspectNetworkOptions>)
            .await
        {
            Ok(_) => return Ok(()),
            Err(e) if is_status(&e, 404) => {}
            Err(e) => return Err(docker_error(format!("inspecting network {}", spec.name))(e)),
        }
        let action = format!("creating network {}", spec.name);
        let all = self
            .docker
            .list_networks(None::<bollard::query_parameters::ListNetworksOptions>)
            .await
            .map_err(docker_error(action.clone()))?;
        let mut used: Vec<Ipv4Net> = all
            .iter()
            .filter_map(|network| network.ipam.as_ref()?.config.as_ref())
            .flatten()
            .filter_map(|config| config.subnet.as_deref()?.parse().ok())
            .collect();
        let claim = {
            let mut claimed = self
                .claimed_subnets
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            used.extend(claimed.iter().copied());
            let subnet = crate::network::pick_subnet(spec.subnet_pool, spec.session_id, &used)
                .ok_or_else(|| RuntimeError::Setup {
                    action: action.clone(),
                    problem: format!(
                        "no free /{} left in subnet_pool {}: give [network] subnet_pool a larger range",
                        crate::network::SESSION_SUBNET_PREFIX,
                        spec.subnet_pool
                    ),
                })?;
            claimed.push(subnet);
            SubnetClaim {
                claimed: self.claimed_subnets.clone(),
                subnet,
            }
        };
        let subnet = claim.subnet;
        let request = NetworkCreateRequest {
            name: spec.name.clone(),
            driver: Some("bridge".to_owned()),
            internal: Some(false),
            attachable: Some(false),
            enable_ipv6: Some(false),
            ipam: Some(Ipam {
                driver: Some("default".to_owned()),
                config: Some(vec![IpamConfig {
                    subnet: Some(subnet.to_string()),
                    gateway: Some(subnet.host(1).to_string()),
                    ..Default::default()
                }]),
                options: None,
            }),
            options: Some(spec.driver_options().into_iter().collect()),
            labels: Some(spec.labels.clone().into_iter().collect()),
            ..Default::default()
        };
        self.docker
            .create_network(request)
            .await
            .map_err(docker_error(action))?;
        // Docker lists it from now on.
        drop(claim);
        info!(network = %spec.name, bridge = %spec.bridge, %subnet, "Created session network.");
        Ok(())
    }

    async fn remove_session_network(&self, id: &str) -> Result<(), RuntimeError> {
        match self.docker.remove_network(id).await {
            Ok(()) => Ok(()),
            Err(e) if is_status(&e, 404) => Ok(()),
            Err(e) => Err(docker_error(format!("removing network {id}"))(e)),
        }
    }
}

/// Session lifecycle: CPU time for activity sampling, and the held image of a release onto
/// other GPUs.
impl DockerRuntime {
    /// The container's cumulative CPU time from its cgroup's counter ([`CgroupFs`]), else
    /// from Docker's stats ([`Self::stats_cpu_time`]).
    async fn container_cpu_time(
        &self,
        container: &ContainerStatus,
    ) -> Result<Option<Duration>, RuntimeError> {
        if let Some(used) = self.cgroup_cpu_time(container).await {
            return Ok(Some(used));
        }
        self.stats_cpu_time(&container.id).await
    }

    /// The container's cumulative CPU time from one `stats` sample (`stream=false`,
    /// `one-shot=true`: no second sample for a delta, which the caller computes between syncs),
    /// answered at the stats collector's next sample (about a second).
    pub async fn stats_cpu_time(&self, id: &str) -> Result<Option<Duration>, RuntimeError> {
        let options = StatsOptionsBuilder::new()
            .stream(false)
            .one_shot(true)
            .build();
        let mut stats = self.docker.stats(id, Some(options));
        let sample = match stats.next().await {
            None => return Ok(None),
            Some(Ok(sample)) => sample,
            Some(Err(e)) if is_status(&e, 404) => return Ok(None),
            Some(Err(e)) => {
                return Err(docker_error(format!(
                    "reading the CPU use of container {id}"
                ))(e))
            }
        };
        // A container that does not run answers with zeroes; one that runs has used some CPU
        // (its init at least).
        let nanoseconds = sample
            .cpu_stats
            .and_then(|cpu| cpu.cpu_usage)
            .and_then(|usage| usage.total_usage)
            .filter(|used| *used > 0);
        Ok(nanoseconds.map(Duration::from_nanos))
    }

    /// The CPU time of a running container read from its cgroup's counter, through the PID
    /// and full id its listing read (no call to Docker); `None` when it does not run or the
    /// counter cannot be read here.
    async fn cgroup_cpu_time(&self, container: &ContainerStatus) -> Option<Duration> {
        if container.state != ContainerState::Running {
            return None;
        }
        let pid = container.pid?;
        let used = self.cgroup_fs.cpu_time(&container.id, pid).await;
        if used.is_none() {
            debug!(
                container = container.id,
                pid,
                "The container's cgroup CPU counter cannot be read here; asking Docker's stats."
            );
        }
        used
    }

    async fn commit_container(&self, id: &str, reference: &str) -> Result<String, RuntimeError> {
        let (repo, tag) = reference.rsplit_once(':').unwrap_or((reference, "latest"));
        let options = CommitContainerOptionsBuilder::new()
            .container(id)
            .repo(repo)
            .tag(tag)
            .comment("ongrid: a held dev container, kept while it moves to other GPUs")
            .pause(true)
            .build();
        let committed = self
            .docker
            .commit_container(options, bollard::models::ContainerConfig::default())
            .await
            .map_err(docker_error(format!(
                "committing container {id} to image {reference}"
            )))?;
        Ok(committed.id)
    }

    async fn has_image(&self, reference: &str) -> Result<bool, RuntimeError> {
        match self.docker.inspect_image(reference).await {
            Ok(_) => Ok(true),
            Err(e) if is_status(&e, 404) => Ok(false),
            Err(e) => Err(docker_error(format!("inspecting image {reference}"))(e)),
        }
    }

    /// `docker rmi --force <reference>`: with a container using the image, Docker only
    /// removes the tag.
    async fn force_remove_tag(&self, reference: &str) -> Result<bool, RuntimeError> {
        let options = bollard::query_parameters::RemoveImageOptionsBuilder::new()
            .force(true)
            .build();
        match self
            .docker
            .remove_image(reference, Some(options), None)
            .await
        {
            Ok(_) => Ok(true),
            Err(e) if is_status(&e, 404) => Ok(false),
            Err(e) => Err(docker_error(format!("removing image tag {reference}"))(e)),
        }
    }

    async fn remove_image_reference(&self, reference: &str) -> Result<(), RuntimeError> {
        match self
            .docker
            .remove_image(
                reference,
                None::<bollard::query_parameters::RemoveImageOptions>,
                None,
            )
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if is_status(&e, 404) => Ok(()),
            Err(e) => Err(docker_error(format!("removing image {reference}"))(e)),
        }
    }
}

/// The GPUs of an `ongrid.gpus` label: comma-separated UUIDs (none for an empty label).
fn parse_gpu_label(value: &str) -> Option<Vec<ongrid_core::GpuId>> {
    value
        .split(',')
        .filter(|part| !part.is_empty())
        .map(|part| ongrid_core::GpuId::parse(part.trim()).ok())
        .collect()
}

/// Freeze: the commit with the image configuration the frozen image should have, the export
/// container, tags.
impl DockerRuntime {
    async fn commit_for_freeze(
        &self,
        container_id: &str,
        spec: &super::CommitSpec,
    ) -> Result<String, RuntimeError> {
        let options = bollard::query_parameters::CommitContainerOptionsBuilder::new()
            .container(container_id)
            .comment(&spec.comment)
            .author("ongrid freeze")
            .pause(true)
            .build();
        let non_empty = |v: &Vec<String>| (!v.is_empty()).then(|| v.clone());
        let config = bollard::models::ContainerConfig {
            entrypoint: non_empty(&spec.entrypoint),
            cmd: non_empty(&spec.cmd),
            working_dir: (!spec.working_dir.is_empty()).then(|| spec.working_dir.clone()),
            labels: Some(spec.labels.clone().into_iter().collect()),
            ..Default::default()
        };
        let committed = self
            .docker
            .commit_container(options, config)
            .await
            .map_err(docker_error(format!("committing container {container_id}")))?;
        Ok(committed.id)
    }

    async fn inspect_image_details(
        &self,
        reference: &str,
    ) -> Result<Option<super::ImageDetails>, RuntimeError> {
        let inspect = match self.docker.inspect_image(reference).await {
            Ok(inspect) => inspect,
            Err(e) if is_status(&e, 404) => return Ok(None),
            Err(e) => return Err(docker_error(format!("inspecting image {reference}"))(e)),
        };
        let config = inspect.config.unwrap_or_default();
        Ok(Some(super::ImageDetails {
            id: inspect.id.unwrap_or_default(),
            size: inspect
                .size
                .and_then(|s| u64::try_from(s).ok())
                .unwrap_or(0),
            env: config.env.unwrap_or_default(),
            working_dir: config.working_dir.filter(|w| !w.is_empty()),
            entrypoint: config.entrypoint.unwrap_or_default(),
            cmd: config.cmd.unwrap_or_default(),
            user: config.user.filter(|u| !u.is_empty()),
            labels: config.labels.unwrap_or_default().into_iter().collect(),
        }))
    }

    async fn create_export(
        &self,
        image: &str,
        name: &str,
        labels: &std::collections::BTreeMap<String, String>,
    ) -> Result<String, RuntimeError> {
        let options = CreateContainerOptionsBuilder::new().name(name).build();
        let body = ContainerCreateBody {
            image: Some(image.to_owned()),
            entrypoint: Some(vec![String::new()]),
            cmd: Some(vec!["true".to_owned()]),
            labels: Some(labels.clone().into_iter().collect()),
            network_disabled: Some(true),
            host_config: Some(HostConfig {
                network_mode: Some("none".to_owned()),
                ..Default::default()
            }),
            ..Default::default()
        };
        let created = self
            .docker
            .create_container(Some(options), body)
            .await
            .map_err(docker_error(format!(
                "creating container {name} to export image {image}"
            )))?;
        Ok(created.id)
    }

    async fn tag(&self, image: &str, repository: &str, tag: &str) -> Result<(), RuntimeError> {
        let options = bollard::query_parameters::TagImageOptionsBuilder::new()
            .repo(repository)
            .tag(tag)
            .build();
        self.docker
            .tag_image(image, Some(options))
            .await
            .map_err(docker_error(format!(
                "tagging image {image} as {repository}:{tag}"
            )))
    }

    async fn remove_image_by_id(&self, image_id: &str) -> Result<(), RuntimeError> {
        let options = bollard::query_parameters::RemoveImageOptionsBuilder::new()
            .force(true)
            .build();
        match self
            .docker
            .remove_image(image_id, Some(options), None)
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if is_status(&e, 404) => Ok(()),
            Err(e) => Err(docker_error(format!("removing image {image_id}"))(e)),
        }
    }
}

/// Docker's create request for the dev container of `spec`.
pub fn create_body(spec: &ContainerSpec) -> ContainerCreateBody {
    let device_requests = match spec.gpu_access {
        GpuAccess::EnvironmentOnly => None,
        GpuAccess::NvidiaDeviceRequest => Some(vec![DeviceRequest {
            driver: Some("nvidia".to_owned()),
            device_ids: Some(spec.gpus.iter().map(|g| g.as_str().to_owned()).collect()),
            capabilities: Some(vec![vec!["gpu".to_owned()]]),
            ..Default::default()
        }]),
    };
    let positive = |value: u64| i64::try_from(value).ok().filter(|v| *v > 0);
    let memory = positive(spec.limits.memory.bytes());
    ContainerCreateBody {
        image: Some(spec.image.clone()),
        hostname: Some(spec.hostname.clone()),
        user: Some(format!("{uid}:{uid}", uid = spec.user.uid)),
        working_dir: Some(spec.home_dir.clone()),
        env: Some(spec.env.iter().map(|(k, v)| format!("{k}={v}")).collect()),
        // `[""]` resets the image's entrypoint; the command alone keeps the container alive.
        entrypoint: Some(vec![String::new()]),
        cmd: Some(spec.command.clone()),
        labels: Some(spec.labels.clone().into_iter().collect()),
        host_config: Some(HostConfig {
            mounts: Some(
                std::iter::once(home_mount(spec))
                    .chain(spec.binds.iter().map(bind_mount))
                    .collect(),
            ),
            // The session's own network, and no IPv6 in it: the node's firewall rules for
            // session networks are IPv4 (see `crate::network`).
            network_mode: Some(spec.network.clone()),
            sysctls: Some(HashMap::from([(
                "net.ipv6.conf.all.disable_ipv6".to_owned(),
                "1".to_owned(),
            )])),
            device_requests,
            nano_cpus: positive(u64::from(spec.limits.millicpus) * 1_000_000),
            memory,
            // Equal to the memory limit: no swap beyond it.
            memory_swap: memory,
            pids_limit: positive(u64::from(spec.limits.pids)),
            security_opt: Some(vec!["no-new-privileges".to_owned()]),
            cap_drop: Some(vec!["ALL".to_owned()]),
            privileged: Some(false),
            init: Some(true),
            restart_policy: Some(RestartPolicy {
                name: Some(RestartPolicyNameEnum::NO),
                maximum_retry_count: None,
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The home at `/home/<login>`: a volume without Docker's copy-up (the working directory Docker
/// creates for the container would otherwise be copied into a new volume with root as owner),
/// or a directory of site storage.
fn home_mount(spec: &ContainerSpec) -> Mount {
    match &spec.home {
        Home::Volume(volume) => Mount {
            typ: Some(MountTypeEnum::VOLUME),
            source: Some(volume.clone()),
            target: Some(spec.home_dir.clone()),
            read_only: Some(false),
            volume_options: Some(MountVolumeOptions {
                no_copy: Some(true),
                ..Default::default()
            }),
            ..Default::default()
        },
        Home::Directory { path, .. } => bind_mount(&BindMount {
            source: path.clone(),
            target: spec.home_dir.clone(),
            read_only: false,
            propagation: Propagation::Private,
        }),
    }
}

/// A directory of the node in the container. Docker's `Mount` API refuses a source that does
/// not exist (never making it as root, as `-v` would).
fn bind_mount(bind: &BindMount) -> Mount {
    let propagation = match bind.propagation {
        Propagation::Private => None,
        Propagation::Slave => Some(MountBindOptionsPropagationEnum::RSLAVE),
        Propagation::Shared => Some(MountBindOptionsPropagationEnum::RSHARED),
    };
    Mount {
        typ: Some(MountTypeEnum::BIND),
        source: Some(bind.source.display().to_string()),
        target: Some(bind.target.clone()),
        read_only: Some(bind.read_only),
        bind_options: propagation.map(|propagation| MountBindOptions {
            propagation: Some(propagation),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The helper that gives a new home volume to the user: root, but only `CAP_CHOWN`, no network.
fn chown_helper_body(spec: &ContainerSpec, node: &NodeName) -> ContainerCreateBody {
    let owner = format!("{uid}:{uid}", uid = spec.user.uid);
    ContainerCreateBody {
        image: Some(spec.image.clone()),
        user: Some("0:0".to_owned()),
        entrypoint: Some(vec![String::new()]),
        cmd: Some(vec!["chown".to_owned(), owner, spec.home_dir.clone()]),
        labels: Some(HashMap::from([
            (LABEL_MANAGED.to_owned(), "true".to_owned()),
            (LABEL_NODE.to_owned(), node.to_string()),
            (LABEL_HELPER.to_owned(), "chown-home".to_owned()),
        ])),
        host_config: Some(HostConfig {
            mounts: Some(vec![home_mount(spec)]),
            network_mode: Some("none".to_owned()),
            cap_drop: Some(vec!["ALL".to_owned()]),
            cap_add: Some(vec!["CHOWN".to_owned()]),
            security_opt: Some(vec!["no-new-privileges".to_owned()]),
            restart_policy: Some(RestartPolicy {
                name: Some(RestartPolicyNameEnum::NO),
                maximum_retry_count: None,
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn is_status(error: &BollardError, status: u16) -> bool {
    matches!(error, BollardError::DockerResponseServerError { status_code, .. } if *status_code == status)
}

fn docker_error(action: String) -> impl FnOnce(BollardError) -> RuntimeError {
    move |e| {
        debug!(%action, error = %e, "Docker call failed.");
        RuntimeError::Docker {
            action,
            source: Box::new(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::fake::desired_session;

    fn spec(access: GpuAccess) -> ContainerSpec {
        let node = NodeName::parse("node1").unwrap();
        let session = desired_session(&["GPU-11111111-2222-3333-4444-555555555501"]);
        ContainerSpec::for_session(&node, &session, access)
    }

    #[test]
    fn dev_container_is_hardened() {
        let spec = spec(GpuAccess::EnvironmentOnly);
        let body = create_body(&spec);
        assert_eq!(body.user.as_deref(), Some("20001:20001"));
        assert_eq!(body.hostname.as_deref(), Some("train1"));
        assert_eq!(
            body.cmd,
            Some(vec!["sleep".to_owned(), "infinity".to_owned()])
        );
        let host = body.host_config.unwrap();
        assert_eq!(host.cap_drop, Some(vec!["ALL".to_owned()]));
        assert_eq!(host.cap_add, None);
        assert_eq!(
            host.security_opt,
            Some(vec!["no-new-privileges".to_owned()])
        );
        assert_eq!(host.privileged, Some(false));
        assert_eq!(host.init, Some(true));
        assert_eq!(host.binds, None);
        assert_eq!(host.nano_cpus, Some(1_500_000_000));
        assert_eq!(host.memory, Some(2 << 30));
        assert_eq!(host.pids_limit, Some(512));
        assert_eq!(
            host.restart_policy.and_then(|p| p.name),
            Some(RestartPolicyNameEnum::NO)
        );
        let mounts = host.mounts.unwrap();
        assert_eq!(mounts.len(), 1);
        assert_eq!(mounts[0].source.as_deref(), Some("ongrid-home-alice-smith"));
        assert_eq!(mounts[0].target.as_deref(), Some("/home/alice-smith"));
        assert_eq!(mounts[0].typ, Some(MountTypeEnum::VOLUME));
        let no_copy = mounts[0].volume_options.as_ref().and_then(|o| o.no_copy);
        assert_eq!(
            no_copy,
            Some(true),
            "copy-up would give the new home to root"
        );
        assert_eq!(host.device_requests, None);
    }

    #[test]
    fn site_storage_is_bind_mounted_and_the_home_too() {
        let mut spec = spec(GpuAccess::EnvironmentOnly);
        spec.home = Home::Directory {
            path: "/site/home/alice-smith".into(),
            root: "/site/home".into(),
            mode: 0o700,
        };
        spec.binds = vec![
            BindMount {
                source: "/cvmfs".into(),
                target: "/cvmfs".into(),
                read_only: true,
                propagation: Propagation::Slave,
            },
            BindMount {
                source: "/site/scratch/alice-smith".into(),
                target: "/scratch".into(),
                read_only: false,
                propagation: Propagation::Private,
            },
        ];
        let bind =
            |source: &str,
             target: &str,
             read_only: bool,
             propagation: Option<MountBindOptionsPropagationEnum>| Mount {
                typ: Some(MountTypeEnum::BIND),
                source: Some(source.to_owned()),
                target: Some(target.to_owned()),
                read_only: Some(read_only),
                bind_options: propagation.map(|propagation| MountBindOptions {
                    propagation: Some(propagation),
                    ..Default::default()
                }),
                ..Default::default()
            };
        let expected = [
            bind("/site/home/alice-smith", "/home/alice-smith", false, None),
            bind(
                "/cvmfs",
                "/cvmfs",
                true,
                Some(MountBindOptionsPropagationEnum::RSLAVE),
            ),
            bind("/site/scratch/alice-smith", "/scratch", false, None),
        ];
        let host = create_body(&spec).host_config.unwrap();
        assert_eq!(host.mounts.unwrap(), expected);
        assert_eq!(host.binds, None);

        // A batch job: its working directory, the home only when asked, the site's mounts.
        let job = JobContainerSpec {
            job_id: JobId(uuid::Uuid::new_v4()),
            name: "ongrid-job-x".into(),
            image: spec.image.clone(),
            user: spec.user.clone(),
            labels: spec.labels.clone(),
            env: Vec::new(),
            gpus: spec.gpus.clone(),
            gpu_access: GpuAccess::EnvironmentOnly,
            limits: spec.limits,
            command: vec!["true".into()],
            network: spec.network.clone(),
            work_dir: "/var/lib/ongrid/jobs/chain".into(),
            mount_home: false,
            home: spec.home.clone(),
            binds: spec.binds.clone(),
        };
        let work = bind(
            "/var/lib/ongrid/jobs/chain",
            ongrid_core::job::WORK_DIR_IN_CONTAINER,
            false,
            None,
        );
        let mounts = |job: &JobContainerSpec| job_create_body(job).host_config.unwrap().mounts;
        assert_eq!(
            mounts(&job).unwrap(),
            [work.clone(), expected[1].clone(), expected[2].clone()]
        );
        let with_home = JobContainerSpec {
            mount_home: true,
            ..job
        };
        assert_eq!(
            mounts(&with_home).unwrap(),
            [
                work,
                expected[0].clone(),
                expected[1].clone(),
                expected[2].clone()
            ]
        );
    }

    #[test]
    fn nvidia_device_request_only_for_real_gpus() {
        let body = create_body(&spec(GpuAccess::NvidiaDeviceRequest));
        let requests = body.host_config.unwrap().device_requests.unwrap();
        assert_eq!(
            requests,
            vec![DeviceRequest {
                driver: Some("nvidia".to_owned()),
                device_ids: Some(vec!["GPU-11111111-2222-3333-4444-555555555501".to_owned()]),
                capabilities: Some(vec![vec!["gpu".to_owned()]]),
                ..Default::default()
            }]
        );
    }

    #[test]
    fn zero_limits_are_left_unset() {
        let mut spec = spec(GpuAccess::EnvironmentOnly);
        spec.limits.millicpus = 0;
        spec.limits.memory = ongrid_core::MemorySize(0);
        spec.limits.pids = 0;
        let host = create_body(&spec).host_config.unwrap();
        assert_eq!(
            (host.nano_cpus, host.memory, host.pids_limit),
            (None, None, None)
        );
    }

    #[test]
    fn initial_size_wrapper_keeps_the_command_whole() {
        let command = vec![
            "/bin/bash".to_owned(),
            "-c".to_owned(),
            "echo 'a b'".to_owned(),
        ];
        let wrapped = with_initial_size(
            TtySize {
                cols: 120,
                rows: 40,
            },
            command,
        );
        assert_eq!(wrapped[..2], ["/bin/sh", "-c"]);
        assert_eq!(
            wrapped[3..],
            ["sh", "40", "120", "/bin/bash", "-c", "echo 'a b'"]
        );
    }

    #[test]
    fn gpu_labels_parse_back() {
        let spec = spec(GpuAccess::EnvironmentOnly);
        let label = &create_body(&spec).labels.unwrap()[LABEL_GPUS];
        assert_eq!(parse_gpu_label(label), Some(spec.gpus.clone()));
        assert_eq!(parse_gpu_label(""), Some(Vec::new()));
        assert_eq!(parse_gpu_label("GPU-1,junk"), None);
    }

    #[test]
    fn chown_helper_has_only_chown_and_no_network() {
        let spec = spec(GpuAccess::NvidiaDeviceRequest);
        let body = chown_helper_body(&spec, &NodeName::parse("node1").unwrap());
        assert_eq!(
            body.cmd,
            Some(vec![
                "chown".to_owned(),
                "20001:20001".to_owned(),
                "/home/alice-smith".to_owned()
            ])
        );
        let labels = body.labels.unwrap();
        assert!(labels.contains_key(LABEL_HELPER));
        assert!(!labels.contains_key(LABEL_SESSION));
        let host = body.host_config.unwrap();
        assert_eq!(host.network_mode.as_deref(), Some("none"));
        assert_eq!(host.cap_add, Some(vec!["CHOWN".to_owned()]));
        assert_eq!(host.cap_drop, Some(vec!["ALL".to_owned()]));
        assert_eq!(host.device_requests, None);
    }
}
