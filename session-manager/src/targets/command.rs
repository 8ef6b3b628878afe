//! Running an engine's command: an argv (never a shell), optional standard input, extra
//! environment, a timeout, and the output captured. Shared by the targets.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::AsyncWriteExt;

/// How long an engine's command may take before it is killed and the engine counts as
/// unavailable.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);

/// A command to run.
#[derive(Debug, Clone, Default)]
pub struct Invocation {
    pub argv: Vec<String>,
    pub stdin: Option<Vec<u8>>,
    pub env: Vec<(String, String)>,
}

/// What a finished command printed.
#[derive(Debug, Clone)]
pub struct Finished {
    /// `None` when killed by a signal.
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Finished {
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }

    /// The last non-empty line of stderr (else stdout), for messages.
    pub fn last_words(&self) -> String {
        let pick = |text: &str| {
            text.lines()
                .rev()
                .map(str::trim)
                .find(|line| !line.is_empty())
                .map(str::to_owned)
        };
        pick(&self.stderr)
            .or_else(|| pick(&self.stdout))
            .unwrap_or_else(|| format!("exit code {:?}, no output", self.code))
    }
}

/// How often a program found busy (`ETXTBSY`) is started again before that is the error.
const BUSY_RETRIES: u32 = 5;

/// Starts `command`. A program file that another process still holds open for writing
/// (`ETXTBSY`: a wrapper script an admin is replacing, or, in a process that writes scripts
/// while other threads fork, a descriptor a forked child has not closed yet) is tried again a
/// few times, 20 ms apart, as cargo and make do.
async fn spawn(command: &mut tokio::process::Command) -> std::io::Result<tokio::process::Child> {
    let mut tries = 0;
    loop {
        match command.spawn() {
            Err(e)
                if e.kind() == std::io::ErrorKind::ExecutableFileBusy && tries < BUSY_RETRIES =>
            {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => return other,
        }
    }
}

/// Runs `invocation`; an error only when it could not be started or timed out (a non-zero
/// exit is a [`Finished`] for the caller to judge).
pub async fn run(invocation: &Invocation) -> Result<Finished, String> {
    let (program, args) = invocation
        .argv
        .split_first()
        .ok_or_else(|| "empty command".to_owned())?;
    let mut command = tokio::process::Command::new(program);
    command
        .args(args)
        .envs(invocation.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(if invocation.stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = spawn(&mut command)
        .await
        .map_err(|e| format!("cannot run {program}: {e}"))?;
    if let (Some(input), Some(mut stdin)) = (&invocation.stdin, child.stdin.take()) {
        match stdin.write_all(input).await {
            Ok(()) => {}
            // It ended without reading all of it (e.g. `run_as` found no such program): its
            // exit code and words say why.
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
            Err(e) => return Err(format!("writing to {program}: {e}")),
        }
        drop(stdin);
    }
    let output = tokio::time::timeout(COMMAND_TIMEOUT, child.wait_with_output())
        .await
        .map_err(|_| {
            format!(
                "{program} did not finish within {} seconds",
                COMMAND_TIMEOUT.as_secs()
            )
        })?
        .map_err(|e| format!("waiting for {program}: {e}"))?;
    Ok(Finished {
        code: output.status.code(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    })
}
