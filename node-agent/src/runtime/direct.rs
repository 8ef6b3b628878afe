//! Processes started in a running container by the container's own OCI runtime, runc, beside
//! dockerd rather than through it (`[exec] mode = "direct"`, the default).
//!
//! `docker exec` carries every byte of a process's stdin and output through dockerd and the
//! container's shim: two more processes and several more copies per byte, which on the bulk
//! SSH path cost more CPU than all of OpenSSH's `sshd` (`tests/examples/ssh_speed.rs` counts
//! it). Here the agent asks runc itself to start the process (`runc exec --detach`): its stdin,
//! stdout and stderr are pipes whose other ends the agent holds, or, with a terminal, the master
//! of the pseudo-terminal runc creates in the container and hands over (`--console-socket`).
//!
//! **Isolation is the container's**, as with `docker exec`. The process spec is the container's
//! own (`config.json` in runc's bundle of it) with only what `docker exec` changes changed: the
//! arguments, the environment (the container's, then the exec's, replacing names already set),
//! the working directory and the terminal. The user must be the container's user, as every
//! stream's is; its supplementary groups, capabilities, no-new-privileges, rlimits, AppArmor and
//! SELinux labels come with the spec, and runc applies the container's seccomp profile and
//! enters its cgroup and namespaces. `tests/agent/exec.rs` compares each of these with a
//! `docker exec` in the same container.
//!
//! **The parent.** runc's `--detach` leaves the process without its parent once runc exits. A
//! small helper, the agent's own binary run as `ongrid-agent exec-helper` ([`helper_main`]),
//! takes that place, as the shim does for `docker exec`: it marks itself a child subreaper, runs
//! runc, reads the process's host PID from runc's PID file, waits for the process and reports
//! how it ended. It reports over a Unix socket of its own (`started PID`, then `exited CODE` or
//! `killed SIGNAL`), so the pipes carry only the process's bytes; it holds none of them once
//! runc has started the process.
//!
//! **Output** ends when the process closes it, or, as dockerd ends an exec's streams, 2 s after
//! the process ended even if a child it left in the background still holds the pipes
//! (`cmd & exit` returns, as it did through `docker exec`).
//!
//! A container runc does not know under `runc_root` (another OCI runtime, rootless Docker, a
//! daemon with another exec root) gets `docker exec`, as does a user other than the container's.

use bytes::BufMut;
use std::collections::{HashMap, VecDeque};
use std::io::{self, Write};
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use futures::stream::BoxStream;
use futures::StreamExt;
use serde::Deserialize;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tracing::{debug, info, warn};

use super::{ExecOutput, ExecProcess, ExecSpec, ExecStatus, RuntimeError};

/// The first argument that makes the agent's binary run [`helper_main`].
pub const HELPER_ARG: &str = "exec-helper";

/// The ids of direct processes start with this; Docker's exec ids are hexadecimal.
const ID_PREFIX: &str = "direct-";

/// How long runc may take to start a process (it answers in tens of milliseconds).
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// How much of a process's output is read at once: as much as one stream frame takes while its
/// WebSocket message (a 4-byte header, the frame's tag, the bytes) stays within 64 KiB, four
/// full TLS records. A read of 64 KiB made a fifth record of 11 bytes for each (the tag and the
/// 10-byte header of a message over 65,535 bytes), and with it a system call and a wake-up more
/// on both ends of the stream.
const CHUNK: usize = 64 * 1024 - 4 - 1;

/// The capacity asked of the pipes of a process's stdout and stderr (Linux's default is 64
/// KiB, the most a user may ask is `/proc/sys/fs/pipe-max-size`, 1 MiB by default). With
/// [`CHUNK`] just under 64 KiB, a full default pipe would leave a few bytes behind each read,
/// read next as a frame of their own; a larger pipe also lets the process write on while the
/// agent sends.
const PIPE_CAPACITY: i32 = 1024 * 1024;

/// How long a process's output may go on once the process has ended (dockerd gives an exec's
/// streams 2 s): a background child that keeps stdout open would otherwise keep the SSH
/// channel open, which `docker exec` never did.
const OUTPUT_GRACE: Duration = Duration::from_secs(2);

/// How many ended processes' statuses are kept (the oldest forgotten first). A stream asks for
/// the status once the output ends, which a background process holding it open can delay for
/// hours after the process itself ended.
const KEEP_ENDED: usize = 10_000;

/// How processes start in dev containers: the `[exec]` table of the agent's config.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecConfig {
    #[serde(default)]
    pub mode: ExecMode,
    /// The OCI runtime Docker runs the containers with.
    #[serde(default = "default_runc")]
    pub runc: PathBuf,
    /// runc's state directory of Docker's containers (`--root`).
    #[serde(default = "default_runc_root")]
    pub runc_root: PathBuf,
}

impl Default for ExecConfig {
    fn default() -> Self {
        Self {
            mode: ExecMode::default(),
            runc: default_runc(),
            runc_root: default_runc_root(),
        }
    }
}

fn default_runc() -> PathBuf {
    PathBuf::from("runc")
}

fn default_runc_root() -> PathBuf {
    PathBuf::from("/run/docker/runtime-runc/moby")
}

/// `direct`: runc beside dockerd, `docker exec` where runc does not know the container.
/// `docker`: always `docker exec`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ExecMode {
    #[default]
    Direct,
    Docker,
}

/// Why a direct process did not start.
#[derive(Debug)]
pub enum DirectError {
    /// Not for this container or this spec; `docker exec` does it instead.
    Unavailable(String),
    /// Started and failed: the error is the exec's.
    Failed(RuntimeError),
}

/// Starts processes with runc and keeps what is known about each until a while after it ended.
#[derive(Debug)]
pub struct DirectExec {
    runc: PathBuf,
    root: PathBuf,
    /// The agent's binary, which runs [`helper_main`] when given [`HELPER_ARG`].
    helper: PathBuf,
    /// Process specs, PID files and the sockets of helpers and consoles (mode 0700).
    dir: tempfile::TempDir,
    next: AtomicU64,
    processes: Arc<Mutex<Registry>>,
    /// Whether falling back to `docker exec` was already logged at `info`.
    fallback_logged: AtomicBool,
}

/// The processes started here: every running one, and the last [`KEEP_ENDED`] ended ones.
#[derive(Debug, Default)]
struct Registry {
    by_id: HashMap<String, Arc<Tracked>>,
    /// Ended processes' ids, oldest first.
    ended: VecDeque<String>,
}

impl Registry {
    /// Notes that `exec_id` ended, forgetting the oldest ended ones beyond [`KEEP_ENDED`].
    fn ended(&mut self, exec_id: String) {
        self.ended.push_back(exec_id);
        while self.ended.len() > KEEP_ENDED {
            if let Some(oldest) = self.ended.pop_front() {
                self.by_id.remove(&oldest);
            }
        }
    }
}

/// A started process as the agent knows it.
#[derive(Debug)]
struct Tracked {
    pid: u32,
    /// The master of its terminal, for resizes, while its stream lasts.
    terminal: Option<std::sync::Weak<OwnedFd>>,
    outcome: Mutex<Outcome>,
}

#[derive(Debug, Clone)]
enum Outcome {
    Running,
    /// Its exit code, a process killed by signal N reporting 128 + N as Docker does.
    Ended {
        code: i64,
    },
    /// The helper went away without saying how the process ended.
    Lost {
        why: String,
    },
}

impl DirectExec {
    /// Direct processes through `runc`, with `helper` as their parent. `None` (and a warning)
    /// when runc does not run here: `docker exec` serves every container then.
    pub fn new(config: &ExecConfig, helper: PathBuf) -> Option<Self> {
        if config.mode == ExecMode::Docker {
            return None;
        }
        let version = std::process::Command::new(&config.runc)
            .arg("--version")
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output();
        match version {
            Ok(out) if out.status.success() => {}
            Ok(out) => {
                warn!(runc = %config.runc.display(), status = %out.status,
                      "runc does not answer --version: processes start through docker exec.");
                return None;
            }
            Err(e) => {
                warn!(runc = %config.runc.display(), error = %e,
                      "Cannot run runc ([exec] runc): processes start through docker exec.");
                return None;
            }
        }
        let dir = match tempfile::Builder::new().prefix("ongrid-exec-").tempdir() {
            Ok(dir) => dir,
            Err(e) => {
                warn!(error = %e, "Cannot make a directory for runc's process files: processes start through docker exec.");
                return None;
            }
        };
        Some(Self {
            runc: config.runc.clone(),
            root: config.runc_root.clone(),
            helper,
            dir,
            next: AtomicU64::new(1),
            processes: Arc::default(),
            fallback_logged: AtomicBool::new(false),
        })
    }

    /// Whether `exec_id` names a process started here.
    pub fn owns(exec_id: &str) -> bool {
        exec_id.starts_with(ID_PREFIX)
    }

    /// Notes that a container gets `docker exec`; said at `info` once, then at `debug`.
    pub fn note_fallback(&self, container_id: &str, why: &str) {
        if self.fallback_logged.swap(true, Ordering::Relaxed) {
            debug!(
                container = container_id,
                why, "Starting the process through docker exec."
            );
        } else {
            info!(
                container = container_id,
                why, "Starting the process through docker exec (said once; later ones at debug)."
            );
        }
    }

    /// Starts `spec` in the running container `container_id`.
    pub async fn start(
        &self,
        container_id: &str,
        spec: &ExecSpec,
    ) -> Result<ExecProcess, DirectError> {
        let action = format!(
            "starting {} in container {container_id} with runc",
            spec.command
                .first()
                .map(String::as_str)
                .unwrap_or("a process")
        );
        let failed = |problem: String| {
            DirectError::Failed(RuntimeError::Setup {
                action: action.clone(),
                problem,
            })
        };
        let bundle = self.bundle(container_id).await?;
        let config = tokio::fs::read(bundle.join("config.json"))
            .await
            .map_err(|e| DirectError::Unavailable(format!("reading runc's bundle: {e}")))?;
        let config: Value = serde_json::from_slice(&config)
            .map_err(|e| DirectError::Unavailable(format!("runc's config.json: {e}")))?;
        let process = exec_process(&config, spec).map_err(DirectError::Unavailable)?;

        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let files = ExecFiles::new(self.dir.path(), n);
        let process_json = serde_json::to_vec(&process)
            .map_err(|e| failed(format!("writing the process spec: {e}")))?;
        tokio::fs::write(&files.process, process_json)
            .await
            .map_err(|e| failed(format!("writing {}: {e}", files.process.display())))?;
        let started = self.spawn_helper(container_id, spec, &files).await;
        files.remove();
        let (child, status, master) = started.map_err(failed)?;

        let id = format!("{ID_PREFIX}{n}");
        let tracked = Arc::new(Tracked {
            pid: status.pid,
            terminal: master.as_ref().map(|m| Arc::downgrade(&m.control)),
            outcome: Mutex::new(Outcome::Running),
        });
        lock(&self.processes)
            .by_id
            .insert(id.clone(), tracked.clone());
        let (ended, ended_seen) = tokio::sync::oneshot::channel();
        tokio::spawn(watch(
            id.clone(),
            status.reader,
            child.helper,
            tracked,
            self.processes.clone(),
            ended,
        ));
        // As dockerd does for `docker exec`: once the process has ended, its output ends too
        // within OUTPUT_GRACE, even while a child it left in the background holds the pipes.
        let output_closes = async move {
            let _ = ended_seen.await;
            tokio::time::sleep(OUTPUT_GRACE).await;
        };

        let (output, input): (_, Pin<Box<dyn AsyncWrite + Send>>) = match (master, child.pipes) {
            (Some(master), _) => {
                let control = master.control;
                let output = chunks(PtyReader(master.reader), ExecOutput::Stdout)
                    .inspect(move |_| {
                        // The terminal can be resized as long as its output is read.
                        let _ = &control;
                    })
                    .boxed();
                (output, Box::pin(master.writer))
            }
            (None, Some(pipes)) => (
                futures::stream::select(
                    chunks(enlarged(pipes.stdout), ExecOutput::Stdout),
                    chunks(enlarged(pipes.stderr), ExecOutput::Stderr),
                )
                .boxed(),
                Box::pin(pipes.stdin),
            ),
            (None, None) => return Err(failed("the terminal was not handed over".to_owned())),
        };
        let output = output.take_until(output_closes).boxed();
        Ok(ExecProcess { id, output, input })
    }

    /// Runs the helper for `files` and waits until runc has started the process (or failed).
    async fn spawn_helper(
        &self,
        container_id: &str,
        spec: &ExecSpec,
        files: &ExecFiles,
    ) -> Result<(Helper, Started, Option<PtyMaster>), String> {
        let status_listener = UnixListener::bind(&files.status)
            .map_err(|e| format!("listening on {}: {e}", files.status.display()))?;
        let console_listener = match spec.tty {
            Some(_) => Some(
                UnixListener::bind(&files.console)
                    .map_err(|e| format!("listening on {}: {e}", files.console.display()))?,
            ),
            None => None,
        };
        let mut helper = self
            .helper_command(container_id, spec.tty.is_some(), files)
            .spawn()
            .map_err(|e| format!("running {}: {e}", self.helper.display()))?;
        let mut stderr = helper
            .stderr
            .take()
            .ok_or_else(|| "the helper's stderr was not piped".to_owned())?;
        // Taken before waiting on the helper, whose `wait` would close its stdin.
        let (stdin, stdout) = (helper.stdin.take(), helper.stdout.take());

        let (reader, pid) = await_start(&mut helper, &mut stderr, status_listener).await?;
        let master = match console_listener {
            Some(listener) => Some(receive_terminal(listener).await?),
            None => None,
        };
        let pipes = match (stdin, stdout) {
            (Some(stdin), Some(stdout)) => Some(Pipes {
                stdin,
                stdout,
                stderr,
            }),
            _ => None,
        };
        Ok((Helper { helper, pipes }, Started { pid, reader }, master))
    }

    /// The helper's command line: runc, its root, the process's files and the container; the
    /// process's own stdin and stdout unless it has a terminal.
    fn helper_command(
        &self,
        container_id: &str,
        tty: bool,
        files: &ExecFiles,
    ) -> tokio::process::Command {
        let mut command = tokio::process::Command::new(&self.helper);
        command
            .arg(HELPER_ARG)
            .arg(&self.runc)
            .arg(&self.root)
            .arg(&files.process)
            .arg(&files.pid)
            .arg(&files.status)
            .arg(if tty {
                files.console.as_os_str()
            } else {
                "-".as_ref()
            })
            .arg(container_id)
            .stderr(Stdio::piped());
        if tty {
            command.stdin(Stdio::null()).stdout(Stdio::null());
        } else {
            command.stdin(Stdio::piped()).stdout(Stdio::piped());
        }
        command
    }

    /// runc's bundle directory of the container; [`DirectError::Unavailable`] when runc does
    /// not know it under the configured root.
    async fn bundle(&self, container_id: &str) -> Result<PathBuf, DirectError> {
        let output = tokio::process::Command::new(&self.runc)
            .arg("--root")
            .arg(&self.root)
            .arg("state")
            .arg(container_id)
            .stdin(Stdio::null())
            .output()
            .await
            .map_err(|e| DirectError::Unavailable(format!("running runc state: {e}")))?;
        if !output.status.success() {
            return Err(DirectError::Unavailable(format!(
                "runc state: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            )));
        }
        #[derive(Deserialize)]
        struct State {
            bundle: PathBuf,
        }
        let state: State = serde_json::from_slice(&output.stdout)
            .map_err(|e| DirectError::Unavailable(format!("runc state's answer: {e}")))?;
        Ok(state.bundle)
    }

    /// What is known of a process started here.
    pub fn status(&self, exec_id: &str) -> Result<ExecStatus, RuntimeError> {
        let Some(tracked) = lock(&self.processes).by_id.get(exec_id).cloned() else {
            return Err(RuntimeError::Setup {
                action: format!("inspecting process {exec_id}"),
                problem: "the agent does not know it (it ended long ago, or before the agent \
                          restarted)"
                    .to_owned(),
            });
        };
        let outcome = lock(&tracked.outcome).clone();
        match outcome {
            Outcome::Running => Ok(ExecStatus {
                running: true,
                exit_code: None,
                pid: Some(tracked.pid),
            }),
            Outcome::Ended { code } => Ok(ExecStatus {
                running: false,
                exit_code: Some(code),
                pid: None,
            }),
            Outcome::Lost { why } => Err(RuntimeError::Setup {
                action: format!("waiting for process {exec_id}"),
                problem: why,
            }),
        }
    }

    /// Resizes the terminal of a process started here with one.
    pub fn resize(&self, exec_id: &str, size: super::TtySize) -> Result<(), RuntimeError> {
        let tracked = lock(&self.processes).by_id.get(exec_id).cloned();
        let Some(master) = tracked.and_then(|t| t.terminal.as_ref().and_then(|w| w.upgrade()))
        else {
            return Err(RuntimeError::Setup {
                action: format!("resizing the terminal of process {exec_id}"),
                problem: "it has no terminal, or its stream has ended".to_owned(),
            });
        };
        let winsize = rustix::termios::Winsize {
            ws_row: size.rows,
            ws_col: size.cols,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        rustix::termios::tcsetwinsize(&*master, winsize).map_err(|e| RuntimeError::Setup {
            action: format!("resizing the terminal of process {exec_id}"),
            problem: e.to_string(),
        })
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The process spec of `spec` in the container whose runc `config.json` is `config`: the
/// container's process with what `docker exec` changes changed. `Err` with the reason when
/// `docker exec` must do it instead.
pub fn exec_process(config: &Value, spec: &ExecSpec) -> Result<Value, String> {
    let mut process = config
        .get("process")
        .filter(|p| p.is_object())
        .cloned()
        .ok_or_else(|| "the container's config.json has no process".to_owned())?;
    let user = process.get("user");
    let id = |key: &str| user.and_then(|u| u.get(key)).and_then(Value::as_u64);
    let (Some(uid), Some(gid)) = (id("uid"), id("gid")) else {
        return Err("the container's process has no numeric user".to_owned());
    };
    if spec.user != format!("{uid}:{gid}") {
        return Err(format!(
            "the exec's user {} is not the container's ({uid}:{gid})",
            spec.user
        ));
    }
    let mut env: Vec<String> = process
        .get("env")
        .and_then(Value::as_array)
        .map(|env| {
            env.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    if spec.tty.is_some() {
        // Docker's default for an exec with a terminal, before the exec's own variables.
        set_default_env(&mut env, "TERM", "xterm");
    }
    for (name, value) in &spec.env {
        replace_or_append_env(&mut env, name, value);
    }
    process["args"] = Value::from(spec.command.clone());
    process["env"] = Value::from(env);
    process["cwd"] = Value::from(spec.working_dir.clone());
    process["terminal"] = Value::from(spec.tty.is_some());
    match spec.tty {
        Some(size) => {
            process["consoleSize"] = serde_json::json!({"height": size.rows, "width": size.cols});
        }
        None => {
            if let Some(object) = process.as_object_mut() {
                object.remove("consoleSize");
            }
        }
    }
    Ok(process)
}

fn env_name(entry: &str) -> &str {
    entry.split_once('=').map_or(entry, |(name, _)| name)
}

fn set_default_env(env: &mut Vec<String>, name: &str, value: &str) {
    if !env.iter().any(|entry| env_name(entry) == name) {
        env.push(format!("{name}={value}"));
    }
}

fn replace_or_append_env(env: &mut Vec<String>, name: &str, value: &str) {
    let entry = format!("{name}={value}");
    match env.iter_mut().find(|existing| env_name(existing) == name) {
        Some(existing) => *existing = entry,
        None => env.push(entry),
    }
}

/// The files of one exec in the runtime's directory.
struct ExecFiles {
    process: PathBuf,
    pid: PathBuf,
    status: PathBuf,
    console: PathBuf,
}

impl ExecFiles {
    fn new(dir: &Path, n: u64) -> Self {
        Self {
            process: dir.join(format!("{n}.json")),
            pid: dir.join(format!("{n}.pid")),
            status: dir.join(format!("{n}.status")),
            console: dir.join(format!("{n}.console")),
        }
    }

    /// Once runc has started the process (or failed), none is needed any more.
    fn remove(&self) {
        for path in [&self.process, &self.pid, &self.status, &self.console] {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// The helper process, and the process's pipes when it has no terminal.
struct Helper {
    helper: tokio::process::Child,
    pipes: Option<Pipes>,
}

struct Pipes {
    stdin: tokio::process::ChildStdin,
    stdout: tokio::process::ChildStdout,
    stderr: tokio::process::ChildStderr,
}

/// The helper's report channel once the process started.
struct Started {
    pid: u32,
    reader: tokio::io::BufReader<UnixStream>,
}

/// What the helper reports, a line each.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Report {
    /// runc started the process; its host PID.
    Started {
        pid: u32,
    },
    /// runc failed with this exit status (its message is on the process's stderr).
    Failed {
        status: String,
    },
    Exited {
        code: i32,
    },
    Killed {
        signal: i32,
        core_dumped: bool,
    },
    /// The helper could not wait for the process.
    Lost {
        why: String,
    },
}

impl Report {
    fn line(&self) -> String {
        match self {
            Self::Started { pid } => format!("started {pid}\n"),
            Self::Failed { status } => format!("failed {status}\n"),
            Self::Exited { code } => format!("exited {code}\n"),
            Self::Killed {
                signal,
                core_dumped,
            } => format!("killed {signal} {}\n", u8::from(*core_dumped)),
            Self::Lost { why } => format!("lost {why}\n"),
        }
    }

    fn parse(line: &str) -> Option<Self> {
        let (word, rest) = line.trim_end().split_once(' ')?;
        Some(match word {
            "started" => Self::Started {
                pid: rest.parse().ok()?,
            },
            "failed" => Self::Failed {
                status: rest.to_owned(),
            },
            "exited" => Self::Exited {
                code: rest.parse().ok()?,
            },
            "killed" => {
                let (signal, core) = rest.split_once(' ')?;
                Self::Killed {
                    signal: signal.parse().ok()?,
                    core_dumped: core == "1",
                }
            }
            "lost" => Self::Lost {
                why: rest.to_owned(),
            },
            _ => return None,
        })
    }
}

/// Reads the helper's last report and reaps it; `ended` fires once the outcome is known.
async fn watch(
    exec_id: String,
    mut reader: tokio::io::BufReader<UnixStream>,
    mut helper: tokio::process::Child,
    tracked: Arc<Tracked>,
    registry: Arc<Mutex<Registry>>,
    ended: tokio::sync::oneshot::Sender<()>,
) {
    let mut line = String::new();
    let outcome = match reader.read_line(&mut line).await {
        Ok(_) => match Report::parse(&line) {
            Some(Report::Exited { code }) => Outcome::Ended {
                code: i64::from(code),
            },
            Some(Report::Killed { signal, .. }) => Outcome::Ended {
                code: 128 + i64::from(signal),
            },
            Some(Report::Lost { why }) => Outcome::Lost { why },
            _ => Outcome::Lost {
                why: format!(
                    "the exec helper ended without saying how the process ended ({:?})",
                    line.trim()
                ),
            },
        },
        Err(e) => Outcome::Lost {
            why: format!("reading the exec helper's report: {e}"),
        },
    };
    debug!(exec_id, ?outcome, "Direct process ended.");
    *lock(&tracked.outcome) = outcome;
    lock(&registry).ended(exec_id);
    let _ = ended.send(());
    let _ = helper.wait().await;
}

/// `pipe` with room for [`PIPE_CAPACITY`] bytes, or as it was where the kernel refuses (said
/// once).
fn enlarged<P: std::os::fd::AsFd>(pipe: P) -> P {
    use nix::fcntl::{fcntl, FcntlArg};
    static REFUSED: AtomicBool = AtomicBool::new(false);
    if let Err(error) = fcntl(&pipe, FcntlArg::F_SETPIPE_SZ(PIPE_CAPACITY)) {
        if !REFUSED.swap(true, Ordering::Relaxed) {
            warn!(%error, bytes = PIPE_CAPACITY, "The kernel does not enlarge processes' output pipes: their output goes in smaller frames. Run the agent as root, or raise /proc/sys/fs/pipe-max-size.");
        }
    }
    pipe
}

/// A process's output as chunks of at most [`CHUNK`] bytes, until it closes it.
fn chunks<R>(
    reader: R,
    wrap: fn(Vec<u8>) -> ExecOutput,
) -> BoxStream<'static, Result<ExecOutput, RuntimeError>>
where
    R: AsyncRead + Unpin + Send + 'static,
{
    futures::stream::unfold(Some(reader), move |reader| async move {
        let mut reader = reader?;
        // Room for one byte more than is read: the stream frame's tag goes in front in place.
        let mut buffer = Vec::with_capacity(CHUNK + 1);
        match reader.read_buf(&mut (&mut buffer).limit(CHUNK)).await {
            Ok(0) => None,
            Ok(_) => Some((Ok(wrap(buffer)), Some(reader))),
            Err(e) => Some((
                Err(RuntimeError::Setup {
                    action: "reading a process's output".to_owned(),
                    problem: e.to_string(),
                }),
                None,
            )),
        }
    })
    .boxed()
}

/// Receives the file descriptor runc sends over its console socket.
async fn receive_fd(socket: &UnixStream) -> io::Result<OwnedFd> {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
    loop {
        socket.readable().await?;
        let received = socket.try_io(tokio::io::Interest::READABLE, || {
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            // runc sends the terminal's name with it.
            let mut name = [0_u8; 4096];
            rustix::net::recvmsg(
                socket,
                &mut [io::IoSliceMut::new(&mut name)],
                &mut control,
                RecvFlags::CMSG_CLOEXEC,
            )?;
            let fd = control.drain().find_map(|message| match message {
                RecvAncillaryMessage::ScmRights(mut fds) => fds.next(),
                _ => None,
            });
            Ok(fd)
        });
        match received {
            Ok(Some(fd)) => return Ok(fd),
            Ok(None) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "runc's message carried no file descriptor",
                ))
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
}

/// The master side of a process's pseudo-terminal: three descriptors of it, one to read, one
/// to write and one for resizes, so that each end of the stream owns its own.
struct PtyMaster {
    reader: tokio::net::unix::pipe::Receiver,
    writer: tokio::net::unix::pipe::Sender,
    control: Arc<OwnedFd>,
}

impl PtyMaster {
    /// tokio's pipe ends poll any descriptor; the terminal is made non-blocking first, as they
    /// need.
    fn new(fd: OwnedFd) -> io::Result<Self> {
        rustix::io::ioctl_fionbio(&fd, true)?;
        let writer = rustix::io::fcntl_dupfd_cloexec(&fd, 0)?;
        let control = rustix::io::fcntl_dupfd_cloexec(&fd, 0)?;
        Ok(Self {
            reader: tokio::net::unix::pipe::Receiver::from_owned_fd_unchecked(fd)?,
            writer: tokio::net::unix::pipe::Sender::from_owned_fd_unchecked(writer)?,
            control: Arc::new(control),
        })
    }
}

/// Reads a terminal's master, ending where the terminal did: once every descriptor of its
/// slave side is closed, reading the master fails with EIO.
struct PtyReader(tokio::net::unix::pipe::Receiver);

impl AsyncRead for PtyReader {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match ready!(Pin::new(&mut self.0).poll_read(cx, buf)) {
            Err(e) if e.raw_os_error() == Some(rustix::io::Errno::IO.raw_os_error()) => {
                Poll::Ready(Ok(()))
            }
            other => Poll::Ready(other),
        }
    }
}

/// `ongrid-agent exec-helper RUNC ROOT PROCESS_JSON PID_FILE STATUS_SOCKET CONSOLE_SOCKET|- ID`:
/// the parent of one direct process (see the module's documentation). Its stdin, stdout and
/// stderr are the process's (with a terminal: none of them matter but stderr, which gets
/// runc's message when it fails).
pub fn helper_main(args: impl Iterator<Item = String>) -> ExitCode {
    let args: Vec<String> = args.collect();
    let [runc, root, process, pid_file, status, console, id] = args.as_slice() else {
        eprintln!(
            "usage: ongrid-agent {HELPER_ARG} RUNC ROOT PROCESS_JSON PID_FILE STATUS_SOCKET \
             CONSOLE_SOCKET|- CONTAINER (the agent runs this; it is not for people)"
        );
        return ExitCode::from(2);
    };
    let mut report = match std::os::unix::net::UnixStream::connect(status) {
        Ok(socket) => socket,
        Err(e) => {
            eprintln!("ongrid-agent {HELPER_ARG}: connecting to {status}: {e}");
            return ExitCode::from(2);
        }
    };
    let mut say = |line: Report| {
        // The agent may have gone; the process is waited for all the same.
        let _ = report.write_all(line.line().as_bytes());
    };
    if let Err(e) = nix::sys::prctl::set_child_subreaper(true) {
        say(Report::Failed {
            status: format!("cannot become a child subreaper: {e}"),
        });
        return ExitCode::from(1);
    }
    let mut command = std::process::Command::new(runc);
    command
        .arg("--root")
        .arg(root)
        .arg("exec")
        .arg("--detach")
        .arg("--pid-file")
        .arg(pid_file)
        .arg("--process")
        .arg(process);
    if console != "-" {
        command.arg("--console-socket").arg(console);
    }
    command.arg(id);
    let status = match command.status() {
        Ok(status) => status,
        Err(e) => {
            eprintln!("running {runc}: {e}");
            say(Report::Failed {
                status: "not run".to_owned(),
            });
            return ExitCode::from(1);
        }
    };
    if !status.success() {
        say(Report::Failed {
            status: status.to_string(),
        });
        return ExitCode::from(1);
    }
    // The process's ends of the pipes are its alone from now on, so that its output ends
    // when it closes them.
    if let Err(e) = drop_stdio() {
        say(Report::Lost {
            why: format!("the exec helper could not let go of the pipes: {e}"),
        });
    }
    let pid = std::fs::read_to_string(pid_file)
        .ok()
        .and_then(|text| text.trim().parse::<i32>().ok());
    let Some(pid) = pid else {
        say(Report::Lost {
            why: format!("runc wrote no PID to {pid_file}"),
        });
        return ExitCode::from(1);
    };
    say(Report::Started {
        pid: u32::try_from(pid).unwrap_or_default(),
    });
    say(wait_for(nix::unistd::Pid::from_raw(pid)));
    ExitCode::SUCCESS
}

/// Points stdin, stdout and stderr at `/dev/null`.
fn drop_stdio() -> io::Result<()> {
    let null = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")?;
    rustix::stdio::dup2_stdin(&null)?;
    rustix::stdio::dup2_stdout(&null)?;
    rustix::stdio::dup2_stderr(&null)?;
    Ok(())
}

/// Reaps children (the process, adopted once runc exited) until `pid` has ended.
fn wait_for(pid: nix::unistd::Pid) -> Report {
    use nix::errno::Errno;
    use nix::sys::wait::{waitpid, WaitStatus};
    loop {
        match waitpid(nix::unistd::Pid::from_raw(-1), None) {
            Ok(WaitStatus::Exited(child, code)) if child == pid => {
                return Report::Exited { code };
            }
            Ok(WaitStatus::Signaled(child, signal, core_dumped)) if child == pid => {
                return Report::Killed {
                    signal: signal as i32,
                    core_dumped,
                };
            }
            Ok(_) | Err(Errno::EINTR) => {}
            Err(e) => {
                return Report::Lost {
                    why: format!("waiting for process {pid}: {e}"),
                };
            }
        }
    }
}

/// Waits for the helper's report that runc started the process: its pid, and the status
/// socket the exit code comes on. runc's own message when it failed, the helper's stderr when
/// it ended before reporting.
async fn await_start(
    helper: &mut tokio::process::Child,
    stderr: &mut tokio::process::ChildStderr,
    status_listener: UnixListener,
) -> Result<(tokio::io::BufReader<tokio::net::UnixStream>, u32), String> {
    let report = async {
        let (socket, _) = status_listener.accept().await?;
        let mut reader = tokio::io::BufReader::new(socket);
        let mut line = String::new();
        reader.read_line(&mut line).await?;
        io::Result::Ok((reader, line))
    };
    let report = tokio::time::timeout(START_TIMEOUT, report);
    tokio::pin!(report);
    let report = tokio::select! {
        report = &mut report => report,
        exited = helper.wait() => {
            // Its report, when it made one before it ended, is already on the socket.
            match tokio::time::timeout(Duration::from_secs(1), &mut report).await {
                Ok(report) => report,
                Err(_) => {
                    let mut message = String::new();
                    let _ = stderr.read_to_string(&mut message).await;
                    return Err(format!(
                        "the exec helper ended ({}) before runc started the process: {}",
                        exited.map(|s| s.to_string()).unwrap_or_else(|e| e.to_string()),
                        message.trim()
                    ));
                }
            }
        }
    };
    let (reader, line) = match report {
        Ok(Ok(report)) => report,
        Ok(Err(e)) => return Err(format!("reading the exec helper's report: {e}")),
        Err(_) => {
            let _ = helper.start_kill();
            return Err(format!(
                "runc did not start it within {} s",
                START_TIMEOUT.as_secs()
            ));
        }
    };
    let pid = match Report::parse(&line) {
        Some(Report::Started { pid }) => pid,
        Some(Report::Failed { status }) => {
            // runc's own message went to the stderr it shared with the process.
            let mut message = String::new();
            let _ =
                tokio::time::timeout(Duration::from_secs(5), stderr.read_to_string(&mut message))
                    .await;
            let _ = helper.wait().await;
            return Err(format!("runc failed ({status}): {}", message.trim()));
        }
        _ => return Err(format!("the exec helper said {:?}", line.trim())),
    };
    Ok((reader, pid))
}

/// The terminal's master, which runc hands over on the console socket.
async fn receive_terminal(listener: UnixListener) -> Result<PtyMaster, String> {
    let receive = async {
        let (socket, _) = listener.accept().await?;
        receive_fd(&socket).await
    };
    let fd = tokio::time::timeout(Duration::from_secs(5), receive)
        .await
        .map_err(|_| "runc did not hand over the terminal".to_owned())?
        .map_err(|e| format!("receiving the terminal from runc: {e}"))?;
    PtyMaster::new(fd).map_err(|e| format!("the terminal's master: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::TtySize;

    /// A process's output pipe is given room for a megabyte, and a read of it takes at most
    /// [`CHUNK`], whose frame fills a 64 KiB WebSocket message (4-byte header) exactly.
    #[tokio::test]
    async fn output_pipes_are_enlarged_and_read_a_frame_at_a_time() {
        use nix::fcntl::{fcntl, FcntlArg};
        let (reader, writer) = nix::unistd::pipe().unwrap();
        let default = fcntl(&reader, FcntlArg::F_GETPIPE_SZ).unwrap();
        let reader = enlarged(reader);
        assert_eq!(
            fcntl(&reader, FcntlArg::F_GETPIPE_SZ).unwrap(),
            PIPE_CAPACITY
        );
        assert!(default < PIPE_CAPACITY, "{default}");

        // 200 KiB written at once fit in the pipe; they are read as full frames and the rest.
        let written = vec![7u8; 200 * 1024];
        std::fs::File::from(writer).write_all(&written).unwrap();
        let reader = tokio::net::unix::pipe::Receiver::from_owned_fd(reader).unwrap();
        let sizes: Vec<usize> = chunks(reader, ExecOutput::Stdout)
            .map(|chunk| match chunk.unwrap() {
                ExecOutput::Stdout(bytes) => bytes.len(),
                other => panic!("{other:?}"),
            })
            .collect()
            .await;
        assert_eq!(sizes, [CHUNK, CHUNK, CHUNK, 200 * 1024 - 3 * CHUNK]);
        let message = ongrid_core::stream::Frame::Data(vec![0; CHUNK]).into_encoded();
        assert_eq!(4 + message.len(), 64 * 1024);
    }

    fn config() -> Value {
        serde_json::json!({
            "ociVersion": "1.0.2-dev",
            "process": {
                "user": {"uid": 20001, "gid": 20001, "additionalGids": [20001, 44]},
                "args": ["sleep", "infinity"],
                "env": ["PATH=/usr/local/cuda/bin:/usr/bin:/bin", "HOSTNAME=abc", "LANG=C.UTF-8"],
                "cwd": "/",
                "capabilities": {"bounding": ["CAP_CHOWN"], "effective": ["CAP_CHOWN"]},
                "noNewPrivileges": true,
                "apparmorProfile": "docker-default",
                "oomScoreAdj": 0,
                "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}]
            }
        })
    }

    fn spec(tty: Option<TtySize>) -> ExecSpec {
        ExecSpec {
            command: vec!["/bin/sh".into(), "-l".into()],
            user: "20001:20001".into(),
            working_dir: "/home/alice".into(),
            env: vec![
                ("HOME".into(), "/home/alice".into()),
                ("LANG".into(), "en_GB.UTF-8".into()),
            ],
            tty,
        }
    }

    #[test]
    fn the_process_is_the_containers_with_what_docker_exec_changes_changed() {
        let process = exec_process(&config(), &spec(None)).unwrap();
        let mut expected = config()["process"].clone();
        expected["args"] = serde_json::json!(["/bin/sh", "-l"]);
        expected["env"] = serde_json::json!([
            "PATH=/usr/local/cuda/bin:/usr/bin:/bin",
            "HOSTNAME=abc",
            "LANG=en_GB.UTF-8",
            "HOME=/home/alice"
        ]);
        expected["cwd"] = serde_json::json!("/home/alice");
        expected["terminal"] = serde_json::json!(false);
        assert_eq!(
            process, expected,
            "user, capabilities, rlimits and labels kept"
        );
    }

    #[test]
    fn a_terminal_gets_its_size_and_docker_exec_s_default_term() {
        let size = TtySize {
            cols: 120,
            rows: 40,
        };
        let process = exec_process(&config(), &spec(Some(size))).unwrap();
        assert_eq!(process["terminal"], serde_json::json!(true));
        assert_eq!(
            process["consoleSize"],
            serde_json::json!({"height": 40, "width": 120})
        );
        assert!(process["env"]
            .as_array()
            .unwrap()
            .contains(&serde_json::json!("TERM=xterm")));

        let mut with_term = spec(Some(size));
        with_term.env.push(("TERM".into(), "xterm-256color".into()));
        let process = exec_process(&config(), &with_term).unwrap();
        let terms: Vec<_> = process["env"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e.as_str().unwrap().starts_with("TERM="))
            .collect();
        assert_eq!(terms, [&serde_json::json!("TERM=xterm-256color")]);
    }

    #[test]
    fn another_user_than_the_containers_is_left_to_docker_exec() {
        let mut other = spec(None);
        other.user = "0:0".into();
        let why = exec_process(&config(), &other).unwrap_err();
        assert!(why.contains("not the container's (20001:20001)"), "{why}");
        other.user = "alice".into();
        assert!(exec_process(&config(), &other).is_err());
        assert!(exec_process(&serde_json::json!({}), &spec(None)).is_err());
    }

    #[test]
    fn reports_survive_their_line() {
        for report in [
            Report::Started { pid: 4242 },
            Report::Failed {
                status: "exit status: 1".into(),
            },
            Report::Exited { code: 3 },
            Report::Killed {
                signal: 15,
                core_dumped: false,
            },
            Report::Killed {
                signal: 11,
                core_dumped: true,
            },
            Report::Lost {
                why: "waiting for process 7: ECHILD".into(),
            },
        ] {
            let line = report.line();
            assert_eq!(Report::parse(&line), Some(report.clone()), "{line:?}");
        }
        assert_eq!(Report::parse("started x\n"), None);
        assert_eq!(Report::parse("hello\n"), None);
    }
}
