//! `devctl session show` (`GET /v1/sessions/{name}[?owner=DN]`): the session's fields, its
//! lifecycle (deadlines, what keeps it alive, when each activity signal was last seen), then
//! its transitions. Also how a session's state and request are put in words elsewhere.

use std::fmt::Write as _;

use chrono::{DateTime, Utc};
use clap::Args;
use ongrid_core::api::SessionView;
use ongrid_core::holds::{LifecycleView, SignalKind};
use ongrid_core::{Dn, GpuRequest, HumanDuration, SessionName, SessionState, Sharing};

use crate::client::{Client, ClientError};
use crate::format::{deadline, format_time, or_dash};
use crate::table::Table;
use crate::terminal::{JsonArgs, Terminal};

#[derive(Debug, Clone, Args)]
pub struct ShowArgs {
    /// The session's name
    pub name: SessionName,
    /// Another user's session, by DN like "/DC=org/DC=example/CN=Alice Smith" (admins only)
    #[arg(long, value_name = "DN")]
    pub owner: Option<Dn>,
    #[command(flatten)]
    pub output: JsonArgs,
}

pub async fn run(args: ShowArgs, client: &Client, term: &mut Terminal<'_>) -> anyhow::Result<()> {
    let session = fetch(client, &args.name, args.owner.as_ref()).await?;
    term.show(args.output.json, &session, render)
}

/// `GET /v1/sessions/{name}[?owner=DN]`
pub async fn fetch(
    client: &Client,
    name: &SessionName,
    owner: Option<&Dn>,
) -> Result<SessionView, ClientError> {
    client
        .get(&format!("v1/sessions/{name}"))
        .owner(owner)
        .send()
        .await
}

/// `GET /v1/sessions/{name}?wait_for=STATES&timeout=SECONDS[&owner=DN]`: the session once it
/// is in one of `states`, or as it is after `wait` (rounded up to a whole second).
pub async fn wait_for(
    client: &Client,
    name: &SessionName,
    owner: Option<&Dn>,
    states: &[SessionState],
    wait: std::time::Duration,
) -> Result<SessionView, ClientError> {
    let states: Vec<&str> = states.iter().map(|s| s.as_str()).collect();
    let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    client
        .get(&format!("v1/sessions/{name}"))
        .owner(owner)
        .query(&[
            ("wait_for", states.join(",")),
            ("timeout", seconds.max(1).to_string()),
        ])
        .send()
        .await
}

/// A request in words: `2 GPUs, capability ≥ 8.0, memory ≥ 40 GB, whole GPUs only`.
pub fn describe_request(request: &GpuRequest) -> String {
    let mut out = match request.count {
        1 if request.sharing.mig().is_some() => "1 MIG device".to_owned(),
        1 => "1 GPU".to_owned(),
        n => format!("{n} GPUs"),
    };
    if let Some(capability) = request.min_capability {
        let _ = write!(out, ", capability ≥ {capability}");
    }
    if let Some(memory) = request.min_memory {
        let _ = write!(out, ", memory ≥ {memory}");
    }
    match request.sharing {
        Sharing::Exclusive => out.push_str(", whole GPUs only"),
        Sharing::Shared => out.push_str(", shared GPUs only"),
        Sharing::Any => out.push_str(", whole or shared"),
        Sharing::Mig(profile) => {
            let _ = write!(out, ", {profile} or larger");
        }
    }
    out
}

/// The state with its queue position when PENDING: `PENDING (#3 in queue)`.
pub fn describe_state(session: &SessionView) -> String {
    match (session.state, session.queue_position) {
        (SessionState::Pending, Some(position)) => format!("PENDING (#{position} in queue)"),
        (state, _) => state.to_string(),
    }
}

/// The text of `devctl session show` (also printed by `session new`).
pub fn render(session: &SessionView) -> String {
    render_at(session, Utc::now())
}

/// [`render`] as of `now` (time left until the deadlines).
pub fn render_at(session: &SessionView, now: DateTime<Utc>) -> String {
    let gpus = if session.gpus.is_empty() {
        "-".to_owned()
    } else {
        session
            .gpus
            .iter()
            .map(|g| g.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut fields = Table::bare();
    fields.field("name", session.name.to_string());
    fields.field(
        "owner",
        format!("{} ({})", session.owner, session.user_name),
    );
    fields.field("state", describe_state(session));
    fields.field("reason", session.reason.clone());
    fields.field(
        "node",
        or_dash(session.node.as_ref().map(ToString::to_string)),
    );
    fields.field("gpus", gpus);
    fields.field("request", describe_request(&session.request));
    fields.field("image", session.image.clone());
    fields.field("container", session.container.clone());
    fields.field("created", format_time(session.created_at));
    fields.field("id", session.id.to_string());

    let mut transitions = Table::bare();
    for t in &session.transitions {
        transitions.row([
            format_time(t.at),
            t.from.map(|s| s.to_string()).unwrap_or_default(),
            format!("→ {}", t.to),
            t.reason.clone(),
        ]);
    }
    let lifecycle = session
        .lifecycle
        .as_ref()
        .map(|view| render_lifecycle(view, now))
        .unwrap_or_default();
    format!(
        "{fields}{lifecycle}transitions:\n{}",
        transitions.render(None, "  ")
    )
}

fn signal_name(kind: SignalKind) -> &'static str {
    match kind {
        SignalKind::Connection => "ssh connection",
        SignalKind::SshTraffic => "ssh traffic",
        SignalKind::Cpu => "cpu",
        SignalKind::Gpu => "gpu",
        SignalKind::Keep => "keep-alive",
    }
}

/// The lifecycle part of `devctl session show`: the deadlines, what keeps the session alive,
/// and when each activity signal was last seen.
pub fn render_lifecycle(view: &LifecycleView, now: DateTime<Utc>) -> String {
    let d = &view.deadlines;
    let mut fields = Table::bare();
    fields.field(
        "idle timeout",
        HumanDuration(std::time::Duration::from_secs(d.idle_timeout_secs)).to_string(),
    );
    if let Some(end) = d.max_end_at {
        fields.field("ends at", deadline(end, now));
    }
    if let Some(keep) = d.keep_until {
        fields.field("kept until", deadline(keep, now));
    }
    fields.field(
        "next hold",
        or_dash(
            d.next_hold
                .as_ref()
                .map(|hold| format!("{} at {}", hold.reason, deadline(hold.at, now))),
        ),
    );
    fields.field(
        "alive because",
        or_dash(view.kept_alive_by.map(|k| signal_name(k).to_owned())),
    );
    if let Some(since) = view.connected_idle_since {
        fields.field(
            "activity",
            format!("connected but idle since {}", format_time(since)),
        );
    }
    let mut signals = Table::bare();
    for signal in &view.signals {
        signals.row([
            signal_name(signal.kind).to_owned(),
            or_dash(signal.last_seen.map(format_time)),
            signal.detail.clone().unwrap_or_default(),
        ]);
    }
    format!(
        "lifecycle:\n{}  last activity:\n{}",
        fields.render(None, "  "),
        signals.render(None, "    ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::fixtures::{at, session};

    #[test]
    fn session_show_says_why_a_session_is_alive() {
        use ongrid_core::holds::{
            ActivitySignal, HoldReason, LifecycleView, PlannedHold, SessionDeadlines, SignalKind,
        };
        let mut s = session("train1", SessionState::Idle);
        s.lifecycle = Some(LifecycleView {
            deadlines: SessionDeadlines {
                session_id: s.id,
                state: SessionState::Idle,
                idle_timeout_secs: 7200,
                max_end_at: Some(at(7 * 86_400)),
                keep_until: None,
                next_hold: Some(PlannedHold {
                    at: at(3600 + 7200),
                    reason: HoldReason::Idle,
                }),
            },
            signals: vec![
                ActivitySignal {
                    kind: SignalKind::Connection,
                    last_seen: Some(at(600)),
                    detail: Some("none open".into()),
                },
                ActivitySignal {
                    kind: SignalKind::Cpu,
                    last_seen: Some(at(3600)),
                    detail: Some("last sample 97% CPU".into()),
                },
            ],
            kept_alive_by: Some(SignalKind::Cpu),
            connected_idle_since: None,
        });
        let text = render_at(&s, at(3600));
        let expected = "lifecycle:\n  idle timeout:   2 hours\n  ends at:        2026-11-28 10:00:00Z (6d 23h left)\n  next hold:      idle at 2026-11-21 13:00:00Z (2h 0m left)\n  alive because:  cpu\n  last activity:\n    ssh connection  2026-11-21 10:10:00Z  none open\n    cpu             2026-11-21 11:00:00Z  last sample 97% CPU\ntransitions:\n";
        assert!(text.contains(expected), "{text}");
    }

    #[test]
    fn session_show_says_when_a_connected_session_is_idle() {
        use ongrid_core::holds::{LifecycleView, SessionDeadlines};
        let mut s = session("train1", SessionState::Connected);
        s.lifecycle = Some(LifecycleView {
            deadlines: SessionDeadlines {
                session_id: s.id,
                state: SessionState::Connected,
                idle_timeout_secs: 7200,
                max_end_at: None,
                keep_until: None,
                next_hold: None,
            },
            signals: Vec::new(),
            kept_alive_by: None,
            connected_idle_since: Some(at(600)),
        });
        let text = render_at(&s, at(3600));
        assert!(
            text.contains(
                "  alive because:  -\n  activity:       connected but idle since 2026-11-21 10:10:00Z\n"
            ),
            "{text}"
        );
    }

    #[test]
    fn session_show_lists_fields_and_transitions() {
        let text = render(&session("train1", SessionState::Starting));
        assert_eq!(
            text,
            "name:       train1
owner:      /DC=org/DC=example/CN=Alice Smith (alice-smith)
state:      STARTING
reason:     placed on node1
node:       node1
gpus:       GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f
request:    1 GPU, capability ≥ 8.0, memory ≥ 40.0 GiB, whole GPUs only
image:      ongrid/dev:latest
container:  ongrid-6f1c2d3e4a5b4c6d8e9f0a1b2c3d4e5f
created:    2026-11-21 10:00:03Z
id:         6f1c2d3e-4a5b-4c6d-8e9f-0a1b2c3d4e5f
transitions:
  2026-11-21 10:00:03Z           → PENDING   created
  2026-11-21 10:00:04Z  PENDING  → STARTING  placed on node1
"
        );
    }

    #[test]
    fn pending_sessions_show_their_queue_position() {
        let mut s = session("train2", SessionState::Pending);
        s.queue_position = Some(3);
        assert_eq!(describe_state(&s), "PENDING (#3 in queue)");
        assert_eq!(
            describe_state(&session("x", SessionState::Waiting)),
            "WAITING"
        );
    }
}
