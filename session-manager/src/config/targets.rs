//! The `[targets]` section: the grid batch engines the site hands jobs to, besides its own GPUs
//! (see [`crate::targets`]).
//!
//! ```toml
//! [targets]
//! default = "local"            # where jobs that name no target go
//! poll_interval = "10 seconds" # how often each engine is asked for its jobs' states
//! accounts = [                 # DN or accounting group -> local account (DN rules first)
//!   { dn = "/DC=org/DC=example/CN=Alice Smith", account = "alice" },
//!   { group = "atlas", account = "atlas001" },
//! ]
//!
//! [targets.slurm]
//! image_dir = "/cvmfs/site/ongrid-images"   # the image store as the cluster's nodes see it
//! output_dir = "/scratch/ongrid"            # shared, writable by the accounts (mode 1777)
//! partition = "gpu"
//! slurm_conf = "/etc/slurm/slurm.conf"
//! gpu_types = [ { name = "a100", capability = "8.0", memory = "40G" } ]
//! ```

use std::path::{Path, PathBuf};

use ongrid_core::job::JobTarget;
use ongrid_core::{ComputeCapability, Dn, HumanDuration, MemorySize};
use serde::Deserialize;

use crate::domain::grid_jobs::{AccountMap, AccountMatch, LocalAccount};
use crate::domain::policy::GroupName;
use crate::targets::slurm::script::GpuType;
use crate::targets::{RunAs, SlurmConfig, TargetsConfig, DEFAULT_POLL_INTERVAL};

/// `[targets]` as written.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTargets {
    /// `local` (default), `slurm` or `htcondor`.
    pub default: Option<String>,
    /// Whether the site's own GPUs take batch jobs (default true).
    pub local: Option<bool>,
    pub poll_interval: Option<String>,
    #[serde(default)]
    pub accounts: Vec<RawAccount>,
    pub slurm: Option<RawSlurm>,
    /// Read by the HTCondor target (`targets/htcondor/config.rs`); its keys are checked there.
    pub htcondor: Option<toml::Table>,
}

/// One mapping: exactly one of `dn` and `group`, and the account.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAccount {
    pub dn: Option<String>,
    pub group: Option<String>,
    pub account: String,
}

/// `[targets.slurm]` as written. Command paths default to the names, found on the manager's
/// PATH.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSlurm {
    pub sbatch: Option<PathBuf>,
    pub squeue: Option<PathBuf>,
    pub sacct: Option<PathBuf>,
    pub scancel: Option<PathBuf>,
    pub slurm_conf: Option<PathBuf>,
    pub image_dir: PathBuf,
    pub output_dir: PathBuf,
    pub partition: Option<String>,
    /// Default `apptainer`.
    pub apptainer: Option<String>,
    /// Default `/usr/local/bin:/usr/bin:/bin`.
    pub job_path: Option<String>,
    /// Default "60 seconds".
    pub halt_lead: Option<String>,
    /// `completion_log` (default: `sacct -c`, `JobCompType=jobcomp/filetxt`, no slurmdbd) or
    /// `slurmdbd`.
    pub accounting: Option<String>,
    /// The command prefix that runs `sbatch`/`scancel` as the job's account; `{account}` is
    /// replaced. Default `["runuser", "-u", "{account}", "--"]` (a manager running as root);
    /// `[]` runs them as the manager's own user.
    pub run_as: Option<Vec<String>>,
    #[serde(default)]
    pub extra_options: Vec<String>,
    #[serde(default)]
    pub gpu_types: Vec<RawGpuType>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawGpuType {
    pub name: String,
    pub capability: String,
    pub memory: String,
    pub feature: Option<String>,
}

type Invalid = (String, String);

fn invalid(key: &str, message: impl Into<String>) -> Invalid {
    (format!("targets.{key}"), message.into())
}

/// Validates `[targets]`; `contact` is `[policy] contact`, named in the refusal of a user
/// without a mapping.
pub fn targets(raw: &RawTargets, contact: Option<&str>) -> Result<TargetsConfig, Invalid> {
    let mut rules = Vec::with_capacity(raw.accounts.len());
    for (i, rule) in raw.accounts.iter().enumerate() {
        let key = format!("accounts[{i}]");
        let account = LocalAccount::parse(rule.account.trim()).map_err(|e| invalid(&key, e))?;
        let matcher = match (&rule.dn, &rule.group) {
            (Some(dn), None) => AccountMatch::Dn(
                Dn::parse(dn.trim()).map_err(|e| invalid(&format!("{key}.dn"), e.to_string()))?,
            ),
            (None, Some(group)) => AccountMatch::Group(
                GroupName::parse(group.trim()).map_err(|e| invalid(&format!("{key}.group"), e))?,
            ),
            _ => {
                return Err(invalid(
                    &key,
                    "give exactly one of dn and group, like { dn = \"/DC=org/CN=Alice\", \
                     account = \"alice\" } or { group = \"atlas\", account = \"atlas001\" }",
                ))
            }
        };
        rules.push((matcher, account));
    }
    let poll_interval = match &raw.poll_interval {
        Some(text) => {
            let d = HumanDuration::parse(text)
                .map_err(|e| invalid("poll_interval", e.to_string()))?
                .as_duration();
            if d.is_zero() {
                return Err(invalid("poll_interval", "must be longer than 0 seconds"));
            }
            d
        }
        None => DEFAULT_POLL_INTERVAL,
    };
    let slurm = raw.slurm.as_ref().map(slurm).transpose()?;
    let htcondor = raw
        .htcondor
        .as_ref()
        .map(crate::targets::htcondor::config::validate)
        .transpose()?;
    let config = TargetsConfig {
        default: match &raw.default {
            Some(text) => text
                .parse()
                .map_err(|e: ongrid_core::job::JobSpecError| invalid("default", e.problem))?,
            None => JobTarget::Local,
        },
        local: raw.local.unwrap_or(true),
        poll_interval,
        accounts: AccountMap {
            rules,
            contact: contact.map(str::to_owned),
        },
        slurm,
        htcondor,
    };
    let offered = match config.default {
        JobTarget::Local => config.local,
        JobTarget::Slurm => config.slurm.is_some(),
        JobTarget::Htcondor => config.htcondor.is_some(),
    };
    if !offered {
        return Err(invalid(
            "default",
            format!(
                "{} is not offered: configure [targets.{}] (or local = true), or choose another",
                config.default, config.default
            ),
        ));
    }
    Ok(config)
}

fn absolute(key: &str, path: &Path) -> Result<PathBuf, Invalid> {
    if !path.is_absolute() {
        return Err(invalid(
            key,
            format!("{} must be an absolute path", path.display()),
        ));
    }
    Ok(path.to_owned())
}

fn slurm(raw: &RawSlurm) -> Result<SlurmConfig, Invalid> {
    let command =
        |value: &Option<PathBuf>, name: &str| value.clone().unwrap_or_else(|| PathBuf::from(name));
    let mut gpu_types = Vec::new();
    for (i, t) in raw.gpu_types.iter().enumerate() {
        let key = format!("slurm.gpu_types[{i}]");
        let name_ok = !t.name.is_empty()
            && t.name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.');
        if !name_ok {
            return Err(invalid(
                &format!("{key}.name"),
                format!("{:?} must be gres.conf's Type=, like a100", t.name),
            ));
        }
        gpu_types.push(GpuType {
            name: t.name.clone(),
            capability: ComputeCapability::parse(&t.capability)
                .map_err(|e| invalid(&format!("{key}.capability"), e.to_string()))?,
            memory: MemorySize::parse(&t.memory)
                .map_err(|e| invalid(&format!("{key}.memory"), e.to_string()))?,
            feature: t.feature.clone(),
        });
    }
    let halt_lead = match &raw.halt_lead {
        Some(text) => HumanDuration::parse(text)
            .map_err(|e| invalid("slurm.halt_lead", e.to_string()))?
            .as_duration(),
        None => std::time::Duration::from_secs(60),
    };
    if halt_lead.as_secs() == 0 || halt_lead.as_secs() > 65_535 {
        return Err(invalid(
            "slurm.halt_lead",
            "must be 1 second to 18 hours (Slurm's --signal lead is at most 65535 seconds)",
        ));
    }
    let completion_log = match raw.accounting.as_deref() {
        None | Some("completion_log") => true,
        Some("slurmdbd") => false,
        Some(other) => {
            return Err(invalid(
                "slurm.accounting",
                format!("{other:?} must be completion_log (sacct -c) or slurmdbd"),
            ))
        }
    };
    for option in &raw.extra_options {
        if !option.starts_with("--") || option.contains('\n') {
            return Err(invalid(
                "slurm.extra_options",
                format!("{option:?} must be one sbatch long option, like --qos=grid"),
            ));
        }
    }
    if let Some(partition) = &raw.partition {
        if partition.is_empty() || partition.contains(|c: char| c.is_whitespace()) {
            return Err(invalid("slurm.partition", "must be a partition name"));
        }
    }
    Ok(SlurmConfig {
        sbatch: command(&raw.sbatch, "sbatch"),
        squeue: command(&raw.squeue, "squeue"),
        sacct: command(&raw.sacct, "sacct"),
        scancel: command(&raw.scancel, "scancel"),
        slurm_conf: raw
            .slurm_conf
            .as_deref()
            .map(|p| absolute("slurm.slurm_conf", p))
            .transpose()?,
        image_dir: absolute("slurm.image_dir", &raw.image_dir)?,
        output_dir: absolute("slurm.output_dir", &raw.output_dir)?,
        partition: raw.partition.clone(),
        apptainer: raw
            .apptainer
            .clone()
            .unwrap_or_else(|| "apptainer".to_owned()),
        job_path: raw
            .job_path
            .clone()
            .unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".to_owned()),
        halt_lead,
        completion_log,
        run_as: raw.run_as.clone().map_or_else(RunAs::runuser, RunAs),
        extra_options: raw.extra_options.clone(),
        gpu_types,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<TargetsConfig, Invalid> {
        let raw: RawTargets = toml::from_str(text).unwrap();
        targets(&raw, Some("gpu@example.org"))
    }

    #[test]
    fn a_slurm_section_with_accounts() {
        let config = parse(
            r#"
            default = "slurm"
            poll_interval = "5 seconds"
            accounts = [
              { dn = "/DC=org/CN=Alice", account = "alice" },
              { group = "atlas", account = "atlas001" },
            ]
            [slurm]
            image_dir = "/images"
            output_dir = "/scratch/ongrid"
            partition = "gpu"
            run_as = []
            gpu_types = [ { name = "a100", capability = "8.0", memory = "40G" } ]
            "#,
        )
        .unwrap();
        assert_eq!(config.default, JobTarget::Slurm);
        assert_eq!(config.accounts.rules.len(), 2);
        let slurm = config.slurm.unwrap();
        assert_eq!(slurm.sbatch, PathBuf::from("sbatch"));
        assert!(slurm.completion_log);
        assert_eq!(slurm.run_as, RunAs(vec![]));
        assert_eq!(slurm.gpu_types[0].name, "a100");
    }

    #[test]
    fn an_htcondor_section() {
        let config = parse(
            "default = \"htcondor\"\n[htcondor]\nimage_dir = \"/images\"\n\
             output_dir = \"/srv/ongrid/htcondor\"\nrun_as = []",
        )
        .unwrap();
        assert_eq!(config.default, JobTarget::Htcondor);
        let htcondor = config.htcondor.unwrap();
        assert_eq!(htcondor.condor_submit, PathBuf::from("condor_submit"));
        assert_eq!(htcondor.run_as, RunAs(vec![]));
        let (key, _) = parse("[htcondor]\nimage_dir = \"/i\"\noutput_dir = \"o\"").unwrap_err();
        assert_eq!(key, "targets.htcondor.output_dir");
    }

    #[test]
    fn mistakes_name_the_key() {
        let cases = [
            ("default = \"slurm\"", "targets.default"),
            (
                "accounts = [ { dn = \"/CN=A\", group = \"g\", account = \"a\" } ]",
                "targets.accounts[0]",
            ),
            (
                "accounts = [ { group = \"g\", account = \"Root User\" } ]",
                "targets.accounts[0]",
            ),
            (
                "[slurm]\nimage_dir = \"images\"\noutput_dir = \"/o\"",
                "targets.slurm.image_dir",
            ),
            (
                "[slurm]\nimage_dir = \"/i\"\noutput_dir = \"/o\"\naccounting = \"db\"",
                "targets.slurm.accounting",
            ),
        ];
        for (text, key) in cases {
            let (got, message) = parse(text).unwrap_err();
            assert_eq!(got, key, "{text}: {message}");
        }
    }
}
