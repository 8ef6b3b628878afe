//! `devctl admin reservation add|ls|rm`: GPUs kept for one group's work from one time to
//! another (`POST /v1/reservations`, `GET /v1/reservations`, `DELETE /v1/reservations/{name}`),
//! and `devctl admin owners` (`GET /v1/owners`): the GPUs and nodes an owner group owns.
//!
//! Times are RFC 3339 (`2026-12-01T09:00:00Z`, `2026-12-01T10:00:00+01:00`), `now`, or a time
//! from now (`+2h`, `in 3 days`), as `devctl job submit --not-before` takes them; devctl turns
//! them into UTC times before sending.

use anyhow::Context;
use chrono::Utc;
use clap::{Args, Subcommand};
use ongrid_core::job::parse_time;
use ongrid_core::reservation::{NewReservation, OwnerView, ReservationView};
use ongrid_core::{GpuUuid, NodeName};

use crate::client::Client;
use crate::format::format_time;
use crate::table::Table;
use crate::terminal::{JsonArgs, Terminal};

#[derive(Debug, Subcommand)]
pub enum ReservationCommand {
    /// Reserve GPUs (or a whole node) for a group's work from one time to another
    Add(AddArgs),
    /// List reservations: group, window, status, GPUs
    Ls(JsonArgs),
    /// Remove a reservation; requests that named it wait like any other
    Rm(NameArgs),
}

#[derive(Debug, Clone, Args)]
pub struct AddArgs {
    /// The reservation's name, which users give to --reservation, like cms-school
    pub name: String,
    /// GPUs by UUID, comma-separated (devctl gpus lists them)
    #[arg(
        long,
        value_delimiter = ',',
        required_unless_present = "node",
        conflicts_with = "node"
    )]
    pub gpus: Vec<GpuUuid>,
    /// A whole node instead of GPUs: every GPU it has during the window
    #[arg(long)]
    pub node: Option<NodeName>,
    /// When the window opens: RFC 3339 like 2026-12-01T09:00:00Z, now, or +2h
    #[arg(long, value_name = "TIME")]
    pub from: String,
    /// When the window closes: RFC 3339, or a time from now like +3d
    #[arg(long, value_name = "TIME")]
    pub to: String,
    /// The accounting group whose work the GPUs take (devctl share lists groups)
    #[arg(long)]
    pub group: String,
    #[command(flatten)]
    pub output: JsonArgs,
}

#[derive(Debug, Clone, Args)]
pub struct NameArgs {
    /// The reservation's name, as devctl admin reservation ls shows it
    pub name: String,
    #[command(flatten)]
    pub output: JsonArgs,
}

pub async fn run(
    command: ReservationCommand,
    client: &Client,
    term: &mut Terminal<'_>,
) -> anyhow::Result<()> {
    match command {
        ReservationCommand::Add(args) => {
            let now = Utc::now();
            let from = parse_time("from", &args.from, now).context("--from")?;
            let to = parse_time("to", &args.to, now).context("--to")?;
            let body = NewReservation {
                name: args.name,
                group: args.group,
                gpus: args.gpus,
                node: args.node,
                from,
                to,
            };
            let view: ReservationView = client.post("v1/reservations").json(&body).send().await?;
            term.show(args.output.json, &view, render_added)
        }
        ReservationCommand::Ls(output) => {
            let views: Vec<ReservationView> = client.get("v1/reservations").send().await?;
            let width = term.width;
            term.show(output.json, &views, |views| render_list(views, width))
        }
        ReservationCommand::Rm(NameArgs { name, output }) => {
            let view: ReservationView = client
                .delete(&format!("v1/reservations/{name}"))
                .send()
                .await?;
            term.show(output.json, &view, |view| {
                format!(
                    "reservation {} of group {} removed; work that named it waits like any other\n",
                    view.name, view.group
                )
            })
        }
    }
}

fn held(view: &ReservationView) -> String {
    match &view.node {
        Some(node) => format!("node {node} ({} GPUs)", view.gpus.len()),
        None if view.gpus.len() == 1 => "1 GPU".to_owned(),
        None => format!("{} GPUs", view.gpus.len()),
    }
}

/// `devctl admin reservation add`: the reservation made.
pub fn render_added(view: &ReservationView) -> String {
    format!(
        "reservation {} holds {} for group {} from {} to {} ({})\n",
        view.name,
        held(view),
        view.group,
        format_time(view.from),
        format_time(view.to),
        view.status
    )
}

/// `devctl admin reservation ls`.
pub fn render_list(views: &[ReservationView], width: Option<u16>) -> String {
    if views.is_empty() {
        return "no reservations\n".to_owned();
    }
    let mut table = Table::new(&["NAME", "GROUP", "FROM", "TO", "STATUS", "HOLDS", "GPUS"]);
    for view in views {
        let gpus: Vec<&str> = view.gpus.iter().map(GpuUuid::as_str).collect();
        table.row([
            view.name.clone(),
            view.group.clone(),
            format_time(view.from),
            format_time(view.to),
            view.status.to_string(),
            held(view),
            gpus.join(","),
        ]);
    }
    table.keep_whole(&[0, 2, 3]);
    table.render(width, "")
}

/// `devctl admin owners`.
pub fn render_owners(views: &[OwnerView], width: Option<u16>) -> String {
    if views.is_empty() {
        return "no GPU or node has an owner group\n".to_owned();
    }
    let mut table = Table::new(&["NODE", "GPU", "OWNER"]);
    for view in views {
        table.row([
            view.node.to_string(),
            view.gpu
                .as_ref()
                .map_or_else(|| "(whole node)".to_owned(), |g| g.to_string()),
            view.group.clone().unwrap_or_default(),
        ]);
    }
    table.render(width, "")
}

/// `devctl admin gpu owner` and `admin node owner`: the owner after the change.
pub fn render_owner(view: &OwnerView) -> String {
    let what = match &view.gpu {
        Some(gpu) => format!("GPU {gpu} on {}", view.node),
        None => format!("node {}", view.node),
    };
    match &view.group {
        Some(group) => format!(
            "{what} is owned by group {group}: its work goes first there; other groups' jobs \
             run there only as backfill\n"
        ),
        None => format!("{what} has no owner group\n"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn a_reservation_reads_as_what_it_holds_for_whom_and_when() {
        let view = ReservationView {
            name: "cms-school".into(),
            group: "cms".into(),
            node: Some(NodeName::parse("node1").unwrap()),
            gpus: vec![GpuUuid::parse("GPU-00000001-0000-0000-0000-000000000000").unwrap()],
            from: Utc.with_ymd_and_hms(2026, 12, 1, 9, 0, 0).unwrap(),
            to: Utc.with_ymd_and_hms(2026, 12, 1, 17, 0, 0).unwrap(),
            status: ongrid_core::reservation::ReservationStatus::Upcoming,
            created_by: "root".into(),
            created_at: Utc.with_ymd_and_hms(2026, 11, 26, 9, 0, 0).unwrap(),
        };
        assert_eq!(
            render_added(&view),
            "reservation cms-school holds node node1 (1 GPUs) for group cms from \
             2026-12-01 09:00:00Z to 2026-12-01 17:00:00Z (upcoming)\n"
        );
    }
}
