//! `devctl freeze` and `devctl image ls|show|rm|share|unshare`: frozen images of sessions.
//!
//! - [`freeze`]: `freeze`, which asks for an image and follows it until READY or FAILED.
//! - [`progress`]: how that wait is shown (a bar on a terminal, plain lines elsewhere).
//! - [`catalog`]: `image ls|show|rm|share|unshare`, and how an image is described.

pub mod catalog;
pub mod freeze;
pub mod progress;

use clap::Subcommand;

use crate::client::Client;
use crate::terminal::Terminal;

#[derive(Debug, Subcommand)]
pub enum ImageCommand {
    /// List your frozen images
    #[command(alias = "list")]
    Ls(catalog::ImageLsArgs),
    /// Show an image: state, SIF path, digest, size, Docker image, provenance
    Show(catalog::ImageRefArgs),
    /// Remove an image; its SIF file goes when no other image has the same digest
    #[command(alias = "remove")]
    Rm(catalog::ImageRefArgs),
    /// Share an image of yours: any user may then run it (sessions and jobs) as
    /// LOGIN/NAME:VERSION or by digest
    Share(catalog::ImageRefArgs),
    /// Make a shared image private again; sessions and jobs already started keep it
    Unshare(catalog::ImageRefArgs),
}

pub async fn run(
    command: ImageCommand,
    client: &Client,
    term: &mut Terminal<'_>,
) -> anyhow::Result<()> {
    match command {
        ImageCommand::Ls(args) => catalog::list(args, client, term).await,
        ImageCommand::Show(args) => catalog::show(args, client, term).await,
        ImageCommand::Rm(args) => catalog::remove(args, client, term).await,
        ImageCommand::Share(args) => catalog::set_shared(args, true, client, term).await,
        ImageCommand::Unshare(args) => catalog::set_shared(args, false, client, term).await,
    }
}
