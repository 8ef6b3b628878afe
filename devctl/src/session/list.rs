//! `devctl session ls` (`GET /v1/sessions[?all=true]`): one row per session.

use clap::Args;
use ongrid_core::api::SessionView;

use super::view::describe_state;
use crate::client::Client;
use crate::format::{format_time, or_dash};
use crate::table::Table;
use crate::terminal::{JsonArgs, Terminal};

#[derive(Debug, Clone, Args)]
pub struct LsArgs {
    /// Everybody's sessions (admins only)
    #[arg(long)]
    pub all: bool,
    #[command(flatten)]
    pub output: JsonArgs,
}

pub async fn run(args: LsArgs, client: &Client, term: &mut Terminal<'_>) -> anyhow::Result<()> {
    let sessions: Vec<SessionView> = client.get("v1/sessions").all(args.all).send().await?;
    let width = term.width;
    term.show(args.output.json, &sessions, |sessions| {
        render(sessions, args.all, width)
    })
}

/// The table of `devctl session ls`; with `all`, each session's owner too. Wrapped to `width`
/// (the terminal's) when given: owners and reasons wrap, the rest stays whole.
pub fn render(sessions: &[SessionView], all: bool, width: Option<u16>) -> String {
    if sessions.is_empty() {
        return "no sessions: start one with devctl session new\n".to_owned();
    }
    let mut headers = vec!["NAME", "STATE", "NODE", "GPUS", "CREATED"];
    if all {
        headers.push("OWNER");
    }
    headers.push("REASON");
    let mut table = Table::new(&headers);
    table.keep_whole(&[0, 1, 2, 3, 4]);
    for s in sessions {
        let mut row = vec![
            s.name.to_string(),
            describe_state(s),
            or_dash(s.node.as_ref().map(ToString::to_string)),
            s.request.count.to_string(),
            format_time(s.created_at),
        ];
        if all {
            row.push(s.owner.to_string());
        }
        row.push(s.reason.clone());
        table.row(row);
    }
    table.render(width, "")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::fixtures::session;
    use ongrid_core::SessionState;

    #[test]
    fn session_list_has_owner_only_for_all() {
        let sessions = [
            session("train1", SessionState::Waiting),
            session("dev", SessionState::Held),
        ];
        assert_eq!(
            render(&sessions, false, None),
            "NAME    STATE    NODE   GPUS  CREATED               REASON
train1  WAITING  node1  1     2026-11-21 10:00:03Z  placed on node1
dev     HELD     node1  1     2026-11-21 10:00:03Z  placed on node1
"
        );
        let all = render(&sessions, true, None);
        assert!(all.lines().next().unwrap().contains("  OWNER  "), "{all}");
        assert!(all.contains("/DC=org/DC=example/CN=Alice Smith"), "{all}");
        assert_eq!(
            render(&[], false, None),
            "no sessions: start one with devctl session new\n"
        );
    }

    #[test]
    fn a_narrow_terminal_wraps_owner_and_reason() {
        let sessions = [session("train1", SessionState::Waiting)];
        let text = render(&sessions, true, Some(80));
        assert!(text.lines().all(|l| l.chars().count() <= 80), "{text}");
        assert!(
            text.contains("train1  WAITING  node1  1     2026-11-21 10:00:03Z  "),
            "{text}"
        );
    }
}
