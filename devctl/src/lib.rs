//! devctl, the command line of ongrid for users and admins.
//!
//! It talks to the manager's HTTPS API (`ongrid_core::api`), presenting the user's grid
//! certificate or proxy as the TLS client certificate, or sending the user's bearer token
//! (WLCG, SciTokens) when it finds one. The code is laid out by feature: each
//! command family's arguments, API calls and text output live together.
//!
//! - [`cli`]: the global flags and the [`cli::Command`]s, each handed to its module.
//! - [`whoami`], [`session`], [`gpu`], [`key`], [`image`], [`share`], [`admin`], [`dashboard`]:
//!   the commands.
//! - [`config`]: flags, environment and `~/.config/ongrid/devctl.toml` resolved into
//!   [`config::Settings`]; [`origin`]: where each setting came from.
//! - [`credentials`]: the certificate, key and CA directory turned into a rustls configuration.
//! - [`token`]: the bearer token, read and checked (not verified: the manager does) before it
//!   is sent.
//! - [`client`]: the HTTPS client, and every failure mapped to one line that names the fix.
//! - [`pubkey`]: the SSH public key file `key add` registers, checked before it is sent.
//! - [`permissions`]: the private key, proxy and config file refused while others may read them.
//! - [`terminal`]: where results (stdout) and notes (stderr) go, text or `--json`.
//! - [`table`] and [`format`]: tables fitted to the terminal, times and sizes for people.
//! - [`manual`]: shell completions and man pages, generated from the clap definition.
//!
//! `main.rs` parses the arguments and calls [`run`]; an error is printed as one line,
//! `error: ...`, with exit code 1 (clap's usage errors exit with 2).

pub mod admin;
pub mod cli;
pub mod client;
pub mod config;
pub mod credentials;
pub mod dashboard;
pub mod format;
pub mod gpu;
pub mod image;
pub mod job;
pub mod key;
pub mod manual;
pub mod origin;
pub mod permissions;
pub mod pubkey;
pub mod session;
pub mod share;
pub mod table;
pub mod terminal;
pub mod token;
pub mod whoami;

use cli::Cli;
use client::Client;
use config::{Defaults, Env};
use terminal::Terminal;

/// Runs the command, resolving the settings and connecting first when it needs the manager.
pub async fn run(
    cli: Cli,
    env: &Env,
    defaults: &Defaults,
    term: &mut Terminal<'_>,
) -> anyhow::Result<()> {
    let connect = || -> anyhow::Result<Client> {
        let settings = config::resolve(&cli.global.overrides(), env, defaults)?;
        Ok(Client::new(&settings)?)
    };
    let home = env.get("HOME").map(std::path::Path::new);
    cli.command.run(connect, home, term).await
}
