//! An in-memory [`ContainerRuntime`] for unit tests of the reconciler: containers are records
//! in a map, every call is logged, and tests can make a container die or an operation fail.
//! A process started in it behaves like `cat` (see [`FakeRuntime::start_exec`]), enough to test
//! the stream endpoint's pumping.
//! The real runtime is tested against the real Docker daemon in `tests/agent/docker.rs`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::StreamExt;
use ongrid_core::api::{ContainerLimits, ContainerState, ContainerUser, DesiredSession, RunState};
use ongrid_core::{Dn, GpuId, MemorySize, NodeName, SessionId, SessionName, UserName};
use tokio::io::AsyncReadExt;

use super::{
    ContainerRuntime, ContainerSpec, ContainerStatus, DaemonInfo, ExecOutput, ExecProcess,
    ExecSpec, ExecStatus, NetworkStatus, NodeResources, RuntimeError, SessionContainer, TtySize,
};

/// A session of the manager's desired state, as tests need one.
pub fn desired_session(gpus: &[&str]) -> DesiredSession {
    DesiredSession {
        session_id: SessionId::new_random(),
        name: SessionName::parse("train1").unwrap(),
        owner: Dn::parse("/DC=org/DC=example/CN=Alice Smith").unwrap(),
        user: ContainerUser {
            name: UserName::parse("alice-smith").unwrap(),
            uid: 20001,
        },
        image: "ongrid/dev:latest".into(),
        gpus: gpus.iter().map(|g| GpuId::parse(g).unwrap()).collect(),
        run: RunState::Running,
        limits: ContainerLimits {
            millicpus: 1500,
            memory: MemorySize::parse("2GiB").unwrap(),
            pids: 512,
        },
        labels: BTreeMap::from([
            ("site.project".to_owned(), "atlas".to_owned()),
            (super::LABEL_USER.to_owned(), "mallory".to_owned()),
        ]),
        resume: false,
    }
}

#[derive(Debug, Default)]
struct State {
    next_id: u32,
    containers: BTreeMap<String, ContainerStatus>,
    specs: BTreeMap<String, ContainerSpec>,
    images: BTreeSet<String>,
    /// Operations (`create`, `start`, `stop`, `remove`) that fail from now on.
    failing: BTreeSet<&'static str>,
    /// Operations that fail from now on for one target only (`create`, container name).
    failing_targets: BTreeSet<(&'static str, String)>,
    /// How long `create`, `start`, `stop` and `remove` take, where tests set it ([`FakeRuntime::slow`]).
    delays: BTreeMap<&'static str, Duration>,
    /// Of those, how many run now, and the most that ever ran at once, by operation.
    in_flight: BTreeMap<&'static str, usize>,
    most_in_flight: BTreeMap<&'static str, usize>,
    /// `begin <operation> <target>` and `end <operation> <target>` of those, in order.
    timeline: Vec<String>,
    list_fails: bool,
    /// `daemon` fails, as a stopping Docker's socket refuses new connections.
    daemon_stopping: bool,
    /// What `daemon` says of live-restore.
    live_restore: bool,
    calls: Vec<String>,
    session_containers: BTreeMap<SessionId, SessionContainer>,
    execs: BTreeMap<String, FakeExec>,
    /// How the next processes end: exit code and what they write to stderr first.
    exec_exit_code: i64,
    exec_stderr: Vec<u8>,
    /// What archive uploads put into containers, by container id and absolute path.
    files: BTreeMap<(String, String), FakeFile>,
    /// CPU time used by running containers, by id, as tests set it.
    cpu_times: BTreeMap<String, Duration>,
    /// How long `cpu_time` takes to answer for a container (a busy Docker's stats, where the
    /// cgroup's counter cannot be read).
    cpu_time_delays: BTreeMap<String, Duration>,
    /// Session networks by id (`n1`, `n2`, ...: a counter of their own, so container ids do
    /// not depend on them).
    networks: BTreeMap<String, NetworkStatus>,
    next_network_id: u32,
    /// Network calls (`ensure_network <name>`, `remove_network <id>`), apart from `calls`.
    network_calls: Vec<String>,
    /// Batch job containers by id (`j1`, `j2`, ...).
    jobs: BTreeMap<String, FakeJob>,
    /// The images `import_image` made: reference, configuration and the tar's bytes.
    imports: Vec<(String, super::ImportConfig, Vec<u8>)>,
    /// While `true`, `follow_logs` of an exited job does not end (Docker that has not sent the
    /// end yet); it ends when set back to `false`.
    output_held: Arc<tokio::sync::watch::Sender<bool>>,
}

/// A batch job's container in the fake.
#[derive(Debug, Clone)]
pub struct FakeJob {
    pub status: super::JobContainerStatus,
    pub spec: super::JobContainerSpec,
    /// What `follow_logs` answers.
    pub output: Vec<u8>,
}

/// A file or directory an archive upload put into a container of the fake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeFile {
    pub directory: bool,
    pub mode: u32,
    pub uid: u64,
    pub gid: u64,
    pub bytes: Vec<u8>,
}

/// A process started in the fake.
#[derive(Debug, Clone)]
pub struct FakeExec {
    pub container_id: String,
    pub spec: ExecSpec,
    pub resizes: Vec<TtySize>,
    exit_code: i64,
    finished: Arc<AtomicBool>,
}

/// See the module documentation.
#[derive(Debug)]
pub struct FakeRuntime {
    node: NodeName,
    state: Mutex<State>,
}

impl FakeRuntime {
    /// A runtime of node `node1` that has the image `ongrid/dev:latest`.
    pub fn new() -> Self {
        let runtime = Self {
            node: NodeName::parse("node1").unwrap(),
            state: Mutex::default(),
        };
        runtime.state().images.insert("ongrid/dev:latest".into());
        runtime
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap()
    }

    /// Adds a container as if it had been there before (another agent run, a person).
    pub fn insert(
        &self,
        name: &str,
        session_id: Option<SessionId>,
        state: ContainerState,
    ) -> String {
        let mut s = self.state();
        s.next_id += 1;
        let id = format!("c{}", s.next_id);
        s.containers.insert(
            id.clone(),
            ContainerStatus {
                id: id.clone(),
                name: name.to_owned(),
                session_id,
                state,
                image: "ongrid/dev:latest".to_owned(),
                gpus: None,
                pid: None,
            },
        );
        id
    }

    /// Sets the CPU time the container `id` has used so far, as `cpu_time` answers while it runs.
    pub fn set_cpu_time(&self, id: &str, used: Duration) {
        self.state().cpu_times.insert(id.to_owned(), used);
    }

    /// Makes `cpu_time` for the container `id` answer only after `delay` (tokio's clock).
    pub fn delay_cpu_time(&self, id: &str, delay: Duration) {
        self.state().cpu_time_delays.insert(id.to_owned(), delay);
    }

    /// The images the node has.
    pub fn images(&self) -> BTreeSet<String> {
        self.state().images.clone()
    }

    /// Makes the session's container stop by itself.
    pub fn die(&self, session_id: SessionId, exit_code: i64, oom_killed: bool) {
        let mut s = self.state();
        for c in s.containers.values_mut() {
            if c.session_id == Some(session_id) {
                c.state = ContainerState::Exited {
                    exit_code,
                    oom_killed,
                    error: None,
                };
            }
        }
    }

    /// Puts an image on the node.
    pub fn add_image(&self, image: &str) {
        self.state().images.insert(image.to_owned());
    }

    pub fn remove_image(&self, image: &str) {
        self.state().images.remove(image);
    }

    pub fn fail(&self, operation: &'static str) {
        self.state().failing.insert(operation);
    }

    /// Makes `operation` fail from now on when it acts on `target` only (for `create`, the
    /// container's name).
    pub fn fail_on(&self, operation: &'static str, target: &str) {
        self.state()
            .failing_targets
            .insert((operation, target.to_owned()));
    }

    /// Makes `operation` (`create`, `start`, `stop` or `remove`) take `delay` of tokio's clock
    /// before it acts, so that tests see how many run at once and in what order they end.
    pub fn slow(&self, operation: &'static str, delay: Duration) {
        self.state().delays.insert(operation, delay);
    }

    /// The most calls of `operation` that were in flight at once so far.
    pub fn most_at_once(&self, operation: &'static str) -> usize {
        self.state()
            .most_in_flight
            .get(operation)
            .copied()
            .unwrap_or(0)
    }

    /// `begin <operation> <target>` and `end <operation> <target>` of every `create`,
    /// `start`, `stop` and `remove` so far, in order; then forgets them.
    pub fn take_timeline(&self) -> Vec<String> {
        std::mem::take(&mut self.state().timeline)
    }

    pub fn heal(&self) {
        let mut s = self.state();
        s.failing.clear();
        s.failing_targets.clear();
        s.list_fails = false;
    }

    /// Makes `daemon` fail (`true`), as it does while Docker stops, or answer again.
    pub fn set_daemon_stopping(&self, stopping: bool) {
        self.state().daemon_stopping = stopping;
    }

    pub fn set_live_restore(&self, on: bool) {
        self.state().live_restore = on;
    }

    pub fn fail_list(&self) {
        self.state().list_fails = true;
    }

    /// The calls made so far, like `create ongrid-...`, `stop c1`; then forgets them.
    pub fn take_calls(&self) -> Vec<String> {
        std::mem::take(&mut self.state().calls)
    }

    /// The network calls made so far; then forgets them.
    pub fn take_network_calls(&self) -> Vec<String> {
        std::mem::take(&mut self.state().network_calls)
    }

    pub fn networks(&self) -> Vec<NetworkStatus> {
        self.state().networks.values().cloned().collect()
    }

    /// Adds a network as if an earlier agent had made it.
    pub fn insert_network(&self, name: &str, session_id: Option<SessionId>) -> String {
        let mut s = self.state();
        s.next_network_id += 1;
        let id = format!("n{}", s.next_network_id);
        let network = NetworkStatus {
            id: id.clone(),
            name: name.to_owned(),
            session_id,
        };
        s.networks.insert(id.clone(), network);
        id
    }

    pub fn containers(&self) -> Vec<ContainerStatus> {
        self.state().containers.values().cloned().collect()
    }

    pub fn spec_of(&self, id: &str) -> Option<ContainerSpec> {
        self.state().specs.get(id).cloned()
    }

    /// Makes `container` the dev container of its session, as `session_container` answers.
    pub fn insert_session_container(&self, container: SessionContainer) {
        self.state()
            .session_containers
            .insert(container.session_id, container);
    }

    /// The processes started from now on write `stderr` first and exit with `exit_code`.
    pub fn set_exec_result(&self, exit_code: i64, stderr: &[u8]) {
        let mut s = self.state();
        s.exec_exit_code = exit_code;
        s.exec_stderr = stderr.to_vec();
    }

    /// The processes started so far, by exec id.
    pub fn execs(&self) -> BTreeMap<String, FakeExec> {
        self.state().execs.clone()
    }

    /// What archive uploads put into `container_id`, by absolute path.
    pub fn files(&self, container_id: &str) -> BTreeMap<String, FakeFile> {
        self.state()
            .files
            .iter()
            .filter(|((container, _), _)| container == container_id)
            .map(|((_, path), file)| (path.clone(), file.clone()))
            .collect()
    }

    fn check(
        &self,
        s: &mut State,
        operation: &'static str,
        target: &str,
    ) -> Result<(), RuntimeError> {
        s.calls.push(format!("{operation} {target}"));
        if s.failing.contains(operation)
            || s.failing_targets.contains(&(operation, target.to_owned()))
        {
            return Err(RuntimeError::Setup {
                action: format!("{operation} {target}"),
                problem: "the fake was told to fail".into(),
            });
        }
        Ok(())
    }

    fn create_now(&self, spec: &ContainerSpec) -> Result<String, RuntimeError> {
        let mut s = self.state();
        self.check(&mut s, "create", &spec.name)?;
        if !s.images.contains(&spec.image) {
            return Err(RuntimeError::ImageMissing {
                image: spec.image.clone(),
                node: self.node.clone(),
            });
        }
        if s.containers.values().any(|c| c.name == spec.name) {
            return Err(RuntimeError::Setup {
                action: format!("creating container {}", spec.name),
                problem: "the name is in use".into(),
            });
        }
        s.next_id += 1;
        let id = format!("c{}", s.next_id);
        s.containers.insert(
            id.clone(),
            ContainerStatus {
                id: id.clone(),
                name: spec.name.clone(),
                session_id: Some(spec.session_id),
                state: ContainerState::Created,
                image: spec.image.clone(),
                gpus: Some(spec.gpus.clone()),
                pid: None,
            },
        );
        s.specs.insert(id.clone(), spec.clone());
        Ok(id)
    }

    fn start_now(&self, id: &str) -> Result<(), RuntimeError> {
        self.set_state(id, "start", ContainerState::Running)?;
        if let Some(job) = self.state().jobs.get_mut(id) {
            if job.status.state == super::JobContainerState::Created {
                job.status.state = super::JobContainerState::Running {
                    started_at: chrono::Utc::now(),
                };
            }
        }
        Ok(())
    }

    fn remove_now(&self, id: &str) -> Result<(), RuntimeError> {
        let mut s = self.state();
        self.check(&mut s, "remove", id)?;
        s.containers.remove(id);
        s.specs.remove(id);
        s.jobs.remove(id);
        Ok(())
    }

    /// Before `operation` acts on `target`: counts it in flight and waits its delay.
    async fn enter(&self, operation: &'static str, target: &str) {
        let delay = {
            let mut s = self.state();
            s.timeline.push(format!("begin {operation} {target}"));
            let now = {
                let count = s.in_flight.entry(operation).or_default();
                *count += 1;
                *count
            };
            let most = s.most_in_flight.entry(operation).or_default();
            *most = (*most).max(now);
            s.delays.get(operation).copied()
        };
        if let Some(delay) = delay {
            tokio::time::sleep(delay).await;
        }
    }

    /// After `operation` acted on `target`.
    fn leave(&self, operation: &'static str, target: &str) {
        let mut s = self.state();
        if let Some(count) = s.in_flight.get_mut(operation) {
            *count = count.saturating_sub(1);
        }
        s.timeline.push(format!("end {operation} {target}"));
    }

    fn set_state(
        &self,
        id: &str,
        operation: &'static str,
        state: ContainerState,
    ) -> Result<(), RuntimeError> {
        let mut s = self.state();
        self.check(&mut s, operation, id)?;
        if let Some(c) = s.containers.get_mut(id) {
            c.state = state;
        }
        Ok(())
    }
}

/// Batch jobs.
impl FakeRuntime {
    pub fn jobs(&self) -> BTreeMap<String, FakeJob> {
        self.state().jobs.clone()
    }

    /// Makes the job's container exit by itself with `exit_code` (after writing `output`).
    pub fn exit_job(&self, id: &str, exit_code: i64, output: &[u8]) {
        let mut s = self.state();
        if let Some(job) = s.jobs.get_mut(id) {
            job.output.extend_from_slice(output);
            if let super::JobContainerState::Running { started_at } = job.status.state {
                job.status.state = super::JobContainerState::Exited {
                    started_at,
                    finished_at: chrono::Utc::now(),
                    exit_code,
                    oom_killed: false,
                };
            }
        }
    }

    /// From now on (`true`), following an exited job's output never ends, as Docker that has not
    /// sent the last of it; `false`: it ends again.
    pub fn hold_output(&self, held: bool) {
        self.state().output_held.send_replace(held);
    }

    /// The images `import_image` made, with their configuration and tar bytes.
    pub fn imports(&self) -> Vec<(String, super::ImportConfig, Vec<u8>)> {
        self.state().imports.clone()
    }
}

impl Default for FakeRuntime {
    fn default() -> Self {
        Self::new()
    }
}

impl ContainerRuntime for FakeRuntime {
    fn list(&self) -> BoxFuture<'_, Result<Vec<ContainerStatus>, RuntimeError>> {
        let result = if self.state().list_fails {
            Err(RuntimeError::Unreachable(
                "the fake was told to fail".into(),
            ))
        } else {
            Ok(self.containers())
        };
        Box::pin(async move { result })
    }

    fn create<'a>(
        &'a self,
        spec: &'a ContainerSpec,
    ) -> BoxFuture<'a, Result<String, RuntimeError>> {
        Box::pin(async move {
            self.enter("create", &spec.name).await;
            let result = self.create_now(spec);
            self.leave("create", &spec.name);
            result
        })
    }

    fn start<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), RuntimeError>> {
        Box::pin(async move {
            self.enter("start", id).await;
            let result = self.start_now(id);
            self.leave("start", id);
            result
        })
    }

    fn stop<'a>(
        &'a self,
        id: &'a str,
        _timeout: Duration,
    ) -> BoxFuture<'a, Result<(), RuntimeError>> {
        Box::pin(async move {
            self.enter("stop", id).await;
            let result = self.set_state(
                id,
                "stop",
                ContainerState::Exited {
                    exit_code: 143,
                    oom_killed: false,
                    error: None,
                },
            );
            self.leave("stop", id);
            result
        })
    }

    fn remove<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), RuntimeError>> {
        Box::pin(async move {
            self.enter("remove", id).await;
            let result = self.remove_now(id);
            self.leave("remove", id);
            result
        })
    }

    fn session_container(
        &self,
        session_id: SessionId,
    ) -> BoxFuture<'_, Result<Option<SessionContainer>, RuntimeError>> {
        let found = self.state().session_containers.get(&session_id).cloned();
        Box::pin(async move { Ok(found) })
    }

    /// A process like `cat`: it writes the configured stderr, then echoes its stdin to stdout
    /// in chunks of at most 1 KiB, and ends when its stdin is closed.
    fn start_exec<'a>(
        &'a self,
        container_id: &'a str,
        spec: &'a ExecSpec,
    ) -> BoxFuture<'a, Result<ExecProcess, RuntimeError>> {
        let result = (|| {
            let mut s = self.state();
            self.check(&mut s, "exec", container_id)?;
            s.next_id += 1;
            let id = format!("e{}", s.next_id);
            let finished = Arc::new(AtomicBool::new(false));
            let exit_code = s.exec_exit_code;
            s.execs.insert(
                id.clone(),
                FakeExec {
                    container_id: container_id.to_owned(),
                    spec: spec.clone(),
                    resizes: Vec::new(),
                    exit_code,
                    finished: finished.clone(),
                },
            );
            let (input, echo) = tokio::io::duplex(1024);
            let stderr = futures::stream::iter(
                Some(Ok(ExecOutput::Stderr(s.exec_stderr.clone())))
                    .filter(|_| !s.exec_stderr.is_empty()),
            );
            let stdout = futures::stream::unfold((echo, finished), |(mut echo, finished)| async {
                let mut buffer = vec![0; 1024];
                match echo.read(&mut buffer).await {
                    Ok(n) if n > 0 => {
                        buffer.truncate(n);
                        Some((Ok(ExecOutput::Stdout(buffer)), (echo, finished)))
                    }
                    _ => {
                        finished.store(true, Ordering::SeqCst);
                        None
                    }
                }
            });
            Ok(ExecProcess {
                id,
                output: stderr.chain(stdout).boxed(),
                input: Box::pin(input),
            })
        })();
        Box::pin(async move { result })
    }

    fn resize_exec<'a>(
        &'a self,
        exec_id: &'a str,
        size: TtySize,
    ) -> BoxFuture<'a, Result<(), RuntimeError>> {
        if let Some(exec) = self.state().execs.get_mut(exec_id) {
            exec.resizes.push(size);
        }
        Box::pin(async move { Ok(()) })
    }

    fn inspect_exec<'a>(
        &'a self,
        exec_id: &'a str,
    ) -> BoxFuture<'a, Result<ExecStatus, RuntimeError>> {
        let result = match self.state().execs.get(exec_id) {
            Some(exec) => {
                let finished = exec.finished.load(Ordering::SeqCst);
                Ok(ExecStatus {
                    running: !finished,
                    exit_code: Some(exec.exit_code).filter(|_| finished),
                    // A PID no process has; the fake's containers have none, so nothing is
                    // ever signalled.
                    pid: (!finished).then_some(4_000_000),
                })
            }
            None => Err(RuntimeError::Setup {
                action: format!("inspecting exec {exec_id}"),
                problem: "no such exec".into(),
            }),
        };
        Box::pin(async move { result })
    }

    /// Records every entry of the archive under `dir`; a container that was never inserted
    /// is fine (the fake does not check).
    fn upload_archive<'a>(
        &'a self,
        container_id: &'a str,
        dir: &'a str,
        archive: Vec<u8>,
    ) -> BoxFuture<'a, Result<(), RuntimeError>> {
        let result = (|| {
            let mut s = self.state();
            self.check(&mut s, "upload", &format!("{container_id} {dir}"))?;
            let broken = |e: std::io::Error| RuntimeError::Setup {
                action: format!("copying files into {dir} of container {container_id}"),
                problem: format!("not a tar archive: {e}"),
            };
            let mut archive = tar::Archive::new(archive.as_slice());
            for entry in archive.entries().map_err(broken)? {
                let mut entry = entry.map_err(broken)?;
                let name = entry.path().map_err(broken)?.display().to_string();
                let path = format!(
                    "{}/{}",
                    dir.trim_end_matches('/'),
                    name.trim_end_matches('/')
                );
                let header = entry.header();
                let mut file = FakeFile {
                    directory: header.entry_type() == tar::EntryType::Directory,
                    mode: header.mode().map_err(broken)?,
                    uid: header.uid().map_err(broken)?,
                    gid: header.gid().map_err(broken)?,
                    bytes: Vec::new(),
                };
                std::io::Read::read_to_end(&mut entry, &mut file.bytes).map_err(broken)?;
                s.files.insert((container_id.to_owned(), path), file);
            }
            Ok(())
        })();
        Box::pin(async move { result })
    }

    /// A file an upload put there, alone in a tar archive as Docker answers.
    fn download_archive<'a>(
        &'a self,
        container_id: &'a str,
        path: &'a str,
    ) -> BoxFuture<'a, Result<Option<Vec<u8>>, RuntimeError>> {
        let result = (|| {
            let mut s = self.state();
            self.check(&mut s, "download", &format!("{container_id} {path}"))?;
            let Some(file) = s.files.get(&(container_id.to_owned(), path.to_owned())) else {
                return Ok(None);
            };
            let mut header = tar::Header::new_gnu();
            header.set_size(file.bytes.len() as u64);
            header.set_mode(file.mode);
            header.set_entry_type(tar::EntryType::Regular);
            let name = path.rsplit('/').next().unwrap_or(path);
            let mut builder = tar::Builder::new(Vec::new());
            builder
                .append_data(&mut header, name, file.bytes.as_slice())
                .unwrap();
            Ok(Some(builder.into_inner().unwrap()))
        })();
        Box::pin(async move { result })
    }

    /// What `set_cpu_time` said (zero when it said nothing), while the container runs; after
    /// the delay `delay_cpu_time` said.
    fn cpu_time<'a>(
        &'a self,
        container: &'a ContainerStatus,
    ) -> BoxFuture<'a, Result<Option<Duration>, RuntimeError>> {
        let id = container.id.as_str();
        let s = self.state();
        let running = s
            .containers
            .get(id)
            .is_some_and(|c| c.state == ContainerState::Running);
        let result = Ok(running.then(|| s.cpu_times.get(id).copied().unwrap_or_default()));
        let delay = s.cpu_time_delays.get(id).copied().unwrap_or_default();
        Box::pin(async move {
            tokio::time::sleep(delay).await;
            result
        })
    }

    /// Records the image; the fake has no filesystems, so the image is just a name.
    fn commit_to_image<'a>(
        &'a self,
        id: &'a str,
        reference: &'a str,
    ) -> BoxFuture<'a, Result<String, RuntimeError>> {
        let result = (|| {
            let mut s = self.state();
            self.check(&mut s, "commit", &format!("{id} {reference}"))?;
            s.images.insert(reference.to_owned());
            Ok(format!("sha256:{reference}"))
        })();
        Box::pin(async move { result })
    }

    fn image_exists<'a>(&'a self, reference: &'a str) -> BoxFuture<'a, Result<bool, RuntimeError>> {
        let result = Ok(self.state().images.contains(reference));
        Box::pin(async move { result })
    }

    /// Like Docker's forced removal of a tag: containers of the image keep running.
    fn remove_tag<'a>(&'a self, reference: &'a str) -> BoxFuture<'a, Result<bool, RuntimeError>> {
        let result = (|| {
            let mut s = self.state();
            self.check(&mut s, "remove_tag", reference)?;
            Ok(s.images.remove(reference))
        })();
        Box::pin(async move { result })
    }

    /// Refuses, like Docker, while a container was created from the image.
    fn untag_image<'a>(&'a self, reference: &'a str) -> BoxFuture<'a, Result<(), RuntimeError>> {
        let result = (|| {
            let mut s = self.state();
            self.check(&mut s, "untag", reference)?;
            if s.containers.values().any(|c| c.image == reference) {
                return Err(RuntimeError::Setup {
                    action: format!("removing image {reference}"),
                    problem: "a container uses it".into(),
                });
            }
            s.images.remove(reference);
            Ok(())
        })();
        Box::pin(async move { result })
    }

    // Freezing is tested against the real Docker daemon (tests/agent/freeze.rs); the fake
    // refuses it, so a unit test that reaches it fails with a clear message.
    fn freeze_commit<'a>(
        &'a self,
        container_id: &'a str,
        _spec: &'a super::CommitSpec,
    ) -> BoxFuture<'a, Result<String, RuntimeError>> {
        Box::pin(async move { Err(no_freeze(format!("committing {container_id}"))) })
    }

    fn image_details<'a>(
        &'a self,
        reference: &'a str,
    ) -> BoxFuture<'a, Result<Option<super::ImageDetails>, RuntimeError>> {
        Box::pin(async move { Err(no_freeze(format!("inspecting image {reference}"))) })
    }

    fn create_export_container<'a>(
        &'a self,
        image: &'a str,
        _name: &'a str,
        _labels: &'a BTreeMap<String, String>,
    ) -> BoxFuture<'a, Result<String, RuntimeError>> {
        Box::pin(async move { Err(no_freeze(format!("exporting image {image}"))) })
    }

    fn export_container(
        &self,
        container_id: &str,
    ) -> futures::stream::BoxStream<'static, Result<Vec<u8>, RuntimeError>> {
        let error = no_freeze(format!("exporting {container_id}"));
        futures::stream::once(async move { Err(error) }).boxed()
    }

    fn tag_image<'a>(
        &'a self,
        image: &'a str,
        _repository: &'a str,
        _tag: &'a str,
    ) -> BoxFuture<'a, Result<(), RuntimeError>> {
        Box::pin(async move { Err(no_freeze(format!("tagging image {image}"))) })
    }

    fn remove_image_id<'a>(&'a self, image_id: &'a str) -> BoxFuture<'a, Result<(), RuntimeError>> {
        Box::pin(async move { Err(no_freeze(format!("removing image {image_id}"))) })
    }

    fn images_labelled<'a>(
        &'a self,
        label: &'a str,
        value: &'a str,
    ) -> BoxFuture<'a, Result<Vec<String>, RuntimeError>> {
        Box::pin(async move {
            Err(no_freeze(format!(
                "listing images labelled {label}={value}"
            )))
        })
    }

    fn list_networks(&self) -> BoxFuture<'_, Result<Vec<NetworkStatus>, RuntimeError>> {
        let networks = self.networks();
        Box::pin(async move { Ok(networks) })
    }

    fn ensure_network<'a>(
        &'a self,
        spec: &'a crate::network::NetworkSpec,
    ) -> BoxFuture<'a, Result<(), RuntimeError>> {
        Box::pin(async move {
            let mut s = self.state();
            s.network_calls
                .push(format!("ensure_network {}", spec.name));
            if s.failing.contains("ensure_network") {
                return Err(RuntimeError::Setup {
                    action: format!("creating network {}", spec.name),
                    problem: "the fake was told to fail".into(),
                });
            }
            if !s.networks.values().any(|n| n.name == spec.name) {
                s.next_network_id += 1;
                let id = format!("n{}", s.next_network_id);
                let network = NetworkStatus {
                    id: id.clone(),
                    name: spec.name.clone(),
                    session_id: Some(spec.session_id),
                };
                s.networks.insert(id, network);
            }
            Ok(())
        })
    }

    fn remove_network<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), RuntimeError>> {
        Box::pin(async move {
            let mut s = self.state();
            s.network_calls.push(format!("remove_network {id}"));
            let name = s.networks.get(id).map(|n| n.name.clone());
            let in_use = s.specs.iter().any(|(cid, spec)| {
                Some(&spec.network) == name.as_ref() && s.containers.contains_key(cid)
            });
            if in_use {
                return Err(RuntimeError::Setup {
                    action: format!("removing network {id}"),
                    problem: "a container still uses it".into(),
                });
            }
            s.networks.remove(id);
            Ok(())
        })
    }

    fn daemon(&self) -> BoxFuture<'_, Result<DaemonInfo, RuntimeError>> {
        let (stopping, live_restore) = {
            let state = self.state();
            (state.daemon_stopping, state.live_restore)
        };
        let result = if stopping {
            Err(RuntimeError::Unreachable(
                "the fake was told it is stopping".into(),
            ))
        } else {
            Ok(DaemonInfo { live_restore })
        };
        Box::pin(async move { result })
    }

    fn node_resources(&self) -> BoxFuture<'_, Result<NodeResources, RuntimeError>> {
        Box::pin(async move {
            Ok(NodeResources {
                millicpus: 8000,
                memory_bytes: 32 << 30,
            })
        })
    }

    fn list_jobs(&self) -> BoxFuture<'_, Result<Vec<super::JobContainerStatus>, RuntimeError>> {
        let result = if self.state().list_fails {
            Err(RuntimeError::Unreachable(
                "the fake was told to fail".into(),
            ))
        } else {
            Ok(self
                .state()
                .jobs
                .values()
                .map(|job| job.status.clone())
                .collect())
        };
        Box::pin(async move { result })
    }

    fn create_job<'a>(
        &'a self,
        spec: &'a super::JobContainerSpec,
    ) -> BoxFuture<'a, Result<String, RuntimeError>> {
        let result = (|| {
            let mut s = self.state();
            self.check(&mut s, "create_job", &spec.name)?;
            if !s.images.contains(&spec.image) {
                return Err(RuntimeError::ImageMissing {
                    image: spec.image.clone(),
                    node: self.node.clone(),
                });
            }
            if s.jobs.values().any(|j| j.status.name == spec.name) {
                return Err(RuntimeError::Setup {
                    action: format!("creating container {}", spec.name),
                    problem: "the name is in use".into(),
                });
            }
            s.next_id += 1;
            let id = format!("j{}", s.next_id);
            let status = super::JobContainerStatus {
                id: id.clone(),
                name: spec.name.clone(),
                job_id: spec.job_id,
                state: super::JobContainerState::Created,
            };
            s.jobs.insert(
                id.clone(),
                FakeJob {
                    status,
                    spec: spec.clone(),
                    output: Vec::new(),
                },
            );
            Ok(id)
        })();
        Box::pin(async move { result })
    }

    /// `SIGKILL` ends a running job with 137; other signals are only recorded (`signal <id>
    /// <signal>`): tests end the job with [`FakeRuntime::exit_job`].
    fn signal<'a>(
        &'a self,
        id: &'a str,
        signal: &'a str,
    ) -> BoxFuture<'a, Result<(), RuntimeError>> {
        let result = (|| {
            let mut s = self.state();
            self.check(&mut s, "signal", &format!("{id} {signal}"))?;
            drop(s);
            if signal == "SIGKILL" {
                self.exit_job(id, 137, b"");
            }
            Ok(())
        })();
        Box::pin(async move { result })
    }

    fn follow_logs(
        &self,
        id: &str,
    ) -> futures::stream::BoxStream<'static, Result<Vec<u8>, RuntimeError>> {
        // Docker's stream ends only once the container stopped; the fake cannot wait, so it
        // answers an error while the job runs (the follower tries again later).
        let s = self.state();
        let output = match s.jobs.get(id) {
            Some(job) if matches!(job.status.state, super::JobContainerState::Exited { .. }) => {
                if *s.output_held.borrow() {
                    let mut held = s.output_held.subscribe();
                    let released = async move {
                        let _ = held.wait_for(|held| !held).await;
                    };
                    return futures::stream::iter([Ok(job.output.clone())])
                        .chain(futures::stream::once(released).filter_map(|()| async { None }))
                        .boxed();
                }
                Ok(job.output.clone())
            }
            _ => Err(RuntimeError::Setup {
                action: format!("following the output of {id}"),
                problem: "the fake follows only exited jobs".into(),
            }),
        };
        futures::stream::iter([output]).boxed()
    }

    fn import_image<'a>(
        &'a self,
        reference: &'a str,
        config: &'a super::ImportConfig,
        tar: futures::stream::BoxStream<'static, Result<Vec<u8>, std::io::Error>>,
    ) -> BoxFuture<'a, Result<(), RuntimeError>> {
        Box::pin(async move {
            self.check(&mut self.state(), "import_image", reference)?;
            let chunks: Vec<Vec<u8>> =
                futures::TryStreamExt::try_collect(tar).await.map_err(|e| {
                    RuntimeError::Docker {
                        action: format!("importing image {reference}"),
                        source: Box::new(e),
                    }
                })?;
            let mut s = self.state();
            s.imports
                .push((reference.to_owned(), config.clone(), chunks.concat()));
            s.images.insert(reference.to_owned());
            Ok(())
        })
    }
}

fn no_freeze(action: String) -> RuntimeError {
    RuntimeError::Setup {
        action,
        problem: "the fake runtime does not freeze".into(),
    }
}
