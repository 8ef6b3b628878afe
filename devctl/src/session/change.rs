//! The commands that change a session: `rm` (`DELETE /v1/sessions/{name}`), `hold`,
//! `release` and `keep` (`POST /v1/sessions/{name}/hold|release|keep`), each with
//! `[?owner=DN]` for admins. `release --wait` waits like `session new --wait`, on the manager's
//! side.

use chrono::{DateTime, Utc};
use clap::Args;
use ongrid_core::api::SessionView;
use ongrid_core::holds::{HoldRequest, KeepRequest};
use ongrid_core::{Dn, HumanDuration, SessionName, SessionState};

use super::new::{wait_until_running, WAIT_FOR};
use super::view;
use crate::client::Client;
use crate::format::deadline;
use crate::terminal::{JsonArgs, Terminal};

#[derive(Debug, Clone, Args)]
pub struct RmArgs {
    /// The session's name
    pub name: SessionName,
    /// Another user's session, by DN (admins only)
    #[arg(long, value_name = "DN")]
    pub owner: Option<Dn>,
    #[command(flatten)]
    pub output: JsonArgs,
}

#[derive(Debug, Clone, Args)]
pub struct HoldArgs {
    /// The session's name
    pub name: SessionName,
    /// Another user's session, by DN (admins only; give a --reason)
    #[arg(long, value_name = "DN")]
    pub owner: Option<Dn>,
    /// Why, shown to the session's owner (admins holding someone else's session)
    #[arg(long, requires = "owner")]
    pub reason: Option<String>,
    #[command(flatten)]
    pub output: JsonArgs,
}

#[derive(Debug, Clone, Args)]
pub struct ReleaseArgs {
    /// The session's name
    pub name: SessionName,
    /// Another user's session, by DN (admins only)
    #[arg(long, value_name = "DN")]
    pub owner: Option<Dn>,
    /// Wait until the session runs again (WAITING for your connection), then print it
    #[arg(long)]
    pub wait: bool,
    /// How long --wait waits, like 5m, 90s or "2 hours"
    #[arg(long, default_value = "5m", requires = "wait", value_name = "DURATION")]
    pub timeout: HumanDuration,
    #[command(flatten)]
    pub output: JsonArgs,
}

#[derive(Debug, Clone, Args)]
pub struct KeepArgs {
    /// The session's name
    pub name: SessionName,
    /// How long from now, like 4h, 90m or "2 hours"
    #[arg(long = "for", value_name = "DURATION")]
    pub duration: HumanDuration,
    /// Another user's session, by DN (admins only)
    #[arg(long, value_name = "DN")]
    pub owner: Option<Dn>,
    #[command(flatten)]
    pub output: JsonArgs,
}

/// `devctl session rm`
pub async fn remove(args: RmArgs, client: &Client, term: &mut Terminal<'_>) -> anyhow::Result<()> {
    let session: SessionView = client
        .delete(&format!("v1/sessions/{}", args.name))
        .owner(args.owner.as_ref())
        .send()
        .await?;
    term.show(args.output.json, &session, |session| {
        format!("session {} removed ({})\n", session.name, session.state)
    })
}

/// `devctl session hold`
pub async fn hold(args: HoldArgs, client: &Client, term: &mut Terminal<'_>) -> anyhow::Result<()> {
    let body = HoldRequest {
        reason: args.reason,
    };
    let session: SessionView = client
        .post(&format!("v1/sessions/{}/hold", args.name))
        .owner(args.owner.as_ref())
        .json(&body)
        .send()
        .await?;
    term.show(args.output.json, &session, |session| {
        format!(
            "session {} is HELD: its GPUs are free for others, its files are kept; bring it back \
             with `devctl session release {}`\n",
            session.name, session.name
        )
    })
}

/// `devctl session release`
pub async fn release(
    args: ReleaseArgs,
    client: &Client,
    term: &mut Terminal<'_>,
) -> anyhow::Result<()> {
    let mut session: SessionView = client
        .post(&format!("v1/sessions/{}/release", args.name))
        .owner(args.owner.as_ref())
        .send()
        .await?;
    if !args.wait {
        return term.show(args.output.json, &session, render_released);
    }
    if session.state == SessionState::Pending {
        term.note(render_released(&session).trim_end());
    }
    let owner = args.owner.as_ref();
    session = wait_until_running(session, args.timeout, |wait| {
        view::wait_for(client, &args.name, owner, &WAIT_FOR, wait)
    })
    .await?;
    term.show(args.output.json, &session, view::render)
}

/// `devctl session keep`
pub async fn keep(args: KeepArgs, client: &Client, term: &mut Terminal<'_>) -> anyhow::Result<()> {
    let body = KeepRequest {
        duration_secs: args.duration.as_duration().as_secs(),
    };
    let session: SessionView = client
        .post(&format!("v1/sessions/{}/keep", args.name))
        .owner(args.owner.as_ref())
        .json(&body)
        .send()
        .await?;
    term.show(args.output.json, &session, |session| {
        render_kept(session, args.duration, Utc::now())
    })
}

/// `devctl session release`: where the session is now.
pub fn render_released(session: &SessionView) -> String {
    match session.state {
        SessionState::Pending => {
            let position = session
                .queue_position
                .map(|p| format!(" at position {p} in the queue"))
                .unwrap_or_default();
            let node = session
                .node
                .as_ref()
                .map(|n| format!(" on {n}"))
                .unwrap_or_default();
            format!(
                "session {} released: PENDING{position}; it restarts in its container{node} once \
                 the scheduler gives it a GPU there (devctl session show {})\n",
                session.name, session.name
            )
        }
        state => format!(
            "session {} released: {state} ({})\n",
            session.name, session.reason
        ),
    }
}

/// `devctl session keep`: until when, and whether the site capped it.
pub fn render_kept(session: &SessionView, asked: HumanDuration, now: DateTime<Utc>) -> String {
    let Some(until) = session
        .lifecycle
        .as_ref()
        .and_then(|l| l.deadlines.keep_until)
    else {
        return format!("session {} kept alive\n", session.name);
    };
    // A minute of slack for the time between the request and now.
    let slack = std::time::Duration::from_secs(60);
    let capped = if until < now + asked.as_duration().saturating_sub(slack) {
        " (the most this site allows)"
    } else {
        ""
    };
    format!(
        "session {} kept alive until {}{capped}\n",
        session.name,
        deadline(until, now)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::fixtures::{at, session};
    use ongrid_core::holds::{LifecycleView, SessionDeadlines};

    #[test]
    fn a_release_says_where_the_session_waits() {
        let mut s = session("train1", SessionState::Pending);
        s.queue_position = Some(1);
        assert_eq!(
            render_released(&s),
            "session train1 released: PENDING at position 1 in the queue; it restarts in its \
             container on node1 once the scheduler gives it a GPU there (devctl session show \
             train1)\n"
        );
        assert_eq!(
            render_released(&session("train1", SessionState::Starting)),
            "session train1 released: STARTING (placed on node1)\n"
        );
    }

    #[test]
    fn a_keep_says_until_when_and_whether_it_was_capped() {
        let mut s = session("train1", SessionState::Idle);
        assert_eq!(
            render_kept(&s, HumanDuration::from_secs(3600), at(0)),
            "session train1 kept alive\n"
        );
        s.lifecycle = Some(LifecycleView {
            deadlines: SessionDeadlines {
                session_id: s.id,
                state: SessionState::Idle,
                idle_timeout_secs: 7200,
                max_end_at: None,
                keep_until: Some(at(3600)),
                next_hold: None,
            },
            signals: vec![],
            kept_alive_by: None,
            connected_idle_since: None,
        });
        assert_eq!(
            render_kept(&s, HumanDuration::from_secs(3600), at(0)),
            "session train1 kept alive until 2026-11-21 11:00:00Z (1h 0m left)\n"
        );
        assert_eq!(
            render_kept(&s, HumanDuration::from_secs(4 * 3600), at(0)),
            "session train1 kept alive until 2026-11-21 11:00:00Z (1h 0m left) (the most this \
             site allows)\n"
        );
    }
}
