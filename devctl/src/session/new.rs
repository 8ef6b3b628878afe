//! `devctl session new` (`POST /v1/sessions`): ask for a session; with `--wait`, wait until it
//! runs, fails, or the timeout passes. The manager does the waiting: `GET
//! /v1/sessions/{name}?wait_for=...&timeout=...` answers as soon as the session reaches one of
//! the states, so devctl sees the change at once and never polls.

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

/// The states `--wait` stops at: running, or one the session does not leave without a person.
pub const WAIT_FOR: [SessionState; 6] = [
    SessionState::Waiting,
    SessionState::Connected,
    SessionState::Idle,
    SessionState::Failed,
    SessionState::Held,
    SessionState::Ended,
];

/// The longest one wait asks the manager for: well within devctl's request timeout.
pub const WAIT_STEP: Duration = Duration::from_secs(20);

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
    /// One MIG device of this profile or larger instead of GPUs, like 1g.10gb (devctl gpus
    /// lists the site's devices)
    #[arg(long, value_name = "PROFILE", conflicts_with_all = ["share", "gpus"])]
    pub mig: Option<ongrid_core::MigProfile>,
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
    /// Run on the GPUs of this reservation of your group, within its window (devctl admin
    /// reservation ls)
    #[arg(long, value_name = "NAME")]
    pub reservation: Option<String>,
    #[command(flatten)]
    pub output: JsonArgs,
}

impl NewArgs {
    pub fn request(&self) -> GpuRequest {
        GpuRequest {
            count: self.gpus,
            min_capability: self.min_capability,
            min_memory: self.min_gpu_memory,
            sharing: self.mig.map_or(self.share, Sharing::Mig),
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
            reservation: self.reservation.clone(),
        }
    }
}

pub async fn run(args: NewArgs, client: &Client, term: &mut Terminal<'_>) -> anyhow::Result<()> {
    let look = match &args.name {
        Some(name) => format!("the session may exist: devctl session show {name}"),
        None => "a session may exist: devctl session ls".to_owned(),
    };
    let mut session: SessionView = client
        .post("v1/sessions")
        .json(&args.body())
        .idempotent()
        .if_lost(look)
        .send()
        .await?;
    if let Some(notice) = queue_notice(&session) {
        term.note(&notice);
    }
    if args.wait {
        let name = session.name.clone();
        session = wait_until_running(session, args.timeout, |wait| {
            view::wait_for(client, &name, None, &WAIT_FOR, wait)
        })
        .await?;
    }
    term.show(args.output.json, &session, view::render)
}

/// What devctl says after creating a session that is not placed yet: no GPU was free, or (on a
/// loaded site) the scheduler's round had not ended when the manager answered
/// (`placement_wait_ms`).
pub fn queue_notice(session: &SessionView) -> Option<String> {
    if session.state != SessionState::Pending {
        return None;
    }
    let position = session
        .queue_position
        .map(|p| format!("queued at position {p}"))
        .unwrap_or_else(|| "queued".to_owned());
    Some(format!(
        "not placed yet: {position}; it starts once the scheduler gives it a GPU (devctl session \
         show {})",
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

/// Waits until the session runs (WAITING, CONNECTED or IDLE), fails, or `timeout` passes.
/// `wait(d)` asks the manager for the session once it reaches one of [`WAIT_FOR`], or after `d`
/// (at most [`WAIT_STEP`]); it is asked again until the deadline. Uses tokio's clock, so tests
/// run it with paused time.
pub async fn wait_until_running<F, Fut>(
    first: SessionView,
    timeout: HumanDuration,
    mut wait: F,
) -> Result<SessionView, WaitError>
where
    F: FnMut(Duration) -> Fut,
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
        session = wait(WAIT_STEP.min(deadline - now)).await?;
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
    type Asked = Arc<Mutex<Vec<Duration>>>;
    type Answer = std::pin::Pin<Box<dyn Future<Output = Result<SessionView, ClientError>>>>;

    /// A manager answering waits from a script: an answer in one of [`WAIT_FOR`] comes at once,
    /// any other after the wait asked for, as the manager's long-poll does. `Left` holds the
    /// answers not asked for yet, `Asked` the waits asked for.
    fn script(answers: Vec<SessionView>) -> (Left, Asked, impl FnMut(Duration) -> Answer) {
        let queue = Arc::new(Mutex::new(VecDeque::from(answers)));
        let asked = Arc::new(Mutex::new(Vec::new()));
        let (shared, asks) = (queue.clone(), asked.clone());
        let wait = move |wait: Duration| -> Answer {
            asks.lock().unwrap().push(wait);
            let next = shared.lock().unwrap().pop_front();
            Box::pin(async move {
                let next = next.ok_or_else(|| ClientError::Other {
                    url: "test".into(),
                    cause: "asked more often than scripted".into(),
                })?;
                if !WAIT_FOR.contains(&next.state) {
                    tokio::time::sleep(wait).await;
                }
                Ok(next)
            })
        };
        (queue, asked, wait)
    }

    #[test]
    fn a_queued_session_says_where_it_waits() {
        let queued = view(SessionState::Pending, "created", Some(3));
        assert_eq!(
            queue_notice(&queued).unwrap(),
            "not placed yet: queued at position 3; it starts once the scheduler gives it a GPU \
             (devctl session show train1)"
        );
        assert_eq!(
            queue_notice(&view(SessionState::Pending, "created", None)).unwrap(),
            "not placed yet: queued; it starts once the scheduler gives it a GPU (devctl session \
             show train1)"
        );
        assert_eq!(
            queue_notice(&view(SessionState::Waiting, "running", None)),
            None
        );
    }

    const FIVE_MINUTES: HumanDuration = HumanDuration::from_secs(300);

    #[tokio::test(start_paused = true)]
    async fn returns_as_soon_as_the_manager_says_the_session_runs() {
        let (left, asked, wait) =
            script(vec![view(SessionState::Waiting, "container running", None)]);
        let start = tokio::time::Instant::now();
        let first = view(SessionState::Starting, "placed on node1", None);
        let done = wait_until_running(first, FIVE_MINUTES, wait).await.unwrap();
        assert_eq!(done.state, SessionState::Waiting);
        assert!(left.lock().unwrap().is_empty());
        assert_eq!(start.elapsed(), Duration::ZERO, "no time spent polling");
        assert_eq!(*asked.lock().unwrap(), [WAIT_STEP]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_running_session_needs_no_wait() {
        let (_, asked, wait) = script(vec![]);
        let first = view(SessionState::Connected, "ssh", None);
        let done = wait_until_running(first, FIVE_MINUTES, wait).await.unwrap();
        assert_eq!(done.state, SessionState::Connected);
        assert!(asked.lock().unwrap().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_failure_reports_the_state_reason() {
        let (_, _, wait) = script(vec![view(
            SessionState::Failed,
            "image foo:1 not found on node1: push it or pick another --image",
            None,
        )]);
        let first = view(SessionState::Starting, "placed on node1", None);
        let err = wait_until_running(first, FIVE_MINUTES, wait)
            .await
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "session train1 FAILED: image foo:1 not found on node1: push it or pick another --image"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn gives_up_at_the_timeout_with_the_queue_position() {
        let answers = (0..20)
            .map(|_| view(SessionState::Pending, "created", Some(2)))
            .collect();
        let (left, asked, wait) = script(answers);
        let start = tokio::time::Instant::now();
        let first = view(SessionState::Pending, "created", Some(3));
        let err = wait_until_running(first, FIVE_MINUTES, wait)
            .await
            .unwrap_err();
        assert_eq!(start.elapsed(), Duration::from_secs(300));
        assert_eq!(left.lock().unwrap().len(), 5, "one wait per 20 s");
        assert!(asked.lock().unwrap().iter().all(|d| *d == WAIT_STEP));
        assert_eq!(
            err.to_string(),
            "session train1 is still PENDING (#2 in queue) after 5 minutes: it stays queued and \
             starts when a GPU frees (see devctl session show train1, or give up with devctl \
             session rm train1)"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_last_wait_ends_at_the_deadline() {
        let answers = (0..2)
            .map(|_| view(SessionState::Starting, "placed on node1", None))
            .collect();
        let (_, asked, wait) = script(answers);
        let first = view(SessionState::Pending, "created", Some(1));
        let err = wait_until_running(first, HumanDuration::from_secs(30), wait)
            .await
            .unwrap_err();
        assert!(matches!(err, WaitError::TimedOut { .. }), "{err}");
        assert_eq!(*asked.lock().unwrap(), [WAIT_STEP, Duration::from_secs(10)]);
    }

    #[tokio::test(start_paused = true)]
    async fn errors_while_waiting_are_passed_on() {
        let (_, _, wait) = script(vec![]);
        let first = view(SessionState::Pending, "created", Some(1));
        let err = wait_until_running(first, FIVE_MINUTES, wait)
            .await
            .unwrap_err();
        assert!(matches!(err, WaitError::Client(_)), "{err}");
    }
}
