//! Shell, exec and the `sftp` subsystem: a process in the session's container (started with
//! runc beside dockerd, else `docker exec`: [`crate::runtime::direct`]), run as the container's
//! user in the user's home, its output and exit status sent back as frames.
//!
//! - Commands. `Shell` is the login shell ([`LOGIN_SHELL`] `-l`, `/bin/sh -l` when the image
//!   lacks it). `Exec` runs the command with that shell's `-c`, as sshd does (never split into
//!   words). `sftp` runs the image's own `sftp-server`, found by a short probe; an image without
//!   one gets the node's, copied into the container once with its loader and libraries
//!   ([`SftpInjector`]), and when the node has none either, an error naming the package.
//! - Environment: HOME, USER, LOGNAME, SHELL, the client's allowed variables (LANG, LC_*, TERM),
//!   and TERM from the pseudo-terminal. PATH is the container's own (the image's), so CUDA images
//!   keep their paths.
//! - Input. `Data` goes to stdin through a bounded queue; `Eof` closes stdin (`cat > f` ends).
//!   With a terminal `Eof` is ignored (sshd too keeps the terminal open): closing a terminal
//!   exec's stdin makes Docker end the whole attach, and the rest of the output would be lost.
//!   `Resize` resizes the terminal. `Signal` is sent by the agent on the host to the process's
//!   group (Docker has no exec-kill API); signals to a subsystem are ignored, as sshd does.
//! - Output: `Data` (stdout, or everything with a terminal) and `Stderr`, then `Eof` when the
//!   output ends, then `Exit` once the process has ended, then the stream closes.
//! - Exit status. Docker reports only an exit code, and a process killed by signal N as
//!   128 + N, exactly like a shell reporting a child killed by N; a direct process is reported
//!   the same way. The agent always answers [`ExitStatus::Code`] (OpenSSH's client then exits
//!   with that code, as a shell would report it); it never claims `exit-signal`.
//! - The gateway going away ends the stream: a process with a terminal gets SIGHUP (the terminal
//!   hung up), one without sees its stdin closed.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use ongrid_core::stream::{env_allowed, ExitStatus, Frame, Pty, StreamKind, StreamOpen};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::host::{self, signal_by_ssh_name};
use super::{send_owned, FrameChannel, QUEUE_FRAMES};
use crate::runtime::accounts::LOGIN_SHELL;
use crate::runtime::inject::{InjectError, SftpInjector};
use crate::runtime::{
    error_chain, ContainerRuntime, ExecOutput, ExecSpec, ExecStatus, RuntimeError,
    SessionContainer, TtySize,
};

pub use crate::runtime::inject::SFTP_SERVER_PATHS;

/// How long the probe for `sftp-server` may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long copying the node's `sftp-server` into a container may take (a few MiB through
/// Docker's archive API; other streams of the container wait meanwhile).
const INJECT_TIMEOUT: Duration = Duration::from_secs(60);
/// The longest wait between two questions to Docker whether a process has ended.
const MAX_EXIT_POLL: Duration = Duration::from_secs(1);
/// How long Docker may report a process as neither running nor ended (starting, or its end not
/// yet recorded) before the agent gives up asking.
const UNSETTLED_LIMIT: Duration = Duration::from_secs(10);

/// What to run for a stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Program {
    LoginShell,
    Command(String),
    /// An executable and its arguments, run directly without a shell (the sftp server).
    Direct(Vec<String>),
}

/// The `docker exec` of `program` for `container`: its user, home, environment and terminal.
pub fn exec_spec(
    container: &SessionContainer,
    program: &Program,
    pty: Option<&Pty>,
    client_env: &[(String, String)],
) -> ExecSpec {
    let home = format!("/home/{}", container.login);
    let shell_fallback = |login_args: &str| {
        format!("if [ -x {LOGIN_SHELL} ]; then exec {LOGIN_SHELL} {login_args}; fi; exec /bin/sh {login_args}")
    };
    let command = match program {
        Program::LoginShell => vec!["/bin/sh".to_owned(), "-c".to_owned(), shell_fallback("-l")],
        Program::Command(command) => vec![
            "/bin/sh".to_owned(),
            "-c".to_owned(),
            shell_fallback(r#"-c "$1""#),
            "sh".to_owned(),
            command.clone(),
        ],
        Program::Direct(command) => command.clone(),
    };
    let mut env = Vec::new();
    let mut set = |name: &str, value: &str| {
        env.retain(|(existing, _): &(String, String)| existing != name);
        env.push((name.to_owned(), value.to_owned()));
    };
    set("HOME", &home);
    set("USER", &container.login);
    set("LOGNAME", &container.login);
    set("SHELL", LOGIN_SHELL);
    for (name, value) in client_env {
        let plain_name =
            !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if env_allowed(name) && plain_name && !value.contains('\0') {
            set(name, value);
        }
    }
    if let Some(pty) = pty {
        set("TERM", &pty.term);
    }
    ExecSpec {
        command,
        user: container.user.clone(),
        working_dir: home,
        env,
        tty: pty.map(tty_size),
    }
}

fn tty_size(pty: &Pty) -> TtySize {
    let clamp = |n: u32| u16::try_from(n).unwrap_or(u16::MAX).max(1);
    TtySize {
        cols: clamp(pty.cols),
        rows: clamp(pty.rows),
    }
}

/// Serves a `Shell`, `Exec` or `Subsystem` stream to its end.
pub async fn serve(
    runtime: Arc<dyn ContainerRuntime>,
    injector: &SftpInjector,
    container: SessionContainer,
    open: StreamOpen,
    channel: FrameChannel,
    shutdown: CancellationToken,
) {
    let (program, pty, is_subsystem) = match open.kind {
        StreamKind::Shell { pty } => (Program::LoginShell, pty, false),
        StreamKind::Exec { command, pty } => (Program::Command(command), pty, false),
        StreamKind::Subsystem { name } if name == "sftp" => {
            match sftp_server(runtime.as_ref(), injector, &container).await {
                Ok(command) => (Program::Direct(command), None, true),
                Err(SftpError::Lend(InjectError::NoHostServer { searched })) => {
                    info!(session = %container.session_id, %searched,
                          "No sftp-server in the image nor on the node.");
                    let message = format!(
                        "the image of session {} has no sftp-server, and this node has none to \
                         lend it: install openssh-sftp-server in the image or on the node (scp -O \
                         and rsync work without it)",
                        container.session_name
                    );
                    let _ = channel.outgoing.send(Frame::Error(message)).await;
                    return;
                }
                Err(SftpError::Lend(e)) => {
                    warn!(session = %container.session_id, error = %error_chain(&e),
                          "Cannot lend the node's sftp server to a container.");
                    let message = format!(
                        "cannot start sftp in session {}: its image has no sftp-server and the \
                         node agent could not copy the node's into it: {}",
                        container.session_name,
                        error_chain(&e)
                    );
                    let _ = channel.outgoing.send(Frame::Error(message)).await;
                    return;
                }
                Err(SftpError::Probe(e)) => {
                    warn!(session = %container.session_id, error = %error_chain(&e),
                          "Cannot look for the sftp server.");
                    let message = format!(
                        "cannot start sftp in session {}: the node agent failed to look for \
                         sftp-server; try again",
                        container.session_name
                    );
                    let _ = channel.outgoing.send(Frame::Error(message)).await;
                    return;
                }
            }
        }
        StreamKind::Subsystem { name } => {
            let message = format!("subsystem {name:?} is not supported: only sftp is");
            let _ = channel.outgoing.send(Frame::Error(message)).await;
            return;
        }
        StreamKind::DirectTcpip { .. } => {
            let _ = channel
                .outgoing
                .send(Frame::Error("internal error: not a process stream".into()))
                .await;
            return;
        }
    };
    let spec = exec_spec(&container, &program, pty.as_ref(), &open.env);
    let stream = ProcessStream {
        runtime,
        container,
        tty: spec.tty,
        is_subsystem,
    };
    stream.run(&spec, channel, shutdown).await;
}

/// One started process and how to talk to it.
struct ProcessStream {
    runtime: Arc<dyn ContainerRuntime>,
    container: SessionContainer,
    tty: Option<TtySize>,
    is_subsystem: bool,
}

/// How the output side of a stream ended.
enum Ended {
    /// The process closed its output.
    Output,
    /// The gateway went away (or the agent is stopping): nobody is listening any more.
    Abandoned,
}

impl ProcessStream {
    async fn run(&self, spec: &ExecSpec, channel: FrameChannel, shutdown: CancellationToken) {
        let FrameChannel { incoming, outgoing } = channel;
        let session = self.container.session_id;
        let process = match self.runtime.start_exec(&self.container.id, spec).await {
            Ok(process) => process,
            Err(e) => {
                warn!(%session, error = %error_chain(&e), "Cannot start a process for a stream.");
                let message = format!(
                    "cannot start a process in session {}: {}",
                    self.container.session_name,
                    error_chain(&e)
                );
                let _ = outgoing.send(Frame::Error(message)).await;
                return;
            }
        };
        let exec_id = process.id.clone();
        info!(%session, %exec_id, tty = self.tty.is_some(), "Stream process started.");
        if let Some(size) = self.tty {
            // Docker sets the initial size itself (ConsoleSize, or the runtime's stty wrapper);
            // this resize makes sure, and a failure here is not worth ending the stream for.
            if let Err(e) = self.runtime.resize_exec(&exec_id, size).await {
                debug!(%exec_id, error = %error_chain(&e), "Initial resize failed.");
            }
        }
        if outgoing.send(Frame::Ready).await.is_err() {
            self.hang_up(&exec_id).await;
            return;
        }

        let (stdin, stdin_queue) = mpsc::channel::<Vec<u8>>(QUEUE_FRAMES);
        let mut input = process.input;
        let stdin_writer = AbortOnDrop(tokio::spawn(async move {
            let mut stdin_queue = stdin_queue;
            while let Some(bytes) = stdin_queue.recv().await {
                if input.write_all(&bytes).await.is_err() {
                    // The process closed its stdin; what else the client sends is dropped.
                    return;
                }
            }
            let _ = input.shutdown().await;
        }));

        let control = self.control(incoming, stdin, &exec_id);
        let output = pump_output(process.output, &outgoing);
        tokio::pin!(control, output);
        let ended = tokio::select! {
            ended = &mut output => ended,
            () = &mut control => Ended::Abandoned,
            () = shutdown.cancelled() => {
                let _ = outgoing.send(Frame::Error(SHUTTING_DOWN.to_owned())).await;
                Ended::Abandoned
            }
        };
        if let Ended::Abandoned = ended {
            self.hang_up(&exec_id).await;
            return;
        }
        if outgoing.send(Frame::Eof).await.is_err() {
            self.hang_up(&exec_id).await;
            return;
        }
        // Signals may still come while the process finishes (its output may be closed early).
        let exit = tokio::select! {
            exit = wait_for_exit(self.runtime.as_ref(), &exec_id) => exit,
            () = &mut control => {
                self.hang_up(&exec_id).await;
                return;
            }
            () = shutdown.cancelled() => {
                let _ = outgoing.send(Frame::Error(SHUTTING_DOWN.to_owned())).await;
                self.hang_up(&exec_id).await;
                return;
            }
        };
        drop(stdin_writer);
        let frame = match exit {
            Ok(code) => {
                info!(%session, %exec_id, code, "Stream process ended.");
                Frame::Exit(ExitStatus::Code {
                    code: u32::try_from(code).unwrap_or(255),
                })
            }
            Err(e) => {
                warn!(%session, %exec_id, error = %error_chain(&e), "Cannot learn how a stream process ended.");
                Frame::Error(format!(
                    "the command ended but its exit status is unknown: {}",
                    error_chain(&e)
                ))
            }
        };
        let _ = outgoing.send(frame).await;
    }

    /// Handles the gateway's frames until it goes away: stdin, EOF, resizes and signals.
    async fn control(
        &self,
        mut incoming: mpsc::Receiver<Frame>,
        stdin: mpsc::Sender<Vec<u8>>,
        exec_id: &str,
    ) {
        let mut stdin = Some(stdin);
        while let Some(frame) = incoming.recv().await {
            match frame {
                Frame::Data(bytes) => {
                    if let Some(queue) = &stdin {
                        if queue.send(bytes).await.is_err() {
                            stdin = None;
                        }
                    }
                }
                Frame::Eof if self.tty.is_none() => stdin = None,
                Frame::Eof => {}
                Frame::Resize { cols, rows } => {
                    if self.tty.is_some() {
                        let size = tty_size(&Pty {
                            term: String::new(),
                            cols,
                            rows,
                        });
                        if let Err(e) = self.runtime.resize_exec(exec_id, size).await {
                            debug!(%exec_id, error = %error_chain(&e), "Resize failed.");
                        }
                    }
                }
                Frame::Signal(name) => self.signal(exec_id, &name).await,
                other => {
                    debug!(%exec_id, frame = ?other, "Ignoring a frame the gateway should not send.");
                }
            }
        }
    }

    async fn signal(&self, exec_id: &str, name: &str) {
        if self.is_subsystem {
            debug!(%exec_id, signal = name, "Not signalling a subsystem, as sshd does not.");
            return;
        }
        let Some(signal) = signal_by_ssh_name(name) else {
            debug!(%exec_id, signal = name, "Ignoring an unknown signal name.");
            return;
        };
        let status = match wait_until_started(self.runtime.as_ref(), exec_id).await {
            Ok(status) => status,
            Err(e) => {
                debug!(%exec_id, error = %error_chain(&e), "Cannot inspect the process to signal.");
                return;
            }
        };
        let (Some(pid), true) = (status.pid, status.running) else {
            debug!(%exec_id, signal = name, "The process has ended; no signal sent.");
            return;
        };
        let Some(container_pid) = self.container.pid else {
            debug!(%exec_id, signal = name, "The container's PID is unknown; no signal sent.");
            return;
        };
        match host::signal_process(pid, container_pid, signal) {
            Ok(()) => {
                info!(session = %self.container.session_id, %exec_id, pid, %signal, "Signal sent.")
            }
            Err(e) => warn!(%exec_id, error = %error_chain(&e), "Cannot send a signal."),
        }
    }

    /// The gateway is gone: a terminal hangs up (SIGHUP), as when sshd's client disconnects.
    /// Without a terminal, dropping the attach closes the process's stdin.
    async fn hang_up(&self, exec_id: &str) {
        if self.tty.is_some() {
            self.signal(exec_id, "HUP").await;
        }
    }
}

/// The gateway's user sees this when the agent stops under an open stream.
pub const SHUTTING_DOWN: &str = "the node agent is restarting: connect again in a moment";

/// Sends the process's output as frames until it ends, or until the gateway is gone.
async fn pump_output(
    mut output: futures::stream::BoxStream<'static, Result<ExecOutput, RuntimeError>>,
    outgoing: &mpsc::Sender<Frame>,
) -> Ended {
    while let Some(chunk) = output.next().await {
        let sent = match chunk {
            Ok(ExecOutput::Stdout(bytes)) => send_owned(outgoing, bytes, Frame::Data).await,
            Ok(ExecOutput::Stderr(bytes)) => send_owned(outgoing, bytes, Frame::Stderr).await,
            Err(e) => {
                // The attach broke (Docker restarted, the container was removed): the output
                // ends here, and the exit status says what happened to the process.
                debug!(error = %error_chain(&e), "The output of a stream process broke off.");
                return Ended::Output;
            }
        };
        if sent.is_err() {
            return Ended::Abandoned;
        }
    }
    Ended::Output
}

/// Waits until Docker reports the process ended; its exit code.
pub async fn wait_for_exit(
    runtime: &dyn ContainerRuntime,
    exec_id: &str,
) -> Result<i64, RuntimeError> {
    let mut delay = Duration::from_millis(10);
    let mut unknown_since = None;
    loop {
        let status = runtime.inspect_exec(exec_id).await?;
        if let Some(code) = status.exit_code {
            return Ok(code);
        }
        if status.running {
            unknown_since = None;
        } else {
            // Neither running nor ended: not started yet, or its end not recorded yet.
            let since = *unknown_since.get_or_insert_with(tokio::time::Instant::now);
            if since.elapsed() > UNSETTLED_LIMIT {
                return Err(RuntimeError::Setup {
                    action: format!("waiting for exec {exec_id}"),
                    problem: "Docker reports it neither running nor ended with an exit code"
                        .to_owned(),
                });
            }
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(MAX_EXIT_POLL);
    }
}

/// The process's status once Docker has it running (or ended): right after `start_exec`
/// returns, Docker may not have started it yet.
async fn wait_until_started(
    runtime: &dyn ContainerRuntime,
    exec_id: &str,
) -> Result<ExecStatus, RuntimeError> {
    let deadline = tokio::time::Instant::now() + UNSETTLED_LIMIT;
    let mut delay = Duration::from_millis(5);
    loop {
        let status = runtime.inspect_exec(exec_id).await?;
        let settled = (status.running && status.pid.is_some()) || status.exit_code.is_some();
        if settled || tokio::time::Instant::now() >= deadline {
            return Ok(status);
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_millis(100));
    }
}

/// Why the sftp server cannot be started.
enum SftpError {
    /// Looking for the image's own failed.
    Probe(RuntimeError),
    /// The image has none, and lending the node's failed.
    Lend(InjectError),
}

/// The command that runs an sftp server in the container: the image's own, else the node's,
/// injected.
async fn sftp_server(
    runtime: &dyn ContainerRuntime,
    injector: &SftpInjector,
    container: &SessionContainer,
) -> Result<Vec<String>, SftpError> {
    match find_sftp_server(runtime, container).await {
        Ok(Some(path)) => Ok(vec![path]),
        Ok(None) => {
            let inject = injector.command(runtime, &container.id);
            match tokio::time::timeout(INJECT_TIMEOUT, inject).await {
                Ok(command) => command.map_err(SftpError::Lend),
                Err(_) => Err(SftpError::Lend(InjectError::Runtime(RuntimeError::Setup {
                    action: format!("copying sftp-server into container {}", container.id),
                    problem: format!(
                        "Docker did not finish within {} s",
                        INJECT_TIMEOUT.as_secs()
                    ),
                }))),
            }
        }
        Err(e) => Err(SftpError::Probe(e)),
    }
}

/// The first of [`SFTP_SERVER_PATHS`] that is executable in the container, asked with a short
/// shell run as the user. An image without `/bin/sh` has none, as far as the agent can tell.
async fn find_sftp_server(
    runtime: &dyn ContainerRuntime,
    container: &SessionContainer,
) -> Result<Option<String>, RuntimeError> {
    let mut spec = exec_spec(container, &Program::LoginShell, None, &[]);
    spec.command = vec![
        "/bin/sh".to_owned(),
        "-c".to_owned(),
        r#"for p in "$@"; do if [ -x "$p" ]; then printf '%s' "$p"; exit 0; fi; done; exit 1"#
            .to_owned(),
        "sh".to_owned(),
    ];
    spec.command
        .extend(SFTP_SERVER_PATHS.iter().map(|p| (*p).to_owned()));
    let probe = async {
        let mut process = runtime.start_exec(&container.id, &spec).await?;
        let _ = process.input.shutdown().await;
        let mut found = Vec::new();
        while let Some(chunk) = process.output.next().await {
            if let ExecOutput::Stdout(bytes) = chunk? {
                found.extend_from_slice(&bytes);
            }
        }
        let code = wait_for_exit(runtime, &process.id).await?;
        let found = String::from_utf8_lossy(&found).into_owned();
        Ok((code == 0 && SFTP_SERVER_PATHS.contains(&found.as_str())).then_some(found))
    };
    tokio::time::timeout(PROBE_TIMEOUT, probe)
        .await
        .unwrap_or_else(|_| {
            Err(RuntimeError::Setup {
                action: format!("looking for sftp-server in container {}", container.id),
                problem: format!("no answer within {} s", PROBE_TIMEOUT.as_secs()),
            })
        })
}

/// Aborts a task when dropped, so no helper task outlives its stream.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ongrid_core::SessionId;

    fn container() -> SessionContainer {
        SessionContainer {
            id: "c1".into(),
            session_id: SessionId::new_random(),
            session_name: "train1".into(),
            owner: "/DC=org/CN=Alice".into(),
            login: "alice".into(),
            user: "20001:20001".into(),
            running: true,
            pid: Some(7),
        }
    }

    fn env_of(spec: &ExecSpec) -> Vec<(&str, &str)> {
        spec.env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect()
    }

    #[test]
    fn a_command_runs_whole_through_the_login_shell_as_the_user_at_home() {
        let command = r#"echo "a  b" | tr a b; exit 3"#;
        let spec = exec_spec(&container(), &Program::Command(command.into()), None, &[]);
        assert_eq!(
            spec.command,
            [
                "/bin/sh",
                "-c",
                r#"if [ -x /bin/bash ]; then exec /bin/bash -c "$1"; fi; exec /bin/sh -c "$1""#,
                "sh",
                command
            ]
        );
        assert_eq!(spec.user, "20001:20001");
        assert_eq!(spec.working_dir, "/home/alice");
        assert_eq!(spec.tty, None);
        assert_eq!(
            env_of(&spec),
            [
                ("HOME", "/home/alice"),
                ("USER", "alice"),
                ("LOGNAME", "alice"),
                ("SHELL", "/bin/bash")
            ]
        );
    }

    #[test]
    fn a_shell_is_a_login_shell_with_the_terminals_type_and_size() {
        let pty = Pty {
            term: "xterm-256color".into(),
            cols: 120,
            rows: 40,
        };
        let client_env = [
            ("TERM".to_owned(), "vt100".to_owned()),
            ("LC_ALL".to_owned(), "C.UTF-8".to_owned()),
            ("LANG".to_owned(), "en_GB.UTF-8".to_owned()),
            ("LD_PRELOAD".to_owned(), "/tmp/evil.so".to_owned()),
            ("HOME".to_owned(), "/root".to_owned()),
            ("LC_BAD=X".to_owned(), "1".to_owned()),
            ("LC_NUL".to_owned(), "a\0b".to_owned()),
        ];
        let spec = exec_spec(&container(), &Program::LoginShell, Some(&pty), &client_env);
        assert_eq!(
            spec.command,
            [
                "/bin/sh",
                "-c",
                "if [ -x /bin/bash ]; then exec /bin/bash -l; fi; exec /bin/sh -l"
            ]
        );
        assert_eq!(
            spec.tty,
            Some(TtySize {
                cols: 120,
                rows: 40
            })
        );
        assert_eq!(
            env_of(&spec),
            [
                ("HOME", "/home/alice"),
                ("USER", "alice"),
                ("LOGNAME", "alice"),
                ("SHELL", "/bin/bash"),
                ("LC_ALL", "C.UTF-8"),
                ("LANG", "en_GB.UTF-8"),
                ("TERM", "xterm-256color"),
            ],
            "only allowed names; the terminal's TERM wins"
        );
    }

    #[test]
    fn terminal_sizes_are_clamped() {
        let size = |cols, rows| {
            tty_size(&Pty {
                term: String::new(),
                cols,
                rows,
            })
        };
        assert_eq!(size(0, 0), TtySize { cols: 1, rows: 1 });
        assert_eq!(
            size(1 << 20, 50),
            TtySize {
                cols: u16::MAX,
                rows: 50
            }
        );
    }

    #[test]
    fn the_sftp_server_runs_directly_without_a_terminal() {
        let program = Program::Direct(vec![SFTP_SERVER_PATHS[0].to_owned()]);
        let spec = exec_spec(&container(), &program, None, &[]);
        assert_eq!(spec.command, ["/usr/lib/openssh/sftp-server"]);
        assert_eq!(spec.tty, None);
    }
}
