//! `[targets.htcondor]` of the manager's config: read here, into [`HtcondorConfig`].
//!
//! ```toml
//! [targets.htcondor]
//! image_dir = "/cvmfs/site/ongrid-images"  # the image store as HTCondor's execute nodes see it
//! output_dir = "/srv/ongrid/htcondor"      # jobs' initialdirs: seen by the manager and the schedd
//! request_disk = "20G"                     # scratch space per job (default 20G)
//! condor_submit = "/usr/bin/condor_submit" # each tool defaults to its name on the manager's PATH
//! run_as = ["runuser", "-u", "{account}", "--"]   # the default; [] runs them as the manager
//! extra_lines = ['+AccountingGroup = "group_grid"']
//! ```

use std::path::{Path, PathBuf};

use ongrid_core::MemorySize;
use serde::Deserialize;

use crate::targets::{HtcondorConfig, RunAs};

/// `[targets.htcondor]` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawHtcondor {
    pub condor_submit: Option<PathBuf>,
    pub condor_q: Option<PathBuf>,
    pub condor_history: Option<PathBuf>,
    pub condor_rm: Option<PathBuf>,
    pub condor_hold: Option<PathBuf>,
    pub image_dir: PathBuf,
    pub output_dir: PathBuf,
    /// Default [`DEFAULT_REQUEST_DISK`].
    pub request_disk: Option<String>,
    /// The command prefix that runs `condor_submit`, `condor_rm` and `condor_hold` (and the
    /// `mkdir` of a job's directory) as the job's account; `{account}` is replaced. Default
    /// `["runuser", "-u", "{account}", "--"]` (a manager running as root); `[]` runs them as the
    /// manager's own user.
    pub run_as: Option<Vec<String>>,
    #[serde(default)]
    pub extra_lines: Vec<String>,
}

/// The scratch space a job asks for unless `request_disk` says otherwise.
pub const DEFAULT_REQUEST_DISK: &str = "20G";

/// A key of `[targets.htcondor]` and what is wrong with it.
pub type Invalid = (String, String);

fn invalid(key: &str, message: impl Into<String>) -> Invalid {
    (format!("targets.htcondor.{key}"), message.into())
}

/// Validates `[targets.htcondor]`.
pub fn validate(table: &toml::Table) -> Result<HtcondorConfig, Invalid> {
    let raw: RawHtcondor = table
        .clone()
        .try_into()
        .map_err(|e: toml::de::Error| (String::from("targets.htcondor"), e.message().to_owned()))?;
    let command =
        |value: &Option<PathBuf>, name: &str| value.clone().unwrap_or_else(|| PathBuf::from(name));
    let request_disk =
        MemorySize::parse(raw.request_disk.as_deref().unwrap_or(DEFAULT_REQUEST_DISK))
            .map_err(|e| invalid("request_disk", e.to_string()))?;
    if request_disk.bytes() < 1024 * 1024 {
        return Err(invalid("request_disk", "must be at least 1M, like 20G"));
    }
    for line in &raw.extra_lines {
        let first = line.split_whitespace().next().unwrap_or_default();
        if line.contains(['\n', '\r']) || !line.contains('=') || first.eq_ignore_ascii_case("queue")
        {
            return Err(invalid(
                "extra_lines",
                format!(
                    "{line:?} must be one submit-description line with `=`, like \
                     +AccountingGroup = \"group_grid\" (ongrid writes `queue` itself)"
                ),
            ));
        }
    }
    Ok(HtcondorConfig {
        condor_submit: command(&raw.condor_submit, "condor_submit"),
        condor_q: command(&raw.condor_q, "condor_q"),
        condor_history: command(&raw.condor_history, "condor_history"),
        condor_rm: command(&raw.condor_rm, "condor_rm"),
        condor_hold: command(&raw.condor_hold, "condor_hold"),
        image_dir: absolute("image_dir", &raw.image_dir)?,
        output_dir: absolute("output_dir", &raw.output_dir)?,
        request_disk,
        run_as: raw.run_as.clone().map_or_else(RunAs::runuser, RunAs),
        extra_lines: raw.extra_lines.clone(),
    })
}

fn absolute(key: &str, path: &Path) -> Result<PathBuf, Invalid> {
    if !path.is_absolute() || path.to_str().is_none() {
        return Err(invalid(
            key,
            format!("{} must be an absolute UTF-8 path", path.display()),
        ));
    }
    Ok(path.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<HtcondorConfig, Invalid> {
        validate(&toml::from_str(text).unwrap())
    }

    #[test]
    fn defaults_and_paths() {
        let config = parse(
            r#"
            image_dir = "/cvmfs/site/ongrid-images"
            output_dir = "/srv/ongrid/htcondor"
            condor_submit = "/opt/condor/bin/condor_submit"
            extra_lines = ['+AccountingGroup = "group_grid"']
            "#,
        )
        .unwrap();
        assert_eq!(
            config.condor_submit,
            PathBuf::from("/opt/condor/bin/condor_submit")
        );
        assert_eq!(config.condor_q, PathBuf::from("condor_q"));
        assert_eq!(config.request_disk, MemorySize::parse("20G").unwrap());
        assert_eq!(config.run_as, RunAs::runuser());
        assert_eq!(config.extra_lines.len(), 1);
    }

    #[test]
    fn mistakes_name_the_key() {
        let base = "image_dir = \"/i\"\noutput_dir = \"/o\"\n";
        let cases = [
            (
                "image_dir = \"i\"\noutput_dir = \"/o\"",
                "targets.htcondor.image_dir",
            ),
            (
                &format!("{base}request_disk = \"lots\"") as &str,
                "targets.htcondor.request_disk",
            ),
            (
                &format!("{base}extra_lines = [\"queue 10\"]"),
                "targets.htcondor.extra_lines",
            ),
            (
                &format!("{base}extra_lines = [\"a = 1\\nqueue\"]"),
                "targets.htcondor.extra_lines",
            ),
            (&format!("{base}condor_sumbit = \"/x\""), "targets.htcondor"),
            ("image_dir = \"/i\"", "targets.htcondor"),
        ];
        for (text, key) in cases {
            let (got, message) = parse(text).unwrap_err();
            assert_eq!(got, key, "{text}: {message}");
        }
    }
}
