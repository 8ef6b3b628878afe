//! What a grid target needs of the manager's host, checked when the manager starts and by
//! `--check-config`, so that a site admin learns it then, naming the key and the fix, instead
//! of from the first job that fails:
//!
//! - the engine's commands (`sbatch`, `squeue`, `sacct`, `scancel`; `condor_submit`,
//!   `condor_q`, `condor_history`, `condor_rm`, `condor_hold`) and the first word of `run_as`
//!   exist: a path that is an executable file, or a name found on the manager's `PATH`;
//! - `output_dir` is a directory each mapped account can write to (the job's output, and for
//!   HTCondor the job's directory, are written as the account);
//! - `image_dir`, the image store as the engine's nodes see it, is readable and searchable by
//!   each mapped account where this host sees it too (Apptainer reads the SIF as the account).
//!   Where this host does not have it, that is said as a warning: it may be mounted only on the
//!   engine's nodes.
//!
//! The accounts' access is tested by running `test` through the target's own `run_as` prefix,
//! as the engine's commands are run: what the kernel decides (modes, ACLs, every parent
//! directory), not a reading of mode bits.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::{RunAs, TargetsConfig};
use crate::domain::grid_jobs::LocalAccount;

/// What a target needs of this host: its config key, commands, `run_as` and directories.
struct EngineHost<'a> {
    /// `targets.slurm` or `targets.htcondor`.
    key: &'static str,
    /// What to install when a command is missing.
    package: &'static str,
    commands: Vec<(&'static str, &'a Path)>,
    run_as: &'a RunAs,
    image_dir: &'a Path,
    output_dir: &'a Path,
}

/// What is wrong with this host for the configured targets: `Err` with every problem, one per
/// line, each naming its key and the fix; `Ok` with warnings (to log) otherwise.
pub fn check(config: &TargetsConfig) -> Result<Vec<String>, String> {
    let mut accounts: Vec<&LocalAccount> = config
        .accounts
        .rules
        .iter()
        .map(|(_, account)| account)
        .collect();
    accounts.sort_by_key(|a| a.as_str());
    accounts.dedup();
    let mut engines = Vec::new();
    if let Some(slurm) = &config.slurm {
        engines.push(EngineHost {
            key: "targets.slurm",
            package: "the Slurm client commands (Debian: slurm-client)",
            commands: vec![
                ("sbatch", &slurm.sbatch),
                ("squeue", &slurm.squeue),
                ("sacct", &slurm.sacct),
                ("scancel", &slurm.scancel),
            ],
            run_as: &slurm.run_as,
            image_dir: &slurm.image_dir,
            output_dir: &slurm.output_dir,
        });
    }
    if let Some(htcondor) = &config.htcondor {
        engines.push(EngineHost {
            key: "targets.htcondor",
            package: "HTCondor's command-line tools",
            commands: vec![
                ("condor_submit", &htcondor.condor_submit),
                ("condor_q", &htcondor.condor_q),
                ("condor_history", &htcondor.condor_history),
                ("condor_rm", &htcondor.condor_rm),
                ("condor_hold", &htcondor.condor_hold),
            ],
            run_as: &htcondor.run_as,
            image_dir: &htcondor.image_dir,
            output_dir: &htcondor.output_dir,
        });
    }
    let mut problems = Vec::new();
    let mut warnings = Vec::new();
    for engine in &engines {
        engine.check(&accounts, &mut problems, &mut warnings);
    }
    if problems.is_empty() {
        Ok(warnings)
    } else {
        Err(problems.join("\n"))
    }
}

impl EngineHost<'_> {
    fn check(
        &self,
        accounts: &[&LocalAccount],
        problems: &mut Vec<String>,
        warnings: &mut Vec<String>,
    ) {
        let key = self.key;
        for (name, program) in &self.commands {
            if let Err(why) = find_program(program) {
                problems.push(format!(
                    "{key}.{name}: {why}: install {} on the manager's host, or set \
                     {key}.{name} to its path",
                    self.package
                ));
            }
        }
        let run_as_works = match self.run_as.0.first() {
            Some(first) => match find_program(Path::new(first)) {
                Ok(_) => true,
                Err(why) => {
                    problems.push(format!(
                        "{key}.run_as: {why}: install it, or set {key}.run_as to the command \
                         that runs a program as the job's account ([] runs it as the \
                         manager's own user)"
                    ));
                    false
                }
            },
            None => true,
        };
        let output_dir = self.output_dir;
        if !output_dir.is_dir() {
            problems.push(format!(
                "{key}.output_dir: {} is not a directory on this host: create it on storage \
                 the engine's nodes see too, writable by the mapped accounts (for instance \
                 mode 1777: `install -d -m 1777 {}`)",
                output_dir.display(),
                output_dir.display()
            ));
        }
        let image_dir = self.image_dir;
        let sees_images = image_dir.is_dir();
        if !sees_images {
            warnings.push(format!(
                "{key}.image_dir: {} is not a directory on this host, so whether the mapped \
                 accounts can read it is not checked here: the engine's nodes must see the \
                 image store there, readable by the accounts",
                image_dir.display()
            ));
        }
        if !run_as_works {
            return;
        }
        // As whom the engine's commands run: each mapped account, or the manager's own user.
        let runners: Vec<Option<&LocalAccount>> = if self.run_as.0.is_empty() {
            vec![None]
        } else {
            accounts.iter().copied().map(Some).collect()
        };
        for account in runners {
            let who = match account {
                Some(account) => format!("account {account}"),
                None => "the manager's own user (run_as = [])".to_owned(),
            };
            if output_dir.is_dir() {
                match self.may(account, &["-w", "-x"], output_dir) {
                    Ok(true) => {}
                    Ok(false) => problems.push(format!(
                        "{key}.output_dir: {who} cannot write to {}: the job's output is \
                         written as the account; make it writable by the accounts (for \
                         instance `chmod 1777 {}`, or an ACL)",
                        output_dir.display(),
                        output_dir.display()
                    )),
                    Err(why) => problems.push(format!("{key}.run_as: {why}")),
                }
            }
            if !sees_images {
                continue;
            }
            let store = image_dir.join("sha256");
            for dir in [image_dir, store.as_path()] {
                if !dir.is_dir() {
                    continue;
                }
                match self.may(account, &["-r", "-x"], dir) {
                    Ok(true) => {}
                    Ok(false) => problems.push(format!(
                        "{key}.image_dir: {who} cannot read {}: Apptainer reads the job's \
                         image as the account; make the image store readable by the accounts \
                         (for instance `chmod o+rx` on it and its parent directories, or an \
                         ACL)",
                        dir.display()
                    )),
                    Err(why) => problems.push(format!("{key}.run_as: {why}")),
                }
            }
        }
    }

    /// Whether `account` (the manager's own user for `None`) passes `test <flag> dir` for every
    /// flag, run through `run_as`; `Err` when the command itself could not run as the account.
    fn may(
        &self,
        account: Option<&LocalAccount>,
        flags: &[&str],
        dir: &Path,
    ) -> Result<bool, String> {
        let mut args = Vec::new();
        for flag in flags {
            if !args.is_empty() {
                args.push("-a".to_owned());
            }
            args.push((*flag).to_owned());
            args.push(dir.display().to_string());
        }
        let argv = match account {
            Some(account) => self.run_as.argv(account, Path::new("test"), &args),
            None => std::iter::once("test".to_owned()).chain(args).collect(),
        };
        let (program, rest) = argv.split_first().expect("argv holds at least `test`");
        let out = Command::new(program)
            .args(rest)
            .output()
            .map_err(|e| format!("cannot run {program}: {e}"))?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stderr = stderr.trim();
        match out.status.code() {
            Some(0) => Ok(true),
            // `test` answers false with exit 1 and no words; `run_as` failing says why.
            Some(1) if stderr.is_empty() => Ok(false),
            _ => Err(format!(
                "running `{}` failed ({}): {}: check the account exists on this host and that \
                 run_as can switch to it (the default, runuser, needs the manager to run as \
                 root)",
                argv.join(" "),
                out.status,
                if stderr.is_empty() {
                    "no output"
                } else {
                    stderr
                }
            )),
        }
    }
}

/// The executable `program` names: a path (with a `/`) to an executable file, or a name found
/// on `PATH`, as the engine's commands are run.
fn find_program(program: &Path) -> Result<PathBuf, String> {
    which::which(program).map_err(|_| {
        if program.components().count() > 1 {
            format!("{} is not an executable file", program.display())
        } else {
            format!(
                "`{}` is not on the manager's PATH ({})",
                program.display(),
                std::env::var("PATH").unwrap_or_default()
            )
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn programs_are_found_by_path_or_on_the_path() {
        assert!(find_program(Path::new("sh")).is_ok());
        assert!(find_program(Path::new("/bin/sh")).is_ok());
        let missing = find_program(Path::new("ongrid-no-such-program")).unwrap_err();
        assert!(
            missing.starts_with("`ongrid-no-such-program` is not on the manager's PATH"),
            "{missing}"
        );
        let not_executable = find_program(Path::new("/etc/passwd")).unwrap_err();
        assert_eq!(not_executable, "/etc/passwd is not an executable file");
    }
}
