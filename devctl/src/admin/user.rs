//! `devctl admin user ls|rm|restore` (`GET /v1/users`, `DELETE /v1/users/{dn}[?force=true]`,
//! `POST /v1/users/{dn}/restore`): the users the manager knows, removing one (their keys,
//! sessions, queued jobs and images go; their name stays in the audit log) and re-admitting one.
//! `devctl admin user link|unlink|links` (`PUT|GET /v1/token-links`, `DELETE
//! /v1/token-links/{issuer}/{subject}`): a bearer token identity (issuer and subject) acting as
//! the user of a DN.

use clap::{Args, Subcommand};
use ongrid_core::api::{LinkToken, TokenLinkView, UserAction, UserRemoved, UserView};
use ongrid_core::Dn;

use crate::client::{path_segment, Client};
use crate::format::format_time;
use crate::table::Table;
use crate::terminal::{JsonArgs, Terminal};

#[derive(Debug, Subcommand)]
pub enum UserCommand {
    /// List the users the manager knows (everyone who connected once), removed ones included
    #[command(alias = "list")]
    Ls(JsonArgs),
    /// Remove a user: their SSH keys at once, their sessions, queued jobs and frozen images;
    /// the audit log keeps their name. Refused while they have a session that has not ended
    /// or a running job, unless --force
    #[command(alias = "remove")]
    Rm(UserRmArgs),
    /// Re-admit a removed user: they may use ongrid again with their certificate (what was
    /// removed stays removed)
    Restore(UserDnArgs),
    /// Let a person's bearer tokens act as the user of their certificate's DN (same login,
    /// sessions, keys and images); the user must have used the site with the certificate once
    Link(LinkArgs),
    /// Undo `link`: the tokens act as a user of their own again
    Unlink(UnlinkArgs),
    /// List the token identities linked to users
    Links(JsonArgs),
}

#[derive(Debug, Clone, Args)]
pub struct LinkArgs {
    /// The token issuer: its name in the manager's [[token_issuers]] or its URL
    #[arg(long)]
    pub issuer: String,
    /// The subject (sub claim) of the person's tokens; `devctl whoami` run with the token shows it
    #[arg(long)]
    pub subject: String,
    /// The user's certificate subject DN, as `devctl admin user ls` shows it
    pub dn: Dn,
    #[command(flatten)]
    pub output: JsonArgs,
}

#[derive(Debug, Clone, Args)]
pub struct UnlinkArgs {
    /// The token issuer: its name in the manager's [[token_issuers]] or its URL
    #[arg(long)]
    pub issuer: String,
    /// The subject (sub claim) of the linked tokens
    #[arg(long)]
    pub subject: String,
    #[command(flatten)]
    pub output: JsonArgs,
}

#[derive(Debug, Clone, Args)]
pub struct UserRmArgs {
    /// The user's certificate subject DN, like "/DC=org/DC=example/CN=Alice Smith"
    pub dn: Dn,
    /// End their sessions and cancel their running jobs too
    #[arg(long)]
    pub force: bool,
    #[command(flatten)]
    pub output: JsonArgs,
}

#[derive(Debug, Clone, Args)]
pub struct UserDnArgs {
    /// The user's certificate subject DN, as `devctl admin user ls` shows it
    pub dn: Dn,
    #[command(flatten)]
    pub output: JsonArgs,
}

pub async fn run(
    command: UserCommand,
    client: &Client,
    term: &mut Terminal<'_>,
) -> anyhow::Result<()> {
    match command {
        UserCommand::Ls(output) => {
            let users: Vec<UserView> = client.get("v1/users").send().await?;
            let width = term.width;
            term.show(output.json, &users, |users| render_users(users, width))
        }
        UserCommand::Rm(UserRmArgs { dn, force, output }) => {
            let path = format!("v1/users/{}", path_segment(dn.as_str()));
            let mut request = client.delete(&path);
            if force {
                request = request.query(&[("force", "true")]);
            }
            let removed: UserRemoved = request.send().await?;
            term.show(output.json, &removed, render_removed)
        }
        UserCommand::Restore(UserDnArgs { dn, output }) => {
            let path = format!("v1/users/{}/restore", path_segment(dn.as_str()));
            let user: UserView = client.post(&path).send().await?;
            term.show(output.json, &user, render_restored)
        }
        UserCommand::Link(LinkArgs {
            issuer,
            subject,
            dn,
            output,
        }) => {
            let body = LinkToken {
                issuer,
                subject,
                dn,
            };
            let link: TokenLinkView = client.put("v1/token-links").json(&body).send().await?;
            term.show(output.json, &link, |link| {
                format!(
                    "tokens of {} at {} now act as {}\n",
                    link.subject, link.issuer, link.dn
                )
            })
        }
        UserCommand::Unlink(UnlinkArgs {
            issuer,
            subject,
            output,
        }) => {
            let path = format!(
                "v1/token-links/{}/{}",
                path_segment(&issuer),
                path_segment(&subject)
            );
            let link: TokenLinkView = client.delete(&path).send().await?;
            term.show(output.json, &link, |link| {
                format!(
                    "tokens of {} at {} no longer act as {}\n",
                    link.subject, link.issuer, link.dn
                )
            })
        }
        UserCommand::Links(output) => {
            let links: Vec<TokenLinkView> = client.get("v1/token-links").send().await?;
            let width = term.width;
            term.show(output.json, &links, |links| render_links(links, width))
        }
    }
}

/// `devctl admin user links`.
pub fn render_links(links: &[TokenLinkView], width: Option<u16>) -> String {
    if links.is_empty() {
        return "no token identity is linked to a user (devctl admin user link)\n".to_owned();
    }
    let mut table = Table::new(&["ISSUER", "SUBJECT", "DN", "LINKED"]);
    for link in links {
        table.row([
            link.issuer_name
                .clone()
                .unwrap_or_else(|| link.issuer.clone()),
            link.subject.clone(),
            link.dn.to_string(),
            format_time(link.linked_at),
        ]);
    }
    table.render(width, "")
}

fn list_or_none(items: &[String]) -> String {
    if items.is_empty() {
        "-".to_owned()
    } else {
        items.join(", ")
    }
}

/// `devctl admin user rm`.
pub fn render_removed(removed: &UserRemoved) -> String {
    let user = &removed.user;
    let mut table = Table::bare();
    table.field("keys deleted", list_or_none(&removed.keys));
    let sessions: Vec<String> = removed.sessions.iter().map(ToString::to_string).collect();
    table.field("sessions ended", list_or_none(&sessions));
    let jobs: Vec<String> = removed.jobs.iter().map(ToString::to_string).collect();
    table.field("jobs cancelled", list_or_none(&jobs));
    table.field("images removed", list_or_none(&removed.images));
    format!(
        "user {} removed ({}); the audit log keeps their name\n{table}\
         their open SSH connections close within seconds; `devctl admin user restore '{}'` \
         re-admits them\n",
        user.user_name, user.dn, user.dn
    )
}

/// `devctl admin user restore`.
pub fn render_restored(user: &UserView) -> String {
    format!(
        "user {} restored ({}): they may use ongrid again with their certificate; their keys, \
         sessions and images stay removed\n",
        user.user_name, user.dn
    )
}

/// `devctl admin user ls`: one line per user, then what admins did to each.
pub fn render_users(users: &[UserView], width: Option<u16>) -> String {
    if users.is_empty() {
        return "no users: the manager adds one the first time someone connects\n".to_owned();
    }
    let mut table = Table::new(&["USER", "UID", "STATE", "DN"]);
    for user in users {
        let state = match (&user.removed_at, &user.removed_by) {
            (Some(at), Some(by)) => format!("removed {} by {by}", format_time(*at)),
            _ => "active".to_owned(),
        };
        table.row([
            user.user_name.to_string(),
            user.uid.to_string(),
            state,
            user.dn.to_string(),
        ]);
    }
    table.keep_whole(&[0, 1]);
    let mut out = table.render(width, "");
    for user in users {
        for event in &user.events {
            let action = match event.action {
                UserAction::Removed => "removed",
                UserAction::Restored => "restored",
            };
            out.push_str(&format!(
                "{}: {action} {} by {}: {}\n",
                user.user_name,
                format_time(event.at),
                event.by,
                event.details
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use chrono::{DateTime, Utc};
    use ongrid_core::api::UserEvent;
    use ongrid_core::UserName;

    use super::*;

    fn at(text: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(text).unwrap().into()
    }

    fn user(removed: bool) -> UserView {
        let admin = Dn::parse("/CN=Admin").unwrap();
        UserView {
            dn: Dn::parse("/DC=org/CN=Alice Smith").unwrap(),
            user_name: UserName::parse("alice-smith").unwrap(),
            uid: 20_001,
            removed_at: removed.then(|| at("2026-11-21T10:00:00Z")),
            removed_by: removed.then(|| admin.clone()),
            events: if removed {
                vec![UserEvent {
                    at: at("2026-11-21T10:00:00Z"),
                    action: UserAction::Removed,
                    by: admin,
                    details: "1 key(s) deleted".to_owned(),
                }]
            } else {
                Vec::new()
            },
        }
    }

    #[test]
    fn links_name_the_issuer_by_its_config_name() {
        let link = TokenLinkView {
            issuer: "https://iam.test.invalid/".to_owned(),
            issuer_name: Some("iam".to_owned()),
            subject: "e1eb758b".to_owned(),
            dn: Dn::parse("/DC=org/CN=Alice Smith").unwrap(),
            linked_at: at("2026-12-02T10:00:00Z"),
        };
        assert_eq!(
            render_links(&[link], None),
            "ISSUER  SUBJECT   DN                      LINKED\n\
             iam     e1eb758b  /DC=org/CN=Alice Smith  2026-12-02 10:00:00Z\n"
        );
        assert!(render_links(&[], None).starts_with("no token identity"));
    }

    #[test]
    fn users_show_whether_and_when_they_were_removed() {
        assert_eq!(
            render_users(&[user(true)], None),
            "USER         UID    STATE                                      DN\n\
             alice-smith  20001  removed 2026-11-21 10:00:00Z by /CN=Admin  /DC=org/CN=Alice Smith\n\
             alice-smith: removed 2026-11-21 10:00:00Z by /CN=Admin: 1 key(s) deleted\n"
        );
        assert!(render_users(&[user(false)], None).contains("  active  "));
        assert!(render_users(&[], None).starts_with("no users"));
    }

    #[test]
    fn a_removal_lists_what_went() {
        let removed = UserRemoved {
            user: user(true),
            keys: vec!["SHA256:abc".to_owned()],
            sessions: vec!["train1".parse().unwrap()],
            jobs: Vec::new(),
            images: vec!["mymodel:v1".to_owned()],
        };
        assert_eq!(
            render_removed(&removed),
            "user alice-smith removed (/DC=org/CN=Alice Smith); the audit log keeps their name\n\
             keys deleted:    SHA256:abc\n\
             sessions ended:  train1\n\
             jobs cancelled:  -\n\
             images removed:  mymodel:v1\n\
             their open SSH connections close within seconds; `devctl admin user restore \
             '/DC=org/CN=Alice Smith'` re-admits them\n"
        );
        assert!(render_restored(&user(false)).starts_with("user alice-smith restored ("));
    }

    #[test]
    fn dns_are_one_path_segment() {
        assert_eq!(
            path_segment("/DC=org/CN=Alice Smith"),
            "%2FDC%3Dorg%2FCN%3DAlice%20Smith"
        );
    }
}
