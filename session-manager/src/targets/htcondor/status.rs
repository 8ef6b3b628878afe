//! What `condor_q -json` and `condor_history -json` print, in ongrid's terms: [`parse_ads`]
//! reads their ClassAd JSON (an array of job ads; nothing at all when no job matched) into
//! [`JobAd`]s, and [`JobAd::observation`] maps HTCondor's `JobStatus` (1 idle, 2 running,
//! 3 removed, 4 completed, 5 held, 6 transferring output, 7 suspended) with its hold, removal,
//! eviction and matching reasons to a [`Phase`] and a sentence a user understands.
//!
//! HTCondor's checkpoint exits (85) restart the job in place under the same `cluster.proc`,
//! and its job ad keeps no count of them, so an observation's `restarts` is always 0: the
//! ongrid job stays RUNNING across them.

use serde_json::{Map, Value};

use ongrid_core::job::JobId;

use crate::domain::grid_jobs::{EngineJobId, Observation, Phase};
use crate::targets::job_of_engine_name;

use super::submit::{JOB_ID_ATTRIBUTE, NOT_RESTARTABLE_REMOVE};

/// The attributes `condor_q` and `condor_history` are asked for (`-attributes`).
pub const ATTRIBUTES: [&str; 20] = [
    "ClusterId",
    "ProcId",
    "JobStatus",
    JOB_ID_ATTRIBUTE,
    "JobBatchName",
    "EnteredCurrentStatus",
    "RemoteHost",
    "LastRemoteHost",
    "NumJobStarts",
    "LastVacateTime",
    "VacateReason",
    "LastRejMatchReason",
    "HoldReason",
    "HoldReasonCode",
    "HoldReasonSubCode",
    "LastHoldReason",
    "RemoveReason",
    "ExitCode",
    "ExitBySignal",
    "ExitSignal",
];

/// The reason ongrid's halt gives `condor_hold`; a job held with it was halted by ongrid.
pub const HALT_HOLD_REASON: &str =
    "ongrid halt: SIGUSR1 sent (kill_sig), killed if still running after job_max_vacate_time";

/// HTCondor's `JobStatus`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobStatus {
    Idle,
    Running,
    Removed,
    Completed,
    Held,
    TransferringOutput,
    Suspended,
}

impl JobStatus {
    pub fn from_code(code: i64) -> Option<Self> {
        Some(match code {
            1 => Self::Idle,
            2 => Self::Running,
            3 => Self::Removed,
            4 => Self::Completed,
            5 => Self::Held,
            6 => Self::TransferringOutput,
            7 => Self::Suspended,
            _ => return None,
        })
    }

    /// `condor_q`'s word for it.
    pub fn word(self) -> &'static str {
        match self {
            Self::Idle => "Idle",
            Self::Running => "Running",
            Self::Removed => "Removed",
            Self::Completed => "Completed",
            Self::Held => "Held",
            Self::TransferringOutput => "Transferring output",
            Self::Suspended => "Suspended",
        }
    }
}

/// One job ad, with the attributes ongrid reads (see [`ATTRIBUTES`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobAd {
    pub cluster: u64,
    pub proc: u64,
    pub status: JobStatus,
    /// From `OngridJobId`, else from `JobBatchName` (`ongrid-<id>`).
    pub job: Option<JobId>,
    pub remote_host: Option<String>,
    pub last_remote_host: Option<String>,
    pub num_job_starts: i64,
    pub last_vacate_time: Option<i64>,
    pub vacate_reason: Option<String>,
    pub last_rej_match_reason: Option<String>,
    pub hold_reason: Option<String>,
    pub hold_reason_code: Option<i64>,
    pub hold_reason_subcode: Option<i64>,
    pub last_hold_reason: Option<String>,
    pub remove_reason: Option<String>,
    pub exit_code: Option<i64>,
    pub exit_by_signal: bool,
    pub exit_signal: Option<i64>,
}

/// Output of `condor_q -json` or `condor_history -json` that is not ClassAd JSON.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdsError {
    #[error("not ClassAd JSON (an array of job ads): {0}")]
    Json(String),
    #[error("job ad {index} has no {attribute} (or not a number): {ad}")]
    Missing {
        index: usize,
        attribute: &'static str,
        ad: String,
    },
    #[error("job ad {cluster}.{proc} has JobStatus {code}, which is none of HTCondor's 1 to 7")]
    Status { cluster: u64, proc: u64, code: i64 },
}

/// The job ads of `condor_q -json` or `condor_history -json` output. Empty output (what both
/// print when no job matched) is no ads.
pub fn parse_ads(output: &str) -> Result<Vec<JobAd>, AdsError> {
    if output.trim().is_empty() {
        return Ok(Vec::new());
    }
    let ads: Vec<Map<String, Value>> =
        serde_json::from_str(output).map_err(|e| AdsError::Json(e.to_string()))?;
    ads.iter()
        .enumerate()
        .map(|(index, ad)| JobAd::from_json(index, ad))
        .collect()
}

impl JobAd {
    fn from_json(index: usize, ad: &Map<String, Value>) -> Result<Self, AdsError> {
        let required = |attribute: &'static str| {
            int(ad, attribute).ok_or_else(|| AdsError::Missing {
                index,
                attribute,
                ad: Value::Object(ad.clone()).to_string(),
            })
        };
        let cluster = required("ClusterId")?;
        let proc = required("ProcId")?;
        let code = required("JobStatus")?;
        let (cluster, proc) = (cluster.max(0) as u64, proc.max(0) as u64);
        let status = JobStatus::from_code(code).ok_or(AdsError::Status {
            cluster,
            proc,
            code,
        })?;
        let job = text(ad, JOB_ID_ATTRIBUTE)
            .and_then(|id| id.parse().ok())
            .or_else(|| text(ad, "JobBatchName").and_then(|name| job_of_engine_name(&name)));
        Ok(Self {
            cluster,
            proc,
            status,
            job,
            remote_host: text(ad, "RemoteHost"),
            last_remote_host: text(ad, "LastRemoteHost"),
            num_job_starts: int(ad, "NumJobStarts").unwrap_or(0),
            last_vacate_time: int(ad, "LastVacateTime"),
            vacate_reason: text(ad, "VacateReason"),
            last_rej_match_reason: text(ad, "LastRejMatchReason"),
            hold_reason: text(ad, "HoldReason"),
            hold_reason_code: int(ad, "HoldReasonCode"),
            hold_reason_subcode: int(ad, "HoldReasonSubCode"),
            last_hold_reason: text(ad, "LastHoldReason"),
            remove_reason: text(ad, "RemoveReason"),
            exit_code: int(ad, "ExitCode"),
            exit_by_signal: ad
                .get("ExitBySignal")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            exit_signal: int(ad, "ExitSignal"),
        })
    }

    /// HTCondor's id of the job: `cluster.proc`.
    pub fn engine_id(&self) -> String {
        format!("{}.{}", self.cluster, self.proc)
    }

    /// What this ad means for the ongrid job.
    pub fn observation(&self) -> Observation {
        let (phase, raw) = self.phase();
        let hosts = match self.status {
            JobStatus::Running | JobStatus::TransferringOutput | JobStatus::Suspended => {
                self.remote_host.clone()
            }
            _ => self.last_remote_host.clone(),
        };
        Observation {
            // A cluster.proc never has white space and is never empty.
            engine_id: EngineJobId::parse(&self.engine_id())
                .unwrap_or_else(|_| unreachable!("cluster.proc is an engine id")),
            job: self.job,
            phase,
            restarts: 0,
            hosts: hosts.unwrap_or_default(),
            raw,
            // A held job stays in the schedd's queue until removed: halted by ongrid, past its
            // max duration, or failed, ongrid removes it once the job has ended.
            held: self.status == JobStatus::Held,
        }
    }

    /// The phase, and HTCondor's own words for `job show` (`Held (46: ...)`).
    fn phase(&self) -> (Phase, String) {
        let word = self.status.word();
        match self.status {
            JobStatus::Idle => (
                Phase::Pending {
                    why: Some(self.idle_reason()),
                },
                match &self.last_rej_match_reason {
                    Some(reason) => format!("{word} ({reason})"),
                    None => word.to_owned(),
                },
            ),
            JobStatus::Running | JobStatus::TransferringOutput | JobStatus::Suspended => {
                (Phase::Running, word.to_owned())
            }
            JobStatus::Completed if self.exit_by_signal => {
                let signal = self
                    .exit_signal
                    .map_or_else(|| "a signal".to_owned(), |s| format!("signal {s}"));
                (
                    Phase::Failed {
                        message: format!("its program was killed by {signal}"),
                    },
                    format!("{word} (killed by {signal})"),
                )
            }
            JobStatus::Completed => {
                let code = self.exit_code.unwrap_or(0);
                (
                    Phase::Exited {
                        code: i32::try_from(code).unwrap_or(i32::MAX),
                    },
                    format!("{word} (exit code {code})"),
                )
            }
            JobStatus::Removed => {
                let reason = self.remove_reason.clone().unwrap_or_default();
                let raw = format!("{word} ({reason})");
                if reason.contains("PeriodicRemove")
                    && reason.contains(NOT_RESTARTABLE_REMOVE)
                    && self.num_job_starts > 0
                {
                    let from = self
                        .last_remote_host
                        .as_deref()
                        .map(|h| format!(" from {h}"))
                        .unwrap_or_default();
                    return (
                        Phase::Failed {
                            message: format!(
                                "HTCondor evicted it{from} and it is not restartable, so it was \
                                 not run again (submit it with --restartable to have it run again)"
                            ),
                        },
                        raw,
                    );
                }
                let message = if reason.is_empty() {
                    "removed from HTCondor's queue".to_owned()
                } else {
                    format!("removed from HTCondor's queue: {reason}")
                };
                (Phase::Cancelled { message }, raw)
            }
            JobStatus::Held => self.held(),
        }
    }

    /// Why an idle job waits.
    fn idle_reason(&self) -> String {
        if self.num_job_starts > 0 || self.last_vacate_time.is_some() {
            let from = self
                .last_remote_host
                .as_deref()
                .map(|h| format!(" from {h}"))
                .unwrap_or_default();
            let why = self
                .vacate_reason
                .as_deref()
                .map(|r| format!(" ({r})"))
                .unwrap_or_default();
            return format!(
                "HTCondor evicted it{from}{why}; it waits to run again, from its last checkpoint"
            );
        }
        if let Some(hold) = &self.last_hold_reason {
            return format!("released after a hold ({hold}); waiting for a machine");
        }
        match self.last_rej_match_reason.as_deref() {
            Some("no match found") => "no HTCondor machine offers what it asks (GPUs, their \
                                       capability and memory, CPUs, memory, disk) right now"
                .to_owned(),
            Some("insufficient priority") => "its owner's HTCondor priority is too low for the \
                                              free machines right now (fair share)"
                .to_owned(),
            Some(other) => format!("waiting for an HTCondor machine: {other}"),
            None => "waiting for HTCondor to match it to a machine".to_owned(),
        }
    }

    /// A held job: halted by ongrid, past its max duration, held by someone who may release it
    /// (waiting), or held by HTCondor because it cannot run as it is (failed).
    fn held(&self) -> (Phase, String) {
        let code = self.hold_reason_code.unwrap_or(0);
        let reason = self.hold_reason.clone().unwrap_or_default();
        let raw = match self.hold_reason_subcode {
            Some(sub) if sub != 0 => format!("Held ({code}.{sub}: {reason})"),
            _ => format!("Held ({code}: {reason})"),
        };
        let phase = match code {
            1 if reason.contains(HALT_HOLD_REASON) => Phase::Halted {
                message: "halted: HTCondor sent SIGUSR1 and stopped it (HTCondor records no \
                          exit code for it)"
                    .to_owned(),
            },
            // JobDurationExceeded (allowed_job_duration), JobExecuteExceeded.
            46 | 47 => Phase::TimeLimit,
            // Held by a person (who may release it), submitted on hold, spooling input.
            1 | 15 | 16 => Phase::Pending {
                why: Some(format!(
                    "held in HTCondor's queue ({reason}): it waits until released (condor_release)"
                )),
            },
            _ => Phase::Failed {
                message: hold_sentence(code, &reason),
            },
        };
        (phase, raw)
    }
}

/// A hold that ends the job, in words a user can act on.
fn hold_sentence(code: i64, reason: &str) -> String {
    let advice = match code {
        6 => "HTCondor could not start its program: check that the command exists in the image",
        7 | 8 | 9 | 10 | 14 | 22 => {
            "HTCondor could not open the job's files on the submit side: tell the site's admins"
        }
        12 | 13 => "HTCondor could not transfer the job's files (a checkpoint exit needs /ongrid/work/checkpoint to exist)",
        34 => "it used more memory or disk than it asked for: submit it again with more --memory",
        35 | 45 => "HTCondor could not start its image: tell the site's admins (the image store must be visible to HTCondor's nodes)",
        3 | 5 => "a policy of the job held it",
        21 | 26 | 27 => "the site's HTCondor policy held it",
        _ => "HTCondor held it",
    };
    if reason.is_empty() {
        format!("{advice} (hold code {code})")
    } else {
        format!("{advice}: {reason} (hold code {code})")
    }
}

/// An attribute as an integer: ClassAd JSON writes integers as numbers (reals too, for a few
/// attributes), `null` for undefined, and a string `/Expr(...)/` for an unevaluated
/// expression (not a number).
fn int(ad: &Map<String, Value>, attribute: &str) -> Option<i64> {
    match ad.get(attribute)? {
        Value::Number(n) => n.as_i64().or_else(|| n.as_f64().map(|f| f as i64)),
        Value::Bool(b) => Some(i64::from(*b)),
        _ => None,
    }
}

/// An attribute as text (`null`, an expression or a number are not text).
fn text(ad: &Map<String, Value>, attribute: &str) -> Option<String> {
    match ad.get(attribute)? {
        Value::String(s) if !s.starts_with("/Expr(") => Some(s.clone()),
        _ => None,
    }
}
