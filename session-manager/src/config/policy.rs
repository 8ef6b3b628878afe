//! The `[policy]` section: who may use the site (see [`crate::domain::policy::admission`]).
//!
//! ```toml
//! [policy]
//! contact = "gpu-support@example.org"
//! admit = [
//!   { dn = "/DC=org/DC=example/CN=Carol Staff", group = "staff" },
//!   { fqan = "/cms/Role=gpu", group = "cms-gpu" },
//!   { vo = "atlas" },
//! ]
//! ```

use ongrid_core::Dn;
use ongrid_x509::voms::Fqan;
use serde::Deserialize;

use crate::domain::policy::{Admission, AdmitRule, GroupName, Principal};

/// `[policy]` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPolicy {
    /// Whom a refused user should ask (an address or a web page), named in the 403.
    #[serde(default)]
    pub contact: Option<String>,
    /// Who may create sessions and jobs; the first matching entry gives the accounting group.
    #[serde(default)]
    pub admit: Vec<RawAdmitRule>,
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
    let Some(raw) = raw else {
        return Ok(Admission::open());
    };
    if raw.admit.is_empty() {
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
    let mut rules = Vec::with_capacity(raw.admit.len());
    for (index, entry) in raw.admit.iter().enumerate() {
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
