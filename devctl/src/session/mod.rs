//! `devctl session ...`: ask for a development session, follow it, change it, remove it.
//!
//! - [`new`]: `session new`, with `--wait` waiting (on the manager's side) until the session runs.
//! - [`list`]: `session ls`.
//! - [`view`]: `session show`, and how a session is described everywhere (state, request).
//! - [`change`]: `session rm|hold|release|keep`.
//! - [`web`]: `session web`, a login link to the session's JupyterLab or a port, opened in a
//!   browser.

pub mod change;
#[cfg(test)]
mod fixtures;
pub mod list;
pub mod new;
pub mod view;
pub mod web;

use clap::Subcommand;

use crate::client::Client;
use crate::terminal::Terminal;

#[derive(Debug, Subcommand)]
pub enum SessionCommand {
    /// Ask for a new session on GPUs that meet your requirements
    ///
    /// The session is queued (PENDING) until a matching GPU is free, then started. A request
    /// that no GPU in the site could ever satisfy is refused, naming the requirement.
    New(new::NewArgs),
    /// List your sessions
    #[command(alias = "list")]
    Ls(list::LsArgs),
    /// Show a session: state, node, GPUs, and every transition with its reason
    Show(view::ShowArgs),
    /// Remove a session: its container is stopped and removed, its GPUs freed
    #[command(alias = "remove")]
    Rm(change::RmArgs),
    /// Put a session on hold: its container stops, its GPUs are freed for others, its files
    /// (the container's and your home directory) are kept until `devctl session release`
    Hold(change::HoldArgs),
    /// Bring a HELD session back: it restarts in the same container on the same node as soon as
    /// a fitting GPU is free there, and waits PENDING (with its queue position) until then
    Release(change::ReleaseArgs),
    /// Keep a session from being held as idle (or for want of a connection) for a while, e.g.
    /// while a job runs with its output going nowhere; the site caps how long
    Keep(change::KeepArgs),
    /// Open a running session's JupyterLab, or a web server you started in it (--port), in your
    /// browser
    ///
    /// Prints a dashboard login link that leads there (it works once, for a few minutes) and
    /// opens it with $BROWSER, or with xdg-open where there is a display (never a text browser
    /// in the terminal). A browser logged in to the dashboard already can open the app's own
    /// address, printed below the link, directly.
    Web(web::WebArgs),
}

pub async fn run(
    command: SessionCommand,
    client: &Client,
    term: &mut Terminal<'_>,
) -> anyhow::Result<()> {
    match command {
        SessionCommand::New(args) => new::run(args, client, term).await,
        SessionCommand::Ls(args) => list::run(args, client, term).await,
        SessionCommand::Show(args) => view::run(args, client, term).await,
        SessionCommand::Rm(args) => change::remove(args, client, term).await,
        SessionCommand::Hold(args) => change::hold(args, client, term).await,
        SessionCommand::Release(args) => change::release(args, client, term).await,
        SessionCommand::Keep(args) => change::keep(args, client, term).await,
        SessionCommand::Web(args) => web::run(args, client, term).await,
    }
}
