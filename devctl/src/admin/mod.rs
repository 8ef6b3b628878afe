//! `devctl admin ...`: site administration, for the admins named in the manager's config.
//!
//! - [`gpu`]: `admin gpu mode`, how sessions may share a GPU; `admin gpu drain|undrain`.
//! - [`node`]: `admin node ls|drain|undrain|rm`, nodes in and out of service.
//! - [`institute`]: `admin institute add|rm|ls|show`, the networks the SSH gateway accepts.
//! - [`audit`]: `admin audit`, the log of SSH connections.
//! - [`user`]: `admin user ls|rm|restore`, removing users and re-admitting them.
//! - [`reservation`]: `admin reservation add|ls|rm`, GPUs kept for a group's work for a time;
//!   `admin owners`, the GPUs and nodes owner groups own (`admin gpu owner`, `admin node owner`).

pub mod audit;
pub mod gpu;
pub mod institute;
pub mod node;
pub mod reservation;
pub mod user;

use clap::Subcommand;

use crate::client::Client;
use crate::terminal::Terminal;

#[derive(Debug, Subcommand)]
pub enum AdminCommand {
    /// Manage GPUs
    #[command(subcommand)]
    Gpu(gpu::AdminGpuCommand),
    /// Manage nodes: list, drain, undrain, remove
    #[command(subcommand)]
    Node(node::NodeCommand),
    /// Manage the institutes whose networks may reach the SSH gateway
    #[command(subcommand)]
    Institute(institute::InstituteCommand),
    /// List SSH connections to sessions: who, from where, with which key, how much
    Audit(audit::AuditArgs),
    /// Manage users: list, remove, restore
    #[command(subcommand)]
    User(user::UserCommand),
    /// Reserve GPUs for a group's work from one time to another: add, list, remove
    #[command(subcommand)]
    Reservation(reservation::ReservationCommand),
    /// List the GPUs and nodes owner groups own
    Owners(crate::terminal::JsonArgs),
}

pub async fn run(
    command: AdminCommand,
    client: &Client,
    term: &mut Terminal<'_>,
) -> anyhow::Result<()> {
    match command {
        AdminCommand::Gpu(command) => gpu::run(command, client, term).await,
        AdminCommand::Node(command) => node::run(command, client, term).await,
        AdminCommand::Institute(command) => institute::run(command, client, term).await,
        AdminCommand::Audit(args) => audit::run(args, client, term).await,
        AdminCommand::User(command) => user::run(command, client, term).await,
        AdminCommand::Reservation(command) => reservation::run(command, client, term).await,
        AdminCommand::Owners(output) => {
            let owners: Vec<ongrid_core::reservation::OwnerView> =
                client.get("v1/owners").send().await?;
            let width = term.width;
            term.show(output.json, &owners, |owners| {
                reservation::render_owners(owners, width)
            })
        }
    }
}
