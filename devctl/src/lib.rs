//! devctl, the command line of ongrid for users and admins.
//!
//! It talks to the manager's HTTPS API (`ongrid_core::api`), presenting the user's grid
//! certificate or proxy as the TLS client certificate. The pieces:
//!
//! - [`cli`]: the arguments, parsed by clap into ongrid-core's types.
//! - [`config`]: flags, environment and `~/.config/ongrid/devctl.toml` resolved into
//!   [`config::Settings`].
//! - [`tls`]: the certificate, key and CA directory turned into a rustls configuration.
//! - [`client`]: the API calls, and every failure mapped to one line that names the fix.
//! - [`commands`]: what each command does, including `session new --wait`.
//! - [`images`]: `freeze` with its progress bar, and `image ls|show|rm`.
//! - [`pubkey`]: the SSH public key file `key add` registers, checked before it is sent.
//! - [`output`]: tables and formats for people.
//!
//! `main.rs` parses the arguments and calls [`run`]; an error is printed as one line,
//! `error: ...`, with exit code 1 (clap's usage errors exit with 2).

pub mod cli;
pub mod client;
pub mod commands;
pub mod config;
pub mod images;
pub mod output;
pub mod pubkey;
pub mod tls;

use cli::Cli;
use client::Client;
use commands::Terminal;
use config::{Defaults, Env};

/// Resolves the settings, connects, and runs the command.
pub async fn run(
    cli: Cli,
    env: &Env,
    defaults: &Defaults,
    term: &mut Terminal<'_>,
) -> anyhow::Result<()> {
    let settings = config::resolve(&cli.global.overrides(), env, defaults)?;
    let client = Client::new(&settings)?;
    let home = env.get("HOME").map(std::path::Path::new);
    commands::execute(cli.command, home, &client, term).await
}
