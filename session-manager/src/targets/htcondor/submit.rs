//! The HTCondor submit description of one job: a pure function of the job, the account it runs
//! under and the site's settings ([`render`]).
//!
//! The job runs in HTCondor's container universe on the frozen image's SIF, as HTCondor finds
//! it on its execute nodes (`[targets.htcondor] image_dir`, e.g. the shared image store;
//! `transfer_container = false`). What the description says, and why:
//!
//! - `executable` + `arguments` are the job's argv, in HTCondor's new argument syntax (the
//!   whole in double quotes, arguments with white space or `'` in single quotes, `'` and `"`
//!   doubled); `transfer_executable = false`, as the program is inside the image.
//! - `environment` (new syntax, the same quoting) is the spec's variables and the restart
//!   chain's `ONGRID_JOB_ID`, `ONGRID_RESTART_COUNT`, `ONGRID_RESTART_INITIAL_JOB_ID`.
//! - `request_gpus`, `gpus_minimum_capability` and `gpus_minimum_memory` (MiB, as HTCondor's
//!   `GlobalMemoryMb`), from which HTCondor writes `RequireGPUs`; `request_cpus` (whole CPUs,
//!   rounded up), `request_memory` (MiB, rounded up; HTCondor's default when the spec has
//!   none), `request_disk` (KiB, the site's setting).
//! - `container_target_dir = /ongrid/work`: the job's scratch directory is where a local job
//!   finds its working directory. A checkpoint exit (85) is HTCondor's own
//!   (`checkpoint_exit_code`): it transfers `/ongrid/work/checkpoint` to the submit side
//!   (`transfer_checkpoint_files`) and starts the job again with it, under the same job.
//! - Halting is `kill_sig = SIGUSR1` with `job_max_vacate_time` = the halt grace, so a job
//!   that HTCondor holds, evicts or halts gets SIGUSR1 and 15 s, as on the local target.
//! - maxDuration is `allowed_job_duration` (HTCondor holds the job past it, hold code 46);
//!   minDuration is `max_job_retirement_time` (HTCondor lets the job run that long after its
//!   machine wants it back; the machine's own `MAXJOBRETIREMENTTIME` caps it).
//! - A job that is not restartable is removed, not run again, when HTCondor evicted it
//!   (`periodic_remove` on an idle job that has started before).
//! - `initialdir` is the job's own directory on the submit side (`<output_dir>/ongrid-<id>/`):
//!   stdout and stderr together in `job.out` (HTCondor brings it back when the job ends),
//!   HTCondor's event log in `job.log`, and what the job left in its working directory.
//! - `+OngridJobId` and `batch_name` (`ongrid-<id>`) name the ongrid job in the queue and in
//!   the history, so a job whose submission answer was lost is found again.
//! - The site's `extra_lines` come last, before `queue`.
//!
//! Every value is written so that HTCondor reads back exactly the text given: `$` is written
//! `$(DOLLAR)` where HTCondor would take it for a macro, and what cannot be written on one
//! line of a submit description (a line break) or would be expanded when the job is matched
//! (`$$(`) is refused with an error saying so.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use ongrid_core::job::{JobId, HALT_GRACE, HALT_SIGNAL, WORK_DIR_IN_CONTAINER};
use ongrid_core::MemorySize;

use crate::targets::{engine_job_name, TargetJob};

/// The exit code that asks HTCondor to transfer the checkpoint and start the job again.
pub const CHECKPOINT_EXIT_CODE: i32 = ongrid_core::job::CHECKPOINT_EXIT_CODE;

/// The directory, relative to the job's working directory (`/ongrid/work`), that HTCondor
/// carries from one start of the job to the next after a checkpoint exit.
pub const CHECKPOINT_DIR: &str = "checkpoint";

/// The ClassAd attribute that names the ongrid job in HTCondor's queue and history.
pub const JOB_ID_ATTRIBUTE: &str = "OngridJobId";
const JOB_ID_ATTRIBUTE_LINE: &str = "+OngridJobId";

/// A job that is not restartable is removed when it waits again after it started (HTCondor
/// evicted it), instead of being run again.
pub const NOT_RESTARTABLE_REMOVE: &str = "JobStatus == 1 && NumJobStarts > 0";

/// The site's settings that go into every description (`[targets.htcondor]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubmitSite {
    /// On the submit side: each job's directory `<output_dir>/ongrid-<job id>/` is its
    /// `initialdir`, where HTCondor writes its output (`job.out`, stdout and stderr together),
    /// its event log (`job.log`) and the files the job leaves in its working directory.
    pub output_dir: PathBuf,
    /// `request_disk`: the scratch space every job asks for.
    pub request_disk: MemorySize,
    /// Lines the site wants in every description (`+AccountingGroup = "grid"`), written as
    /// they are, before `queue`.
    pub extra_lines: Vec<String>,
}

impl SubmitSite {
    /// The submit-side directory of one job (its `initialdir`).
    pub fn job_dir(&self, job: JobId) -> PathBuf {
        self.output_dir.join(engine_job_name(job))
    }
}

/// The file, in a job's directory, that holds its stdout and stderr.
pub const OUTPUT_FILE: &str = "job.out";
/// The file, in a job's directory, that holds HTCondor's event log of the job.
pub const EVENT_LOG_FILE: &str = "job.log";

/// Why a job cannot be written as a submit description.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error(
        "{what} contains a line break, which an HTCondor submit description cannot carry: \
         pass multi-line text in a file inside the image, or submit with --to local"
    )]
    LineBreak { what: String },
    #[error(
        "{what} contains \"$$(\", which HTCondor replaces when it matches the job to a machine: \
         write it another way (e.g. in a script inside the image), or submit with --to local"
    )]
    MatchMacro { what: String },
    #[error(
        "{what} contains \"$(DOLLAR)\", which HTCondor turns into \"$\" wherever it appears (in \
         any case, however it is quoted): write it another way (e.g. in a script inside the \
         image), or submit with --to local"
    )]
    DollarMacro { what: String },
    #[error(
        "the program {program:?} starts or ends with white space or ends with \\, which an \
         HTCondor submit description cannot carry: name the program plainly"
    )]
    Program { program: String },
    #[error("{what} {path:?} is not valid UTF-8: choose a path HTCondor can be given")]
    Path { what: &'static str, path: PathBuf },
}

/// The submit description of `job` for `site`.
pub fn render(job: &TargetJob, site: &SubmitSite) -> Result<String, SubmitError> {
    let spec = &job.spec;
    let job_dir = site.job_dir(job.id);

    let mut lines: Vec<(&str, String)> = Vec::new();
    let mut push = |key: &'static str, value: String| lines.push((key, value));
    push("universe", "container".into());
    push("container_image", path_value("the image's SIF", &job.sif)?);
    push("transfer_container", "false".into());
    push("container_target_dir", WORK_DIR_IN_CONTAINER.into());
    let program = spec.command.program();
    if program.trim() != program || program.ends_with('\\') {
        return Err(SubmitError::Program {
            program: program.to_owned(),
        });
    }
    push("executable", value("the program", program)?);
    push("transfer_executable", "false".into());
    if !spec.command.args().is_empty() {
        push("arguments", arguments(spec.command.args())?);
    }
    let chain_env = job.chain.env(job.id);
    let env = spec
        .env
        .iter()
        .chain(chain_env.iter().map(|(k, v)| (*k, v.as_str())));
    push("environment", environment(env)?);

    push("request_gpus", spec.gpus.count.to_string());
    if let Some(capability) = spec.gpus.min_capability {
        push("gpus_minimum_capability", capability.to_string());
    }
    if let Some(memory) = spec.gpus.min_memory {
        push("gpus_minimum_memory", mib_up(memory).to_string());
    }
    let cpus = spec.cpus.map_or(1, |c| c.millis().div_ceil(1000));
    push("request_cpus", cpus.to_string());
    if let Some(memory) = spec.memory {
        push("request_memory", mib_up(memory).to_string());
    }
    push(
        "request_disk",
        site.request_disk.bytes().div_ceil(1024).to_string(),
    );

    push("should_transfer_files", "YES".into());
    push("when_to_transfer_output", "ON_EXIT".into());
    push("checkpoint_exit_code", CHECKPOINT_EXIT_CODE.to_string());
    push("transfer_checkpoint_files", CHECKPOINT_DIR.into());
    push("kill_sig", HALT_SIGNAL.into());
    push("job_max_vacate_time", HALT_GRACE.as_secs().to_string());
    if let Some(max) = job.max_duration {
        push(
            "allowed_job_duration",
            max.as_duration().as_secs().to_string(),
        );
    }
    if let Some(min) = spec.min_duration {
        push(
            "max_job_retirement_time",
            min.as_duration().as_secs().to_string(),
        );
    }
    if !spec.restartable {
        push("periodic_remove", NOT_RESTARTABLE_REMOVE.into());
    }

    push("initialdir", path_value("output_dir", &job_dir)?);
    push("output", OUTPUT_FILE.into());
    push("error", OUTPUT_FILE.into());
    push("log", EVENT_LOG_FILE.into());
    push("batch_name", engine_job_name(job.id));
    lines.push((JOB_ID_ATTRIBUTE_LINE, format!("\"{}\"", job.id)));

    let mut text = format!(
        "# ongrid job {} (restart {} of {}) for account {}\n",
        job.id, job.chain.restart_count, job.chain.initial_job, job.account
    );
    for (key, value) in lines {
        let _ = writeln!(text, "{key} = {value}");
    }
    for line in &site.extra_lines {
        let _ = writeln!(text, "{line}");
    }
    text.push_str("queue\n");
    Ok(text)
}

/// Bytes as whole MiB, rounded up (HTCondor's `request_memory` and `GlobalMemoryMb` unit).
fn mib_up(memory: MemorySize) -> u64 {
    memory.bytes().div_ceil(1024 * 1024)
}

fn path_value(what: &'static str, path: &Path) -> Result<String, SubmitError> {
    let text = path.to_str().ok_or_else(|| SubmitError::Path {
        what,
        path: path.to_owned(),
    })?;
    value(what, text)
}

/// A value that HTCondor reads back as `text`: no line break, no `$$(`, no `$(DOLLAR)`, and a
/// `$` that would start a macro (`$(`, `$NAME(`) written `$(DOLLAR)`.
///
/// HTCondor replaces every `$(DOLLAR)` (any case) left after macro expansion by `$`, also one
/// that expansion itself produced (`$(DOLLAR)(DOLLAR)` reads back as `$`), so the literal text
/// has no spelling and is refused.
pub fn value(what: &str, text: &str) -> Result<String, SubmitError> {
    if text.contains(['\n', '\r']) {
        return Err(SubmitError::LineBreak { what: what.into() });
    }
    if text.to_ascii_uppercase().contains("$(DOLLAR)") {
        return Err(SubmitError::DollarMacro { what: what.into() });
    }
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    for (i, c) in text.char_indices() {
        if c != '$' {
            out.push(c);
            continue;
        }
        // What follows the `$`: a name (possibly empty), then `(` makes it a macro.
        let rest = &bytes[i + 1..];
        let name_len = rest
            .iter()
            .take_while(|b| b.is_ascii_alphanumeric() || **b == b'_')
            .count();
        let starts_macro = rest.get(name_len) == Some(&b'(');
        let after_dollar = i > 0 && bytes[i - 1] == b'$';
        if rest.first() == Some(&b'$') || after_dollar {
            // `$$` is HTCondor's match-time expansion when a `(` follows; a run of `$` is
            // kept as it is unless a macro would start inside it.
            let run_end = bytes[i..]
                .iter()
                .position(|b| *b != b'$')
                .map_or(bytes.len(), |n| i + n);
            if bytes.get(run_end) == Some(&b'(') || starts_after_run(bytes, run_end) {
                return Err(SubmitError::MatchMacro { what: what.into() });
            }
            out.push('$');
        } else if starts_macro {
            out.push_str("$(DOLLAR)");
        } else {
            out.push('$');
        }
    }
    Ok(out)
}

/// Whether a `$NAME(` macro starts right after a run of `$` ending at `end`.
fn starts_after_run(bytes: &[u8], end: usize) -> bool {
    let rest = &bytes[end..];
    let name_len = rest
        .iter()
        .take_while(|b| b.is_ascii_alphanumeric() || **b == b'_')
        .count();
    name_len > 0 && rest.get(name_len) == Some(&b'(')
}

/// One argument or environment value in HTCondor's new syntax, inside the outer double quotes:
/// single-quoted when it is empty or holds white space or `'`, `'` doubled inside, `"` doubled
/// everywhere.
fn quoted(what: &str, text: &str) -> Result<String, SubmitError> {
    let text = value(what, text)?;
    let needs_quotes =
        text.is_empty() || text.contains(|c: char| c == '\'' || c.is_ascii_whitespace());
    let body = text.replace('"', "\"\"");
    Ok(if needs_quotes {
        format!("'{}'", body.replace('\'', "''"))
    } else {
        body
    })
}

/// `arguments = "..."` in HTCondor's new syntax.
pub fn arguments(args: &[String]) -> Result<String, SubmitError> {
    let mut parts = Vec::with_capacity(args.len());
    for (n, arg) in args.iter().enumerate() {
        parts.push(quoted(&format!("argument {}", n + 1), arg)?);
    }
    Ok(format!("\"{}\"", parts.join(" ")))
}

/// `environment = "..."` in HTCondor's new syntax.
pub fn environment<'a>(
    vars: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Result<String, SubmitError> {
    let mut parts = Vec::new();
    for (name, val) in vars {
        // Names are `[A-Za-z_][A-Za-z0-9_]*` (JobEnv), so only the value needs quoting.
        parts.push(format!(
            "{name}={}",
            quoted(&format!("the value of {name}"), val)?
        ));
    }
    Ok(format!("\"{}\"", parts.join(" ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_are_quoted_in_the_new_syntax() {
        let args: Vec<String> = ["plain", "two words", "it's", "say \"hi\"", "", "tab\there"]
            .map(String::from)
            .to_vec();
        assert_eq!(
            arguments(&args).unwrap(),
            r#""plain 'two words' 'it''s' 'say ""hi""' '' 'tab	here'""#
        );
    }

    #[test]
    fn dollars_that_would_start_a_macro_are_escaped() {
        assert_eq!(value("x", "$HOME $x a$").unwrap(), "$HOME $x a$");
        assert_eq!(value("x", "$(HOME)").unwrap(), "$(DOLLAR)(HOME)");
        assert_eq!(value("x", "$ENV(HOME)").unwrap(), "$(DOLLAR)ENV(HOME)");
        assert_eq!(value("x", "$$ $$x").unwrap(), "$$ $$x");
        for bad in ["$$(x)", "a$$$(y)", "$$ENV(HOME)"] {
            assert!(
                matches!(value("x", bad), Err(SubmitError::MatchMacro { .. })),
                "{bad}"
            );
        }
        assert!(matches!(
            value("x", "a\nb"),
            Err(SubmitError::LineBreak { .. })
        ));
    }
}
