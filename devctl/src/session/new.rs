//! `devctl session new` (`POST /v1/sessions`): ask for a session; with `--wait`, poll it
//! (`GET /v1/sessions/{name}`) once a second until it runs, fails, or the timeout passes.

use std::future::Future;
use std::time::Duration;

use clap::Args;
use ongrid_core::api::{CreateSession, SessionView};
use ongrid_core::{
    ComputeCapability, GpuRequest, HumanDuration, MemorySize, SessionName, SessionState, Sharing,
};

use super::view::{self, describe_state};
use crate::client::{Client, ClientError};
use crate::terminal::{JsonArgs, Terminal};

/// How often `session new --wait` asks the manager about the session.
pub const WAIT_POLL_INTERVAL: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, Args)]
pub struct NewArgs {
    /// Session name, also the SSH user name that reaches it: lower-case letters, digits and
    /// '-' [default: dev, dev-2, ...]
    #[arg(long)]
    pub name: Option<SessionName>,
    /// How many GPUs, all on one node
    #[arg(long, default_value = "1", value_parser = parse_gpu_count)]
    pub gpus: u32,
    /// Lowest CUDA compute capability to accept, like 8.0
    #[arg(long, value_name = "X.Y")]
    pub min_capability: Option<ComputeCapability>,
    /// Least memory per GPU, like 40G (10^9 bytes, as GPUs are sold) or 40GiB
    #[arg(long, value_name = "SIZE")]
    pub min_gpu_memory: Option<MemorySize>,
    /// Whole GPUs only (exclusive), shares of shared GPUs only (shared), or either (any)
    #[arg(long, default_value = "exclusive", value_name = "exclusive|shared|any")]
    pub share: Sharing,
    /// Docker image of the dev container [default: the site's]
    #[arg(long, value_name = "IMAGE", value_parser = parse_image)]
    pub image: Option<String>,
    /// Wait until the session runs (WAITING for your connection), then print it
    #[arg(long)]
    pub wait: bool,
    /// How long --wait waits, like 5m, 90s or "2 hours"
    #[arg(long, default_value = "5m", requires = "wait", value_name = "DURATION")]
    pub timeout: HumanDuration,
    /// Hold the session after this long without a connection or activity, like 2h
    /// [default: the site's; at most the site's maximum]
    #[arg(long, value_name = "DURATION")]
    pub idle_timeout: Option<HumanDuration>,
    /// Hold the session this long after it first started, whatever happens, like 3d
    /// [default: the site's; at most the site's maximum]
    #[arg(long, value_name = "DURATION")]
    pub max_duration: Option<HumanDuration>,
    #[command(flatten)]
    pub output: JsonArgs,
}

impl NewArgs {
    pub fn request(&self) -> GpuRequest {
        GpuRequest {
            count: self.gpus,
            min_capability: self.min_capability,
            min_memory: self.min_gpu_memory,
            sharing: self.share,
        }
    }
}

/// A GPU count, checked by the same rule the manager applies.
fn parse_gpu_count(value: &str) -> Result<u32, String> {
    let count: u32 = value
        .trim()
        .parse()
        .map_err(|_| format!("GPU count {value:?} must be a whole number like 1 or 2"))?;
    let request = GpuRequest {
        count,
        ..GpuRequest::default()
    };
    request.validate().map_err(|err| err.to_string())?;
    Ok(count)
}

fn parse_image(value: &str) -> Result<String, String> {
    let value = value.trim();
    if value.is_empty() || value.contains(char::is_whitespace) {
        return Err(format!(
            "image {value:?} must be a Docker image reference like ongrid/dev:latest"
        ));
    }
    Ok(value.to_owned())
}

impl NewArgs {
    /// The body of `POST /v1/sessions`.
    pub fn body(&self) -> CreateSession {
        CreateSession {
            name: self.name.clone(),
            gpus: self.request(),
            image: self.image.clone(),
            idle_timeout_secs: self.idle_timeout.map(|d| d.as_duration().as_secs()),
            max_duration_secs: self.max_duration.map(|d| d.as_duration().as_secs()),
        }
    }
}

pub async fn run(args: NewArgs, client: &Client, term: &mut Terminal<'_>) -> anyhow::Result<()> {
    let mut session: SessionView = client.post("v1/sessions").json(&args.body()).send().await?;
    if let Some(notice) = queue_notice(&session) {
        term.note(&notice);
    }
    if args.wait {
        let name = session.name.clone();
        session = wait_until_running(session, args.timeout, WAIT_POLL_INTERVAL, || {
            view::fetch(client, &name, None)
        })
        .await?;
    }
    term.show(args.output.json, &session, view::render)
}

/// What devctl says after creating a session that has to wait for a GPU.
pub fn queue_notice(session: &SessionView) -> Option<String> {
    if session.state != SessionState::Pending {
        return None;
    }
    let position = session
        .queue_position
        .map(|p| format!("queued at position {p}"))
        .unwrap_or_else(|| "queued".to_owned());
    Some(format!(
        "no GPU free now: {position}; it starts when a GPU frees (devctl session show {})",
        session.name
    ))
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
                state: describe_state(&session),
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

    #[test]
    fn a_queued_session_says_where_it_waits() {
        let queued = view(SessionState::Pending, "created", Some(3));
        assert_eq!(
            queue_notice(&queued).unwrap(),
            "no GPU free now: queued at position 3; it starts when a GPU frees (devctl session \
             show train1)"
        );
        assert_eq!(
            queue_notice(&view(SessionState::Pending, "created", None)).unwrap(),
            "no GPU free now: queued; it starts when a GPU frees (devctl session show train1)"
        );
        assert_eq!(
            queue_notice(&view(SessionState::Waiting, "running", None)),
            None
        );
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
