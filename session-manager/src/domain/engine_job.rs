//! A job handed to a grid target (Slurm, HTCondor) as the manager stores it beside the job
//! ([`GridJob`]), and the names it goes by there: the engine's job id ([`EngineJobId`]) and
//! the local account it runs under ([`LocalAccount`]). Facts only: the rules over them are
//! `grid_jobs.rs`; `jobs.rs` keeps a `GridJob` in each job record. Below both.

use std::fmt;

use chrono::{DateTime, Utc};
use ongrid_core::job::JobTarget;
use serde::{Deserialize, Serialize};

/// A local POSIX account on the engine's side: 1 to 32 of `a-z 0-9 _ -`, not starting with a
/// digit or `-` (what `useradd` accepts by default).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct LocalAccount(String);

impl LocalAccount {
    pub fn parse(text: &str) -> Result<Self, String> {
        let ok = !text.is_empty()
            && text.len() <= 32
            && text
                .bytes()
                .next()
                .is_some_and(|b| b.is_ascii_lowercase() || b == b'_')
            && text
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
        if ok {
            Ok(Self(text.to_owned()))
        } else {
            Err(format!(
                "{text:?} is not a local account name: 1 to 32 lower-case letters, digits, _ or -, \
                 starting with a letter or _"
            ))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for LocalAccount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for LocalAccount {
    type Error = String;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::parse(&value)
    }
}

impl From<LocalAccount> for String {
    fn from(value: LocalAccount) -> Self {
        value.0
    }
}

/// An engine's job id: `42` (Slurm), `17.0` (HTCondor). Not empty, no white space.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct EngineJobId(String);

impl EngineJobId {
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if text.is_empty() || text.len() > 128 || text.chars().any(char::is_whitespace) {
            return Err(format!("{text:?} is not an engine job id"));
        }
        Ok(Self(text.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for EngineJobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for EngineJobId {
    type Error = String;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::parse(&value)
    }
}

impl From<EngineJobId> for String {
    fn from(value: EngineJobId) -> Self {
        value.0
    }
}

/// A job's life in its engine, as stored beside the job (table `grid_jobs`, migration 0017).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GridJob {
    pub target: JobTarget,
    pub account: LocalAccount,
    /// `None` until the engine answered the submission.
    pub engine_id: Option<EngineJobId>,
    /// When the manager began to hand it to the engine; `None`: not yet (a re-queued job of a
    /// chain that the loop submits).
    pub submit_started_at: Option<DateTime<Utc>>,
    /// How many times the engine had re-queued its engine job when this ongrid job began (0
    /// for a fresh submission; a re-queue by the engine continues the chain under the same
    /// engine id with one more).
    pub engine_restarts: u32,
    /// What the engine said last, in its own words, and when.
    pub engine_state: Option<String>,
    pub polled_at: Option<DateTime<Utc>>,
    /// The engine has ended its job (or forgotten it): nothing more to ask it, but its output.
    pub engine_final: bool,
}

impl GridJob {
    /// A job about to be handed to `target` now, under `account`.
    pub fn submitting(target: JobTarget, account: LocalAccount, now: DateTime<Utc>) -> Self {
        Self {
            target,
            account,
            engine_id: None,
            submit_started_at: Some(now),
            engine_restarts: 0,
            engine_state: None,
            polled_at: None,
            engine_final: false,
        }
    }
}
