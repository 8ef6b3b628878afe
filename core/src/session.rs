//! The session state machine of DESIGN.md.
//!
//! `PENDING → STARTING → WAITING ⇄ CONNECTED ⇄ IDLE`; any live state `→ HELD → PENDING`
//! (release), `→ ENDED` (removed) or `→ FAILED`. Every transition is recorded with its time and
//! reason; an invalid one is a typed error and changes nothing.

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum SessionState {
    /// Waiting for a GPU.
    Pending,
    /// Placed on a node; the agent is creating the container.
    Starting,
    /// Running; nobody has connected since it became ready.
    Waiting,
    /// At least one SSH connection is open.
    Connected,
    /// Running, no connection open, after one was.
    Idle,
    /// Stopped with its GPU freed; the container and home volume are kept.
    Held,
    /// Removed by its owner or an admin. Terminal.
    Ended,
    /// Could not run; the reason says what to do. Only removal follows.
    Failed,
}

impl SessionState {
    pub const ALL: [SessionState; 8] = [
        Self::Pending,
        Self::Starting,
        Self::Waiting,
        Self::Connected,
        Self::Idle,
        Self::Held,
        Self::Ended,
        Self::Failed,
    ];

    /// Live states are those that may still run: everything but HELD, ENDED and FAILED.
    pub fn is_live(self) -> bool {
        matches!(
            self,
            Self::Pending | Self::Starting | Self::Waiting | Self::Connected | Self::Idle
        )
    }

    /// States in which the session holds GPUs (placed on a node).
    pub fn holds_gpus(self) -> bool {
        matches!(
            self,
            Self::Starting | Self::Waiting | Self::Connected | Self::Idle
        )
    }

    /// Whether the container should exist and run on its node.
    pub fn wants_container_running(self) -> bool {
        self.holds_gpus()
    }

    /// Whether nothing can follow (ENDED); every other state keeps the session's name taken.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Ended)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "PENDING",
            Self::Starting => "STARTING",
            Self::Waiting => "WAITING",
            Self::Connected => "CONNECTED",
            Self::Idle => "IDLE",
            Self::Held => "HELD",
            Self::Ended => "ENDED",
            Self::Failed => "FAILED",
        }
    }

    /// Whether `self → to` is allowed.
    pub fn can_become(self, to: SessionState) -> bool {
        use SessionState::*;
        match (self, to) {
            (Pending, Starting) => true,
            (Starting, Waiting) => true,
            // A node that vanished before the container ran: back to the queue.
            (Starting, Pending) => true,
            (Waiting, Connected) | (Connected, Idle) | (Idle, Connected) => true,
            (Connected, Waiting) => false,
            (from, Held) if from.is_live() => true,
            (Held, Pending) => true,
            (from, Failed) if from.is_live() || from == Held => true,
            (from, Ended) if from != Ended => true,
            _ => false,
        }
    }
}

impl fmt::Display for SessionState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown session state {0:?}")]
pub struct UnknownState(pub String);

impl FromStr for SessionState {
    type Err = UnknownState;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|state| state.as_str().eq_ignore_ascii_case(s))
            .ok_or_else(|| UnknownState(s.to_owned()))
    }
}

/// One recorded change of state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Transition {
    /// `None` for the creation of the session.
    pub from: Option<SessionState>,
    pub to: SessionState,
    pub at: DateTime<Utc>,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a session cannot go from {from} to {to}")]
pub struct InvalidTransition {
    pub from: SessionState,
    pub to: SessionState,
}

/// A session's state with its full history. The only way to change the state is
/// [`Lifecycle::transition`], so the history is always complete.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lifecycle {
    state: SessionState,
    history: Vec<Transition>,
}

impl Lifecycle {
    /// A new session, PENDING since `at`.
    pub fn new(at: DateTime<Utc>, reason: impl Into<String>) -> Self {
        let first = Transition {
            from: None,
            to: SessionState::Pending,
            at,
            reason: reason.into(),
        };
        Self {
            state: SessionState::Pending,
            history: vec![first],
        }
    }

    /// Rebuilds a lifecycle from stored history, checking that it is a valid sequence.
    pub fn from_history(history: Vec<Transition>) -> Result<Self, InvalidTransition> {
        let mut state: Option<SessionState> = None;
        for t in &history {
            match (state, t.from) {
                (None, None) if t.to == SessionState::Pending => {}
                (Some(current), Some(from)) if current == from && from.can_become(t.to) => {}
                (current, _) => {
                    return Err(InvalidTransition {
                        from: current.unwrap_or(SessionState::Ended),
                        to: t.to,
                    })
                }
            }
            state = Some(t.to);
        }
        match state {
            Some(state) => Ok(Self { state, history }),
            None => Err(InvalidTransition {
                from: SessionState::Ended,
                to: SessionState::Pending,
            }),
        }
    }

    pub fn state(&self) -> SessionState {
        self.state
    }

    pub fn history(&self) -> &[Transition] {
        &self.history
    }

    pub fn last(&self) -> &Transition {
        // `new` and `from_history` guarantee at least one entry.
        &self.history[self.history.len() - 1]
    }

    /// Moves to `to`, recording when and why. An invalid move changes nothing.
    pub fn transition(
        &mut self,
        to: SessionState,
        at: DateTime<Utc>,
        reason: impl Into<String>,
    ) -> Result<&Transition, InvalidTransition> {
        if !self.state.can_become(to) {
            return Err(InvalidTransition {
                from: self.state,
                to,
            });
        }
        self.history.push(Transition {
            from: Some(self.state),
            to,
            at,
            reason: reason.into(),
        });
        self.state = to;
        Ok(self.last())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use SessionState::*;

    fn t0() -> DateTime<Utc> {
        DateTime::from_timestamp(1_700_000_000, 0).unwrap()
    }

    #[test]
    fn happy_path_records_everything() {
        let mut l = Lifecycle::new(t0(), "created");
        l.transition(Starting, t0(), "placed on node1").unwrap();
        l.transition(Waiting, t0(), "container running").unwrap();
        l.transition(Connected, t0(), "ssh from 10.0.0.1").unwrap();
        l.transition(Idle, t0(), "last connection closed").unwrap();
        l.transition(Held, t0(), "idle").unwrap();
        l.transition(Pending, t0(), "released").unwrap();
        l.transition(Ended, t0(), "removed by owner").unwrap();
        assert_eq!(l.state(), Ended);
        assert_eq!(l.history().len(), 8);
        assert_eq!(l.history()[5].from, Some(Idle));
        assert_eq!(l.history()[5].reason, "idle");
        let rebuilt = Lifecycle::from_history(l.history().to_vec()).unwrap();
        assert_eq!(rebuilt, l);
    }

    #[test]
    fn invalid_transitions_are_typed_and_change_nothing() {
        let mut l = Lifecycle::new(t0(), "created");
        let err = l.transition(Connected, t0(), "x").unwrap_err();
        assert_eq!(
            err,
            InvalidTransition {
                from: Pending,
                to: Connected
            }
        );
        assert_eq!(
            err.to_string(),
            "a session cannot go from PENDING to CONNECTED"
        );
        assert_eq!(l.state(), Pending);
        assert_eq!(l.history().len(), 1);
        l.transition(Ended, t0(), "removed").unwrap();
        assert!(l.transition(Pending, t0(), "x").is_err());
        assert!(l.transition(Ended, t0(), "x").is_err());
    }

    #[test]
    fn failed_only_leads_to_ended() {
        for to in SessionState::ALL {
            assert_eq!(Failed.can_become(to), to == Ended, "{to}");
        }
        assert!(Held.can_become(Failed));
        assert!(!Held.can_become(Held));
    }

    #[test]
    fn tampered_history_is_refused() {
        let mut l = Lifecycle::new(t0(), "created");
        l.transition(Starting, t0(), "placed").unwrap();
        let mut history = l.history().to_vec();
        history[1].to = Connected;
        assert!(Lifecycle::from_history(history).is_err());
        assert!(Lifecycle::from_history(vec![]).is_err());
    }

    #[test]
    fn state_names_roundtrip() {
        for s in SessionState::ALL {
            assert_eq!(s.as_str().parse::<SessionState>().unwrap(), s);
            assert_eq!(serde_json::to_string(&s).unwrap(), format!("\"{s}\""));
        }
    }

    proptest! {
        #[test]
        fn any_sequence_keeps_history_consistent(moves in proptest::collection::vec(0usize..8, 0..40)) {
            let mut l = Lifecycle::new(t0(), "created");
            for m in moves {
                let to = SessionState::ALL[m];
                let before = l.state();
                match l.transition(to, t0(), "step") {
                    Ok(_) => prop_assert!(before.can_become(to)),
                    Err(_) => prop_assert_eq!(l.state(), before),
                }
            }
            let rebuilt = Lifecycle::from_history(l.history().to_vec()).unwrap();
            prop_assert_eq!(rebuilt.state(), l.state());
        }
    }
}
