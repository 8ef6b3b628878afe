//! How the gateway's connection events move a session between WAITING, CONNECTED and IDLE.
//!
//! The store calls [`follow_connection`] inside the transaction that records the event, so that
//! two connections opening and closing at once can never leave a session IDLE with a connection
//! open.
//!
//! Connections coming and going would add two transitions each to the session's history; they
//! fold instead ([`folds`]): the history keeps the first CONNECTED (from WAITING) and the latest
//! CONNECTED ⇄ IDLE pair, each with how many times it happened.

use chrono::{DateTime, Utc};
use ongrid_core::api::{ConnectionEvent, ConnectionEventKind};
use ongrid_core::{normalize_ip, SessionState, Transition};

use super::Change;

/// How a connection event moves its session, in `state` before it, with `open_after` of its
/// connections open after it: an open (or the activity report of a connection whose open was
/// lost) makes a WAITING or IDLE session CONNECTED; the close of its last open connection makes
/// a CONNECTED session IDLE. Anything else (a session held or removed meanwhile, a repeated
/// event) changes nothing.
pub fn follow_connection(
    state: SessionState,
    event: &ConnectionEvent,
    open_after: u32,
    now: DateTime<Utc>,
) -> Option<Change> {
    let source = normalize_ip(event.source);
    let institute = &event.institute;
    let (to, reason) = match (event.event, state) {
        (ConnectionEventKind::Open, SessionState::Waiting | SessionState::Idle) => (
            SessionState::Connected,
            format!("SSH connection from {source} ({institute})"),
        ),
        (ConnectionEventKind::Activity, SessionState::Waiting | SessionState::Idle)
            if open_after > 0 =>
        {
            (
                SessionState::Connected,
                format!("SSH connection from {source} ({institute}) reported open"),
            )
        }
        (ConnectionEventKind::Close, SessionState::Connected) if open_after == 0 => {
            (SessionState::Idle, "last SSH connection closed".to_owned())
        }
        _ => return None,
    };
    Some(Change::keep_placement(to, now, reason))
}

/// Whether a move of a session with `history` to `to` folds into its history instead of adding
/// a row: it is a CONNECTED ⇄ IDLE flip, and the history ends with the same flip followed by
/// its reverse. The store then drops the reverse (the last row) and gives the same flip (now
/// the last) the new time and reason, counting one more repeat: the replayed history stays a
/// valid sequence and ends in the same state, and no row but the last is ever removed.
pub fn folds(history: &[Transition], to: SessionState) -> bool {
    let flip = |from: Option<SessionState>, to: SessionState| {
        matches!(
            (from, to),
            (Some(SessionState::Connected), SessionState::Idle)
                | (Some(SessionState::Idle), SessionState::Connected)
        )
    };
    match history {
        [.., before, last] => {
            flip(Some(last.to), to)
                && flip(before.from, before.to)
                && flip(last.from, last.to)
                && before.from == Some(last.to)
                && before.to == to
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use ongrid_core::{Dn, InstituteName, SessionId};

    use super::*;

    #[test]
    fn connections_move_sessions_between_waiting_connected_and_idle() {
        use SessionState::*;
        let now = Utc::now();
        let event = |kind: ConnectionEventKind| ConnectionEvent {
            connection_id: uuid::Uuid::new_v4(),
            event: kind,
            at: now,
            owner: Dn::parse("/CN=Alice").unwrap(),
            fingerprint: "SHA256:x".to_owned(),
            source: "::ffff:192.0.2.7".parse().unwrap(),
            institute: InstituteName::parse("uni-x").unwrap(),
            session_id: SessionId::new_random(),
            bytes_in: 0,
            bytes_out: 0,
            close_reason: None,
        };
        let open = event(ConnectionEventKind::Open);
        let close = event(ConnectionEventKind::Close);
        let activity = event(ConnectionEventKind::Activity);
        let follow = |state, event: &ConnectionEvent, open| {
            follow_connection(state, event, open, now).map(|c| (c.to, c.reason))
        };
        assert_eq!(
            follow(Waiting, &open, 1),
            Some((
                Connected,
                "SSH connection from 192.0.2.7 (uni-x)".to_owned()
            ))
        );
        let change = follow_connection(Waiting, &open, 1, now).unwrap();
        assert_eq!(change.at, now);
        assert_eq!(change.placement, super::super::Placement::Keep);
        assert_eq!(follow(Idle, &open, 1).map(|c| c.0), Some(Connected));
        assert_eq!(follow(Connected, &open, 2), None);
        assert_eq!(follow(Held, &open, 1), None);
        assert_eq!(follow(Connected, &close, 1), None, "another is still open");
        assert_eq!(
            follow(Connected, &close, 0),
            Some((Idle, "last SSH connection closed".to_owned()))
        );
        assert_eq!(follow(Idle, &close, 0), None);
        assert_eq!(follow(Ended, &close, 0), None);
        // A report of a connection whose open was lost.
        assert_eq!(
            follow(Idle, &activity, 1),
            Some((
                Connected,
                "SSH connection from 192.0.2.7 (uni-x) reported open".to_owned()
            ))
        );
        assert_eq!(follow(Waiting, &activity, 0), None, "closed meanwhile");
    }

    #[test]
    fn only_repeated_connection_flips_fold() {
        use SessionState::*;
        let history = |states: &[SessionState]| -> Vec<Transition> {
            let mut from = None;
            states
                .iter()
                .map(|&to| {
                    let t = Transition {
                        from,
                        to,
                        at: Utc::now(),
                        reason: String::new(),
                    };
                    from = Some(to);
                    t
                })
                .collect()
        };
        let waited = [Pending, Starting, Waiting];
        // The first connection, its close and the next open are kept as rows...
        assert!(!folds(&history(&waited), Connected));
        assert!(!folds(
            &history(&[&waited[..], &[Connected]].concat()),
            Idle
        ));
        assert!(!folds(
            &history(&[&waited[..], &[Connected, Idle]].concat()),
            Connected
        ));
        // ...from then on each flip folds into the pair before it.
        let pair = [&waited[..], &[Connected, Idle, Connected]].concat();
        assert!(folds(&history(&pair), Idle));
        let pair = [&waited[..], &[Connected, Idle, Connected, Idle]].concat();
        assert!(folds(&history(&pair), Connected));
        // Anything else is a row of its own.
        assert!(!folds(&history(&pair), Held));
        let released = [&waited[..], &[Connected, Held, Pending, Starting, Waiting]].concat();
        assert!(!folds(&history(&released), Connected));
    }
}
