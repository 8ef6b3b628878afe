//! What Slurm's commands print, parsed with serde and mapped to ongrid's terms: `squeue --json`
//! (Slurm 22.05's OpenAPI v0.0.38 layout, which Debian bookworm's `slurm-client` prints; the
//! later layouts' lists and objects are read too), `sacct --parsable2` lines (the job-completion
//! log with `sacct -c` where no slurmdbd runs: `sacct --json` needs slurmdbd, as 22.05 says:
//! "slurm_openapi_p_init: slurm not configured with slurmdbd"), `sbatch --parsable`'s answer,
//! and every Slurm state and pending reason as a [`Phase`] and a sentence a user understands.

use serde::Deserialize;

use crate::domain::grid_jobs::{EngineJobId, Phase};

/// `squeue --json`. Slurm 22.05 prints every job whatever the filters, so callers pick theirs.
#[derive(Debug, Clone, Deserialize)]
pub struct SqueueOutput {
    #[serde(default)]
    pub jobs: Vec<SqueueJob>,
    #[serde(default)]
    pub errors: Vec<serde_json::Value>,
}

/// One job of `squeue --json` (the fields ongrid reads).
#[derive(Debug, Clone, Deserialize)]
pub struct SqueueJob {
    pub job_id: u64,
    #[serde(default)]
    pub name: String,
    /// `"RUNNING"` (22.05), `["RUNNING"]` (23.02 and later).
    pub job_state: OneOrMany,
    #[serde(default)]
    pub state_reason: String,
    #[serde(default)]
    pub nodes: String,
    #[serde(default)]
    pub restart_cnt: u32,
    /// The wait status (22.05: `768` is exit code 3, `9` is signal 9), or 23.02's object.
    #[serde(default)]
    pub exit_code: Option<ExitCode>,
    #[serde(default)]
    pub user_name: String,
    /// Minutes (22.05), or 23.02's `{"set": true, "number": N}`.
    #[serde(default)]
    pub time_limit: Option<serde_json::Value>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    /// The base state (the first of a list: 23.02 lists flags such as `COMPLETING` after it).
    pub fn base(&self) -> &str {
        match self {
            Self::One(state) => state,
            Self::Many(states) => states.first().map_or("", String::as_str),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum ExitCode {
    /// A wait status, as 22.05 prints it.
    Status(i64),
    /// 23.02 and later.
    Object {
        #[serde(default)]
        return_code: Option<serde_json::Value>,
        #[serde(default)]
        signal: Option<serde_json::Value>,
    },
}

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    Code(i32),
    Signal(i32),
}

impl ExitCode {
    pub fn ended(&self) -> Ended {
        match self {
            Self::Status(status) => {
                let status = i32::try_from(*status).unwrap_or(i32::MAX);
                if status & 0x7f != 0 {
                    Ended::Signal(status & 0x7f)
                } else {
                    Ended::Code((status >> 8) & 0xff)
                }
            }
            Self::Object {
                return_code,
                signal,
            } => {
                let number = |v: &Option<serde_json::Value>| -> i64 {
                    match v {
                        Some(serde_json::Value::Number(n)) => n.as_i64().unwrap_or(0),
                        Some(serde_json::Value::Object(o)) => o
                            .get("number")
                            .and_then(serde_json::Value::as_i64)
                            .unwrap_or(0),
                        _ => 0,
                    }
                };
                let sig = number(&signal.as_ref().and_then(|s| match s {
                    serde_json::Value::Object(o) => o.get("id").cloned(),
                    other => Some(other.clone()),
                }));
                if sig != 0 {
                    Ended::Signal(i32::try_from(sig).unwrap_or(0))
                } else {
                    Ended::Code(i32::try_from(number(return_code)).unwrap_or(-1))
                }
            }
        }
    }
}

/// Why `squeue --json`'s output was not understood.
pub fn parse_squeue(text: &str) -> Result<SqueueOutput, String> {
    serde_json::from_str(text).map_err(|e| {
        format!(
            "squeue --json printed what ongrid cannot read ({e}): is the slurm-client package \
             (with its openapi and serializer/json plugins) installed?"
        )
    })
}

/// One job of the job-completion log or the accounting database: `sacct --parsable2
/// --noheader --format=JobID,JobName,State,ExitCode,NodeList`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SacctJob {
    pub job_id: String,
    pub name: String,
    /// The first word (`CANCELLED by 0` → `CANCELLED`).
    pub state: String,
    pub ended: Ended,
    pub nodes: String,
}

/// The columns [`parse_sacct`] reads, for `--format`.
pub const SACCT_FORMAT: &str = "JobID,JobName,State,ExitCode,NodeList";

/// Every job line of `sacct --parsable2 --noheader --format=`[`SACCT_FORMAT`], the last line of
/// a job winning (a job re-queued by Slurm has a line per run); job steps (`42.batch`) are left
/// out.
pub fn parse_sacct(text: &str) -> Vec<SacctJob> {
    let mut jobs: Vec<SacctJob> = Vec::new();
    for line in text.lines() {
        let fields: Vec<&str> = line.split('|').collect();
        let [job_id, name, state, exit, nodes, ..] = fields.as_slice() else {
            continue;
        };
        if job_id.is_empty() || job_id.contains('.') || *job_id == "JobID" {
            continue;
        }
        let (code, signal) = exit.split_once(':').unwrap_or((exit, "0"));
        let signal: i32 = signal.trim().parse().unwrap_or(0);
        let ended = if signal != 0 {
            Ended::Signal(signal)
        } else {
            Ended::Code(code.trim().parse().unwrap_or(0))
        };
        let job = SacctJob {
            job_id: (*job_id).to_owned(),
            name: (*name).to_owned(),
            state: state.split_whitespace().next().unwrap_or("").to_owned(),
            ended,
            nodes: if *nodes == "(null)" || *nodes == "None assigned" {
                String::new()
            } else {
                (*nodes).to_owned()
            },
        };
        jobs.retain(|j| j.job_id != job.job_id);
        jobs.push(job);
    }
    jobs
}

/// The job id `sbatch --parsable` printed (`42`, or `42;cluster`).
pub fn parse_sbatch(stdout: &str) -> Result<EngineJobId, String> {
    let line = stdout
        .lines()
        .map(str::trim)
        .rfind(|line| !line.is_empty())
        .unwrap_or("");
    let id = line.split(';').next().unwrap_or("");
    if id.is_empty() || !id.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("sbatch printed {line:?}, not a job id"));
    }
    EngineJobId::parse(id)
}

/// What sbatch's complaint means: the job can never run as asked (refused, shown to the user)
/// or Slurm could not be asked (retried).
pub fn sbatch_refused(stderr: &str) -> Option<String> {
    let line = stderr
        .lines()
        .find(|line| line.contains("Batch job submission failed"))
        .or_else(|| {
            stderr
                .lines()
                .find(|line| line.contains("error:") && !unavailable(line))
        })?;
    let words = line
        .split("Batch job submission failed:")
        .nth(1)
        .or_else(|| line.split("error:").nth(1))
        .unwrap_or(line)
        .trim();
    if unavailable(words) {
        return None;
    }
    Some(words.to_owned())
}

fn unavailable(text: &str) -> bool {
    let text = text.to_ascii_lowercase();
    [
        "unable to contact slurm controller",
        "connection refused",
        "socket timed out",
        "munge",
        "slurm_persist_conn",
        "communication connection failure",
    ]
    .iter()
    .any(|needle| text.contains(needle))
}

/// A job's Slurm state and reason as a [`Phase`].
pub fn phase(state: &str, reason: &str, ended: Ended) -> Phase {
    match state {
        "PENDING" | "REQUEUED" | "REQUEUE_HOLD" | "REQUEUE_FED" | "SPECIAL_EXIT"
        | "RESV_DEL_HOLD" => Phase::Pending {
            why: pending_reason(reason),
        },
        "RUNNING" | "CONFIGURING" | "COMPLETING" | "SIGNALING" | "STAGE_OUT" | "RESIZING"
        | "SUSPENDED" | "STOPPED" => Phase::Running,
        "COMPLETED" => match ended {
            Ended::Code(code) => Phase::Exited { code },
            Ended::Signal(signal) => killed(signal),
        },
        "FAILED" => match ended {
            Ended::Code(code) if code != 0 => Phase::Exited { code },
            Ended::Signal(signal) => killed(signal),
            Ended::Code(_) => Phase::Failed {
                message: format!(
                    "Slurm could not start it ({})",
                    reason_words(reason).unwrap_or_else(|| "no reason given".to_owned())
                ),
            },
        },
        "CANCELLED" => Phase::Cancelled {
            message: "cancelled in Slurm (by its owner's account or an administrator)".to_owned(),
        },
        "TIMEOUT" => Phase::TimeLimit,
        "DEADLINE" => Phase::Failed {
            message: "Slurm did not start it before its deadline".to_owned(),
        },
        "NODE_FAIL" => Phase::Failed {
            message: "its Slurm node failed".to_owned(),
        },
        "BOOT_FAIL" => Phase::Failed {
            message: "its Slurm node failed to boot".to_owned(),
        },
        "PREEMPTED" => Phase::Failed {
            message: "preempted by Slurm for higher-priority work".to_owned(),
        },
        "OUT_OF_MEMORY" => Phase::Failed {
            message: "ran out of memory: ask for more with --memory".to_owned(),
        },
        "REVOKED" => Phase::Failed {
            message: "revoked by Slurm (a federated job started on another cluster)".to_owned(),
        },
        other => Phase::Pending {
            why: Some(format!("Slurm reports state {other} ({reason})")),
        },
    }
}

fn killed(signal: i32) -> Phase {
    let name = match signal {
        9 => " (SIGKILL)",
        15 => " (SIGTERM)",
        6 => " (SIGABRT)",
        11 => " (SIGSEGV)",
        _ => "",
    };
    Phase::Failed {
        message: format!("killed by signal {signal}{name}"),
    }
}

/// Why a PENDING job waits, in words a user understands; `None` when Slurm gives no reason.
pub fn pending_reason(reason: &str) -> Option<String> {
    reason_words(reason).map(|words| format!("waiting in Slurm: {words}"))
}

/// Slurm's reason codes (`squeue`'s `state_reason`, `man squeue` "JOB REASON CODES") in words.
fn reason_words(reason: &str) -> Option<String> {
    let reason = reason.trim();
    let words = match reason {
        "" | "None" => return None,
        "Priority" => "other jobs go first (they have higher priority)",
        "Resources" => "the GPUs (or CPUs, memory) it asks for are in use by other jobs",
        "Dependency" => "it depends on another job that has not finished",
        "DependencyNeverSatisfied" => "it depends on a job that failed: it will never start",
        "BeginTime" => "its start time has not come (Slurm waits before starting a re-queued job)",
        "JobHeldUser" => "held by its owner's account (scontrol release releases it)",
        "JobHeldAdmin" => "held by an administrator",
        "launch failed requeued held" => "its launch failed and Slurm holds it: ask the site",
        "ReqNodeNotAvail" => "a node it needs is not available (drained, down or reserved)",
        "NodeDown" => "a node it needs is down",
        "PartitionDown" => "its partition is down: ask the site",
        "PartitionInactive" => "its partition does not take jobs now",
        "PartitionNodeLimit" => "it asks for more nodes than its partition allows",
        "PartitionTimeLimit" => "its max duration is longer than its partition allows: shorten it",
        "PartitionConfig" => "it asks for more than its partition's configuration allows",
        "BadConstraints" => "no node has the features and GPUs it asks for",
        "InvalidAccount" => "its Slurm account is not valid: ask the site",
        "InvalidQOS" => "its Slurm QOS is not valid: ask the site",
        "Reservation" => "it waits for its reservation to start",
        "Licenses" => "the licenses it needs are in use",
        "Cleaning" => "Slurm is cleaning up after an earlier run of it",
        "Prolog" => "its node's prolog is running",
        "FrontEndDown" => "the front end node is down",
        "SystemFailure" => "Slurm had a failure: ask the site",
        "JobArrayTaskLimit" => "its array has the most tasks running it may",
        "NonZeroExitCode" => {
            "it exited with a code Slurm re-queues on (a checkpoint), and waits to run again"
        }
        "OutOfMemory" => "an earlier run ran out of memory",
        "TimeLimit" => "an earlier run reached its time limit",
        "Deadline" => "its deadline passed",
        "InactiveLimit" => "it reached Slurm's inactivity limit",
        "MaxRequeue" | "MaxRequeueReached" => "it was re-queued as often as Slurm allows",
        "PowerUpNode" => "a node it needs is powering up",
        _ if reason.starts_with("QOS") => {
            return Some(format!(
                "a limit of its quality of service is reached ({reason}): it starts when \
                 your other jobs finish"
            ))
        }
        _ if reason.starts_with("Assoc") => {
            return Some(format!(
                "a limit of its Slurm account is reached ({reason}): it starts when \
                 jobs of that account finish"
            ))
        }
        _ if reason.contains("Grp") || reason.contains("Max") => {
            return Some(format!("a site limit is reached ({reason})"))
        }
        other => return Some(format!("Slurm's reason: {other}")),
    };
    Some(words.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `squeue --json` of Debian bookworm's Slurm 22.05.8 (recorded from the test cluster of
    /// `session-manager/tests/slurm`, trimmed to a few jobs): a pending job (Resources), a
    /// running one, one completed, one exited 3, one killed by signal 9, one re-queued by its
    /// checkpoint exit 85.
    const SQUEUE_22_05: &str = include_str!("testdata/squeue-22.05.json");

    #[test]
    fn squeue_22_05_is_read_with_states_reasons_and_exit_codes() {
        let out = parse_squeue(SQUEUE_22_05).unwrap();
        let phases: Vec<(u64, Phase, u32)> = out
            .jobs
            .iter()
            .map(|j| {
                let ended = j.exit_code.as_ref().map_or(Ended::Code(0), ExitCode::ended);
                (
                    j.job_id,
                    phase(j.job_state.base(), &j.state_reason, ended),
                    j.restart_cnt,
                )
            })
            .collect();
        assert_eq!(
            phases,
            vec![
                (1, Phase::Exited { code: 0 }, 0),
                (2, Phase::Exited { code: 3 }, 0),
                (
                    3,
                    Phase::Failed {
                        message: "killed by signal 9 (SIGKILL)".into()
                    },
                    0
                ),
                (
                    4,
                    Phase::Pending {
                        why: Some(
                            "waiting in Slurm: its start time has not come (Slurm waits before \
                             starting a re-queued job)"
                                .into()
                        )
                    },
                    1
                ),
                (5, Phase::Running, 0),
                (
                    6,
                    Phase::Pending {
                        why: Some(
                            "waiting in Slurm: the GPUs (or CPUs, memory) it asks for are in use \
                             by other jobs"
                                .into()
                        )
                    },
                    0
                ),
            ]
        );
        assert_eq!(out.jobs[4].nodes, "vm");
        assert_eq!(out.jobs[4].name, "ongrid-test5");
    }

    #[test]
    fn later_layouts_with_lists_and_objects_are_read_too() {
        let text = r#"{"jobs": [{"job_id": 7, "name": "x", "job_state": ["FAILED"],
            "state_reason": "NonZeroExitCode",
            "exit_code": {"status": ["EXITED"], "return_code": {"set": true, "number": 4},
                          "signal": {"id": {"set": false, "number": 0}, "name": ""}}}]}"#;
        let out = parse_squeue(text).unwrap();
        let job = &out.jobs[0];
        assert_eq!(job.job_state.base(), "FAILED");
        assert_eq!(job.exit_code.as_ref().unwrap().ended(), Ended::Code(4));
    }

    #[test]
    fn the_completion_log_keeps_the_last_run_of_each_job() {
        // `sacct -c --parsable2 --noheader --format=JobID,JobName,State,ExitCode,NodeList` of
        // the test cluster: job 4 exited 85 (re-queued), then was cancelled while pending.
        let text = "1|ongrid-a|COMPLETED|0:0|vm\n4|ongrid-r|FAILED|85:0|vm\n\
                    4|ongrid-r|CANCELLED by 0|85:0|(null)\n3|ongrid-k|FAILED|0:9|vm\n";
        let jobs = parse_sacct(text);
        assert_eq!(jobs.len(), 3);
        let four = jobs.iter().find(|j| j.job_id == "4").unwrap();
        assert_eq!(
            (four.state.as_str(), four.nodes.as_str()),
            ("CANCELLED", "")
        );
        let three = jobs.iter().find(|j| j.job_id == "3").unwrap();
        assert_eq!(three.ended, Ended::Signal(9));
    }

    #[test]
    fn sbatch_answers_and_refusals() {
        assert_eq!(parse_sbatch("42\n").unwrap().as_str(), "42");
        assert_eq!(parse_sbatch("43;cluster\n").unwrap().as_str(), "43");
        assert!(parse_sbatch("Submitted batch job 42").is_err());
        assert_eq!(
            sbatch_refused(
                "sbatch: error: Batch job submission failed: Requested node configuration is \
                 not available\n"
            )
            .as_deref(),
            Some("Requested node configuration is not available")
        );
        assert_eq!(
            sbatch_refused(
                "sbatch: error: Batch job submission failed: Unable to contact slurm controller \
                 (connect failure)\n"
            ),
            None
        );
    }

    #[test]
    fn every_reason_reads_as_words() {
        for reason in [
            "Priority",
            "Resources",
            "QOSMaxGRESPerUser",
            "AssocGrpGRES",
            "PartitionTimeLimit",
            "ReqNodeNotAvail",
            "SomethingNew",
        ] {
            let words = pending_reason(reason).unwrap();
            assert!(words.starts_with("waiting in Slurm: "), "{words}");
            assert!(words.len() > "waiting in Slurm: ".len() + 10, "{words}");
        }
        assert_eq!(pending_reason("None"), None);
        assert!(pending_reason("QOSMaxGRESPerUser")
            .unwrap()
            .contains("quality of service"));
    }
}
