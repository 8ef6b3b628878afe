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
use std::time::Duration;

use ongrid_core::{Dn, HumanDuration};
use ongrid_x509::voms::Fqan;
use serde::Deserialize;

use crate::domain::policy::fairshare::{FairShareConfig, DEFAULT_HALF_LIFE};
use crate::domain::policy::limits::{LengthClasses, LengthScope, Limit, LimitsConfig};
use crate::domain::policy::{Admission, AdmitRule, GroupName, Principal};
use crate::domain::sessions::holds::LONGEST;

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
///
/// [limits.length_classes]   # CHTC's classes; every key is optional
/// short = "12 hours"
/// medium = "24 hours"
/// long = "7 days"
/// medium_max_fraction = 0.33
/// long_max_gpus = 4
/// per = "user"
/// ```
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLimits {
    #[serde(default)]
    pub user: Limit,
    #[serde(default)]
    pub group: Limit,
    #[serde(default)]
    pub groups: BTreeMap<String, Limit>,
    /// Limits by how long work may hold its GPUs; left out: none. A key left out is CHTC's.
    #[serde(default)]
    pub length_classes: Option<RawLengthClasses>,
}

/// `[limits.length_classes]` as written.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLengthClasses {
    /// The longest short work: no cap (default "12 hours").
    pub short: Option<String>,
    /// The longest medium work (default "24 hours").
    pub medium: Option<String>,
    /// The longest work the site takes (default "7 days").
    pub long: Option<String>,
    /// Of the site's GPUs, the most that work longer than `short` holds (default 1/3).
    pub medium_max_fraction: Option<f64>,
    /// The most GPUs work longer than `medium` holds (default 4).
    pub long_max_gpus: Option<u32>,
    /// Whose work each maximum counts: "user" (default), "group" or "site".
    pub per: Option<String>,
}

/// Validates `[limits]`: `Err((key, message))`.
pub fn limits(raw: &RawLimits) -> Result<LimitsConfig, (String, String)> {
    let mut groups = BTreeMap::new();
    for (group, limit) in &raw.groups {
        let name = GroupName::parse(group).map_err(|e| (format!("limits.groups.{group}"), e))?;
        groups.insert(name, *limit);
    }
    Ok(LimitsConfig {
        user: raw.user,
        group: raw.group,
        groups,
        length_classes: raw
            .length_classes
            .as_ref()
            .map(length_classes)
            .transpose()?,
    })
}

/// Validates `[limits.length_classes]`: every key left out is CHTC's.
fn length_classes(raw: &RawLengthClasses) -> Result<LengthClasses, (String, String)> {
    let chtc = LengthClasses::CHTC;
    let duration = |name: &str, text: &Option<String>, default: Duration| {
        let key = format!("limits.length_classes.{name}");
        let Some(text) = text else {
            return Ok(default);
        };
        let duration = HumanDuration::parse(text)
            .map_err(|e| (key.clone(), e.to_string()))?
            .as_duration();
        if duration.is_zero() || duration > LONGEST {
            return Err((
                key,
                format!(
                    "{text} must be longer than nothing and at most 100 years, like \"12 hours\""
                ),
            ));
        }
        Ok(duration)
    };
    let short = duration("short", &raw.short, chtc.short)?;
    let medium = duration("medium", &raw.medium, chtc.medium)?;
    let long = duration("long", &raw.long, chtc.long)?;
    if !(short < medium && medium < long) {
        return Err((
            "limits.length_classes".to_owned(),
            format!(
                "short ({}), medium ({}) and long ({}) must each be longer than the one before",
                HumanDuration(short),
                HumanDuration(medium),
                HumanDuration(long)
            ),
        ));
    }
    let medium_max_fraction = raw.medium_max_fraction.unwrap_or(chtc.medium_max_fraction);
    if !(medium_max_fraction > 0.0 && medium_max_fraction <= 1.0) {
        return Err((
            "limits.length_classes.medium_max_fraction".to_owned(),
            format!(
                "{medium_max_fraction} must be a fraction of the site's GPUs above 0 and at most \
                 1, like 0.33"
            ),
        ));
    }
    let long_max_gpus = raw.long_max_gpus.unwrap_or(chtc.long_max_gpus);
    if long_max_gpus == 0 {
        return Err((
            "limits.length_classes.long_max_gpus".to_owned(),
            "must be at least 1: to take no work longer than medium, set long just above medium"
                .to_owned(),
        ));
    }
    let per = match raw.per.as_deref() {
        None => chtc.per,
        Some(text) => LengthScope::parse(text).ok_or_else(|| {
            (
                "limits.length_classes.per".to_owned(),
                format!("{text:?} must be \"user\", \"group\" or \"site\""),
            )
        })?,
    };
    Ok(LengthClasses {
        short,
        medium,
        long,
        medium_max_fraction,
        long_max_gpus,
        per,
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

    /// The section `name` of a config file's `text`, as the file's loader reads it.
    fn section<T: serde::de::DeserializeOwned>(text: &str, name: &str) -> T {
        let mut file: toml::Table = toml::from_str(text).unwrap();
        file.remove(name).unwrap().try_into().unwrap()
    }

    fn parse(text: &str) -> Result<Admission, (String, String)> {
        admission(Some(&section(text, "policy")))
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
        let parse = |text: &str| fair_share(&section(text, "fairshare"));
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
        let parse = |text: &str| limits(&section(text, "limits"));
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
    fn length_classes_are_off_unless_set_and_chtcs_for_keys_left_out() {
        let parse = |text: &str| limits(&section(text, "limits"));
        let none = parse("[limits]\nuser = { max_gpus = 4 }\n").unwrap();
        assert_eq!(none.length_classes, None);
        let chtc = parse("[limits.length_classes]\n").unwrap();
        assert_eq!(chtc.length_classes, Some(LengthClasses::CHTC));
        let site = parse(
            "[limits.length_classes]\nshort = \"4 hours\"\nmedium = \"2 days\"\n\
             long = \"14 days\"\nmedium_max_fraction = 0.5\nlong_max_gpus = 8\n\
             per = \"group\"\n",
        )
        .unwrap()
        .length_classes
        .unwrap();
        assert_eq!(site.short, Duration::from_secs(4 * 3600));
        assert_eq!(site.medium, Duration::from_secs(2 * 86_400));
        assert_eq!(site.long, Duration::from_secs(14 * 86_400));
        assert_eq!(site.medium_max_fraction, 0.5);
        assert_eq!(site.long_max_gpus, 8);
        assert_eq!(site.per, LengthScope::Group);
        let key = |text: &str| parse(text).unwrap_err().0;
        assert_eq!(
            key("[limits.length_classes]\nmedium = \"8 hours\"\n"),
            "limits.length_classes"
        );
        assert_eq!(
            key("[limits.length_classes]\nmedium_max_fraction = 1.5\n"),
            "limits.length_classes.medium_max_fraction"
        );
        assert_eq!(
            key("[limits.length_classes]\nlong_max_gpus = 0\n"),
            "limits.length_classes.long_max_gpus"
        );
        assert_eq!(
            key("[limits.length_classes]\nper = \"node\"\n"),
            "limits.length_classes.per"
        );
        assert_eq!(
            key("[limits.length_classes]\nshort = \"soon\"\n"),
            "limits.length_classes.short"
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
