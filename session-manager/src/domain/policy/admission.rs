//! Who may create sessions and jobs, and the accounting group their use counts against.
//!
//! The `[policy] admit` rules name VOs (`vo = "atlas"`: any verified FQAN of that VO), FQAN
//! patterns (`fqan = "/cms/Role=gpu"`, matched as [`Fqan::matches`] does: that group, and the
//! role when the pattern names one) and DNs. The first rule that matches gives the accounting
//! group, so a DN rule placed first maps a person to a group whatever their VOs. Without a
//! `[policy]` section the site admits every user of the CAs in `ca_dir`, in group `default`:
//! the CAs already decide who holds a certificate, and a site that trusts the IGTF bundle
//! should name its VOs. Admins are always admitted (they must be able to fix the policy's
//! effects); with no rule of theirs matching, their group is `admins`.

use std::fmt;

use ongrid_core::Dn;
use ongrid_x509::voms::Fqan;

use crate::domain::Refusal;

/// Whether `value` is 1 to `max_len` lower-case letters, digits, `-`, `_` and `.`, starting with
/// a letter or digit: the names of groups and reservations.
pub(super) fn is_policy_name(value: &str, max_len: usize) -> bool {
    !value.is_empty()
        && value.len() <= max_len
        && value
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && value.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'_' | b'.')
        })
}

/// An accounting group: lower-case letters, digits, `-`, `_` and `.`, 1 to 32 characters,
/// starting with a letter or digit.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GroupName(String);

impl GroupName {
    pub fn parse(value: &str) -> Result<Self, String> {
        if is_policy_name(value, 32) {
            Ok(Self(value.to_owned()))
        } else {
            Err(format!(
                "group name {value:?} must be 1 to 32 lower-case letters, digits, '-', '_' or \
                 '.', starting with a letter or digit, like atlas or cms-gpu"
            ))
        }
    }

    /// The group of users admitted by the default policy (no `[policy]` section).
    pub fn default_group() -> Self {
        Self("default".to_owned())
    }

    /// The group of admins no rule matches.
    pub fn admins() -> Self {
        Self("admins".to_owned())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::str::FromStr for GroupName {
    type Err = String;

    fn from_str(value: &str) -> Result<Self, String> {
        Self::parse(value)
    }
}

impl fmt::Display for GroupName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Whom one rule admits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Principal {
    /// Any holder of a verified FQAN of this VO.
    Vo(String),
    /// Holders of a verified FQAN matching this pattern.
    Fqan(Fqan),
    /// The holder of this certificate (or of proxies of it).
    Dn(Dn),
}

impl Principal {
    fn matches(&self, dn: &Dn, fqans: &[Fqan]) -> bool {
        match self {
            Self::Vo(vo) => fqans.iter().any(|fqan| fqan.vo() == vo),
            Self::Fqan(pattern) => fqans.iter().any(|fqan| fqan.matches(pattern)),
            Self::Dn(listed) => listed == dn,
        }
    }
}

impl fmt::Display for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Vo(vo) => write!(f, "VO {vo}"),
            Self::Fqan(fqan) => write!(f, "FQAN {fqan}"),
            Self::Dn(dn) => write!(f, "DN {dn}"),
        }
    }
}

/// One `[[policy.admit]]` entry: whom it admits and the group their use counts against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdmitRule {
    pub principal: Principal,
    pub group: GroupName,
}

/// The validated `[policy]` admission rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admission {
    /// `None`: no `[policy]` section, every user of the site's CAs is admitted.
    rules: Option<Vec<AdmitRule>>,
    /// Whom to ask to be admitted, like an e-mail address or a web page.
    contact: Option<String>,
}

impl Default for Admission {
    fn default() -> Self {
        Self::open()
    }
}

/// That a caller is admitted: their accounting group and the rule that said so.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admitted {
    pub group: GroupName,
    /// The rule, as people read it: `VO atlas`, `DN /DC=...`, `admin`, or `any user of the
    /// site's CAs`.
    pub rule: String,
}

impl Admission {
    /// No `[policy]` section: every user of the site's CAs, in group `default`.
    pub fn open() -> Self {
        Self {
            rules: None,
            contact: None,
        }
    }

    /// The site admits only whom `rules` name (first match gives the group); `contact` is
    /// named in every refusal.
    pub fn restricted(rules: Vec<AdmitRule>, contact: Option<String>) -> Self {
        Self {
            rules: Some(rules),
            contact,
        }
    }

    pub fn is_open(&self) -> bool {
        self.rules.is_none()
    }

    /// Whether the holder of `dn` with the verified `fqans` may use the site, and their
    /// accounting group; `admin`: listed in the config's `admins`. The refusal (403) names
    /// what the site admits, what the credential showed, and whom to ask.
    pub fn admit(&self, dn: &Dn, fqans: &[Fqan], admin: bool) -> Result<Admitted, Refusal> {
        self.admit_showing(dn, fqans, admin, Shown::Voms)
    }

    /// [`Admission::admit`] of a bearer token's user, whose `groups` (`wlcg.groups`) count as
    /// FQANs; the refusal speaks of token groups.
    pub fn admit_token(&self, dn: &Dn, groups: &[Fqan], admin: bool) -> Result<Admitted, Refusal> {
        self.admit_showing(dn, groups, admin, Shown::TokenGroups)
    }

    fn admit_showing(
        &self,
        dn: &Dn,
        fqans: &[Fqan],
        admin: bool,
        shown: Shown,
    ) -> Result<Admitted, Refusal> {
        let Some(rules) = &self.rules else {
            return Ok(Admitted {
                group: GroupName::default_group(),
                rule: "any user the site authenticates".to_owned(),
            });
        };
        if let Some(rule) = rules.iter().find(|rule| rule.principal.matches(dn, fqans)) {
            return Ok(Admitted {
                group: rule.group.clone(),
                rule: rule.principal.to_string(),
            });
        }
        if admin {
            return Ok(Admitted {
                group: GroupName::admins(),
                rule: "admin".to_owned(),
            });
        }
        Err(Refusal::Forbidden(self.refusal(dn, fqans, rules, shown)))
    }

    fn refusal(&self, dn: &Dn, fqans: &[Fqan], rules: &[AdmitRule], kind: Shown) -> String {
        let mut vos: Vec<&str> = Vec::new();
        let mut patterns: Vec<String> = Vec::new();
        for rule in rules {
            match &rule.principal {
                Principal::Vo(vo) if !vos.contains(&vo.as_str()) => vos.push(vo),
                Principal::Fqan(fqan) => patterns.push(fqan.to_string()),
                _ => {}
            }
        }
        let mut needs = Vec::new();
        if !vos.is_empty() {
            needs.push(format!("membership of VO {}", vos.join(", ")));
        }
        if !patterns.is_empty() {
            let what = match kind {
                Shown::Voms => "the VOMS attribute",
                Shown::TokenGroups => "the group",
            };
            needs.push(format!("{what} {}", patterns.join(", ")));
        }
        let shown = if fqans.is_empty() {
            match kind {
                Shown::Voms => "no VOMS attributes".to_owned(),
                Shown::TokenGroups => "no groups".to_owned(),
            }
        } else {
            fqans
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut message = format!("this site does not admit {dn} (your credential shows {shown})");
        if needs.is_empty() {
            message.push_str(": it admits listed people only");
        } else {
            message.push_str(&format!(": it needs {}", needs.join(" or ")));
            match (kind, vos.first()) {
                (Shown::Voms, Some(vo)) => message.push_str(&format!(
                    "; if you are a member, make a proxy with voms-proxy-init --voms {vo}"
                )),
                (Shown::TokenGroups, _) => message.push_str(
                    "; if you are a member, ask your token issuer for a token with that group \
                     (oidc-token --scope wlcg.groups ACCOUNT)",
                ),
                (Shown::Voms, None) => {}
            }
        }
        match &self.contact {
            Some(contact) => message.push_str(&format!("; to be admitted, ask {contact}")),
            None => message.push_str("; to be admitted, ask the site's admins"),
        }
        message
    }
}

/// What the credential showed to be admitted by: VOMS attributes, or a token's groups.
#[derive(Debug, Clone, Copy)]
enum Shown {
    Voms,
    TokenGroups,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dn(s: &str) -> Dn {
        Dn::parse(s).unwrap()
    }

    fn fqan(s: &str) -> Fqan {
        Fqan::parse(s).unwrap()
    }

    fn rule(principal: Principal, group: &str) -> AdmitRule {
        AdmitRule {
            principal,
            group: GroupName::parse(group).unwrap(),
        }
    }

    fn site() -> Admission {
        Admission::restricted(
            vec![
                rule(
                    Principal::Dn(dn("/DC=org/DC=example/CN=Carol Staff")),
                    "staff",
                ),
                rule(Principal::Fqan(fqan("/cms/Role=gpu")), "cms-gpu"),
                rule(Principal::Vo("atlas".into()), "atlas"),
            ],
            Some("gpu-support@example.org".into()),
        )
    }

    const ALICE: &str = "/DC=org/DC=example/CN=Alice Smith";

    #[test]
    fn without_a_policy_every_user_of_the_cas_is_admitted_in_group_default() {
        let admitted = Admission::open().admit(&dn(ALICE), &[], false).unwrap();
        assert_eq!(admitted.group.as_str(), "default");
        assert_eq!(admitted.rule, "any user the site authenticates");
    }

    #[test]
    fn the_first_matching_rule_gives_the_group() {
        let site = site();
        let atlas = site
            .admit(
                &dn(ALICE),
                &[fqan("/atlas/Role=NULL/Capability=NULL")],
                false,
            )
            .unwrap();
        assert_eq!(atlas.group.as_str(), "atlas");
        assert_eq!(atlas.rule, "VO atlas");
        // A subgroup's FQAN is still of the VO.
        let sub = site
            .admit(&dn(ALICE), &[fqan("/atlas/higgs")], false)
            .unwrap();
        assert_eq!(sub.group.as_str(), "atlas");
        // The role rule comes before the VO rule of atlas; a DN rule before both.
        let cms = site
            .admit(&dn(ALICE), &[fqan("/atlas"), fqan("/cms/Role=gpu")], false)
            .unwrap();
        assert_eq!(cms.group.as_str(), "cms-gpu");
        let carol = site
            .admit(
                &dn("/DC=org/DC=example/CN=Carol Staff"),
                &[fqan("/atlas")],
                false,
            )
            .unwrap();
        assert_eq!(carol.group.as_str(), "staff");
    }

    #[test]
    fn a_credential_matching_no_rule_is_refused_with_what_is_needed_and_whom_to_ask() {
        let site = site();
        // /cms without the gpu role matches neither the role rule nor any VO rule.
        let Err(Refusal::Forbidden(message)) = site.admit(&dn(ALICE), &[fqan("/cms")], false)
        else {
            panic!("refused with 403");
        };
        assert_eq!(
            message,
            "this site does not admit /DC=org/DC=example/CN=Alice Smith (your credential shows \
             /cms): it needs membership of VO atlas or the VOMS attribute /cms/Role=gpu; if you \
             are a member, make a proxy with voms-proxy-init --voms atlas; to be admitted, ask \
             gpu-support@example.org"
        );
        let Err(Refusal::Forbidden(message)) = Admission::restricted(
            vec![rule(Principal::Dn(dn("/DC=org/CN=Someone")), "staff")],
            None,
        )
        .admit(&dn(ALICE), &[], false) else {
            panic!("refused with 403");
        };
        assert!(message.contains("shows no VOMS attributes"), "{message}");
        assert!(
            message
                .ends_with("it admits listed people only; to be admitted, ask the site's admins"),
            "{message}"
        );
    }

    #[test]
    fn admins_are_admitted_by_their_rule_or_else_in_group_admins() {
        let site = site();
        let admin = site.admit(&dn(ALICE), &[], true).unwrap();
        assert_eq!(admin.group.as_str(), "admins");
        let admin_in_atlas = site.admit(&dn(ALICE), &[fqan("/atlas")], true).unwrap();
        assert_eq!(admin_in_atlas.group.as_str(), "atlas");
    }

    #[test]
    fn group_names_are_short_lower_case_words() {
        for good in ["atlas", "cms-gpu", "a.b_c", "0x"] {
            assert!(GroupName::parse(good).is_ok(), "{good}");
        }
        for bad in ["", "Atlas", "-x", "a b", &"x".repeat(33)] {
            assert!(GroupName::parse(bad).is_err(), "{bad}");
        }
    }
}
