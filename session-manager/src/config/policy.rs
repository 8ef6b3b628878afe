//! The `[policy]` section: who may use the site (see [`crate::domain::policy::admission`]).
//!
//! ```toml
//! [policy]
//! contact = "gpu-support@example.org"
//! sessions_on_owned_gpus = false
//! admit = [
//!   { dn = "/DC=org/DC=example/CN=Carol Staff", group = "staff" },
//!   { fqan = "/cms/Role=gpu", group = "cms-gpu" },
//!   { vo = "atlas" },
//! ]
//! ```

use std::collections::BTreeMap;

use ongrid_core::{Dn, HumanDuration};
use ongrid_x509::voms::Fqan;
use serde::Deserialize;

use crate::domain::policy::fairshare::{FairShareConfig, DEFAULT_HALF_LIFE};
use crate::domain::policy::limits::{Limit, LimitsConfig};
use crate::domain::policy::{Admission, AdmitRule, GroupName, Principal};

/// `[fairshare]` as written: without it requests are served first come, first served.
///
/// ```toml
/// [fairshare]
/// half_life = "1 day"
/// shares = { atlas = 3, cms = 1 }
/// cost = { A100 = 1.0, H100 = 2.0, T4 = 0.25 }
/// ```
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawFairShare {
    /// Usage counts half after this long (default "1 day").
    #[serde(default)]
    pub half_life: Option<String>,
    /// Relative shares per accounting group; groups not listed have 1.
    #[serde(default)]
    pub shares: BTreeMap<String, u32>,
    /// Cost weight of one GPU-hour per name found in the GPU model (`nvidia-smi` names it, like
    /// `NVIDIA H100 80GB HBM3`); the longest name found wins, no match weighs 1.0.
    #[serde(default)]
    pub cost: BTreeMap<String, f64>,
}

/// `[limits]` as written: the maxima of every user, of every group, and of named groups.
///
/// ```toml
/// [limits]
/// user = { max_gpus = 4, max_sessions = 2 }
/// group = { max_gpus = 16 }
/// groups = { atlas = { max_gpus = 32, max_job_gpus = 24 } }
/// ```
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLimits {
    #[serde(default)]
    pub user: RawLimit,
    #[serde(default)]
    pub group: RawLimit,
    #[serde(default)]
    pub groups: BTreeMap<String, RawLimit>,
}

/// One set of maxima; a key left out is no limit.
#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLimit {
    pub max_gpus: Option<u32>,
    pub max_session_gpus: Option<u32>,
    pub max_job_gpus: Option<u32>,
    pub max_sessions: Option<u32>,
}

impl From<RawLimit> for Limit {
    fn from(raw: RawLimit) -> Self {
        Self {
            max_gpus: raw.max_gpus,
            max_session_gpus: raw.max_session_gpus,
            max_job_gpus: raw.max_job_gpus,
            max_sessions: raw.max_sessions,
        }
    }
}

/// Validates `[limits]`: `Err((key, message))`.
pub fn limits(raw: &RawLimits) -> Result<LimitsConfig, (String, String)> {
    let mut groups = BTreeMap::new();
    for (group, limit) in &raw.groups {
        let name = GroupName::parse(group).map_err(|e| (format!("limits.groups.{group}"), e))?;
        groups.insert(name, Limit::from(*limit));
    }
    Ok(LimitsConfig {
        user: raw.user.into(),
        group: raw.group.into(),
        groups,
    })
}

/// Validates `[fairshare]`: `Err((key, message))`.
pub fn fair_share(raw: &RawFairShare) -> Result<FairShareConfig, (String, String)> {
    let half_life = match &raw.half_life {
        None => DEFAULT_HALF_LIFE,
        Some(text) => {
            let duration = HumanDuration::parse(text)
                .map_err(|e| ("fairshare.half_life".to_owned(), e.to_string()))?
                .as_duration();
            if duration.as_secs() < 60 {
                return Err((
                    "fairshare.half_life".to_owned(),
                    format!("{text} is too short: give at least a minute, like \"1 day\""),
                ));
            }
            duration
        }
    };
    let mut shares = BTreeMap::new();
    for (group, share) in &raw.shares {
        let key = format!("fairshare.shares.{group}");
        let name = GroupName::parse(group).map_err(|e| (key.clone(), e))?;
        if *share == 0 {
            return Err((
                key,
                "must be at least 1: leave the group out of [policy] admit to keep it off the \
                 site"
                    .to_owned(),
            ));
        }
        shares.insert(name, *share);
    }
    let mut cost = Vec::new();
    for (model, weight) in &raw.cost {
        if model.trim().is_empty() || !weight.is_finite() || *weight < 0.0 {
            return Err((
                format!("fairshare.cost.{model}"),
                format!(
                    "{weight} must be a weight of 0 or more for a name in the GPU model, like \
                     H100 = 2.0"
                ),
            ));
        }
        cost.push((model.trim().to_owned(), *weight));
    }
    Ok(FairShareConfig {
        half_life,
        shares,
        cost,
    })
}

/// `[policy]` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPolicy {
    /// Whom a refused user should ask (an address or a web page), named in the 403.
    #[serde(default)]
    pub contact: Option<String>,
    /// Who may create sessions and jobs; the first matching entry gives the accounting group.
    /// Absent: every user of the site's CAs, in group `default`.
    #[serde(default)]
    pub admit: Option<Vec<RawAdmitRule>>,
    /// Whether other groups' sessions may be placed on GPUs an owner group owns (`devctl admin
    /// gpu owner`); default false: only their batch jobs, as backfill halted for owner work.
    #[serde(default)]
    pub sessions_on_owned_gpus: bool,
}

/// One entry of `admit`: exactly one of `vo`, `fqan`, `dn`, and the group (default: the VO's
/// name for `vo` and `fqan`; required for `dn`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAdmitRule {
    #[serde(default)]
    pub vo: Option<String>,
    #[serde(default)]
    pub fqan: Option<String>,
    #[serde(default)]
    pub dn: Option<String>,
    #[serde(default)]
    pub group: Option<String>,
}

/// Validates `[policy]`: `Err((key, message))`; `None` (no section) admits every user of the
/// site's CAs.
pub fn admission(raw: Option<&RawPolicy>) -> Result<Admission, (String, String)> {
    let Some((raw, admit)) = raw.and_then(|raw| Some((raw, raw.admit.as_ref()?))) else {
        return Ok(Admission::open());
    };
    if admit.is_empty() {
        return Err((
            "policy.admit".to_owned(),
            "is empty, so nobody could use the site: list VOs, FQANs or DNs like \
             { vo = \"atlas\" }, or remove [policy] to admit every user of the CAs in ca_dir"
                .to_owned(),
        ));
    }
    let contact = match raw.contact.as_deref().map(str::trim) {
        Some("") => {
            return Err((
                "policy.contact".to_owned(),
                "is empty: name an address or web page, or leave it out".to_owned(),
            ))
        }
        other => other.map(str::to_owned),
    };
    let mut rules = Vec::with_capacity(admit.len());
    for (index, entry) in admit.iter().enumerate() {
        let key = format!("policy.admit[{index}]");
        let invalid = |message: String| (key.clone(), message);
        let (principal, default_group) = match (&entry.vo, &entry.fqan, &entry.dn) {
            (Some(vo), None, None) => {
                let fqan = Fqan::parse(&format!("/{}", vo.trim()))
                    .ok()
                    .filter(|f| f.vo() == vo.trim() && f.role().is_none())
                    .ok_or_else(|| {
                        invalid(format!(
                            "vo {vo:?} must be a VO name like atlas (for groups and roles use fqan)"
                        ))
                    })?;
                (
                    Principal::Vo(fqan.vo().to_owned()),
                    Some(fqan.vo().to_owned()),
                )
            }
            (None, Some(text), None) => {
                let fqan = Fqan::parse(text.trim()).map_err(|e| invalid(e.to_string()))?;
                let vo = fqan.vo().to_owned();
                (Principal::Fqan(fqan), Some(vo))
            }
            (None, None, Some(text)) => {
                let dn = Dn::parse(text.trim()).map_err(|e| invalid(e.to_string()))?;
                (Principal::Dn(dn), None)
            }
            _ => {
                return Err(invalid(
                    "must name exactly one of vo, fqan or dn, like { vo = \"atlas\" }".to_owned(),
                ))
            }
        };
        let group = match (&entry.group, default_group) {
            (Some(group), _) => GroupName::parse(group.trim()).map_err(invalid)?,
            (None, Some(vo)) => GroupName::parse(&vo.to_ascii_lowercase())
                .map_err(|e| invalid(format!("{e}; give this entry a group = \"...\"")))?,
            (None, None) => {
                return Err(invalid(
                    "a dn entry needs group = \"...\": the accounting group of that person"
                        .to_owned(),
                ))
            }
        };
        rules.push(AdmitRule { principal, group });
    }
    Ok(Admission::restricted(rules, contact))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Admission, (String, String)> {
        #[derive(Deserialize)]
        struct File {
            policy: RawPolicy,
        }
        let file: File = toml::from_str(text).unwrap();
        admission(Some(&file.policy))
    }

    #[test]
    fn rules_get_their_vo_as_group_unless_they_name_one() {
        let admitted_site = parse(
            "[policy]\ncontact = \"gpu@example.org\"\nadmit = [\n\
             { dn = \"/DC=org/CN=Carol\", group = \"staff\" },\n\
             { fqan = \"/cms/Role=gpu\", group = \"cms-gpu\" },\n{ vo = \"atlas\" },\n]\n",
        )
        .unwrap();
        let admitted = admitted_site
            .admit(
                &Dn::parse("/DC=org/CN=Alice").unwrap(),
                &[Fqan::parse("/atlas").unwrap()],
                false,
            )
            .unwrap();
        assert_eq!(admitted.group.as_str(), "atlas");
        assert!(!admitted_site.is_open());
        assert!(admission(None).unwrap().is_open());
    }

    #[test]
    fn fair_share_reads_half_life_shares_and_costs() {
        #[derive(Deserialize)]
        struct File {
            fairshare: RawFairShare,
        }
        let parse = |text: &str| {
            let file: File = toml::from_str(text).unwrap();
            fair_share(&file.fairshare)
        };
        let config = parse(
            "[fairshare]\nhalf_life = \"2 days\"\nshares = { atlas = 3, cms = 1 }\n\
             cost = { H100 = 2.0, T4 = 0.25 }\n",
        )
        .unwrap();
        assert_eq!(config.half_life.as_secs(), 2 * 86_400);
        assert_eq!(config.share(&GroupName::parse("atlas").unwrap()), 3);
        assert_eq!(config.share(&GroupName::parse("lhcb").unwrap()), 1);
        assert_eq!(config.weight("NVIDIA H100 80GB HBM3"), 2.0);
        assert_eq!(parse("[fairshare]\n").unwrap().half_life, DEFAULT_HALF_LIFE);
        assert_eq!(
            parse("[fairshare]\nshares = { atlas = 0 }\n")
                .unwrap_err()
                .0,
            "fairshare.shares.atlas"
        );
        assert_eq!(
            parse("[fairshare]\ncost = { H100 = -1.0 }\n")
                .unwrap_err()
                .0,
            "fairshare.cost.H100"
        );
        assert_eq!(
            parse("[fairshare]\nhalf_life = \"10s\"\n").unwrap_err().0,
            "fairshare.half_life"
        );
    }

    #[test]
    fn limits_read_user_group_and_named_groups() {
        #[derive(Deserialize)]
        struct File {
            limits: RawLimits,
        }
        let parse = |text: &str| {
            let file: File = toml::from_str(text).unwrap();
            limits(&file.limits)
        };
        let config = parse(
            "[limits]\nuser = { max_gpus = 4, max_sessions = 2 }\ngroup = { max_gpus = 16 }\n\
             groups = { atlas = { max_job_gpus = 24 } }\n",
        )
        .unwrap();
        assert_eq!(config.user.max_gpus, Some(4));
        assert_eq!(config.user.max_sessions, Some(2));
        assert_eq!(config.group.max_gpus, Some(16));
        let atlas = config.groups[&GroupName::parse("atlas").unwrap()];
        assert_eq!((atlas.max_job_gpus, atlas.max_gpus), (Some(24), None));
        assert_eq!(
            parse("[limits]\ngroups = { Atlas = { max_gpus = 1 } }\n")
                .unwrap_err()
                .0,
            "limits.groups.Atlas"
        );
    }

    #[test]
    fn mistakes_name_the_entry_and_the_fix() {
        let err = |text: &str| parse(text).unwrap_err();
        assert_eq!(err("[policy]\nadmit = []\n").0, "policy.admit");
        let (key, message) = err("[policy]\nadmit = [{ vo = \"atlas\", dn = \"/O=x\" }]\n");
        assert_eq!(key, "policy.admit[0]");
        assert!(
            message.contains("exactly one of vo, fqan or dn"),
            "{message}"
        );
        let (_, message) = err("[policy]\nadmit = [{ dn = \"/O=x\" }]\n");
        assert!(message.contains("needs group"), "{message}");
        let (_, message) = err("[policy]\nadmit = [{ vo = \"atlas/Role=x\" }]\n");
        assert!(message.contains("use fqan"), "{message}");
        let (_, message) = err("[policy]\nadmit = [{ fqan = \"cms\" }]\n");
        assert!(message.contains("must start with /<vo>"), "{message}");
        let (_, message) = err("[policy]\nadmit = [{ vo = \"atlas\", group = \"Atlas\" }]\n");
        assert!(message.contains("lower-case"), "{message}");
    }
}
