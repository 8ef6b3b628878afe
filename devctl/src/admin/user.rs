//! `devctl admin user ls|rm|restore` (`GET /v1/users`, `DELETE /v1/users/{dn}[?force=true]`,
//! `POST /v1/users/{dn}/restore`): the users the manager knows, removing one (their keys,
//! sessions, queued jobs and images go; their name stays in the audit log) and re-admitting one.

use clap::{Args, Subcommand};
use ongrid_core::api::{UserAction, UserRemoved, UserView};
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
    }
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
