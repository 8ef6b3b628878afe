//! What each command does: one or two API calls, then the answer printed as text or `--json`.
//! Results go to `out` (stdout); notes for the person at the terminal, such as the queue
//! position of a PENDING session, go to `note` (stderr), so `--json` output stays parseable.

use std::future::Future;
use std::io::Write;
use std::path::Path;
use std::time::Duration;

use anyhow::Context as _;
use chrono::Utc;
use ongrid_core::api::{AddKey, CreateSession, Institute, SessionView};
use ongrid_core::lifecycle::{HoldRequest, KeepRequest};
use ongrid_core::{HumanDuration, SessionName, SessionState};
use serde::Serialize;

use crate::cli::{
    AdminCommand, AdminGpuCommand, AuditArgs, Command, GpuModeArgs, HoldArgs, InstituteAddArgs,
    InstituteCommand, InstituteNameArgs, KeepArgs, KeyAddArgs, KeyCommand, KeyLsArgs, KeyRmArgs,
    LsArgs, NewArgs, ReleaseArgs, RmArgs, SessionCommand, ShowArgs,
};
use crate::client::{Client, ClientError, KeyAdded};
use crate::{output, pubkey};

/// How often `session new --wait` asks the manager about the session.
pub const WAIT_POLL_INTERVAL: Duration = Duration::from_secs(1);

/// Where commands write.
pub struct Terminal<'a> {
    pub out: &'a mut dyn Write,
    pub note: &'a mut dyn Write,
}

impl Terminal<'_> {
    fn print(&mut self, text: &str) -> anyhow::Result<()> {
        self.out
            .write_all(text.as_bytes())
            .and_then(|()| self.out.flush())
            .context("writing to standard output")
    }

    fn json<T: Serialize>(&mut self, value: &T) -> anyhow::Result<()> {
        let mut text = serde_json::to_string_pretty(value).context("encoding JSON")?;
        text.push('\n');
        self.print(&text)
    }

    fn note(&mut self, text: &str) {
        // A note that cannot be written (stderr closed) is not worth failing the command for.
        let _ = writeln!(self.note, "{text}");
    }
}

/// Runs one command against the manager. `home` is where `key add` looks for `~/.ssh`.
pub async fn execute(
    command: Command,
    home: Option<&Path>,
    client: &Client,
    term: &mut Terminal<'_>,
) -> anyhow::Result<()> {
    match command {
        Command::Whoami(args) => {
            let me = client.whoami().await?;
            if args.json {
                term.json(&me)
            } else {
                term.print(&output::render_whoami(&me, Utc::now()))
            }
        }
        Command::Gpus(args) => {
            let nodes = client.nodes().await?;
            if args.json {
                term.json(&nodes)
            } else {
                term.print(&output::render_gpus(&nodes))
            }
        }
        Command::Session(SessionCommand::New(args)) => new_session(args, client, term).await,
        Command::Session(SessionCommand::Ls(LsArgs { all, output })) => {
            let sessions = client.sessions(all).await?;
            if output.json {
                term.json(&sessions)
            } else {
                term.print(&output::render_sessions(&sessions, all))
            }
        }
        Command::Session(SessionCommand::Show(ShowArgs {
            name,
            owner,
            output,
        })) => {
            let session = client.session(&name, owner.as_ref()).await?;
            if output.json {
                term.json(&session)
            } else {
                term.print(&output::render_session(&session))
            }
        }
        Command::Session(SessionCommand::Hold(HoldArgs {
            name,
            owner,
            reason,
            output,
        })) => {
            let body = HoldRequest { reason };
            let session = client.hold_session(&name, owner.as_ref(), &body).await?;
            if output.json {
                term.json(&session)
            } else {
                term.print(&format!(
                    "session {} is HELD: its GPUs are free for others, its files are kept; \
                     bring it back with `devctl session release {}`\n",
                    session.name, session.name
                ))
            }
        }
        Command::Session(SessionCommand::Release(ReleaseArgs {
            name,
            owner,
            output,
        })) => {
            let session = client.release_session(&name, owner.as_ref()).await?;
            if output.json {
                term.json(&session)
            } else {
                term.print(&output::render_released(&session))
            }
        }
        Command::Session(SessionCommand::Keep(KeepArgs {
            name,
            duration,
            owner,
            output,
        })) => {
            let body = KeepRequest {
                duration_secs: duration.as_duration().as_secs(),
            };
            let session = client.keep_session(&name, owner.as_ref(), &body).await?;
            if output.json {
                term.json(&session)
            } else {
                term.print(&output::render_kept(&session, duration, Utc::now()))
            }
        }
        Command::Session(SessionCommand::Rm(RmArgs {
            name,
            owner,
            output,
        })) => {
            let session = client.remove_session(&name, owner.as_ref()).await?;
            if output.json {
                term.json(&session)
            } else {
                term.print(&format!(
                    "session {} removed ({})\n",
                    session.name, session.state
                ))
            }
        }
        Command::Admin(AdminCommand::Gpu(AdminGpuCommand::Mode(GpuModeArgs {
            gpu,
            mode,
            output,
        }))) => {
            let view = client.set_gpu_mode(&gpu, mode).await?;
            if output.json {
                term.json(&view)
            } else {
                term.print(&output::render_gpu_mode(&view))
            }
        }
        Command::Key(KeyCommand::Add(args)) => add_key(args, home, client, term).await,
        Command::Freeze(args) => crate::images::freeze(args, client, term).await,
        Command::Image(command) => crate::images::image(command, client, term).await,
        Command::Key(KeyCommand::Ls(KeyLsArgs { all, output })) => {
            let keys = client.keys(all).await?;
            if output.json {
                term.json(&keys)
            } else {
                term.print(&output::render_keys(&keys, all, Utc::now()))
            }
        }
        Command::Key(KeyCommand::Rm(KeyRmArgs {
            fingerprint,
            output,
        })) => {
            let key = client.remove_key(fingerprint.as_str()).await?;
            if output.json {
                term.json(&key)
            } else {
                term.print(&output::render_key_removed(&key))
            }
        }
        Command::Admin(AdminCommand::Institute(command)) => institute(command, client, term).await,
        Command::Admin(AdminCommand::Audit(AuditArgs {
            user,
            since,
            output,
        })) => {
            let since = since.map(|since| since.resolve(Utc::now()));
            let records = client.audit(user.as_ref(), since).await?;
            if output.json {
                term.json(&records)
            } else {
                let filtered = user.is_some() || since.is_some();
                term.print(&output::render_audit(&records, filtered))
            }
        }
    }
}

async fn add_key(
    args: KeyAddArgs,
    home: Option<&Path>,
    client: &Client,
    term: &mut Terminal<'_>,
) -> anyhow::Result<()> {
    let key = pubkey::load(args.file.as_deref(), home)?;
    term.note(&format!("public key file: {}", key.path.display()));
    let (added, view) = client
        .add_key(&AddKey {
            public_key: key.line,
        })
        .await?;
    if args.output.json {
        term.json(&view)
    } else {
        term.print(&output::render_key_added(&view, added == KeyAdded::Renewed))
    }
}

async fn institute(
    command: InstituteCommand,
    client: &Client,
    term: &mut Terminal<'_>,
) -> anyhow::Result<()> {
    match command {
        InstituteCommand::Add(InstituteAddArgs {
            name,
            cidrs,
            output,
        }) => {
            let institute = client.add_institute(&Institute { name, cidrs }).await?;
            if output.json {
                term.json(&institute)
            } else {
                term.print(&output::render_institute_added(&institute))
            }
        }
        InstituteCommand::Rm(InstituteNameArgs { name, output }) => {
            let institute = client.remove_institute(&name).await?;
            if output.json {
                term.json(&institute)
            } else {
                term.print(&output::render_institute_removed(&institute))
            }
        }
        InstituteCommand::Ls(output) => {
            let institutes = client.institutes().await?;
            if output.json {
                term.json(&institutes)
            } else {
                term.print(&output::render_institutes(&institutes))
            }
        }
        InstituteCommand::Show(InstituteNameArgs { name, output }) => {
            let institute = client.institute(&name).await?;
            if output.json {
                term.json(&institute)
            } else {
                term.print(&output::render_institute(&institute))
            }
        }
    }
}

async fn new_session(
    args: NewArgs,
    client: &Client,
    term: &mut Terminal<'_>,
) -> anyhow::Result<()> {
    let body = CreateSession {
        name: args.name.clone(),
        gpus: args.request(),
        image: args.image.clone(),
        idle_timeout_secs: args.idle_timeout.map(|d| d.as_duration().as_secs()),
        max_duration_secs: args.max_duration.map(|d| d.as_duration().as_secs()),
    };
    let mut session = client.create_session(&body).await?;
    if let Some(notice) = output::queue_notice(&session) {
        term.note(&notice);
    }
    if args.wait {
        let name = session.name.clone();
        session = wait_until_running(session, args.timeout, WAIT_POLL_INTERVAL, || {
            client.session(&name, None)
        })
        .await?;
    }
    if args.output.json {
        term.json(&session)
    } else {
        term.print(&output::render_session(&session))
    }
}

/// Why `session new --wait` gave up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WaitError {
    #[error("session {name} FAILED: {reason}")]
    Failed { name: SessionName, reason: String },
    #[error("session {name} was removed before it ran: {reason}")]
    Ended { name: SessionName, reason: String },
    #[error("session {name} was put on HOLD before it ran: {reason}")]
    Held { name: SessionName, reason: String },
    #[error("session {name} is still {state} after {waited}: it stays queued and starts when a GPU frees (see devctl session show {name}, or give up with devctl session rm {name})")]
    TimedOut {
        name: SessionName,
        /// `PENDING (#3 in queue)` or `STARTING`.
        state: String,
        waited: HumanDuration,
    },
    #[error(transparent)]
    Client(#[from] ClientError),
}

/// Polls the session every `poll` until it runs (WAITING, CONNECTED or IDLE), fails, or
/// `timeout` passes. Uses tokio's clock, so tests run it with paused time.
pub async fn wait_until_running<F, Fut>(
    first: SessionView,
    timeout: HumanDuration,
    poll: Duration,
    mut fetch: F,
) -> Result<SessionView, WaitError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<SessionView, ClientError>>,
{
    let deadline = tokio::time::Instant::now() + timeout.as_duration();
    let mut session = first;
    loop {
        let name = session.name.clone();
        let reason = session.reason.clone();
        match session.state {
            SessionState::Waiting | SessionState::Connected | SessionState::Idle => {
                return Ok(session)
            }
            SessionState::Failed => return Err(WaitError::Failed { name, reason }),
            SessionState::Ended => return Err(WaitError::Ended { name, reason }),
            SessionState::Held => return Err(WaitError::Held { name, reason }),
            SessionState::Pending | SessionState::Starting => {}
        }
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return Err(WaitError::TimedOut {
                name,
                state: output::describe_state(&session),
                waited: timeout,
            });
        }
        tokio::time::sleep(poll.min(deadline - now)).await;
        session = fetch().await?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::DateTime;
    use ongrid_core::api::SessionView;
    use ongrid_core::{Dn, GpuRequest, SessionId, UserName};
    use std::collections::VecDeque;
    use std::sync::{Arc, Mutex};

    fn view(state: SessionState, reason: &str, position: Option<u32>) -> SessionView {
        SessionView {
            id: SessionId::new_random(),
            name: SessionName::parse("train1").unwrap(),
            owner: Dn::parse("/DC=org/CN=Alice").unwrap(),
            user_name: UserName::parse("alice").unwrap(),
            state,
            reason: reason.into(),
            request: GpuRequest::default(),
            image: "ongrid/dev:latest".into(),
            node: None,
            gpus: vec![],
            container: "ongrid-x".into(),
            created_at: DateTime::from_timestamp(1_795_255_200, 0).unwrap(),
            queue_position: position,
            lifecycle: None,
            transitions: vec![],
        }
    }

    type Left = Arc<Mutex<VecDeque<SessionView>>>;
    type Answer = std::future::Ready<Result<SessionView, ClientError>>;

    /// Answers polls from a script; `Left` holds the answers not asked for yet.
    fn script(answers: Vec<SessionView>) -> (Left, impl FnMut() -> Answer) {
        let queue = Arc::new(Mutex::new(VecDeque::from(answers)));
        let shared = queue.clone();
        let fetch = move || {
            let next = shared.lock().unwrap().pop_front();
            std::future::ready(next.ok_or_else(|| ClientError::Other {
                url: "test".into(),
                cause: "asked more often than scripted".into(),
            }))
        };
        (queue, fetch)
    }

    const FIVE_MINUTES: HumanDuration = HumanDuration::from_secs(300);

    #[tokio::test(start_paused = true)]
    async fn returns_once_the_session_runs() {
        let (left, fetch) = script(vec![
            view(SessionState::Pending, "created", Some(1)),
            view(SessionState::Starting, "placed on node1", None),
            view(SessionState::Waiting, "container running", None),
        ]);
        let start = tokio::time::Instant::now();
        let first = view(SessionState::Pending, "created", Some(2));
        let done = wait_until_running(first, FIVE_MINUTES, WAIT_POLL_INTERVAL, fetch)
            .await
            .unwrap();
        assert_eq!(done.state, SessionState::Waiting);
        assert!(left.lock().unwrap().is_empty());
        assert_eq!(start.elapsed(), Duration::from_secs(3));
    }

    #[tokio::test(start_paused = true)]
    async fn a_running_session_needs_no_poll() {
        let (_, fetch) = script(vec![]);
        let first = view(SessionState::Connected, "ssh", None);
        let done = wait_until_running(first, FIVE_MINUTES, WAIT_POLL_INTERVAL, fetch)
            .await
            .unwrap();
        assert_eq!(done.state, SessionState::Connected);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failure_reports_the_state_reason() {
        let (_, fetch) = script(vec![view(
            SessionState::Failed,
            "image foo:1 not found on node1: push it or pick another --image",
            None,
        )]);
        let first = view(SessionState::Starting, "placed on node1", None);
        let err = wait_until_running(first, FIVE_MINUTES, WAIT_POLL_INTERVAL, fetch)
            .await
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "session train1 FAILED: image foo:1 not found on node1: push it or pick another --image"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn gives_up_at_the_timeout_with_the_queue_position() {
        let answers = (0..400)
            .map(|_| view(SessionState::Pending, "created", Some(2)))
            .collect();
        let (left, fetch) = script(answers);
        let start = tokio::time::Instant::now();
        let first = view(SessionState::Pending, "created", Some(3));
        let err = wait_until_running(first, FIVE_MINUTES, WAIT_POLL_INTERVAL, fetch)
            .await
            .unwrap_err();
        assert_eq!(start.elapsed(), Duration::from_secs(300));
        assert_eq!(left.lock().unwrap().len(), 100, "one poll per second");
        assert_eq!(
            err.to_string(),
            "session train1 is still PENDING (#2 in queue) after 5 minutes: it stays queued and \
             starts when a GPU frees (see devctl session show train1, or give up with devctl \
             session rm train1)"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn errors_while_polling_are_passed_on() {
        let (_, fetch) = script(vec![]);
        let first = view(SessionState::Pending, "created", Some(1));
        let err = wait_until_running(first, FIVE_MINUTES, WAIT_POLL_INTERVAL, fetch)
            .await
            .unwrap_err();
        assert!(matches!(err, WaitError::Client(_)), "{err}");
    }
}
