//! What people ask of a session by hand: hold it (its owner, or an admin with a reason), release
//! a HELD one (back to the queue, pinned to the node where its container is), keep one alive for
//! a while (`devctl session keep NAME --for 4h`, capped by `keep_max`), remove it.

use std::time::Duration;

use chrono::{DateTime, Utc};
use ongrid_core::holds::HoldReason;
use ongrid_core::{SessionState, UserName};

use super::holds::{keep_until, LifecycleConfig, LifecycleFacts};
use super::{Change, SessionRecord};
use crate::domain::{utc, Refusal};

/// The longest reason an admin may give.
pub const MAX_REASON: usize = 500;

/// Holds `session` for `by`. `someone_elses`: `by` is an admin holding another user's session,
/// who must say why (`reason` is shown to the owner); an owner gives no reason.
pub fn hold(
    session: &SessionRecord,
    by: &UserName,
    someone_elses: bool,
    reason: Option<&str>,
    now: DateTime<Utc>,
) -> Result<Change, Refusal> {
    let reason = reason.map(str::trim).filter(|r| !r.is_empty());
    let (why, details) = match (someone_elses, reason) {
        (false, None) => (HoldReason::Owner, format!("held by {by}")),
        (false, Some(_)) => {
            return Err(Refusal::Invalid(
                "a reason is for admins holding someone else's session: leave out --reason"
                    .to_owned(),
            ))
        }
        (true, None) => {
            return Err(Refusal::Invalid(format!(
                "say why you hold {}'s session, it is shown to them: --reason \"...\"",
                session.user_name
            )))
        }
        (true, Some(reason)) => {
            if reason.len() > MAX_REASON || reason.chars().any(char::is_control) {
                return Err(Refusal::Invalid(format!(
                    "the reason must be one line of at most {MAX_REASON} characters"
                )));
            }
            (HoldReason::Admin, format!("{reason} (held by {by})"))
        }
    };
    match session.state {
        SessionState::Held => Err(Refusal::Conflict(format!(
            "session {} is already HELD ({}): release it with `devctl session release {}`",
            session.name, session.reason, session.name
        ))),
        state if !state.is_live() => Err(Refusal::Conflict(format!(
            "session {} is {state}: only a live session can be held",
            session.name
        ))),
        _ => Ok(Change::hold(why, now, details)),
    }
}

/// Releases a HELD `session` for `by`: PENDING again, on the node where its container is.
/// Refused when its maximum lifetime (from its lifecycle `facts`) has run out.
pub fn release(
    session: &SessionRecord,
    facts: Option<&LifecycleFacts>,
    config: &LifecycleConfig,
    by: &UserName,
    now: DateTime<Utc>,
) -> Result<Change, Refusal> {
    if session.state != SessionState::Held {
        return Err(Refusal::Conflict(format!(
            "session {} is {}, not HELD: only a held session can be released",
            session.name, session.state
        )));
    }
    if let Some(end) = facts
        .and_then(|f| f.max_end_at(config))
        .filter(|&end| end <= now)
    {
        return Err(Refusal::Conflict(format!(
            "session {} reached its maximum lifetime at {}, so it cannot run again: start a new \
             one with `devctl session new` (your home directory is kept)",
            session.name,
            utc(end)
        )));
    }
    let reason = match &session.node {
        Some(node) => {
            format!("released by {by}; waits for a GPU on {node}, where its container is")
        }
        None => format!("released by {by}"),
    };
    Ok(Change::keep_placement(SessionState::Pending, now, reason))
}

/// The duration a keep-alive asks for, in seconds: more than none.
pub fn keep_duration(secs: u64) -> Result<Duration, Refusal> {
    if secs == 0 {
        return Err(Refusal::Invalid(
            "--for must be longer than 0 seconds, like --for 4h".to_owned(),
        ));
    }
    Ok(Duration::from_secs(secs))
}

/// The new end of `session`'s keep-alive, asked for `asked` at `now`: at most `keep_max` from
/// now. Only a live session has anything to keep alive.
pub fn keep(
    session: &SessionRecord,
    asked: Duration,
    config: &LifecycleConfig,
    now: DateTime<Utc>,
) -> Result<DateTime<Utc>, Refusal> {
    if !session.state.is_live() {
        let fix = if session.state == SessionState::Held {
            format!(
                ": release it first with `devctl session release {}`",
                session.name
            )
        } else {
            String::new()
        };
        return Err(Refusal::Conflict(format!(
            "session {} is {}, so there is nothing to keep alive{fix}",
            session.name, session.state
        )));
    }
    Ok(keep_until(config, asked, now))
}

/// Removes a session for `by`: ENDED, its GPUs free; its agent removes the container.
pub fn remove(by: &UserName, now: DateTime<Utc>) -> Change {
    Change::keep_placement(SessionState::Ended, now, format!("removed by {by}"))
}

#[cfg(test)]
mod tests {
    use chrono::TimeDelta;

    use super::super::fixtures::session;
    use super::*;

    fn user(name: &str) -> UserName {
        UserName::parse(name).unwrap()
    }

    #[test]
    fn owners_hold_without_a_reason_admins_with_one() {
        let now = Utc::now();
        let running = session("train1", SessionState::Idle);
        let change = hold(&running, &user("alice"), false, None, now).unwrap();
        assert_eq!(
            (change.to, change.hold, change.reason.as_str()),
            (SessionState::Held, Some(HoldReason::Owner), "held by alice")
        );
        assert_eq!(change.sentence(), "owner: held by alice");
        let change = hold(&running, &user("root"), true, Some(" maintenance "), now).unwrap();
        assert_eq!(change.hold, Some(HoldReason::Admin));
        assert_eq!(change.sentence(), "admin: maintenance (held by root)");
        let refused = |r| match r {
            Err(Refusal::Invalid(text)) => text,
            other => panic!("{other:?}"),
        };
        assert!(
            refused(hold(&running, &user("alice"), false, Some("x"), now))
                .contains("leave out --reason")
        );
        assert!(
            refused(hold(&running, &user("root"), true, Some("  "), now))
                .contains("--reason \"...\"")
        );
        let long = "x".repeat(MAX_REASON + 1);
        assert!(
            refused(hold(&running, &user("root"), true, Some(&long), now))
                .contains("one line of at most 500")
        );
        assert!(
            refused(hold(&running, &user("root"), true, Some("a\nb"), now)).contains("one line")
        );
    }

    #[test]
    fn only_live_sessions_are_held_and_only_held_ones_released() {
        let now = Utc::now();
        let alice = user("alice");
        let mut held = session("train1", SessionState::Held);
        held.node = Some(ongrid_core::NodeName::parse("node1").unwrap());
        assert_eq!(
            hold(&held, &alice, false, None, now),
            Err(Refusal::Conflict(
                "session train1 is already HELD (because): release it with `devctl session \
                 release train1`"
                    .to_owned()
            ))
        );
        let failed = session("train1", SessionState::Failed);
        assert!(matches!(
            hold(&failed, &alice, false, None, now),
            Err(Refusal::Conflict(_))
        ));
        let config = LifecycleConfig::default();
        let change = release(&held, None, &config, &alice, now).unwrap();
        assert_eq!(change.to, SessionState::Pending);
        assert_eq!(change.placement, super::super::Placement::Keep, "pinned");
        assert_eq!(
            change.reason,
            "released by alice; waits for a GPU on node1, where its container is"
        );
        held.node = None;
        let change = release(&held, None, &config, &alice, now).unwrap();
        assert_eq!(change.reason, "released by alice");
        assert_eq!(
            release(&failed, None, &config, &alice, now),
            Err(Refusal::Conflict(
                "session train1 is FAILED, not HELD: only a held session can be released"
                    .to_owned()
            ))
        );
    }

    #[test]
    fn a_session_past_its_maximum_lifetime_is_not_released() {
        let config = LifecycleConfig::default();
        let now = Utc::now();
        let held = session("train1", SessionState::Held);
        let facts = LifecycleFacts {
            session_id: held.id,
            state: SessionState::Held,
            state_since: now,
            idle_timeout_secs: None,
            max_duration_secs: Some(3600),
            first_started_at: Some(now - TimeDelta::seconds(3600)),
            ready_at: None,
            last_close_at: None,
            last_traffic_at: None,
            cpu: Default::default(),
            gpu: Default::default(),
            keep_until: None,
            open_connections: Vec::new(),
        };
        let alice = user("alice");
        let refusal = release(&held, Some(&facts), &config, &alice, now).unwrap_err();
        assert!(
            refusal
                .to_string()
                .contains("reached its maximum lifetime at"),
            "{refusal}"
        );
        let earlier = now - TimeDelta::seconds(1);
        assert!(release(&held, Some(&facts), &config, &alice, earlier).is_ok());
    }

    #[test]
    fn keep_alives_are_capped_and_only_for_live_sessions() {
        let config = LifecycleConfig::default();
        let now = Utc::now();
        assert!(keep_duration(0).is_err());
        let asked = keep_duration(100 * 3600).unwrap();
        let idle = session("train1", SessionState::Idle);
        assert_eq!(
            keep(&idle, asked, &config, now),
            Ok(now + TimeDelta::hours(12)),
            "capped by keep_max"
        );
        let held = session("train1", SessionState::Held);
        assert_eq!(
            keep(&held, asked, &config, now),
            Err(Refusal::Conflict(
                "session train1 is HELD, so there is nothing to keep alive: release it first \
                 with `devctl session release train1`"
                    .to_owned()
            ))
        );
        let change = remove(&user("alice"), now);
        assert_eq!(
            (change.to, change.reason.as_str()),
            (SessionState::Ended, "removed by alice")
        );
    }
}
