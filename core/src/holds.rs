//! Wire types of the session hold policy: why a session is held, the deadlines a session
//! lives under, and the activity signals that keep it alive.
//!
//! The policy itself (when to hold) is computed by the manager from these values and an
//! injected clock; agents report activity, the gateway reports SSH traffic and shows deadlines.

use std::fmt;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::names::SessionId;
use crate::session::SessionState;

/// Why a session was (or will be) held. The manager stores it in a column of its own beside the
/// hold's details; the reason people read is rendered from both by [`HoldReason::sentence`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HoldReason {
    /// No SSH connection within the connect deadline after start or release.
    NoConnection,
    /// No connection and no activity for the idle timeout.
    Idle,
    /// The session reached its maximum lifetime.
    MaxDuration,
    /// Held by its owner (`devctl session hold`).
    Owner,
    /// Held by an admin, with a reason.
    Admin,
}

impl HoldReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NoConnection => "no-connection",
            Self::Idle => "idle",
            Self::MaxDuration => "max-duration",
            Self::Owner => "owner",
            Self::Admin => "admin",
        }
    }
}

impl HoldReason {
    pub const ALL: [HoldReason; 5] = [
        Self::NoConnection,
        Self::Idle,
        Self::MaxDuration,
        Self::Owner,
        Self::Admin,
    ];

    /// The hold reason named `text` (as [`HoldReason::as_str`] writes it).
    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.as_str() == text)
    }

    /// The reason of a hold as people read it: `idle: no SSH connection and no activity ...`.
    pub fn sentence(self, details: &str) -> String {
        format!("{self}: {details}")
    }
}

impl fmt::Display for HoldReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A hold the policy will apply unless something changes (a connection, activity, a keep).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedHold {
    pub at: DateTime<Utc>,
    pub reason: HoldReason,
}

/// The deadlines one session lives under, as absolute times. Returned to the gateway for the
/// login banner and the ten-minute warning, and shown by `devctl session show`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionDeadlines {
    pub session_id: SessionId,
    pub state: SessionState,
    /// Idle timeout in seconds that applies to this session.
    pub idle_timeout_secs: u64,
    /// When the session ends by `max_duration` (it is then HELD with reason `max-duration`).
    pub max_end_at: Option<DateTime<Utc>>,
    /// The end of an explicit keep-alive (`devctl session keep`), if one is running.
    pub keep_until: Option<DateTime<Utc>>,
    /// The earliest hold the policy will apply if nothing changes.
    pub next_hold: Option<PlannedHold>,
}

/// The kinds of activity that keep a session from being idle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SignalKind {
    /// An SSH connection is open.
    Connection,
    /// SSH data the client sent (from the gateway's reports; keep-alives are not data).
    SshTraffic,
    /// CPU use of the container's processes above the site threshold.
    Cpu,
    /// GPU utilisation of the session's GPUs above the site threshold.
    Gpu,
    /// An explicit keep-alive.
    Keep,
}

/// The last time one signal was seen, for "why is this session still alive?".
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ActivitySignal {
    pub kind: SignalKind,
    pub last_seen: Option<DateTime<Utc>>,
    /// The last measured value when it has one: `"37% CPU"`, `"82% GPU"`, `"2 connections"`.
    pub detail: Option<String>,
}

/// Lifecycle part of a session as users see it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LifecycleView {
    pub deadlines: SessionDeadlines,
    pub signals: Vec<ActivitySignal>,
    /// The signal that currently keeps the session alive, if any.
    pub kept_alive_by: Option<SignalKind>,
    /// A session with an open connection but no activity for a while: its last activity
    /// (`session show`: "connected but idle since ..."). Absent from older managers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connected_idle_since: Option<DateTime<Utc>>,
}

/// What the agent measured for one session's container over its last sampling interval.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContainerActivity {
    pub session_id: SessionId,
    pub sampled_at: DateTime<Utc>,
    /// CPU use of all the container's processes, in percent of one core (200.0 = two cores busy).
    pub cpu_percent: f64,
    /// Highest utilisation among the session's GPUs, in percent; `None` when unknown.
    pub gpu_percent: Option<f64>,
}

/// Body of `POST /v1/sessions/{name}/hold`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HoldRequest {
    /// Why; only admins holding someone else's session give one (it is shown to the owner).
    #[serde(default)]
    pub reason: Option<String>,
}

/// Body of `POST /v1/sessions/{name}/keep`: keep the session from being held as idle (or for
/// want of a connection) for this long from now, capped by the site's `keep_max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeepRequest {
    pub duration_secs: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hold_reasons_are_named_and_rendered_into_sentences() {
        for reason in HoldReason::ALL {
            assert_eq!(HoldReason::parse(reason.as_str()), Some(reason));
            assert_eq!(
                serde_json::to_string(&reason).unwrap(),
                format!("\"{reason}\"")
            );
            assert_eq!(
                reason.sentence("because"),
                format!("{}: because", reason.as_str())
            );
        }
        assert_eq!(
            HoldReason::Idle.sentence("no activity for 2 hours"),
            "idle: no activity for 2 hours"
        );
        assert_eq!(HoldReason::parse("Idle"), None);
        assert_eq!(HoldReason::parse("idle: x"), None);
        assert_eq!(HoldReason::parse(""), None);
    }
}
