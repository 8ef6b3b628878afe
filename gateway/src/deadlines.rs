//! What users are told about their session's deadlines, from the [`SessionDeadlines`] the
//! manager answers to each connection event: the banner of an interactive shell, and the
//! one-time warning before a planned hold.
//!
//! Only interactive shells (a `shell` request with a PTY) ever get these lines, on stderr: an
//! exec or subsystem channel carries a protocol (scp, sftp, rsync, VS Code's server) that a
//! stray line would break. Each connection keeps the latest deadlines in a watch channel
//! ([`DeadlinesState`]), updated by the audit reporter from the answers to its `open` and
//! `activity` events; each interactive channel reads it. Everything here is pure and takes the
//! time as an argument; the channel turns [`Warning::At`] into a timer.

use std::time::Duration;

use chrono::{DateTime, Utc};
use ongrid_core::holds::{HoldReason, PlannedHold, SessionDeadlines};
use ongrid_core::{NodeName, SessionName};
use tokio::sync::watch;

/// What a connection knows of its session's deadlines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeadlinesState {
    /// The `open` event has not been answered yet.
    Pending,
    Known(SessionDeadlines),
    /// The manager did not say (an older manager answering 204, the session gone, a failure).
    Unavailable,
}

/// Where the audit reporter puts the answers for one connection.
pub type DeadlinesSender = watch::Sender<DeadlinesState>;
pub type DeadlinesReceiver = watch::Receiver<DeadlinesState>;

/// The banner of an interactive shell: one line, in the user's terms.
///
/// `ongrid: session train1 on node1 · held if idle for 2 h · ends at 18:40 UTC (in 6 d 23 h) ·
/// devctl session show train1 for details`
pub fn banner(
    session: &SessionName,
    node: &NodeName,
    deadlines: &SessionDeadlines,
    now: DateTime<Utc>,
) -> String {
    let mut parts = vec![format!("ongrid: session {session} on {node}")];
    if let Some(keep) = deadlines.keep_until.filter(|keep| *keep > now) {
        parts.push(format!("kept alive until {}", clock(keep, now)));
    }
    parts.push(format!(
        "held if idle for {}",
        span(Duration::from_secs(deadlines.idle_timeout_secs))
    ));
    if let Some(end) = deadlines.max_end_at {
        parts.push(format!(
            "ends at {} (in {})",
            clock(end, now),
            span(until(end, now))
        ));
    }
    parts.push(format!("devctl session show {session} for details"));
    parts.join(" · ")
}

/// Whether a warning is due now, later, or not at all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Warning {
    /// The planned hold is within the warning period: warn (once).
    Due(PlannedHold),
    /// The warning period of the planned hold starts then.
    At(DateTime<Utc>),
    /// No hold is planned.
    None,
}

/// Whether the hold planned in `deadlines` is within `warn_before` of `now`.
pub fn warning(deadlines: &SessionDeadlines, now: DateTime<Utc>, warn_before: Duration) -> Warning {
    let Some(hold) = &deadlines.next_hold else {
        return Warning::None;
    };
    let warn_before = chrono::Duration::from_std(warn_before).unwrap_or(chrono::Duration::MAX);
    match hold.at.checked_sub_signed(warn_before) {
        Some(start) if start > now => Warning::At(start),
        _ => Warning::Due(hold.clone()),
    }
}

/// The warning line for a planned hold, naming what the user can do about its reason.
pub fn warning_text(session: &SessionName, hold: &PlannedHold, now: DateTime<Utc>) -> String {
    let fix = match hold.reason {
        HoldReason::Idle => {
            format!("save your work, or keep it running: devctl session keep {session} --for 2h")
        }
        HoldReason::NoConnection => {
            format!("stay connected, or keep it running: devctl session keep {session} --for 2h")
        }
        HoldReason::MaxDuration => format!(
            "save your work: the maximum duration cannot be extended; freeze the environment \
             (devctl freeze {session} --tag NAME:VERSION) or copy your files out, then \
             devctl session release {session} starts it again"
        ),
        HoldReason::Owner | HoldReason::Admin => "save your work".to_owned(),
    };
    format!(
        "ongrid: session {session} will be held at {} (in {}, {}): {fix}",
        clock(hold.at, now),
        span(until(hold.at, now)),
        hold.reason
    )
}

/// Remembers what one channel was warned about, so each planned hold is announced once.
#[derive(Debug, Default)]
pub struct WarnOnce {
    warned: Option<HoldReason>,
}

impl WarnOnce {
    /// The hold to announce now, if it was not announced yet. Once no hold is due any more (a
    /// keep, activity), the next one is announced again.
    pub fn check(&mut self, warning: &Warning) -> Option<PlannedHold> {
        match warning {
            Warning::Due(hold) if self.warned == Some(hold.reason) => None,
            Warning::Due(hold) => {
                self.warned = Some(hold.reason);
                Some(hold.clone())
            }
            Warning::At(_) | Warning::None => {
                self.warned = None;
                None
            }
        }
    }
}

fn until(at: DateTime<Utc>, now: DateTime<Utc>) -> Duration {
    (at - now).to_std().unwrap_or_default()
}

/// `18:40 UTC` on the same day, `2026-05-02 18:40 UTC` otherwise.
fn clock(at: DateTime<Utc>, now: DateTime<Utc>) -> String {
    if at.date_naive() == now.date_naive() {
        at.format("%H:%M UTC").to_string()
    } else {
        at.format("%Y-%m-%d %H:%M UTC").to_string()
    }
}

/// `6 d 23 h`, `2 h`, `2 h 30 min`, `8 min`, `40 s`: the two largest units, rounded down.
pub fn span(duration: Duration) -> String {
    let total = duration.as_secs();
    let (days, hours, minutes) = (total / 86_400, total % 86_400 / 3600, total % 3600 / 60);
    let pair = |big: u64, big_unit: &str, small: u64, small_unit: &str| {
        if small == 0 {
            format!("{big} {big_unit}")
        } else {
            format!("{big} {big_unit} {small} {small_unit}")
        }
    };
    if days > 0 {
        pair(days, "d", hours, "h")
    } else if hours > 0 {
        pair(hours, "h", minutes, "min")
    } else if minutes > 0 {
        format!("{minutes} min")
    } else {
        format!("{total} s")
    }
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;
    use ongrid_core::{SessionId, SessionState};

    use super::*;

    fn now() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 4, 25, 18, 40, 0).unwrap()
    }

    fn deadlines(next_hold: Option<PlannedHold>) -> SessionDeadlines {
        SessionDeadlines {
            session_id: SessionId::new_random(),
            state: SessionState::Connected,
            idle_timeout_secs: 2 * 3600,
            max_end_at: Some(now() + chrono::Duration::hours(7 * 24 - 1)),
            keep_until: None,
            next_hold,
        }
    }

    fn names() -> (SessionName, NodeName) {
        (
            SessionName::parse("train1").unwrap(),
            NodeName::parse("node1").unwrap(),
        )
    }

    #[test]
    fn banner_says_what_holds_the_session_and_when_it_ends() {
        let (session, node) = names();
        assert_eq!(
            banner(&session, &node, &deadlines(None), now()),
            "ongrid: session train1 on node1 · held if idle for 2 h · ends at 2026-05-02 17:40 UTC (in 6 d 23 h) · devctl session show train1 for details"
        );
        let mut kept = deadlines(None);
        kept.keep_until = Some(now() + chrono::Duration::minutes(90));
        kept.max_end_at = Some(now() + chrono::Duration::minutes(300));
        kept.idle_timeout_secs = 1800;
        assert_eq!(
            banner(&session, &node, &kept, now()),
            "ongrid: session train1 on node1 · kept alive until 20:10 UTC · held if idle for 30 min · ends at 23:40 UTC (in 5 h) · devctl session show train1 for details"
        );
        // A keep that ran out is not mentioned; no maximum, no end.
        kept.keep_until = Some(now() - chrono::Duration::minutes(1));
        kept.max_end_at = None;
        assert_eq!(
            banner(&session, &node, &kept, now()),
            "ongrid: session train1 on node1 · held if idle for 30 min · devctl session show train1 for details"
        );
    }

    #[test]
    fn spans_are_two_units_rounded_down() {
        let cases = [
            (0, "0 s"),
            (40, "40 s"),
            (60, "1 min"),
            (8 * 60 + 59, "8 min"),
            (2 * 3600, "2 h"),
            (2 * 3600 + 30 * 60 + 5, "2 h 30 min"),
            (86_400, "1 d"),
            (7 * 86_400 - 3600, "6 d 23 h"),
        ];
        for (seconds, text) in cases {
            assert_eq!(span(Duration::from_secs(seconds)), text, "{seconds}");
        }
    }

    #[test]
    fn a_warning_is_due_within_warn_before() {
        let ten = Duration::from_secs(600);
        let hold = |minutes: i64, reason| PlannedHold {
            at: now() + chrono::Duration::minutes(minutes),
            reason,
        };
        assert_eq!(warning(&deadlines(None), now(), ten), Warning::None);
        let far = hold(25, HoldReason::MaxDuration);
        assert_eq!(
            warning(&deadlines(Some(far)), now(), ten),
            Warning::At(now() + chrono::Duration::minutes(15))
        );
        for minutes in [10, 8, 0, -1] {
            let near = hold(minutes, HoldReason::Idle);
            assert_eq!(
                warning(&deadlines(Some(near.clone())), now(), ten),
                Warning::Due(near),
                "{minutes}"
            );
        }
    }

    #[test]
    fn each_hold_is_announced_once_until_it_is_no_longer_due() {
        let idle = PlannedHold {
            at: now(),
            reason: HoldReason::Idle,
        };
        let max = PlannedHold {
            at: now(),
            reason: HoldReason::MaxDuration,
        };
        let mut once = WarnOnce::default();
        assert_eq!(once.check(&Warning::Due(idle.clone())), Some(idle.clone()));
        assert_eq!(once.check(&Warning::Due(idle.clone())), None);
        assert_eq!(once.check(&Warning::Due(max.clone())), Some(max.clone()));
        assert_eq!(once.check(&Warning::Due(max.clone())), None);
        assert_eq!(once.check(&Warning::At(now())), None);
        assert_eq!(once.check(&Warning::Due(max.clone())), Some(max));
        assert_eq!(once.check(&Warning::None), None);
        assert_eq!(once.check(&Warning::Due(idle.clone())), Some(idle));
    }

    #[test]
    fn warnings_name_the_fix_for_the_reason() {
        let (session, _) = names();
        let hold = |reason| PlannedHold {
            at: now() + chrono::Duration::minutes(8),
            reason,
        };
        assert_eq!(
            warning_text(&session, &hold(HoldReason::Idle), now()),
            "ongrid: session train1 will be held at 18:48 UTC (in 8 min, idle): save your work, or keep it running: devctl session keep train1 --for 2h"
        );
        let max = warning_text(&session, &hold(HoldReason::MaxDuration), now());
        assert!(
            max.starts_with("ongrid: session train1 will be held at 18:48 UTC (in 8 min, max-duration): save your work: the maximum duration cannot be extended"),
            "{max}"
        );
        assert!(max.contains("devctl freeze train1"), "{max}");
        let connection = warning_text(&session, &hold(HoldReason::NoConnection), now());
        assert!(
            connection.contains("devctl session keep train1 --for 2h"),
            "{connection}"
        );
        let admin = warning_text(&session, &hold(HoldReason::Admin), now());
        assert!(
            admin.ends_with("(in 8 min, admin): save your work"),
            "{admin}"
        );
    }
}
