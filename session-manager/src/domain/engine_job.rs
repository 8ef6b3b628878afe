//! A job handed to a grid target (Slurm, HTCondor) as the manager stores it beside the job
//! ([`GridJob`]), and the names it goes by there: the engine's job id ([`EngineJobId`]) and
//! the local account it runs under ([`LocalAccount`]). Facts only: the rules over them are
//! `grid_jobs.rs`; `jobs.rs` keeps a `GridJob` in each job record. Below both.

use std::fmt;

use chrono::{DateTime, Utc};
use ongrid_core::job::{JobId, JobTarget};
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
    /// Why the engine keeps it waiting, in words a user understands (Slurm's and HTCondor's
    /// pending reasons, mapped by the target), as of its last poll; `None` while it does not.
    pub engine_waiting: Option<String>,
    pub polled_at: Option<DateTime<Utc>>,
    /// The engine has ended its job (or forgotten it): nothing more to ask it, but its output.
    pub engine_final: bool,
}

impl GridJob {
    /// Why a QUEUED job of a grid target waits, for people (`job show`): the engine's reason in
    /// words as of its last poll, else where it is in being handed over.
    pub fn waiting_reason(&self) -> String {
        if let Some(why) = &self.engine_waiting {
            return why.clone();
        }
        match (&self.engine_id, self.polled_at) {
            (None, _) => format!("to be handed to {}", self.target),
            (Some(id), None) => format!(
                "handed to {} as its job {id}: not asked about yet",
                self.target
            ),
            (Some(id), Some(_)) => format!("in {}'s queue as its job {id}", self.target),
        }
    }

    /// A job about to be handed to `target` now, under `account`.
    pub fn submitting(target: JobTarget, account: LocalAccount, now: DateTime<Utc>) -> Self {
        Self {
            target,
            account,
            engine_id: None,
            submit_started_at: Some(now),
            engine_restarts: 0,
            engine_state: None,
            engine_waiting: None,
            polled_at: None,
            engine_final: false,
        }
    }
}

/// What one poll of its engine said of a job, as stored (`Store::record_engine_poll`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnginePoll<'a> {
    /// The engine's own words (`PENDING (Resources)`).
    pub state: &'a str,
    /// Why the engine keeps the job waiting, in words; `None` when it does not.
    pub waiting: Option<&'a str>,
    /// The engine is done with the job (once done, it stays done).
    pub engine_final: bool,
    pub at: DateTime<Utc>,
}

impl<'a> EnginePoll<'a> {
    /// The engine is done with the job (or never had it): `state` says how.
    pub fn done(state: &'a str, at: DateTime<Utc>) -> Self {
        Self {
            state,
            waiting: None,
            engine_final: true,
            at,
        }
    }
}

/// The id of the ongrid job that continues `previous`'s chain when the engine itself re-queued
/// `previous`'s engine job (Slurm's `RequeueExit`): derived, so the job script computes the same
/// id for its next run without asking the manager (`targets/slurm/script.rs`,
/// [`REQUEUED_JOB_ID_BASH`]). The first 16 bytes of SHA-256 of `ongrid requeue of <previous>`,
/// as a version-8 (custom) UUID.
pub fn requeued_job_id(previous: JobId) -> JobId {
    JobId(super::idempotency::sha256_uuid(&format!(
        "ongrid requeue of {previous}"
    )))
}

/// [`requeued_job_id`] as a bash function of the job script: `ongrid_requeued_id ID` prints the
/// id of the job that continues ID's chain (`sha256sum` of coreutils on the job's PATH).
pub const REQUEUED_JOB_ID_BASH: &str = "ongrid_requeued_id() {\n\
     \x20 local h\n\
     \x20 h=$(printf 'ongrid requeue of %s' \"$1\" | sha256sum) || return 1\n\
     \x20 printf '%s-%s-8%s-%x%s-%s' \"${h:0:8}\" \"${h:8:4}\" \"${h:13:3}\" \"$(( (0x${h:16:1} & 3) | 8 ))\" \"${h:17:3}\" \"${h:20:12}\"\n\
     }\n";

#[cfg(test)]
mod tests {
    use super::*;

    /// The job script's bash computes the same ids as the manager, run after run.
    #[test]
    fn the_scripts_requeued_ids_are_the_managers() {
        let first = JobId(uuid::Uuid::from_u128(
            0x0123_4567_89ab_cdef_0011_2233_4455_6677,
        ));
        let mut ids = vec![first];
        for _ in 0..3 {
            ids.push(requeued_job_id(*ids.last().unwrap()));
        }
        assert_eq!(ids[1].0.get_version_num(), 8);
        assert_ne!(ids[1], ids[2]);
        let script = format!(
            "{REQUEUED_JOB_ID_BASH}id={first}\nfor _ in 1 2 3; do id=$(ongrid_requeued_id \"$id\"); echo \"$id\"; done\n"
        );
        let out = std::process::Command::new("bash")
            .args(["-c", &script])
            .output()
            .expect("bash runs");
        assert!(out.status.success(), "{out:?}");
        let from_bash: Vec<JobId> = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| l.parse().unwrap())
            .collect();
        assert_eq!(from_bash, ids[1..]);
    }
}
