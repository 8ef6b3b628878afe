//! `devctl whoami`: who the manager takes the caller for (`GET /v1/whoami`): DN, login, uid,
//! admin, and (from managers that say) whether the site admits them and in which accounting group,
//! and the credential: its kind, VOs and FQANs, time left; for a bearer token, where devctl found
//! it and the issuer, subject, groups and scopes the manager read from it. A caller the site
//! does not admit gets the manager's 403, which says what is needed.

use chrono::{DateTime, Utc};
use ongrid_core::api::{CredentialKind, WhoAmI};

use crate::client::Client;
use crate::format::{format_time, time_left};
use crate::table::Table;
use crate::terminal::{JsonArgs, Terminal};

pub async fn run(args: JsonArgs, client: &Client, term: &mut Terminal<'_>) -> anyhow::Result<()> {
    let me: WhoAmI = client.get("v1/whoami").send().await?;
    let token_source = client.context().token_source.as_deref();
    term.show(args.json, &me, |me| render(me, token_source, Utc::now()))
}

/// The text of `devctl whoami` as of `now`; `token_source` is where devctl found the bearer
/// token it sent, if it sent one.
pub fn render(me: &WhoAmI, token_source: Option<&str>, now: DateTime<Utc>) -> String {
    let mut table = Table::bare();
    table.field("dn", me.dn.to_string());
    table.field("login", me.user_name.to_string());
    table.field("uid", me.uid.to_string());
    table.field("admin", if me.admin { "yes" } else { "no" });
    if let Some(group) = &me.group {
        let site = match &me.admitted_by {
            Some(rule) => format!("admitted ({rule})"),
            None => "admitted".to_owned(),
        };
        table.field("site", site);
        table.field("group", group.clone());
    }
    if let Some(kind) = me.credential {
        let list = |items: &[String]| {
            if items.is_empty() {
                "-".to_owned()
            } else {
                items.join(", ")
            }
        };
        match (kind, token_source) {
            (CredentialKind::Token, Some(source)) => {
                table.field("credential", format!("{kind} ({source})"));
            }
            _ => table.field("credential", kind.to_string()),
        }
        if kind == CredentialKind::Token {
            if let Some(token) = &me.token {
                table.field("issuer", token.issuer.clone());
                table.field("subject", token.subject.clone());
                table.field("groups", list(&token.groups));
                table.field("scopes", list(&token.scopes));
            }
        } else {
            table.field("vo", list(&me.vos));
            table.field("fqans", list(&me.fqans));
        }
        if let Some(not_after) = me.not_after {
            table.field(
                "time left",
                format!(
                    "{} (until {})",
                    time_left(not_after, now),
                    format_time(not_after)
                ),
            );
        }
    }
    table.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ongrid_core::api::TokenInfo;
    use ongrid_core::{Dn, UserName};

    fn at(secs: i64) -> DateTime<Utc> {
        // 2026-11-21 10:00:00Z
        DateTime::from_timestamp(1_795_255_200 + secs, 0).unwrap()
    }

    #[test]
    fn whoami_is_a_short_list() {
        let me = WhoAmI {
            dn: Dn::parse("/DC=org/DC=example/CN=Alice Smith").unwrap(),
            user_name: UserName::parse("alice-smith").unwrap(),
            uid: 20000,
            admin: false,
            credential: None,
            vos: Vec::new(),
            fqans: Vec::new(),
            not_after: None,
            group: None,
            admitted_by: None,
            token: None,
        };
        assert_eq!(
            render(&me, None, at(0)),
            "dn:     /DC=org/DC=example/CN=Alice Smith\nlogin:  alice-smith\nuid:    20000\nadmin:  no\n"
        );
        let proxy = WhoAmI {
            credential: Some(CredentialKind::Impersonation),
            vos: vec!["myvo".into()],
            fqans: vec![
                "/myvo/Role=NULL/Capability=NULL".into(),
                "/myvo/prod/Role=production/Capability=NULL".into(),
            ],
            not_after: Some(at(12 * 3600 - 61)),
            ..me.clone()
        };
        assert_eq!(
            render(&proxy, None, at(0)),
            "dn:          /DC=org/DC=example/CN=Alice Smith\n\
             login:       alice-smith\n\
             uid:         20000\n\
             admin:       no\n\
             credential:  impersonation proxy\n\
             vo:          myvo\n\
             fqans:       /myvo/Role=NULL/Capability=NULL, /myvo/prod/Role=production/Capability=NULL\n\
             time left:   11h 58m (until 2026-11-21 21:58:59Z)\n"
        );
        let admitted = WhoAmI {
            group: Some("atlas".into()),
            admitted_by: Some("VO atlas".into()),
            token: None,
            ..me.clone()
        };
        assert!(
            render(&admitted, None, at(0))
                .ends_with("admin:  no\nsite:   admitted (VO atlas)\ngroup:  atlas\n"),
            "{}",
            render(&admitted, None, at(0))
        );
        let plain = WhoAmI {
            credential: Some(CredentialKind::EndEntity),
            not_after: Some(at(-1)),
            ..me
        };
        let text = render(&plain, None, at(0));
        assert!(
            text.contains("credential:  end-entity certificate\nvo:          -\nfqans:       -\n"),
            "{text}"
        );
        assert!(
            text.ends_with("time left:   expired (until 2026-11-21 09:59:59Z)\n"),
            "{text}"
        );
    }

    /// With a bearer token: where devctl found it, and what the manager read from it, in place
    /// of VOs and FQANs.
    #[test]
    fn whoami_with_a_token_names_its_source_and_claims() {
        let me = WhoAmI {
            dn: Dn::parse("/DC=org/DC=example/CN=Alice Smith").unwrap(),
            user_name: UserName::parse("alice-smith").unwrap(),
            uid: 20000,
            admin: false,
            credential: Some(CredentialKind::Token),
            vos: Vec::new(),
            fqans: Vec::new(),
            not_after: Some(at(3599)),
            group: Some("cms".into()),
            admitted_by: Some("group /cms".into()),
            token: Some(TokenInfo {
                issuer: "https://iam.test.invalid/".into(),
                subject: "e1eb758b-b73c-4761-bfff-adc793da409c".into(),
                groups: vec!["/cms".into(), "/cms/uscms".into()],
                scopes: vec!["compute.create".into(), "compute.read".into()],
            }),
        };
        assert_eq!(
            render(
                &me,
                Some("BEARER_TOKEN_FILE /run/user/1000/bt_u1000"),
                at(0)
            ),
            "dn:          /DC=org/DC=example/CN=Alice Smith\n\
             login:       alice-smith\n\
             uid:         20000\n\
             admin:       no\n\
             site:        admitted (group /cms)\n\
             group:       cms\n\
             credential:  bearer token (BEARER_TOKEN_FILE /run/user/1000/bt_u1000)\n\
             issuer:      https://iam.test.invalid/\n\
             subject:     e1eb758b-b73c-4761-bfff-adc793da409c\n\
             groups:      /cms, /cms/uscms\n\
             scopes:      compute.create, compute.read\n\
             time left:   59m 59s (until 2026-11-21 10:59:59Z)\n"
        );
        let no_groups = WhoAmI {
            token: Some(TokenInfo {
                groups: Vec::new(),
                scopes: Vec::new(),
                ..me.token.clone().unwrap()
            }),
            ..me.clone()
        };
        let text = render(&no_groups, None, at(0));
        assert!(
            text.contains("credential:  bearer token\nissuer:      https://iam.test.invalid/\nsubject:     e1eb758b-b73c-4761-bfff-adc793da409c\ngroups:      -\nscopes:      -\n"),
            "{text}"
        );
    }
}
